"""Decoding: a ``lax.scan`` sampler and beam search driven by a step function.

Nothing here knows the model. Both entry points take a step function

    step_fn(params, tokens [B, L] int32, cache, num_valid [B] int32)
        -> (logits float32 [B, L, V], or [B, 1, V] at each row's last real token; new_cache)

plus ``params`` (a jit argument, so new weights never recompile) and an empty cache whose leaves
all have the batch as their leading axis. ``model_steps`` builds step functions for
``TransformerLM`` and the encoder-decoder ``Transformer``.
"""

from transformer_jax.decoding.beam_search import BeamOutput, beam_search, length_penalty
from transformer_jax.decoding.huge_pages import HugePages, place_on_huge_pages
from transformer_jax.decoding.model_steps import (
    LMStep,
    RecomputeLMStep,
    Seq2SeqStep,
    encode_source,
    lm_step_fn,
    recompute_cache,
    seq2seq_step_fn,
)
from transformer_jax.decoding.sampling import (
    GenerateOutput,
    SamplingConfig,
    StepFn,
    bucket_length,
    generate,
    pad_prompts,
    pad_to_bucket,
    sample_from_logits,
)

__all__ = [
    "BeamOutput",
    "GenerateOutput",
    "HugePages",
    "LMStep",
    "RecomputeLMStep",
    "SamplingConfig",
    "Seq2SeqStep",
    "StepFn",
    "beam_search",
    "bucket_length",
    "encode_source",
    "generate",
    "length_penalty",
    "lm_step_fn",
    "pad_prompts",
    "pad_to_bucket",
    "place_on_huge_pages",
    "recompute_cache",
    "sample_from_logits",
    "seq2seq_step_fn",
]
