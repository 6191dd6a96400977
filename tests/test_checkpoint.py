"""Checkpoints: exact resume (in-process restart, SIGTERM), restore onto another mesh or
device count, restore_for_inference, and checkpoint averaging."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import tiny
from transformer_jax import parallel
from transformer_jax.config import ConfigError
from transformer_jax.training import average_checkpoints, restore_for_inference, train_and_evaluate
from transformer_jax.training.checkpoint import Checkpointer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(tempfile.gettempdir(), "transformer_jax_test_xla_cache")
STEPS = 20


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


def tiny_config(data_dir, **overrides):
    config = tiny.get_config()
    config.dataset.data_dir = data_dir
    config.compilation_cache_dir = CACHE  # shared by the tests: each program compiles once
    config.num_train_steps = STEPS
    config.log_every_steps = 1
    config.eval_every_steps = 100
    config.checkpoint_every_steps = 5
    config.model.dropout_rate = 0.1  # the dropout key must resume exactly too
    config.update(overrides)
    return config


def train_losses(workdir, key="loss"):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {r["step"]: r[key] for r in records if "loss" in r}


def window_loss(reference, first: int, last: int) -> float:
    """The loss a line logging steps first..last shows: the per-step losses of the reference (which
    logs every step) weighted by each step's target tokens."""
    tokens = train_losses(reference[1], "num_tokens")
    steps = range(first, last + 1)
    return float(np.average([reference[0][s] for s in steps], weights=[tokens[s] for s in steps]))


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
    """An uninterrupted run: {step: loss} and its workdir."""
    workdir = str(tmp_path_factory.mktemp("reference"))
    train_and_evaluate(tiny_config(data_dir), workdir)
    return train_losses(workdir), workdir


