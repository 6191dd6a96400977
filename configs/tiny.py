"""Tiny encoder-decoder on the small built-in English->French set: for tests and smoke runs.

Trains a ~50k-parameter model for 20 steps on one CPU in seconds; the loss falls but nothing
useful is learned.

    python train.py --config=configs/tiny.py --workdir=/tmp/tiny
"""

import ml_collections

from transformer_jax import presets
from transformer_jax.data import default_dataset_config
from transformer_jax.training import with_defaults
from transformer_jax.training.optimizer import default_optimizer_config


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.num_train_steps = 20
    c.log_every_steps = 5
    c.eval_every_steps = 10
    c.checkpoint_every_steps = 10
    c.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1})

    c.dataset = default_dataset_config("enfr_builtin")
    c.dataset.builder_config = "small"
    c.dataset.eval_split = "validation"  # periodic loss; the test split stays for test_split
    c.dataset.vocab_size = 320
    c.dataset.batch_size = 16
    c.dataset.eval_batch_size = 16
    c.dataset.max_source_len = 24
    c.dataset.max_target_len = 24
    c.dataset.max_eval_examples = 32

    c.model = presets.tiny(vocab_size=320, max_len=64).to_dict()

    c.optimizer = default_optimizer_config()
    c.optimizer.schedule = "constant"
    c.optimizer.learning_rate = 3e-3
    c.optimizer.warmup_steps = 5
    c.optimizer.label_smoothing = 0.1
    c = with_defaults(c)
    c.progress_bar = False
    c.max_checkpoints_to_keep = 5
    return c
