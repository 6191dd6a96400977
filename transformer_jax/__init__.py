"""transformer_jax: the Transformer of "Attention Is All You Need" (Vaswani et al., 2017) in JAX/Flax.

    import transformer_jax as tj
    config = tj.presets.tiny(num_encoder_layers=0)  # decoder-only
    model = tj.TransformerLM(config)

The sampler is `tj.decoding.generate` (the name `transformer_jax.generate` is the command-line
module, `python -m transformer_jax.generate`).

Importing has no side effects: no devices are touched, no files are written.
"""

from transformer_jax import decoding, presets
from transformer_jax.config import ConfigError, ModelConfig
from transformer_jax.convert import load_hf_checkpoint
from transformer_jax.decoding import (
    BeamOutput,
    GenerateOutput,
    SamplingConfig,
    beam_search,
)
from transformer_jax.decoding.model_steps import LMStep, Seq2SeqStep, encode_source
from transformer_jax.modeling import KVCache, Transformer, TransformerLM, init_cache
from transformer_jax.params import count_params

__version__ = "0.1.0"

__all__ = [
    "BeamOutput",
    "ConfigError",
    "GenerateOutput",
    "LMStep",
    "SamplingConfig",
    "Seq2SeqStep",
    "KVCache",
    "ModelConfig",
    "Transformer",
    "TransformerLM",
    "beam_search",
    "count_params",
    "decoding",
    "encode_source",
    "init_cache",
    "load_hf_checkpoint",
    "presets",
]
