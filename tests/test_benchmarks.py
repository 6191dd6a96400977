"""The accelerator benchmark script runs end to end (tiny sizes, on CPU) and reports every figure;
the CPU suite's rows are set against the run's limits."""

import json
import math
import os
import types

import jax
import pytest

from benchmarks import accelerator

# The packages of requirements.txt that an accelerator machine with jax, flax, optax, orbax and
# sentencepiece need not have (and frameworks nothing here uses).
NOT_ON_ACCELERATOR = ("grain", "tensorflow_datasets", "array_record", "ml_collections", "tqdm",
                      "sacrebleu", "tensorflow", "torch", "transformers")
_BLOCKED_RUN = """
import importlib.abc, runpy, sys

class Missing(importlib.abc.MetaPathFinder):  # as if these were not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, Missing())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_accelerator_script_smoke_run_reports_every_section(tmp_path):
    """The script itself, as it runs on the accelerator machine (which has no data stack: grain,
    tensorflow-datasets, ml_collections, ...): every section measured, the report in --out."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "smoke.json"
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCKED_RUN.format(blocked=set(NOT_ON_ACCELERATOR)),
         os.path.join(repo, "benchmarks", "accelerator.py"), "--smoke", f"--out={out}"],
        env={**os.environ, "PYTHONPATH": repo}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    results = report["results"]
    for name in ("checks", "train", "decode", "attention"):
        assert "error" not in results[name], results[name].get("traceback")
        assert all("error" not in row for row in results[name]["rows"]), results[name]["rows"]
    [train] = results["train"]["rows"]
    assert train["attention_impl"] == accelerator.fused_attention_impl(report["meta"]["platform"])
    assert 0 < train["mfu"] < 1 and train["tokens_per_s"] > 0 and math.isfinite(train["loss"])
    # by the causal count, the masked half of the self-attention is no work: a lower MFU
    assert 0 < train["causal_share"] < 1
    assert train["mfu_causal"] == round(train["mfu_exact"] * train["causal_share"], 3) < train["mfu"]
    assert report["summary"][1]["ratio_causal"] == train["mfu_causal"]
    assert {"jaxlib", "flax", "optax", "platform_version", "driver"} <= set(report["meta"])
    assert report["meta"]["flax"] and report["meta"]["optax"]
    decode = {(row["kernel_layout"], row["single_row"], row["batch"], row["fused_qkv"]): row
              for row in results["decode"]["rows"]}
    assert list(decode) == [accelerator.variant_key(v) for v in accelerator.DECODE_VARIANTS]
    for row in decode.values():
        # bf16 weights: the roofline counts the bytes actually held, params + whole KV cache
        assert row["weights"] == "bfloat16" and row["decode_tok_s"] > 0
        # the tiny model's bytes stay in the processor's cache, and a bandwidth reading under the
        # other test worker's load can be low: above 1 is possible; a unit slip (bits, ms) is not
        assert 0 < row["roofline_frac"] < 10
    for layout in ("in_out", "out_in"):  # a bigger cache; the same weights in every layout
        assert (decode[layout, "vector", 8, False]["bytes_per_step"]
                > decode[layout, "vector", 1, False]["bytes_per_step"])
        one_row = decode["in_out", "vector", 1, False]["bytes_per_step"]
        assert decode[layout, "two_rows", 1, False]["bytes_per_step"] == one_row
        assert decode[layout, "vector", 1, True]["bytes_per_step"] == one_row
    impls = {row["impl"] for row in results["attention"]["rows"]}
    assert {"xla", "chunked"} <= impls
    for row in results["attention"]["rows"]:  # the causal rate counts the triangle, just over half
        if row.get("forward_ms"):
            share = (row["length"] + 1) / (2 * row["length"])
            expected = pytest.approx(share * row["forward_tflops"], rel=0.02, abs=2e-3)
            assert row["forward_tflops_causal"] == expected
    # the checks: every backend against the reference for three masks, cached decoding, and the
    # decode section's batch-1 variants
    checks = results["checks"]["rows"]
    assert len(checks) == 8 and all(row["passed"] for row in checks), checks
    assert {row["mask"] for row in checks if "mask" in row} == {"causal", "causal_packed", "key_padding"}
    assert [line.get("target") for line in report["summary"]] == [None, 0.45] + [
        0.6 if variant[2] == 1 else None for variant in accelerator.DECODE_VARIANTS]
    assert report["summary"][0] == dict(workload="correctness checks", passed=8, total=8, failed=[], met=True)
    assert [line["workload"] for line in report["summary"][3:5]] == [
        "decode batch 1 (kernel_layout in_out, single_row vector, fused_qkv)",
        "decode batch 1 (kernel_layout in_out, single_row two_rows)"]
    assert report["meta"]["peak_bf16_tflops"] > 0 and report["meta"]["bandwidth_gb_s"] > 0


def test_rows_are_set_against_the_highest_reading_of_the_run():
    from benchmarks import run

    row = dict(batch=8, new_tokens=64, decode_tok_s=350.0, decode_step_ms=22.9)
    results = {
        "train": {"rows": [dict(dtype="float32", peak_tflops=0.2, mfu=0.6, causal_share=0.75),
                           dict(dtype="float32", peak_tflops=0.3, mfu=0.5)]},
        # the first row's bandwidth was read low under outside load: 20 against 25 elsewhere
        "decode": {"rows": [dict(row, bandwidth_gb_s=20.0, roofline_frac=0.64),
                            dict(row, bandwidth_gb_s=25.0, roofline_frac=0.5)]},
    }
    peaks, bandwidth = run.against_run_limits(results, dict(float32=0.25, bfloat16=1.2), 24.0)
    assert peaks == dict(float32=0.3, bfloat16=1.2) and bandwidth == 25.0
    low, high = results["decode"]["rows"]
    assert low["roofline_frac"] == 0.512 and low["roofline_frac_adjacent"] == 0.64
    assert high["roofline_frac"] == 0.5 and high["run_bandwidth_gb_s"] == 25.0
    first, second = results["train"]["rows"]
    assert first["mfu"] == 0.4 and first["mfu_adjacent"] == 0.6 and second["mfu"] == 0.5
    assert first["mfu_causal"] == 0.3 and "mfu_causal" not in second  # 0.4 of which 3/4 is causal work
    table = run.summarise(results | {"train": {"rows": []}}, peaks, bandwidth)
    assert [line["ratio"] for line in table] == [0.512, 0.5]
    assert table[0]["target_met"] is False  # 0.64 against its own low reading would have met 0.6


def test_run_limits_recompute_ratios_from_the_measured_quantities():
    from benchmarks import run

    # 305 MB per 21.7 ms step: 0.468 against the 30 GB/s read next to it, 0.4448 against 31.6 GB/s.
    # Rescaling the rounded 0.468 would give 0.444; the ratio comes from the bytes and seconds.
    decode = dict(batch=8, new_tokens=64, bytes_per_step=305e6, decode_step_s=0.0217,
                  bandwidth_gb_s=30.0, roofline_frac=0.468)
    train = dict(dtype="float32", achieved_tflops=0.1802, peak_tflops=0.3, mfu=0.601)
    results = {"train": {"rows": [train]}, "decode": {"rows": [decode]}}
    run.against_run_limits(results, dict(float32=0.31, bfloat16=1.6), 31.6)
    assert decode["roofline_frac"] == 0.445 and decode["roofline_frac_adjacent"] == 0.468
    assert train["mfu"] == 0.581  # 0.1802 / 0.31 = 0.5813; rescaling 0.601 gives 0.5816


def test_decoding_roofline_counts_one_row_of_lookup_only_tables():
    import transformer_jax as tj
    from benchmarks import bench_decode

    ones = jax.numpy.ones((1, 8), jax.numpy.int32)
    # tied output: the token table is read whole by the output projection; the learned position
    # table [max_len, D] only at one row per batch row
    config = tj.presets.tiny(num_encoder_layers=0, position="learned", max_len=128)
    params = bench_decode.random_params(tj.TransformerLM(config), ones, dtype="float32")
    table = 128 * config.d_model * 4
    assert bench_decode.step_param_bytes(config, params, 3) == (
        bench_decode.tree_bytes(params) - table + 3 * config.d_model * 4)
    # untied: the input embedding is a lookup too; the output kernel is read whole
    config = config.replace(tie_output=False)
    params = bench_decode.random_params(tj.TransformerLM(config), ones, dtype="float32")
    vocab = config.padded_vocab_size * config.d_model * 4
    assert bench_decode.step_param_bytes(config, params, 3) == (
        bench_decode.tree_bytes(params) - table - vocab + 2 * 3 * config.d_model * 4)
    # encoder-decoder: nothing of the encoder (its layers, positions, source table) is read, nor the
    # cross-attention's key and value projections, applied to the encoded source before the steps
    config = tj.presets.tiny(position="learned", max_len=128, share_embeddings=False)
    params = bench_decode.random_params(tj.Transformer(config), ones, ones, dtype="float32")
    cross_kv = [params["decoder"][f"layer_{i}"]["cross_attention"][name] for i in range(2)
                for name in ("key", "value")]
    decoder_side = bench_decode.tree_bytes(params) - bench_decode.tree_bytes(
        (params["encoder"], params["source_embed"], cross_kv))
    assert bench_decode.step_param_bytes(config, params, 2) == decoder_side - table + 2 * config.d_model * 4


