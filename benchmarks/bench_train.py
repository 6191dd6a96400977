"""Training-step throughput: steps/s, tokens/s and MFU of the jitted train step on synthetic batches.

    python benchmarks/bench_train.py --out /tmp/bench_train.json
    python benchmarks/bench_train.py --d_model 512 --layers 6 --batch 64 --length 128 --dtype bfloat16

Prints one JSON object (also written to --out): compile seconds, seconds per step, target+source
tokens per second, model TFLOP/s and MFU against --peak_tflops (per device; 0 = look it up).
"""

import argparse
import json
import os
import sys
import time

# The checkout ahead of any installed copy: `python benchmarks/<script>.py` runs this tree's code.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.cli import check_out_file, non_negative_float, non_negative_int, positive_int, write_json
from transformer_jax import parallel
from transformer_jax.config import ConfigError, ModelConfig
from transformer_jax.params import build_model
from transformer_jax.training import metrics, steps
from transformer_jax.training.optimizer import create_optimizer, default_optimizer_config
from transformer_jax.training.schedules import create_schedule
from transformer_jax.training.state import count_params, create_train_state

FIRST_TOKEN = 4  # ids below it are the special tokens (padding, EOS, BOS, unknown)


def synthetic_batch(batch: int, length: int, vocab: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for key in ("inputs", "targets"):
        out[key] = rng.integers(FIRST_TOKEN, vocab, (batch, length)).astype(np.int32)
        out[f"{key}_segment_ids"] = np.ones((batch, length), np.int32)
        out[f"{key}_positions"] = np.broadcast_to(np.arange(length, dtype=np.int32), (batch, length)).copy()
    return out


def model_config(args) -> ModelConfig:
    return ModelConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        d_ff=args.d_ff or 4 * args.d_model,
        num_heads=args.heads,
        num_encoder_layers=args.layers,
        num_decoder_layers=args.layers,
        dropout_rate=0.0,
        max_len=max(64, args.length),
        dtype=args.dtype,
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--d_model", type=positive_int, default=128)
    p.add_argument("--d_ff", type=non_negative_int, default=0, help="0 = 4 x d_model")
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--layers", type=positive_int, default=2)
    p.add_argument("--vocab", type=positive_int, default=2000)
    p.add_argument("--batch", type=positive_int, default=64)
    p.add_argument("--length", type=positive_int, default=32)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--steps", type=positive_int, default=10)
    p.add_argument("--peak_tflops", type=non_negative_float, default=0.0)
    p.add_argument("--out", default="")
    args = p.parse_args()
    check_out_file(p, args.out)
    if args.vocab <= FIRST_TOKEN:
        p.error(f"--vocab {args.vocab}: the synthetic tokens are ids {FIRST_TOKEN} and up, so at least "
                f"{FIRST_TOKEN + 1}")
    try:
        cfg = model_config(args)
    except ConfigError as e:  # e.g. --heads that do not divide --d_model
        p.error(str(e))
    model, opt = build_model(cfg), default_optimizer_config()
    tx, schedule = create_optimizer(opt, cfg.d_model, 1000), create_schedule(opt, cfg.d_model, 1000)
    mesh = parallel.create_mesh(data=-1)
    state, shardings = create_train_state(model, tx, mesh)
    fn = jax.jit(
        lambda s, b: steps.train_step(
            s, b, model=model, tx=tx, schedule=schedule, settings=steps.StepSettings()
        ),
        in_shardings=(shardings, parallel.batch_sharding(mesh)),
        donate_argnums=0,
    )
    with parallel.sharding_context(mesh):
        batch = parallel.shard_batch(synthetic_batch(args.batch, args.length, args.vocab), mesh)
        start = time.perf_counter()
        state, m = fn(state, batch)
        jax.block_until_ready(m)
        compile_s = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(args.steps):
            state, m = fn(state, batch)
        jax.block_until_ready(m)
        step_s = (time.perf_counter() - start) / args.steps
    flops = metrics.train_flops_per_step(cfg, args.batch, args.length, args.length)
    # The looked-up peaks are data-sheet 16-bit ones: off TPU, a float32 run gets an MFU only
    # against a --peak_tflops given for it.
    peak = metrics.peak_tflops_per_device(args.peak_tflops, args.dtype)
    result = {
        "device": jax.devices()[0].device_kind,
        "devices": jax.device_count(),
        "params": count_params(state.params),
        "compile_s": compile_s,
        "step_s": step_s,
        "tokens_per_s": 2 * args.batch * args.length / step_s,
        "model_tflops_per_s": flops / step_s / 1e12,
        "mfu": flops / step_s / (peak * 1e12 * jax.device_count()) if peak else None,
        "loss": float(jnp.asarray(m["loss"])),
        **vars(args),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
