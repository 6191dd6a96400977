"""`ModelConfig.kernel_layout='out_in'` (projection kernels stored output axes first) and the product
behind it, `matmul.contract_transposed`: the same numbers as the default layout, for values,
gradients, cached decoding and sharded models; conversion both ways; the weights-first product XLA:CPU
streams faster in decoding steps; and the float32 KV cache that bf16 decoding gets on CPU."""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import transformer_jax as tj
from transformer_jax import parallel
from transformer_jax.config import ConfigError
from transformer_jax.decoding import generate
from transformer_jax.decoding.model_steps import LMStep
from transformer_jax.modeling import matmul, native
from transformer_jax.modeling.attention import dot_product_attention
from transformer_jax.params import convert_params, param_shapes

# Distinct primes, so that a swapped axis cannot pass.
IN, OUT = (5, 7), (11, 13)


def _close(a, b, tol):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, atol=tol * np.abs(b).max(), rtol=0)


@pytest.mark.parametrize("rows", [1, 8, 96])  # weights-first (<= 32); bf16: its own backward pass
@pytest.mark.parametrize("n_in", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_contract_transposed_equals_einsum_with_gradients(dtype, n_in, rows):
    kx, kw = jax.random.split(jax.random.key(rows))
    in_shape = IN[-n_in:]
    x = jax.random.normal(kx, (rows,) + in_shape).astype(dtype)
    w_t = (jax.random.normal(kw, OUT + in_shape) * 0.3).astype(dtype)  # [out..., in...]
    spec = "rab,opab->rop" if n_in == 2 else "rb,opb->rop"
    plain = lambda x, w: jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
    mine = lambda x, w: matmul.contract_transposed(x, w, n_in)
    out = jax.jit(mine)(x, w_t)
    assert out.dtype == jnp.float32 and out.shape == (rows,) + OUT
    _close(out, jax.jit(plain)(x, w_t), 1e-6)
    loss = lambda f: (lambda x, w: jnp.sum(jnp.sin(f(x, w))))
    grads = jax.jit(jax.grad(loss(mine), argnums=(0, 1)))(x, w_t)
    reference = jax.jit(jax.grad(loss(plain), argnums=(0, 1)))(x, w_t)
    for g, r in zip(grads, reference):
        assert g.dtype == r.dtype == jnp.dtype(dtype)
        _close(g, r, 1e-5 if dtype == "float32" else 2e-2)


@pytest.mark.parametrize("rows", [1, 8, 40])  # decoding steps; a prefill's rows
@pytest.mark.parametrize("n_in", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_contract_packed_equals_einsum_with_gradients(dtype, n_in, rows):
    # A packed weight's product, on the kernel (bf16 on a CPU with it) or through the tiles' view,
    # equals the out_in weight's; its gradient is the out_in gradient in the packed order.
    kx, kw = jax.random.split(jax.random.key(rows))
    out, in_ = (4, 8), ((2, 6) if n_in == 2 else (12,))
    x = jax.random.normal(kx, (rows,) + in_).astype(dtype)
    w_t = (jax.random.normal(kw, out + in_) * 0.3).astype(dtype)
    w_p = native.pack_kernel(w_t.reshape(32, -1)).reshape(w_t.shape)
    loss = lambda f: (lambda x, w: jnp.sum(jnp.sin(f(x, w))))  # noqa: E731
    mine = lambda x, w: matmul.contract_packed(x, w, n_in, cpu_kernels="auto")  # noqa: E731
    plain = lambda x, w: matmul.contract_transposed(x, w, n_in)  # noqa: E731
    tol = 1e-5 if dtype == "float32" else 2e-2
    _close(jax.jit(mine)(x, w_p), jax.jit(plain)(x, w_t), 1e-6 if dtype == "float32" else 1e-2)
    gx, gw = jax.jit(jax.grad(loss(mine), argnums=(0, 1)))(x, w_p)
    rx, rw = jax.jit(jax.grad(loss(plain), argnums=(0, 1)))(x, w_t)
    _close(gx, rx, tol)
    _close(gw, native.pack_kernel(rw.reshape(32, -1)).reshape(rw.shape), tol)
    with pytest.raises(ValueError, match=r"does not end in w_p's input axes"):
        matmul.contract_packed(jnp.ones((3, 5), dtype), w_p, n_in)
    with pytest.raises(TypeError, match="contract_packed: x is"):
        matmul.contract_packed(x.astype(jnp.float16), w_p, n_in)


def test_contract_transposed_rejects_mismatched_inputs():
    x = jnp.ones((3, 7))
    with pytest.raises(ValueError, match=r"does not end in w_t's input axes \(5,\)"):
        matmul.contract_transposed(x, jnp.ones((11, 5)))
    with pytest.raises(TypeError, match="x is float32 but w_t is bfloat16"):
        matmul.contract_transposed(x, jnp.ones((11, 7), jnp.bfloat16))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="about XLA:CPU's matmul kernels")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decoding_steps_multiply_weights_first_on_cpu(dtype):
    # A decoding step's product runs as w [out, in] x^T -> [out, rows], the form XLA:CPU streams
    # fastest, in the input dtype; with many rows it stays x w^T -> [rows, out].
    w_t = jnp.ones((143, 64), dtype)
    for rows, want in ((8, "143,8"), (1, "143,2" if dtype == "bfloat16" else "143,1"),
                       (48, "48,143")):
        hlo = jax.jit(matmul.contract_transposed).lower(jnp.ones((rows, 64), dtype), w_t)
        hlo = hlo.compile().as_text()
        types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo))
        dots = re.findall(r"= f32\[([\d,]+)\]\{[\d,]+\} dot\(%([\w.\-]+), %([\w.\-]+)\)", hlo)
        assert [shape for shape, _, _ in dots] == [want], (rows, dots)
        short = "bf16" if dtype == "bfloat16" else "f32"
        assert {(types[a], types[b]) for _, a, b in dots} == {(short, short)}


