"""The weight matmuls (`modeling.matmul`): values and gradients equal a plain `lax.dot_general`, the
bf16 backward pass keeps every product in bf16 on CPU, and whole models train the same way in bf16
as in float32, on one device and on a mesh."""

import math
import os
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import transformer_jax as tj
from transformer_jax import parallel
from transformer_jax.modeling import matmul, native

# Distinct primes: a transposed axis cannot pass. 3 * 29 = 87 rows, above the transposed-copy threshold.
LEAD, IN, OUT = (3, 29), (5, 7), (11, 13)


def _arrays(dtype, n_in):
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, LEAD + IN[-n_in:], jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, IN[-n_in:] + OUT, jnp.float32) * 0.3).astype(dtype)
    return x, w


def _loss(product):
    # A non-linear read-out so that every output element gets its own cotangent.
    return lambda x, w: jnp.sum(jnp.sin(product(x, w)))


def _close(a, b, rtol):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, atol=rtol * np.abs(b).max(), rtol=0)


@pytest.mark.parametrize("n_in", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_contract_equals_dot_general_with_gradients(dtype, n_in):
    x, w = _arrays(jnp.dtype(dtype), n_in)
    dims = ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))), ((), ()))
    plain = lambda x, w: jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)
    mine = lambda x, w: matmul.contract(x, w, n_in)
    out = jax.jit(mine)(x, w)
    assert out.dtype == jnp.float32 and out.shape == LEAD + OUT
    _close(out, jax.jit(plain)(x, w), 1e-6)
    grads = jax.jit(jax.grad(_loss(mine), argnums=(0, 1)))(x, w)
    reference = jax.jit(jax.grad(_loss(plain), argnums=(0, 1)))(x, w)
    for g, r in zip(grads, reference):
        assert g.dtype == r.dtype == jnp.dtype(dtype)
        _close(g, r, 1e-6 if dtype == "float32" else 2e-2)  # bf16: within one rounding


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_contract_transposed_equals_einsum_with_gradients(dtype):
    x, _ = _arrays(jnp.dtype(dtype), 1)
    table = (jax.random.normal(jax.random.key(2), (37, IN[-1])) * 0.3).astype(dtype)  # [V, D]
    plain = lambda x, e: jnp.einsum("ABD,VD->ABV", x, e, preferred_element_type=jnp.float32)
    mine = matmul.contract_transposed
    _close(jax.jit(mine)(x, table), jax.jit(plain)(x, table), 1e-6)
    grads = jax.jit(jax.grad(_loss(mine), argnums=(0, 1)))(x, table)
    reference = jax.jit(jax.grad(_loss(plain), argnums=(0, 1)))(x, table)
    for g, r in zip(grads, reference):
        _close(g, r, 1e-6 if dtype == "float32" else 2e-2)


@pytest.mark.parametrize("transposed", [False, True])
def test_bf16_products_take_forward_mode_and_transpose_it_into_their_backward_pass(transposed):
    """The bf16 products' derivatives are two more bf16 products, so jax.jvp, jax.jacfwd, vmapped
    JVPs and jax.linearize work (JAX refused them while the products carried a custom VJP), with
    the plain dot_general's values; and JAX transposes those tangents into the products' own
    backward pass (jax.linear_transpose of the linearized product equals the VJP)."""
    x, w = _arrays(jnp.bfloat16, 1)  # 87 rows: the transposed-copy path of contract_transposed
    if transposed:
        w = w[:, :, 0].T  # [11, 7]: stored output axes first
        mine, spec = matmul.contract_transposed, "ABI,OI->ABO"
    else:
        mine, spec = matmul.contract, "ABI,IOP->ABOP"
    plain = lambda x, w: jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
    dx, dw = (jax.random.normal(jax.random.key(k), a.shape).astype(a.dtype) for k, a in ((5, x), (6, w)))
    for f in (jax.jvp, lambda f, p, t: jax.jit(lambda p, t: jax.jvp(f, p, t))(p, t)):
        got, want = f(mine, (x, w), (dx, dw)), f(plain, (x, w), (dx, dw))
        for g, r in zip(got, want):
            assert g.dtype == r.dtype == jnp.float32
            _close(g, r, 1e-6)
    # jacfwd maps the tangents (each operand alone); vmap of jvp maps primals and tangents together
    _close(jax.jacfwd(lambda w: mine(x[:1], w))(w), jax.jacfwd(lambda w: plain(x[:1], w))(w), 1e-6)
    _close(jax.jacfwd(lambda x: mine(x, w))(x[:1, :2]), jax.jacfwd(lambda x: plain(x, w))(x[:1, :2]), 1e-6)
    both = lambda f: jax.vmap(lambda x, w, dx, dw: jax.jvp(f, (x, w), (dx, dw))[1])
    stack = lambda a: jnp.stack([a, -a])
    _close(both(mine)(stack(x), stack(w), stack(dx), stack(dw)),
           both(plain)(stack(x), stack(w), stack(dx), stack(dw)), 1e-6)
    # reverse mode through the linearized tangent: the products' own backward pass
    y, linear = jax.linearize(mine, x, w)
    g = jax.random.normal(jax.random.key(7), y.shape)
    transposed_grads = jax.linear_transpose(linear, x, w)(g)
    vjp_grads = jax.vjp(mine, x, w)[1](g)
    for t, v in zip(transposed_grads, vjp_grads):
        assert t.dtype == v.dtype == jnp.bfloat16
        np.testing.assert_array_equal(t, v)
    reference = jax.vjp(plain, x, w)[1](g)
    for t, r in zip(transposed_grads, reference):
        _close(t, r, 2e-2)  # within one bf16 rounding


