"""Step functions for the library's models, for `generate` and `beam_search`.

A step function is a frozen dataclass holding only the (hashable) Linen module, so it can be a
static jit argument: two ``LMStep(model)`` built from equal configs hash equal and share one
compilation. Parameters are never captured; the decoders pass them as a traced argument::

    model = tj.TransformerLM(config)
    cache = tj.init_cache(config, batch_size, prompt_width + max_new_tokens)
    out = generate(LMStep(model), params, cache, prompts, lengths, max_new_tokens=...)

    model = tj.Transformer(config)
    cache = encode_source(model, params, src, max_length=src_len + 50)   # runs the encoder once
    start = jnp.full((batch, 1), config.decoder_start_id)
    out = beam_search(Seq2SeqStep(model), params, cache, start, jnp.ones(batch, jnp.int32),
                      max_new_tokens=src_len + 50)

`RecomputeLMStep` is the no-cache baseline: every call runs the whole model over a fixed-size
token buffer. It gives the same tokens as `LMStep` and exists to measure what the cache saves.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


def _check_kind(step, drives: str, wrong: str, right: str) -> None:
    """The two step functions call their model differently (``apply(tokens)`` against
    ``apply(src, tgt)``): swapped, the call fails inside the decoder's jit with a TypeError about
    `__call__`'s arguments. Said here, at construction, instead."""
    from transformer_jax import modeling  # model_steps is the one decoding file that knows them

    if isinstance(step.model, getattr(modeling, wrong)):
        raise TypeError(f"{type(step).__name__} drives a {drives}; for a {wrong} use tj.{right}(model)")


@dataclasses.dataclass(frozen=True)
class LMStep:
    """``step_fn`` for `TransformerLM`: ``params`` is the module's 'params' collection and the
    cache a `KVCache` from ``tj.init_cache``. Returns the logits of each row's last real token
    only ([B, 1, V]), so a prompt prefill does not compute a [B, P, V] array."""

    model: nn.Module

    def __post_init__(self):
        _check_kind(self, "TransformerLM", "Transformer", "Seq2SeqStep")

    def __call__(self, params, tokens, cache, num_valid):
        return self.model.apply({"params": params}, tokens, cache=cache, num_valid=num_valid,
                                last_only=True)


@dataclasses.dataclass(frozen=True)
class Seq2SeqStep:
    """``step_fn`` for the encoder-decoder `Transformer`; the cache (from `encode_source`) holds
    the encoded source, so each step runs the decoder only."""

    model: nn.Module

    def __post_init__(self):
        _check_kind(self, "Transformer", "TransformerLM", "LMStep")

    def __call__(self, params, tokens, cache, num_valid):
        return self.model.apply({"params": params}, None, tokens, cache=cache, num_valid=num_valid,
                                last_only=True)


def lm_step_fn(model: nn.Module) -> LMStep:
    """The step function of a `TransformerLM` (params go to `generate`, not here)."""
    return LMStep(model)


def seq2seq_step_fn(model: nn.Module) -> Seq2SeqStep:
    """The step function of an encoder-decoder `Transformer`."""
    return Seq2SeqStep(model)


def encode_source(model: nn.Module, params: Any, src, max_length: int, src_segment_ids=None):
    """Encodes ``src`` [B, S] once; returns the decoding cache for up to ``max_length`` target
    tokens (per INTERFACES: ``method='init_cache'``). Compiled once per model, shape and
    ``max_length``; the source's token ids are checked first, on the host (inside the compiled
    program an id past the vocabulary would look up NaN, and a negative one a row from the end)."""
    from transformer_jax.modeling.transformer import TransformerLM, _as_tokens

    if isinstance(model, TransformerLM):  # Flax's error named init_cache only
        raise TypeError("encode_source encodes the source of an encoder-decoder tj.Transformer; a "
                        "TransformerLM has no source: decode it from tj.init_cache(config, batch, "
                        "length) with tj.LMStep(model), which prefills the prompt")
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    src = _as_tokens("src", src, vocab_size, src_segment_ids=src_segment_ids)
    return _encode_source(model, params, src, max_length, src_segment_ids)


@functools.partial(jax.jit, static_argnames=("model", "max_length"))
def _encode_source(model: nn.Module, params: Any, src, max_length: int, src_segment_ids=None):
    return model.apply(
        {"params": params}, src, max_length, src_segment_ids=src_segment_ids, method="init_cache"
    )


@dataclasses.dataclass(frozen=True)
class RecomputeLMStep:
    """A `TransformerLM` step function *without* a KV cache (the baseline the cache is measured
    against): each call writes the new tokens into a token buffer and runs the full model over
    the whole buffer, O(S) work per token instead of O(1).

    Its cache is ``recompute_cache(batch, max_length)``: {'tokens': int32 [B, S], 'lengths': [B]}.
    """

    model: nn.Module

    def __post_init__(self):
        _check_kind(self, "TransformerLM", "Transformer", "Seq2SeqStep")

    def __call__(self, params, tokens, cache, num_valid):
        batch, length = tokens.shape
        rows = jnp.arange(batch)[:, None]
        positions = cache["lengths"][:, None] + jnp.arange(length)  # [B, L]
        buffer = cache["tokens"].at[rows, positions].set(tokens, mode="drop")
        lengths = cache["lengths"] + num_valid
        # Explicit segment ids: a generated token equal to pad_id is still a real token.
        filled = jnp.arange(buffer.shape[1]) < lengths[:, None]
        # The unfilled slots (masked out) take position 0: a buffer longer than the model's
        # max_len would otherwise look up learned positions past the table (NaN), and through
        # the attention products a NaN reaches the real rows too.
        positions_all = jnp.where(filled, jnp.arange(buffer.shape[1]), 0)
        logits = self.model.apply(
            {"params": params},
            buffer,
            segment_ids=filled.astype(jnp.int32),
            positions=positions_all,
        )
        logits = jnp.take_along_axis(logits, positions[:, :, None], axis=1, mode="clip")
        return logits, {"tokens": buffer, "lengths": lengths}


def recompute_cache(batch_size: int, max_length: int) -> dict:
    """The token buffer `RecomputeLMStep` uses instead of a KV cache."""
    return {
        "tokens": jnp.zeros((batch_size, max_length), jnp.int32),
        "lengths": jnp.zeros((batch_size,), jnp.int32),
    }
