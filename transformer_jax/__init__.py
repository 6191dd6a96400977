"""transformer_jax: the Transformer of "Attention Is All You Need" (Vaswani et al., 2017) in JAX/Flax.

    import transformer_jax as tj
    config = tj.presets.tiny()
    model = tj.TransformerLM(config)

Importing has no side effects: no devices are touched, no files are written.
"""

from transformer_jax import presets
from transformer_jax.config import ConfigError, ModelConfig
from transformer_jax.convert import load_hf_checkpoint
from transformer_jax.modeling import KVCache, Transformer, TransformerLM, init_cache
from transformer_jax.params import count_params

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "KVCache",
    "ModelConfig",
    "Transformer",
    "TransformerLM",
    "count_params",
    "init_cache",
    "load_hf_checkpoint",
    "presets",
]