@pytest.mark.parametrize("transposed", [False, True])
def test_bf16_products_inside_shard_map_follow_the_varying_axes(transposed):
    """Inside jax.shard_map (check_vma, its default) the bf16 products' gradients and tangents are a
    plain dot_general's: a weight replicated over the mesh gets its cotangent summed over the
    axis, as JAX does for its own primitives. The custom VJP before failed there ("the manual axis
    types do not match")."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    x, w = _arrays(jnp.bfloat16, 1)
    x = jnp.concatenate([x, -x, 2 * x, x[::-1]])  # 12 rows of 29 tokens: 3 per device
    if transposed:
        w = w[:, :, 0].T
        mine, spec = matmul.contract_transposed, "ABI,OI->ABO"
    else:
        mine, spec = matmul.contract, "ABI,IOP->ABOP"
    plain = lambda x, w: jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])

    def run(product):
        def step(x, w):
            grads = jax.grad(_loss(product), (0, 1))(x, w)
            tangent = jax.jvp(product, (x, w), (x, w))[1]
            return grads, tangent

        f = jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P()),
                          out_specs=((P("data"), P()), P("data")))
        return jax.jit(f)(jax.device_put(x, NamedSharding(mesh, P("data"))), w)

    (got_dx, got_dw), got_t = run(mine)
    (want_dx, want_dw), want_t = run(plain)
    _close(got_t, want_t, 1e-6)
    _close(got_dx, want_dx, 2e-2)  # within one bf16 rounding
    _close(got_dw, want_dw, 2e-2)
    one_device = jax.grad(_loss(plain), 1)(x, w)  # the four shards' weight gradients, summed
    _close(want_dw, one_device, 2e-2)


def test_bf16_models_take_forward_mode_as_float32_does():
    """jax.jvp of a bf16 model's logits follows the float32 model's (same weights), with every
    product on the bf16 paths (tied output projection, an untied LM head, out_in kernels)."""
    config = tj.presets.tiny(dropout_rate=0.0, norm="pre")
    tokens = jax.random.randint(jax.random.key(1), (4, 24), 3, config.vocab_size)

    def jvp(config):
        model = tj.TransformerLM(config)
        params = jax.jit(lambda k: nn.unbox(model.init(k, tokens))["params"])(jax.random.key(0))
        params = jax.tree.map(lambda a: a.astype(jnp.float32), params)
        direction = jax.tree.map(lambda x: jax.random.normal(jax.random.key(2), x.shape), params)
        f = lambda p: model.apply({"params": p}, tokens).astype(jnp.float32)
        return jax.jit(lambda p, t: jax.jvp(f, (p,), (t,))[1])(params, direction)

    for variant in (dict(), dict(tie_output=False, kernel_layout="out_in", scan_layers=True)):
        want = jvp(config.replace(**variant))
        got = jvp(config.replace(dtype="bfloat16", **variant))
        # bf16 rounding moves the tangent by ~1% of its norm; a lost term by order 100%
        assert float(jnp.linalg.norm(got - want)) < 0.05 * float(jnp.linalg.norm(want))


def _dot_operand_dtypes(hlo: str) -> list[tuple[str, str]]:
    """(lhs, rhs) element types of every dot in compiled HLO text."""
    types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo))
    dots = re.findall(r"\bdot\(%([\w.\-]+), %([\w.\-]+)\)", hlo)
    return [(types[a], types[b]) for a, b in dots]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="about XLA:CPU's bf16 kernel")
def test_bf16_backward_products_stay_bf16_on_cpu():
    # Without the transposed copy of x, XLA:CPU converts the operands of the weight gradient's
    # product to float32 (2-4x slower on this CPU): the plain dot_general's gradient shows it does.
    x, w = _arrays(jnp.bfloat16, 1)
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    plain = lambda x, w: jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)
    compiled = lambda f: jax.jit(jax.grad(_loss(f), argnums=(0, 1))).lower(x, w).compile().as_text()
    assert ("f32", "f32") in _dot_operand_dtypes(compiled(plain))
    table = w[:, :, 0].T  # [11, 7]: a [V, D] table
    for product, args in ((lambda a, b: matmul.contract(a, b), (x, w)),
                          (matmul.contract_transposed, (x, table))):
        hlo = jax.jit(jax.grad(_loss(product), argnums=(0, 1))).lower(*args).compile().as_text()
        kinds = _dot_operand_dtypes(hlo)
        assert len(kinds) == 3 and set(kinds) == {("bf16", "bf16")}, kinds


def _entry_users(hlo: str, parameter: int) -> dict[str, bool]:
    """The ops of the compiled entry computation that read its `parameter`-th parameter (through
    bitcasts, which are free reshapes), by name -> whether it is a matrix product (a dot, or a
    fusion whose computation holds one)."""
    bodies = dict(re.findall(r"^%([\w.\-]+) [^\n]*\{\n(.*?)^\}", hlo, re.S | re.M))
    entry = hlo[hlo.index("ENTRY"):]
    ops = re.findall(r"^\s*(?:ROOT )?%([\w.\-]+) = [^\n]*? ([\w\-]+)\(([^)\n]*)\)([^\n]*)", entry, re.M)
    names = {n for n, op, operands, _ in ops if op == "parameter" and operands == str(parameter)}
    assert names, f"no parameter({parameter}) in the entry computation"
    users = {}
    for name, op, operands, rest in ops:  # in program order: a bitcast comes before its readers
        if any(re.search(r"%" + re.escape(m) + r"(?![\w.\-])", operands) for m in names):
            if op == "bitcast":
                names.add(name)
            else:
                called = re.search(r"calls=%([\w.\-]+)", rest)
                users[name] = op == "dot" or bool(called and " dot(" in bodies.get(called.group(1), ""))
    return users


@pytest.mark.skipif(jax.default_backend() != "cpu" or not native.cpu_multiplies_bf16(),
                    reason="about XLA:CPU's bf16 kernel on a CPU with bf16 arithmetic")
def test_bf16_products_read_the_weight_as_stored():
    # XLA:CPU's bf16 kernel takes the right operand with its contracted axes last as well as first:
    # the forward product of a weight stored [out, in] and dx = dy W^T read the weight as it is (a
    # transposed copy of it made the 256-row prefill of a GPT-2-small bf16 model ~1.8x slower).
    # Only dW, which contracts the token axes, multiplies a transposed copy, of the activation (in
    # bf16: test_bf16_backward_products_stay_bf16_on_cpu).
    x, w = _arrays(jnp.bfloat16, 1)  # x [3, 29, 7], w [7, 11, 13]
    table = w[:, :, 0].T  # [11, 7]: a weight stored output axes first
    for product, args in ((matmul.contract, (x, w)), (matmul.contract_transposed, (x, table))):
        hlo = jax.jit(jax.grad(_loss(product), argnums=(0, 1))).lower(*args).compile().as_text()
        users = _entry_users(hlo, 1)
        assert users and all(users.values()), (product.__name__, users)


needs_kernels = pytest.mark.skipif(jax.default_backend() != "cpu" or not native.available(),
                                   reason="the native CPU kernels do not run here")


@needs_kernels
@pytest.mark.parametrize("transposed", [False, True])
def test_bf16_backward_materializes_the_activation_before_its_transposed_copy(transposed):
    # With the native kernels the activation reaches its transposed copy through
    # `native.materialize` (XLA:CPU otherwise fuses its producer, here a tanh, into the transposing
    # loop, ~5-10x slower). The identity changes nothing: the same gradients, bit for bit; the
    # weight, a parameter, is read as stored.
    x, w = _arrays(jnp.bfloat16, 1)
    if transposed:
        w = w[:, :, 0].T  # [11, 7]: weights stored output axes first
    product = matmul.contract_transposed if transposed else matmul.contract

    def grads(kernels):
        f = lambda x, w: jnp.sum(jnp.sin(product(jnp.tanh(x), w, cpu_kernels=kernels)))
        step = jax.jit(jax.grad(f, argnums=(0, 1)))
        hlo = step.lower(x, w).compile().as_text()
        calls = hlo.count('custom_call_target="transformer_jax_materialize"')
        return calls, _dot_operand_dtypes(hlo), step(x, w)

    calls, kinds, got = grads("native")
    xla_calls, _, want = grads("xla")
    assert (calls, xla_calls) == (1, 0) and set(kinds) == {("bf16", "bf16")}, kinds
    for g, r in zip(got, want):
        np.testing.assert_array_equal(g, r)


@needs_kernels
def test_materialize_is_the_identity_under_transformations():
    x = jax.random.normal(jax.random.key(3), (4, 5, 6))
    f = lambda x: jnp.sum(jnp.sin(native.materialize(x * 2.0)))
    np.testing.assert_array_equal(jax.jit(native.materialize)(x), x)
    np.testing.assert_array_equal(jax.vmap(native.materialize)(x), x)
    np.testing.assert_allclose(jax.grad(f)(x), 2.0 * jnp.cos(x * 2.0), rtol=1e-6)
    tangent = jax.jvp(f, (x,), (jnp.ones_like(x),))[1]
    np.testing.assert_allclose(tangent, jnp.sum(2.0 * jnp.cos(x * 2.0)), rtol=1e-5)


def test_bf16_embedding_lookup_gathers_in_place_with_the_usual_gradient():
    from transformer_jax.modeling.layers import _take_rows

    table = (jax.random.normal(jax.random.key(1), (97, 12)) * 3).astype(jnp.bfloat16)
    ids = jnp.array([[5, 96, 5, 0], [3, 3, 3, 41]])  # repeated rows accumulate in the gradient
    np.testing.assert_array_equal(np.asarray(_take_rows(table, ids), np.float32),
                                  np.asarray(jnp.take(table, ids, axis=0), np.float32))
    weights = jax.random.normal(jax.random.key(2), ids.shape + (12,))
    loss = lambda take: lambda t: jnp.sum(jnp.sin(take(t, ids).astype(jnp.float32) * weights))
    ours = jax.grad(loss(_take_rows))(table)
    plain = jax.grad(loss(lambda t, i: jnp.take(t, i, axis=0)))(table)
    assert ours.dtype == jnp.bfloat16
    _close(ours, plain, 1e-2)
    tangent = jax.random.normal(jax.random.key(4), table.shape).astype(jnp.bfloat16)
    primal, out = jax.jvp(lambda t: _take_rows(t, ids), (table,), (tangent,))
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(tangent[ids], np.float32))
    np.testing.assert_array_equal(np.asarray(primal, np.float32), np.asarray(table[ids], np.float32))

    # In a decoding loop the table is loop-invariant: neither a float32 conversion nor a bit-pattern
    # copy of the whole [97, 12] table may be hoisted out of the loop.
    def decode(table, ids):
        step = lambda i, acc: acc + _take_rows(table, ids + i).astype(jnp.float32)
        return jax.lax.fori_loop(0, 5, step, jnp.zeros(ids.shape + (12,)))

    hlo = jax.jit(decode).lower(table, ids).compile().as_text()
    whole_table = r"= (f32|u16)\[97,12\]\{1,0\} fusion\("  # a table-sized result written out
    assert not re.search(whole_table, hlo)
    plain_hlo = jax.jit(lambda t, i: jax.lax.fori_loop(
        0, 5, lambda j, acc: acc + jnp.take(t, i + j, axis=0).astype(jnp.float32),
        jnp.zeros(i.shape + (12,)))).lower(table, ids).compile().as_text()
    # What the bit-pattern gather avoids, with XLA's default (fusion) emitters; the suite's loop
    # emitters (processes.FAST_COMPILE_FLAGS) do not hoist the conversion, so there the check needs
    # TJ_TEST_XLA_OPT=default.
    if "--xla_cpu_use_fusion_emitters=false" not in os.environ.get("XLA_FLAGS", "").split():
        assert re.search(whole_table, plain_hlo)


def _lm_grads(config, tokens, mesh=None):
    model = tj.TransformerLM(config)
    params = jax.jit(lambda k: nn.unbox(model.init(k, tokens))["params"])(jax.random.key(0))

    def loss(p, t):
        logits = model.apply({"params": p}, t)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), t[..., None], -1))

    if mesh is None:
        return jax.jit(jax.value_and_grad(loss))(params, tokens)
    abstract = jax.eval_shape(lambda k: model.init(k, tokens)["params"], jax.random.key(0))
    with jax.set_mesh(mesh), nn.logical_axis_rules(parallel.DEFAULT_RULES):
        sharded = jax.device_put(params, parallel.logical_to_sharding(abstract, mesh))
        batch = jax.device_put(tokens, parallel.batch_sharding(mesh))
        return jax.jit(jax.value_and_grad(loss))(sharded, batch)


def _relative_error(a, b):
    """Largest per-parameter |a - b| / |b|; a gradient that is zero in exact arithmetic (the key
    bias: softmax ignores a shift shared by all keys) is measured against 1e-3 of the largest."""
    pairs = list(zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    floor = 1e-3 * max(float(jnp.linalg.norm(y)) for _, y in pairs)
    return max(float(jnp.linalg.norm(x - y)) / max(float(jnp.linalg.norm(y)), floor)
               for x, y in pairs)


@pytest.mark.parametrize("variant", [
    dict(),
    dict(tie_output=False, scan_layers=True, remat="dots_saveable", norm="pre"),
    dict(tie_output=False, kernel_layout="out_in"),
])
def test_bf16_training_gradients_follow_float32(variant):
    # 4 x 24 = 96 tokens: the tied output projection takes its transposed-copy path too.
    config = tj.presets.tiny(dropout_rate=0.0, **variant)
    tokens = jax.random.randint(jax.random.key(1), (4, 24), 3, config.vocab_size)
    loss32, grads32 = _lm_grads(config, tokens)
    loss16, grads16 = _lm_grads(config.replace(dtype="bfloat16"), tokens)
    assert abs(float(loss16) - float(loss32)) < 0.02 * float(loss32)
    # bf16 rounding alone moves this tiny model's gradients by about 5% (the same with a plain
    # dot_general); a wrong axis or a lost term moves them by order 100%.
    assert _relative_error(grads16, grads32) < 0.1


def test_bf16_hessian_vector_products_follow_float32():
    """Forward over reverse (jax.jvp of jax.grad, what Hessian-vector products and jax.hessian do)
    through the bf16 products' own backward pass and the bf16 embedding lookup. The lookup was a
    custom VJP whose forward pass called itself, which JAX's forward mode refused."""
    config = tj.presets.tiny(dropout_rate=0.0, tie_output=False, norm="pre")
    tokens = jax.random.randint(jax.random.key(1), (4, 24), 3, config.vocab_size)

    def hvp(config):
        model = tj.TransformerLM(config)
        params = jax.jit(lambda k: nn.unbox(model.init(k, tokens))["params"])(jax.random.key(0))
        direction = jax.tree.map(lambda x: jax.random.normal(jax.random.key(2), x.shape), params)

        def loss(p):
            logits = model.apply({"params": p}, tokens)
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], -1))

        return jax.jit(lambda p, t: jax.jvp(jax.grad(loss), (p,), (t,))[1])(params, direction)

    # As for the gradients above: bf16 rounding moves each parameter's product by up to ~6%, a lost
    # term by ~100%. The key bias's is zero in exact arithmetic and its bf16 rounding ~1e-4 of the
    # largest, so each is measured against at least 2% of the largest (the smallest other is 4%).
    pairs = list(zip(jax.tree.leaves(hvp(config.replace(dtype="bfloat16"))), jax.tree.leaves(hvp(config))))
    floor = 0.02 * max(float(jnp.linalg.norm(y)) for _, y in pairs)
    assert max(float(jnp.linalg.norm(x - y)) / max(float(jnp.linalg.norm(y)), floor) for x, y in pairs) < 0.1


