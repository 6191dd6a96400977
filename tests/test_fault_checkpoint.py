"""Damaged checkpoints and failing disks: a file cut short, a flipped byte, a missing file, a step
without its manifest, a checkpoint of another model, a full disk and an unwritable workdir are each
caught with a message saying what is wrong and how to proceed; nothing is loaded silently."""

import errno
import gc
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import types

import orbax.checkpoint as ocp
import pytest
from full_disk import full_disk_open
from test_checkpoint import _tiny_state, flip_byte  # a three-number TrainState at a given step

from configs import tiny
from transformer_jax.config import ConfigError
from transformer_jax.training import integrity, restore_for_inference, train_and_evaluate
from transformer_jax.training.checkpoint import Checkpointer

CACHE = os.path.join(tempfile.gettempdir(), "transformer_jax_test_xla_cache")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


def tiny_config(data_dir, **overrides):
    config = tiny.get_config()
    config.dataset.data_dir = data_dir
    config.compilation_cache_dir = CACHE
    config.num_train_steps = 10
    config.log_every_steps = 1
    config.eval_every_steps = 100
    config.checkpoint_every_steps = 5
    config.update(overrides)
    return config


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    """A workdir with checkpoints at steps 5 and 10."""
    workdir = str(tmp_path_factory.mktemp("trained"))
    train_and_evaluate(tiny_config(data_dir), workdir)
    return workdir


@pytest.fixture
def workdir(trained, tmp_path):
    """A fresh copy of ``trained`` to damage."""
    return shutil.copytree(trained, str(tmp_path / "w"))


def ckpt(workdir):
    return os.path.join(workdir, "checkpoints")


def biggest_file(workdir, step, item=""):
    path = os.path.join(integrity.step_dir(ckpt(workdir), step), item)
    files = [os.path.join(r, n) for r, _, ns in os.walk(path) for n in ns if n != integrity.MANIFEST_NAME]
    return max(files, key=os.path.getsize)


def cut_short(path):
    with open(path, "rb+") as f:
        f.truncate(os.path.getsize(path) // 2)


def write(path, text):
    with open(path, "w") as f:
        f.write(text)


def test_complete_checkpoints_verify(trained):
    assert Checkpointer(trained).all_steps() == [5, 10]
    for step in (5, 10):
        verdict = integrity.verify(ckpt(trained), step)
        assert verdict.status == "ok", verdict
        with open(os.path.join(integrity.step_dir(ckpt(trained), step), integrity.MANIFEST_NAME)) as f:
            manifest = json.load(f)
        assert manifest["model_config"]["d_model"] == 32 and len(manifest["files"]) > 5


def test_a_training_workdir_holds_no_pickles(trained):
    """Everything a run writes (checkpoints with the optimizer and data-iterator state, manifests,
    config, tokenizer, metrics, TensorBoard events) loads without unpickling: no file starts with a
    pickle's protocol marker or is named as one."""
    seen = 0
    for root, _, names in os.walk(trained):
        for name in names:
            seen += 1
            assert not name.endswith((".pkl", ".pickle")), name
            with open(os.path.join(root, name), "rb") as f:
                assert not f.read(2).startswith(b"\x80"), os.path.join(root, name)  # protocol 2+
    assert seen > 20 and os.path.isdir(os.path.join(trained, "checkpoints", "10", "data"))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda w: cut_short(biggest_file(w, 10)), "cut short"),
        (lambda w: flip_byte(biggest_file(w, 10)), "has changed"),
        (lambda w: os.remove(biggest_file(w, 10)), "is missing"),
        (lambda w: write(os.path.join(ckpt(w), "10", integrity.MANIFEST_NAME), "{"), "unreadable"),
        (lambda w: _copy_step(w, 5, 10), "records step 5, not 10"),
        # a changed byte in the manifest, still valid JSON: it read as a checkpoint of another model
        # (d_model=36), refused with no fallback and advice to set config.model to what it never was
        (lambda w: _edit_manifest(w, 10, '"d_model": 32', '"d_model": 36'), "its own SHA-256 differs"),
    ],
    ids=["truncated", "flipped_byte", "missing_file", "bad_manifest", "copied_step", "edited_manifest"],
)
def test_damage_is_detected_and_inference_falls_back(workdir, damage, message, capsys, caplog):
    damage(workdir)
    verdict = integrity.verify(ckpt(workdir), 10)
    assert verdict.status == "corrupt" and message in verdict.describe(), verdict
    with caplog.at_level(logging.INFO, logger="absl"):  # absl's own level may be WARNING (train.py's)
        bundle = restore_for_inference(workdir)  # newest *good* step, with a warning
    assert bundle.step == 5
    # One line on stderr (stdout carries outputs); the log record, which the command lines printed
    # as a second warning of the same thing, is at INFO, for logs kept at that level.
    assert capsys.readouterr().err.count("step 10 is corrupt") == 1
    records = [r for r in caplog.records if "step 10" in r.getMessage() and "corrupt" in r.getMessage()]
    assert [r.levelno for r in records] == [logging.INFO], records
    # Asked for by number: refused, never loaded; the message named config.checkpoint_fallback=False,
    # a setting never made, and said to rerun, which asked for the same step again.
    with pytest.raises(integrity.CheckpointCorruptError) as refused:
        restore_for_inference(workdir, step=10)
    assert re.search(r"step 10 .*, the step asked for, is corrupt: .*Ask for another of its steps \(\[5\]\)",
                     str(refused.value)) and "fallback" not in str(refused.value), refused.value


def _edit_manifest(workdir, step, old, new):
    path = os.path.join(ckpt(workdir), str(step), integrity.MANIFEST_NAME)
    with open(path) as f:
        text = f.read()
    assert old in text
    write(path, text.replace(old, new))


def _copy_step(workdir, source, target):
    """Step ``source``'s directory copied in as step ``target`` (from another run, or by hand)."""
    shutil.rmtree(os.path.join(ckpt(workdir), str(target)))
    shutil.copytree(os.path.join(ckpt(workdir), str(source)), os.path.join(ckpt(workdir), str(target)))


