"""Compile time of the training step against depth, with and without `scan_layers`.

    python benchmarks/bench_compile.py --depths 2 6 12 24

GPT-2-small-shaped decoder (d_model 768, 12 heads), batch 8 x 256, float32; the step is lowered from
abstract shapes (nothing is allocated) and compiled with the persistent compilation cache off.
Reports trace+lower seconds and XLA compile seconds separately.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import optax

import transformer_jax as tj
from transformer_jax.params import build_model

try:
    from benchmarks.bench_model import abstract_state, make_batch, make_train_step
except ImportError:
    from bench_model import abstract_state, make_batch, make_train_step


def compile_time(depth: int, scan: bool, batch: int = 8, length: int = 256) -> dict:
    jax.config.update("jax_enable_compilation_cache", False)
    config = tj.presets.gpt2_small(num_decoder_layers=depth, scan_layers=scan, dropout_rate=0.0,
                                    attention_dropout_rate=0.0)
    model = build_model(config)
    data = make_batch(config, batch, length)
    params = abstract_state(model, config, data)
    tx = optax.adam(1e-4)
    opt_state = jax.eval_shape(tx.init, params)
    step = make_train_step(model, tx, False)
    start = time.perf_counter()
    lowered = step.lower(params, opt_state, data)
    traced = time.perf_counter() - start
    lowered.compile()
    total = time.perf_counter() - start
    return dict(layers=depth, scan=scan, lower_s=round(traced, 2), compile_s=round(total - traced, 2),
                total_s=round(total, 2))


def bench(depths, scans=(False, True)) -> list[dict]:
    rows = []
    for scan in scans:
        for depth in depths:
            rows.append(compile_time(depth, scan))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 6, 12, 24])
    args = parser.parse_args()
    bench(args.depths)


if __name__ == "__main__":
    main()