def test_restart_resumes_bit_for_bit_and_logs_each_step_once(data_dir, tmp_path, reference):
    """Resumed from step 5 (as if killed before saving step 10), the run trains and logs steps 6-10
    again: their old records are dropped from metrics.jsonl (they appeared twice), and TensorBoard
    gets a restart marker (SessionLog START) at step 6, so that neither shows a step twice."""
    import glob
    import shutil

    from transformer_jax.training import metrics

    workdir = str(tmp_path / "w")
    train_and_evaluate(tiny_config(data_dir, num_train_steps=10), workdir)
    assert Checkpointer(workdir).latest_step() == 10
    shutil.rmtree(os.path.join(workdir, "checkpoints", "10"))
    final = train_and_evaluate(tiny_config(data_dir), workdir)
    assert final["step"] == STEPS
    assert train_losses(workdir) == reference[0]  # exact equality, steps 1..20
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        steps = [r["step"] for r in map(json.loads, f) if "loss" in r]
    assert steps == list(range(1, STEPS + 1))
    newest = sorted(glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*")))[-1]
    # Event.step = 6 (field 2), Event.session_log (field 7) = SessionLog{status: START (field 1 = 1)}:
    # TensorBoard purges the earlier files' steps >= 6
    marker = bytes([0x10, 6, 0x3A, 2, 0x08, 1])
    assert any(payload.endswith(marker) for payload in metrics.read_events(newest))


def test_a_run_killed_before_its_first_checkpoint_logs_each_step_once(data_dir, tmp_path, reference):
    """With no checkpoint left (killed before the first save completed), the rerun starts from step
    0 and trains steps 1.. again: the killed run's records of them were kept, so each appeared twice
    in metrics.jsonl, and TensorBoard got no restart marker."""
    import glob
    import shutil

    from transformer_jax.training import metrics

    workdir = str(tmp_path / "w")
    train_and_evaluate(tiny_config(data_dir, num_train_steps=5), workdir)
    shutil.rmtree(os.path.join(workdir, "checkpoints", "5"))  # as if killed while writing step 5
    assert Checkpointer(workdir).latest_step() is None
    train_and_evaluate(tiny_config(data_dir), workdir)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        steps = [r["step"] for r in map(json.loads, f) if "loss" in r]
    assert steps == list(range(1, STEPS + 1))
    assert train_losses(workdir) == reference[0]
    newest = sorted(glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*")))[-1]
    marker = bytes([0x10, 1, 0x3A, 2, 0x08, 1])  # SessionLog START at step 1: earlier steps purged
    assert any(payload.endswith(marker) for payload in metrics.read_events(newest))


def _train_py(workdir, data_dir, steps=STEPS, extra=()):
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
    args = [
        sys.executable,
        os.path.join(REPO, "train.py"),
        "--config=" + os.path.join(REPO, "configs/tiny.py"),
        f"--workdir={workdir}",
        f"--config.dataset.data_dir={data_dir}",
        f"--config.num_train_steps={steps}",
        "--config.log_every_steps=1",
        "--config.checkpoint_every_steps=5",
        "--config.eval_every_steps=100",
        "--config.model.dropout_rate=0.1",
        f"--config.compilation_cache_dir={CACHE}",
        *extra,
    ]
    return subprocess.Popen(
        args, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _wait_for_step(workdir, step, proc, timeout=240):
    path = os.path.join(workdir, "metrics.jsonl")
    start = time.time()
    while time.time() - start < timeout:
        if proc.poll() is not None:
            raise AssertionError("train.py ended early:\n" + proc.stdout.read()[-3000:])
        if os.path.exists(path):
            with open(path) as f:
                if any(f'"step": {step},' in line for line in f):
                    return
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_first_ctrl_c_asks_for_a_checkpoint_and_the_second_interrupts():
    """A first Ctrl-C (SIGINT) is a stop with a checkpoint, as SIGTERM is (the loop polls the flag;
    the SIGTERM test below runs the whole path); it used to end in a KeyboardInterrupt traceback
    that could discard a save in progress. A second one interrupts at once."""
    from transformer_jax.training import checkpoint as ckpt_lib

    # The handler to come back after: Python's default, or SIG_IGN in a process started in the
    # background by a non-interactive shell (as CI may start the suite).
    before = signal.getsignal(signal.SIGINT)
    with ckpt_lib.PreemptionFlag() as flag:
        os.kill(os.getpid(), signal.SIGINT)
        assert flag._event.is_set() and flag.signal_name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


def _interrupt_inside_a_gc_callback(handler):
    """Calls ``handler`` for a SIGINT from inside a garbage-collector callback, where JAX runs one
    at every collection: an exception raised there is printed ("Exception ignored in") and lost."""
    import gc

    calls = []

    def callback(phase, info):
        if phase == "start" and not calls:
            calls.append(phase)
            handler(signal.SIGINT, sys._getframe())

    gc.callbacks.append(callback)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(callback)
    assert calls


def test_a_ctrl_c_landing_in_a_gc_callback_is_not_lost():
    """About one Ctrl-C in six, pressed twice, landed in JAX's garbage-collector callback: the
    second one's KeyboardInterrupt was dropped there, and the run saved as after one. At start-up
    (train.py's handler) the same dropped one Ctrl-C for good: the run trained to its end. Such a
    signal is now delivered again once the callback has returned."""
    import logging

    from transformer_jax.training import checkpoint as ckpt_lib

    before = signal.signal(signal.SIGINT, ckpt_lib.interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            _interrupt_inside_a_gc_callback(ckpt_lib.interrupt)
            time.sleep(5)  # the signal comes again within milliseconds
    finally:
        signal.signal(signal.SIGINT, before)
    records = []
    mine = logging.Handler()
    mine.emit = records.append
    logging.getLogger().addHandler(mine)
    try:
        with ckpt_lib.PreemptionFlag() as flag:
            os.kill(os.getpid(), signal.SIGINT)
            assert flag.requested()
            with pytest.raises(KeyboardInterrupt):
                _interrupt_inside_a_gc_callback(flag._handle)
                time.sleep(5)
        # orbax's error log of a wait that the second Ctrl-C cut (its traceback) is not shown
        logging.getLogger("absl").error("Save Finalize thread failed", exc_info=KeyboardInterrupt())
        logging.getLogger("absl").error("another error")
    finally:
        logging.getLogger().removeHandler(mine)
    assert [r.getMessage() for r in records if r.levelno >= logging.ERROR] == ["another error"]
    assert signal.getsignal(signal.SIGINT) is before


def test_a_second_ctrl_c_while_the_first_is_announced_stops_at_once(monkeypatch):
    """Two Ctrl-Cs 10 ms apart: the second's handler ran while the first's was still writing its
    notice, found the flag unset, and was taken for a first one (the run saved and stopped)."""
    from transformer_jax.training import checkpoint as ckpt_lib

    announced = []

    def warning(*args):  # the second Ctrl-C arrives as the first is logged
        announced.append(args)
        if len(announced) == 1:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(ckpt_lib.logging, "warning", warning)
    with ckpt_lib.PreemptionFlag(), pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    assert len(announced) == 1


def test_a_ctrl_c_while_the_config_loads_stops_train_py_before_it_trains(tmp_path):
    """Ctrl-C during train.py's first second (the config file importing jax): Python's own handler
    raised it wherever it landed: in JAX's garbage-collector callback it was dropped and the run
    trained to its end; in the config file it was "error: reading --config failed". Now it is the
    one interrupted line, status 130, nothing written."""
    config = tmp_path / "interrupted.py"
    config.write_text("import os, signal\n"
                      "from configs import tiny\n\n\n"
                      "def get_config():\n"
                      "    os.kill(os.getpid(), signal.SIGINT)  # as a Ctrl-C would land here\n"
                      "    return tiny.get_config()\n")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, os.path.join(repo, "train.py"), f"--config={config}", f"--workdir={tmp_path / 'w'}"],
        cwd=tmp_path, env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": repo},
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 130, proc.stderr[-3000:]
    last = "interrupted: stopped without saving; the run resumes from its latest checkpoint"
    assert proc.stderr.strip().splitlines() == [last], proc.stderr[-3000:]
    assert not (tmp_path / "w").exists()


def test_sigterm_saves_where_it_stops_and_resumes_exactly(data_dir, tmp_path, reference):
    """Preemption: SIGTERM mid-training saves the current step and exits with status 143. (SIGKILL at
    random moments, with the same exact-resume check, is tests/test_fault_chaos.py.)"""
    signum = signal.SIGTERM
    workdir = str(tmp_path / "w")
    # A long run, so that the signal surely arrives mid-training; the schedule is constant, so
    # the losses of the first 20 steps do not depend on num_train_steps.
    # Evaluating 300 examples after every step slows it down, so that the signal arrives well
    # before step 20 (evaluation does not touch the train state).
    proc = _train_py(
        workdir,
        data_dir,
        steps=100000,
        extra=["--config.eval_every_steps=1", "--config.dataset.max_eval_examples=300"],
    )
    _wait_for_step(workdir, 7, proc)
    while not os.path.isdir(os.path.join(workdir, "checkpoints", "5")):
        time.sleep(0.02)
    proc.send_signal(signum)
    out = proc.communicate(timeout=120)[0]
    saved = Checkpointer(workdir).latest_step()
    assert proc.returncode == 128 + signum, out[-3000:]  # not finished: 143
    assert f"Stopped by {signal.Signals(signum).name}" in out and "\nstopped: " in out
    assert saved >= 7 and saved == max(train_losses(workdir))  # saved where it stopped
    assert saved < STEPS, f"the signal came too late (step {saved}); the machine is very slow"
    train_and_evaluate(tiny_config(data_dir), workdir)
    assert train_losses(workdir) == reference[0]


def test_a_stop_between_logging_steps_logs_the_steps_before_it(data_dir, tmp_path, reference, monkeypatch):
    """Logging every 4 steps, a checkpoint every 5, stopped after step 6: step 5 is logged with its
    checkpoint and step 6 at the stop (they were dropped, and the resume starts after them), and the
    resumed run logs 7-8 at step 8. The figures returned at the stop say which step their evaluation
    is of (4, not the stop's 6)."""
    from transformer_jax.training import checkpoint as ckpt_lib
    from transformer_jax.training import metrics

    workdir = str(tmp_path / "w")
    monkeypatch.setattr(ckpt_lib.PreemptionFlag, "reached", lambda self, manager, step: step == 6)
    # "checkpoint saved." only once the step has committed: it was printed while the background
    # save ran, and a SIGKILL right after it (a scheduler's grace period ending) lost the step.
    committed_at_message = []
    real_message = metrics.MetricsLogger.message

    def message(self, text):
        if text.startswith("Stopped by"):
            committed_at_message.append(Checkpointer(workdir, read_only=True).all_steps())
        real_message(self, text)

    monkeypatch.setattr(metrics.MetricsLogger, "message", message)
    final = train_and_evaluate(tiny_config(data_dir, log_every_steps=4, eval_every_steps=4), workdir)
    monkeypatch.undo()
    assert committed_at_message and committed_at_message[0][-1] == 6, committed_at_message
    assert final["step"] == 6 and final["eval_step"] == 4 and "eval_loss" in final
    assert sorted(train_losses(workdir)) == [4, 5, 6] and Checkpointer(workdir).latest_step() == 6
    train_and_evaluate(tiny_config(data_dir, log_every_steps=4, num_train_steps=8), workdir)
    losses = train_losses(workdir)
    assert sorted(losses) == [4, 5, 6, 8]
    for step, first in [(4, 1), (5, 5), (6, 6), (8, 7)]:
        np.testing.assert_allclose(losses[step], window_loss(reference, first, step), rtol=1e-5)


def test_a_run_resumed_from_any_checkpoint_logs_the_lines_of_an_uninterrupted_one(data_dir, tmp_path,
                                                                                  reference):
    """Logging every 4 steps with a checkpoint every 5: each checkpoint ends a logging window too
    (lines at 4, 5, 8, 10, 12). Resumed from step 5 after a crash lost checkpoints 10 and 12, the run
    drops its lines after 5 and logs the same ones again. A window ran across a checkpoint: the
    dropped line at 8 covered steps 5-8 and the resumed run's 6-8 alone, step 5 in no line."""
    import shutil

    workdir = str(tmp_path / "w")
    config = tiny_config(data_dir, log_every_steps=4, num_train_steps=12)
    train_and_evaluate(config, workdir)
    first = train_losses(workdir)
    for step in (10, 12):
        shutil.rmtree(os.path.join(workdir, "checkpoints", str(step)))
    assert Checkpointer(workdir).latest_step() == 5
    train_and_evaluate(config, workdir)
    losses = train_losses(workdir)
    assert sorted(losses) == [4, 5, 8, 10, 12] and losses == first
    for step, start in [(4, 1), (5, 5), (8, 6), (10, 9), (12, 11)]:
        np.testing.assert_allclose(losses[step], window_loss(reference, start, step), rtol=1e-5)


@pytest.mark.parametrize("moment", ["start", "last_save", "test_evaluation"])
def test_a_sigterm_before_the_first_or_after_the_last_step_stops_cleanly(data_dir, tmp_path, monkeypatch,
                                                                         capsys, moment):
    """The handlers covered the training loop only. A SIGTERM while the last checkpoint was being
    written killed the run (status -15) and lost it; one during the test-set (BLEU) evaluation
    killed it there; one that reached the last step's check saved and then ran the whole BLEU
    evaluation anyway; one during start-up killed it (a first Ctrl-C said it stopped without
    saving). Now: at start-up the run stops after its first step, with that step saved; at the
    last save it stops once the save has committed; in the evaluation, before its next batch.
    Each time the run returns without the test figures, and running it again evaluates."""
    from transformer_jax.training import checkpoint as ckpt_lib
    from transformer_jax.training import evaluate, loop

    def sigterm_before(owner, name, when=lambda *args: True):
        real, sent = getattr(owner, name), []

        def call(*args, **kwargs):
            if not sent and when(*args):
                sent.append(True)
                os.kill(os.getpid(), signal.SIGTERM)
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, call)
        return sent

    steps = 6
    if moment == "start":
        sent = sigterm_before(loop, "create_train_state")
    elif moment == "last_save":  # the wait after the loop, for the last step's background save
        sent = sigterm_before(Checkpointer, "wait", lambda self: self.latest_step() == steps)
    else:  # two batches of 16 examples: the stop comes before the second
        sent = sigterm_before(evaluate, "decode_batch")
    before = signal.getsignal(signal.SIGTERM)
    workdir = str(tmp_path / "w")
    config = tiny_config(data_dir, num_train_steps=steps, test_split="test")
    final = train_and_evaluate(config, workdir)
    assert sent and signal.getsignal(signal.SIGTERM) is before
    out = capsys.readouterr().out
    saved = 1 if moment == "start" else steps
    assert final["step"] == saved and Checkpointer(workdir).latest_step() == saved
    assert not any(key.startswith("test_") for key in final), final
    assert final["stopped_by"] == "SIGTERM"  # train.py: "stopped:" and status 143, the run unfinished
    if moment == "test_evaluation":
        assert f"Stopped by SIGTERM during the test evaluation after the last step, {steps}" in out
    else:
        assert f"Stopped by SIGTERM after step {saved}; checkpoint saved." in out
    assert out.count("Stopped by") == 1
    monkeypatch.undo()
    assert "test_bleu" in train_and_evaluate(config, workdir)
    assert not ckpt_lib.PreemptionFlag().requested()


# A mesh with axis names of its own, and the rules that map the model's logical names onto them.
OWN_RULES = (("batch", ("replica", "shard")), ("embed", "shard"), ("vocab", "model"), ("heads", "model"),
             ("kv_heads", "model"), ("mlp", "model"))


def _own_mesh(shape):
    devices = np.asarray(jax.devices()[:int(np.prod(shape))]).reshape(shape)
    return jax.sharding.Mesh(devices, ("replica", "shard", "model"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 3)


def test_restore_on_another_mesh_and_device_count(data_dir, tmp_path, reference):
    """The first steps train on a mesh with axes of its own (2 x 2 x 2) through rules of its own; the
    run resumes on one device with the default rules and loses nothing; the parameters restore
    alike on either kind of mesh. (With custom rules the training helpers placed the state by the
    default rules, which name axes that mesh lacks.)"""
    workdir = str(tmp_path / "w")
    own = _own_mesh((2, 2, 2))
    train_and_evaluate(tiny_config(data_dir, num_train_steps=10), workdir, mesh=own, rules=OWN_RULES)
    one = parallel.create_mesh(1, 1, 1, jax.devices()[:1])
    final = train_and_evaluate(tiny_config(data_dir), workdir, mesh=one)  # resume on 1 device
    assert final["step"] == STEPS
    np.testing.assert_allclose(
        [train_losses(workdir)[s] for s in range(1, STEPS + 1)],
        [reference[0][s] for s in range(1, STEPS + 1)],
        rtol=2e-5,
    )
    on_one = restore_for_inference(workdir, mesh=one)
    on_all = restore_for_inference(workdir, mesh=parallel.create_mesh(data=1, fsdp=4, tensor=2))
    on_own = restore_for_inference(workdir, mesh=_own_mesh((1, 4, 2)), rules=OWN_RULES)
    assert on_one.step == STEPS and on_one.tokenizer.vocab_size == 320
    for other in (on_all, on_own):
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                     on_one.params, other.params)
    # placed by the rules: the feed-forward's first kernel [embed, mlp] over ('shard', 'model')
    wi = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(on_own.params)
          if "feed_forward" in jax.tree_util.keystr(path) and "'wi']['kernel" in jax.tree_util.keystr(path)]
    assert wi and all(leaf.sharding.spec[-2:] == ("shard", "model") for leaf in wi), [w.sharding for w in wi]
    with pytest.raises(ConfigError, match=r"entry 0, \('batch', \('data', 'fsdp'\)\), names mesh axis 'da"):
        restore_for_inference(workdir, mesh=own)  # the default rules on a mesh without their axes
    with pytest.raises(ConfigError, match=r"entry 1, \('embed',\): expected a pair"):
        train_and_evaluate(tiny_config(data_dir), str(tmp_path / "bad"), mesh=own,
                           rules=(OWN_RULES[0], ("embed",)))
    with pytest.raises(ConfigError, match=r"entry 0, .*: expected a pair .*distinct mesh axes"):
        parallel.check_rules((("batch", ("shard", "shard")),), own)
    assert parallel.check_rules(None, one) == parallel.DEFAULT_RULES
    with pytest.raises(ConfigError, match=r"restore_for_inference: rules of your own are given without the "
                                          r"mesh whose axes they name; pass mesh= too"):
        restore_for_inference(workdir, rules=OWN_RULES)  # (it named axes of the default mesh)


def test_a_finished_run_started_again_logs_its_final_evaluation_once(data_dir, tmp_path, reference):
    """Nothing left to train: the final test evaluation is computed and returned again, but not
    appended to metrics.jsonl (and TensorBoard) a second time."""
    import shutil

    workdir = shutil.copytree(reference[1], str(tmp_path / "w"))
    # (the reference ran without a test split: the first start here evaluates and logs it)
    first, again = (train_and_evaluate(tiny_config(data_dir, test_split="test"), workdir) for _ in range(2))
    assert first["step"] == again["step"] == STEPS and again["test_bleu"] == first["test_bleu"]
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    tests = [r for r in records if "test_bleu" in r]
    assert len(tests) == 1 and tests[0]["step"] == STEPS and tests[0]["test_bleu"] == first["test_bleu"]


def test_restore_for_inference_without_checkpoint(tmp_path):
    with pytest.raises(ValueError, match=str(tmp_path)):
        restore_for_inference(str(tmp_path))


@pytest.mark.parametrize("moment", ["verifying", "restoring"])
def test_a_step_pruned_while_it_is_read_for_inference_is_named_as_removed(reference, tmp_path, monkeypatch,
                                                                          moment):
    """A run still training in the workdir prunes its oldest steps. `restore_for_inference` (and so
    `generate --step`) of a step pruned mid-read called it intact but of another optimizer state
    (pruned while orbax read it), corrupt with missing files, or raised a bare FileNotFoundError
    (pruned while its files were hashed)."""
    import shutil

    from transformer_jax.training import integrity

    workdir = str(tmp_path / "w")
    shutil.copytree(reference[1], workdir)
    directory = os.path.join(workdir, "checkpoints")
    oldest = Checkpointer(workdir).all_steps()[0]
    owner, name = (integrity, "_sha256") if moment == "verifying" else (ocp.CheckpointManager, "restore")
    real = getattr(owner, name)

    def pruned_first(*args, **kwargs):
        shutil.rmtree(integrity.step_dir(directory, oldest), ignore_errors=True)  # as the training run does
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, pruned_first)
    removed = rf"Checkpoint step {oldest} in .* was removed while it was being read"
    with pytest.raises(ValueError, match=removed):
        restore_for_inference(workdir, step=oldest)


