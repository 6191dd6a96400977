"""Filling the library's parameter tree from checkpoint tensors, checking every shape on the way.

The converters name, for each parameter of ours, the checkpoint tensor it comes from, the shape
that tensor must have, and how to lay it out (transpose, split, reshape). Anything missing or
mis-shaped is an error naming the tensor and both shapes; any parameter left unfilled is an error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import jax.numpy as jnp
import numpy as np
from absl import logging

from transformer_jax.config import ModelConfig
from transformer_jax.convert.hf_files import ConversionError, Unreadable

# Hugging Face activation names -> ours (HF's "gelu" is the exact erf GELU; "gelu_new", GPT-2's,
# "gelu_pytorch_tanh" and "gelu_fast" are the same tanh approximation).
HF_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}


def strip_prefix(tensors: Mapping[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """Drops ``prefix`` from the names that have it (``transformer.h.0...`` -> ``h.0...``), so a
    checkpoint of the bare model and one of the model with its head read the same."""
    return {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in tensors.items()}


def untie_a_distinct_head(cfg: ModelConfig, tensors: Mapping[str, np.ndarray], table: str,
                          head: str = "lm_head.weight") -> ModelConfig:
    """``tie_output=False`` when the checkpoint stores an output head ``head`` that differs from
    the token table ``table`` a tied head would reuse, although its config asks for tying: as
    transformers loads it, the stored head is used (tying it to the table would give other logits,
    silently). Equal or absent: ``cfg`` as it is."""
    if not cfg.tie_output or head not in tensors or table not in tensors:
        return cfg
    if isinstance(tensors[head], Unreadable) or isinstance(tensors[table], Unreadable):
        return cfg  # not comparable: reading the table (or the head, if used) names the dtype

    if np.array_equal(np.asarray(tensors[head]), np.asarray(tensors[table])):
        return cfg
    logging.warning("The checkpoint's %s differs from %s although its config ties them "
                    "(tie_word_embeddings); using the stored %s, as transformers does.", head, table, head)
    return cfg.replace(tie_output=False)


def _flatten(tree, prefix=()):
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _flatten(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def _shape(x) -> tuple[int, ...]:
    return tuple(int(d) for d in x.shape)


class ParamBuilder:
    """Collects our parameters one at a time: ``take`` reads a checkpoint tensor (checking its
    shape), ``put`` stores one of ours (checking it against the shape our model expects)."""

    def __init__(
        self,
        tensors: Mapping[str, np.ndarray],
        config: ModelConfig,
        ignore: Callable[[str], bool] = lambda name: False,
    ):
        from transformer_jax.params import param_shapes

        self._tensors = tensors
        self._ignore = ignore
        self._config = config
        self._expected = {"/".join(path): _shape(x) for path, x in _flatten(param_shapes(config))}
        self._values: dict[str, np.ndarray] = {}
        self._used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self._tensors

    def take(self, name: str, shape: Iterable[int]) -> np.ndarray:
        """The checkpoint tensor ``name`` as float32, which must have ``shape``."""
        shape = tuple(shape)
        if name not in self._tensors:
            raise ConversionError(f"tensor {name!r} (expected shape {shape}) is missing from the checkpoint")
        value = self._tensors[name]
        if isinstance(value, Unreadable):
            raise ConversionError(value.why)
        if _shape(value) != shape:
            raise ConversionError(
                f"tensor {name!r} has shape {_shape(value)}, expected {shape} from config.json's sizes "
                f"(where config.json lacks one, transformers' default): the weights and config.json "
                f"are of different models")
        self._used.add(name)
        return np.asarray(value, np.float32)

    def put(self, path: str, value: np.ndarray, source: str) -> None:
        """Stores our parameter ``path`` ('decoder/layer_0/self_attention/query/kernel')."""
        if path not in self._expected:
            raise ConversionError(f"internal: {source!r} maps to {path!r}, which the model does not have")
        if _shape(value) != self._expected[path]:
            raise ConversionError(
                f"tensor {source!r} becomes {path!r} with shape {_shape(value)}, "
                f"but the model expects {self._expected[path]}"
            )
        self._values[path] = value

    def build(self) -> dict:
        """The nested parameter dict (jax arrays in the config's param_dtype)."""
        missing = sorted(set(self._expected) - set(self._values))
        if missing:
            raise ConversionError(f"internal: no checkpoint tensor mapped to {missing}")
        unused = sorted(k for k in self._tensors if k not in self._used and not self._ignore(k))
        if unused:
            logging.warning("checkpoint tensors not used: %s", unused)
        dtype = self._config.weights_dtype
        tree: dict = {}
        for path, value in self._values.items():
            *parents, leaf = path.split("/")
            node = tree
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = jnp.asarray(value, dtype)
        return tree


# ----------------------------------------------------------------------------- layouts


def heads_in(kernel_in_out: np.ndarray, num_heads: int) -> np.ndarray:
    """A [D, H*K] projection (inputs first) -> our [D, H, K] query/key/value kernel."""
    d, hk = kernel_in_out.shape
    return kernel_in_out.reshape(d, num_heads, hk // num_heads)


def heads_out(kernel_in_out: np.ndarray, num_heads: int) -> np.ndarray:
    """A [H*K, D] output projection (inputs first) -> our [H, K, D] kernel."""
    hk, d = kernel_in_out.shape
    return kernel_in_out.reshape(num_heads, hk // num_heads, d)


def heads_bias(bias: np.ndarray, num_heads: int) -> np.ndarray:
    """[H*K] -> [H, K]."""
    return bias.reshape(num_heads, -1)


def check_options(model_type: str, problems: list[str]) -> None:
    """Raises one error listing every unsupported option found."""
    if problems:
        listed = "\n  - ".join(problems)
        raise ConversionError(f"unsupported {model_type} checkpoint options:\n  - {listed}")
