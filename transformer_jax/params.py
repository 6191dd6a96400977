"""Parameter shapes and counts without allocating memory (`jax.eval_shape`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from transformer_jax.config import ModelConfig


def build_model(config: ModelConfig):
    """The module for a config: `Transformer` when it has an encoder, `TransformerLM` otherwise."""
    from transformer_jax.modeling import Transformer, TransformerLM

    return Transformer(config) if config.num_encoder_layers > 0 else TransformerLM(config)


def dummy_inputs(config: ModelConfig, batch_size: int = 1, length: int = 8):
    tokens = jnp.zeros((batch_size, length), jnp.int32)
    return (tokens, tokens) if config.num_encoder_layers > 0 else (tokens,)


def param_shapes(config: ModelConfig):
    """The parameter pytree as `jax.ShapeDtypeStruct`s (logical-partitioning boxes removed)."""
    import flax.linen as nn

    model = build_model(config)
    variables = jax.eval_shape(
        lambda: model.init(jax.random.key(0), *dummy_inputs(config))
    )
    return nn.unbox(variables["params"])


def count_params(config: ModelConfig) -> int:
    """Number of trainable parameters (shared embeddings counted once). Allocates nothing."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(param_shapes(config)))
