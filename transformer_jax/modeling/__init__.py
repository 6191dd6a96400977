"""The Transformer's building blocks as Flax Linen modules.

Dimension key, used in einsum strings, docstrings and shape comments throughout:

    B  batch              L  query length          S  key/value length
    D  d_model            H  query heads           G  query heads per key/value head
    N  key/value heads    K  head_dim (d_k = d_v)  F  d_ff               V  vocabulary

Logical axis names carried by parameters and activations, one vocabulary for both (mapped to mesh
axes only in `transformer_jax.parallel.rules`): 'batch', 'length', 'embed', 'heads', 'kv_heads',
'kv' (head_dim), 'mlp', 'vocab', 'layers'.
"""

from transformer_jax.modeling.attention import MultiHeadAttention, dot_product_attention
from transformer_jax.modeling.blocks import TransformerBlock
from transformer_jax.modeling.cache import KVCache, init_cache
from transformer_jax.modeling.chunked_attention import chunked_attention
from transformer_jax.modeling.layers import Embed, FeedForward
from transformer_jax.modeling.masks import (
    AttentionMask,
    causal_mask,
    combine_masks,
    padding_mask,
    segment_mask,
    shift_right,
)
from transformer_jax.modeling.positional import apply_rope, sinusoidal_encoding
from transformer_jax.modeling.transformer import (
    Decoder,
    Encoder,
    Transformer,
    TransformerLM,
    scan_params,
    unscan_params,
)

__all__ = [
    "AttentionMask",
    "Decoder",
    "Embed",
    "Encoder",
    "FeedForward",
    "KVCache",
    "MultiHeadAttention",
    "Transformer",
    "TransformerBlock",
    "TransformerLM",
    "apply_rope",
    "causal_mask",
    "chunked_attention",
    "combine_masks",
    "dot_product_attention",
    "init_cache",
    "padding_mask",
    "scan_params",
    "segment_mask",
    "shift_right",
    "sinusoidal_encoding",
    "unscan_params",
]
