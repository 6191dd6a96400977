"""Scaled dot-product attention (section 3.2.1, Eq. 1) and multi-head attention (section 3.2.2).

One `MultiHeadAttention` serves encoder self-attention, masked decoder self-attention and
encoder-decoder cross-attention, for training, prompt prefill and one-token decoding with a KV
cache. `dot_product_attention` is the backend switch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from transformer_jax.config import ATTENTION_IMPLS
from transformer_jax.modeling import derivatives, masks, native
from transformer_jax.modeling.activations import activation_fn
from transformer_jax.modeling.chunked_attention import chunked_attention
from transformer_jax.modeling.matmul import contract, contract_packed, contract_transposed
from transformer_jax.modeling.positional import apply_rope

_MASKED = -1e30  # finite, so a fully masked row cannot produce inf - inf = NaN


def _reference_attention(q, k, v, mask, *, dropout_rate, dropout_rng, deterministic, kv_layout="BSNK"):
    """softmax(QK^T / sqrt(d_k)) V written out with einsums; returns (out, probs).

    q: [B, L, H, K], k/v: [B, S, N, K] (kv_layout 'BSNK') or [B, N, S, K] ('BNSK', the KV cache's
    layout: the matmuls read it in place), H = N * G (grouped-query), mask: [B, 1|H, L, S].
    Logits and softmax in float32 whatever the compute dtype.
    """
    B, L, H, K = q.shape
    N = k.shape[kv_layout.index("N")]
    q = q.reshape(B, L, N, H // N, K) / jnp.sqrt(K).astype(q.dtype)
    logits = jnp.einsum(f"BLNGK,{kv_layout}->BNGLS", q, k, preferred_element_type=jnp.float32)
    logits = logits.reshape(B, H, L, -1)
    if mask is not None:
        logits = jnp.where(mask, logits, _MASKED)
    probs = jax.nn.softmax(logits, axis=-1)
    if mask is not None:
        probs = probs * mask  # a query with no visible key gets all-zero weights, not 1/S each
    if not deterministic and dropout_rate > 0.0:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs.shape)
        probs = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)
    weights = probs.astype(v.dtype).reshape(B, N, H // N, L, -1)
    out = jnp.einsum(f"BNGLS,{kv_layout}->BNGLK", weights, v, preferred_element_type=jnp.float32)
    # The barrier keeps XLA from folding the transpose below into the product by swapping its
    # operands: with bf16 inputs XLA:CPU has no kernel for the swapped form and fails at run time.
    out = jnp.transpose(jax.lax.optimization_barrier(out), (0, 3, 1, 2, 4))
    out = out.astype(v.dtype).reshape(B, L, H, K)
    return out, probs


def _fused_mask_args(mask, batch: int):
    """(keyword arguments for jax.nn.dot_product_attention, None or a bool array broadcastable to the
    output [B, L, H, K] that is False for queries that see no key).

    A mask that is only causal from position 0 (training, and decoder self-attention without a
    cache) and/or key lengths goes as ``is_causal`` / ``key_value_seq_lengths``: cuDNN then picks its
    causal and padding kernels, which skip masked blocks, and nothing of size [L, S] is built. Any
    other mask is materialised and passed dense.
    """
    if (isinstance(mask, masks.AttentionMask) and mask.dense is None and mask.kv_valid is None
            and mask.q_segment_ids is None and mask.causal_offset is None):
        lengths = mask.kv_lengths
        if mask.kv_limit is not None:
            limit = jnp.full((batch,), mask.kv_limit, jnp.int32)
            lengths = limit if lengths is None else jnp.minimum(lengths, limit)
        if lengths is None:  # every query sees key 0 at least
            return dict(is_causal=mask.causal), None
        lengths = jnp.broadcast_to(lengths.astype(jnp.int32), (batch,))
        # A row with no key goes to the kernel with one (a fully masked row may give NaN statistics
        # in a fused kernel's backward pass) and is zeroed afterwards, its gradient with it.
        visible = (lengths > 0)[:, None, None, None]
        return dict(is_causal=mask.causal, key_value_seq_lengths=jnp.maximum(lengths, 1)), visible
    mask = _materialize(mask)
    if mask is None:
        return {}, None
    return dict(mask=mask), jnp.swapaxes(jnp.any(mask, axis=-1), 1, 2)[..., None]


def _fused_attention(q, k, v, mask, implementation):
    """jax.nn.dot_product_attention ('xla' everywhere, 'cudnn' on NVIDIA GPUs)."""
    # 'cudnn' off a GPU is named here: JAX's own error comes from deep inside it ("cuDNN is not
    # detected"), after this message had sent a float32 model to bfloat16 for nothing.
    problem = impl_problem(implementation, dtype=q.dtype, head_dim=q.shape[-1])
    if problem:
        raise NotImplementedError(f"attention_impl={problem}")
    kwargs, visible = _fused_mask_args(mask, q.shape[0])
    if implementation == "cudnn" and "mask" in kwargs:
        # cuDNN takes a mask (as a bias) of the full [.., L, S] only: a key-padding mask [B, 1, 1, S]
        # or a dense one with broadcast axes is spread out here (JAX refuses it otherwise).
        dense = kwargs["mask"]
        kwargs["mask"] = jnp.broadcast_to(dense, dense.shape[:2] + (q.shape[1], k.shape[1]))
    # One batch row, head, query and key in bf16: XLA:CPU rewrites the product of two vectors
    # into an elementwise one, which cannot honour the bf16 x bf16 -> float32 algorithm the 'xla'
    # path asks for ("Algorithm not supported by the ElementalIrEmitter": a one-token source
    # through a one-head bf16 encoder). One key's weight is 1, so the output is that value's row.
    single = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[1] == 1
    if implementation == "xla" and jax.default_backend() == "cpu" and (
            q.dtype == jnp.float16 or (q.dtype == jnp.bfloat16 and single)):
        # XLA:CPU has no float16 x float16 -> float32 product, which the 'xla' path asks for: the
        # attention runs in float32 there and rounds once (what its float32 accumulation gives).
        out = jax.nn.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                           implementation=implementation, **kwargs).astype(q.dtype)
    else:
        out = jax.nn.dot_product_attention(q, k, v, implementation=implementation, **kwargs)
    if visible is not None:  # the fused kernels average V over a fully masked row; we want zeros
        out = jnp.where(visible, out, jnp.zeros((), out.dtype))
    return out


def _dense_attention_lse(q, k, v, q_seg, kv_seg, causal):
    """What `native.sequence_attention_forward` computes, in XLA ops: (out, lse [B, H, T])."""
    B, T, H, D = q.shape
    N = k.shape[2]
    visible = (q_seg[:, :, None] == kv_seg[:, None, :]) & (kv_seg[:, None, :] != 0)
    if causal:
        visible &= jnp.tril(jnp.ones((T, k.shape[1]), jnp.bool_))
    visible = visible[:, None, None]  # [B, 1, 1, T, S] against [B, N, G, T, S]
    q = q.reshape(B, T, N, H // N, D) / jnp.sqrt(jnp.float32(D))
    logits = jnp.where(visible, jnp.einsum("BTNGD,BSND->BNGTS", q, k), -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)
    probs = jnp.where(visible, jnp.exp(logits - jnp.where(jnp.isfinite(lse), lse, 0)[..., None]), 0)
    out = jnp.einsum("BNGTS,BSND->BTNGD", probs, v).reshape(B, T, H, D)
    return out, lse.reshape(B, H, T)


def _dense_attention_vjp(q, k, v, q_seg, kv_seg, g, causal):
    """What `native.sequence_attention_backward` computes, in XLA ops: (dq, dk, dv)."""
    forward = lambda q, k, v: _dense_attention_lse(q, k, v, q_seg, kv_seg, causal)[0]
    return jax.vjp(forward, q, k, v)[1](g)


# The kernels' own derivatives, for forward mode over reverse mode: differentiating a
# gradient (a Hessian-vector product `jax.jvp(jax.grad(f), ...)`, `jax.hessian`, a gradient
# penalty's gradient) takes the derivatives of the forward and backward kernels, which custom calls
# do not have. Their tangents are XLA's ops', as `rows_matmul`'s are; the values stay the kernels'.
def _kernel_forward_tangent(primals, tangents, causal):
    q, k, v, q_seg, kv_seg = primals
    dense = lambda q, k, v: _dense_attention_lse(q, k, v, q_seg, kv_seg, causal)
    (_, lse), (d_out, d_lse) = jax.jvp(dense, (q, k, v), tuple(tangents[:3]))
    # A query that sees no key has lse -inf, and logsumexp's tangent there is 0/0.
    return d_out, jnp.where(jnp.isfinite(lse), d_lse, 0.0)


def _kernel_backward_tangent(primals, tangents, causal):
    # out and lse are the forward's, functions of q, k and v: the XLA ops recompute them from those,
    # so their tangents (carried by q's, k's and v's) are not read here.
    q, k, v, out, lse, g, q_seg, kv_seg = primals
    dq, dk, dv, _, _, dg, _, _ = tangents
    dense = lambda q, k, v, g: _dense_attention_vjp(q, k, v, q_seg, kv_seg, g, causal)
    return jax.jvp(dense, (q, k, v, g), (dq, dk, dv, dg))[1]


_kernel_forward_p = native.differentiable_call(
    "transformer_jax_attention_forward", native.sequence_attention_forward, _kernel_forward_tangent)
_kernel_backward_p = native.differentiable_call(
    "transformer_jax_attention_backward", native.sequence_attention_backward, _kernel_backward_tangent)


def _kernel_forward(q, k, v, q_seg, kv_seg, causal):
    return tuple(derivatives.bind(_kernel_forward_p, q, k, v, q_seg, kv_seg, causal=bool(causal)))


def _kernel_backward(q, k, v, q_seg, kv_seg, out, lse, g, causal):
    return tuple(derivatives.bind(_kernel_backward_p, q, k, v, out, lse, g, q_seg, kv_seg,
                                  causal=bool(causal)))


def _native_forward(q, k, v, q_seg, kv_seg, causal):
    return jax.lax.platform_dependent(
        q, k, v, q_seg, kv_seg, cpu=functools.partial(_kernel_forward, causal=causal),
        default=functools.partial(_dense_attention_lse, causal=causal))


def _attention_tangent(q, k, v, out, lse, q_seg, kv_seg, dq, dk, dv, *, causal):
    # The tangent of the output in XLA's ops (dense attention, which recomputes the probabilities
    # from q and k; out and lse are there for the transpose rule below).
    dense = lambda q, k, v: _dense_attention_lse(q, k, v, q_seg, kv_seg, causal)[0]
    return jax.jvp(dense, (q, k, v), (dq, dk, dv))[1]


def _attention_tangent_transpose(g, q, k, v, out, lse, q_seg, kv_seg, *, causal):
    # The cotangents of (dq, dk, dv): the backward kernel on the CPU, XLA's VJP elsewhere.
    def on_cpu(q, k, v, q_seg, kv_seg, out, lse, g):
        return _kernel_backward(q, k, v, q_seg, kv_seg, out, lse, g, causal)

    def elsewhere(q, k, v, q_seg, kv_seg, out, lse, g):
        return _dense_attention_vjp(q, k, v, q_seg, kv_seg, g, causal)

    return jax.lax.platform_dependent(q, k, v, q_seg, kv_seg, out, lse, g, cpu=on_cpu, default=elsewhere)


# The output tangent of `_native_attention`, linear in (dq, dk, dv): its value is XLA's dense JVP,
# and JAX transposes it (reverse mode) into the backward kernel's call.
_attention_tangent_p = derivatives.linear_tangent(
    "transformer_jax_attention_tangent", _attention_tangent, _attention_tangent_transpose, 3)


@functools.partial(jax.custom_jvp, nondiff_argnums=(5,))
def _native_attention(q, k, v, q_seg, kv_seg, causal):
    """float32 attention by the package's CPU kernels, forward and backward; XLA's ops elsewhere.
    Forward mode takes the tangent from XLA's ops; reverse mode transposes it into the backward
    kernel (`_attention_tangent_p`)."""
    return _native_forward(q, k, v, q_seg, kv_seg, causal)[0]


@functools.partial(_native_attention.defjvp, symbolic_zeros=True)
def _native_attention_jvp(causal, primals, tangents):
    q, k, v, q_seg, kv_seg = primals
    out, lse = _native_forward(q, k, v, q_seg, kv_seg, causal)
    # Named so that remat='dots_saveable' keeps them: the backward kernel needs only these and its
    # inputs, where recomputing them would run the forward kernel again.
    out = checkpoint_name(out, "attention_out")
    lse = checkpoint_name(lse, "attention_lse")
    dq, dk, dv = (jnp.zeros(x.shape, x.dtype) if derivatives.is_zero(t) else t
                  for x, t in zip((q, k, v), tangents[:3]))
    d_out = derivatives.bind(_attention_tangent_p, q, k, v, out, lse, q_seg, kv_seg, dq, dk, dv,
                             causal=bool(causal))
    return out, d_out


def native_attention(q, k, v, mask):
    """Attention by `native.sequence_attention_forward`, for what `native.sequence_attention_fits`
    accepts: bfloat16 inputs are widened to float32 and the output rounded back."""
    causal, q_seg, kv_seg = native.sequence_attention_mask_args(mask, q.shape[0], q.shape[1], k.shape[1])
    out = _native_attention(*(x.astype(jnp.float32) for x in (q, k, v)), q_seg, kv_seg, causal)
    return out.astype(q.dtype)


# Above this many query x key pairs 'auto' switches to the chunked kernel where no fused one applies
# (always on CPU): the dense backends hold B*H*L*S float32 logits (at 8k x 8k, 256 MiB per head and
# batch row).
CHUNKED_THRESHOLD = 8192 * 8192


# cuDNN's fused attention takes 16-bit (or fp8) inputs only, and head dimensions that are multiples
# of 8 up to 128 (256 from Hopper on; 128 is the bound every supported GPU meets).
CUDNN_MAX_HEAD_DIM = 128


def _cudnn_supports(dtype, head_dim: int) -> bool:
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and head_dim % 8 == 0 and head_dim <= CUDNN_MAX_HEAD_DIM)


def impl_problem(impl: str, *, dtype, head_dim: int, backend: str | None = None) -> str | None:
    """Why an explicitly chosen attention backend cannot run on ``backend`` (default: JAX's) for
    this dtype and head dimension, or None: what a training config is checked against before
    anything is built ('auto', 'xla', 'reference' and 'chunked' run everywhere)."""
    backend = backend or jax.default_backend()
    if impl == "flash" and backend not in ("gpu", "tpu"):
        return (f"'flash' needs a TPU (Pallas kernel) or an NVIDIA GPU (cuDNN); this is {backend!r}: "
                "use 'chunked' (memory-efficient, pure JAX), 'xla' or 'auto'")
    if impl == "cudnn" and backend != "gpu":
        return f"'cudnn' needs an NVIDIA GPU; this is {backend!r}: use 'auto' or 'xla'"
    if impl in ("cudnn", "flash") and backend == "gpu" and not _cudnn_supports(dtype, head_dim):
        return (f"{impl!r} runs cuDNN on a GPU, which needs float16 or bfloat16 and a head dimension "
                f"that is a multiple of 8, at most {CUDNN_MAX_HEAD_DIM}; got {jnp.dtype(dtype)} and "
                f"{head_dim}: set ModelConfig.dtype='bfloat16', or attention_impl='auto' or 'xla'")
    return None


def resolve_impl(impl: str, *, need_weights: bool = False, dropout_active: bool = False,
                 q_length: int = 0, kv_length: int = 0, mask=None, dtype=jnp.bfloat16,
                 head_dim: int = 64) -> str:
    """The backend that will run.

    'auto' picks cuDNN on GPU for float16/bfloat16 inputs whose head dimension it takes (a
    float32 model gets XLA there: cuDNN has no float32 kernel), the Pallas flash kernel on TPU
    (when it supports the mask), and otherwise XLA, or 'chunked' once L*S exceeds
    `CHUNKED_THRESHOLD`. The reference path runs whenever attention weights or attention dropout
    are needed.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention impl {impl!r} is not one of {list(ATTENTION_IMPLS)}")
    if need_weights or dropout_active:
        return "reference"
    if impl != "auto":
        return impl
    backend = jax.default_backend()
    if backend == "gpu" and _cudnn_supports(dtype, head_dim):
        return "cudnn"
    if backend == "tpu" and _pallas_tpu_supports(mask, q_length, kv_length):
        return "flash"
    return "chunked" if q_length * kv_length > CHUNKED_THRESHOLD else "xla"


def _materialize(mask):
    return mask.materialize() if isinstance(mask, masks.AttentionMask) else mask


def _pallas_tpu_supports(mask, q_length, kv_length) -> bool:
    """The Pallas TPU kernel takes causal (no offset) and segment-id masks, block-aligned lengths."""
    if q_length % 128 or kv_length % 128:
        return False
    if mask is None:
        return True
    return (isinstance(mask, masks.AttentionMask) and mask.dense is None and mask.kv_lengths is None
            and mask.causal_offset is None and mask.kv_limit is None
            and (mask.q_segment_ids is None or mask.kv_valid is None))


def _pallas_tpu_flash(q, k, v, mask):
    """jax.experimental.pallas.ops.tpu.flash_attention: [B, H, L, K] layout, K/V heads repeated."""
    from jax.experimental.pallas.ops.tpu import flash_attention as pallas_flash

    B, L, H, K = q.shape
    S, N = k.shape[1:3]
    k, v = (jnp.repeat(x, H // N, axis=2) if N != H else x for x in (k, v))
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    segment_ids, causal, q_valid = None, False, None
    if mask is not None:
        causal = mask.causal
        if mask.q_segment_ids is not None:
            q_ids, kv_ids = mask.q_segment_ids, mask.kv_segment_ids
        elif mask.kv_valid is not None:  # key padding as two segments: 1 = real, 0 = padding
            q_ids, kv_ids = jnp.ones((B, L), jnp.int32), mask.kv_valid.astype(jnp.int32)
        if mask.q_segment_ids is not None or mask.kv_valid is not None:
            # ids of one row stand for every row, as the mask broadcasts them elsewhere
            q_ids, kv_ids = jnp.broadcast_to(q_ids, (B, L)), jnp.broadcast_to(kv_ids, (B, S))
            segment_ids = pallas_flash.SegmentIds(q=q_ids, kv=kv_ids)
            q_valid = _queries_that_see_a_key(q_ids, kv_ids, causal)
    out = pallas_flash.flash_attention(q, k, v, segment_ids=segment_ids, causal=causal,
                                       sm_scale=K**-0.5)
    out = jnp.swapaxes(out, 1, 2)
    if q_valid is not None:  # rows that see no key: zeros, like every other backend
        out = out * q_valid[:, :, None, None].astype(out.dtype)
    return out


def _queries_that_see_a_key(q_ids, kv_ids, causal: bool):
    """bool [B, L]: query i has a key j with kv_ids[j] == q_ids[i] != 0 (and j <= i when causal).
    The Pallas kernel gives such a query an average of values instead of zeros: a causal query before
    the first real key of a left-padded row, a packed target segment with no source of its id. The
    first key of each id is found by a sort of the keys' ids, O((L + S) log S), not an [L, S] mask."""
    order = jnp.argsort(kv_ids, axis=1, stable=True)  # ties keep key order: the first key comes first
    ids = jnp.take_along_axis(kv_ids, order, axis=1)
    at = jnp.minimum(jax.vmap(jnp.searchsorted)(ids, q_ids), kv_ids.shape[1] - 1)
    seen = (jnp.take_along_axis(ids, at, axis=1) == q_ids) & (q_ids != 0)
    if causal:
        seen &= jnp.take_along_axis(order, at, axis=1) <= jnp.arange(q_ids.shape[1])[None, :]
    return seen


def _flash_attention(q, k, v, mask):
    backend = jax.default_backend()
    if backend == "gpu":
        return _fused_attention(q, k, v, mask, "cudnn")
    if backend == "tpu":
        if not _pallas_tpu_supports(mask, q.shape[1], k.shape[1]):
            raise NotImplementedError(
                "attention_impl='flash' on TPU takes causal/segment/key-padding masks and lengths "
                "that are multiples of 128; use 'chunked' or 'xla' for this mask")
        return _pallas_tpu_flash(q, k, v, mask)
    raise NotImplementedError(f"attention_impl={impl_problem('flash', dtype=q.dtype, head_dim=q.shape[-1])}")


_check_inputs = masks.check_attention_inputs


def _plain_cache_attention(q, k, v, mask):
    """What `native.cache_attention` computes, in XLA ops (float32 out)."""
    return _reference_attention(q, k, v, mask, dropout_rate=0.0, dropout_rng=None, deterministic=True,
                                kv_layout="BNSK")[0].astype(jnp.float32)


_cache_attention_p = native.with_xla_derivatives(
    "transformer_jax_cache_attention",
    lambda q, k, v, mask: jax.lax.platform_dependent(q, k, v, mask, cpu=native.cache_attention,
                                                     default=_plain_cache_attention),
    _plain_cache_attention)


def _cache_attention(q, k, v, mask):
    """Attention over a heads-first cache: the native kernel on the CPU, XLA's ops elsewhere.
    Its derivatives are the XLA path's, so a model call with a cache stays differentiable."""
    if mask is None:
        mask = jnp.ones((q.shape[0], 1, 1, k.shape[2]), jnp.bool_)
    return _cache_attention_p(q, k, v, mask)


# `native.cache_write` on the CPU, XLA's update elsewhere; differentiable (the write is linear in
# the cache and the new entries).
_native_cache_write = native.with_xla_derivatives(
    "transformer_jax_cache_write",
    lambda cache, new, index: jax.lax.platform_dependent(cache, new, index, cpu=native.cache_write,
                                                         default=native.cache_write_xla),
    native.cache_write_xla)


def dot_product_attention(
    q, k, v, mask=None, *, impl="auto", dropout_rate=0.0, dropout_rng=None,
    deterministic=True, return_weights=False, kv_layout="BSNK", cpu_kernels="xla",
):
    """Eq. 1: Attention(Q, K, V) = softmax(QK^T / sqrt(d_k)) V.

    q: [B, L, H, K]; k, v: [B, S, N, K] (N divides H); mask: bool [B, 1|H, L|1, S] (True = attend)
    or a `masks.AttentionMask` (its ingredients; the dense backends materialise it, 'chunked' and
    'flash' compute it tile by tile). impl: 'auto' | 'reference' | 'xla' | 'cudnn' | 'chunked' |
    'flash' (see `resolve_impl`). A query that sees no key gets a zero output on every backend.
    kv_layout 'BNSK': k, v are [B, N, S, K] (the KV cache); 'xla' and 'reference' then contract
    them in place (with positions first, XLA would copy a transposed cache every decoding step),
    the other backends get them as [B, S, N, K]. With 'xla' or 'auto', a float32 'BNSK' cache, up
    to 16 queries, no dropout or weights, and `native.use_native(cpu_kernels)` (see
    `ModelConfig.cpu_kernels`), a CPU computation runs `native.cache_attention` instead; with 'xla'
    or 'auto' and 'BSNK' inputs of more than 16 queries that `native.sequence_attention_fits`,
    `native_attention` (forward and backward kernels; reverse-mode differentiation only).
    Returns (out [B, L, H, K], probs [B, H, L, S] float32 or None).
    """
    _check_inputs(q, k, v, mask, kv_layout)
    impl = resolve_impl(
        impl, need_weights=return_weights,
        dropout_active=not deterministic and dropout_rate > 0.0,
        q_length=q.shape[1], kv_length=k.shape[kv_layout.index("S")], mask=mask,
        dtype=q.dtype, head_dim=q.shape[-1],
    )
    if len({q.dtype, k.dtype, v.dtype}) > 1:
        # A cache in another dtype than the queries (cache.cache_dtype): the fused kernels take one
        # 16-bit dtype, so K and V join the queries'; the others compute in the wider of the two.
        wide = jnp.promote_types(q.dtype, jnp.promote_types(k.dtype, v.dtype))
        dtype = q.dtype if impl in ("cudnn", "flash") else wide
        q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    # The KV cache at decoding steps (impl 'xla': no attention weights or dropout, for which
    # resolve_impl says 'reference') may go to the native CPU kernel.
    dense = _materialize(mask)
    if (kv_layout == "BNSK" and impl == "xla" and native.attention_fits(q, k, v, dense)
            and native.use_native(cpu_kernels)):
        return _cache_attention(q, k, v, dense).astype(v.dtype), None
    if kv_layout == "BNSK" and impl not in ("xla", "reference"):
        k, v, kv_layout = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), "BSNK"
    if kv_layout == "BNSK":
        out, probs = _reference_attention(
            q, k, v, _materialize(mask), dropout_rate=dropout_rate, dropout_rng=dropout_rng,
            deterministic=deterministic, kv_layout=kv_layout,
        )
        return out, (probs if return_weights else None)
    if impl == "chunked":
        return chunked_attention(q, k, v, mask), None
    if impl == "flash":
        return _flash_attention(q, k, v, mask), None
    # Whole sequences (training, evaluation, a long prompt's prefill) on the CPU: the native kernels
    # (forward and reverse mode; the tangents are XLA's dense ops'). A few queries stay on XLA's
    # ops, where the kernel saves little.
    if (impl == "xla" and q.shape[1] > native.MAX_ROWS and native.sequence_attention_fits(q, k, v, mask)
            and native.use_native(cpu_kernels)):
        return native_attention(q, k, v, mask), None
    if impl in ("xla", "cudnn"):
        return _fused_attention(q, k, v, mask, impl), None
    if impl == "reference":
        out, probs = _reference_attention(
            q, k, v, _materialize(mask), dropout_rate=dropout_rate, dropout_rng=dropout_rng,
            deterministic=deterministic,
        )
        return out, (probs if return_weights else None)
    raise AssertionError(f"resolve_impl returned {impl!r}")  # it checks the name


class Projection(nn.Module):
    """y = x W + b contracting `axis` of x with the input axes of a full-shape kernel.

    The kernel is created in its real shape (e.g. [D, H, K]) so that its logical axis names
    `names` (input axes, then output axes) line up with its dimensions under a mesh. With
    ``kernel_layout='out_in'`` it is stored output axes first ([H, K, D] -> [D, H, K] for the
    attention output; PyTorch's nn.Linear order), names reordered to match: the same function,
    a layout XLA:CPU streams faster in decoding steps (see `matmul.contract_transposed`).
    """

    features: tuple[int, ...]
    names: tuple[str, ...]
    axis: tuple[int, ...] = (-1,)
    use_bias: bool = True
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    kernel_layout: str = "in_out"
    cpu_kernels: str = "xla"  # see ModelConfig.cpu_kernels
    kernel_init: Callable | None = None  # default: Glorot uniform over the input/output axes
    out_dtype: jnp.dtype | None = None  # default: `dtype` (the output layer keeps float32 logits)
    # Applied to the output (after its rounding to out_dtype): a feed-forward layer's first product.
    # In a decoding step on the CPU kernels, bias, rounding and activation are one native pass.
    activation: str | None = None

    @nn.compact
    def __call__(self, x):
        axis = tuple(a % x.ndim for a in self.axis)
        n_in, n_out = len(axis), len(self.features)
        in_shape = tuple(x.shape[a] for a in axis)
        out_first = self.kernel_layout in ("out_in", "packed")
        packed = self.kernel_layout == "packed"
        if out_first:
            shape, names = self.features + in_shape, self.names[n_in:] + self.names[:n_in]
            in_axes, out_axes = tuple(range(n_out, n_out + n_in)), tuple(range(n_out))
        else:
            shape, names = in_shape + self.features, self.names
            in_axes, out_axes = tuple(range(n_in)), tuple(range(n_in, n_in + n_out))
        init = self.kernel_init or nn.initializers.xavier_uniform(in_axis=in_axes, out_axis=out_axes)
        if packed:
            init = _packed_init(init, n_out)
        kernel = self.param("kernel", nn.with_logical_partitioning(init, names), shape,
                            self.param_dtype)
        # Low-precision inputs, float32 accumulation (and bias add), one rounding at the end: on
        # CPU and GPU the bf16 x bf16 -> f32 product is also the fast one.
        x, kernel = x.astype(self.dtype), jnp.asarray(kernel, self.dtype)
        out_dtype = jnp.dtype(self.out_dtype or self.dtype)
        bias = None
        if self.use_bias:
            bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros,
                                                                    self.names[n_in:]),
                              self.features, self.param_dtype)
        trailing = axis == tuple(range(x.ndim - n_in, x.ndim))
        rows = math.prod(x.shape[:x.ndim - n_in])
        if packed:  # a decoding step's few rows, in bf16 (native.packed_dense)
            fits = rows <= native.MAX_ROWS and native.packed_fits(rows, x.dtype)
        elif out_first:
            fits = 1 <= rows <= native.MAX_ROWS
        else:
            fits = native.cols_fit(rows, math.prod(self.features), x.dtype)
        # A packed product takes its bias (and rounding) in the same call even with no activation
        # (native.packed_dense): that replaces XLA's fusion of bias and rounding after it.
        activation = "none" if self.activation is None and packed and bias is not None else self.activation
        if (activation in native.ACTIVATION_CODES and trailing and (packed or n_in == n_out == 1) and fits
                and x.dtype in (jnp.bfloat16, jnp.float32)
                and out_dtype in (jnp.bfloat16, jnp.float32) and native.use_native(self.cpu_kernels)):
            return _native_dense(x, kernel, bias, activation, out_dtype, out_first, packed, n_in, n_out)
        if not trailing and packed:  # the general product below reads the weight as stored
            kernel = unpack_kernel(kernel, n_out)
        if trailing and packed:
            y = contract_packed(x, kernel, n_in, cpu_kernels=self.cpu_kernels)
        elif trailing and out_first:
            y = contract_transposed(x, kernel, n_in, cpu_kernels=self.cpu_kernels)
        elif trailing:
            y = contract(x, kernel, n_in, cpu_kernels=self.cpu_kernels)
        else:
            y = jax.lax.dot_general(x, kernel, ((axis, in_axes), ((), ())),
                                    preferred_element_type=jnp.float32)
        if bias is not None:
            y = y + jnp.asarray(bias, jnp.float32)
        y = y.astype(out_dtype)
        return activation_fn(self.activation)(y) if self.activation else y


