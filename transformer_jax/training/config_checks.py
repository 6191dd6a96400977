"""Checks of a training config before anything is built, each error naming the config key."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing

import ml_collections
import numpy as np
from ml_collections import config_dict

from transformer_jax.config import ConfigError, ModelConfig
from transformer_jax.data import DATASET_NAMES, EOS_ID, PAD_ID
from transformer_jax.data.inputs import LM_DATASETS, TRANSLATION_DATASETS, default_dataset_config
from transformer_jax.data.tokenizer import MIN_VOCAB_SIZE, TOKENIZER_TYPES
from transformer_jax.training.checkpoint import check_keep_best_mode, resolve_keep_best_mode
from transformer_jax.training.evaluate import EVAL_METRICS
from transformer_jax.training.optimizer import OPTIMIZERS, default_optimizer_config
from transformer_jax.training.schedules import SCHEDULES
from transformer_jax.training.steps import LOSS_SCALE_MODES, MAX_LOSS_SCALE, MIN_LOSS_SCALE

REQUIRED = (
    "seed",
    "num_train_steps",
    "eval_every_steps",
    "checkpoint_every_steps",
    "log_every_steps",
    "mesh",
    "model",
    "dataset",
    "optimizer",
)


def training_defaults() -> ml_collections.ConfigDict:
    """Loop settings every config gets unless it sets them (configs/ start from these)."""
    c = ml_collections.ConfigDict()
    c.max_checkpoints_to_keep = 3
    c.keep_best_metric = ""  # e.g. 'eval_loss': keep the best checkpoints by it (and the newest)
    c.keep_best_mode = "auto"  # 'min' / 'max'; 'auto': the metric's own (higher accuracy is better)
    c.skip_nonfinite = False  # False: stop at a non-finite step; True: skip it
    # Dynamic loss scaling ('dynamic'; 'none' off; 'auto' = 'dynamic' for model.dtype='float16'): the
    # gradients of the mean loss times a scale that halves when they overflow (the step skipped)
    # and doubles after loss_scale_period finite steps in a row.
    c.loss_scale = "auto"
    c.loss_scale_init = 2.0**15
    c.loss_scale_period = 2000
    c.checkpoint_fallback = True  # a corrupt newest checkpoint: True resume from an older one; False stop
    # False: a resume starts the input pipeline afresh instead of at its saved position (for another
    # process count or dataset.num_workers, which cannot take the saved position; not bit-exact).
    c.resume_data_position = True
    c.inject_nan_at_step = -1  # testing the non-finite guard
    c.test_split = ""  # translation: BLEU / exact match on this split after training ('' = none)
    c.beam_size = 1  # 1 = greedy decoding for BLEU
    c.beam_alpha = 0.6
    c.decode_max_len = 0  # 0 = dataset.max_target_len
    # >= 0: each output also at most its source's length + this many tokens (the paper: 50); -1: off
    c.decode_extra_len = -1
    c.num_printed_examples = 3
    c.compilation_cache = True
    c.compilation_cache_dir = ""
    c.use_wandb = False
    c.progress_bar = True
    c.peak_tflops = 0.0  # per device, for the MFU estimate; 0 = look up the accelerator
    c.profile_start_step = -1  # capture a profiler trace from this step (-1 = never)
    c.profile_num_steps = 5
    return c


@functools.cache
def _optional_model_fields() -> dict[str, type]:
    """The `ModelConfig` fields that may be None, each with the type of its other values."""
    out = {}
    for name, hint in typing.get_type_hints(ModelConfig).items():
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) else ()
        others = [a for a in args if a is not type(None)]
        if type(None) in args and len(others) == 1:  # e.g. `int | None` (a wider union stays as is)
            out[name] = others[0]
    return out


def with_defaults(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """``config`` with every missing loop setting filled from :func:`training_defaults`, and every
    `ModelConfig` field that ``config.model`` leaves out filled with its default (what
    `ModelConfig.from_dict` would use anyway), so that a command line can override it:
    ``--config.model.kernel_layout=out_in`` works with any config. A field that is None (``head_dim``,
    ``num_kv_heads``, ``final_norm`` by default) becomes a typed ml_collections placeholder, still None
    but settable from the command line: ``--config.model.head_dim=32``."""
    out = training_defaults()
    out.update(config)
    fill_section_defaults(out)
    if isinstance(out.get("model"), ml_collections.ConfigDict):
        optional = _optional_model_fields()
        with out.model.unlocked():
            for field in dataclasses.fields(ModelConfig):
                name = field.name
                if name not in out.model:
                    value = field.default
                elif name in optional and out.model[name] is None:
                    value = None
                else:
                    continue
                out.model[name] = config_dict.placeholder(optional[name]) if value is None else value
    return out


_SECTIONS = ("model", "optimizer", "dataset", "mesh")


def _has_numpy_scalars(value) -> bool:
    if isinstance(value, dict):
        return any(_has_numpy_scalars(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_has_numpy_scalars(v) for v in value)
    return isinstance(value, np.generic)


def _python_numbers(value):
    """``value`` with NumPy scalars (``np.int64(100)`` from a computed step count, ``np.float32``
    rates) as the Python numbers they hold: the checks refused them ("must be an integer") where
    `ModelConfig` takes them, and config.json could not hold them."""
    if isinstance(value, dict):
        return {k: _python_numbers(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_python_numbers(v) for v in value)
    return value.item() if isinstance(value, np.generic) else value


def as_run_config(config) -> ml_collections.ConfigDict:
    """``config`` as the ConfigDict a run reads and fills in: a ConfigDict as it is; a plain dict or
    a FrozenConfigDict (read-only) as a ConfigDict copy of it; a `ModelConfig` given as
    ``config.model`` as its fields; NumPy scalars anywhere in it as Python numbers (a copy).
    Anything else, and a section that is not a mapping (None, a
    string), is a ConfigError naming it: each failed with an AttributeError or TypeError traceback,
    the ModelConfig only after the data was prepared."""
    from collections.abc import Mapping

    if isinstance(config, ml_collections.FrozenConfigDict):
        config = config.as_configdict()
    elif isinstance(config, Mapping) and not isinstance(config, ml_collections.ConfigDict):
        config = ml_collections.ConfigDict(dict(config))
    elif not isinstance(config, ml_collections.ConfigDict):
        raise ConfigError(
            f"config must be an ml_collections.ConfigDict (or a dict), got {type(config).__name__}")
    if isinstance(config.get("model"), ModelConfig):
        items = dict(config.items())
        items["model"] = config.model.to_dict()
        config = ml_collections.ConfigDict(items)
    if _has_numpy_scalars(config.to_dict()):  # a copy with Python numbers (see _python_numbers)
        config = ml_collections.ConfigDict(_python_numbers(config.to_dict()))
    for section in _SECTIONS:
        value = config.get(section, {})
        if not isinstance(value, ml_collections.ConfigDict | Mapping):
            raise ConfigError(
                f"config.{section} must be a section of its fields (a ConfigDict or dict"
                + (", or a ModelConfig" if section == "model" else "") + f"), got {type(value).__name__}")
    return config


def fill_section_defaults(config: ml_collections.ConfigDict) -> None:
    """Fills, in place, the keys that ``config.optimizer``, ``config.dataset`` and ``config.mesh``
    leave out from their defaults (the paper's optimizer, the named dataset's, one data-parallel
    mesh): a config file replacing a section with a few keys of its own (after `with_defaults`)
    otherwise failed with a KeyError traceback. A missing section is left for `check_config`."""
    dataset = config.get("dataset")
    name = dataset.get("name", "enfr_builtin") if isinstance(dataset, ml_collections.ConfigDict) else None
    sections = {"optimizer": default_optimizer_config,
                "dataset": lambda: default_dataset_config(name) if name in DATASET_NAMES else {},
                "mesh": lambda: {"data": -1, "fsdp": 1, "tensor": 1}}
    for section, defaults in sections.items():
        given = config.get(section)
        if not isinstance(given, ml_collections.ConfigDict):
            continue
        filled = defaults()
        missing = [key for key in filled if key not in given]
        if missing:
            with given.unlocked():
                for key in missing:
                    given[key] = filled[key]


# The step counter is int32 (as in the train state and the schedules): 2**31 steps or more
# overflowed in a compiled schedule, after the tokenizer and the state were built.
MAX_STEPS = 2**31 - 1


def _positive_int(config, key: str, minimum: int = 1, prefix: str = "config", steps: bool = False) -> None:
    """``config[key]`` is an integer >= ``minimum``; a number of steps (``steps``) at most MAX_STEPS."""
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{prefix}.{key}={value!r} must be an integer >= {minimum}")
    if steps and value > MAX_STEPS:
        raise ConfigError(f"{prefix}.{key}={value!r} must be at most {MAX_STEPS} (2**31 - 1, the step "
                          f"counter's int32 range)")


def _number_in(config, key: str, prefix: str, low: float, high: float = math.inf, *,
               low_open: bool = False, high_open: bool = True) -> None:
    """``config[key]`` is a real number in the interval from ``low`` to ``high`` (ends as given)."""
    value = config[key]
    ok = (not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
          and (value > low if low_open else value >= low) and (value < high if high_open else value <= high))
    if not ok:
        interval = (("(" if low_open else "[") + f"{low:g}, " + (f"{high:g}" if high != math.inf else "inf")
                    + (")" if high_open else "]"))
        raise ConfigError(f"{prefix}.{key}={value!r} must be a number in {interval}")


# On/off settings: a config file's string ('no', 'False') is truthy, and turned the setting on.
_SWITCHES = {"config": ("skip_nonfinite", "checkpoint_fallback", "resume_data_position", "compilation_cache",
                        "use_wandb", "progress_bar"),
             "config.dataset": ("pack", "reverse"), "config.optimizer": ("decay_embeddings",)}


def _check_switches(config) -> None:
    for prefix, keys in _SWITCHES.items():
        section = config if prefix == "config" else config[prefix.split(".")[1]]
        for key in keys:
            if key in section and not isinstance(section[key], bool | np.bool_):
                raise ConfigError(f"{prefix}.{key}={section[key]!r} must be True or False")


def _check_numbers(config) -> None:
    """Ranges of the numeric settings whose bad values would otherwise run (a negative learning rate
    ascends the loss; max_checkpoints_to_keep=0 keeps no checkpoint) or fail late."""
    ds, opt = config.dataset, config.optimizer
    _check_switches(config)
    _number_in(opt, "learning_rate", "config.optimizer", 0.0, low_open=True)
    for key in ("b1", "b2"):
        _number_in(opt, key, "config.optimizer", 0.0, 1.0)
    _number_in(opt, "eps", "config.optimizer", 0.0)
    if float(np.float32(opt.eps)) == 0.0:  # 0, or so small that it is 0 in float32
        raise ConfigError(
            f"config.optimizer.eps={opt.eps!r} is 0 in float32: Adam's update m / (sqrt(v) + eps) is "
            f"then 0/0 = NaN for every parameter whose gradient is still zero (the embedding rows of "
            f"tokens not yet seen, for one); use a positive eps, e.g. the paper's 1e-9")
    for key in ("weight_decay", "grad_clip_norm", "z_loss"):
        if key in opt:
            _number_in(opt, key, "config.optimizer", 0.0)
    if "end_learning_rate_ratio" in opt:  # above 1 the "decay" climbed past the peak, silently
        _number_in(opt, "end_learning_rate_ratio", "config.optimizer", 0.0, 1.0, high_open=False)
    _positive_int(opt, "warmup_steps", 0, "config.optimizer", steps=True)
    if opt.get("decay_steps") is not None:  # None or 0: num_train_steps
        _positive_int(opt, "decay_steps", 0, "config.optimizer", steps=True)
    if config.max_checkpoints_to_keep is not None:  # None: keep every checkpoint
        _positive_int(config, "max_checkpoints_to_keep")
    _positive_int(config, "decode_max_len", 0)
    _positive_int(config, "decode_extra_len", -1)
    _positive_int(config, "num_printed_examples", 0)  # a negative one sliced off the end instead
    # Read only by the BLEU evaluation after training: a bad value would fail after the whole run.
    _number_in(config, "beam_alpha", "config", 0.0)
    _number_in(config, "peak_tflops", "config", 0.0)  # 0 = look the accelerator up
    _positive_int(ds, "max_eval_examples", 0, "config.dataset")  # 0 = all
    _positive_int(ds, "num_workers", 0, "config.dataset")  # 0 = in the main process
    if config.loss_scale not in LOSS_SCALE_MODES:
        raise ConfigError(f"config.loss_scale={config.loss_scale!r} is not one of {list(LOSS_SCALE_MODES)}")
    _number_in(config, "loss_scale_init", "config", MIN_LOSS_SCALE, MAX_LOSS_SCALE, high_open=False)
    _positive_int(config, "loss_scale_period")
    if config.loss_scale_period > 2**31 - 1:  # counted in int32
        raise ConfigError(f"config.loss_scale_period={config.loss_scale_period} must be below 2**31")
    if config.profile_start_step >= 0:  # 0 steps would stop the trace before it started
        _positive_int(config, "profile_num_steps")
    lengths = ("max_source_len", "max_target_len") if ds.name in TRANSLATION_DATASETS else ("max_len",)
    for key in lengths:
        _positive_int(ds, key, 1, "config.dataset")
    _check_tokenizer_and_lengths(ds)
    # grain's shuffle, the packer and the tokenizer's trainer refuse these only as the pipeline is
    # built, without naming the key (a seed outside [0, 2**32), "num_bins must be >= 1", a division by 0)
    # jax.random.PRNGKey takes a signed 64-bit seed (a larger one: OverflowError once training
    # starts, after the data is prepared).
    if isinstance(config.seed, bool) or not isinstance(config.seed, int) or not -2**63 <= config.seed < 2**63:
        raise ConfigError(f"config.seed={config.seed!r} must be an integer in [-2**63, 2**63)")
    if "seed" in ds:
        _positive_int(ds, "seed", 0, "config.dataset")
        if ds.seed >= 2**32:
            raise ConfigError(f"config.dataset.seed={ds.seed} must be below 2**32")
    if "pack_bins" in ds:
        _positive_int(ds, "pack_bins", 0, "config.dataset")  # 0 = max(per-host batch, 32)
    if "tokenizer_max_chars" in ds:
        _positive_int(ds, "tokenizer_max_chars", 1, "config.dataset")


# Dataset settings that only some datasets read, with their unset value.
_READ_BY = {
    "train_files": (("tsv", "text"), ()),
    "eval_files": (("tsv", "text"), ()),
    "builder_config": (("enfr_builtin", "stdlib_lm"), ""),
    "source_lang": (TRANSLATION_DATASETS, ""),
    "target_lang": (TRANSLATION_DATASETS, ""),
    "reverse": (TRANSLATION_DATASETS, False),
}


def unread_dataset_settings(config: ml_collections.ConfigDict) -> list[str]:
    """A warning for each dataset setting given a value that ``config.dataset.name`` does not read
    (train_files for the built-in corpus, a translation direction for a language model, ...): known
    keys, so the typo check passes them, but the run would go on without them."""
    ds = config.dataset
    out = []
    for key, (readers, unset) in _READ_BY.items():
        value = ds.get(key, unset)
        if ds.name in readers or value is None or value == unset or (isinstance(value, tuple | list)
                                                                     and not value):
            continue
        out.append(f"WARNING: config.dataset.{key}={value!r} is not read for dataset {ds.name!r} "
                   f"(only for {', '.join(readers)}): the run goes on without it")
    return out


def unread_training_settings(config: ml_collections.ConfigDict) -> list[str]:
    """A warning for each training setting given a value that nothing in this run reads: the decay
    settings of a schedule that does not decay, a keep-best mode without a metric, the settings of
    the evaluation after training where there is none, and a profiler window that starts after the
    last step. Known keys pass the typo check; the run would go on as if they were not there."""
    opt, out = config.optimizer, []

    def unread(key, value, why):
        out.append(f"WARNING: config.{key}={value!r} is not read: {why}; the run goes on without it")

    schedule = opt.get("schedule", "rsqrt_paper")
    if schedule != "cosine":
        for key in ("decay_steps", "end_learning_rate_ratio"):
            if opt.get(key):
                unread(f"optimizer.{key}", opt[key], f"only the 'cosine' schedule decays "
                                                     f"(optimizer.schedule is {schedule!r})")
    if not config.keep_best_metric and config.keep_best_mode != "auto":
        unread("keep_best_mode", config.keep_best_mode,
               "it ranks checkpoints by config.keep_best_metric, which is unset (the newest are kept)")
    translation = config.dataset.name in TRANSLATION_DATASETS
    if config.test_split and not translation:
        unread("test_split", config.test_split, f"the evaluation after training (BLEU, exact match) is "
                                                f"for translation, and dataset {config.dataset.name!r} "
                                                f"is a language model's")
    if not (translation and config.test_split):
        defaults = training_defaults()
        why = ("config.test_split is unset" if translation else
               f"dataset {config.dataset.name!r} is a language model's, which has none")
        for key in ("beam_size", "beam_alpha"):
            if config[key] != defaults[key]:
                unread(key, config[key], f"it is a setting of the translation evaluation after "
                                         f"training, and {why}")
    if config.profile_start_step >= config.num_train_steps:
        unread("profile_start_step", config.profile_start_step,
               f"the run's last step is {config.num_train_steps - 1} (config.num_train_steps="
               f"{config.num_train_steps}), so no profiler trace is captured")
    return out


def _check_tokenizer_and_lengths(ds) -> None:
    """The dataset settings the tokenizer and the pipeline would otherwise refuse only after the
    dataset is built, without naming the config key."""
    _positive_int(ds, "vocab_size", MIN_VOCAB_SIZE, "config.dataset")  # byte pieces + specials
    if ds.tokenizer_type not in TOKENIZER_TYPES:
        raise ConfigError(f"config.dataset.tokenizer_type={ds.tokenizer_type!r} is not one of "
                          f"{list(TOKENIZER_TYPES)}")
    policies = ("truncate", "drop", "split") if ds.name in LM_DATASETS else ("truncate", "drop")
    if ds.length_policy not in policies:
        why = " ('split' cuts decoder-only documents)" if ds.length_policy == "split" else ""
        raise ConfigError(f"config.dataset.length_policy={ds.length_policy!r} is not one of "
                          f"{list(policies)} for dataset {ds.name!r}{why}")


def _check_keep_best(config) -> None:
    """Keep-best ranks checkpoints by the evaluation run at their step, so every periodic checkpoint
    must fall on an evaluation step (t5x refuses checkpoint and eval periods that are not multiples
    of each other too)."""
    check_keep_best_mode(config.keep_best_mode)
    metric = config.keep_best_metric
    if not metric:
        return
    if metric not in EVAL_METRICS:
        raise ConfigError(
            f"config.keep_best_metric={metric!r} is not a metric evaluation produces; use one of "
            f"{list(EVAL_METRICS)} (or '' to keep the newest checkpoints)")
    resolve_keep_best_mode(metric, config.keep_best_mode)  # a mode against the metric's direction
    if config.checkpoint_every_steps % config.eval_every_steps:
        raise ConfigError(
            f"config.keep_best_metric={metric!r} ranks checkpoints by the evaluation at their step, but "
            f"config.checkpoint_every_steps={config.checkpoint_every_steps} is not a multiple of "
            f"config.eval_every_steps={config.eval_every_steps}")


def _check_unknown_keys(config) -> None:
    """A key no code reads (a typo in a config file: ``optimizer.learning_rat``) would silently leave
    the setting at its default; `ModelConfig` refuses its own unknown fields, this the others'."""
    from transformer_jax.data import default_dataset_config
    from transformer_jax.training.optimizer import default_optimizer_config

    known = {
        "": set(REQUIRED) | set(training_defaults()),
        "dataset.": set(default_dataset_config()),
        "optimizer.": set(default_optimizer_config()),
        "mesh.": {"data", "fsdp", "tensor"},
    }
    for prefix, names in known.items():
        section = config[prefix[:-1]] if prefix else config
        if not hasattr(section, "keys"):
            continue
        for key in sorted(set(section.keys()) - names):
            close = difflib.get_close_matches(key, sorted(names), n=1)
            raise ConfigError(f"config.{prefix}{key} is not a setting the training program reads"
                              + (f" (did you mean config.{prefix}{close[0]}?)" if close else ""))


