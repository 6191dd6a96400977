"""Named model sizes. Each returns a `ModelConfig`; any field can be overridden by keyword.

    >>> transformer_base(vocab_size=32000).d_model
    512
"""

from __future__ import annotations

from transformer_jax.config import ModelConfig


def transformer_base(**overrides) -> ModelConfig:
    """Table 3 "base": N=6, d_model=512, d_ff=2048, h=8, d_k=d_v=64, P_drop=0.1 (~63M with 37k vocab)."""
    return ModelConfig(**overrides)


def transformer_big(**overrides) -> ModelConfig:
    """Table 3 "big": N=6, d_model=1024, d_ff=4096, h=16, d_k=d_v=64, P_drop=0.3 (~214M with 37k vocab)."""
    values = dict(d_model=1024, d_ff=4096, num_heads=16, dropout_rate=0.3)
    return ModelConfig(**{**values, **overrides})


def gpt2_small(**overrides) -> ModelConfig:
    """GPT-2 124M shape: decoder-only, 12 layers, d_model=768, 12 heads, learned positions, Pre-LN,
    tanh-GELU, tied head, 50257-token vocabulary, 1024 positions; GPT-2's dropout of 0.1 on the
    residual branches, the embeddings and the attention probabilities."""
    values = dict(
        vocab_size=50257, d_model=768, num_heads=12, d_ff=3072, num_encoder_layers=0,
        num_decoder_layers=12, dropout_rate=0.1, attention_dropout_rate=0.1, max_len=1024,
        norm="pre", norm_eps=1e-5,
        activation="gelu_tanh", position="learned", scale_embeddings=False, pad_id=None,
        eos_id=50256, bos_id=50256, decoder_start_id=50256,
    )
    return ModelConfig(**{**values, **overrides})


def tiny(**overrides) -> ModelConfig:
    """A ~45k-parameter model for tests and CPU demos (both encoder and decoder stacks)."""
    values = dict(
        vocab_size=64, d_model=32, num_heads=4, d_ff=64, num_encoder_layers=2,
        num_decoder_layers=2, dropout_rate=0.0, max_len=128,
    )
    return ModelConfig(**{**values, **overrides})
