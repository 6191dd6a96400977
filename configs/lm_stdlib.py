"""Decoder-only language model on the Python standard library's source code (``stdlib_lm``).

What it trains: a 4-layer Pre-LN TransformerLM (d_model 256, 4 heads, d_ff 1024, learned
positions, ~4.2M parameters) on the .py files of the running interpreter's standard library
(built offline on first use), 4k-token BPE, rows of 256 packed tokens, warm-up + cosine Adam.

Hardware and time: a 2-core CPU, about 75 minutes for 2,000 steps (0.45 steps/s, ~3,600
tokens/s, measured over the first 40 steps); not timed on a GPU. The final perplexity has not
been measured. Sample from it with
``python -m transformer_jax.generate --workdir=runs/lm_stdlib --prompt="def "``.

    python train.py --config=configs/lm_stdlib.py
"""

import ml_collections

from transformer_jax.data import default_dataset_config
from transformer_jax.training import with_defaults
from transformer_jax.training.optimizer import default_optimizer_config


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.num_train_steps = 2000
    c.log_every_steps = 50
    c.eval_every_steps = 500
    c.checkpoint_every_steps = 500
    c.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1})
    c.dataset = default_dataset_config("stdlib_lm")
    c.dataset.max_eval_examples = 512
    c.model = dict(
        vocab_size=c.dataset.vocab_size,
        d_model=256,
        num_heads=4,
        d_ff=1024,
        num_encoder_layers=0,
        num_decoder_layers=4,
        dropout_rate=0.0,
        max_len=c.dataset.max_len,
        norm="pre",
        position="learned",
        activation="gelu",
    )
    c.optimizer = default_optimizer_config()
    c.optimizer.schedule = "cosine"
    c.optimizer.learning_rate = 1e-3
    c.optimizer.warmup_steps = 100
    c.optimizer.label_smoothing = 0.0
    c.optimizer.grad_clip_norm = 1.0
    return with_defaults(c)
