"""Multi-process dataset preparation: process 0 builds, the others wait for the finished files."""

import tempfile
import threading
import time

import jax
import pytest

from transformer_jax.data import DataError, builders


def _builder(data_dir):
    return builders.EnfrBuiltin(config="small", data_dir=data_dir, file_format="array_record")


def _two_processes_sharing_the_data_dir(monkeypatch, shared=True, same=True):
    """The collectives of a two-process start, as one process sees them: not every process has the
    prepared files yet, each would prepare the same dataset (or not), and its data_dir is (or is
    not) the one process 0 prepares in."""
    from transformer_jax import parallel

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(parallel, "on_every_process", lambda flag: False)
    monkeypatch.setattr(parallel, "same_on_every_process", lambda text: same)
    monkeypatch.setattr(builders, "_shares_process_0_data_dir", lambda builder: shared)


def test_other_processes_wait_for_process_0(tmp_path, monkeypatch, capsys):
    data_dir = str(tmp_path)
    waiting = _builder(data_dir)  # made before the files exist, as on a second host
    assert not waiting.data_path.exists()
    _two_processes_sharing_the_data_dir(monkeypatch)
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
    _two_processes_sharing_the_data_dir(monkeypatch)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    try:
        builders.prepare(_builder(str(tmp_path)), wait_timeout_s=0.5)
    except TimeoutError as e:
        assert "shared by all hosts" in str(e)
    else:
        raise AssertionError("expected a TimeoutError")


def test_a_process_with_its_own_copy_of_the_data_dir_prepares_it(tmp_path, monkeypatch, capsys):
    """The README lets dataset.data_dir differ between hosts (a local cache on each): a process
    whose folder is not process 0's waited 30 minutes for files process 0 never writes there, the
    others waiting for it in silence. It prepares its own copy."""
    _two_processes_sharing_the_data_dir(monkeypatch, shared=False)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    local = builders.prepare(_builder(str(tmp_path / "local")), wait_timeout_s=1)
    assert local.info.splits["train"].num_examples > 0
    out = capsys.readouterr().out
    assert f"Process 1: dataset.data_dir {tmp_path / 'local'} is not the one process 0 prepares in" in out


def test_processes_that_would_prepare_different_datasets_are_stopped(tmp_path, monkeypatch):
    """User files are prepared in a folder named by a hash of their paths and contents: a host
    with other files would train on other data (the marker check below would call its folder "a
    local copy" and prepare it). Every process names it instead."""
    _two_processes_sharing_the_data_dir(monkeypatch, same=False)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    with pytest.raises(DataError, match=r"the processes would prepare different datasets: "
                                        r"enfr_builtin/small/1.0.0 on process 1\. Give every host the "
                                        r"same data files"):
        builders.prepare(_builder(str(tmp_path)), wait_timeout_s=1)


def test_whether_a_data_dir_is_process_0s_is_found_by_a_file_process_0_writes(tmp_path, monkeypatch):
    """Process 0 writes a file named by a number it draws in its dataset.data_dir; a process sees
    it where it shares that folder, not in a copy of the path on its own disk. The file is removed.
    Where process 0 cannot write it (a read-only folder), the folder counts as shared, as before."""
    from transformer_jax import parallel

    ours, other = _builder(str(tmp_path / "shared")), _builder(str(tmp_path / "own"))
    marker = tmp_path / "shared" / ".shared-check-12345"
    answers = []

    def from_process_0(value):  # the number drawn, then whether process 0 wrote its file
        answers.append(value)
        if len(answers) % 2:
            return 12345
        if jax.process_index() == 0:  # its own answer
            return value
        if process_0_writes:
            marker.parent.mkdir(exist_ok=True)
            marker.write_text("")
        return int(process_0_writes)

    monkeypatch.setattr(parallel, "on_every_process", lambda flag: flag)
    monkeypatch.setattr(parallel, "from_process_0", from_process_0)
    monkeypatch.setattr(parallel, "sync_global", lambda name: None)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    process_0_writes = True
    assert builders._shares_process_0_data_dir(ours) is True
    marker.unlink()
    assert builders._shares_process_0_data_dir(other) is False
    marker.unlink()
    process_0_writes = False
    assert builders._shares_process_0_data_dir(other) is True  # as before: wait for process 0
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    assert builders._shares_process_0_data_dir(ours) is True  # it writes and sees its own file...
    assert not marker.exists()  # ...and removes it


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
