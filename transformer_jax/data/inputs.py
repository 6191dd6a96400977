"""The config-facing entry: ``dataset`` config -> (tokenizer, train iterator, eval batches).

    cfg = default_dataset_config("enfr_builtin")
    data = build_datasets(cfg, workdir)
    batch = next(data.train_iter)      # host-local numpy batch, INTERFACES.md layout

Dataset names: 'enfr_builtin', 'stdlib_lm' (offline, built on first use), 'tsv', 'text'
(user files), 'wmt14_translate/de-en', 'wmt17_translate/de-en', 'lm1b' (prepared TFDS
ArrayRecord files in ``data_dir``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Iterator

import grain
import ml_collections
import numpy as np
from absl import logging

from transformer_jax.data import builders, pipeline
from transformer_jax.data.errors import DataError
from transformer_jax.data.tokenizer import Tokenizer, get_or_train_tokenizer, training_lines

TRANSLATION_DATASETS = ("enfr_builtin", "tsv", *builders.STANDARD_TRANSLATION)
LM_DATASETS = ("stdlib_lm", "text", *builders.STANDARD_LM)
DATASET_NAMES = TRANSLATION_DATASETS + LM_DATASETS

_DEFAULTS = {
    # name: (vocab_size, max_source_len, max_target_len, max_len, batch_size)
    "enfr_builtin": (2000, 32, 32, 64, 64),
    "tsv": (8000, 128, 128, 256, 64),
    "wmt14_translate/de-en": (37000, 256, 256, 256, 256),
    "wmt17_translate/de-en": (37000, 256, 256, 256, 256),
    "stdlib_lm": (4000, 128, 128, 256, 32),
    "text": (8000, 128, 128, 256, 32),
    "lm1b": (32000, 128, 128, 128, 256),
}


def default_dataset_config(name: str = "enfr_builtin") -> ml_collections.ConfigDict:
    """Every dataset field with its default for ``name``; configs/ start from this."""
    if name not in _DEFAULTS:
        raise DataError(f"Unknown dataset {name!r}; choose one of {list(_DEFAULTS)}")
    vocab, src_len, tgt_len, max_len, batch = _DEFAULTS[name]
    cfg = ml_collections.ConfigDict()
    cfg.name = name
    cfg.builder_config = ""  # e.g. 'small' for enfr_builtin; '' = the builder's default
    cfg.data_dir = os.path.join("~", "tensorflow_datasets")
    cfg.train_files = ()  # 'tsv' / 'text': paths
    cfg.eval_files = ()
    # Translation direction: source_lang -> target_lang (feature names of the dataset);
    # '' = the dataset's default (en -> fr, en -> de, source -> target); one of them set alone
    # takes the dataset's other language for the other (source_lang='fr' on en-fr: fr -> en).
    cfg.source_lang = ""
    cfg.target_lang = ""
    cfg.reverse = False  # swap source and target
    cfg.vocab_size = vocab
    cfg.tokenizer_type = "bpe"  # 'bpe' | 'unigram'
    cfg.tokenizer_max_chars = 20_000_000  # training text for SentencePiece
    cfg.max_source_len = src_len  # tokens, EOS included (translation)
    cfg.max_target_len = tgt_len
    cfg.max_len = max_len  # tokens per row (decoder-only)
    cfg.batch_size = batch  # global rows per step; each host gets batch_size / process_count
    cfg.pack = True
    cfg.pack_bins = 0  # open rows in the packer; 0 = max(per-host batch, 32)
    # Training examples longer than the row: 'truncate' | 'drop' | 'split' (decoder-only: cut
    # into row-sized pieces). Evaluation truncates translation examples and cuts decoder-only
    # documents into row-sized pieces.
    cfg.length_policy = "split" if name in LM_DATASETS else "truncate"
    cfg.seed = 0
    cfg.num_workers = 0  # grain worker processes (0 = in the main process)
    cfg.eval_split = ""  # '' = the dataset's validation split ('test' for lm1b, which has no other)
    cfg.eval_batch_size = batch
    cfg.max_eval_examples = 0  # 0 = all
    return cfg


@dataclasses.dataclass
class Datasets:
    tokenizer: Tokenizer
    train_iter: Iterator[dict[str, np.ndarray]]  # a grain.DatasetIterator (get_state/set_state)
    eval_batches: list[dict[str, np.ndarray]]
    is_translation: bool
    train_size: int
    eval_size: int


def _direction(cfg, default: tuple[str, str], available) -> tuple[str, str]:
    """(source, target) language of a translation dataset with the two languages ``available``.

    One side set alone takes the dataset's other language as the other side (``source_lang='fr'``
    on en-fr is fr -> en), neither set is ``default``, and both set to the same language is an
    error: a copy task, whose loss falls and whose BLEU looks high, teaches no translation.
    """
    src, tgt = cfg.source_lang, cfg.target_lang
    for key, lang in (("source_lang", src), ("target_lang", tgt)):
        if lang and lang not in available:
            raise DataError(f"dataset.{key}={lang!r}: dataset {cfg.name!r} has no language {lang!r}; "
                            f"it has {sorted(available)}")
    other = lambda lang: next(x for x in available if x != lang)  # noqa: E731
    if src and not tgt:
        tgt = other(src)
    elif tgt and not src:
        src = other(tgt)
    elif not src:
        src, tgt = default
    if src == tgt:
        raise DataError(f"dataset.source_lang and dataset.target_lang are both {src!r}: a translation "
                        f"needs two languages (dataset {cfg.name!r} has {sorted(available)}); set one "
                        f"of them, or neither for {default[0]} -> {default[1]}")
    if cfg.reverse:
        src, tgt = tgt, src
    return src, tgt


def _open(cfg):
    """-> (builder, train split, eval split, record fields, corpus id)."""
    data_dir = os.path.expanduser(cfg.data_dir)
    name = cfg.name
    if name not in DATASET_NAMES:
        raise DataError(f"Unknown dataset {name!r}; choose one of {list(DATASET_NAMES)}")
    if name in builders.STANDARD_TRANSLATION or name in builders.STANDARD_LM:
        builder = builders.standard_builder(name, data_dir)
        if name in builders.STANDARD_LM:
            field, train_split, eval_split = builders.STANDARD_LM[name]
            return builder, train_split, eval_split, (field,)
        (lang_a, lang_b), train_split, eval_split = builders.STANDARD_TRANSLATION[name]
        # WMT de-en: English -> German by default, as in the paper.
        return builder, train_split, eval_split, _direction(cfg, (lang_b, lang_a),
                                                             (lang_a, lang_b))
    builder = builders.builtin_builder(name, data_dir, cfg.builder_config or None,
                                       cfg.train_files, cfg.eval_files)
    if name == "enfr_builtin":
        return builder, "train", "validation", _direction(cfg, ("en", "fr"), ("en", "fr"))
    if name == "tsv":
        return builder, "train", "validation", _direction(cfg, ("source", "target"),
                                                          ("source", "target"))
    return builder, "train", "validation", ("text",)


def _eval_split(cfg, builder, default: str) -> str:
    """``cfg.eval_split``, or the dataset's evaluation split ``default``.

    Only the default is replaced by 'validation' where the dataset lacks it; a split that was
    asked for by name and does not exist is a :class:`DataError` listing those that do.
    """
    splits = builder.info.splits
    if cfg.eval_split and cfg.eval_split != default:
        if cfg.eval_split not in splits:
            files = (" (for 'tsv' and 'text', dataset.eval_files make the 'validation' split)"
                     if cfg.name in ("tsv", "text") else "")
            raise DataError(f"Dataset {builder.info.full_name} has no split {cfg.eval_split!r} "
                            f"(dataset.eval_split, or test_split after training); it has "
                            f"{sorted(splits)}{files}")
        return cfg.eval_split
    if default not in splits and "validation" in splits:
        logging.warning("dataset %s has no %r split: evaluating on 'validation'",
                        builder.info.full_name, default)
        return "validation"
    return default


def resolve_test_split(cfg: ml_collections.ConfigDict, split: str) -> str:
    """The split the after-training evaluation (``config.test_split``) reads, checked before
    training starts: ``split`` itself when the dataset has it. Your own files ('tsv', 'text')
    have only 'train' and, with ``dataset.eval_files``, 'validation': the latter is used, else the
    training examples, with a warning (the metrics are named after the split read). For any other
    dataset a missing split is a :class:`DataError` listing those it has, and so is a split whose
    files are missing, cut short or unreadable (found after training, hours in, before)."""
    builder, _, _, _ = _open(cfg)
    splits = builder.info.splits
    if split in splits:
        builders.data_source(builder, split)  # its files checked (a footer read each)
        return split
    if cfg.name in ("tsv", "text"):
        used = "validation" if "validation" in splits else "train"
        logging.warning("dataset %s has no %r split (config.test_split): evaluating on %r after "
                        "training instead", cfg.name, split, used)
        return used
    raise DataError(f"Dataset {builder.info.full_name} has no split {split!r} (config.test_split); "
                    f"it has {sorted(splits)}")


def _tokenizer_texts(source, fields, max_chars: int):
    """Yields the text of ``fields`` of the records of ``source`` that tokenizer training takes
    (``max_chars`` characters, counted as training counts them), in the source's order: all of
    them where the split fits, else a sample spread evenly over it. The sample is the first records
    of the bit-reversed order (0, n/2, n/4, 3n/4, ...): any prefix of it is spaced evenly. Spaced
    by an estimate from a few records instead, one huge line among them thinned the sample to 2 of
    200 records, and an estimate too low left the end of the split out.
    """
    def texts():
        n = len(source)
        bits = max(0, n - 1).bit_length()
        chosen, budget = {}, max_chars
        for j in range(1 << bits):
            if budget <= 0:
                break
            i = int(format(j, f"0{bits}b")[::-1], 2) if bits else 0  # j's bits reversed
            if i < n:
                record = source[i]
                chosen[i] = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t
                             for t in (record[f] for f in fields)]
                budget -= sum(len(line) for text in chosen[i] for line in training_lines(text))
        for i in sorted(chosen):
            yield from chosen[i]
    return texts


def build_datasets(cfg: ml_collections.ConfigDict, workdir: str, *,
                   shard: grain.sharding.ShardOptions | None = None) -> Datasets:
    """Builds (once) and opens the dataset, gets the tokenizer, and makes the iterators.

    The tokenizer is trained on the training split (both sides for translation: one shared
    vocabulary) and kept as ``workdir/tokenizer.model``. ``shard`` defaults to this JAX process.
    """
    builder, train_split, eval_split, fields = _open(cfg)
    eval_split = _eval_split(cfg, builder, eval_split)
    train_source = builders.data_source(builder, train_split)
    if eval_split not in builder.info.splits and cfg.name in ("tsv", "text"):
        # No eval_files: evaluate on (up to 1,000 of) the training examples, and say so.
        n = min(1000, len(train_source), cfg.max_eval_examples or len(train_source))
        eval_source = [train_source[i] for i in range(n)]  # (max_eval_examples: those evaluated)
        logging.warning("dataset %s has no eval_files: evaluating on %d training examples",
                        cfg.name, len(eval_source))
    else:
        eval_source = builders.data_source(builder, eval_split)
    index, count = pipeline._shard_options(shard)
    shard = grain.sharding.ShardOptions(index, count)
    if cfg.batch_size % count or cfg.eval_batch_size % count:
        raise DataError(f"batch_size {cfg.batch_size} and eval_batch_size "
                        f"{cfg.eval_batch_size} must divide by the {count} processes")

    corpus_key = f"{builder.info.full_name}:{train_split}:{len(train_source)}:" + \
        hashlib.sha1(",".join(sorted(set(fields))).encode()).hexdigest()[:8]
    tokenizer = get_or_train_tokenizer(
        workdir, corpus_key, _tokenizer_texts(train_source, sorted(set(fields)),
                                              cfg.tokenizer_max_chars),
        cfg.vocab_size, cfg.tokenizer_type, process_index=index,
        max_training_chars=cfg.tokenizer_max_chars)

    is_translation = len(fields) == 2
    if is_translation:
        features = pipeline.Features({"inputs": fields[0], "targets": fields[1]})
        lengths = {"inputs": cfg.max_source_len, "targets": cfg.max_target_len}
    else:
        features = pipeline.Features({"targets": fields[0]})
        lengths = {"targets": cfg.max_len}
    train_iter = pipeline.make_train_iterator(
        train_source, tokenizer, features, lengths, cfg.batch_size // count,
        seed=cfg.seed, pack=cfg.pack, length_policy=cfg.length_policy, shard=shard,
        num_workers=cfg.num_workers, num_bins=cfg.pack_bins or None, split=train_split)
    eval_batches = pipeline.make_eval_batches(
        eval_source, tokenizer, features, lengths, cfg.eval_batch_size // count, shard=shard,
        max_examples=cfg.max_eval_examples or None)
    eval_size = min(len(eval_source), cfg.max_eval_examples or len(eval_source))  # those evaluated
    return Datasets(tokenizer, train_iter, eval_batches, is_translation, len(train_source), eval_size)
