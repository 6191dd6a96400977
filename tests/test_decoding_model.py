"""Decoding the real models: cached decoding equals full recomputation (tokens and, in float32,
log-probabilities to 1e-5), ragged batches equal one-by-one, beam search runs on the
encoder-decoder, and repeated calls with the same model do not recompile."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import transformer_jax as tj
from transformer_jax.decoding import beam_search, generate, pad_prompts
from transformer_jax.decoding.model_steps import (
    LMStep,
    RecomputeLMStep,
    Seq2SeqStep,
    encode_source,
    recompute_cache,
)
from transformer_jax.decoding.sampling import _generate_donating, _generate_jit

CONFIG = tj.presets.tiny()
PROMPTS = [[5, 17, 3, 40, 9, 22], [7], [12, 0, 33]]  # token 0 (= pad id) inside a real prompt
STEPS = 7


def _random_params(model, *args, seed=0):
    """Random parameters of the right shapes, drawn in numpy (nothing to compile), larger than
    the initializers' so that outputs vary from token to token."""
    shapes = jax.eval_shape(model.init, jax.random.key(0), *args)["params"]
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            return 1.0 + 0.3 * rng.standard_normal(leaf.shape, np.float32)
        fan_in = leaf.shape[0] if leaf.ndim > 1 else 10.0
        return rng.standard_normal(leaf.shape, np.float32) / np.sqrt(fan_in)

    return jax.tree_util.tree_map_with_path(draw, shapes)


@pytest.fixture(scope="module")
def lm():
    model = tj.TransformerLM(CONFIG)
    return model, _random_params(model, jnp.ones((1, 8), jnp.int32))


@pytest.fixture(scope="module")
def seq2seq():
    model = tj.Transformer(CONFIG.replace(num_encoder_layers=1))
    ones = jnp.ones((1, 8), jnp.int32)
    return model, _random_params(model, ones, ones, seed=2)


def _full_logprobs(model, params, sequences, lengths):
    """log-softmax of one cache-free forward pass over right-padded sequences [B, S]."""
    return np.asarray(_full_logprobs_jit(model, params, jnp.asarray(sequences), jnp.asarray(lengths)))


@functools.partial(jax.jit, static_argnames="model")
def _full_logprobs_jit(model, params, seq, lengths):
    real = (jnp.arange(seq.shape[1]) < lengths[:, None]).astype(jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(seq.shape[1]), seq.shape)
    logits = model.apply({"params": params}, seq, segment_ids=real, positions=positions)
    return jax.nn.log_softmax(logits, axis=-1)


def _check_against_full_forward(logp, prompt_len, generated, step_logprobs, greedy):
    """logp: [S, V] full-forward log-probs of prompt + generated for one row."""
    for t, token in enumerate(generated):
        row = logp[prompt_len - 1 + t]
        if greedy:
            assert token == int(np.argmax(row)), t
        assert step_logprobs[t] == pytest.approx(row[token], abs=1e-5), t


def test_lm_cached_step_logits_equal_full_forward(lm):
    """Prefill of a ragged batch, then three one-token steps: all next-token log-probabilities
    [V] equal those of one cache-free pass over the whole sequence, to 1e-5."""
    model, params = lm
    step = LMStep(model)
    extra = np.array([[31, 32, 33], [40, 0, 41], [50, 51, 52]], np.int32)  # [B, 3] appended tokens

    @jax.jit
    def cached(params, tokens, lengths):
        logits, cache = step(params, tokens, tj.init_cache(CONFIG, 3, 16), lengths)
        assert logits.shape == (3, 1, CONFIG.vocab_size)  # the prefill computes the last position only
        every, _ = model.apply({"params": params}, tokens, cache=tj.init_cache(CONFIG, 3, 16),
                               num_valid=lengths)
        assert every.shape == (3, tokens.shape[1], CONFIG.vocab_size)
        out = [logits[:, 0], jnp.take_along_axis(every, (lengths - 1)[:, None, None], axis=1)[:, 0]]
        for i in range(extra.shape[1]):
            logits, cache = step(params, jnp.asarray(extra[:, i : i + 1]), cache, jnp.ones(3, jnp.int32))
            out.append(logits[:, 0])
        return jax.nn.log_softmax(jnp.stack(out, axis=1), axis=-1)  # [B, 5, V]

    tokens, lengths = pad_prompts(PROMPTS)
    got = np.asarray(cached(params, tokens, lengths))
    np.testing.assert_allclose(got[:, 0], got[:, 1], atol=1e-6)  # last_only = every position's last
    got = np.delete(got, 1, axis=1)
    with pytest.raises(ValueError, match="last_only=True needs a cache"):
        model.apply({"params": params}, tokens, last_only=True)
    seqs = [p + extra[row].tolist() for row, p in enumerate(PROMPTS)]
    full = _full_logprobs(model, params, pad_prompts(seqs, min_length=16)[0], [len(s) for s in seqs])
    for row, prompt in enumerate(PROMPTS):
        want = full[row, len(prompt) - 1 : len(prompt) + extra.shape[1]]
        np.testing.assert_allclose(got[row], want, atol=1e-5)


