"""Behaviour of the full models: shapes, causality, padding, the KV cache, dtypes, variants.

Sizes are distinct primes where they can be (B=3, L=7, S=11, F=13, V=37, H=5 heads; D=30 must
split into heads) so a transposed axis cannot pass unnoticed.
"""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import transformer_jax as tj
from transformer_jax.modeling import chunked_attention, dot_product_attention, masks

B, L, S, V = 3, 7, 11, 37
VARIANTS = {
    "paper": dict(),
    "pre_ln_gelu_rope_gqa": dict(norm="pre", activation="gelu", position="rope", num_kv_heads=1,
                                 head_dim=6),
    "rmsnorm_swiglu_learned_untied": dict(norm="pre", norm_type="rmsnorm", activation="swiglu",
                                          position="learned", tie_output=False, logits_bias=True,
                                          share_embeddings=False, use_bias=False),
}


@functools.cache
def japply(model):
    """A jitted `model.apply`: one compilation per shape instead of one per primitive."""
    return jax.jit(model.apply, static_argnames=("method", "mutable", "deterministic"))


def config(**overrides):
    base = dict(vocab_size=V, d_model=30, num_heads=5, d_ff=13, num_encoder_layers=2,
                num_decoder_layers=2, dropout_rate=0.0, max_len=64)
    return tj.ModelConfig(**{**base, **overrides})


def tokens(key, shape, low=3):
    return jax.random.randint(jax.random.key(key), shape, low, V)


def init_lm(cfg, t):
    model = tj.TransformerLM(cfg)
    return model, jax.jit(model.init)(jax.random.key(0), t)["params"]


