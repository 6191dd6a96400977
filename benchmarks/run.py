"""The one benchmark entry point: every workload next to this machine's limits, measured in one run.

    python benchmarks/run.py --quick            # a few minutes on a 2-core CPU
    python benchmarks/run.py                    # the full set (longer: more lengths and depths)
    python benchmarks/accelerator.py            # on a GPU/TPU: the accelerator-sized suite (its own script)

Writes benchmarks/results/<date>-<HHMMSS>.json and .md and prints the Markdown table. Workloads:
  train     training step (fwd+bwd+Adam) tokens/s and MFU, GPT-2-small-shaped decoder and the paper's
            base encoder-decoder, batch 8 x 256 tokens on CPU, float32 and bfloat16
            (MFU formula: benchmarks/bench_model.py; peak = the measured matmul FLOP/s, same dtype)
  decode    cached greedy decoding of the GPT-2-small shape at batch 1 and 8 (bench_decode.py),
            float32 and bf16 weights, kernel_layout 'in_out', 'out_in' and (bf16) 'packed': fraction of the
            memory-bandwidth roofline (params + KV cache read once per step); on a CPU also bf16
            'out_in' batch 8 split over a 2-device tensor mesh, one host device per core, in a
            child process (the vocabulary padded to 50304 rows so that the mesh divides it)
  attention causal attention at 1k-16k tokens per backend: forward time and XLA's peak memory
  compile   train-step compile time at 2/6/12/24 layers, with and without scan_layers
Each train row's peak matmul FLOP/s (its dtype) and each decode row's bandwidth are measured just
before and just after it (the load changes by the minute), and the run also measures both at its
start and end. A row's limit is the highest reading of the whole run, so that a low reading under
outside load cannot flatter the row next to it; the JSON keeps the ratio against the readings next
to the row too (`mfu_adjacent`, `roofline_frac_adjacent`). The load average is recorded with each
section.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import traceback

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import jax  # noqa: E402

import transformer_jax as tj  # noqa: E402
from benchmarks import bench_attention, bench_compile, bench_model, hardware  # noqa: E402
from transformer_jax import host_memory  # noqa: E402
from transformer_jax.modeling import native  # noqa: E402

SECTIONS = ("train", "decode", "attention", "compile")
TARGETS = dict(mfu_gpt2_f32=0.55, bf16_speedup=1.5, decode_roofline=0.60, chunked_memory_ratio=1 / 8,
               chunked_slowdown=1.5, scan_compile_ratio=1.5)


def section(name, fn, results):
    print(f"== {name} (load {hardware.load()})", flush=True)
    start = time.perf_counter()
    try:
        results[name] = dict(load=hardware.load(), rows=fn())
    except Exception as e:  # a failing section is reported, the others still run
        results[name] = dict(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        print(results[name]["error"], flush=True)
    results[name]["seconds"] = round(time.perf_counter() - start, 1)


def mfu_peak(peaks: dict, dtype: str) -> float:
    """The matmul peak a row in ``dtype`` is set against: float32's for float32; for bf16 the faster
    of the two, since on a CPU without bf16 arithmetic the model multiplies bf16 widened to float32
    (`matmul.widen_bf16`) and XLA's bf16 kernel, which the bf16 probe times, is the slower one."""
    return peaks["float32"] if dtype == "float32" else max(peaks.values())


def train_rows(peaks, quick, batch=8, length=256):
    rows = []
    for model in ("gpt2_small", "transformer_base"):
        adjacent = {}  # the peaks measured next to this model's rows
        for dtype in ("float32", "bfloat16"):
            config = bench_model.PRESETS[model](dtype=dtype)
            # The load changes minute to minute: the peak is measured just before and just after
            # this row, and the higher of the two is its limit.
            before = hardware.peak_matmul_flops(dtype, repeats=3)
            row = bench_model.bench_train(config, batch, length, steps=3 if quick else 6,
                                          peak_flops=before)
            adjacent[dtype] = max(before, hardware.peak_matmul_flops(dtype, repeats=3))
            peak = mfu_peak(adjacent, dtype)
            row.update(peak_tflops=round(peak / 1e12, 4), mfu=round(row["achieved_flops"] / peak, 3),
                       dtype_peak_tflops=round(adjacent[dtype] / 1e12, 4))  # this dtype's own reading
            rows.append(dict(model=model, **row, load=hardware.load()))
            print(json.dumps(rows[-1]), flush=True)
    return rows


