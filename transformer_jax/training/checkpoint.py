"""Checkpoints: orbax ``CheckpointManager`` over ``DIR/checkpoints``, exact resume, inference loading.

Each checkpoint step holds these items, written collectively by every process:

* ``params``  the model parameters (sharded arrays; restored onto any mesh);
* ``train``   ``{'step', 'opt_state', 'rng'}``: the rest of the ``TrainState``;
* ``data``    the grain iterator state (one JSON per process), so the data order resumes exactly;
* ``loss_scale`` ``{'scale', 'good_steps'}``, in runs with dynamic loss scaling only.

``DIR/config.json`` (the resolved config) and ``DIR/tokenizer.model`` sit beside them, so a workdir
is all that ``restore_for_inference`` (and ``python -m transformer_jax.generate``) needs.
Saves are asynchronous: training continues while the previous checkpoint is written.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import errno
import json
import logging as pylogging
import os
import re
import signal
import threading
import types
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from transformer_jax import parallel
from transformer_jax.config import ConfigError, ModelConfig, first_line
from transformer_jax.data import DataError, Tokenizer, checkpoint_args
from transformer_jax.data.tokenizer import METADATA_FILENAME, recorded_model_differs
from transformer_jax.parallel.rules import DEFAULT_RULES, LogicalRules, require_mesh_for, unbox_shapes
from transformer_jax.params import build_model, dummy_inputs
from transformer_jax.training import integrity
from transformer_jax.training.state import LossScale, TrainState

CONFIG_FILENAME = integrity.CONFIG_FILENAME
CHECKPOINT_DIRNAME = "checkpoints"


class _ReadOnlyNotice(pylogging.Filter):
    """Drops orbax's "Given directory is read only" warning: we open managers read-only on purpose
    (inference, averaging), and a user read it as a problem with a writable workdir."""

    def filter(self, record) -> bool:
        return not (record.levelno < pylogging.ERROR and "orbax" in record.pathname
                    and str(record.msg).startswith("Given directory is read only"))


pylogging.getLogger("absl").addFilter(_ReadOnlyNotice())


# Two calls of tensorstore's Python binding (0.1.86 and earlier) never free the Python objects they
# return: `experimental_collect_matching_metrics` (~130 objects a call) and `to_json` (~4 for a
# key-value store's spec). orbax makes both for every save: it times each batch of arrays with
# the first and resolves each array's file spec with the second. A training process grew by
# ~0.13-0.2 MB with every checkpoint of `configs/tiny.py`; the functions below return the same
# values from the text forms of both, which are freed, and `_use_freed_tensorstore_calls` puts
# them in place when this module is imported.

# `tensorstore_kvstore_<driver>_bytes_written 1234` (a label set, if any, before the value)
_IO_BYTES_LINE = re.compile(r"^tensorstore_kvstore_\w+?_bytes_(written|read)(?:\{[^}]*\})? (\S+)$")


def tensorstore_io_bytes(direction=None) -> int:
    """The bytes tensorstore's key-value stores have written (`direction` orbax's
    ``IoDirection.WRITE``, or None) or read (``IoDirection.READ``) in this process: orbax's
    ``get_tensorstore_raw_bytes``, from the metrics' Prometheus text form."""
    import tensorstore as ts

    wanted = "read" if getattr(direction, "value", "write") == "read" else "written"
    total = 0
    for line in ts.experimental_collect_prometheus_format_metrics("/tensorstore/kvstore/"):
        match = _IO_BYTES_LINE.match(line)
        if match and match.group(1) == wanted:
            total += int(float(match.group(2)))
    return total


def kvstore_spec_to_json(spec, include_defaults: bool = False):
    """``tensorstore.KvStore.Spec.to_json``, read back from the spec's repr,
    ``KvStore.Spec({...})``, where that holds no escape (tensorstore's own for anything else:
    defaults included; a non-ASCII path, which the repr spells as escaped UTF-8 bytes)."""
    original = kvstore_spec_to_json.tensorstore_original
    if not include_defaults:
        text = repr(spec)
        if text.startswith("KvStore.Spec(") and text.endswith(")") and "\\" not in text:
            try:
                value = ast.literal_eval(text[len("KvStore.Spec("):-1])
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                value = None
            if isinstance(value, dict):
                return value
    return original(spec, include_defaults=include_defaults)


def _use_freed_tensorstore_calls() -> None:
    """Once: orbax's byte counter reads `tensorstore_io_bytes`, and ``KvStore.Spec.to_json`` is
    `kvstore_spec_to_json` (each left as it is where this orbax or tensorstore lacks what it
    replaces or reads)."""
    try:
        import tensorstore as ts
        from orbax.checkpoint._src.serialization import tensorstore_utils
    except ImportError:
        return
    counter = getattr(tensorstore_utils, "get_tensorstore_raw_bytes", None)
    if (counter is not None and counter is not tensorstore_io_bytes
            and hasattr(ts, "experimental_collect_prometheus_format_metrics")):
        tensorstore_io_bytes.orbax_original = counter  # for the test that the totals agree
        tensorstore_utils.get_tensorstore_raw_bytes = tensorstore_io_bytes
    spec_class = getattr(getattr(ts, "KvStore", None), "Spec", None)
    to_json = getattr(spec_class, "__dict__", {}).get("to_json")
    if to_json is not None and to_json is not kvstore_spec_to_json:
        kvstore_spec_to_json.tensorstore_original = to_json
        with contextlib.suppress(TypeError, AttributeError):  # a tensorstore whose classes are immutable
            spec_class.to_json = kvstore_spec_to_json


_use_freed_tensorstore_calls()


