"""Large host allocations on transparent huge pages, for a whole training process on a CPU.

XLA:CPU allocates its buffers with ``malloc``, and every large one is fresh memory that Linux maps
4 KiB at a time as it is first written. A training step fills several such buffers from scratch:
the stacked activations a scanned layer stack keeps for the backward pass, the stacked gradient
accumulators, the logits. In GPT-2 small's float32 step (8 x 256 tokens) the zero-filling of those
alone took ~330 ms of ~5 s, at ~3 GB/s, bound by page faults. glibc 2.35 and later can ask for
2 MiB transparent huge pages under its large allocations (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``),
which cut that step from 4.95-5.00 to 4.39-4.40 s in alternating processes (AMD EPYC Zen 5,
`benchmarks/NOTES.md`). glibc reads the setting only when a process starts, so
`restart_with_huge_page_malloc()` starts the running script again with it set: ``train.py`` and
``benchmarks/run.py`` call it first. Setting ``GLIBC_TUNABLES`` yourself (to anything, empty
included) leaves the process as it is.
"""

from __future__ import annotations

import os
import platform
import sys

ENV = "GLIBC_TUNABLES"
TUNABLE = "glibc.malloc.hugetlb=1"
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_page_malloc_problem() -> str | None:
    """Why this process cannot get malloc's huge pages by a restart, or None where it can."""
    if sys.platform != "linux":
        return f"needs Linux (this is {sys.platform})"
    libc, version = platform.libc_ver()
    try:
        numbers = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        numbers = ()
    if libc != "glibc" or numbers < (2, 35):
        return f"needs glibc 2.35 or later (this is {libc or 'an unknown C library'} {version})".rstrip()
    return transparent_huge_pages_problem()


def transparent_huge_pages_problem() -> str | None:
    """Why this process gets no transparent huge pages at all (none on the system, set to
    'never', or turned off for the process), or None where it may."""
    try:
        with open(_THP_ENABLED) as f:
            mode = f.read()
    except OSError:
        return f"no transparent huge pages ({_THP_ENABLED} is missing)"
    if "[never]" in mode:
        return "transparent huge pages are off ([never])"
    if _thp_disabled_for_process():
        return "transparent huge pages are off for this process (prctl PR_SET_THP_DISABLE)"
    return None


PR_GET_THP_DISABLE = 42  # <linux/prctl.h>


def _thp_disabled_for_process() -> bool:
    """Whether this process (or the one that started it: the flag is inherited) has turned
    transparent huge pages off for itself, as some sandboxes and launchers do."""
    try:
        import ctypes

        return ctypes.CDLL(None).prctl(PR_GET_THP_DISABLE, 0, 0, 0, 0) == 1
    except Exception:  # no prctl (not Linux), or a C library that cannot be loaded
        return False


def _restartable() -> bool:
    """Whether starting this process again runs the same program: not for an interactive
    interpreter or a notebook kernel (their state would be lost, their cells rerun), nor for a
    script read from standard input (the new process would find it already read, and do nothing)."""
    if hasattr(sys, "ps1") or sys.flags.interactive or "ipykernel" in sys.modules or "IPython" in sys.modules:
        return False
    return len(sys.orig_argv) >= 2 and sys.argv[0] not in ("", "-")


def restart_environment() -> dict[str, str] | None:
    """The environment to start this process again with, or None: where ``GLIBC_TUNABLES`` is set
    already (the tunable, or the user's own choice) or `huge_page_malloc_problem()` names a reason."""
    if ENV in os.environ or huge_page_malloc_problem() is not None:
        return None
    return dict(os.environ, **{ENV: TUNABLE})


def restart_with_huge_page_malloc() -> None:
    """Starts the running script again, same process id, interpreter flags and arguments, with
    ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (see the module doc); returns at once where
    `restart_environment()` is None, and in an interactive interpreter, a notebook kernel or a
    script read from standard input (``python - < job.py``), which a restart would not run again.
    Call it first thing, before any output or work; it does not return when it restarts."""
    env = restart_environment()
    if env is None or not _restartable():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)
