"""Parameters on transparent huge pages, for decoding on a CPU.

A decoding step reads every weight of the model once. Over ordinary 4 KiB pages a 250 MB model
spans ~60,000 pages, and the read pays for a TLB miss and a restart of the hardware prefetcher at
each one. `place_on_huge_pages(params)` asks Linux (6.1 or later) to move the memory under each
array onto 2 MiB transparent huge pages, at once (``madvise(MADV_COLLAPSE)``): the contents and the
addresses stay as they are, only the pages under them change, so nothing else about the arrays or
the programs that read them changes. Measured on a 2-core AVX-512 CPU (`benchmarks/NOTES.md`): the
weight products of a GPT-2-small step read ~8% faster.

XLA allocates the buffers, so the 2 MiB ranges that hold an array may also hold a neighbour's
bytes; those move too, unchanged. It is best effort: a range the kernel cannot move (no free huge
page, a mapping it does not cover) stays as it was, and the result says how much moved. Arrays on
an accelerator, and on systems without the call, are left alone.

`python -m transformer_jax.generate` places a model's parameters this way on a CPU
(``--huge_pages``, on by default).
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import platform
import sys
from pathlib import Path

import jax

MADV_COLLAPSE = 25  # <linux/mman.h>, Linux 6.1+
_PAGE_SIZE_FILE = Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")


@dataclasses.dataclass(frozen=True)
class HugePages:
    """What `place_on_huge_pages` did: bytes of the huge-page-sized ranges under the CPU arrays
    (`requested`) and of those now on huge pages (`placed`), the page size, and why nothing
    (or not everything) moved, if so."""

    placed: int
    requested: int
    page_size: int
    reason: str | None = None


def huge_page_size() -> int | None:
    """The transparent huge page size of this system in bytes, or None if it has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return int(_PAGE_SIZE_FILE.read_text().strip()) or None
    except (OSError, ValueError):
        return None


def _collapse_refused_because() -> str:
    """Why Linux refuses MADV_COLLAPSE everywhere, as far as this process can tell."""
    from transformer_jax import host_memory

    try:
        release = tuple(int(part) for part in platform.release().split("-")[0].split(".")[:2])
    except ValueError:
        release = ()
    if release and release < (6, 1):
        return f"it needs Linux 6.1 or later (this is {platform.release()})"
    problem = host_memory.transparent_huge_pages_problem()
    if problem is not None:
        return problem
    return "it needs Linux 6.1 or later, with transparent huge pages not set to 'never'"


def _cpu_buffers(tree):
    """(address, nbytes) of each CPU buffer behind the arrays of `tree` (every addressable shard),
    once the computations that write them are done (a page being written cannot move)."""
    for leaf in jax.tree_util.tree_leaves(tree):
        if not isinstance(leaf, jax.Array) or leaf.is_deleted():
            continue
        leaf.block_until_ready()
        for shard in leaf.addressable_shards:
            if shard.device.platform != "cpu" or shard.data.nbytes == 0:
                continue
            yield shard.data.unsafe_buffer_pointer(), shard.data.nbytes


def place_on_huge_pages(tree) -> HugePages:
    """Moves the memory under `tree`'s CPU arrays (every addressable shard) onto transparent huge
    pages (see the module docstring), once the computations writing them are done; returns what
    moved. Leaves that are not arrays, deleted arrays and accelerator memory are skipped. Values,
    addresses and shardings are unchanged; calling it again moves only what had not moved."""
    size = huge_page_size()
    if size is None:
        return HugePages(0, 0, 0, "this system has no transparent huge pages")
    starts = set()
    for address, nbytes in _cpu_buffers(tree):
        starts.update(range(address // size * size, address + nbytes, size))
    if not starts:
        return HugePages(0, 0, size, "no arrays in CPU memory")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    placed, failures = 0, {}
    for start in sorted(starts):
        if libc.madvise(start, size, MADV_COLLAPSE) == 0:
            placed += size
            continue
        code = ctypes.get_errno()
        failures[code] = failures.get(code, 0) + 1
    reason = None
    if failures.get(errno.EINVAL) == len(starts):
        reason = "madvise(MADV_COLLAPSE) refused everywhere (EINVAL): " + _collapse_refused_because()
    elif failures:
        reason = "; ".join(f"{count} of {len(starts)} ranges not moved: {os.strerror(code)}"
                           for code, count in sorted(failures.items()))
    return HugePages(placed, len(starts) * size, size, reason)
