"""`load_hf_checkpoint`: a local Hugging Face directory -> (ModelConfig, params), by model_type."""

from __future__ import annotations

import dataclasses
import os

from transformer_jax.config import ConfigError, ModelConfig
from transformer_jax.convert import gpt2, marian
from transformer_jax.convert.hf_files import ConversionError, read_config, read_weights
from transformer_jax.modeling.transformer import scan_params
from transformer_jax.params import CONVERTIBLE_FIELDS, PARAMETER_FREE_FIELDS, convert_params

# Fields a loaded checkpoint may take other values of: how it computes and is stored, its layer
# layout, and which token ids generation uses (pad_id only where no encoder masks the source by it).
# Any other field would change the function the weights compute (a norm placement, an activation,
# an epsilon, an embedding scale) while the weights still fit, so it is refused.
OVERRIDABLE_FIELDS = CONVERTIBLE_FIELDS + PARAMETER_FREE_FIELDS + (
    "eos_id", "bos_id", "pad_id", "decoder_start_id")

_CONVERTERS = {"gpt2": gpt2, "marian": marian}
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
SUPPORTED_MODEL_TYPES = tuple(sorted(_CONVERTERS))


def _converter(hf_config: dict, directory: str):
    model_type = hf_config.get("model_type")
    if model_type is None and isinstance(hf_config.get("model"), dict):  # our own config.json
        raise ConversionError(f"{directory} is a training workdir, not a Hugging Face checkpoint: "
                              f"give it as --workdir (or load it with restore_for_inference)")
    if model_type not in _CONVERTERS:
        raise ConversionError(
            f"{directory}: unsupported model_type {model_type!r}; supported: {list(SUPPORTED_MODEL_TYPES)}"
        )
    return _CONVERTERS[model_type]


