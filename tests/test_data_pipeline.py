"""grain pipeline: packing, determinism, exact resume, per-host shards, eval coverage, datasets."""

import collections
import os
import re

import grain
import numpy as np
import pytest
import tensorflow_datasets as tfds

from transformer_jax.data import builders, inputs, packing, pipeline
from transformer_jax.data import tokenizer as tk
from transformer_jax.data.errors import DataError

tfds.disable_progress_bar()
SOURCE = [{"src": f"sentence number {i} " + "x" * (i % 7), "tgt": f"phrase {i} " + "y" * (i % 5)}
          for i in range(97)]
TRANSLATION = pipeline.Features({"inputs": "src", "targets": "tgt"})
LENGTHS = {"inputs": 24, "targets": 20}


@pytest.fixture(scope="module")
def tok():
    texts = [r["src"] for r in SOURCE] + [r["tgt"] for r in SOURCE]
    return tk.Tokenizer.train(texts, tk.TokenizerSettings(vocab_size=320))


def shard(i=0, n=1):
    return grain.sharding.ShardOptions(i, n)


def _segments(batch, key):
    """The examples in a batch: lists of token ids, one per (row, segment)."""
    out = []
    for row, seg in zip(batch[key], batch[f"{key}_segment_ids"]):
        for s in range(1, seg.max() + 1):
            out.append(tuple(row[seg == s]))
    return out


def _check_layout(batch, key, eos=True):
    tokens, seg, pos = batch[key], batch[f"{key}_segment_ids"], batch[f"{key}_positions"]
    assert tokens.dtype == seg.dtype == pos.dtype == np.int32
    assert np.all(tokens[seg == 0] == 0) and np.all(pos[seg == 0] == 0)
    for row_seg, row_pos, row_tok in zip(seg, pos, tokens):
        n = int(row_seg.max())
        ends = []
        for s in range(1, n + 1):
            idx = np.flatnonzero(row_seg == s)
            assert np.array_equal(idx, np.arange(idx[0], idx[-1] + 1))  # contiguous
            assert np.array_equal(row_pos[idx], np.arange(len(idx)))  # positions restart
            if eos:  # each example ends with its only EOS
                assert row_tok[idx[-1]] == tk.EOS_ID and tk.EOS_ID not in row_tok[idx[:-1]]
            ends.append(idx[-1])
        assert ends == sorted(ends)  # segments in order, padding only at the end
        assert np.all(row_seg[: ends[-1] + 1] > 0) if n else True


def test_make_row_literal():
    row = packing.make_row([{"t": [5, 6, 1]}, {"t": [7, 1]}], {"t": 7})
    np.testing.assert_array_equal(row["t"], [5, 6, 1, 7, 1, 0, 0])
    np.testing.assert_array_equal(row["t_segment_ids"], [1, 1, 1, 2, 2, 0, 0])
    np.testing.assert_array_equal(row["t_positions"], [0, 1, 2, 0, 1, 0, 0])
    with pytest.raises(ValueError, match="fit"):
        packing.make_row([{"t": [1] * 8}], {"t": 7})


def test_first_fit_emits_the_fullest_row_when_every_row_is_open():
    """Rows of 10 tokens, two open at most. A (6) opens row 1, B (8) row 2; C (5) fits neither and
    both rows are open, so the fullest (B) leaves and C opens a row; D (4) fills A's row, which
    leaves at once; C is emitted at the end. (Emitting the emptiest row, or keeping a third row
    open, each keeps every token and passed the other packing tests.)"""
    A, B, C, D = [5] * 6, [6] * 8, [7] * 5, [8] * 4
    ds = grain.MapDataset.source([{"t": np.array(x)} for x in (A, B, C, D)]).to_iter_dataset()
    rows = list(packing.FirstFitPackIterDataset(ds, {"t": 10}, num_bins=2))
    real = [r["t"][r["t_segment_ids"] > 0].tolist() for r in rows]
    assert real == [B, A + D, C]


def test_a_row_full_in_one_feature_is_not_held_for_ever():
    """Translation rows of 40 source and 10 target tokens, two open at most. A's row has 1 target
    token left, so it takes no more examples; B-rows (15 + 3 tokens each) keep forming beside it.
    Counting free tokens over both features, A's row (38 + 1 free) looked emptier than a B-row
    (10 + 4) every time one had to leave, and A came out only when the stream ended: in the
    endless training stream, never."""
    A = {"inputs": [5] * 2, "targets": [5] * 9}
    B = {"inputs": [6] * 15, "targets": [6] * 3}
    ds = grain.MapDataset.source([A] + [B] * 60).to_iter_dataset()
    rows = list(packing.FirstFitPackIterDataset(ds, {"inputs": 40, "targets": 10}, num_bins=2))
    first_sources = [r["inputs"][r["inputs_segment_ids"] == 1].tolist() for r in rows]
    assert first_sources.index(A["inputs"]) <= 1  # A's row leaves when the next one must


def test_packing_keeps_every_token_and_pairs_segments(tok):
    examples = [pipeline.Tokenize(tok, TRANSLATION, LENGTHS).map(r) for r in SOURCE]
    ds = grain.MapDataset.source(examples).to_iter_dataset()
    rows = list(packing.FirstFitPackIterDataset(ds, LENGTHS, num_bins=4))
    batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    for key in LENGTHS:
        _check_layout(batch, key)
    # each example's source and target share the segment id of one row
    np.testing.assert_array_equal(batch["inputs_segment_ids"].max(1),
                                  batch["targets_segment_ids"].max(1))
    packed = list(zip(_segments(batch, "inputs"), _segments(batch, "targets")))
    expected = [(tuple(e["inputs"]), tuple(e["targets"])) for e in examples]
    assert collections.Counter(packed) == collections.Counter(expected)
    assert len(rows) < len(examples) / 2  # several examples per row


def _take(it, n):
    return [next(it) for _ in range(n)]


def _equal(a, b):
    return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in x) and len(a) == len(b)


@pytest.mark.parametrize("pack", [True, False])
def test_train_iterator_deterministic_and_resumable(tok, pack):
    make = lambda seed=0: pipeline.make_train_iterator(
        SOURCE, tok, TRANSLATION, LENGTHS, 4, seed=seed, pack=pack, shard=shard())
    it = make()
    first = _take(it, 3)
    for key in LENGTHS:
        _check_layout(first[0], key)
    state = it.get_state()
    after = _take(it, 40)  # runs through several epochs
    assert _equal(first, _take(make(), 3))
    assert not _equal(first, _take(make(seed=1), 3))
    resumed = make()
    resumed.set_state(state)
    assert _equal(after, _take(resumed, 40))