def _lm(**overrides):
    return tj.presets.tiny(**{"num_encoder_layers": 0, "dropout_rate": 0.0, **overrides})


VARIANTS = {
    "lm": dict(),
    "lm_untied_scanned": dict(tie_output=False, scan_layers=True, norm="pre"),
    "encoder_decoder": dict(num_encoder_layers=2),
    "lm_gqa_rope": dict(num_kv_heads=1, position="rope", activation="swiglu"),
}


def _model_and_params(config, batch=2, length=9):
    model = tj.params.build_model(config)
    tokens = jax.random.randint(jax.random.key(1), (batch, length), 3, config.vocab_size)
    inputs = (tokens, tokens) if config.num_encoder_layers else (tokens,)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), *inputs))["params"]
    return model, params, inputs


@pytest.mark.parametrize("layout", ["out_in", "packed"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_out_in_layout_computes_the_same_model(variant, layout):
    config = _lm(**VARIANTS[variant])
    model, params, inputs = _model_and_params(config)
    target = config.replace(kernel_layout=layout)
    converted = convert_params(params, config, target)
    shapes = jax.tree.map(lambda s: s.shape, param_shapes(target))
    assert jax.tree.map(lambda a: a.shape, converted) == shapes
    query = lambda p: p["decoder"]["layers" if config.scan_layers else "layer_0"]["self_attention"]
    in_out, out_in = query(params)["out"]["kernel"], query(converted)["out"]["kernel"]
    # [(layers,) H, K, D] -> [(layers,) D, H, K]: the layer axis stays first.
    assert out_in.shape == in_out.shape[:-3] + in_out.shape[-1:] + in_out.shape[-3:-1]
    expected = jax.jit(model.apply)({"params": params}, *inputs)
    got = jax.jit(tj.params.build_model(target).apply)({"params": converted}, *inputs)
    _close(got, expected, 1e-5)
    back = convert_params(converted, target, config)
    assert all(bool(jnp.array_equal(a, b)) for a, b in
               zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True))
    same = convert_params(params, config, config.replace(dtype="bfloat16"))  # compute dtype only
    assert all(a is b for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(params), strict=True))
    as_bf16 = convert_params(params, config, target.replace(param_dtype="bfloat16"))
    assert {x.dtype for x in jax.tree.leaves(as_bf16)} == {jnp.dtype(jnp.bfloat16)}


def test_out_in_layout_trains_from_its_own_initialisation():
    # Initialised directly in the 'out_in' layout, the model trains (gradients reach every kernel)
    # and its Glorot initialisation keeps the scale of the 'in_out' one.
    config = _lm(kernel_layout="out_in", tie_output=False)
    model, params, (tokens,) = _model_and_params(config)
    ref = _model_and_params(config.replace(kernel_layout="in_out"))[1]
    kernels = lambda tree: [x for path, x in jax.tree_util.tree_leaves_with_path(tree)
                            if "kernel" in jax.tree_util.keystr(path)]
    assert len(kernels(params)) == 2 * 6 + 1  # q, k, v, out, wi, wo per layer; the output layer
    for a, b in zip(kernels(params), kernels(ref), strict=True):
        assert 0.8 < float(jnp.std(a)) / float(jnp.std(b)) < 1.25

    def loss(p):
        logits = model.apply({"params": p}, tokens)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], -1))

    grads = jax.jit(jax.grad(loss))(params)
    assert all(float(jnp.abs(g).max()) > 0 for g in kernels(grads))


