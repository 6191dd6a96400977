"""The model's weight matmuls: x W with low-precision inputs and float32 accumulation.

`contract(x, w, n_in)` contracts the trailing `n_in` axes of x with the leading `n_in` axes of w
and returns float32. In float32 it is one `lax.dot_general`, differentiated by JAX as usual.

With bfloat16 inputs it carries its own backward pass, as the transpose rules of the primitive
that is its tangent (`derivatives.bilinear`): reverse mode runs the products below, and forward
mode (`jax.jvp`, `jax.jacfwd`) works too. XLA:CPU runs a bf16 x bf16 -> f32 matmul in its fast
bf16 kernel when the left operand has its contracted axes minor (last); the right operand it takes
with its contracted axes either first or last. Otherwise it converts both to float32 first and
runs at the float32 rate, 2-4x slower on a CPU with bf16 matrix units. Of the backward products of
x W, dx = dy W^T reads W as it is stored, but dW = x^T dy contracts the token axes, which are the
first axes of x. XLA folds a plain `jnp.transpose` back into the matmul's dimension numbers, so on
CPU the backward pass here makes the transposed copy of x explicit (a transpose whose result is
padded and sliced, which XLA keeps as an array of its own); on other platforms it is an ordinary
transpose. The copy costs one pass over x; the product then runs in bf16. The same holds for a
weight stored output axes first (`contract_transposed`): x W_t^T and dx = dy W_t read W_t as
stored, and dW_t = dy^T x multiplies a transposed copy of x.

Measured on an AMD Zen 5 CPU (avx512_bf16) with jax 0.10.2, bf16 at 2048 rows: x^T dy with x as it is
against a transposed copy of x, [768, 3072] 27.4 against 12.6 ms; dy W^T with W as stored
against a transposed copy of W, 13.0 against 13.8 ms; x W_t^T with the [50257, 768] table as stored
against a copy, 306 against 337 ms (at 256 rows 38.7 against 66.8 ms, at 64 rows 7.9 against 36.0).

The incoming gradient is rounded to the input dtype before the backward products, as it would be
if the product's output were bf16. For a projection whose output is cast to bf16 anyway (every
`Projection`) this rounding is exact; for float32 logits it rounds dL/dlogits to bf16.

A CPU without bf16 matrix instructions (AVX2, or AVX-512 without its bf16 extension; see
`native.cpu_multiplies_bf16`) is the exception: there XLA:CPU's bf16 kernel runs at ~0.6x of its
float32 one, so bf16 products of `MIN_TOKENS_TO_WIDEN` rows or more convert both operands to
float32 and multiply those (`widen_bf16`). The values are the same products of bf16-rounded
numbers, summed in float32; the backward products then keep the incoming gradient in float32.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from transformer_jax.modeling import derivatives, native

# From this many tokens per call, a bf16 product with a weight stored output axes first takes the
# backward pass of the module doc (dW_t from a transposed copy of x); fewer keep JAX's own, whose
# dW_t product runs in float32 but over few rows.
MIN_TOKENS_FOR_TRANSPOSED_COPY = 64
# Up to this many tokens per call (decoding steps), a weight stored [out, in] is the left operand.
WEIGHTS_FIRST_MAX_TOKENS = 32
# From this many tokens per call, bf16 products on a CPU without bf16 matrix instructions run in
# float32 (see the module doc). Fewer keep the bf16 paths: converting the weight is a pass of its
# own that writes a float32 copy, which a product of few rows does not win back (AMD Zen 3, bf16
# against float32 after conversion: 768 x 3072 at 64 rows 3.0 against 3.2-4.3 ms, at 256 rows 11.7
# against 7.2-8.1, at 1024 47.4 against 28.5; the 50257 x 768 table at 256 rows 209-233 against
# 207-243 ms, at 1024 880-896 against 615-638).
MIN_TOKENS_TO_WIDEN = 256
# 'auto' as above; 'always' or 'never' fix the choice (tests and measurements).
WIDEN_BF16 = "auto"
# How a product of a single row (a batch-1 decoding step) runs where it is not on the native CPU
# kernels: 'vector', as one matrix-vector `dot_general`; 'two_rows', as a product of two rows, the
# second zero, its result cut back to one. XLA:GPU rewrites a matrix-vector product whose weight has
# fewer than ~10M elements (a 2048 x 2048 projection, say) into a multiply and a reduction, which
# for weights stored [in, out] sums down the columns; two rows keep it a matrix product on XLA's
# GEMM kernels. Read when a computation is traced (a program compiled before a change keeps the
# setting it was traced with: `jax.clear_caches()`); a knob for measurements, see
# benchmarks/accelerator.py.
SINGLE_ROW = "vector"


def _dims(n_lhs: int, n_contract: int) -> tuple:
    """Contract the trailing `n_contract` axes of an `n_lhs`-axis lhs with the rhs's leading ones."""
    return ((tuple(range(n_lhs - n_contract, n_lhs)), tuple(range(n_contract))), ((), ()))


