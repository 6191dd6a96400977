"""The performance suite at accelerator size, in one script that writes JSON (GPU or TPU).

    python benchmarks/accelerator.py --out accelerator.json     # on the GPU/TPU machine
    python benchmarks/accelerator.py --smoke --out smoke.json   # the same code, tiny sizes, any CPU

Needs only jax, flax, optax and this repository: synthetic batches, random weights, nothing
downloaded. One run measures the device's own limits and each workload against them:

  checks     the platform's fused attention (with what 'auto' picks) and the chunked one against the
             reference path (forward and gradients; causal, packed and key-padding masks), and cached
             greedy decoding against recomputing the sequence each step: passed or not, per row
  hardware   peak bf16 matmul FLOP/s (the fastest of 8192^2, 8192 x 4096 x 8192 and 8192 x 768 x 3072
             products with float32 output, one a call, and of a chain of eight bf16 8192^2 products in
             one call) and memory bandwidth (the faster of a jitted sum and a matrix-vector product
             over 4 GiB), each the higher of a measurement at the start and at the end
  train      a ~350M-parameter decoder (24 layers, d_model 1024, 16 heads, GPT-2's 50257-token
             vocabulary with its table padded to 50304 rows) on 8 x 2048 tokens on one device, bf16
             compute with float32 master weights, scan_layers, dots_saveable remat, cuDNN attention on
             GPU / Pallas flash on TPU: tokens/s and MFU (target: MFU >= 0.45 of the measured bf16 peak)
  decode     a ~1.3B decoder (d_model 2048, d_ff 8192, 24 layers; `--decode-model 7b`: a 7B-shaped
             one, d_model 4096, d_ff 16384, 32 layers) with bf16 weights, cached greedy
             decoding of 256 new tokens after a 32-token prompt at batch 1 and 8: ms/step and the
             fraction of the bandwidth roofline (parameters + the KV cache up to each step's own
             position, read once per step; target at batch 1: >= 0.6), with the weights stored
             [in, out] and [out, in] (`kernel_layout`), at batch 1 with the one-row products
             also run as two rows (`matmul.SINGLE_ROW`), and with each layer's query, key and value
             kernels stored as one (`fused_qkv`; see DECODE_VARIANTS)
  attention  causal attention, batch 1, 16 heads of 64, bf16, at 4k / 16k / 32k tokens for the
             platform's fused kernel, XLA's and the chunked one: forward ms and peak memory

Each section, and each row of the decode and attention sections, is guarded: an error is recorded in
the JSON and the next row still runs. With --out the file is rewritten (atomically) after every row,
so a run killed at a time limit keeps everything measured before it; no row starts after --budget-s
(default 420 s, for a 10-minute limit), and `--only` runs only some sections (a rerun). Nothing here
imports the data stack (grain, tensorflow-datasets, ml_collections): a machine with only jax, flax
and optax runs it.
`--smoke` shrinks every size (a 2-layer model, 256 tokens) so the whole path runs on CPU in about a
minute; tests/test_benchmarks.py runs it. Without it, a jax with no GPU or TPU is refused
(`--allow-cpu` runs the full sizes on the CPU anyway).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import transformer_jax as tj  # noqa: E402
from benchmarks import bench_attention, bench_decode, bench_model, hardware  # noqa: E402
from benchmarks.cli import check_out_file, non_negative_float, write_json  # noqa: E402

SECTIONS = ("checks", "train", "decode", "attention")
OPTIONAL_SECTIONS = ("profile",)  # run only when named in --only

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
# A 7B-shaped decoder (LLaMA-7B's widths with GPT-2's vocabulary, ~6.7B parameters, 13 GB in bf16)
# for `--decode-model 7b`: the bandwidth a batch-1 step reaches when every weight product is large.
DECODE_7B = dict(vocab_size=50257, pad_vocab_multiple=128, d_model=4096, num_heads=32, d_ff=16384,
                 num_decoder_layers=32, max_len=2048)
SMOKE = dict(model=dict(vocab_size=500, pad_vocab_multiple=128, d_model=64, num_heads=4,
                        d_ff=128, num_decoder_layers=2, max_len=256),
             decode_model=dict(vocab_size=500, pad_vocab_multiple=128, d_model=96, num_heads=4,
                               d_ff=192, num_decoder_layers=2, max_len=256),
             # 128 new tokens: a step of this model takes ~0.05 ms, and with 16 the time left after
             # subtracting the prefill (~1.5 ms) was noise under load (a ratio of 178,865 once).
             batch=2, length=128, new_tokens=128, peak_n=512, bandwidth_mib=64,
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
    """The peak is the faster of single products with float32 outputs and a chain of bf16 ones in
    one call: the higher reading, so the stricter denominator for MFU."""
    single = hardware.peak_matmul_flops("bfloat16", n=sizes["peak_n"], repeats=5)
    chained = hardware.peak_matmul_chain_flops("bfloat16", n=sizes["peak_n"], repeats=5)
    return dict(peak_bf16_flops=max(single, chained), peak_single_flops=single, peak_chain_flops=chained,
                bandwidth_bytes_s=hardware.memory_bandwidth(mib=sizes["bandwidth_mib"], repeats=5))


def train_section(sizes: dict, platform: str, limits: dict, remat: str = "dots_saveable") -> list[dict]:
    config = model_config(sizes, platform, remat=remat)
    row = bench_model.bench_train(config, sizes["batch"], sizes["length"], steps=sizes["train_steps"],
                                  peak_flops=limits["peak_bf16_flops"])
    return [dict(row, attention_impl=config.attention_impl, remat=remat)]


def decoding_model(sizes: dict, platform: str, model_name: str):
    """(config, model, random bf16 params) of the decoding model: ~1.3B, or with `model_name` '7b'
    (outside the smoke sizes) the 7B-shaped one."""
    if model_name == "7b" and sizes is not SMOKE:
        sizes = dict(sizes, decode_model=DECODE_7B)
    # Decoding attends one query over the cache: XLA reads the heads-first [B, N, S, K] cache in
    # place, where the cuDNN call takes [B, S, N, K] and would copy every layer's cache each step.
    config = model_config(sizes, platform, "decode_model", param_dtype="bfloat16",
                          scan_layers=False, remat="none", attention_impl="xla")
    model = tj.TransformerLM(config)
    return config, model, bench_decode.random_params(model, jnp.ones((1, 8), jnp.int32), dtype=jnp.bfloat16)


# The decode section's rows: (kernel_layout, matmul.SINGLE_ROW, batch[, fused_qkv]). A batch-1
# step's products have one row, which XLA:GPU turns into a multiply and a reduction below ~10M
# weight elements (the 1.3B model's attention projections), summing down the columns of an
# [in, out] weight and along the rows of an [out, in] one; 'two_rows' keeps them matrix products.
# `ModelConfig.fused_qkv` (True) stores each layer's Q/K/V kernels as one: a step then launches one
# product for them where it launched three. Baseline first, then the batch-1 variants (the target's
# batch: a run that spends its --budget-s leaves out the last rows), then batch 8.
DECODE_VARIANTS = (("in_out", "vector", 1), ("in_out", "vector", 1, True), ("in_out", "two_rows", 1),
                   ("out_in", "vector", 1), ("out_in", "vector", 1, True), ("out_in", "two_rows", 1),
                   ("in_out", "vector", 8), ("in_out", "vector", 8, True), ("out_in", "vector", 8))


def _stored(layout: str, fused: bool) -> str:
    """How a variant stores the weights, for error messages: 'out_in', 'in_out with fused_qkv'."""
    return f"{layout} with fused_qkv" if fused else layout


def variant_key(variant) -> tuple:
    """(kernel_layout, single_row, batch, fused_qkv) of a DECODE_VARIANTS entry."""
    layout, single_row, batch, *fused = variant
    return layout, single_row, batch, bool(fused and fused[0])


def decode_variants(sizes: dict, platform: str, model_name: str, variants=DECODE_VARIANTS, model=None):
    """Yields (config, model, params, kernel_layout, single_row, batch, fused_qkv, error) for each
    variant, with
    matmul.SINGLE_ROW set (and the compilation caches cleared, since the setting is read when a
    step is traced) until the next one. The same random weights in every layout: the `out_in` and
    `fused_qkv` parameters are the `in_out` ones converted (`tj.params.convert_params`; the config
    says which). `error` is None, or
    why the weights could not be converted to the variant's layout (out of memory, say), in which
    case the variant is not to be run but the ones after it still come. `model`: (config, model,
    params) to use instead of the decode section's model."""
    from transformer_jax.modeling import matmul

    config, model, params = model or decoding_model(sizes, platform, model_name)
    before = matmul.SINGLE_ROW
    try:
        for variant in variants:
            layout, single_row, batch, fused = variant_key(variant)
            if (layout, fused) != (config.kernel_layout, config.fused_qkv):
                target = config.replace(kernel_layout=layout, fused_qkv=fused)
                try:
                    converted = tj.params.convert_params(params, config, target)
                except Exception as e:
                    yield config, model, params, layout, single_row, batch, fused, f"{type(e).__name__}: {e}"
                    continue
                config, model, params = target, tj.TransformerLM(target), converted
            matmul.SINGLE_ROW = single_row
            jax.clear_caches()
            yield config, model, params, layout, single_row, batch, fused, None
    finally:
        matmul.SINGLE_ROW = before
        jax.clear_caches()