def test_bf16_gradients_on_a_mesh_equal_one_device():
    config = tj.presets.tiny(dropout_rate=0.0, dtype="bfloat16")
    tokens = jax.random.randint(jax.random.key(1), (4, 24), 3, config.vocab_size)
    loss1, grads1 = _lm_grads(config, tokens)
    loss8, grads8 = _lm_grads(config, tokens, parallel.create_mesh(2, 2, 2))
    np.testing.assert_allclose(loss8, loss1, rtol=1e-3)
    assert _relative_error(grads8, grads1) < 0.1  # bf16 sums in another order: about 5%


def test_a_cpu_without_bf16_matrix_instructions_is_told_by_its_flags(monkeypatch):
    from transformer_jax.modeling import native

    cases = [("x86_64", {"avx2", "fma"}, False), ("x86_64", {"avx2", "fma", "avx512f", "avx512bw"}, False),
             ("x86_64", {"avx512f", "avx512_bf16"}, True), ("x86_64", {"avx2", "amx_bf16"}, True),
             ("x86_64", set(), True), ("aarch64", {"asimd"}, True)]
    try:
        for machine, flags, expected in cases:
            monkeypatch.setattr(native.platform, "machine", lambda m=machine: m)
            monkeypatch.setattr(native, "_cpu_flags", lambda f=flags: f)
            native.cpu_multiplies_bf16.cache_clear()
            assert native.cpu_multiplies_bf16() is expected, (machine, flags)
    finally:
        native.cpu_multiplies_bf16.cache_clear()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="about XLA:CPU's bf16 kernel")