def _dot(a, b, n_contract: int):
    return lax.dot_general(a, b, _dims(a.ndim, n_contract), preferred_element_type=jnp.float32)


def _cpu_transposed_copy(a, perm):
    # Barrier 1: `a` is computed in its own pass (an elementwise producer fused into a transposing
    # loop runs ~5x slower than a plain transposing copy). Barrier 2: the transpose (with a float32
    # convert, still the fast copy kind) is a pass of its own. Pad-then-slice gives the result a
    # fresh row-major layout that XLA does not fold back into the matmul.
    t = lax.optimization_barrier(jnp.transpose(lax.optimization_barrier(a), perm).astype(jnp.float32))
    pad = [(0, 0, 0)] * (t.ndim - 1) + [(0, 1, 0)]
    t = lax.slice_in_dim(lax.pad(t, jnp.zeros((), t.dtype), pad), 0, t.shape[-1], axis=t.ndim - 1)
    return t.astype(a.dtype)


def _materialized_transposed_copy(a, perm):
    return _cpu_transposed_copy(native.materialize(a), perm)


def transposed_copy(a, perm: tuple[int, ...], cpu_kernels: str = "xla"):
    """`jnp.transpose(a, perm)`; on CPU materialised as a row-major array (see the module doc). Where
    `native.use_native(cpu_kernels)`, `a` is first made an array of its own (`native.materialize`):
    XLA:CPU otherwise fuses its producer into the transposing loop, which then runs ~5-10x slower
    (a bf16 [2048, 3072] activation: 7.9 against 1.6 ms). For a computed operand; a parameter would
    only be copied once more."""
    on_cpu = _materialized_transposed_copy if native.use_native(cpu_kernels) else _cpu_transposed_copy
    return lax.platform_dependent(a, cpu=partial(on_cpu, perm=perm),
                                  default=partial(jnp.transpose, axes=perm))


def widen_bf16(rows: int) -> bool:
    """Whether a bf16 product of `rows` rows in a CPU computation being traced runs in float32."""
    if WIDEN_BF16 not in ("auto", "always", "never"):
        raise ValueError(f"matmul.WIDEN_BF16={WIDEN_BF16!r}; choose 'auto', 'always' or 'never'")
    if WIDEN_BF16 == "never" or jax.default_backend() != "cpu":
        return False
    return WIDEN_BF16 == "always" or (rows >= MIN_TOKENS_TO_WIDEN and not native.cpu_multiplies_bf16())


def single_row_as_two_rows(rows: int) -> bool:
    """Whether a product of `rows` rows, off the native CPU kernels, runs as two rows (SINGLE_ROW)."""
    if SINGLE_ROW not in ("vector", "two_rows"):
        raise ValueError(f"matmul.SINGLE_ROW={SINGLE_ROW!r}; choose 'vector' or 'two_rows'")
    return rows == 1 and SINGLE_ROW == "two_rows"


def _as_two_rows(product, x2, w2):
    """product(x2, w2) for one row x2 [1, in], run on [x2; 0] and cut back to the first row. The
    barriers keep XLA from slicing the zero row off again before the product."""
    y = product(lax.optimization_barrier(jnp.pad(x2, ((0, 1), (0, 0)))), w2)
    return lax.optimization_barrier(y)[:1]


def _widened(x, w, n_in):
    return _dot(x.astype(jnp.float32), w.astype(jnp.float32), n_in)


def _widened_t(x2, w2):
    return _plain_t(x2.astype(jnp.float32), w2.astype(jnp.float32))


def _contract_lhs_transpose(g, w, x_aval, *, n_in, cpu_kernels):
    # dx = g W^T: g's output axes (its last) against W's (its last), W read as it is stored. As
    # matrices: with several output axes contracted at once XLA:CPU makes a transposed copy of W.
    rows = math.prod(x_aval.shape[:x_aval.ndim - n_in])
    size_in, size_out = math.prod(w.shape[:n_in]), math.prod(w.shape[n_in:])
    dx = _plain_t(g.astype(x_aval.dtype).reshape(rows, size_out), w.reshape(size_in, size_out))
    return dx.reshape(x_aval.shape).astype(x_aval.dtype)