@pytest.mark.parametrize("damage", ["copied_step", "no_data_position"])
def test_unsealed_steps_that_are_not_what_they_say_fall_back(workdir, data_dir, capsys, damage):
    """Steps without a manifest: step 5 copied in as step 10 resumed "from 10" with step 5's state,
    and the real step 10 was never written (the number was taken); a step whose input-pipeline
    position file is gone was reported as saved by another number of processes, with no fallback.
    Both are corrupt steps now."""
    if damage == "copied_step":
        _copy_step(workdir, 5, 10)
    else:
        os.remove(os.path.join(ckpt(workdir), "10", "data", "process_0-of-1.json"))
    os.remove(os.path.join(ckpt(workdir), "10", integrity.MANIFEST_NAME))
    final = train_and_evaluate(tiny_config(data_dir, num_train_steps=12), workdir)
    err = capsys.readouterr().err
    assert "checkpoint step 10 is corrupt" in err and "trying step 5" in err, err[-2000:]
    assert final["step"] == 12 and Checkpointer(workdir).all_steps() == [5, 10, 12]
    assert integrity.verify(ckpt(workdir), 10).status == "ok"  # written again, by this run


@pytest.mark.parametrize("keep", ["half", "10 bytes"])
def test_unsealed_damaged_step_is_caught_by_the_restore(workdir, capsys, caplog, monkeypatch, keep):
    """No manifest (killed between orbax's commit and the manifest) and files cut short. The one
    warning is all the user sees: orbax's abandoned reads of the other arrays, which end on a closed
    event loop, printed ~80 "Exception ignored ... Event loop is closed" tracebacks around it; cut
    to 10 bytes, asyncio logged "exception was never retrieved" errors of the reads that failed.
    (Their coroutines' "Exception ignored" reports and "never awaited" warnings, which the same
    change drops, came at the end of a `generate` process on a workdir of train.py's; neither this
    process nor a child one restoring this workdir showed them.)"""
    os.remove(os.path.join(ckpt(workdir), "10", integrity.MANIFEST_NAME))
    assert integrity.verify(ckpt(workdir), 10).status == "unsealed"
    params = os.path.join(ckpt(workdir), "10", "params")
    for root, _, names in os.walk(params):  # every array data file (orbax alone misses some cuts)
        for name in names:
            if os.path.basename(root) == "d":
                if keep == "half":
                    cut_short(os.path.join(root, name))
                else:
                    os.truncate(os.path.join(root, name), 10)
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    assert restore_for_inference(workdir).step == 5
    time.sleep(0.3)  # the abandoned reads end within milliseconds of the failure
    gc.collect()  # and their coroutines, never awaited, report their errors when collected
    assert "orbax could not restore it" in capsys.readouterr().err
    assert [str(u.exc_value) for u in reported] == []
    assert not [r.getMessage() for r in caplog.records if r.name == "asyncio"]
    # Any other unraisable exception still reaches the hook installed before.
    sys.unraisablehook(types.SimpleNamespace(exc_type=ValueError, exc_value=ValueError("x"),
                                             exc_traceback=None, object=None))
    assert [str(u.exc_value) for u in reported] == ["x"]


def test_unsealed_step_with_a_metadata_file_cut_short_is_corrupt_not_sealed(workdir, capsys):
    """orbax restores a step whose _sharding or _CHECKPOINT_METADATA is cut short (it can do
    without them), and the step without a manifest was then sealed as restored, vouching for the
    cut file from then on. Such a step is corrupt: the restore falls back to the step before."""
    step10 = integrity.step_dir(ckpt(workdir), 10)
    os.remove(os.path.join(step10, integrity.MANIFEST_NAME))
    for cut in (os.path.join("data", "process_0-of-1.json"), "_CHECKPOINT_METADATA",
                os.path.join("params", "_sharding")):
        with open(os.path.join(step10, cut), "rb") as f:
            whole = f.read()
        os.truncate(os.path.join(step10, cut), 5)
        verdict = integrity.verify(ckpt(workdir), 10)
        assert verdict.status == "corrupt" and len(verdict.problems) == 1, verdict
        assert verdict.problems[0].startswith(f"{cut} is not valid JSON (cut short or damaged: "), verdict
        if cut != os.path.join("params", "_sharding"):
            with open(os.path.join(step10, cut), "wb") as f:
                f.write(whole)
            assert integrity.verify(ckpt(workdir), 10).status == "unsealed"
    assert restore_for_inference(workdir).step == 5  # the last one cut: restored by orbax before
    assert "params/_sharding is not valid JSON" in capsys.readouterr().err
    assert integrity.read_manifest(ckpt(workdir), 10) is None  # not sealed


def test_failed_restores_leave_one_quieting_hook(monkeypatch):
    reported = []

    def recorder(unraisable):
        reported.append(unraisable)

    monkeypatch.setattr(sys, "unraisablehook", recorder)
    with integrity.quiet_abandoned_reads():  # a restore that succeeds leaves no hook behind
        assert sys.unraisablehook is not recorder
    assert sys.unraisablehook is recorder
    hooks = []
    for _ in range(3):
        with pytest.raises(OSError), integrity.quiet_abandoned_reads():
            raise OSError("a file cut short")
        hooks.append(sys.unraisablehook)
    assert hooks[0] is not recorder and hooks == [hooks[0]] * 3  # one hook, not a chain
    with integrity.quiet_abandoned_reads():
        pass
    assert sys.unraisablehook is hooks[0]  # the left one stays
    sys.unraisablehook(types.SimpleNamespace(exc_type=ValueError, exc_value=ValueError("x"),
                                             exc_traceback=None, object=None))
    assert [str(u.exc_value) for u in reported] == ["x"]


def test_training_falls_back_and_rewrites_the_step(workdir, trained, data_dir, capsys):
    flip_byte(biggest_file(workdir, 10))
    final = train_and_evaluate(tiny_config(data_dir, num_train_steps=12), workdir)
    captured = capsys.readouterr()
    assert "checkpoint step 10 is corrupt" in captured.err and "Resumed from checkpoint 5" in captured.out
    assert final["step"] == 12
    assert os.listdir(os.path.join(workdir, "checkpoints_corrupt"))[0].startswith("10.")  # kept aside
    assert all(integrity.verify(ckpt(workdir), s).status == "ok" for s in Checkpointer(workdir).all_steps())
    assert Checkpointer(workdir).all_steps() == [5, 10, 12]  # step 10 written again, verifiably


