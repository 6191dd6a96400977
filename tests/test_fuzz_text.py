"""Text and prompts fuzzed with hypothesis: any unicode (control characters, separators, private use,
lone surrogates), empty and huge inputs through the tokenizer (exact round trip), the input pipeline
(user TSV / text files full of garbage lines: no crash, every line either read or counted as skipped)
and generation (``encode_inputs`` and a tiny model: a clear ``GenerateError`` for empty or too long
input, never a crash). ``TJ_FUZZ_EXAMPLES`` scales the number of examples (default CI size)."""

import os
import re

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transformer_jax import presets
from transformer_jax.data import builders, pipeline
from transformer_jax.data import tokenizer as tk
from transformer_jax.data.errors import DataError
from transformer_jax.generate import DecodeOptions, GenerateError, Generator, encode_inputs, generate_texts
from transformer_jax.params import build_model, dummy_inputs

SCALE = int(os.environ.get("TJ_FUZZ_EXAMPLES", "1"))
FUZZ = settings(max_examples=100 * SCALE, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Every code point, control characters and separators included; surrogates come separately.
ANY_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=80)
NASTY = st.sampled_from(
    [
        "",
        " ",
        "\t",
        "\n",
        "\r\n",
        "\x00",
        "\x7f",
        "\u200b",
        "\u2028",
        "\ufeff",
        "\u2581",
        "\U0010ffff",
        "\ue000",
        "e\u0301",
        "🙂",
        "漢字",
        "\\",
        '"',
        "<s>",
        "</s>",
        "<pad>",
        "<unk>",
    ]
)
TEXT = st.lists(st.one_of(ANY_TEXT, NASTY), max_size=6).map("".join)
CORPUS = [
    "the tired engineer drank the cold coffee",
    "l'ingénieur fatigué a bu le café froid",
    "your cat is a great cat",
    "ton chat est un grand chat",
    "x = [1, 2, 3]\n",
] * 20


@pytest.fixture(scope="module")
def tok():
    return tk.Tokenizer.train(CORPUS, tk.TokenizerSettings(vocab_size=300))


# ------------------------------------------------------------------------------------ tokenizer


