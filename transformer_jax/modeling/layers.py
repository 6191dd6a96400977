"""Embeddings (section 3.4), the position-wise feed-forward network (section 3.3, Eq. 2) and norms."""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.modeling import native
from transformer_jax.modeling.attention import projection
from transformer_jax.modeling.matmul import contract_packed, contract_transposed


def _gather_rows(table, ids, packed: bool):
    """table[ids] (rows along axis 0); of a table stored packed (`native.pack_kernel`: rows in
    groups of tiles of 16, each group [D / 2, tiles, 16, 2]), gathered from the groups' views."""
    V, D = table.shape
    tiled = native.packed_rows(V, D) if packed else 0
    if tiled == 0:  # (an odd width is stored as it is)
        return jnp.take(table, ids, axis=0)
    rows = jnp.take(table[tiled:], jnp.clip(ids - tiled, 0, V - tiled - 1), axis=0) if tiled < V else None
    tile = native.PACK_TILE
    for first, view in native.packed_group_views(table):
        groups, _, tiles = view.shape[:3]
        local = ids - first
        inside = (local >= 0) & (local < groups * tiles * tile)
        local = jnp.where(inside, local, 0)
        found = view[local // (tiles * tile), :, local // tile % tiles, local % tile, :]
        found = found.reshape(ids.shape + (D,))
        rows = found if rows is None else jnp.where(inside[..., None], found, rows)
    return rows


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _take_rows(table, ids, packed=False):
    """``jnp.take(table, ids, axis=0)`` for a 16-bit float table, gathering its bit patterns (of a
    packed table, through `_gather_rows`).

    XLA:CPU gathers bf16 through float32: in a decoding loop it hoists the conversion of the whole
    table out of the loop (50257 x 768: 75 ms on every call). Integers gather in place, on every
    backend. The tangent is the gather of the table's tangent, so the gradient is the usual
    scatter-add into a zero table, summed in float32.
    """
    # The barrier ties the table to this call's ids. Without it XLA hoists the loop-invariant
    # bitcast out of a decoding loop and writes a whole copy of the table on every call.
    table, ids = jax.lax.optimization_barrier((table, ids))
    bits = jax.lax.bitcast_convert_type(table, jnp.uint16)
    return jax.lax.bitcast_convert_type(_gather_rows(bits, ids, packed), table.dtype)


@_take_rows.defjvp
def _take_rows_jvp(packed, primals, tangents):
    # A JVP rule, not a VJP one: JAX's forward mode (jax.jvp; over jax.grad, Hessian-vector
    # products) cannot pass a custom VJP, and a gather of bit patterns has no derivative of its own.
    table, ids = primals
    rows = _gather_rows(tangents[0].astype(jnp.float32), ids, packed)
    return _take_rows(table, ids, packed), rows.astype(table.dtype)


def _packed_table_init(init, key, shape, dtype):
    return native.pack_kernel(init(key, shape, dtype))


class Embed(nn.Module):
    """A [V, D] embedding table. `attend` reuses it as the pre-softmax projection (section 3.4:
    the same weight matrix for both embedding layers and the output linear transformation)."""

    num_embeddings: int
    features: int
    scale: float = 1.0  # sqrt(d_model) in the paper
    names: tuple[str, str] = ("vocab", "embed")
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    cpu_kernels: str = "xla"  # for `attend`; see ModelConfig.cpu_kernels
    # The table stored packed (``kernel_layout='packed'``: `native.pack_kernel`'s order), for
    # `attend` on the CPU decoding kernel; lookups gather from the tiles' view.
    packed: bool = False
    # The rows ids may name (None: all): a padded vocabulary's extra rows (`pad_vocab_multiple`)
    # are not tokens. An id outside [0, valid_rows) looks up NaN.
    valid_rows: int | None = None

    def setup(self):
        # N(0, 1/D): with the sqrt(D) scale the embedded tokens start with unit variance.
        init = nn.initializers.normal(stddev=self.features**-0.5)
        if self.packed:  # the same values, in the packed order
            init = functools.partial(_packed_table_init, init)
        self.embedding = self.param(
            "embedding", nn.with_logical_partitioning(init, self.names),
            (self.num_embeddings, self.features), self.param_dtype,
        )

    def __call__(self, ids):
        """ids: int [B, L] -> [B, L, D] in the compute dtype, times `scale`."""
        table = jnp.asarray(self.embedding, self.dtype)
        # Under a mesh: the lookup is gathered with the ids' batch sharding, from the table with its
        # embedding axis whole (still split over the vocabulary). Gathering from a table split on
        # both axes gave rows split on the embedding axis, which XLA could only turn into the
        # batch's sharding by replicating them ("Involuntary full rematerialization").
        table = nn.with_logical_constraint(table, (self.names[0], None))
        ids = nn.with_logical_constraint(ids, ("batch", "length")[-ids.ndim:])
        if table.dtype.itemsize == 2 and jnp.issubdtype(table.dtype, jnp.floating):
            out = _take_rows(table, ids, self.packed)
        else:
            out = _gather_rows(table, ids, self.packed)
        # Inside jit the ids cannot be checked: one outside the table is NaN, never another row (a
        # negative id counted from the table's end, one in a padded vocabulary's extra rows read
        # that row, the packed and 16-bit lookups clamped or filled with a finite value). The select
        # is not fused with the gather: ~0.15 ms per [8, 512] lookup of a 50257 x 768 bf16 table on
        # a 2-core CPU, nothing measurable per decoding step.
        rows = self.num_embeddings if self.valid_rows is None else self.valid_rows
        outside = (ids < 0) | (ids >= rows)
        out = jnp.where(outside[..., None], jnp.asarray(jnp.nan, out.dtype), out)
        return out * jnp.asarray(self.scale, self.dtype) if self.scale != 1.0 else out

    def attend(self, x):
        """Tied output projection: x [B, L, D] -> float32 logits [B, L, V] (x E^T), accumulated in
        float32 whatever the compute dtype (in bf16 through `matmul.contract_transposed`)."""
        product = contract_packed if self.packed else contract_transposed
        return product(x.astype(self.dtype), jnp.asarray(self.embedding, self.dtype),
                       cpu_kernels=self.cpu_kernels)


class FeedForward(nn.Module):
    """Eq. 2: FFN(x) = max(0, x W_1 + b_1) W_2 + b_2, with other activations by name.

    Gated variants ('swiglu', 'geglu'; Shazeer 2020) compute act(x W_gate) * (x W_1) before W_2.
    """

    d_ff: int
    activation: str = "relu"
    use_bias: bool = True
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    kernel_layout: str = "in_out"
    cpu_kernels: str = "xla"  # see ModelConfig.cpu_kernels

    def _dense(self, features, names, name, activation=None):
        return projection(features, names, use_bias=self.use_bias, dtype=self.dtype,
                          param_dtype=self.param_dtype, kernel_layout=self.kernel_layout,
                          cpu_kernels=self.cpu_kernels, name=name, activation=activation)

    @nn.compact
    def __call__(self, x):
        """x: [B, L, D] -> [B, L, D]."""
        if self.activation in ("swiglu", "geglu"):
            h = self._dense(self.d_ff, ("embed", "mlp"), "wi")(x)
            gate = self._dense(self.d_ff, ("embed", "mlp"), "wi_gate", activation=self.activation)(x)
            h = gate * h
        else:
            # The activation is the projection's own: one native pass with its bias on the CPU
            # kernels (Projection.activation).
            h = self._dense(self.d_ff, ("embed", "mlp"), "wi", activation=self.activation)(x)
        h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
        return self._dense(x.shape[-1], ("mlp", "embed"), "wo")(h)


def _native_norm_fits(x, dtype, cpu_kernels) -> bool:
    """Whether a norm of x (over its last axis) takes `native.layer_norm`: a decoding step's few rows
    (at most native.MAX_ROWS), float32 or bf16 in and out, where the model calls the package's CPU
    kernels (`native.use_native`)."""
    rows = math.prod(x.shape[:-1])
    return (1 <= rows <= native.MAX_ROWS and x.dtype in native.CACHE_DTYPES
            and jnp.dtype(dtype or x.dtype) in native.CACHE_DTYPES and native.use_native(cpu_kernels))


def _native_norm(x, scale, bias, eps, kind, dtype):
    """The norm through `native.layer_norm` on a CPU, where it replaces the five operations XLA:CPU
    makes of a decoding step's norm (two reductions among them); elsewhere
    (`lax.platform_dependent`) XLA's ops, the module's own numbers."""
    dtype = jnp.dtype(dtype or x.dtype)
    x2 = x.reshape(-1, x.shape[-1])
    bias = jnp.zeros(scale.shape, jnp.float32) if bias is None else bias

    def on_cpu(x2, scale, bias):
        return native.layer_norm(x2, scale, bias, eps, kind, dtype)

    def elsewhere(x2, scale, bias):
        return native.layer_norm_xla(x2, scale, bias, eps, kind, dtype)

    return jax.lax.platform_dependent(x2, scale, bias, cpu=on_cpu, default=elsewhere).reshape(x.shape)


class LayerNorm(nn.Module):
    """LayerNorm over the last axis (Ba et al. 2016), statistics in float32 and the variance as the
    mean of squared deviations: flax's `nn.LayerNorm(use_fast_variance=False)`, the same parameters
    and the same numbers (tested), which on a CPU takes a decoding step's few rows through the
    package's kernel (`cpu_kernels`, see ModelConfig.cpu_kernels)."""

    epsilon: float = 1e-6
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    cpu_kernels: str = "xla"

    @nn.compact
    def __call__(self, x):
        shape = (x.shape[-1],)
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)), shape,
                           self.param_dtype)
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)), shape,
                          self.param_dtype)
        if _native_norm_fits(x, self.dtype, self.cpu_kernels):
            return _native_norm(x, scale, bias, self.epsilon, "layernorm", self.dtype)
        return native.layer_norm_xla(x, scale, bias, self.epsilon, "layernorm", self.dtype or x.dtype)


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019): x / rms(x) * scale, computed in float32."""

    eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    cpu_kernels: str = "xla"  # a decoding step's few rows on the package's kernel (see LayerNorm)

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                           (x.shape[-1],), self.param_dtype)
        if _native_norm_fits(x, self.dtype, self.cpu_kernels):
            return _native_norm(x, scale, None, self.eps, "rmsnorm", self.dtype)
        return native.layer_norm_xla(x, scale, jnp.zeros_like(scale), self.eps, "rmsnorm", self.dtype)


def make_norm(norm_type: str, eps: float, dtype, param_dtype, name: str,
              cpu_kernels: str = "xla") -> nn.Module:
    """LayerNorm (the paper's, Ba et al. 2016) or RMSNorm; statistics in float32."""
    if norm_type not in ("layernorm", "rmsnorm"):
        raise ValueError(f"norm_type must be 'layernorm' or 'rmsnorm', got {norm_type!r}")
    if norm_type == "rmsnorm":
        return RMSNorm(eps=eps, dtype=dtype, param_dtype=param_dtype, cpu_kernels=cpu_kernels, name=name)
    return LayerNorm(epsilon=eps, dtype=dtype, param_dtype=param_dtype, cpu_kernels=cpu_kernels, name=name)
