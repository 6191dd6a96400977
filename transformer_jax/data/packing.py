"""Packing several examples into fixed-length rows, as a checkpointable grain transform.

A row holds whole examples one after another; ``<key>_segment_ids`` numbers them 1, 2, 3, ...
(0 marks padding) and ``<key>_positions`` restarts at 0 in each. For translation an example is
a source and a target and both go into the same row under the same segment id, so the
attention masks built from the segment ids keep every example separate.

The packer is first-fit over ``num_bins`` open rows: an example goes into the first row with
room for all its features; when none has room, the fullest row is emitted and the example
opens a new one. "Fullest" is by the feature that is most used (a fraction of its length): a
translation row whose targets are full cannot take another example however much room its
inputs have, so it must be the first to leave. With a few dozen open rows and short examples,
rows come out >= 90 % full.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import grain
import numpy as np


def make_row(examples: Sequence[Mapping[str, Sequence[int]]],
             lengths: Mapping[str, int]) -> dict[str, np.ndarray]:
    """Lays ``examples`` (each {key: token ids}) into one padded row per key.

    Returns {key, key_segment_ids, key_positions} int32 arrays of shape [lengths[key]].
    """
    row = {}
    for key, length in lengths.items():
        tokens, segments, positions = [], [], []
        for seg, ex in enumerate(examples, start=1):
            ids = ex[key]
            n = len(ids)
            tokens.extend(ids)
            segments.extend([seg] * n)
            positions.extend(range(n))
        pad = length - len(tokens)
        if pad < 0:
            raise ValueError(f"examples do not fit in {length} tokens of {key!r}")
        row[key] = np.array(tokens + [0] * pad, np.int32)
        row[f"{key}_segment_ids"] = np.array(segments + [0] * pad, np.int32)
        row[f"{key}_positions"] = np.array(positions + [0] * pad, np.int32)
    return row


class _Bin:
    __slots__ = ("examples", "room", "lengths")

    def __init__(self, lengths):
        self.examples: list[dict[str, list[int]]] = []
        self.lengths = list(lengths.values())
        self.room = list(self.lengths)  # free tokens per key, in the order of ``lengths``

    def fits(self, sizes) -> bool:
        return all(s <= r for s, r in zip(sizes, self.room))

    def add(self, example, sizes) -> None:
        self.examples.append(example)
        self.room = [r - s for r, s in zip(self.room, sizes)]

    def fill(self) -> float:
        # The most used feature's share, not the total of free tokens: with the total, a row
        # whose targets are full but whose inputs have room (it takes no example any more) looked
        # emptier than fresh rows, was never chosen, and held its examples for ever.
        return max((n - r) / n for n, r in zip(self.lengths, self.room))


class FirstFitPackIterDataset(grain.IterDataset):
    """Packs examples {key: 1-D int array, len <= lengths[key]} into rows (see ``make_row``)."""

    def __init__(self, parent: grain.IterDataset, lengths: Mapping[str, int], num_bins: int = 32):
        super().__init__(parent)
        if num_bins < 1:
            raise ValueError(f"num_bins must be >= 1, got {num_bins}")
        self._lengths = dict(lengths)
        self._num_bins = num_bins

    def __iter__(self) -> grain.DatasetIterator:
        return _FirstFitPackIterator(self._parent.__iter__(), self._lengths, self._num_bins)

    def __str__(self) -> str:
        return f"FirstFitPackIterDataset(lengths={self._lengths}, num_bins={self._num_bins})"


class _FirstFitPackIterator(grain.DatasetIterator):
    """State = the parent's state + the open rows' examples (lists of ints, JSON-friendly), so a
    restored iterator continues with exactly the rows the original would have produced."""

    def __init__(self, parent: grain.DatasetIterator, lengths: dict[str, int], num_bins: int):
        super().__init__(parent)
        self._lengths = lengths
        self._num_bins = num_bins
        self._bins: list[_Bin] = []
        self._exhausted = False

    def __next__(self) -> dict[str, np.ndarray]:
        while not self._exhausted:
            try:
                example = next(self._parent)
            except StopIteration:
                self._exhausted = True
                break
            example = {k: np.asarray(example[k]).tolist() for k in self._lengths}
            row = self._place(example)
            if row is not None:
                return row
        if not self._bins:
            raise StopIteration
        return self._emit(self._fullest())

    def _place(self, example) -> dict[str, np.ndarray] | None:
        sizes = [len(example[k]) for k in self._lengths]
        for i, b in enumerate(self._bins):
            if b.fits(sizes):
                b.add(example, sizes)
                if min(b.room) == 0:  # a full row leaves at once: fewer rows to scan
                    return self._emit(i)
                return None
        emitted = None
        if len(self._bins) >= self._num_bins:
            emitted = self._emit(self._fullest())
        new = _Bin(self._lengths)
        if not new.fits(sizes):
            raise ValueError(f"example of {sizes} tokens longer than the row {self._lengths}")
        new.add(example, sizes)
        self._bins.append(new)
        return emitted

    def _fullest(self) -> int:
        fills = [b.fill() for b in self._bins]
        return fills.index(max(fills))

    def _emit(self, index: int) -> dict[str, np.ndarray]:
        b = self._bins.pop(index)
        return make_row(b.examples, self._lengths)

    def get_state(self):
        return {
            "parent": self._parent.get_state(),
            "bins": [list(b.examples) for b in self._bins],  # a copy: bins keep filling
            "exhausted": self._exhausted,
        }

    def set_state(self, state):
        for examples in state["bins"]:  # rows being filled when the state was saved
            for key, length in self._lengths.items():
                used = sum(len(ex[key]) for ex in examples)
                if used > length:
                    from transformer_jax.data.errors import DataError

                    raise DataError(
                        f"the saved input pipeline position holds a row being packed with {used} "
                        f"tokens of {key!r}, more than this run's rows of {length} (the dataset's "
                        f"max length settings changed since): resume with the lengths the run was "
                        f"trained with, or set config.resume_data_position=False to start the input "
                        f"pipeline afresh")
        self._parent.set_state(state["parent"])
        self._bins = []
        for examples in state["bins"]:
            b = _Bin(self._lengths)
            for ex in examples:
                b.add({k: list(v) for k, v in ex.items()}, [len(ex[k]) for k in self._lengths])
            self._bins.append(b)
        self._exhausted = bool(state["exhausted"])