def test_training_refuses_without_fallback(workdir, data_dir):
    cut_short(biggest_file(workdir, 10))
    config = tiny_config(data_dir, num_train_steps=12, checkpoint_fallback=False)
    with pytest.raises(integrity.CheckpointCorruptError, match=r"step 10 .*checkpoint_fallback=True.*\[5\]"):
        train_and_evaluate(config, workdir)


def test_every_checkpoint_corrupt_is_an_error(workdir, data_dir):
    """Each reader gets the advice it can follow: a run that only reads the workdir (decoding,
    evaluating) is not told to move its only weights away to train from scratch."""
    for step in (5, 10):
        os.remove(biggest_file(workdir, step))
    with pytest.raises(integrity.CheckpointCorruptError,
                       match=r"No usable checkpoint.*step 5.*left as they are: restore the workdir") as e:
        restore_for_inference(workdir)
    assert "train from scratch" not in str(e.value)
    with pytest.raises(integrity.CheckpointCorruptError, match="No usable checkpoint.*fresh --workdir"):
        train_and_evaluate(tiny_config(data_dir, num_train_steps=12), workdir)


def test_checkpoint_of_another_model_names_the_fields(workdir, data_dir, monkeypatch):
    """... before the datasets are built (it was refused once the data were prepared: minutes for
    WMT)."""
    from transformer_jax.training import loop

    monkeypatch.setattr(loop, "build_datasets", lambda *a: pytest.fail("built the datasets first"))
    config = tiny_config(data_dir, num_train_steps=12)
    config.model.d_ff = 96
    config.model.num_heads = 2
    with pytest.raises(
        integrity.CheckpointConfigMismatchError, match="num_heads=4 .* but 2 .*d_ff=64 .* but 96"
    ) as e:
        train_and_evaluate(config, workdir)
    assert "fresh --workdir" in str(e.value)
    assert integrity.verify(ckpt(workdir), 10).status == "ok"  # nothing was touched
    with open(os.path.join(workdir, "config.json")) as f:  # what generate and averaging read
        assert json.load(f)["model"]["d_ff"] == 64


def test_checkpoints_another_program_wrote_are_named_so_not_corrupt(data_dir, tmp_path, monkeypatch):
    """A flax- or MaxText-style workdir (checkpoints/<step>/items): each step was "corrupt: orbax
    could not restore it (KeyError ...)", once the tokenizer had been trained into that workdir."""
    from transformer_jax.training import loop

    workdir = str(tmp_path / "w")
    os.makedirs(os.path.join(workdir, "checkpoints", "100", "items"))
    write(os.path.join(workdir, "checkpoints", "100", "_CHECKPOINT_METADATA"), "{}")
    monkeypatch.setattr(loop, "build_datasets", lambda *a: pytest.fail("built the datasets first"))
    with pytest.raises(integrity.CheckpointConfigMismatchError,
                       match=r"holds checkpoints this project did not write: no step has params/ .*"
                             r"\['_CHECKPOINT_METADATA', 'items'\]\). Choose another --workdir"):
        train_and_evaluate(tiny_config(data_dir), workdir)
    assert not os.path.exists(os.path.join(workdir, "tokenizer.model"))


@pytest.mark.parametrize("field, value", [("activation", "gelu"), ("d_ff", 96)])
def test_unsealed_checkpoint_of_another_model_is_refused_too(workdir, data_dir, field, value, monkeypatch):
    """Steps killed before their manifest record no model: the workdir's config.json (written by the
    run that saved them) does. Same shapes with another activation restored without a word and were
    then sealed as the new model; other shapes were declared corrupt and set aside."""
    from transformer_jax.training import loop

    for step in (5, 10):
        os.remove(os.path.join(ckpt(workdir), str(step), integrity.MANIFEST_NAME))
    monkeypatch.setattr(loop, "build_datasets", lambda *a: pytest.fail("built the datasets first"))
    config = tiny_config(data_dir, num_train_steps=12)
    assert config.model[field] != value
    config.model[field] = value
    expected = rf"step 10 .*{field}=.* in the checkpoint but {value!r}.*no manifest.*config.json"
    with pytest.raises(integrity.CheckpointConfigMismatchError, match=expected):
        train_and_evaluate(config, workdir)
    assert Checkpointer(workdir).all_steps() == [5, 10]
    assert not os.path.exists(os.path.join(workdir, "checkpoints_corrupt"))
    assert integrity.verify(ckpt(workdir), 10).status == "unsealed"  # not sealed as the new model


def test_resume_may_change_how_the_parameters_are_computed_with(workdir, data_dir):
    """Compute dtype, dropout, the attention backend and rematerialisation leave the parameters as
    they are: a run out of memory may switch on remat and resume (they were refused as another model)."""
    config = tiny_config(data_dir, num_train_steps=12)
    config.model.remat = "full"
    config.model.dtype = "bfloat16"
    config.model.attention_impl = "reference"
    config.model.dropout_rate = 0.2
    assert train_and_evaluate(config, workdir)["step"] == 12


def test_a_second_run_in_a_busy_workdir_is_refused(workdir, data_dir):
    """Two train.py on one workdir: the second's start-up deleted the first's checkpoint in progress
    and their metrics interleaved. The first holds an OS lock on DIR/.train.lock for its whole run."""
    import fcntl

    path = os.path.join(workdir, integrity.LOCK_NAME)
    with open(path, "w") as held:  # (the copied workdir has the lock file of the run that made it)
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("pid 4242 on elsewhere\n")
        held.flush()
        with pytest.raises(ConfigError, match=r"in use by another training run \(pid 4242 on elsewhere"):
            train_and_evaluate(tiny_config(data_dir, num_train_steps=12), workdir)
    # released (as when a run ends or is killed): the next run takes it and says who holds it
    with integrity.workdir_lock(workdir), open(path) as f:
        assert f.read().startswith(f"pid {os.getpid()} on ")


def test_intact_checkpoint_of_another_optimizer_is_a_config_error_not_corruption(workdir, data_dir):
    """Clipping adds state to the optimizer's: orbax cannot restore the saved tree into it. The files
    match their manifests, so this is a setting to put back, not a damaged step (which every step
    was declared before, with the advice to move the checkpoints away)."""
    config = tiny_config(data_dir, num_train_steps=12)
    config.optimizer.grad_clip_norm = 1.0
    with pytest.raises(integrity.CheckpointConfigMismatchError,
                       match=r"step 10 .* is intact .*config.optimizer.*fresh --workdir"):
        train_and_evaluate(config, workdir)
    assert Checkpointer(workdir).all_steps() == [5, 10]
    assert not os.path.exists(os.path.join(workdir, "checkpoints_corrupt"))
    with open(os.path.join(workdir, "config.json")) as f:
        assert json.load(f)["optimizer"]["grad_clip_norm"] == 0.0


