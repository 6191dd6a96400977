"""Default: a small encoder-decoder Transformer learns the built-in English->French corpus.

What it trains: a 2+2-layer Post-LN Transformer (d_model 128, 4 heads, d_ff 512, ~1.2M params)
on the 100k synthetic sentence pairs of ``enfr_builtin`` (agreement, adjective order, elision,
tenses, negation), packed 64 rows x 32 tokens per batch, Adam(0.9, 0.98, 1e-9) with warm-up and
cosine decay, label smoothing 0.1. At the end it translates the whole held-out test split (2,000
pairs) greedily and reports BLEU and exact match.

Hardware and time: one 2-core CPU, 400 steps. Measured (first run, dataset, tokenizer and XLA
cache built from scratch, machine shared with other jobs at load average ~6): 5 min 27 s wall,
3 min 56 s of it training at ~1.7 steps/s (~7k tokens/s); expect 3-4 minutes on a quiet machine.
Result: validation token accuracy 99.3% (perplexity 1.17); on the 2,000 held-out test pairs,
greedy decoding, BLEU 98.2 and exact match 95.9%.

    python train.py                      # = --config=configs/default.py --workdir=runs/default
"""

import ml_collections

from transformer_jax.data import default_dataset_config
from transformer_jax.training import with_defaults
from transformer_jax.training.optimizer import default_optimizer_config


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.num_train_steps = 400
    c.log_every_steps = 25
    c.eval_every_steps = 200
    c.checkpoint_every_steps = 200
    c.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1})

    c.dataset = default_dataset_config("enfr_builtin")  # 2,000-token shared BPE, 64 x 32 rows
    c.dataset.eval_split = "validation"  # periodic loss; BLEU on test_split at the end
    c.dataset.eval_batch_size = 256

    c.model = dict(
        vocab_size=c.dataset.vocab_size,
        d_model=128,
        num_heads=4,
        d_ff=512,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dropout_rate=0.0,
        max_len=64,
        norm="post",
    )

    c.optimizer = default_optimizer_config()
    c.optimizer.schedule = "cosine"
    c.optimizer.learning_rate = 2e-3
    c.optimizer.warmup_steps = 50
    c.optimizer.label_smoothing = 0.1

    c = with_defaults(c)
    c.test_split = "test"
    c.beam_size = 1  # greedy
    c.peak_tflops = 0.31  # this 2-core CPU in float32 (benchmarks/hardware.py), for the MFU estimate
    return c
