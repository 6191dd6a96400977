"""The accelerator benchmark script runs end to end (tiny sizes, on CPU) and reports every figure;
the CPU suite's rows are set against the run's limits."""

import json
import math

import jax

from benchmarks import accelerator


def test_accelerator_script_smoke_run_reports_every_section():
    report = accelerator.run(smoke=True)
    json.dumps(report, default=str)  # the file it writes
    results = report["results"]
    for name in ("train", "decode", "attention"):
        assert "error" not in results[name], results[name].get("traceback")
    [train] = results["train"]["rows"]
    assert train["attention_impl"] == accelerator.fused_attention_impl(report["meta"]["platform"])
    assert 0 < train["mfu"] < 1 and train["tokens_per_s"] > 0 and math.isfinite(train["loss"])
    decode = {row["batch"]: row for row in results["decode"]["rows"]}
    assert sorted(decode) == [1, 8]
    for row in decode.values():
        # bf16 weights: the roofline counts the bytes actually held, params + whole KV cache
        assert row["weights"] == "bfloat16" and row["decode_tok_s"] > 0
        # the tiny model's bytes stay in the processor's cache, and a bandwidth reading under the
        # other test worker's load can be low: above 1 is possible; a unit slip (bits, ms) is not
        assert 0 < row["roofline_frac"] < 10
    assert decode[8]["bytes_per_step"] > decode[1]["bytes_per_step"]  # a bigger cache
    impls = {row["impl"] for row in results["attention"]["rows"]}
    assert {"xla", "chunked"} <= impls
    assert [line["target"] for line in report["summary"]] == [0.45, 0.6, None]
    assert report["meta"]["peak_bf16_tflops"] > 0 and report["meta"]["bandwidth_gb_s"] > 0


def test_rows_are_set_against_the_highest_reading_of_the_run():
    from benchmarks import run

    row = dict(batch=8, new_tokens=64, decode_tok_s=350.0, decode_step_ms=22.9)
    results = {
        "train": {"rows": [dict(dtype="float32", peak_tflops=0.2, mfu=0.6),
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
    # encoder-decoder: nothing of the encoder (its layers, positions, source table) is read
    config = tj.presets.tiny(position="learned", max_len=128, share_embeddings=False)
    params = bench_decode.random_params(tj.Transformer(config), ones, ones, dtype="float32")
    decoder_side = bench_decode.tree_bytes(params) - bench_decode.tree_bytes(
        (params["encoder"], params["source_embed"]))
    assert bench_decode.step_param_bytes(config, params, 2) == decoder_side - table + 2 * config.d_model * 4


def test_tensor_parallel_decoding_row_counts_the_padded_model_and_is_labelled():
    import transformer_jax as tj
    from benchmarks import bench_decode, run

    config = tj.presets.tiny(vocab_size=61, num_encoder_layers=0, pad_vocab_multiple=8, dropout_rate=0.0)
    row = bench_decode.tensor_parallel_row(config, batch=4, steps=4, tensor=4, repeats=1)
    # (the step time is the whole run's minus the prefill's, floored at 1 ns: on this tiny model under
    # load its milliseconds can round to 0, so ratios use the unrounded seconds)
    assert row["tensor_parallel"] == 4 and row["padded_vocab"] == 64 and row["decode_step_s"] > 0
    assert "roofline_frac" not in row  # the parent process sets it against its own bandwidth reading
    params = bench_decode.random_params(tj.TransformerLM(config), jax.numpy.ones((1, 8), jax.numpy.int32),
                                        dtype="float32")
    cache = tj.init_cache(config, 4, bench_decode.PROMPT + 4)
    # every parameter (the 64-row table included) and the whole cache, read once per step
    assert row["bytes_per_step"] == bench_decode.tree_bytes(params) + bench_decode.tree_bytes(cache.layers)
    assert params["embed"]["embedding"].value.shape == (64, config.d_model)
    # the row is set against the run's bandwidth like the others and carries the batch-8 target
    line = dict(row, batch=8, roofline_frac=0.61, bandwidth_gb_s=24.0, dtype="bfloat16",
                kernel_layout="out_in")
    table = run.summarise({"decode": {"rows": [line]}}, {}, 24.0)
    assert table[0]["workload"] == "decode gpt2_small bfloat16 out_in tensor=4 b8 (4 new)"
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
