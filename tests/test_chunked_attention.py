"""The memory-efficient backends ('chunked', 'flash') against the reference softmax(QK^T/sqrt(d_k))V.

Sizes are odd primes that the chunk sizes (4 queries, 8 keys) do not divide; H=6 query heads share
N=2 key/value heads (grouped-query attention).
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import transformer_jax as tj
from transformer_jax.modeling import AttentionMask, attention, chunked_attention, dot_product_attention, masks
from transformer_jax.modeling.attention import (
    _pallas_tpu_flash,
    _pallas_tpu_supports,
    _queries_that_see_a_key,
    resolve_impl,
)

B, L, S, H, N, K = 2, 13, 19, 6, 2, 8
SEG_Q = jnp.array([[1] * 6 + [2] * 5 + [0] * 2, [1] * 13])
SEG_KV = jnp.array([[1] * 8 + [2] * 7 + [0] * 4, [1] * 11 + [0] * 8])
MASKS = {
    "none": AttentionMask(L, S),
    "causal": AttentionMask(L, S, causal=True),
    "causal_cache_offset": AttentionMask(L, S, causal=True, causal_offset=jnp.array([0, 5])),
    "key_padding": AttentionMask(L, S, kv_valid=jnp.arange(S)[None] < jnp.array([[7], [19]])),
    "segments_with_padding_rows": AttentionMask(L, S, q_segment_ids=SEG_Q, kv_segment_ids=SEG_KV),
    "key_lengths_one_row_empty": AttentionMask(L, S, kv_lengths=jnp.array([0, 10])),
    "causal_key_lengths_and_limit": AttentionMask(L, S, causal=True, kv_lengths=jnp.array([3, 17]),
                                                  kv_limit=12),
    "dense_per_head": AttentionMask(
        L, S, dense=jax.random.bernoulli(jax.random.key(9), 0.3, (B, H, L, S))),
}


def qkv(dtype=jnp.float32, heads=(H, N), lengths=(L, S)):
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (B, lengths[0], heads[0], K), dtype)
    k = jax.random.normal(kk, (B, lengths[1], heads[1], K), dtype)
    v = jax.random.normal(kv, (B, lengths[1], heads[1], K), dtype)
    return q, k, v


def loss(fn):
    return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)))


@pytest.mark.parametrize("name", MASKS)
def test_chunked_equals_reference_forward_and_gradients(name):
    spec = MASKS[name]
    q, k, v = qkv()

    def reference(q, k, v):
        return dot_product_attention(q, k, v, spec.materialize(), impl="reference")[0]

    def chunked(q, k, v):
        return chunked_attention(q, k, v, spec, q_chunk=4, kv_chunk=8)

    def both(fn):
        return jax.jit(lambda q, k, v: (fn(q, k, v), jax.grad(loss(fn), (0, 1, 2))(q, k, v)))

    (got, got_grads), (want, want_grads) = both(chunked)(q, k, v), both(reference)(q, k, v)
    np.testing.assert_allclose(got, want, atol=2e-6)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5)
    # Forward mode (JAX's JVP of the loops), and forward over reverse (a Hessian-vector product
    # through the backward loops)
    tangents = tuple(jax.random.normal(jax.random.key(i), x.shape) for i, x in enumerate((q, k, v), 5))

    def forward_modes(fn):
        jvp = lambda q, k, v: jax.jvp(fn, (q, k, v), tangents)[1]
        hvp = lambda q, k, v: jax.jvp(jax.grad(loss(fn), (0, 1, 2)), (q, k, v), tangents)[1]
        return jax.jit(lambda q, k, v: (jvp(q, k, v), hvp(q, k, v)))(q, k, v)

    (got_jvp, got_hvp), (want_jvp, want_hvp) = forward_modes(chunked), forward_modes(reference)
    np.testing.assert_allclose(got_jvp, want_jvp, atol=2e-5)
    for g, w in zip(got_hvp, want_hvp, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4)


def test_chunked_inside_shard_map_equals_reference():
    """Under jax.shard_map with check_vma (its default), data-parallel over the batch: the loops'
    initial carries follow the inputs' varying axes (JAX refused the mismatch before), and the
    forward pass, gradients and JVP equal the reference's on the whole batch."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    spec = MASKS["segments_with_padding_rows"]
    q, k, v = qkv()
    tangents = tuple(jax.random.normal(jax.random.key(i), x.shape) for i, x in enumerate((q, k, v), 5))

    def everything(attend, q, k, v, *tangents):
        return (attend(q, k, v), jax.grad(loss(attend), (0, 1, 2))(q, k, v),
                jax.jvp(attend, (q, k, v), tangents)[1])

    def sharded(q, k, v, q_seg, kv_seg, *tangents):
        mask = AttentionMask(L, S, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
        return everything(lambda q, k, v: chunked_attention(q, k, v, mask, q_chunk=4, kv_chunk=8),
                          q, k, v, *tangents)

    rows = P("data")
    put = lambda a: jax.device_put(a, NamedSharding(mesh, rows))
    got = jax.jit(jax.shard_map(sharded, mesh=mesh, in_specs=rows, out_specs=rows))(
        *map(put, (q, k, v, spec.q_segment_ids, spec.kv_segment_ids, *tangents)))
    reference = lambda q, k, v: dot_product_attention(q, k, v, spec.materialize(), impl="reference")[0]
    want = jax.jit(lambda *a: everything(reference, *a))(q, k, v, *tangents)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_model_trains_data_parallel_under_shard_map(dtype):
    """A whole LM with chunked attention (bf16: its weight products too) inside jax.shard_map over
    a 'data' axis, check_vma on: the loss is the one-device loss, and each replicated parameter's
    gradient is the sum over the two shards of their mean losses' gradients, twice the one-device
    gradient of the mean. Both failed before, in JAX's check of varying axes."""
    import flax.linen as nn
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    config = tj.presets.tiny(num_encoder_layers=0, dtype=dtype, attention_impl="chunked", dropout_rate=0.0)
    model = tj.TransformerLM(config)
    tokens = jax.random.randint(jax.random.key(1), (4, 24), 3, config.vocab_size)
    params = nn.unbox(model.init(jax.random.key(0), tokens)["params"])

    def loss(p, t):
        logits = model.apply({"params": p}, t)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), t[..., None], -1))

    def step(p, t):
        value, grads = jax.value_and_grad(loss)(p, t)
        return jax.lax.pmean(value, "data"), grads

    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    sharded = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
    value, grads = sharded(params, jax.device_put(tokens, NamedSharding(mesh, P("data"))))
    want_value, want = jax.jit(jax.value_and_grad(loss))(params, tokens)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    pairs = list(zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True))
    floor = 1e-2 * max(float(jnp.linalg.norm(w)) for _, w in pairs)  # the key bias's is ~0
    for g, w in pairs:
        assert float(jnp.linalg.norm(g / 2 - w)) < (1e-4 if dtype == "float32" else 0.1) * max(
            float(jnp.linalg.norm(w)), floor)


