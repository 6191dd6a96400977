"""`python -m transformer_jax.generate`: continuations and translations equal transformers' on
tiny random checkpoints, sampling and beam search equal the library's, batching keeps input order, a
training workdir works, and bad input ends with `error: ...` and exit code 2 (no traceback)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest
from absl import flags

from transformer_jax import generate as cli

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch  # noqa: E402
from test_convert_fixtures import gpt2_checkpoint, hf_model, marian_checkpoint  # noqa: E402


def run_cli(*args: str) -> list[str]:
    """Runs the command line in this process; returns its stdout lines."""
    fv = flags.FlagValues()
    cli.define_flags(fv)
    fv(["generate", *args])
    out = io.StringIO()
    cli.run(fv, out)
    return out.getvalue().splitlines()


def cli_error(capsys, *args: str) -> str:
    """Runs the command line expecting exit code 2; returns what it wrote to stderr."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_cli(*args)
    assert e.value.code == 2
    return capsys.readouterr().err


def hf_greedy_text(directory, text, max_new_tokens=None, seq2seq=False):
    """transformers' greedy output text; for translation at most source length + 50 tokens (the
    paper's limit, our default) within the 64 positions of the test models."""
    import transformers

    if seq2seq:
        names = ("source.spm", "target.spm", "vocab.json")
        tok = transformers.MarianTokenizer(*(os.path.join(directory, n) for n in names))
    else:
        tok = transformers.GPT2TokenizerFast(tokenizer_file=os.path.join(directory, "tokenizer.json"))
    ids = tok(text, return_tensors="pt").input_ids
    max_new_tokens = max_new_tokens or min(ids.shape[1] + 50, 64)
    with torch.no_grad():
        out = hf_model(directory).generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            num_beams=1,
            max_new_tokens=max_new_tokens,
            pad_token_id=tok.eos_token_id,
        )
    new = out[0, 1:] if seq2seq else out[0, ids.shape[1] :]
    return cli._escape_newlines(tok.decode(new, skip_special_tokens=True))  # as the command writes it


def test_gpt2_continuation_matches_transformers():
    directory = gpt2_checkpoint("gpt2_a")
    prompts = ["the tired engineer", "hello"]
    lines = run_cli(
        f"--hf_checkpoint={directory}", *(f"--prompt={p}" for p in prompts), "--max_new_tokens=20"
    )
    assert lines == [hf_greedy_text(directory, p, 20) for p in prompts]


def test_marian_translation_matches_transformers():
    directory = marian_checkpoint("marian_swish")
    lines = run_cli(f"--hf_checkpoint={directory}", "--prompt=your cat is great", "--prompt=hello")
    assert lines == [hf_greedy_text(directory, t, seq2seq=True) for t in ("your cat is great", "hello")]


def test_input_file_batches_keep_input_order(tmp_path):
    directory = gpt2_checkpoint("gpt2_a")
    texts = ["the cold coffee", "a", "your cat is a great cat and the box", "hello there"] * 2
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n")
    common = (f"--hf_checkpoint={directory}", "--max_new_tokens=6")
    batched = run_cli(*common, f"--input_file={tmp_path / 'in.txt'}", "--batch_size=3")
    one_by_one = [run_cli(*common, f"--prompt={t}")[0] for t in texts[:4]]
    assert batched == one_by_one * 2


def test_sampled_text_does_not_depend_on_the_batch_size(tmp_path):
    """--decoding=sample: input i samples with its own key (fold_in(key(seed), i)), so the batch
    size, which changes the inputs each is batched with, does not change its text. With one key
    per batch (as before) the outputs at --batch_size=3 and 1 differed."""
    directory = gpt2_checkpoint("gpt2_a")
    texts = ["the cold coffee", "a", "your cat is a great cat and the box", "hello there", "the box"]
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n")
    common = (f"--hf_checkpoint={directory}", f"--input_file={tmp_path / 'in.txt'}", "--max_new_tokens=8",
              "--decoding=sample", "--temperature=1.5", "--seed=5")
    by_three = run_cli(*common, "--batch_size=3")
    assert by_three == run_cli(*common, "--batch_size=1")
    assert by_three == run_cli(*common, "--batch_size=5")
    assert len(set(by_three)) == len(texts) and by_three != run_cli(*common[:3])  # greedy differs
    assert by_three != run_cli(*common[:-1], "--seed=6", "--batch_size=3")
    # All 64 bits of the seed count: 5 + 2**32 sampled what 5 did (jax.random.key keeps 32 bits).
    assert by_three != run_cli(*common[:-1], f"--seed={5 + 2**32}", "--batch_size=3")


def _library_decode(directory, text, new_tokens, seed=None, **kwargs):
    """One translation by the library's own sampler (seed given) or beam search, set up as the
    command line documents it: source + EOS padded to its length bucket, decoding from
    decoder_start_id, the checkpoint's banned tokens never generated, key fold_in(key(seed), 0)."""
    import jax
    import jax.numpy as jnp

    from transformer_jax import decoding
    from transformer_jax.decoding import model_steps
    from transformer_jax.params import build_model

    gen = cli.load_hf_generator(directory)
    cfg, model = gen.config, build_model(gen.config)
    src = gen.input_ids(text)
    tokens = np.full((1, decoding.bucket_length(len(src))), cfg.pad_id, np.int32)
    tokens[0, : len(src)] = src
    cache = model_steps.encode_source(model, gen.params, jnp.asarray(tokens), max_length=new_tokens + 1)
    step_fn = cli.BanTokensStep(model_steps.Seq2SeqStep(model), gen.banned_ids)
    start, one = jnp.full((1, 1), cfg.decoder_start_id, jnp.int32), jnp.ones((1,), jnp.int32)
    common = dict(max_new_tokens=new_tokens, eos_id=cfg.eos_id, pad_id=cfg.pad_id)
    if seed is None:
        out = decoding.beam_search(step_fn, gen.params, cache, start, one, **common, **kwargs)
        ids, n = out.tokens[0, 0], int(out.lengths[0, 0])
    else:
        key = jax.random.fold_in(jax.random.key(seed), 0)
        out = decoding.generate(step_fn, gen.params, cache, start, one, rng=key, **common, **kwargs)
        ids, n = out.tokens[0], int(out.lengths[0])
    ids = np.asarray(ids[:n]).tolist()
    return gen.tokenizer.decode(ids[:-1] if ids and ids[-1] == cfg.eos_id else ids)