def _item_handler(backend: str) -> ocp.StandardCheckpointHandler:
    """orbax's handler of a ``StandardSave`` item, which on a CPU or GPU backend writes each
    replicated array from one device.

    orbax's default, "replica-parallel", cuts an array replicated over N devices into N slices, one
    from each device's copy, to spread the device-to-host transfers over the devices; it leaves it
    off where JAX_PLATFORMS names a GPU. On a CPU every device's copy is already in host memory and
    each slice is one more dispatched op: ~0.3 ms an array and device, which made each save of a
    tiny model on 8 CPU devices block training for ~0.8 s. It stays on for TPUs. The handler is
    orbax's own class, so a step's metadata names the same handler and any orbax reader restores
    it; where this orbax version lacks the attributes set here, orbax's default handler is used."""
    handler = ocp.StandardCheckpointHandler()
    if backend not in ("cpu", "gpu"):
        return handler
    array_handler = copy.copy(ocp.type_handlers.get_type_handler(jax.Array))
    if not hasattr(handler, "_impl") or not hasattr(array_handler, "_use_replica_parallel"):
        return handler
    array_handler._use_replica_parallel = False
    registry = ocp.type_handlers.create_type_handler_registry(
        *[(ty, array_handler if ty is jax.Array else ocp.type_handlers.get_type_handler(ty))
          for ty in ocp.type_handlers.supported_types()])
    # As StandardCheckpointHandler() builds its PyTree handler, with this registry.
    handler._impl = ocp.PyTreeCheckpointHandler(save_concurrent_gb=96, restore_concurrent_gb=96,
                                                type_handler_registry=registry)
    return handler


def _handler_registry(backend: str):
    """The params, train and loss_scale items go through `_item_handler`; the data item keeps grain's
    own."""
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for item in ("params", "train", "loss_scale"):
        handler = _item_handler(backend)
        registry.add(item, ocp.args.StandardSave, handler)
        registry.add(item, ocp.args.StandardRestore, handler)
    return registry


def _read_only_options() -> ocp.CheckpointManagerOptions:
    """Options for reading checkpoints: nothing is created or saved (set explicitly, so that orbax
    does not warn that it overrides them)."""
    return ocp.CheckpointManagerOptions(read_only=True, save_interval_steps=0, create=False)


def checkpoint_dir(workdir: str) -> str:
    return os.path.join(os.path.abspath(workdir), CHECKPOINT_DIRNAME)


# ------------------------------------------------------------------------------------ config files