def test_lm_decoding_equals_full_recomputation(lm):
    model, params = lm
    tokens, lengths = pad_prompts(PROMPTS)
    width = tokens.shape[1] + STEPS
    runs = {
        "greedy": generate(
            LMStep(model),
            params,
            tj.init_cache(CONFIG, 3, width),
            tokens,
            lengths,
            max_new_tokens=STEPS,
            eos_id=None,
        ),
        "sampled": generate(
            LMStep(model),
            params,
            tj.init_cache(CONFIG, 3, width),
            tokens,
            lengths,
            max_new_tokens=STEPS,
            eos_id=None,
            temperature=1.0,
            rng=jax.random.key(4),
        ),
    }
    recomputed = generate(
        RecomputeLMStep(model),
        params,
        recompute_cache(3, width),
        tokens,
        lengths,
        max_new_tokens=STEPS,
        eos_id=None,
    )
    np.testing.assert_array_equal(recomputed.tokens, runs["greedy"].tokens)
    np.testing.assert_allclose(recomputed.logprobs, runs["greedy"].logprobs, atol=1e-5)
    assert len(set(np.asarray(runs["sampled"].tokens).ravel().tolist())) > 5
    for name, out in runs.items():
        seqs = [p + np.asarray(out.tokens[row]).tolist() for row, p in enumerate(PROMPTS)]
        full = _full_logprobs(model, params, pad_prompts(seqs, min_length=16)[0], [len(s) for s in seqs])
        for row, prompt in enumerate(PROMPTS):
            _check_against_full_forward(
                full[row],
                len(prompt),
                seqs[row][len(prompt) :],
                np.asarray(out.logprobs[row]),
                name == "greedy",
            )
    # Ragged batch == one by one (the one-token prompt, padded most in the batch).
    alone = generate(
        LMStep(model),
        params,
        tj.init_cache(CONFIG, 1, 1 + STEPS),
        jnp.asarray([PROMPTS[1]]),
        jnp.asarray([1]),
        max_new_tokens=STEPS,
        eos_id=None,
    )
    np.testing.assert_array_equal(alone.tokens[0], runs["greedy"].tokens[1])
    np.testing.assert_allclose(alone.logprobs[0], runs["greedy"].logprobs[1], atol=1e-5)
    # A fresh module with the same config and new parameter values reuses the compilation.
    size = _generate_jit._cache_size()
    generate(
        LMStep(tj.TransformerLM(CONFIG)),
        jax.tree.map(lambda x: -x, params),
        tj.init_cache(CONFIG, 3, width),
        tokens,
        lengths,
        max_new_tokens=STEPS,
        eos_id=None,
    )
    assert _generate_jit._cache_size() == size


def test_a_donated_cache_decodes_in_place_with_the_same_tokens(lm, seq2seq):
    model, params = lm
    tokens, lengths = pad_prompts(PROMPTS)
    width = tokens.shape[1] + STEPS
    for eos_id in (None, 22):  # the scan and the while loop
        for sample in ({}, {"temperature": 1.0, "rng": jax.random.key(4)}):
            cache = tj.init_cache(CONFIG, 3, width)
            kept = generate(LMStep(model), params, cache, tokens, lengths, max_new_tokens=STEPS,
                            eos_id=eos_id, **sample)
            assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(cache))  # usable again
            donated = generate(LMStep(model), params, cache, tokens, lengths, max_new_tokens=STEPS,
                               eos_id=eos_id, donate_cache=True, **sample)
            assert all(leaf.is_deleted() for leaf in jax.tree.leaves(cache))
            for got, want in zip(donated, kept, strict=True):
                np.testing.assert_array_equal(got, want)
    s2s, s2s_params = seq2seq
    start, ones = jnp.full((3, 1), CONFIG.decoder_start_id, jnp.int32), jnp.ones(3, jnp.int32)
    encode = lambda: encode_source(s2s, s2s_params, jnp.asarray(SOURCES), STEPS + 1)  # noqa: E731
    kept, donated = (generate(Seq2SeqStep(s2s), s2s_params, encode(), start, ones, max_new_tokens=STEPS,
                              donate_cache=donate) for donate in (False, True))
    for got, want in zip(donated, kept, strict=True):
        np.testing.assert_array_equal(got, want)

    # Memory, from the compiled programs: without donation the loop decodes in a copy of the cache
    # (XLA may not write into an argument); donated, the cache's own buffers are the loop's.
    cache = jax.eval_shape(lambda: tj.init_cache(CONFIG, 8, 512))
    cache_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(cache))
    args = (LMStep(model), params, cache, jax.ShapeDtypeStruct((8, 16), jnp.int32),
            jax.ShapeDtypeStruct((8,), jnp.int32), jax.random.key(0), jnp.float32(1), jnp.float32(1),
            jnp.int32(0), None)
    static = dict(max_new_tokens=32, greedy=True, top_k=0, use_top_p=False, eos_id=1, pad_id=0)
    copying = _generate_jit.lower(*args, **static).compile().memory_analysis()
    in_place = _generate_donating.lower(*args, **static).compile().memory_analysis()
    assert copying.temp_size_in_bytes >= cache_bytes
    assert in_place.temp_size_in_bytes < cache_bytes / 8
    assert in_place.alias_size_in_bytes == cache_bytes