def test_average_checkpoints(reference, data_dir, tmp_path):
    from transformer_jax.training import integrity

    workdir = reference[1]
    steps = Checkpointer(workdir).all_steps()
    assert steps[-2:] == [15, 20]
    out = average_checkpoints(workdir, last_k=2, output_workdir=str(tmp_path / "avg"))
    averaged = restore_for_inference(out)
    last = restore_for_inference(workdir, step=20).params
    before = restore_for_inference(workdir, step=15).params
    assert averaged.step == 20
    jax.tree.map(
        lambda a, x, y: np.testing.assert_allclose(
            a, (np.asarray(x) + np.asarray(y)) / 2, rtol=1e-6, atol=1e-7
        ),
        averaged.params,
        last,
        before,
    )
    # Exactly the float32 mean, also for a count that is not a power of two: XLA had made the
    # division by 3 a multiplication by 1/3, one unit in the last place off for ~1 value in 5.
    three = average_checkpoints(workdir, last_k=3, output_workdir=str(tmp_path / "avg3"))
    singles = [restore_for_inference(workdir, step=s).params for s in steps[-3:]]
    want = jax.tree.map(lambda a, b, c: (np.float32(a) + np.float32(b) + np.float32(c)) / np.float32(3),
                        *singles)
    jax.tree.map(np.testing.assert_array_equal, restore_for_inference(three).params, want)
    # Training on in the average's workdir: it has no optimizer state. Before, orbax's error was
    # read as "another optimizer state ... set config.optimizer back", which was not the cause.
    with pytest.raises(integrity.CheckpointConfigMismatchError, match=r"holds parameters only"):
        train_and_evaluate(tiny_config(data_dir), out)