def init_ed(cfg, src, tgt):
    model = tj.Transformer(cfg)
    return model, jax.jit(model.init)(jax.random.key(0), src, tgt)["params"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_shapes_and_dtypes(variant):
    cfg = config(**VARIANTS[variant])
    src, tgt = tokens(1, (B, S)), tokens(2, (B, L))
    model, params = init_ed(cfg, src, tgt)
    logits = japply(model)({"params": params}, src, tgt)
    assert logits.shape == (B, L, V) and logits.dtype == jnp.float32
    lm, lm_params = init_lm(cfg, tgt)
    assert japply(lm)({"params": lm_params}, tgt).shape == (B, L, V)
    kernel = params["decoder"]["layer_0"]["self_attention"]["query"]["kernel"]
    assert kernel.unbox().shape == (30, 5, cfg.qk_dim)
    assert kernel.names == ("embed", "heads", "kv")


@pytest.mark.parametrize("variant", VARIANTS)
def test_decoder_is_causal(variant):
    cfg = config(**VARIANTS[variant])
    src, tgt = tokens(1, (B, S)), tokens(2, (B, L))
    model, params = init_ed(cfg, src, tgt)
    base = japply(model)({"params": params}, src, tgt)
    for t in range(L - 1):
        changed = tgt.at[:, t + 1].set((tgt[:, t + 1] + 5) % V)
        out = japply(model)({"params": params}, src, changed)
        np.testing.assert_allclose(out[:, : t + 1], base[:, : t + 1], atol=1e-5)
        assert not np.allclose(out[:, t + 1], base[:, t + 1])


def test_source_padding_changes_nothing_that_is_not_padding():
    cfg = config()
    src, tgt = tokens(1, (B, S)), tokens(2, (B, L))
    src = src.at[:, 8:].set(0)  # pad_id = 0
    model, params = init_ed(cfg, src, tgt)
    base = japply(model)({"params": params}, src, tgt)
    longer = jnp.pad(src, ((0, 0), (0, 6)))  # more padding
    np.testing.assert_allclose(japply(model)({"params": params}, longer, tgt), base, atol=1e-5)
    trimmed = src[:, :8]  # no padding at all
    np.testing.assert_allclose(japply(model)({"params": params}, trimmed, tgt), base, atol=1e-5)


def test_target_right_padding_changes_no_real_position():
    cfg = config(norm="pre")
    t = tokens(3, (B, L))
    lm, params = init_lm(cfg, t)
    padded = jnp.pad(t, ((0, 0), (0, 4)))
    np.testing.assert_allclose(japply(lm)({"params": params}, padded)[:, :L],
                               japply(lm)({"params": params}, t), atol=1e-5)


def test_packed_rows_equal_separate_examples():
    cfg = config(norm="pre")
    a, b = tokens(4, (1, 4)), tokens(5, (1, 3))
    lm, params = init_lm(cfg, a)
    packed = jnp.concatenate([a, b], axis=1)
    seg = jnp.array([[1, 1, 1, 1, 2, 2, 2]])
    pos = jnp.array([[0, 1, 2, 3, 0, 1, 2]])
    out = japply(lm)({"params": params}, packed, segment_ids=seg, positions=pos)
    np.testing.assert_allclose(out[:, :4], japply(lm)({"params": params}, a), atol=1e-5)
    np.testing.assert_allclose(out[:, 4:], japply(lm)({"params": params}, b), atol=1e-5)


def test_packed_rows_without_positions_name_the_missing_argument():
    """An encoder-decoder has src_positions and tgt_positions: the error said only "positions"."""
    model = tj.Transformer(config())
    src, tgt = tokens(0, (1, 6)), tokens(1, (1, 4))
    src_seg, tgt_seg = jnp.array([[1, 1, 1, 2, 2, 0]]), jnp.array([[1, 1, 2, 2]])
    src_pos, tgt_pos = jnp.array([[0, 1, 2, 0, 1, 0]]), jnp.array([[0, 1, 0, 1]])
    params = model.init(jax.random.key(0), src, tgt)["params"]
    packed = dict(src_segment_ids=src_seg, tgt_segment_ids=tgt_seg)
    with pytest.raises(ValueError, match="pass src_positions"):
        model.apply({"params": params}, src, tgt, **packed, tgt_positions=tgt_pos)
    with pytest.raises(ValueError, match="pass tgt_positions"):
        model.apply({"params": params}, src, tgt, **packed, src_positions=src_pos)
    lm, lm_params = init_lm(config(), tgt)
    with pytest.raises(ValueError, match="pass positions"):
        lm.apply({"params": lm_params}, tgt, segment_ids=tgt_seg)


def test_fully_masked_rows_give_zeros_not_nan():
    q = jax.random.normal(jax.random.key(0), (2, 3, 4, 5))
    k = jax.random.normal(jax.random.key(1), (2, 7, 4, 5))
    mask = jnp.ones((2, 1, 3, 7), bool).at[0, :, 1].set(False)
    for impl in ("reference", "xla"):
        out, _ = dot_product_attention(q, k, k, mask, impl=impl)
        assert not jnp.isnan(out).any()
        np.testing.assert_array_equal(out[0, 1], 0.0)
    _, probs = dot_product_attention(q, k, k, mask, impl="reference", return_weights=True)
    np.testing.assert_array_equal(probs[0, :, 1], 0.0)
    np.testing.assert_allclose(probs[1].sum(-1), 1.0, atol=1e-6)


@pytest.mark.parametrize("impl", ["reference", "xla", "chunked"])
def test_mask_or_shapes_that_do_not_fit_are_an_error_naming_them(impl):
    """An additive 0/-inf mask (PyTorch's convention) read as a boolean attends exactly to the
    masked keys: 'reference' and 'chunked' gave wrong outputs silently, 'xla' a JAX error."""
    q = jax.random.normal(jax.random.key(0), (2, 3, 4, 5))
    k = jax.random.normal(jax.random.key(1), (2, 7, 4, 5))
    valid = jnp.ones((2, 7), bool).at[0, 4:].set(False)
    additive = jnp.where(valid, 0.0, -jnp.inf)[:, None, None, :]
    with pytest.raises(ValueError, match="mask must be bool"):
        dot_product_attention(q, k, k, additive, impl=impl)
    with pytest.raises(ValueError, match=re.escape("mask has shape (2, 7); it must broadcast to")):
        dot_product_attention(q, k, k, valid, impl=impl)
    with pytest.raises(ValueError, match="does not fit k"):  # 3 key/value heads for 4 query heads
        dot_product_attention(q, k[:, :, :3], k[:, :, :3], impl=impl)
    with pytest.raises(ValueError, match="does not fit k"):  # a key batch of 1: 'xla' refused it
        dot_product_attention(q, k[:1], k[:1], impl=impl)
    out, _ = dot_product_attention(q, k, k, valid[:, None, None, :], impl=impl)  # [B, 1, 1, S]
    ref, _ = dot_product_attention(q[:1], k[:1, :4], k[:1, :4], impl="reference")
    np.testing.assert_allclose(out[:1], ref, atol=1e-5)
    # The parts of an AttentionMask: a float kv_valid gave NaN ('reference') or the masked keys
    # ('chunked'), one of the wrong length an error from inside a slice.
    # (an int 0/1 kv_valid, Hugging Face's attention_mask, is `astype(bool)`: `== 0` would invert it)
    parts = [(dict(kv_valid=additive[:, 0, 0]), r"AttentionMask.kv_valid must be bool .* got float32"),
             (dict(kv_valid=valid.astype(jnp.int32)), r"got int32; a 0/1 mask .* is `mask.astype\(bool\)`"),
             (dict(kv_valid=valid[:, :5]), r"kv_valid has shape \(2, 5\); it must be \[B\|1, S\]"),
             (dict(kv_lengths=jnp.full((2,), 4.0)), r"AttentionMask.kv_lengths must be integer, got float32"),
             (dict(q_segment_ids=jnp.ones((2, 3), jnp.int32), kv_segment_ids=jnp.ones((2, 6), jnp.int32)),
              r"AttentionMask.kv_segment_ids has shape \(2, 6\)"),
             (dict(q_segment_ids=jnp.ones((2, 3), jnp.int32)), r"given together \(got only q_segment_ids\)")]
    for fields, message in parts:
        with pytest.raises(ValueError, match=message):
            dot_product_attention(q, k, k, masks.AttentionMask(3, 7, **fields), impl=impl)
    with pytest.raises(ValueError, match=r"\(q_length=3, kv_length=6\) does not fit 3 queries and 7"):
        dot_product_attention(q, k, k, masks.AttentionMask(3, 6), impl=impl)
    out, _ = dot_product_attention(q, k, k, masks.AttentionMask(3, 7, kv_valid=valid), impl=impl)
    np.testing.assert_allclose(out[:1], ref, atol=1e-5)


def test_chunked_attention_called_directly_checks_its_mask():
    """`chunked_attention` is public: an additive float mask attended exactly to the masked keys
    (it skipped the checks `dot_product_attention` makes), a 3-D one failed with an IndexError."""
    q = jax.random.normal(jax.random.key(0), (2, 3, 4, 5))
    k = jax.random.normal(jax.random.key(1), (2, 7, 4, 5))
    valid = jnp.ones((2, 7), bool).at[0, 4:].set(False)
    with pytest.raises(ValueError, match="mask must be bool"):
        chunked_attention(q, k, k, jnp.where(valid, 0.0, -jnp.inf)[:, None, None, :])
    with pytest.raises(ValueError, match=re.escape("mask has shape (2, 3, 7)")):
        chunked_attention(q, k, k, jnp.ones((2, 3, 7), bool))
    np.testing.assert_allclose(chunked_attention(q, k, k, valid[:, None, None, :]),
                               dot_product_attention(q, k, k, valid[:, None, None, :], impl="reference")[0],
                               atol=1e-5)


def test_backends_agree():
    q = jax.random.normal(jax.random.key(0), (3, 7, 6, 5))
    k = jax.random.normal(jax.random.key(1), (3, 11, 2, 5))  # grouped-query: 6 heads, 2 kv heads
    v = jax.random.normal(jax.random.key(2), (3, 11, 2, 5))
    mask = jax.random.bernoulli(jax.random.key(3), 0.7, (3, 1, 7, 11))
    ref, _ = dot_product_attention(q, k, v, mask, impl="reference")
    xla, _ = dot_product_attention(q, k, v, mask, impl="xla")
    np.testing.assert_allclose(ref, xla, atol=1e-5)


def test_attention_weights_on_request_only():
    cfg = config()
    src, tgt = tokens(1, (B, S)), tokens(2, (B, L))
    model, params = init_ed(cfg, src, tgt)
    logits, state = japply(model)({"params": params}, src, tgt, mutable="intermediates")
    np.testing.assert_allclose(logits, japply(model)({"params": params}, src, tgt), atol=1e-5)
    layer = state["intermediates"]["decoder"]["layer_1"]
    (self_w,) = layer["self_attention"]["attention_weights"]
    (cross_w,) = layer["cross_attention"]["attention_weights"]
    assert self_w.shape == (B, 5, L, L) and cross_w.shape == (B, 5, L, S)
    np.testing.assert_allclose(self_w.sum(-1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(jnp.triu(self_w, 1), 0.0)  # causal


@pytest.mark.parametrize("variant", VARIANTS)
def test_lm_cache_with_ragged_prompts_equals_full_recomputation(variant):
    cfg = config(**VARIANTS[variant])
    full_tokens = tokens(6, (B, 13))
    lm, params = init_lm(cfg, full_tokens)
    full = japply(lm)({"params": params}, full_tokens)
    lengths = jnp.array([3, 7, 5])
    prompt = jnp.where(jnp.arange(7) < lengths[:, None], full_tokens[:, :7], 0)
    cache = tj.init_cache(cfg, B, 13)
    logits, cache = japply(lm)({"params": params}, prompt, cache=cache, num_valid=lengths)
    for b in range(B):
        np.testing.assert_allclose(logits[b, : lengths[b]], full[b, : lengths[b]], atol=1e-5)
    for _ in range(5):
        position = cache.lengths
        step = full_tokens[jnp.arange(B), position][:, None]
        logits, cache = japply(lm)({"params": params}, step, cache=cache)
        np.testing.assert_allclose(logits[:, 0], full[jnp.arange(B), position], atol=1e-5)
    np.testing.assert_array_equal(cache.lengths, lengths + 5)


@pytest.mark.parametrize("model_change, cache_change, message", [
    (dict(scan_layers=True), {}, "built for scan_layers=False, the model has scan_layers=True"),
    ({}, dict(scan_layers=True), "built for scan_layers=True, the model has scan_layers=False"),
    ({}, dict(num_kv_heads=1), r"holds 1 key/value heads of 8, the model 4 of 8 \(num_kv_heads"),
    ({}, dict(num_decoder_layers=1), "holds 1 decoder layers, the model has num_decoder_layers=2"),
    ({}, dict(num_decoder_layers=3), "holds 3 decoder layers, the model has num_decoder_layers=2"),
])
def test_a_cache_built_for_another_config_is_named(model_change, cache_change, message):
    """TypeError / KeyError / IndexError from deep inside the model, or (more layers) no error."""
    base = tj.presets.tiny(num_encoder_layers=0, num_decoder_layers=2, num_heads=4, head_dim=8)
    t = jnp.array([[5, 6, 7]])
    lm = tj.TransformerLM(base.replace(**model_change))
    params = lm.init(jax.random.key(0), t)["params"]
    with pytest.raises(ValueError, match=message):
        lm.apply({"params": params}, t, cache=tj.init_cache(base.replace(**cache_change), 1, 8))


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_cache_is_head_major_and_every_backend_reads_it(impl):
    """The self-attention cache is [B, N, S_max, K]; backends other than xla get it as [B, S, N, K]."""
    cfg = config(num_kv_heads=1, attention_impl=impl)
    full_tokens = tokens(6, (B, 9))
    lm, params = init_lm(cfg, full_tokens)
    full = japply(lm)({"params": params}, full_tokens)
    cache = tj.init_cache(cfg, B, 9)
    assert cache.layers[0]["k"].shape == (B, 1, 9, cfg.qk_dim) and cache.max_length == 9
    logits, cache = japply(lm)({"params": params}, full_tokens[:, :4], cache=cache)
    np.testing.assert_allclose(logits, full[:, :4], atol=1e-5)
    for t in range(4, 9):
        logits, cache = japply(lm)({"params": params}, full_tokens[:, t : t + 1], cache=cache)
        np.testing.assert_allclose(logits[:, 0], full[:, t], atol=1e-5)


def test_bf16_cached_prefill_follows_full_forward_at_batch_8():
    """bf16 weights and compute, a cached 32-token prefill at batch 8: XLA:CPU once turned the
    attention-weighted sum over the head-major cache into a bf16 product it has no kernel for,
    which failed at run time (the shapes matter; batch 1 ran)."""
    cfg = tj.ModelConfig(vocab_size=512, d_model=64, num_heads=4, d_ff=128, num_encoder_layers=0,
                         num_decoder_layers=1, max_len=64, dropout_rate=0.0, norm="pre",
                         dtype="bfloat16", param_dtype="bfloat16")
    prompt = jax.random.randint(jax.random.key(1), (8, 32), 3, cfg.vocab_size)
    lm, params = init_lm(cfg, prompt)
    full = japply(lm)({"params": params}, prompt)
    logits, cache = japply(lm)({"params": params}, prompt, cache=tj.init_cache(cfg, 8, 48))
    np.testing.assert_array_equal(cache.lengths, 32)
    err = jnp.abs(logits - full).max() / jnp.abs(full).max()
    assert err < 0.02, err  # the same product order up to bf16 rounding


@pytest.mark.parametrize("variant", VARIANTS)
def test_encoder_decoder_cache_equals_full_recomputation(variant):
    cfg = config(**VARIANTS[variant])
    src = tokens(1, (B, S)).at[0, 5:].set(0).at[2, 9:].set(0)
    tgt = tokens(2, (B, L))
    model, params = init_ed(cfg, src, tgt)
    full = japply(model)({"params": params}, src, tgt)
    start = jax.jit(lambda p, s: model.apply(p, s, L, method="init_cache"))
    cache = start({"params": params}, src)
    assert cache.cross[0]["k"].shape == (B, cfg.kv_heads, S, cfg.qk_dim)  # heads first
    if variant == "paper":  # ... so a decoding step reads the source's K/V without transposing them
        step = jax.jit(lambda p, t, c: model.apply(p, None, t, cache=c))
        hlo = step.lower({"params": params}, tgt[:, :1], cache).compile().as_text()
        entry = hlo[hlo.index("ENTRY"):]
        shapes = {tuple(map(int, dims.split(","))) for dims in re.findall(r"= f32\[([0-9,]+)\]", entry)}
        cross_sized = {s for s in shapes if np.prod(s) == B * cfg.kv_heads * S * cfg.qk_dim}
        assert cross_sized == {(B, cfg.kv_heads, S, cfg.qk_dim)}, cross_sized
    logits, cache = japply(model)({"params": params}, None, tgt[:, :2], cache=cache)
    np.testing.assert_allclose(logits, full[:, :2], atol=1e-5)
    for t in range(2, L):
        logits, cache = japply(model)({"params": params}, None, tgt[:, t : t + 1], cache=cache)
        np.testing.assert_allclose(logits[:, 0], full[:, t], atol=1e-5)


def test_encoder_decoder_refuses_a_cache_without_the_source():
    """`tj.init_cache` builds a TransformerLM's cache (no cross-attention K/V). Given to the
    encoder-decoder, each block's cross-attention attended over the new target tokens instead
    of the source: logits that ignored the source (off by ~5 here), silently."""
    cfg = config()
    src, tgt = tokens(1, (2, 5)), tokens(2, (2, 3))
    model, params = init_ed(cfg, src, tgt)
    with pytest.raises(ValueError, match=r"holds the encoded source: build it with tj.encode_source"):
        model.apply({"params": params}, None, tgt, cache=tj.init_cache(cfg, 2, 8))
    step = tj.Seq2SeqStep(model)
    with pytest.raises(ValueError, match=r"tj.init_cache builds a TransformerLM's cache"):
        tj.decoding.generate(step, params, tj.init_cache(cfg, 2, 8), tgt[:, :1], jnp.ones(2, jnp.int32),
                             max_new_tokens=2)
    with pytest.raises(ValueError, match=r"this decoder has cross-attention: pass memory"):
        model.apply({"params": params}, tgt, method=lambda m, t: m.decoder(t))
    # The other way round: the encoded source given to a TransformerLM decoded without a word,
    # the source carried along unread.
    lm = tj.TransformerLM(cfg.replace(num_encoder_layers=0))
    lm_params = lm.init(jax.random.key(0), tgt)["params"]
    with pytest.raises(ValueError, match=r"TransformerLM decodes from .*holds an encoded source"):
        tj.decoding.generate(tj.LMStep(lm), lm_params, tj.encode_source(model, params, src, 8), tgt,
                             jnp.full(2, 3, jnp.int32), max_new_tokens=2)


def test_bfloat16_compute_stays_close_to_float32():
    cfg32 = config(d_model=64, num_heads=4, d_ff=128)
    cfg16 = cfg32.replace(dtype="bfloat16")
    src, tgt = tokens(1, (B, S)), tokens(2, (B, L))
    model, params = init_ed(cfg32, src, tgt)
    ref = japply(model)({"params": params}, src, tgt)
    out = japply(tj.Transformer(cfg16))({"params": params}, src, tgt)
    assert out.dtype == jnp.float32  # logits for the loss stay float32
    assert params["embed"]["embedding"].unbox().dtype == jnp.float32
    err = jnp.abs(out - ref).max() / jnp.abs(ref).max()
    assert err < 0.05, err
    np.testing.assert_array_equal(out.argmax(-1)[ref.max(-1) - jnp.sort(ref, -1)[..., -2] > 0.5],
                                  ref.argmax(-1)[ref.max(-1) - jnp.sort(ref, -1)[..., -2] > 0.5])


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_bf16_logits_are_accumulated_and_returned_in_float32(tie):
    """The output layer multiplies bf16 activations by the bf16 table with float32 accumulation and
    returns the float32 sums: logits rounded to bf16 (0.4% steps) would blur the loss and sampling."""
    cfg = config(num_encoder_layers=0, norm="pre", dtype="bfloat16", tie_output=tie)
    t = tokens(3, (B, L))
    lm, params = init_lm(cfg, t)
    run = jax.jit(functools.partial(lm.apply, capture_intermediates=True, mutable="intermediates"))
    logits, state = run({"params": params}, t)
    (hidden,) = state["intermediates"]["decoder"]["final_norm"]["__call__"]  # bf16 [B, L, D]
    p = nn.unbox(params)
    table = p["embed"]["embedding"].T if tie else p["decoder"]["output"]["kernel"]
    as32 = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
    want = as32(hidden) @ as32(table)
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_a_prompt_that_fills_the_cache_exactly_is_accepted():
    """L tokens fit in a cache of L positions: a prefill to the last slot equals the full forward."""
    cfg = config()
    t = tokens(6, (B, 9))
    lm, params = init_lm(cfg, t)
    logits, cache = japply(lm)({"params": params}, t, cache=tj.init_cache(cfg, B, 9))
    np.testing.assert_allclose(logits, japply(lm)({"params": params}, t), atol=1e-5)
    np.testing.assert_array_equal(cache.lengths, 9)


def test_positions_past_a_learned_position_table_are_refused():
    """The full forward refuses more tokens than max_len; given positions (packed rows) or cached
    tokens reaching position max_len gave NaN logits instead, for the whole row (its NaN keys and
    values reach every query through 0 * NaN), and a cache kept them for every later step. Up to
    the table's last row the cached call equals the full forward."""
    cfg = config(position="learned", max_len=8, norm="pre", num_encoder_layers=1, num_decoder_layers=1)
    t = tokens(6, (B, 9))
    lm, params = init_lm(cfg, t[:, :8])
    logits, cache = lm.apply({"params": params}, t[:, :8], cache=tj.init_cache(cfg, B, 12))
    np.testing.assert_allclose(logits, japply(lm)({"params": params}, t[:, :8]), atol=1e-5)
    past = r"reach position 8, past the learned position table's 8 rows \(ModelConfig.max_len\)"
    with pytest.raises(ValueError, match="the cached tokens " + past):
        lm.apply({"params": params}, t[:, 8:], cache=cache)
    seg = jnp.ones((B, 3), jnp.int32)
    pos = jnp.broadcast_to(jnp.array([6, 7, 8]), (B, 3))
    with pytest.raises(ValueError, match="positions " + past):
        lm.apply({"params": params}, t[:, :3], segment_ids=seg, positions=pos)
    seq2seq = tj.Transformer(cfg)
    # The check comes before any layer runs: parameter shapes are enough.
    ed_params = jax.eval_shape(seq2seq.init, jax.random.key(0), t[:, :3], t[:, :3])
    for name in ("src_positions", "tgt_positions"):
        with pytest.raises(ValueError, match=f"{name} " + past):
            seq2seq.apply(ed_params, t[:, :3], t[:, :3], src_segment_ids=seg, tgt_segment_ids=seg,
                          **{"src_positions": pos - 1, "tgt_positions": pos - 1, name: pos})


def _rope(x, positions, theta):
    """Pairs (k, k + K/2) of x [B, L, H, K] rotated by position * theta^(-2k/K)."""
    half = x.shape[-1] // 2
    angle = positions[:, :, None, None] * theta ** (-2 * np.arange(half) / x.shape[-1])
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle)], -1)