def test_lengths_just_past_a_chunk_are_split_evenly():
    """513 rows in chunks of at most 512 are two chunks of 264 (15 rows of padding), not two of 512
    (511 rows of padding, twice the work); the result still equals the reference."""
    from transformer_jax.modeling.chunked_attention import _even_chunk

    assert [_even_chunk(n, 512, 8) for n in (7, 512, 513, 1000, 1025, 16384)] == [7, 512, 264, 504, 344, 512]
    assert _even_chunk(13, 4, 8) == 4  # a granule larger than the chunk is not forced
    q, k, v = qkv(heads=(2, 1), lengths=(520, 530))
    spec = AttentionMask(520, 530, causal=True, causal_offset=jnp.array([10, 3]))
    got = jax.jit(lambda q, k, v: chunked_attention(q, k, v, spec))(q, k, v)
    want = dot_product_attention(q, k, v, spec.materialize(), impl="reference")[0]
    np.testing.assert_allclose(got, want, atol=2e-6)


@pytest.mark.parametrize("name", MASKS)
def test_xla_backend_equals_reference_forward_and_gradients(name):
    """jax.nn.dot_product_attention gets causal masks and key lengths as arguments, the rest dense."""
    spec = MASKS[name]
    q, k, v = qkv()

    def run(impl):
        fn = lambda q, k, v: dot_product_attention(q, k, v, spec, impl=impl)[0]
        return jax.jit(lambda q, k, v: (fn(q, k, v), jax.grad(loss(fn), (0, 1, 2))(q, k, v)))(q, k, v)

    (got, got_grads), (want, want_grads) = run("xla"), run("reference")
    np.testing.assert_allclose(got, want, atol=2e-6)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5)