def test_convert_params_names_what_does_not_match():
    config = _lm()
    _, params, _ = _model_and_params(config)
    target = config.replace(kernel_layout="out_in")
    converted = convert_params(params, config, target)
    with pytest.raises(ValueError, match=r"params\['decoder'\]\['layer_0'\]\['feed_forward'\]\['wi'\]"
                                         r"\['kernel'\] has shape \(64, 32\), but the source "
                                         r"config \(kernel_layout='in_out', fused_qkv=False, "
                                         r"scan_layers=False, 64 vocabulary rows\) has \(32, 64\); "
                                         r"they are the parameters of kernel_layout='out_in' \(or "
                                         r"'packed', the same shapes\), the target's: converted already\?"):
        convert_params(converted, config, target)  # already converted
    # The layout the parameters do have: one field away from the source config given, or the target's
    scanned = config.replace(scan_layers=True)
    with pytest.raises(ValueError, match=r"missing .*unexpected .*the parameters of scan_layers=True: give "
                                         r"that as the source config"):
        convert_params(convert_params(params, config, scanned), config, target)
    both = scanned.replace(kernel_layout="out_in")
    with pytest.raises(ValueError, match=r"they are in the target's layout already: converted before\?"):
        convert_params(convert_params(params, config, both), config, both)
    with pytest.raises(ValueError, match=r"also differ in \['d_ff', 'norm'\]"):
        convert_params(params, config, target.replace(norm="pre", d_ff=32))
    del converted["decoder"]["layer_1"]
    with pytest.raises(ValueError, match=r"missing \[\"\['decoder'\]\['layer_1'\]"):
        convert_params(converted, target, config)
    with pytest.raises(ConfigError, match=r"kernel_layout='out-in': must be one of"):
        config.replace(kernel_layout="out-in")


def _cached_logits(config, params, tokens, cache_dtype=None):
    """Prefill all but the last 3 tokens, then one token per call: logits of every position."""
    model = tj.TransformerLM(config)
    batch, length = tokens.shape
    cache = tj.init_cache(config, batch, length, dtype=cache_dtype)
    step = jax.jit(lambda p, t, c: model.apply({"params": p}, t, cache=c))
    logits, cache = step(params, tokens[:, :-3], cache)
    out = [logits]
    for i in range(length - 3, length):
        logits, cache = step(params, tokens[:, i:i + 1], cache)
        out.append(logits)
    return jnp.concatenate(out, axis=1), cache


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_out_in_cached_decoding_follows_the_full_forward(dtype):
    config = _lm(dtype=dtype, param_dtype=dtype)
    _, params, _ = _model_and_params(config)
    target = config.replace(kernel_layout="out_in")
    params = convert_params(params, config, target)
    tokens = jax.random.randint(jax.random.key(3), (8, 12), 3, config.vocab_size)
    full = jax.jit(tj.TransformerLM(target).apply)({"params": params}, tokens)
    cached, cache = _cached_logits(target, params, tokens)
    if dtype == "bfloat16" and jax.default_backend() == "cpu":  # see test_bf16_cache_on_cpu...
        want = jnp.bfloat16 if native.use_native(target.cpu_kernels) else jnp.float32
        assert cache.layers[0]["k"].dtype == want
    _close(cached, full, 1e-5 if dtype == "float32" else 3e-2)


def assert_same_greedy_generation(config, params, target):
    """10 greedy tokens after 8 ragged prompts: the same with `params` converted to `target`."""
    prompts = jax.random.randint(jax.random.key(4), (8, 6), 3, config.vocab_size)
    lengths = jnp.array([6, 3, 5, 6, 1, 2, 6, 4], jnp.int32)

    def run(cfg, p):
        cache = tj.init_cache(cfg, 8, 6 + 10)
        return generate(LMStep(tj.TransformerLM(cfg)), p, cache, prompts, lengths,
                        max_new_tokens=10, eos_id=None)

    a = run(config, params)
    b = run(target, convert_params(params, config, target))
    np.testing.assert_array_equal(b.tokens, a.tokens)
    np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-4)


