"""``train_and_evaluate(config, workdir)``: the training program, in named sections.

setup (config checks, compilation cache, mesh) -> data -> state (fresh or resumed) -> compiled
steps -> the loop (train, log, evaluate, checkpoint, preemption) -> final evaluation.
"""

from __future__ import annotations

import functools
import os
import time

import jax
import ml_collections
import numpy as np

from transformer_jax import parallel
from transformer_jax.config import ConfigError, ModelConfig
from transformer_jax.data import DataError, build_datasets, to_global_batch
from transformer_jax.data.inputs import resolve_test_split
from transformer_jax.data.pipeline import LENGTH_STATS, close_train_iterator
from transformer_jax.params import build_model
from transformer_jax.training import checkpoint as ckpt_lib
from transformer_jax.training import evaluate, integrity, steps
from transformer_jax.training import metrics as metrics_lib
from transformer_jax.training.config_checks import (
    as_run_config,
    check_config,
    fill_section_defaults,
    unread_dataset_settings,
    unread_training_settings,
)
from transformer_jax.training.optimizer import create_optimizer
from transformer_jax.training.schedules import create_schedule
from transformer_jax.training.state import LossScale, count_params, create_train_state, state_shardings


def enable_compilation_cache(path: str = "") -> None:
    """The persistent XLA cache: a second run of the same config skips compilation."""
    default = os.path.join("~", ".cache", "transformer_jax", "xla")
    path = os.path.expanduser(path or default)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def compilation_cache_conflict(platform: str, process_count: int) -> str | None:
    """Why the persistent compilation cache must stay off for this run, or None when it may be on.

    Several processes on CPU: JAX writes cache entries from process 0 only, and an entry is kept per
    device assignment, so each later run finds process 0's programs in the cache and compiles all of
    process 1's. Process 1 then reaches the first cross-process collective the whole compile time
    after process 0, and the CPU collectives (gloo) give that rendezvous 30 s: past it the run fails.
    GPU and TPU collectives wait, so the cache stays on there."""
    if platform == "cpu" and process_count > 1:
        return (f"config.compilation_cache is off for this run: {process_count} CPU processes would "
                "compile unevenly (only process 0 reads its programs from the cache) and could miss "
                "the collectives' 30 s start-up deadline")
    return None


def _say(text: str) -> None:
    if parallel.is_primary():
        print(text, flush=True)


# The dataset settings that decide which rows each training step gets. A resume that restores the
# input position but changes one of them trains on other batches than an uninterrupted run would.
DATA_STREAM_KEYS = (
    "name", "builder_config", "train_files", "source_lang", "target_lang", "reverse", "vocab_size",
    "tokenizer_type", "tokenizer_max_chars", "max_source_len", "max_target_len", "max_len",
    "batch_size", "pack", "pack_bins", "length_policy", "seed",
)


def _saved_and_current(workdir: str, config: ml_collections.ConfigDict) -> tuple[dict, dict] | None:
    """(``DIR/config.json``, the config of the run that wrote the checkpoints, and ``config``) as
    plain dicts with tuples as lists, as config.json has them; None without a readable one."""
    import json

    try:
        saved = ckpt_lib.load_config(workdir)
    except ValueError:
        return None
    return saved.to_dict(), json.loads(config.to_json_best_effort())


def _differences(old: dict, new: dict, keys, prefix: str = "") -> list[str]:
    return [f"{prefix}{key} ({old[key]!r} -> {new[key]!r})" for key in keys
            if key in old and key in new and old[key] != new[key]]


def changed_data_settings(workdir: str, config: ml_collections.ConfigDict) -> list[str]:
    """'dataset.KEY (old -> new)' for each `DATA_STREAM_KEYS` setting that differs from the one in
    ``DIR/config.json``, the config of the run that wrote the checkpoints ([] without one)."""
    configs = _saved_and_current(workdir, config)
    if configs is None or configs[0].get("dataset") is None:
        return []
    old, new = configs
    return _differences(old["dataset"], new["dataset"], DATA_STREAM_KEYS, "dataset.")