def test_average_checks_each_step_and_its_arguments(reference, tmp_path, caplog):
    import shutil

    from transformer_jax.training import integrity

    workdir = str(tmp_path / "copy")
    shutil.copytree(reference[1], workdir)
    with pytest.raises(ValueError, match=r"last_k=0 \(--last\): average at least one checkpoint"):
        average_checkpoints(workdir, last_k=0)
    # more than there are: all of them, and the output is named after the number averaged
    steps = Checkpointer(workdir).all_steps()
    out = average_checkpoints(workdir, last_k=50)
    assert out.endswith(f"average_last{len(steps)}")
    each = [restore_for_inference(workdir, step=s).params for s in steps]  # the mean of those there are
    jax.tree.map(lambda a, *xs: np.testing.assert_allclose(a, np.mean(xs, axis=0), rtol=1e-5, atol=1e-7),
                 restore_for_inference(out).params, *each)
    with pytest.raises(ValueError, match=r"already holds a checkpoint at step 20 .*--output"):
        average_checkpoints(workdir, last_k=50)  # the same output again: not overwritten
    # Stopped after the step was committed and before its manifest: a rerun finishes it (it was
    # refused as "an earlier average", the unsealed step left to load on orbax's word alone).
    manifest = os.path.join(integrity.step_dir(os.path.join(out, "checkpoints"), 20), integrity.MANIFEST_NAME)
    os.remove(manifest)
    with caplog.at_level("WARNING"):
        assert average_checkpoints(workdir, last_k=50) == out
    assert "without its manifest (an average stopped before it was sealed)" in caplog.text
    assert os.path.exists(manifest) and integrity.verify(os.path.join(out, "checkpoints"), 20).status == "ok"
    jax.tree.map(lambda a, *xs: np.testing.assert_allclose(a, np.mean(xs, axis=0), rtol=1e-5, atol=1e-7),
                 restore_for_inference(out).params, *each)
    # Steps that are not consecutive saves (keep_best_metric keeps the best ones, which may lie far
    # apart) were averaged as "the last K" without a word.
    with open(os.path.join(workdir, "config.json")) as f:
        every = json.load(f)["checkpoint_every_steps"]
    shutil.rmtree(integrity.step_dir(os.path.join(workdir, "checkpoints"), 20 - every))
    with caplog.at_level("WARNING"):
        average_checkpoints(workdir, last_k=2, output_workdir=str(tmp_path / "gap"))
    assert (f"are not consecutive saves (one every {every} steps): averaging steps "
            f"[{20 - 2 * every}, 20]") in caplog.text
    # Closer than the saves too: a save at a preemption (31 after 30) or at a last step off the grid
    # gave its stretch double weight without a word (only wider gaps were named).
    from transformer_jax.training.checkpoint import evenly_spaced

    assert evenly_spaced([20, 30, 40], 10) and evenly_spaced([40], 10)
    assert not evenly_spaced([30, 31, 40, 50, 60], 10) and not evenly_spaced([20, 40], 10)
    assert not evenly_spaced([30, 40, 45], 10)
    # a flipped byte in the newest step's parameters: refused, like any restore of it
    flip_byte(_biggest_params_file(integrity.step_dir(os.path.join(workdir, "checkpoints"), 20)))
    with pytest.raises(integrity.CheckpointCorruptError, match=r"step 20 .* is corrupt: .*has changed.*"
                                                               r"Not averaging it"):
        average_checkpoints(workdir, last_k=2, output_workdir=str(tmp_path / "bad"))
    assert not os.path.exists(tmp_path / "bad")
    with pytest.raises(ValueError, match=r"No checkpoint at step 99 in .*; it has steps \[.*20\]"):
        restore_for_inference(workdir, step=99)