def _check_cudnn_arguments(args, kwargs):
    """JAX's own check of what jax.nn.dot_product_attention hands cuDNN (q, k, v in [B, T, N, H],
    the mask as its bias, key lengths), which runs before the kernel on a GPU: it refused a
    [B, 1, 1, S] key-padding mask there ("Bias must have same seq length as QKV")."""
    from jax._src.cudnn.fused_attention_stablehlo import AttentionLayout, check_layout

    check_layout(*args, kwargs.get("mask"), None, kwargs.get("key_value_seq_lengths"), None, None,
                 None, None, AttentionLayout.BTNH)


@pytest.mark.parametrize("name, expected", [
    ("causal", dict(is_causal=True)),
    ("key_lengths_one_row_empty", dict(is_causal=False, key_value_seq_lengths=[1, 10])),  # 0 -> 1, zeroed
    ("causal_key_lengths_and_limit", dict(is_causal=True, key_value_seq_lengths=[3, 12])),
    ("causal_cache_offset", dict(mask=(B, 1, L, S))),
    ("key_padding", dict(mask=(B, 1, L, S))),  # cuDNN takes a bias of the full [L, S] only
])
def test_cudnn_gets_causal_and_key_lengths_as_arguments_not_a_dense_mask(monkeypatch, name, expected):
    """What the cuDNN path hands jax.nn.dot_product_attention (recorded, then run by XLA on CPU; the
    cuDNN kernel itself needs a GPU): a causal mask from position 0 and key lengths go as is_causal /
    key_value_seq_lengths, so that cuDNN's causal and padding kernels run and no [L, S] mask is
    built; other masks go dense."""
    calls = []
    real = jax.nn.dot_product_attention

    def record(*args, implementation=None, **kwargs):
        calls.append((implementation, kwargs))
        _check_cudnn_arguments(args, kwargs)
        return real(*args, implementation="xla", **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", record)
    q, k, v = qkv(jnp.bfloat16)  # the cuDNN kernel takes 16-bit inputs only
    with monkeypatch.context() as on_gpu:  # as on a GPU, where 'cudnn' is not refused
        on_gpu.setattr(attention.jax, "default_backend", lambda: "gpu")
        got = dot_product_attention(q, k, v, MASKS[name], impl="cudnn")[0]
    ((implementation, kwargs),) = calls
    assert implementation == "cudnn"
    seen = {key: (value.shape if key == "mask" else value.tolist() if key.endswith("lengths") else value)
            for key, value in kwargs.items()}
    assert seen == expected
    want = dot_product_attention(q, k, v, MASKS[name], impl="reference")[0]
    np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), atol=2e-2)


def test_encoder_decoder_with_padding_passes_cudnns_argument_check(monkeypatch):
    """The paper's model in bf16 with cuDNN attention, as on a GPU: every attention call of a padded
    batch (encoder self-attention, decoder self-attention, cross-attention) hands cuDNN arguments
    that JAX's own cuDNN check accepts, and the logits equal those of the XLA backend. (The
    key-padding masks of the encoder and the cross-attention were refused on an H200.)"""
    real = jax.nn.dot_product_attention
    checked = []

    def as_cudnn(*args, implementation=None, **kwargs):
        if implementation == "cudnn":
            _check_cudnn_arguments(args, kwargs)
            checked.append(kwargs.get("mask") is not None)
        return real(*args, implementation="xla", **kwargs)

    config = tj.presets.tiny(dtype="bfloat16", pad_id=0)
    source = jnp.array([[5, 9, 3, 7, 0, 0], [4, 8, 2, 6, 11, 12]])
    target = jnp.array([[2, 6, 8, 0, 0], [2, 3, 9, 10, 4]])
    model = tj.Transformer(config)
    params = model.init(jax.random.key(0), source, target)
    want = model.apply(params, source, target)
    monkeypatch.setattr(jax.nn, "dot_product_attention", as_cudnn)
    monkeypatch.setattr(attention.jax, "default_backend", lambda: "gpu")
    cudnn_model = tj.Transformer(config.replace(attention_impl="cudnn"))
    cudnn_model.apply(params, source, target)  # (a first call also traces an init, to check the params)
    checked.clear()
    got = cudnn_model.apply(params, source, target)
    assert len(checked) == 6 and any(checked)  # 2 encoder, 2 decoder self- and 2 cross-attention calls
    np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), atol=0.05)