# (compute and weight dtype, kernel layout, batch sizes, ModelConfig.cpu_kernels) of the decoding
# rows. 'out_in' stores the kernels output axes first, which XLA:CPU streams faster at a few rows and
# the native kernels take (ModelConfig.kernel_layout); 'packed', in the tiles the native bf16 kernel
# reads fastest; the last row is the bf16 'out_in' step on XLA's kernels alone.
DECODE_VARIANTS = (("float32", "in_out", (1, 8), "auto"), ("float32", "out_in", (8,), "auto"),
                   ("bfloat16", "out_in", (1, 8), "auto"), ("bfloat16", "packed", (1, 8), "auto"),
                   ("bfloat16", "out_in", (8,), "xla"))


def decode_rows(quick):
    """Cached greedy decoding of the GPT-2-small shape through bench_decode (same roofline
    definition): bytes of the parameters and of the KV cache's visible positions per step, over the
    bandwidth."""
    from benchmarks import bench_decode

    rows = []
    for dtype, layout, batches, kernels in DECODE_VARIANTS:
        config = tj.presets.gpt2_small(dropout_rate=0.0, dtype=dtype, param_dtype=dtype,
                                       kernel_layout=layout, cpu_kernels=kernels)
        model = tj.TransformerLM(config)
        params = bench_decode.random_params(model, jax.numpy.ones((1, 8), jax.numpy.int32),
                                            dtype=config.param_dtype)
        for batch in batches:
            prompt = jax.random.randint(jax.random.key(1), (batch, bench_decode.PROMPT), 3,
                                        config.vocab_size)
            lengths = jax.numpy.full((batch,), bench_decode.PROMPT, jax.numpy.int32)
            steps = 64 if quick else 128
            before = hardware.memory_bandwidth(repeats=3)
            try:
                row = bench_decode.lm_row(config, model, params, prompt, lengths, steps, before, 2)
            except Exception as e:  # reported in the JSON and the table; the next row still runs
                rows.append(dict(dtype=dtype, kernel_layout=layout, batch=batch, cpu_kernels=kernels,
                                 error=f"{type(e).__name__}: {e}"))
                print(json.dumps(rows[-1]), flush=True)
                continue
            after = hardware.memory_bandwidth(repeats=3)
            # bench_decode's roofline fraction, against the higher of the two adjacent measurements;
            # `against_run_limits` sets it against the run's highest reading once the run is over.
            row["roofline_frac"] = round(row["roofline_frac"] * before / max(before, after), 3)
            row["bandwidth_gb_s"] = round(max(before, after) / 1e9, 2)
            # What this batch size's matmul kernels can stream in this dtype and layout: the step's
            # bytes at that rate, over the measured step time (1.0 = as fast as the kernels allow).
            stream = hardware.weight_streaming(batch, dtype=dtype, layout=layout, repeats=3,
                                               cpu_kernels=kernels)
            row["weight_stream_gb_s"] = round(stream / 1e9, 2)
            row["stream_frac"] = round(row["bytes_per_step"] / stream / row["decode_step_s"], 3)
            rows.append(dict(row, dtype=dtype, kernel_layout=layout, load=hardware.load(),
                             cpu_kernels=kernels, native=kernels != "xla" and native.available()))
            print(json.dumps(rows[-1]), flush=True)
    try:
        row = tensor_parallel_decode_row(quick)
    except Exception as e:  # reported in the JSON; the rows measured above are kept
        row = dict(TENSOR_PARALLEL_DECODE, error=f"{type(e).__name__}: {e}")
    if row is not None:
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# The batch-8 bf16 'out_in' row again with the model split over two devices of a tensor mesh, one
# host device per core on a CPU: XLA:CPU runs each device's attention on its own core.
TENSOR_PARALLEL_DECODE = dict(dtype="bfloat16", layout="out_in", batch=8, tensor=2)


