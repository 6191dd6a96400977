"""Attention masks as pure functions. A mask is boolean, True where a query may attend to a key,
shaped [B, 1, L, S] (broadcast over heads). Section 3.2.3: the decoder's self-attention masks out
(sets to -inf before the softmax) every key to the right of the query.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


def padding_mask(q_valid, kv_valid):
    """[B, L] and [B, S] booleans -> [B, 1, L, S]: both the query and the key are real tokens."""
    return (q_valid[:, :, None] & kv_valid[:, None, :])[:, None]


def key_padding_mask(kv_valid):
    """[B, S] boolean -> [B, 1, 1, S]: every query may see every real key."""
    return kv_valid[:, None, None, :]


def causal_mask(length: int, kv_length: int | None = None):
    """[1, 1, L, S]: query i sees keys j <= i (section 3.2.3)."""
    kv_length = length if kv_length is None else kv_length
    return (jnp.arange(length)[:, None] >= jnp.arange(kv_length)[None, :])[None, None]


def segment_mask(q_segment_ids, kv_segment_ids):
    """[B, L], [B, S] int -> [B, 1, L, S]: same packed example, and the key is not padding (id 0)."""
    same = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    return (same & (kv_segment_ids[:, None, :] != 0))[:, None]


def cache_mask(lengths, num_queries: int, cache_length: int):
    """Causal mask for queries appended to a KV cache.

    Row b's queries sit at positions lengths[b] + i; they see cache slots j <= lengths[b] + i.
    [B] -> [B, 1, L, S].
    """
    positions = lengths[:, None] + jnp.arange(num_queries)[None, :]
    return (jnp.arange(cache_length)[None, None, :] <= positions[:, :, None])[:, None]


def combine_masks(*masks):
    """Logical AND of the masks that are not None (None if all are None)."""
    masks = [m for m in masks if m is not None]
    if not masks:
        return None
    out = masks[0]
    for m in masks[1:]:
        out = out & m
    return out


def shift_right(tokens, segment_ids=None, start_id: int = 2):
    """Decoder inputs from targets: shift right by one and put `start_id` at each example's start.

    With packing (`segment_ids` given) the shift happens inside each segment, so no example sees
    the last token of the one before it; padding (segment 0) stays 0.
    """
    shifted = jnp.pad(tokens, ((0, 0), (1, 0)))[:, :-1]
    if segment_ids is None:
        return shifted.at[:, 0].set(start_id)
    previous = jnp.pad(segment_ids, ((0, 0), (1, 0)))[:, :-1]
    starts = segment_ids != previous
    shifted = jnp.where(starts, start_id, shifted)
    return jnp.where(segment_ids == 0, 0, shifted).astype(tokens.dtype)


@flax.struct.dataclass
class AttentionMask:
    """A mask given by its ingredients, so that memory-efficient backends never build [L, S].

    Query i of row b may attend to key j when every ingredient that is set allows it:
      causal:          j <= causal_offset[b] + i (causal_offset None = 0: query i sits at position i;
                       with a KV cache the new queries sit after the `lengths[b]` cached tokens)
      q/kv_segment_ids [B, L] / [B, S] int: same packed example and the key is not padding (id 0)
      kv_valid         bool [B, S]: the key is a real token
      kv_lengths       int [B]: j < kv_lengths[b]
      dense            bool [B|1, 1|H, L|1, S|1]: any other pattern (materialised by the caller)
    Dense backends call `materialize()`; `chunk()` gives one [q0:q0+cq, k0:k0+ck] tile of it.
    """

    q_length: int = flax.struct.field(pytree_node=False)
    kv_length: int = flax.struct.field(pytree_node=False)
    causal: bool = flax.struct.field(pytree_node=False, default=False)
    kv_limit: int | None = flax.struct.field(pytree_node=False, default=None)  # keys >= it: padding
    causal_offset: jax.Array | None = None
    q_segment_ids: jax.Array | None = None
    kv_segment_ids: jax.Array | None = None
    kv_valid: jax.Array | None = None
    kv_lengths: jax.Array | None = None
    dense: jax.Array | None = None

    def chunk(self, q_start, q_size: int, kv_start, kv_size: int):
        """bool [B|1, 1|H, q_size, kv_size] for queries q_start.. and keys kv_start.. (the starts may
        be traced), or None when nothing is masked."""
        q_idx = q_start + jnp.arange(q_size)
        kv_idx = kv_start + jnp.arange(kv_size)

        def cols(x):  # [B, S] -> the [B, 1, 1, kv_size] tile
            return jax.lax.dynamic_slice_in_dim(x, kv_start, kv_size, 1)[:, None, None, :]

        parts = []
        if self.causal:
            offset = 0 if self.causal_offset is None else self.causal_offset[:, None, None, None]
            parts.append(kv_idx[None, None, None, :] <= q_idx[None, None, :, None] + offset)
        if self.q_segment_ids is not None:
            q_seg = jax.lax.dynamic_slice_in_dim(self.q_segment_ids, q_start, q_size, 1)
            kv_seg = cols(self.kv_segment_ids)
            parts.append((q_seg[:, None, :, None] == kv_seg) & (kv_seg != 0))
        if self.kv_valid is not None:
            parts.append(cols(self.kv_valid))
        if self.kv_lengths is not None:
            parts.append(kv_idx[None, None, None, :] < self.kv_lengths[:, None, None, None])
        if self.kv_limit is not None:
            parts.append(kv_idx[None, None, None, :] < self.kv_limit)
        if self.dense is not None:
            # An axis of size 1 broadcasts (e.g. `key_padding_mask`'s [B, 1, 1, S], which the dense
            # backends take as it is): there is nothing to cut from it.
            tile = self.dense
            if tile.shape[2] != 1:
                tile = jax.lax.dynamic_slice_in_dim(tile, q_start, q_size, 2)
            if tile.shape[3] != 1:
                tile = jax.lax.dynamic_slice_in_dim(tile, kv_start, kv_size, 3)
            parts.append(tile)
        return combine_masks(*parts)

    def materialize(self):
        """The dense bool mask [B|1, 1|H, L, S] (None when nothing is masked)."""
        return self.chunk(0, self.q_length, 0, self.kv_length)

    @property
    def is_empty(self) -> bool:
        return not self.causal and self.kv_limit is None and all(
            x is None for x in (self.q_segment_ids, self.kv_valid, self.kv_lengths, self.dense))

    def padded(self, pad_q: int, pad_kv: int) -> AttentionMask:
        """The same mask for inputs padded at the end by `pad_q` queries and `pad_kv` keys: padded keys
        are hidden; padded queries see only padded keys (the caller cuts their rows off)."""
        def pad(x, axis, amount, value):
            if x is None or amount == 0 or x.shape[axis] == 1:  # size 1: broadcast, nothing to pad
                return x
            widths = [(0, 0)] * x.ndim
            widths[axis] = (0, amount)
            return jnp.pad(x, widths, constant_values=value)

        return self.replace(
            q_length=self.q_length + pad_q, kv_length=self.kv_length + pad_kv,
            kv_limit=(self.kv_limit if not pad_kv else self.kv_length if self.kv_limit is None
                      else min(self.kv_limit, self.kv_length)),
            q_segment_ids=pad(self.q_segment_ids, 1, pad_q, 0),
            kv_segment_ids=pad(self.kv_segment_ids, 1, pad_kv, 0),
            kv_valid=pad(self.kv_valid, 1, pad_kv, False),
            dense=pad(pad(self.dense, 2, pad_q, False), 3, pad_kv, False),
        )


def as_attention_mask(mask, q_length: int, kv_length: int) -> AttentionMask:
    """An `AttentionMask` from None, a dense bool array [B|1, 1|H, L, S], or an `AttentionMask`."""
    if isinstance(mask, AttentionMask):
        return mask
    return AttentionMask(q_length, kv_length, dense=mask)


def causal_spec(length: int, segment_ids=None) -> AttentionMask:
    """Decoder self-attention: causal (section 3.2.3), within packed segments when given."""
    return AttentionMask(length, length, causal=True, q_segment_ids=segment_ids,
                         kv_segment_ids=segment_ids)


def bidirectional_spec(q_length: int, kv_length: int, *, kv_valid=None, q_segment_ids=None,
                       kv_segment_ids=None) -> AttentionMask:
    """Encoder self-attention and cross-attention: every real key of the same segment."""
    if q_segment_ids is not None:
        kv_valid = None  # the segment ids already hide padding keys (id 0)
    return AttentionMask(q_length, kv_length, q_segment_ids=q_segment_ids,
                         kv_segment_ids=kv_segment_ids, kv_valid=kv_valid)


def cache_spec(lengths, num_queries: int, cache_length: int) -> AttentionMask:
    """`cache_mask` as ingredients: queries at lengths[b] + i see cache slots j <= lengths[b] + i."""
    return AttentionMask(num_queries, cache_length, causal=True, causal_offset=lengths)


def _dtype_of(x):
    return x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype


def _check_part(name: str, x, kind: str, shape: tuple, fits) -> None:
    """One part of a mask: of ``kind`` ('bool' or 'int') and of a shape ``fits`` accepts."""
    dtype = _dtype_of(x)
    ok = dtype == jnp.bool_ if kind == "bool" else jnp.issubdtype(dtype, jnp.integer)
    if not ok:
        want = "bool (True = a real key)" if kind == "bool" else "integer"
        raise ValueError(f"AttentionMask.{name} must be {want}, got {dtype}"
                         + ("; a 0/1 mask such as Hugging Face's attention_mask (1 = a real token) is "
                            "`mask.astype(bool)`, an additive mask of 0 / -inf `mask == 0`"
                            if kind == "bool" else ""))
    if not fits(np.shape(x)):  # (np: jnp.shape of a nested list is deprecated)
        raise ValueError(f"AttentionMask.{name} has shape {np.shape(x)}; it must be {shape}")


def check_attention_inputs(q, k, v, mask, kv_layout: str = "BSNK") -> None:
    """Shapes and mask checked once, naming the argument: otherwise each backend fails its own way
    deep inside (a reshape, an einsum label, a slice), or, for 'reference' and 'chunked', takes a
    key batch of 1 as broadcast where 'xla' refuses it.

    A dense mask must be bool and broadcast to [B, H, L, S]. An additive float mask (0 / -inf,
    PyTorch's and Hugging Face's convention) would otherwise be read as True wherever it is
    non-zero: 'reference' and 'chunked' attended exactly to the masked keys, silently. The parts
    of an `AttentionMask` are checked alike (a float ``kv_valid`` gave NaN on one backend and the
    wrong keys on another; one of the wrong length, an error from inside a slice)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k and v must be 4-D ([B, L, H, K] and [B, S, N, K]), got shapes "
                         f"{q.shape}, {k.shape}, {v.shape}")
    B, L, H, K = q.shape
    N, S = k.shape[kv_layout.index("N")], k.shape[kv_layout.index("S")]
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != K or H % N:
        raise ValueError(f"q {q.shape} [B, L, H, K] does not fit k {k.shape} / v {v.shape} "
                         f"({'[B, N, S, K]' if kv_layout == 'BNSK' else '[B, S, N, K]'}): k and v "
                         "must have one shape, the batch and head_dim of q, and N dividing H")
    dense = mask
    if isinstance(mask, AttentionMask):
        dense = mask.dense
        if (mask.q_length, mask.kv_length) != (L, S):
            raise ValueError(f"AttentionMask(q_length={mask.q_length}, kv_length={mask.kv_length}) does "
                             f"not fit {L} queries and {S} keys")
        rows = lambda n: (lambda shape: len(shape) == 2 and shape[0] in (1, B) and shape[1] == n)
        per_row = lambda shape: len(shape) == 1 and shape[0] in (1, B)
        if (mask.q_segment_ids is None) != (mask.kv_segment_ids is None):
            given = "q_segment_ids" if mask.kv_segment_ids is None else "kv_segment_ids"
            raise ValueError(f"AttentionMask: q_segment_ids and kv_segment_ids must be given together "
                             f"(got only {given})")
        parts = (("q_segment_ids", "int", f"[B|1, L] = [{B}|1, {L}]", rows(L)),
                 ("kv_segment_ids", "int", f"[B|1, S] = [{B}|1, {S}]", rows(S)),
                 ("kv_valid", "bool", f"[B|1, S] = [{B}|1, {S}]", rows(S)),
                 ("kv_lengths", "int", f"[B|1] = [{B}|1]", per_row),
                 ("causal_offset", "int", f"[B|1] = [{B}|1]", per_row))
        for name, kind, shape, fits in parts:
            if getattr(mask, name) is not None:
                _check_part(name, getattr(mask, name), kind, shape, fits)
    if dense is None:
        return
    if not hasattr(dense, "dtype"):  # a nested list; arrays are only read, not copied
        dense = jnp.asarray(dense)
    want = (B, H, L, S)
    if dense.dtype != jnp.bool_:
        raise ValueError(f"mask must be bool (True = attend), got {dense.dtype}; an additive mask "
                         "of 0 / -inf is `mask == 0`, a 0/1 mask `mask.astype(bool)`")
    if dense.ndim != 4 or any(n not in (1, w) for n, w in zip(dense.shape, want, strict=True)):
        raise ValueError(f"mask has shape {dense.shape}; it must broadcast to [B, H, L, S] = {want} "
                         "(e.g. [B, 1, L, S], or masks.key_padding_mask(valid) [B, 1, 1, S])")