def restretched_schedule(workdir: str, config: ml_collections.ConfigDict, step: int) -> str | None:
    """A warning when a resumed cosine schedule that decays over ``num_train_steps`` (no
    ``optimizer.decay_steps``) gets another ``num_train_steps`` than the run that wrote ``workdir``'s
    checkpoints: the whole curve stretches, and the rate at the resumed step jumps (from near its end
    value back up the curve, for a longer run). None where nothing changed."""
    opt = config.optimizer
    if opt.schedule != "cosine" or int(opt.get("decay_steps") or 0):
        return None
    try:
        saved = ckpt_lib.load_config(workdir)
    except ValueError:
        return None
    old_steps = saved.get("num_train_steps") if saved is not None else None
    if not isinstance(old_steps, int) or old_steps == config.num_train_steps:
        return None
    d_model = config.model.d_model
    try:
        was = float(create_schedule(opt, d_model, old_steps)(step))
        now = float(create_schedule(opt, d_model, config.num_train_steps)(step))
    except ConfigError:  # warm-up no shorter than the old length: no cosine curve to compare with
        return None
    return (f"WARNING: num_train_steps changed ({old_steps} -> {config.num_train_steps}) and the cosine "
            f"schedule decays over it (optimizer.decay_steps is 0): the learning rate at step {step} "
            f"goes from {was:.3g} to {now:.3g}, as if the run had been planned this long from the "
            f"start; set --config.optimizer.decay_steps={old_steps} to keep the schedule it trained with")


# Training settings a resumed run may change on purpose (a lower learning rate), but by mistake too
# (a config file edited meanwhile): named at the resume, not refused. (Settings that change the
# optimizer state's structure, clipping or weight decay, are refused by the restore.)
TRAINING_KEYS = ("seed", "loss_scale", "skip_nonfinite", "max_checkpoints_to_keep", "keep_best_metric",
                 "keep_best_mode")


def changed_training_settings(workdir: str, config: ml_collections.ConfigDict) -> list[str]:
    """'KEY (old -> new)' for each optimizer setting (and `TRAINING_KEYS`) that differs from
    ``DIR/config.json``, the config of the run that wrote the checkpoints ([] without one)."""
    configs = _saved_and_current(workdir, config)
    if configs is None:
        return []
    old, new = configs
    optimizer = old.get("optimizer") or {}
    return (_differences(optimizer, new.get("optimizer") or {}, optimizer, "optimizer.")
            + _differences(old, new, TRAINING_KEYS))


def unit_rate_as_peak(config: ml_collections.ConfigDict) -> str | None:
    """A warning for optimizer.learning_rate=1.0, the paper's multiplier under 'rsqrt_paper', left in
    place under a schedule that takes it as the peak rate itself (Adam at 1.0 diverges), and for
    the opposite: a peak-sized rate (1e-3) as the multiplier under 'rsqrt_paper', which then trains at
    ~1e-6 of it (the paper's configs with the README's example override learned nothing, silently)."""
    opt = config.optimizer
    rate = float(opt.get("learning_rate", 0.0))
    if opt.get("schedule") == "rsqrt_paper":
        if not 0.0 < rate < 0.05:
            return None
        warmup = max(int(opt.get("warmup_steps") or 1), 1)
        peak = rate * int(config.model.d_model) ** -0.5 * warmup ** -0.5
        return (f"WARNING: optimizer.learning_rate={rate:g} is a multiplier under schedule 'rsqrt_paper' "
                f"(of d_model^-0.5 * min(step^-0.5, step * warmup^-1.5); 1.0 is the paper's): the rate "
                f"peaks at {peak:.2g}; for a peak of {rate:g}, set --config.optimizer.schedule to "
                f"'cosine' or 'constant'")
    if rate != 1.0:
        return None
    return (f"WARNING: optimizer.learning_rate=1.0 is the peak rate itself under schedule "
            f"{opt.schedule!r} (it is a multiplier of d_model^-0.5 only under 'rsqrt_paper'); "
            f"set the rate to train at, e.g. --config.optimizer.learning_rate=3e-4")


def unfinished_warmup(config: ml_collections.ConfigDict) -> str | None:
    """A warning when the schedule warms up for longer than the run trains (the learning rate never
    reaches its peak; under 'cosine' this needs a decay_steps longer than the warm-up, which it
    refuses otherwise). None otherwise."""
    opt = config.optimizer
    warmup, steps = int(opt.get("warmup_steps") or 0), int(config.num_train_steps)
    if warmup <= steps:
        return None
    return (f"WARNING: optimizer.warmup_steps={warmup} is longer than num_train_steps={steps}: the run "
            f"ends during the warm-up, its learning rate reaching {steps / warmup:.0%} of the "
            f"{opt.schedule!r} schedule's peak")