def test_seeds_do_not_share_epoch_orders(tok):
    """grain reshuffles epoch e with the shuffle seed + e: given dataset.seed as it is, seed 1's
    first epoch was seed 0's second, record for record."""
    n = len(SOURCE)

    def rows(seed, count):
        it = pipeline.make_train_iterator(SOURCE, tok, TRANSLATION, LENGTHS, 1, seed=seed, pack=False,
                                          shard=shard())
        return [tuple(next(it)["inputs"][0].tolist()) for _ in range(count)]

    zero, one = rows(0, 2 * n), rows(1, n)
    assert sorted(zero[:n]) == sorted(zero[n:]) == sorted(one)  # every record once an epoch
    assert len(set(zero[:n])) == n and zero[:n] != zero[n:]      # reshuffled each epoch
    assert zero[n:] != one and zero[:n] != one


def test_resuming_with_shorter_rows_names_the_setting(tok):
    """The saved packing bins hold rows being filled to the old lengths; with shorter rows they
    failed deep inside row building ('examples do not fit in 16 tokens')."""
    make = lambda lengths: pipeline.make_train_iterator(SOURCE, tok, TRANSLATION, lengths, 4, shard=shard())
    it = make(LENGTHS)
    _take(it, 3)
    state = it.get_state()
    shorter = make({key: 4 for key in LENGTHS})
    with pytest.raises(DataError, match=r"tokens of '.*', more than this run's rows of 4 .*"
                                        r"resume_data_position=False"):
        shorter.set_state(state)


def test_resume_through_orbax(tok, tmp_path):
    import orbax.checkpoint as ocp

    make = lambda: pipeline.make_train_iterator(SOURCE, tok, TRANSLATION, LENGTHS, 4,
                                                shard=shard())
    it = make()
    _take(it, 5)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(5, args=ocp.args.Composite(data=pipeline.checkpoint_args(it)))
        mngr.wait_until_finished()
    expected = _take(it, 5)
    fresh = make()
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.restore(5, args=ocp.args.Composite(
            data=pipeline.checkpoint_args(fresh, restore=True)))
    assert _equal(expected, _take(fresh, 5))


def test_two_processes_read_disjoint_complete_shards(tok):
    seen = []
    for i in range(2):
        it = pipeline.make_train_iterator(SOURCE, tok, TRANSLATION, LENGTHS, 1, pack=False,
                                          shard=shard(i, 2))
        start, end = pipeline.shard_bounds(len(SOURCE), i, 2)
        epoch = [tok.decode(b["inputs"][0]) for b in _take(it, end - start)]
        assert len(set(epoch)) == end - start  # one epoch = the whole slice once
        seen.append(set(epoch))
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == {r["src"] for r in SOURCE}


def test_eval_covers_every_example_once(tok):
    per_host = []
    for i in range(2):
        batches = pipeline.make_eval_batches(SOURCE, tok, TRANSLATION, LENGTHS, 8,
                                             shard=shard(i, 2))
        assert len(batches) == 7  # ceil(ceil(97 / 2) / 8) on both hosts
        rows = [row for b in batches for row, s in zip(b["targets"], b["targets_segment_ids"])
                if s.max() > 0]
        for b in batches:
            _check_layout(b, "inputs")
            assert set(np.unique(b["targets_segment_ids"])) <= {0, 1}
        per_host.append([tok.decode(r) for r in rows])
    everything = per_host[0] + per_host[1]
    assert sorted(everything) == sorted(r["tgt"] for r in SOURCE)
    limited = pipeline.make_eval_batches(SOURCE, tok, TRANSLATION, LENGTHS, 8, shard=shard(),
                                         max_examples=10)
    assert sum(int((b["targets_segment_ids"].max(1) > 0).sum()) for b in limited) == 10


def test_lm_eval_scores_every_token_once(tok):
    lm = pipeline.Features({"targets": "text"})
    docs = [{"text": f"doc {i} " + "word " * (i * 7)} for i in range(9)]
    ids = [tok.encode(d["text"]) + [tk.EOS_ID] for d in docs]
    assert max(map(len, ids)) > 3 * 16  # some documents need several rows
    pieces, num_batches = [], set()
    for i in range(2):
        batches = pipeline.make_eval_batches(docs, tok, lm, {"targets": 16}, 4, shard=shard(i, 2))
        num_batches.add(len(batches))
        for b in batches:
            _check_layout(b, "targets", eos=False)
        pieces += _segments({k: np.concatenate([b[k] for b in batches]) for k in batches[0]},
                            "targets")
    assert len(num_batches) == 1  # both hosts run the same number of eval steps
    # In order, every token once; EOS only at the end of a document, never at a cut.
    assert [t for p in pieces for t in p] == [t for d in ids for t in d]
    assert sum(p[-1] == tk.EOS_ID for p in pieces) == len(docs)


def test_length_policies(tok):
    long = [{"text": "word " * 200}, {"text": "short"}]
    lm = pipeline.Features({"targets": "text"})
    cut = pipeline.Tokenize(tok, lm, {"targets": 16}, "truncate").map(long[0])
    assert len(cut["targets"]) == 16 and cut["targets"][-1] == tk.EOS_ID
    # the first 15 tokens are kept (a text whose tokens differ along it: the head, not the tail)
    varied = " ".join(f"sentence number {i}" for i in range(40))
    cut = pipeline.Tokenize(tok, lm, {"targets": 16}, "truncate").map({"text": varied})
    assert list(cut["targets"]) == list(tok.encode(varied)[:15]) + [tk.EOS_ID]
    assert pipeline.Tokenize(tok, lm, {"targets": 16}, "drop").map(long[0]) is None
    it = pipeline.make_train_iterator(long, tok, lm, {"targets": 16}, 2, length_policy="drop",
                                      shard=shard())
    b = next(it)
    assert all(tok.decode(r) == "short" for r in _segments(b, "targets"))
    pieces = pipeline.Tokenize(tok, lm, {"targets": 16}, "split").map(long[0])
    joined = np.concatenate([p["targets"] for p in pieces])
    assert tok.decode(joined) == long[0]["text"] and joined[-1] == tk.EOS_ID
    assert pipeline.LENGTH_STATS.counts["train/targets/dropped"] >= 1
    with pytest.raises(ValueError, match="length_policy"):
        pipeline.Tokenize(tok, lm, {"targets": 16}, "wrap")


