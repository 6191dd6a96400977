"""Import pretrained Hugging Face checkpoints from local files (no network, no transformers needed).

    config, params = tj.load_hf_checkpoint("path/to/gpt2")          # -> TransformerLM
    config, params = tj.load_hf_checkpoint("path/to/opus-mt-en-de")  # -> Transformer
    tokenizer = load_hf_tokenizer("path/to/gpt2")

Supported ``model_type``: 'gpt2' and 'marian'. Every architectural difference is a `ModelConfig`
option (positions, norm placement, activation, logits bias, decoder start token); the modules
have no special cases for either.
"""

from transformer_jax.convert.hf_files import ConversionError
from transformer_jax.convert.loader import SUPPORTED_MODEL_TYPES, load_hf_checkpoint, load_hf_config
from transformer_jax.convert.tokenizers import HFTokenizer, load_hf_tokenizer

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ConversionError",
    "HFTokenizer",
    "load_hf_checkpoint",
    "load_hf_config",
    "load_hf_tokenizer",
]
