"""Memory-efficient attention in pure JAX: Eq. 1 computed tile by tile with an online softmax.

The algorithm of Rabe & Staats (2021, "Self-attention does not need O(n^2) memory") and FlashAttention
(Dao et al. 2022; the backward pass of FlashAttention-2): for each chunk of queries, loop over chunks
of keys keeping a running maximum m, a running sum of exp(logits - m) and an unnormalised output,
all in float32; the [L, S] logits are never held, only one [cq, ck] tile per head. The mask is an
`AttentionMask` whose tiles are computed from its ingredients (causal offset, segment ids, key
validity), so nothing of size L x S exists at all. Tiles that a causal or key-length mask hides
completely are skipped (the loops' bounds depend on the chunk), which halves causal work.

The gradient recomputes each tile's probabilities from the saved row log-sum-exp instead of
storing them: O(L) memory for training too. It is the transpose of the output's tangent (a
primitive of `derivatives.linear_tangent`), so forward mode (`jax.jvp`, `jax.jacfwd`), which runs
JAX's own JVP of the loops, works as well.

Runs everywhere XLA does; on GPU/TPU the fused kernels ('cudnn', 'flash') are faster.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from transformer_jax.modeling import derivatives
from transformer_jax.modeling.masks import AttentionMask, as_attention_mask, check_attention_inputs

_NEG = -1e30  # finite: a fully masked tile cannot produce inf - inf


def chunked_attention(q, k, v, mask=None, *, q_chunk: int = 512, kv_chunk: int = 512):
    """softmax(QK^T / sqrt(d_k)) V with O(L) memory.

    q: [B, L, H, K]; k, v: [B, S, N, K] (N divides H: grouped-query); mask: an `AttentionMask`, a
    dense bool [B|1, 1|H, L|1, S] array (True = attend; `masks.key_padding_mask` gives [B, 1, 1, S])
    or None. A query that sees no key gets zeros.
    Returns [B, L, H, K] in q's dtype. Lengths need not be multiples of the chunk sizes.
    """
    check_attention_inputs(q, k, v, mask)  # a float mask was read as True where non-zero, silently
    B, L, H, K = q.shape
    S, N = k.shape[1], k.shape[2]
    spec = as_attention_mask(mask, L, S)
    cq, ck = _even_chunk(L, q_chunk, 8), _even_chunk(S, kv_chunk, 8)
    pad_q, pad_kv = -L % cq, -S % ck
    if pad_q or pad_kv:
        q = jnp.pad(q, ((0, 0), (0, pad_q), (0, 0), (0, 0)))
        k = jnp.pad(k, ((0, 0), (0, pad_kv), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, pad_kv), (0, 0), (0, 0)))
        spec = spec.padded(pad_q, pad_kv)
    q = (q / jnp.sqrt(K).astype(q.dtype)).reshape(B, L + pad_q, N, H // N, K)
    out = _attention(q, k, v, spec, cq, ck)
    return out.reshape(B, L + pad_q, H, K)[:, :L]


# ------------------------------------------------------------------------------------- tiling
def _even_chunk(length: int, chunk: int, granule: int) -> int:
    """The chunk size for `length` rows: at most `chunk`, in as few chunks as `chunk` allows, split
    evenly and rounded up to a multiple of `granule` where that stays within `chunk`. The padding is
    then under one granule per chunk: 513 rows in chunks of 512 are two of 264, not two of 512."""
    if length <= chunk:
        return length
    count = -(-length // chunk)
    even = -(-length // count)
    return min(-(-even // granule) * granule, chunk)


def _tile_mask(spec: AttentionMask, q0, cq, k0, ck, N):
    """The mask tile broadcastable to the logits tile [B, N, G, cq, ck] (None: nothing masked)."""
    m = spec.chunk(q0, cq, k0, ck)  # [B|1, 1|H, cq|1, ck|1]
    if m is None:
        return None
    if m.shape[1] == 1:
        return m[:, :, None]
    return m.reshape(m.shape[0], N, -1, *m.shape[2:])


def _kv_range(spec: AttentionMask, q0, cq, ck, num_kv):
    """[lo, hi) of the key chunks that can hold a visible key for queries q0..q0+cq-1."""
    hi = jnp.asarray(num_kv, jnp.int32)
    if spec.causal:
        offset = 0 if spec.causal_offset is None else jnp.max(spec.causal_offset)
        hi = jnp.minimum(hi, (q0 + cq + offset + ck - 1) // ck)
    if spec.kv_lengths is not None:
        hi = jnp.minimum(hi, (jnp.max(spec.kv_lengths) + ck - 1) // ck)
    if spec.kv_limit is not None:
        hi = jnp.minimum(hi, (spec.kv_limit + ck - 1) // ck)
    return jnp.asarray(0, jnp.int32), jnp.maximum(hi, 0)


def _q_range(spec: AttentionMask, k0, cq, ck, num_q):
    """[lo, hi) of the query chunks that can see a key of the chunk starting at k0."""
    lo, hi = jnp.asarray(0, jnp.int32), jnp.asarray(num_q, jnp.int32)
    if spec.causal:
        offset = 0 if spec.causal_offset is None else jnp.max(spec.causal_offset)
        lo = jnp.clip((k0 - offset) // cq, 0, num_q)
    if spec.kv_lengths is not None:
        hi = jnp.where(k0 < jnp.max(spec.kv_lengths), hi, lo)
    if spec.kv_limit is not None:
        hi = jnp.where(k0 < spec.kv_limit, hi, lo)
    return lo, hi


def _logits(qc, kc):
    return jnp.einsum("BLNGK,BSNK->BNGLS", qc, kc, preferred_element_type=jnp.float32)


# ------------------------------------------------------------------------------------- forward
def _forward(q, k, v, spec, cq, ck):
    """-> out [B, L, N, G, K] (q's dtype), lse [B, N, G, L] float32 (0 on rows that see nothing)."""
    B, L, N, G, K = q.shape
    num_q, num_kv = L // cq, k.shape[1] // ck

    def query_chunk(i):
        q0 = i * cq
        qc = jax.lax.dynamic_slice_in_dim(q, q0, cq, 1)

        def kv_step(j, carry):
            acc, m, total = carry
            k0 = j * ck
            kc = jax.lax.dynamic_slice_in_dim(k, k0, ck, 1)
            vc = jax.lax.dynamic_slice_in_dim(v, k0, ck, 1)
            s = _logits(qc, kc)
            tile = _tile_mask(spec, q0, cq, k0, ck, N)
            if tile is not None:
                s = jnp.where(tile, s, _NEG)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.exp(s - m_new[..., None])
            if tile is not None:
                p = jnp.where(tile, p, 0.0)  # a fully masked tile must add nothing
            alpha = jnp.exp(m - m_new)
            pv = jnp.einsum("BNGLS,BSNK->BNGLK", p.astype(v.dtype), vc,
                            preferred_element_type=jnp.float32)
            return acc * alpha[..., None] + pv, m_new, total * alpha + jnp.sum(p, axis=-1)

        init = (jnp.zeros((B, N, G, cq, K), jnp.float32), jnp.full((B, N, G, cq), _NEG, jnp.float32),
                jnp.zeros((B, N, G, cq), jnp.float32))
        init = derivatives.vary_like(init, qc, k, v, *jax.tree.leaves(spec))
        lo, hi = _kv_range(spec, q0, cq, ck, num_kv)
        acc, m, total = jax.lax.fori_loop(lo, hi, kv_step, init)
        seen = total > 0.0
        out = jnp.where(seen[..., None], acc / jnp.where(seen, total, 1.0)[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), 0.0)
        return out.astype(q.dtype), lse

    out, lse = jax.lax.map(query_chunk, jnp.arange(num_q))  # [nq, B, N, G, cq, K], [nq, B, N, G, cq]
    out = jnp.transpose(out, (1, 0, 4, 2, 3, 5)).reshape(B, L, N, G, K)
    lse = jnp.transpose(lse, (1, 2, 3, 0, 4)).reshape(B, N, G, L)
    return out, lse


# ------------------------------------------------------------------------------------- backward
def _backward(q, k, v, spec, cq, ck, out, lse, dout):
    """FlashAttention-2 backward: outer loop over key chunks (accumulating dK, dV in registers of the
    loop), inner loop over query chunks, dQ accumulated in a full-size float32 buffer."""
    B, L, N, G, K = q.shape
    S = k.shape[1]
    num_q, num_kv = L // cq, S // ck
    # D_i = sum_k dO_ik O_ik = sum_j P_ij dP_ij (the softmax Jacobian's correction term).
    delta = jnp.einsum("BLNGK,BLNGK->BNGL", dout.astype(jnp.float32), out.astype(jnp.float32))

    def kv_chunk(dq, j):
        k0 = j * ck
        kc = jax.lax.dynamic_slice_in_dim(k, k0, ck, 1)
        vc = jax.lax.dynamic_slice_in_dim(v, k0, ck, 1)

        def q_step(i, carry):
            dq, dk, dv = carry
            q0 = i * cq
            qc = jax.lax.dynamic_slice_in_dim(q, q0, cq, 1)
            doc = jax.lax.dynamic_slice_in_dim(dout, q0, cq, 1)
            lse_c = jax.lax.dynamic_slice_in_dim(lse, q0, cq, 3)
            delta_c = jax.lax.dynamic_slice_in_dim(delta, q0, cq, 3)
            p = jnp.exp(_logits(qc, kc) - lse_c[..., None])  # [B, N, G, cq, ck]
            tile = _tile_mask(spec, q0, cq, k0, ck, N)
            if tile is not None:
                p = jnp.where(tile, p, 0.0)
            dv = dv + jnp.einsum("BNGLS,BLNGK->BSNK", p.astype(v.dtype), doc,
                                 preferred_element_type=jnp.float32)
            dp = jnp.einsum("BLNGK,BSNK->BNGLS", doc, vc, preferred_element_type=jnp.float32)
            ds = (p * (dp - delta_c[..., None])).astype(q.dtype)
            dk = dk + jnp.einsum("BNGLS,BLNGK->BSNK", ds, qc, preferred_element_type=jnp.float32)
            dq_c = jnp.einsum("BNGLS,BSNK->BLNGK", ds, kc, preferred_element_type=jnp.float32)
            dq = jax.lax.dynamic_update_slice_in_dim(
                dq, jax.lax.dynamic_slice_in_dim(dq, q0, cq, 1) + dq_c, q0, 1)
            return dq, dk, dv

        zeros = derivatives.vary_like(jnp.zeros((B, ck, N, K), jnp.float32), q, k, v, dout, dq,
                                      *jax.tree.leaves(spec))
        lo, hi = _q_range(spec, k0, cq, ck, num_q)
        dq, dk, dv = jax.lax.fori_loop(lo, hi, q_step, (dq, zeros, zeros))
        return dq, (dk, dv)

    dq = derivatives.vary_like(jnp.zeros(q.shape, jnp.float32), q, k, v, dout, *jax.tree.leaves(spec))
    dq, (dk, dv) = jax.lax.scan(kv_chunk, dq, jnp.arange(num_kv))
    dk = jnp.moveaxis(dk, 0, 1).reshape(B, S, N, K)
    dv = jnp.moveaxis(dv, 0, 1).reshape(B, S, N, K)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _tangent(*args, spec_tree, cq, ck):
    """The output's tangent: JAX's forward mode through `_forward` (its loops too), so O(L) memory;
    args are q, k, v, out, lse, the mask's arrays and the tangents dq, dk, dv."""
    q, k, v = args[:3]
    spec = jax.tree.unflatten(spec_tree, args[5:-3])
    forward = lambda q, k, v: _forward(q, k, v, spec, cq, ck)[0]
    return jax.jvp(forward, (q, k, v), tuple(args[-3:]))[1]


def _tangent_transpose(g, q, k, v, out, lse, *spec_leaves, spec_tree, cq, ck):
    return _backward(q, k, v, jax.tree.unflatten(spec_tree, spec_leaves), cq, ck, out, lse, g)


# Linear in (dq, dk, dv); reverse mode transposes it into `_backward`.
_tangent_p = derivatives.linear_tangent("transformer_jax_chunked_attention_tangent", _tangent,
                                        _tangent_transpose, 3)


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5))
def _attention(q, k, v, spec, cq, ck):
    return _forward(q, k, v, spec, cq, ck)[0]


@functools.partial(_attention.defjvp, symbolic_zeros=True)
def _attention_jvp(cq, ck, primals, tangents):
    q, k, v, spec = primals
    out, lse = _forward(q, k, v, spec, cq, ck)
    dq, dk, dv = (jnp.zeros(x.shape, x.dtype) if derivatives.is_zero(t) else t
                  for x, t in zip((q, k, v), tangents[:3]))
    leaves, tree = jax.tree.flatten(spec)
    return out, derivatives.bind(_tangent_p, q, k, v, out, lse, *leaves, dq, dk, dv, spec_tree=tree,
                                 cq=cq, ck=ck)
