"""`ModelConfig.fused_qkv`: self-attention's query, key and value kernels stored as one
[D, N, G + 2, K] kernel (N key/value heads, G = H / N query heads each), so that each call is one
product. The same model as three kernels (values, cached decoding, greedy generation, a sharded
mesh), conversion both ways with every other convertible field, its own initialisation, and a
decoding step with one weight product where there were three."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# The kernel-layout tests' helpers (tests/ is on sys.path): the same checks for another storage.
from test_kernel_layout import (
    _cached_logits,
    _close,
    _lm,
    _model_and_params,
    assert_same_greedy_generation,
    on_a_mesh,
)

import transformer_jax as tj
from transformer_jax.modeling.attention import fuse_qkv, split_qkv
from transformer_jax.params import convert_params, param_shapes


def test_fuse_and_split_place_each_query_head_with_its_key_and_value_head():
    # H = 6 query heads over N = 2 key/value heads: query head h reads key/value head h // 3.
    q = jnp.arange(6)[None, :, None] * jnp.ones((5, 1, 4))  # [D, H, K], each head its own number
    k, v = 100 + jnp.arange(2)[None, :, None] * jnp.ones((5, 1, 4)), 200 + jnp.zeros((5, 2, 4))
    fused = fuse_qkv(q, k, v, axis=1)
    assert fused.shape == (5, 2, 5, 4)
    np.testing.assert_array_equal(fused[0, :, :, 0], [[0, 1, 2, 100, 200], [3, 4, 5, 101, 200]])
    for a, b in zip(split_qkv(fused, axis=1), (q, k, v), strict=True):
        np.testing.assert_array_equal(a, b)


VARIANTS = {
    "lm": dict(),
    "lm_out_in_scanned": dict(kernel_layout="out_in", scan_layers=True, norm="pre", tie_output=False),
    "encoder_decoder": dict(num_encoder_layers=2),
    "lm_gqa_rope": dict(num_kv_heads=2, position="rope", activation="swiglu"),
    "lm_multi_query_no_bias": dict(num_kv_heads=1, use_bias=False, kernel_layout="out_in"),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fused_qkv_computes_the_same_model(variant):
    config = _lm(**VARIANTS[variant])
    model, params, inputs = _model_and_params(config)
    target = config.replace(fused_qkv=True)
    fused = convert_params(params, config, target)
    assert jax.tree.map(lambda a: a.shape, fused) == jax.tree.map(lambda s: s.shape, param_shapes(target))
    layer = lambda p: p["decoder"]["layers" if config.scan_layers else "layer_0"]
    attention = layer(fused)["self_attention"]
    assert set(attention) == {"qkv", "out"}
    heads, kv_heads = config.num_heads, config.kv_heads
    slots = (kv_heads, heads // kv_heads + 2, config.qk_dim)
    kernel = attention["qkv"]["kernel"]
    assert kernel.shape[-4:] == (slots + (32,) if config.kernel_layout == "out_in" else (32,) + slots)
    if config.num_encoder_layers:  # cross-attention keeps its three projections
        assert {"query", "key", "value"} <= set(layer(fused)["cross_attention"])
    expected = jax.jit(model.apply)({"params": params}, *inputs)
    got = jax.jit(tj.params.build_model(target).apply)({"params": fused}, *inputs)
    _close(got, expected, 1e-5)
    back = convert_params(fused, target, config)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    assert all(bool(jnp.array_equal(a, b)) for a, b in
               zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True))


def test_fused_qkv_converts_together_with_the_other_fields():
    config = _lm(num_kv_heads=2)
    _, params, (tokens,) = _model_and_params(config)
    target = config.replace(fused_qkv=True, kernel_layout="out_in", pad_vocab_multiple=48)
    both = convert_params(params, config, target)
    assert both["decoder"]["layer_1"]["self_attention"]["qkv"]["kernel"].shape == (2, 4, 8, 32)
    expected = jax.jit(tj.TransformerLM(config).apply)({"params": params}, tokens)
    got = jax.jit(tj.TransformerLM(target).apply)({"params": both}, tokens)
    _close(got, expected, 1e-5)
    back = convert_params(both, target, config)
    assert all(bool(jnp.array_equal(a, b)) for a, b in
               zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True))
    with pytest.raises(ValueError, match=r"missing .*\['self_attention'\]\['qkv'\]"):
        convert_params(params, target, config)  # the separate kernels, said to be fused


def test_fused_qkv_initialises_each_projection_as_its_own_kernel_and_trains():
    # Glorot over each projection's own axes: a fused kernel that took its fan-out from all three
    # would start ~1.6x smaller than the separate ones.
    config = _lm(num_kv_heads=1, fused_qkv=True)
    model, params, (tokens,) = _model_and_params(config)
    separate = _model_and_params(config.replace(fused_qkv=False))[1]
    assert tj.count_params(config) == tj.count_params(config.replace(fused_qkv=False))
    attention = params["decoder"]["layer_0"]["self_attention"]
    q, k, v = split_qkv(attention["qkv"]["kernel"], axis=1)
    for ours, name in zip((q, k, v), ("query", "key", "value"), strict=True):
        theirs = separate["decoder"]["layer_0"]["self_attention"][name]["kernel"]
        assert ours.shape == theirs.shape
        assert 0.85 < float(jnp.std(ours)) / float(jnp.std(theirs)) < 1.15, name

    def loss(p):
        logits = model.apply({"params": p}, tokens)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], -1))

    grads = jax.jit(jax.grad(loss))(params)["decoder"]["layer_0"]["self_attention"]["qkv"]
    for part in split_qkv(grads["kernel"], axis=1):  # every slot learns
        assert float(jnp.abs(part).max()) > 0


@pytest.mark.parametrize("setting", [dict(dtype="float32"), dict(dtype="bfloat16", kernel_layout="out_in"),
                                     dict(dtype="float32", kernel_layout="out_in", num_kv_heads=2,
                                          position="rope")])
def test_fused_qkv_cached_decoding_follows_the_full_forward(setting):
    dtype = setting["dtype"]
    config = _lm(**setting, param_dtype=dtype, fused_qkv=True)
    _, params, _ = _model_and_params(config)
    tokens = jax.random.randint(jax.random.key(3), (8, 12), 3, config.vocab_size)
    full = jax.jit(tj.TransformerLM(config).apply)({"params": params}, tokens)
    _close(_cached_logits(config, params, tokens)[0], full, 1e-5 if dtype == "float32" else 3e-2)


@pytest.mark.parametrize("layout", ["in_out", "out_in"])
def test_greedy_generation_is_the_same_with_fused_qkv(layout):
    config = _lm(kernel_layout=layout)
    _, params, _ = _model_and_params(config)
    assert_same_greedy_generation(config, params, config.replace(fused_qkv=True))


def test_fused_qkv_shards_its_key_value_heads_over_the_tensor_axis():
    expected, got, spec = on_a_mesh(_lm(num_kv_heads=2, fused_qkv=True), "self_attention", "qkv", "kernel")
    # [embed, kv_heads, qkv, kv]: the key/value heads split over `tensor`, each with its queries.
    assert "tensor" in str(spec[1]) and spec[2] is None and spec[3] is None
    _close(got, expected, 1e-5)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="about XLA:CPU's products")
def test_a_fused_decoding_step_has_one_weight_product_for_query_key_and_value():
    # Per layer: one [3 * H * K, D] product where there were three [H * K, D] ones; the other
    # weight products and the output layer are unchanged.
    counts = {}
    for fused in (False, True):
        config = _lm(kernel_layout="out_in", cpu_kernels="xla", fused_qkv=fused)
        model, params, _ = _model_and_params(config)
        step = jax.jit(lambda p, t, c, m=model: m.apply({"params": p}, t, cache=c))
        cache = tj.init_cache(config, 8, 16)
        hlo = step.lower(params, jnp.ones((8, 1), jnp.int32), cache).compile().as_text()
        dots = re.findall(r"= \w+\[([\d,]+)\]\{[\d,]+\} dot\(", hlo)
        counts[fused] = [shape for shape in dots if shape.count(",") == 1]  # [out, rows]: weights
    assert len(counts[False]) - len(counts[True]) == 2 * 2  # two fewer a layer, two layers
    assert counts[True].count("96,8") == 2 and "96,8" not in counts[False]
