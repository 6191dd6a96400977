"""Multi-process start-up: one Python process per host (TPU VM worker, GPU node or GPU).

Call :func:`initialize` first thing in the program, before anything touches a device.

* Cloud TPU pods (and multi-slice): no arguments; JAX reads the TPU metadata.
* GPU clusters under SLURM (``srun``) or Open MPI (``mpirun``): no arguments; JAX reads the
  scheduler's variables (``SLURM_JOB_ID``, ``SLURM_NTASKS``, ``SLURM_PROCID``, ...).
* Anything else: pass ``coordinator_address``, ``num_processes``, ``process_id`` (flags) or set
  ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID`` on every process.
* A single process with none of the above: nothing to do.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

import jax
from absl import logging
from jax.experimental import multihost_utils

from transformer_jax.config import ConfigError

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    """The integer in environment variable ``name`` (None if unset or empty); anything else is a
    ``ConfigError`` naming the variable, not int()'s bare 'invalid literal'."""
    value = env.get(name, "").strip()
    try:
        return int(value) if value else None
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} must be an integer") from None


def detect_cluster(env: Mapping[str, str] | None = None) -> str | None:
    """Names the multi-process launcher JAX can configure itself from, or None.

    Returns ``'slurm'`` (more than one task), ``'mpi'`` (Open MPI, more than one rank) or
    ``'tpu'`` (a multi-host Cloud TPU slice, or multi-slice).
    """
    env = os.environ if env is None else env
    if "SLURM_JOB_ID" in env and (_env_int(env, "SLURM_NTASKS") or 1) > 1:
        return "slurm"
    if (_env_int(env, "OMPI_COMM_WORLD_SIZE") or 1) > 1:
        return "mpi"
    hosts = env.get("TPU_WORKER_HOSTNAMES", "")
    if "," in hosts or "MEGASCALE_COORDINATOR_ADDRESS" in env:
        return "tpu"
    return None


