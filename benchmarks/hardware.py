"""This machine's limits, measured in the same run as the workloads they are compared with.

    python benchmarks/hardware.py        # prints JSON: peak matmul FLOP/s (f32, bf16), bandwidth, load

Peak matmul: a jitted [n, n] x [n, n] product (bf16 inputs accumulate in float32, as the model's
matmuls do); memory bandwidth: a jitted sum over a 512 MiB float32 array (bytes read / time). Each is
the median of `repeats` timed runs; on a shared machine compare only ratios measured together.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp


def median_time(fn, repeats: int = 5) -> float:
    """Median wall time of fn() (blocking on its result) over `repeats` runs after one warm-up."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_matmul_flops(dtype="float32", n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a big jitted matmul in `dtype` (float32 accumulation)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
    matmul = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
    return 2 * n**3 / median_time(lambda: matmul(a, b), repeats)


def memory_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes per second read by a jitted reduction over a `mib` MiB float32 array."""
    x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    return x.nbytes / median_time(lambda: total(x), repeats)


def weight_streaming(rows: int, d_in: int = 768, d_out: int = 3072, count: int = 40,
                     repeats: int = 5, dtype: str = "float32", layout: str = "in_out") -> float:
    """Bytes per second of weights read by one jitted program that multiplies a [rows, d_in]
    activation by `count` distinct [d_in, d_out] matrices (~380 MiB in float32, more than the caches
    hold), stored as `layout` ('in_out': [d_in, d_out], x @ W; 'out_in': [d_out, d_in], through
    `matmul.contract_transposed` as the model runs it): the rate at which a decoding step's matmuls
    can stream parameters at batch `rows`, as opposed to `memory_bandwidth`, which no matmul kernel
    need reach."""
    from transformer_jax.modeling.matmul import contract, contract_transposed

    keys = jax.random.split(jax.random.key(0), count)
    shape = (d_in, d_out) if layout == "in_out" else (d_out, d_in)
    weights = [jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in keys]
    x = jnp.ones((rows, d_in), dtype)
    product = contract if layout == "in_out" else contract_transposed
    products = jax.jit(lambda x, ws: [product(x, w) for w in ws])
    return sum(w.nbytes for w in weights) / median_time(lambda: products(x, weights), repeats)


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def describe() -> dict:
    device = jax.devices()[0]
    return dict(platform=jax.default_backend(), device_kind=str(device.device_kind),
                device_count=jax.device_count(), host=platform.machine(), cpus=os.cpu_count(),
                jax=jax.__version__, xla_flags=os.environ.get("XLA_FLAGS", ""))


def measure(repeats: int = 5) -> dict:
    """Peak f32 / bf16 matmul FLOP/s and memory bandwidth, with the load average around them."""
    before = load()
    result = dict(
        matmul_f32_tflops=peak_matmul_flops("float32", repeats=repeats) / 1e12,
        matmul_bf16_tflops=peak_matmul_flops("bfloat16", repeats=repeats) / 1e12,
        bandwidth_gb_s=memory_bandwidth(repeats=repeats) / 1e9,
    )
    return dict({k: round(v, 4) for k, v in result.items()}, load_before=before, load_after=load())


if __name__ == "__main__":
    print(json.dumps(dict(describe(), **measure()), indent=1))
