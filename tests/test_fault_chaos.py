"""Kill at any moment, lose nothing: ``train.py`` is SIGKILLed again and again (mid-step, mid-startup,
and while an asynchronous checkpoint is being written) and restarted until it finishes.

After every kill the checkpoint directory is inspected: a kill leaves at most orbax's temporary
``*.orbax-checkpoint-tmp-*`` directory, never a half-written step, and the next run must resume from
the newest *complete* step (one that verifies against its integrity manifest). At the end the
parameters and the logged losses (metrics.jsonl, last record of each step) equal an uninterrupted
run's bit for bit.

CI size: 3 kills, one at each of the three moments (each costs a restart of ~15 s on a 2-core
machine). More, the fourth onwards at moments picked at random:
``TJ_CHAOS_KILLS=50 pytest tests/test_fault_chaos.py`` (the run gets longer with the number of
kills). ``TJ_CHAOS_SEED`` picks another random sequence.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
import pytest

from configs import tiny
from transformer_jax.training import integrity, restore_for_inference, train_and_evaluate
from transformer_jax.training.checkpoint import Checkpointer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(tempfile.gettempdir(), "transformer_jax_test_xla_cache")
KILLS = int(os.environ.get("TJ_CHAOS_KILLS", "3"))
SEED = int(os.environ.get("TJ_CHAOS_SEED", "0"))
STEPS = max(30, 4 * KILLS)
EVERY = 3  # checkpoint every 3 steps: many saves, so many kills land in one
SETTINGS = {
    "num_train_steps": STEPS,
    "log_every_steps": 1,
    "checkpoint_every_steps": EVERY,
    "eval_every_steps": 10 * STEPS,  # only the final evaluation
    "max_checkpoints_to_keep": 3,  # old steps are deleted while training: a kill may land there too
    "model.dropout_rate": 0.1,  # the dropout key must resume exactly too
}


def _config(data_dir):
    config = tiny.get_config()
    config.dataset.data_dir = data_dir
    config.compilation_cache_dir = CACHE
    for key, value in SETTINGS.items():
        *parents, leaf = key.split(".")
        target = config
        for p in parents:
            target = target[p]
        target[leaf] = value
    return config


def _train_py(workdir, data_dir):
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
    args = [
        sys.executable,
        os.path.join(REPO, "train.py"),
        "--config=" + os.path.join(REPO, "configs/tiny.py"),
        f"--workdir={workdir}",
        f"--config.dataset.data_dir={data_dir}",
        f"--config.compilation_cache_dir={CACHE}",
        *(f"--config.{k}={v}" for k, v in SETTINGS.items()),
    ]
    return subprocess.Popen(
        args, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def losses(workdir):
    """{step: loss}, the last record of each step (a resumed run logs some steps again)."""
    out = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)  # a torn line would fail here: the loop repairs them
            if "loss" in record:
                out[record["step"]] = record["loss"]
    return out


def _logged_steps(workdir) -> int:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        steps = re.findall(r'"step": (\d+)', f.read())
    return max(map(int, steps), default=0)


def temporaries(directory) -> list[str]:
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return [n for n in names if ".orbax-checkpoint-tmp" in n]


def inspect(directory) -> dict:
    """The committed steps, orbax temporaries, and the step a restart must resume from."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    steps = sorted(int(n) for n in names if n.isdigit())
    temporaries = [n for n in names if ".orbax-checkpoint-tmp" in n]
    verdicts = {s: integrity.verify(directory, s) for s in steps}
    usable = [s for s in steps if verdicts[s].usable]
    return {
        "steps": steps,
        "temporaries": temporaries,
        "verdicts": verdicts,
        "expected": usable[-1] if usable else None,
    }


def _kill(proc, workdir, mode, rng):
    """Waits for the moment ``mode`` picks, then SIGKILLs; returns what it waited for."""
    directory = os.path.join(workdir, "checkpoints")
    start, deadline = time.time(), time.time() + 120
    if mode == "startup":  # anywhere in imports, data, restore or compilation
        time.sleep(rng.uniform(0.5, 4.0))
    elif mode == "async_save":  # while orbax writes a step in the background
        stale = set(temporaries(directory))  # left by the last kill; removed when the run starts
        while time.time() < deadline and proc.poll() is None and stale & set(temporaries(directory)):
            time.sleep(0.01)
        while time.time() < deadline and proc.poll() is None and not temporaries(directory):
            time.sleep(0.002)
        time.sleep(rng.uniform(0.0, 0.05))
    else:  # 'step': a few steps after the run got going, plus a random fraction of a step
        target = _logged_steps(workdir) + rng.randint(1, 2 * EVERY)
        while time.time() < deadline and proc.poll() is None and _logged_steps(workdir) < target:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.2))
    if proc.poll() is not None:
        return None
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    return f"{mode} after {time.time() - start:.2f}s"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


def test_sigkill_at_random_moments_loses_nothing(data_dir, tmp_path):
    rng = random.Random(SEED)
    reference_dir = str(tmp_path / "reference")
    train_and_evaluate(_config(data_dir), reference_dir)  # uninterrupted, in-process

    workdir = str(tmp_path / "chaos")
    directory = os.path.join(workdir, "checkpoints")
    modes = ["async_save", "step", "startup"]
    kills, during_save, resumes_checked, log = 0, 0, 0, []
    expected = None  # the step the next run must resume from (None: a fresh start)
    for _attempt in range(4 * KILLS + 10):
        proc = _train_py(workdir, data_dir)
        if kills < KILLS:
            how = _kill(proc, workdir, modes[kills % len(modes)] if kills < 3 else rng.choice(modes), rng)
        else:
            how = None
            proc.wait(timeout=600)
        out = proc.stdout.read()
        resumed = re.search(r"Resumed from checkpoint (\d+)", out)
        if resumed:  # the run got far enough to restore: from the newest complete step
            assert expected is not None and int(resumed.group(1)) == expected, (expected, log, out[-3000:])
            resumes_checked += 1
        elif "parameters:" in out:
            assert expected is None, f"started from scratch although step {expected} was complete"
        state = inspect(directory)
        if how is None:
            assert proc.returncode == 0, out[-3000:]
            break
        kills += 1
        during_save += bool(state["temporaries"])
        # Only orbax's temporaries may be incomplete; every step directory is complete (or an old
        # step that was being deleted when the kill came, never the newest).
        for step, verdict in state["verdicts"].items():
            assert verdict.usable or step != state["steps"][-1], (step, verdict)
        expected = state["expected"]
        log.append((how, state["steps"], state["temporaries"][:1]))
    else:
        raise AssertionError(f"never finished: {log}")

    print(f"\nchaos: {kills} kills ({during_save} during an async save), {resumes_checked} resumes checked")
    print("\n".join(map(str, log)))
    assert kills >= KILLS and during_save >= 1 and resumes_checked >= KILLS // 2, log
    final = inspect(directory)
    assert final["steps"][-1] == STEPS and not final["temporaries"], (final, log)
    listed = Checkpointer(workdir, read_only=True).all_steps()  # what a restore can pick from
    assert all(final["verdicts"][s].status == "ok" for s in listed), (listed, final, log)
    assert losses(workdir) == losses(reference_dir)  # every step 1..STEPS, bit for bit
    assert sorted(losses(workdir)) == list(range(1, STEPS + 1))
    got, want = restore_for_inference(workdir), restore_for_inference(reference_dir)
    assert got.step == want.step == STEPS
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got.params, want.params
    )
