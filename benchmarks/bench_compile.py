"""Compile time of the training step against depth, with and without `scan_layers`.

    python benchmarks/bench_compile.py --depths 2 6 12 24

GPT-2-small-shaped decoder (d_model 768, 12 heads), batch 8 x 256 packed rows, float32, Adam; the
step is the training loop's own (`training.steps.train_step`: loss, gradients, update and the guard
that keeps a non-finite step out of the state), lowered from abstract shapes (nothing is allocated)
and compiled with the persistent compilation cache off. Reports trace+lower seconds and XLA compile
seconds separately.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# The checkout ahead of any installed copy: `python benchmarks/<script>.py` runs this tree's code.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import optax

import transformer_jax as tj
from benchmarks.cli import positive_int
from transformer_jax.params import build_model
from transformer_jax.training import steps
from transformer_jax.training.state import TrainState

try:
    from benchmarks.bench_model import abstract_state, make_batch
except ImportError:
    from bench_model import abstract_state, make_batch


def _packed_batch(config, batch: int, length: int) -> dict:
    """Abstract token rows with the segment ids and positions of the training pipeline's batches."""
    rows = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    keys = ["targets"] + (["inputs"] if config.num_encoder_layers else [])
    return {f"{k}{suffix}": rows for k in keys for suffix in ("", "_segment_ids", "_positions")}


def compile_time(depth: int, scan: bool, batch: int = 8, length: int = 256) -> dict:
    """The train step compiled with the persistent compilation cache off, even where a cache folder
    is set (JAX_COMPILATION_CACHE_DIR, common on TPU hosts): JAX decides whether to use the cache at
    the first compile of a process, so the switch alone, after the run's matmul probes, left it on,
    and the rows timed loads from it. Resetting the cache makes the next compile decide again."""
    from jax.experimental.compilation_cache import compilation_cache

    cached = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        return _compile_time(depth, scan, batch, length)
    finally:
        jax.config.update("jax_enable_compilation_cache", cached)
        compilation_cache.reset_cache()


def _compile_time(depth: int, scan: bool, batch: int, length: int) -> dict:
    config = tj.presets.gpt2_small(num_decoder_layers=depth, scan_layers=scan, dropout_rate=0.0,
                                    attention_dropout_rate=0.0)
    model = build_model(config)
    params = abstract_state(model, config, make_batch(config, 1, 8))
    tx = optax.adam(1e-4)
    state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
                       opt_state=jax.eval_shape(tx.init, params),
                       rng=jax.eval_shape(lambda: jax.random.PRNGKey(0)))
    settings, schedule = steps.StepSettings(), optax.constant_schedule(1e-4)
    train_step = lambda s, b: steps.train_step(s, b, model=model, tx=tx, schedule=schedule, settings=settings)
    step = jax.jit(train_step, donate_argnums=0)
    start = time.perf_counter()
    lowered = step.lower(state, _packed_batch(config, batch, length))
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
    parser.add_argument("--depths", type=positive_int, nargs="+", default=[2, 6, 12, 24])
    args = parser.parse_args()
    bench(args.depths)


if __name__ == "__main__":
    main()
