"""grain input pipelines: tokenise, fit to length, pack, batch; shard per host; resume exactly.

Training::

    source (random access) -> this host's slice -> shuffle(seed), reshuffled every epoch
      -> repeat -> tokenise + EOS + length policy -> pack (or pad) -> batch -> [worker processes]

Evaluation: every example of this host's slice exactly once, one example per row, padded with
all-zero rows (segment id 0) to the same number of batches on every host. Long translation
examples are truncated; long decoder-only documents are cut into row-sized pieces, so every
token is scored once.

Batches are dicts of host-local int32 numpy arrays in the layout of INTERFACES.md:
``inputs``/``targets`` plus ``*_segment_ids`` and ``*_positions``; :func:`to_global_batch`
turns them into global ``jax.Array`` s.

The train iterator is a ``grain.DatasetIterator``: ``get_state()``/``set_state()`` give exact
resume, and orbax checkpoints it with ``grain.checkpoint.CheckpointSave(iterator)`` /
``CheckpointRestore(iterator)`` inside ``ocp.args.Composite`` (one JSON file per process).
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np
from absl import flags, logging

from transformer_jax.data.errors import DataError
from transformer_jax.data.packing import FirstFitPackIterDataset, make_row
from transformer_jax.data.tokenizer import EOS_ID, Tokenizer


@dataclasses.dataclass(frozen=True)
class Features:
    """Which record fields feed which batch keys: {batch key: record field}.

    Translation: ``{'inputs': 'en', 'targets': 'fr'}``; LM: ``{'targets': 'text'}``.
    """

    fields: Mapping[str, str]

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(self.fields)


class LengthStats:
    """Counts of examples cut or dropped by the length policy, in this process.

    With ``dataset.num_workers > 0`` the training examples are tokenised in the input workers, so
    each worker counts (and reports) its own, and ``worker`` names it in the message."""

    def __init__(self):
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self._reported: set[str] = set()
        self.worker = ""  # e.g. "input worker 1 of 2"; set in the worker processes

    def add(self, what: str, message: str) -> None:
        with self._lock:
            self.counts[what] = self.counts.get(what, 0) + 1
            first = what not in self._reported
            self._reported.add(what)
        if first:  # once per kind of event and process; the totals stay in ``counts``
            if self.worker:
                logging.warning("%s (%s: reported once by each worker; further cases are only "
                                "counted in that worker process).", message, self.worker)
            else:
                logging.warning("%s (reported once; further cases are only counted in "
                                "transformer_jax.data.pipeline.LENGTH_STATS).", message)


LENGTH_STATS = LengthStats()


class Tokenize(grain.transforms.Map):
    """Record -> {key: int32 token ids + EOS}, fitted to ``lengths`` by ``policy``.

    ``policy='truncate'`` keeps the first ``length - 1`` tokens and the EOS; ``'drop'`` returns
    None, which grain treats as a filtered-out element; ``'split'`` (decoder-only data only)
    returns a list of consecutive pieces of at most ``length`` tokens (flattened by
    :class:`SplitLong`), so no text is lost: the right policy for long documents.
    """

    def __init__(self, tokenizer: Tokenizer, features: Features, lengths: Mapping[str, int],
                 policy: str = "truncate", name: str = "train"):
        if policy not in ("truncate", "drop", "split"):
            raise DataError(f"length_policy must be 'truncate', 'drop' or 'split', got "
                            f"{policy!r}")
        if policy == "split" and len(features.fields) != 1:
            raise DataError("length_policy='split' is for decoder-only data (one feature)")
        self._tokenizer = tokenizer
        self._features = features
        self._lengths = dict(lengths)
        self._policy = policy
        self._name = name

    def map(self, record: Mapping[str, Any]) -> dict[str, np.ndarray] | None:
        out = {}
        for key, field in self._features.fields.items():
            ids = self._tokenizer.encode(record[field])
            ids.append(EOS_ID)
            limit = self._lengths[key]
            if len(ids) > limit and self._policy == "split":
                return [{key: np.asarray(ids[i:i + limit], np.int32)}
                        for i in range(0, len(ids), limit)]
            if len(ids) > limit:
                if self._policy == "drop":
                    LENGTH_STATS.add(f"{self._name}/{key}/dropped",
                                     f"Dropping {self._name} examples whose {key} is longer "
                                     f"than {limit} tokens ({len(ids)} seen)")
                    return None
                LENGTH_STATS.add(f"{self._name}/{key}/truncated",
                                 f"Truncating {self._name} {key} longer than {limit} tokens "
                                 f"({len(ids)} seen) to {limit} (EOS kept)")
                ids = ids[: limit - 1] + [EOS_ID]
            out[key] = np.asarray(ids, np.int32)
        return [out] if self._policy == "split" else out

    def too_long(self, record: Mapping[str, Any]) -> dict[str, int]:
        """{key: tokens with EOS} of the fields longer than their limit (nothing counted)."""
        out = {}
        for key, field in self._features.fields.items():
            n = len(self._tokenizer.encode(record[field])) + 1
            if n > self._lengths[key]:
                out[key] = n
        return out


def _read(source, indices) -> list:
    """The records at ``indices``, in one ``__getitems__`` call where the source has it."""
    indices = [int(i) for i in indices]
    if hasattr(source, "__getitems__"):
        return source.__getitems__(indices)
    return [source[i] for i in indices]


class ReadAndTokenize(grain.transforms.Map):
    """A chunk of record indices -> the list of their tokenised examples.

    Reads the chunk with one ``source.__getitems__`` call: ArrayRecord random reads cost about
    ten times more one record at a time than in a batch. Dropped examples are left out and
    split ones spread out, so the list can be shorter or longer than the chunk.
    """

    def __init__(self, source, tokenize: Tokenize):
        self._source = source
        self._tokenize = tokenize

    def map(self, indices):
        out = []
        for record in _read(self._source, indices):
            example = self._tokenize.map(record)
            if isinstance(example, list):
                out.extend(example)
            elif example is not None:
                out.append(example)
        return out


class Unbatch(grain.experimental.FlatMapTransform):
    """Flattens the lists made by :class:`ReadAndTokenize`."""

    max_fan_out = 1 << 16

    def flat_map(self, examples):
        return examples


class PadToRow(grain.transforms.Map):
    """One example per row (the unpacked layout), segment id 1, positions 0..n-1."""

    def __init__(self, lengths: Mapping[str, int]):
        self._lengths = dict(lengths)

    def map(self, example):
        return make_row([example], self._lengths)


def shard_bounds(num_records: int, process_index: int, process_count: int) -> tuple[int, int]:
    """[start, end) of this process's contiguous slice; sizes differ by at most one."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    return (num_records * process_index // process_count,
            num_records * (process_index + 1) // process_count)