def test_drop_with_nothing_that_fits_is_an_error_not_a_hang(tok):
    lm = pipeline.Features({"targets": "text"})
    long = [{"text": "word " * 200}] * 10
    with pytest.raises(DataError, match=r"keeps none of the 10 examples of split 'mine'.*longer "
                                        r"than 16 tokens \(EOS included\) in targets \(field "
                                        r"'text'"):
        pipeline.make_train_iterator(long, tok, lm, {"targets": 16}, 2, length_policy="drop",
                                     shard=shard(), split="mine")
    pairs = [{"src": "short", "tgt": "word " * 50}, {"src": "word " * 50, "tgt": "short"}]
    with pytest.raises(DataError, match=r"1 longer than 20 tokens.* in targets.*1 longer than "
                                        r"24 tokens.* in inputs \(field 'src'"):
        pipeline.make_train_iterator(pairs, tok, TRANSLATION, LENGTHS, 2, length_policy="drop",
                                     shard=shard())
    # One example that fits is enough (the one that fits comes last in the shard).
    it = pipeline.make_train_iterator(long + [{"text": "short"}], tok, lm, {"targets": 16}, 2,
                                      length_policy="drop", shard=shard())
    assert tok.decode(_segments(next(it), "targets")[0]) == "short"


def test_an_example_of_exactly_the_row_length_fits(tok):
    """EOS included, ``limit`` tokens fit and ``limit + 1`` do not, under every policy."""
    lm = pipeline.Features({"targets": "text"})
    record = {"text": "sentence number 7"}
    expected = tok.encode(record["text"]) + [tk.EOS_ID]
    n = len(expected)
    for policy in ("truncate", "drop", "split"):
        out = pipeline.Tokenize(tok, lm, {"targets": n}, policy).map(record)
        out = out[0] if policy == "split" else out
        assert out["targets"].tolist() == expected, policy
    assert pipeline.Tokenize(tok, lm, {"targets": n}, "drop").too_long(record) == {}
    assert pipeline.Tokenize(tok, lm, {"targets": n - 1}, "drop").too_long(record) == {"targets": n}
    # one token too long everywhere: an error up front, not an iterator that never yields
    with pytest.raises(DataError, match="keeps none of the 3 examples"):
        pipeline.make_train_iterator([record] * 3, tok, lm, {"targets": n - 1}, 2,
                                     length_policy="drop", shard=shard())


def test_to_global_batch_on_eight_devices():
    import jax
    from jax.sharding import AxisType, PartitionSpec

    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    batch = packing.make_row([{"targets": [4, 5, 1]}], {"targets": 6})
    batch = {k: np.stack([v] * 8) for k, v in batch.items()}
    out = pipeline.to_global_batch(batch, mesh)
    assert out["targets"].shape == (8, 6)
    assert out["targets"].sharding.spec == PartitionSpec(("data",))
    np.testing.assert_array_equal(np.asarray(out["targets"]), batch["targets"])
    # a training mesh: the batch over both data-parallel axes, 'data' and 'fsdp' (as the compiled steps
    # take it), not copied across 'fsdp' (where fsdp spans hosts, copies would take every host's rows
    # for the same rows)
    from transformer_jax import parallel

    out = pipeline.to_global_batch(batch, parallel.create_mesh(2, 2, 2))
    assert out["targets"].sharding.spec == PartitionSpec(("data", "fsdp"))
    np.testing.assert_array_equal(np.asarray(out["targets"]), batch["targets"])


# -- datasets --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


def _cfg(name, data_dir, **kw):
    cfg = inputs.default_dataset_config(name)
    cfg.data_dir = data_dir
    cfg.vocab_size = 400
    cfg.batch_size = cfg.eval_batch_size = 8
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def test_enfr_builtin_end_to_end(data_dir, tmp_path):
    cfg = _cfg("enfr_builtin", data_dir, builder_config="small", max_eval_examples=50)
    data = inputs.build_datasets(cfg, str(tmp_path), shard=shard())
    assert data.is_translation and data.train_size == 3000
    assert (tmp_path / "tokenizer.model").exists()
    batch = next(data.train_iter)
    assert set(batch) == {"inputs", "inputs_segment_ids", "inputs_positions", "targets",
                          "targets_segment_ids", "targets_positions"}
    assert batch["inputs"].shape == (8, 32)
    src = builders.data_source(builders.builtin_builder("enfr_builtin", data_dir, "small"),
                               "train")
    pairs = {(r["en"].decode(), r["fr"].decode()) for r in src}
    assert ("I love chocolates", "j'aime les chocolats") in pairs
    english = lambda split: {r["en"] for r in builders.data_source(
        builders.builtin_builder("enfr_builtin", data_dir, "small"), split)}
    assert not english("train") & english("test") and not english("validation") & english("test")
    builder = builders.builtin_builder("enfr_builtin", data_dir, "small")
    every = {(r["en"].decode(), r["fr"].decode()) for split in ("train", "validation", "test")
             for r in builders.data_source(builder, split)}
    # fr -> en, asked for three ways (one language set alone takes the other for the other side; it
    # took the default's, a French -> French copy task): every evaluation source is a French
    # sentence of the corpus and its target the English one it pairs with.
    for direction in (dict(reverse=True), dict(source_lang="fr"), dict(target_lang="en")):
        rev = inputs.build_datasets(_cfg("enfr_builtin", data_dir, builder_config="small", max_source_len=64,
                                         max_target_len=64, **direction),  # none cut short
                                    str(tmp_path), shard=shard())
        row = rev.eval_batches[0]
        decoded = [(rev.tokenizer.decode(row["targets"][i]), rev.tokenizer.decode(row["inputs"][i]))
                   for i in range(len(row["inputs"])) if row["inputs"][i].any()]
        assert decoded and all(pair in every for pair in decoded), (direction, decoded[:3])


def test_stdlib_lm_end_to_end(data_dir, tmp_path):
    cfg = _cfg("stdlib_lm", data_dir, builder_config=f"{builders._PY}_small", max_len=64)
    data = inputs.build_datasets(cfg, str(tmp_path), shard=shard())
    assert not data.is_translation
    batch = next(data.train_iter)
    assert set(batch) == {"targets", "targets_segment_ids", "targets_positions"}
    _check_layout(batch, "targets", eos=False)  # 'split': pieces of long documents
    assert (batch["targets_segment_ids"] > 0).mean() > 0.9  # long documents fill the rows


