"""ModelConfig validation, presets and parameter counts against the paper's Table 3."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import transformer_jax as tj
from transformer_jax.config import ConfigError


def test_defaults_are_the_papers_base_model():
    c = tj.presets.transformer_base()
    assert (c.num_encoder_layers, c.d_model, c.d_ff, c.num_heads, c.qk_dim) == (6, 512, 2048, 8, 64)
    assert (c.dropout_rate, c.norm, c.activation, c.position) == (0.1, "post", "relu", "sinusoidal")
    assert c.share_embeddings and c.tie_output and c.scale_embeddings


def test_presets_accept_overrides():
    assert tj.presets.transformer_big(vocab_size=1000).vocab_size == 1000
    assert tj.presets.transformer_big().dropout_rate == 0.3
    assert tj.presets.gpt2_small(num_decoder_layers=2).num_decoder_layers == 2


@pytest.mark.parametrize(
    "field,value",
    [
        ("d_model", 0), ("vocab_size", -3), ("num_heads", 0), ("d_ff", 1.5),
        ("num_heads", 7),  # 512 is not divisible by 7
        ("num_kv_heads", 3),  # does not divide 8 heads
        ("dropout_rate", 1.0), ("attention_dropout_rate", -0.1),
        ("norm", "middle"), ("activation", "tanh"), ("position", "absolute"),
        ("attention_impl", "magic"), ("dtype", "int8"), ("num_encoder_layers", -1),
        ("num_decoder_layers", 0),  # accepted before: an encoder-decoder that ignored its source
        ("eos_id", 40000), ("pad_id", -1), ("norm_eps", 0.0), ("pad_vocab_multiple", 0),
        ("eos_id", 37000),  # token ids are below vocab_size=37000
        ("pad_vocab_multiple", True),
        # wrong types: accepted before (truthy strings, True as 1) or a bare TypeError
        ("share_embeddings", "no"), ("scan_layers", 1), ("final_norm", 1), ("num_kv_heads", True),
        ("pad_id", 1.5), ("eos_id", True), ("norm_eps", "1e-6"), ("rope_theta", "1e4"),
        ("dtype", "bf16"), ("param_dtype", object()),
        ("norm_eps", float("inf")), ("rope_theta", float("inf")),  # accepted: NaN or unrotated output
    ],
)
def test_bad_values_name_the_field(field, value):
    from transformer_jax.config import ConfigError

    with pytest.raises(ConfigError, match=rf"ModelConfig\.{field}="):
        tj.ModelConfig(**{field: value})


@pytest.mark.parametrize("value", [None, float, 5, object(), np.float64, np.zeros(2), np.float32(1.0),
                                   np.zeros(2, np.float32), jnp.zeros(2, jnp.bfloat16),
                                   jax.ShapeDtypeStruct((2,), jnp.float16)])
def test_a_dtype_that_is_not_a_name_is_refused_as_given(value):
    """None and Python's float were reported as 'float64', a value nobody passed, and 5 or object()
    raised an error whose `field` was unset; np.float32(1.0) was reported as 1.0, and a bf16 jax array
    or a ShapeDtypeStruct was taken as its dtype."""
    for field in ("dtype", "param_dtype"):
        message = rf"^ModelConfig\.{field}={re.escape(repr(value))}: must be one of"
        with pytest.raises(ConfigError, match=message) as e:
            tj.ModelConfig(**{field: value})
        assert e.value.field == field


def test_dtype_objects_are_taken_as_their_names():
    import jax.numpy as jnp

    for value, name in ((jnp.bfloat16, "bfloat16"), (np.float32, "float32"),
                        (np.dtype("float16"), "float16"), (np.str_("bfloat16"), "bfloat16")):
        config = tj.ModelConfig(dtype=value, param_dtype=value)
        assert (config.dtype, config.param_dtype) == (name, name)
        assert type(config.dtype) is str and type(config.param_dtype) is str


def test_numpy_scalars_are_taken_as_the_numbers_they_equal():
    """A size computed with NumPy was refused: "vocab_size=np.int64(100): must be a positive integer"."""
    c = tj.presets.tiny(vocab_size=np.int64(100), num_heads=np.int32(4), dropout_rate=np.float64(0.25),
                        use_bias=np.bool_(False))
    assert c == tj.presets.tiny(vocab_size=100, num_heads=4, dropout_rate=0.25, use_bias=False)
    assert type(c.vocab_size) is int and type(c.use_bias) is bool
    assert tj.ModelConfig.from_dict(json.loads(c.to_json())) == c  # JSON cannot write NumPy types
    with pytest.raises(ConfigError, match=r"ModelConfig\.d_model=0: must be a positive integer"):
        tj.presets.tiny(d_model=np.int64(0))
    with pytest.raises(ConfigError, match=r"ModelConfig\.d_ff=True"):
        tj.presets.tiny(d_ff=np.bool_(True))


def test_head_dim_allows_indivisible_d_model():
    c = tj.ModelConfig(d_model=510, num_heads=7, head_dim=64)
    assert c.qk_dim == 64


def test_an_odd_rotary_head_dim_names_the_value_it_is_derived_from():
    with pytest.raises(ConfigError, match=r"need an even head_dim \(d_model / num_heads = 9\)"):
        tj.presets.tiny(position="rope", d_model=36, num_heads=4)
    with pytest.raises(ConfigError, match=r"head_dim=7: rotary positions need an even head_dim$"):
        tj.presets.tiny(position="rope", head_dim=7)


def test_round_trip_and_diff():
    c = tj.presets.tiny(norm="pre")
    assert tj.ModelConfig.from_dict(c.to_dict()) == c
    assert c.diff(c.replace(d_ff=128)) == {"d_ff": (64, 128)}
    with pytest.raises(ValueError, match=r"no field\(s\) \['depth'\]; known fields"):
        tj.ModelConfig.from_dict({**c.to_dict(), "depth": 3})
    # a typo in a config file's model section (its own key there) gets the field it was meant as
    with pytest.raises(ValueError, match=r"\['hed_dim'\] \(did you mean 'hed_dim' -> 'head_dim'\?\)"):
        tj.ModelConfig.from_dict({**c.to_dict(), "hed_dim": 8})


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        tj.presets.tiny().d_model = 8


def test_param_counts_against_table_3():
    # With a 37,000-token shared vocabulary the Table 3 sizes give exactly these counts:
    base = tj.count_params(tj.presets.transformer_base(vocab_size=37000))
    big = tj.count_params(tj.presets.transformer_big(vocab_size=37000))
    assert base == 63_082_496
    assert big == 214_245_376
    assert abs(base - 65e6) / 65e6 < 0.05  # paper: 65M
    assert abs(big - 213e6) / 213e6 < 0.01  # paper: 213M
    assert tj.count_params(tj.presets.gpt2_small()) == 124_439_808  # GPT-2 "124M"


def test_eval_shape_of_big_presets_allocates_nothing():
    before = sum(x.nbytes for x in jax.live_arrays())
    shapes = tj.params.param_shapes(tj.presets.transformer_big())
    after = sum(x.nbytes for x in jax.live_arrays())
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(shapes))
    assert after - before < 1_000_000  # 214M float32 params would be 857 MB
