"""Tokenizer: exact round trip on any text, fixed special ids, cached training across processes."""

import json
import logging
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transformer_jax.data import tokenizer as tk
from transformer_jax.data.errors import DataError

TEXTS = ["the tired engineer drank the cold coffee", "l'ingénieur fatigué a bu le café froid",
         "I love chocolates", "j'aime les chocolats", "def f(x):\n    return x  # 42",
         "your cat is a great cat", "ton chat est un grand chat"] * 30


@pytest.fixture(scope="module", params=["bpe", "unigram"])
def tok(request):
    return tk.Tokenizer.train(TEXTS, tk.TokenizerSettings(vocab_size=400,
                                                          model_type=request.param))


def test_special_ids(tok):
    assert (tk.PAD_ID, tk.EOS_ID, tk.BOS_ID, tk.UNK_ID) == (0, 1, 2, 3)
    assert tok.id_to_piece(tk.EOS_ID) == "</s>"
    assert tok.id_to_piece(tk.PAD_ID) == "<pad>"
    assert 300 <= tok.vocab_size <= 400


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=60))
def test_round_trip_any_unicode(tok, text):
    ids = tok.encode(text)
    assert all(tk.UNK_ID < i < tok.vocab_size for i in ids)  # byte fallback: never <unk>
    assert tok.decode(ids) == text


@pytest.mark.parametrize("text", ["", " ", "  lead", "trail  ", "a\u2581b", "\u2581", " \u2581x",
                                  "\x00\x01\n\t\r\x7f", "é漢字🙂\ufeff", "a  b\n\n c"])
def test_round_trip_edge_cases(tok, text):
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode_batch(tok.encode_batch([text, "x"])) == [text, "x"]


def test_bad_input_does_not_crash(tok):
    assert tok.decode(tok.encode("x\ud800y")) == "x\ufffdy"  # lone surrogate
    assert tok.decode(tok.encode(b"ok \xff\xfe")) == "ok \ufffd\ufffd"  # invalid UTF-8 bytes
    assert tok.decode([5, 99999, -1, tk.EOS_ID, tk.PAD_ID]) == tok.decode([5])


def test_a_full_disk_while_saving_is_one_error_naming_the_file(tok, tmp_path, monkeypatch):
    """It was an OSError traceback (train.py exit status 1) where a workdir problem is one
    'error:' line: now a DataError naming the file, and no temporary file or partial file left."""
    import errno
    import os

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    path = tmp_path / "tokenizer.model"
    with pytest.raises(DataError, match=f"Could not write {path}: No space left on device. Free space"):
        tok.save(str(path))
    assert os.listdir(tmp_path) == []


def test_save_load_pickle(tok, tmp_path):
    import pickle

    tok.save(tmp_path / "t.model")
    again = tk.Tokenizer.load(tmp_path / "t.model")
    assert again.encode("I love chocolates") == tok.encode("I love chocolates")
    assert pickle.loads(pickle.dumps(tok)).encode("abc") == tok.encode("abc")


def test_get_or_train_reuses_and_retrains(tmp_path):
    calls = []

    def texts():
        calls.append(1)
        return TEXTS

    a = tk.get_or_train_tokenizer(tmp_path, "c1", texts, 350, "bpe", process_index=0)
    b = tk.get_or_train_tokenizer(tmp_path, "c1", texts, 350, "bpe", process_index=0)
    assert len(calls) == 1 and a.model_proto == b.model_proto
    meta = json.loads((tmp_path / tk.METADATA_FILENAME).read_text())
    assert meta["settings"]["corpus_key"] == "c1" and meta["settings"]["vocab_size"] == 350
    tk.get_or_train_tokenizer(tmp_path, "c1", texts, 360, "bpe", process_index=0)
    tk.get_or_train_tokenizer(tmp_path, "c2", texts, 360, "bpe", process_index=0)
    tk.get_or_train_tokenizer(tmp_path, "c2", texts, 360, "unigram", process_index=0)
    assert len(calls) == 4