def test_fully_masked_rows_are_zero():
    q, k, v = qkv()
    out = chunked_attention(q, k, v, MASKS["segments_with_padding_rows"], q_chunk=4, kv_chunk=8)
    np.testing.assert_array_equal(out[0, 11:], 0.0)  # segment id 0 = padding queries
    out = chunked_attention(q, k, v, MASKS["key_lengths_one_row_empty"], q_chunk=4, kv_chunk=8)
    np.testing.assert_array_equal(out[0], 0.0)
    assert np.all(np.isfinite(out))


def test_dense_bool_mask_and_bfloat16():
    """A plain boolean array works too; bfloat16 inputs give bfloat16 outputs close to float32."""
    q, k, v = qkv()
    mask = masks.combine_masks(masks.causal_mask(L, S), masks.segment_mask(SEG_Q, SEG_KV))
    want = dot_product_attention(q, k, v, mask, impl="reference")[0]
    got = dot_product_attention(q, k, v, mask, impl="chunked")[0]
    np.testing.assert_allclose(got, want, atol=2e-6)
    lo = chunked_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16),
                           mask, q_chunk=4, kv_chunk=8)
    assert lo.dtype == jnp.bfloat16
    np.testing.assert_allclose(lo.astype(jnp.float32), want, atol=5e-2)


def test_float16_runs_on_every_backend_under_jit_and_in_a_model():
    """XLA:CPU has no float16 x float16 -> float32 product, which jax.nn.dot_product_attention's
    'xla' path asks for under jit; a float16 model ('auto' -> 'xla') failed inside XLA."""
    q, k, v = (x.astype(jnp.float16) for x in qkv())
    mask = masks.causal_mask(L, S)
    want = dot_product_attention(q, k, v, mask, impl="reference")[0].astype(jnp.float32)
    for impl in ("xla", "chunked", "auto"):
        got = jax.jit(lambda q, k, v, impl=impl: dot_product_attention(q, k, v, mask, impl=impl)[0])(q, k, v)
        assert got.dtype == jnp.float16
        np.testing.assert_allclose(got.astype(jnp.float32), want, atol=2e-3)
    config = tj.presets.tiny(dtype="float16")
    model = tj.Transformer(config)
    ids = jnp.array([[5, 6, 7, 1]])
    params = model.init(jax.random.key(0), ids, ids)
    logits = jax.jit(model.apply)(params, ids, ids)
    assert np.all(np.isfinite(logits))


@pytest.mark.parametrize("heads", [1, 2])
def test_a_one_token_source_through_a_one_head_bfloat16_encoder(heads):
    """One row, head, query and key in bf16: XLA:CPU made the logits' product elementwise and then
    refused its bf16 x bf16 -> float32 algorithm ('Algorithm not supported by the
    ElementalIrEmitter'), so encoding a one-token source failed; two heads did not."""
    config = tj.presets.tiny(num_heads=heads, dtype="bfloat16", param_dtype="bfloat16", norm="pre")
    model = tj.Transformer(config)
    params = model.init(jax.random.key(0), jnp.ones((1, 4), jnp.int32), jnp.ones((1, 4), jnp.int32))["params"]
    src = jnp.array([[5]])
    cache = jax.jit(lambda p, s: model.apply({"params": p}, s, 8, method="init_cache"))(params, src)
    assert all(np.all(np.isfinite(np.asarray(x, np.float32))) for x in jax.tree.leaves(cache)
               if jnp.issubdtype(x.dtype, jnp.floating))
    wide = jax.tree.map(lambda x: x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x, params)
    model32 = tj.Transformer(config.replace(dtype="float32", param_dtype="float32"))
    want = jax.jit(lambda p, s: model32.apply({"params": p}, s, method="encode"))(wide, src)
    got = jax.jit(lambda p, s: model.apply({"params": p}, s, method="encode"))(params, src)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=0.1)