def save_config(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Writes ``DIR/config.json`` (process 0 only)."""
    if not parallel.is_primary():
        return
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, CONFIG_FILENAME)
    try:
        text = config.to_json_best_effort(indent=2, sort_keys=True)
        integrity.write_atomically(path, lambda f: f.write(text))
    except OSError as e:  # a full disk: one line, not a traceback, and no .tmp file left
        raise integrity.file_write_error(
            e, path, "The run's config is recorded there (resuming checks against it); the "
                     "checkpoints are unchanged.") from e


def load_config(workdir: str) -> ml_collections.ConfigDict:
    path = os.path.join(workdir, CONFIG_FILENAME)
    if not os.path.exists(path):
        raise ValueError(f"Workdir {workdir!r} has no {CONFIG_FILENAME}; is it a training workdir?")
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); it is the config the workdir was trained "
                         f"with") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return ml_collections.ConfigDict(value)


# ------------------------------------------------------------------------------------ the manager


# Which way is better for the metrics evaluation produces (keep_best_mode='auto').
_BEST_MODES = {"loss": "min", "nll": "min", "perplexity": "min", "accuracy": "max", "bleu": "max"}
KEEP_BEST_MODES = ("auto", "min", "max")


def check_keep_best_mode(mode: str) -> None:
    if mode not in KEEP_BEST_MODES:
        raise ConfigError(f"config.keep_best_mode={mode!r} must be one of {list(KEEP_BEST_MODES)}")


def resolve_keep_best_mode(metric: str, mode: str = "auto") -> str:
    """'min' or 'max' for ranking checkpoints by ``metric``: ``mode`` itself, or for 'auto' the
    direction of a metric named ``*loss``, ``*nll``, ``*perplexity`` (lower is better),
    ``*accuracy`` or ``*bleu`` (higher is better). A ``ConfigError`` names a mode that is none
    of these, an 'auto' for a metric of unknown direction, and a mode against the metric's
    direction (it would keep the worst checkpoints)."""
    check_keep_best_mode(mode)
    known = next((m for suffix, m in _BEST_MODES.items() if metric.endswith(suffix)), None)
    if mode == "auto":
        if known is None:
            raise ConfigError(f"config.keep_best_mode='auto' cannot tell whether a higher or a lower "
                              f"{metric!r} is better; set keep_best_mode to 'min' or 'max'")
        return known
    if known is not None and mode != known:
        better = "lower" if known == "min" else "higher"
        raise ConfigError(
            f"config.keep_best_mode={mode!r} with keep_best_metric={metric!r} would keep the worst "
            f"checkpoints: a {better} {metric} is better; use {known!r} or 'auto'")
    return mode


class Checkpointer:
    """Saves and restores ``TrainState`` + data iterator under ``DIR/checkpoints``.

    ``keep_best_metric`` (e.g. ``'eval_loss'``) keeps the ``max_to_keep`` best checkpoints by that
    eval metric (``keep_best_mode``: 'auto' for the metric's own direction, or 'min' or 'max'; see
    `resolve_keep_best_mode`) and the latest one (the step to resume from,
    e.g. one saved at preemption), instead of the ``max_to_keep`` most recent ones. A checkpoint
    saved without that metric is kept only while it is the latest.

    Every committed step gets an integrity manifest (see ``integrity.py``) for ``model_config``;
    :meth:`restore` verifies it and, with ``fallback``, skips corrupt steps with a warning.
    """

    def __init__(
        self,
        workdir: str,
        max_to_keep: int | None = 3,
        keep_best_metric: str = "",
        keep_best_mode: str = "auto",
        async_save: bool = True,
        read_only: bool = False,
        model_config: ModelConfig | None = None,
        fallback: bool = True,
    ):
        check_keep_best_mode(keep_best_mode)
        # ('min' without a metric: orbax's options take no 'auto', and nothing is ranked)
        keep_best_mode = (resolve_keep_best_mode(keep_best_metric, keep_best_mode) if keep_best_metric
                          else "min")
        self.keep_best_metric, self.max_to_keep = keep_best_metric, max_to_keep
        best_fn = (lambda m: float(m[keep_best_metric])) if keep_best_metric else None
        policy = None
        if best_fn is not None:
            # orbax's BestN alone may delete the step just saved (it ranks below the best N), so a
            # resume would go back to an older step; the latest is always kept as well. BestN's
            # `reverse` sorts worst first for 'min', as orbax's own default policy does.
            best = ocp.checkpoint_managers.BestN(
                get_metric_fn=best_fn,
                reverse=keep_best_mode == "min",
                n=max_to_keep,
                keep_checkpoints_without_metrics=False,
            )
            policy = ocp.checkpoint_managers.AnyPreservationPolicy(
                [ocp.checkpoint_managers.LatestN(1), best]
            )
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if policy is not None else max_to_keep,
            preservation_policy=policy,
            best_fn=best_fn,  # also what makes orbax store the metrics of each step
            best_mode=keep_best_mode,
            enable_async_checkpointing=async_save,
            create=not read_only,
            read_only=read_only,
            cleanup_tmp_directories=not read_only,  # partial saves of a killed run
        )
        self.directory = checkpoint_dir(workdir)
        self._pending_config = None  # see write_config_on_commit
        self.model_config, self.fallback, self.read_only = model_config, fallback, read_only
        self.restored_step: int | None = None
        self._unsealed: list[int] = []  # saved steps still waiting for their manifest
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             handler_registry=_handler_registry(jax.default_backend()))
        if not read_only:
            # orbax removes the partial saves of a killed run in a background thread and only waits
            # for it inside its next save; wait here, so the directory is settled before anything
            # reads or lists it, and a run that ends before its first save leaves no partial write.
            wait = getattr(self.manager, "_maybe_await_cleanup_tmp_directory", None)
            if wait is not None:
                wait()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def unranked_steps(self) -> list[int]:
        """With ``keep_best_metric``: the steps saved without that metric, which are deleted once
        the steps outnumber ``max_to_keep`` (a step without it is kept only while it is the latest);
        a run resumed with keep_best_metric switched on lost all its earlier checkpoints so, without
        a word. [] otherwise, and where only the latest lacks it (a save at SIGTERM, documented)."""
        if not self.keep_best_metric or self.max_to_keep is None:  # None: every step is kept
            return []
        steps = self.all_steps()
        unranked = [s for s in steps if self.keep_best_metric not in (self.manager.metrics(s) or {})]
        return [] if unranked == steps[-1:] else unranked

    def save(
        self, state: TrainState, data_iter=None, metrics: dict | None = None, force: bool = False
    ) -> bool:
        step = int(jax.device_get(state.step))
        if step in self.manager.all_steps():
            return False
        self._check_writable(step)
        items = {
            "params": ocp.args.StandardSave(state.params),
            "train": ocp.args.StandardSave(
                {"step": state.step, "opt_state": state.opt_state, "rng": state.rng}
            ),
        }
        if state.loss_scale is not None:
            items["loss_scale"] = ocp.args.StandardSave(_fields(state.loss_scale))
        if data_iter is not None:
            items["data"] = checkpoint_args(data_iter)
        if self.keep_best_metric and (not metrics or self.keep_best_metric not in metrics):
            metrics = None  # kept as a checkpoint without metrics
        try:
            saved = self.manager.save(step, args=ocp.args.Composite(**items), metrics=metrics, force=force)
        except Exception as e:  # a file-system error, whatever raised it; any other as it is
            failure = self._write_error(e, step)
            if failure is e:
                raise
            raise failure from e
        if saved:
            logging.info("Saving checkpoint %d to %s", step, self.directory)
            # orbax has finished the earlier saves before starting this one: those it no longer
            # lists, it pruned (max_to_keep, keep-best), and no manifest or failure is theirs.
            listed = set(self.manager.all_steps())
            self._unsealed = [s for s in self._unsealed if s in listed] + [step]
            # Those earlier saves are committed now: sealed at once, not at the next step's seal(),
            # so that a process killed while this save writes leaves only this step without its
            # manifest (restored then on orbax's word alone).
            self.seal()
        return saved

    def _check_writable(self, step: int) -> None:
        """A checkpoint directory this process may not write to (remounted read-only mid-run, or
        owned by another user) as a CheckpointWriteError now: orbax fails to create the step's
        directory in a background thread and the save then waited 300 s on a signal that never
        came, ending in a timeout blamed on I/O (errno 5)."""
        if not integrity.is_local(self.directory) or not os.path.isdir(self.directory):
            return
        if os.access(self.directory, os.W_OK | os.X_OK):
            return
        try:
            read_only = bool(os.statvfs(self.directory).f_flag & os.ST_RDONLY)
        except OSError:
            read_only = False
        code = errno.EROFS if read_only else errno.EACCES
        # A save still writing in the background fails there too: that earlier step is the one to
        # name (and its partial write the one to remove), as its own error would, once it has ended.
        integrity.quiet_failed_write()
        self.seal(block=True)
        raise integrity.write_error(OSError(code, os.strerror(code), self.directory), step, self.directory,
                                    self._sealed_steps())

    def _sealed_steps(self) -> list[int]:
        return [s for s in self.all_steps() if s not in self._unsealed]

    def _write_error(self, error: Exception, step: int | None) -> Exception:
        """The error to raise for a save that failed: a file-system failure (a full disk, lost
        permissions) as `integrity.write_error` for the save it belongs to, else `error` itself.
        orbax writes in the background and raises a failed write's error from the next call
        (`save` of a later step, or the wait), so the failed save is the oldest one started here
        that has not committed; the partial writes of those after it are deleted too."""
        cause = integrity.os_error_of(error)
        if cause is None:
            return error
        integrity.quiet_failed_write()
        committed = set(self.manager.all_steps())
        failed = [s for s in self._unsealed if s not in committed]
        failed += [step] if step is not None and step not in failed else []
        if not failed:
            return error
        for later in failed[1:]:
            with contextlib.suppress(OSError):
                integrity.remove_partial_save(self.directory, later)
        return integrity.write_error(cause, failed[0], self.directory, self._sealed_steps())

    def seal(self, block: bool = False) -> None:
        """Writes the integrity manifest of every committed save (cheap to call after each step)."""
        if not self._unsealed:
            return
        if not block and self.manager.is_saving_in_progress():
            # orbax finishes one save before it starts the next: all but the newest are committed.
            # Seal them now; a run whose saves take longer than the checkpoint period left every
            # step unsealed until its end (a killed run: resumed without the model-config check).
            done, self._unsealed = self._unsealed[:-1], self._unsealed[-1:]
            listed = set(self.manager.all_steps())  # orbax drops a step it is deleting from the list
            for step in done:
                if parallel.is_primary() and integrity.is_local(self.directory) and step in listed:
                    with contextlib.suppress(FileNotFoundError):  # deleted meanwhile by the save's pruning
                        self._write_manifest(step)
            if done:
                self._write_pending_config()
            return
        try:
            self.manager.wait_until_finished()
            self.manager.check_for_errors()
        except Exception as e:  # as in save
            failure = self._write_error(e, None)
            if failure is e:
                raise
            raise failure from e
        committed = set(self.manager.all_steps())
        for step in self._unsealed:
            if parallel.is_primary() and integrity.is_local(self.directory) and step in committed:
                self._write_manifest(step)
        if committed.intersection(self._unsealed):
            self._write_pending_config()
        self._unsealed = []

    def _write_manifest(self, step: int) -> None:
        """Seals committed ``step``; a full disk (or lost permissions) is a CheckpointWriteError
        saying that the step is committed but unsealed, and which steps are sealed."""
        try:
            integrity.write_manifest(self.directory, step, self.model_config)
        except FileNotFoundError:
            raise
        except OSError as e:
            manifests = {s: integrity.read_manifest(self.directory, s) for s in self.all_steps() if s != step}
            sealed = [s for s, m in manifests.items() if m is not None and "unreadable" not in m]  # on disk
            path = os.path.join(integrity.step_dir(self.directory, step), integrity.MANIFEST_NAME)
            raise integrity.file_write_error(
                e, path, f"Checkpoint step {step} is committed but unsealed (a resume restores it "
                         f"without checking its files); "
                         + (f"checkpoints {sealed} are sealed." if sealed else "no other checkpoint exists.")
            ) from e

    def write_config_on_commit(self, config: ml_collections.ConfigDict) -> None:
        """Writes ``DIR/config.json`` once this checkpointer has committed a step. A resumed run
        records its config only then: until it has written a checkpoint, the newest steps are the
        previous run's, which the resume checks (`changed_data_settings`, the schedule) compare
        against, so a run that stops before its first save leaves that run's config in place."""
        self._pending_config = config

    def _write_pending_config(self) -> None:
        config, self._pending_config = self._pending_config, None
        if config is not None:
            save_config(config, os.path.dirname(self.directory))

    def restore(self, abstract_state: TrainState, data_iter=None, step: int | None = None):
        """-> TrainState restored onto ``abstract_state``'s shardings (any mesh); ``data_iter``'s
        position is restored in place. Without ``step``, the newest step that verifies."""
        steps, fallback = ([step], False) if step is not None else (self.all_steps()[::-1], self.fallback)
        restore = self._restore_step
        return integrity.restore_verified(self, steps, fallback, restore, abstract_state, data_iter,
                                          asked=step is not None)

    def _restore_step(self, abstract_state: TrainState, data_iter, step: int):
        path = integrity.step_dir(self.directory, step)
        if (integrity.is_local(self.directory) and os.path.isdir(os.path.join(path, "params"))
                and not os.path.isdir(os.path.join(path, "train"))):
            # An average's workdir: orbax's own error read as "another optimizer state".
            raise integrity.CheckpointConfigMismatchError(
                f"Checkpoint step {step} in {self.directory} holds parameters only (an average of "
                f"checkpoints): no optimizer state, step or data position to resume training from. "
                f"Load it with restore_for_inference or `python -m transformer_jax.generate "
                f"--workdir=...`; train in another --workdir.")
        train = {
            "step": abstract_state.step,
            "opt_state": abstract_state.opt_state,
            "rng": abstract_state.rng,
        }
        items = {
            "params": ocp.args.StandardRestore(abstract_state.params),
            "train": ocp.args.StandardRestore(train),
        }
        # A run with dynamic loss scaling resuming from a checkpoint written without it gets
        # loss_scale None here (the loop starts the scale afresh); one without it ignores a saved scale.
        scaler = abstract_state.loss_scale
        if scaler is not None and epath.Path(path, "loss_scale").exists():
            items["loss_scale"] = ocp.args.StandardRestore(_fields(scaler))
        if data_iter is not None:
            _check_data_state(integrity.step_dir(self.directory, step), step, data_iter)
            items["data"] = checkpoint_args(data_iter, restore=True)
        out = self.manager.restore(step, args=ocp.args.Composite(**items))
        saved_step = int(out["train"]["step"])
        if saved_step != step:
            raise integrity.StepNumberMismatchError(
                f"it holds the training state of step {saved_step}, copied in under another number")
        return TrainState(
            step=out["train"]["step"],
            params=out["params"],
            opt_state=out["train"]["opt_state"],
            rng=out["train"]["rng"],
            loss_scale=LossScale(**out["loss_scale"]) if "loss_scale" in items else None,
        )

    def wait(self) -> None:
        self.seal(block=True)

    def close(self) -> None:
        self.seal(block=True)
        self.manager.close()


def _fields(loss_scale: LossScale) -> dict:
    return {"scale": loss_scale.scale, "good_steps": loss_scale.good_steps}


def _check_data_state(step_path: str, step: int, data_iter) -> None:
    """Raises a :class:`DataError` naming the setting when the input pipeline's saved position
    cannot be restored into ``data_iter``: it was saved by another number of processes, or by a
    pipeline of another shape (``dataset.num_workers`` 0 against > 0, which grain stores
    differently), or by another number of workers (restored silently otherwise, at a position
    that is not the saved one). Otherwise the restore would fail inside grain, and the step would
    be taken for a corrupt one."""
    index, count = jax.process_index(), jax.process_count()
    directory = os.path.join(step_path, "data")
    path = os.path.join(directory, f"process_{index}-of-{count}.json")
    if not os.path.isdir(directory):
        return  # not a local directory: orbax reports what it finds
    if not os.path.exists(path):
        saved = sorted(n for n in os.listdir(directory) if n.startswith("process_") and n.endswith(".json"))
        if not saved:
            return  # no process's position at all: a damaged step, which the restore reports as corrupt
        counts = sorted({n.rsplit("-of-", 1)[-1][: -len(".json")] for n in saved})
        raise DataError(
            f"Checkpoint step {step} holds the input pipeline's position for {' or '.join(counts)} "
            f"process(es) ({', '.join(saved)}), and this run has {count}: the data position of one "
            f"process count cannot be restored into another. Resume with the process count that "
            f"saved it, or set config.resume_data_position=False to start the input pipeline afresh.")
    try:
        with open(path) as f:
            saved = json.load(f)
        saved_keys = sorted(saved)
    except (OSError, ValueError, TypeError):
        return  # unreadable: the restore reports it as corrupt
    try:
        wanted = data_iter.get_state()
    except Exception:  # noqa: BLE001 (no state to compare with: the restore itself will tell)
        return
    saved_packs, wanted_packs = _holds_key(saved, "bins"), _holds_key(wanted, "bins")
    if saved_packs != wanted_packs:  # the packer's open rows ("bins") are part of its position
        raise DataError(
            f"Checkpoint step {step} holds the input pipeline's position with dataset.pack="
            f"{saved_packs}, and this run has dataset.pack={wanted_packs}: a packed and an unpacked "
            f"pipeline store their positions differently. Resume with dataset.pack={saved_packs}, "
            f"or set config.resume_data_position=False to start the input pipeline afresh.")
    if isinstance(wanted, dict) and sorted(wanted) != saved_keys:
        workers = any("worker" in k or "iterators_in_use" in k for k in saved_keys)
        raise DataError(
            f"Checkpoint step {step} holds an input pipeline position that this run's pipeline "
            f"cannot take (saved state {saved_keys}, this pipeline's {sorted(wanted)}): it was "
            f"saved with dataset.num_workers {'> 0' if workers else '= 0'}, and grain stores the "
            f"two differently. Resume with that setting of dataset.num_workers, or set "
            f"config.resume_data_position=False to start the input pipeline afresh.")
    # grain interleaves one iterator per worker, each over its own slice (i::num_workers) of the
    # records, and stores one state per worker. Another worker count has the same keys, but grain
    # would restore the first states into workers reading other slices and start the rest from the
    # beginning: a position that is not the saved one (records seen again), with no error.
    saved_workers = saved.get("iterators_in_use_states") if isinstance(saved, dict) else None
    wanted_workers = wanted.get("iterators_in_use_states") if isinstance(wanted, dict) else None
    if (isinstance(saved_workers, list) and isinstance(wanted_workers, list)
            and len(saved_workers) != len(wanted_workers)):
        raise DataError(
            f"Checkpoint step {step} holds the input pipeline's position for "
            f"dataset.num_workers={len(saved_workers)}, and this run has "
            f"dataset.num_workers={len(wanted_workers)}: each worker reads its own slice of the "
            f"records, so the position of one worker count cannot be restored into another. Resume "
            f"with dataset.num_workers={len(saved_workers)}, or set "
            f"config.resume_data_position=False to start the input pipeline afresh.")


def _holds_key(state, key: str) -> bool:
    """Whether a (nested) grain iterator state has ``key`` at any depth."""
    if isinstance(state, dict):
        return key in state or any(_holds_key(v, key) for v in state.values())
    if isinstance(state, list):
        return any(_holds_key(v, key) for v in state)
    return False


# ------------------------------------------------------------------------------------ preemption


class PreemptionFlag:
    """Set by SIGTERM (what schedulers and Cloud TPU maintenance send before killing a job), and in a
    single-process run by the first Ctrl-C (SIGINT) too: both save a checkpoint at the current step
    and stop. A second Ctrl-C interrupts at once, without saving (KeyboardInterrupt).

    The loop polls :meth:`reached`, saves a checkpoint and returns. With one process a Python
    SIGTERM handler sets the flag. With several, the stop must be agreed on: a process that
    stopped alone would wait in the checkpoint's collectives while the others trained on. So the
    signal is left to JAX's preemption notifier (installed by ``jax.distributed.initialize``),
    which tells every process through the coordination service, and orbax's
    ``reached_preemption`` (JAX's preemption sync point) then stops them all at the same step,
    whichever process got the signal. A Python handler would replace the notifier's.
    """

    def __init__(self):
        self._event = threading.Event()
        self._previous = {}
        self.signal_name = None
        # What a first Ctrl-C announces; the loop changes it once training is over.
        self.notice = "saving a checkpoint at the end of this step and stopping"
        if threading.current_thread() is threading.main_thread() and jax.process_count() == 1:
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and self._event.is_set():  # a second Ctrl-C: stop now
            if _redelivered_outside_gc_callback(signum, frame):
                return
            self.restore_handler()
            _drop_interrupt_reports()
            raise KeyboardInterrupt
        self.signal_name = name
        # Set before the notice is written: a second Ctrl-C whose handler ran while the first's
        # was still logging found the flag unset and was taken for a first one (seen 10 ms apart).
        self._event.set()
        logging.warning("%s received: %s.", name, self.notice)
        if signum == signal.SIGINT:
            print(f"\n{name}: {self.notice} (Ctrl-C again to stop without saving).", flush=True)

    def requested(self) -> bool:
        """Whether this process's own handler got a stop signal (never with several processes,
        whose signals go to JAX's notifier: see `reached`)."""
        return self._event.is_set()

    def reached(self, manager: Checkpointer, step: int) -> bool:
        if jax.process_count() > 1:
            try:
                if manager.manager.reached_preemption(step):
                    return True
            except Exception:  # no preemption service configured
                pass
        return self._event.is_set()

    def restore_handler(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.restore_handler()


def _redelivered_outside_gc_callback(signum: int, frame) -> bool:
    """Whether ``frame`` runs inside a garbage-collector callback, in which case the signal is sent
    again 10 ms later and True returned. JAX runs one at every collection, and Python prints an
    exception raised there ("Exception ignored in: <function _xla_gc_callback>") and drops it: a
    Ctrl-C landing there (about one in six, measured on a second Ctrl-C) was lost."""
    import gc

    callbacks = {getattr(callback, "__code__", None) for callback in gc.callbacks}
    while frame is not None:
        if frame.f_code in callbacks:
            threading.Timer(0.01, os.kill, (os.getpid(), signum)).start()
            return True
        frame = frame.f_back
    return False


def interrupt(signum, frame) -> None:
    """A SIGINT handler that raises KeyboardInterrupt as Python's own does, except that one
    arriving inside a garbage-collector callback is delivered again once it has returned (see
    `_redelivered_outside_gc_callback`): ``train.py`` installs it from its start."""
    if not _redelivered_outside_gc_callback(signum, frame):
        raise KeyboardInterrupt


class _NoInterruptReports(pylogging.Filter):
    def filter(self, record: pylogging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], KeyboardInterrupt))


