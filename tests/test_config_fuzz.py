"""Property-based: any ModelConfig either builds a model that runs, or is refused with a
ConfigError that names the offending field — never an error from deep inside JAX/XLA."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import transformer_jax as tj
from transformer_jax import config as config_module

small_int = st.one_of(st.integers(-2, 12), st.sampled_from([None, 0, 1.5, "4", True]))
rate = st.one_of(st.floats(-0.5, 1.5), st.sampled_from([0.0, 0.1, None, float("nan")]))


def choice(options):
    return st.one_of(st.sampled_from(options), st.text(max_size=6), st.none())


fields = {
    "vocab_size": st.one_of(st.integers(-1, 40), st.just(16)),
    "d_model": st.one_of(st.sampled_from([8, 12, 16]), small_int),
    "num_heads": st.one_of(st.sampled_from([1, 2, 4]), small_int),
    "head_dim": st.one_of(st.none(), st.sampled_from([2, 3, 4]), small_int),
    "num_kv_heads": st.one_of(st.none(), st.sampled_from([1, 2]), small_int),
    "d_ff": st.one_of(st.sampled_from([8, 24]), small_int),
    "num_encoder_layers": st.sampled_from([0, 1, -1]),
    "num_decoder_layers": st.sampled_from([1, 2, 0, -1]),
    "dropout_rate": rate,
    "attention_dropout_rate": rate,
    "max_len": st.one_of(st.sampled_from([16, 32]), small_int),
    "norm": choice(config_module.NORM_PLACEMENTS),
    "norm_type": choice(config_module.NORM_TYPES),
    "activation": choice(config_module.ACTIVATIONS),
    "position": choice(config_module.POSITIONS),
    "attention_impl": st.sampled_from(["auto", "reference", "xla", "bogus"]),
    "dtype": st.sampled_from(["float32", "bfloat16", "int4"]),
    "pad_id": st.sampled_from([0, None, -1, 99]),
    "eos_id": st.sampled_from([1, 99]),
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({}, optional=fields))
def test_config_runs_or_names_the_field(values):
    values = {**dict(vocab_size=16, d_model=8, num_heads=2, d_ff=8, num_encoder_layers=1,
                     num_decoder_layers=1, max_len=16), **values}
    try:
        cfg = tj.ModelConfig(**values)
    except ValueError as error:
        match = re.match(r"ModelConfig\.(\w+)=", str(error))
        assert match, f"error does not name a field: {error}"
        assert match.group(1) in {f.name for f in dataclasses.fields(tj.ModelConfig)}
        return
    except TypeError as error:  # a wrong type that Python itself rejects (e.g. int % str)
        raise AssertionError(f"unhelpful TypeError for {values}: {error}") from error
    model = tj.Transformer(cfg) if cfg.num_encoder_layers > 0 else tj.TransformerLM(cfg)
    tokens = jnp.ones((2, 5), jnp.int32)
    inputs = (tokens, tokens) if cfg.num_encoder_layers > 0 else (tokens,)
    variables = jax.eval_shape(model.init, jax.random.key(0), *inputs)
    out = jax.eval_shape(model.apply, variables, *inputs)
    assert out.shape == (2, 5, cfg.vocab_size)


def test_one_fuzzed_config_really_runs():
    cfg = tj.ModelConfig(vocab_size=16, d_model=12, num_heads=4, head_dim=4, num_kv_heads=2,
                         d_ff=8, num_encoder_layers=0, num_decoder_layers=1, max_len=16,
                         norm="pre", position="rope", activation="geglu")
    model = tj.TransformerLM(cfg)
    tokens = jnp.ones((2, 5), jnp.int32)
    params = jax.jit(model.init)(jax.random.key(0), tokens)
    assert np.isfinite(np.asarray(jax.jit(model.apply)(params, tokens))).all()