SOURCES = [[9, 4, 27, 1], [30, 11, 1, 0], [5, 1, 0, 0]]  # right-padded, ending with EOS


def test_seq2seq_greedy_and_beam_search_match_the_full_model(seq2seq):
    model, params = seq2seq
    src = jnp.asarray(SOURCES)
    start = jnp.full((3, 1), CONFIG.decoder_start_id, jnp.int32)
    cache = encode_source(model, params, src, STEPS + 1)
    out = generate(
        Seq2SeqStep(model), params, cache, start, jnp.ones(3, jnp.int32), max_new_tokens=STEPS, eos_id=None
    )
    beams = beam_search(
        Seq2SeqStep(model),
        params,
        cache,
        start,
        jnp.ones(3, jnp.int32),
        max_new_tokens=STEPS,
        beam_size=2,
        alpha=0.6,
    )
    assert beams.tokens.shape == (3, 2, STEPS)
    assert np.all(np.asarray(beams.scores[:, 0] >= beams.scores[:, 1]))

    @jax.jit
    def full_logprobs(targets):  # teacher-forced, no cache: [B, STEPS, V]
        tgt_in = jnp.concatenate([start, targets[:, :-1]], axis=1)
        ones = jnp.ones(tgt_in.shape, jnp.int32)
        logits = model.apply(
            {"params": params}, src, tgt_in, tgt_segment_ids=ones, tgt_positions=jnp.cumsum(ones, axis=1) - 1
        )
        return jax.nn.log_softmax(logits, axis=-1)

    full = np.asarray(full_logprobs(out.tokens))
    for row in range(3):
        _check_against_full_forward(
            full[row], 1, np.asarray(out.tokens[row]).tolist(), np.asarray(out.logprobs[row]), greedy=True
        )
    for k in range(2):
        full = np.asarray(full_logprobs(beams.tokens[:, k]))
        for row in range(3):
            length = int(beams.lengths[row, k])
            hyp = np.asarray(beams.tokens[row, k, :length])
            total = full[row, np.arange(length), hyp].sum()
            assert float(beams.logprobs[row, k]) == pytest.approx(total, abs=1e-4)
    assert np.all(np.asarray(beams.logprobs[:, 0]) >= np.asarray(out.logprobs.sum(1)) - 1e-4)


def test_source_segment_ids_mark_padding_that_is_not_the_pad_id(seq2seq):
    """`encode_source` with segment ids: the tokens marked 0 are padding whatever their ids (here
    not the pad id), for the encoder and for the decoder's cross-attention. Cached decoding then
    equals the full model run on each source cut to its real tokens."""
    model, params = seq2seq
    real = [[9, 4, 27, 1], [30, 11, 1]]
    src = jnp.asarray([[9, 4, 27, 1, 5, 6], [30, 11, 1, 7, 8, 9]])
    segment_ids = jnp.asarray([[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]])
    tgt = jnp.asarray([[CONFIG.decoder_start_id, 5, 17, 3]] * 2)
    cache = encode_source(model, params, src, 4, src_segment_ids=segment_ids)
    np.testing.assert_array_equal(cache.source_mask, segment_ids != 0)
    apply = jax.jit(model.apply)
    logits, _ = apply({"params": params}, None, tgt, cache=cache)
    for row, tokens in enumerate(real):
        want = apply({"params": params}, jnp.asarray([tokens]), tgt[row : row + 1])
        np.testing.assert_allclose(logits[row], want[0], atol=1e-5)


