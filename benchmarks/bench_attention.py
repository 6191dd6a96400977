"""Long-context attention: time and peak memory per backend at 1k-16k tokens.

    python benchmarks/bench_attention.py --lengths 1024 4096 16384

Causal self-attention, batch 1, 8 heads of 64 (the model's attention layer shape at d_model=512),
float32 (`--dtype bfloat16` for cuDNN on a GPU). Peak memory is XLA's own account of the compiled
program's temporary buffers (`compiled.memory_analysis().temp_size_in_bytes`; works on CPU, unlike
device memory stats) plus its arguments and outputs, for the forward pass and for forward+backward
(gradients of q, k, v). A program whose temporaries exceed --memory-budget is compiled (for its
memory figure) but not run.
Time: median forward pass.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# The checkout ahead of any installed copy: `python benchmarks/<script>.py` runs this tree's code.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

from benchmarks.cli import positive_float, positive_int
from benchmarks.hardware import median_time
from transformer_jax.modeling import dot_product_attention, masks
from transformer_jax.modeling.attention import impl_problem

IMPLS = ("reference", "xla", "chunked")


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    if m is None:
        return dict(temp_bytes=None, peak_bytes=None)
    peak = m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
    return dict(temp_bytes=int(m.temp_size_in_bytes), peak_bytes=int(peak))


def bench_one(impl: str, length: int, *, heads=8, head_dim=64, batch=1, dtype="float32",
              memory_budget=4 * 2**30, repeats=3) -> dict:
    shape = jax.ShapeDtypeStruct((batch, length, heads, head_dim), jnp.dtype(dtype))
    spec = masks.causal_spec(length)

    def forward(q, k, v):
        return dot_product_attention(q, k, v, spec, impl=impl)[0]

    def loss(q, k, v):
        return jnp.sum(forward(q, k, v).astype(jnp.float32))

    fwd = jax.jit(forward).lower(shape, shape, shape).compile()
    row = dict(impl=impl, length=length, forward=_memory(fwd))
    temp = row["forward"]["temp_bytes"] or 0
    if temp > memory_budget:
        row["forward_ms"] = None
        row["note"] = f"not run: temporaries {temp / 2**30:.1f} GiB > budget"
    else:
        q, k, v = (jax.random.normal(jax.random.key(i), shape.shape, shape.dtype) for i in range(3))
        seconds = median_time(lambda: fwd(q, k, v), repeats)
        row["forward_ms"] = round(1e3 * seconds, 3)
        flops = 4 * batch * heads * length * length * head_dim  # QK^T and PV over the full square
        row["forward_tflops"] = round(flops / seconds / 1e12, 3)  # from the unrounded time
        # The causal triangle only ((L+1)/2 keys a query on average): the work left to a kernel that
        # skips masked blocks, which the full-square rate above can show above the matmul peak.
        row["forward_tflops_causal"] = round(flops * (length + 1) / (2 * length) / seconds / 1e12, 3)
        del q, k, v
    # The gradient program is compiled for its memory figure only, after the forward pass is timed:
    # compiling it can fail where the forward pass ran (on a GPU, XLA autotunes each product on
    # buffers of its real size, [H, L, L] float32 logits in the dense backends), and the forward
    # time is kept then.
    try:
        bwd = jax.jit(jax.grad(loss, (0, 1, 2))).lower(shape, shape, shape).compile()
        row["train"] = _memory(bwd)
    except Exception as e:
        row["train"] = dict(error=f"{type(e).__name__}: {e}")
    return row


def bench(lengths, impls=IMPLS, **kwargs) -> list[dict]:
    rows = []
    for length in lengths:
        for impl in impls:
            rows.append(bench_one(impl, length, **kwargs))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=positive_int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--impls", nargs="+", default=list(IMPLS),
                        choices=["reference", "xla", "chunked", "cudnn", "flash"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="q, k and v (cuDNN, and 'flash' on a GPU, need bfloat16)")
    parser.add_argument("--memory-budget-gib", type=positive_float, default=4.0,
                        help="compile but do not run programs with more temporaries than this")
    args = parser.parse_args()
    for impl in args.impls:  # refused here, not by a traceback at the first row
        problem = impl_problem(impl, dtype=args.dtype, head_dim=64)
        if problem:
            parser.error(f"--impls {impl}: {problem.replace('ModelConfig.dtype=', '--dtype ')}")
    bench(args.lengths, args.impls, dtype=args.dtype, memory_budget=args.memory_budget_gib * 2**30)


if __name__ == "__main__":
    main()