def test_decoding_flops_count_every_matrix_once_per_row_and_the_attention():
    import transformer_jax as tj
    from benchmarks import bench_decode

    ones = jax.numpy.ones((1, 8), jax.numpy.int32)
    d, ff, vocab = 32, 64, 64  # tiny: 4 heads of 8, 2 layers
    # decoder-only: per layer Q, K, V, out (d x d each) and the feed-forward's two; the tied table
    # once, as the output projection; biases, norms and the position table are no matrices
    config = tj.presets.tiny(num_encoder_layers=0, position="learned", max_len=128)
    params = bench_decode.random_params(tj.TransformerLM(config), ones, dtype="float32")
    matrices = 2 * (4 * d * d + 2 * d * ff) + vocab * d
    assert bench_decode.step_flops(config, params, 3, 100) == 2 * 3 * matrices + 2 * 100
    # grouped-query: K and V at 2 of the 4 heads; each cached head serves two query heads
    config = config.replace(num_kv_heads=2)
    params = bench_decode.random_params(tj.TransformerLM(config), ones, dtype="float32")
    matrices = 2 * (3 * d * d + 2 * d * ff) + vocab * d
    assert bench_decode.step_flops(config, params, 3, 100) == 2 * 3 * matrices + 2 * 2 * 100
    # untied: the output kernel is a matrix, the input table a lookup
    config = tj.presets.tiny(num_encoder_layers=0, tie_output=False)
    params = bench_decode.random_params(tj.TransformerLM(config), ones, dtype="float32")
    matrices = 2 * (4 * d * d + 2 * d * ff) + d * vocab
    assert bench_decode.step_flops(config, params, 1, 0) == 2 * matrices
    # encoder-decoder: the decoder's self-attention, the cross-attention's query and output
    # projections and the feed-forward; nothing of the encoder
    config = tj.presets.tiny()
    params = bench_decode.random_params(tj.Transformer(config), ones, ones, dtype="float32")
    matrices = 2 * (4 * d * d + 2 * d * d + 2 * d * ff) + vocab * d
    assert bench_decode.step_flops(config, params, 2, 10) == 2 * 2 * matrices + 2 * 10


def test_decoding_rows_show_the_bound_their_arithmetic_sets():
    from benchmarks import run

    # GPT-2 small's step at batch 8: ~1.99 GFLOP. In bf16 (266 MB) on a CPU whose float32 matmul
    # peak (0.184 TFLOP/s) beats its bf16 one, the FLOPs take 10.82 ms and the bytes 5.95 ms at
    # 44.7 GB/s: no step can reach more than 0.55 of the roofline. In float32 (532 MB) the bytes
    # take longer than the FLOPs: 1.0.
    row = dict(batch=8, new_tokens=64, decode_tok_s=450.0, decode_step_ms=17.7, decode_step_s=0.0177,
               bandwidth_gb_s=44.7, roofline_frac=0.336, flops_per_step=1.99e9)
    bf16, f32 = dict(row, dtype="bfloat16", bytes_per_step=266e6), dict(row, dtype="float32",
                                                                         bytes_per_step=532e6)
    results = {"decode": {"rows": [bf16, f32]}}
    peaks, bandwidth = run.against_run_limits(results, dict(float32=0.184, bfloat16=0.105), 44.7)
    assert bf16["compute_bound_ms"] == 10.82 and bf16["roofline_ceiling"] == 0.55
    assert f32["roofline_ceiling"] == 1.0
    table = run.summarise(results, peaks, bandwidth)
    assert "take 10.8 ms, so at most 0.55" in table[0]["limit"]
    # a CPU with bf16 arithmetic (bf16 peak 0.386): the bf16 row is bound by its bytes
    bf16 = dict(row, dtype="bfloat16", bytes_per_step=266e6)
    run.against_run_limits({"decode": {"rows": [bf16]}}, dict(float32=0.195, bfloat16=0.386), 44.7)
    assert bf16["compute_bound_ms"] == 5.16 and bf16["roofline_ceiling"] == 1.0


def test_tensor_parallel_decoding_row_counts_the_padded_model_and_is_labelled(monkeypatch):
    import transformer_jax as tj
    from benchmarks import bench_decode, run

    config = tj.presets.tiny(vocab_size=61, num_encoder_layers=0, pad_vocab_multiple=8, dropout_rate=0.0)
    # this tiny model's three steps take about as long as its prefill, so under load the timing guard
    # (tested on its own below) would refuse the row; here the byte count and the labels are tested
    monkeypatch.setattr(bench_decode, "steps_time",
                        lambda total_s, fixed_s, fixed: max(total_s - fixed_s, 1e-9))
    row = bench_decode.tensor_parallel_row(config, batch=4, steps=4, tensor=4, repeats=1)
    assert row["tensor_parallel"] == 4 and row["padded_vocab"] == 64 and row["decode_step_s"] > 0
    assert "roofline_frac" not in row  # the parent process sets it against its own bandwidth reading
    params = bench_decode.random_params(tj.TransformerLM(config), jax.numpy.ones((1, 8), jax.numpy.int32),
                                        dtype="float32")
    cache = tj.init_cache(config, 4, bench_decode.PROMPT + 4)
    # every parameter (the 64-row table included) and the cache positions the three timed steps
    # attend to (33, 34, 35 of 36), read once per step
    seen = round(bench_decode.tree_bytes(cache.layers) * 34 / 36)
    assert row["bytes_per_step"] == bench_decode.tree_bytes(params) + seen
    assert params["embed"]["embedding"].value.shape == (64, config.d_model)
    # the row is set against the run's bandwidth like the others and carries the batch-8 target
    line = dict(row, batch=8, roofline_frac=0.61, bandwidth_gb_s=24.0, dtype="bfloat16",
                kernel_layout="out_in")
    table = run.summarise({"decode": {"rows": [line]}}, {}, 24.0)
    assert table[0]["workload"] == "decode gpt2_small bfloat16 out_in tensor=4 (XLA's kernels) b8 (4 new)"
    assert table[0]["target"] == 0.6 and table[0]["target_met"] is True


