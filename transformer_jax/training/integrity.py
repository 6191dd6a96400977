"""Checkpoint integrity: a manifest per step, verified before anything is restored.

orbax writes a step into ``<step>.orbax-checkpoint-tmp-*`` and renames it when every file is
written, so a process killed mid-save leaves a temporary directory, never a half-written step.
That guards against a crash, not against what happens to the files afterwards (a copy cut short,
a flipped bit, a deleted file, a step directory copied in from another run). So once a save is
committed we write ``<step>/integrity.json``: the size and SHA-256 of every file in the step
directory plus the ``ModelConfig`` the step was written for. Before a restore we check it:

* ``ok``        every file present with the recorded size and hash, same model config;
* ``unsealed``  no manifest: the process stopped between orbax's commit and our manifest (a few
  milliseconds: the training loop's checkpointer seals each save as soon as orbax has committed
  it), or the manifest was lost. orbax's own commit is the guarantee; the restore itself is the
  check (it catches a file cut short, not a changed byte), with a warning that the files went
  unchecked, and the model config is checked against the workdir's ``config.json`` instead;
* ``corrupt``   a file missing, cut short or changed: never restored. The loop falls back to the
  previous good step with a warning (``config.checkpoint_fallback=True``, the default) or stops
  with a message saying how to proceed;
* a different model config raises :class:`CheckpointConfigMismatchError` naming the fields.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import inspect
import json
import os
import re
import socket
import sys
import time
import types

from transformer_jax.config import PACKED_ORDER, ConfigError, ModelConfig, first_line
from transformer_jax.data.errors import DataError

MANIFEST_NAME = "integrity.json"
CONFIG_FILENAME = "config.json"  # the workdir's resolved config (written by checkpoint.save_config)
FORMAT = 1
_CHUNK = 1 << 20


class CheckpointCorruptError(ValueError):
    """A checkpoint step whose files do not match its integrity manifest (or cannot be read)."""


class CheckpointConfigMismatchError(ValueError):
    """A checkpoint step written for another ``ModelConfig``."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, read-only or missing directory)."""


@dataclasses.dataclass
class Verdict:
    step: int
    status: str  # 'ok' | 'unsealed' | 'corrupt'
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def usable(self) -> bool:
        return self.status != "corrupt"

    def describe(self) -> str:
        return "; ".join(self.problems) if self.problems else self.status