def _contract_rhs_transpose(g, x, w_aval, *, n_in, cpu_kernels):
    # dW = x^T g, over a transposed copy of x ([in, lead])
    g = g.astype(x.dtype)
    n_lead = x.ndim - n_in
    x_t = transposed_copy(x, tuple(range(n_lead, x.ndim)) + tuple(range(n_lead)), cpu_kernels)
    return _dot(x_t, g, n_lead).astype(w_aval.dtype)


def _contract_batched(x, x_dim, w, w_dim, *, n_in, cpu_kernels):
    if w_dim is None:  # the mapped axis is one more leading axis of x
        out = derivatives.bind(_contract_p, jnp.moveaxis(x, x_dim, 0), w, n_in=n_in, cpu_kernels=cpu_kernels)
        return out, 0
    if x_dim is None:  # one more output axis of w, the last
        out = derivatives.bind(_contract_p, x, jnp.moveaxis(w, w_dim, -1), n_in=n_in, cpu_kernels=cpu_kernels)
        return out, out.ndim - 1
    # Both mapped: one product per element, each transposed into the products of the module doc.
    return derivatives.map_over_mapped(_contract_p)([x, w], [x_dim, w_dim], n_in=n_in,
                                                    cpu_kernels=cpu_kernels)


_contract_p = derivatives.bilinear("transformer_jax_low_precision_contract",
                        lambda x, w, *, n_in, cpu_kernels: _dot(x, w, n_in),
                        _contract_lhs_transpose, _contract_rhs_transpose, _contract_batched)


@partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _low_precision_contract(x, w, n_in, cpu_kernels="xla"):
    return _dot(x, w, n_in)


@partial(_low_precision_contract.defjvp, symbolic_zeros=True)
def _low_precision_contract_jvp(n_in, cpu_kernels, primals, tangents):
    # The value is the plain product (what remat policies such as dots_saveable look for); the
    # tangent, two products of the primitive, which reverse mode transposes into the backward
    # products of the module doc.
    return _dot(*primals, n_in), derivatives.bilinear_tangent(_contract_p, primals, tangents, n_in=n_in,
                                          cpu_kernels=cpu_kernels)


def _contract_t_product(x, w_t, *, cpu_kernels):
    # x [R, in] against w_t [out, in]: both contracted axes last, w_t read as it is stored
    return _plain_t(x, w_t)


def _contract_t_lhs_transpose(g, w_t, x_aval, *, cpu_kernels):
    return _dot(g.astype(x_aval.dtype), w_t, 1).astype(x_aval.dtype)  # [.., out] x [out, in]: as laid out


def _contract_t_rhs_transpose(g, x, w_aval, *, cpu_kernels):
    g = g.astype(x.dtype)
    x_t = transposed_copy(x, (x.ndim - 1,) + tuple(range(x.ndim - 1)), cpu_kernels)
    # [in, out]; the barrier keeps XLA from folding the transpose below into the product, which
    # would swap its operands into a layout the bf16 kernel does not take.
    dw = lax.optimization_barrier(_dot(x_t, g, x.ndim - 1))
    return dw.T.astype(w_aval.dtype)


def _contract_t_batched(x, x_dim, w_t, w_dim, *, cpu_kernels):
    # The operands are matrices: x [R, in], w_t [out, in].
    if w_dim is None:  # [B, R, in] as [B * R, in]
        x = jnp.moveaxis(x, x_dim, 0)
        out = derivatives.bind(_contract_t_p, x.reshape(-1, x.shape[-1]), w_t, cpu_kernels=cpu_kernels)
        return out.reshape(x.shape[:2] + (w_t.shape[0],)), 0
    w_t = jnp.moveaxis(w_t, w_dim, 0)
    if x_dim is None:  # [B, out, in] as [B * out, in]
        out = derivatives.bind(_contract_t_p, x, w_t.reshape(-1, w_t.shape[-1]), cpu_kernels=cpu_kernels)
        return out.reshape(x.shape[0], w_t.shape[0], w_t.shape[1]), 1
    return derivatives.map_over_mapped(_contract_t_p)([x, w_t], [x_dim, 0], cpu_kernels=cpu_kernels)


_contract_t_p = derivatives.bilinear("transformer_jax_low_precision_contract_t", _contract_t_product,
                          _contract_t_lhs_transpose, _contract_t_rhs_transpose, _contract_t_batched)