def tensor_parallel_decode_row(quick):
    """`TENSOR_PARALLEL_DECODE` in a child process with one host device per core (the device count
    is fixed when jax starts), set against the bandwidth this process measures next to it. None
    off CPU (accelerator.py covers real devices) or on a one-core machine."""
    v = TENSOR_PARALLEL_DECODE
    if jax.default_backend() != "cpu" or (os.cpu_count() or 1) < v["tensor"]:
        return None
    flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={v['tensor']}"
    command = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_decode.py"),
               "--tensor-parallel", str(v["tensor"]), "--batch", str(v["batch"]),
               "--steps", str(64 if quick else 128), "--dtype", v["dtype"], "--kernel-layout", v["layout"]]
    before = hardware.memory_bandwidth(repeats=3)
    # The child runs a script from benchmarks/, so the package must be importable from the checkout
    # too, as it is here, where it may not be installed.
    path = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run(command, env=dict(os.environ, XLA_FLAGS=flags.strip(), PYTHONPATH=path),
                          capture_output=True, text=True, timeout=900)
    after = hardware.memory_bandwidth(repeats=3)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    bandwidth = max(before, after)
    row["roofline_frac"] = round(row["bytes_per_step"] / bandwidth / row["decode_step_s"], 3)
    row["bandwidth_gb_s"] = round(bandwidth / 1e9, 2)
    return dict(row, dtype=v["dtype"], kernel_layout=v["layout"], load=hardware.load())


def against_run_limits(results, peaks: dict, bandwidth_gb_s: float) -> tuple[dict, float]:
    """Sets every row against the machine's limit: the highest matmul peak (per dtype) and memory
    bandwidth measured anywhere in the run (at its start and end, and next to each row), so that
    one low reading under outside load cannot flatter the row next to it. The ratios against the
    readings next to each row are kept as `mfu_adjacent` / `roofline_frac_adjacent`. Returns the
    run's (peaks in TFLOP/s per dtype, bandwidth in GB/s)."""
    train = results.get("train", {}).get("rows", [])
    decode = [r for r in results.get("decode", {}).get("rows", []) if "error" not in r]
    # (a bf16 row's peak_tflops may be float32's, the faster: see mfu_peak)
    peaks = {dtype: max([peak] + [r.get("dtype_peak_tflops", r["peak_tflops"]) for r in train
                                  if r["dtype"] == dtype])
             for dtype, peak in peaks.items()}
    # Ratios are recomputed from the measured quantities where a row has them (rescaling the
    # rounded ratio would carry its rounding), else rescaled; `*_exact` keeps them unrounded, for
    # the targets (a ratio rounded up to the target is not the target met).
    for r in train:
        r["mfu_adjacent"] = r["mfu"]
        peak = mfu_peak(peaks, r["dtype"])
        if "achieved_flops" in r:
            r["mfu_exact"] = r["achieved_flops"] / (peak * 1e12)
        elif "achieved_tflops" in r:
            r["mfu_exact"] = r["achieved_tflops"] / peak
        else:
            r["mfu_exact"] = r["mfu"] * r["peak_tflops"] / peak
        r["mfu"] = round(r["mfu_exact"], 3)
        if "causal_share" in r:  # the MFU with the causal self-attention's masked half left out
            r["mfu_causal"] = round(r["mfu_exact"] * r["causal_share"], 3)
        r["run_peak_tflops"] = round(peak, 4)
    bandwidth_gb_s = max([bandwidth_gb_s] + [r["bandwidth_gb_s"] for r in decode])
    for r in decode:
        r["roofline_frac_adjacent"] = r["roofline_frac"]
        if "bytes_per_step" in r and "decode_step_s" in r:
            r["roofline_frac_exact"] = r["bytes_per_step"] / (bandwidth_gb_s * 1e9) / r["decode_step_s"]
        else:
            r["roofline_frac_exact"] = r["roofline_frac"] * r["bandwidth_gb_s"] / bandwidth_gb_s
        r["roofline_frac"] = round(r["roofline_frac_exact"], 3)
        r["run_bandwidth_gb_s"] = round(bandwidth_gb_s, 2)
        if "flops_per_step" in r and "bytes_per_step" in r:
            r.update(arithmetic_bound(r, peaks, bandwidth_gb_s))
    return peaks, bandwidth_gb_s