def test_sampling_and_beam_search_equal_the_library():
    """The sampling and beam flags reach the library: a CLI that decoded greedily whatever
    --decoding said passed the earlier check (one seed twice gives the same text)."""
    directory = marian_checkpoint("marian_swish")
    common = (f"--hf_checkpoint={directory}", "--prompt=the cat", "--max_new_tokens=8")
    settings = dict(temperature=1.5, top_k=20, top_p=0.9)
    sample = (*common, "--decoding=sample", *(f"--{k}={v}" for k, v in settings.items()))
    three, four = run_cli(*sample, "--seed=3"), run_cli(*sample, "--seed=4")
    assert three == [_library_decode(directory, "the cat", 8, seed=3, **settings)]
    assert four == [_library_decode(directory, "the cat", 8, seed=4, **settings)]
    assert three != four and three != run_cli(*common)  # another seed, and greedy, differ
    # (this random model never ends a hypothesis, so alpha changes nothing here: the test above
    # checks that --alpha and --beam_size reach beam_search)
    beam = run_cli(*common, "--decoding=beam", "--beam_size=3", "--alpha=0.6")
    assert beam == [_library_decode(directory, "the cat", 8, beam_size=3, alpha=0.6)]


def test_batched_outputs_do_not_depend_on_the_inputs_batched_with_them():
    """GPT-2 (48 learned positions): a prompt near the limit batched with a short one, which may
    generate more tokens. Each row stops at its own limit, so decoding passes the position-table
    check (without per-row limits the long row's steps would reach past the table, which
    `generate` refuses), and each output equals its one-by-one output."""
    directory = gpt2_checkpoint("gpt2_b")
    texts = [" ".join(["the cold coffee"] * 7), "hello"]
    batched = run_cli(f"--hf_checkpoint={directory}", *(f"--prompt={t}" for t in texts))
    assert batched == [run_cli(f"--hf_checkpoint={directory}", f"--prompt={t}")[0] for t in texts]



def test_beam_decoding_gets_each_inputs_own_limit(monkeypatch):
    """Translation by beam search: each row's hypotheses end at its own limit (source length + 50,
    within the model's positions), so its result does not depend on the rows batched with it
    (beam_search's per-row limits are tested against separate searches in test_decoding.py)."""
    import jax.numpy as jnp

    from transformer_jax import decoding

    seen = {}

    def record(step_fn, params, cache, prompt, lengths, **kwargs):
        seen.update(kwargs)
        batch, steps = prompt.shape[0], kwargs["max_new_tokens"]
        zeros = jnp.zeros((batch, kwargs["beam_size"]), jnp.int32)
        return decoding.BeamOutput(jnp.zeros((batch, kwargs["beam_size"], steps), jnp.int32),
                                   zeros * 0.0, zeros * 0.0, zeros + 1)

    monkeypatch.setattr(decoding, "beam_search", record)
    directory = marian_checkpoint("marian_swish")  # 64 positions
    texts = ["your cat is a great cat and the box is cold", "hello"]
    run_cli(f"--hf_checkpoint={directory}", "--decoding=beam", "--min_new_tokens=2", "--beam_size=3",
            "--alpha=1.25", *(f"--prompt={t}" for t in texts))
    limits = seen["max_new_tokens_per_row"].tolist()
    assert limits[0] == 64 and limits[1] < 64 and seen["max_new_tokens"] == 64, limits
    assert seen["min_new_tokens"] == 2 and seen["beam_size"] == 3 and seen["alpha"] == 1.25


def test_truncate_cuts_long_prompts(capsys):
    directory = gpt2_checkpoint("gpt2_b")  # 48 positions
    long_prompt = "--prompt=" + " ".join(["the cold coffee"] * 30)
    err = cli_error(capsys, f"--hf_checkpoint={directory}", long_prompt, "--max_new_tokens=4")
    assert "more than the 45 this model allows" in err and "--truncate" in err  # 48 - 4 + 1
    lines = run_cli(f"--hf_checkpoint={directory}", long_prompt, "--max_new_tokens=4", "--truncate")
    assert len(lines) == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt="], "empty input (--prompt number 1)"),
        (["--prompt=a", "--max_new_tokens=0"], "--max_new_tokens=0: must be a positive integer"),
        (["--prompt=a", "--min_new_tokens=5", "--max_new_tokens=3"],
         "--min_new_tokens=5 exceeds --max_new_tokens=3"),
        (["--prompt=a", "--decoding=sample", "--top_p=1.5"], "--top_p=1.5: must be in (0, 1]"),
        (["--prompt=a", "--decoding=sample", "--temperature=-1"], "--temperature=-1.0: must be > 0"),
        (["--prompt=a", "--decoding=sample", "--temperature=inf"],
         "--temperature=inf: must be > 0 and finite"),
        (["--prompt=a", "--top_k=5"], "--top_k applies only to --decoding=sample"),
        (["--prompt=a", "--seed=3"], "--seed applies only to --decoding=sample (got --decoding=greedy)"),
        (["--prompt=a", "--decoding=beam", "--seed=3", "--top_p=0.9"],
         "--top_p, --seed apply only to --decoding=sample"),
        (["--prompt=a", "--decoding=nucleus"], "--decoding='nucleus': must be one of"),
        (["--prompt=a", "--decoding=beam", "--alpha=inf"], "--alpha=inf: must be >= 0 and finite"),
        (["--prompt=a", "--decoding=sample", f"--seed={2**64}"],
         f"--seed={2**64}: must be in [-2**63, 2**63)"),
        ([], "give --prompt=TEXT or --input_file=FILE"),
        (["--prompt=a", "--max_new_tokens=65"], "leaves no room for a prompt"),  # 64 positions
        (["--input_file=/nonexistent/in.txt"], "cannot read --input_file='/nonexistent/in.txt'"),
        (["--prompt=a", "--kernel_layout=out-in"], "ModelConfig.kernel_layout='out-in': must be one of"),
        (["--prompt=a", "--dtype=bf16"], "ModelConfig.dtype='bf16': must be one of"),
        (["--prompt=a", "--mesh=model=2"], "--mesh='model=2': 'model=2' is not AXIS=SIZE with AXIS one of"),
        (["--prompt=a", "--mesh=tensor"], "'tensor' is not AXIS=SIZE"),
        (["--prompt=a", "--mesh=tensor=two"], "--mesh='tensor=two': tensor='two' is not an integer"),
        (["--prompt=a", "--mesh=tensor=2,tensor=4"], "names tensor twice"),
        (["--prompt=a", "--mesh=tensor=3"], "--mesh='tensor=3': Cannot fill mesh.data=-1"),  # 8 devices
        (["--prompt=a", "--mesh=data=2,tensor=2"], "multiply to 4, but there are 8 devices"),
        (["--prompt=a", "--mesh=tensor=0"], "Mesh sizes must be positive or -1"),
    ],
)
def test_bad_input_is_a_clear_error(capsys, args, message):
    err = cli_error(capsys, f"--hf_checkpoint={gpt2_checkpoint('gpt2_a')}", *args)
    assert message in err and "Traceback" not in err


def test_a_prompt_that_is_not_utf8_is_a_clear_error(capsys):
    """Bytes that are not UTF-8 on the command line reach argv as lone surrogates; the GPT-2
    tokenizer raised a TypeError on them (a traceback, exit code 1)."""
    latin1 = b"caf\xe9".decode("utf-8", "surrogateescape")  # what Python makes of argv b"caf\xe9"
    directory = gpt2_checkpoint("gpt2_a")
    err = cli_error(capsys, f"--hf_checkpoint={directory}", "--prompt=a", f"--prompt={latin1}")
    assert "error: --prompt number 2 is not UTF-8 text (byte 0xe9 at character 4)" in err
    assert "Traceback" not in err