@pytest.mark.parametrize("shape", [(B, 1, 1, S), (B, H, 1, S)])
def test_dense_masks_that_broadcast_over_queries(shape):
    """`masks.key_padding_mask` gives [B, 1, 1, S], which the dense backends broadcast; the chunked
    one cut a [cq, ck] tile out of its length-1 query axis and failed (so 'auto' crashed once a
    sequence passed CHUNKED_THRESHOLD). Row 0 sees no key at all."""
    mask = jax.random.bernoulli(jax.random.key(3), 0.6, shape).at[0].set(False)
    q, k, v = qkv()

    def both(fn):
        return jax.jit(lambda q, k, v: (fn(q, k, v), jax.grad(loss(fn), (0, 1, 2))(q, k, v)))(q, k, v)

    want, want_grads = both(lambda q, k, v: dot_product_attention(q, k, v, mask, impl="reference")[0])
    for fn in (lambda q, k, v: chunked_attention(q, k, v, mask, q_chunk=4, kv_chunk=8),
               lambda q, k, v: dot_product_attention(q, k, v, mask, impl="chunked")[0]):
        got, got_grads = both(fn)
        np.testing.assert_allclose(got, want, atol=2e-6)
        np.testing.assert_array_equal(got[0], 0.0)
        for g, w in zip(got_grads, want_grads, strict=True):
            np.testing.assert_allclose(g, w, atol=2e-5)


def test_specs_materialize_to_the_literal_masks():
    seg = jnp.array([[1, 1, 2, 2, 0]])
    np.testing.assert_array_equal(
        masks.causal_spec(5, seg).materialize(),
        masks.combine_masks(masks.causal_mask(5), masks.segment_mask(seg, seg)))
    np.testing.assert_array_equal(masks.cache_spec(jnp.array([2, 0]), 2, 4).materialize(),
                                  masks.cache_mask(jnp.array([2, 0]), 2, 4))
    valid = seg != 0
    np.testing.assert_array_equal(masks.bidirectional_spec(5, 5, kv_valid=valid).materialize(),
                                  masks.key_padding_mask(valid))


def test_auto_picks_chunked_for_long_sequences_and_flash_explains_itself():
    if jax.default_backend() != "cpu":
        pytest.skip("the choices checked here are the CPU ones")
    assert resolve_impl("auto", q_length=1024, kv_length=1024) == "xla"
    assert resolve_impl("auto", q_length=16384, kv_length=16384) == "chunked"
    assert resolve_impl("auto", need_weights=True, q_length=16384, kv_length=16384) == "reference"
    with pytest.raises(NotImplementedError, match="chunked"):
        dot_product_attention(*qkv(), impl="flash")
    # a misspelt name is refused with the choices, also where the weights would pick 'reference'
    for weights in (False, True):
        with pytest.raises(ValueError, match=r"attention impl 'flsh' is not one of \['auto', 'reference'"):
            dot_product_attention(*qkv(), impl="flsh", return_weights=weights)


def test_auto_on_gpu_takes_cudnn_only_for_inputs_it_supports(monkeypatch):
    """cuDNN has no float32 kernel: a float32 model (the default dtype) must get XLA on a GPU, and
    an explicit 'cudnn' with float32 inputs must say which setting to change."""
    monkeypatch.setattr(attention.jax, "default_backend", lambda: "gpu")
    assert resolve_impl("auto", q_length=256, kv_length=256, dtype=jnp.bfloat16, head_dim=64) == "cudnn"
    assert resolve_impl("auto", q_length=256, kv_length=256, dtype=jnp.float16, head_dim=128) == "cudnn"
    assert resolve_impl("auto", q_length=256, kv_length=256, dtype=jnp.float32, head_dim=64) == "xla"
    assert resolve_impl("auto", q_length=256, kv_length=256, dtype=jnp.bfloat16, head_dim=60) == "xla"
    assert resolve_impl("auto", q_length=256, kv_length=256, dtype=jnp.bfloat16, head_dim=256) == "xla"
    assert resolve_impl("auto", q_length=16384, kv_length=16384, dtype=jnp.float32,
                        head_dim=64) == "chunked"
    with pytest.raises(NotImplementedError, match="ModelConfig.dtype='bfloat16'"):
        dot_product_attention(*qkv(), impl="cudnn")