def _drop_interrupt_reports() -> None:
    """orbax logs an error with the KeyboardInterrupt's traceback ("Save Finalize thread failed",
    14 lines) when a second Ctrl-C lands while it waits for a save: the stop's one line is what
    is meant to be seen. Drops such records from every root handler for the rest of the process."""
    for handler in pylogging.getLogger().handlers:
        if not any(isinstance(f, _NoInterruptReports) for f in handler.filters):
            handler.addFilter(_NoInterruptReports())


# ------------------------------------------------------------------------------------ inference


@dataclasses.dataclass
class InferenceBundle:
    model_config: ModelConfig
    params: Any  # plain (unboxed) pytree
    tokenizer: Tokenizer
    config: ml_collections.ConfigDict
    step: int


def abstract_params(model_config: ModelConfig, mesh, rules: LogicalRules = DEFAULT_RULES):
    """Parameter ShapeDtypeStructs carrying their shardings on ``mesh`` (placed by ``rules``)."""
    rules = parallel.check_rules(rules, mesh)
    model = build_model(model_config)
    with parallel.sharding_context(mesh, rules):
        boxed = jax.eval_shape(
            lambda: model.init(jax.random.PRNGKey(0), *dummy_inputs(model_config))["params"]
        )
    shardings = parallel.logical_to_sharding(boxed, mesh, rules)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), unbox_shapes(boxed), shardings
    )