def check_config(config: ml_collections.ConfigDict) -> None:
    """Raises ``ConfigError`` (a ValueError) naming the first bad key."""
    missing = [k for k in REQUIRED if k not in config]
    if missing:
        raise ConfigError(f"config is missing {', '.join('config.' + k for k in missing)}")
    for key in ("num_train_steps", "eval_every_steps", "checkpoint_every_steps", "log_every_steps"):
        _positive_int(config, key, steps=True)
    unknown = sorted(set(training_defaults()) - set(config))
    if unknown:
        raise ConfigError(
            f"config is missing {unknown}; start configs from "
            "transformer_jax.training.config_checks.with_defaults"
        )
    _check_unknown_keys(config)
    try:
        model = ModelConfig.from_dict(config.model.to_dict())
    except (ConfigError, TypeError) as e:
        raise ConfigError(f"config.model: {e}") from e
    from transformer_jax.modeling.attention import impl_problem

    problem = impl_problem(model.attention_impl, dtype=model.compute_dtype, head_dim=model.qk_dim)
    if problem:
        raise ConfigError(f"config.model.attention_impl={model.attention_impl!r}: {problem}")
    if model.param_dtype == "float16":  # Adam's moments take the parameters' dtype
        raise ConfigError(
            "config.model.param_dtype='float16' cannot be trained with Adam: its second moment, kept in "
            "the parameters' dtype, is 0 in float16 for every gradient below ~2.4e-4 (and eps=1e-9 is 0 "
            "there too), so updates come out NaN or thousands of times the learning rate; keep float32 "
            "parameters (model.dtype='float16' still computes in float16) or use 'bfloat16' ones")
    ds, opt = config.dataset, config.optimizer
    if ds.name not in DATASET_NAMES:
        raise ConfigError(f"config.dataset.name={ds.name!r} is not one of {list(DATASET_NAMES)}")
    if ds.name in TRANSLATION_DATASETS and model.num_encoder_layers == 0:
        raise ConfigError(
            f"config.dataset.name={ds.name!r} is a translation dataset (source -> target), but "
            "config.model.num_encoder_layers=0 is a decoder-only model; give it encoder layers or "
            f"use a language-modelling dataset: {list(LM_DATASETS)}")
    if ds.name in LM_DATASETS and model.num_encoder_layers > 0:
        raise ConfigError(
            f"config.dataset.name={ds.name!r} is a language-modelling dataset (one text stream), but "
            f"config.model.num_encoder_layers={model.num_encoder_layers} makes an encoder-decoder; "
            "set it to 0 (e.g. start from configs/lm_stdlib.py) or use a translation dataset: "
            f"{list(TRANSLATION_DATASETS)}")
    for key in ("batch_size", "eval_batch_size"):
        _positive_int(ds, key, prefix="config.dataset")
    # Said now, not once the tokenizer is trained (minutes on a large corpus): the configs copy
    # dataset.vocab_size into the model as the file is read, so a command line that changes only
    # the dataset's leaves the model's behind.
    wanted = ds.get("vocab_size")
    if isinstance(wanted, int) and not isinstance(wanted, bool) and model.vocab_size < wanted:
        raise ConfigError(
            f"config.model.vocab_size={model.vocab_size} is smaller than the tokenizer's {wanted} tokens "
            f"(config.dataset.vocab_size): the model needs a row for each; set "
            f"--config.model.vocab_size={wanted} as well")
    _check_keep_best(config)
    if opt.name not in OPTIMIZERS:
        raise ConfigError(f"config.optimizer.name={opt.name!r} is not one of {OPTIMIZERS}")
    if opt.schedule not in SCHEDULES:
        raise ConfigError(f"config.optimizer.schedule={opt.schedule!r} is not one of {SCHEDULES}")
    _positive_int(opt, "grad_accum_steps", prefix="config.optimizer")
    _check_numbers(config)
    if ds.batch_size % opt.grad_accum_steps:
        raise ConfigError(
            f"config.dataset.batch_size={ds.batch_size} is not divisible by "
            f"config.optimizer.grad_accum_steps={opt.grad_accum_steps}"
        )
    smoothing = opt.label_smoothing
    if isinstance(smoothing, bool) or not isinstance(smoothing, int | float) or not 0.0 <= smoothing < 1.0:
        raise ConfigError(f"config.optimizer.label_smoothing={smoothing!r} must be in [0, 1)")
    for key in ("data", "fsdp", "tensor"):
        value = config.mesh[key]
        if not isinstance(value, int) or (value < 1 and value != -1):
            raise ConfigError(f"config.mesh.{key}={value!r} must be a positive integer or -1")
    if isinstance(config.beam_size, bool) or not isinstance(config.beam_size, int) or config.beam_size < 1:
        raise ConfigError(f"config.beam_size={config.beam_size!r} must be an integer >= 1 (1 = greedy)")
    for key, fixed, why in (
        ("pad_id", PAD_ID, "the model's attention masks would take padding for text"),
        ("eos_id", EOS_ID, "decoding would stop on a token the data never ends with"),
    ):
        if getattr(model, key) != fixed:  # the pipeline pads with, and ends every example by, these
            raise ConfigError(
                f"config.model.{key}={getattr(model, key)} differs from the id the input pipeline uses "
                f"({fixed}): {why}; set it to {fixed}")
    _check_learned_positions(config, model)


def _check_learned_positions(config, model: ModelConfig) -> None:
    """A learned position table has ``model.max_len`` rows; a row or a decoded output longer than
    that would look past its end (NaN embeddings in training, a ValueError at the BLEU evaluation
    after training)."""
    if model.position != "learned":
        return
    ds = config.dataset
    if ds.name in TRANSLATION_DATASETS:
        lengths = {"dataset.max_source_len": ds.max_source_len, "dataset.max_target_len": ds.max_target_len,
                   "decode_max_len": config.decode_max_len or ds.max_target_len}
    else:
        lengths = {"dataset.max_len": ds.max_len}
    for key, length in lengths.items():
        if length > model.max_len:
            raise ConfigError(
                f"config.{key}={length} exceeds config.model.max_len={model.max_len}: with "
                f"position='learned' the position table has max_len rows; raise model.max_len or "
                f"shorten {key}")
