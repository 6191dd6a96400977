"""This machine's limits, measured in the same run as the workloads they are compared with.

    python benchmarks/hardware.py        # prints JSON: peak matmul FLOP/s (f32, bf16), bandwidth, load

Peak matmul: the fastest of a few jitted products ([n, n] x [n, n], [n, n/2] x [n/2, n] and the
GPT-2-small feed-forward shape [n, 768] x [768, 3072]; bf16 inputs accumulate in float32, as the
model's matmuls do): XLA:CPU's bf16 kernel runs some shapes markedly faster than the square.
Memory bandwidth: the fastest of a jitted sum and a matrix-vector product over a 512 MiB float32 array,
as allocated and on transparent huge pages (bytes read / time; the product reads ~12% faster on the
first CPU measured, huge pages ~7% faster on another). Each timing is the median of
`repeats` runs; on a shared machine compare only ratios measured together.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from functools import partial

# The checkout ahead of any installed copy: `python benchmarks/<script>.py` runs this tree's code.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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
    """FLOP/s of the fastest of a few big jitted matmuls in `dtype` (float32 accumulation): the
    [n, n] square, [n, n/2] x [n/2, n], and (n >= 768) the [n, 768] x [768, 3072] feed-forward
    product of GPT-2 small."""
    shapes = [(n, n, n), (n, n // 2, n)] + ([(n, 768, 3072)] if n >= 768 else [])
    matmul = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
    best = 0.0
    for m, k, cols in shapes:
        a = jax.random.normal(jax.random.key(0), (m, k), jnp.float32).astype(dtype)
        b = jax.random.normal(jax.random.key(1), (k, cols), jnp.float32).astype(dtype)
        best = max(best, 2 * m * k * cols / median_time(lambda a=a, b=b: matmul(a, b), repeats))
    return best


def peak_matmul_chain_flops(dtype="bfloat16", n: int = 8192, count: int = 8, repeats: int = 5) -> float:
    """FLOP/s of `count` dependent [n, n] x [n, n] products in one jitted call, each rounded to
    `dtype` before the next (the product a layer hands the next one): the cost of launching the call
    and waiting for it is spread over `count` products, where `peak_matmul_flops` times one product
    a call. The weight is scaled by 1/sqrt(n), so the values stay of order one along the chain."""
    @jax.jit
    def chain(x, w):
        return jax.lax.fori_loop(0, count, lambda i, x: jnp.matmul(x, w).astype(x.dtype), x)

    x = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    w = (jax.random.normal(jax.random.key(1), (n, n), jnp.float32) / n ** 0.5).astype(dtype)
    return 2 * count * n ** 3 / median_time(lambda: chain(x, w), repeats)


def memory_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes per second read from a `mib` MiB float32 array: the fastest of a jitted sum and a
    jitted matrix-vector product over it (the read a decoding step's weight products make), over
    the array as allocated and over a copy on transparent huge pages where the system has them
    (`place_on_huge_pages`, as decoding places its parameters)."""
    from transformer_jax.decoding.huge_pages import place_on_huge_pages

    total, matvec = jax.jit(jnp.sum), jax.jit(jnp.matmul)
    vector = jnp.ones((8192,), jnp.float32)

    def fastest_read(x, matrix):
        return min(median_time(lambda: total(x), repeats),
                   median_time(lambda: matvec(matrix, vector), repeats))

    x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    fastest = fastest_read(x, x.reshape(-1, 8192))
    del x
    x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    matrix = x.reshape(-1, 8192)  # its own buffer
    if place_on_huge_pages([x, matrix]).placed:
        fastest = min(fastest, fastest_read(x, matrix))
    return mib * 2**20 / fastest


def weight_streaming(rows: int, d_in: int = 768, d_out: int = 3072, count: int = 40,
                     repeats: int = 5, dtype: str = "float32", layout: str = "in_out",
                     cpu_kernels: str = "xla") -> float:
    """Bytes per second of weights read by one jitted program that multiplies a [rows, d_in]
    activation by `count` distinct [d_in, d_out] matrices in turn (~380 MiB in float32, more than the caches
    hold), stored as `layout` ('in_out': [d_in, d_out], through `matmul.contract`; 'out_in':
    [d_out, d_in], through `matmul.contract_transposed`; 'packed': [d_out, d_in] in tiles, through
    `matmul.contract_packed`), each as the model runs it, with the model's `cpu_kernels` setting
    (the native kernels of each layout where they run): the
    rate at which a decoding step's matmuls can stream parameters at batch `rows`, as opposed to
    `memory_bandwidth`, which no matmul kernel need reach."""
    from transformer_jax.decoding.huge_pages import place_on_huge_pages
    from transformer_jax.modeling.matmul import contract, contract_packed, contract_transposed

    keys = jax.random.split(jax.random.key(0), count)
    shape = (d_in, d_out) if layout == "in_out" else (d_out, d_in)
    weights = [jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in keys]
    place_on_huge_pages(weights)  # as decoding places its parameters
    x = jnp.ones((rows, d_in), dtype)
    # (random values: stored packed, they are any values in another order)
    transposed = contract_packed if layout == "packed" else contract_transposed
    product = partial(contract if layout == "in_out" else transposed, cpu_kernels=cpu_kernels)

    def chain(x, ws):
        # Each product's input comes from the one before, as layer follows layer in a step: XLA
        # may run independent products side by side, each then on one core (the native kernel's
        # helper thread is busy with the other product), which no decoding step does.
        for w in ws:
            x = (product(x, w)[:, :d_in] * 1e-3).astype(x.dtype)
        return x

    products = jax.jit(chain)
    return sum(w.nbytes for w in weights) / median_time(lambda: products(x, weights), repeats)


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def cpu_model() -> dict:
    """The CPU's model name and the vector extensions the kernels depend on (Linux), so that a
    report says which host it measured: hosts of one machine type differ 2x in bandwidth."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return dict(cpu_model=platform.processor() or None, cpu_flags=[])
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    flags = set(fields.get("flags", "").split())
    return dict(cpu_model=fields.get("model name"), cpu_flags=[f for f in wanted if f in flags])


def describe() -> dict:
    device = jax.devices()[0]
    return dict(platform=jax.default_backend(), device_kind=str(device.device_kind),
                device_count=jax.device_count(), host=platform.machine(), cpus=os.cpu_count(),
                jax=jax.__version__, xla_flags=os.environ.get("XLA_FLAGS", ""), **cpu_model())


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