@pytest.mark.parametrize("empty", ["validation", "train"])
def test_stdlib_splits_are_never_empty(monkeypatch, tmp_path, empty):
    """With few files the path hashes could send none to validation (the small config's 40 files
    on Python 3.13: 'has no split validation'); the file of the lowest hash goes there then, and
    of the highest to an empty train split."""
    import hashlib
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    percent = lambda path: int(hashlib.sha1(os.path.relpath(path, root).encode()).hexdigest(), 16) % 100
    want_validation = empty == "train"  # files that all hash to the other split
    paths = [p for p in builders.stdlib_files() if (percent(p) < 3) == want_validation][:4]
    assert len(paths) == 4
    monkeypatch.setattr(builders, "stdlib_files", lambda max_files=None: paths)
    builder = builders.StdlibLm(config=f"{builders._PY}_small", data_dir=str(tmp_path))
    splits = {name: [example["path"] for _, example in examples]
              for name, examples in builder._split_generators(None).items()}
    pick = min if empty == "validation" else max
    moved = os.path.relpath(pick(paths, key=percent), root)
    assert set(splits[empty]) == {moved}
    other = "train" if empty == "validation" else "validation"
    assert set(splits[other]) == {os.path.relpath(p, root) for p in paths} - {moved}


def test_stdlib_documents_capped():
    docs = builders.split_document("a = 1\n" * 1000 + "x" * 5000, 2000)
    assert all(len(d) <= 2000 for d in docs) and "".join(docs) == "a = 1\n" * 1000 + "x" * 5000


def test_user_files_and_bad_input(data_dir, tmp_path):
    tsv = tmp_path / "pairs.tsv"
    tsv.write_bytes(b"hello\tbonjour\n\n   \nno tab\n\xff\xfe\tbad utf8\n \t empty side\n"
                    b"a\tb\tc\n" + b"long " * 400 + b"\tlong\n" + b"cat\tchat\r\n")
    cfg = _cfg("tsv", data_dir, train_files=[str(tsv)], eval_files=[str(tsv)],
               max_source_len=16, max_target_len=16)
    data = inputs.build_datasets(cfg, str(tmp_path / "w"), shard=shard())
    assert data.train_size == 3  # hello, the long line, cat
    _take(data.train_iter, 5)  # the long line is truncated, never a crash
    texts = sorted(data.tokenizer.decode(r) for b in data.eval_batches
                   for r, s in zip(b["targets"], b["targets_segment_ids"]) if s.max())
    assert texts == ["bonjour", "chat", "long"]
    txt = tmp_path / "mono.txt"
    txt.write_bytes(b"first line\n\n\xc3\x28 broken\nsecond line\n")
    data = inputs.build_datasets(_cfg("text", data_dir, train_files=[str(txt)],
                                      eval_files=[str(txt)]), str(tmp_path / "m"),
                                 shard=shard())
    assert data.train_size == 2


def test_without_eval_files_the_warning_counts_the_examples_evaluated(data_dir, tmp_path, caplog):
    """No eval_files: up to 1,000 training examples are evaluated, and at most max_eval_examples;
    the warning said 'evaluating on 300 training examples' where 32 were."""
    txt = tmp_path / "mono.txt"
    txt.write_text("".join(f"line number {i}\n" for i in range(300)))
    with caplog.at_level("WARNING"):
        data = inputs.build_datasets(_cfg("text", data_dir, train_files=[str(txt)], max_eval_examples=32),
                                     str(tmp_path / "w"), shard=shard())
    assert "has no eval_files: evaluating on 32 training examples" in caplog.text
    assert data.eval_size == 32 and data.train_size == 300


def test_user_files_in_utf16_are_an_error_and_bad_lines_are_located(data_dir, tmp_path, caplog):
    # Windows' "Unicode" is UTF-16: read as UTF-8 its lines are valid text with NULs in between,
    # which used to become training pairs.
    pairs = "hello world\tbonjour le monde\r\nthe cat\tle chat\r\n"
    for encoding, name in (("utf-16", "UTF-16"), ("utf-32", "UTF-32")):
        path = tmp_path / f"{encoding}.tsv"
        path.write_bytes(pairs.encode(encoding))
        with pytest.raises(DataError, match=f"{path}.* is {name}-encoded.*save it as UTF-8"):
            inputs.build_datasets(_cfg("tsv", data_dir, train_files=[str(path)]),
                                  str(tmp_path / "w"), shard=shard())
    no_bom = tmp_path / "utf16le.txt"
    no_bom.write_bytes(pairs.encode("utf-16-le"))
    with pytest.raises(DataError, match="no usable lines"):
        inputs.build_datasets(_cfg("text", data_dir, train_files=[str(no_bom)]),
                              str(tmp_path / "w"), shard=shard())
    # A UTF-8 byte-order mark is dropped, not kept in the first source; bad lines are counted
    # with the file and line of the first of each kind.
    bom = tmp_path / "bom.tsv"
    bom.write_bytes(b"\xef\xbb\xbfcat\tchat\nno tab\ndog\tchien\nalso none\n\xff\tx\n")
    with caplog.at_level("WARNING"):
        lines = list(builders.read_lines([str(bom)], tsv=True))
    assert lines == [("cat", "chat"), ("dog", "chien")]
    assert f"no tab: 2 (first at {bom}:2)" in caplog.text
    assert f"invalid UTF-8: 1 (first at {bom}:5)" in caplog.text


def test_user_files_end_lines_at_lf_crlf_and_a_lone_cr(tmp_path, caplog):
    # Old Mac OS files end lines with CR alone: such a file was read as one line (one example).
    mac = tmp_path / "mac.tsv"
    mac.write_bytes(b"cat\tchat\rno tab\rdog\tchien\r\rbird\toiseau\r")
    with caplog.at_level("WARNING"):
        assert list(builders.read_lines([str(mac)], tsv=True)) == [
            ("cat", "chat"), ("dog", "chien"), ("bird", "oiseau")]
    assert f"no tab: 1 (first at {mac}:2)" in caplog.text
    assert f"empty or whitespace-only: 1 (first at {mac}:4)" in caplog.text
    # All three line ends in one file, a CR before CRLF, and a last line without an end.
    mixed = tmp_path / "mixed.txt"
    mixed.write_bytes("un\ndeux\r\ntrois\rquatre\r\r\ncinq é\rsix".encode())
    assert [line for (line,) in builders.read_lines([str(mixed)], tsv=False)] == [
        "un", "deux", "trois", "quatre", "cinq é", "six"]