def test_beam_reordering_leaves_the_source_cross_attention_alone(seq2seq, monkeypatch):
    """`KVCache.reorder_beams` gathers the self-attention cache only: every beam of a row holds the
    same source K/V. Same hypotheses as gathering every leaf, and no gather of source-shaped
    arrays in the compiled loop."""
    from transformer_jax.decoding.beam_search import _beam_search_jit
    from transformer_jax.modeling.cache import KVCache

    model, params = seq2seq
    src = jnp.asarray(SOURCES)
    start = jnp.full((3, 1), CONFIG.decoder_start_id, jnp.int32)
    cache = encode_source(model, params, src, STEPS + 1)
    args = (Seq2SeqStep(model), params, cache, start, jnp.ones(3, jnp.int32), jnp.float32(0.6),
            jnp.int32(0), jnp.full((3,), STEPS, jnp.int32))
    static = dict(beam_size=2, max_new_tokens=STEPS, eos_id=1, pad_id=0)

    reordered = KVCache(layers=cache.layers, lengths=jnp.arange(3), cross=cache.cross,
                        source_mask=cache.source_mask).reorder_beams(jnp.array([2, 2, 0]))
    assert reordered.cross is cache.cross and reordered.source_mask is cache.source_mask
    np.testing.assert_array_equal(reordered.lengths, [2, 2, 0])

    cross_shape = f"f32[6,{CONFIG.kv_heads},{src.shape[1]},{CONFIG.qk_dim}]"  # [B*K, N, S, K]
    gathers = lambda hlo: [line for line in hlo.splitlines()
                           if line.lstrip().startswith("%") and f"= {cross_shape}" in line
                           and "gather" in line]
    ours = _beam_search_jit(*args, **static)
    assert not gathers(_beam_search_jit.lower(*args, **static).compile().as_text())

    monkeypatch.delattr(KVCache, "reorder_beams")
    jax.clear_caches()
    every_leaf = _beam_search_jit(*args, **static)
    assert gathers(_beam_search_jit.lower(*args, **static).compile().as_text())  # what is avoided
    np.testing.assert_array_equal(ours.tokens, every_leaf.tokens)
    np.testing.assert_allclose(ours.scores, every_leaf.scores, atol=1e-6)


def test_decoding_stops_at_the_models_own_eos_by_default(lm, seq2seq):
    """eos_id / pad_id default to the model config's (a GPT-2 import's eos is 50256, Marian's 0);
    they were fixed at 1 / 0, cutting GPT-2 rows at token 1 and never stopping Marian."""
    from transformer_jax.decoding.sampling import resolve_special_ids
    from transformer_jax.generate import BanTokensStep

    model, params = lm
    prompt, lengths = pad_prompts(PROMPTS)
    cache = lambda cfg: tj.init_cache(cfg, len(PROMPTS), prompt.shape[1] + STEPS)
    free = generate(LMStep(model), params, cache(CONFIG), prompt, lengths, max_new_tokens=STEPS,
                    eos_id=None)
    first = int(free.tokens[0, 0])
    pad = (first + 1) % CONFIG.vocab_size
    own = CONFIG.replace(eos_id=first, pad_id=pad)  # ids only: the same weights apply
    out = generate(LMStep(tj.TransformerLM(own)), params, cache(own), prompt, lengths, max_new_tokens=STEPS)
    assert int(out.lengths[0]) == 1 and out.tokens[0, 1:].tolist() == [pad] * (STEPS - 1)
    beams = beam_search(LMStep(tj.TransformerLM(own)), params, cache(own), prompt, lengths,
                        max_new_tokens=STEPS, beam_size=2)
    explicit = beam_search(LMStep(tj.TransformerLM(own)), params, cache(own), prompt, lengths,
                           max_new_tokens=STEPS, beam_size=2, eos_id=first, pad_id=pad)
    np.testing.assert_array_equal(beams.tokens, explicit.tokens)
    # through wrappers too; a step function with no model keeps 1 / 0; a model without pad_id pads
    # with the EOS it stops at (as Hugging Face does), and with 0 only when it has no EOS either
    gpt2_like = tj.TransformerLM(CONFIG.replace(eos_id=50, pad_id=None))
    assert resolve_special_ids(BanTokensStep(LMStep(gpt2_like), (3,)), "model", "model") == (50, 50)
    assert resolve_special_ids(LMStep(gpt2_like), 7, "model") == (7, 7)
    assert resolve_special_ids(LMStep(gpt2_like), None, "model") == (None, 0)
    assert resolve_special_ids(LMStep(gpt2_like), "model", 3) == (50, 3)
    gpt2_like = tj.TransformerLM(CONFIG.replace(eos_id=first, pad_id=None))
    out = generate(LMStep(gpt2_like), params, cache(CONFIG), prompt, lengths, max_new_tokens=STEPS)
    assert int(out.lengths[0]) == 1 and out.tokens[0].tolist() == [first] * STEPS
    assert resolve_special_ids(Seq2SeqStep(seq2seq[0]), "model", "model") == (CONFIG.eos_id, CONFIG.pad_id)
    assert resolve_special_ids(lambda *a: a, "model", "model") == (1, 0)
    with pytest.raises(ValueError, match="eos_id must be an integer, None or 'model'"):
        resolve_special_ids(lambda *a: a, "eos", 0)