def test_greedy_generation_is_the_same_in_both_layouts():
    config = _lm()
    _, params, _ = _model_and_params(config)
    assert_same_greedy_generation(config, params, config.replace(kernel_layout="out_in"))
    assert_same_greedy_generation(config, params, config.replace(kernel_layout="packed"))


@pytest.mark.parametrize("variant", [dict(), dict(num_encoder_layers=2, scan_layers=True),
                                     dict(fused_qkv=True, tie_output=False, vocab_size=1000)])
def test_packed_layout_stores_out_in_values_in_tiles(variant):
    # 'packed' holds out_in's values in out_in's shapes, each kernel's [out, in] matrix (and each
    # token table) in tiles of 16 rows x 2 inputs, three to a group; a vocabulary of no multiple of
    # 16 keeps its last rows as they are. Lookups of every token, and the initialisation, agree with out_in's.
    config = _lm(**variant)
    _, params, _ = _model_and_params(config)
    out_in, packed = config.replace(kernel_layout="out_in"), config.replace(kernel_layout="packed")
    a, b = convert_params(params, config, out_in), convert_params(params, config, packed)
    assert jax.tree.map(lambda x: x.shape, a) == jax.tree.map(lambda x: x.shape, b)
    table_a, table_b = a["embed"]["embedding"], b["embed"]["embedding"]
    np.testing.assert_array_equal(native.unpack_kernel(table_b), table_a)
    rows = native.packed_rows(*table_a.shape)
    assert rows == table_a.shape[0] // 16 * 16 and (rows < table_a.shape[0]) == (config.vocab_size == 1000)
    layer = (lambda p: p["decoder"]["layers"]) if config.scan_layers else (lambda p: p["decoder"]["layer_0"])
    wi_a, wi_b = layer(a)["feed_forward"]["wi"]["kernel"], layer(b)["feed_forward"]["wi"]["kernel"]
    unpack = jax.vmap(native.unpack_kernel) if config.scan_layers else native.unpack_kernel
    np.testing.assert_array_equal(unpack(wi_b), wi_a)
    assert not np.array_equal(wi_b, wi_a)
    embed = lambda cfg, p: tj.params.build_model(cfg).apply(  # noqa: E731
        {"params": p}, jnp.arange(config.vocab_size)[None], method=lambda m, t: m.embed(t))
    np.testing.assert_array_equal(embed(packed, b), embed(out_in, a))
    init_a = _model_and_params(out_in)[1]
    init_b = _model_and_params(packed)[1]
    back = convert_params(init_b, packed, out_in)
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(init_a), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("vocab,width", [(50, 8), (50, 7), (16, 4), (3, 6)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_table_lookups_return_every_row(vocab, width, dtype):
    # Rows in tiles, rows after the tiles, and an odd width (stored as it is): every lookup is the row.
    from transformer_jax.modeling.layers import Embed

    table = jnp.arange(vocab * width, dtype=jnp.float32).reshape(vocab, width).astype(dtype)
    embed = Embed(vocab, width, dtype=dtype, param_dtype=dtype, packed=True)
    ids = jnp.arange(vocab)[::-1].reshape(1, vocab)
    got = embed.apply({"params": {"embedding": native.pack_kernel(table)}}, ids)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(table[::-1], np.float32))


@pytest.mark.skipif(not native.available(), reason="no native CPU kernels here")
@pytest.mark.parametrize("variant", ["plain", "fused_qkv_untied"])
def test_packed_cached_decoding_follows_the_full_forward_on_the_kernel(variant):
    # fused_qkv_untied: one [3 H K, D] product a layer for Q/K/V (three output axes, flattened for
    # the kernel) and an untied head of 1000 rows (8 after the tiles).
    extra = dict(fused_qkv=True, tie_output=False, vocab_size=1000) if variant != "plain" else {}
    config = _lm(dtype="bfloat16", param_dtype="bfloat16", **extra)
    _, params, _ = _model_and_params(config)
    target = config.replace(kernel_layout="packed", cpu_kernels="native")
    params = convert_params(params, config, target)
    tokens = jax.random.randint(jax.random.key(3), (8, 12), 3, config.vocab_size)
    full = jax.jit(tj.TransformerLM(target).apply)({"params": params}, tokens)
    cached, _ = _cached_logits(target, params, tokens)
    _close(cached, full, 3e-2)
    step = jax.jit(lambda p, t, c: tj.TransformerLM(target).apply({"params": p}, t, cache=c))
    hlo = step.lower(params, jnp.ones((8, 1), jnp.int32), tj.init_cache(target, 8, 16)).compile().as_text()
    # Every weight product of the step on the packed kernel: 6 a layer (4 with fused Q/K/V), each
    # with its bias (and wi with its activation) in the same call, then the output head's product.
    assert hlo.count('custom_call_target="transformer_jax_packed_dense"') == 2 * (4 if extra else 6)
    assert hlo.count('custom_call_target="transformer_jax_packed_matmul"') == 1
    assert "transformer_jax_rows_matmul" not in hlo and "transformer_jax_bias_activation" not in hlo


@pytest.mark.parametrize("impl", ["xla", "reference", "chunked"])
def test_a_cache_in_another_dtype_is_read_in_the_wider_one(impl):
    # float32 queries with a bf16 cache: K and V are widened; the queries are not rounded to bf16.
    q = jax.random.normal(jax.random.key(0), (2, 1, 4, 8))
    k, v = (jax.random.normal(jax.random.key(i), (2, 4, 16, 8)).astype(jnp.bfloat16) for i in (1, 2))
    mask = jnp.ones((2, 1, 1, 16), bool)
    out, _ = dot_product_attention(q, k, v, mask, impl=impl, kv_layout="BNSK")
    wide, _ = dot_product_attention(q, k.astype(jnp.float32), v.astype(jnp.float32), mask,
                                    impl=impl, kv_layout="BNSK")
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, wide, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", ["xla", "reference", "chunked"])
def test_bf16_queries_read_a_float32_cache_in_float32(impl):
    # bf16 queries with a float32 cache (what a bf16 model decodes with on CPU): the arithmetic is
    # float32, against softmax(QK^T / sqrt(d_k)) V in float64; K and V are not rounded to bf16.
    q = jax.random.normal(jax.random.key(0), (2, 1, 4, 8)).astype(jnp.bfloat16)
    k, v = (jax.random.normal(jax.random.key(i), (2, 4, 16, 8)) for i in (1, 2))  # [B, N, S, K]
    mask = jnp.ones((2, 1, 1, 16), bool)
    out, _ = dot_product_attention(q, k, v, mask, impl=impl, kv_layout="BNSK")
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q.astype(jnp.float32), k, v))
    logits = np.einsum("blhk,bhsk->bhls", q64, k64) / np.sqrt(8)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, np.einsum("bhls,bhsk->blhk", probs, v64), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cpu_kernels", ["auto", "xla"])