def test_cudnn_off_a_gpu_is_named_before_any_other_advice():
    """On a CPU 'cudnn' said to switch a float32 model to bfloat16, after which JAX failed deep
    inside ("cuDNN is not detected"): the missing GPU is the problem to name, in either dtype."""
    for dtype in (jnp.float32, jnp.bfloat16):
        with pytest.raises(NotImplementedError, match="'cudnn' needs an NVIDIA GPU; this is 'cpu'"):
            dot_product_attention(*qkv(dtype), impl="cudnn")


def test_auto_on_tpu_takes_flash_only_for_masks_and_lengths_it_supports(monkeypatch):
    """The Pallas kernel takes causal (no offset) and segment/key-padding masks on lengths that are
    multiples of 128: with a KV cache's mask (key lengths, a causal offset) 'auto' must not pick it
    ('flash' would raise), nor for a length off the block size."""
    monkeypatch.setattr(attention.jax, "default_backend", lambda: "tpu")
    n = 256
    pick = lambda mask, lq=n, lk=n: resolve_impl("auto", q_length=lq, kv_length=lk, mask=mask)
    assert pick(None) == "flash"
    assert pick(AttentionMask(n, n, causal=True)) == "flash"
    assert pick(AttentionMask(n, n, kv_valid=jnp.ones((2, n), bool))) == "flash"
    assert pick(AttentionMask(n, n, kv_lengths=jnp.array([3, 200]))) == "xla"
    assert pick(AttentionMask(n, n, causal=True, causal_offset=jnp.array([0, 5]))) == "xla"
    assert pick(AttentionMask(n, n, causal=True, kv_limit=100)) == "xla"
    assert pick(jnp.ones((2, 1, n, n), bool)) == "xla"  # a dense array
    assert pick(None, lq=200) == "xla"
    assert pick(AttentionMask(16384, 16384, kv_lengths=jnp.array([3, 200])), 16384, 16384) == "chunked"


