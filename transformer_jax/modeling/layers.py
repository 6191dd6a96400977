"""Embeddings (section 3.4), the position-wise feed-forward network (section 3.3, Eq. 2) and norms."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.modeling.attention import projection
from transformer_jax.modeling.matmul import contract_transposed


@jax.custom_jvp
def _take_rows(table, ids):
    """``jnp.take(table, ids, axis=0)`` for a 16-bit float table, gathering its bit patterns.

    XLA:CPU gathers bf16 through float32: in a decoding loop it hoists the conversion of the whole
    table out of the loop (50257 x 768: 75 ms on every call). Integers gather in place, on every
    backend. The tangent is the gather of the table's tangent, so the gradient is the usual
    scatter-add into a zero table, summed in float32.
    """
    # The barrier ties the table to this call's ids. Without it XLA hoists the loop-invariant
    # bitcast out of a decoding loop and writes a whole copy of the table on every call.
    table, ids = jax.lax.optimization_barrier((table, ids))
    bits = jax.lax.bitcast_convert_type(table, jnp.uint16)
    return jax.lax.bitcast_convert_type(jnp.take(bits, ids, axis=0), table.dtype)


@_take_rows.defjvp
def _take_rows_jvp(primals, tangents):
    # A JVP rule, not a VJP one: JAX's forward mode (jax.jvp; over jax.grad, Hessian-vector
    # products) cannot pass a custom VJP, and a gather of bit patterns has no derivative of its own.
    table, ids = primals
    rows = jnp.take(tangents[0].astype(jnp.float32), ids, axis=0)
    return _take_rows(table, ids), rows.astype(table.dtype)


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

    def setup(self):
        # N(0, 1/D): with the sqrt(D) scale the embedded tokens start with unit variance.
        init = nn.initializers.normal(stddev=self.features**-0.5)
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
            out = _take_rows(table, ids)
        else:
            out = jnp.take(table, ids, axis=0)
        return out * jnp.asarray(self.scale, self.dtype) if self.scale != 1.0 else out

    def attend(self, x):
        """Tied output projection: x [B, L, D] -> float32 logits [B, L, V] (x E^T), accumulated in
        float32 whatever the compute dtype (in bf16 through `matmul.contract_transposed`)."""
        return contract_transposed(x.astype(self.dtype), jnp.asarray(self.embedding, self.dtype),
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


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019): x / rms(x) * scale, computed in float32."""

    eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                           (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * scale).astype(self.dtype)


def make_norm(norm_type: str, eps: float, dtype, param_dtype, name: str) -> nn.Module:
    """LayerNorm (the paper's, Ba et al. 2016) or RMSNorm; statistics in float32."""
    if norm_type == "rmsnorm":
        return RMSNorm(eps=eps, dtype=dtype, param_dtype=param_dtype, name=name)
    return nn.LayerNorm(
        epsilon=eps, dtype=dtype, param_dtype=param_dtype, use_fast_variance=False,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
        name=name,
    )
