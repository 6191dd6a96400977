"""Decoding speed: prefill and per-token decode throughput, with and without the KV cache.

    python benchmarks/bench_decode.py --quick            # ~2-3 minutes on a 2-core CPU
    python benchmarks/bench_decode.py --out decode.json  # adds 512 new tokens and batch 8 baselines

Models (random weights, float32 unless --dtype, kernel_layout from --kernel-layout): a
GPT-2-small-shaped decoder (tj.presets.gpt2_small)
and the paper's base encoder-decoder (tj.presets.transformer_base), 32-token prompts / sources.

For each (model, batch, new tokens) it reports
  compile_s         compiling the whole decode program (prefill + lax.scan loop),
  prefill_tok_s     prompt tokens processed per second by the single prefill call
                    (for the encoder-decoder: encoding the source),
  decode_tok_s      generated tokens per second over the scan (batch * steps / time),
  roofline_frac     time a step must take at least, reading every decoder parameter (one row per batch
                    row of a table read only by lookup: learned positions, an untied input
                    embedding) and the keys and values it attends to (the self-attention cache up to
                    its own position, on average over the timed steps, and all of the encoded
                    source's) once at the measured memory bandwidth, divided by the measured step
                    time. The cache is allocated for the whole generation; the positions not yet
                    written need not be read (this package's CPU attention kernel skips them, XLA's
                    attention reads them). The encoder's parameters and the cross-attention's
                    key and value projections are applied to the source before the steps.
  flops_per_step    2 per multiply-add of a step: each row through every matrix it reads, every
                    query head over the keys and values it attends to (benchmarks/run.py sets it
                    against the run's matmul peak: `compute_bound_ms`, `roofline_ceiling`).
The no-cache baseline runs the whole model over the full (prompt + new tokens) buffer each step
(static shapes, as a jit-compiled decoder without a cache must); its per-step cost does not depend on
the step, so a few steps measure it. `cache_speedup` = cached / no-cache decode tokens per second,
both at the longest run's new tokens (512; 128 with --quick).
The parameters are placed on transparent huge pages first, as the generate command does on a CPU
(`huge_pages_mb`: how much moved; `transformer_jax.decoding.huge_pages`).
Bandwidth is measured in the same run, at its start and end (`hardware.memory_bandwidth`: the
fastest of a jitted sum and a matrix-vector product over a 512 MiB float32 array, on ordinary and
on huge pages), because timings on a shared machine vary 1.5-2x: compare ratios from one run.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time

# The checkout ahead of any installed copy: `python benchmarks/<script>.py` runs this tree's code.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

import transformer_jax as tj
from benchmarks.cli import check_out_file, non_negative_int, positive_int, write_json
from benchmarks.hardware import memory_bandwidth
from transformer_jax.decoding.huge_pages import place_on_huge_pages
from transformer_jax.decoding.model_steps import (
    LMStep,
    RecomputeLMStep,
    Seq2SeqStep,
    encode_source,
    recompute_cache,
)
from transformer_jax.decoding.sampling import _generate_jit

PROMPT = 32


def tree_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def visible_cache_fraction(seen_first: int, steps: int, allocated: int) -> float:
    """The mean share of a self-attention cache of `allocated` positions that `steps` timed decoding
    steps attend to, the first seeing `seen_first` positions and each later one one more."""
    return (seen_first + (steps - 1) / 2) / allocated


def step_param_bytes(config, params, batch: int) -> int:
    """Bytes of the decoder's parameters that one decoding step of `batch` rows reads: all of them,
    except tables read only by lookup (learned positions; the input embedding when the output
    projection is a kernel of its own), of which a step reads one row per batch row. The encoder's
    parameters, and the cross-attention's key and value projections, are not read after the source
    is encoded."""
    total = 0
    for name, leaf in _step_leaves(params):
        size = leaf.size * leaf.dtype.itemsize
        lookup_only = _read_by_lookup(config, name)
        total += min(size, batch * leaf.shape[-1] * leaf.dtype.itemsize) if lookup_only else size
    return total


def _read_by_lookup(config, name: str) -> bool:
    return name.endswith("position_embed/embedding") or (
        not config.tie_output and name in ("embed/embedding", "target_embed/embedding"))


def _step_leaves(params):
    """(name, array) of every parameter a decoding step reads: not the encoder's, nor the
    cross-attention's key and value projections, which were applied to the encoded source once,
    before the first step (their results are in the cache)."""
    from flax.traverse_util import flatten_dict

    for path, leaf in flatten_dict(params).items():
        name = "/".join(str(p) for p in path)
        if not (name.startswith(("encoder/", "source_embed/"))
                or "/cross_attention/key/" in name or "/cross_attention/value/" in name):
            yield name, getattr(leaf, "value", leaf)  # LogicallyPartitioned boxes


def step_flops(config, params, batch: int, cached_elements: float) -> int:
    """Floating-point operations of one decoding step of `batch` rows, 2 per multiply-add: each row
    through every matrix of the decoder (its kernels and the tied output projection; not the tables
    read only by lookup, nor the encoder, nor vectors such as biases and norm scales), and every
    query head over the `cached_elements` key and value elements the step attends to (the query-key
    logits and the probabilities times the values; a cached head serves num_heads / num_kv_heads
    query heads). With the machine's matmul peak it bounds how fast the step can run, as its bytes
    and the bandwidth do."""
    matrices = 0
    for name, leaf in _step_leaves(params):
        last = name.rsplit("/", 1)[-1]
        if last == "kernel" or (last == "embedding" and not _read_by_lookup(config, name)):
            matrices += leaf.size
    queries_per_cached_head = config.num_heads // (config.num_kv_heads or config.num_heads)
    return round(2 * batch * matrices + 2 * queries_per_cached_head * cached_elements)


def tree_size(tree) -> int:
    return sum(x.size for x in jax.tree.leaves(tree))


def best_time(fn, repeats: int, setup=None) -> float:
    """Fastest of `repeats` runs of fn() (blocking on its result), in seconds. With `setup`, each
    run is fn(setup()), the result of setup() made ready before the clock starts (a fresh cache to
    fill, whose allocation is no part of what is timed)."""
    times = []
    for _ in range(repeats):
        args = () if setup is None else (jax.block_until_ready(setup()),)
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def random_params(model, *args, dtype):
    """Random weights of the right shapes: drawn in numpy on a CPU (no large compile), on the device
    elsewhere (numpy takes minutes for a 7B model's weights, a GPU well under a second)."""
    shapes = jax.eval_shape(model.init, jax.random.key(0), *args)["params"]
    if jax.default_backend() != "cpu":
        draw_on_device = jax.jit(lambda key, shape: (0.02 * jax.random.normal(key, shape)).astype(dtype),
                                 static_argnums=1)
        leaves, treedef = jax.tree.flatten(shapes)
        keys = jax.random.split(jax.random.key(0), len(leaves))
        drawn = [draw_on_device(key, leaf.shape) for key, leaf in zip(keys, leaves)]
        return jax.tree.unflatten(treedef, drawn)
    rng = np.random.default_rng(0)
    draw = lambda s: (rng.standard_normal(s.shape, np.float32) * 0.02).astype(dtype)
    return jax.tree.map(lambda s: jnp.asarray(draw(s)), shapes)


def timed_generate(step_fn, params, make_cache, prompt, lengths, steps, repeats, time_cache=False):
    """(compile seconds, best run seconds) of greedy generation with a fresh cache per run: the
    program `generate` runs, compiled once and timed as compiled (calling `generate` would compile
    it a second time: its jit cache is not filled by an explicit lowering). The cache is made
    before the clock starts, unless `time_cache` (where making it is work to count, such as
    encoding the source)."""
    dynamic = lambda: (params, make_cache(), prompt, lengths, jax.random.key(0), jnp.float32(1.0),
                       jnp.float32(1.0), jnp.int32(0), None)  # None: no per-row limits
    static = dict(max_new_tokens=steps, greedy=True, top_k=0, use_top_p=False, eos_id=None, pad_id=0)
    start = time.perf_counter()
    compiled = _generate_jit.lower(step_fn, *dynamic(), **static).compile()
    compile_s = time.perf_counter() - start
    jax.block_until_ready(compiled(*dynamic()))
    if time_cache:
        return compile_s, best_time(lambda: compiled(*dynamic()), repeats)
    return compile_s, best_time(lambda args: compiled(*args), repeats, setup=dynamic)


# A generation's steps must take at least this share of its time for their time to be the
# difference of two separately timed runs (the whole generation, its prefill): below it, outside
# load on one of the two runs can make up most of the difference.
MIN_STEPS_SHARE = 0.25


def steps_time(total_s: float, fixed_s: float, fixed: str) -> float:
    """The decoding steps' time in a generation that took `total_s` in all, of which its `fixed`
    part (timed on its own) took `fixed_s`. Raises ValueError where the steps' share is under
    MIN_STEPS_SHARE: the row is not measured, rather than a ratio made up of timing noise."""
    if total_s - fixed_s < MIN_STEPS_SHARE * total_s:
        raise ValueError(f"decoding steps not measured: the whole generation took {1e3 * total_s:.3f} ms "
                         f"and its {fixed} alone {1e3 * fixed_s:.3f} ms, leaving the steps under "
                         f"{MIN_STEPS_SHARE:.0%} of the time (more new tokens, or a quieter machine)")
    return total_s - fixed_s


def bench_lm(config, batches, new_tokens, no_cache_steps, bandwidth, repeats):
    model = tj.TransformerLM(config)
    params = random_params(model, jnp.ones((1, 8), jnp.int32), dtype=config.param_dtype)
    rows = []
    for batch in batches:
        prompt = jax.random.randint(jax.random.key(1), (batch, PROMPT), 3, config.vocab_size)
        lengths = jnp.full((batch,), PROMPT, jnp.int32)
        for steps in new_tokens:
            rows.append(lm_row(config, model, params, prompt, lengths, steps, bandwidth, repeats))
            print(json.dumps(rows[-1]), flush=True)
        if batch in no_cache_steps:
            # in the buffer of the longest cached run, which its speed-up is set against
            rows.append(bench_no_cache(model, params, prompt, lengths, no_cache_steps[batch],
                                       total_new=max(new_tokens)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def lm_row(config, model, params, prompt, lengths, steps, bandwidth, repeats):
    batch = prompt.shape[0]
    huge = place_on_huge_pages(params)  # as `python -m transformer_jax.generate` does on a CPU
    make_cache = lambda: tj.init_cache(config, batch, PROMPT + steps)
    prefill = jax.jit(LMStep(model))
    prefill_s = best_time(lambda cache: prefill(params, prompt, cache, lengths), repeats + 1,
                          setup=make_cache)
    compile_s, total_s = timed_generate(LMStep(model), params, make_cache, prompt, lengths, steps, repeats)
    decode_s = steps_time(total_s, prefill_s, "prefill") / (steps - 1)
    # The timed steps follow the prefill: the first attends to the prompt and its own position.
    visible = visible_cache_fraction(PROMPT + 1, steps - 1, PROMPT + steps)
    layers = jax.eval_shape(make_cache).layers  # shapes only: no cache is allocated to count it
    step_bytes = step_param_bytes(config, params, batch) + round(tree_bytes(layers) * visible)
    flops = step_flops(config, params, batch, tree_size(layers) * visible)
    return dict(
        model="gpt2_small",
        batch=batch,
        new_tokens=steps,
        compile_s=round(compile_s, 2),
        prefill_tok_s=round(batch * PROMPT / prefill_s, 1),
        decode_tok_s=round(batch / decode_s, 1),
        decode_step_ms=round(1e3 * decode_s, 2),
        decode_step_s=decode_s,  # unrounded, for ratios computed later (a tiny model's ms round to 0)
        bytes_per_step=step_bytes,
        flops_per_step=flops,
        roofline_frac=round(step_bytes / bandwidth / decode_s, 3),
        huge_pages_mb=round(huge.placed / 2**20),
    )


# Instructions whose profiler events enclose other instructions' events (a loop, a scanned stack of
# layers, a branch): not counted as time of their own.
_CONTAINERS = ("while", "conditional", "call")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_CALLED_LISTS = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")


def _instructions(hlo_text: str):
    """From a compiled program's text: (kinds, loops). kinds maps an instruction's name to what a
    profile row calls it: the target of a custom call (the package's kernels), else its name
    without the number ('convert_add_fusion', 'copy'); None for containers. loops maps each `while`
    of the entry computation to the names of every instruction its body and condition run,
    directly or through the computations they call."""
    kinds, members, calls, entry_whiles = {}, {}, {}, {}
    computation, entry = None, False
    for line in hlo_text.splitlines():
        head = re.match(r"(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head and not line.startswith(" "):
            computation, entry = head.group(2), bool(head.group(1))
            members[computation], calls[computation] = [], set()
            continue
        match = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*? ([\w\-]+)\(", line)
        if computation is None or not match:
            continue
        name, opcode = match.groups()
        called = set(_CALLED.findall(line))
        for group in _CALLED_LISTS.findall(line):
            called |= {c.strip().lstrip("%") for c in group.split(",") if c.strip()}
        members[computation].append(name)
        calls[computation] |= called
        target = re.search(r'custom_call_target="([^"]+)"', line)
        kinds[name] = None if opcode in _CONTAINERS else (target.group(1) if target
                                                          else re.sub(r"[.\d]+$", "", name))
        if entry and opcode == "while":
            entry_whiles[name] = called
    loops = {}
    for loop, roots in entry_whiles.items():
        seen, todo = set(), list(roots)
        while todo:
            c = todo.pop()
            if c in seen or c not in members:
                continue
            seen.add(c)
            todo.extend(calls[c])
        loops[loop] = {name for c in seen for name in members[c]}
    return kinds, loops


def profile_steps(config, batch: int = 8, steps: int = 32, top: int = 25) -> dict:
    """Where a cached greedy decoding step's time goes on XLA:CPU: one generation of `steps` new
    tokens after a PROMPT-token prompt (random weights on huge pages, as `lm_row` times them) run
    under `jax.profiler`; the events of the decoding loop's instructions (found in the compiled
    program's text) grouped by kind: the package's kernels by FFI target, XLA's own ops by
    instruction name without its number. Per step: each kind's calls and microseconds and its
    share of the busy time (the sum over all kinds, on every thread);
    `loop_ms_per_step` is the time from the loop's first op to its last per step (busy time plus
    the gaps between ops).
    The profiler slows a step down (by ~10-40% here); the shares carry over, the times less so."""
    import collections
    import glob
    import gzip
    import os
    import tempfile

    if jax.default_backend() != "cpu":
        raise ValueError("profile_steps summarises XLA:CPU's ops; on a GPU or TPU use "
                         "`python benchmarks/accelerator.py --only profile`")
    model = tj.TransformerLM(config)
    params = random_params(model, jnp.ones((1, 8), jnp.int32), dtype=config.param_dtype)
    place_on_huge_pages(params)
    prompt = jax.random.randint(jax.random.key(1), (batch, PROMPT), 3, config.vocab_size)
    lengths = jnp.full((batch,), PROMPT, jnp.int32)
    dynamic = lambda: (params, tj.init_cache(config, batch, PROMPT + steps), prompt, lengths,
                       jax.random.key(0), jnp.float32(1.0), jnp.float32(1.0), jnp.int32(0), None)
    static = dict(max_new_tokens=steps, greedy=True, top_k=0, use_top_p=False, eos_id=None, pad_id=0)
    compiled = _generate_jit.lower(LMStep(model), *dynamic(), **static).compile()
    kinds, loops = _instructions(compiled.as_text())
    jax.block_until_ready(compiled(*dynamic()))
    with tempfile.TemporaryDirectory() as trace_dir:
        args = dynamic()
        jax.profiler.start_trace(trace_dir)
        try:
            jax.block_until_ready(compiled(*args))
        finally:
            jax.profiler.stop_trace()
        [path] = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
        with gzip.open(path) as f:
            events = json.load(f)
    events = [e for e in (events["traceEvents"] if isinstance(events, dict) else events)
              if e.get("ph") == "X" and kinds.get(e.get("name")) is not None]
    # The decoding loop: of the entry computation's loops, the one whose instructions ran most often
    # (a loop's own event may end before its last iteration does, when the executor carries the
    # loop on elsewhere, so its events are picked by instruction, not by time).
    ran = collections.Counter(e["name"] for e in events)
    if not loops:
        raise RuntimeError("no decoding loop in the compiled program")
    body = max(loops.values(), key=lambda names: sum(ran[n] for n in names))
    by_kind = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e["name"] in body:
            by_kind[kinds[e["name"]]][0] += 1
            by_kind[kinds[e["name"]]][1] += e.get("dur", 0)
    inside = [e for e in events if e["name"] in body]
    start, end = min(e["ts"] for e in inside), max(e["ts"] + e.get("dur", 0) for e in inside)
    # The loop runs steps - 1 times: the prefill chooses the first new token.
    per_step = steps - 1
    busy_us = sum(t for _, t in by_kind.values())
    ranked = sorted(by_kind.items(), key=lambda kv: -kv[1][1])
    return dict(
        model="gpt2_small" if config.vocab_size == 50257 and config.d_model == 768 else "custom",
        batch=batch, steps=per_step, dtype=str(jnp.dtype(config.dtype)), kernel_layout=config.kernel_layout,
        cpu_kernels=config.cpu_kernels, loop_ms_per_step=round((end - start) / per_step / 1e3, 3),
        busy_ms_per_step=round(busy_us / per_step / 1e3, 3),
        ops_per_step=round(sum(c for c, _ in by_kind.values()) / per_step, 1),
        kinds=[dict(kind=k, calls_per_step=round(c / per_step, 2), us_per_step=round(t / per_step, 1),
                    share=round(t / busy_us, 4)) for k, (c, t) in ranked[:top]],
    )


def profile_table(row: dict) -> str:
    """`profile_steps`' result as a Markdown table."""
    lines = [f"{row['model']} {row['dtype']} `{row['kernel_layout']}` batch {row['batch']}, "
             f"cpu_kernels={row['cpu_kernels']}: {row['loop_ms_per_step']} ms per step in the loop, "
             f"{row['busy_ms_per_step']} ms busy in {row['ops_per_step']} ops (under the profiler)",
             "", "| kind | calls per step | µs per step | share of busy time |", "|---|---|---|---|"]
    lines += [f"| {k['kind']} | {k['calls_per_step']:g} | {k['us_per_step']:.1f} | {k['share']:.1%} |"
              for k in row["kinds"]]
    return "\n".join(lines)


def gpt2_tensor_parallel_config(dtype, layout):
    """The GPT-2-small shape with its vocabulary padded to a multiple of 128 (50257 -> 50304 rows),
    so that a tensor mesh axis divides the table."""
    return tj.presets.gpt2_small(dropout_rate=0.0, dtype=dtype, param_dtype=dtype, kernel_layout=layout,
                                 pad_vocab_multiple=128)


def tensor_parallel_row(config, batch, steps, tensor, repeats=2):
    """`lm_row` with the model split over a tensor mesh of the first `tensor` devices (heads, d_ff
    and the vocabulary; the cache follows the heads). On a CPU, run it with one host device per
    core (``--xla_force_host_platform_device_count``). The row has no `roofline_frac`: the caller
    sets `bytes_per_step` against the machine's bandwidth, measured outside this process's split of
    the cores."""
    import flax.linen as nn

    from transformer_jax import parallel

    if jax.device_count() < tensor:
        raise SystemExit(f"--tensor-parallel {tensor}: only {jax.device_count()} devices; on a CPU "
                         f"set XLA_FLAGS=--xla_force_host_platform_device_count={tensor}")
    model = tj.TransformerLM(config)
    mesh = parallel.create_mesh(data=1, fsdp=1, tensor=tensor, devices=jax.devices()[:tensor])
    dummy = jnp.ones((1, 8), jnp.int32)
    boxed = jax.eval_shape(model.init, jax.random.key(0), dummy)
    prompt = jax.random.randint(jax.random.key(1), (batch, PROMPT), 3, config.vocab_size)
    lengths = jnp.full((batch,), PROMPT, jnp.int32)
    with parallel.sharding_context(mesh):
        params = jax.device_put(random_params(model, dummy, dtype=config.param_dtype),
                                parallel.logical_to_sharding(boxed, mesh)["params"])
        row = lm_row(config, model, nn.unbox(params), prompt, lengths, steps, 1.0, repeats)
    del row["roofline_frac"]  # against 1 byte/s here
    return dict(row, tensor_parallel=tensor, padded_vocab=config.padded_vocab_size)


def bench_no_cache(model, params, prompt, lengths, steps, total_new=512):
    """Per-step cost of decoding without a cache in a buffer of PROMPT + total_new tokens."""
    batch = prompt.shape[0]
    make_cache = lambda: recompute_cache(batch, PROMPT + total_new)
    compile_s, total_s = timed_generate(RecomputeLMStep(model), params, make_cache, prompt, lengths, steps, 1)
    step_s = total_s / steps  # the prefill call costs the same as a step here
    return dict(
        model="gpt2_small",
        batch=batch,
        new_tokens=total_new,
        cache=False,
        steps_measured=steps,
        compile_s=round(compile_s, 2),
        decode_tok_s=round(batch / step_s, 2),
        decode_step_ms=round(1e3 * step_s, 1),
    )


def bench_seq2seq(config, batches, new_tokens, bandwidth, repeats):
    model = tj.Transformer(config)
    ones = jnp.ones((1, 8), jnp.int32)
    params = random_params(model, ones, ones, dtype=config.param_dtype)
    rows = []
    for batch in batches:
        src = jax.random.randint(jax.random.key(2), (batch, PROMPT), 3, config.vocab_size)
        for steps in new_tokens:
            rows.append(seq2seq_row(config, model, params, src, steps, bandwidth, repeats))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def seq2seq_row(config, model, params, src, steps, bandwidth, repeats):
    batch = src.shape[0]
    huge = place_on_huge_pages(params)
    start = jnp.full((batch, 1), config.decoder_start_id, jnp.int32)
    encode = lambda: encode_source(model, params, src, steps)
    encode_s = best_time(encode, repeats + 1)
    ones = jnp.ones((batch,), jnp.int32)
    compile_s, total_s = timed_generate(Seq2SeqStep(model), params, encode, start, ones, steps, repeats,
                                        time_cache=True)
    decode_s = steps_time(total_s, encode_s, "encoding") / steps  # the timed run includes encoding
    cache = encode()
    # The first step attends to its own position; the encoded source's keys and values to all.
    visible = visible_cache_fraction(1, steps, steps)
    step_bytes = (step_param_bytes(config, params, batch) + round(tree_bytes(cache.layers) * visible)
                  + tree_bytes(cache.cross))
    flops = step_flops(config, params, batch, tree_size(cache.layers) * visible + tree_size(cache.cross))
    return dict(
        model="transformer_base",
        batch=batch,
        new_tokens=steps,
        compile_s=round(compile_s, 2),
        prefill_tok_s=round(batch * PROMPT / encode_s, 1),
        decode_tok_s=round(batch / decode_s, 1),
        decode_step_ms=round(1e3 * decode_s, 2),
        decode_step_s=decode_s,  # unrounded, for ratios computed later (a tiny model's ms round to 0)
        bytes_per_step=step_bytes,
        flops_per_step=flops,
        roofline_frac=round(step_bytes / bandwidth / decode_s, 3),
        huge_pages_mb=round(huge.placed / 2**20),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="128 new tokens only; no-cache at batch 1")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--kernel-layout", default="in_out", choices=["in_out", "out_in", "packed"],
                        help="ModelConfig.kernel_layout ('out_in' decodes faster on CPU; 'packed', "
                             "in bf16, faster still)")
    parser.add_argument("--repeats", type=positive_int, default=2)
    parser.add_argument("--tensor-parallel", type=non_negative_int, default=0, metavar="N",
                        help="only the GPT-2-small row split over a tensor mesh of N devices "
                             "(see tensor_parallel_row); prints that one row")
    parser.add_argument("--batch", type=positive_int, default=8, help="with --tensor-parallel or --profile")
    parser.add_argument("--steps", type=int, default=64,
                        help="new tokens, with --tensor-parallel or --profile")
    parser.add_argument("--profile", action="store_true",
                        help="only where a GPT-2-small decoding step's time goes (profile_steps), at "
                             "--batch, --dtype and --kernel-layout: prints a table and the JSON")
    args = parser.parse_args()
    if args.steps < 2:  # lm_row times steps - 1 decoding steps: the prefill makes the first token
        parser.error(f"--steps {args.steps}: at least 2 new tokens (the first comes from the prefill)")
    if args.profile and args.steps < 3:  # one decoding step is compiled without its loop
        parser.error(f"--steps {args.steps}: --profile needs at least 3 new tokens (a decoding loop "
                     "of two steps or more)")
    check_out_file(parser, args.out)
    if args.tensor_parallel:
        config = gpt2_tensor_parallel_config(args.dtype, args.kernel_layout)
        row = tensor_parallel_row(config, args.batch, args.steps, args.tensor_parallel, args.repeats)
        print(json.dumps(row))
        if args.out:
            write_json(args.out, row)
        return
    if args.profile:
        config = tj.presets.gpt2_small(dropout_rate=0.0, dtype=args.dtype, param_dtype=args.dtype,
                                       kernel_layout=args.kernel_layout)
        row = profile_steps(config, args.batch, args.steps)
        print(profile_table(row))
        print(json.dumps(row))
        if args.out:
            write_json(args.out, row)
        return

    bandwidth = memory_bandwidth()
    new_tokens = (128,) if args.quick else (128, 512)
    no_cache_steps = {1: 4} if args.quick else {1: 6, 8: 2}
    dtypes = dict(dtype=args.dtype, param_dtype=args.dtype, kernel_layout=args.kernel_layout)
    gpt2 = tj.presets.gpt2_small(dropout_rate=0.0, **dtypes)
    base = tj.presets.transformer_base(dropout_rate=0.0, **dtypes)
    lm_rows = bench_lm(gpt2, (1, 8), new_tokens, no_cache_steps, bandwidth, args.repeats)
    s2s_rows = bench_seq2seq(base, (1, 8), new_tokens, bandwidth, args.repeats)
    # Measured again at the end; the higher figure keeps roofline fractions conservative under load.
    later = memory_bandwidth()
    if later > bandwidth:
        for row in lm_rows + s2s_rows:
            if "roofline_frac" in row:
                row["roofline_frac"] = round(row["roofline_frac"] * bandwidth / later, 3)
        bandwidth = later
    speedup = {}
    for row in lm_rows:
        if row.get("cache") is False:
            cached = [r for r in lm_rows if r["batch"] == row["batch"] and "cache" not in r]
            best = next(r for r in cached if r["new_tokens"] == row["new_tokens"])  # 512; --quick 128
            speedup[f"batch{row['batch']}"] = dict(
                cached_tok_s=best["decode_tok_s"],
                cached_new_tokens=best["new_tokens"],
                no_cache_tok_s=row["decode_tok_s"],
                speedup=round(best["decode_tok_s"] / row["decode_tok_s"], 1),
            )
    result = dict(
        benchmark="decode",
        device=str(jax.devices()[0].device_kind),
        platform=jax.default_backend(),
        host=platform.machine(),
        jax=jax.__version__,
        dtype=args.dtype,
        kernel_layout=args.kernel_layout,
        prompt_tokens=PROMPT,
        memory_bandwidth_gb_s=round(bandwidth / 1e9, 1),
        results=lm_rows + s2s_rows,
        cache_speedup=speedup,
    )
    print(json.dumps(result, indent=1))
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