def test_one_key_per_row_samples_each_row_independently_of_its_batch(lm):
    """With one key per row a row's sampled tokens depend on its own key only: the same as the row
    decoded alone (with that key, or a batch of one key), and the same in another batch. With one
    key for the batch, a row's tokens change with the rows batched with it."""
    model, params = lm
    keys = jax.random.split(jax.random.key(7), len(PROMPTS))
    settings = dict(max_new_tokens=STEPS, eos_id=None, temperature=1.3, top_p=0.95)

    def sample(rows, rng):
        tokens, lengths = pad_prompts([PROMPTS[r] for r in rows])
        cache = tj.init_cache(CONFIG, len(rows), tokens.shape[1] + STEPS)
        return generate(LMStep(model), params, cache, tokens, lengths, rng=rng, **settings)

    batch = sample([0, 1, 2], keys)
    others = sample([2, 0], keys[jnp.array([2, 0])])
    raw = sample([0, 1, 2], jax.random.key_data(keys))  # raw uint32 keys [B, 2]: the same keys
    np.testing.assert_array_equal(raw.tokens, batch.tokens)
    for row in range(len(PROMPTS)):
        for rng in (keys[row], keys[row : row + 1]):
            alone = sample([row], rng)
            np.testing.assert_array_equal(alone.tokens[0], batch.tokens[row])
            np.testing.assert_allclose(alone.logprobs[0], batch.logprobs[row], atol=1e-5)
    np.testing.assert_array_equal(others.tokens, batch.tokens[jnp.array([2, 0])])
    assert len({tuple(np.asarray(t).tolist()) for t in batch.tokens}) == len(PROMPTS)
    # One key for the whole batch: the noise a row draws depends on its place in the batch, so
    # prompt 1 alone and second in a batch of three sample different tokens.
    shared = jax.random.key(7)
    assert not np.array_equal(sample([1], shared).tokens[0], sample([0, 1, 2], shared).tokens[1])


def test_settings_may_be_traced_inside_a_jit_of_your_own(lm):
    """temperature, top_p, min_new_tokens, beam search's alpha and the per-row limits as arguments
    of a user's jit give what the same Python numbers give (a traced temperature of 0 is still
    argmax)."""
    model, params = lm
    prompt, lengths = pad_prompts(PROMPTS)
    cache = lambda: tj.init_cache(CONFIG, len(PROMPTS), prompt.shape[1] + STEPS)
    common = dict(max_new_tokens=STEPS)

    @jax.jit
    def sample(params, rng, temperature, top_p, least):
        return generate(LMStep(model), params, cache(), prompt, lengths, rng=rng, temperature=temperature,
                        top_p=top_p, min_new_tokens=least, **common).tokens

    @jax.jit
    def search(params, alpha, least):
        return beam_search(LMStep(model), params, cache(), prompt, lengths, beam_size=2, alpha=alpha,
                           min_new_tokens=least, **common).tokens

    key = jax.random.key(3)
    for temperature, top_p, least in ((0.0, 1.0, 0), (0.8, 0.9, 2), (1.3, 1.0, 0)):
        want = generate(LMStep(model), params, cache(), prompt, lengths, rng=key, temperature=temperature,
                        top_p=top_p, min_new_tokens=least, **common).tokens
        np.testing.assert_array_equal(sample(params, key, temperature, top_p, least), want)
    want = beam_search(LMStep(model), params, cache(), prompt, lengths, beam_size=2, alpha=0.6,
                       min_new_tokens=3, **common).tokens
    np.testing.assert_array_equal(search(params, 0.6, 3), want)

    limits = np.array([2, STEPS, 4], np.int32)  # one per prompt
    for decode in (generate, functools.partial(beam_search, beam_size=2)):
        limited = jax.jit(lambda p, rows, decode=decode: decode(
            LMStep(model), p, cache(), prompt, lengths, max_new_tokens_per_row=rows, **common).tokens)
        want = decode(LMStep(model), params, cache(), prompt, lengths, max_new_tokens_per_row=limits,
                      **common).tokens
        np.testing.assert_array_equal(limited(params, jnp.asarray(limits)), want)
        assert (np.asarray(want)[0, ..., 2:] == 0).all()  # (row 0 stops after 2 tokens: the limit acts)