def test_an_input_file_that_is_not_utf8_text_names_its_line(capsys, tmp_path):
    """UTF-16 without a byte-order mark is valid UTF-8 (its NUL bytes too) and gave 3 outputs of
    nonsense for 2 lines; a bad byte in a file of CR line ends was put at line 1."""
    directory = gpt2_checkpoint("gpt2_a")
    utf16 = tmp_path / "u16.txt"
    utf16.write_bytes("the cat\nhello\n".encode("utf-16-le"))
    err = cli_error(capsys, f"--hf_checkpoint={directory}", f"--input_file={utf16}")
    assert "is not UTF-8 text (a NUL character at line 1; UTF-16?)" in err and "Traceback" not in err
    cr = tmp_path / "cr.txt"
    cr.write_bytes(b"the cat\rhello\rbad \xff here\r")
    err = cli_error(capsys, f"--hf_checkpoint={directory}", f"--input_file={cr}")
    assert "is not UTF-8 text (invalid start byte at line 3)" in err, err


def test_step_with_a_hugging_face_checkpoint_is_an_error(capsys, tmp_path):
    """--step picks a workdir's checkpoint; with --hf_checkpoint it used to be ignored silently."""
    err = cli_error(capsys, f"--hf_checkpoint={tmp_path}", "--prompt=a", "--step=3")
    assert "--step applies only to --workdir" in err


def test_a_too_long_prompt_counts_the_start_token_in_its_message():
    """A decoder-only workdir model puts its start token before the prompt: a one-token prompt
    with room for one was reported as "2 tokens, more than the 1" with no word of why."""
    opts = cli.DecodeOptions()
    with pytest.raises(cli.GenerateError, match=r"has 2 tokens with the start token, more than the 1"):
        cli._fit_input([1, 7], 1, 0, opts, seq2seq=False, eos=1, prefix=(1,))
    with pytest.raises(cli.GenerateError, match=r"input 1 has 2 tokens, more than the 1"):
        cli._fit_input([5, 7], 1, 0, opts, seq2seq=False, eos=1)


def test_truncate_keeps_the_start_of_a_source_and_the_end_of_a_prompt():
    """--truncate: a translation keeps the start of its source and the EOS; a continuation keeps
    its prefix and the tokens just before the ones it generates."""
    import transformer_jax as tj

    class Numbers:  # the text is its token ids
        def encode(self, text):
            return [int(w) for w in text.split()]

    text = " ".join(str(i) for i in range(10, 20))  # 10 tokens
    opts = cli.DecodeOptions(max_new_tokens=3, truncate=True)
    lm = cli.Generator(tj.presets.tiny(num_encoder_layers=0, max_len=8), None, Numbers(), prompt_prefix=(2,))
    # 8 positions less the 2 new tokens fed back (the third is not)
    assert cli.encode_inputs(lm, [text], opts) == [[2, 15, 16, 17, 18, 19]]
    translation = cli.Generator(tj.presets.tiny(max_len=8), None, Numbers())
    assert cli.encode_inputs(translation, [text], opts) == [[10, 11, 12, 13, 14, 15, 16, 1]]


def test_max_new_tokens_leaving_only_the_start_token_is_an_error():
    """A workdir LM's start token takes a position: with max_len new tokens, --truncate would cut
    every prompt to the start token alone and continue from nothing, without a word."""
    import transformer_jax as tj

    class Numbers:
        def encode(self, text):
            return [int(w) for w in text.split()]

    cfg = tj.presets.tiny(num_encoder_layers=0, max_len=8)
    lm = cli.Generator(cfg, None, Numbers(), prompt_prefix=(2,))
    # P prompt tokens and N new ones take P + N - 1 positions (the last new token is not fed back).
    for truncate in (False, True):
        opts = cli.DecodeOptions(max_new_tokens=8, truncate=truncate)
        with pytest.raises(cli.GenerateError, match=r"--max_new_tokens=8 leaves no room for a prompt "
                                                    r"within the model's 8 positions \(1 of them"):
            cli.encode_inputs(lm, ["10 11 12"], opts)
    # One position left for the prompt itself: it keeps its last token.
    one_left = cli.DecodeOptions(max_new_tokens=7, truncate=True)
    assert cli.encode_inputs(lm, ["10 11 12"], one_left) == [[2, 12]]
    # Without a start token (a GPT-2 checkpoint) max_len new tokens still leave one prompt token.
    gpt2_like = cli.Generator(cfg, None, Numbers())
    no_start = cli.DecodeOptions(max_new_tokens=8, truncate=True)
    assert cli.encode_inputs(gpt2_like, ["10 11 12"], no_start) == [[12]]
    # A prompt of exactly max_len tokens takes one new token; it was refused.
    assert cli.encode_inputs(gpt2_like, [" ".join(map(str, range(10, 18)))], cli.DecodeOptions()) == [
        list(range(10, 18))]
    assert cli._new_tokens_limit(gpt2_like, cli.DecodeOptions(), 8) == 1
    assert cli._new_tokens_limit(gpt2_like, cli.DecodeOptions(), 5) == 4  # positions 0..7


def test_truncate_without_max_new_tokens_leaves_room_for_the_default_continuation():
    """--truncate alone cut a long prompt to max_len - 1 tokens, which left room for exactly one
    new token, where the default continuation is 64."""
    import transformer_jax as tj

    class Numbers:
        def encode(self, text):
            return [int(w) for w in text.split()]

    text = " ".join(str(i) for i in range(300))
    opts = cli.DecodeOptions(truncate=True)
    lm_config = tj.presets.tiny(num_encoder_layers=0, max_len=200)
    lm = cli.Generator(lm_config, None, Numbers(), prompt_prefix=(2,))
    [ids] = cli.encode_inputs(lm, [text], opts)
    assert ids == [2, *range(300 - 136, 300)]  # 200 positions less the 63 new tokens fed back
    assert cli._new_tokens_limit(lm, opts, len(ids)) == cli.DEFAULT_CONTINUATION == 64
    # A short model keeps half its positions (after the start token) for the continuation.
    short = cli.Generator(lm_config.replace(max_len=9), None, Numbers(), prompt_prefix=(2,))
    [ids] = cli.encode_inputs(short, [text], opts)
    assert ids == [2, 295, 296, 297, 298, 299] and cli._new_tokens_limit(short, opts, len(ids)) == 4
    # --min_new_tokens above the default budget raises it (within the positions), not silently cut.
    assert cli._new_tokens_limit(lm, cli.DecodeOptions(min_new_tokens=100), 20) == 100
    assert cli._new_tokens_limit(lm, cli.DecodeOptions(min_new_tokens=100), 150) == 51
    translation = cli.Generator(lm_config.replace(num_encoder_layers=1), None, Numbers())
    assert cli._new_tokens_limit(translation, cli.DecodeOptions(min_new_tokens=90), 10) == 90
    # ...and a prompt leaving less room than --min_new_tokens is refused, or with --truncate cut to
    # leave it: it was cut for the default 64 and then decoded 64, or, uncut, fewer, silently.
    prompt = " ".join(str(i) for i in range(149))  # 150 tokens with the start token
    with pytest.raises(cli.GenerateError, match=r"input 1 has 150 tokens with the start token, more than "
                       r"the 101 this model allows \(.* of the --min_new_tokens=100\); shorten it or pass "
                       r"--truncate"):
        cli.encode_inputs(lm, [prompt], cli.DecodeOptions(min_new_tokens=100))
    [ids] = cli.encode_inputs(lm, [text], cli.DecodeOptions(min_new_tokens=150, truncate=True))
    assert len(ids) == 51 and cli._new_tokens_limit(lm, cli.DecodeOptions(min_new_tokens=150), 51) == 150
    with pytest.raises(cli.GenerateError, match=r"--min_new_tokens=200 leaves no room for a prompt"):
        cli.encode_inputs(lm, ["5"], cli.DecodeOptions(min_new_tokens=200))
    with pytest.raises(cli.GenerateError, match=r"--min_new_tokens=201 exceeds the model's 200 target"):
        cli.encode_inputs(translation, ["5"], cli.DecodeOptions(min_new_tokens=201))


