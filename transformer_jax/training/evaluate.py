"""Evaluation: validation loss / perplexity / token accuracy, and for translation BLEU and exact
match of decoded outputs (greedy or beam search from ``transformer_jax.decoding``).

BLEU is sacrebleu's corpus BLEU, cased, on detokenised text (our SentencePiece tokenizer
round-trips the raw text exactly, so decoded ids are the detokenised sentence), over every example
of the split (or its first ``dataset.max_eval_examples``, as the training loop builds the batches).
References come from the evaluation batches' target ids (the same round trip).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from transformer_jax import parallel
from transformer_jax.data import EOS_ID, to_global_batch
from transformer_jax.decoding import beam_search, bucket_length, generate
from transformer_jax.decoding.model_steps import Seq2SeqStep, encode_source
from transformer_jax.training import losses

# The quality metrics `evaluate_loss` returns (it adds eval_num_tokens): what the loop logs every
# eval_every_steps and what config.keep_best_metric may rank checkpoints by.
EVAL_METRICS = ("eval_loss", "eval_nll", "eval_perplexity", "eval_accuracy")


class Stopped(Exception):  # noqa: N818 - a stop that was asked for, not an error
    """`translate` was asked to stop (its ``stop`` answered True) before it had decoded every batch."""


def _batch_sharding(mesh, rules):
    """Where a global batch goes: by ``rules`` (logical axis rules), or, for None, `to_global_batch`'s
    default (split over the mesh's 'data' and 'fsdp' axes, as the default rules split it)."""
    return None if rules is None else parallel.batch_sharding(mesh, parallel.check_rules(rules, mesh))


def evaluate_loss(eval_step: Callable, params, batches: Sequence[dict], mesh, rules=None) -> dict[str, float]:
    """Token-weighted means over every batch: the ``EVAL_METRICS`` and eval_num_tokens. ``rules``:
    the logical axis rules that split the batch over ``mesh`` (None: its 'data' and 'fsdp' axes)."""
    sharding = _batch_sharding(mesh, rules)
    totals = None
    one_at_a_time = parallel.one_program_at_a_time()  # multi-process on CPUs: they would hang
    for batch in batches:
        sums = eval_step(params, to_global_batch(batch, mesh, sharding))
        totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
        if one_at_a_time:
            jax.block_until_ready(totals)
    totals = jax.device_get(totals)
    aux = {k: totals[k] for k in ("nll", "z_loss", "correct")}
    metrics = losses.normalize_metrics(totals["loss_sum"], totals["weight_sum"], aux)
    return {f"eval_{k}": float(v) for k, v in metrics.items() if k != "z_loss"}


@dataclasses.dataclass
class Translations:
    sources: list[str]
    references: list[str]
    hypotheses: list[str]

    @property
    def exact_match(self) -> float:
        pairs = zip(self.hypotheses, self.references)
        return sum(h == r for h, r in pairs) / max(1, len(self.references))

    def bleu(self) -> float:
        """Corpus BLEU (sacrebleu's defaults: cased, 13a tokenisation); 0.0 for no examples, as
        `exact_match` gives (sacrebleu raised IndexError)."""
        import sacrebleu

        if not self.hypotheses:
            return 0.0
        return float(sacrebleu.corpus_bleu(self.hypotheses, [self.references]).score)

    def examples(self, n: int = 3) -> str:
        lines = []
        for src, ref, hyp in list(zip(self.sources, self.references, self.hypotheses))[:n]:
            lines += [f"  source:    {src}", f"  reference: {ref}", f"  output:    {hyp}", ""]
        return "\n".join(lines)


def _cut_at_eos(ids) -> list[int]:
    ids = [int(i) for i in ids]
    return ids[: ids.index(EOS_ID)] if EOS_ID in ids else ids


def _gather(x) -> np.ndarray:
    """A global array -> the whole array as numpy on every process."""
    if jax.process_count() == 1:
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def decode_batch(
    model,
    params,
    src,
    src_segment_ids,
    *,
    max_new_tokens: int,
    beam_size: int = 1,
    alpha: float = 0.6,
    max_new_tokens_per_row=None,
) -> jax.Array:
    """Output token ids [B, T] for a global source batch; beam_size 1 = greedy. Row b stops after
    ``max_new_tokens_per_row[b]`` tokens when given (int [B], each in [1, T])."""
    cfg = model.config
    cache = encode_source(model, params, src, max_new_tokens + 1, src_segment_ids)
    batch = src.shape[0]
    start = jnp.full((batch, 1), cfg.decoder_start_id, jnp.int32)
    ones = jnp.ones((batch,), jnp.int32)
    step_fn = Seq2SeqStep(model)
    if beam_size > 1:
        out = beam_search(
            step_fn,
            params,
            cache,
            start,
            ones,
            max_new_tokens=max_new_tokens,
            beam_size=beam_size,
            alpha=alpha,
            max_new_tokens_per_row=max_new_tokens_per_row,
            eos_id=cfg.eos_id,
            pad_id=cfg.pad_id or 0,
        )
        return out.tokens[:, 0]
    return generate(
        step_fn,
        params,
        cache,
        start,
        ones,
        max_new_tokens=max_new_tokens,
        max_new_tokens_per_row=max_new_tokens_per_row,
        eos_id=cfg.eos_id,
        pad_id=cfg.pad_id or 0,
        donate_cache=True,
    ).tokens


def _source_width(longest: int, width: int) -> int:
    """The columns to decode a batch of sources whose longest has ``longest`` tokens: the next power
    of two (at least 8), within the rows' ``width``."""
    return min(width, bucket_length(max(1, longest)))


def translate(
    model,
    params,
    batches: Sequence[dict],
    tokenizer,
    mesh,
    *,
    max_new_tokens: int,
    beam_size: int = 1,
    alpha: float = 0.6,
    extra_len: int | None = None,
    stop: Callable[[], bool] | None = None,
    rules=None,
) -> Translations:
    """Decodes every example of ``batches`` (host-local eval batches, one example per row);
    the result holds all processes' examples, in split order (each process holding a contiguous
    part of it, as `data.pipeline.make_eval_batches` shards it), on every process.

    Each output has at most ``max_new_tokens`` tokens, and with ``extra_len`` at most its source's
    length (its tokens up to and including EOS) + ``extra_len``: the paper's limit is + 50.

    ``stop`` is asked before each batch; when it answers True, `Stopped` is raised (a preemption
    during a long beam-search evaluation). With several processes it must answer alike on all.

    ``rules``: the logical axis rules for ``mesh`` (None: `parallel.DEFAULT_RULES`)."""
    parts = []  # per batch: (order, source, target, output) rows of every process
    sharding = _batch_sharding(mesh, rules)
    with parallel.sharding_context(mesh, parallel.DEFAULT_RULES if rules is None else rules):
        for index, batch in enumerate(batches):
            if stop is not None and stop():
                raise Stopped(f"stopped before batch {index} of {len(batches)}")
            # Each row's place in split order: process, then batch, then row (each process holds a
            # contiguous part of the split). The global batch stacks the processes' rows side by
            # side, so gathering batch by batch alone would interleave the processes' parts.
            rows = batch["inputs"].shape[0]
            order = (jax.process_index() * len(batches) + index) * rows + np.arange(rows, dtype=np.int32)
            glob = to_global_batch({**{k: batch[k] for k in ("inputs", "inputs_segment_ids", "targets")},
                                    "order": order.astype(np.int32)}, mesh, sharding)
            source_len = jnp.sum(glob["inputs_segment_ids"] > 0, axis=1, dtype=jnp.int32)
            limits = None
            if extra_len is not None:
                limits = jnp.clip(source_len + extra_len, 1, max_new_tokens)
            # One example per row, right-padded: padding is inferred from pad ids. Decoded at the
            # width of the batch's longest source (a power of two, so a few widths compile), not at
            # the rows' width, which holds the longest source the model takes.
            width = _source_width(int(jax.device_get(jnp.max(source_len))), glob["inputs"].shape[1])
            tokens = decode_batch(
                model,
                params,
                glob["inputs"][:, :width],
                None,
                max_new_tokens=max_new_tokens,
                beam_size=beam_size,
                alpha=alpha,
                max_new_tokens_per_row=limits,
            )
            src, tgt, seg, at = (_gather(glob[k])
                                 for k in ("inputs", "targets", "inputs_segment_ids", "order"))
            real = seg[:, 0] > 0
            parts += zip(at[real], src[real], tgt[real], _gather(tokens)[real])
    parts.sort(key=lambda part: int(part[0]))
    sources = tokenizer.decode_batch([_cut_at_eos(p[1]) for p in parts])
    references = tokenizer.decode_batch([_cut_at_eos(p[2]) for p in parts])
    hypotheses = tokenizer.decode_batch([_cut_at_eos(p[3]) for p in parts])
    return Translations(sources, references, hypotheses)
