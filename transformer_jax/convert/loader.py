"""`load_hf_checkpoint`: a local Hugging Face directory -> (ModelConfig, params), by model_type."""

from __future__ import annotations

import os

from transformer_jax.config import ConfigError, ModelConfig
from transformer_jax.convert import gpt2, marian
from transformer_jax.convert.hf_files import ConversionError, read_config, read_weights
from transformer_jax.params import convert_params

_CONVERTERS = {"gpt2": gpt2, "marian": marian}
SUPPORTED_MODEL_TYPES = tuple(sorted(_CONVERTERS))


def _converter(hf_config: dict, directory: str):
    model_type = hf_config.get("model_type")
    if model_type not in _CONVERTERS:
        raise ConversionError(
            f"{directory}: unsupported model_type {model_type!r}; supported: {list(SUPPORTED_MODEL_TYPES)}"
        )
    return _CONVERTERS[model_type]


def load_hf_config(path: str | os.PathLike, **overrides) -> ModelConfig:
    """The `ModelConfig` equivalent to a checkpoint's config.json (weights are not read).

    ``overrides`` replace fields afterwards, e.g. ``dtype='bfloat16'``, ``dropout_rate=0.0``.
    """
    directory = os.fspath(path)
    hf_config = read_config(directory)
    try:
        config = _converter(hf_config, directory).config_from_hf(hf_config)
    except ConfigError as e:
        raise ConversionError(f"{directory}: config.json does not give a valid ModelConfig: {e}") from e
    try:
        return config.replace(**overrides) if overrides else config
    except (TypeError, ConfigError) as e:
        raise ConversionError(f"bad override {overrides}: {e}") from e


def load_hf_checkpoint(path: str | os.PathLike, **overrides) -> tuple[ModelConfig, dict]:
    """Loads a local Hugging Face GPT-2 or Marian checkpoint.

    Args:
      path: a directory with config.json and model.safetensors (or a sharded safetensors index,
        or pytorch_model.bin, read only with ``torch.load(weights_only=True)``).
      **overrides: `ModelConfig` fields to change (dtype, param_dtype, dropout_rate,
        kernel_layout, ...); the architecture fields must keep their checkpoint values for the
        weights to fit.

    Returns:
      (config, params): build the model with ``transformer_jax.params.build_model(config)``
      (`TransformerLM` for GPT-2, `Transformer` for Marian) and call it with ``{'params': params}``.

    Raises:
      ConversionError: unsupported model_type or options (all listed), missing files, missing or
        mis-shaped tensors (named, with both shapes), or a pickle that is not plain tensors.
    """
    directory = os.fspath(path)
    hf_config = read_config(directory)
    converter = _converter(hf_config, directory)
    config = load_hf_config(directory, **overrides)
    tensors = read_weights(directory)
    # The converters write Flax's [in, out] kernels and the checkpoint's own vocabulary; another
    # kernel_layout is a permutation after, and a padded vocabulary gets zero rows.
    base = config.replace(kernel_layout="in_out", pad_vocab_multiple=1)
    params = converter.params_from_hf(tensors, base)
    return config, (params if base == config else convert_params(params, base, config))