def test_tensor_parallel_row_runs_in_a_child_process_and_a_failure_is_reported(monkeypatch):
    import subprocess

    import pytest

    from benchmarks import run

    monkeypatch.setattr(run.hardware, "memory_bandwidth", lambda repeats=3: 25e9)
    monkeypatch.setattr(run.os, "cpu_count", lambda: 2)
    calls = []

    def child(command, env, **kwargs):
        calls.append((command, env))
        row = dict(batch=8, new_tokens=64, decode_tok_s=400.0, decode_step_ms=20.0, decode_step_s=0.02,
                   bytes_per_step=305_000_000, tensor_parallel=2)
        out = "compiling...\n" + json.dumps(row) + "\n"
        return subprocess.CompletedProcess(command, 0, stdout=out, stderr="")

    monkeypatch.setattr(run.subprocess, "run", child)
    row = run.tensor_parallel_decode_row(quick=True)
    command, env = calls[0]
    assert env["XLA_FLAGS"].endswith("--xla_force_host_platform_device_count=2")
    # the child imports the package from this checkout even where it is not installed
    assert env["PYTHONPATH"].split(os.pathsep)[0] == os.path.dirname(os.path.dirname(run.__file__))
    assert command[command.index("--tensor-parallel") + 1] == "2"
    assert command[command.index("--steps") + 1] == "64"
    assert row["roofline_frac"] == 0.61  # 305 MB per 20 ms step against 25 GB/s, set in this process
    assert row["bandwidth_gb_s"] == 25.0 and row["dtype"] == "bfloat16"

    def failing(command, env, **kwargs):
        return subprocess.CompletedProcess(command, 1, stdout="", stderr="out of memory")

    monkeypatch.setattr(run.subprocess, "run", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        run.tensor_parallel_decode_row(quick=True)
    # decode_rows keeps such a failure as a row of its own, which the summary reports and skips
    failed = dict(run.TENSOR_PARALLEL_DECODE, error="RuntimeError: out of memory")
    good = dict(row, roofline_frac=0.61)
    results = {"decode": {"rows": [good, failed]}}
    _, bandwidth = run.against_run_limits(results, dict(float32=0.3, bfloat16=1.3), 24.0)
    assert bandwidth == 25.0
    table = run.summarise(results, {}, bandwidth)
    assert table[0]["ratio"] == 0.61 and table[1]["measured"] == "failed: RuntimeError: out of memory"


def test_decode_rows_divide_their_bytes_by_the_bandwidth_and_one_step_per_new_token(monkeypatch):
    """The rows' timings replaced by round numbers: a step is the decode time over the tokens the
    scan generates (the prefill makes the first of an LM's; a seq2seq run decodes all of them after
    encoding), and the roofline reads the parameters, the self-attention cache and (seq2seq) the
    cross-attention keys and values of the encoded source once per step, in bytes."""
    import transformer_jax as tj
    from benchmarks import bench_decode

    monkeypatch.setattr(bench_decode, "best_time", lambda fn, repeats, setup=None: 0.5)  # prefill / encoding
    monkeypatch.setattr(bench_decode, "timed_generate", lambda *args, **kw: (1.0, 2.5))  # compile, whole run
    ones = jax.numpy.ones((1, 8), jax.numpy.int32)
    # seq2seq, batch 3, 5 new tokens: (2.5 - 0.5) s / 5 steps
    config = tj.presets.tiny()
    model = tj.Transformer(config)
    params = bench_decode.random_params(model, ones, ones, dtype="float32")
    src = jax.numpy.ones((3, bench_decode.PROMPT), jax.numpy.int32)
    row = bench_decode.seq2seq_row(config, model, params, src, 5, 1e9, 1)
    assert row["decode_step_s"] == 0.4 and row["decode_tok_s"] == 7.5 and row["prefill_tok_s"] == 192.0
    # 2 layers x (k, v) x batch 3 x 32 features x float32: of the 5 target positions the steps see
    # 1, 2, .., 5 (3 on average), and all 32 source positions
    self_cache, cross = 2 * 2 * 3 * 32 * 3 * 4, 2 * 2 * 3 * 32 * bench_decode.PROMPT * 4
    assert row["bytes_per_step"] == bench_decode.step_param_bytes(config, params, 3) + self_cache + cross
    assert row["roofline_frac"] == round(row["bytes_per_step"] / 1e9 / 0.4, 3)
    # decoder-only, batch 2, 5 new tokens: the prefill gives the first, (2.5 - 0.5) s / 4 steps
    config = tj.presets.tiny(num_encoder_layers=0)
    model = tj.TransformerLM(config)
    params = bench_decode.random_params(model, ones, dtype="float32")
    prompt = jax.numpy.ones((2, bench_decode.PROMPT), jax.numpy.int32)
    lengths = jax.numpy.full((2,), bench_decode.PROMPT)
    row = bench_decode.lm_row(config, model, params, prompt, lengths, 5, 2e9, 1)
    assert row["decode_step_s"] == 0.5 and row["decode_step_ms"] == 500.0 and row["decode_tok_s"] == 4.0
    assert row["prefill_tok_s"] == 128.0
    # of the PROMPT + 5 cache positions the 4 timed steps see PROMPT + 1 .. PROMPT + 4
    cache = round(2 * 2 * 2 * 32 * (bench_decode.PROMPT + 2.5) * 4)
    assert row["bytes_per_step"] == bench_decode.step_param_bytes(config, params, 2) + cache
    assert row["roofline_frac"] == round(row["bytes_per_step"] / 2e9 / 0.5, 3)  # bytes, not bits


def test_decoding_timings_leave_out_making_the_cache(monkeypatch):
    """A fresh cache is allocated before the clock starts: the prefill's tokens per second (and
    the steps, the whole generation less the prefill) count the model's work, not the
    allocation. On a clock that only moves when the cache is made, every timing is zero."""
    import transformer_jax as tj
    from benchmarks import bench_decode

    clock = [0.0]
    monkeypatch.setattr(bench_decode.time, "perf_counter", lambda: clock[0])
    slow = lambda: clock.__setitem__(0, clock[0] + 10.0) or "cache"
    assert bench_decode.best_time(lambda cache: cache, 3, setup=slow) == 0.0
    assert bench_decode.best_time(lambda: slow(), 3) == 10.0  # without setup it is timed
    seen = {}
    def fake_best_time(fn, repeats, setup=None):
        seen.setdefault("setup", []).append(setup)
        return 0.5
    monkeypatch.setattr(bench_decode, "best_time", fake_best_time)
    monkeypatch.setattr(bench_decode, "timed_generate", lambda *args, **kw: seen.update(kw) or (1.0, 2.5))
    config = tj.presets.tiny(num_encoder_layers=0)
    model = tj.TransformerLM(config)
    params = bench_decode.random_params(model, jax.numpy.ones((1, 8), jax.numpy.int32), dtype="float32")
    prompt = jax.numpy.ones((2, bench_decode.PROMPT), jax.numpy.int32)
    bench_decode.lm_row(config, model, params, prompt, jax.numpy.full((2,), bench_decode.PROMPT), 5, 2e9, 1)
    [setup] = seen["setup"]  # the prefill's cache comes from setup, outside the timed call
    assert setup is not None and setup().layers[0]["k"].shape[0] == 2
    assert not seen.get("time_cache")  # the generation's cache too


def test_a_decoding_row_whose_steps_vanish_in_the_timing_noise_is_not_measured(monkeypatch):
    """A generation timed no longer than its prefill (a tiny model under outside load) has no step
    time to give: the row says so, in run.py's table too, instead of a ratio of noise."""
    import transformer_jax as tj
    from benchmarks import bench_decode, run

    config = tj.presets.tiny(num_encoder_layers=0)
    model = tj.TransformerLM(config)
    params = bench_decode.random_params(model, jax.numpy.ones((1, 8), jax.numpy.int32), dtype="float32")
    prompt = jax.numpy.ones((2, bench_decode.PROMPT), jax.numpy.int32)
    lengths = jax.numpy.full((2,), bench_decode.PROMPT)
    monkeypatch.setattr(bench_decode, "best_time", lambda fn, repeats, setup=None: 0.0015)  # the prefill
    for total in (0.0012, 0.0015, 0.0019):  # shorter than, as long as, 21% longer than the prefill
        monkeypatch.setattr(bench_decode, "timed_generate", lambda *args, total=total, **kw: (1.0, total))
        with pytest.raises(ValueError, match="decoding steps not measured.*prefill alone 1.500 ms"):
            bench_decode.lm_row(config, model, params, prompt, lengths, 5, 2e9, 1)
    monkeypatch.setattr(bench_decode, "timed_generate", lambda *args, **kw: (1.0, 0.0021))  # 29% steps
    assert bench_decode.lm_row(config, model, params, prompt, lengths, 5, 2e9, 1)["decode_step_s"] == (
        pytest.approx(0.0006 / 4))
    failed = dict(dtype="bfloat16", kernel_layout="out_in", batch=8, cpu_kernels="auto",
                  error="ValueError: decoding steps not measured")
    [line] = run.summarise({"decode": {"rows": [failed]}}, {"float32": 1.0, "bfloat16": 1.0}, 1.0)
    assert line["workload"] == "decode gpt2_small bfloat16 out_in cpu_kernels=auto b8"
    assert line["measured"].startswith("failed: ValueError") and line["ratio"] is None


def test_hardware_limits_are_the_fastest_reading_in_bytes_and_flops(monkeypatch):
    """Each timing is replaced by a given one: the bandwidth is the faster of the sum and the
    matrix-vector product; the matmul peak the fastest of its shapes at 2 FLOPs per multiply-add;
    weight streaming counts bytes of the given dtype; `measure` reports each dtype's own peak."""
    from benchmarks import hardware
    from transformer_jax.decoding import huge_pages

    times = []
    monkeypatch.setattr(hardware, "median_time", lambda fn, repeats=5: times.pop(0))
    # The sum, then the product over 1 MiB as allocated, then both again on huge pages where the
    # system has them: the fastest of the four; without huge pages, of the first two.
    placed = []
    monkeypatch.setattr(huge_pages, "place_on_huge_pages",
                        lambda tree: placed.append(tree) or huge_pages.HugePages(2**21, 2**21, 2**21))
    times[:] = [0.004, 0.001, 0.003, 0.002]
    assert hardware.memory_bandwidth(mib=1, repeats=1) == 2**20 / 0.001
    times[:] = [0.004, 0.003, 0.0005, 0.002]
    assert hardware.memory_bandwidth(mib=1, repeats=1) == 2**20 / 0.0005
    assert [[x.size for x in tree] for tree in placed] == [[2**18, 2**18]] * 2  # the array and its matrix
    monkeypatch.setattr(huge_pages, "place_on_huge_pages", lambda tree: huge_pages.HugePages(0, 2**21, 2**21))
    times[:] = [0.001, 0.004]
    assert hardware.memory_bandwidth(mib=1, repeats=1) == 2**20 / 0.001
    monkeypatch.undo()
    monkeypatch.setattr(hardware, "median_time", lambda fn, repeats=5: times.pop(0))
    # [768, 768] x [768, 768] in 1 s, [768, 384] x [384, 768] in 0.25 s, [768, 768] x [768, 3072] in 4 s
    times[:] = [1.0, 0.25, 4.0]
    assert hardware.peak_matmul_flops("float32", n=768, repeats=1) == 2 * 768 * 384 * 768 / 0.25
    assert not times
    times[:] = [0.5, 0.5]
    assert hardware.weight_streaming(2, d_in=8, d_out=16, count=3, repeats=1) == 3 * 8 * 16 * 4 / 0.5
    assert hardware.weight_streaming(2, d_in=8, d_out=16, count=3, repeats=1, dtype="bfloat16",
                                     layout="out_in") == 3 * 8 * 16 * 2 / 0.5
    monkeypatch.setattr(hardware, "peak_matmul_flops",
                        lambda dtype, repeats=5: dict(float32=2e11, bfloat16=8e11)[dtype])
    monkeypatch.setattr(hardware, "memory_bandwidth", lambda repeats=5: 2.5e10)
    measured = hardware.measure(repeats=1)
    assert (measured["matmul_f32_tflops"], measured["matmul_bf16_tflops"], measured["bandwidth_gb_s"]) == (
        0.2, 0.8, 25.0)


def test_training_flops_count_the_matmuls_and_each_kind_of_attention():
    """By hand, on a parameter tree of known sizes: 6 FLOPs per matmul parameter and token, the
    tied embedding once (as the output projection), no position table; 12 * layers * D per query
    and key for the decoder's self-attention, the encoder's and the cross-attention."""
    import transformer_jax as tj
    from benchmarks import bench_model

    shape = lambda *s: jax.ShapeDtypeStruct(s, jax.numpy.float32)
    norm = dict(scale=shape(32), bias=shape(32))  # not matmul parameters: left out
    abstract = dict(encoder=dict(layers=dict(kernel=shape(32, 100), bias=shape(100), norm=norm),
                                 position_embed=dict(embedding=shape(128, 32))),
                    decoder=dict(layers=dict(kernel=shape(32, 200)), final_norm=norm),
                    embed=dict(embedding=shape(64, 32)))
    config = tj.presets.tiny()  # d_model 32, 2 + 2 layers, tied output
    assert bench_model.matmul_params(abstract, config) == (3200, 6400 + 2048, 0)
    # batch 2, 10 source and 6 target tokens per row
    matmuls = 6 * (3200 * 2 * 10 + 8448 * 2 * 6)
    decoder_self, encoder_self, cross = 12 * 2 * 32 * 6 * 12, 12 * 2 * 32 * 10 * 20, 12 * 2 * 32 * 10 * 12
    attention = decoder_self + encoder_self + cross
    assert bench_model.model_flops(config, abstract, 2, 10, 6) == matmuls + attention
    # causal: the decoder's self-attention queries see 1..6 keys, 3.5 on average; the rest as before
    causal = matmuls + 12 * 2 * 32 * 3.5 * 12 + encoder_self + cross
    assert bench_model.model_flops(config, abstract, 2, 10, 6, causal=True) == causal
    # untied: the output kernel sits in the decoder, the target table is a lookup
    untied = dict(abstract, target_embed=abstract["embed"],
                  decoder=dict(layers=dict(kernel=shape(32, 200)), output=dict(kernel=shape(32, 64))))
    del untied["embed"]
    assert bench_model.matmul_params(untied, config.replace(tie_output=False)) == (3200, 6400 + 2048, 0)
    # cross-attention keys and values project the source tokens (10 a row), not the target's (6)
    heads = lambda: dict(kernel=shape(32, 4, 8))
    cross = dict(abstract, decoder=dict(layers=dict(kernel=shape(32, 200), cross_attention=dict(
        key=heads(), value=heads(), query=heads()))))
    assert bench_model.matmul_params(cross, config) == (3200, 6400 + 3 * 1024 + 2048, 2048)
    moved = 6 * 2048 * 2 * (10 - 6)
    assert bench_model.model_flops(config, cross, 2, 10, 6) == matmuls + attention + 6 * 3072 * 2 * 6 + moved
    # decoder-only: 6*N*T + 12*layers*L*D*T
    decoder_only = dict(decoder=abstract["decoder"], embed=abstract["embed"])
    config = tj.presets.tiny(num_encoder_layers=0)
    assert bench_model.model_flops(config, decoder_only, 2, 0, 6) == 6 * 8448 * 12 + 12 * 2 * 6 * 32 * 12
    # the scores' products are H * d_k wide (4 heads of 24 = 96 here), not d_model: it was 32
    wide = config.replace(head_dim=24)
    assert bench_model.model_flops(wide, decoder_only, 2, 0, 6) == 6 * 8448 * 12 + 12 * 2 * 6 * 96 * 12


def test_benchmark_and_training_loop_count_the_same_flops():
    """The benchmarks' model FLOPs (from the parameters' own shapes) and the loop's logged MFU
    numerator (from the config) agree, with grouped-query K/V, head_dim * heads != d_model and an
    encoder-decoder with padded vocabulary."""
    import transformer_jax as tj
    from benchmarks import bench_model
    from transformer_jax.training import metrics

    for config in (tj.presets.tiny(num_kv_heads=1, head_dim=24, pad_vocab_multiple=48, vocab_size=100),
                   tj.presets.tiny(num_encoder_layers=0, num_kv_heads=2, activation="swiglu")):
        model = bench_model.build_model(config)
        abstract = bench_model.abstract_state(model, config, bench_model.make_batch(config, 2, 8))
        for source in ((5, 8, 13) if config.num_encoder_layers else (0,)):  # cross K/V: source tokens
            abstract = bench_model.abstract_state(model, config, bench_model.make_batch(config, 2, 8))
            assert bench_model.model_flops(config, abstract, 2, source, 8) == metrics.train_flops_per_step(
                config, 2, 8, source)


def test_training_row_figures_from_the_step_time(monkeypatch):
    """bench_train with a step that costs nothing and a clock that advances 0.5 s per reading: the
    tokens of both sides, and an MFU against the peak of the compute dtype (bf16 here, although the
    weights are float32)."""

    import transformer_jax as tj
    from benchmarks import bench_model

    clock = iter(0.5 * i for i in range(100))
    monkeypatch.setattr(bench_model, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    monkeypatch.setattr(bench_model, "make_train_step",
                        lambda model, tx, encoder_decoder: lambda p, o, b: (p, o, jax.numpy.float32(2.0)))
    peaks = dict(float32=1e6, bfloat16=4e6)
    monkeypatch.setattr(bench_model, "peak_matmul_flops", lambda dtype: peaks[str(dtype)])
    config = tj.presets.tiny(dtype="bfloat16")
    row = bench_model.bench_train(config, 2, 8, steps=3)
    model = bench_model.build_model(config)
    flops = bench_model.model_flops(config, bench_model.abstract_state(model, config, bench_model.make_batch(
        config, 2, 8)), 2, 8, 8)
    assert row["step_ms"] == 500.0 and row["first_step_s"] == 0.5 and row["loss"] == 2.0
    assert row["tokens_per_s"] == 2 * 8 * 2 / 0.5  # source and target tokens
    assert row["mfu"] == round(flops / 0.5 / 4e6, 3)
    assert row["achieved_tflops"] == round(flops / 0.5 / 1e12, 4)


def test_cpu_suite_rows_take_the_higher_adjacent_reading_of_their_own_dtype(monkeypatch):
    """train_rows and decode_rows with the workloads and readings replaced by given numbers."""
    import transformer_jax as tj
    from benchmarks import bench_decode, run

    readings = dict(float32=[2e11, 3e11, 2e11, 3e11], bfloat16=[6e11, 5e11, 6e11, 5e11])
    monkeypatch.setattr(run.hardware, "peak_matmul_flops", lambda dtype, repeats=5: readings[dtype].pop(0))
    monkeypatch.setattr(run.bench_model, "bench_train", lambda config, batch, length, steps, peak_flops: dict(
        dtype=config.dtype, batch=batch, length=length, tokens_per_s=100.0, achieved_tflops=0.15,
        achieved_flops=0.15e12, mfu=round(0.15e12 / peak_flops, 3)))
    rows = run.train_rows(None, quick=True)
    assert [(r["model"], r["dtype"], r["peak_tflops"], r["mfu"]) for r in rows] == [
        ("gpt2_small", "float32", 0.3, 0.5), ("gpt2_small", "bfloat16", 0.6, 0.25),
        ("transformer_base", "float32", 0.3, 0.5), ("transformer_base", "bfloat16", 0.6, 0.25)]
    # A CPU without bf16 arithmetic: XLA's bf16 kernel (what the bf16 probe times) is the slower, and
    # the model multiplies bf16 in float32 there, so a bf16 row is set against the float32 peak; the
    # bf16 one gave such a row an MFU above 1 (0.15 / 0.1 here).
    readings.update(float32=[2e11, 3e11, 2e11, 3e11], bfloat16=[1e11, 0.9e11, 1e11, 0.9e11])
    rows = run.train_rows(None, quick=True)
    assert [(r["dtype"], r["peak_tflops"], r["mfu"]) for r in rows[:2]] == [
        ("float32", 0.3, 0.5), ("bfloat16", 0.3, 0.5)]
    # the run's bf16 peak still comes from bf16 readings only
    peaks, _ = run.against_run_limits({"train": {"rows": rows}}, dict(float32=0.25, bfloat16=0.08), 1.0)
    assert peaks == dict(float32=0.3, bfloat16=0.1) and rows[1]["mfu"] == 0.5

    # before and after each row
    bandwidths = [20e9, 25e9, 25e9, 20e9, 20e9, 25e9, 25e9, 20e9,
                  20e9, 25e9, 20e9, 25e9, 25e9, 20e9, 20e9, 25e9]
    monkeypatch.setattr(run.hardware, "memory_bandwidth", lambda repeats=5: bandwidths.pop(0))
    streamed = []
    monkeypatch.setattr(run.hardware, "weight_streaming", lambda batch, dtype, layout, repeats, cpu_kernels: (
        streamed.append(cpu_kernels) or 4e10))
    monkeypatch.setattr(run, "tensor_parallel_decode_row", lambda quick: None)
    monkeypatch.setattr(bench_decode, "random_params", lambda *args, **kwargs: None)
    monkeypatch.setattr(tj, "TransformerLM", lambda config: None)

    def lm_row(config, model, params, prompt, lengths, steps, bandwidth, repeats):
        # 100 MB per 10 ms step: 0.5 of the bandwidth read before the row
        return dict(batch=prompt.shape[0], new_tokens=steps, bytes_per_step=1e8, decode_step_s=0.01,
                    roofline_frac=round(1e8 / bandwidth / 0.01, 3))

    monkeypatch.setattr(bench_decode, "lm_row", lm_row)
    rows = run.decode_rows(quick=True)
    assert [(r["dtype"], r["kernel_layout"], r["batch"], r["cpu_kernels"]) for r in rows] == [
        ("float32", "in_out", 1, "auto"), ("float32", "in_out", 8, "auto"),
        ("float32", "out_in", 8, "auto"), ("bfloat16", "out_in", 1, "auto"),
        ("bfloat16", "out_in", 8, "auto"), ("bfloat16", "packed", 1, "auto"),
        ("bfloat16", "packed", 8, "auto"), ("bfloat16", "out_in", 8, "xla")]
    assert streamed == [r["cpu_kernels"] for r in rows]  # each row's products, as the model runs them
    # against 25 GB/s, the higher reading next to each row, whichever came first
    assert [r["roofline_frac"] for r in rows] == [0.4] * 8
    assert [r["bandwidth_gb_s"] for r in rows] == [25.0] * 8
    # 100 MB per 10 ms step against the 40 GB/s the matmuls stream
    assert [r["stream_frac"] for r in rows] == [0.25] * 8 and rows[0]["weight_stream_gb_s"] == 40.0


def test_summary_table_of_training_attention_and_compile_rows():
    from benchmarks import run

    train = [dict(model="gpt2_small", dtype="float32", batch=8, length=256, tokens_per_s=100.0, mfu=0.58,
                  peak_tflops=0.3, run_peak_tflops=0.31),
             dict(model="gpt2_small", dtype="bfloat16", batch=8, length=256, tokens_per_s=180.0, mfu=0.3,
                  peak_tflops=1.2, run_peak_tflops=1.24),
             dict(model="transformer_base", dtype="float32", batch=8, length=256, tokens_per_s=200.0,
                  mfu=0.4, peak_tflops=0.3)]
    mib = 2**20
    attention = [dict(impl=impl, length=length, forward_ms=ms, forward=dict(peak_bytes=mem * mib),
                      train=dict(peak_bytes=2 * mem * mib))
                 for impl, length, ms, mem in [("reference", 1024, 10.0, 40), ("chunked", 1024, 14.0, 8),
                                               ("reference", 4096, 100.0, 640), ("chunked", 4096, 120.0, 64)]]
    compile_rows = [dict(scan=scan, layers=layers, total_s=s) for scan, layers, s in
                    [(False, 2, 10.0), (False, 24, 60.0),
                     (True, 2, 10.0), (True, 6, 11.0), (True, 12, 12.0), (True, 24, 14.0)]]
    results = {"train": {"rows": train}, "attention": {"rows": attention}, "compile": {"rows": compile_rows}}
    peaks = dict(float32=0.31, bfloat16=1.24)
    table = {line["workload"]: line for line in run.summarise(results, peaks, 25.0)}
    gpt2 = table["train gpt2_small float32 b8x256"]
    assert (gpt2["ratio"], gpt2["target"], gpt2["target_met"]) == (0.58, 0.55, True)
    assert gpt2["limit"] == "0.310 TFLOP/s float32 matmul (highest in the run; 0.300 next to the row)"
    assert table["train transformer_base float32 b8x256"]["target"] is None
    speedup = table["train gpt2_small bf16 / f32 tokens/s"]  # bf16 over f32, against the peaks' ratio
    assert (speedup["measured"], speedup["limit"], speedup["ratio"], speedup["target_met"]) == (
        "1.80x", "matmul peak ratio 4.00x", 1.8, True)
    assert "train transformer_base bf16 / f32 tokens/s" not in table  # no bf16 row
    # the memory ratio at the longest length only, lower is better: 64 / 640 MiB meets 1/8
    memory = table["attention chunked causal L=4096"]
    assert (memory["ratio"], memory["target_met"]) == (0.1, True)
    assert table["attention chunked causal L=1024"]["ratio"] is None
    slowdown = table["attention chunked/reference time L=4096"]
    assert (slowdown["ratio"], slowdown["target_met"]) == (1.2, True)
    assert table["attention chunked/reference time L=1024"]["target_met"] is True  # 1.4 <= 1.5
    # compile time of the deepest over the shallowest stack
    scanned = table["compile 24/2 layers scan=True"]
    assert (scanned["ratio"], scanned["target"], scanned["target_met"]) == (1.4, 1.5, True)
    unscanned = table["compile 24/2 layers scan=False"]
    assert (unscanned["ratio"], unscanned["target"]) == (6.0, None)
    meta = dict(date="d", device_kind="cpu", cpus=2, jax="0", load_start=[1.0], load_end=[1.0],
                peaks=dict(float32=0.31, bfloat16=1.24), bandwidth_gb_s=25.0)
    text = run.markdown(run.summarise(results, peaks, 25.0), meta)
    assert "| 1.80x | matmul peak ratio 4.00x | 1.8 | ≥ 1.5 (speed-up) | yes |" in text
    assert "| 0.1 | ≤ 0.125 (memory / reference) | yes |" in text


def test_targets_are_judged_on_unrounded_ratios_and_comparison_rows_have_none():
    """A roofline fraction of 0.5998 shows as 0.6 but misses a 0.6 target (it was judged on the
    rounded figure, so 0.5995-0.5999 passed); the step on XLA's kernels alone is a comparison row,
    without the target."""
    from benchmarks import run

    decode = [dict(batch=8, new_tokens=64, dtype="bfloat16", kernel_layout="out_in", cpu_kernels=kernels,
                   native=kernels != "xla", decode_tok_s=1.0, decode_step_ms=10.0, decode_step_s=0.01,
                   bytes_per_step=bytes_per_step, bandwidth_gb_s=50.0, roofline_frac=0.0)
              for kernels, bytes_per_step in (("auto", 299_900_000), ("auto", 300_000_000), ("xla", 1e8))]
    results = {"decode": {"rows": decode}}
    peaks, bandwidth = run.against_run_limits(results, dict(float32=0.3, bfloat16=0.6), 50.0)
    table = run.summarise(results, peaks, bandwidth)
    assert [(t["ratio"], t["target"], t["target_met"]) for t in table] == [
        (0.6, 0.6, False), (0.6, 0.6, True), (0.2, None, None)]
    assert table[2]["workload"] == "decode gpt2_small bfloat16 out_in XLA kernels only b8 (64 new)"


def test_compile_rows_time_the_training_loop_s_own_step(monkeypatch):
    """The compile benchmark lowers `steps.train_step` (its guard and metrics included), not a
    benchmark-only step, from abstract packed batches."""
    from benchmarks import bench_compile
    from transformer_jax.training import steps

    seen = []
    real = steps.train_step

    def spy(state, batch, **kwargs):
        seen.append(sorted(batch))
        return real(state, batch, **kwargs)

    monkeypatch.setattr(steps, "train_step", spy)
    cached = jax.config.jax_enable_compilation_cache
    row = bench_compile.compile_time(1, scan=False, batch=2, length=16)
    assert jax.config.jax_enable_compilation_cache == cached  # off for the timing only
    assert seen == [["targets", "targets_positions", "targets_segment_ids"]]
    assert row["layers"] == 1 and row["scan"] is False
    assert row["compile_s"] > 0 and row["total_s"] >= row["lower_s"] + row["compile_s"] - 0.02


def test_compile_rows_stay_out_of_a_persistent_cache_set_before_them(tmp_path):
    """With a compilation cache folder set and a program compiled before (the run's matmul probes),
    the compile rows neither read nor write the cache: JAX decides at a process's first compile
    whether to use it, and switching it off later alone left it on (the rows timed cache loads:
    ~0.3 s against ~10 s compiled). The cache is back on for what follows."""
    import jax.numpy as jnp
    from jax.experimental.compilation_cache import compilation_cache

    from benchmarks import bench_compile

    folder = tmp_path / "cache"
    settings = {"jax_enable_compilation_cache": True, "jax_compilation_cache_dir": str(folder),
                "jax_persistent_cache_min_compile_time_secs": 0.0,
                "jax_persistent_cache_min_entry_size_bytes": 0}
    saved = {name: getattr(jax.config, name) for name in settings}
    for name, value in settings.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()
    try:
        jax.jit(lambda x: x @ x + 3.0)(jnp.ones((8, 8))).block_until_ready()
        before = set(os.listdir(folder))
        assert before  # the cache is in use
        bench_compile.compile_time(1, scan=False, batch=1, length=8)
        assert set(os.listdir(folder)) == before
        jax.jit(lambda x: x @ x + 4.0)(jnp.ones((8, 8))).block_until_ready()
        assert len(os.listdir(folder)) > len(before)  # and in use again after the rows
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


def test_the_weight_streaming_probe_runs_each_layout_on_the_models_kernels(monkeypatch):
    """The probe that a decoding row's `stream_frac` is set against multiplies by the model's own
    product for each layout, with the row's `cpu_kernels`: for 'in_out' it ran XLA's product where
    the row ran the native kernel, and the step streamed "2.03 times faster than the limit"."""
    from benchmarks import hardware
    from transformer_jax.modeling import matmul

    seen = []
    for name in ("contract", "contract_transposed", "contract_packed"):
        real = getattr(matmul, name)
        monkeypatch.setattr(matmul, name, lambda x, w, *a, _real=real, _name=name, **kw: seen.append(
            (_name, kw.get("cpu_kernels"))) or _real(x, w, *a, **kw))
    for layout in ("in_out", "out_in"):
        hardware.weight_streaming(1, d_in=16, d_out=32, count=2, repeats=1, layout=layout, cpu_kernels="auto")
    assert seen == [("contract", "auto")] * 2 + [("contract_transposed", "auto")] * 2


def test_run_checks_its_out_dir_before_measuring(monkeypatch, tmp_path, capsys):
    """--out-dir was made after every section had run: a path that cannot be a folder lost the
    whole run's measurements to a traceback. It is refused before anything is measured."""
    import sys

    from benchmarks import hardware, run

    monkeypatch.setattr(hardware, "measure", lambda **kwargs: pytest.fail("measured the hardware"))
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for bad in (blocker, blocker / "below"):
        monkeypatch.setattr(sys, "argv", ["run.py", "--quick", "--only", "compile", "--out-dir", str(bad)])
        with pytest.raises(SystemExit) as exit_info:
            run.main()
        assert exit_info.value.code == 2 and f"--out-dir {bad}" in capsys.readouterr().err


def test_accelerator_ratios_are_against_the_higher_reading_of_each_limit(monkeypatch):
    """accelerator.run with its sections replaced: the MFU and roofline are set against the higher
    of the start and end readings, each limit on its own (the peak read higher at the start, the
    bandwidth at the end), and the summary holds the decode target at batch 1 only."""
    readings = [dict(peak_bf16_flops=1.0e15, bandwidth_bytes_s=3.5e12),
                dict(peak_bf16_flops=0.8e15, bandwidth_bytes_s=4.0e12)]
    monkeypatch.setattr(accelerator, "checks_section", lambda sizes, platform: [])
    monkeypatch.setattr(accelerator, "measure_hardware", lambda sizes: readings.pop(0))
    monkeypatch.setattr(accelerator, "train_section", lambda sizes, platform, limits, *options: [
        dict(tokens_per_s=1000.0, achieved_tflops=460.0, mfu=0.575)])
    monkeypatch.setattr(accelerator, "decode_section", lambda sizes, platform, limits, *options: [
        dict(batch=batch, decode_tok_s=batch * 1000.0, bytes_per_step=2.6e9, decode_step_s=0.001,
             roofline_frac=0.743) for batch in (1, 8)])
    monkeypatch.setattr(accelerator, "attention_section", lambda sizes, platform: [])
    report = accelerator.run(smoke=True)
    assert report["meta"]["peak_bf16_tflops"] == 1000.0 and report["meta"]["bandwidth_gb_s"] == 4000.0
    [train] = report["results"]["train"]["rows"]
    assert train["mfu"] == 0.46  # 460 TFLOP/s of 1000
    assert [row["roofline_frac"] for row in report["results"]["decode"]["rows"]] == [0.65, 0.65]
    assert [(line["ratio"], line["target"], line["met"]) for line in report["summary"]] == [
        (0.46, 0.45, True), (0.65, 0.6, True), (0.65, None, None)]


def test_bench_train_script_counts_both_sides_and_every_device(monkeypatch, tmp_path):
    """bench_train.py on a tiny model, its clock advancing 0.5 s per reading (2 steps in 0.5 s) and
    its step doing nothing: tokens of the source and target sides, and an MFU against the given
    peak of each device."""
    import sys

    from benchmarks import bench_train
    from transformer_jax.training import metrics

    clock = iter(0.5 * i for i in range(100))
    monkeypatch.setattr(bench_train, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    monkeypatch.setattr(bench_train.steps, "train_step", lambda state, batch, **kwargs: (
        state, {"loss": jax.numpy.float32(2.0)}))
    out = tmp_path / "train.json"
    monkeypatch.setattr(sys, "argv", ["bench_train.py", "--d_model=16", "--heads=2", "--layers=1",
                                      "--vocab=64", "--batch=8", "--length=8", "--steps=2",
                                      "--peak_tflops=2e-6", f"--out={out}"])
    bench_train.main()
    result = json.loads(out.read_text())
    config = bench_train.ModelConfig(vocab_size=64, d_model=16, d_ff=64, num_heads=2, num_encoder_layers=1,
                                     num_decoder_layers=1, dropout_rate=0.0, max_len=64)
    flops = metrics.train_flops_per_step(config, 8, 8, 8)
    assert result["compile_s"] == 0.5 and result["step_s"] == 0.25 and result["devices"] == jax.device_count()
    assert result["tokens_per_s"] == 2 * 8 * 8 / 0.25
    assert result["mfu"] == flops / 0.25 / (2e-6 * 1e12 * jax.device_count())
    assert result["model_tflops_per_s"] == flops / 0.25 / 1e12 and result["loss"] == 2.0


def test_accelerator_checks_its_out_path_before_the_run(monkeypatch, tmp_path):
    """--out is checked before anything is measured (a full run takes minutes on an accelerator):
    a missing folder is made and the report lands in it; a path that cannot be a file is refused
    with a usage error naming the flag, and the run never starts."""
    import sys

    import pytest

    runs = []
    monkeypatch.setattr(accelerator, "run", lambda smoke, **kwargs: runs.append(smoke) or dict(
        meta=dict(smoke=smoke), summary=[]))
    out = tmp_path / "new" / "folder" / "report.json"
    monkeypatch.setattr(sys, "argv", ["accelerator.py", "--smoke", f"--out={out}"])
    accelerator.main()
    assert runs == [True] and json.loads(out.read_text())["meta"] == dict(smoke=True)

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for bad in (blocker / "report.json", tmp_path):  # under a regular file; a folder
        monkeypatch.setattr(sys, "argv", ["accelerator.py", f"--out={bad}"])
        with pytest.raises(SystemExit) as exit_info:
            accelerator.main()
        assert exit_info.value.code == 2
    assert runs == [True]  # neither bad path started a run


def test_run_refuses_an_unknown_section(monkeypatch, capsys):
    """A misspelt --only section is a usage error, not a run that measures the hardware and writes
    an empty table."""
    import sys

    import pytest

    from benchmarks import hardware, run

    monkeypatch.setattr(hardware, "measure", lambda **kwargs: pytest.fail("measured the hardware"))
    monkeypatch.setattr(sys, "argv", ["run.py", "--quick", "--only", "train", "trian"])
    with pytest.raises(SystemExit) as exit_info:
        run.main()
    assert exit_info.value.code == 2 and "'trian'" in capsys.readouterr().err


def test_bench_decode_refuses_fewer_than_two_new_tokens(monkeypatch, capsys):
    """A step's time is (generate - prefill) / (steps - 1), the first token coming from the prefill:
    --steps 1 is a usage error naming the flag, not a ZeroDivisionError after compiling the model."""
    import sys

    import pytest

    from benchmarks import bench_decode

    monkeypatch.setattr(bench_decode, "tensor_parallel_row", lambda *a: pytest.fail("ran the row"))
    monkeypatch.setattr(sys, "argv", ["bench_decode.py", "--tensor-parallel", "2", "--steps", "1"])
    with pytest.raises(SystemExit) as exit_info:
        bench_decode.main()
    assert exit_info.value.code == 2 and "--steps 1" in capsys.readouterr().err


def test_accelerator_keeps_every_row_measured_before_a_failure_or_a_kill(monkeypatch, tmp_path):
    """The accelerator run is one chance: --out is rewritten after every row, so a run killed at its
    time limit leaves the rows measured so far; a failing row (a backend out of memory at 32k) or a
    failing section is recorded and the rest still runs."""
    import sys

    import pytest

    from benchmarks import bench_attention

    monkeypatch.setattr(accelerator, "checks_section", lambda sizes, platform: [])
    monkeypatch.setattr(accelerator, "measure_hardware", lambda sizes: dict(
        peak_bf16_flops=1.0e15, bandwidth_bytes_s=4.0e12))
    monkeypatch.setattr(accelerator, "train_section", lambda sizes, platform, limits, *options: [
        dict(tokens_per_s=1000.0, achieved_tflops=460.0, mfu=0.46)])

    def decode(sizes, platform, limits, *options):
        yield dict(batch=1, decode_tok_s=1000.0, bytes_per_step=2.6e9, decode_step_s=0.001,
                   roofline_frac=0.65)
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

    def bench_one(impl, length, **kwargs):
        if impl == "xla":
            raise RuntimeError("RESOURCE_EXHAUSTED: autotuning")
        return dict(impl=impl, length=length, forward_ms=1.0)

    monkeypatch.setattr(accelerator, "decode_section", decode)
    monkeypatch.setattr(bench_attention, "bench_one", bench_one)
    snapshots = []
    report = accelerator.run(smoke=True, save=lambda r: snapshots.append(json.loads(json.dumps(r))))
    results = report["results"]
    assert results["decode"]["error"] == "RuntimeError: RESOURCE_EXHAUSTED: out of memory"
    assert [row["batch"] for row in results["decode"]["rows"]] == [1]  # kept
    attention = results["attention"]["rows"]
    assert [(row["impl"], "error" in row) for row in attention] == [("xla", True), ("chunked", False)]
    assert [line["workload"] for line in report["summary"]] == ["train ~350M decoder bf16",
                                                                 "decode batch 1"]
    # saved as each row came: the decode row is in the file before the attention section starts
    first_decode = next(s for s in snapshots if s["results"].get("decode", {}).get("rows"))
    assert "attention" not in first_decode["results"]
    assert first_decode["results"]["train"]["rows"][0]["tokens_per_s"] == 1000.0

    # main: the file holds the last saved report when the run dies (SIGKILL is not catchable; a
    # SystemExit from inside the run stands for it), and no half-written file is left
    def killed(smoke, save, sections, budget_s, **options):
        save(dict(meta=dict(smoke=smoke), results=dict(train=dict(rows=[dict(step_ms=1.0)]))))
        raise SystemExit(137)

    out = tmp_path / "report.json"
    monkeypatch.setattr(accelerator, "run", killed)
    monkeypatch.setattr(sys, "argv", ["accelerator.py", "--smoke", f"--out={out}"])
    with pytest.raises(SystemExit):
        accelerator.main()
    assert json.loads(out.read_text())["results"]["train"]["rows"] == [dict(step_ms=1.0)]
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_accelerator_starts_no_row_after_its_time_budget(monkeypatch):
    """Past --budget-s no new row starts (a 10-minute limit would kill it and the end reading), but
    the end reading and the summary are still made."""

    now = [0.0]
    monkeypatch.setattr(accelerator, "time", types.SimpleNamespace(
        monotonic=lambda: now[0], perf_counter=lambda: now[0]))
    readings = []
    monkeypatch.setattr(accelerator, "checks_section", lambda sizes, platform: [])
    monkeypatch.setattr(accelerator, "measure_hardware", lambda sizes: readings.append(1) or dict(
        peak_bf16_flops=1.0e15, bandwidth_bytes_s=4.0e12))
    monkeypatch.setattr(accelerator, "train_section", lambda sizes, platform, limits, *options: [
        dict(tokens_per_s=1000.0, achieved_tflops=460.0, mfu=0.46)])

    def decode(sizes, platform, limits, *options):
        for batch in (1, 8):
            now[0] += 300.0  # each row takes 5 minutes
            yield dict(batch=batch, decode_tok_s=1000.0, bytes_per_step=2.6e9, decode_step_s=0.001)

    monkeypatch.setattr(accelerator, "decode_section", decode)
    monkeypatch.setattr(accelerator, "attention_section", lambda sizes, platform: pytest.fail("ran"))
    report = accelerator.run(smoke=True, budget_s=420.0)
    results = report["results"]
    assert [row["batch"] for row in results["decode"]["rows"]] == [1, 8]  # batch 8 began at 300 s
    assert "skipped" in results["attention"]
    assert results["attention"]["rows"] == [] and len(readings) == 2
    assert [line["ratio"] for line in report["summary"]] == [0.46, 0.65, 0.65]


def test_random_params_are_drawn_on_an_accelerator_not_in_numpy(monkeypatch):
    """Off a CPU the benchmark weights are drawn on the device: numpy took longer than a 95 s slot
    for a 7B model's weights on a GPU machine. Same shapes and dtype, scale 0.02, leaves differ."""
    import numpy as np
    import pytest

    import transformer_jax as tj
    from benchmarks import bench_decode

    model = tj.TransformerLM(tj.presets.tiny(num_encoder_layers=0))
    tokens = jax.numpy.ones((1, 8), jax.numpy.int32)
    on_cpu = bench_decode.random_params(model, tokens, dtype=jax.numpy.bfloat16)
    monkeypatch.setattr(bench_decode.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(bench_decode.np.random, "default_rng", lambda seed: pytest.fail("drew in numpy"))
    on_device = bench_decode.random_params(model, tokens, dtype=jax.numpy.bfloat16)
    assert jax.tree.structure(on_device) == jax.tree.structure(on_cpu)
    leaves = jax.tree.leaves(on_device)
    assert [(x.shape, x.dtype) for x in leaves] == [(x.shape, x.dtype) for x in jax.tree.leaves(on_cpu)]
    big = [np.asarray(x, np.float32) for x in leaves if x.size >= 1024]
    assert all(0.015 < x.std() < 0.025 for x in big)
    assert len({float(x.ravel()[0]) for x in big}) == len(big)  # each leaf its own key


def test_trace_summary_puts_the_devices_kernels_first(tmp_path):
    """The profile section's summary of a profiler trace: per thread, the device's streams before the
    host's threads, event counts per step, and op names ranked by total time."""
    import gzip

    meta = lambda pid, tid, kind, name: dict(ph="M", pid=pid, tid=tid, name=kind, args=dict(name=name))
    op = lambda pid, tid, name, dur: dict(ph="X", pid=pid, tid=tid, name=name, ts=0, dur=dur)
    events = [meta(1, None, "process_name", "/host:CPU"), meta(1, 7, "thread_name", "python"),
              meta(2, None, "process_name", "/device:GPU:0"), meta(2, 3, "thread_name", "Stream #1"),
              op(1, 7, "generate", 5000.0)]
    events += [op(2, 3, "gemv_kernel", 8.0) for _ in range(8)]
    events += [op(2, 3, "fusion_ln", 2.0) for _ in range(4)]
    folder = tmp_path / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    with gzip.open(folder / "host.trace.json.gz", "wt") as f:
        json.dump(dict(traceEvents=events), f)
    device, host = accelerator.trace_summary(str(tmp_path), steps=4)
    assert device["thread"] == "/device:GPU:0 / Stream #1" and host["thread"] == "/host:CPU / python"
    assert (device["events"], device["events_per_step"], device["total_ms"]) == (12, 3.0, 0.072)
    assert [(t["name"], t["count"], t["total_us"], t["mean_us"]) for t in device["top"]] == [
        ("gemv_kernel", 8, 64.0, 8.0), ("fusion_ln", 4, 8.0, 2.0)]


def test_profile_section_traces_decoding_steps():
    """--only profile on the smoke model, on this CPU: XLA's threads ran the decoding loop."""
    rows = list(accelerator.profile_section(accelerator.SMOKE, "cpu"))
    assert rows and all(row["steps"] == 8 and row["batch"] == 1 for row in rows)
    traced = {(row["kernel_layout"], row["single_row"], 1, row["fused_qkv"]) for row in rows}
    assert traced == {accelerator.variant_key(v) for v in accelerator.DECODE_VARIANTS if v[2] == 1}
    names = {t["name"] for row in rows for t in row["top"]}
    assert any(name.startswith("while") for name in names), names  # the generate loop


def test_a_layout_the_weights_cannot_be_converted_to_fails_its_rows_only(monkeypatch):
    """Converting the decode model's weights to `out_in` or `fused_qkv` fails (out of memory on a
    device, say): those rows are error rows that say so, every other row is still measured, in order."""
    from benchmarks import bench_decode

    def convert(params, config, target):
        raise RuntimeError("RESOURCE_EXHAUSTED: 13.1 GiB")

    monkeypatch.setattr(accelerator, "decoding_model", lambda sizes, platform, name: (
        accelerator.tj.presets.tiny(num_encoder_layers=0, vocab_size=256), "model", "params"))
    monkeypatch.setattr(accelerator.tj.params, "convert_params", convert)
    monkeypatch.setattr(bench_decode, "lm_row", lambda config, model, params, prompt, lengths, *rest: dict(
        batch=prompt.shape[0], decode_tok_s=1.0, layout_seen=config.kernel_layout))
    rows = list(accelerator.decode_section(accelerator.SMOKE, "cpu", dict(bandwidth_bytes_s=1e9), "7b"))
    variants = [(r["kernel_layout"], r["single_row"], r["batch"], r["fused_qkv"]) for r in rows]
    assert variants == [accelerator.variant_key(v) for v in accelerator.DECODE_VARIANTS]
    for row in rows:
        if row["kernel_layout"] == "in_out" and not row["fused_qkv"]:
            assert row["layout_seen"] == "in_out" and "error" not in row, row
        else:
            stored = row["kernel_layout"] + (" with fused_qkv" if row["fused_qkv"] else "")
            assert row["error"] == (f"RuntimeError: converting the weights to {stored}: "
                                    "RuntimeError: RESOURCE_EXHAUSTED: 13.1 GiB"), row
    # profile_section takes the same variants: an error row for out_in, not an exception
    monkeypatch.setattr(accelerator, "DECODE_VARIANTS", (("out_in", "vector", 1),))
    [row] = accelerator.profile_section(accelerator.SMOKE, "cpu", "7b")
    assert row["error"].startswith("converting the weights to out_in: RuntimeError: RESOURCE_EXHAUSTED")


@pytest.mark.parametrize("scan", [False, True])
def test_decoding_profile_counts_each_kernel_once_per_step(scan):
    """`bench_decode.profile_steps` attributes the profiled ops of the decoding loop, and only those,
    to each step: with the package's kernels, a GPT-style step of L layers makes 6 L + 1 weight
    products ([out, in] kernels: query, key, value, output, wi, wo and the tied output projection),
    L attentions over the cache, 2 L cache writes (bf16 keys and values) and 2 L + 1 norms, whether
    the layers are separate or one scanned loop inside the decoding loop; the greedy choice once.
    On XLA's kernels alone none of the package's kernels appear."""
    import transformer_jax as tj
    from benchmarks import bench_decode
    from transformer_jax.modeling import native

    layers = 3
    config = tj.ModelConfig(vocab_size=997, d_model=64, num_heads=4, d_ff=128, num_encoder_layers=0,
                            num_decoder_layers=layers, max_len=96, norm="pre", activation="gelu_tanh",
                            dropout_rate=0.0, attention_dropout_rate=0.0, dtype="bfloat16",
                            param_dtype="bfloat16", kernel_layout="out_in", scan_layers=scan,
                            cpu_kernels="xla")
    row = bench_decode.profile_steps(config, batch=2, steps=9)
    kinds = {k["kind"]: k for k in row["kinds"]}
    assert row["steps"] == 8 and not any(k.startswith("transformer_jax") for k in kinds)
    assert row["busy_ms_per_step"] > 0 and abs(sum(k["share"] for k in row["kinds"]) - 1) < 0.05
    if not native.available():
        pytest.skip(f"native CPU kernels unavailable: {native.unavailable_reason()}")
    row = bench_decode.profile_steps(config.replace(cpu_kernels="native"), batch=2, steps=9, top=100)
    calls = {k["kind"]: k["calls_per_step"] for k in row["kinds"]}
    assert calls["transformer_jax_rows_matmul"] == 6 * layers + 1
    assert calls["transformer_jax_cache_attention"] == layers
    assert calls["transformer_jax_cache_write"] == 2 * layers
    assert calls["transformer_jax_bias_activation"] == layers
    assert calls["transformer_jax_greedy_choice"] == 1
    assert calls["transformer_jax_layer_norm"] == 2 * layers + 1  # two a layer, then the final norm
    assert abs(sum(k["share"] for k in row["kinds"]) - 1) < 1e-3  # every kind listed
    table = bench_decode.profile_table(row)
    assert "| transformer_jax_rows_matmul | 19 |" in table


@pytest.mark.parametrize("script", ["bench_attention", "bench_compile", "bench_decode", "bench_model",
                                    "bench_soak", "bench_train"])
def test_benchmark_scripts_import_the_checkout_ahead_of_an_installed_copy(script, tmp_path):
    """`python benchmarks/<script>.py` times the checkout it sits in: it ran without the package
    installed (ModuleNotFoundError), and with another copy installed it timed that copy."""
    import subprocess
    import sys

    installed = tmp_path / "site" / "transformer_jax"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text('raise ImportError("imported the installed copy")\n')
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, os.path.join(root, "benchmarks", f"{script}.py"), "--help"],
                            env=dict(os.environ, PYTHONPATH=str(tmp_path / "site")), cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "usage:" in result.stdout, result.stderr[-2000:]


@pytest.mark.parametrize("script, flag", [("bench_train", "--steps"), ("bench_model", "--batch"),
                                          ("bench_attention", "--lengths"), ("bench_compile", "--depths"),
                                          ("bench_soak", "--checkpoint-every")])
def test_benchmark_scripts_refuse_a_count_below_one(script, flag, monkeypatch, capsys):
    """--steps 0 was a ZeroDivisionError or a StatisticsError after compiling the model; a count
    below one is a usage error naming the flag."""
    import importlib
    import sys

    module = importlib.import_module(f"benchmarks.{script}")
    monkeypatch.setattr(sys, "argv", [f"{script}.py", flag, "0"])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    assert exit_info.value.code == 2 and f"argument {flag}: 0: must be at least 1" in capsys.readouterr().err


def test_summary_shows_an_attention_row_whose_gradient_did_not_compile():
    """bench_attention keeps the forward figures of a row whose gradient program failed to compile
    (train = {error}); the summary raised KeyError on it and the run wrote no report at all."""
    from benchmarks import run

    mib = 2**20
    rows = [dict(impl="reference", length=4096, forward_ms=100.0, forward=dict(peak_bytes=640 * mib),
                 train=dict(error="XlaRuntimeError: RESOURCE_EXHAUSTED: out of memory\nmore")),
            dict(impl="chunked", length=4096, forward_ms=120.0, forward=dict(peak_bytes=64 * mib),
                 train=dict(temp_bytes=None, peak_bytes=None))]
    table = {line["workload"]: line for line in run.summarise({"attention": {"rows": rows}}, {}, 25.0)}
    reference = table["attention reference causal L=4096"]["measured"]
    assert reference == ("100.0 ms, peak 640 MiB (train not compiled: XlaRuntimeError: RESOURCE_EXHAUSTED: "
                         "out of memory)")
    chunked = table["attention chunked causal L=4096"]
    assert chunked["measured"] == "120.0 ms, peak 64 MiB (train peak not reported)"
    assert chunked["ratio"] == 0.1


def test_soak_benchmark_samples_a_training_run_between_its_checkpoints(tmp_path):
    """bench_soak runs train.py on the tiny config and reports resident memory, threads and open
    files sampled between the first and the last checkpoint, and the slope of memory per save."""
    from benchmarks import bench_soak

    assert bench_soak.slope([1, 2, 3, 4], [10, 12, 14, 16]) == 2
    assert bench_soak.slope([5, 5], [1, 2]) is None
    result = bench_soak.main(["--steps", "40", "--checkpoint-every", "4", "--interval", "0.05",
                              "--workdir", str(tmp_path / "run"), "--data-dir", str(tmp_path / "data")])
    assert result["checkpoints_saved"] == 10 and result["checkpoints_on_disk"] == 5  # tiny keeps 5
    assert result["orbax_temporaries"] == []
    assert result["samples"] >= 2 and result["rss_kb_per_checkpoint"] is not None
    assert 100 < result["rss_mb_first"] < 8000 and 100 < result["rss_mb_last"] < 8000
    assert result["threads"][0] >= 1 and result["open_files"][0] >= 3
    with pytest.raises(SystemExit, match="2"):
        bench_soak.main(["--steps", "5", "--checkpoint-every", "10"])


def test_reports_name_the_cpu_they_measured(monkeypatch, tmp_path):
    """Hosts of one machine type differ 2x in bandwidth and in how fast their bf16 instructions
    are: each report records the CPU model and the extensions the kernels depend on."""
    import builtins

    from benchmarks import hardware

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Some CPU @ 2.0GHz\n"
                       "flags\t\t: fpu avx2 fma avx512f amx_tile\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: real_open(
        cpuinfo if path == "/proc/cpuinfo" else path, *a, **k))
    assert hardware.cpu_model() == dict(cpu_model="Some CPU @ 2.0GHz",
                                        cpu_flags=["avx2", "fma", "avx512f", "amx_tile"])
    monkeypatch.undo()
    assert {"cpu_model", "cpu_flags"} <= set(hardware.describe())


def _refuse_to_run(*args, **kwargs):
    raise AssertionError("the benchmark ran despite a bad argument")


@pytest.mark.parametrize("script, argv, message", [
    ("accelerator", [], "jax found no GPU or TPU (its backend is 'cpu')"),
    ("accelerator", ["--smoke", "--budget-s", "-1"], "argument --budget-s: -1: must be at least 0"),
    ("bench_soak", ["--interval", "-1"], "argument --interval: -1: must be more than 0"),
    ("bench_soak", ["--out", "{tmp}"], "--out {tmp}: not a writable file path"),
    ("bench_train", ["--vocab", "3"], "--vocab 3: the synthetic tokens are ids 4 and up"),
    ("bench_train", ["--heads", "3"], "num_heads"),
    ("bench_train", ["--dtype", "bf16"], "argument --dtype: invalid choice: 'bf16'"),
    ("bench_train", ["--out", "{tmp}"], "--out {tmp}: not a writable file path"),
    ("bench_data", ["--datasets", "enfr_builtin,nope"], "--datasets: unknown 'nope'"),
    ("bench_data", ["--batches", "0"], "argument --batches: 0: must be at least 1"),
    ("bench_data", ["--out", "{tmp}/file/under/a/file"], "--out {tmp}/file/under/a/file"),
    ("bench_decode", ["--profile", "--steps", "2"], "--profile needs at least 3 new tokens"),
    ("bench_decode", ["--tensor-parallel", "-2"], "argument --tensor-parallel: -2: must be at least 0"),
    ("bench_decode", ["--out", "{tmp}"], "--out {tmp}: not a writable file path"),
    ("bench_attention", ["--impls", "cudnn"], "--impls cudnn: 'cudnn' needs an NVIDIA GPU"),
    ("bench_attention", ["--memory-budget-gib", "-1"],
     "argument --memory-budget-gib: -1: must be more than 0"),
])
def test_benchmark_scripts_refuse_bad_arguments_before_running(script, argv, message, monkeypatch, capsys,
                                                              tmp_path):
    """Each mistake is a one-line usage error naming the argument, before anything is measured:
    before, --out was opened after the run (a traceback once the figures were in), --interval -1
    left a training run going in the background, a misspelt dataset failed after the ones before it
    were built, --vocab 3 and --batches 0 were numpy and ZeroDivision tracebacks, --impls cudnn a
    traceback at the first row, and accelerator.py without --smoke on a CPU ran the full sizes."""
    import importlib
    import sys

    import jax

    (tmp_path / "file").write_text("")
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")  # the refusals of a CPU, on any machine
    module = importlib.import_module(f"benchmarks.{script}")
    for name in ("run", "bench", "measure", "profile_steps", "tensor_parallel_row", "bench_lm",
                 "build_model"):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, _refuse_to_run)
    argv = [arg.format(tmp=tmp_path) for arg in argv]
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        module.main(*([argv] if script == "bench_soak" else []))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert message.format(tmp=tmp_path) in err and "Traceback" not in err