def test_switching_keep_best_on_at_a_resume_names_the_steps_it_deletes(workdir, data_dir, capsys):
    """keep_best_metric ranks the steps by the metric orbax stored with them; the steps of a run
    without it have none, and were deleted without a word once the steps outnumbered
    max_checkpoints_to_keep. Switching it off (or changing how many are kept) is named too."""
    config = tiny_config(data_dir, num_train_steps=20, keep_best_metric="eval_loss", eval_every_steps=5,
                         max_checkpoints_to_keep=2)
    train_and_evaluate(config, workdir)
    out = capsys.readouterr().out
    assert "keep_best_metric ('' -> 'eval_loss')" in out and "max_checkpoints_to_keep (5 -> 2)" in out
    assert re.search(r"WARNING: keep_best_metric='eval_loss' .*steps \[5, 10\] were saved without it "
                     r".*deleted as soon as the steps outnumber max_checkpoints_to_keep=2", out), out
    assert Checkpointer(workdir).all_steps() == [15, 20]  # as it warned
    config.num_train_steps = 25
    train_and_evaluate(config, workdir)
    assert "were saved without it" not in capsys.readouterr().out  # every step is ranked


def test_steps_without_the_metric_are_unranked_only_where_steps_are_deleted(tmp_path):
    """With max_checkpoints_to_keep=None every step is kept: no warning that any will go. Only the
    latest without the metric (a save at SIGTERM) is the documented case, no warning either."""
    workdir = str(tmp_path)
    for step in (1, 2):
        _save_tiny(workdir, step)
    assert Checkpointer(workdir, max_to_keep=2, keep_best_metric="eval_loss").unranked_steps() == [1, 2]
    assert Checkpointer(workdir, max_to_keep=None, keep_best_metric="eval_loss").unranked_steps() == []
    assert Checkpointer(workdir, max_to_keep=2).unranked_steps() == []
    ranked = Checkpointer(str(tmp_path / "r"), async_save=False, max_to_keep=2, keep_best_metric="eval_loss")
    ranked.save(_tiny_state(1), metrics={"eval_loss": 1.0})
    ranked.save(_tiny_state(2))  # at SIGTERM, between evaluations
    assert ranked.unranked_steps() == []
    ranked.close()


def test_an_unsealed_step_of_another_optimizer_is_a_config_error_not_corruption(workdir, data_dir):
    """The same with steps killed before their manifests: step 10, then step 5, were called corrupt,
    ending in "No usable checkpoint ... move the checkpoints away to train from scratch"."""
    for step in (5, 10):
        os.remove(os.path.join(integrity.step_dir(ckpt(workdir), step), integrity.MANIFEST_NAME))
    config = tiny_config(data_dir, num_train_steps=12)
    config.optimizer.grad_clip_norm = 1.0
    with pytest.raises(integrity.CheckpointConfigMismatchError,
                       match=r"step 10 .* has no integrity.json .*another tree.*config.optimizer.*fresh "
                             r"--workdir"):
        train_and_evaluate(config, workdir)
    assert Checkpointer(workdir).all_steps() == [5, 10]
    assert not os.path.exists(os.path.join(workdir, "checkpoints_corrupt"))
    # A newest step that lost its params/ and manifest (damage) among the project's own steps is not
    # "another program's": the restore falls back past it, to step 5.
    shutil.rmtree(os.path.join(ckpt(workdir), "10", "params"))
    config.optimizer.grad_clip_norm = 0.0
    assert train_and_evaluate(config, workdir)["step"] == 12


# A full disk as Python reports it, and as tensorstore does (orbax raises its error as a ValueError;
# it was a traceback per array in flight, and the partial write stayed on the full disk).
FULL_DISK = [OSError(errno.ENOSPC, "No space left on device"),
             ValueError("RESOURCE_EXHAUSTED: Error writing \"opt_state.0.mu\" in OCDBT database at local "
                        "file \"/w/checkpoints/15.orbax-checkpoint-tmp/train/d/x\": [RESOURCE_EXHAUSTED: "
                        "Error writing local file ...: No space left on device [os_error_code='28']]")]


@pytest.mark.parametrize("error", FULL_DISK, ids=["OSError", "tensorstore"])
def test_disk_full_mid_save_keeps_earlier_checkpoints(workdir, data_dir, monkeypatch, error):
    real_save = ocp.CheckpointManager.save

    def full_disk(self, step, *args, **kwargs):  # a partial write, then ENOSPC
        partial = os.path.join(str(self.directory), f"{step}.orbax-checkpoint-tmp-1")
        os.makedirs(os.path.join(partial, "params"))
        with open(os.path.join(partial, "params", "data"), "wb") as f:
            f.write(b"\0" * 100)
        raise error

    monkeypatch.setattr(ocp.CheckpointManager, "save", full_disk)
    expected = r"step 15 .*disk is full.*partial write was deleted; checkpoints \[5, 10\] are intact"
    with pytest.raises(integrity.CheckpointWriteError, match=expected):
        train_and_evaluate(tiny_config(data_dir, num_train_steps=15), workdir)
    # deleted at once (it held the space a full disk needs until the next run's start cleaned it)
    assert not [n for n in os.listdir(ckpt(workdir)) if "tmp" in n]
    monkeypatch.setattr(ocp.CheckpointManager, "save", real_save)
    assert all(integrity.verify(ckpt(workdir), s).status == "ok" for s in (5, 10))
    assert restore_for_inference(workdir).step == 10


def test_disk_full_while_logging_is_one_error_naming_the_file(workdir, data_dir, monkeypatch):
    """A full disk hit first by the metrics writer was an OSError traceback from MetricsLogger."""
    from transformer_jax.training import metrics

    real = metrics.EventWriter.scalars

    def full(self, step, values):
        if step == 13:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, step, values)

    monkeypatch.setattr(metrics.EventWriter, "scalars", full)
    with pytest.raises(integrity.CheckpointWriteError,
                       match=r"metrics of step 13 to .*metrics.jsonl .*No space left.*free space and rerun"):
        train_and_evaluate(tiny_config(data_dir, num_train_steps=15), workdir)
    assert integrity.verify(ckpt(workdir), 10).status == "ok"