def _restore_params(directory: str, step: int | None, abstract, model_config: ModelConfig | None = None):
    """-> (params, step): ``step``, or the newest step that verifies (see ``integrity.py``)."""
    manager = ocp.CheckpointManager(directory, options=_read_only_options())
    try:
        available = sorted(manager.all_steps())
        if step is not None and step not in available:
            raise ValueError(f"No checkpoint at step {step} in {directory}; it has steps {available}.")
        steps = [step] if step is not None else available[::-1]
        if not steps:
            return None, None
        reader = types.SimpleNamespace(
            directory=directory, model_config=model_config, read_only=True, manager=manager
        )

        def restore(s):
            args = ocp.args.Composite(params=ocp.args.StandardRestore(abstract))
            return manager.restore(s, args=args)["params"]

        try:
            params = integrity.restore_verified(reader, steps, step is None, restore, asked=step is not None)
        except Exception as e:
            # A run training in this workdir prunes old steps. One pruned while it was read failed
            # as if it were corrupt, missing files, or intact but of another optimizer state.
            if not os.path.isdir(integrity.step_dir(directory, steps[0])):
                raise ValueError(
                    f"Checkpoint step {steps[0]} in {directory} was removed while it was being read (a "
                    f"run training in this workdir keeps only its newest checkpoints): read a newer "
                    f"step, or a copy of the workdir") from e
            raise
        return params, reader.restored_step
    finally:
        manager.close()


