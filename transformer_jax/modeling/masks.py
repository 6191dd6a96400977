"""Attention masks as pure functions. A mask is boolean, True where a query may attend to a key,
shaped [B, 1, L, S] (broadcast over heads). Section 3.2.3: the decoder's self-attention masks out
(sets to -inf before the softmax) every key to the right of the query.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


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