def _compile_steps(model, tx, schedule, settings, shardings, mesh, rules=parallel.DEFAULT_RULES):
    batch_sharding = parallel.batch_sharding(mesh, rules)
    # Partials, not lambdas: the programs are named jit(train_step) / jit(eval_step) in profiles.
    train = jax.jit(
        functools.partial(steps.train_step, model=model, tx=tx, schedule=schedule, settings=settings),
        in_shardings=(shardings, batch_sharding),
        out_shardings=(shardings, None),
        donate_argnums=0,
    )
    evaluate_fn = jax.jit(
        functools.partial(steps.eval_step, model=model, settings=settings),
        in_shardings=(shardings.params, batch_sharding),
    )
    return train, evaluate_fn


# Per-token means of each step (losses.normalize_metrics): a window's is weighted by the steps' tokens.
_PER_TOKEN = ("loss", "nll", "accuracy", "z_loss")


def _summarise(history: list, seconds: float, flops: float, peak, num_devices=None) -> dict:
    """Means of the per-step metrics since the last log, plus throughput and MFU; the per-token
    ones (loss, nll, accuracy, z_loss) weighted by each step's ``num_tokens``, so that they are the
    window's per-token figures, as evaluation's are (a plain mean of steps gave a step of 75
    tokens the weight of one of 96); the learning rate
    is the logged step's own (a mean over a warm-up window is no step's rate), the perplexity
    exp(the window's nll) (the mean of each step's exp(nll) exceeded it: 443 against
    exp(6.08) = 437). tokens/s counts each
    step's ``real_tokens`` (source and target tokens that are not padding, over the global batch).
    The MFU is against ``peak`` TFLOP/s on each of ``num_devices`` (the mesh's; default every device).

    Non-finite (skipped) steps are left out of the means and counted in ``skipped``; a window of
    only such steps reports their (non-finite) means. Their tokens count: the step ran. Steps that
    dynamic loss scaling skipped (its scaled gradients overflowed) are counted in
    ``loss_scale_skipped`` instead; ``loss_scale`` is the logged step's scale.
    """
    host = jax.device_get(history)
    finite = [h for h in host if bool(h["finite"])]
    kept = finite or host
    out = {k: float(np.mean([h[k] for h in kept])) for k in host[0]
           if k not in ("finite", "real_tokens", "overflow")}
    weights = np.array([float(h.get("num_tokens", 0.0)) for h in kept])
    if weights.sum() > 0:  # (a window of steps without tokens keeps the plain means)
        for key in _PER_TOKEN:
            if key in out:
                out[key] = float(np.average([float(h[key]) for h in kept], weights=weights))
    for key in ("learning_rate", "loss_scale"):  # the logged step's own
        if key in host[-1]:
            out[key] = float(host[-1][key])
    if "nll" in out and "perplexity" in out:  # exp of the window's nll, not the mean of each step's
        out["perplexity"] = float(np.exp(out["nll"]))
    overflowed = sum(bool(h.get("overflow", 0)) for h in host)
    out["skipped"] = len(host) - len(finite) - overflowed
    if "overflow" in host[0]:
        out["loss_scale_skipped"] = overflowed
    out["tokens_per_sec"] = sum(int(h["real_tokens"]) for h in host) / seconds
    out["steps_per_sec"] = len(history) / seconds
    if peak:
        out["mfu"] = flops * len(history) / seconds / (peak * 1e12 * (num_devices or jax.device_count()))
    return out


# BLEU's references are decoded from the evaluation batches' target ids: read them this long,
# not cut at dataset.max_target_len like the targets of the loss; and the sources as long as the
# model takes, up to this (each batch is decoded at the width of its longest source).
REFERENCE_MAX_TOKENS = 1024