def _model_config_of(workdir: str, config) -> ModelConfig:
    """The workdir's model config, or a ValueError naming its config.json (a directory that is not
    a training workdir, or a file edited by hand)."""
    try:
        return ModelConfig.from_dict(dict(config.model))
    except (AttributeError, KeyError, TypeError) as e:
        path = os.path.join(workdir, CONFIG_FILENAME)
        if "model_type" in config:  # a Hugging Face checkpoint's config.json
            raise ValueError(f"{path} is a Hugging Face checkpoint's config (model_type="
                             f"{config.get('model_type')!r}), not a training workdir's: load it with "
                             f"--hf_checkpoint={workdir} (tj.load_hf_checkpoint in Python)") from e
        raise ValueError(f"{path} has no readable 'model' section ({type(e).__name__}: {e}); is "
                         f"{workdir} a training workdir?") from e


def restore_for_inference(workdir: str, step: int | None = None, mesh=None,
                          rules: LogicalRules = DEFAULT_RULES) -> InferenceBundle:
    """Loads the model config, params (latest or ``step``), tokenizer and config of a workdir.

    ``mesh`` defaults to all devices with params replicated (``data=-1``); pass an FSDP / tensor
    mesh to shard a large model, and ``rules`` (logical axis rules) for a mesh whose axes are not
    the default rules' ``data`` / ``fsdp`` / ``tensor``.
    """
    require_mesh_for(rules, mesh, "restore_for_inference")
    config = load_config(workdir)
    model_config = _model_config_of(workdir, config)
    mesh = parallel.create_mesh(data=-1) if mesh is None else mesh
    directory = checkpoint_dir(workdir)
    params = None
    if os.path.isdir(directory):
        params, step = _restore_params(directory, step, abstract_params(model_config, mesh, rules),
                                       model_config)
    if params is None:
        what = integrity.not_a_directory(directory)
        raise ValueError(f"Workdir {workdir!r} has no checkpoint: {directory} {what}." if what
                         else f"Workdir {workdir!r} has no checkpoint in {directory}.")
    tokenizer_path = os.path.join(workdir, "tokenizer.model")
    if not os.path.isfile(tokenizer_path):
        raise ValueError(f"Workdir {workdir!r} has no tokenizer.model: its checkpoints decode only with "
                         f"the tokenizer training wrote there; copy it (and tokenizer.json) back from "
                         f"the run's workdir")
    tokenizer = Tokenizer.load(tokenizer_path)
    if tokenizer.vocab_size > model_config.vocab_size:  # another run's: its ids pass the table's end
        raise ValueError(f"{tokenizer_path} has {tokenizer.vocab_size} pieces, more than the model's "
                         f"vocab_size={model_config.vocab_size}: it is not the tokenizer this model was "
                         f"trained with")
    if not os.path.isfile(os.path.join(workdir, METADATA_FILENAME)):
        logging.warning("%s has no %s recording which tokenizer the run trained with: %s is used "
                        "unchecked", workdir, METADATA_FILENAME, tokenizer_path)
    recorded = recorded_model_differs(workdir, tokenizer)
    if recorded:  # another run's of no larger vocabulary: its ids fit, and mean other pieces
        raise ValueError(f"{tokenizer_path} is not the tokenizer recorded in {recorded} (sha256 differs): "
                         f"it is not the tokenizer this model was trained with; put back the run's own")
    return InferenceBundle(model_config, params, tokenizer, config, int(step))