def test_bf16_cache_on_cpu_is_float32_unless_the_cpu_kernels_write_it_with_the_same_results(cpu_kernels):
    config = _lm(dtype="bfloat16", cpu_kernels=cpu_kernels)
    on_cpu = jax.default_backend() == "cpu"
    want = jnp.float32 if on_cpu and not native.use_native(cpu_kernels) else jnp.bfloat16
    assert tj.init_cache(config, 2, 8).layers[0]["k"].dtype == want
    _, params, _ = _model_and_params(config)
    tokens = jax.random.randint(jax.random.key(5), (8, 12), 3, config.vocab_size)
    f32, _ = _cached_logits(config, params, tokens, cache_dtype=jnp.float32)
    bf16, cache = _cached_logits(config, params, tokens, cache_dtype=jnp.bfloat16)
    assert cache.layers[0]["k"].dtype == jnp.bfloat16
    if on_cpu and native.use_native(cpu_kernels):
        # The keys and values are bf16 numbers either way, and the kernel widens them exactly.
        np.testing.assert_array_equal(f32, bf16)
    else:  # XLA computes the attention in the cache's dtype
        _close(f32, bf16, 2e-2)


def on_a_mesh(config, *path):
    """(logits on one device, the same on a 2x2x2 data/FSDP/tensor mesh, the mesh's partition spec of
    the parameter at `path` under layer_0) for an LM of `config`."""
    model, params, (tokens,) = _model_and_params(config, batch=4, length=16)
    expected = jax.jit(model.apply)({"params": params}, tokens)
    mesh = parallel.create_mesh(2, 2, 2)
    abstract = jax.eval_shape(lambda k: model.init(k, tokens)["params"], jax.random.key(0))
    with jax.set_mesh(mesh), nn.logical_axis_rules(parallel.DEFAULT_RULES):
        shardings = parallel.logical_to_sharding(abstract, mesh)
        spec = functools.reduce(lambda tree, key: tree[key], path, shardings["decoder"]["layer_0"]).spec
        sharded = jax.device_put(params, shardings)
        got = jax.jit(model.apply)({"params": sharded}, jax.device_put(tokens, parallel.batch_sharding(mesh)))
    return expected, got, spec


