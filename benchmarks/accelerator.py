"""The performance suite at accelerator size, in one script that writes JSON (GPU or TPU).

    python benchmarks/accelerator.py --out accelerator.json     # on the GPU/TPU machine
    python benchmarks/accelerator.py --smoke --out smoke.json   # the same code, tiny sizes, any CPU

Needs only jax, flax, optax and this repository: synthetic batches, random weights, nothing
downloaded. One run measures the device's own limits and each workload against them:

  hardware   peak bf16 matmul FLOP/s (the fastest of 8192^2, 8192 x 4096 x 8192 and 8192 x 768 x 3072
             products, float32 accumulation) and memory bandwidth (the faster of a jitted sum and a
             matrix-vector product over 4 GiB), each the higher of a measurement at the start and at
             the end
  train      a ~350M-parameter decoder (24 layers, d_model 1024, 16 heads, GPT-2's 50257-token
             vocabulary with its table padded to 50304 rows) on 8 x 2048 tokens on one device, bf16
             compute with float32 master weights, scan_layers, dots_saveable remat, cuDNN attention on
             GPU / Pallas flash on TPU: tokens/s and MFU (target: MFU >= 0.45 of the measured bf16 peak)
  decode     a ~1.3B decoder (d_model 2048, d_ff 8192, 24 layers) with bf16 weights, cached greedy
             decoding of 256 new tokens after a 32-token prompt at batch 1 and 8: ms/step and the
             fraction of the bandwidth roofline (parameters + whole KV cache read once per step;
             target at batch 1: >= 0.6)
  attention  causal attention, batch 1, 16 heads of 64, bf16, at 4k / 16k / 32k tokens for the
             platform's fused kernel, XLA's and the chunked one: forward ms and peak memory

Each section is guarded: an error is recorded in the JSON and the next section still runs.
`--smoke` shrinks every size (a 2-layer model, 256 tokens) so the whole path runs on CPU in under a
minute; tests/test_benchmarks.py runs it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import transformer_jax as tj  # noqa: E402
from benchmarks import bench_attention, bench_decode, bench_model, hardware  # noqa: E402
from benchmarks.run import section  # noqa: E402

TARGETS = dict(train_mfu=0.45, decode_b1_roofline=0.60)

# GPT-2's vocabulary, its table padded to a multiple of 128 rows (50304) for the matmul tiles.
FULL = dict(model=dict(vocab_size=50257, pad_vocab_multiple=128, d_model=1024, num_heads=16,
                       d_ff=4096, num_decoder_layers=24, max_len=2048),
            # Decoding reads every weight per token; a bigger model (~1.3B, 2.6 GB in bf16) keeps
            # a step's bytes large against the fixed cost of launching its kernels.
            decode_model=dict(vocab_size=50257, pad_vocab_multiple=128, d_model=2048, num_heads=16,
                              d_ff=8192, num_decoder_layers=24, max_len=2048),
            batch=8, length=2048, new_tokens=256, peak_n=8192, bandwidth_mib=4096,
            attention_lengths=(4096, 16384, 32768), attention_heads=16, train_steps=5)
SMOKE = dict(model=dict(vocab_size=500, pad_vocab_multiple=128, d_model=64, num_heads=4,
                        d_ff=128, num_decoder_layers=2, max_len=256),
             decode_model=dict(vocab_size=500, pad_vocab_multiple=128, d_model=96, num_heads=4,
                               d_ff=192, num_decoder_layers=2, max_len=256),
             batch=2, length=128, new_tokens=16, peak_n=512, bandwidth_mib=64,
             attention_lengths=(256,), attention_heads=4, train_steps=2)


def fused_attention_impl(platform: str) -> str:
    """The platform's fused attention kernel (XLA's own fusion where there is none)."""
    return {"gpu": "cudnn", "tpu": "flash"}.get(platform, "xla")


def model_config(sizes: dict, platform: str, model: str = "model", **overrides) -> tj.ModelConfig:
    fields = dict(sizes[model], num_encoder_layers=0, dropout_rate=0.0, norm="pre",
                  activation="gelu", position="learned", dtype="bfloat16", scan_layers=True,
                  remat="dots_saveable", attention_impl=fused_attention_impl(platform))
    return tj.ModelConfig(**{**fields, **overrides})


def measure_hardware(sizes: dict) -> dict:
    return dict(peak_bf16_flops=hardware.peak_matmul_flops("bfloat16", n=sizes["peak_n"], repeats=5),
                bandwidth_bytes_s=hardware.memory_bandwidth(mib=sizes["bandwidth_mib"], repeats=5))


def train_section(sizes: dict, platform: str, limits: dict) -> list[dict]:
    config = model_config(sizes, platform)
    row = bench_model.bench_train(config, sizes["batch"], sizes["length"], steps=sizes["train_steps"],
                                  peak_flops=limits["peak_bf16_flops"])
    return [dict(row, attention_impl=config.attention_impl)]


def decode_section(sizes: dict, platform: str, limits: dict) -> list[dict]:
    # Decoding attends one query over the cache: XLA reads the heads-first [B, N, S, K] cache in
    # place, where the cuDNN call takes [B, S, N, K] and would copy every layer's cache each step.
    config = model_config(sizes, platform, "decode_model", param_dtype="bfloat16",
                          scan_layers=False, remat="none", attention_impl="xla")
    model = tj.TransformerLM(config)
    params = bench_decode.random_params(model, jnp.ones((1, 8), jnp.int32), dtype=jnp.bfloat16)
    rows = []
    for batch in (1, 8):
        prompt = jax.random.randint(jax.random.key(1), (batch, bench_decode.PROMPT), 3,
                                    config.vocab_size)
        lengths = jnp.full((batch,), bench_decode.PROMPT, jnp.int32)
        row = bench_decode.lm_row(config, model, params, prompt, lengths, sizes["new_tokens"],
                                  limits["bandwidth_bytes_s"], 3)
        rows.append(dict(row, model="accelerator_decoder", weights="bfloat16"))
    return rows


def attention_section(sizes: dict, platform: str) -> list[dict]:
    impls = dict.fromkeys((fused_attention_impl(platform), "xla", "chunked"))
    rows = []
    for length in sizes["attention_lengths"]:
        for impl in impls:
            rows.append(bench_attention.bench_one(impl, length, heads=sizes["attention_heads"],
                                                  dtype="bfloat16", memory_budget=32 * 2**30))
    return rows


def summary(results: dict, limits: dict) -> list[dict]:
    """One line per target: measured ratio, target, met."""
    lines = []
    for train in results.get("train", {}).get("rows") or []:
        lines.append(dict(workload="train ~350M decoder bf16", tokens_per_s=train["tokens_per_s"],
                          ratio=train["mfu"], target=TARGETS["train_mfu"],
                          met=train["mfu"] >= TARGETS["train_mfu"]))
    for row in results.get("decode", {}).get("rows") or []:
        target = TARGETS["decode_b1_roofline"] if row["batch"] == 1 else None
        lines.append(dict(workload=f"decode batch {row['batch']}", tokens_per_s=row["decode_tok_s"],
                          ratio=row["roofline_frac"], target=target,
                          met=None if target is None else row["roofline_frac"] >= target))
    return lines


def run(smoke: bool = False) -> dict:
    sizes = SMOKE if smoke else FULL
    platform = jax.default_backend()
    device = jax.devices()[0]
    meta = dict(date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                platform=platform, device_kind=str(device.device_kind),
                device_count=jax.device_count(), jax=jax.__version__, smoke=smoke)
    first = measure_hardware(sizes)
    results = {}
    section("train", lambda: train_section(sizes, platform, first), results)
    section("decode", lambda: decode_section(sizes, platform, first), results)
    section("attention", lambda: attention_section(sizes, platform), results)
    last = measure_hardware(sizes)
    limits = {k: max(first[k], last[k]) for k in first}
    # Ratios against the higher of the two measurements of each limit (conservative).
    for train in results["train"].get("rows") or []:
        train["mfu"] = round(train["achieved_tflops"] * 1e12 / limits["peak_bf16_flops"], 3)
    for row in results["decode"].get("rows") or []:
        row["roofline_frac"] = round(row["bytes_per_step"] / limits["bandwidth_bytes_s"]
                                     / row["decode_step_s"], 3)
    meta.update(peak_bf16_tflops=round(limits["peak_bf16_flops"] / 1e12, 2),
                bandwidth_gb_s=round(limits["bandwidth_bytes_s"] / 1e9, 1),
                hardware_start=first, hardware_end=last)
    return dict(meta=meta, targets=TARGETS, results=results, summary=summary(results, limits))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: the same code on any CPU")
    parser.add_argument("--out", default=None, help="JSON file (default: print only)")
    args = parser.parse_args()
    if args.out:
        # Checked before the run (minutes on an accelerator), not after it, where a bad path would
        # lose every measurement: a missing folder is made (as run.py makes --out-dir), a path that
        # cannot be written is refused before anything is measured.
        folder = os.path.dirname(os.path.abspath(args.out))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            parser.error(f"--out {args.out}: {e}")
        if os.path.isdir(args.out) or not os.access(folder, os.W_OK):
            parser.error(f"--out {args.out}: not a writable file path")
    report = run(args.smoke)
    text = json.dumps(report, indent=1, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(json.dumps(dict(meta=report["meta"], summary=report["summary"]), indent=1, default=str))


if __name__ == "__main__":
    main()