def is_local(directory: str) -> bool:
    """Manifests are written and checked for local (POSIX) paths; gs:// etc. rely on orbax alone."""
    return "://" not in str(directory)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(step_dir: str) -> list[str]:
    """The files of a step that its manifest covers. Hidden files are not among them: orbax writes
    none and reads none, and the ones that appear (a file browser's .DS_Store, an NFS client's
    .nfsXXXX for a file still open) made an intact step "corrupt", moved aside and trained again."""
    out = []
    for root, dirs, names in os.walk(step_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            rel = os.path.relpath(os.path.join(root, name), step_dir)
            if rel != MANIFEST_NAME and not rel.endswith(".tmp") and not name.startswith("."):
                out.append(rel)
    return out


# orbax's JSON files in a step: its metadata, each item's tree and sharding, the arrays' metadata,
# and the input pipeline's position.
_JSON_NAMES = ("_CHECKPOINT_METADATA", "_METADATA", "_sharding")


def _unparsable_metadata(step_dir: str) -> list[str]:
    """The JSON files of a step without a manifest that do not parse (cut short). orbax restores
    such a step where the file is one it can do without (``_sharding``, ``_CHECKPOINT_METADATA``,
    with a log line at most), and the restore then sealed the step with the damaged file in it."""
    problems = []
    for rel in _files(step_dir):
        name = os.path.basename(rel)
        in_array_metadatas = os.path.basename(os.path.dirname(rel)) == "array_metadatas"
        if name in _JSON_NAMES or name.endswith(".json") or in_array_metadatas:
            try:
                with open(os.path.join(step_dir, rel), "rb") as f:
                    json.loads(f.read())
            except (OSError, ValueError) as e:
                problems.append(f"{rel} is not valid JSON (cut short or damaged: {first_line(e)})")
    return problems


def step_dir(directory: str, step: int) -> str:
    return os.path.join(str(directory), str(step))


def write_manifest(directory: str, step: int, model_config: ModelConfig | None) -> str:
    """Hashes every file of a committed step into ``<step>/integrity.json`` (atomic rename)."""
    path = step_dir(directory, step)
    files = {
        rel: {"size": os.path.getsize(os.path.join(path, rel)), "sha256": _sha256(os.path.join(path, rel))}
        for rel in _files(path)
    }
    manifest = {
        "format": FORMAT,
        "step": step,
        "written": time.time(),
        "model_config": model_config.to_dict() if model_config is not None else None,
        "packed_order": PACKED_ORDER,
        "files": files,
    }
    manifest[SELF_HASH] = _manifest_hash(manifest)
    target = os.path.join(path, MANIFEST_NAME)
    write_atomically(target, lambda f: json.dump(manifest, f, indent=1, sort_keys=True), sync=True)
    return target


def write_atomically(path: str, write, sync: bool = False) -> None:
    """``write(f)`` into ``path + '.tmp'``, then renamed over ``path``. A failed write (a full disk)
    removes the .tmp file before its error goes on, so it takes no space and no reader sees it."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            write(f)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


# The manifest's own SHA-256 (of its canonical JSON without this key): a changed byte in its model
# config, still valid JSON, read as "written for another model", with advice that could not work and no
# fallback to the older steps. Manifests written before it have none and are read as they are.
SELF_HASH = "manifest_sha256"


def _manifest_hash(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != SELF_HASH}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def read_manifest(directory: str, step: int) -> dict | None:
    path = os.path.join(step_dir(directory, step), MANIFEST_NAME)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            raise ValueError("not a manifest")
        for rel, entry in manifest["files"].items():
            if (not isinstance(entry, dict) or not isinstance(entry.get("size"), int)
                    or not isinstance(entry.get("sha256"), str)):
                raise ValueError(f"its entry for {rel} has no size and SHA-256")
        if SELF_HASH in manifest and manifest[SELF_HASH] != _manifest_hash(manifest):
            raise ValueError("it has changed since it was written: its own SHA-256 differs")
        return manifest
    except (OSError, ValueError) as e:
        return {"unreadable": f"{MANIFEST_NAME} is unreadable ({e})"}


def check_model_config(directory: str, step: int, manifest: dict | None, model_config: ModelConfig) -> None:
    """Raises :class:`CheckpointConfigMismatchError` naming each field that differs."""
    if not manifest or not manifest.get("model_config"):
        return
    where = os.path.join(step_dir(directory, step), MANIFEST_NAME)
    try:
        saved = ModelConfig.from_dict(manifest["model_config"])
    except (TypeError, ValueError) as e:
        raise CheckpointConfigMismatchError(
            f"Checkpoint step {step} in {directory} records a model config this version cannot read ({e})."
        ) from e
    if saved.kernel_layout == "packed" and manifest.get("packed_order") != PACKED_ORDER:
        raise CheckpointConfigMismatchError(
            f"Checkpoint step {step} in {directory} stores its kernels packed (kernel_layout='packed') "
            f"in the order of an earlier version ({where} records packed_order="
            f"{manifest.get('packed_order', 1)}; this version reads order {PACKED_ORDER}, groups of "
            "three tiles interleaved): its values would be read in the wrong places. Restore it "
            "with the version that wrote it, convert its params there to kernel_layout='out_in' "
            "(tj.params.convert_params), and load those here.")
    _compare(directory, step, saved, model_config, f"recorded in {where}")


def _compare(directory: str, step: int, saved: ModelConfig, model_config: ModelConfig, where: str) -> None:
    from transformer_jax.params import PARAMETER_FREE_FIELDS

    # Fields that change how the same parameters are computed with, not what they are (compute dtype,
    # dropout, attention backend, rematerialisation) may change on resume.
    diff = {k: v for k, v in saved.diff(model_config).items() if k not in PARAMETER_FREE_FIELDS}
    if diff:
        fields = ", ".join(
            f"{k}={a!r} in the checkpoint but {b!r} in config.model" for k, (a, b) in diff.items()
        )
        raise CheckpointConfigMismatchError(
            f"Checkpoint step {step} in {directory} was written for another model: {fields}. "
            "Train in a fresh --workdir, or set config.model back to the checkpoint's values "
            f"({where})."
        )


def check_unsealed_against_workdir(directory: str, step: int, model_config: ModelConfig) -> None:
    """A step without a manifest (its run was killed between orbax's commit and the manifest) records
    no model config; the workdir's ``config.json`` does: a fresh run writes it at its start and a
    resumed one once it has committed a step, so it names the model of the run that wrote the
    newest steps. Same shapes with another
    activation or norm placement would otherwise restore without a word (and be sealed as this model),
    and other shapes would be declared corrupt and set aside. An unreadable or absent file leaves the
    check to the restore, as before."""
    path = os.path.join(os.path.dirname(os.path.abspath(directory)), CONFIG_FILENAME)
    try:
        with open(path, encoding="utf-8") as f:
            model = json.load(f).get("model")
        saved = ModelConfig.from_dict(dict(model))
    except (OSError, ValueError, TypeError, AttributeError):
        return
    _compare(directory, step, saved, model_config,
             f"step {step} has no manifest; the model of the run that wrote it is recorded in {path}")


def check_newest_step_model(directory: str, model_config: ModelConfig) -> None:
    """The model check `verify` makes of the newest step, made before the datasets are built: a
    resume with another model was refused only once the data were prepared (minutes for WMT). A
    step whose manifest cannot be read is left to the restore, which falls back past it."""
    if not os.path.isdir(directory):
        return
    steps = sorted((int(n) for n in os.listdir(directory) if n.isdigit() and str(int(n)) == n
                    and os.path.isdir(os.path.join(directory, n))), reverse=True)
    if not steps:
        return
    ours = [s for s in steps if {"params", MANIFEST_NAME} & set(os.listdir(step_dir(directory, s)))]
    if not ours:  # every step this project writes holds params/ (a damaged one may have lost it)
        items = sorted(os.listdir(step_dir(directory, steps[0])))
        raise CheckpointConfigMismatchError(
            f"{directory} holds checkpoints this project did not write: no step has params/ or "
            f"{MANIFEST_NAME} (step {steps[0]} holds {items[:6]}). Choose another --workdir (or convert "
            f"those parameters and load them with tj.params).")
    manifest = read_manifest(directory, steps[0])
    if manifest is None:
        check_unsealed_against_workdir(directory, steps[0], model_config)
    elif "unreadable" not in manifest:
        check_model_config(directory, steps[0], manifest, model_config)


def verify(directory: str, step: int, model_config: ModelConfig | None = None) -> Verdict:
    """Checks a step against its manifest; raises :class:`CheckpointConfigMismatchError` on another model."""
    path = step_dir(directory, step)
    if not os.path.isdir(path):
        return Verdict(step, "corrupt", [f"{path} is missing"])
    manifest = read_manifest(directory, step)
    if manifest is None:
        if model_config is not None:
            check_unsealed_against_workdir(directory, step, model_config)
        problems = _unparsable_metadata(path)
        return Verdict(step, "corrupt", problems) if problems else Verdict(step, "unsealed")
    if "unreadable" in manifest:
        return Verdict(step, "corrupt", [manifest["unreadable"]])
    if model_config is not None:
        check_model_config(directory, step, manifest, model_config)
    problems = []
    if "step" in manifest and manifest["step"] != step:
        # A step directory copied in under another number: it would resume (and be averaged or
        # decoded) as this step, and the real one would never be written, the number being taken.
        problems.append(f"{MANIFEST_NAME} records step {manifest['step']}, not {step} (a step copied in "
                        "under another number)")
    expected = manifest["files"]
    present = set(_files(path))
    for rel in sorted(set(expected) - present):
        problems.append(f"{rel} is missing")
    for rel in sorted(present - set(expected)):
        problems.append(f"{rel} is not in the manifest")
    for rel in sorted(set(expected) & present):
        full = os.path.join(path, rel)
        size = os.path.getsize(full)
        if size != expected[rel]["size"]:
            problems.append(f"{rel} has {size} bytes, expected {expected[rel]['size']} (cut short or grown)")
        elif _sha256(full) != expected[rel]["sha256"]:
            problems.append(f"{rel} has changed (SHA-256 differs from the manifest)")
    return Verdict(step, "corrupt" if problems else "ok", problems)


def move_aside(directory: str, step: int) -> str:
    """Renames a corrupt step out of orbax's directory (kept for inspection), so the step can be
    written again; returns the new path."""
    aside = os.path.join(os.path.dirname(os.path.abspath(directory)), "checkpoints_corrupt")
    os.makedirs(aside, exist_ok=True)
    target = os.path.join(aside, f"{step}.{int(time.time())}")
    os.replace(step_dir(directory, step), target)
    return target


def not_a_directory(path: str) -> str | None:
    """What ``path`` is where a directory should be ('is a file', 'is a broken symbolic link to
    X'); None where it is a directory or nothing at all."""
    if os.path.isdir(path) or not os.path.lexists(path):
        return None
    if os.path.islink(path) and not os.path.exists(path):
        return f"is a broken symbolic link to {os.readlink(path)!r}"
    return "is a file, not a directory"


def check_writable(workdir: str) -> None:
    """Creates ``workdir`` and writes a probe file in it and in its checkpoint directory, where
    that exists already (read-only, or another user's): an unwritable workdir is an error at the
    start, not after the first N steps of training."""
    from transformer_jax.training.checkpoint import CHECKPOINT_DIRNAME

    os_error = None
    what = not_a_directory(workdir)
    if what:  # (makedirs said "File exists", read as the workdir not being writable)
        raise CheckpointWriteError(errno.ENOTDIR, f"Workdir {workdir!r} {what}: choose another --workdir")
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        os_error, where = e, workdir
    for directory in ([] if os_error else [workdir, os.path.join(workdir, CHECKPOINT_DIRNAME)]):
        if directory != workdir and not os.path.isdir(directory):
            what = not_a_directory(directory)
            if what:  # orbax failed on it with a traceback from deep inside its path library
                raise CheckpointWriteError(
                    errno.ENOTDIR, f"Checkpoint directory {directory!r} {what}: move it away (or "
                    f"mount what the link points to), or choose another --workdir")
            continue
        probe = os.path.join(directory, f".write_probe.{os.getpid()}")
        try:
            with open(probe, "w") as f:
                f.write("ok")
        except OSError as e:
            os_error, where = e, directory
        finally:  # a full disk lets the file be made and refuses its byte: it went unremoved
            with contextlib.suppress(OSError):
                os.remove(probe)
        if os_error is not None:
            break
    if os_error is not None:
        what = f"Workdir {workdir!r}" if where == workdir else f"Checkpoint directory {where!r}"
        if os_error.errno in (errno.ENOSPC, errno.EDQUOT):
            problem = f"is on a full disk ({os_error.strerror or os_error})"
            fix = "free space or choose another --workdir"
        else:
            problem = f"is not writable ({os_error.strerror or os_error})"
            fix = "choose another --workdir" + ("" if where == workdir else " (or fix its permissions)")
        raise CheckpointWriteError(os_error.errno, f"{what} {problem}; {fix}") from os_error


LOCK_NAME = ".train.lock"


@contextlib.contextmanager
def workdir_lock(workdir: str, primary: bool = True):
    """Holds an exclusive lock on ``DIR/.train.lock`` while a run trains in ``workdir`` (process 0
    of a run takes it; the others share its workdir). A second run started on the same workdir
    would delete the first one's checkpoint in progress and interleave its metrics: it is refused,
    naming the process that holds the lock. The lock goes with the process (an OS file lock), so a
    killed run leaves nothing to clean up. Checks that the workdir is writable first."""
    if not primary:
        yield
        return
    check_writable(workdir)
    path = os.path.join(workdir, LOCK_NAME)
    handle = open(path, "a+")  # noqa: SIM115 (held open for the whole run)
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise ConfigError(
                f"workdir {workdir!r} is in use by another training run ({holder}, holding {path}): "
                f"two runs in one workdir would overwrite each other's checkpoints. Stop it, or "
                f"give this run another --workdir.") from None
        except OSError as e:  # a filesystem without locks (some network mounts): run unguarded
            from absl import logging

            logging.warning("Cannot lock %s (%s): nothing stops a second run in this workdir.", path, e)
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        yield
    finally:
        handle.close()  # releases the lock


def remove_partial_save(directory: str, step: int) -> list[str]:
    """Deletes the temporary directories of a failed save of ``step`` (orbax's
    ``<step>.orbax-checkpoint-tmp-*``; process 0, local paths), so that a full disk gets its space
    back now rather than when the next run starts; returns what was removed."""
    import shutil

    import jax

    if jax.process_index() != 0 or not is_local(directory) or not os.path.isdir(directory):
        return []
    prefix = f"{step}.orbax-checkpoint-tmp"
    removed = []
    for name in sorted(os.listdir(directory)):
        if name.startswith(prefix):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
            removed.append(name)
    return removed


_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")
_OS_ERROR_TEXT = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
                  "Read-only file system": errno.EROFS, "Permission denied": errno.EACCES}


def os_error_of(error: BaseException) -> OSError | None:
    """The file-system error behind a failed checkpoint write, or None for any other failure: an
    OSError as it is; tensorstore's, which orbax raises as a ValueError ('RESOURCE_EXHAUSTED:
    Error writing ... No space left on device [os_error_code=28]'), as the OSError it reports."""
    if isinstance(error, OSError):
        return error
    text = str(error)
    code = _OS_ERROR_CODE.search(text)
    number = int(code.group(1)) if code else next((n for t, n in _OS_ERROR_TEXT.items() if t in text), None)
    if number is None:
        return None
    return OSError(number, first_line(error))


_WRITE_REASONS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
}


def file_write_error(error: OSError, path: str, what: str) -> CheckpointWriteError:
    """A :class:`CheckpointWriteError` for a small file of the workdir (``config.json``, a step's
    manifest) that could not be written (`write_atomically` has removed its temporary file)."""
    reason = _WRITE_REASONS.get(error.errno, str(error))
    return CheckpointWriteError(
        error.errno or errno.EIO,
        f"Could not write {path}: {reason} ({error.strerror or error}). {what} Free space (or fix "
        f"permissions) and rerun the same command to resume.",
    )


def write_error(error: OSError, step: int, directory: str, kept: list[int]) -> CheckpointWriteError:
    """A :class:`CheckpointWriteError` saying what failed and what is still intact; the failed save's
    partial write is deleted first."""
    reason = _WRITE_REASONS.get(error.errno, str(error))
    intact = f"checkpoints {kept} are intact" if kept else "no earlier checkpoint exists"
    try:
        partial = ("The partial write was deleted" if remove_partial_save(directory, step)
                   else "No partial write was left")
    except OSError:
        partial = "The partial write (if any) is not a checkpoint"
    return CheckpointWriteError(
        error.errno or errno.EIO,
        f"Could not write checkpoint step {step} to {directory}: {reason} ({error}). {partial}; "
        f"{intact}. Free space (or fix permissions) and rerun the same command to resume.",
    )


def _is_abandoned_read(unraisable) -> bool:
    """A read that orbax started and gave up on finishing after its event loop was closed.

    When a restore fails part-way (a file cut short), orbax's event loop is closed while
    tensorstore still has reads of the other arrays in flight; as each of them ends, tensorstore's
    own thread posts its result to that closed loop and Python reports an "Exception ignored"
    traceback, ~80 of them for the tiny test model, around the one clear warning. Reads that did
    fail, of the other arrays, are reported as their coroutines (never awaited once the restore
    had failed) are collected, often as the process ends: "Exception ignored in: <coroutine object
    _read_array_index_and_device_put>", 64 of them for the tiny model."""
    if (inspect.iscoroutine(unraisable.object)
            and getattr(unraisable.object, "__name__", "") == "_read_array_index_and_device_put"):
        return True
    tb = unraisable.exc_traceback
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return (unraisable.exc_type is RuntimeError and unraisable.object is None
            and str(unraisable.exc_value) == "Event loop is closed"
            and tb is not None and tb.tb_frame.f_code.co_name == "_check_closed")


def _is_abandoned_read_record(record) -> bool:
    """asyncio's report of a read `_is_abandoned_read` describes (or of a write abandoned as a
    checkpoint write failed), whose task or future nobody awaited once the restore or save had
    failed ("Task exception was never retrieved")."""
    error = record.exc_info[1] if record.exc_info else None
    return (record.getMessage().startswith(("Task exception was never retrieved",
                                            "Future exception was never retrieved"))
            and error is not None and any(text in str(error) for text in (
                "while reading array index", "Error reading", "Error writing")))


def _quiet_abandoned_read_reports() -> None:
    """From the first restore on, for the rest of the process: asyncio's log records and Python's
    'never awaited' warnings of a failed restore's abandoned reads, which may come before the
    failure reaches `quiet_abandoned_reads` (installed once; the unraisable reports are its hook's)."""
    import logging as pylogging
    import warnings

    log = pylogging.getLogger("asyncio")
    if any(getattr(f, "drops_abandoned_reads", False) for f in log.filters):
        return  # (adding a warnings filter again would reset the record of warnings shown)
    log.addFilter(types.SimpleNamespace(filter=lambda record: not _is_abandoned_read_record(record),
                                        drops_abandoned_reads=True))
    warnings.filterwarnings("ignore", category=RuntimeWarning,
                            message="coroutine '_read_array_index_and_device_put' was never awaited")


def _drop_abandoned_reports():
    """Puts in place the hook that drops `_is_abandoned_read`'s reports (and the asyncio records
    and warnings of `_quiet_abandoned_read_reports`): (hook it replaced, hook), or None where one
    is in place already (left by an earlier failure), so failures do not stack hooks."""
    _quiet_abandoned_read_reports()
    previous = sys.unraisablehook
    if getattr(previous, "drops_abandoned_reads", False):
        return None

    def hook(unraisable):
        if not _is_abandoned_read(unraisable):
            previous(unraisable)

    hook.drops_abandoned_reads = True
    sys.unraisablehook = hook
    return previous, hook


@contextlib.contextmanager
def quiet_abandoned_reads():
    """Drops the reports of `_is_abandoned_read` while an orbax restore runs, and, once one has
    failed, for the rest of the process (its abandoned reads end after it has returned; the
    asyncio records and warnings from the first restore on). Every other unraisable exception goes
    to the hook that was installed before (`_drop_abandoned_reports`)."""
    installed = _drop_abandoned_reports()
    if installed is None:
        yield
        return
    previous, hook = installed
    try:
        yield
    except BaseException:
        raise  # the hook stays: the failed restore's reads are still ending
    else:
        if sys.unraisablehook is hook:
            sys.unraisablehook = previous


def quiet_failed_write() -> None:
    """After a checkpoint write failed (a full disk): for the rest of the process, drops the
    reports of tensorstore's abandoned writes, which end on orbax's closed event loop as the
    abandoned reads of `quiet_abandoned_reads` do (~75 "Event loop is closed" tracebacks before
    the one error line, on a real full disk)."""
    _drop_abandoned_reports()


class StepNumberMismatchError(Exception):
    """A restored training state whose own step is not its directory's number: a step copied in
    under another number (treated as a corrupt step)."""


def restore_verified(checkpointer, steps: list[int], fallback: bool, restore_fn, *args, asked: bool = False):
    """Restores the first of ``steps`` (newest first) that verifies and that orbax can read.

    A corrupt step is skipped with a warning when ``fallback`` (and moved to
    ``DIR/checkpoints_corrupt/`` once an older step restored, so that training can write the step
    again), else :class:`CheckpointCorruptError` says how to proceed. Sets
    ``checkpointer.restored_step``.
    """
    from absl import logging

    directory = checkpointer.directory
    if not steps:
        raise ValueError(f"No checkpoint in {directory}.")
    local = is_local(directory)
    bad: list[Verdict] = []
    for i, step in enumerate(steps):
        verdict = verify(directory, step, checkpointer.model_config) if local else Verdict(step, "unsealed")
        if verdict.usable:
            try:
                with quiet_abandoned_reads():
                    state = restore_fn(*args, step)
            except (DataError, CheckpointConfigMismatchError):  # named mismatches: not corruption
                raise
            except Exception as e:  # noqa: BLE001 (any unreadable step is a corrupt step...)
                # ...unless every file matches its manifest
                if verdict.status == "ok" and not isinstance(e, StepNumberMismatchError):
                    raise CheckpointConfigMismatchError(
                        f"Checkpoint step {step} in {directory} is intact (every file matches its "
                        f"manifest), but it could not be restored into what this run builds "
                        f"({first_line(e)}). When training, a tree-structure mismatch means another "
                        f"optimizer state (it follows config.optimizer: name, weight_decay, "
                        f"grad_clip_norm, ...): set those back to the values in the workdir's "
                        f"config.json, or train in a fresh --workdir. The step itself was left as it is."
                    ) from e
                if verdict.status == "unsealed" and "tree structures do not match" in str(e):
                    # Files no manifest vouches for, but a damaged file does not change the tree
                    # its metadata names: another optimizer or model, as for a sealed step, not
                    # damage (the advice was to move the checkpoints away and train from scratch).
                    # (Another model is named by the workdir's config.json where it has one.)
                    which = ("the model (config.model)" if getattr(checkpointer, "read_only", False)
                             else "the optimizer (config.optimizer: name, weight_decay, grad_clip_norm, "
                                  "...) or the model (config.model)")
                    raise CheckpointConfigMismatchError(
                        f"Checkpoint step {step} in {directory} has no {MANIFEST_NAME} (its files went "
                        f"unchecked), and its arrays are another tree than what this run builds "
                        f"({first_line(e)}): it was written for another setting of {which}. Set those "
                        f"back to the values of the run that wrote it (its config.json), or train in a "
                        f"fresh --workdir. The step itself was left as it is."
                    ) from e
                verdict = Verdict(step, "corrupt", [f"orbax could not restore it ({first_line(e)})"])
            else:
                _after_restore(checkpointer, step, verdict, bad)
                return state
        bad.append(verdict)
        older = steps[i + 1 :]
        if asked:  # a step asked for by number: no fallback, whatever the config says
            others = sorted(set(checkpointer.manager.all_steps()) - {step})
            raise CheckpointCorruptError(
                f"Checkpoint step {step} in {directory}, the step asked for, is corrupt: "
                f"{verdict.describe()}. "
                + (f"Ask for another of its steps ({others}), or for none to load the newest good one."
                   if others else "It is the only step.")
            )
        if not fallback:
            hint = (
                f"Set config.checkpoint_fallback=True to resume from the newest good step before it "
                f"(one of {older}), or move {step_dir(directory, step)} away and rerun."
                if older
                else f"Move {step_dir(directory, step)} away (or use a fresh --workdir) and rerun."
            )
            raise CheckpointCorruptError(
                f"Checkpoint step {step} in {directory} is corrupt: {verdict.describe()}. Refusing to load "
                f"it (config.checkpoint_fallback=False). {hint}"
            )
        logging.info(  # for logs kept at INFO; the line below is what a user sees
            "Checkpoint step %d in %s is corrupt: %s. %s",
            step,
            directory,
            verdict.describe(),
            f"Falling back to step {older[0]}." if older else "No older checkpoint left.",
        )
        print(
            f"WARNING: checkpoint step {step} is corrupt ({verdict.describe()}); "
            + (f"trying step {older[0]}." if older else "no older checkpoint."),
            file=sys.stderr,  # stdout carries outputs (`transformer_jax.generate` > out.txt)
            flush=True,
        )
    if getattr(checkpointer, "read_only", False):  # decoding, evaluating: nothing here trains
        advice = (" Its steps were left as they are: restore the workdir from a copy, or point at "
                  "another run's.")
    else:
        advice = f" Move {directory} away (or use a fresh --workdir) to train from scratch."
    raise CheckpointCorruptError(
        f"No usable checkpoint in {directory}: "
        + "; ".join(f"step {v.step}: {v.describe()}" for v in bad)
        + "." + advice
    )


def _after_restore(checkpointer, step: int, verdict: Verdict, bad: list[Verdict]) -> None:
    """Seals a step restored without a manifest; sets corrupt newer steps aside."""
    import jax
    from absl import logging

    checkpointer.restored_step = step
    if not is_local(checkpointer.directory):
        return
    primary = jax.process_index() == 0
    read_only = getattr(checkpointer, "read_only", False)
    if primary and verdict.status == "unsealed":
        # Only a save still being written (the newest step) lacks its manifest legitimately; a
        # manifest deleted or lost in a copy looks the same. Either way no byte was checked.
        seals = not read_only and checkpointer.model_config is not None
        message = (f"checkpoint step {step} has no {MANIFEST_NAME} (the run that wrote it stopped "
                   f"before sealing it, or the file was lost): restored without checking its files"
                   + ("; sealed now as restored." if seals else "."))
        logging.info("%s", message)  # for logs kept at INFO; the line below is what a user sees
        print(f"WARNING: {message}", file=sys.stderr, flush=True)  # stdout carries outputs
        if seals:
            try:
                write_manifest(checkpointer.directory, step, checkpointer.model_config)
            except OSError as e:  # a full disk: the step restored all the same; sealed at a later resume
                logging.warning("could not seal checkpoint step %d now (%s); it stays unsealed", step, e)
    if read_only:
        return
    if not bad:
        return
    if primary:
        for v in bad:
            if os.path.isdir(step_dir(checkpointer.directory, v.step)):
                target = move_aside(checkpointer.directory, v.step)
                logging.warning("Moved corrupt checkpoint step %d to %s", v.step, target)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("transformer_jax_corrupt_steps_moved")
    checkpointer.manager.reload()


def repair_jsonl(path: str) -> bool:
    """Cuts an incomplete last line (a process killed mid-write) so the next record starts on its own
    line; returns True if something was cut."""
    if not os.path.exists(path):
        return False
    with open(path, "rb+") as f:
        data = f.read()
        if not data or data.endswith(b"\n"):
            return False
        f.truncate(data.rfind(b"\n") + 1)
    return True