def test_a_cache_too_small_or_for_another_batch_is_refused_before_it_corrupts_tokens(lm):
    """The cache write clamps its start index: a cache one slot short would overwrite its last
    slot and decode wrong tokens with no error. The decoders check the size (a prompt of 6 and
    7 new tokens need 6 + 7 - 1 = 12 slots: the last token is never fed back) and the batch."""
    model, params = lm
    tokens, lengths = jnp.asarray([PROMPTS[0]]), jnp.asarray([6])
    fits = generate(LMStep(model), params, tj.init_cache(CONFIG, 1, 12), tokens, lengths,
                    max_new_tokens=STEPS, eos_id=None)
    roomy = generate(LMStep(model), params, tj.init_cache(CONFIG, 1, 20), tokens, lengths,
                     max_new_tokens=STEPS, eos_id=None)
    np.testing.assert_array_equal(fits.tokens, roomy.tokens)
    for decode in (generate, functools.partial(beam_search, beam_size=2)):
        with pytest.raises(ValueError, match=r"KV cache holds 11 positions .* need 12"):
            decode(LMStep(model), params, tj.init_cache(CONFIG, 1, 11), tokens, lengths,
                   max_new_tokens=STEPS, eos_id=None)
        with pytest.raises(ValueError, match="built for batch size 2, the prompts have 1 rows"):
            decode(LMStep(model), params, tj.init_cache(CONFIG, 2, 20), tokens, lengths,
                   max_new_tokens=STEPS, eos_id=None)
        # The prefill writes the whole padded prompt: its width counts even when longer.
        with pytest.raises(ValueError, match=r"padded to 8\) and max_new_tokens=3 need 8: .* >= 8"):
            decode(LMStep(model), params, tj.init_cache(CONFIG, 1, 7), *pad_prompts([[5, 6]]),
                   max_new_tokens=3, eos_id=None)
    with pytest.raises(ValueError, match="6 tokens do not fit in a KV cache of 4 positions"):
        model.apply({"params": params}, tokens, cache=tj.init_cache(CONFIG, 1, 4))


def test_ids_outside_the_vocabulary_are_refused_before_decoding(lm):
    """Inside the decoding program an id past the embedding table looks up NaN (greedy then picked
    the last token at every step) and a negative one counts from the table's end; an EOS id past
    the vocabulary would never be emitted, a negative one masked the last token instead. The
    padding after a row's length is not looked at."""
    model, params = lm
    V = CONFIG.vocab_size
    prompt, lengths = jnp.array([[4, V + 5, 6], [3, 0, 0]]), jnp.array([3, 1])

    def run(search, **kwargs):
        args = dict(dict(prompt_tokens=prompt, prompt_lengths=lengths, max_new_tokens=3), **kwargs)
        cache = tj.init_cache(CONFIG, 2, 8)
        if search is beam_search:
            return search(LMStep(model), params, cache, beam_size=2, **args)
        return search(LMStep(model), params, cache, **args)

    for search in (generate, beam_search):
        with pytest.raises(ValueError, match=rf"prompt_tokens holds token id {V + 5} at row 0, position 1, "
                                             rf"outside the model's vocabulary \[0, {V}\)"):
            run(search)
        with pytest.raises(ValueError, match=rf"eos_id={V} is not a token id of the model: it must lie "
                                             rf"in \[0, vocab_size={V}\)"):
            run(search, prompt_tokens=prompt.at[0, 1].set(5), eos_id=V)
        with pytest.raises(ValueError, match=r"pad_id=-1 is not a token id"):
            run(search, prompt_tokens=prompt.at[0, 1].set(5), pad_id=-1)
    with pytest.raises(ValueError, match="token id -3 at row 1, position 0"):
        run(generate, prompt_tokens=jnp.array([[4, 5, 6], [-3, 0, 0]]))
    # Out-of-range ids in the padding after a row's length are never read: accepted.
    out = run(generate, prompt_tokens=jnp.array([[4, 5, 6], [3, V + 9, -1]]))
    assert np.isfinite(np.asarray(out.logprobs)).all()


def test_padding_past_the_vocabulary_does_not_reach_the_real_tokens(lm):
    """The padding after a row's length is not read, but the prefill looked it up: an id past the
    table (a tokenizer's pad id at vocab_size) gave NaN keys and values in masked cache slots, and
    XLA's attention (GPUs, TPUs, meshes, CPUs without the package's kernels) multiplied them by
    probability 0: NaN log-probabilities and other tokens in every row, beam scores of -2e30."""
    _, params = lm
    V = CONFIG.vocab_size
    model = tj.TransformerLM(CONFIG.replace(cpu_kernels="xla"))
    lengths = jnp.array([3, 5])
    clean = jnp.array([[4, 5, 6, 0, 0], [7, 8, 9, 10, 11]])
    for search, kwargs in ((generate, {}), (beam_search, {"beam_size": 2})):
        outs = [search(LMStep(model), params, tj.init_cache(CONFIG, 2, 11), prompt, lengths, max_new_tokens=6,
                       eos_id=None, **kwargs)
                for prompt in (clean, clean.at[0, 3:].set(V + 951))]
        assert np.isfinite(np.asarray(outs[1].tokens if search is generate else outs[1].scores)).all()
        np.testing.assert_array_equal(outs[0].tokens, outs[1].tokens)
        scores = [o.logprobs if search is generate else o.scores for o in outs]
        np.testing.assert_allclose(scores[0], scores[1], rtol=0, atol=0)
        assert np.isfinite(np.asarray(scores[1])).all()