@partial(jax.custom_jvp, nondiff_argnums=(2,))
def _low_precision_contract_t(x, w_t, cpu_kernels="xla"):
    return _contract_t_product(x, w_t, cpu_kernels=cpu_kernels)


@partial(_low_precision_contract_t.defjvp, symbolic_zeros=True)
def _low_precision_contract_t_jvp(cpu_kernels, primals, tangents):
    return (_contract_t_product(*primals, cpu_kernels=cpu_kernels),
            derivatives.bilinear_tangent(_contract_t_p, primals, tangents, cpu_kernels=cpu_kernels))


def _plain_t(x2, w2):
    return lax.dot_general(x2, w2, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _cpu_weights_first(x2, w2):
    # w [out, in] x^T -> [out, rows], then the small result is transposed. The barrier keeps XLA
    # from folding that transpose into the product, which would swap the operands back. A bf16
    # product with one row goes to a slow matrix-vector path, so a single row gets a zero partner.
    rows = x2.shape[0]
    if x2.dtype == jnp.bfloat16 and rows == 1:
        x2 = jnp.pad(x2, ((0, 1), (0, 0)))
    y_t = lax.dot_general(w2, x2, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return lax.optimization_barrier(y_t).T[:rows]


def _as_matrices(caller: str, name: str, x, w, n_in: int):
    """x [..., in...] and an output-axes-first w [out..., in...] as matrices x2 [rows, in] and
    w2 [out, in], with x's leading and w's output shapes; errors name `caller` and the weight."""
    if x.dtype != w.dtype:
        raise TypeError(f"{caller}: x is {x.dtype} but {name} is {w.dtype}")
    n_out = w.ndim - n_in
    out_shape, in_shape = w.shape[:n_out], w.shape[n_out:]
    if n_in < 1 or x.shape[x.ndim - n_in:] != in_shape:
        raise ValueError(f"{caller}: x {x.shape} does not end in {name}'s input axes "
                         f"{in_shape} ({name} {w.shape}, n_in={n_in})")
    x2 = x.reshape(-1, math.prod(in_shape))
    return x2, w.reshape(math.prod(out_shape), math.prod(in_shape)), x.shape[:x.ndim - n_in], out_shape


def contract_transposed(x, w_t, n_in: int = 1, *, cpu_kernels: str = "xla"):
    """x [..., in...] times a weight stored output axes first, w_t [out..., in...], over the `n_in`
    `in` axes -> float32 [..., out...]. Used for the tied embedding as the output projection
    ([V, D]) and for every kernel of a model with ``kernel_layout='out_in'``.

    How the product runs depends on the number of rows (tokens) r:
    - 1 <= r <= native.MAX_ROWS on CPU, bfloat16 or float32, where `native.use_native(cpu_kernels)`:
      the package's own kernel (`native.rows_matmul`), which streams the weight at about the
      memory bandwidth;
    - r = 1 with SINGLE_ROW = 'two_rows': these rules for the row and a zero row, cut back to one;
    - bfloat16 with r >= MIN_TOKENS_TO_WIDEN on a CPU without bf16 matrix instructions: in float32
      (`widen_bf16`);
    - r <= WEIGHTS_FIRST_MAX_TOKENS (decoding steps), on CPU: w_t x^T, weights as the left operand,
      which XLA:CPU streams 1.5x (float32) to 2x (bf16) faster than x w at 2-16 rows;
    - bfloat16 with r >= MIN_TOKENS_FOR_TRANSPOSED_COPY: one `lax.dot_general` with the backward
      pass of the module doc (dW_t from a transposed copy of x);
    - otherwise one `lax.dot_general`.
    """
    x2, w2, lead, out_shape = _as_matrices("contract_transposed", "w_t", x, w_t, n_in)
    rows = x2.shape[0]
    if (1 <= rows <= native.MAX_ROWS and x.dtype in (jnp.bfloat16, jnp.float32)
            and native.use_native(cpu_kernels)):
        y = lax.platform_dependent(x2, w2, cpu=native.rows_matmul, default=_plain_t)
    elif single_row_as_two_rows(rows):  # the rules below, for two rows
        y = _as_two_rows(partial(contract_transposed, cpu_kernels=cpu_kernels), x2, w2)
    elif x.dtype == jnp.bfloat16 and widen_bf16(rows):
        # elsewhere than on CPU, what the rules below give
        default = (partial(_low_precision_contract_t, cpu_kernels=cpu_kernels)
                   if rows >= MIN_TOKENS_FOR_TRANSPOSED_COPY else _plain_t)
        y = lax.platform_dependent(x2, w2, cpu=_widened_t, default=default)
    elif rows <= WEIGHTS_FIRST_MAX_TOKENS:
        y = lax.platform_dependent(x2, w2, cpu=_cpu_weights_first, default=_plain_t)
    elif x.dtype == jnp.bfloat16 and rows >= MIN_TOKENS_FOR_TRANSPOSED_COPY:
        y = _low_precision_contract_t(x2, w2, cpu_kernels)
    else:
        y = _plain_t(x2, w2)
    return y.reshape(lead + out_shape)


def contract_packed(x, w_p, n_in: int = 1, *, cpu_kernels: str = "xla"):
    """As `contract_transposed`, for a weight stored packed (``kernel_layout='packed'``): w_p has
    the shape [out..., in...] of an output-axes-first weight, its [out, in] matrix stored as
    `native.pack_kernel` orders it. A bfloat16 product of 1 to native.PACKED_MAX_ROWS rows on CPU
    (decoding steps and prefills), where `native.use_native(cpu_kernels)`, runs on the package's
    kernel (`native.packed_matmul`); any other, as one product per run of groups of tiles over its
    [groups, in / 2, tiles, 16, 2] view (`native.packed_matmul_xla`, differentiated by JAX as
    usual)."""
    x2, w2, lead, out_shape = _as_matrices("contract_packed", "w_p", x, w_p, n_in)
    if native.packed_fits(x2.shape[0], x.dtype) and native.use_native(cpu_kernels):
        y = lax.platform_dependent(x2, w2, cpu=native.packed_matmul, default=native.packed_matmul_xla)
    else:
        y = native.packed_matmul_xla(x2, w2)
    return y.reshape(lead + out_shape)


def _contract_2d(x2, w2):
    # What the native kernel's call computes elsewhere than on CPU: contract's own rules.
    return _low_precision_contract(x2, w2, 1) if x2.dtype == jnp.bfloat16 else _dot(x2, w2, 1)


def contract(x, w, n_in: int = 1, *, cpu_kernels: str = "xla"):
    """x [..., in...] times w [in..., out...] over the `n_in` `in` axes -> float32 [..., out...].

    x and w must share a dtype; bfloat16 inputs take the backward pass described above (or, on a
    CPU without bf16 matrix instructions and from MIN_TOKENS_TO_WIDEN rows, run in float32). With a
    few rows (decoding steps) on CPU, where `native.use_native(cpu_kernels)` and `native.cols_fit`,
    the product runs on the package's kernel for input-major weights (`native.cols_matmul`). One
    row with SINGLE_ROW = 'two_rows' runs as two, the second zero."""
    if x.dtype != w.dtype:
        raise TypeError(f"contract: x is {x.dtype} but w is {w.dtype}; cast both to the compute dtype")
    lead, out_shape = x.shape[:x.ndim - n_in], w.shape[n_in:]
    rows = math.prod(lead)
    if (x.dtype in (jnp.bfloat16, jnp.float32) and native.cols_fit(rows, math.prod(out_shape), x.dtype)
            and x.shape[x.ndim - n_in:] == w.shape[:n_in] and native.use_native(cpu_kernels)):
        size = math.prod(w.shape[:n_in])
        x2, w2 = x.reshape(rows, size), w.reshape(size, math.prod(out_shape))
        y = lax.platform_dependent(x2, w2, cpu=native.cols_matmul, default=_contract_2d)
        return y.reshape(lead + out_shape)
    if single_row_as_two_rows(rows):  # the rules below, for two rows
        if x.shape[x.ndim - n_in:] != w.shape[:n_in]:
            raise ValueError(f"contract: x {x.shape} does not end in w's input axes {w.shape[:n_in]} "
                             f"(w {w.shape}, n_in={n_in})")
        size = math.prod(w.shape[:n_in])
        y = _as_two_rows(partial(contract, cpu_kernels=cpu_kernels), x.reshape(1, size),
                         w.reshape(size, math.prod(out_shape)))
        return y.reshape(lead + out_shape)
    if x.dtype == jnp.bfloat16:
        if widen_bf16(math.prod(x.shape[:x.ndim - n_in])):
            default = lambda x, w: _low_precision_contract(x, w, n_in, cpu_kernels)
            return lax.platform_dependent(x, w, cpu=partial(_widened, n_in=n_in), default=default)
        return _low_precision_contract(x, w, n_in, cpu_kernels)
    return _dot(x, w, n_in)