def test_a_tokenizer_model_in_a_fresh_workdir_is_replaced_with_a_warning(tmp_path, caplog):
    """A tokenizer.model that tokenizer.json does not record for this data and these settings (one
    copied in by hand, say) is retrained before the workdir has checkpoints: it was replaced in
    silence."""
    tk.get_or_train_tokenizer(tmp_path, "c1", lambda: TEXTS, 350, "bpe", process_index=0)
    (tmp_path / tk.METADATA_FILENAME).unlink()
    with caplog.at_level(logging.WARNING):
        tk.get_or_train_tokenizer(tmp_path, "c1", lambda: TEXTS, 350, "bpe", process_index=0)
    assert any(r.getMessage().startswith(f"Replaced {tmp_path / tk.MODEL_FILENAME} by a tokenizer trained "
                                         "now: tokenizer.json does not record it") for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # recorded, so reused: no word
        tk.get_or_train_tokenizer(tmp_path, "c1", lambda: TEXTS, 350, "bpe", process_index=0)
    assert not caplog.records


def test_a_tokenizer_smaller_than_asked_is_named(tmp_path, caplog):
    """A text with fewer pieces than dataset.vocab_size gave a smaller tokenizer in silence, the
    model keeping embedding rows no token ever reaches (4,643 of 50,000 on the built-in corpus)."""
    import logging

    with caplog.at_level(logging.WARNING):
        tok = tk.get_or_train_tokenizer(tmp_path, "c1", lambda: ["ab ba"] * 20, 5000, "bpe", process_index=0)
    assert tok.vocab_size < 5000
    assert f"The tokenizer has {tok.vocab_size} pieces, fewer than dataset.vocab_size=5000" in caplog.text
    # never advised below the smallest vocab_size the settings take (it advised 262, then refused)
    assert tok.vocab_size < tk.MIN_VOCAB_SIZE and "(300 is the smallest dataset.vocab_size), set " \
        "dataset.vocab_size and model.vocab_size to 300 before" in caplog.text, caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        tk.get_or_train_tokenizer(tmp_path / "c", "c1", lambda: ["ab ba"] * 20, 300, "bpe", process_index=0)
    assert "(the smallest it takes)" in caplog.text and "set dataset.vocab_size" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        tk.get_or_train_tokenizer(tmp_path / "b", "c1", lambda: TEXTS, 350, "bpe", process_index=0)
    assert "fewer than dataset.vocab_size" not in caplog.text


@pytest.mark.parametrize("record", ["null", "[]", '"x"', "{not json"])
def test_a_tokenizer_json_that_is_no_record_is_retrained_or_kept_with_checkpoints(tmp_path, record, caplog):
    """JSON that is not an object (`null`, a list) raised AttributeError from `.get` in both paths."""
    calls = []

    def texts():
        calls.append(1)
        return TEXTS

    first = tk.get_or_train_tokenizer(tmp_path, "c1", texts, 350, "bpe", process_index=0)
    (tmp_path / tk.METADATA_FILENAME).write_text(record)
    again = tk.get_or_train_tokenizer(tmp_path, "c1", texts, 350, "bpe", process_index=0)
    assert len(calls) == 2 and again.model_proto == first.model_proto  # retrained: nothing to trust
    assert json.loads((tmp_path / tk.METADATA_FILENAME).read_text())["settings"]["corpus_key"] == "c1"
    (tmp_path / tk.METADATA_FILENAME).write_text(record)
    (tmp_path / "checkpoints" / "10").mkdir(parents=True)
    with caplog.at_level("WARNING"):
        kept = tk.get_or_train_tokenizer(tmp_path, "c1", texts, 350, "bpe", process_index=0)
    assert len(calls) == 2 and kept.model_proto == first.model_proto
    assert f"no readable {tk.METADATA_FILENAME}" in caplog.text
    assert tk.recorded_model_differs(tmp_path, kept) is None


def test_other_processes_wait_for_process_zero(tmp_path):
    results = {}

    def worker():
        results["p1"] = tk.get_or_train_tokenizer(tmp_path, "k", lambda: 1 / 0, 350, "bpe",
                                                  process_index=1, wait_timeout_s=60)

    t = threading.Thread(target=worker)
    t.start()
    p0 = tk.get_or_train_tokenizer(tmp_path, "k", lambda: TEXTS, 350, "bpe", process_index=0)
    t.join(60)
    assert results["p1"].model_proto == p0.model_proto
    with pytest.raises(TimeoutError, match="shared"):
        tk.get_or_train_tokenizer(tmp_path, "other", lambda: TEXTS, 350, "bpe",
                                  process_index=1, wait_timeout_s=0.2)


def test_bad_settings():
    with pytest.raises(ValueError, match="model_type"):
        tk.TokenizerSettings(model_type="wordpiece")
    with pytest.raises(ValueError, match="vocab_size"):
        tk.TokenizerSettings(vocab_size=100)


def test_vocabulary_too_small_for_the_characters_names_the_setting():
    # 103 distinct characters: with the 256 byte pieces and 4 specials, 300 pieces cannot give the
    # characters of 98% of the text a piece each (SentencePiece's lowest coverage)
    import random
    import string

    rng = random.Random(0)
    chars = string.ascii_letters + string.digits + string.punctuation + "äöüßÄÖÜé "
    texts = ["".join(rng.choice(chars) for _ in range(60)) for _ in range(500)]
    with pytest.raises(DataError, match=r"vocab_size=300 is too small .* need \d+ pieces .*"
                                           r"raise dataset.vocab_size"):
        tk.Tokenizer.train(texts, tk.TokenizerSettings(vocab_size=300))
    assert tk.Tokenizer.train(texts, tk.TokenizerSettings(vocab_size=400)).vocab_size == 400


def test_decode_batch_of_nothing_is_an_empty_list(tok):
    assert tok.decode_batch([]) == [] and tok.decode_batch([[]]) == [""]


def test_workdir_with_checkpoints_never_retrains(tmp_path, monkeypatch):
    calls = []

    def texts():
        calls.append(1)
        return TEXTS

    first = tk.get_or_train_tokenizer(tmp_path, "c1", texts, 350, "bpe", process_index=0)
    model = (tmp_path / tk.MODEL_FILENAME).read_bytes()
    (tmp_path / "checkpoints" / "20.orbax-checkpoint-tmp-1").mkdir(parents=True)
    tk.get_or_train_tokenizer(tmp_path, "c0", texts, 350, "bpe", process_index=0)
    assert len(calls) == 2  # a partial save is not a checkpoint: retraining is still allowed
    first = tk.get_or_train_tokenizer(tmp_path, "c1", texts, 350, "bpe", process_index=0)
    model = (tmp_path / tk.MODEL_FILENAME).read_bytes()
    (tmp_path / "checkpoints" / "20").mkdir()
    # New or re-prepared data: the tokenizer the checkpoints were trained with is kept, with a
    # warning naming both corpus keys (and none when nothing changed).
    warnings = []
    monkeypatch.setattr(tk.logging, "warning", lambda msg, *args: warnings.append(msg % args))
    kept = tk.get_or_train_tokenizer(tmp_path, "c2", texts, 350, "bpe", process_index=0)
    assert kept.model_proto == first.model_proto
    assert len(warnings) == 1 and "corpus key 'c1' -> 'c2'" in warnings[0], warnings
    # and that a resumed pipeline starts where it stopped in the old data (nothing said it)
    assert "starts at the position saved for the data it read then (config.resume_data_position=False" \
        in warnings[0], warnings
    # named by the config keys a user sets back (it said model_type, max_training_chars)
    with pytest.raises(DataError, match=r"dataset\.vocab_size 350 \(tokenizer\) -> 360.*fresh workdir"):
        tk.get_or_train_tokenizer(tmp_path, "c1", texts, 360, "bpe", process_index=1)
    with pytest.raises(DataError, match=r"dataset\.tokenizer_type 'bpe' \(tokenizer\) -> 'unigram' \(now\); "
                                        r"dataset\.tokenizer_max_chars 20000000 \(tokenizer\) -> 1000"):
        tk.get_or_train_tokenizer(tmp_path, "c1", texts, 350, "unigram", process_index=1,
                                  max_training_chars=1000)
    assert len(calls) == 3 and (tmp_path / tk.MODEL_FILENAME).read_bytes() == model
    # A library upgrade (settings version) alone keeps the tokenizer the checkpoints used.
    monkeypatch.setattr(tk, "_SETTINGS_VERSION", tk._SETTINGS_VERSION + 1)
    warnings.clear()
    again = tk.get_or_train_tokenizer(tmp_path, "c1", texts, 350, "bpe", process_index=0)
    assert len(calls) == 3 and again.model_proto == first.model_proto and not warnings, warnings
    (tmp_path / tk.MODEL_FILENAME).write_bytes(b"junk")
    with pytest.raises(DataError, match=r"Cannot use tokenizer .*tokenizer\.model"):
        tk.get_or_train_tokenizer(tmp_path, "c1", texts, 350, "bpe", process_index=0)


def test_load_errors_name_the_file(tmp_path):
    import io

    import sentencepiece as spm

    bad = tmp_path / "corrupt.model"
    for data in (b"not a model", b""):
        bad.write_bytes(data)
        with pytest.raises(DataError, match=r"Cannot use tokenizer .*corrupt\.model: not a "
                                            r"SentencePiece model.*Put back"):
            tk.Tokenizer.load(bad)
    buf = io.BytesIO()  # SentencePiece's default ids: unk 0, bos 1, eos 2, no pad
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXTS), model_writer=buf,
                                   vocab_size=40, minloglevel=2)
    (tmp_path / "default_ids.model").write_bytes(buf.getvalue())
    with pytest.raises(DataError, match=r"default_ids\.model: SentencePiece model has special "
                                        r"ids \(pad, eos, bos, unk\)=\(-1, 2, 1, 0\)"):
        tk.Tokenizer.load(tmp_path / "default_ids.model")


