"""Position information (section 3.5): sinusoidal encodings, and rotary embeddings (RoPE, Su et al.
2021) for modern decoder-only models. Learned absolute positions are an `Embed` table (row E of
Table 3).
"""

from __future__ import annotations

import operator

import jax.numpy as jnp


def sinusoidal_encoding(positions, d_model: int, layout: str = "interleaved", max_timescale=1e4):
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)).

    positions: integer array [...]; returns float32 [..., D]. `layout='interleaved'` is the paper's
    (sin on even dimensions, cos on odd); `'concat'` puts all sines first, then all cosines (the
    layout of Marian checkpoints). Same frequencies either way (fairseq's sinusoids are not these:
    their frequencies are 10000^(-i/(D/2 - 1)) and their positions start after the padding id).
    """
    try:
        width = operator.index(d_model)  # an int, NumPy's too
    except TypeError:
        width = None
    if width is None or width <= 0 or width % 2:
        raise ValueError(f"sinusoidal encodings pair a sine and a cosine per frequency: d_model must be a "
                         f"positive even integer, got {d_model!r}")
    if layout not in ("interleaved", "concat"):
        raise ValueError(f"layout must be 'interleaved' or 'concat', got {layout!r}")
    i = jnp.arange(width // 2, dtype=jnp.float32)
    inv_freq = 1.0 / (max_timescale ** (2.0 * i / width))
    angles = jnp.asarray(positions).astype(jnp.float32)[..., None] * inv_freq  # [..., D/2]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    if layout == "concat":
        return jnp.concatenate([sin, cos], axis=-1)
    return jnp.stack([sin, cos], axis=-1).reshape(*angles.shape[:-1], width)


def apply_rope(x, positions, theta: float = 10000.0):
    """Rotate query/key features by position (RoPE). x: [B, L, H, K], positions: [B, L].

    Rotates pairs (k, k + K/2) ("rotate half" layout), so <q_m, k_n> depends only on m - n.
    """
    # A module with `rope_theta` set and no positions (MultiHeadAttention's q_positions /
    # kv_positions, TransformerBlock's positions) would otherwise fail on `None.astype`.
    if positions is None or jnp.ndim(positions) != 2:
        got = None if positions is None else jnp.shape(positions)
        raise ValueError(f"rotary positions (rope_theta set) need positions int [B, L] for the "
                         f"{x.shape} queries/keys, got {got}: pass q_positions (and kv_positions "
                         "for cross-attention), e.g. jnp.arange(L)[None]")
    rows, length = jnp.shape(positions)
    if length != x.shape[1] or rows not in (1, x.shape[0]):  # [B, 1] broadcast along the length
        raise ValueError(f"rotary positions have shape {jnp.shape(positions)} for the {x.shape} "
                         f"queries/keys: they must be [{x.shape[0]} (or 1), {x.shape[1]}], one per token")
    if x.shape[-1] % 2:
        raise ValueError(f"rotary positions need an even head_dim, got {x.shape[-1]}")
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles = positions.astype(jnp.float32)[:, :, None, None] * inv_freq  # [B, L, 1, K/2]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)
