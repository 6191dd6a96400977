"""Transformer big on WMT 2014 English->German: the paper's Table 3 "big" recipe.

Model: N=6, d_model=1024, d_ff=4096, h=16, P_drop=0.3 (214M parameters with the shared 37k
vocabulary). Training as ``wmt14_ende_base`` (Adam(0.9, 0.98, 1e-9), rsqrt schedule, warm-up 4000,
label smoothing 0.1, ~25k+25k tokens per batch) for 300k steps; params and optimizer state
sharded with FSDP over all devices; bf16 compute, float32 master weights. Average the last 20
checkpoints (section 6.1). The paper wrote them 10 minutes apart (~600 steps at its 1.0 s/step, ~12k
steps in all); this config saves every 1,000 steps, so its last 20 span 19k steps: for the paper's
spacing, add ``--config.checkpoint_every_steps=600``.

Hardware and time: the paper took 3.5 days on 8 P100 GPUs (1.0 s/step); about a day on 8 H100s
or a TPU v4-32 slice. Expected result: newstest2014 BLEU about 28 (paper: 28.4), beam 4, alpha 0.6.

    python train.py --config=configs/wmt14_ende_big.py --config.dataset.data_dir=DIR
    python -m transformer_jax.training.average --workdir=runs/wmt14_ende_big --last=20
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from wmt14_ende_base import wmt14_config  # noqa: E402

from transformer_jax import presets  # noqa: E402


def get_config():
    model = presets.transformer_big(vocab_size=37000, max_len=256, dtype="bfloat16")
    c = wmt14_config(model, num_train_steps=300_000)
    c.mesh.data, c.mesh.fsdp = 1, -1  # shard params and Adam moments over every device
    return c