# ------------------------------------------------------------------------------------ averaging


def _check_still_there(directory: str, step: int) -> None:
    if not os.path.isdir(integrity.step_dir(directory, step)):
        raise ValueError(
            f"Checkpoint step {step} in {directory} was removed while it was being read (a run "
            f"training in this workdir keeps only its newest checkpoints): run again, or average a "
            f"copy of the workdir")


def _same_run_file(a: str, b: str) -> bool:
    """Whether two workdir files belong to the same model: tokenizer files byte for byte; of
    ``config.json`` the ``model`` section only (a run resumed with more ``num_train_steps`` rewrites
    the rest, and its later averages still go into the same output)."""
    with open(a, "rb") as f, open(b, "rb") as g:
        x, y = f.read(), g.read()
    if x == y or os.path.basename(a) != CONFIG_FILENAME:
        return x == y
    try:
        return json.loads(x).get("model") == json.loads(y).get("model")
    except (ValueError, AttributeError):
        return False


def _mean_of_sum(total: jax.Array, count: int) -> jax.Array:
    """``total / count`` rounded once, on the host where the array is all here: XLA:CPU divides by
    a scalar as a multiplication by its reciprocal, one unit in the last place off for about one
    value in five (exact only for a power of two)."""
    if not total.is_fully_addressable:
        return total / count
    exact = np.asarray(total) / np.asarray(count, np.asarray(total).dtype)
    return jax.device_put(exact, total.sharding)


def evenly_spaced(steps: Sequence[int], every: int) -> bool:
    """Whether sorted checkpoint ``steps`` are consecutive saves, ``every`` steps apart."""
    return all(b - a == every for a, b in zip(steps, steps[1:]))