def test_a_token_buffer_too_small_for_recomputation_is_refused(lm):
    """`RecomputeLMStep` drops writes past its buffer and reads the logits from its last slot:
    a buffer too small decoded wrong log-probabilities without a word, where a KV cache of the same
    size is refused."""
    model, params = lm
    prompt, lengths = jnp.array([[4, 5, 6]]), jnp.array([3])
    with pytest.raises(ValueError, match=r"the token buffer holds 5 positions per row, but a prompt of 3 "
                                         r"tokens \(padded to 3\) and max_new_tokens=8 need 10"):
        generate(RecomputeLMStep(model), params, recompute_cache(1, 5), prompt, lengths, max_new_tokens=8)
    out = generate(RecomputeLMStep(model), params, recompute_cache(1, 10), prompt, lengths, max_new_tokens=8)
    assert out.tokens.shape == (1, 8)


def test_learned_positions_past_max_len_are_refused_not_nan():
    """A learned position table looked up past its end gives NaN logits (and a junk token from
    them): decoding that would reach position max_len is refused, naming the field."""
    config = CONFIG.replace(position="learned", max_len=12)
    model = tj.TransformerLM(config)
    params = _random_params(model, jnp.ones((1, 8), jnp.int32))
    tokens, lengths = jnp.asarray([[9, 13, 60, 9, 9, 2, 7, 5]]), jnp.asarray([8])
    ok = generate(LMStep(model), params, tj.init_cache(config, 1, 16), tokens, lengths,
                  max_new_tokens=5, eos_id=None)  # positions 0..11
    assert np.isfinite(np.asarray(ok.logprobs)).all()
    with pytest.raises(ValueError, match=r"reach position 12, .* \(ModelConfig.max_len\)"):
        generate(LMStep(model), params, tj.init_cache(config, 1, 16), tokens, lengths,
                 max_new_tokens=6, eos_id=None)
    # Next to a short prompt that may generate more, the long one stops at its own limit: only
    # the positions it reaches before that must exist (the later steps of its row are padding).
    both = jnp.asarray([[9, 13, 60, 9, 9, 2, 7, 5], [9, 13, 0, 0, 0, 0, 0, 0]])
    out = generate(LMStep(model), params, tj.init_cache(config, 2, 16), both, jnp.asarray([8, 2]),
                   max_new_tokens=8, max_new_tokens_per_row=[4, 8], eos_id=None)
    np.testing.assert_array_equal(out.tokens[0, :4], ok.tokens[0, :4])
    assert np.isfinite(np.asarray(out.logprobs)).all() and out.lengths.tolist() == [4, 8]
    # A row limit that reaches the table's last row exactly (8 + 5 - 1 = 12 positions) is allowed.
    exact = generate(LMStep(model), params, tj.init_cache(config, 2, 16), both, jnp.asarray([8, 2]),
                     max_new_tokens=8, max_new_tokens_per_row=[5, 8], eos_id=None)
    np.testing.assert_array_equal(exact.tokens[0, :5], ok.tokens[0])
    with pytest.raises(ValueError, match=r"reach position 12, "):
        generate(LMStep(model), params, tj.init_cache(config, 2, 16), both, jnp.asarray([8, 2]),
                 max_new_tokens=8, max_new_tokens_per_row=[6, 8], eos_id=None)
    # a source longer than the encoder's table, with or without segment ids (which skipped the check
    # and gave NaN cross-attention keys); and the helpers that initialise a model fit a short table
    seq2seq = tj.Transformer(config.replace(num_encoder_layers=1, max_len=8))
    src = jnp.ones((1, 12), jnp.int32)
    p = _random_params(seq2seq, src[:, :8], src[:, :8])
    for segments in (None, jnp.ones_like(src)):
        with pytest.raises(ValueError, match=r"12 tokens exceed the learned position table's 8 rows"):
            encode_source(seq2seq, p, src, max_length=8, src_segment_ids=segments)
    short = config.replace(max_len=4)
    assert tj.count_params(short) == tj.count_params(config) - 2 * 8 * config.d_model  # two tables


def test_recomputation_over_a_buffer_longer_than_learned_positions_equals_the_cache():
    """`RecomputeLMStep` runs the model over its whole token buffer. Its unfilled slots took
    positions up to the buffer's width: past a learned table's max_len they looked up NaN, which
    reached the real rows through the attention products (NaN log-probabilities, token 60 every
    step). They are masked out, so any position does; they now take 0."""
    config = CONFIG.replace(position="learned", max_len=16)
    model = tj.TransformerLM(config)
    params = _random_params(model, jnp.ones((1, 8), jnp.int32))
    tokens, lengths = jnp.asarray([[9, 13, 60]]), jnp.asarray([3])
    cached = generate(LMStep(model), params, tj.init_cache(config, 1, 8), tokens, lengths,
                      max_new_tokens=4, eos_id=None)
    for width in (12, 32):
        out = generate(RecomputeLMStep(model), params, recompute_cache(1, width), tokens, lengths,
                       max_new_tokens=4, eos_id=None)
        np.testing.assert_array_equal(out.tokens, cached.tokens)
        np.testing.assert_allclose(out.logprobs, cached.logprobs, atol=1e-5)