def test_a_translation_does_not_depend_on_the_sources_batched_with_it_without_a_pad_id(monkeypatch):
    """A model without a pad id took the padding of a shorter source for tokens (its encoder masks
    padding by the pad id), so the shorter source's translation changed with its batch-mates."""
    import jax

    import transformer_jax as tj
    from transformer_jax import decoding

    logprobs = []
    real_generate = decoding.generate

    def recording_generate(*args, **kwargs):
        out = real_generate(*args, **kwargs)
        logprobs.append(np.asarray(out.logprobs))
        return out

    monkeypatch.setattr(decoding, "generate", recording_generate)

    cfg = tj.presets.tiny(pad_id=None, max_len=32, dropout_rate=0.0)
    model = tj.Transformer(cfg)
    params = model.init(jax.random.key(0), np.ones((1, 4), np.int32), np.ones((1, 4), np.int32))["params"]

    class Numbers:
        def encode(self, text):
            return [int(w) for w in text.split()]

    gen = cli.Generator(cfg, params, Numbers())
    opts = cli.DecodeOptions(max_new_tokens=6)
    short, long = gen.input_ids("5 6 7"), gen.input_ids("8 9 10 11 12 13 14 15 16 17")
    alone = cli._decode_batch(gen, [short], opts, 1, None)
    together = cli._decode_batch(gen, [short, long], opts, 2, None)
    assert together[0] == alone[0]
    # The tokens of a random model rarely move; the log-probabilities of its choices do.
    np.testing.assert_allclose(logprobs[1][0], logprobs[0][0], rtol=0, atol=1e-5)


def test_newlines_inside_an_output_are_written_as_backslash_n():
    assert cli._escape_newlines("a\nb\r\nc\rd") == "a\\nb\\nc\\nd"
    # A backslash is doubled, so a literal backslash-n (code) differs from a line end.
    assert cli._escape_newlines('print("a\\nb")') == 'print("a\\\\nb")'
    assert cli._escape_newlines('print("a\\nb")') != cli._escape_newlines('print("a\nb")')
    # Other control characters (a byte-level tokenizer samples them) would reach the terminal (ESC
    # starts its commands) or make the output a file --input_file refuses (NUL): written as hex.
    assert (cli._escape_newlines("a\x1b[2Jb\x00c\td\x7fe\x85f\u2028g\u2029h\x0ci")
            == "a\\x1b[2Jb\\x00c\td\\x7fe\\x85f\\u2028g\\u2029h\\x0ci")
    assert cli._escape_newlines("café 東京") == "café 東京"
    assert cli._escape_newlines("\x9b31m\x80\xa0") == "\\x9b31m\\x80\xa0"  # C1 (CSI) escaped, NBSP kept


def test_outputs_are_utf8_whatever_the_locale_and_standard_input_is_a_file(monkeypatch):
    """An ASCII or Latin-1 stdout raised UnicodeEncodeError (a traceback, exit 1) after all the
    decoding had run; and --input_file=- was a file named '-'."""
    directory = gpt2_checkpoint("gpt2_a")
    seen = []
    monkeypatch.setattr(cli, "iter_generated", lambda gen, texts, opts, progress, mesh=None: (
        seen.append(texts) or [[(i, f"café {t}\x1b") for i, t in enumerate(texts)]]))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"first\r\nsecond\n"), encoding="ascii"))
    stdout = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", stdout)
    fv = flags.FlagValues()
    cli.define_flags(fv)
    fv(["generate", f"--hf_checkpoint={directory}", "--input_file=-"])
    cli.run(fv)
    assert seen == [["first", "second"]]
    assert stdout.buffer.getvalue() == "café first\\x1b\ncafé second\\x1b\n".encode()


def test_an_empty_input_file_is_an_error(capsys, tmp_path):
    (tmp_path / "in.txt").write_text("")
    err = cli_error(capsys, f"--workdir={tmp_path}", f"--input_file={tmp_path / 'in.txt'}")
    assert f"--input_file='{tmp_path / 'in.txt'}' is empty" in err


def test_input_file_gives_one_input_per_line(capsys, tmp_path):
    # str.splitlines also breaks at form feeds, U+2028, U+0085, ...: those lines used to become
    # two inputs, so out.txt had more lines than src.txt.
    path = tmp_path / "in.txt"
    path.write_bytes("\ufefffirst\r\na\x0cb\nc\u2028d\x85e\rlast\n".encode())
    assert cli._read_file(str(path)) == ["first", "a\x0cb", "c\u2028d\x85e", "last"]
    path.write_bytes(b"good\nalso good\nbad \xff byte\n")
    err = cli_error(capsys, f"--workdir={tmp_path}", f"--input_file={path}")
    assert "is not UTF-8 text (invalid start byte at line 3)" in err
    path.write_bytes("first\nsecond\n".encode("utf-16"))  # with its byte-order mark: named as such
    err = cli_error(capsys, f"--workdir={tmp_path}", f"--input_file={path}")
    assert "is UTF-16 text (it starts with a UTF-16 byte-order mark), not UTF-8" in err, err


def test_step_flag_picks_the_checkpoint(capsys, tmp_path, monkeypatch):
    from transformer_jax.training import checkpoint

    asked = []

    def restore(workdir, step=None, mesh=None, rules=None):
        asked.append(step)
        raise FileNotFoundError(f"{workdir} has no checkpoint at step {step}")

    monkeypatch.setattr(checkpoint, "restore_for_inference", restore)
    err = cli_error(capsys, f"--workdir={tmp_path}", "--prompt=a", "--step=3")
    assert asked == [3] and "has no checkpoint at step 3" in err