def arithmetic_bound(row, peaks: dict, bandwidth_gb_s: float) -> dict:
    """How far the arithmetic alone lets a decoding row go: its step's FLOPs at the run's fastest
    matmul rate for its dtype (float32: the float32 peak; bf16: the faster of the two peaks, since a
    CPU without bf16 arithmetic multiplies bf16 widened to float32) as `compute_bound_ms`, and
    `roofline_ceiling`, the roofline fraction a step would reach if it ran at the slower of that and
    the bandwidth, memory and arithmetic fully overlapped (1.0: the bytes bound it, not the FLOPs)."""
    peak = mfu_peak(peaks, row.get("dtype", "float32"))
    compute_s = row["flops_per_step"] / (peak * 1e12)
    memory_s = row["bytes_per_step"] / (bandwidth_gb_s * 1e9)
    return dict(compute_bound_ms=round(compute_s * 1e3, 2),
                roofline_ceiling=round(memory_s / max(memory_s, compute_s), 3))


def summarise(results, peaks, bandwidth) -> list[dict]:
    """The table: measured figure, the machine's limit (same run), ratio, target."""
    table = []

    def add(workload, measured, limit, ratio, target, note=""):
        """note starts with '≥' (higher is better) or '≤' (lower is better)."""
        met = None
        if ratio is not None and target is not None:
            met = bool(ratio <= target) if note.startswith("≤") else bool(ratio >= target)
        table.append(dict(workload=workload, measured=measured, limit=limit,
                          ratio=None if ratio is None else round(ratio, 3), target=target,
                          target_met=met, note=note))

    train = {(r["model"], r["dtype"]): r for r in results.get("train", {}).get("rows", [])}
    for (model, dtype), r in train.items():
        target = TARGETS["mfu_gpt2_f32"] if (model, dtype) == ("gpt2_small", "float32") else None
        kind = "float32" if dtype == "float32" else "bf16 or float32, the faster,"
        limit = f"{r.get('run_peak_tflops', r['peak_tflops']):.3f} TFLOP/s {kind} matmul"
        if "run_peak_tflops" in r:
            limit += f" (highest in the run; {r['peak_tflops']:.3f} next to the row)"
        add(f"train {model} {dtype} b{r['batch']}x{r['length']}", f"{r['tokens_per_s']} tok/s",
            limit, r.get("mfu_exact", r["mfu"]), target, "≥ MFU")
    for model in ("gpt2_small", "transformer_base"):
        if (model, "float32") in train and (model, "bfloat16") in train:
            speedup = train[(model, "bfloat16")]["tokens_per_s"] / train[(model, "float32")]["tokens_per_s"]
            add(f"train {model} bf16 / f32 tokens/s", f"{speedup:.2f}x",
                f"matmul peak ratio {peaks['bfloat16'] / peaks['float32']:.2f}x",
                speedup, TARGETS["bf16_speedup"], "≥ speed-up")
    for r in results.get("decode", {}).get("rows", []):
        if "error" in r:
            variant = (f"tensor={r['tensor']}" if "tensor" in r
                       else f"{r['dtype']} {r['kernel_layout']} cpu_kernels={r['cpu_kernels']}")
            add(f"decode gpt2_small {variant} b{r['batch']}", f"failed: {r['error']}", "", None, None)
            continue
        streaming = (f"; b{r['batch']} matmuls stream {r['weight_stream_gb_s']:.1f} GB/s, "
                     f"step at {r['stream_frac']:.2f} of that" if "stream_frac" in r else "")
        if "roofline_ceiling" in r:
            streaming += (f"; its FLOPs at the run's matmul peak take {r['compute_bound_ms']:.1f} ms, "
                          f"so at most {r['roofline_ceiling']:.2f}")
        variant = f"{r.get('dtype', 'float32')} {r.get('kernel_layout', 'in_out')}"
        xla_only = r.get("cpu_kernels") == "xla" or bool(r.get("cpu_kernels") and not r.get("native"))
        if xla_only:  # a comparison row: the step without the package's CPU kernels
            variant += " XLA kernels only"
        if r.get("tensor_parallel"):  # a multi-device mesh runs XLA's kernels (native.use_native)
            variant += f" tensor={r['tensor_parallel']} (XLA's kernels)"
        limit = f"{r.get('run_bandwidth_gb_s', r['bandwidth_gb_s']):.1f} GB/s"
        if "run_bandwidth_gb_s" in r:
            limit += f" (highest in the run; {r['bandwidth_gb_s']:.1f} next to the row)"
        add(f"decode gpt2_small {variant} b{r['batch']} ({r['new_tokens']} new)",
            f"{r['decode_tok_s']} tok/s ({r['decode_step_ms']} ms/step)",
            f"{limit}{streaming}", r.get("roofline_frac_exact", r["roofline_frac"]),
            TARGETS["decode_roofline"] if r["batch"] == 8 and not xla_only else None,
            "≥ of bandwidth roofline")
    attention = results.get("attention", {}).get("rows", [])
    by = {(r["impl"], r["length"]): r for r in attention}
    for length in sorted({r["length"] for r in attention}):
        ref, chunk = by.get(("reference", length)), by.get(("chunked", length))
        for impl in bench_attention.IMPLS:
            r = by.get((impl, length))
            if r is None:
                continue
            mem = r["forward"]["peak_bytes"]
            time_s = "not run" if r.get("forward_ms") is None else f"{r['forward_ms']} ms"
            measured = f"{time_s}, peak {_mib(r['forward'])} (train {_mib(r['train'])})"
            ratio, target, note = None, None, ""
            if (impl == "chunked" and ref is not None and length == max(r["length"] for r in attention)
                    and mem and ref["forward"]["peak_bytes"]):
                ratio = mem / ref["forward"]["peak_bytes"]
                target, note = TARGETS["chunked_memory_ratio"], "≤ memory / reference"
            add(f"attention {impl} causal L={length}", measured, "", ratio, target, note)
        if ref and chunk and ref.get("forward_ms") and chunk.get("forward_ms"):
            slowdown = chunk["forward_ms"] / ref["forward_ms"]
            add(f"attention chunked/reference time L={length}", f"{slowdown:.2f}x", "", slowdown,
                TARGETS["chunked_slowdown"], "≤ slow-down")
    compiles = {(r["scan"], r["layers"]): r["total_s"] for r in results.get("compile", {}).get("rows", [])}
    for scan in (False, True):
        depths = sorted(d for s, d in compiles if s == scan)
        for d in depths:
            add(f"compile train step {d} layers scan={scan}", f"{compiles[(scan, d)]} s", "", None, None)
        if len(depths) > 1:
            ratio = compiles[(scan, depths[-1])] / compiles[(scan, depths[0])]
            add(f"compile {depths[-1]}/{depths[0]} layers scan={scan}", f"{ratio:.2f}x", "", ratio,
                TARGETS["scan_compile_ratio"] if scan else None, "≤ compile-time ratio")
    return table