def test_config_errors(data_dir, tmp_path):
    with pytest.raises(ValueError, match="Unknown dataset 'nope'"):
        inputs.default_dataset_config("nope")
    cfg = _cfg("text", data_dir)
    cfg.name = "nope"
    with pytest.raises(ValueError, match="Unknown dataset 'nope'"):
        inputs.build_datasets(cfg, str(tmp_path), shard=shard())
    with pytest.raises(ValueError, match="not found.*missing.txt"):
        inputs.build_datasets(_cfg("text", data_dir, train_files=[str(tmp_path / "missing.txt")]),
                              str(tmp_path), shard=shard())
    # 'a.tsv,b.tsv' on the command line is one path: the error says how to give several.
    (tmp_path / "a.txt").write_text("x\n")
    for key in ("train", "eval"):
        files = {f"{key}_files": [f"{tmp_path / 'a.txt'},{tmp_path / 'a.txt'}"]}
        with pytest.raises(ValueError, match=rf"not found.*a.txt,.*a.txt; for several files give a "
                                             rf"tuple, e.g. --config.dataset.{key}_files="):
            inputs.build_datasets(_cfg("text", data_dir, **{"train_files": [str(tmp_path / "a.txt")],
                                                            **files}),
                                  str(tmp_path), shard=shard())
    with pytest.raises(ValueError, match="not found.*missing.txt$"):  # no hint without a comma
        inputs.build_datasets(_cfg("text", data_dir, train_files=[str(tmp_path / "missing.txt")]),
                              str(tmp_path), shard=shard())
    with pytest.raises(ValueError, match="train_files"):
        inputs.build_datasets(_cfg("tsv", data_dir), str(tmp_path), shard=shard())
    empty = tmp_path / "empty.tsv"
    empty.write_text("\n\nno tab\n")
    with pytest.raises(ValueError, match="no usable lines"):
        inputs.build_datasets(_cfg("tsv", data_dir, train_files=[str(empty)]), str(tmp_path),
                              shard=shard())
    with pytest.raises(ValueError, match="not prepared.*lm1b"):
        inputs.build_datasets(_cfg("lm1b", str(tmp_path / "none")), str(tmp_path),
                              shard=shard())
    with pytest.raises(ValueError, match="dataset.source_lang='xx'.*no language 'xx'"):
        inputs.build_datasets(_cfg("enfr_builtin", data_dir, builder_config="small",
                                   source_lang="xx"), str(tmp_path), shard=shard())
    with pytest.raises(ValueError, match="source_lang and dataset.target_lang are both 'fr'"):
        inputs.build_datasets(_cfg("enfr_builtin", data_dir, builder_config="small", source_lang="fr",
                                   target_lang="fr"), str(tmp_path), shard=shard())


def test_data_file_lists_are_read_as_meant_and_their_mistakes_named(data_dir, tmp_path, caplog):
    """A config file's dataset section giving train_files as one string was read one path per
    character ('Data file not found: /'); a directory, an empty path and a missing file were all
    'not found', naming no setting; a file listed twice, eval files that are the train files and an
    empty file among several went through without a word."""
    import logging

    import ml_collections

    a, b, empty = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "empty.txt"
    a.write_text("one line\nanother line\n")
    b.write_text("a third line\n")
    empty.write_text("")
    one = builders.files_config(str(a), ())
    assert one.train_files == (str(a),) and one == builders.files_config([str(a)], [])
    cfg = ml_collections.ConfigDict({**_cfg("text", data_dir).to_dict(), "train_files": str(a)})
    assert inputs.build_datasets(cfg, str(tmp_path / "w"), shard=shard()).train_size == 2
    for files, message in ((str(tmp_path), f"dataset.train_files: {tmp_path} is a directory"),
                           ([str(a), ""], "dataset.train_files holds '', not a file path"),
                           ([str(tmp_path / "missing.txt")], "dataset.train_files: data file not found: ")):
        with pytest.raises(ValueError, match=re.escape(message)):
            builders.files_config(files, ())
    with pytest.raises(ValueError, match=re.escape("dataset.eval_files: data file not found")):
        builders.files_config([str(a)], [str(tmp_path / "missing.txt")])
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        builders.files_config([str(a), str(b), str(a)], [str(b), str(a)])
        builders.files_config([str(a), str(empty)], ())
    assert [r.getMessage() for r in caplog.records] == [
        f"dataset.train_files lists {a} 2 times: its examples count 2 times",
        f"dataset.eval_files are the train_files ({a}, {b}): the evaluation measures the training "
        "data, not held-out text",
        f"dataset.train_files: {empty} is empty"]
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # an eval file among the train files (no word before)
        builders.files_config([str(a), str(b)], [str(b)])
    assert [r.getMessage() for r in caplog.records] == [
        f"dataset.eval_files {b} is also in dataset.train_files: the evaluation "
        "measures training data there, not held-out text"]
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # nothing to say; and each warning once per process (the
        builders.files_config([str(a)], [str(b)])  # test evaluation reads the lists again)
        builders.files_config([str(a), str(b), str(a)], [str(b), str(a)])
    assert not caplog.records


