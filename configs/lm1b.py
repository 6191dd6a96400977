"""Decoder-only language model on LM1B (One Billion Word), as in the flax lm1b example.

Model: 6-layer Pre-LN TransformerLM, d_model 512, 8 heads, d_ff 2048, 32k SentencePiece BPE,
rows of 128 packed tokens, 256 rows per batch, AdamW (weight decay 0.1, off for norms and biases)
with 1,000 warm-up steps and cosine decay over 100k steps, gradient clipping 1.0; bf16 compute.

Hardware and time: a TPU v4-8 / v5e-8 or 8 GPUs, about 6 hours. Expected result: test perplexity
around 30 (not measured here). Prepare the data once:
``tfds build lm1b --file_format=array_record --data_dir=DIR``.

    python train.py --config=configs/lm1b.py --config.dataset.data_dir=DIR
"""

import ml_collections

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
    c.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1})
    c.dataset = default_dataset_config("lm1b")
    c.dataset.max_eval_examples = 10_000
    c.model = dict(
        vocab_size=c.dataset.vocab_size,
        d_model=512,
        num_heads=8,
        d_ff=2048,
        num_encoder_layers=0,
        num_decoder_layers=6,
        dropout_rate=0.1,
        max_len=c.dataset.max_len,
        norm="pre",
        dtype="bfloat16",
    )
    c.optimizer = default_optimizer_config()
    c.optimizer.name = "adamw"
    c.optimizer.schedule = "cosine"
    c.optimizer.learning_rate = 1e-3
    c.optimizer.warmup_steps = 1000
    c.optimizer.b2 = 0.98
    c.optimizer.weight_decay = 0.1
    c.optimizer.grad_clip_norm = 1.0
    c.optimizer.label_smoothing = 0.0
    return with_defaults(c)