def _mib(memory: dict) -> str:
    """An attention row's memory figure: its peak in MiB, or why there is none (the program did not
    compile, or the backend reports no memory analysis)."""
    if memory.get("error"):
        return "not compiled: " + memory["error"].splitlines()[0][:80]
    if memory.get("peak_bytes") is None:
        return "peak not reported"
    return f"{memory['peak_bytes'] / 2**20:.0f} MiB"


def markdown(table, meta) -> str:
    lines = [f"Measured {meta['date']} on {meta['device_kind']} ({meta['cpus']} CPUs), jax {meta['jax']}; "
             f"load average {meta['load_start']} -> {meta['load_end']}; peaks in this run: "
             f"f32 matmul {meta['peaks']['float32']:.3f} TFLOP/s, bf16 {meta['peaks']['bfloat16']:.3f} "
             f"TFLOP/s, bandwidth {meta['bandwidth_gb_s']:.1f} GB/s.", "",
             "| workload | measured | limit (same run) | ratio | target | met |",
             "|---|---|---|---|---|---|"]
    for row in table:
        target = "" if row["target"] is None else f"{row['note'][:1]} {row['target']:.3g} ({row['note'][2:]})"
        met = {None: "", True: "yes", False: "no"}[row["target_met"]]
        ratio = "" if row["ratio"] is None else f"{row['ratio']:.3g}"
        cells = (row["workload"], row["measured"], row["limit"], ratio, target, met)
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer lengths, depths and repeats")
    # choices: a misspelt section would otherwise run nothing and write an empty table
    parser.add_argument("--only", nargs="+", default=None, choices=SECTIONS, metavar="SECTION",
                        help=f"sections to run: {' '.join(SECTIONS)}")
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    # Checked before the measuring (minutes), not after it, where a bad folder would lose it all.
    try:
        os.makedirs(args.out_dir, exist_ok=True)
    except OSError as e:
        parser.error(f"--out-dir {args.out_dir}: {e}")
    if not os.access(args.out_dir, os.W_OK | os.X_OK):
        parser.error(f"--out-dir {args.out_dir}: not a writable folder")
    wanted = set(args.only or SECTIONS)
    # As train.py does: large buffers on huge pages where glibc can (transformer_jax/host_memory.py).
    host_memory.restart_with_huge_page_malloc()

    meta = dict(hardware.describe(), date=datetime.datetime.now().isoformat(timespec="seconds"),
                quick=args.quick, load_start=hardware.load(),
                glibc_tunables=os.environ.get(host_memory.ENV))
    start_hw = hardware.measure(repeats=3 if args.quick else 5)
    peaks = dict(float32=start_hw["matmul_f32_tflops"], bfloat16=start_hw["matmul_bf16_tflops"])
    bandwidth = start_hw["bandwidth_gb_s"]
    results = {}
    if "train" in wanted:
        section("train", lambda: train_rows(peaks, args.quick), results)
    if "decode" in wanted:
        section("decode", lambda: decode_rows(args.quick), results)
    if "attention" in wanted:
        lengths = (1024, 4096, 16384) if args.quick else (1024, 2048, 4096, 8192, 16384)
        section("attention", lambda: bench_attention.bench(lengths), results)
    if "compile" in wanted:
        depths = (2, 24) if args.quick else (2, 6, 12, 24)
        section("compile", lambda: bench_compile.bench(depths), results)
    end_hw = hardware.measure(repeats=3 if args.quick else 5)
    # The highest measurement anywhere in the run is the limit: ratios stay conservative under
    # varying load.
    peaks, new_bandwidth = against_run_limits(
        results, dict(float32=max(peaks["float32"], end_hw["matmul_f32_tflops"]),
                      bfloat16=max(peaks["bfloat16"], end_hw["matmul_bf16_tflops"])),
        max(bandwidth, end_hw["bandwidth_gb_s"]))
    meta.update(load_end=hardware.load(), hardware_start=start_hw, hardware_end=end_hw, peaks=peaks,
                bandwidth_gb_s=new_bandwidth)
    table = summarise(results, peaks, new_bandwidth)
    text = markdown(table, meta)
    print(text, flush=True)  # on the screen first, whatever becomes of the files
    stem = os.path.join(args.out_dir, datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S"))
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, targets=TARGETS, results=results, table=table), f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(text)
    print(f"wrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    main()