def resolve_arguments(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[str | None, int | None, int | None]:
    """Explicit arguments win; otherwise the ``JAX_*`` environment variables fill them in."""
    env = os.environ if env is None else env
    if coordinator_address is None:
        coordinator_address = env.get(ENV_COORDINATOR) or None
    if num_processes is None:
        num_processes = _env_int(env, ENV_NUM_PROCESSES)
    if process_id is None:
        process_id = _env_int(env, ENV_PROCESS_ID)
    return coordinator_address, num_processes, process_id


def _check_arguments(address, count, index, cluster) -> None:
    """Settings JAX would refuse only after a wait, or with a traceback, as a ConfigError that
    names the flag and its environment variable. On a detected cluster JAX fills in what is left
    out, so only the values given are checked there (and for one process, which needs none)."""
    names = {"coordinator_address": ENV_COORDINATOR, "num_processes": ENV_NUM_PROCESSES,
             "process_id": ENV_PROCESS_ID}
    said = lambda key: f"--{key} (${names[key]})"
    if count is not None and count < 1:
        raise ConfigError(f"{said('num_processes')}={count} must be >= 1")
    if index is not None and index < 0:
        raise ConfigError(f"{said('process_id')}={index} must be >= 0")
    if index is not None and count is not None and index >= count:
        raise ConfigError(f"{said('process_id')}={index} must be below num_processes={count} "
                          f"(processes are numbered 0 to {count - 1})")
    if not cluster:
        missing = [key for key, value in (("coordinator_address", address), ("num_processes", count),
                                          ("process_id", index)) if value is None]
        if missing:
            raise ConfigError(
                f"several processes need {', '.join(said(k) for k in missing)} as well "
                "(no cluster detected to fill them in); give all three to every process, or none")


def _check_coordinator_port(address: str) -> None:
    """On process 0, which serves the coordinator on every interface at the address's port: a
    ConfigError if that port is not a number or another program listens on it. JAX's runtime
    would log a gRPC line and crash the process (a segmentation fault), leaving the other
    processes waiting for their start-up timeout without a word."""
    import errno
    import socket

    said = f"--coordinator_address (${ENV_COORDINATOR})={address!r}"
    host, _, port_text = address.rpartition(":")
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not host or not 0 < port < 65536:
        raise ConfigError(f"{said} must be host:port with a port from 1 to 65535")
    try:
        probe = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # both families, as the runtime binds
        where = ("::", port)
    except OSError:  # no IPv6 on this host
        probe, where = socket.socket(socket.AF_INET, socket.SOCK_STREAM), ("0.0.0.0", port)
    with probe:
        # A port left in TIME_WAIT by an earlier run is free for the runtime, which reuses addresses.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(where)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(f"{said}: port {port} on this host (process 0 serves the coordinator "
                                  "there) is in use by another program; choose a free port for every "
                                  "process") from None
            if e.errno == errno.EACCES:
                raise ConfigError(f"{said}: this user may not listen on port {port}; choose a port "
                                  "above 1023") from None
            raise


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: int | Sequence[int] | None = None,
    initialization_timeout: int = 300,
    auto: bool | None = None,
    heartbeat_timeout_seconds: int | None = None,
) -> bool:
    """Connects this process to the others (``jax.distributed.initialize``) when there are any.

    Args:
      coordinator_address: ``host:port`` of process 0 (any free port), e.g. ``10.0.0.1:1234``.
      num_processes: total number of processes.
      process_id: this process's index, ``0 .. num_processes - 1``.
      local_device_ids: restrict this process to some local devices (one process per GPU).
      initialization_timeout: seconds to wait for every peer, so that a missing or misconfigured
        host stops the run instead of hanging it (JAX's runtime then ends the process with its own
        fatal message, exit status 134; other start-up failures raise RuntimeError).
      heartbeat_timeout_seconds: how long a silent peer may go unnoticed before the others stop
        with an error (a dead process must not hang the job); default ``TJ_HEARTBEAT_TIMEOUT_S``
        or JAX's 100 s.
      auto: True forces JAX's cluster auto-detection (``jax.distributed.initialize()`` with no
        address), False forbids it; None auto-detects only when :func:`detect_cluster` finds
        SLURM, Open MPI or a multi-host TPU.

    Returns:
      True if this call (or an earlier one) set up multi-process JAX, False for a single process.
    """
    if jax.distributed.is_initialized():
        return True
    address, count, index = resolve_arguments(coordinator_address, num_processes, process_id)
    explicit = address is not None or count is not None or index is not None
    cluster = detect_cluster()
    if not explicit and not (auto or (auto is None and cluster)):
        return False
    if explicit and count == 1:  # nothing to connect; a --process_id of 1 or more is still a mistake
        _check_arguments(address, count, index, cluster=True)
        return False
    if explicit:
        _check_arguments(address, count, index, cluster)
        if index == 0 and address is not None:
            _check_coordinator_port(address)
    logging.info(
        "jax.distributed.initialize(coordinator=%s, num_processes=%s, process_id=%s, cluster=%s)",
        address,
        count,
        index,
        cluster or "explicit",
    )
    try:
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=count,
            process_id=index,
            local_device_ids=local_device_ids,
            initialization_timeout=initialization_timeout,
            heartbeat_timeout_seconds=heartbeat_timeout_seconds
            or int(os.environ.get("TJ_HEARTBEAT_TIMEOUT_S", "100")),
        )
    except Exception as e:  # re-raised with the settings that matter for debugging
        raise RuntimeError(
            f"Multi-process initialisation failed (coordinator_address={address}, "
            f"num_processes={count}, process_id={index}, detected cluster={cluster}, "
            f"timeout={initialization_timeout}s). Check that every process was started with the "
            f"same coordinator address and process count, and that the port is reachable. "
            f"Cause: {e}"
        ) from e
    if count is not None and jax.process_count() != count:
        # The coordinator's count rules: a process told another one joins and would train on,
        # its own flag wrong, as if nothing were amiss.
        raise ConfigError(
            f"num_processes={count} on this process (process_id={index}), but the job the coordinator "
            f"{address} started has {jax.process_count()} processes: give every process the same "
            f"--num_processes")
    return True


def is_primary() -> bool:
    """True on process 0, the one that writes logs, configs and metrics."""
    return jax.process_index() == 0