def _translation_eval(config, workdir, model, params, data, mesh, split: str, log, step, stop=None,
                      rules=None) -> dict:
    dataset_cfg = ml_collections.ConfigDict(config.dataset.to_dict())
    dataset_cfg.eval_split = split
    dataset_cfg.max_target_len = max(dataset_cfg.max_target_len, REFERENCE_MAX_TOKENS)
    # Whole sources: cut at dataset.max_source_len (a length chosen for training), the model
    # translated half a sentence and was scored against the whole reference.
    dataset_cfg.max_source_len = max(dataset_cfg.max_source_len,
                                     min(model.config.max_len, REFERENCE_MAX_TOKENS))
    cut_before = LENGTH_STATS.counts.get("eval/inputs/truncated", 0)
    batches = build_datasets(dataset_cfg, workdir).eval_batches
    cut = LENGTH_STATS.counts.get("eval/inputs/truncated", 0) - cut_before  # this process's rows:
    if jax.process_count() > 1:  # the split's are every process's
        from jax.experimental import multihost_utils

        cut = int(np.sum(multihost_utils.process_allgather(np.int32(cut))))
    start = time.time()
    result = evaluate.translate(
        model,
        params,
        batches,
        data.tokenizer,
        mesh,
        max_new_tokens=config.decode_max_len or config.dataset.max_target_len,
        beam_size=config.beam_size,
        alpha=config.beam_alpha,
        extra_len=config.decode_extra_len if config.decode_extra_len >= 0 else None,
        stop=stop,
        rules=rules,
    )
    out = {
        f"{split}_bleu": result.bleu(),
        f"{split}_exact_match": result.exact_match,
        f"{split}_examples": len(result.references),
        f"{split}_decode_seconds": time.time() - start,
    }
    log.message(
        f"step {step} {split}: BLEU {out[f'{split}_bleu']:.2f}, exact match "
        f"{100 * result.exact_match:.1f}% of {len(result.references)} "
        f"({'beam ' + str(config.beam_size) if config.beam_size > 1 else 'greedy'})"
        + (f"; {cut} sources cut to {dataset_cfg.max_source_len} tokens" if cut else "") + "\n"
        + result.examples(config.num_printed_examples)
    )
    return out


# What `train_and_evaluate` raises for a problem in the config, the data or the workdir (each message
# names the key, file or step); train.py prints these without a traceback and exits with status 2.
# Config problems are ConfigError (a ValueError), the mesh and batch checks of `parallel` included;
# a non-finite loss is a FloatingPointError naming the step and the last good checkpoint.
USER_ERRORS = (ConfigError, DataError, integrity.CheckpointConfigMismatchError,
               integrity.CheckpointCorruptError, integrity.CheckpointWriteError, FloatingPointError)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, mesh=None,
                       rules: parallel.LogicalRules = parallel.DEFAULT_RULES) -> dict:
    """Trains ``config`` in ``workdir`` (resuming from its latest checkpoint) and evaluates.

    ``mesh`` overrides ``config.mesh`` (e.g. a mesh over some of the devices, or one with axes of
    your own); ``rules``, the logical axis rules that place the state and the batches on it
    (`parallel.DEFAULT_RULES`, for the axes ``data``, ``fsdp`` and ``tensor``, by default).

    Returns the final metrics: the last training summary, validation loss/perplexity/accuracy,
    and for translation BLEU and exact match on ``config.test_split``.
    """
    # --- setup: checks before anything is compiled -----------------------------------------------
    config = as_run_config(config)  # a dict, a FrozenConfigDict, a ModelConfig as config.model
    fill_section_defaults(config)  # a config file's partial optimizer / dataset / mesh section
    if integrity.is_local(workdir):  # `--workdir=~/run`: the shell leaves a '~' after '=' as it is
        workdir = os.path.expanduser(workdir)
    # The workdir too: one the hosts see at different paths left process 0 waiting in a collective
    # after writing the tokenizer and the others waiting for it in their own workdir, for good.
    where = os.path.abspath(workdir) if integrity.is_local(workdir) else workdir
    differing = parallel.config_differences({**config.to_dict(), "workdir": where},
                                            ignore=("dataset.data_dir",))
    if differing:  # other values would train on silently, or end in a hang or an abort in a collective
        raise ConfigError(f"the {jax.process_count()} processes were given different configs or workdirs "
                          "(run the same command on every host, its workdir at the same path on each); "
                          f"differing: {'; '.join(differing)}")
    # Checked after the comparison: a value refused on one host only (a typo in its command) is then
    # named on every host, not only on that one, the others left waiting for it in a collective until
    # the runtime's heartbeat aborts them.
    check_config(config)
    for warning in unread_dataset_settings(config) + unread_training_settings(config):
        _say(warning)
    if unit_rate := unit_rate_as_peak(config):
        _say(unit_rate)
    if not integrity.is_local(workdir):
        raise ConfigError(
            f"workdir {workdir!r}: URLs are not supported (the tokenizer, metrics and checkpoint "
            "manifests are written with local file calls); use a local path, or mount the bucket "
            "(e.g. Cloud Storage FUSE) and give its mount point")
    if config.compilation_cache:
        conflict = compilation_cache_conflict(jax.default_backend(), jax.process_count())
        if conflict:
            _say(f"NOTE: {conflict}")
        else:
            enable_compilation_cache(config.get("compilation_cache_dir", ""))
    parallel.rules.require_mesh_for(rules, mesh, "train_and_evaluate")
    mesh = parallel.mesh_from_config(config.mesh) if mesh is None else mesh
    rules = parallel.check_rules(rules, mesh)
    parallel.check_batch_divisible(config.dataset.batch_size, mesh, rules,
                                   grad_accum_steps=config.optimizer.grad_accum_steps)
    parallel.check_batch_divisible(config.dataset.eval_batch_size, mesh, rules, key="dataset.eval_batch_size")
    model_cfg = ModelConfig.from_dict(config.model.to_dict())
    model = build_model(model_cfg)
    schedule = create_schedule(config.optimizer, model_cfg.d_model, config.num_train_steps)
    tx = create_optimizer(config.optimizer, model_cfg.d_model, config.num_train_steps)

    with integrity.workdir_lock(workdir, parallel.is_primary()):
        return _train_in(config, workdir, mesh, rules, model_cfg, model, schedule, tx)