def test_average_reads_the_steps_onto_the_runs_own_mesh(reference, tmp_path, monkeypatch, caplog):
    """Averaging put the whole model on every device: a model sharded over fsdp because it does not
    fit one device could not be averaged. It reads onto the mesh the run trained on where the
    devices allow, else (another machine's mesh) whole on every device, with a warning."""
    import shutil

    from transformer_jax.training import checkpoint as checkpoint_lib

    workdir = str(tmp_path / "copy")
    shutil.copytree(reference[1], workdir, ignore=shutil.ignore_patterns("average_last*"))
    seen = []
    mean_of_sum = checkpoint_lib._mean_of_sum
    monkeypatch.setattr(checkpoint_lib, "_mean_of_sum",
                        lambda total, count: seen.append(total.sharding) or mean_of_sum(total, count))
    plain = restore_for_inference(average_checkpoints(workdir, last_k=2, output_workdir=str(tmp_path / "a")))
    assert {dict(s.mesh.shape)["data"] for s in seen} == {8}  # the run's mesh: data=-1
    path = os.path.join(workdir, "config.json")
    with open(path) as f:
        config = json.load(f)
    for mesh, shape in (({"data": 1, "fsdp": 8, "tensor": 1}, {"data": 1, "fsdp": 8, "tensor": 1}),
                        ({"data": 1, "fsdp": 16, "tensor": 1}, {"data": 8, "fsdp": 1, "tensor": 1})):
        with open(path, "w") as f:
            json.dump({**config, "mesh": mesh}, f)
        seen.clear()
        caplog.clear()
        out = average_checkpoints(workdir, last_k=2, output_workdir=str(tmp_path / f"fsdp{mesh['fsdp']}"))
        assert {tuple(dict(s.mesh.shape).items()) for s in seen} == {tuple(shape.items())}
        assert any(not s.is_fully_replicated for s in seen) == (mesh["fsdp"] == 8)  # split, not whole
        assert ("the run's mesh cannot be made here" in caplog.text) == (mesh["fsdp"] == 16)
        jax.tree.map(np.testing.assert_array_equal, restore_for_inference(out).params, plain.params)