def _packed_init(init, n_out: int):
    """`init` for a kernel stored packed: the same values, in the packed order (`pack_kernel`)."""

    def packed_init(key, shape, dtype=jnp.float32):
        return pack_kernel(init(key, shape, dtype), n_out)

    return packed_init


def pack_kernel(kernel, n_out: int):
    """An output-axes-first kernel [out..., in...] (its first `n_out` axes the outputs) with its
    [out, in] matrix in `native.pack_kernel`'s order (``kernel_layout='packed'``); numpy or JAX."""
    rows = math.prod(kernel.shape[:n_out])
    return native.pack_kernel(kernel.reshape(rows, -1)).reshape(kernel.shape)


def unpack_kernel(kernel, n_out: int):
    """The output-axes-first kernel that `pack_kernel` packed."""
    rows = math.prod(kernel.shape[:n_out])
    return native.unpack_kernel(kernel.reshape(rows, -1)).reshape(kernel.shape)


def _native_dense(x, kernel, bias, activation, out_dtype, out_first, packed=False, n_in=1, n_out=1):
    """act(x W + b) for a few rows through the CPU kernels: the product (of a kernel stored
    [out, in] if `out_first`, packed if `packed`, else [in, out]), then bias, rounding and
    activation in one pass (`native.bias_activation`; packed: all in one call,
    `native.packed_dense`); XLA's ops where the computation is not on the CPU. x's last `n_in`
    axes are contracted with the kernel's input axes, and its `n_out` output axes end the result
    (more than one of either for a kernel stored output-first only)."""
    features = kernel.shape[:n_out] if out_first else kernel.shape[n_in:]
    size = math.prod(features)
    x2 = x.reshape(-1, math.prod(x.shape[x.ndim - n_in:]))
    kernel = kernel.reshape(size, -1) if out_first else kernel.reshape(-1, size)
    b = jnp.zeros((size,), jnp.float32) if bias is None else jnp.asarray(bias, jnp.float32).reshape(size)
    contracted = 1 if out_first else 0
    shape = x.shape[:x.ndim - n_in] + tuple(features)

    def on_cpu(x2, kernel, b):
        if packed:  # written in the result's shape: XLA:CPU copied a reshape of [R, O] after it
            return native.packed_dense(x2, kernel, b, activation, out_dtype, shape)
        if out_first:
            y = native.bias_activation(native.rows_matmul(x2, kernel), b, activation, out_dtype)
        else:
            y = native.bias_activation(native.cols_matmul(x2, kernel), b, activation, out_dtype,
                                       rows_first=True)
        return y.reshape(shape)

    def elsewhere(x2, kernel, b):
        if packed:
            y = native.packed_matmul_xla(x2, kernel)
        else:
            y = jax.lax.dot_general(x2, kernel, (((1,), (contracted,)), ((), ())),
                                    preferred_element_type=jnp.float32)
        return native.bias_activation_xla(y, b, activation, out_dtype).reshape(shape)

    return jax.lax.platform_dependent(x2, kernel, b, cpu=on_cpu, default=elsewhere)