def test_model_level_misuse_is_refused_or_nan_not_silently_wrong(lm, seq2seq):
    """Called directly with a cache (no decoder checking sizes): a row whose tokens overflow the
    cache gets NaN logits (its write was clamped onto earlier slots); a cached call refuses
    positions or segment ids it would ignore; a learned table refuses rows longer than itself."""
    model, params = lm
    cache = tj.init_cache(CONFIG, 1, 4)
    logits, cache = model.apply({"params": params}, jnp.asarray([[3, 4, 5]]), cache=cache)
    assert np.isfinite(np.asarray(logits)).all()
    logits, _ = model.apply({"params": params}, jnp.asarray([[6, 7]]), cache=cache)  # 5 > 4 slots
    assert np.isnan(np.asarray(logits)).all()
    with pytest.raises(ValueError, match="positions follow cache.lengths"):
        model.apply({"params": params}, jnp.asarray([[6]]), cache=cache, positions=jnp.asarray([[3]]))
    learned = tj.TransformerLM(CONFIG.replace(position="learned", max_len=8))
    with pytest.raises(ValueError, match=r"9 tokens exceed the learned position table's 8 rows"):
        learned.init(jax.random.key(0), jnp.ones((1, 9), jnp.int32))
    # init_cache with segment ids marking the source (0 = padding): as with pad ids.
    s2s, s2s_params = seq2seq
    src = jnp.asarray(SOURCES)
    by_pad = s2s.apply({"params": s2s_params}, src, 8, method="init_cache")
    by_segment = s2s.apply({"params": s2s_params}, src, 8, src_segment_ids=(src != 0).astype(jnp.int32),
                           method="init_cache")
    np.testing.assert_array_equal(by_pad.source_mask, by_segment.source_mask)
    real = np.asarray(by_pad.source_mask)[:, None, :, None]
    for a, b in zip(jax.tree.leaves(by_pad.cross), jax.tree.leaves(by_segment.cross), strict=True):
        np.testing.assert_allclose(np.where(real, a, 0), np.where(real, b, 0), atol=1e-5)


def test_step_function_of_the_other_model_kind_is_an_error_naming_the_right_one():
    """LMStep(Transformer) failed inside generate's jit with `__call__() missing 'tgt'`."""
    seq2seq, lm = tj.Transformer(CONFIG), tj.TransformerLM(CONFIG.replace(num_encoder_layers=0))
    with pytest.raises(TypeError, match=r"for a Transformer use tj\.Seq2SeqStep\(model\)"):
        tj.LMStep(seq2seq)
    with pytest.raises(TypeError, match=r"for a TransformerLM use tj\.LMStep\(model\)"):
        tj.Seq2SeqStep(lm)
    with pytest.raises(TypeError, match=r"RecomputeLMStep drives a TransformerLM; for a Transformer"):
        RecomputeLMStep(seq2seq)
    assert tj.LMStep(lm) == tj.LMStep(lm) and tj.Seq2SeqStep(seq2seq).model is seq2seq
    # encode_source(TransformerLM): Flax's "no attribute 'init_cache'" named no mistake
    tokens = jnp.array([[5, 6, 7]])
    lm_params = lm.init(jax.random.key(0), tokens)["params"]
    with pytest.raises(TypeError, match=r"encode_source encodes the source of an encoder-decoder "
                                        r"tj\.Transformer; a TransformerLM has no source.*tj\.LMStep"):
        tj.encode_source(lm, lm_params, tokens, 8)


def test_cache_arguments_without_a_cache_are_errors_naming_them():
    """Without a cache, an encoder-decoder's last_only=True asked for `memory`, which its callers
    cannot pass; and num_valid was checked, then ignored (the logits were the same whatever it held)."""
    seq2seq, lm = tj.Transformer(CONFIG), tj.TransformerLM(CONFIG.replace(num_encoder_layers=0))
    src, tokens = jnp.array([[5, 6, 1], [7, 1, 0]]), jnp.array([[5, 6, 7], [8, 0, 0]])
    p_seq = seq2seq.init(jax.random.key(0), src, tokens)["params"]
    p_lm = lm.init(jax.random.key(0), tokens)["params"]
    for call in (lambda **kw: seq2seq.apply({"params": p_seq}, src, tokens, **kw),
                 lambda **kw: lm.apply({"params": p_lm}, tokens, **kw)):
        with pytest.raises(ValueError, match=r"^last_only=True needs a cache"):
            call(last_only=True)
        with pytest.raises(ValueError, match=r"^num_valid needs a cache \(it counts the tokens appended"):
            call(num_valid=jnp.array([3, 1]))
        with pytest.raises(ValueError, match=r"num_valid holds 4"):  # its own checks come first
            call(num_valid=jnp.array([4, 1]))