def average_checkpoints(workdir: str, last_k: int = 5, output_workdir: str | None = None,
                        mesh=None, rules: LogicalRules = DEFAULT_RULES) -> str:
    """Averages the params of the last ``last_k`` checkpoints (section 6.1: 5 for base, 20 for big).

    The steps are read onto ``mesh``, by default the run's own (``config.mesh`` of the workdir)
    where this machine's devices make it, else all devices with the parameters whole on each: a
    model sharded because it does not fit one device is averaged sharded as it trained. ``rules``
    (logical axis rules) place them on a ``mesh`` of your own.

    Writes a new workdir (default ``DIR/average_last{K}``, K the number of steps averaged, which
    is fewer than ``last_k`` when the workdir holds fewer) with the config, tokenizer and one
    params-only checkpoint at the newest step (an output holding that step, or another run's
    config or tokenizer, is an error: nothing in it is overwritten), loadable by
    ``restore_for_inference`` and ``transformer_jax.generate``. Every step is verified against its
    manifest first; a damaged one is a
    :class:`~transformer_jax.training.integrity.CheckpointCorruptError`. The output step gets
    its own manifest, so that damage to it is caught when it is loaded. Returns its path.
    """
    import shutil

    import jax.numpy as jnp

    if isinstance(last_k, bool) or not isinstance(last_k, int) or last_k < 1:
        raise ValueError(f"last_k={last_k!r} (--last): average at least one checkpoint (an integer >= 1).")
    require_mesh_for(rules, mesh, "average_checkpoints")
    config = load_config(workdir)
    model_config = _model_config_of(workdir, config)
    if mesh is None:
        try:
            mesh = parallel.mesh_from_config(config.get("mesh") or {})
        except (ConfigError, ValueError) as e:  # another machine's mesh: more devices than here
            logging.warning("Averaging with the parameters whole on every device: the run's mesh "
                            "cannot be made here (%s).", first_line(e))
            mesh = parallel.create_mesh(data=-1)
    abstract = abstract_params(model_config, mesh, rules)
    directory = checkpoint_dir(workdir)
    manager = ocp.CheckpointManager(directory, options=_read_only_options())
    try:
        steps = sorted(manager.all_steps())[-last_k:]
        if not steps:
            raise ValueError(f"Workdir {workdir!r} has no checkpoints to average in {directory}.")
        if len(steps) < last_k:
            logging.warning(
                "Only %d checkpoints in %s (asked for %d); averaging them all.", len(steps), workdir, last_k
            )
        every = config.get("checkpoint_every_steps")
        if isinstance(every, int) and not evenly_spaced(steps, every):
            # The paper averages the last saves, one every checkpoint_every_steps; keep_best_metric
            # keeps the best ones, which may lie far apart, and a save at a preemption (step 31
            # after 30) or at a last step off the grid gives its stretch of training double weight.
            logging.warning(
                "The newest %d checkpoints in %s are not consecutive saves (one every %d steps%s): "
                "averaging steps %s.", len(steps), workdir, every,
                f"; keep_best_metric={config.get('keep_best_metric')!r} kept the best ones"
                if config.get("keep_best_metric") else "", steps)
        total = None
        for step in steps:
            # Each step is checked against its manifest first, as every restore is: a damaged one
            # would otherwise be averaged in without a word.
            _check_still_there(directory, step)
            verdict = (integrity.verify(directory, step, model_config) if integrity.is_local(directory)
                       else integrity.Verdict(step, "unsealed"))
            problem = None if verdict.usable else verdict.describe()
            if problem is None:
                try:
                    args = ocp.args.Composite(params=ocp.args.StandardRestore(abstract))
                    with integrity.quiet_abandoned_reads():
                        params = manager.restore(step, args=args)["params"]
                except Exception as e:  # noqa: BLE001 (an unreadable step is a corrupt one)
                    problem = f"orbax could not restore it ({first_line(e)})"
            if problem is not None:
                _check_still_there(directory, step)
                raise integrity.CheckpointCorruptError(
                    f"Checkpoint step {step} in {directory} is corrupt: {problem}. Not averaging it: "
                    f"average fewer of the newest steps (--last), or move "
                    f"{integrity.step_dir(directory, step)} away and rerun.")
            params = jax.tree.map(lambda x: x.astype(jnp.float32), params)
            total = params if total is None else jax.tree.map(jnp.add, total, params)
    finally:
        manager.close()
    average = jax.tree.map(lambda t, a: _mean_of_sum(t, len(steps)).astype(a.dtype), total, abstract)

    output_workdir = output_workdir or os.path.join(workdir, f"average_last{len(steps)}")
    existing = integrity.step_dir(checkpoint_dir(output_workdir), steps[-1])
    # An average stopped after orbax committed its step and before its manifest was written: a
    # rerun writes it again (it was refused as "an earlier average", and loaded unsealed).
    unfinished = (os.path.exists(existing) and integrity.is_local(output_workdir)
                  and not os.path.exists(os.path.join(existing, integrity.MANIFEST_NAME)))
    if os.path.exists(existing) and not unfinished:
        raise ValueError(
            f"{output_workdir} already holds a checkpoint at step {steps[-1]} (an earlier average?): "
            f"remove it, or give another output directory (--output)")
    copied = [n for n in (CONFIG_FILENAME, "tokenizer.model", "tokenizer.json")
              if os.path.exists(os.path.join(workdir, n))]
    for name in copied:
        # An output holding another run's files (an average of another workdir, written to the
        # same --output) would get this run's config and tokenizer over them: its own steps could
        # no longer be loaded. The same files (an earlier average of this workdir) are fine.
        there = os.path.join(output_workdir, name)
        if os.path.exists(there) and not _same_run_file(there, os.path.join(workdir, name)):
            raise ValueError(
                f"{there} differs from {os.path.join(workdir, name)}: {output_workdir} holds another "
                f"run's files, which averaging would overwrite; give another output directory (--output)")
    if parallel.is_primary():
        if unfinished:
            logging.warning("%s holds step %d without its manifest (an average stopped before it was "
                            "sealed): writing it again", output_workdir, steps[-1])
            shutil.rmtree(existing)
        os.makedirs(output_workdir, exist_ok=True)
        for name in copied:  # via a temporary file: a failed copy leaves no half-written file
            tmp = os.path.join(output_workdir, name + ".tmp")
            shutil.copy(os.path.join(workdir, name), tmp)
            os.replace(tmp, os.path.join(output_workdir, name))
    parallel.sync_global("transformer_jax_average_output_ready")  # the unfinished step is gone
    out = ocp.CheckpointManager(
        checkpoint_dir(output_workdir), options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    )
    out.save(steps[-1], args=ocp.args.Composite(params=ocp.args.StandardSave(average)), force=True)
    out.wait_until_finished()
    out.close()
    # Sealed like every training step: without a manifest the average is restored "unsealed", on
    # orbax's word alone, and a flipped byte in its array data loaded as silently changed weights.
    if parallel.is_primary() and integrity.is_local(output_workdir):
        integrity.write_manifest(checkpoint_dir(output_workdir), steps[-1], model_config)
    # No process returns before the manifest is there: one that loaded the average at once would
    # otherwise find it unsealed (restored on orbax's word alone, without the integrity check).
    parallel.sync_global("transformer_jax_average_sealed")
    logging.info("Averaged steps %s of %s into %s", steps, workdir, output_workdir)
    return output_workdir