def one_program_at_a_time() -> bool:
    """Whether a loop of independent jitted programs whose collectives cross processes must wait
    for each before it queues the next: on CPUs in a multi-process run.

    XLA:CPU runs queued programs as soon as their inputs are ready, each device on a thread of its
    own, so two queued programs can be in their cross-process all-reduces (gloo) at once, paired up
    wrongly between the processes: both then wait for ever, alive, so no heartbeat ends them.
    Measured with two processes of two CPU devices on 2 cores: 20 to 200 queued sums of a sharded
    batch hung in 5 of 9 runs, more often with the cores busy; 100 to 200 run one at a time never
    did, nor did 200 to 300 steps each fetching the one before (the training loop's pattern: it
    checks each step's metrics one step late). GPUs and TPUs run a device's programs in order."""
    return jax.process_count() > 1 and jax.default_backend() == "cpu"


def on_every_process(flag: bool) -> bool:
    """Whether ``flag`` holds on every process; ``flag`` on one (a collective: every process calls it)."""
    if jax.process_count() == 1:
        return bool(flag)
    import numpy as np

    return bool(np.all(multihost_utils.process_allgather(np.array([bool(flag)]))))


def same_on_every_process(text: str) -> bool:
    """Whether every process holds the same ``text`` (compared by checksum; a collective)."""
    if jax.process_count() == 1:
        return True
    import zlib

    import numpy as np

    sums = multihost_utils.process_allgather(np.array([zlib.crc32(text.encode())], np.uint32))
    return bool(np.all(sums == sums[0]))


def from_process_0(value: int) -> int:
    """Process 0's ``value`` (an int32) on every process (a collective: every process calls it)."""
    if jax.process_count() == 1:
        return int(value)
    import numpy as np

    return int(multihost_utils.broadcast_one_to_all(np.array([value], np.int32))[0])


def sync_global(name: str) -> None:
    """Blocks until every process reaches the barrier called ``name``; free on one process."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def config_differences(config: Mapping, ignore: Sequence[str] = ()) -> list[str]:
    """The fields of a (nested) config whose values differ between the processes, each as
    ``'field (this process: value)'``; empty on one process or when all agree.

    Every process must call it (it gathers a checksum of each field from all of them). Processes
    that train with different values compute different updates of arrays that should be the same
    on all of them, or wait on each other in different collectives; either goes unnoticed or ends
    in a hang or a runtime abort far from the cause. ``ignore``: fields that may differ per host
    (e.g. a local data directory).
    """
    if jax.process_count() == 1:
        return []
    import zlib

    import numpy as np
    from flax.traverse_util import flatten_dict

    items = sorted((name, repr(value)) for name, value in flatten_dict(dict(config), sep=".").items()
                   if name not in ignore)
    names = zlib.crc32("\n".join(name for name, _ in items).encode())
    shape = multihost_utils.process_allgather(np.array([len(items), names], np.uint32))
    if not (shape == shape[0]).all():  # other field sets: the per-field checksums would not line up
        return ["the set of config fields (a config file or a version of the code that differs)"]
    sums = np.array([zlib.crc32(f"{name}={value}".encode()) for name, value in items], np.uint32)
    gathered = multihost_utils.process_allgather(sums)  # [processes, fields]
    return [f"{name} (this process: {value})" for (name, value), column in zip(items, gathered.T)
            if not (column == column[0]).all()]


def leave_and_exit(code: int = 0) -> None:
    """Ends a finished multi-process run: every process leaves the cluster at the same point
    (``jax.distributed.shutdown``) and exits without interpreter teardown. After a multi-process
    run that teardown occasionally hangs in the runtime's C++ destructors (about once in 20 runs
    with two CPU processes here, with no Python frame on the stack), which would leave a finished
    job running. Call it only once everything is written and closed."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.flush()
    if jax.process_count() > 1:
        stop_child_processes()
        jax.distributed.shutdown()
        os._exit(code)


def stop_child_processes(timeout_s: float = 5.0) -> None:
    """Terminates this process's multiprocessing children (the input pipeline's workers with
    ``dataset.num_workers > 0``). ``os._exit`` skips the interpreter's own clean-up, which would
    otherwise leave them running, holding memory and the parent's output pipes."""
    import multiprocessing
    import time

    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    deadline = time.monotonic() + timeout_s
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            child.kill()