def test_average_never_overwrites_another_runs_files(reference, tmp_path):
    """An --output reused for another workdir's average kept its steps but got this run's config and
    tokenizer over its own: its earlier average could no longer be loaded. Now an error, nothing
    written; an earlier average of the same workdir (same model and tokenizer) is still a fine output."""
    out = tmp_path / "avg"
    out.mkdir()
    other = '{"model": {"vocab_size": 7}}'  # another run's config.json
    (out / "config.json").write_text(other)
    with pytest.raises(ValueError, match=r"config.json differs from .*another output directory"):
        average_checkpoints(reference[1], last_k=1, output_workdir=str(out))
    assert (out / "config.json").read_text() == other and sorted(os.listdir(out)) == ["config.json"]
    average_checkpoints(reference[1], last_k=1, output_workdir=str(tmp_path / "same"))
    with open(tmp_path / "same" / "config.json") as f:
        resumed = json.load(f)
    resumed["num_train_steps"] = 1000  # the run went on training: the same model, a later average
    with open(tmp_path / "same" / "config.json", "w") as f:
        json.dump(resumed, f)
    os.rename(tmp_path / "same" / "checkpoints", tmp_path / "earlier")  # an average at another step
    assert restore_for_inference(average_checkpoints(reference[1], 1, str(tmp_path / "same"))).step == 20


def test_a_damaged_average_is_caught_when_it_is_loaded(reference, tmp_path, monkeypatch):
    """The averaged step is sealed like a training step: a flipped byte in its array data is caught
    (without a manifest, orbax read it as silently changed weights). In a multi-process run no
    process returns before the seal is written."""
    from transformer_jax import parallel
    from transformer_jax.training import integrity

    # Every process waits for process 0's manifest before it returns (and may load the average).
    events = []
    write = integrity.write_manifest
    monkeypatch.setattr(integrity, "write_manifest", lambda *a: (events.append("sealed"), write(*a))[1])
    monkeypatch.setattr(parallel, "sync_global", events.append)
    out = average_checkpoints(reference[1], last_k=2, output_workdir=str(tmp_path / "avg"))
    assert events[-2:] == ["sealed", "transformer_jax_average_sealed"]
    directory = os.path.join(out, "checkpoints")
    assert integrity.verify(directory, 20).status == "ok"
    flip_byte(_biggest_params_file(integrity.step_dir(directory, 20)), at=0.1)
    with pytest.raises(integrity.CheckpointCorruptError, match=r"step 20: .*has changed"):
        restore_for_inference(out)


def test_average_names_a_step_removed_while_reading(reference, tmp_path, monkeypatch):
    """A run still training in the workdir deletes old steps: one that vanishes mid-read is named as
    removed, not called corrupt (with advice to move it away)."""
    import shutil

    from transformer_jax.training import integrity

    workdir = str(tmp_path / "copy")
    shutil.copytree(reference[1], workdir)

    def deleting_verify(directory, step, model_config=None):
        shutil.rmtree(integrity.step_dir(directory, step))  # the trainer's pruning, at this moment
        return integrity.Verdict(step, "corrupt", ["a file is missing"])

    monkeypatch.setattr(integrity, "verify", deleting_verify)
    with pytest.raises(ValueError, match=r"step 15 .* was removed while it was being read"):
        average_checkpoints(workdir, last_k=2, output_workdir=str(tmp_path / "avg"))


def test_average_cli(reference, tmp_path):
    # Paths as `--workdir=~/...` (the shell leaves a '~' after '=' as it is): the workdir was "not a
    # training workdir" and the output a folder named '~' in the current directory.
    os.symlink(reference[1], tmp_path / "run")
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu", "HOME": str(tmp_path)}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "transformer_jax.training.average",
            "--workdir=~/run",
            "--last=3",
            "--output=~/avg3",
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # one line out, the output's path; the checkpoint library's INFO logs (~90 lines) only with
    # --verbosity, and no "read only" notice for the workdir opened read-only on purpose
    assert out.stdout.strip() == str(tmp_path / "avg3") and out.stderr.strip() == "", out.stderr[-3000:]
    assert restore_for_inference(str(tmp_path / "avg3")).step == 20


def flip_byte(path, at=0.5):
    """Flips the lowest bit of the byte at fraction ``at`` of the file (silent data damage)."""
    with open(path, "rb+") as f:
        f.seek(int(os.path.getsize(path) * at))
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))


def _biggest_params_file(step_dir):
    """The largest file of a checkpoint step's parameters (array data, not metadata)."""
    files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(step_dir, "params")) for f in fs]
    return max(files, key=os.path.getsize)


def _tiny_state(step: int):
    import jax.numpy as jnp

    from transformer_jax.training.state import TrainState

    params = {"w": jnp.full(3, float(step))}
    return TrainState(step=jnp.int32(step), params=params, opt_state={}, rng=jax.random.PRNGKey(0))


