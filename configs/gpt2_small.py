"""GPT-2 small (124M shape) trained from scratch on your own text files.

Model: ``presets.gpt2_small`` (12 layers, d_model 768, 12 heads, learned positions, Pre-LN,
tanh-GELU, tied head) with our SentencePiece vocabulary (32k BPE trained on the files) and the
project's special ids; rows of 1,024 packed tokens, 64 rows (65k tokens) per step; AdamW
(0.9, 0.95), weight decay 0.1, warm-up 2,000 + cosine, gradient clipping 1.0, bf16 compute,
params and optimizer state sharded with FSDP.

Hardware and time: 8 A100/H100 GPUs or a TPU v4-8, about 1-2 days for 100k steps (not run
here). Point it at one-document-per-line text files:

    python train.py --config=configs/gpt2_small.py \\
        --config.dataset.train_files="('/data/train.txt',)" \\
        --config.dataset.eval_files="('/data/valid.txt',)"
"""

import ml_collections

from transformer_jax import presets
from transformer_jax.data import default_dataset_config
from transformer_jax.training import with_defaults
from transformer_jax.training.optimizer import default_optimizer_config


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.num_train_steps = 100_000
    c.log_every_steps = 100
    c.eval_every_steps = 2000
    c.checkpoint_every_steps = 2000
    c.mesh = ml_collections.ConfigDict({"data": 1, "fsdp": -1, "tensor": 1})
    c.dataset = default_dataset_config("text")
    c.dataset.vocab_size = 32000
    c.dataset.max_len = 1024
    c.dataset.batch_size = 64
    c.dataset.eval_batch_size = 64
    model = presets.gpt2_small(
        vocab_size=32000, pad_id=0, eos_id=1, bos_id=2, decoder_start_id=2, dtype="bfloat16"
    )
    c.model = model.to_dict()
    c.optimizer = default_optimizer_config()
    c.optimizer.name = "adamw"
    c.optimizer.schedule = "cosine"
    c.optimizer.learning_rate = 6e-4
    c.optimizer.warmup_steps = 2000
    c.optimizer.b2 = 0.95
    c.optimizer.eps = 1e-8
    c.optimizer.weight_decay = 0.1
    c.optimizer.grad_clip_norm = 1.0
    c.optimizer.label_smoothing = 0.0
    return with_defaults(c)