def _train_in(config, workdir: str, mesh, rules, model_cfg: ModelConfig, model, schedule, tx) -> dict:
    """`train_and_evaluate` once the config is checked and the workdir is this run's alone."""
    if parallel.is_primary():
        integrity.repair_jsonl(os.path.join(workdir, "metrics.jsonl"))
    integrity.check_newest_step_model(ckpt_lib.checkpoint_dir(workdir), model_cfg)  # before the data

    # --- data --------------------------------------------------------------------------------
    data = build_datasets(config.dataset, workdir)
    # From here to the end, through the last save and the test-set evaluation, SIGTERM (and a first
    # Ctrl-C) stop the run cleanly: one arriving before the first step stops it after that step.
    preemption = ckpt_lib.PreemptionFlag()
    try:
        with preemption:
            return _train_on(data, preemption, config, workdir, mesh, rules, model_cfg, model, schedule, tx)
    finally:  # also on an error: input workers and their shared memory end with the run
        _close_input(data)


def _close_input(data) -> None:
    """Ends the training input pipeline (with ``dataset.num_workers > 0``, its worker processes).

    Left to garbage collection, grain closed it at interpreter exit, if at all: "Exception ignored
    in DatasetIterator.__del__" tracebacks and "leaked shared_memory objects" warnings ended every
    run with input workers (see `close_train_iterator`). Closing twice is harmless."""
    close_train_iterator(data.train_iter)