def projection(features, names, *, axis=-1, use_bias, dtype, param_dtype, name,
               kernel_layout="in_out", cpu_kernels="xla", **options):
    """A `Projection` to `features` (int or tuple) whose parameters carry logical `names`."""
    features = tuple(features) if isinstance(features, tuple | list) else (features,)
    axis = axis if isinstance(axis, tuple) else (axis,)
    return Projection(features, tuple(names), axis, use_bias, dtype, param_dtype, kernel_layout,
                      cpu_kernels, name=name, **options)


def fuse_qkv(q, k, v, axis: int):
    """Query, key and value parameters (kernels or biases of one layout) as the one parameter of
    ``ModelConfig.fused_qkv``: `axis` is q's query-head axis (H heads) and k's and v's key/value-head
    axis (N heads, N dividing H); the result has N there, followed by a new axis of G + 2 slots
    (G = H / N): the G query heads that read key/value head n, then its key, then its value."""
    heads, kv_heads = q.shape[axis], k.shape[axis]
    q = q.reshape(q.shape[:axis] + (kv_heads, heads // kv_heads) + q.shape[axis + 1:])
    k, v = jnp.expand_dims(k, axis + 1), jnp.expand_dims(v, axis + 1)
    return jnp.concatenate([q, k.astype(q.dtype), v.astype(q.dtype)], axis=axis + 1)


def split_qkv(qkv, axis: int):
    """`fuse_qkv` undone: (q, k, v) from the fused parameter, `axis` its key/value-head axis."""
    take = lambda start, stop: jax.lax.slice_in_dim(qkv, start, stop, axis=axis + 1)
    groups = qkv.shape[axis + 1] - 2
    q = take(0, groups)
    q = q.reshape(q.shape[:axis] + (q.shape[axis] * groups,) + q.shape[axis + 2:])
    k, v = (jnp.squeeze(take(i, i + 1), axis + 1) for i in (groups, groups + 1))
    return q, k, v


def _fused_qkv_init(num_heads: int, num_kv_heads: int, head_dim: int, out_first: bool):
    """The fused kernel initialised as the three separate ones would be (Glorot uniform over each
    projection's own input and output axes), then fused."""

    def init(key, shape, dtype=jnp.float32):
        d_model = shape[-1] if out_first else shape[0]
        keys = jax.random.split(key, 3)
        kernels = []
        for k, heads in zip(keys, (num_heads, num_kv_heads, num_kv_heads), strict=True):
            if out_first:
                part = nn.initializers.xavier_uniform(in_axis=(2,), out_axis=(0, 1))(
                    k, (heads, head_dim, d_model), dtype)
            else:
                part = nn.initializers.xavier_uniform(in_axis=(0,), out_axis=(1, 2))(
                    k, (d_model, heads, head_dim), dtype)
            kernels.append(part)
        return fuse_qkv(*kernels, axis=0 if out_first else 1)

    return init


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1..head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

    Self-attention when `inputs_kv` is None, cross-attention otherwise. With `num_kv_heads` < heads,
    groups of query heads share one key/value head (GQA; 1 = multi-query).
    """

    d_model: int
    num_heads: int
    head_dim: int
    num_kv_heads: int
    use_bias: bool = True
    rope_theta: float | None = None  # rotary positions on queries and keys when set
    attention_dropout_rate: float = 0.0
    attention_impl: str = "auto"
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    kernel_layout: str = "in_out"
    cpu_kernels: str = "xla"  # see ModelConfig.cpu_kernels
    # Self-attention only: Q, K and V from one stored kernel, `qkv` [D, N, G + 2, K] (see
    # ModelConfig.fused_qkv and `fuse_qkv`), instead of `query`, `key` and `value`.
    fused_qkv: bool = False

    def setup(self):
        def heads_proj(heads, names, name):
            return projection((heads, self.head_dim), names, use_bias=self.use_bias,
                              dtype=self.dtype, param_dtype=self.param_dtype,
                              kernel_layout=self.kernel_layout, cpu_kernels=self.cpu_kernels,
                              name=name)

        if self.fused_qkv:
            if self.num_heads % self.num_kv_heads:
                raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads="
                                 f"{self.num_kv_heads}")
            groups = self.num_heads // self.num_kv_heads
            self.qkv = projection(
                (self.num_kv_heads, groups + 2, self.head_dim), ("embed", "kv_heads", "qkv", "kv"),
                use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype,
                kernel_layout=self.kernel_layout, cpu_kernels=self.cpu_kernels, name="qkv",
                kernel_init=_fused_qkv_init(self.num_heads, self.num_kv_heads, self.head_dim,
                                            self.kernel_layout in ("out_in", "packed")))
        else:
            self.query = heads_proj(self.num_heads, ("embed", "heads", "kv"), "query")
            self.key = heads_proj(self.num_kv_heads, ("embed", "kv_heads", "kv"), "key")
            self.value = heads_proj(self.num_kv_heads, ("embed", "kv_heads", "kv"), "value")
        self.out = projection(self.d_model, ("heads", "kv", "embed"), axis=(-2, -1),
                              use_bias=self.use_bias, dtype=self.dtype,
                              param_dtype=self.param_dtype, kernel_layout=self.kernel_layout,
                              cpu_kernels=self.cpu_kernels, name="out")

    def project_kv(self, inputs_kv, kv_positions=None):
        """K and V for `inputs_kv` [B, S, D] -> two [B, S, N, K] (cross-attention caches these)."""
        k, v = self.key(inputs_kv), self.value(inputs_kv)
        if self.rope_theta is not None:
            k = apply_rope(k, kv_positions, self.rope_theta)
        return k, v

    def _self_projections(self, x, positions):
        """Q, K and V of self-attention: three products, or with `fused_qkv` one product against
        the kernel stored fused. (Stacking the three kernels at each call for one product was
        measured no faster in training on the CPU this was tuned on, and copied the kernels every
        step: `benchmarks/NOTES.md`.)"""
        if self.fused_qkv:
            y = self.qkv(x)  # [B, L, N, G + 2, K]
            groups = self.num_heads // self.num_kv_heads
            q = y[..., :groups, :].reshape(*y.shape[:-3], self.num_heads, self.head_dim)
            k, v = y[..., groups, :], y[..., groups + 1, :]
            if self.rope_theta is not None:
                k = apply_rope(k, positions, self.rope_theta)
            return q, k, v
        k, v = self.project_kv(x, positions)
        return self.query(x), k, v

    def __call__(
        self, inputs_q, inputs_kv=None, *, mask=None, q_positions=None, kv_positions=None,
        precomputed_kv=None, cache=None, cache_index=None, deterministic=True,
    ):
        """inputs_q: [B, L, D]; inputs_kv: [B, S, D] for cross-attention (None: self-attention);
        mask: bool [B, 1, L, S] (True = attend) or a `masks.AttentionMask`.

        precomputed_kv: (k, v) [B, N, S, K], heads first, already projected by `project_kv`
        (cross-attention during decoding: the source's K/V are computed once, and stored in the
        layout the attention matmuls read without a copy).
        cache: {'k', 'v'} [B, N, S_max, K] for self-attention decoding: the new keys and values
        are written at each row's `cache_index` [B], and attention runs over all S_max slots (the
        mask hides the unwritten ones). Returns (out [B, L, D], updated cache or None).
        """
        if precomputed_kv is None and inputs_kv is None:
            q, k, v = self._self_projections(inputs_q, q_positions)
        elif self.fused_qkv:
            raise ValueError("fused_qkv is for self-attention: this layer has no separate query, key "
                             "and value projections for cross-attention")
        else:
            q = self.query(inputs_q)
            k, v = precomputed_kv if precomputed_kv is not None else self.project_kv(inputs_kv, kv_positions)
        if self.rope_theta is not None:
            q = apply_rope(q, q_positions, self.rope_theta)
        kv_layout = "BSNK" if precomputed_kv is None else "BNSK"
        if cache is not None:
            # [B, L, N, K] -> [B, N, L, K], written at each row's own position along S_max: a
            # bf16 cache on the CPU kernels in place (XLA:CPU would convert all of it), else by XLA.
            if native.use_native(self.cpu_kernels) and cache["k"].dtype == jnp.bfloat16:
                write = _native_cache_write
            else:
                write = native.cache_write_xla
            k, v = write(cache["k"], k, cache_index), write(cache["v"], v, cache_index)
            cache, kv_layout = {"k": k, "v": v}, "BNSK"
        q = nn.with_logical_constraint(q, ("batch", "length", "heads", "kv"))

        want_weights = self.is_mutable_collection("intermediates")
        dropout_rng = None
        if not deterministic and self.attention_dropout_rate > 0.0:
            dropout_rng = self.make_rng("dropout")
        if cache is None and precomputed_kv is None:  # a cache is read in its own dtype (see
            k, v = k.astype(self.dtype), v.astype(self.dtype)  # cache.cache_dtype)
        out, probs = dot_product_attention(
            q, k, v, mask, impl=self.attention_impl,
            dropout_rate=self.attention_dropout_rate, dropout_rng=dropout_rng,
            deterministic=deterministic, return_weights=want_weights, kv_layout=kv_layout,
            cpu_kernels=self.cpu_kernels,
        )
        if want_weights:
            self.sow("intermediates", "attention_weights", probs)
        out = nn.with_logical_constraint(out, ("batch", "length", "heads", "kv"))
        return self.out(out), cache


