"""Training: losses, learning-rate schedules, optimizer, train state, steps, checkpoints, metrics,
evaluation and the loop (``train_and_evaluate``)."""

from transformer_jax.training.checkpoint import (
    InferenceBundle,
    average_checkpoints,
    restore_for_inference,
)
from transformer_jax.training.config_checks import check_config, training_defaults, with_defaults
from transformer_jax.training.loop import USER_ERRORS, train_and_evaluate
from transformer_jax.training.state import TrainState, create_train_state

__all__ = [
    "USER_ERRORS",
    "InferenceBundle",
    "TrainState",
    "average_checkpoints",
    "check_config",
    "create_train_state",
    "restore_for_inference",
    "train_and_evaluate",
    "training_defaults",
    "with_defaults",
]