def _train_on(data, preemption, config, workdir: str, mesh, rules, model_cfg: ModelConfig, model,
              schedule, tx) -> dict:
    """`_train_in` once the datasets are built."""
    test_split = config.test_split
    if data.is_translation and test_split:  # read after training: resolved and checked now
        test_split = resolve_test_split(config.dataset, test_split)
    if data.tokenizer.vocab_size > model_cfg.vocab_size:
        raise ConfigError(
            f"config.model.vocab_size={model_cfg.vocab_size} is smaller than the "
            f"tokenizer's {data.tokenizer.vocab_size} tokens (dataset.vocab_size)."
        )

    # --- state: fresh, or resumed from the latest checkpoint ----------------------------------
    checkpointer = ckpt_lib.Checkpointer(
        workdir,
        config.max_checkpoints_to_keep,
        config.keep_best_metric,
        config.keep_best_mode,
        model_config=model_cfg,
        fallback=config.get("checkpoint_fallback", True),
    )
    loss_scale = steps.initial_loss_scale(config)
    abstract, shardings = state_shardings(model, tx, mesh, config.seed, loss_scale=loss_scale, rules=rules)
    warmup_warning = unfinished_warmup(config)
    if warmup_warning:
        _say(warmup_warning)
    if checkpointer.latest_step() is not None:
        exact = config.get("resume_data_position", True)
        state = checkpointer.restore(abstract, data.train_iter if exact else None)
        _say(f"Resumed from checkpoint {checkpointer.restored_step} in {checkpointer.directory}"
             + ("" if exact else " (the input pipeline starts afresh: resume_data_position=False)"))
        if loss_scale is not None and state.loss_scale is None:
            # created on the mesh as create_train_state creates the state (any number of processes)
            fresh = jax.jit(lambda: LossScale.initial(loss_scale), out_shardings=shardings.loss_scale)()
            state = state.replace(loss_scale=fresh)
            _say(f"NOTE: the checkpoint was written without dynamic loss scaling: its scale starts at "
                 f"config.loss_scale_init={loss_scale:g}")
        changed = changed_data_settings(workdir, config) if exact else []
        if changed:
            _say(f"WARNING: {', '.join(changed)} changed since the checkpoints were written: the input "
                 f"pipeline resumes at its saved position, but its batches are not the ones an "
                 f"uninterrupted run would have trained on (config.resume_data_position=False "
                 f"starts it afresh instead)")
        retuned = changed_training_settings(workdir, config)
        if retuned:
            _say(f"NOTE: resuming with training settings other than those of the run that wrote the "
                 f"checkpoints: {', '.join(retuned)}")
        unranked = checkpointer.unranked_steps()
        if unranked:
            _say(f"WARNING: keep_best_metric={config.keep_best_metric!r} keeps the checkpoints ranked by "
                 f"the {config.keep_best_metric} saved with them; steps {unranked} were saved without it "
                 f"(by a run without keep_best_metric, or between evaluations) and are deleted as soon "
                 f"as the steps outnumber max_checkpoints_to_keep={config.max_checkpoints_to_keep}, "
                 f"the latest excepted. Copy them out of {checkpointer.directory} to keep them.")
        # (a checkpoint at or past num_train_steps has nothing to train: the warning below says so)
        restretched = (restretched_schedule(workdir, config, checkpointer.restored_step)
                       if checkpointer.restored_step < config.num_train_steps else None)
        if restretched:
            _say(restretched)
        # Recorded once this run commits a checkpoint: until then the newest steps are the previous
        # run's, and its config.json is what the checks above (and the next resume) compare with;
        # a resume refused above, or one that stops before saving, leaves it untouched.
        checkpointer.write_config_on_commit(config)
    else:
        state, _ = create_train_state(model, tx, mesh, config.seed, loss_scale=loss_scale,
                                      shardings=shardings, rules=rules)
        ckpt_lib.save_config(config, workdir)
    start_step = int(jax.device_get(state.step))
    if start_step > config.num_train_steps:
        _say(f"WARNING: the checkpoint is at step {start_step}, past num_train_steps="
             f"{config.num_train_steps}: nothing to train (raise --config.num_train_steps to continue; "
             f"with a cosine schedule, set --config.optimizer.decay_steps to the old value to keep its "
             f"curve)")
    _say(
        f"config:\n{config}\nworkdir: {os.path.abspath(workdir)} (checkpoints/, metrics.jsonl, "
        f"tensorboard/)\n{parallel.describe_mesh(mesh, rules)}\ndevices: {jax.device_count()} "
        f"({jax.devices()[0].device_kind}), processes: {jax.process_count()}\n"
        f"parameters: {count_params(state.params):,}\ntrain examples: {data.train_size:,}, "
        f"eval examples: {data.eval_size:,}, vocabulary: {data.tokenizer.vocab_size}"
    )

    # --- compiled steps ---------------------------------------------------------------------
    settings = steps.settings_from_config(config)
    train_step, eval_step = _compile_steps(model, tx, schedule, settings, shardings, mesh, rules)
    ds = config.dataset
    flops = metrics_lib.train_flops_per_step(
        model_cfg,
        ds.batch_size,
        ds.max_target_len if data.is_translation else ds.max_len,
        ds.max_source_len if data.is_translation else 0,
    )
    peak = metrics_lib.peak_tflops_per_device(config.peak_tflops, model_cfg.dtype)
    log = metrics_lib.MetricsLogger(
        workdir,
        config.num_train_steps,
        start_step,
        use_wandb=config.use_wandb,
        config=config,
        progress=config.progress_bar,
    )

    # --- the loop ---------------------------------------------------------------------------
    history, skipped, summary, eval_metrics, evaluated_at, stop = [], 0, {}, {}, None, False
    last_log, pending, tracing = time.time(), None, False
    profile_dir = os.path.join(workdir, "profile")
    profile_end = config.profile_start_step + config.profile_num_steps

    compile_seconds = None  # the train step's, reported with the first window

    def log_window(done: int) -> dict:
        nonlocal compile_seconds
        # The mesh's devices, not jax.device_count(): a `mesh` argument may cover some of them only.
        summary = _summarise(history, time.time() - last_log, flops, peak, mesh.size)
        summary["skipped_steps"] = skipped
        if compile_seconds is not None:
            summary["compile_seconds"], compile_seconds = compile_seconds, None
        log.write(done, summary)
        figures = dict(loss=summary["loss"], lr=summary.get("learning_rate"), tok_s=summary["tokens_per_sec"])
        log.progress(done, **{k: v for k, v in figures.items() if v is not None})
        return summary

    batch_sharding = parallel.batch_sharding(mesh, rules)
    with parallel.sharding_context(mesh, rules):
        for step in range(start_step, config.num_train_steps):
            if step == config.profile_start_step:
                jax.profiler.start_trace(profile_dir)
                tracing = True
            batch = to_global_batch(next(data.train_iter), mesh, batch_sharding)
            if step == start_step:
                # Compiled before its first call (the call then finds the program in jit's cache) and
                # timed apart, so that the first window's tokens/s and MFU are of training alone.
                compile_start = time.time()
                train_step.lower(state, batch).compile()
                compile_seconds = time.time() - compile_start
                last_log += compile_seconds
                log.message(f"Compiled the train step in {compile_seconds:.1f} s")
            state, step_metrics = train_step(state, batch)
            history.append(step_metrics)
            checkpointer.seal()  # integrity manifest of a finished async save
            if pending is not None and _non_finite_step(pending[1]):  # checked one step late
                skipped += _non_finite(config, pending[0], checkpointer, log)
            pending = (step, step_metrics)
            done = step + 1
            if tracing and done == profile_end:
                tracing = _stop_trace(state, config.profile_start_step, done, profile_dir)
            if done % config.log_every_steps == 0 or done == config.num_train_steps:
                summary = log_window(done)
                history, last_log = [], time.time()
            evaluated = done % config.eval_every_steps == 0 or done == config.num_train_steps
            if evaluated:
                jax.block_until_ready(state)  # the steps before it count as training time
                eval_start = time.time()
                eval_metrics = evaluate.evaluate_loss(eval_step, state.params, data.eval_batches, mesh, rules)
                evaluated_at = done
                log.write(done, eval_metrics)
                log.message(f"step {done}: " + ", ".join(f"{k} {v:.4f}" for k, v in eval_metrics.items()))
                # Evaluation time does not count against tokens/s and MFU. The window may hold steps
                # from before the evaluation (eval_every_steps not a multiple of log_every_steps):
                # move its start on by the evaluation's duration, not to now, which would divide all
                # of its steps by the time of those after the evaluation only.
                last_log += time.time() - eval_start
            stop = preemption.reached(checkpointer, done)
            if done % config.checkpoint_every_steps == 0 or done == config.num_train_steps or stop:
                if pending is not None and _non_finite_step(pending[1]):
                    skipped += _non_finite(config, pending[0], checkpointer, log)
                pending = None
                if history:
                    # A checkpoint ends the logging window (a line here too where checkpoint_every_steps
                    # is not a multiple of log_every_steps, or at a stop): a run resumed from it logs the
                    # lines an uninterrupted run does. A window across it lost its steps up to the
                    # checkpoint when a crash dropped its line, the resumed run's line covering the rest.
                    summary = log_window(done)
                    history, last_log = [], time.time()
                # Keep-best ranks a checkpoint only by an evaluation of this very step; one saved
                # between evaluations (at preemption) has no metrics and is kept while it is the latest.
                jax.block_until_ready(state)  # the steps before it count as training time
                save_start = time.time()
                saved = checkpointer.save(state, data.train_iter, eval_metrics if evaluated else None,
                                          force=stop)
                last_log += time.time() - save_start  # nor does the save's blocking part
                if saved and not stop:  # (a stop says so once the save has committed)
                    log.message(f"step {done}: saving a checkpoint to {checkpointer.directory} "
                                "(in the background)")
            if stop:  # (its steps since the last line were logged with the checkpoint)
                # The save runs in the background: "saved" only once it has committed (a scheduler's
                # SIGKILL at the end of its grace period may follow the line at once).
                checkpointer.wait()
                log.message(f"Stopped by {preemption.signal_name or 'SIGTERM'} after step {done}; "
                            "checkpoint saved.")
                break

    if tracing:  # the window ran past the last step (or a stop): the trace is written only when stopped
        _stop_trace(state, config.profile_start_step, done, profile_dir)

    # --- final evaluation -------------------------------------------------------------------
    checkpointer.wait()
    _close_input(data)  # the test-set decoding needs no training batches: free the input workers
    final = {**summary, **eval_metrics, "step": int(jax.device_get(state.step))}
    if not stop and preemption.requested():  # a signal after the last step's check (or with none to train)
        stop = True
        log.message(f"Stopped by {preemption.signal_name} after step {final['step']}; checkpoint saved.")
    if stop:  # train.py exits with the signal's status: the run is not finished
        final["stopped_by"] = preemption.signal_name or "SIGTERM"
    if eval_metrics and evaluated_at != final["step"]:  # stopped between evaluations
        final["eval_step"] = evaluated_at  # the step the evaluation figures are of
    if data.is_translation and final["step"] == config.num_train_steps and test_split and not stop:
        step, params = final["step"], state.params
        preemption.notice = f"stopping the {test_split} evaluation (step {step}'s checkpoint is saved)"
        # With several processes a stop is agreed on at a step's sync point only: none here.
        requested = preemption.requested if jax.process_count() == 1 else None
        try:
            final.update(_translation_eval(config, workdir, model, params, data, mesh, test_split, log,
                                           step, stop=requested, rules=rules))
        except evaluate.Stopped:
            final["stopped_by"] = preemption.signal_name or "SIGTERM"  # unfinished: train.py says so
            log.message(f"Stopped by {preemption.signal_name} during the {test_split} evaluation after the "
                        f"last step, {step}, whose checkpoint is saved: run the same command again to "
                        f"evaluate.")
        else:
            if not (start_step == step and log.logged(step, f"{test_split}_")):  # (a finished run rerun)
                log.write(step, {k: v for k, v in final.items() if k.startswith(test_split)})
    checkpointer.close()
    log.close()
    return final