def test_bad_model_sources_are_clear_errors(capsys, tmp_path):
    assert "exactly one of --workdir" in cli_error(capsys, "--prompt=a")
    assert "no config.json" in cli_error(capsys, f"--hf_checkpoint={tmp_path}", "--prompt=a")
    assert "has no config.json" in cli_error(capsys, f"--workdir={tmp_path}", "--prompt=a")
    (tmp_path / "config.json").write_text(json.dumps({"model": {"vocab_size": 300}}))
    assert "has no checkpoint" in cli_error(capsys, f"--workdir={tmp_path}", "--prompt=a")
    # a damaged config.json, of a workdir or of a Hugging Face checkpoint, is named
    (tmp_path / "config.json").write_text("{not json")
    config_json = tmp_path / "config.json"
    for source in ("--workdir", "--hf_checkpoint"):
        err = cli_error(capsys, f"{source}={tmp_path}", "--prompt=a")
        assert f"{config_json}: not valid JSON" in err and "Traceback" not in err, err
    config_json.write_text("[1, 2]")
    err = cli_error(capsys, f"--hf_checkpoint={tmp_path}", "--prompt=a")
    assert "expected a JSON object, got list" in err
    # A directory that is not a training workdir (a Hugging Face checkpoint's config.json), and a
    # model section edited into another type: one line naming the file, not an AttributeError.
    config_json.write_text('{"model": [1]}')
    err = cli_error(capsys, f"--workdir={tmp_path}", "--prompt=a")
    assert f"{config_json} has no readable 'model' section" in err and "Traceback" not in err, err
    config_json.write_text('{"model_type": "gpt2"}')  # with the way out it has
    err = cli_error(capsys, f"--workdir={tmp_path}", "--prompt=a")
    assert (f"{config_json} is a Hugging Face checkpoint's config (model_type='gpt2'), not a training "
            f"workdir's: load it with --hf_checkpoint={tmp_path}") in err and "Traceback" not in err, err
    # ...and the other way round: a training workdir given as a Hugging Face checkpoint.
    config_json.write_text(json.dumps({"model": {"vocab_size": 300}}))
    err = cli_error(capsys, f"--hf_checkpoint={tmp_path}", "--prompt=a")
    assert "is a training workdir, not a Hugging Face checkpoint: give it as --workdir" in err, err


def test_a_workdir_without_its_tokenizer_files_is_named(capsys, tmp_path, caplog):
    from transformer_jax.training import restore_for_inference

    _tiny_workdir(str(tmp_path))
    (tmp_path / "tokenizer.json").unlink()  # nothing to check the tokenizer against: said
    with caplog.at_level("WARNING"):
        restore_for_inference(str(tmp_path))
    assert f"{tmp_path} has no tokenizer.json recording which tokenizer the run trained with" in caplog.text
    (tmp_path / "tokenizer.model").unlink()
    err = cli_error(capsys, f"--workdir={tmp_path}", "--prompt=a")
    assert err == (f"error: Workdir {str(tmp_path)!r} has no tokenizer.model: its checkpoints decode only "
                   f"with the tokenizer training wrote there; copy it (and tokenizer.json) back from the "
                   f"run's workdir\n"), err


def test_a_tokenizer_of_another_model_in_the_workdir_is_refused(capsys, tmp_path):
    """Another run's larger tokenizer.model copied into a workdir: its ids pass the end of the
    model's table, and the command printed nonsense with exit status 0."""
    from transformer_jax.data import Tokenizer
    from transformer_jax.data.tokenizer import TokenizerSettings

    config, _, _ = _tiny_workdir(str(tmp_path))
    bigger = Tokenizer.train(["the tired engineer drank the cold coffee, then another one"] * 50,
                             TokenizerSettings(vocab_size=config.vocab_size + 40))
    bigger.save(str(tmp_path / "tokenizer.model"))
    err = cli_error(capsys, f"--workdir={tmp_path}", "--prompt=the engineer")
    assert f"{tmp_path / 'tokenizer.model'} has {config.vocab_size + 40} pieces" in err, err


def test_a_tokenizer_of_another_model_with_no_more_pieces_is_refused(capsys, tmp_path):
    """Another run's tokenizer.model of no larger a vocabulary: its ids fit the model's table, so
    only the SHA-256 that training recorded in tokenizer.json tells it apart; the command printed
    nonsense with exit status 0."""
    import hashlib

    from transformer_jax.data import Tokenizer
    from transformer_jax.data.tokenizer import TokenizerSettings
    from transformer_jax.training import restore_for_inference

    config, _, own = _tiny_workdir(str(tmp_path))
    record = tmp_path / "tokenizer.json"
    record.write_text(json.dumps({"model_sha256": hashlib.sha256(own.model_proto).hexdigest()}))
    assert restore_for_inference(str(tmp_path)).tokenizer.vocab_size == own.vocab_size  # its own
    other = Tokenizer.train(["a quiet river ran past the old mill at dawn, then on"] * 50,
                            TokenizerSettings(vocab_size=own.vocab_size))
    assert other.vocab_size == own.vocab_size <= config.vocab_size and other.model_proto != own.model_proto
    other.save(str(tmp_path / "tokenizer.model"))
    err = cli_error(capsys, f"--workdir={tmp_path}", "--prompt=the engineer")
    assert (f"{tmp_path / 'tokenizer.model'} is not the tokenizer recorded in {record} (sha256 "
            f"differs)") in err, err
    own.save(str(tmp_path / "tokenizer.model"))  # put back: generates again
    assert restore_for_inference(str(tmp_path)).step >= 0


def test_real_process_exits_2_without_traceback():
    directory = gpt2_checkpoint("gpt2_a")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "transformer_jax.generate",
            f"--hf_checkpoint={directory}",
            "--prompt=a",
            "--decoding=sample",
            "--top_p=0",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=120,
    )
    assert proc.returncode == 2
    assert "error: --top_p=0.0: must be in (0, 1]" in proc.stderr and "Traceback" not in proc.stderr
    # An unknown flag or a value of the wrong type: the same one line and status 2 (absl alone
    # exits 1 with 'FATAL Flags parsing error').
    proc = subprocess.run([sys.executable, "-m", "transformer_jax.generate", f"--hf_checkpoint={directory}",
                           "--prompt=a", "--max_new_tokens=abc"], capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: flag --max_new_tokens=abc"), proc.stderr


# ----------------------------------------------------------------------------- training workdirs


def _tiny_workdir(directory):
    """A workdir as training leaves it: config.json, tokenizer.model, one params checkpoint."""
    import flax.linen as nn
    import jax
    import orbax.checkpoint as ocp

    import transformer_jax as tj
    from transformer_jax.data import Tokenizer
    from transformer_jax.data.tokenizer import TokenizerSettings
    from transformer_jax.params import build_model, dummy_inputs
    from transformer_jax.training import integrity

    tokenizer = Tokenizer.train(
        ["the tired engineer drank the cold coffee"] * 50, TokenizerSettings(vocab_size=300)
    )
    tokenizer.save(os.path.join(directory, "tokenizer.model"))
    with open(os.path.join(directory, "tokenizer.json"), "w") as f:  # as training records it
        json.dump({"model_sha256": hashlib.sha256(tokenizer.model_proto).hexdigest()}, f)
    config = tj.presets.tiny(vocab_size=tokenizer.vocab_size, num_encoder_layers=0, max_len=32)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"model": config.to_dict(), "seed": 0}, f)
    params = build_model(config).init(jax.random.key(0), *dummy_inputs(config))["params"]
    params = jax.tree.map(lambda x: x * 8.0, nn.unbox(params))  # spread out, so outputs vary
    manager = ocp.CheckpointManager(
        os.path.join(directory, "checkpoints"),
        options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False),
    )
    manager.save(7, args=ocp.args.Composite(params=ocp.args.StandardSave(params)), force=True)
    manager.wait_until_finished()
    manager.close()
    # sealed as training seals its steps (without a manifest a restore warns that nothing was checked)
    integrity.write_manifest(os.path.join(directory, "checkpoints"), 7, config)
    return config, params, tokenizer


