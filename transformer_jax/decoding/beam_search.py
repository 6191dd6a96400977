"""Beam search with a GNMT length penalty, fixed shapes, inside one ``lax.while_loop``.

The paper decodes translations with beam size 4 and length penalty alpha = 0.6 (section 6.1),
the penalty of Wu et al. 2016 (GNMT): ``score = log P(Y) / ((5 + |Y|) / 6) ** alpha``.

Like GNMT and t5x, two sets are kept per batch row: K *live* hypotheses that have not emitted
EOS, and the K best *finished* ones. At each step the live beams propose their 2K best
extensions (so that K non-EOS ones always remain); those ending in EOS compete for the finished
set, the rest become the new live beams, and the cache rows are gathered to follow their parents.
The loop stops early once no live beam can beat the worst finished one: log-probabilities only
fall as a hypothesis grows, so a live beam's best reachable score is its current log-probability
divided by the penalty at the maximum length (alpha >= 0).

Same step-function contract as `sampling.generate`:
``step_fn(params, tokens [B, L], cache, num_valid [B]) -> (logits [B, L, V] or [B, 1, V], cache)``.
The prompt is prefilled once at batch B; the cache is then repeated to B * beam_size rows.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from transformer_jax.decoding.sampling import (
    FROM_MODEL,
    NEG_INF,
    SamplingConfig,
    StepFn,
    _check_cache,
    _check_max_new_tokens,
    _check_prompt,
    _is_whole,
    _last_valid,
    _prefill,
    _row_limits,
    resolve_special_ids,
    step_model_config,
)


class BeamOutput(NamedTuple):
    """Result of `beam_search`, hypotheses ordered best first along the beam axis.

    tokens:    int32 [B, K, T] generated tokens (prompt excluded), ``pad_id`` after EOS.
    scores:    float32 [B, K] length-penalised scores, log P / ((5 + length) / 6) ** alpha.
    logprobs:  float32 [B, K] total log-probability of each hypothesis (no penalty).
    lengths:   int32 [B, K] generated length, counting the EOS; T for a hypothesis cut off at
               max_new_tokens without EOS.
    """

    tokens: jax.Array
    scores: jax.Array
    logprobs: jax.Array
    lengths: jax.Array


class _Beams(NamedTuple):
    """A fixed-size set of K hypotheses per row; [B, K, ...] leaves."""

    tokens: jax.Array  # int32 [B, K, T]
    logprobs: jax.Array  # float32 [B, K]
    scores: jax.Array  # float32 [B, K] (finished set only; live beams rank by logprobs)
    lengths: jax.Array  # int32 [B, K]


def length_penalty(length, alpha):
    """GNMT length penalty ((5 + length) / 6) ** alpha (Wu et al. 2016, eq. 14)."""
    return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def _take(x: jax.Array, index: jax.Array) -> jax.Array:
    """Per-row gather along the beam axis: x [B, N, ...], index [B, M] -> [B, M, ...]."""
    index = index.reshape(index.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, index, axis=1)


def _top(beams: _Beams, rank: jax.Array, k: int) -> _Beams:
    """The k entries of ``beams`` with the highest ``rank`` [B, N], best first."""
    _, index = jax.lax.top_k(rank, k)
    return jax.tree.map(lambda x: _take(x, index), beams)


def _expand(live: _Beams, finished: _Beams, logprobs, step, alpha, limits, min_new_tokens, *, eos_id):
    """One beam step: extends ``live`` with next-token ``logprobs`` [B, K, V] at position ``step``.

    EOS is forbidden while ``step < min_new_tokens`` (its log-probability set to -inf, as a
    logits processor would; the others are not renormalised). A row whose limit [B] is reached
    (``step >= limits``) adds nothing to its finished set; its live beams, cut off when they
    reached the limit (`_cut_off`), carry on unused.

    Returns (new live, new finished, parent beam index [B, K] of each new live beam).
    """
    if eos_id is not None:
        too_early = step < min_new_tokens
        logprobs = logprobs.at[..., eos_id].set(jnp.where(too_early, NEG_INF, logprobs[..., eos_id]))
    batch, beam, vocab = logprobs.shape
    totals = (live.logprobs[:, :, None] + logprobs).reshape(batch, beam * vocab)
    cand_logprobs, flat = jax.lax.top_k(totals, 2 * beam)
    parent, token = flat // vocab, (flat % vocab).astype(jnp.int32)
    cand_tokens = _take(live.tokens, parent).at[:, :, step].set(token)
    length = jnp.full(parent.shape, step + 1, jnp.int32)
    is_eos = jnp.zeros_like(token, bool) if eos_id is None else token == eos_id
    candidates = _Beams(cand_tokens, cand_logprobs, cand_logprobs / length_penalty(step + 1, alpha), length)

    live_rank = jnp.where(is_eos, NEG_INF * 2, cand_logprobs)
    _, live_index = jax.lax.top_k(live_rank, beam)
    new_live = jax.tree.map(lambda x: _take(x, live_index), candidates)
    new_live = new_live._replace(logprobs=_take(live_rank, live_index))

    active = (step < limits)[:, None]
    ended = is_eos & active
    new_finished = candidates._replace(scores=jnp.where(ended, candidates.scores, NEG_INF * 2))
    pool = jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1), finished, new_finished)
    return new_live, _top(pool, pool.scores, beam), _take(parent, live_index)


def _as_finished(live: _Beams, length, alpha, keep) -> _Beams:
    """Live hypotheses ended without EOS at ``length`` tokens, scored; only rows/beams where ``keep``
    [B, 1] is true and that are real hypotheses (not the -inf fillers) get a finite score."""
    real = keep & (live.logprobs > NEG_INF)
    return live._replace(
        lengths=jnp.broadcast_to(jnp.asarray(length, jnp.int32), live.lengths.shape),
        scores=jnp.where(real, live.logprobs / length_penalty(length, alpha), NEG_INF * 2),
    )


def _cut_off(live: _Beams, finished: _Beams, step, alpha, limits):
    """After the token at position ``step``: rows whose limit [B] it reached end their live beams
    there, which compete for the finished set as hypotheses cut off at max_new_tokens do."""
    cut = (step + 1 == limits)[:, None]
    ended = _as_finished(live, step + 1, alpha, cut)
    pool = jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1), finished, ended)
    live = live._replace(logprobs=jnp.where(cut, NEG_INF * 2, live.logprobs))
    return live, _top(pool, pool.scores, live.logprobs.shape[1])


def _reorder(cache, parent: jax.Array, cpu_kernels: str):
    """Gathers cache rows [B * K, ...] so row (b, k) holds the state of beam parent[b, k].

    A cache with a ``reorder_beams(rows, cpu_kernels)`` method reorders itself (`KVCache` leaves
    the source's cross-attention K/V alone, the same for every beam of a row, and on the CPU copies
    only the filled positions of the rows whose parent changed); any other pytree has every leaf
    gathered.
    """
    batch, beam = parent.shape
    rows = (jnp.arange(batch)[:, None] * beam + parent).reshape(-1)
    if hasattr(cache, "reorder_beams"):
        return cache.reorder_beams(rows, cpu_kernels)
    return jax.tree.map(lambda x: x[rows], cache)


@functools.partial(jax.jit, static_argnames=("step_fn", "beam_size", "max_new_tokens", "eos_id", "pad_id"))
def _beam_search_jit(
    step_fn,
    params,
    cache,
    prompt_tokens,
    prompt_lengths,
    alpha,
    min_new_tokens,
    limits,
    *,
    beam_size,
    max_new_tokens,
    eos_id,
    pad_id,
):
    batch, beam, steps = prompt_tokens.shape[0], beam_size, max_new_tokens
    config = step_model_config(step_fn)
    cpu_kernels = getattr(config, "cpu_kernels", "xla")
    logits, cache = _prefill(step_fn, params, prompt_tokens, cache, prompt_lengths)
    first = jax.nn.log_softmax(_last_valid(logits, prompt_lengths).astype(jnp.float32), axis=-1)
    cache = jax.tree.map(lambda x: jnp.repeat(x, beam, axis=0), cache)

    empty_tokens = jnp.full((batch, beam, steps), pad_id, jnp.int32)
    zeros = jnp.zeros((batch, beam), jnp.int32)
    # Only beam 0 starts live, so the first step does not propose K copies of each token.
    start = jnp.where(jnp.arange(beam) == 0, 0.0, NEG_INF * 2)
    live = _Beams(empty_tokens, jnp.broadcast_to(start, (batch, beam)), zeros * 0.0, zeros)
    finished = _Beams(empty_tokens, zeros * 0.0, jnp.full((batch, beam), NEG_INF * 2), zeros)
    live, finished, parent = _expand(
        live, finished, jnp.repeat(first[:, None], beam, axis=1), jnp.int32(0), alpha, limits,
        min_new_tokens, eos_id=eos_id,
    )
    live, finished = _cut_off(live, finished, jnp.int32(0), alpha, limits)
    cache = _reorder(cache, parent, cpu_kernels)
    ones = jnp.ones((batch * beam,), jnp.int32)

    def keep_going(state):
        step, live, finished, _ = state
        best_reachable = live.logprobs[:, 0] / length_penalty(limits, alpha)
        can_improve = (finished.scores[:, -1] < best_reachable) & (step < limits)
        return (step < steps) & jnp.any(can_improve)

    def body(state):
        step, live, finished, cache = state
        last = live.tokens[:, :, step - 1].reshape(batch * beam, 1)
        logits, cache = step_fn(params, last, cache, ones)
        logprobs = jax.nn.log_softmax(logits[:, 0].astype(jnp.float32), axis=-1)
        live, finished, parent = _expand(
            live, finished, logprobs.reshape(batch, beam, -1), step, alpha, limits,
            min_new_tokens, eos_id=eos_id,
        )
        live, finished = _cut_off(live, finished, step, alpha, limits)
        return step + 1, live, finished, _reorder(cache, parent, cpu_kernels)

    step, live, finished, _ = jax.lax.while_loop(keep_going, body, (jnp.int32(1), live, finished, cache))

    # Hypotheses still live when decoding stops early (no live beam could beat the finished ones)
    # compete too; rows cut off at their limit have already put theirs in the finished set.
    live = _as_finished(live, step, alpha, (step < limits)[:, None])
    pool = jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1), finished, live)
    best = _top(pool, pool.scores, beam)
    return BeamOutput(best.tokens, best.scores, best.logprobs, best.lengths)


def beam_search(
    step_fn: StepFn,
    params: Any,
    cache: Any,
    prompt_tokens,
    prompt_lengths,
    *,
    max_new_tokens: int,
    beam_size: int = 4,
    alpha: float = 0.6,
    min_new_tokens: int = 0,
    max_new_tokens_per_row=None,
    eos_id: int | None | str = FROM_MODEL,
    pad_id: int | str = FROM_MODEL,
) -> BeamOutput:
    """Beam search for the highest-scoring continuations of each prompt.

    Args:
      step_fn: ``step_fn(params, tokens [B, L], cache, num_valid [B])``
        ``-> (logits [B, L, V] or [B, 1, V] at each row's last real token, cache)``;
        hashable (a static jit argument).
      params: passed to ``step_fn`` unchanged (any pytree, may be None).
      cache: empty step-function state for B rows (it is repeated to B * beam_size rows after the
        prefill) with room for max(P, longest prompt + max_new_tokens - 1) positions (checked for a
        `KVCache`);
        batch-leading leaves.
      prompt_tokens: int32 [B, P], right-padded. For translation, the decoder start token (P = 1).
      prompt_lengths: int32 [B], each in [1, P].
      max_new_tokens: T (the paper uses source length + 50).
      beam_size: K (the paper uses 4). When fewer than K distinct hypotheses exist (tiny
        vocabularies), the missing ones come back with scores of about -1e30.
      alpha: length-penalty exponent, >= 0 and finite (the paper uses 0.6; 0 ranks by
        log-probability).
      min_new_tokens: EOS is forbidden for the first ``min_new_tokens`` tokens (its
        log-probability set to -inf; the other tokens keep theirs).
      max_new_tokens_per_row: optional int [B], each in [1, T]: row b's hypotheses end at
        ``max_new_tokens_per_row[b]`` tokens, exactly as at T (so the result for a row does not
        depend on the longer limits of the rows batched with it). Traced: no recompilation.
      eos_id: ends a hypothesis; None: every hypothesis runs to its row's limit. Default: the
        model's ``eos_id`` (from ``step_fn.model.config``, as in `generate`), else 1.
      pad_id: written after EOS. Default: the model's ``pad_id`` (if it has none, the EOS id, as
        Hugging Face does; 0 without either).

    Returns:
      BeamOutput(tokens [B, K, T], scores [B, K], logprobs [B, K], lengths [B, K]), best first.
    """
    if not _is_whole(beam_size) or beam_size < 1:
        raise ValueError(f"beam_size must be a positive integer, got {beam_size}")
    _check_max_new_tokens(max_new_tokens)
    if not isinstance(alpha, jax.core.Tracer) and not 0.0 <= alpha < float("inf"):  # traced: the caller's
        # (an infinite alpha scores every hypothesis longer than one token -0.0: an arbitrary tie)
        raise ValueError(f"alpha must be >= 0 and finite, got {alpha}")
    eos_id, pad_id = resolve_special_ids(step_fn, eos_id, pad_id)
    prompt_tokens = jnp.asarray(prompt_tokens)
    prompt_lengths = jnp.asarray(prompt_lengths)
    _check_prompt(prompt_tokens, prompt_lengths, step_fn)
    SamplingConfig(min_new_tokens=min_new_tokens)  # checks it, as for `generate`
    batch = prompt_tokens.shape[0]
    limits = _row_limits(max_new_tokens_per_row, batch, int(max_new_tokens))
    _check_cache(step_fn, cache, prompt_tokens, prompt_lengths, int(max_new_tokens), limits)
    if limits is None:
        limits = jnp.full((batch,), max_new_tokens, jnp.int32)
    return _beam_search_jit(
        step_fn,
        params,
        cache,
        prompt_tokens.astype(jnp.int32),
        prompt_lengths.astype(jnp.int32),
        jnp.float32(alpha),
        jnp.int32(min_new_tokens),
        limits,
        beam_size=int(beam_size),
        max_new_tokens=int(max_new_tokens),
        eos_id=eos_id,
        pad_id=pad_id,
    )