def test_bf16_products_of_many_rows_run_in_float32_on_a_cpu_without_bf16_matrix_instructions(monkeypatch):
    """There XLA:CPU's bf16 matmul is slower than converting to float32 first: from
    MIN_TOKENS_TO_WIDEN rows both products and their gradients run in float32, with the same
    values; fewer rows, or a CPU with bf16 instructions, keep the bf16 products."""
    from transformer_jax.modeling import native

    rows = matmul.MIN_TOKENS_TO_WIDEN
    kx, kw = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (rows, IN[-1]), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (IN[-1], OUT[0]), jnp.float32) * 0.3).astype(jnp.bfloat16)
    table = w.T  # [V, D]
    plain = {"contract": lambda a, b: a.astype(jnp.float32) @ b.astype(jnp.float32),
             "contract_transposed": lambda a, b: a.astype(jnp.float32) @ b.astype(jnp.float32).T}
    products = {"contract": (matmul.contract, w), "contract_transposed": (matmul.contract_transposed, table)}

    def dot_kinds(product, *args):
        hlo = jax.jit(jax.grad(_loss(product), argnums=(0, 1))).lower(*args).compile().as_text()
        return set(_dot_operand_dtypes(hlo))

    for multiplies, n, widened in ((False, rows, True), (False, rows - 1, False), (True, rows, False)):
        monkeypatch.setattr(native, "cpu_multiplies_bf16", lambda m=multiplies: m)
        for name, (product, weight) in products.items():
            kinds = dot_kinds(product, x[:n], weight)
            expected = {("f32", "f32")} if widened else {("bf16", "bf16")}
            assert kinds == expected, (name, multiplies, n, kinds)
            if widened:
                _close(jax.jit(product)(x, weight), jax.jit(plain[name])(x, weight), 1e-6)
                grads = jax.jit(jax.grad(_loss(product), argnums=(0, 1)))(x, weight)
                reference = jax.jit(jax.grad(_loss(plain[name]), argnums=(0, 1)))(x, weight)
                for g, r in zip(grads, reference):
                    assert g.dtype == jnp.bfloat16
                    _close(g, r.astype(jnp.bfloat16), 1e-2)
    monkeypatch.setattr(matmul, "WIDEN_BF16", "sometimes")
    with pytest.raises(ValueError, match=r"matmul.WIDEN_BF16='sometimes'; choose 'auto'"):
        matmul.contract(x, w)