def test_workdir_generation_equals_the_library(tmp_path):
    from transformer_jax.decoding import generate, model_steps, pad_prompts
    from transformer_jax.modeling import init_cache
    from transformer_jax.params import build_model

    config, params, tokenizer = _tiny_workdir(str(tmp_path))
    lines = run_cli(f"--workdir={tmp_path}", "--prompt=the tired engineer", "--max_new_tokens=10")
    # Training starts every example with decoder_start_id, so workdir prompts do too.
    prompt = [config.decoder_start_id, *tokenizer.encode("the tired engineer")]
    tokens, lengths = pad_prompts([prompt])
    cache = init_cache(config, 1, tokens.shape[1] + 10)
    out = generate(
        model_steps.LMStep(build_model(config)),
        params,
        cache,
        tokens,
        lengths,
        max_new_tokens=10,
        eos_id=config.eos_id,
    )
    ids = np.asarray(out.tokens[0, : int(out.lengths[0])]).tolist()
    assert lines == [tokenizer.decode([i for i in ids if i != config.eos_id])]
    # The same checkpoint decoded with 'out_in' kernels (converted on load): the same text.
    args = (f"--workdir={tmp_path}", "--prompt=the tired engineer", "--max_new_tokens=10")
    assert run_cli(*args, "--kernel_layout=out_in") == lines
    assert len(run_cli(*args, "--kernel_layout=out_in", "--dtype=bfloat16")) == 1
    # ... and with Q, K and V stored as one kernel, in either layout: the same text.
    assert run_cli(*args, "--fused_qkv") == lines
    assert run_cli(*args, "--fused_qkv", "--kernel_layout=out_in") == lines