def _stop_trace(state, first: int, done: int, profile_dir: str) -> bool:
    """Ends the profiler trace of steps ``first..done - 1`` (written to disk only now); -> False."""
    jax.block_until_ready(state)
    jax.profiler.stop_trace()
    _say(f"Profiler trace of steps {first}..{done - 1} in {profile_dir}")
    return False


def _non_finite_step(step_metrics: dict) -> bool:
    """A step the non-finite guard skipped; one dynamic loss scaling skipped is not an error."""
    return not bool(step_metrics["finite"]) and not bool(step_metrics.get("overflow", False))


def _non_finite(config, step: int, checkpointer, log) -> int:
    """Skips (returns 1) or stops with the step number and the last good checkpoint. ``step`` is
    0-based (the updates before it); the messages number it from 1, as metrics.jsonl, the
    evaluations and the checkpoints do."""
    if config.skip_nonfinite:
        log.message(f"step {step + 1}: non-finite loss, gradients or update; step skipped (state unchanged).")
        return 1
    checkpointer.wait()
    last = checkpointer.latest_step()
    where = f"step {last} in {checkpointer.directory}" if last is not None else "none yet"
    raise FloatingPointError(
        f"Non-finite loss, gradients or update at step {step + 1}. Last good checkpoint: {where}. "
        "Lower the learning rate, enable optimizer.grad_clip_norm, or set config.skip_nonfinite=True."
    )
