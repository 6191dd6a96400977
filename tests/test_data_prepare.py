"""Multi-process dataset preparation: process 0 builds, the others wait for the finished files."""

import tempfile
import threading
import time

import jax
import pytest

from transformer_jax.data import DataError, builders


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


def test_a_data_dir_that_cannot_be_written_is_one_error_naming_it(tmp_path):
    """A dataset.data_dir that is a file (or read-only, or on a full disk) was a 45-line traceback
    from TFDS's download manager and exit status 1; now a DataError, one line from train.py."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(DataError, match=rf"Cannot prepare dataset enfr_builtin in {blocker}/.* "
                                        r"\(dataset.data_dir\): Not a directory .*choose another "
                                        r"--config.dataset.data_dir"):
        builders.prepare(_builder(str(blocker)))


def test_built_in_and_file_builders_leave_no_temporary_directories(tmp_path, monkeypatch):
    # TFDS makes an empty directory for metadata it would fetch from its bucket and leaves it behind;
    # our builders' metadata is never there, so constructing and preparing one makes none.
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    pairs, lines = tmp_path / "pairs.tsv", tmp_path / "lines.txt"
    pairs.write_text("a cat\tun chat\n")
    lines.write_text("one line\n")
    data_dir = str(tmp_path / "data")
    made = [builders.prepare(_builder(data_dir)),
            builders.StdlibLm(config=builders._PY, data_dir=data_dir, file_format="array_record"),
            builders.TranslationFiles(config=builders.files_config([str(pairs)], []), data_dir=data_dir,
                                      file_format="array_record"),
            builders.TextFiles(config=builders.files_config([str(lines)], []), data_dir=data_dir,
                               file_format="array_record")]
    assert [b.name for b in made] == ["enfr_builtin", "stdlib_lm", "translation_files", "text_files"]
    assert sorted(p.name for p in scratch.iterdir()) == []


@pytest.mark.parametrize("name, valid", [("enfr_builtin", ["default", "small"]),
                                         ("stdlib_lm", ["py311", "py311_small"])])
def test_an_unknown_builder_config_is_named_with_the_valid_ones(tmp_path, name, valid):
    """--config.dataset.builder_config=nosuch was tfds' ValueError traceback from the builder."""
    with pytest.raises(DataError, match=rf"dataset.builder_config='nosuch' is not a configuration of "
                                        rf"'{name}'; choose one of {valid!r}".replace("[", r"\[")):
        builders.builtin_builder(name, str(tmp_path), "nosuch")
    assert list(tmp_path.iterdir()) == []  # nothing prepared