def _shard_options(shard: grain.sharding.ShardOptions | None) -> tuple[int, int]:
    if shard is None:
        import jax

        return jax.process_index(), jax.process_count()
    return shard.shard_index, shard.shard_count


def _check_something_fits(source, tokenize: Tokenize, start: int, end: int, split: str,
                          chunk: int) -> None:
    """With ``length_policy='drop'`` and no example that fits, the endless train iterator would
    wait for ever: read records [start, end) up to the first that fits (usually the first one)
    and raise a :class:`DataError` if none does."""
    too_long: dict[str, list[int]] = {}  # key -> [count, longest]
    for i in range(start, end, chunk):
        for record in _read(source, range(i, min(i + chunk, end))):
            over = tokenize.too_long(record)
            if not over:
                return
            for key, n in over.items():
                count, longest = too_long.get(key, (0, 0))
                too_long[key] = [count + 1, max(longest, n)]
    details = "; ".join(
        f"{count} longer than {tokenize._lengths[key]} tokens (EOS included) in {key} (field "
        f"{tokenize._features.fields[key]!r}; longest {longest})"
        for key, (count, longest) in too_long.items())
    raise DataError(
        f"length_policy='drop' keeps none of the {end - start} examples of split {split!r} in "
        f"this process's shard (records {start} to {end - 1}): {details}. Raise the length "
        f"(dataset.max_len; max_source_len / max_target_len for translation) or use "
        f"length_policy='truncate' ('split' for decoder-only data).")


