"""Translation evaluation plumbing, with the decoder replaced by fakes whose outputs are known: which
rows count, where hypotheses are cut, which beam is read, and BLEU's argument order."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sacrebleu

from transformer_jax import parallel
from transformer_jax.data.tokenizer import EOS_ID
from transformer_jax.decoding import BeamOutput, GenerateOutput
from transformer_jax.training import evaluate

JUNK = 29  # what the fakes emit after EOS, and in every beam but the best


class WordTokenizer:
    def decode_batch(self, rows):
        return [" ".join(f"w{i}" for i in row) for row in rows]


def _batch():
    """Three real examples and one padding row (segment id 0), one example per row."""
    targets = np.array([[5, 6, 7, 18, 19, EOS_ID, 0, 0], [8, 20, 21, 22, EOS_ID, 0, 0, 0],
                        [9, 10, 23, 24, 25, 26, EOS_ID, 0], [0] * 8], np.int32)
    inputs = np.array([[11, 12, EOS_ID, 0], [13, EOS_ID, 0, 0], [14, 15, 16, EOS_ID], [0, 0, 0, 0]], np.int32)
    seg = (inputs > 0).astype(np.int32)
    return {"inputs": inputs, "inputs_segment_ids": seg, "targets": targets}


@pytest.mark.parametrize("beam_size", [1, 3])
def test_translate_reads_the_best_hypothesis_up_to_eos_of_real_rows_only(monkeypatch, beam_size):
    batch = _batch()
    answers = np.where(batch["targets"] == 0, JUNK, batch["targets"])  # the reference, junk after EOS
    answers[3] = 17  # the padding row decodes to something (it must not be counted)

    def fake_generate(step_fn, params, cache, prompt, lengths, **kwargs):
        return GenerateOutput(jnp.asarray(answers), jnp.zeros(4, jnp.int32), jnp.zeros(answers.shape))

    def fake_beam_search(step_fn, params, cache, prompt, lengths, *, beam_size, **kwargs):
        beams = np.full((4, beam_size, answers.shape[1]), JUNK, np.int32)
        beams[:, 0] = answers  # best first
        zeros = jnp.zeros((4, beam_size))
        return BeamOutput(jnp.asarray(beams), zeros, zeros, zeros.astype(jnp.int32))

    monkeypatch.setattr(evaluate, "encode_source", lambda *a, **k: None)
    monkeypatch.setattr(evaluate, "Seq2SeqStep", lambda model: None)
    monkeypatch.setattr(evaluate, "generate", fake_generate)
    monkeypatch.setattr(evaluate, "beam_search", fake_beam_search)
    model = types.SimpleNamespace(config=types.SimpleNamespace(decoder_start_id=2, eos_id=EOS_ID, pad_id=0))
    mesh = parallel.create_mesh(1, 1, 1, jax.devices()[:1])
    out = evaluate.translate(model, None, [batch], WordTokenizer(), mesh, max_new_tokens=8,
                             beam_size=beam_size)
    assert out.references == ["w5 w6 w7 w18 w19", "w8 w20 w21 w22", "w9 w10 w23 w24 w25 w26"]
    assert out.sources == ["w11 w12", "w13", "w14 w15 w16"]
    assert out.hypotheses == out.references and out.exact_match == 1.0
    assert out.bleu() == pytest.approx(100.0)


def test_bleu_is_sacrebleu_of_hypotheses_against_references():
    """Not symmetric (the brevity penalty): swapped arguments give another number."""
    refs = ["the tired engineer drank the cold coffee", "your cat is a great cat"]
    hyps = ["the engineer drank coffee", "your cat is a great cat"]
    out = evaluate.Translations(["s1", "s2"], refs, hyps)
    assert out.bleu() == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
    assert out.bleu() != pytest.approx(sacrebleu.corpus_bleu(refs, [hyps]).score)
    assert out.exact_match == 0.5
    empty = evaluate.Translations([], [], [])  # no examples: 0, not sacrebleu's IndexError
    assert (empty.bleu(), empty.exact_match) == (0.0, 0.0)


@pytest.mark.parametrize("beam_size", [1, 4])
def test_translate_passes_the_decoding_settings_to_the_decoder(monkeypatch, beam_size):
    """The source reaches the encoder, every row starts from decoder_start_id, and max_new_tokens,
    the length penalty alpha and the model's eos / pad ids reach greedy or beam search (the fakes
    above ignore them, so a translate that decoded with beam search's default alpha passed)."""
    batch = _batch()
    calls = []

    def fake_encode(model, params, src, max_length, src_segment_ids):
        calls.append(("encode", np.asarray(src), max_length))
        return "cache"

    def fake_decode(kind):
        def decode(step_fn, params, cache, prompt, lengths, **kwargs):
            calls.append((kind, cache, np.asarray(prompt), np.asarray(lengths), kwargs))
            tokens = np.full((4, kwargs.get("beam_size", 1), 3), EOS_ID, np.int32)
            if kind == "beam":
                return BeamOutput(jnp.asarray(tokens), *(jnp.zeros((4, kwargs["beam_size"])),) * 3)
            return GenerateOutput(jnp.asarray(tokens[:, 0]), jnp.zeros(4, jnp.int32), jnp.zeros((4, 3)))
        return decode

    monkeypatch.setattr(evaluate, "encode_source", fake_encode)
    monkeypatch.setattr(evaluate, "Seq2SeqStep", lambda model: None)
    monkeypatch.setattr(evaluate, "generate", fake_decode("greedy"))
    monkeypatch.setattr(evaluate, "beam_search", fake_decode("beam"))
    config = types.SimpleNamespace(decoder_start_id=3, bos_id=2, eos_id=EOS_ID, pad_id=0)
    model = types.SimpleNamespace(config=config)
    mesh = parallel.create_mesh(1, 1, 1, jax.devices()[:1])
    evaluate.translate(model, None, [batch], WordTokenizer(), mesh, max_new_tokens=7, beam_size=beam_size,
                       alpha=0.9)
    (_, src, max_length), (kind, cache, prompt, lengths, kwargs) = calls
    np.testing.assert_array_equal(src, batch["inputs"])
    assert max_length >= 7 and cache == "cache"
    assert kind == ("beam" if beam_size > 1 else "greedy")
    np.testing.assert_array_equal(prompt, np.full((4, 1), 3))
    np.testing.assert_array_equal(lengths, np.ones(4))
    want = {"max_new_tokens": 7, "max_new_tokens_per_row": None, "eos_id": EOS_ID, "pad_id": 0}
    if beam_size > 1:
        want.update(beam_size=4, alpha=0.9)
    else:
        want.update(donate_cache=True)  # the cache is made for this call alone
    assert kwargs == want

    # extra_len: each row at most its source's length (tokens up to EOS: 3, 2, 4; the padding row 0)
    # + extra_len, within [1, max_new_tokens]
    for extra, limits in [(2, [5, 4, 6, 2]), (4, [7, 6, 7, 4]), (0, [3, 2, 4, 1])]:
        calls.clear()
        evaluate.translate(model, None, [batch], WordTokenizer(), mesh, max_new_tokens=7,
                           beam_size=beam_size, alpha=0.9, extra_len=extra)
        assert calls[1][4]["max_new_tokens"] == 7
        np.testing.assert_array_equal(calls[1][4]["max_new_tokens_per_row"], limits)