def decode_section(sizes: dict, platform: str, limits: dict, model_name: str = "1.3b"):
    """Yields one row per variant (DECODE_VARIANTS; an error row where one fails)."""
    for config, model, params, layout, single_row, batch, fused, error in decode_variants(sizes, platform,
                                                                                          model_name):
        try:
            if error:
                raise RuntimeError(f"converting the weights to {_stored(layout, fused)}: {error}")
            prompt = jax.random.randint(jax.random.key(1), (batch, bench_decode.PROMPT), 3,
                                        config.vocab_size)
            lengths = jnp.full((batch,), bench_decode.PROMPT, jnp.int32)
            row = bench_decode.lm_row(config, model, params, prompt, lengths, sizes["new_tokens"],
                                      limits["bandwidth_bytes_s"], 3)
        except Exception as e:  # the next variant may still run where this one failed
            row = dict(batch=batch, error=f"{type(e).__name__}: {e}")
        yield dict(row, model=f"accelerator_decoder_{model_name}", weights="bfloat16",
                   kernel_layout=layout, single_row=single_row, fused_qkv=fused)


def trace_summary(trace_dir: str, steps: int, top: int = 15) -> list[dict]:
    """Per thread of the profiler's trace (the device's streams on a GPU; XLA's threads on a CPU):
    events, their total time, events per decoding step, and the `top` op or kernel names by time."""
    import collections
    import glob
    import gzip

    [path] = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    with gzip.open(path) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name")}
    threads = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            where = f"{names.get((e['pid'], None), e['pid'])} / {names.get((e['pid'], e['tid']), e['tid'])}"
            threads[where].append(e)
    rows = []
    # The device's threads first (a GPU's streams: its kernels), then the host's, each by total time.
    order = lambda kv: (not kv[0].startswith("/device"), -sum(e.get("dur", 0) for e in kv[1]))
    for where, items in sorted(threads.items(), key=order):
        by_name = collections.defaultdict(lambda: [0, 0.0])
        for e in items:
            by_name[e["name"]][0] += 1
            by_name[e["name"]][1] += e.get("dur", 0)
        ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
        rows.append(dict(thread=where, events=len(items), events_per_step=round(len(items) / steps, 1),
                         total_ms=round(sum(e.get("dur", 0) for e in items) / 1e3, 3),
                         top=[dict(name=n[:120], count=c, total_us=round(t, 1), mean_us=round(t / c, 2))
                              for n, (c, t) in ranked]))
    return rows


