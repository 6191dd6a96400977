"""Multi-host faults: two ``train.py`` processes (jax.distributed on 127.0.0.1); one is SIGKILLed
mid-training and the other must exit with an error within a bounded time (the heartbeat timeout,
``TJ_HEARTBEAT_TIMEOUT_S``) instead of hanging; restarting both resumes from the last checkpoint,
and a SIGTERM to one of them then stops both at the same step with a checkpoint of it.

About 80 s on a 2-core machine (two processes started twice); part of the default run.
``TJ_FAULT_MULTIHOST=0`` skips it.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
from processes import GLOO_DEADLINE, child_xla_flags, free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEARTBEAT_S = 10
BOUND_S = 3 * HEARTBEAT_S + 30  # detection plus shutdown, with room for a slow, shared machine
STEPS = 400

pytestmark = pytest.mark.skipif(
    os.environ.get("TJ_FAULT_MULTIHOST") == "0", reason="TJ_FAULT_MULTIHOST=0"
)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Prepared here once: two processes preparing one fresh TFDS directory at once race."""
    from configs import tiny
    from transformer_jax.data import build_datasets

    path = str(tmp_path_factory.mktemp("tfds"))
    config = tiny.get_config().dataset
    config.data_dir = path
    build_datasets(config, str(tmp_path_factory.mktemp("prepare")))
    return path


def _start_pair(workdir, data_dir, steps):
    port = free_port()
    env = {
        **os.environ,
        "XLA_FLAGS": child_xla_flags(2),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": REPO,
        "TJ_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_S),
    }
    args = [
        sys.executable,
        os.path.join(REPO, "train.py"),
        "--config=" + os.path.join(REPO, "configs/tiny.py"),
        f"--workdir={workdir}",
        f"--config.dataset.data_dir={data_dir}",
        f"--config.num_train_steps={steps}",
        "--config.log_every_steps=1",
        "--config.checkpoint_every_steps=2",
        f"--config.eval_every_steps={10 * STEPS}",
        "--config.mesh.fsdp=2",
        f"--coordinator_address=127.0.0.1:{port}",
        "--num_processes=2",
    ]
    return [
        subprocess.Popen(
            args + [f"--process_id={i}"],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]


def _wait_for_checkpoint(workdir, procs, timeout=240, after=0):
    directory = os.path.join(workdir, "checkpoints")
    start = time.time()
    while time.time() - start < timeout:
        ended = [p for p in procs if p.poll() is not None]
        if ended:
            raise AssertionError("a process ended early:\n" + ended[0].stdout.read()[-3000:])
        if os.path.isdir(directory) and any(n.isdigit() and int(n) > after for n in os.listdir(directory)):
            return
        time.sleep(0.05)
    raise AssertionError("no checkpoint in time")


def _start_until_checkpoint(workdir, data_dir, after=0, starts=3):
    """`_start_pair`, then `_wait_for_checkpoint`; a start that missed gloo's deadline is stopped and
    made again (it wrote no checkpoint: the first collective is the first step's), up to `starts`."""
    for start in range(starts):
        procs = _start_pair(workdir, data_dir, STEPS)
        try:
            _wait_for_checkpoint(workdir, procs, after=after)
            return procs
        except AssertionError as e:
            if start == starts - 1 or GLOO_DEADLINE not in str(e):
                raise
            for p in procs:
                p.kill()
                p.communicate()
    raise AssertionError("unreachable")


def test_one_process_dies_the_other_stops_and_both_resume(data_dir, tmp_path):
    workdir = str(tmp_path / "w")
    procs = _start_until_checkpoint(workdir, data_dir)  # STEPS: the kill lands mid-training
    procs[1].send_signal(signal.SIGKILL)
    killed_at = time.time()
    try:
        out = procs[0].communicate(timeout=BOUND_S)[0]
    except subprocess.TimeoutExpired:
        procs[0].kill()
        raise AssertionError(f"process 0 still running {BOUND_S}s after its peer died") from None
    waited = time.time() - killed_at
    print(f"\nsurvivor exited with {procs[0].returncode} after {waited:.1f}s")
    assert procs[0].returncode != 0, out[-3000:]
    procs[1].wait()

    steps = _checkpoint_steps(workdir)
    assert 0 < max(steps) < STEPS
    # Both restarted: they resume; then SIGTERM reaches one process only (one VM of a slice
    # preempted). Both must stop at the same step, save it and exit cleanly: a stop decided by
    # one process alone would leave it in the checkpoint's collectives and the other training.
    procs = _start_until_checkpoint(workdir, data_dir, after=max(steps))
    procs[1].send_signal(signal.SIGTERM)
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=BOUND_S)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"still running {BOUND_S}s after SIGTERM reached process 1") from None
    for p, o in zip(procs, outs, strict=True):
        assert p.returncode == 143, o[-3000:]  # 128 + SIGTERM: stopped, not finished
    assert f"Resumed from checkpoint {max(steps)}" in outs[0]
    assert "Stopped by SIGTERM after step " in outs[0], outs[0][-3000:]  # process 0 logs
    stopped = int(outs[0].split("Stopped by SIGTERM after step ")[1].split(";")[0])
    assert max(_checkpoint_steps(workdir)) == stopped < STEPS


def _checkpoint_steps(workdir):
    return [int(n) for n in os.listdir(os.path.join(workdir, "checkpoints")) if n.isdigit()]