def test_decode_drops_the_first_id_past_the_vocabulary(tok):
    """vocab_size itself is out of range (ids run 0..vocab_size-1): dropped, not an IndexError."""
    n = tok.vocab_size
    assert tok.decode([5, n, n - 1]) == tok.decode([5, n - 1])
    assert tok.decode_batch([[n], [5, n]]) == ["", tok.decode([5])]


def test_training_text_is_cut_per_line_and_stops_at_the_budget():
    settings = tk.TokenizerSettings(max_training_chars=7, max_sentence_chars=4)
    # 'abcdefgh' is cut to 'abcd' (4 chars), blank lines are skipped, 'xy' makes 6 < 7, 'zzzz'
    # (cut to 4) makes 10 >= 7: it is the last line taken.
    texts = ["abcdefgh\n\n  \nxy", "zzzzzz\nnever", "never"]
    assert list(tk._training_sentences(texts, settings)) == ["abcd", "xy", "zzzz"]
    # A corpus that is one long line (a minified file) trains: SentencePiece would leave out a
    # sentence longer than its max_sentence_length and then find no text at all.
    one_line = tk.Tokenizer.train(["word " * 5000], tk.TokenizerSettings(vocab_size=300))
    assert one_line.decode(one_line.encode("word word")) == "word word"
    assert len(one_line.encode("word word")) == 2  # 'word' was learnt as a piece


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_tokenizer_files_are_readable_as_the_umask_allows(tmp_path, umask, mode):
    """Written through a temporary file (mkstemp: 0600 whatever the umask), the tokenizer was the
    one file of a workdir that a teammate who could read the checkpoints could not."""
    import os

    old = os.umask(umask)
    try:
        tk._atomic_write(tmp_path / "tokenizer.model", b"model")
    finally:
        os.umask(old)
    assert (tmp_path / "tokenizer.model").stat().st_mode & 0o777 == mode
    assert (tmp_path / "tokenizer.model").read_bytes() == b"model"