@pytest.mark.parametrize("num_kv_heads, fused", [(4, True), (4, False), (2, False), (2, True), (1, False)],
                         ids=["mha_fused_qkv", "mha", "gqa", "gqa_fused_qkv", "mqa"])
def test_rotary_attention_layer_equals_the_formula(num_kv_heads, fused):
    """MultiHeadAttention with rotary positions against numpy: Q, K, V projections with biases,
    RoPE on Q and K, softmax(QK^T / sqrt(d_k)) V with query head h reading K/V head h // (H / N),
    then W^O. With `fused_qkv` the same parameters, stored as one Q/K/V kernel, must give it."""
    from transformer_jax.modeling import attention

    H, K, D, theta = 4, 6, 10, 10000.0
    mha = attention.MultiHeadAttention(d_model=D, num_heads=H, head_dim=K, num_kv_heads=num_kv_heads,
                                       rope_theta=theta)
    x = jax.random.normal(jax.random.key(0), (2, 5, D))
    positions = jnp.array([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    shapes = jax.eval_shape(mha.init, jax.random.key(0), x, q_positions=positions)["params"]
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32) * 0.5, nn.unbox(shapes))
    if fused:
        separate = [params.pop(name) for name in ("query", "key", "value")]
        params["qkv"] = {part: attention.fuse_qkv(*(p[part] for p in separate), axis=axis)
                         for part, axis in (("kernel", 1), ("bias", 0))}
        out, _ = jax.jit(mha.clone(fused_qkv=True).apply)({"params": params}, x, q_positions=positions)
        params.update(zip(("query", "key", "value"), separate))
    else:
        out, _ = jax.jit(mha.apply)({"params": params}, x, q_positions=positions)

    x64, pos = np.asarray(x, np.float64), np.asarray(positions, np.float64)
    proj = lambda name: np.einsum("bld,dhk->blhk", x64, params[name]["kernel"]) + params[name]["bias"]
    q, k, v = _rope(proj("query"), pos, theta), _rope(proj("key"), pos, theta), proj("value")
    k, v = (np.repeat(a, H // num_kv_heads, axis=2) for a in (k, v))
    logits = np.einsum("blhk,bshk->bhls", q, k) / np.sqrt(K)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    heads = np.einsum("bhls,bshk->blhk", probs, v)
    want = np.einsum("blhk,hkd->bld", heads, params["out"]["kernel"]) + params["out"]["bias"]
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)


def test_dropout_needs_rng_only_in_training():
    cfg = config(dropout_rate=0.3, attention_dropout_rate=0.2)
    t = tokens(2, (B, L))
    lm, params = init_lm(cfg, t)
    a = japply(lm)({"params": params}, t)
    np.testing.assert_allclose(a, japply(lm)({"params": params}, t))
    d1 = japply(lm)({"params": params}, t, deterministic=False, rngs={"dropout": jax.random.key(1)})
    d2 = japply(lm)({"params": params}, t, deterministic=False, rngs={"dropout": jax.random.key(2)})
    assert not np.allclose(d1, a) and not np.allclose(d1, d2)


@pytest.mark.parametrize("layout", ["BSNK", "BNSK"])
def test_attention_dropout_drops_a_fraction_p_of_the_weights_and_rescales_the_rest(layout):
    """Equal scores give weights 1/S, and an identity V reads the dropped weights out directly:
    about a fraction p of them are zero and the rest are (1/S) / (1 - p), so their mean stays 1/S
    (keeping with probability p instead of 1 - p passed the "outputs differ" test above)."""
    batch, length, heads, keys, p = 2, 16, 4, 64, 0.2
    q = jnp.zeros((batch, length, heads, keys))
    k = jnp.zeros((batch, keys, heads, keys))
    v = jnp.broadcast_to(jnp.eye(keys)[None, :, None, :], (batch, keys, heads, keys))
    if layout == "BNSK":  # the KV cache's layout takes its own path through the reference attention
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    run = functools.partial(dot_product_attention, q, k, v, impl="reference", kv_layout=layout,
                            dropout_rate=p)
    np.testing.assert_allclose(run(deterministic=True)[0], 1.0 / keys, rtol=1e-6)
    weights = np.asarray(run(deterministic=False, dropout_rng=jax.random.key(0))[0])  # [B, L, H, S]
    dropped = weights == 0.0
    assert abs(dropped.mean() - p) < 0.02, dropped.mean()  # 8192 weights: 4.5 standard deviations
    np.testing.assert_allclose(weights[~dropped], 1.0 / keys / (1.0 - p), rtol=1e-6)
    assert abs(weights.sum(-1).mean() - 1.0) < 0.02


def test_residual_dropout_is_on_the_sub_layer_output_not_on_the_sum():
    """Section 5.4: dropout on each sub-layer's output before it is added. With a rate so close to 1
    that this key drops every element, each pre-norm block passes its input through unchanged, so the
    logits are the final norm of the embedding sums times the table (dropout on the sum would zero
    the residual stream instead)."""
    t = tokens(2, (B, L))
    cfg = config(norm="pre", dropout_rate=1.0 - 1e-7, embedding_dropout_rate=0.0)
    lm, params = init_lm(cfg, t)
    dropped = japply(lm)({"params": params}, t, deterministic=False, rngs={"dropout": jax.random.key(0)})

    def blocks_skipped(m, tokens):
        x = m.decoder.embed_tokens(tokens, jnp.broadcast_to(jnp.arange(L), tokens.shape), True)
        return m.embed.attend(m.decoder.finish(x))

    np.testing.assert_allclose(dropped, lm.apply({"params": params}, t, method=blocks_skipped), atol=1e-5)
    assert not np.allclose(dropped, japply(lm)({"params": params}, t), atol=1e-3)  # the blocks do matter


def test_embedding_dropout_rate_applies_to_the_embedding_sums_only():
    t = tokens(2, (B, L))
    params = init_lm(config(), t)[1]  # dropout rates change no parameter: one set serves every config
    run = lambda cfg, key: japply(tj.TransformerLM(cfg))(
        {"params": params}, t, deterministic=False, rngs={"dropout": jax.random.key(key)})
    plain = japply(tj.TransformerLM(config(dropout_rate=0.0)))({"params": params}, t)
    # only the embedding dropout is on: training outputs differ from the deterministic ones
    assert not np.allclose(run(config(dropout_rate=0.0, embedding_dropout_rate=0.5), 1), plain)
    # with it off, residual dropout alone is what moves them; None means dropout_rate, as in the paper
    np.testing.assert_allclose(run(config(dropout_rate=0.0, embedding_dropout_rate=0.0), 1), plain, atol=1e-6)
    np.testing.assert_array_equal(run(config(dropout_rate=0.3), 3),
                                  run(config(dropout_rate=0.3, embedding_dropout_rate=0.3), 3))
    assert not np.allclose(run(config(dropout_rate=0.3), 3),
                           run(config(dropout_rate=0.3, embedding_dropout_rate=0.0), 3))
    with pytest.raises(ValueError, match=r"embedding_dropout_rate=1.0: must be in \[0, 1\) or None"):
        config(embedding_dropout_rate=1.0)


def test_train_state_of_a_language_model_whose_config_has_encoder_fields():
    """TransformerLM ignores the encoder fields; create_train_state initialised it with the two
    inputs of an encoder-decoder (a TypeError) since it read the config, not the module."""
    import optax

    from transformer_jax import parallel
    from transformer_jax.training.state import create_train_state

    lm = tj.TransformerLM(tj.presets.tiny(vocab_size=100, norm="pre"))  # num_encoder_layers=2
    state, _ = create_train_state(lm, optax.adam(1e-3), parallel.create_mesh(1, 1, 1, jax.devices()[:1]))
    assert "encoder" not in state.params and "decoder" in state.params


def test_bad_model_inputs_name_the_argument():
    """Each failed deep inside a layer (IndexError, a broadcasting TypeError, flax's shape error)."""
    cfg = config()
    seq2seq = tj.Transformer(cfg)
    src = tokens(1, (2, 5))
    params = {"params": seq2seq.init(jax.random.key(0), src, src)["params"]}
    cases = [
        (([1, 2, 3], src), {}, r"src must be \[batch, length\] token ids, got shape \(3,\)"),
        ((src, src.astype(jnp.float32)), {}, r"tgt must be integer token ids, got float32"),
        ((src, tokens(2, (3, 5))), {}, r"the source has 2 rows but the target 3"),
        ((src, src), dict(tgt_positions=jnp.zeros((1, 3), jnp.int32)),
         r"tgt_positions has shape \(1, 3\) but tgt has \(2, 5\)"),
        ((src, src), dict(src_segment_ids=jnp.ones((2, 4), jnp.int32)), r"src_segment_ids has shape"),
        # ids outside the vocabulary gave NaN logits (JAX's gather fills out-of-range rows with NaN)
        ((src.at[1, 3].set(cfg.vocab_size), src), {},
         rf"src holds token id {cfg.vocab_size} \(at \(1, 3\)\), outside the model's vocabulary "
         rf"\[0, {cfg.vocab_size}\)"),
        ((src, src.at[0, 0].set(-100)), {}, r"tgt holds token id -100 \(at \(0, 0\)\)"),
        # float positions gave sines of fractional positions, float segment ids float equality
        ((src, src), dict(tgt_positions=jnp.zeros((2, 5)) + .5), r"tgt_positions must be integers .*float32"),
        ((src, src), dict(src_segment_ids=jnp.ones((2, 5))), r"src_segment_ids must be integers"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            seq2seq.apply(params, *args, **kwargs)
    # lists of ids are fine
    np.testing.assert_allclose(seq2seq.apply(params, src.tolist(), src.tolist()),
                               seq2seq.apply(params, src, src))
    lm, lm_params = init_lm(cfg, src)
    with pytest.raises(ValueError, match=r"num_valid must have shape \(2,\)"):
        lm.apply({"params": lm_params}, src, cache=tj.init_cache(cfg, 2, 8), num_valid=jnp.ones(3, jnp.int32))
    with pytest.raises(ValueError, match=r"tokens holds token id -1 \(at \(0, 2\)\)"):
        lm.apply({"params": lm_params}, src.at[0, 2].set(-1))
    # inside jit the ids cannot be read: no error, and the lookup's NaN shows in the logits; a
    # negative id (counted from the table's end) and one in a padded vocabulary's extra rows, and
    # on the bf16 and packed lookups, read finite rows of the table before
    too_big = src.at[0, 2].set(cfg.vocab_size)
    assert np.isnan(np.asarray(jax.jit(lm.apply)({"params": lm_params}, too_big))[0, 2]).all()
    for kwargs in (dict(pad_vocab_multiple=64), dict(param_dtype="bfloat16", dtype="bfloat16"),
                   dict(kernel_layout="packed")):
        padded, padded_params = init_lm(config(**kwargs), src)
        for bad in (cfg.vocab_size, -1):
            logits = np.asarray(jax.jit(padded.apply)({"params": padded_params}, src.at[0, 2].set(bad)),
                                np.float32)
            assert np.isnan(logits[0, 2:]).all() and np.isfinite(logits[1]).all(), (kwargs, bad)
    # a concrete bool array, as before, and positions given as nested lists (the error names them)
    np.testing.assert_array_equal(lm.apply({"params": lm_params}, src, deterministic=jnp.array(True)),
                                  lm.apply({"params": lm_params}, src))
    with pytest.raises(ValueError, match=r"positions must be integers \(token indices\), got float"):
        lm.apply({"params": lm_params}, src, positions=[[0.5] * 5] * 2)
    with pytest.raises(TypeError, match="deterministic must be a Python bool .* static_argnames"):
        jax.jit(lm.apply)({"params": lm_params}, src, deterministic=False,
                          rngs={"dropout": jax.random.key(0)})


def test_misused_decoding_and_position_arguments_are_named():
    """Each was accepted and gave wrong numbers without a word: tj.encode_source (compiled) skipped
    the source's vocabulary check (an id past it filled the cache with NaN, a negative one read a
    row from the table's end); num_valid outside [0, L] shifted the cache (logits off by 0.4-1.8),
    and a float one was truncated; a negative learned position read the table's last row; an
    integer cache truncated every key and value; the encoder-decoder with a cache dropped the
    target positions and segment ids it was given. A negative or float cache length failed inside
    XLA, and src=None without a cache in jnp.asarray."""
    cfg = config(position="learned", max_len=16, norm="pre")
    src, tgt = tokens(1, (2, 5)), tokens(2, (2, 3))
    seq2seq, params = init_ed(cfg, src, tgt)
    cache = tj.encode_source(seq2seq, params, src, 8)
    direct = seq2seq.apply({"params": params}, src, 8, method="init_cache")
    np.testing.assert_array_equal(cache.cross[0]["k"], direct.cross[0]["k"])
    for bad in (V, -1):
        with pytest.raises(ValueError, match=rf"src holds token id {bad} \(at \(0, 0\)\)"):
            tj.encode_source(seq2seq, params, src.at[0, 0].set(bad), 8)
    ids = jnp.ones((2, 3), jnp.int32)
    for source, kwargs, name in ((src, {}, "src"), (None, dict(tgt_positions=ids), "tgt_positions"),
                                 (None, dict(tgt_segment_ids=ids), "tgt_segment_ids")):
        with pytest.raises(ValueError, match=rf"with a cache .*: {name} cannot be given"):
            seq2seq.apply({"params": params}, source, tgt, cache=cache, **kwargs)
    with pytest.raises(ValueError, match=r"src is None: without a cache"):
        seq2seq.apply({"params": params}, None, tgt)
    for length, message in ((-1, r"max_length must be at least 1, got -1"),
                            (16.0, r"max_length must be an integer, got 16.0")):
        with pytest.raises(ValueError, match=message):
            seq2seq.apply({"params": params}, src, length, method="init_cache")
        with pytest.raises(ValueError, match=message):
            tj.init_cache(cfg, 2, length)

    t = tokens(3, (2, 4))
    lm, lm_params = init_lm(cfg, t)
    cached = tj.init_cache(cfg, 2, 8)
    for num_valid, message in (([5, 4], r"num_valid holds 5: each row counts 0 to 4"),
                               ([4, -1], r"num_valid holds -1"),
                               (jnp.array([2.7, 4.0]), r"num_valid must be integer counts, got float32")):
        with pytest.raises(ValueError, match=message):
            lm.apply({"params": lm_params}, t, cache=cached, num_valid=jnp.asarray(num_valid))
    logits, _ = lm.apply({"params": lm_params}, t, cache=cached, num_valid=jnp.array([4, 0]))  # 0..L: fine
    np.testing.assert_allclose(logits[0], japply(lm)({"params": lm_params}, t)[0], atol=1e-5)
    for dtype in (jnp.int32, jnp.int8, jnp.bool_):
        with pytest.raises(ValueError, match=r"the cache dtype must be a floating-point type"):
            tj.init_cache(cfg, 2, 8, dtype=dtype)
    segments = jnp.ones((2, 4), jnp.int32)
    with pytest.raises(ValueError, match=r"positions hold position -1: positions start at 0"):
        lm.apply({"params": lm_params}, t, segment_ids=segments, positions=jnp.array([[0, 1, 2, -1]] * 2))
    with pytest.raises(ValueError, match=r"positions must be integers .*, got float32"):
        lm.apply({"params": lm_params}, t, segment_ids=segments, positions=jnp.zeros((2, 4)))


def test_params_of_another_config_are_refused_not_read_in_part():
    """Flax reads only the entries a model asks for: a 3-layer model's params ran a 2-layer one on
    its first two layers, untied params a tied model (its output projection unread), and an
    encoder-decoder's params a decoder-only model, each without a word. Params that are the
    model's own, boxed or plain, still run."""
    t = tokens(4, (2, 5))
    base = config(num_encoder_layers=0, num_decoder_layers=2, norm="pre")
    lm, params = init_lm(base, t)
    np.testing.assert_array_equal(lm.apply({"params": nn.unbox(params)}, t), lm.apply({"params": params}, t))
    for other, named in ((dict(num_decoder_layers=3), r"decoder/layer_2/"),
                         (dict(tie_output=False), r"output")):
        _, other_params = init_lm(base.replace(**other), t)
        with pytest.raises(ValueError, match=rf"the params hold \d+ entries that a TransformerLM of this "
                                             rf"config does not have \(.*{named}"):
            lm.apply({"params": other_params}, t)
    _, ed_params = init_ed(config(norm="pre"), t, t)
    with pytest.raises(ValueError, match=r"entries that a TransformerLM .*\(.*(cross_attention|encoder)"):
        lm.apply({"params": ed_params}, t)
    with pytest.raises(ValueError, match=r"entries that a TransformerLM"):
        jax.jit(lm.apply)({"params": ed_params}, t)  # checked on the structure: inside jit too
    # Boxes saved as they are and restored by orbax without a target: every leaf a {'value': array}
    # (the message blamed another config's params).
    deeper = jax.tree.map(lambda box: {"value": box.value}, params,
                          is_leaf=lambda x: isinstance(x, nn.Partitioned))
    with pytest.raises(ValueError, match=r"the params hold every parameter one level deeper, under 'value' "
                                         r"\(.*\): nn.LogicallyPartitioned boxes saved as they are and "
                                         r"restored without a target. Save nn.unbox\(params\)"):
        lm.apply({"params": deeper}, t)


def test_building_blocks_name_a_bad_setting():
    """Used directly (not through ModelConfig), the blocks ran an unknown `norm` as 'post' and an
    unknown `norm_type` as LayerNorm; an unknown activation was a bare KeyError; rotary positions
    of another length were broadcast ([B, 1]: off by 0.7) or failed inside XLA ([B, L + 1])."""
    from transformer_jax import modeling

    x = jax.random.normal(jax.random.key(0), (2, 5, 16))
    mask = jnp.tril(jnp.ones((5, 5), bool))[None, None]

    def block(**fields):
        return modeling.TransformerBlock(**{**dict(d_model=16, num_heads=2, head_dim=8, num_kv_heads=2,
                                                   d_ff=32), **fields})

    for fields, message in ((dict(norm="mid"), r"norm must be 'post' or 'pre', got 'mid'"),
                            (dict(norm_type="batchnorm"), r"norm_type must be 'layernorm' or 'rmsnorm'"),
                            (dict(activation="gelu2"), r"activation must be one of .*, got 'gelu2'")):
        with pytest.raises(ValueError, match=message):
            block(**fields).init(jax.random.key(1), x, self_mask=mask)
    rope = block(rope_theta=10000.0)
    positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
    variables = rope.init(jax.random.key(1), x, self_mask=mask, positions=positions)
    out = rope.apply(variables, x, self_mask=mask, positions=positions)[0]
    np.testing.assert_allclose(rope.apply(variables, x, self_mask=mask, positions=positions[:1])[0], out,
                               atol=1e-6)  # [1, L]: one row of positions for the whole batch
    for bad in (positions[:, :1], jnp.broadcast_to(jnp.arange(6), (2, 6))):
        shape = rf"\({bad.shape[0]}, {bad.shape[1]}\)"
        with pytest.raises(ValueError, match=rf"rotary positions have shape {shape} "):
            rope.apply(variables, x, self_mask=mask, positions=bad)


def test_remat_gives_the_same_gradients():
    t = tokens(2, (B, L))
    grads = []
    for remat in ("none", "full", "dots_saveable"):
        cfg = config(remat=remat)
        lm, params = init_lm(cfg, t)
        loss = lambda p, lm=lm: lm.apply({"params": p}, t).mean()
        grads.append(jax.jit(jax.grad(loss))(params))
    for g in grads[1:]:
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), grads[0], g)


def test_linen_modules_work_from_nnx():
    from flax import nnx
    from flax.nnx import bridge

    cfg = config()
    t = tokens(2, (B, L))
    linen_lm = tj.TransformerLM(cfg)
    # Logical axis names become shardings only under a mesh; without one, build unsharded.
    with nnx.use_eager_sharding(False):
        nnx_lm = bridge.ToNNX(linen_lm, rngs=nnx.Rngs(0))
        bridge.lazy_init(nnx_lm, t)
        out = nnx_lm(t)
    assert out.shape == (B, L, V)
    # The same parameters through Linen give the same logits.
    params = nnx.state(nnx_lm, nnx.Param)
    linen_params = jax.tree.map(lambda x: x, nnx.to_pure_dict(params))
    np.testing.assert_allclose(japply(linen_lm)({"params": linen_params}, t), out, atol=1e-6)