def make_train_iterator(
    source: Sequence[Mapping[str, Any]],
    tokenizer: Tokenizer,
    features: Features,
    lengths: Mapping[str, int],
    batch_size: int,
    *,
    seed: int = 0,
    pack: bool = True,
    length_policy: str = "truncate",
    shard: grain.sharding.ShardOptions | None = None,
    num_workers: int = 0,
    num_bins: int | None = None,
    read_threads: int = 2,
    read_chunk: int = 64,
    split: str = "train",
) -> grain.DatasetIterator:
    """An endless iterator of host-local batches of ``batch_size`` rows.

    ``source``: random-access records (a TFDS data source, or any sequence of dicts).
    ``shard``: this host's shard (default ``jax.process_index()`` of ``jax.process_count()``);
    each host reads a distinct contiguous slice of the records. ``num_workers`` > 0 runs the
    pipeline in that many worker processes (absl flags must be parsed first). ``num_bins``:
    rows kept open by the packer (default: ``max(batch_size, 32)``). ``split``: the source's
    name in error messages. With ``length_policy='drop'``, a shard where no example fits is a
    :class:`DataError` here (it would otherwise never yield a batch).
    """
    index, count = _shard_options(shard)
    start, end = shard_bounds(len(source), index, count)
    if end <= start:
        raise DataError(f"process {index} of {count} has no training records "
                        f"({len(source)} in all)")
    tokenize = Tokenize(tokenizer, features, lengths, length_policy, "train")
    if length_policy == "drop":
        _check_something_fits(source, tokenize, start, end, split, read_chunk)
    # Shuffle record indices (repeat reseeds the shuffle every epoch), then read and tokenise
    # them in chunks: per-record overheads (ArrayRecord reads, grain bookkeeping) dominate
    # otherwise.
    ds = grain.MapDataset.range(start, end).shuffle(seed=epoch_shuffle_seed(seed)).repeat(None)
    ds = ds.batch(read_chunk, batch_fn=list)
    ds = ds.map(ReadAndTokenize(source, tokenize))
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=read_threads,
                                              prefetch_buffer_size=2 * read_threads))
    it = grain.experimental.FlatMapIterDataset(it, Unbatch())
    if pack:
        it = FirstFitPackIterDataset(it, lengths, num_bins or max(batch_size, 32))
    else:
        it = it.map(PadToRow(lengths))
    it = it.batch(batch_size, drop_remainder=True)
    if num_workers > 0:
        # grain reads absl flags of its own here: outside train.py (a notebook, a script calling the
        # library) nothing has parsed them, which it refuses with UnparsedFlagAccessError.
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers),
                            worker_init_fn=init_input_worker)
    return iter(it)


def close_train_iterator(iterator) -> None:
    """Ends a train iterator's input workers and the unlinking of its batches' shared memory.

    The training process unlinks each batch's shared-memory blocks once the batch is garbage, on
    grain's deletion thread. Blocks still queued there when the interpreter exits (the last batch,
    freed as the training function returns) were reported by Python's resource tracker as "leaked
    shared_memory objects" (it then removes them): here the queue is waited for, and later
    deletions run at once. Closing twice is harmless; an iterator without workers is closed only."""
    close = getattr(iterator, "close", None)
    if close is not None:
        close()
    try:  # (no public way to drain the queue; another grain version may keep it elsewhere)
        from grain._src.python.ipc.shared_memory_array import SharedMemoryArray
    except ImportError:
        return
    deleting = getattr(SharedMemoryArray, "_del_thread_pool", None)
    if deleting is not None:
        SharedMemoryArray._del_thread_pool = SharedMemoryArray._outstanding_del_requests = None
        deleting.close()
        deleting.join()


def epoch_shuffle_seed(seed: int) -> int:
    """The shuffle seed of ``dataset.seed``: a 31-bit value mixed from it. grain reshuffles epoch e
    with seed + e, so seed s + 1 given as it is would replay every epoch of seed s one epoch later."""
    return int(np.random.SeedSequence(int(seed)).generate_state(1, np.uint32)[0] >> 1)


