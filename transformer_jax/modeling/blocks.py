"""One Transformer layer (section 3.1, Figure 1): self-attention, optional cross-attention, and the
feed-forward network, each wrapped in a residual connection with layer normalisation.

The same block is the encoder layer (bidirectional mask, no cross-attention), the paper's decoder
layer (causal mask, cross-attention over the encoder output) and a GPT-style decoder layer (causal,
no cross-attention): the masks passed in decide, not separate classes.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from transformer_jax.modeling.attention import MultiHeadAttention
from transformer_jax.modeling.layers import FeedForward, make_norm


class TransformerBlock(nn.Module):
    """Post-LN (paper): x = LayerNorm(x + Dropout(Sublayer(x))).
    Pre-LN (deviation, Xiong et al. 2020; GPT-2): x = x + Dropout(Sublayer(LayerNorm(x))).
    """

    d_model: int
    num_heads: int
    head_dim: int
    num_kv_heads: int
    d_ff: int
    cross_attention: bool = False
    activation: str = "relu"
    norm: str = "post"
    norm_type: str = "layernorm"
    norm_eps: float = 1e-6
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    rope_theta: float | None = None
    use_bias: bool = True
    attention_impl: str = "auto"
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    kernel_layout: str = "in_out"
    cpu_kernels: str = "xla"
    fused_qkv: bool = False  # the self-attention's Q/K/V kernels stored as one (ModelConfig.fused_qkv)

    def setup(self):
        if self.norm not in ("post", "pre"):  # any other value ran as 'post'
            raise ValueError(f"norm must be 'post' or 'pre', got {self.norm!r}")

        def attention(name, rope_theta, fused_qkv=False):
            return MultiHeadAttention(
                d_model=self.d_model, num_heads=self.num_heads, head_dim=self.head_dim,
                num_kv_heads=self.num_kv_heads,
                use_bias=self.use_bias, rope_theta=rope_theta,
                attention_dropout_rate=self.attention_dropout_rate,
                attention_impl=self.attention_impl, dtype=self.dtype, param_dtype=self.param_dtype,
                kernel_layout=self.kernel_layout, cpu_kernels=self.cpu_kernels, fused_qkv=fused_qkv,
                name=name,
            )

        def norm(name):
            return make_norm(self.norm_type, self.norm_eps, self.dtype, self.param_dtype, name,
                             self.cpu_kernels)

        self.self_attention = attention("self_attention", self.rope_theta, self.fused_qkv)
        self.self_attention_norm = norm("self_attention_norm")
        if self.cross_attention:
            self.cross_attention_layer = attention("cross_attention", None)
            self.cross_attention_norm = norm("cross_attention_norm")
        self.feed_forward = FeedForward(self.d_ff, self.activation, self.use_bias, self.dtype,
                                        self.param_dtype, self.kernel_layout, self.cpu_kernels,
                                        name="feed_forward")
        self.feed_forward_norm = norm("feed_forward_norm")
        self.dropout = nn.Dropout(self.dropout_rate)

    def _residual(self, x, sublayer, norm, deterministic):
        """Section 5.4: dropout on the sub-layer output before it is added to its input."""
        if self.norm == "pre":
            out, aux = sublayer(norm(x))
            return x + self.dropout(out, deterministic=deterministic), aux
        out, aux = sublayer(x)
        return norm(x + self.dropout(out, deterministic=deterministic)), aux

    def cross_kv(self, memory):
        """The cross-attention K/V of the encoder output [B, S_src, D], computed once per source and
        stored heads first, [B, N, S_src, K]: the layout the attention matmuls read in place, as for
        the self-attention cache (with positions first every decoding step transposed them)."""
        k, v = self.cross_attention_layer.project_kv(memory)
        return jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)

    def __call__(
        self, x, deterministic=True, *, self_mask, positions=None, memory=None, cross_mask=None,
        cross_kv=None, cache=None, cache_index=None,
    ):
        """x: [B, L, D]; self_mask: [B, 1, L, S]; memory: encoder output [B, S_src, D] (or
        `cross_kv`, its projected K/V [B, N, S_src, K] from a cache); cross_mask: [B, 1, L, S_src].

        Returns (y [B, L, D], updated self-attention cache or None).
        """

        def attend_self(h):
            return self.self_attention(h, mask=self_mask, q_positions=positions, cache=cache,
                                       cache_index=cache_index, deterministic=deterministic)

        x, new_cache = self._residual(x, attend_self, self.self_attention_norm, deterministic)
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))

        if self.cross_attention:

            def attend_memory(h):
                return self.cross_attention_layer(
                    h, memory, mask=cross_mask, precomputed_kv=cross_kv,
                    deterministic=deterministic,
                )

            x, _ = self._residual(x, attend_memory, self.cross_attention_norm, deterministic)

        x, _ = self._residual(x, lambda h: (self.feed_forward(h), None), self.feed_forward_norm,
                              deterministic)
        return nn.with_logical_constraint(x, ("batch", "length", "embed")), new_cache