def test_pallas_tpu_flash_in_interpret_mode():
    """The TPU kernel behind 'flash' (causal + segment ids, GQA heads repeated), run by the Pallas
    interpreter on CPU, against the reference."""
    try:
        from jax.experimental.pallas import tpu as pltpu
        from jax.experimental.pallas.ops.tpu import flash_attention  # noqa: F401
    except ImportError as e:
        pytest.skip(f"Pallas TPU flash attention not importable: {e}")
    n = 128  # the kernel's smallest block
    q, k, v = qkv(heads=(4, 2), lengths=(n, n))  # two K/V heads: repeated, not tiled
    seg = jnp.concatenate([jnp.ones((B, 96), jnp.int32), jnp.full((B, 32), 2, jnp.int32)], axis=1)
    spec = masks.causal_spec(n, seg)
    # Only an interpreter that cannot run at all is a skip; an error from our call into the kernel
    # (a renamed argument, a wrong SegmentIds) must fail the test, not hide as a skip.
    try:
        with pltpu.force_tpu_interpret_mode():
            from jax.experimental import pallas as pl

            def copy(x_ref, o_ref):
                o_ref[...] = x_ref[...]

            jax.block_until_ready(pl.pallas_call(copy, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32))(
                jnp.zeros((8, 128), jnp.float32)))
    except Exception as e:  # noqa: BLE001 - the interpreter itself is unavailable here
        pytest.skip(f"Pallas TPU interpret mode does not run here: {type(e).__name__}: {e}")
    # Each interpreted call is waited for before anything else is dispatched: the interpreter's
    # callbacks run JAX operations of their own on the device's queue, and an operation queued
    # behind the interpreted call meanwhile left both waiting (the test hung, now and then).
    with pltpu.force_tpu_interpret_mode():
        got = jax.block_until_ready(_pallas_tpu_flash(q, k, v, spec))
    want = dot_product_attention(q, k, v, spec.materialize(), impl="reference")[0]
    np.testing.assert_allclose(got, want, atol=2e-5)
    # Queries that see no key get zeros, as on every backend; the kernel gave them an average of
    # values (up to 0.27 off): causal queries before a left-padded row's first real key, and a packed
    # target segment whose id no source key carries (cross-attention, L != S).
    left_padded = AttentionMask(n, n, causal=True, kv_valid=jnp.arange(n)[None] >= jnp.array([[40], [0]]))
    q2, k2, v2 = qkv(heads=(4, 2), lengths=(n, 2 * n))
    q_seg = jnp.ones((B, n), jnp.int32).at[:, 64:].set(2)
    kv_seg = jnp.ones((B, 2 * n), jnp.int32).at[:, 200:].set(0)
    cross = AttentionMask(n, 2 * n, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    # One row of ids for every row, as the other backends broadcast it (a vmap size error here)
    one_row = AttentionMask(n, 2 * n, causal=True, kv_valid=jnp.arange(2 * n)[None] >= 10)
    for mask, (q_, k_, v_) in ((left_padded, (q, k, v)), (cross, (q2, k2, v2)), (one_row, (q2, k2, v2))):
        assert _pallas_tpu_supports(mask, *mask.materialize().shape[2:])
        with pltpu.force_tpu_interpret_mode():
            got = jax.block_until_ready(_pallas_tpu_flash(q_, k_, v_, mask))
        want = dot_product_attention(q_, k_, v_, mask.materialize(), impl="reference")[0]
        assert (np.abs(np.asarray(want)).max(axis=(2, 3)) == 0).any()  # some rows see no key
        np.testing.assert_allclose(got, want, atol=2e-5)


def test_queries_that_see_a_key_equal_the_mask_any_over_keys():
    """The rows the Pallas path zeroes, from the ids alone, against the materialised mask."""
    rng = np.random.default_rng(0)
    for trial in range(24):
        L, S = ((9, 9), (5, 11), (11, 1))[trial % 3]
        causal = bool(trial % 2)
        q_ids = jnp.asarray(rng.integers(0, 4, size=(3, L)), jnp.int32)
        kv_ids = jnp.asarray(rng.integers(0, 4, size=(3, S)), jnp.int32)
        mask = AttentionMask(int(L), int(S), causal=causal, q_segment_ids=q_ids, kv_segment_ids=kv_ids)
        want = np.asarray(mask.materialize()).any(axis=-1)[:, 0]
        np.testing.assert_array_equal(_queries_that_see_a_key(q_ids, kv_ids, causal), want)


# ----------------------------------------------------------------------------- full models
def config(**overrides):
    base = dict(vocab_size=37, d_model=30, num_heads=6, num_kv_heads=2, head_dim=4, d_ff=13,
                num_encoder_layers=1, num_decoder_layers=2, dropout_rate=0.0, max_len=64,
                norm="pre", position="rope")
    return tj.ModelConfig(**{**base, **overrides})


def test_models_with_chunked_attention_equal_reference():
    src = jax.random.randint(jax.random.key(1), (2, 11), 3, 37).at[1, 7:].set(0)  # padded source
    tgt = jax.random.randint(jax.random.key(2), (2, 7), 3, 37)
    seg = jnp.array([[1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 1]])
    pos = jnp.array([[0, 1, 2, 0, 1, 2, 0], list(range(7))])
    ref_cfg, chunk_cfg = config(attention_impl="reference"), config(attention_impl="chunked")
    ed = tj.Transformer(ref_cfg)
    params = jax.jit(ed.init)(jax.random.key(0), src, tgt)["params"]
    want = jax.jit(ed.apply)({"params": params}, src, tgt)
    got = jax.jit(tj.Transformer(chunk_cfg).apply)({"params": params}, src, tgt)
    np.testing.assert_allclose(got, want, atol=1e-5)

    lm, lm_chunked = tj.TransformerLM(ref_cfg), tj.TransformerLM(chunk_cfg)
    lm_params = jax.jit(lm.init)(jax.random.key(0), tgt)["params"]
    apply = jax.jit(lambda m, p, t, s, q: m.apply({"params": p}, t, segment_ids=s, positions=q),
                    static_argnums=0)
    np.testing.assert_allclose(apply(lm_chunked, lm_params, tgt, seg, pos),
                               apply(lm, lm_params, tgt, seg, pos), atol=1e-5)

    # KV-cache decoding with chunked attention equals the full forward pass.
    step = jax.jit(lambda p, t, c: lm_chunked.apply({"params": p}, t, cache=c))
    cache = tj.init_cache(chunk_cfg, 2, 10)
    logits, cache = step(lm_params, tgt[:, :4], cache)
    logits = [logits]
    for i in range(4, 7):
        out, cache = step(lm_params, tgt[:, i : i + 1], cache)
        logits.append(out)
    full = apply(lm, lm_params, tgt, None, None)
    np.testing.assert_allclose(jnp.concatenate(logits, axis=1), full, atol=1e-5)
