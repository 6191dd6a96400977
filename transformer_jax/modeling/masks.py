"""Attention masks as pure functions. A mask is boolean, True where a query may attend to a key,
shaped [B, 1, L, S] (broadcast over heads). Section 3.2.3: the decoder's self-attention masks out
(sets to -inf before the softmax) every key to the right of the query.
"""

from __future__ import annotations

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
