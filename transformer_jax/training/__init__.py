"""Training: losses, learning-rate schedules, optimizer, train state, steps, checkpoints, metrics,
evaluation and the loop (``train_and_evaluate``).

The names below are imported on first use (PEP 562), not with the package: the checkpoint and loop
modules bring the data pipeline (grain, tensorflow-datasets, ml_collections), and a program that
needs only ``training.losses`` (the benchmarks, on an accelerator machine that has jax, flax and
optax but not the data stack) must not fail importing them.
"""

import importlib

# Each public name and the submodule that defines it.
_EXPORTS = {
    "InferenceBundle": "checkpoint",
    "average_checkpoints": "checkpoint",
    "restore_for_inference": "checkpoint",
    "check_config": "config_checks",
    "training_defaults": "config_checks",
    "with_defaults": "config_checks",
    "USER_ERRORS": "loop",
    "train_and_evaluate": "loop",
    "LossScale": "state",
    "TrainState": "state",
    "create_train_state": "state",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value  # later lookups are plain attribute reads
        return value
    try:  # `training.steps` after `import transformer_jax.training`, as when __init__ imported it
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