@FUZZ
@given(text=TEXT)
def test_tokenizer_round_trips_anything(tok, text):
    ids = tok.encode(text)
    assert all(tk.UNK_ID < i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode(text.encode("utf-8")) == ids


@FUZZ
@given(data=st.binary(max_size=64))
def test_tokenizer_takes_any_bytes(tok, data):
    assert tok.decode(tok.encode(data)) == data.decode("utf-8", errors="replace")


@FUZZ
@given(ids=st.lists(st.integers(-(2**40), 2**40), max_size=40))
def test_tokenizer_decodes_any_ids(tok, ids):
    assert isinstance(tok.decode(ids), str)  # out-of-range ids are dropped, not a crash


def test_tokenizer_huge_inputs(tok):
    huge = ("the cold coffee é漢🙂\x00\t" * 20_000)[:300_000]
    assert tok.decode(tok.encode(huge)) == huge
    one_line = "a" * 1_000_000
    assert tok.decode(tok.encode(one_line)) == one_line


# ------------------------------------------------------------------------------------ pipeline

LINE = st.one_of(
    st.binary(max_size=30),
    TEXT.map(lambda t: t.encode("utf-8")),
    st.tuples(TEXT, TEXT).map(lambda p: f"{p[0]}\t{p[1]}".encode()),
    st.tuples(TEXT, TEXT, TEXT).map(lambda p: "\t".join(p).encode()),
)


def _expected(raw_lines, tsv):
    """What read_lines must yield: an independent restatement of its rules."""
    out, skipped = [], 0
    for i, raw in enumerate(raw_lines):
        if i == 0 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark is dropped
            raw = raw[3:]
        try:
            line = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError:
            skipped += 1
            continue
        if "\0" in line:  # NUL characters: not text
            skipped += 1
            continue
        fields = line.split("\t") if tsv else [line]
        if not line.strip() or (tsv and (len(fields) != 2 or not all(f.strip() for f in fields))):
            skipped += 1
            continue
        out.append(tuple(fields))
    return out, skipped


@FUZZ
@given(lines=st.lists(LINE, max_size=12), tsv=st.booleans())
def test_user_files_with_garbage_lines(tok, tmp_path_factory, lines, tsv):
    path = tmp_path_factory.mktemp("files") / ("data.tsv" if tsv else "data.txt")
    data = b"\n".join(lines)
    path.write_bytes(data)
    raw_lines = _split_like_a_file(data)
    if data.startswith((b"\xff\xfe", b"\xfe\xff", b"\x00\x00\xfe\xff")):  # UTF-16/32 mark
        with pytest.raises(DataError, match=re.escape(str(path)) + " is UTF-(16|32)-encoded"):
            list(builders.read_lines([str(path)], tsv=tsv))
        return
    want, skipped = _expected(raw_lines, tsv)
    got = list(builders.read_lines([str(path)], tsv=tsv))
    assert got == want and len(got) + skipped == len(raw_lines)
    features = pipeline.Features({"inputs": "src", "targets": "tgt"} if tsv else {"targets": "text"})
    policy = "truncate" if tsv else "split"
    tokenize = pipeline.Tokenize(tok, features, {"inputs": 16, "targets": 16}, policy)
    for fields in got:
        record = dict(zip(("src", "tgt") if tsv else ("text",), fields, strict=True))
        out = tokenize.map(record)
        for example in out if isinstance(out, list) else [out]:
            for ids in example.values():
                assert 1 <= len(ids) <= 16 and ids.dtype == np.int32 and (ids < tok.vocab_size).all()


def _split_like_a_file(part: bytes) -> list[bytes]:
    """Lines end at \\n, \\r\\n or a lone \\r: universal newlines, which bytes.splitlines
    applies (unlike str.splitlines, it leaves \\x0b, \\x0c, \\x85, \\u2028 ... inside lines)."""
    return part.splitlines(keepends=True)


def test_garbage_tsv_trains_a_tokenizer_and_builds_batches(tmp_path, caplog):
    """End to end once: a TSV of mostly garbage -> dataset with exactly the good lines."""
    from configs import tiny
    from transformer_jax.data import build_datasets

    good = [f"sentence {i} é漢🙂\tphrase {i} \x7f" for i in range(40)]
    bad = [b"\xff\xfe\tbad utf8", b"no tab at all", b"a\tb\tc", b" \t ", b"", b"\x00\t", b"\r"]
    body = b"\n".join([g.encode() for g in good] + bad * 3)
    (tmp_path / "train.tsv").write_bytes(body)
    cfg = tiny.get_config().dataset
    cfg.name, cfg.builder_config = "tsv", ""
    cfg.train_files = cfg.eval_files = (str(tmp_path / "train.tsv"),)
    cfg.data_dir, cfg.vocab_size = str(tmp_path / "tfds"), 300
    data = build_datasets(cfg, str(tmp_path / "work"))
    assert data.train_size == 40  # exactly the good lines; the 21 others counted and reported
    assert "Skipped 21 lines" in caplog.text
    batch = next(data.train_iter)
    assert batch["inputs"].shape[0] == cfg.batch_size


# ------------------------------------------------------------------------------------ generation


def _generator(tok, encoder_layers, with_params=True):
    cfg = presets.tiny(vocab_size=320, max_len=32, num_encoder_layers=encoder_layers)
    params = None  # encode_inputs needs only the config and the tokenizer
    if with_params:
        params = jax.jit(build_model(cfg).init)(jax.random.PRNGKey(0), *dummy_inputs(cfg))["params"]
    prefix = () if encoder_layers else (cfg.decoder_start_id,)
    return Generator(cfg, params, tok, prompt_prefix=prefix)


@pytest.fixture(scope="module", params=[2, 0], ids=["seq2seq", "decoder_only"])
def gen(request, tok):
    return _generator(tok, request.param, with_params=False)


@FUZZ
@given(
    texts=st.lists(TEXT, min_size=1, max_size=4),
    max_new=st.one_of(st.none(), st.integers(1, 40)),
    truncate=st.booleans(),
)
def test_encode_inputs_is_ids_or_a_clear_error(gen, texts, max_new, truncate):
    opts = DecodeOptions(max_new_tokens=max_new, truncate=truncate)
    try:
        rows = encode_inputs(gen, texts, opts)
    except GenerateError as e:
        assert any(w in str(e) for w in ("is empty", "more than the", "max_new_tokens")), e
        return
    # P prompt tokens and N new ones take P + N - 1 positions (the last new token is not fed back)
    limit = gen.config.max_len if gen.is_seq2seq else gen.config.max_len - (max_new or 1) + 1
    assert len(rows) == len(texts)
    for row in rows:
        assert 0 < len(row) <= limit and all(0 <= i < gen.config.vocab_size for i in row)


def test_generation_on_fuzzed_prompts(tok):
    """A handful of nasty prompts translated end to end (compiling is the cost, so few)."""
    gen = _generator(tok, 2)
    prompts = ["\x00\x01\x02 control", "é漢字🙂\u200b\ufeff", "</s><pad><unk>", "a" * 5, "\t\n x \r\n"]
    opts = DecodeOptions(max_new_tokens=4, batch_size=8)
    out = generate_texts(gen, prompts, opts)
    assert len(out) == len(prompts) and all(isinstance(o, str) for o in out)
    for bad, message in [
        ([""], "input 1 is empty"),
        (["ok", " \t\n"], "input 2 is empty"),
        (["x " * 400], "more than the"),
    ]:
        with pytest.raises(GenerateError, match=message):
            generate_texts(gen, bad, opts)
    assert len(generate_texts(gen, ["x " * 400], DecodeOptions(max_new_tokens=4, truncate=True))) == 1