def test_a_damaged_copy_of_a_prepared_dataset_is_named(data_dir, tmp_path):
    """A prepared dataset copied in part (a shard file missing or cut short) failed only once the
    pipeline reached the file, with array_record's RuntimeError traceback; one whose
    dataset_info.json was damaged was called "not prepared"."""
    import glob
    import pathlib
    import shutil

    builders.builtin_builder("enfr_builtin", data_dir, "small")  # prepared in data_dir
    copy = str(tmp_path / "copy")
    shutil.copytree(data_dir, copy)
    [version] = glob.glob(os.path.join(copy, "enfr_builtin", "small", "*"))
    assert len(builders.data_source(builders.standard_builder("enfr_builtin/small", copy), "validation"))
    [shard] = glob.glob(os.path.join(version, "*-validation.array_record-*"))
    with open(shard, "rb") as f:
        whole = f.read()
    for damage, found in ((lambda: os.remove(shard), "is missing"),
                          (lambda: pathlib.Path(shard).write_bytes(whole[: len(whole) // 2]),
                           "cannot be read as an ArrayRecord file")):
        damage()
        for builder in (builders.standard_builder("enfr_builtin/small", copy),
                        builders.builtin_builder("enfr_builtin", copy, "small")):
            with pytest.raises(DataError, match=re.escape(f"split 'validation': {shard} {found}") +
                               ".*incomplete or damaged: copy it again"):
                builders.data_source(builder, "validation")
    # The test split, read after training, is checked before it starts: its shard cut short was
    # found only after the whole run.
    cfg = _cfg("enfr_builtin", copy, builder_config="small")
    assert inputs.resolve_test_split(cfg, "test") == "test"
    [test_shard] = glob.glob(os.path.join(version, "*-test.array_record-*"))
    pathlib.Path(test_shard).write_bytes(pathlib.Path(test_shard).read_bytes()[:100])
    with pytest.raises(DataError, match=re.escape(f"split 'test': {test_shard} cannot be read")):
        inputs.resolve_test_split(cfg, "test")
    with open(os.path.join(version, "dataset_info.json"), "w") as f:
        f.write('{"name": "enfr')
    with pytest.raises(DataError, match=r"cannot be read \(.*dataset_info.json is there, but TFDS failed "
                                        r"on it: .*\): the copy of the prepared dataset is incomplete"):
        builders.standard_builder("enfr_builtin/small", copy)
    with pytest.raises(DataError, match="is not prepared in"):  # nothing there at all
        builders.standard_builder("enfr_builtin/small", str(tmp_path / "empty"))
    # Parquet, which TFDS reads by index too, is no ArrayRecord file to check (it was "damaged")
    parquet = str(tmp_path / "parquet")
    builders.EnfrBuiltin(config="small", data_dir=parquet, file_format="parquet").download_and_prepare()
    assert len(builders.data_source(builders.standard_builder("enfr_builtin/small", parquet), "validation"))


def test_missing_eval_split_is_an_error_not_replaced(data_dir, tmp_path):
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text("".join(f"{r['src']}\t{r['tgt']}\n" for r in SOURCE[:20]))
    valid = tmp_path / "valid.tsv"
    valid.write_text("valid 1\tvalide 1\n")
    cfg = _cfg("tsv", data_dir, train_files=[str(tsv)], eval_files=[str(valid)], vocab_size=300)
    for split in ("test", "validaton"):
        cfg.eval_split = split
        with pytest.raises(DataError, match=rf"no split '{split}'.*it has \['train', "
                                            r"'validation'\]"):
            inputs.build_datasets(cfg, str(tmp_path / "w"), shard=shard())
    cfg.eval_split = "validation"  # the default, by name
    assert inputs.build_datasets(cfg, str(tmp_path / "w"), shard=shard()).eval_size == 1
    # test_split, read after training, is resolved before it starts: on your own files a missing
    # 'test' (configs/default.py's) means validation, or the training examples without eval files.
    assert inputs.resolve_test_split(cfg, "test") == "validation"
    assert inputs.resolve_test_split(cfg, "validation") == "validation"
    cfg.eval_files = ()
    assert inputs.resolve_test_split(cfg, "test") == "train"
    cfg.eval_files = [str(valid)]
    cfg.eval_files, cfg.eval_split = (), ""  # no eval files: the training examples, as before
    assert inputs.build_datasets(cfg, str(tmp_path / "w2"), shard=shard()).eval_size == 20


# Stand-ins for the prepared WMT and LM1B datasets: same names, configs, features and splits.
# The real builders import TensorFlow; our reader never imports them, it reads prepared files.
# (Their metadata is `builders._LocalInfo`, so that preparing them leaves no empty temporary
# directory behind, see there.)


class _FakeWmt(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    name = "wmt14_translate"
    code_path = None
    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIGS = [tfds.core.BuilderConfig(name="de-en")]

    def _info(self):
        return builders._LocalInfo(builder=self, features=tfds.features.Translation(
            languages=("de", "en")), supervised_keys=("de", "en"))

    def _split_generators(self, dl_manager):
        return {s: self._generate_examples(s) for s in ("train", "validation", "test")}

    def _generate_examples(self, split):
        for i in range(20):
            yield i, {"de": f"die katze {i} {split}", "en": f"the cat {i} {split}"}


class _FakeLm1b(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    name = "lm1b"
    code_path = None
    VERSION = tfds.core.Version("1.1.0")

    def _info(self):
        return builders._LocalInfo(builder=self, features=tfds.features.FeaturesDict(
            {"text": tfds.features.Text()}))

    def _split_generators(self, dl_manager):
        return {s: self._generate_examples(s) for s in ("train", "test")}

    def _generate_examples(self, split):
        for i in range(30):
            yield i, {"text": f"sentence {i} of the {split} split ."}


def test_wmt_and_lm1b_read_from_prepared_files(tmp_path):
    data_dir = str(tmp_path / "tfds")
    for cls in (_FakeWmt, _FakeLm1b):
        builders.prepare(cls(data_dir=data_dir, file_format="array_record"))
    wmt = inputs.build_datasets(_cfg("wmt14_translate/de-en", data_dir, vocab_size=300),
                                str(tmp_path / "w"), shard=shard())
    assert wmt.is_translation and wmt.train_size == 20
    row = wmt.eval_batches[0]
    assert wmt.tokenizer.decode(row["inputs"][0]).startswith("the cat")  # EN -> DE default
    assert wmt.tokenizer.decode(row["targets"][0]).startswith("die katze")
    assert wmt.tokenizer.decode(row["targets"][0]).endswith("validation")  # newstest2013's place
    de_en = inputs.build_datasets(_cfg("wmt14_translate/de-en", data_dir, vocab_size=300,
                                       reverse=True), str(tmp_path / "w"), shard=shard())
    assert de_en.tokenizer.decode(de_en.eval_batches[0]["inputs"][0]).startswith("die katze")
    lm = inputs.build_datasets(_cfg("lm1b", data_dir, vocab_size=300), str(tmp_path / "l"),
                               shard=shard())
    assert lm.eval_size == 30 and "targets" in next(lm.train_iter)


def test_a_dataset_prepared_as_tfrecord_files_names_the_rebuild(tmp_path):
    """`tfds build` writes TFRecord files by default, which have no random access: TFDS's
    NotImplementedError escaped as a traceback instead of a DataError saying what to run."""
    import glob
    import json

    data_dir = str(tmp_path / "tfds")
    builders.prepare(_FakeWmt(data_dir=data_dir, file_format="array_record"))
    version = os.path.join(data_dir, "wmt14_translate", "de-en", "1.0.0")
    with open(os.path.join(version, "dataset_info.json")) as f:
        info = json.load(f)
    info["fileFormat"] = "tfrecord"  # as `tfds build` without --file_format leaves it
    with open(os.path.join(version, "dataset_info.json"), "w") as f:
        json.dump(info, f)
    for name in glob.glob(os.path.join(version, "*array_record*")):
        os.rename(name, name.replace("array_record", "tfrecord"))
    with pytest.raises(DataError, match=r"stored as tfrecord files.*`tfds build wmt14_translate/de-en "
                                        r"--file_format=array_record"):
        inputs.build_datasets(_cfg("wmt14_translate/de-en", data_dir, vocab_size=300),
                              str(tmp_path / "w"), shard=shard())


def test_tokenizer_texts_sample_records_evenly_and_read_both_sides():
    source = [{"a": f"a{i:08d}".encode(), "b": f"b{i:08d}".encode()} for i in range(10)]
    everything = [f"{f}{i:08d}" for i in range(10) for f in "ab"]
    assert list(inputs._tokenizer_texts(source, ["a", "b"], 10_000)()) == everything
    # 18 characters a record, 180 in all, 45 wanted: records 0, 8 and 4 of the bit-reversed order
    # (the third overshoots), in the source's order
    assert list(inputs._tokenizer_texts(source, ["a", "b"], 45)()) == [
        "a00000000", "b00000000", "a00000004", "b00000004", "a00000008", "b00000008"]


def test_one_huge_record_does_not_thin_out_the_tokenizer_sample():
    """The spacing came from the probed records' mean length: one 100,000-character line among
    them spaced the sample 101 records apart (2 of 200 read) though the rest fit the budget. Lines
    count as training cuts them (4,096 characters), and records are taken in bit-reversed order, so
    a budget that runs out still leaves a sample of the whole split, in its order."""
    source = [{"t": ("x" * 100_000 if i == 0 else f"record {i:03d} ".ljust(40, "."))} for i in range(200)]
    read = list(inputs._tokenizer_texts(source, ["t"], 10_000)())
    numbers = [int(t.split()[1]) for t in read[1:]]
    assert read[0] == "x" * 100_000 and numbers == sorted(numbers)
    # 10,000 - 4,096 (the cut huge line) leaves 147 records of 40 characters and one more, spread
    # over all 199: every even one, then odd ones spread over the split
    assert len(numbers) == 148 and set(range(2, 200, 2)) <= set(numbers) and numbers[-1] >= 195


def test_a_split_that_fits_the_tokenizer_budget_is_read_whole_in_order():
    """Whatever the records' lengths (many long ones and a few short ones made a median-spaced
    sample skip half of a split that fitted), a split within the budget is read whole, in order, as
    before: the tokenizers of existing configs stay the same."""
    lengths = [1 if i % 7 == 0 else 90 for i in range(2100)]
    source = [{"t": "é" * n} for n in lengths]  # characters counted, not UTF-8 bytes
    texts = list(inputs._tokenizer_texts(source, ["t"], sum(lengths))())
    assert texts == [r["t"] for r in source]
    assert len(list(inputs._tokenizer_texts(source, ["t"], sum(lengths) // 2)())) < 2100


def test_the_evaluation_split_is_the_validation_split_where_there_is_one(data_dir):
    """Periodic evaluation and `keep_best_metric` read it: the built-in corpus and WMT defaulted to
    their test split (WMT's newstest2014), which choosing checkpoints on would bias the test BLEU."""
    assert inputs._open(_cfg("enfr_builtin", data_dir, builder_config="small"))[2] == "validation"
    assert builders.STANDARD_TRANSLATION["wmt14_translate/de-en"][2] == "validation"
    assert builders.STANDARD_LM["lm1b"][2] == "test"  # LM1B has no other


def test_editing_a_user_file_rebuilds_the_dataset(data_dir, tmp_path):
    """The build is named by the files' contents: an edit that keeps the size (a typo fixed) must
    not reuse the old build, and a copy with another modification time (the same file copied to
    every host) names the same build. Named by modification times, a host with its own copy waited
    for a build process 0 never made, then blamed data_dir."""
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text("cat\tchat\n")
    read = lambda: [r["target"] for r in builders.data_source(
        builders.builtin_builder("tsv", data_dir, None, [str(tsv)]), "train")]
    assert read() == [b"chat"]
    mtime = tsv.stat().st_mtime_ns
    name = builders.files_config([str(tsv)], []).name
    os.utime(tsv, ns=(mtime + 10**9, mtime + 10**9))  # as a copy on another host
    assert builders.files_config([str(tsv)], []).name == name
    tsv.write_text("cat\tchou\n")  # same size
    os.utime(tsv, ns=(mtime, mtime))
    assert builders.files_config([str(tsv)], []).name != name
    assert read() == [b"chou"]


def test_build_datasets_gives_each_host_its_share_and_each_side_its_length(data_dir, tmp_path):
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text("".join(f"{r['src']}\t{r['tgt']}\n" for r in SOURCE[:20]))
    cfg = _cfg("tsv", data_dir, train_files=[str(tsv)], vocab_size=300, max_source_len=16,
               max_target_len=12)  # global batch_size = eval_batch_size = 8
    data = inputs.build_datasets(cfg, str(tmp_path / "w"), shard=shard(0, 2))
    batch = next(data.train_iter)
    assert batch["inputs"].shape == (4, 16) and batch["targets"].shape == (4, 12)
    assert len(data.eval_batches) == 3  # ceil(ceil(20 / 2) / 4)
    for b in data.eval_batches:
        assert b["inputs"].shape == (4, 16) and b["targets"].shape == (4, 12)


class _FakeWmtNoTest(_FakeWmt, skip_registration=True):
    """A prepared WMT without its evaluation split 'test'."""

    name = "wmt14_translate"

    def _split_generators(self, dl_manager):
        return {s: self._generate_examples(s) for s in ("train", "validation")}


def test_evaluation_reads_the_eval_split_and_max_eval_examples(tmp_path):
    """Without 'test' the evaluation falls back to 'validation': its first max_eval_examples
    records, never the training examples."""
    data_dir = str(tmp_path / "tfds")
    builder = builders.prepare(_FakeWmtNoTest(data_dir=data_dir, file_format="array_record"))
    validation = builders.data_source(builder, "validation")
    want = [(validation[i]["en"].decode(), validation[i]["de"].decode()) for i in range(5)]
    assert all(en.endswith(" validation") for en, _ in want)
    data = inputs.build_datasets(_cfg("wmt14_translate/de-en", data_dir, vocab_size=300,
                                      max_eval_examples=5), str(tmp_path / "w"), shard=shard())
    assert data.eval_size == 5 and len(data.eval_batches) == 1  # of 20 in 'validation'
    b = data.eval_batches[0]
    real = b["inputs_segment_ids"].max(1) > 0
    got = [(data.tokenizer.decode(i), data.tokenizer.decode(t))
           for i, t in zip(b["inputs"][real], b["targets"][real])]
    assert got == want


PIPELINE_WITH_A_WORKER = '''
import multiprocessing, os, signal, sys, time
from absl import flags
import grain
from transformer_jax.data import pipeline, tokenizer as tk


def pipeline_with_a_worker(long_target=False):
    """A train iterator with one input worker, its first batch read, as a script calling the
    library makes it: no absl flags parsed (grain's worker pipeline reads some of its own)."""
    assert not flags.FLAGS.is_parsed()
    source = [{"src": f"sentence {i}", "tgt": f"phrase {i}"} for i in range(40)]
    if long_target:  # longer than 16 tokens: truncated, with a warning
        source[3]["tgt"] = " ".join(["phrase"] * 40)
    tok = tk.Tokenizer.train([r["src"] for r in source] + [r["tgt"] for r in source],
                             tk.TokenizerSettings(vocab_size=320))
    it = pipeline.make_train_iterator(
        source, tok, pipeline.Features({"inputs": "src", "targets": "tgt"}),
        {"inputs": 16, "targets": 16}, 4, num_workers=1, shard=grain.sharding.ShardOptions(0, 1))
    next(it)
    return it
'''

KILLED_TRAINER = PIPELINE_WITH_A_WORKER + '''
if __name__ == "__main__":
    it = pipeline_with_a_worker()
    print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would: no cleanup runs
'''


INTERRUPTED_TRAINER = PIPELINE_WITH_A_WORKER + '''
if __name__ == "__main__":
    it = pipeline_with_a_worker(long_target=True)
    interrupted = False
    try:  # (entered first: the signal may come as soon as READY is out)
        print("READY", flush=True)
        # Short sleeps: a signal delivered to another thread of the process (grain's) would not
        # end one long sleep of the main thread; the check between sleeps sees it.
        for _ in range(1200):
            time.sleep(0.1)
    except KeyboardInterrupt:  # train.py's first Ctrl-C: save a checkpoint (reading on), then stop
        interrupted = True
    read = sum(len(next(it)["targets"]) for _ in range(30))  # more than the worker had queued
    it.close()
    del it  # as when train.py's training function returns (not at interpreter exit)
    print("READ", read // 4, "after Ctrl-C" if interrupted else "without a Ctrl-C", flush=True)
'''


CLOSED_TRAINER = PIPELINE_WITH_A_WORKER + '''
if __name__ == "__main__":
    it = pipeline_with_a_worker()
    batches = [next(it) for _ in range(3)]
    pipeline.close_train_iterator(it)
    del batches, it  # as the training function returns, just before the interpreter exits
'''


def test_closing_the_train_iterator_leaves_no_shared_memory_to_the_exit(tmp_path):
    """The last batches, freed as training ends, had their shared memory unlinked on grain's
    deletion thread, which the exit overtook: "resource_tracker: There appear to be 6 leaked
    shared_memory objects to clean up at shutdown" ended runs with input workers."""
    import subprocess
    import sys

    script = tmp_path / "closed_trainer.py"
    script.write_text(CLOSED_TRAINER)
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err:  # not run(capture_output): the workers hold the pipe open
        proc = subprocess.run([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=err,
                              timeout=300)
    stderr = log.read_text()
    assert proc.returncode == 0, stderr[-2000:]
    assert "leaked shared_memory" not in stderr and "Exception ignored" not in stderr, stderr[-2000:]


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="process groups")
def test_a_ctrl_c_leaves_the_input_workers_serving(tmp_path):
    """A Ctrl-C in a terminal signals the whole process group. Before, the input workers died of
    it (KeyboardInterrupt tracebacks on stderr) and the training process's next read failed with
    "Worker process was terminated unexpectedly", while it was meant to save and stop cleanly.
    Also: a worker's length warning names the worker (each reports its own)."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "interrupted_trainer.py"
    script.write_text(INTERRUPTED_TRAINER)
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err:  # not run(capture_output): the workers hold the pipe open
        # As from a terminal: SIGINT at its default (a shell's background job, as a test run may
        # be, passes it on ignored, and then no Ctrl-C would reach the script or its workers).
        proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=err,
                                text=True, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            assert proc.stdout.readline().strip() == "READY"
            os.killpg(proc.pid, signal.SIGINT)
            out = proc.stdout.read()
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.stdout.close()
    stderr = log.read_text()
    assert proc.returncode == 0 and out.strip() == "READ 30 after Ctrl-C", stderr[-2000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-2000:]
    assert "Truncating train targets longer than 16 tokens" in stderr, stderr[-2000:]
    assert "(input worker 0 of 1: reported once by each worker" in stderr, stderr[-2000:]


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_workers_end_when_the_training_process_is_killed(tmp_path):
    """A training process killed outright (SIGKILL, the OOM killer) runs no cleanup; before, its
    grain workers waited forever on their full queue, holding their memory."""
    import subprocess
    import sys
    import time

    script = tmp_path / "killed_trainer.py"
    script.write_text(KILLED_TRAINER)
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err:  # not run(capture_output): the workers hold the pipe open
        proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=err,
                                text=True)
        workers = [int(p) for p in proc.stdout.readline().split()]
        proc.wait(timeout=120)
        proc.stdout.close()
    assert proc.returncode == -9 and workers, log.read_text()[-2000:]
    deadline = time.monotonic() + 30  # a bound on the wait, not a speed assertion (polls every 1 s)
    while any(map(_running, workers)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in workers if _running(p)]
    for pid in left:  # do not leave them behind for the rest of the test run
        os.kill(pid, 9)
    assert not left, f"worker processes {left} outlived the killed training process"
