"""`scan_layers=True`: one nn.scan over identical blocks, parameters stacked on a 'layers' axis.

The scanned model must be the same function as the per-layer one once its checkpoint is converted
with `scan_params` / `unscan_params`, train the same (remat inside the scanned body), and decode
with a KV cache exactly like full recomputation.
"""

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import transformer_jax as tj
from transformer_jax.modeling import scan_params, unscan_params

B, L, S, V = 3, 7, 11, 37


def config(**overrides):
    base = dict(vocab_size=V, d_model=30, num_heads=5, d_ff=13, num_encoder_layers=2,
                num_decoder_layers=3, dropout_rate=0.0, max_len=64)
    return tj.ModelConfig(**{**base, **overrides})


def tokens(key, shape):
    return jax.random.randint(jax.random.key(key), shape, 3, V)


def test_lm_scanned_equals_unscanned_and_converts_both_ways():
    cfg = config(norm="pre", position="rope", num_kv_heads=1, head_dim=6)
    t = tokens(1, (B, L))
    plain, scanned = tj.TransformerLM(cfg), tj.TransformerLM(cfg.replace(scan_layers=True))
    boxed = jax.jit(plain.init)(jax.random.key(0), t)["params"]
    stacked_boxed = scan_params(boxed, cfg)
    kernel = stacked_boxed["decoder"]["layers"]["self_attention"]["query"]["kernel"]
    assert kernel.names == ("layers", "embed", "heads", "kv") and kernel.value.shape == (3, 30, 5, 6)
    # The converted boxes have the names and shapes that the scanned model's own init creates.
    own = jax.eval_shape(scanned.init, jax.random.key(0), t)["params"]
    assert jax.tree.structure(own) == jax.tree.structure(stacked_boxed)
    assert jax.tree.map(jnp.shape, own) == jax.tree.map(jnp.shape, stacked_boxed)

    params = nn_unbox(boxed)
    want = jax.jit(plain.apply)({"params": params}, t)
    got = jax.jit(scanned.apply)({"params": scan_params(params, cfg)}, t)
    np.testing.assert_allclose(got, want, atol=1e-5)
    back = unscan_params(scan_params(params, cfg), cfg)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), back, params))


def nn_unbox(tree):
    return nn.meta.unbox(tree)


def test_lm_scanned_cache_decoding_equals_full_recomputation():
    cfg = config(scan_layers=True, norm="pre", position="rope")
    lm = tj.TransformerLM(cfg)
    t = tokens(2, (B, L))
    params = nn_unbox(jax.jit(lm.init)(jax.random.key(0), t)["params"])
    full = jax.jit(lm.apply)({"params": params}, t)
    cache = tj.init_cache(cfg, B, 10)
    assert cache.layers["k"].shape == (B, 3, 5, 10, 6) and cache.max_length == 10
    assert all(leaf.shape[0] == B for leaf in jax.tree.leaves(cache))
    step = jax.jit(lambda p, x, c: lm.apply({"params": p}, x, cache=c))
    first, cache = step(params, t[:, :4], cache)
    second, cache = step(params, t[:, 4:], cache)
    np.testing.assert_allclose(jnp.concatenate([first, second], axis=1), full, atol=1e-5)
    # Beams gather rows of every leaf: repeating the rows keeps each copy's logits.
    beams = jax.tree.map(lambda x: jnp.repeat(x, 2, axis=0), cache)
    nxt, _ = step(params, jnp.repeat(t[:, :1], 2, axis=0), beams)
    one, _ = step(params, t[:, :1], cache)
    np.testing.assert_allclose(nxt[::2], one, atol=1e-5)


def test_encoder_decoder_scanned_equals_unscanned_with_cache():
    cfg = config()
    src, tgt = tokens(3, (B, S)).at[0, 8:].set(0), tokens(4, (B, L))
    plain, scanned = tj.Transformer(cfg), tj.Transformer(cfg.replace(scan_layers=True))
    params = nn_unbox(jax.jit(plain.init)(jax.random.key(0), src, tgt)["params"])
    sparams = scan_params(params, cfg)
    want = jax.jit(plain.apply)({"params": params}, src, tgt)
    np.testing.assert_allclose(jax.jit(scanned.apply)({"params": sparams}, src, tgt), want, atol=1e-5)

    cache = jax.jit(lambda p, s: scanned.apply({"params": p}, s, 9, method="init_cache"))(sparams, src)
    assert cache.cross["k"].shape == (B, 3, 5, S, 6)  # [B, layers, N, S, K]
    step = jax.jit(lambda p, x, c: scanned.apply({"params": p}, None, x, cache=c))
    first, cache = step(sparams, tgt[:, :5], cache)
    second, cache = step(sparams, tgt[:, 5:], cache)
    np.testing.assert_allclose(jnp.concatenate([first, second], axis=1), want, atol=1e-5)