def profile_section(sizes: dict, platform: str, model_name: str = "1.3b"):
    """Where a batch-1 decoding step's time goes, for each batch-1 variant of the decode section:
    `steps` cached greedy steps under the profiler, summarised per thread (`trace_summary`). Not in
    the default run (`--only profile`)."""
    import tempfile

    from transformer_jax.decoding import generate

    steps = 8 if sizes is SMOKE else 32
    variants = [v for v in DECODE_VARIANTS if v[2] == 1]
    for config, model, params, layout, single_row, _, fused, error in decode_variants(sizes, platform,
                                                                                      model_name, variants):
        if error:
            yield dict(model=f"accelerator_decoder_{model_name}", batch=1, kernel_layout=layout,
                       single_row=single_row, fused_qkv=fused,
                       error=f"converting the weights to {_stored(layout, fused)}: {error}")
            continue
        prompt = jax.random.randint(jax.random.key(1), (1, bench_decode.PROMPT), 3, config.vocab_size)
        lengths = jnp.full((1,), bench_decode.PROMPT, jnp.int32)

        def run(model=model, params=params, config=config, prompt=prompt, lengths=lengths):
            cache = tj.init_cache(config, 1, bench_decode.PROMPT + steps)
            return generate(tj.LMStep(model), params, cache, prompt, lengths, max_new_tokens=steps,
                            eos_id=None)

        jax.block_until_ready(run())  # compiled outside the trace
        with tempfile.TemporaryDirectory() as trace_dir:
            jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
            try:
                jax.block_until_ready(run())
            finally:
                jax.profiler.stop_trace()
            for row in trace_summary(trace_dir, steps)[:4]:
                yield dict(row, model=f"accelerator_decoder_{model_name}", batch=1, steps=steps,
                           kernel_layout=layout, single_row=single_row, fused_qkv=fused)