@pytest.mark.parametrize("beam_size", [1, 2])
def test_each_batch_is_decoded_at_the_width_of_its_longest_source(monkeypatch, beam_size):
    """The BLEU evaluation reads sources as long as the model takes (cut at the training length,
    half a sentence was scored against the whole reference); each batch is then decoded at the
    width of its longest source, rounded up to a power of two, with the same outputs."""
    import transformer_jax as tj

    assert [evaluate._source_width(n, 64) for n in (1, 8, 9, 33, 64)] == [8, 8, 16, 64, 64]
    assert evaluate._source_width(30, 20) == 20
    cfg = tj.presets.tiny(dropout_rate=0.0, max_len=64)
    model = tj.Transformer(cfg)
    ones = jnp.ones((1, 4), jnp.int32)
    params = model.init(jax.random.key(0), ones, ones)["params"]
    params = jax.tree.map(lambda x: 4.0 * x, params)  # spread out, so outputs vary
    batch = _batch()
    batch = {k: np.pad(v, ((0, 0), (0, 40 - v.shape[1]))) for k, v in batch.items()}  # rows of 40
    widths = []
    encode = evaluate.encode_source
    def recording_encode(model, params, src, *args):
        widths.append(src.shape[1])
        return encode(model, params, src, *args)

    monkeypatch.setattr(evaluate, "encode_source", recording_encode)
    mesh = parallel.create_mesh(1, 1, 1, jax.devices()[:1])
    run = lambda: evaluate.translate(model, params, [batch], WordTokenizer(), mesh,  # noqa: E731
                                     max_new_tokens=6, beam_size=beam_size)
    trimmed = run()
    monkeypatch.setattr(evaluate, "_source_width", lambda longest, width: width)
    whole = run()
    assert widths == [8, 40]  # trimmed (the longest source has 4 tokens), then whole
    assert trimmed.hypotheses == whole.hypotheses and trimmed.sources == whole.sources
    assert len(set(trimmed.hypotheses)) > 1
