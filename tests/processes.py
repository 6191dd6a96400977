"""Helpers for the tests that start several training processes on this machine."""

import socket


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
    (conftest.py's FAST_COMPILE_FLAGS: the same results, compiled faster)."""
    import os

    level = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if f.startswith(("--xla_backend_optimization_level", "--xla_cpu_use_fusion_emitters"))]
    return " ".join([f"--xla_force_host_platform_device_count={devices}", *level])