def test_steps_are_sealed_while_a_later_save_is_still_writing(tmp_path, monkeypatch):
    """A run whose saves outlast the checkpoint period always has one in progress: sealing waited
    for a moment with none, and could leave every step without its manifest until the run ended."""
    from transformer_jax.training import integrity

    ck = Checkpointer(str(tmp_path), max_to_keep=5)
    ck.save(_tiny_state(1), force=True)
    ck.manager.wait_until_finished()
    ck.save(_tiny_state(2), force=True)
    monkeypatch.setattr(ck.manager, "is_saving_in_progress", lambda: True)
    ck.seal()
    directory = os.path.join(str(tmp_path), "checkpoints")
    assert integrity.verify(directory, 1).status == "ok"  # sealed although step 2 is "writing"
    monkeypatch.undo()
    ck.close()
    assert integrity.verify(directory, 2).status == "ok"


def test_a_save_seals_the_saves_before_it_at_once(tmp_path):
    """orbax commits the earlier saves before it starts a new one: their manifests are written
    then, not at the next step's seal(), so that a process killed while the new save writes (one
    whole training step or more) leaves no older step without its manifest."""
    from transformer_jax.training import integrity

    ck = Checkpointer(str(tmp_path), max_to_keep=5)
    directory = os.path.join(str(tmp_path), "checkpoints")
    ck.save(_tiny_state(1), force=True)
    ck.save(_tiny_state(2), force=True)
    assert integrity.verify(directory, 1).status == "ok"
    ck.save(_tiny_state(3), force=True)
    assert integrity.verify(directory, 2).status == "ok"
    ck.close()
    assert [integrity.verify(directory, step).status for step in (1, 2, 3)] == ["ok"] * 3


def _replicated_state(mesh):
    import jax.numpy as jnp
    import optax

    from transformer_jax.training.state import TrainState

    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    params = {"w": jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32), "b": jnp.ones(32)}
    state = TrainState(step=jnp.int32(7), params=params, opt_state=optax.adam(1e-3).init(params),
                       rng=jax.random.PRNGKey(3))
    return jax.device_put(state, replicated)


def test_a_save_on_cpu_devices_copies_each_replicated_array_once(tmp_path, monkeypatch):
    """orbax's default cuts an array replicated over N devices into N slices, one dispatched op and
    one transfer each (to spread the copies over accelerators); on 8 CPU devices that made a save
    of the tiny config block training ~0.8 s. The checkpointer copies each array from one device,
    and writes the files orbax's default handler writes: a plain orbax manager restores them."""
    from jax._src import array as jax_array

    mesh = jax.make_mesh((8,), ("data",))
    state = _replicated_state(mesh)
    leaves = len(jax.tree.leaves(state))
    copies = []
    start_copy = jax_array.ArrayImpl.copy_to_host_async
    monkeypatch.setattr(jax_array.ArrayImpl, "copy_to_host_async",
                        lambda self: (copies.append(self.shape), start_copy(self))[1])

    def save(checkpointer):
        copies.clear()
        checkpointer.save(state, force=True)
        checkpointer.close()
        return len(copies)

    assert save(Checkpointer(str(tmp_path / "ours"))) <= leaves + 1  # + reading the step number
    default = Checkpointer(str(tmp_path / "default"))
    default.manager.close()
    default.manager = ocp.CheckpointManager(default.directory)  # orbax's own handlers
    assert save(default) > 4 * leaves  # the cost avoided: the two big arrays in 8 slices each

    plain = ocp.CheckpointManager(os.path.join(str(tmp_path / "ours"), "checkpoints"))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    items = plain.restore(7, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract.params)))
    jax.tree.map(np.testing.assert_array_equal, items.params, state.params)
    with open(os.path.join(str(tmp_path / "ours"), "checkpoints", "7", "_CHECKPOINT_METADATA")) as f:
        handlers = json.load(f)["item_handlers"]
    assert handlers == dict.fromkeys(["params", "train"], ocp.StandardCheckpointHandler.typestr())


def test_saves_and_restores_do_not_grow_python_memory_and_give_orbax_the_same_values(tmp_path, monkeypatch):
    """Two tensorstore calls that orbax makes for every save never free the Python objects they
    return: the metrics orbax times each batch of arrays with (~130 objects a call) and each
    array's resolved file spec, `KvStore.Spec.to_json` (~4). A training process grew by
    ~0.13-0.2 MB with each checkpoint. The checkpoint module gives orbax the same values from
    the text forms of both, which are freed."""
    import gc
    import os as _os
    import sys

    import tensorstore as ts
    from orbax.checkpoint._src.serialization import tensorstore_utils
    from orbax.checkpoint._src.serialization.types import IoDirection

    from transformer_jax.training import checkpoint

    ours, to_json = checkpoint.tensorstore_io_bytes, checkpoint.kvstore_spec_to_json
    assert tensorstore_utils.get_tensorstore_raw_bytes is ours and ts.KvStore.Spec.to_json is to_json
    if _os.environ.get("TJ_TEST_LEAKING_TENSORSTORE"):  # the calls orbax made before: this test fails
        monkeypatch.setattr(tensorstore_utils, "get_tensorstore_raw_bytes", ours.orbax_original)
        monkeypatch.setattr(ts.KvStore.Spec, "to_json", to_json.tensorstore_original)
    for spec in ({"driver": "file", "path": str(tmp_path) + "/"}, {"driver": "memory"},
                 {"driver": "gcs", "bucket": "a-bucket", "path": "p/"},
                 {"driver": "ocdbt", "base": "file:///tmp/x/", "config": {"max_decoded_node_bytes": 9}},
                 {"driver": "file", "path": "/tmp/d\u00e9j\u00e0 'vu\"\n/", "file_io_sync": False}):
        spec = ts.KvStore.Spec(spec)
        for defaults in (False, True):
            assert to_json(spec, include_defaults=defaults) == to_json.tensorstore_original(spec, defaults)
    state = _replicated_state(jax.make_mesh((1,), ("data",)))
    ck = Checkpointer(str(tmp_path / "run"), max_to_keep=2)

    def save(first, last):
        for step in range(first, last):
            ck.save(state.replace(step=jax.numpy.int32(step)), force=True)
            ck.seal(block=True)

    save(1, 6)  # orbax's and tensorstore's first-use allocations
    written = ours(IoDirection.WRITE)
    gc.collect()
    blocks = sys.getallocatedblocks()
    save(6, 26)
    gc.collect()
    per_save = (sys.getallocatedblocks() - blocks) / 20
    assert ours(IoDirection.WRITE) > written + 20 * 64 * 32 * 4  # the counter orbax reads moves
    restored = ck.restore(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state))
    np.testing.assert_array_equal(restored.params["w"], state.params["w"])
    ck.close()
    for direction in (IoDirection.WRITE, IoDirection.READ):  # the totals orbax logs are unchanged
        assert ours(direction) == ours.orbax_original(direction) > 0, direction
    assert per_save < 200, per_save  # ~50 here (orbax's caches), ~600 with the leaking calls
    spec = ts.KvStore.Spec({"driver": "file", "path": str(tmp_path) + "/"})

    def calls():
        gc.collect()
        blocks = sys.getallocatedblocks()
        for _ in range(500):
            ours(IoDirection.WRITE)
            spec.to_json()
        gc.collect()
        return sys.getallocatedblocks() - blocks

    calls()
    assert calls() < 200  # nothing kept from a call (~67,000 blocks with the leaking calls)