def test_real_process_prints_outputs_and_nothing_on_stderr(tmp_path):
    """A successful run writes one line per prompt to stdout and nothing to stderr (the checkpoint
    library's notices are hidden unless --verbosity is given)."""
    _tiny_workdir(str(tmp_path))
    command = [sys.executable, "-m", "transformer_jax.generate", f"--workdir={tmp_path}",
               "--prompt=the tired engineer", "--max_new_tokens=4"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == 1 and proc.stderr == ""
    proc = subprocess.run(command + ["--verbosity=0"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and "orbax" in proc.stderr  # on request, the library's logs are back


def test_bad_words_ids_in_config_json_are_banned_without_a_generation_config(tmp_path):
    """Checkpoints saved before generation_config.json existed (older opus-mt snapshots) keep
    ``bad_words_ids=[[pad]]`` in config.json, and transformers' generate bans them from there."""
    import shutil

    src = marian_checkpoint("marian_swish")
    for name in os.listdir(src):
        if name != "generation_config.json":
            shutil.copy(os.path.join(src, name), tmp_path / name)
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    config["bad_words_ids"] = [[config["pad_token_id"]]]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert cli.load_hf_generator(str(tmp_path)).banned_ids == (config["pad_token_id"],)
    assert cli.load_hf_generator(src).banned_ids == ()  # its generation_config.json bans none


def test_the_parameters_go_onto_huge_pages_unless_asked_not_to(tmp_path, monkeypatch):
    import flax.linen as nn
    import jax

    from transformer_jax.decoding import huge_pages
    from transformer_jax.params import build_model, dummy_inputs

    config, _, _ = _tiny_workdir(str(tmp_path))
    placed = []
    real = huge_pages.place_on_huge_pages
    monkeypatch.setattr(huge_pages, "place_on_huge_pages", lambda tree: placed.append(tree) or real(tree))
    args = (f"--workdir={tmp_path}", "--prompt=the tired engineer", "--max_new_tokens=4",
            "--kernel_layout=out_in")
    lines = run_cli(*args)
    # What is placed is what decodes: the parameters after the conversion to 'out_in'.
    out_in = config.replace(kernel_layout="out_in")
    expected = nn.unbox(jax.eval_shape(build_model(out_in).init, jax.random.key(0), *dummy_inputs(out_in)))
    shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
    assert len(placed) == 1 and shapes(placed[0]) == shapes(expected["params"])
    assert shapes(placed[0]) != shapes(jax.eval_shape(lambda: nn.unbox(build_model(config).init(
        jax.random.key(0), *dummy_inputs(config)))["params"]))
    assert run_cli(*args, "--nohuge_pages") == lines and len(placed) == 1


def test_auto_layout_picks_out_in_where_the_native_kernels_take_every_step(monkeypatch):
    """`--kernel_layout=auto` (the default) converts to 'out_in' ('packed' in bf16) only where the
    decoding steps' weight products run on the native CPU kernels: at most 16 rows a step (the batch
    the inputs fill, times the beams), kernels the model lets it use, a checkpoint not already in
    that layout."""
    import transformer_jax as tj
    from transformer_jax.modeling import native

    config = tj.presets.tiny(num_encoder_layers=0, vocab_size=100)
    opts, beam = cli.DecodeOptions(), cli.DecodeOptions(decoding="beam", beam_size=4)
    monkeypatch.setattr(native, "use_native", lambda setting: setting != "xla")
    monkeypatch.setattr(native, "isa", lambda: "avx512")
    monkeypatch.setattr(native, "bf16_products", lambda: "dot")
    assert cli.auto_kernel_layout(config, opts, 1) == "out_in"
    assert cli.auto_kernel_layout(config, opts, 1000) == "out_in"  # batches of 16
    assert cli.auto_kernel_layout(config, cli.DecodeOptions(batch_size=32), 17) is None  # 32 rows
    assert cli.auto_kernel_layout(config, cli.DecodeOptions(batch_size=32), 16) == "out_in"
    assert cli.auto_kernel_layout(config, beam, 4) == "out_in"  # 4 inputs x 4 beams
    assert cli.auto_kernel_layout(config, beam, 5) is None  # a batch of 8 x 4 beams
    assert cli.auto_kernel_layout(config.replace(cpu_kernels="xla"), opts, 1) is None
    assert cli.auto_kernel_layout(config.replace(kernel_layout="out_in"), opts, 1) is None
    # bf16 (the checkpoint's compute dtype, or --dtype's): the tiles of the bf16 kernel
    bf16 = config.replace(dtype="bfloat16")
    assert cli.auto_kernel_layout(bf16, opts, 1) == "packed"
    assert cli.auto_kernel_layout(config, opts, 1, dtype="bfloat16") == "packed"
    assert cli.auto_kernel_layout(bf16, opts, 1, dtype="float32") == "out_in"
    assert cli.auto_kernel_layout(bf16.replace(kernel_layout="packed"), opts, 1) is None
    assert cli.auto_kernel_layout(bf16.replace(kernel_layout="out_in"), opts, 1) == "packed"
    assert cli.auto_kernel_layout(bf16, cli.DecodeOptions(batch_size=32), 17) is None  # 32 rows
    # where the bf16 dot product is slow (the kernels widen bf16 to float32 FMAs), the packed tiles,
    # read by that instruction alone, decoded GPT-2 small ~3x slower than 'out_in' at batch 1
    monkeypatch.setattr(native, "bf16_products", lambda: "widen")
    assert cli.auto_kernel_layout(bf16, opts, 1) == "out_in"
    assert cli.auto_kernel_layout(bf16.replace(kernel_layout="out_in"), opts, 1) is None
    monkeypatch.setattr(native, "isa", lambda: "avx2")  # widened always, packed tiles too
    assert cli.auto_kernel_layout(bf16, opts, 1) == "packed"
    monkeypatch.setattr(native, "use_native", lambda setting: False)  # another backend, another CPU
    assert cli.auto_kernel_layout(config, opts, 1) is None
    assert cli.auto_kernel_layout(bf16, opts, 1) is None


def test_the_default_layout_is_chosen_per_run_and_gives_the_same_text(tmp_path, monkeypatch):
    from transformer_jax.modeling import native

    _tiny_workdir(str(tmp_path))
    asked = []
    real = cli.for_decoding
    record = lambda gen, **kw: asked.append(kw["kernel_layout"]) or real(gen, **kw)  # noqa: E731
    monkeypatch.setattr(cli, "for_decoding", record)
    args = (f"--workdir={tmp_path}", "--prompt=the tired engineer", "--max_new_tokens=8")
    lines = run_cli(*args)
    assert asked == ["out_in" if native.use_native("auto") else None]
    assert run_cli(*args, "--kernel_layout=in_out") == lines and asked[-1] == "in_out"
    run_cli(*args, "--decoding=beam", "--beam_size=17")  # 17 rows a step: the checkpoint's layout
    assert asked[-1] is None


def test_auto_layout_keeps_the_checkpoints_where_a_converted_copy_would_not_fit(monkeypatch, caplog):
    import transformer_jax as tj
    from transformer_jax.modeling import native

    config = tj.presets.tiny(num_encoder_layers=0, vocab_size=100)
    monkeypatch.setattr(native, "use_native", lambda setting: True)
    monkeypatch.setattr(cli, "_available_memory", lambda: 10 << 30)
    assert cli.auto_kernel_layout(config, cli.DecodeOptions(), 1, param_bytes=7 << 30) == "out_in"
    assert cli.auto_kernel_layout(config, cli.DecodeOptions(), 1, param_bytes=9 << 30) is None
    assert "needs another 9.0 GiB, and 10.0 GiB are available" in caplog.text
    monkeypatch.setattr(cli, "_available_memory", lambda: None)  # no /proc/meminfo: no limit known
    assert cli.auto_kernel_layout(config, cli.DecodeOptions(), 1, param_bytes=9 << 30) == "out_in"


def test_a_mesh_shards_the_parameters_and_splits_the_batch_with_the_same_text(tmp_path, monkeypatch):
    """`--mesh`: the parameters sharded as in training (restored straight onto the mesh from a
    workdir, placed on it after loading a Hugging Face checkpoint or converting one), each batch
    split over data x fsdp (rounded up to a multiple of it), and the text of one device's decoding:
    greedy, sampled and beam search, decoder-only and translation."""
    import jax

    seen = []
    real = cli._decode_rows

    def spy(gen, rows, opts, batch, keys, placement):
        leaves = jax.tree.leaves(gen.params)
        seen.append((batch, placement, sum(not leaf.sharding.is_fully_replicated for leaf in leaves),
                     {len(leaf.sharding.device_set) for leaf in leaves}))
        return real(gen, rows, opts, batch, keys, placement)

    monkeypatch.setattr(cli, "_decode_rows", spy)
    _tiny_workdir(str(tmp_path))
    prompts = ("--prompt=the tired engineer", "--prompt=the cold", "--prompt=coffee")
    lm = (f"--workdir={tmp_path}", *prompts, "--max_new_tokens=10")
    for decoding in (("--decoding=greedy",), ("--decoding=sample", "--seed=3", "--top_p=0.9"),
                     ("--decoding=beam", "--beam_size=3")):
        seen.clear()
        want = run_cli(*lm, *decoding)
        assert seen[-1][1] is None and seen[-1][0] == 4  # one device's run: nothing placed
        assert run_cli(*lm, *decoding, "--mesh=data=2,fsdp=2,tensor=2") == want, decoding
        batch, placement, sharded, devices = seen[-1]
        assert placement.mesh.shape == {"data": 2, "fsdp": 2, "tensor": 2} and batch == 4
        assert sharded > 10 and devices == {8}, (sharded, devices)
    import numpy as np

    from transformer_jax import parallel

    # The Python API on a mesh with axes of its own, through logical axis rules of its own: the
    # parameters placed and the batch split by them, the text one device's
    own = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(2, 2, 2), ("replica", "shard", "model"),
                            axis_types=(jax.sharding.AxisType.Auto,) * 3)
    rules = (("batch", ("replica", "shard")), ("embed", "shard"), ("vocab", "model"), ("heads", "model"),
             ("kv_heads", "model"), ("mlp", "model"))
    texts, opts = ["the tired engineer", "the cold", "coffee"], cli.DecodeOptions(max_new_tokens=10)
    plain = cli.generate_texts(cli.load_workdir_generator(str(tmp_path)), texts, opts)
    placed = cli.load_workdir_generator(str(tmp_path), mesh=own, rules=rules)
    assert cli.generate_texts(placed, texts, opts, mesh=own, rules=rules) == plain
    batch, placement, sharded, devices = seen[-1]
    assert placement.spec[0] == ("replica", "shard") and batch == 4 and sharded > 10 and devices == {8}
    four = parallel.create_mesh(data=4, tensor=2)  # a batch of 6 rounds down to 4, of 3 up to 4
    assert cli._batch_size(cli.DecodeOptions(batch_size=6), 10, four) == 4
    assert cli._batch_size(cli.DecodeOptions(), 3, four) == cli._batch_size(cli.DecodeOptions(), 1, four) == 4
    # 3 inputs over 8 batch pieces: a batch of 8; with --dtype the converted parameters are placed
    assert run_cli(*lm, "--mesh=fsdp=8", "--dtype=float32", "--kernel_layout=out_in") == run_cli(*lm)
    assert seen[-2][0] == 8 and seen[-2][1].mesh.shape["fsdp"] == 8 and seen[-2][2] > 10
    directory = marian_checkpoint("marian_swish")
    mt = (f"--hf_checkpoint={directory}", "--prompt=the cat", "--prompt=a dog sat", "--max_new_tokens=8")
    assert run_cli(*mt, "--mesh=tensor=2") == run_cli(*mt)  # (beam search on a mesh: above)
    assert seen[-2][1].mesh.shape == {"data": 4, "fsdp": 1, "tensor": 2} and seen[-2][2] > 10


class _FlushLog(io.StringIO):
    """An output stream that records, at each flush, how many lines had been written."""

    def __init__(self):
        super().__init__()
        self.flushed: list[int] = []

    def flush(self):
        self.flushed.append(len(self.getvalue().splitlines()))


def test_outputs_are_written_as_soon_as_the_inputs_before_them_are_decoded(tmp_path, monkeypatch, capsys):
    """The batches go longest input first; an output is written once every input before it is
    decoded, flushed batch by batch (they were all held back to the end, and a Ctrl-C lost them):
    an interrupted run keeps the finished ones, with one line saying how many, and status 130."""
    directory = gpt2_checkpoint("gpt2_a")
    texts = ["your cat is a great cat and the box of it", "the box", "a", "the cold coffee"]
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n")
    args = (f"--hf_checkpoint={directory}", f"--input_file={tmp_path / 'in.txt'}", "--max_new_tokens=4",
            "--batch_size=1")
    whole = run_cli(*args)
    fv = flags.FlagValues()
    cli.define_flags(fv)
    fv(["generate", *args])
    out = _FlushLog()
    cli.run(fv, out)
    assert out.getvalue().splitlines() == whole
    # Decoded in the order 0 (longest), 3, 1, 2: input 0's line at the first flush, 1 at the third
    # (with nothing new at the second), then 2 and 3 together.
    assert out.flushed == [1, 1, 2, 4]

    decode = cli._decode_batch
    calls = []

    def interrupted_at_the_third_batch(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return decode(*a, **k)

    monkeypatch.setattr(cli, "_decode_batch", interrupted_at_the_third_batch)
    out = _FlushLog()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli.run(fv, out)
    assert e.value.code == 130 and out.getvalue().splitlines() == whole[:1]
    err = capsys.readouterr().err  # after the progress bar's lines
    assert err.endswith("\nerror: interrupted; the outputs of the first 1 of 4 inputs were written\n")
    # Before the inputs are read (Ctrl-C at a terminal that --input_file=- reads): the same one line
    # (it was an UnboundLocalError, two tracebacks and status 1).
    def interrupted_reading(prompts, input_file):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_read_inputs", interrupted_reading)
    with pytest.raises(SystemExit) as e:
        cli.run(fv, _FlushLog())
    assert e.value.code == 130
    assert capsys.readouterr().err == "error: interrupted before the inputs were read\n"
    # Any other error mid-stream keeps its traceback, after a line saying what was written.
    monkeypatch.undo()
    calls.clear()

    def out_of_memory_at_the_second_batch(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("out of memory")
        return decode(*a, **k)

    monkeypatch.setattr(cli, "_decode_batch", out_of_memory_at_the_second_batch)
    out = _FlushLog()
    with pytest.raises(MemoryError):
        cli.run(fv, out)
    assert out.getvalue().splitlines() == whole[:1]
    assert capsys.readouterr().err.endswith(
        "note: the outputs of the first 1 of 4 inputs were written before the error below\n")


def test_a_failed_write_of_the_outputs_is_one_line_or_a_quiet_end_for_a_closed_pipe(tmp_path):
    """`> /dev/full` was an OSError traceback (twice: once more as Python flushed at exit); `| head`
    a BrokenPipeError traceback; a closed stdout (`>&-`) an AttributeError after decoding. Now:
    one error line and status 1; status 141 and nothing on stderr, as for a program the pipe's
    end stops; one error line and status 2 before anything is loaded."""
    _tiny_workdir(str(tmp_path))
    command = [sys.executable, "-m", "transformer_jax.generate", f"--workdir={tmp_path}",
               "--prompt=the tired engineer", "--prompt=a", "--max_new_tokens=4"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    with open("/dev/full", "w") as full:
        proc = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == ("error: cannot write the outputs (No space left on device); the outputs of the "
                           "first 0 of 2 inputs were written\n")
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # the reader has gone before the first line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err
    proc = subprocess.run(" ".join(map(shlex.quote, command)) + " >&-", shell=True, capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: standard output is closed"), proc.stderr


def test_malformed_bad_words_ids_are_named(tmp_path, capsys):
    """A generation config's bad_words_ids that is not a list of token-id lists was a TypeError or
    ValueError traceback; it is an error naming the entry."""
    import shutil

    src = gpt2_checkpoint("gpt2_a")
    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), tmp_path / name)
    for bad, message in (([[54], 3], "entry 1 is 3, not a list of token ids"),
                         ([["a"]], "entry 0 is ['a'], not a list of token ids"),
                         ([[54], [10**6]], "entry 1 has token ids outside the vocabulary"),
                         ("[54]", "is '[54]', not a list of token-id lists")):
        (tmp_path / "generation_config.json").write_text(json.dumps({"bad_words_ids": bad}))
        err = cli_error(capsys, f"--hf_checkpoint={tmp_path}", "--prompt=a")
        assert f"error: {tmp_path}: bad_words_ids in its generation config" in err and message in err, err
    (tmp_path / "generation_config.json").write_text(json.dumps({"bad_words_ids": [[54], [7, 8]]}))
    assert cli.load_hf_generator(str(tmp_path)).banned_ids == (54,)  # single tokens only, as before


def test_empty_lines_at_the_end_of_an_input_file_are_not_inputs(tmp_path, capsys):
    path = tmp_path / "in.txt"
    path.write_text("first\nsecond\n\n\n")  # an editor's or `echo >>`'s extra line end
    assert cli._read_file(str(path)) == ["first", "second"]
    path.write_text("first\n\nsecond\n")  # one inside is still an empty input
    err = cli_error(capsys, f"--workdir={tmp_path}", f"--input_file={path}")
    assert "empty input (line 2 of --input_file)" in err


def test_paths_starting_with_a_tilde_are_the_home_folder_s(tmp_path, monkeypatch):
    """`--workdir=~/run` reaches the program with its '~' (the shell expands it only at a word's
    start): it was "not a directory", as train.py and the averaging command expand it."""
    _tiny_workdir(str(tmp_path / "run"))
    (tmp_path / "in.txt").write_text("the tired engineer\n")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert len(run_cli("--workdir=~/run", "--input_file=~/in.txt", "--max_new_tokens=2")) == 1
