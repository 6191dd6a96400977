"""Transformer base on WMT 2014 English->German: the paper's Table 3 "base" recipe (section 5).

Model: N=6, d_model=512, d_ff=2048, h=8, P_drop=0.1, Post-LN, sinusoidal positions, one shared
37k BPE vocabulary for source, target and output (63M parameters). Training: Adam(0.9, 0.98, 1e-9),
the rsqrt schedule with 4,000 warm-up steps (Eq. 3), label smoothing 0.1, batches of ~25k source
+ ~25k target tokens (96 packed rows x 256 tokens each side), 100k steps; bf16 compute with float32
master weights. Checkpoints every 1,000 steps, the last 20 kept, for averaging the last 5.

Hardware and time: the paper took 12 hours on 8 P100 GPUs (0.4 s/step); expect about the same on
8 A100/H100 GPUs or a TPU v4-8 / v5e-8 slice. Expected result: newstest2013 perplexity about 4.9,
newstest2014 BLEU about 27 (paper: 27.3) with beam 4, alpha 0.6 and outputs of at most input
length + 50 tokens (section 6.1), after averaging the last 5 checkpoints.

Data: prepare once where TensorFlow and the internet are available:
``tfds build wmt14_translate/de-en --file_format=array_record --data_dir=DIR``.

    python train.py --config=configs/wmt14_ende_base.py --config.dataset.data_dir=DIR
    python -m transformer_jax.training.average --workdir=runs/wmt14_ende_base --last=5
"""

import ml_collections

from transformer_jax import presets
from transformer_jax.data import default_dataset_config
from transformer_jax.training import with_defaults
from transformer_jax.training.optimizer import default_optimizer_config


def wmt14_config(model, num_train_steps: int) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.num_train_steps = num_train_steps
    c.log_every_steps = 100
    c.eval_every_steps = 5000
    c.checkpoint_every_steps = 1000
    c.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1})
    c.dataset = default_dataset_config("wmt14_translate/de-en")  # English -> German by default
    c.dataset.vocab_size = 37000
    c.dataset.max_source_len = 256
    c.dataset.max_target_len = 256
    c.dataset.batch_size = 96  # x 256 = 24,576 token slots per side (section 5.1: ~25k)
    c.dataset.eval_batch_size = 96
    c.dataset.eval_split = "validation"  # newstest2013
    c.model = model.to_dict()
    c.optimizer = default_optimizer_config()  # the paper's Adam, rsqrt schedule, warmup 4000, ls 0.1
    c = with_defaults(c)
    c.max_checkpoints_to_keep = 20
    c.test_split = "test"  # newstest2014
    c.beam_size = 4
    c.beam_alpha = 0.6
    c.decode_max_len = 256
    c.decode_extra_len = 50  # section 6.1: at most input length + 50 tokens, and 256
    return c


def get_config() -> ml_collections.ConfigDict:
    model = presets.transformer_base(vocab_size=37000, max_len=256, dtype="bfloat16")
    return wmt14_config(model, num_train_steps=100_000)