def init_input_worker(worker_index: int, worker_count: int, poll_s: float = 1.0) -> None:
    """grain worker init: the worker names itself in length warnings, ignores Ctrl-C and ends
    itself once the training process is gone.

    A Ctrl-C in a terminal signals the whole process group. The training process answers the first
    one by saving a checkpoint and stopping, and may still read batches until then; a worker that
    died of the same KeyboardInterrupt printed its traceback and failed the next read. So workers
    ignore SIGINT and leave the stopping to the training process.

    grain ends its workers when the training process exits (even at SIGTERM), but a process killed
    outright (SIGKILL, the OOM killer) runs no cleanup, and its workers would wait forever on a
    full queue, holding their memory. A daemon thread polls the parent's pid (a worker is
    reparented when its parent dies)."""
    LENGTH_STATS.worker = f"input worker {worker_index} of {worker_count}"
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)  # not sys.exit: a normal exit would wait on grain's threads

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def make_eval_batches(
    source: Sequence[Mapping[str, Any]],
    tokenizer: Tokenizer,
    features: Features,
    lengths: Mapping[str, int],
    batch_size: int,
    *,
    shard: grain.sharding.ShardOptions | None = None,
    max_examples: int | None = None,
) -> list[dict[str, np.ndarray]]:
    """Every evaluation example of this host's slice once, one per row, in order.

    Translation examples longer than ``lengths`` are truncated (an evaluation set drops
    nothing). Decoder-only documents are cut into pieces of at most the row length, as
    ``length_policy='split'`` does, so every token is scored once (only the document's last
    piece ends with EOS); then the hosts share the pieces, not the documents, so each host
    tokenises all ``n`` documents. The last batches are filled with all-zero rows (segment id 0,
    so loss weight 0); every host gets ``ceil(ceil(rows / process_count) / batch_size)``
    batches, so multi-host steps stay in step.
    """
    index, count = _shard_options(shard)
    n = len(source) if max_examples is None else min(len(source), max_examples)
    if n == 0:
        raise DataError("evaluation set is empty")
    decoder_only = len(features.fields) == 1
    read = ReadAndTokenize(source, Tokenize(tokenizer, features, lengths,
                                            "split" if decoder_only else "truncate", "eval"))
    if decoder_only:  # the number of pieces is known only after tokenising: share them out
        examples = [ex for i in range(0, n, 256) for ex in read.map(range(i, min(i + 256, n)))]
        start, end = shard_bounds(len(examples), index, count)
        examples, total = examples[start:end], len(examples)
    else:
        start, end = shard_bounds(n, index, count)
        examples = [ex for i in range(start, end, 256)
                    for ex in read.map(range(i, min(i + 256, end)))]
        total = n
    rows = [make_row([ex], lengths) for ex in examples]
    num_batches = math.ceil(math.ceil(total / count) / batch_size)
    empty = make_row([], lengths)
    rows += [empty] * (num_batches * batch_size - len(rows))
    return [{k: np.stack([r[k] for r in rows[b * batch_size:(b + 1) * batch_size]])
             for k in empty} for b in range(num_batches)]


def to_global_batch(batch: Mapping[str, np.ndarray], mesh, sharding=None) -> dict[str, Any]:
    """Host-local batch -> global ``jax.Array`` s, the batch axis split over the mesh.

    ``sharding``: a ``jax.sharding.Sharding`` (or a ``PartitionSpec`` used with ``mesh``); by
    default the batch axis is split over the mesh's 'data' and 'fsdp' axes (or its first axis)
    and replicated over the rest. Each process passes its own rows
    (``jax.make_array_from_process_local_data``); the global batch is the hosts' rows stacked in
    process order.
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    if sharding is None:
        axes = tuple(a for a in mesh.axis_names if a in ("data", "fsdp")) or mesh.axis_names[:1]
        sharding = NamedSharding(mesh, PartitionSpec(axes))
    elif isinstance(sharding, PartitionSpec):
        sharding = NamedSharding(mesh, sharding)
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
            for k, v in batch.items()}


def checkpoint_args(iterator: grain.DatasetIterator, *, restore: bool = False):
    """The orbax argument that saves (or restores) ``iterator``'s state, for
    ``ocp.args.Composite(..., data=checkpoint_args(it))``."""
    import grain.checkpoint as gc

    return gc.CheckpointRestore(iterator) if restore else gc.CheckpointSave(iterator)