def test_scanned_gradients_with_remat_equal_unscanned():
    cfg = config(num_encoder_layers=0, norm="pre", remat="full", dropout_rate=0.1)
    t = tokens(5, (B, L))
    plain = tj.TransformerLM(cfg.replace(remat="none", dropout_rate=0.0))
    scanned = tj.TransformerLM(cfg.replace(scan_layers=True))
    params = nn_unbox(jax.jit(plain.init)(jax.random.key(0), t)["params"])

    def loss(model, p, deterministic):
        logits = model.apply({"params": p}, t, deterministic=deterministic,
                             rngs={"dropout": jax.random.key(1)})
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])

    grad = jax.jit(jax.grad(loss, argnums=1), static_argnums=(0, 2))
    want = scan_params(grad(plain, params, True), cfg)
    got = grad(scanned, scan_params(params, cfg), True)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, atol=1e-5), got, want)
    # Dropout on (deterministic=False is static inside the scanned, rematerialised body).
    noisy = grad(scanned, scan_params(params, cfg), False)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(noisy))


def test_conversion_with_another_depth_is_an_error_naming_the_field():
    # Indexing a stack past its end clamps in JAX: without the check, unscan_params with one
    # layer too many copied the last layer into it, and one too few dropped a layer, silently.
    cfg = config(num_encoder_layers=0)
    t = tokens(6, (B, L))
    params = nn_unbox(jax.jit(tj.TransformerLM(cfg).init)(jax.random.key(0), t)["params"])
    stacked = scan_params(params, cfg)
    for depth in (2, 4):
        other = cfg.replace(num_decoder_layers=depth)
        with pytest.raises(ValueError, match=rf"num_decoder_layers={depth}"):
            unscan_params(stacked, other)
        with pytest.raises(ValueError, match=rf"num_decoder_layers={depth}"):
            scan_params(params, other)


def test_convert_params_changes_the_layer_layout_with_the_other_fields():
    """convert_params refused a scan_layers change as one that 'changes what the parameters mean';
    it now stacks or unstacks the layers (exactly) beside a kernel layout, fused_qkv or dtype change,
    and a model given the other layout names scan_layers and the conversion, not the config's depth."""
    from transformer_jax.params import convert_params

    cfg = config(num_kv_heads=1, head_dim=6)
    src, tgt = tokens(7, (B, S)), tokens(8, (B, L))
    plain = tj.Transformer(cfg)
    params = nn_unbox(jax.jit(plain.init)(jax.random.key(0), src, tgt)["params"])
    want = jax.jit(plain.apply)({"params": params}, src, tgt)
    target = cfg.replace(scan_layers=True, kernel_layout="out_in", fused_qkv=True)
    stacked = convert_params(params, cfg, target)
    assert stacked["encoder"]["layers"]["self_attention"]["qkv"]["kernel"].shape[0] == 2
    np.testing.assert_allclose(jax.jit(tj.Transformer(target).apply)({"params": stacked}, src, tgt),
                               want, atol=1e-5)
    back = convert_params(stacked, target, cfg)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), back, params))
    # A FrozenDict's query, key and value kernels were left as they were, without a word.
    frozen = convert_params(flax.core.freeze(params), cfg, target)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), frozen, stacked))
    half = {**params, "encoder": scan_params(params, cfg)["encoder"]}  # one stack in the other layout
    for model_cfg, p, convert in ((cfg.replace(scan_layers=True), params, "scan_params"),
                                  (cfg, scan_params(params, cfg), "unscan_params"),
                                  (cfg, half, "unscan_params")):
        with pytest.raises(ValueError, match=rf"config has scan_layers={model_cfg.scan_layers}: convert "
                                             rf"them with transformer_jax\.modeling\.{convert}\(params"):
            tj.Transformer(model_cfg).apply({"params": p}, src, tgt)