def test_keep_best_keeps_the_latest_too_and_drops_checkpoints_without_metrics(tmp_path):
    """max_to_keep best by the metric + the latest (what a resume needs, e.g. the one saved at
    preemption); a checkpoint without the metric is kept only while it is the latest."""
    ck = Checkpointer(str(tmp_path), max_to_keep=2, keep_best_metric="eval_loss", async_save=False)
    on_disk = []
    for step, loss in [(100, 3.0), (200, 2.5), (300, 2.6), (400, 2.7), (450, None), (500, 2.4)]:
        ck.save(_tiny_state(step), metrics=None if loss is None else {"eval_loss": loss}, force=True)
        ck.wait()
        assert ck.latest_step() == step  # the step just saved is never deleted
        on_disk.append(ck.all_steps())
    ck.close()
    assert on_disk[3] == [200, 300, 400]  # best two (2.5, 2.6) + the latest (2.7, rising)
    assert on_disk[4] == [200, 300, 450]  # saved at preemption, between evaluations: no metrics
    assert on_disk[5] == [200, 500]  # the one without metrics is gone once it is not the latest


def test_keep_best_by_accuracy_keeps_the_highest(tmp_path):
    """keep_best_mode='auto' (the default) ranks eval_accuracy highest first. The default was
    'min' for every metric: keep_best_metric='eval_accuracy' alone kept the least accurate
    checkpoints. A mode against the metric's direction is a config error."""
    ck = Checkpointer(str(tmp_path), max_to_keep=2, keep_best_metric="eval_accuracy", async_save=False)
    for step, accuracy in [(100, 0.2), (200, 0.5), (300, 0.3), (400, 0.6), (500, 0.1)]:
        ck.save(_tiny_state(step), metrics={"eval_accuracy": accuracy}, force=True)
        ck.wait()
    assert ck.all_steps() == [200, 400, 500]  # best two (0.6, 0.5) + the latest
    ck.close()
    with pytest.raises(ConfigError, match=r"keep_best_mode='min' with keep_best_metric='eval_accuracy' "
                                          r"would keep the worst checkpoints.*use 'max' or 'auto'"):
        Checkpointer(str(tmp_path / "other"), keep_best_metric="eval_accuracy", keep_best_mode="min")
    with pytest.raises(ConfigError, match=r"'auto' cannot tell whether a higher or a lower 'f1'"):
        Checkpointer(str(tmp_path / "other"), keep_best_metric="f1")


def test_keep_best_ranks_by_the_evaluation_of_the_checkpoint_step(data_dir, tmp_path, monkeypatch):
    """A checkpoint saved between evaluations (here at preemption) gets no metrics, not the last
    evaluation's; it is kept while it is the latest, then dropped."""
    from transformer_jax.training import checkpoint as ckpt_lib

    workdir = str(tmp_path / "w")
    config = tiny_config(data_dir, num_train_steps=8, eval_every_steps=4, checkpoint_every_steps=4,
                         keep_best_metric="eval_loss", max_checkpoints_to_keep=1)
    monkeypatch.setattr(ckpt_lib.PreemptionFlag, "reached", lambda self, manager, step: step == 6)
    train_and_evaluate(config, workdir)
    monkeypatch.undo()
    ck = Checkpointer(workdir, read_only=True)
    assert ck.all_steps() == [4, 6]
    assert ck.manager.metrics(6) is None  # not step 4's evaluation
    train_and_evaluate(config, workdir)  # resumes from 6
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        evals = {r["step"]: r["eval_loss"] for r in map(json.loads, f) if "eval_loss" in r}
    ck = Checkpointer(workdir, read_only=True)
    assert 6 not in ck.all_steps() and ck.all_steps()[-1] == 8
    for step in ck.all_steps():
        assert ck.manager.metrics(step)["eval_loss"] == pytest.approx(evals[step])


def test_max_to_keep_keeps_that_many_of_the_newest_steps(tmp_path):
    ck = Checkpointer(str(tmp_path), max_to_keep=2, async_save=False)
    on_disk = []
    for step in (1, 2, 3, 4):
        ck.save(_tiny_state(step), force=True)
        ck.wait()
        on_disk.append(ck.all_steps())
    ck.close()
    assert on_disk == [[1], [1, 2], [2, 3], [3, 4]]
    assert Checkpointer(str(tmp_path), read_only=True).all_steps() == [3, 4]