def load_hf_config(path: str | os.PathLike, **overrides) -> ModelConfig:
    """The `ModelConfig` equivalent to a checkpoint's config.json (weights are not read).

    ``overrides`` replace fields, e.g. ``dtype='bfloat16'``, ``dropout_rate=0.0``, among
    `OVERRIDABLE_FIELDS`; a token id override also stands in for one that config.json gives out of
    range or null.
    """
    directory = os.fspath(path)
    hf_config = read_config(directory)
    converter = _converter(hf_config, directory)
    # A token id config.json leaves null is derived from another (GPT-2's BOS from its EOS, the
    # decoder's start from its BOS): an override standing in for the null one stands in for those
    # derived from it too, rather than each failing in turn on the default they were derived from.
    stated, hf_config = hf_config, dict(hf_config)
    for key, field in converter.ID_SOURCES.items():  # only the id read from that key, not those
        if field in overrides and hf_config.get(key) is None:  # derived from it or sharing it
            hf_config[key] = overrides[field]
    try:
        fields = converter.config_fields(hf_config)
    except ConversionError as e:  # options the model cannot express, listed by the converter
        raise ConversionError(f"{os.path.join(directory, 'config.json')}: {e}") from e
    except KeyError as e:
        raise ConversionError(f"{directory}: config.json has no {e.args[0]!r}, which this model needs") from e
    except (TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
        # A value of the wrong type or zero where a size goes ("n_embd": "24", "n_head": 0).
        raise ConversionError(f"{directory}: config.json has a value of the wrong type or out of range "
                              f"({type(e).__name__}: {e})") from e
    unknown = sorted(set(overrides) - set(_DEFAULTS))
    if unknown:  # a misspelt field is not one the checkpoint "was trained for"
        raise ConversionError(f"{directory}: {unknown} is not a ModelConfig field "
                              f"(overridable: {sorted(OVERRIDABLE_FIELDS)})")
    given = {**_DEFAULTS, **fields}
    # An encoder masks the source tokens equal to pad_id: only its own value is no change there.
    overridable = set(OVERRIDABLE_FIELDS) - ({"pad_id"} if given["num_encoder_layers"] else set())
    fixed = sorted(k for k in set(overrides) - overridable
                   if overrides[k] != given[k])  # its own value is no change
    if given["position"] != "learned" and "max_len" in overrides:
        fixed.remove("max_len")  # computed positions extend to any length
    why = " (the encoder masks the source tokens equal to pad_id)" if "pad_id" in fixed else ""
    if fixed:
        raise ConversionError(
            f"{directory}: cannot override {fixed}: the checkpoint's weights were trained for its own "
            f"values ({', '.join(f'{k}={given[k]!r}' for k in fixed)}), and other values "
            f"would compute another function{why}. Overridable: {sorted(overridable)}.")
    merged = {**fields, **overrides}
    vocab = merged.get("vocab_size")
    bad_ids = [k for k in converter.TOKEN_ID_KEYS if k not in overrides  # (a bad override: below)
               and isinstance(merged.get(k), int) and isinstance(vocab, int) and not 0 <= merged[k] < vocab]
    if bad_ids:  # all of them in one error, each with the way out it has
        def way_out(k):
            if k in overridable:  # the command line (generate --hf_checkpoint) has config.json only
                return (f"set config.json's {converter.TOKEN_ID_KEYS[k]} to a token id, or give "
                        f"{k}=<token id> to load_hf_checkpoint")
            return ("it cannot be overridden (the encoder masks the source tokens equal to it): "
                    "fix config.json")
        def source(k):
            key = converter.TOKEN_ID_KEYS[k]
            if stated.get(key) is not None:
                return f"config.json's {key}"
            return f"config.json has no {key}: derived"
        listed = "; ".join(f"{k}={merged[k]} ({source(k)}): {way_out(k)}" for k in bad_ids)
        raise ConversionError(f"{directory}: token ids outside the vocabulary [0, {vocab}): {listed}")
    try:
        return ModelConfig(**merged)
    except ConfigError as e:
        if e.field in overrides:
            raise ConversionError(f"bad override {overrides}: {e}") from e
        hint = ""
        if e.field in converter.TOKEN_ID_KEYS:
            hint = (f" (config.json's {converter.TOKEN_ID_KEYS[e.field]}: set a token id there, or give "
                    f"{e.field}=<token id> to load_hf_checkpoint)")
        raise ConversionError(f"{directory}: config.json does not give a valid ModelConfig: {e}{hint}") from e


def load_hf_checkpoint(path: str | os.PathLike, **overrides) -> tuple[ModelConfig, dict]:
    """Loads a local Hugging Face GPT-2 or Marian checkpoint.

    Args:
      path: a directory with config.json and model.safetensors (or a sharded safetensors index,
        or pytorch_model.bin, read only with ``torch.load(weights_only=True)``).
      **overrides: `ModelConfig` fields to change, among `OVERRIDABLE_FIELDS` (dtype, param_dtype,
        dropout rates, attention_impl, remat, kernel_layout, pad_vocab_multiple, fused_qkv,
        scan_layers, token ids, ``pad_id`` only without an encoder; ``max_len`` for computed
        positions); any other is a ConversionError, since the weights would still fit but compute
        another function. A token id override also stands in for one config.json gives out of range.

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
    if hasattr(converter, "config_for_tensors"):  # what config.json alone does not tell
        config = converter.config_for_tensors(config, tensors)
    # The converters write Flax's unscanned [in, out] kernels, three for each attention, and the
    # checkpoint's own vocabulary; scanned layers are stacked after, another kernel_layout is a
    # permutation, fused_qkv a concatenation, and a padded vocabulary gets zero rows.
    base = config.replace(kernel_layout="in_out", pad_vocab_multiple=1, scan_layers=False, fused_qkv=False)
    params = converter.params_from_hf(tensors, base)
    if config.scan_layers:
        params = scan_params(params, base)
        base = base.replace(scan_layers=True)
    return config, (params if base == config else convert_params(params, base, config))
