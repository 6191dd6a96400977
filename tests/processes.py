"""Helpers for the tests that start several training processes on this machine."""

import socket

# XLA flags the suite compiles with (conftest.py adds them unless TJ_TEST_XLA_OPT=default; child
# processes get them through child_xla_flags). The suite is bound by compilation (hundreds of small
# programs, each run a few times):
# - without LLVM's optimisation passes, test_transformer.py took 105 s against 217 s on 2 cores;
#   the generated code is slower, which only the notebooks that train and decode would notice (their
#   kernels drop both flags, see test_notebooks.py);
# - XLA:CPU's fusion emitters (through MLIR) take twice as long to compile a fusion as its loop
#   emitters: backend compilation 24.8 -> 13.6 s on eight tests of test_transformer.py, where it is
#   75% of their time.
# The tests compare against references within tolerances, and the bit-exact ones (the native
# kernels' activations against XLA's) pass either way.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def is_fast_compile_flag(flag: str) -> bool:
    """Whether an XLA_FLAGS entry sets one of FAST_COMPILE_FLAGS' options (to any value)."""
    return flag.split("=")[0] in {f.split("=")[0] for f in FAST_COMPILE_FLAGS}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Gloo's rendezvous at the first collective has a fixed 30 s deadline. On an overloaded 2-core machine
# (the other test worker busy beside two training processes) one process can get there over 30 s after
# the other: it fails with this message before its first step, and its peer waits for ever. Tests that
# start processes stop such a start and make it again.
GLOO_DEADLINE = "Gloo context initialization failed"


def child_xla_flags(devices: int) -> str:
    """XLA_FLAGS for a child process with `devices` host devices, compiling as the suite does
    (FAST_COMPILE_FLAGS where the suite has them: the same results, compiled faster)."""
    import os

    fast = [f for f in os.environ.get("XLA_FLAGS", "").split() if is_fast_compile_flag(f)]
    return " ".join([f"--xla_force_host_platform_device_count={devices}", *fast])
