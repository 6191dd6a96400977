"""Multi-process dataset preparation: process 0 builds, the others wait for the finished files."""

import threading
import time

import jax

from transformer_jax.data import builders


def _builder(data_dir):
    return builders.EnfrBuiltin(config="small", data_dir=data_dir, file_format="array_record")


def test_other_processes_wait_for_process_0(tmp_path, monkeypatch, capsys):
    data_dir = str(tmp_path)
    waiting = _builder(data_dir)  # made before the files exist, as on a second host
    assert not waiting.data_path.exists()
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("b", builders.prepare(waiting)))
    thread.start()
    time.sleep(1.5)
    assert thread.is_alive() and not waiting.data_path.exists()  # still waiting, wrote nothing
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    capsys.readouterr()
    builders.prepare(_builder(data_dir))  # process 0 builds
    # its own words, not TFDS's "Downloading and preparing dataset Unknown size (download: ...)"
    out = capsys.readouterr().out
    assert f"Preparing dataset enfr_builtin (small) in {data_dir}" in out and "nothing is downloaded" in out
    assert "Downloading" not in out and f"Dataset enfr_builtin prepared in {data_dir}" in out
    thread.join(timeout=60)
    b = result["b"]
    assert b.info.splits["train"].num_examples > 0
    assert len(b.as_data_source(split="validation")) == b.info.splits["validation"].num_examples


def test_waiting_times_out_with_a_clear_message(tmp_path, monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    try:
        builders.prepare(_builder(str(tmp_path)), wait_timeout_s=0.5)
    except TimeoutError as e:
        assert "shared by all hosts" in str(e)
    else:
        raise AssertionError("expected a TimeoutError")