def test_accelerator_runs_the_full_sizes_on_a_cpu_only_when_told(monkeypatch):
    """--allow-cpu is the way past the refusal above; the run then gets the full sizes."""
    import sys

    import jax

    runs = []
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    monkeypatch.setattr(accelerator, "run", lambda smoke, **kwargs: runs.append(smoke) or dict(
        meta=dict(smoke=smoke), summary=[]))
    monkeypatch.setattr(sys, "argv", ["accelerator.py", "--allow-cpu"])
    accelerator.main()
    assert runs == [False]


def test_soak_benchmark_stops_its_training_run_when_it_is_interrupted(monkeypatch, tmp_path):
    """A Ctrl-C (or any failure) while the soak benchmark samples ends the training run it started,
    instead of leaving it to train on unwatched in the background."""
    import subprocess

    from benchmarks import bench_soak

    children = []
    popen = subprocess.Popen

    def start(command, **kwargs):  # a stand-in for train.py that would outlive the test
        children.append(popen(["sleep", "600"], **kwargs))
        return children[-1]

    def interrupted(seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_soak.subprocess, "Popen", start)
    monkeypatch.setattr(bench_soak.time, "sleep", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bench_soak.run(10, 5, str(tmp_path), str(tmp_path / "data"), 0.5)
    assert children and children[0].poll() is not None