def _dot_input_rows(fn, x, w, in_size: int = 35) -> set[int]:
    """The rows (elements / `in_size`) of every dot operand in `fn`'s lowered program that is
    not the weight `w`, which may be either operand (XLA:CPU's decoding products put it first)."""
    text = jax.jit(fn).lower(x, w).as_text()
    operands = re.findall(r"stablehlo\.dot_general.*: \(tensor<([\dx]+)x\w+>, tensor<([\dx]+)x\w+>\)", text)
    sizes = {math.prod(int(d) for d in shape.split("x")) for pair in operands for shape in pair}
    return {size // in_size for size in sizes if size != w.size}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_single_row_products_run_as_two_rows_when_asked(monkeypatch, dtype):
    """matmul.SINGLE_ROW='two_rows': a one-row product (a batch-1 decoding step) multiplies a
    zero second row with it, so that XLA:GPU keeps it a matrix product; the values, and their
    gradients, are those of the one-row product. More rows are unchanged."""
    x, w = _arrays(jnp.dtype(dtype), 2)  # x [3, 29, 5, 7], w [5, 7, 11, 13]
    table = w.reshape(35, 143).T  # [143, 35]: a weight stored [out, in]
    cases = {"contract": (lambda a, b: matmul.contract(a, b, 2), x[:1, :1], w),
             "contract_transposed": (matmul.contract_transposed, x[:1, 0].reshape(1, 35), table),
             "contract, 29 rows": (lambda a, b: matmul.contract(a, b, 2), x[:1], w)}
    tol = 1e-6 if dtype == "float32" else 1e-2
    for name, (product, a, b) in cases.items():
        rows = a.size // 35
        # XLA:CPU's bf16 matrix-vector path is slow: there contract_transposed pads one row anyway.
        padded_anyway = (name == "contract_transposed" and dtype == "bfloat16"
                         and jax.default_backend() == "cpu")
        monkeypatch.setattr(matmul, "SINGLE_ROW", "vector")
        jax.clear_caches()  # the setting is read when a computation is traced
        assert _dot_input_rows(product, a, b) == {2 if padded_anyway else rows}, name
        value = jax.jit(product)(a, b)
        grads = jax.jit(jax.grad(_loss(product), argnums=(0, 1)))(a, b)
        monkeypatch.setattr(matmul, "SINGLE_ROW", "two_rows")
        jax.clear_caches()
        assert _dot_input_rows(product, a, b) == {2 if rows == 1 else rows}, name
        _close(jax.jit(product)(a, b), value, 1e-6)
        for g, r in zip(jax.jit(jax.grad(_loss(product), argnums=(0, 1)))(a, b), grads):
            _close(g, r, tol)
    with pytest.raises(ValueError, match=r"contract: x \(1, 3, 2\) does not end in w's input axes"):
        matmul.contract(jnp.ones((1, 3, 2), dtype), jnp.ones((2, 3, 4), dtype), 2)
    jax.clear_caches()
    monkeypatch.setattr(matmul, "SINGLE_ROW", "three_rows")
    with pytest.raises(ValueError, match=r"matmul.SINGLE_ROW='three_rows'; choose 'vector' or 'two_rows'"):
        matmul.contract(x[:1, :1], w, 2)


def test_batch_1_decoding_with_two_row_products_gives_the_same_tokens(monkeypatch):
    """A bf16 LM on XLA's kernels, greedy cached decoding at batch 1 under both SINGLE_ROW settings:
    the same tokens, log-probabilities within bf16 rounding."""
    config = tj.presets.tiny(num_encoder_layers=0, vocab_size=61, norm="pre", dtype="bfloat16",
                             param_dtype="bfloat16", cpu_kernels="xla")
    model = tj.TransformerLM(config)
    params = model.init(jax.random.key(0), jnp.ones((1, 8), jnp.int32))["params"]
    tokens, lengths = tj.decoding.pad_prompts([[5, 6, 7, 8]])
    outputs, padded = {}, []
    as_two_rows = matmul._as_two_rows
    monkeypatch.setattr(matmul, "_as_two_rows", lambda *args: padded.append(1) or as_two_rows(*args))
    for setting in ("vector", "two_rows"):
        monkeypatch.setattr(matmul, "SINGLE_ROW", setting)
        jax.clear_caches()  # the setting is read when the step is traced
        outputs[setting] = tj.decoding.generate(tj.LMStep(model), params, tj.init_cache(config, 1, 24),
                                                tokens, lengths, max_new_tokens=16, eos_id=None)
        # the six products of each layer of a step and its output projection; of the prompt's
        # (4 rows), only the output projection, which reads the last position
        assert len(padded) == (0 if setting == "vector" else 6 * config.num_decoder_layers + 2), setting
    jax.clear_caches()
    vector, two_rows = outputs["vector"], outputs["two_rows"]
    np.testing.assert_array_equal(two_rows.tokens, vector.tokens)
    _close(two_rows.logprobs, vector.logprobs, 2e-2)