def attention_section(sizes: dict, platform: str):
    """Yields one row per (length, backend); a backend that fails at one length (out of memory in
    XLA's autotuning of a 32k x 32k product, say) is an error row, and the others still run."""
    impls = dict.fromkeys((fused_attention_impl(platform), "xla", "chunked"))
    for length in sizes["attention_lengths"]:
        for impl in impls:
            try:
                yield bench_attention.bench_one(impl, length, heads=sizes["attention_heads"],
                                                dtype="bfloat16", memory_budget=32 * 2**30)
            except Exception as e:
                yield dict(impl=impl, length=length, error=f"{type(e).__name__}: {e}")


def _attention_inputs(shape, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k, v, cotangent = (jax.random.normal(key, shape, jnp.float32) for key in keys)
    return tuple(x.astype(dtype) for x in (q, k, v)), cotangent


def attention_check(impl: str, mask_name: str, *, dtype="bfloat16", length=512, heads=8, head_dim=64):
    """One backend against the reference einsum path on the same inputs: the output and the
    gradients of <out, cotangent> with respect to q, k and v. The reference runs in float32 at the
    highest matmul precision (no TF32 on a GPU); the error is the largest absolute difference over
    the largest reference magnitude, against a tolerance set by the compute dtype."""
    from transformer_jax.modeling import dot_product_attention, masks

    batch = 2
    (q, k, v), cotangent = _attention_inputs((batch, length, heads, head_dim), jnp.dtype(dtype))
    if mask_name == "causal":
        mask = masks.causal_spec(length)
    elif mask_name == "causal_packed":  # two documents per row, split at different places
        split = jnp.array([[length // 3], [length // 2]])
        mask = masks.causal_spec(length, (jnp.arange(length)[None] >= split).astype(jnp.int32) + 1)
    elif mask_name == "key_padding":  # bidirectional, the second row's last quarter padding
        valid = jnp.arange(length)[None] < jnp.array([[length], [3 * length // 4]])
        mask = masks.bidirectional_spec(length, length, kv_valid=valid)
    else:
        raise ValueError(mask_name)

    def loss(q, k, v, impl):
        out = dot_product_attention(q, k, v, mask, impl=impl)[0]
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    grad = jax.jit(jax.grad(loss, (0, 1, 2), has_aux=True), static_argnums=3)
    got_grads, got = grad(q, k, v, impl)
    with jax.default_matmul_precision("highest"):
        wide = tuple(x.astype(jnp.float32) for x in (q, k, v))
        want_grads, want = grad(*wide, "reference")
    errors = {}
    for name, a, b in [("out", got, want)] + list(zip(("dq", "dk", "dv"), got_grads, want_grads)):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        errors[name] = float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))
    tolerance = 3e-2 if jnp.dtype(dtype).itemsize == 2 else 1e-3
    from transformer_jax.modeling.attention import resolve_impl

    resolved = {name: resolve_impl(name, q_length=length, kv_length=length, mask=mask, dtype=jnp.dtype(dtype),
                                   head_dim=head_dim) for name in (impl, "auto")}
    return dict(check=f"attention {impl} vs reference", impl_ran=resolved[impl], auto_picks=resolved["auto"],
                mask=mask_name, dtype=dtype,
                length=length, relative_errors={key: round(e, 6) for key, e in errors.items()},
                tolerance=tolerance, passed=all(e <= tolerance for e in errors.values()))


def _check_decoder():
    """(config, model, params) of a small float32 decoder with weights of unit gain (1/sqrt(fan-in))
    and norm scales around 1, so that the greedy choice varies from step to step (small initial
    weights repeat one token)."""
    # XLA's products on a CPU too (the native kernels take one-row products before SINGLE_ROW is read).
    config = tj.presets.tiny(num_encoder_layers=0, vocab_size=256, d_model=128, num_heads=4, d_ff=256,
                             num_decoder_layers=3, max_len=64, cpu_kernels="xla")
    model = tj.TransformerLM(config)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, 8), jnp.int32))["params"]
    paths, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(jax.random.key(3), len(paths))

    def draw(key, path, leaf):
        d = jax.random.normal(key, leaf.shape, jnp.float32)
        if "scale" in jax.tree_util.keystr(path):
            return 1.0 + 0.3 * d
        return d / (jnp.sqrt(leaf.shape[0]) if leaf.ndim > 1 else 10.0)

    params = jax.tree.unflatten(treedef, [draw(key, path, leaf) for key, (path, leaf) in zip(keys, paths)])
    return config, model, params


def decode_check():
    """Cached greedy decoding against recomputing the whole sequence every step (no cache), on a
    small float32 decoder at the highest matmul precision: the same tokens, and log-probabilities
    within 1e-4. A ragged batch of prompts (right-padded)."""
    from transformer_jax.decoding import generate, pad_prompts
    from transformer_jax.decoding.model_steps import LMStep, RecomputeLMStep, recompute_cache

    config, model, params = _check_decoder()
    tokens, lengths = pad_prompts([[5, 17, 3, 40, 9, 22], [7], [12, 0, 33, 80]])
    steps = 12
    width = tokens.shape[1] + steps
    with jax.default_matmul_precision("highest"):
        cached = generate(LMStep(model), params, tj.init_cache(config, 3, width), tokens, lengths,
                          max_new_tokens=steps, eos_id=None)
        full = generate(RecomputeLMStep(model), params, recompute_cache(3, width), tokens, lengths,
                        max_new_tokens=steps, eos_id=None)
    same = bool(jnp.all(cached.tokens == full.tokens))
    error = float(jnp.max(jnp.abs(cached.logprobs - full.logprobs)))
    return dict(check="cached greedy decoding vs full recomputation", dtype="float32",
                tokens_equal=same, logprob_max_abs_diff=round(error, 8), tolerance=1e-4,
                distinct_tokens=len(set(jnp.ravel(cached.tokens).tolist())),
                passed=same and error <= 1e-4)


def single_row_check():
    """Batch-1 cached greedy decoding of `_check_decoder` with its one-row products run as two rows
    (matmul.SINGLE_ROW='two_rows', as the decode section's variants do) against one row, with
    weights stored `in_out` and `out_in`, and with Q/K/V stored as one kernel (`fused_qkv`) in both, at
    the highest matmul precision: the same tokens, and log-probabilities within 1e-4."""
    from transformer_jax.decoding import generate, pad_prompts
    from transformer_jax.decoding.model_steps import LMStep

    tokens, lengths = pad_prompts([[5, 17, 3, 40, 9, 22]])
    steps = 12
    variants = [(layout, mode, 1) for layout in ("in_out", "out_in") for mode in ("vector", "two_rows")]
    variants += [(layout, "vector", 1, True) for layout in ("out_in", "in_out")]
    out = {}
    with jax.default_matmul_precision("highest"):
        runs = decode_variants(None, None, None, variants, _check_decoder())
        for config, model, params, layout, mode, _, fused, error in runs:
            if error:
                raise RuntimeError(f"converting the weights to {_stored(layout, fused)}: {error}")
            cache = tj.init_cache(config, 1, tokens.shape[1] + steps)
            out[layout, mode, config.fused_qkv] = generate(LMStep(model), params, cache, tokens, lengths,
                                                           max_new_tokens=steps, eos_id=None)
    base = out["in_out", "vector", False]
    same = all(bool(jnp.all(o.tokens == base.tokens)) for o in out.values())
    error = max(float(jnp.max(jnp.abs(o.logprobs - base.logprobs))) for o in out.values())
    return dict(check="batch-1 decoding: two-row products, out_in and fused_qkv weights vs one row, in_out",
                dtype="float32", tokens_equal=same, logprob_max_abs_diff=round(error, 8), tolerance=1e-4,
                passed=same and error <= 1e-4)


def checks_section(sizes: dict, platform: str):
    """Correctness on the device before its speed: the platform's fused attention (with what 'auto'
    picks for the same inputs) and the chunked one against the reference path, for causal, packed
    and key-padding masks, cached decoding against recomputation, and batch-1 decoding in the decode
    section's variants against its baseline. One row each; an error is that row's alone."""
    fused = fused_attention_impl(platform)
    cases = [(impl, mask) for impl in (fused, "chunked")
             for mask in ("causal", "causal_packed", "key_padding")]
    length = 128 if sizes is SMOKE else 512
    for impl, mask in cases:
        try:
            yield attention_check(impl, mask, length=length)
        except Exception as e:
            yield dict(check=f"attention {impl} vs reference", mask=mask, error=f"{type(e).__name__}: {e}",
                       passed=False)
    checks = ((decode_check, "cached greedy decoding vs full recomputation"),
              (single_row_check, "batch-1 decoding: two-row products, out_in and fused_qkv weights"))
    for check, name in checks:
        try:
            yield check()
        except Exception as e:
            yield dict(check=name, error=f"{type(e).__name__}: {e}", passed=False)


def _measured(row: dict, *keys: str) -> bool:
    return "error" not in row and all(key in row for key in keys)


def summary(results: dict, limits: dict) -> list[dict]:
    """One line per target: measured ratio, target, met."""
    lines = []
    checks = results.get("checks", {}).get("rows") or []
    if checks:
        failed = [f"{row['check']} ({row.get('mask', row.get('dtype'))})" for row in checks
                  if not row["passed"]]
        lines.append(dict(workload="correctness checks", passed=len(checks) - len(failed), total=len(checks),
                          failed=failed, met=not failed))
    for train in results.get("train", {}).get("rows") or []:
        if not _measured(train, "mfu"):
            continue
        mfu = train.get("mfu_exact", train["mfu"])
        lines.append(dict(workload="train ~350M decoder bf16", tokens_per_s=train["tokens_per_s"],
                          ratio=train["mfu"], target=TARGETS["train_mfu"], met=mfu >= TARGETS["train_mfu"],
                          ratio_causal=train.get("mfu_causal")))
    for row in results.get("decode", {}).get("rows") or []:
        if not _measured(row, "roofline_frac"):
            continue
        target = TARGETS["decode_b1_roofline"] if row["batch"] == 1 else None
        frac = row.get("roofline_frac_exact", row["roofline_frac"])
        variant = ", ".join(f"{key} {row[key]}" for key in ("kernel_layout", "single_row") if key in row)
        variant += ", fused_qkv" if row.get("fused_qkv") else ""
        lines.append(dict(workload=f"decode batch {row['batch']}" + (f" ({variant})" if variant else ""),
                          tokens_per_s=row["decode_tok_s"],
                          ratio=row["roofline_frac"], target=target,
                          met=None if target is None else frac >= target))
    return lines


def section(name: str, rows, results: dict, save, deadline: float | None = None) -> None:
    """Runs one section, recording each row as it comes (rows() is a list or a generator) and
    saving the report after it: an error, or the run killed at its time limit, keeps every row
    measured before it. A failing section is recorded; the next one still runs. Past `deadline`
    (time.monotonic()) no further row is started."""
    print(f"== {name}", flush=True)
    start = time.perf_counter()
    entry = results[name] = dict(rows=[])
    over = lambda: deadline is not None and time.monotonic() > deadline
    try:
        iterator = iter(rows()) if not over() else iter(())
        while not over():
            try:
                row = next(iterator)
            except StopIteration:
                break
            entry["rows"].append(row)
            entry["seconds"] = round(time.perf_counter() - start, 1)
            print(json.dumps(row, default=str), flush=True)
            save()
        else:
            entry["skipped"] = "time budget spent (--budget-s): later rows not run"
            print(entry["skipped"], flush=True)
    except Exception as e:
        entry.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        print(entry["error"], flush=True)
    entry["seconds"] = round(time.perf_counter() - start, 1)
    save()


def _hardware(sizes: dict, meta: dict, key: str) -> dict | None:
    """measure_hardware, its failure recorded in meta[key] rather than ending the run."""
    try:
        meta[key] = measure_hardware(sizes)
    except Exception as e:
        meta[key] = dict(error=f"{type(e).__name__}: {e}")
        print(f"== hardware: {meta[key]['error']}", flush=True)
    return None if "error" in meta[key] else meta[key]


def _software(device) -> dict:
    """Versions a figure depends on: the packages, the backend's own (the CUDA or TPU runtime, as
    the client reports it), and an NVIDIA driver where `nvidia-smi` answers."""
    import importlib.metadata
    import subprocess

    versions = {}
    for package in ("jaxlib", "flax", "optax"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    try:
        versions["platform_version"] = str(device.client.platform_version)
    except Exception:  # a backend without the attribute
        versions["platform_version"] = None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        lines = out.stdout.strip().splitlines() if out.returncode == 0 else []
        versions["driver"] = lines[0] if lines else None
    except (OSError, subprocess.SubprocessError):
        versions["driver"] = None
    return versions


def run(smoke: bool = False, save=None, sections=SECTIONS, budget_s: float | None = None,
        remat: str = "dots_saveable", decode_model: str = "1.3b") -> dict:
    """The whole suite; `save(report)` (if given) is called with the report so far after every
    row, so that a run cut short leaves what it measured. After `budget_s` seconds no new row is
    started: the end reading of the limits and the summary are still made."""
    deadline = None if not budget_s else time.monotonic() + budget_s
    sizes = SMOKE if smoke else FULL
    platform = jax.default_backend()
    device = jax.devices()[0]
    meta = dict(date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                platform=platform, device_kind=str(device.device_kind),
                device_count=jax.device_count(), jax=jax.__version__, smoke=smoke,
                xla_flags=os.environ.get("XLA_FLAGS", ""), remat=remat, decode_model=decode_model,
                **_software(device))
    results = {}
    report = dict(meta=meta, targets=TARGETS, results=results, summary=[])

    def checkpoint():  # the summary so far: ratios against the start reading until the end one
        report["summary"] = summary(results, {})
        if save:
            save(report)

    # Until the end reading exists, rows are set against the start reading (NaN if it failed: a
    # train row then falls back to bench_train's own peak measurement).
    first = _hardware(sizes, meta, "hardware_start")
    checkpoint()
    start = first or dict(peak_bf16_flops=None, bandwidth_bytes_s=float("nan"))
    runners = dict(checks=lambda: checks_section(sizes, platform),
                   train=lambda: train_section(sizes, platform, start, remat),
                   decode=lambda: decode_section(sizes, platform, start, decode_model),
                   attention=lambda: attention_section(sizes, platform),
                   profile=lambda: profile_section(sizes, platform, decode_model))
    for name in sections:
        section(name, runners[name], results, checkpoint, deadline)
    last = _hardware(sizes, meta, "hardware_end")
    readings = [r for r in (first, last) if r is not None]
    if readings:
        limits = {k: max(r[k] for r in readings) for k in readings[0]}
        # Ratios against the higher of the two measurements of each limit (conservative).
        # `*_exact`: unrounded, what the targets are judged on.
        for train in results.get("train", {}).get("rows") or []:
            if _measured(train, "achieved_tflops"):
                achieved = train.get("achieved_flops", train["achieved_tflops"] * 1e12)
                train["mfu_exact"] = achieved / limits["peak_bf16_flops"]
                train["mfu"] = round(train["mfu_exact"], 3)
                if "causal_share" in train:  # the masked half of causal attention left out
                    train["mfu_causal"] = round(train["mfu_exact"] * train["causal_share"], 3)
        for row in results.get("decode", {}).get("rows") or []:
            if _measured(row, "bytes_per_step", "decode_step_s"):
                row["roofline_frac_exact"] = (row["bytes_per_step"] / limits["bandwidth_bytes_s"]
                                              / row["decode_step_s"])
                row["roofline_frac"] = round(row["roofline_frac_exact"], 3)
        meta.update(peak_bf16_tflops=round(limits["peak_bf16_flops"] / 1e12, 2),
                    bandwidth_gb_s=round(limits["bandwidth_bytes_s"] / 1e9, 1))
    checkpoint()
    return report


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: the same code on any CPU")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run the full sizes even where jax has no GPU/TPU (hours on a CPU)")
    parser.add_argument("--out", default=None,
                        help="JSON file (default: print only), rewritten after every row")
    parser.add_argument("--only", nargs="+", choices=SECTIONS + OPTIONAL_SECTIONS, default=list(SECTIONS),
                        help="run only these sections (the hardware limits are always measured); "
                             "'profile' (a per-kernel breakdown of batch-1 decoding steps) runs only "
                             "when named")
    parser.add_argument("--budget-s", type=non_negative_float, default=420.0,
                        help="start no new row after this many seconds of the run (0: no limit), so "
                             "that the row in flight, the end reading of the limits and the summary "
                             "still fit in a 10-minute limit")
    parser.add_argument("--remat", default="dots_saveable", choices=["none", "dots_saveable", "full"],
                        help="the training model's rematerialisation policy")
    parser.add_argument("--decode-model", default="1.3b", choices=["1.3b", "7b"],
                        help="the decoding model: ~1.3B (d_model 2048) or 7B-shaped (d_model 4096)")
    args = parser.parse_args()
    # Checked before the run (minutes on an accelerator), not after it, where a bad path would lose
    # every measurement.
    check_out_file(parser, args.out)
    if not args.smoke and not args.allow_cpu and jax.default_backend() == "cpu":
        # The likeliest way here is an accelerator machine whose jax lacks its CUDA/TPU plugin: the
        # full sizes (a ~350M-parameter training step on 8 x 2048 tokens) would run for hours.
        parser.error("jax found no GPU or TPU (its backend is 'cpu'): install jax's CUDA or TPU "
                     "plugin, or pass --smoke for the tiny sizes (--allow-cpu runs the full sizes "
                     "on the CPU anyway)")
    save = (lambda report: write_json(args.out, report)) if args.out else None
    report = run(args.smoke, save=save, sections=tuple(args.only), budget_s=args.budget_s,
                 remat=args.remat, decode_model=args.decode_model)
    if save:
        save(report)
    print(json.dumps(dict(meta=report["meta"], summary=report["summary"]), indent=1, default=str))


if __name__ == "__main__":
    main()