@pytest.mark.parametrize("layout", ["out_in", "packed"])
def test_out_in_and_packed_layouts_on_a_mesh_equal_one_device(layout):
    expected, got, out_spec = on_a_mesh(_lm(kernel_layout=layout), "feed_forward", "wi", "kernel")
    # wi is [mlp, embed] in these layouts: its first axis is the tensor-parallel one.
    assert out_spec[0] is not None and "tensor" in str(out_spec[0])
    _close(got, expected, 1e-5)
    # The query projection too ([heads, kv, embed]: heads over tensor, embed over fsdp), where
    # XLA's partitioner once computed the product over the packed view wrongly (by up to 2.6).
    _, _, q_spec = on_a_mesh(_lm(kernel_layout=layout), "self_attention", "query", "kernel")
    assert "tensor" in str(q_spec[0]) and "fsdp" in str(q_spec[-1]), q_spec


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="about XLA:CPU's matmul kernels")
@pytest.mark.parametrize("variant", [dict(), dict(activation="swiglu", norm_type="rmsnorm",
                                                  tie_output=False)])
def test_bf16_out_in_decoding_step_multiplies_bf16_weights_first(variant):
    # In a whole decoding step (XLA may move transposes across the layers), every weight product
    # is still a bf16 x bf16 product with the weights first: [out, in] x [8, in] -> [out, 8]. Only
    # the attention products over the (float32) cache are float32.
    config = _lm(dtype="bfloat16", param_dtype="bfloat16", kernel_layout="out_in", cpu_kernels="xla",
                 **variant)
    model, params, _ = _model_and_params(config)
    cache = tj.init_cache(config, 8, 16)
    step = jax.jit(lambda p, t, c: model.apply({"params": p}, t, cache=c))
    hlo = step.lower(params, jnp.ones((8, 1), jnp.int32), cache).compile().as_text()
    assert "custom_call_target" not in hlo or "transformer_jax" not in hlo
    shapes = dict(re.findall(r"%([\w.\-]+) = (\w+\[[\d,]*\])", hlo))
    dots = re.findall(r"= (\w+)\[([\d,]+)\]\{[\d,]+\} dot\(%([\w.\-]+), %([\w.\-]+)\)", hlo)
    weight_dots = [(shapes[a], shapes[b], out) for _, out, a, b in dots if out.count(",") == 1]
    attention_dots = [d for d in dots if d[1].count(",") == 3]
    assert len(weight_dots) == 2 * (4 + (3 if variant else 2)) + 1  # per layer; the output layer
    for lhs, rhs, out in weight_dots:
        assert lhs.startswith("bf16[") and rhs in ("bf16[8,32]", "bf16[8,64]"), (lhs, rhs)
        assert out.endswith(",8") and lhs[5:-1].split(",")[0] == out.split(",")[0]
    assert len(attention_dots) == 4 and len(dots) == len(weight_dots) + 4
    assert all(d[0] == "f32" for d in attention_dots)


def test_packing_keeps_each_kernels_sharding():
    # Packing reorders elements within a kernel of the same shape: the packed kernel keeps the
    # sharding the kernel had (here wi split by its output rows over 4 devices, or replicated).
    config = _lm(dtype="bfloat16", param_dtype="bfloat16", kernel_layout="out_in")
    _, params, _ = _model_and_params(config)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("tensor",))
    P = jax.sharding.PartitionSpec
    rows = jax.sharding.NamedSharding(mesh, P("tensor", None))
    params = jax.tree.map(lambda a: jax.device_put(a, jax.sharding.NamedSharding(mesh, P())), params)
    layer = params["decoder"]["layer_0"]["feed_forward"]["wi"]
    layer["kernel"] = jax.device_put(layer["kernel"], rows)
    packed = convert_params(params, config, config.replace(kernel_layout="packed"))
    wi = packed["decoder"]["layer_0"]["feed_forward"]["wi"]["kernel"]
    assert wi.sharding == rows
    np.testing.assert_array_equal(np.asarray(wi), native.pack_kernel(np.asarray(layer["kernel"])))
    for a in jax.tree.leaves(packed["decoder"]["layer_0"]["self_attention"]):
        assert a.sharding.is_fully_replicated
