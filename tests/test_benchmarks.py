"""The accelerator benchmark script runs end to end (tiny sizes, on CPU) and reports every figure."""

import json
import math

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
        assert 0 < row["roofline_frac"] < 2
    assert decode[8]["bytes_per_step"] > decode[1]["bytes_per_step"]  # a bigger cache
    impls = {row["impl"] for row in results["attention"]["rows"]}
    assert {"xla", "chunked"} <= impls
    assert [line["target"] for line in report["summary"]] == [0.45, 0.6, None]
    assert report["meta"]["peak_bf16_tflops"] > 0 and report["meta"]["bandwidth_gb_s"] > 0