def fail_commit(monkeypatch, error, step=None):
    """Makes the commit (the rename) of orbax's background write of `step` (None: of every step
    and item) raise `error`."""
    from orbax.checkpoint._src.path import atomicity

    real = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self):
        if step is None or os.path.basename(str(self.get_final())) == str(step):
            raise error
        return await real(self)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", finalize)


def test_async_write_failure_is_reported(workdir, data_dir, monkeypatch):
    """The write fails in orbax's background thread: the error surfaces, earlier steps stay good."""
    fail_commit(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    expected = r"step 15 .*disk is full.*partial write was deleted; checkpoints \[5, 10\] are intact"
    with pytest.raises(integrity.CheckpointWriteError, match=expected):
        train_and_evaluate(tiny_config(data_dir, num_train_steps=15), workdir)
    assert not [n for n in os.listdir(ckpt(workdir)) if "tmp" in n]
    monkeypatch.undo()
    assert all(integrity.verify(ckpt(workdir), s).status == "ok" for s in (5, 10))
    assert restore_for_inference(workdir).step == 10


def test_a_failed_background_write_is_named_by_its_own_step(workdir, data_dir, monkeypatch):
    """orbax raises a background write's error from the next save's call: the error named that
    later step and said no partial write was left, while the failed step's stayed on the disk."""
    fail_commit(monkeypatch, OSError(errno.EACCES, "Permission denied"), step=15)
    # (the workdir holds steps 5 and 10: the run resumes from 10, saves 15, then 20)
    expected = r"step 15 .*permission denied.*partial write was deleted; checkpoints \[5, 10\] are intact"
    with pytest.raises(integrity.CheckpointWriteError, match=expected):
        train_and_evaluate(tiny_config(data_dir, num_train_steps=20), workdir)
    assert not [n for n in os.listdir(ckpt(workdir)) if "tmp" in n]
    monkeypatch.undo()
    assert Checkpointer(workdir).all_steps() == [5, 10] and restore_for_inference(workdir).step == 10


def test_a_failed_background_write_after_a_pruned_step_names_its_own_step(tmp_path, monkeypatch):
    """With max_to_keep=1 orbax prunes step 15 as step 16's save starts; 16's background write then
    fails. The error named the pruned step 15 (and deleted 16's partial write as a later one's)."""
    fail_commit(monkeypatch, OSError(errno.ENOSPC, "No space left on device"), step=16)
    checkpointer = Checkpointer(str(tmp_path), max_to_keep=1)
    checkpointer.save(_tiny_state(15))
    checkpointer.save(_tiny_state(16))
    expected = r"step 16 .*disk is full.*partial write was deleted"
    with pytest.raises(integrity.CheckpointWriteError, match=expected):
        checkpointer.wait()
    assert not [n for n in os.listdir(ckpt(str(tmp_path))) if "tmp" in n]


def test_unwritable_workdir_fails_at_the_start(data_dir, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(integrity.CheckpointWriteError, match="is not writable.*choose another --workdir"):
        train_and_evaluate(tiny_config(data_dir), str(blocker / "run"))
    # the workdir itself a file: "is not writable (File exists)" said what was not the problem
    with pytest.raises(integrity.CheckpointWriteError,
                       match=r"Workdir '.*a_file' is a file, not a directory: choose another --workdir"):
        train_and_evaluate(tiny_config(data_dir), str(blocker))


def test_a_workdir_on_a_full_disk_is_named_so_and_keeps_no_probe_file(tmp_path, monkeypatch):
    """On a full disk the start-up probe file is made and its one byte refused: each failed start
    left an empty .write_probe.PID behind, and the advice was to choose another --workdir only."""
    probe_on_full_disk = full_disk_open(lambda path: ".write_probe." in path)
    monkeypatch.setattr(integrity, "open", probe_on_full_disk, raising=False)
    with pytest.raises(integrity.CheckpointWriteError,
                       match=r"Workdir '.*' is on a full disk \(No space left on device\); free space"):
        integrity.check_writable(str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_an_unwritable_checkpoint_directory_fails_at_the_start(workdir, data_dir, monkeypatch):
    """The workdir writable, its checkpoints/ not (another user's): the start-up probe wrote only
    to the workdir, and the first save then waited 300 s for orbax's background thread."""
    import builtins

    def refusing_open(path, *args, **kwargs):
        if str(path).startswith(ckpt(workdir) + os.sep):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr(integrity, "open", refusing_open, raising=False)
    with pytest.raises(integrity.CheckpointWriteError,
                       match=r"Checkpoint directory .*checkpoints' is not writable \(Permission denied\)"):
        train_and_evaluate(tiny_config(data_dir, num_train_steps=15), workdir)
    monkeypatch.undo()
    assert Checkpointer(workdir).all_steps() == [5, 10]


def test_a_checkpoint_directory_that_turns_read_only_stops_the_next_save_at_once(workdir, data_dir,
                                                                               monkeypatch):
    """A file system remounted read-only mid-run (ext4's errors=remount-ro): orbax failed to make
    the step's directory in its background thread, and the save waited 300 s on a signal, then
    blamed a timeout with errno 5. Now the save names the cause before starting."""
    real_access, real_statvfs = os.access, os.statvfs
    directory = ckpt(workdir)
    saves = []
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: (
        False if str(path) == directory and saves else real_access(path, mode, **kw)))
    monkeypatch.setattr(os, "statvfs", lambda path: (
        types.SimpleNamespace(f_flag=os.ST_RDONLY) if str(path) == directory else real_statvfs(path)))
    real_save = Checkpointer.save

    def save(self, state, *args, **kwargs):
        result = real_save(self, state, *args, **kwargs)
        saves.append(int(state.step))  # read-only from the save after the first
        return result

    monkeypatch.setattr(Checkpointer, "save", save)
    expected = r"step 20 .*the file system is read-only.*checkpoints \[5, 10(, 15)?\] are intact"
    with pytest.raises(integrity.CheckpointWriteError, match=expected):  # before orbax starts the save
        train_and_evaluate(tiny_config(data_dir, num_train_steps=20), workdir)
    monkeypatch.undo()
    assert Checkpointer(workdir).all_steps() == [5, 10, 15]


def test_a_directory_turning_read_only_under_a_save_in_flight_names_that_save(tmp_path, monkeypatch):
    """Remounted read-only while step 10 is written in the background: the next save's check named
    its own step 15, said "No partial write was left" while 10's was, and let orbax's error for 10
    go unheard. Now it waits for the save in flight and names step 10, whose partial write goes."""
    workdir = str(tmp_path)
    checkpointer = Checkpointer(workdir, async_save=False)
    checkpointer.save(_tiny_state(5))
    directory = checkpointer.directory
    partial = os.path.join(directory, "10.orbax-checkpoint-tmp")
    os.makedirs(os.path.join(partial, "params.orbax-checkpoint-tmp"))
    checkpointer._unsealed = [10]  # started, never committed: as orbax leaves a save in flight
    failed = ValueError('PERMISSION_DENIED: Error writing "params/0" in OCDBT database at local file '
                        f'"{partial}/params.orbax-checkpoint-tmp/": Read-only file system '
                        "[os_error_code='30']")
    monkeypatch.setattr(checkpointer.manager, "wait_until_finished", lambda: (_ for _ in ()).throw(failed))
    real_access, real_statvfs = os.access, os.statvfs
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: (
        False if str(path) == directory else real_access(path, mode, **kw)))
    monkeypatch.setattr(os, "statvfs", lambda path: (
        types.SimpleNamespace(f_flag=os.ST_RDONLY) if str(path) == directory else real_statvfs(path)))
    with pytest.raises(integrity.CheckpointWriteError,
                       match=r"step 10 .*the file system is read-only.*The partial write was deleted; "
                             r"checkpoints \[5\] are intact"):
        checkpointer.save(_tiny_state(15))
    monkeypatch.undo()
    assert not os.path.exists(partial) and checkpointer.all_steps() == [5]
    checkpointer.close()


def test_input_pipeline_that_cannot_take_the_saved_position_is_named_not_corrupt(
        workdir, data_dir, capsys):
    """The data iterator's saved position fits only a pipeline of the same shape. A run with
    another dataset.num_workers (0 against > 0: grain stores the two differently), another
    dataset.pack or another process count gets a DataError naming the setting; before, the restore
    failed inside grain, every step was taken for corrupt, and the message said to start from
    scratch."""
    from absl import flags

    from transformer_jax.data import DataError

    parsed = flags.FLAGS.is_parsed()
    flags.FLAGS.mark_as_parsed()  # grain's worker pipeline reads its flags (train.py parses them)
    try:
        config = tiny_config(data_dir, num_train_steps=12)
        config.dataset.num_workers = 1
        with pytest.raises(DataError, match=r"step 10 .*saved with dataset.num_workers = 0"):
            train_and_evaluate(config, workdir)
        # Packing changes the stored position too: named, not blamed on num_workers (it was).
        config = tiny_config(data_dir, num_train_steps=12)
        packed = bool(config.dataset.pack)
        config.dataset.pack = not packed
        with pytest.raises(DataError, match=rf"step 10 .*dataset.pack={packed}, and this run has "
                                            rf"dataset.pack={not packed}.*resume_data_position=False"):
            train_and_evaluate(config, workdir)
    finally:
        if not parsed:  # as it was, for the tests after this one
            flags.FLAGS.unparse_flags()
    from transformer_jax.config import ModelConfig

    for step in (5, 10):  # as two processes would have saved it (one file shown), sealed again
        data = os.path.join(integrity.step_dir(ckpt(workdir), step), "data")
        os.rename(os.path.join(data, "process_0-of-1.json"), os.path.join(data, "process_0-of-2.json"))
        model = ModelConfig.from_dict(integrity.read_manifest(ckpt(workdir), step)["model_config"])
        integrity.write_manifest(ckpt(workdir), step, model)
    with pytest.raises(DataError, match=r"step 10 .*for 2 process\(es\) .*this run has 1.*"
                                        r"resume_data_position=False"):
        train_and_evaluate(tiny_config(data_dir, num_train_steps=12), workdir)
    assert not os.path.exists(os.path.join(workdir, "checkpoints_corrupt"))
    final = train_and_evaluate(tiny_config(data_dir, num_train_steps=12, resume_data_position=False), workdir)
    assert final["step"] == 12  # resumed from step 10, the pipeline started afresh
    assert "changed since" not in capsys.readouterr().out
    # Settings that change the batches, with the position restored: resumed, with a warning naming them
    config = tiny_config(data_dir, num_train_steps=12)
    config.dataset.max_source_len, config.dataset.seed = 30, 3
    train_and_evaluate(config, workdir)
    assert re.search(r"WARNING: dataset.max_source_len \(24 -> 30\), dataset.seed \(0 -> 3\) changed "
                     r"since the checkpoints were written: .*config.resume_data_position=False",
                     capsys.readouterr().out)


def test_a_resume_records_its_config_only_once_it_has_saved(workdir, data_dir, capsys):
    """config.json is what a resume compares its batch settings and schedule with: the config of the
    run that wrote the newest checkpoint. A resumed run wrote its own at once, so one that stopped
    before saving (here a non-finite step) hid the change from the next resume, which trained on
    without the warning; a run with nothing to train rewrote it too."""
    def saved_batch_size():
        with open(os.path.join(workdir, "config.json")) as f:
            return json.load(f)["dataset"]["batch_size"]

    before = saved_batch_size()
    config = tiny_config(data_dir, num_train_steps=14, inject_nan_at_step=10)
    config.dataset.batch_size = 2 * before
    with pytest.raises(FloatingPointError, match=r"at step 11\. Last good checkpoint: step 10"):
        train_and_evaluate(config, workdir)
    assert "dataset.batch_size" in capsys.readouterr().out
    assert saved_batch_size() == before  # no checkpoint of this run: the old config stays
    config.num_train_steps = 8  # nothing to train: nothing saved, nothing recorded
    train_and_evaluate(config, workdir)
    assert saved_batch_size() == before
    config.num_train_steps, config.inject_nan_at_step = 14, -1
    train_and_evaluate(config, workdir)
    warning = rf"WARNING: dataset.batch_size \({before} -> {2 * before}\) changed"
    assert re.search(warning, capsys.readouterr().out)
    assert saved_batch_size() == 2 * before  # recorded with the checkpoints this run wrote


def _save_tiny(workdir, step, data_iter=None, model_config=None):
    """A committed, sealed step of a three-number state (no training); returns its directory."""
    ck = Checkpointer(workdir, async_save=False, model_config=model_config)
    ck.save(_tiny_state(step), data_iter, force=True)
    ck.close()
    return integrity.step_dir(ckpt(workdir), step)


def test_the_manifest_covers_every_file_of_a_step_and_nothing_else(tmp_path):
    """Every file, the input pipeline's position (JSON) too: a changed position (valid JSON, so
    orbax reads it) would resume the data order elsewhere without a word. A file that is not the
    step's (copied in from another run) is caught as well."""
    import grain

    iterator = iter(grain.MapDataset.range(10).to_iter_dataset())
    next(iterator), next(iterator)
    workdir = str(tmp_path)
    path = _save_tiny(workdir, 1, iterator)
    on_disk = sorted(os.path.relpath(os.path.join(r, n), path) for r, _, ns in os.walk(path) for n in ns
                     if n != integrity.MANIFEST_NAME)
    position = os.path.join("data", "process_0-of-1.json")
    assert position in on_disk
    assert sorted(integrity.read_manifest(ckpt(workdir), 1)["files"]) == on_disk
    with open(os.path.join(path, position)) as f:
        saved = f.read()
    moved = saved.replace("2", "7")  # grain's next_index, 2 -> 7
    assert moved != saved and json.loads(moved)
    write(os.path.join(path, position), moved)
    verdict = integrity.verify(ckpt(workdir), 1)
    assert verdict.status == "corrupt" and f"{position} has changed" in verdict.describe(), verdict
    write(os.path.join(path, position), saved)
    assert integrity.verify(ckpt(workdir), 1).status == "ok"
    write(os.path.join(path, "params", "stray"), "from another run")
    verdict = integrity.verify(ckpt(workdir), 1)
    assert verdict.status == "corrupt" and verdict.problems == [
        f"{os.path.join('params', 'stray')} is not in the manifest"]
    os.remove(os.path.join(path, "params", "stray"))
    # Hidden files are not the step's: a file browser's .DS_Store or an NFS client's .nfsXXXX (a
    # file still open elsewhere) made this intact step corrupt, moved aside and trained again.
    write(os.path.join(path, ".DS_Store"), "")
    os.makedirs(os.path.join(path, "params", ".snapshot"))
    write(os.path.join(path, "params", ".snapshot", ".nfs0000000012345"), "held open")
    assert integrity.verify(ckpt(workdir), 1).status == "ok"


@pytest.mark.parametrize("manifest", ['{"format": 1, "step": 1}', '{"files": []}', "[]",
                                      '{"files": {"data": {"sha256": "00"}}}', '{"files": {"data": 5}}'])
def test_a_manifest_without_its_file_table_is_unreadable(tmp_path, manifest):
    os.makedirs(os.path.join(tmp_path, "1"))
    write(os.path.join(tmp_path, "1", "data"), "x")
    write(os.path.join(tmp_path, "1", integrity.MANIFEST_NAME), manifest)
    verdict = integrity.verify(str(tmp_path), 1)
    assert verdict.status == "corrupt" and "integrity.json is unreadable" in verdict.describe(), verdict


def test_a_full_disk_while_sealing_a_step_or_recording_the_config_is_one_error(tmp_path, monkeypatch):
    """The disk filling up between orbax's commit of a step and its manifest, or while config.json is
    written, was an OSError traceback with the .tmp file left on the full disk. Each is now a
    CheckpointWriteError naming the file and what is intact, its .tmp removed."""
    import builtins

    from transformer_jax.training import checkpoint as checkpoint_module

    workdir = str(tmp_path)
    ck = Checkpointer(workdir, async_save=False)
    ck.save(_tiny_state(1))
    real_dump = json.dump

    def full_dump(obj, f, **kwargs):
        f.write("{")  # a partial write, then ENOSPC
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(integrity, "json", types.SimpleNamespace(**{**vars(json), "dump": full_dump}))
    expected = (r"Could not write .*/2/integrity.json: the disk is full \(No space left on device\)\. "
                r"Checkpoint step 2 is committed but unsealed .* checkpoints \[1\] are sealed\. Free space")
    with pytest.raises(integrity.CheckpointWriteError, match=expected):
        ck.save(_tiny_state(2))
    assert sorted(os.listdir(integrity.step_dir(ckpt(workdir), 2))) == sorted(
        n for n in os.listdir(integrity.step_dir(ckpt(workdir), 1)) if n != integrity.MANIFEST_NAME)
    monkeypatch.setattr(integrity, "json", types.SimpleNamespace(**{**vars(json), "dump": real_dump}))
    assert integrity.verify(ckpt(workdir), 1).status == "ok"
    assert integrity.verify(ckpt(workdir), 2).status == "unsealed"

    config = tiny.get_config()
    checkpoint_module.save_config(config, workdir)
    with open(os.path.join(workdir, "config.json")) as f:
        recorded = f.read()

    def full_open(path, mode="r", *args, **kwargs):
        f = builtins.open(path, mode, *args, **kwargs)  # noqa: SIM115 (returned open)
        if "w" in mode:
            f.close()
            raise OSError(errno.ENOSPC, "No space left on device")
        return f

    monkeypatch.setattr(integrity, "open", full_open, raising=False)  # (the atomic writes of both)
    config.seed = 7
    with pytest.raises(integrity.CheckpointWriteError,
                       match=r"Could not write .*config.json: the disk is full .*checkpoints are unchanged"):
        checkpoint_module.save_config(config, workdir)
    assert sorted(os.listdir(workdir)) == ["checkpoints", "config.json"]  # no config.json.tmp
    with open(os.path.join(workdir, "config.json")) as f:
        assert f.read() == recorded


@pytest.mark.parametrize("kind", ["file", "broken link"])
def test_a_checkpoint_path_that_is_no_directory_is_named(data_dir, tmp_path, kind):
    """DIR/checkpoints as a file, or a link to a scratch disk that is not mounted: training ended in
    a 111-line traceback from orbax's path library, inference said only that there is no
    checkpoint."""
    workdir = str(tmp_path / "w")
    os.makedirs(workdir)
    path = os.path.join(workdir, "checkpoints")
    if kind == "file":
        write(path, "")
    else:
        os.symlink(str(tmp_path / "unmounted" / "ckpt"), path)
    what = ("is a file, not a directory" if kind == "file"
            else "is a broken symbolic link to '.*unmounted/ckpt'")
    with pytest.raises(integrity.CheckpointWriteError,
                       match=f"Checkpoint directory '.*checkpoints' {what}: move"):
        train_and_evaluate(tiny_config(data_dir), workdir)
    write(os.path.join(workdir, "config.json"), json.dumps(tiny_config(data_dir).to_dict()))
    with pytest.raises(ValueError, match=f"has no checkpoint: .*checkpoints {what}"):
        restore_for_inference(workdir)


def test_a_failed_save_removes_only_its_own_partial_write(tmp_path):
    """Step 1's failed save leaves step 10, 11 and their temporaries alone."""
    names = ["1", "10", "11", "1.orbax-checkpoint-tmp-5", "10.orbax-checkpoint-tmp-2"]
    for name in names:
        os.makedirs(os.path.join(tmp_path, name))
    assert integrity.remove_partial_save(str(tmp_path), 1) == ["1.orbax-checkpoint-tmp-5"]
    assert sorted(os.listdir(tmp_path)) == ["1", "10", "10.orbax-checkpoint-tmp-2", "11"]


def test_a_step_restored_without_its_manifest_is_sealed_for_the_model(tmp_path, capsys, caplog):
    """A step committed by orbax but killed before its manifest is sealed once a run restores it
    (with this run's model config, checked against the workdir's first); a read-only reader
    (inference, averaging) leaves it as it is. Both say that its files went unchecked: a changed
    byte in a step without its manifest (lost in a copy, say) loaded in silence."""
    import numpy as np

    from configs import tiny as tiny_config_module
    from transformer_jax.config import ModelConfig

    model = ModelConfig.from_dict(dict(tiny_config_module.get_config().model))
    workdir = str(tmp_path)
    path = _save_tiny(workdir, 3, model_config=model)
    os.remove(os.path.join(path, integrity.MANIFEST_NAME))
    reader = Checkpointer(workdir, read_only=True, model_config=model)
    with caplog.at_level(logging.INFO, logger="absl"):  # absl's own level may be WARNING (train.py's)
        reader.restore(_tiny_state(0))
    assert reader.restored_step == 3 and integrity.verify(ckpt(workdir), 3).status == "unsealed"
    unchecked = "WARNING: checkpoint step 3 has no integrity.json (the run that wrote it stopped before "
    err = capsys.readouterr().err
    assert f"{unchecked}sealing it, or the file was lost): restored without checking its files.\n" in err
    # said once: the log record (at INFO) was a second warning of it on the command lines
    assert err.count("has no integrity.json") == 1
    assert [r.levelno for r in caplog.records if "has no integrity.json" in r.getMessage()] == [logging.INFO]
    ck = Checkpointer(workdir, model_config=model)
    state = ck.restore(_tiny_state(0))
    ck.close()
    assert "restored without checking its files; sealed now as restored." in capsys.readouterr().err
    np.testing.assert_array_equal(state.params["w"], [3.0, 3.0, 3.0])
    assert integrity.verify(ckpt(workdir), 3, model).status == "ok"
    assert integrity.read_manifest(ckpt(workdir), 3)["model_config"] == model.to_dict()


def test_position_saved_by_another_worker_count_is_an_error(tmp_path):
    """grain stores one state per worker process (each reads its own slice i::num_workers of the
    records): the keys are the same for 2 and 3 workers. Before, a checkpoint saved with
    dataset.num_workers=2 resumed with 3 silently, the first two states restored into workers
    reading other slices and the third starting at the beginning (records seen again)."""
    from transformer_jax.data import DataError
    from transformer_jax.training.checkpoint import _check_data_state

    def position(workers):
        return {"next_index_in_cycle": 0, "next_index_in_datasets": workers, "future_states": {},
                "iterators_in_use_indices": list(range(workers)), "exhausted": [0] * workers,
                "iterators_in_use_states": [{"parent": {"next_index": 7}}] * workers}

    class Pipeline:  # the data iterator of a run with `workers` workers
        def __init__(self, workers):
            self.workers = workers

        def get_state(self):
            return position(self.workers)

    os.makedirs(tmp_path / "data")
    write(str(tmp_path / "data" / "process_0-of-1.json"), json.dumps(position(2)))
    _check_data_state(str(tmp_path), 10, Pipeline(2))  # the same worker count: restored
    with pytest.raises(DataError, match=r"step 10 .*dataset.num_workers=2, and this run has "
                                        r"dataset.num_workers=3.*resume_data_position=False"):
        _check_data_state(str(tmp_path), 10, Pipeline(3))


@pytest.mark.parametrize("layout", ["packed", "out_in"])
def test_packed_kernels_of_the_earlier_order_are_refused(tmp_path, layout):
    """Manifests record the packed order (`PACKED_ORDER`). A step written for kernel_layout='packed'
    before the order changed (no record: order 1) would restore its values in the wrong places, so
    it is refused with a message that says how to bring it over; other layouts never depended on
    it and restore as before."""
    from configs import tiny as tiny_config_module
    from transformer_jax.config import PACKED_ORDER, ModelConfig

    model = ModelConfig.from_dict(dict(tiny_config_module.get_config().model)).replace(kernel_layout=layout)
    workdir = str(tmp_path)
    path = _save_tiny(workdir, 2, model_config=model)
    manifest = integrity.read_manifest(ckpt(workdir), 2)
    assert manifest["packed_order"] == PACKED_ORDER == 2
    assert integrity.verify(ckpt(workdir), 2, model).status == "ok"
    del manifest["packed_order"], manifest[integrity.SELF_HASH]  # as the earlier versions wrote it
    write(os.path.join(path, integrity.MANIFEST_NAME), json.dumps(manifest))
    if layout == "out_in":
        assert integrity.verify(ckpt(workdir), 2, model).status == "ok"
        return
    with pytest.raises(integrity.CheckpointConfigMismatchError,
                       match=r"packed_order=1; this version reads order 2.*convert_params"):
        integrity.verify(ckpt(workdir), 2, model)
