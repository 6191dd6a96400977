"""The sampler and beam search against fake step functions (no model needed).

Two fakes:
- ``bigram_step``: next-token logits depend only on the current token (``params`` is a [V, V]
  table), so expected outputs can be worked out by hand.
- ``history_step``: a cache-dependent fake LM. Its cache holds every token written so far and the
  per-row lengths; the logits at each position hash (previous token read from the cache, token,
  absolute position) into a row of ``params``. Getting ragged prefill, positions or beam
  reordering of the cache wrong changes its outputs.
"""

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import decoding
from transformer_jax.decoding import beam_search, generate, length_penalty
from transformer_jax.decoding.beam_search import _beam_search_jit
from transformer_jax.decoding.sampling import _generate_jit

V = 11  # a prime vocabulary size, distinct from every other dimension below
EOS, PAD = 1, 0


def bigram_step(params, tokens, cache, num_valid):
    return params[tokens], {"lengths": cache["lengths"] + num_valid}


def bigram_cache(batch):
    return {"lengths": jnp.zeros((batch,), jnp.int32)}


def history_step(params, tokens, cache, num_valid):
    batch, length = tokens.shape
    rows = jnp.arange(batch)[:, None]
    pos = cache["lengths"][:, None] + jnp.arange(length)  # [B, L] absolute positions
    # Like a real KV cache, padding is written too and overwritten by the next call.
    buffer = cache["tokens"].at[rows, pos].set(tokens, mode="drop")
    prev = jnp.where(pos > 0, buffer[rows, jnp.maximum(pos - 1, 0)], 0)
    index = (prev * 31 + tokens * 7 + pos * 3) % params.shape[0]
    return params[index], {"tokens": buffer, "lengths": cache["lengths"] + num_valid}


def history_cache(batch, size=32):
    return {"tokens": jnp.zeros((batch, size), jnp.int32), "lengths": jnp.zeros((batch,), jnp.int32)}


def history_params(seed=0, rows=97, scale=3.0):
    return scale * jax.random.normal(jax.random.key(seed), (rows, V), jnp.float32)


def rescore(params, prompt, generated):
    """log P(generated | prompt) under history_step, recomputed in numpy token by token."""
    table, seq = np.asarray(params, np.float64), list(prompt) + list(generated)
    total = 0.0
    for pos in range(len(prompt) - 1, len(seq) - 1):
        prev = seq[pos - 1] if pos > 0 else 0
        row = table[(prev * 31 + seq[pos] * 7 + pos * 3) % table.shape[0]]
        total += row[seq[pos + 1]] - np.log(np.sum(np.exp(row - row.max()))) - row.max()
    return total


def shift_table(scale=10.0):
    """Token t is followed by t + 1 (mod V) with near certainty."""
    return scale * jax.nn.one_hot((jnp.arange(V) + 1) % V, V)


def trim(tokens, length):
    return [int(t) for t in tokens[: int(length)]]


# ----------------------------------------------------------------------------- sampling


def test_next_token_is_token_plus_one_until_eos():
    prompts = jnp.array([[3, 0, 0], [5, 6, 7], [8, 0, 0]], jnp.int32)
    out = generate(
        bigram_step,
        shift_table(),
        bigram_cache(3),
        prompts,
        jnp.array([1, 3, 1]),
        max_new_tokens=8,
        eos_id=EOS,
        pad_id=PAD,
    )
    # Row 0 never reaches EOS (token 1) within 8 tokens; rows 1 and 2 stop there, then pad.
    np.testing.assert_array_equal(
        out.tokens,
        [[4, 5, 6, 7, 8, 9, 10, 0], [8, 9, 10, 0, EOS, PAD, PAD, PAD], [9, 10, 0, EOS, PAD, PAD, PAD, PAD]],
    )
    np.testing.assert_array_equal(out.lengths, [8, 5, 4])
    assert out.tokens.dtype == jnp.int32 and out.logprobs.shape == (3, 8)
    assert np.all(np.asarray(out.logprobs[1, 5:]) == 0.0)
    assert np.all(np.asarray(out.logprobs[1, :5]) < 0.0)


def test_min_new_tokens_masks_eos():
    # EOS is by far the likeliest token everywhere; the runner-up is token 5.
    table = jnp.zeros((V, V)).at[:, EOS].set(8.0).at[:, 5].set(4.0)
    out = generate(
        bigram_step,
        table,
        bigram_cache(1),
        jnp.array([[2]]),
        jnp.array([1]),
        max_new_tokens=6,
        min_new_tokens=3,
    )
    np.testing.assert_array_equal(out.tokens, [[5, 5, 5, EOS, PAD, PAD]])
    assert int(out.lengths[0]) == 4
    # While EOS is forbidden, log-probabilities are over the other tokens (as transformers'
    # compute_transition_scores(..., normalize_logits=True) gives); from then on over all of them.
    without_eos = np.delete(np.asarray(table[5]), EOS)
    np.testing.assert_allclose(out.logprobs[0, :3], jax.nn.log_softmax(without_eos)[4], rtol=1e-6)
    assert float(out.logprobs[0, 3]) == pytest.approx(float(jax.nn.log_softmax(table[5])[EOS]), rel=1e-6)
    sampled = generate(
        bigram_step,
        table,
        bigram_cache(64),
        jnp.full((64, 1), 2),
        jnp.ones(64, jnp.int32),
        max_new_tokens=6,
        min_new_tokens=2,
        temperature=1.0,
        rng=jax.random.key(3),
    )
    assert not np.any(np.asarray(sampled.tokens[:, :2]) == EOS)
    assert np.all(np.asarray(sampled.lengths) >= 3)


def test_min_new_tokens_of_one_forbids_eos_as_the_first_token():
    """min_new_tokens=1: the first token (chosen from the prefill's logits, step 0) may not be EOS;
    the second may. Counting the prefill's token as step 1 let EOS through first."""
    table = jnp.zeros((V, V)).at[:, EOS].set(8.0).at[:, 5].set(4.0)
    out = generate(bigram_step, table, bigram_cache(1), jnp.array([[2]]), jnp.array([1]),
                   max_new_tokens=3, min_new_tokens=1)
    np.testing.assert_array_equal(out.tokens, [[5, EOS, PAD]])
    assert int(out.lengths[0]) == 2
    without_eos = np.delete(np.asarray(table[2]), EOS)  # token 5 is its index 4
    expected = [jax.nn.log_softmax(without_eos)[4], jax.nn.log_softmax(table[5])[EOS]]
    np.testing.assert_allclose(out.logprobs[0, :2], expected, rtol=1e-6)


def test_greedy_takes_the_first_of_tied_maxima_and_logprobs_are_log_softmax():
    # Row t: ties at the maximum between tokens 3 and 7 (and 9 for odd t); large logits, so a
    # naive exp would overflow.
    table = np.full((V, V), -5.0, np.float32)
    table[:, 3] = table[:, 7] = 900.0
    table[1::2, 9] = 900.0
    table[:, 4] = 899.0
    table = jnp.asarray(table)
    out = generate(bigram_step, table, bigram_cache(2), jnp.array([[2], [5]]), jnp.ones(2, jnp.int32),
                   max_new_tokens=3, eos_id=None)
    np.testing.assert_array_equal(out.tokens, [[3, 3, 3], [3, 3, 3]])
    assert np.array_equal(np.asarray(jnp.argmax(table, -1)), np.full(V, 3))
    expected = np.asarray(jax.nn.log_softmax(table, -1))
    rows = [[2, 3, 3], [5, 3, 3]]  # the previous tokens: row 3 has three tied maxima
    np.testing.assert_allclose(out.logprobs, expected[rows, 3], rtol=1e-6)
    assert float(out.logprobs[0, 0]) == pytest.approx(-math.log(2.0 + math.exp(-1.0)), rel=1e-6)
    # Sampled tokens report the same log-softmax of the raw logits (before the temperature).
    prompts = np.arange(8, dtype=np.int32)[:, None]
    sampled = generate(bigram_step, table, bigram_cache(8), prompts, jnp.ones(8, jnp.int32),
                       max_new_tokens=4, rng=jax.random.key(0), temperature=0.5, eos_id=None)
    tokens = np.asarray(sampled.tokens)
    previous = np.concatenate([prompts, tokens[:, :-1]], axis=1)
    assert set(np.unique(tokens).tolist()) <= {3, 4, 7, 9}
    np.testing.assert_allclose(sampled.logprobs, expected[previous, tokens], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("batch", [1, 2, 3, 8])
def test_greedy_tokens_stay_in_the_vocabulary_when_every_logit_is_negative(batch):
    """A trained model's logits are often all negative (GPT-2's lie around -60). The CPU kernel's
    greedy choice let the zeros past the last row of its vectors win the maximum at 1, 2, 4 or 8
    rows, naming token V, past the vocabulary (37 here: not a multiple of the 16 lanes)."""
    vocab = 37
    table = jnp.asarray(np.random.default_rng(5).standard_normal((vocab, vocab)) * 3 - 60, jnp.float32)
    prompts = jnp.arange(batch, dtype=jnp.int32)[:, None] * 5
    out = generate(bigram_step, table, bigram_cache(batch), prompts, jnp.ones(batch, jnp.int32),
                   max_new_tokens=6, eos_id=None)
    previous = np.concatenate([np.asarray(prompts), np.asarray(out.tokens[:, :-1])], axis=1)
    np.testing.assert_array_equal(out.tokens, np.argmax(np.asarray(table)[previous], axis=-1))
    want = np.asarray(jax.nn.log_softmax(table, -1))[previous, np.asarray(out.tokens)]
    np.testing.assert_allclose(out.logprobs, want, rtol=0, atol=1e-5)


def _sample_bigram(table, *, batch=64, steps=96, seed=0, **kwargs):
    prompts = jax.random.randint(jax.random.key(seed + 100), (batch, 1), 0, V)
    out = generate(
        bigram_step,
        table,
        bigram_cache(batch),
        prompts,
        jnp.ones(batch, jnp.int32),
        max_new_tokens=steps,
        rng=jax.random.key(seed),
        eos_id=None,
        **kwargs,
    )
    previous = np.concatenate([np.asarray(prompts), np.asarray(out.tokens[:, :-1])], axis=1)
    return previous, np.asarray(out.tokens)


def _allowed_top_p(row, temperature, top_p):
    probs = np.exp(row / temperature - np.max(row / temperature))
    probs /= probs.sum()
    order = np.argsort(-probs)
    before = np.cumsum(probs[order]) - probs[order]
    return set(order[before < top_p].tolist())


def test_top_k_never_leaves_the_top_k():
    table = np.asarray(history_params(1, rows=V))
    previous, tokens = _sample_bigram(jnp.asarray(table), temperature=1.5, top_k=3)
    allowed = {t: set(np.argsort(-table[t])[:3].tolist()) for t in range(V)}
    assert all(tok in allowed[p] for p, tok in zip(previous.ravel(), tokens.ravel()))
    # With three choices and a high temperature, more than one of them does get sampled.
    assert len(set(tokens[previous == 4].tolist())) > 1


def test_top_p_with_top_k_never_leaves_the_nucleus():
    table = np.asarray(history_params(2, rows=V))
    previous, tokens = _sample_bigram(jnp.asarray(table), temperature=1.0, top_p=0.7, top_k=4)
    for t in range(V):
        allowed = _allowed_top_p(table[t], 1.0, 0.7) & set(np.argsort(-table[t])[:4].tolist())
        assert set(tokens[previous == t].tolist()) <= allowed, t


def test_temperature_sampling_matches_softmax():
    logits = jnp.asarray([2.0, 1.0, 0.5, 0.0, -0.5, 1.5, 0.2, -1.0, 0.8, 0.3, -2.0])
    table = jnp.broadcast_to(logits, (V, V))
    temperature, draws = 0.8, 64 * 96
    _, tokens = _sample_bigram(table, temperature=temperature)
    counts = np.bincount(tokens.ravel(), minlength=V)
    expected = draws * np.asarray(jax.nn.softmax(logits / temperature))
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    assert chi2 < 35.0, chi2  # 10 degrees of freedom: P(chi2 > 35) ~ 1e-4
    # ... and a clearly different temperature would not pass the same test.
    hot = draws * np.asarray(jax.nn.softmax(logits / 2.0))
    assert float(np.sum((counts - hot) ** 2 / hot)) > 200.0


def _truncated_softmax(logits, temperature, top_k=0, top_p=1.0):
    """The distribution sampling should follow, in float64: logits / temperature, then the top_k
    largest kept, then the smallest set of most likely tokens whose renormalised mass reaches top_p."""
    scaled = np.asarray(logits, np.float64) / temperature
    keep = np.ones(scaled.shape, bool)
    if top_k:
        keep &= scaled >= np.sort(scaled)[::-1][top_k - 1]
    probs = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
    probs /= probs.sum()
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        nucleus = np.zeros(scaled.shape, bool)
        nucleus[order[before < top_p]] = True
        probs = np.where(nucleus, probs, 0.0)
        probs /= probs.sum()
    return probs


@pytest.mark.parametrize(
    "temperature, top_k, top_p, kept",
    [(1.5, 3, 1.0, 3), (0.5, 0, 0.8, 3), (2.0, 0, 0.8, 7), (2.0, 5, 0.9, 5), (0.7, 6, 0.75, 3)],
)
def test_top_k_and_top_p_sample_the_renormalised_truncated_softmax(temperature, top_k, top_p, kept):
    """Frequencies, not only the support: a filter that keeps one token too few (top-k off by one,
    a nucleus that stops short of top_p) or a nucleus taken before the temperature (the kept sets at
    temperature 1 differ from these: 3, 6, 6, 4, 4) fails the chi-square test. Every boundary sits at
    least 0.007 of probability mass away from top_p."""
    logits = jnp.asarray([2.0, 1.0, 0.5, 0.0, -0.5, 1.5, 0.2, -1.0, 0.8, 0.3, -2.0])
    expected = _truncated_softmax(logits, temperature, top_k, top_p)
    assert int(np.sum(expected > 0)) == kept
    draws = 64 * 96
    _, tokens = _sample_bigram(jnp.broadcast_to(logits, (V, V)), temperature=temperature, top_k=top_k,
                               top_p=top_p, seed=kept)
    counts = np.bincount(tokens.ravel(), minlength=V)
    assert counts[expected == 0].sum() == 0, counts
    support = expected > 0
    chi2 = float(np.sum((counts[support] - draws * expected[support]) ** 2 / (draws * expected[support])))
    assert chi2 < 30.0, (chi2, counts, np.round(draws * expected))  # <= 6 dof: P(chi2 > 30) < 1e-4


def test_traced_top_p_of_one_keeps_every_token():
    """A traced top_p compiles the filter in, and 1.0 must keep the whole vocabulary: with one
    dominant token the float32 running sum reaches 1.0 before the tail, which the filter used to
    drop (mass before token 1 = 1 + 2e-9 - 2e-9 rounds to 1.0, not < 1.0)."""
    from transformer_jax.decoding.sampling import _top_p_mask

    logits = jnp.asarray([[20.0, 0.0, 0.0, -1.0], [0.0, 1.0, 2.0, 3.0]])
    kept = jax.jit(_top_p_mask)(logits, jnp.float32(1.0))
    np.testing.assert_array_equal(kept, logits)
    # Just below 1.0, the tail of the first row (mass 6e-9) goes; the second row keeps 4 tokens.
    kept = jax.jit(_top_p_mask)(logits, jnp.float32(0.999))
    assert (np.asarray(kept) > -1e29).sum(axis=-1).tolist() == [1, 4]


def test_top_p_keeps_the_smallest_set_when_logits_tie():
    """Ties at the cut-off are ranked by token id: the nucleus is the smallest set reaching top_p,
    as the docstrings say. Thresholding by the cut-off's logit kept every tied token: 4 of 4
    uniform tokens at top_p=0.5, or all 8 (no filtering at all) at 0.85 below."""
    from transformer_jax.decoding.sampling import _top_p_mask

    kept = lambda logits, p: (np.asarray(jax.jit(_top_p_mask)(jnp.asarray(logits), jnp.float32(p))) > -1e29)
    np.testing.assert_array_equal(kept([[0.0, 0.0, 0.0, 0.0]], 0.5), [[True, True, False, False]])
    np.testing.assert_array_equal(kept([[0.0, 0.0, 0.0, 0.0]], 0.51), [[True, True, True, False]])
    # One likely token (0.742) and seven tied ones (0.037 each): 0.85 needs the first three.
    row = [3.0] + [0.0] * 7
    np.testing.assert_array_equal(kept([row, row[::-1]], 0.85),
                                  [[True, True, True, True, False, False, False, False],
                                   [True, True, True, False, False, False, False, True]])
    # In sampling over V = 11 (0.668, then ten tied at 0.0332): tokens 0-6 reach 0.85, and only
    # they are drawn (all 11 were).
    table = jnp.broadcast_to(jnp.asarray([3.0] + [0.0] * (V - 1)), (V, V))
    _, tokens = _sample_bigram(table, temperature=1.0, top_p=0.85, steps=32)
    assert set(np.unique(tokens).tolist()) == set(range(7)), np.unique(tokens)


@pytest.mark.parametrize("candidates", [1, 128, 4096])
def test_top_p_equals_a_sorted_float64_nucleus_on_random_rows(candidates, monkeypatch):
    """Both ways of finding the nucleus give sorting's: random rows of 1-2999 logits (eight widths,
    so eight compilations), bf16-rounded and integer-rounded ones (many ties, -0.0 beside 0.0),
    masked tokens, several top_p. One candidate sends every row of more than one token to the
    bisection, 4096 none; 128 mixes them within a batch. Rows whose boundary lies within 1e-5 of
    top_p may differ by float32 summation and are skipped."""
    from transformer_jax.decoding import sampling

    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", candidates)
    jax.clear_caches()
    rng = np.random.default_rng(0)
    mask = jax.jit(sampling._top_p_mask)
    compared = 0
    for trial in range(40):
        width = int(rng.choice([1, 2, 7, 130, 777, 1024, 2049, 2999]))
        x = (rng.standard_normal((4, width)) * rng.choice([0.1, 1.0, 3.0, 10.0])).astype(np.float32)
        if trial % 3 == 0:
            x = np.array(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
        if trial % 4 == 1:
            x = np.round(x)  # ties, -0.0 among them
        if trial % 5 == 2:
            x[:, rng.integers(0, width, size=max(1, width // 4))] = -1e30
        top_p = float(rng.choice([0.1, 0.5, 0.9, 0.95, 0.999, 1.0, rng.uniform(0.01, 1.0)]))
        got = np.asarray(mask(jnp.asarray(x), jnp.float32(top_p))) > -1e29
        for row, kept in zip(x.astype(np.float64), got):
            probs = np.exp(row - row.max())
            probs /= probs.sum()
            order = np.lexsort((np.arange(width), -row))  # logit descending, then id
            before = np.cumsum(probs[order]) - probs[order]
            if np.min(np.abs(before - top_p)) < 1e-5:
                continue
            want = np.zeros(width, bool)
            want[order[(before < top_p) | (top_p >= 1.0)]] = True
            np.testing.assert_array_equal(kept & (row > -1e29), want & (row > -1e29))
            compared += 1
    assert compared >= 120, compared  # of 160 rows


def test_a_rows_nucleus_does_not_depend_on_the_other_rows():
    """A peaked row (nucleus among the candidates) next to a flat one (which sends the step to the
    bisection) keeps what it keeps alone, and so does the flat one."""
    from transformer_jax.decoding.sampling import TOP_P_CANDIDATES, _top_p_mask

    rng = np.random.default_rng(3)
    peaked = rng.standard_normal(5000).astype(np.float32) * 10
    flat = rng.standard_normal(5000).astype(np.float32)
    mask = jax.jit(_top_p_mask)
    alone = [np.asarray(mask(jnp.asarray(r[None]), jnp.float32(0.9)))[0] for r in (peaked, flat)]
    both = np.asarray(mask(jnp.asarray(np.stack([peaked, flat])), jnp.float32(0.9)))
    np.testing.assert_array_equal(both, np.stack(alone))
    assert 1 <= np.sum(alone[0] > -1e29) <= TOP_P_CANDIDATES < np.sum(alone[1] > -1e29)


def test_top_k_and_top_p_compile_without_a_sort():
    """XLA:CPU sorts GPT-2's [8, 50257] logits in ~60 ms, ten decoding steps: neither filter may
    sort (a slice of top_k's output became a full sort, ~52 ms; top-p sorted the whole row)."""
    from transformer_jax.decoding.sampling import _top_k_mask, _top_p_mask

    logits = jnp.zeros((8, 50257), jnp.float32)
    for f, arg in ((_top_k_mask, 40), (_top_p_mask, jnp.float32(0.9))):
        static = (1,) if f is _top_k_mask else ()
        hlo = jax.jit(f, static_argnums=static).lower(logits, arg).compile().as_text()
        assert " sort(" not in hlo, f.__name__


def _inverse_cdf64(u, logits):
    """Float64 inverse transform sampling: the first token whose cumulative probability exceeds u."""
    x = np.asarray(logits, np.float64)
    p = np.exp(x - x.max())
    cdf = np.cumsum(p) / p.sum()
    return int(np.searchsorted(cdf, u, side="right")), cdf


def test_sampling_is_the_inverse_of_the_float64_cdf():
    """`sample_from_logits` draws the first token whose cumulative probability exceeds u, summing
    over blocks of 128 tokens and then inside one: the same token as a float64 search for u spread
    over [0, 1), wherever u is not within 1e-5 of a boundary, over several blocks and a partial
    last one, with masked runs (never drawn) and probabilities from 1e-30 up."""
    from transformer_jax.decoding.sampling import NEG_INF, SAMPLE_BLOCK, sample_from_logits

    rng = np.random.default_rng(0)
    vocab = 5 * SAMPLE_BLOCK + 37
    rows = [rng.normal(size=vocab) * scale for scale in (0.5, 3.0, 12.0)]
    masked = rng.normal(size=vocab)
    masked[SAMPLE_BLOCK: 3 * SAMPLE_BLOCK] = NEG_INF  # whole blocks without mass
    masked[-20:] = NEG_INF  # the partial last block's tail
    rows.append(masked)
    spiky = np.full(vocab, -70.0)
    spiky[[3, 300, vocab - 1]] = [0.0, 1.0, 0.5]  # three tokens hold all but ~1e-27 of the mass
    rows.append(spiky)
    logits = np.stack(rows).astype(np.float32)
    draw = jax.jit(sample_from_logits)
    compared = 0
    for u in np.concatenate([rng.uniform(size=400), [0.0, 0.5, 1 - 2.0**-24]]).astype(np.float32):
        got = np.asarray(draw(jnp.full((len(rows),), u), jnp.asarray(logits)))
        for row, token in zip(logits, got):
            want, cdf = _inverse_cdf64(float(u), row)
            assert row[token] > NEG_INF  # never a masked token, not even at u just under 1
            if np.min(np.abs(cdf - u)) > 1e-5:
                assert token == want, (u, token, want)
                compared += 1
    assert compared > 1900
    # +inf logits (a forced token, or a large logit over a tiny temperature) share all the mass;
    # inf - inf made every sum NaN and token 0 came out, masked or not.
    forced = np.full((4, vocab), NEG_INF, np.float32)
    forced[:, 5] = 0.0
    forced[:, [200, 600]] = np.inf
    got = np.asarray(draw(jnp.asarray([0.0, 0.3, 0.7, 1 - 2.0**-24]), jnp.asarray(forced)))
    assert got.tolist() == [200, 200, 600, 600]
    # Rounding at the top: u just under 1 with the last tokens masked gives the last real token.
    last = np.full((1, vocab), NEG_INF, np.float32)
    last[0, [0, 200]] = 0.0
    assert int(draw(jnp.asarray([1 - 2.0**-24]), jnp.asarray(last))[0]) == 200


def test_a_tiny_temperature_samples_the_likeliest_token():
    """40 / 1e-37 overflows float32 to +inf: the token whose logit it was must be drawn (it was
    token 0, here EOS, while EOS was still forbidden)."""
    table = jnp.zeros((V, V), jnp.float32).at[:, 7].set(40.0)
    _, tokens = _sample_bigram(table, temperature=1e-37)
    assert np.all(np.asarray(tokens) == 7)


@pytest.mark.parametrize("temperature", [1e-29, 1e-38, 1e-50])
def test_a_tiny_temperature_is_greedy_and_keeps_masked_tokens_masked(temperature):
    """Below ~1e-28 every real logit over the temperature fell under the masks' NEG_INF, and EOS, the
    likeliest token but forbidden before min_new_tokens, was drawn first; at 1e-38 the positive
    ones overflowed to +inf and any of them was drawn; 1e-50, 0 in float32, divided by zero. Each
    is now greedy decoding with EOS held back."""
    row = jnp.asarray([0.0, 60.0, 5.0, 10.0, 9.9, 9.95, -3.0, -40.0, 0.0, 1.0, 2.0])
    prompts = jnp.full((32, 1), 2, jnp.int32)
    kwargs = dict(max_new_tokens=4, min_new_tokens=3, eos_id=EOS, pad_id=PAD)
    for offset in (0.0, -70.0):  # positive logits and negative ones
        table = jnp.tile(row + offset, (V, 1))
        greedy = generate(bigram_step, table, bigram_cache(32), prompts, jnp.ones(32, jnp.int32), **kwargs)
        out = generate(bigram_step, table, bigram_cache(32), prompts, jnp.ones(32, jnp.int32),
                       rng=jax.random.key(0), temperature=temperature, **kwargs)
        assert np.asarray(greedy.tokens)[0].tolist() == [3, 3, 3, EOS]
        np.testing.assert_array_equal(out.tokens, greedy.tokens, err_msg=str(offset))
        np.testing.assert_allclose(out.logprobs, greedy.logprobs, rtol=1e-6)
    # A +inf logit takes all the mass: a finite 50 overflowed to +inf too and shared the draw.
    from transformer_jax.decoding.sampling import _choose

    forced = jnp.tile(jnp.asarray([[jnp.inf, 50.0, 0.0, -1.0]]), (256, 1))
    for greedy in (False, None):  # a Python temperature, and a traced one
        tokens, _ = _choose(forced, jax.random.key(0), jnp.int32(0), jnp.float32(temperature),
                            jnp.float32(1.0), jnp.int32(0), greedy=greedy, top_k=0, use_top_p=False,
                            eos_id=None)
        assert (np.asarray(tokens) == 0).all(), (greedy, np.bincount(np.asarray(tokens)))


def test_sampling_draws_one_random_number_per_row():
    """Gumbel-max sampling (`jax.random.categorical`) draws one random number per token and takes
    two logarithms of each: ~5.7 ms for [8, 50257] on this CPU, half a decoding step. The sampler
    draws one per row: no random bits of the logits' shape in the compiled step."""
    from transformer_jax.decoding.sampling import _choose

    logits = jnp.zeros((8, 50257), jnp.float32)
    choose = functools.partial(_choose, greedy=False, top_k=0, use_top_p=False, eos_id=None)
    hlo = jax.jit(choose).lower(logits, jax.random.key(0), jnp.int32(0), jnp.float32(1.0),
                                jnp.float32(1.0), jnp.int32(0)).compile().as_text()
    assert "u32[8,50257]" not in hlo and "rng-bit-generator" not in hlo
    assert "u32[8]" in hlo  # the one number per row


def test_a_huge_temperature_keeps_masked_tokens_masked():
    """EOS before min_new_tokens (and banned tokens) get NEG_INF logits; divided by a finite but
    huge temperature they came to about -1 and were drawn (296 of 2000 rows ended too early at
    1e30)."""
    table = jnp.zeros((V, V), jnp.float32)
    prompts = jnp.full((256, 1), 2, jnp.int32)
    for temperature in (1.0, 1e30):
        out = generate(bigram_step, table, bigram_cache(256), prompts, jnp.ones(256, jnp.int32),
                       max_new_tokens=4, min_new_tokens=3, rng=jax.random.key(0), temperature=temperature,
                       eos_id=EOS, pad_id=PAD)
        assert (np.asarray(out.tokens)[:, :3] != EOS).all(), temperature
        assert (np.asarray(out.tokens)[:, 3] == EOS).any()  # the fourth may end it


@pytest.mark.parametrize("value", [float("inf"), float("nan"), None, 2.5, -1])
def test_min_new_tokens_that_is_not_a_count_is_a_value_error_naming_it(value):
    from transformer_jax.decoding.sampling import SamplingConfig

    with pytest.raises(ValueError, match="min_new_tokens must be a non-negative integer"):
        SamplingConfig(temperature=1.0, min_new_tokens=value)


def test_a_sampling_config_stands_for_its_keywords():
    """`generate(..., sampling=tj.SamplingConfig(...))` samples as the four keywords do; the config
    and a keyword together are a ValueError naming the keyword (tj.SamplingConfig was exported, but
    generate took keywords only)."""
    import dataclasses

    import transformer_jax as tj

    table = history_params(3, rows=V, scale=1.0)
    prompts = np.arange(32, dtype=np.int32)[:, None] % V
    settings = dict(temperature=0.7, top_k=5, top_p=0.8, min_new_tokens=3)
    run = lambda **kw: generate(bigram_step, table, bigram_cache(32), prompts, jnp.ones(32, jnp.int32),
                                max_new_tokens=6, rng=jax.random.key(4), eos_id=EOS, pad_id=PAD, **kw)
    want, got = run(**settings), run(sampling=tj.SamplingConfig(**settings))
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(want.tokens, run(sampling=tj.SamplingConfig(temperature=0.7)).tokens)
    greedy = run(sampling=tj.SamplingConfig())
    np.testing.assert_array_equal(greedy.tokens, run().tokens)
    config = tj.SamplingConfig(temperature=0.7)
    for keyword in (dict(temperature=0.9), dict(top_k=3), dict(top_p=0.5), dict(min_new_tokens=1),
                    dict(temperature=jnp.float32(0.7))):
        with pytest.raises(ValueError, match=rf"SamplingConfig\(\.\.\.\) and {next(iter(keyword))}= given"):
            run(sampling=config, **keyword)
    with pytest.raises(ValueError, match=r"\(\.\.\.\) and top_k=, min_new_tokens= given together"):
        run(sampling=config, top_k=2, min_new_tokens=1)
    np.testing.assert_array_equal(run(sampling=config, top_k=0).tokens,  # a default is no setting
                                  run(sampling=config).tokens)
    with pytest.raises(TypeError, match="sampling must be a SamplingConfig, got dict"):
        run(sampling=settings)
    traced = jax.jit(lambda t: run(sampling=dataclasses.replace(config, temperature=t)).tokens)
    np.testing.assert_array_equal(traced(jnp.float32(0.7)), run(sampling=config).tokens)


def test_top_p_alone_and_same_key_same_tokens():
    table = history_params(4, rows=V)
    previous, a = _sample_bigram(table, seed=5, temperature=1.0, top_p=0.9)
    b = _sample_bigram(table, seed=5, temperature=1.0, top_p=0.9)[1]
    c = _sample_bigram(table, seed=6, temperature=1.0, top_p=0.9)[1]
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    for t in range(V):
        assert set(a[previous == t].tolist()) <= _allowed_top_p(np.asarray(table[t]), 1.0, 0.9), t


@pytest.mark.parametrize("filters", [dict(top_k=3), dict(top_p=0.6), dict(top_k=5, top_p=0.7)])
def test_sampled_logprobs_are_over_the_whole_vocabulary_whatever_the_filters(filters):
    """logprobs are the log-softmax of the raw logits, before top-k and top-p as before the
    temperature (GenerateOutput): not renormalised over the tokens the filters kept."""
    table = history_params(1, rows=V, scale=1.0)
    prompts = np.arange(16, dtype=np.int32)[:, None] % V
    out = generate(bigram_step, table, bigram_cache(16), prompts, jnp.ones(16, jnp.int32), max_new_tokens=6,
                   rng=jax.random.key(2), temperature=1.0, eos_id=None, **filters)
    tokens = np.asarray(out.tokens)
    previous = np.concatenate([prompts, tokens[:, :-1]], axis=1)
    rows = np.asarray(table, np.float64)
    full = rows - rows.max(1, keepdims=True)
    full -= np.log(np.exp(full).sum(1, keepdims=True))
    np.testing.assert_allclose(out.logprobs, full[previous, tokens], atol=1e-5)
    # The filters do cut: over the kept tokens alone every log-probability would be >= 0.1 larger.
    kept_mass = [np.exp(full[t])[_truncated_softmax(rows[t], 1.0, **filters) > 0].sum() for t in range(V)]
    assert max(kept_mass) < 0.9, kept_mass


RAGGED = [[5, 9, 2, 7, 3, 4], [6], [8, 2, 10, 4]]


def _ragged_batch(prompts, width=8):
    tokens, lengths = decoding.pad_prompts(prompts, buckets=[width])
    return jnp.asarray(tokens), jnp.asarray(lengths)


def test_ragged_batch_equals_one_by_one_and_logprobs_match_rescoring():
    params = history_params()
    tokens, lengths = _ragged_batch(RAGGED)
    batched = generate(history_step, params, history_cache(3), tokens, lengths, max_new_tokens=8)
    for row, prompt in enumerate(RAGGED):
        alone = generate(
            history_step,
            params,
            history_cache(1),
            jnp.asarray([prompt]),
            jnp.asarray([len(prompt)]),
            max_new_tokens=8,
        )
        np.testing.assert_array_equal(batched.tokens[row], alone.tokens[0])
        np.testing.assert_allclose(batched.logprobs[row], alone.logprobs[0], atol=1e-5)
        generated = trim(batched.tokens[row], batched.lengths[row])
        total = float(batched.logprobs[row].sum())
        assert total == pytest.approx(rescore(params, prompt, generated), abs=1e-4)


def test_per_row_limits_stop_each_row_as_its_own_call_would():
    """max_new_tokens_per_row: row b stops after its limit (padding after it, length at most it),
    with the tokens and log-probabilities a call with that max_new_tokens alone gives."""
    params = history_params()
    tokens, lengths = _ragged_batch(RAGGED)
    limits = [3, 8, 1]
    for eos_id in (None, EOS):
        batched = generate(history_step, params, history_cache(3), tokens, lengths, max_new_tokens=8,
                           max_new_tokens_per_row=np.array(limits), eos_id=eos_id)
        for row, limit in enumerate(limits):
            alone = generate(history_step, params, history_cache(1), tokens[row : row + 1],
                             lengths[row : row + 1], max_new_tokens=limit, eos_id=eos_id)
            np.testing.assert_array_equal(batched.tokens[row, :limit], alone.tokens[0])
            np.testing.assert_allclose(batched.logprobs[row, :limit], alone.logprobs[0], atol=1e-6)
            assert np.all(np.asarray(batched.tokens[row, limit:]) == PAD)
            assert int(batched.lengths[row]) == int(alone.lengths[0]) <= limit
    with pytest.raises(ValueError, match=r"max_new_tokens_per_row must lie in \[1, max_new_tokens=8\]"):
        generate(history_step, params, history_cache(3), tokens, lengths, max_new_tokens=8,
                 max_new_tokens_per_row=[3, 9, 1])


def test_prompt_bucketing_shares_compilations():
    assert [decoding.bucket_length(n) for n in (1, 8, 9, 17, 64)] == [8, 8, 16, 32, 64]
    assert decoding.bucket_length(5, buckets=[4, 16, 6]) == 6
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        decoding.bucket_length(20, buckets=[4, 16])
    assert decoding.pad_to_bucket(np.ones((2, 3), np.int32), pad_id=0).shape == (2, 8)
    with pytest.raises(ValueError, match=r"prompt_tokens must be \[batch, length\] with length >= 1"):
        decoding.pad_to_bucket(np.ones((2, 0), np.int32))
    params = history_params()
    traces = []

    def counting_step(params, tokens, cache, num_valid):
        traces.append(tokens.shape)
        return history_step(params, tokens, cache, num_valid)

    outputs = []
    for prompt in (RAGGED[2], RAGGED[0]):  # lengths 4 and 6
        tokens, lengths = decoding.pad_prompts([prompt])
        assert tokens.shape == (1, 8)
        outputs.append(generate(counting_step, params, history_cache(1), tokens, lengths, max_new_tokens=8))
        exact = generate(
            history_step,
            params,
            history_cache(1),
            jnp.asarray([prompt]),
            jnp.asarray([len(prompt)]),
            max_new_tokens=8,
        )
        np.testing.assert_array_equal(outputs[-1].tokens, exact.tokens)
    assert len(traces) == 2  # one prefill + one decode-step trace: a single compilation


def test_padding_helpers_fill_the_right_with_pad_id():
    tokens, lengths = decoding.pad_prompts([[5, 6, 7], [8]], pad_id=9, buckets=[2, 5])
    np.testing.assert_array_equal(tokens, [[5, 6, 7, 9, 9], [8, 9, 9, 9, 9]])
    np.testing.assert_array_equal(lengths, [3, 1])
    assert tokens.dtype == np.int32
    # a 2-D array of prompts: `not prompts` raised numpy's "truth value ... is ambiguous"
    tokens, lengths = decoding.pad_prompts(np.array([[5, 6, 7], [8, 9, 4]]), pad_id=9, buckets=[4])
    np.testing.assert_array_equal(tokens, [[5, 6, 7, 9], [8, 9, 4, 9]])
    np.testing.assert_array_equal(lengths, [3, 3])
    with pytest.raises(ValueError, match=r"a list of prompts, each a list of token ids"):
        decoding.pad_prompts([5, 6, 7])  # one prompt, not a list of them: len() of an int
    padded = decoding.pad_to_bucket(np.array([[3, 4, 5], [6, 7, 8]], np.int32), pad_id=2, buckets=[4, 6])
    np.testing.assert_array_equal(padded, [[3, 4, 5, 2], [6, 7, 8, 2]])


def test_repeated_calls_do_not_recompile():
    traces = []

    def counting_step(params, tokens, cache, num_valid):
        traces.append(1)
        return bigram_step(params, tokens, cache, num_valid)

    prompts, lengths = jnp.array([[3, 4], [5, 0]]), jnp.array([2, 1])
    kwargs = dict(max_new_tokens=4, rng=jax.random.key(0), top_k=5, top_p=0.9)
    generate(
        counting_step,
        shift_table(),
        bigram_cache(2),
        prompts,
        lengths,
        temperature=1.0,
        min_new_tokens=1,
        **kwargs,
    )
    first, size = len(traces), _generate_jit._cache_size()
    for seed in range(3):  # new params values, temperature, top-p mass, min length: no retrace
        generate(
            counting_step,
            history_params(seed, rows=V),
            bigram_cache(2),
            prompts,
            lengths,
            temperature=0.5 + seed,
            min_new_tokens=seed,
            **{**kwargs, "top_p": 0.5},
        )
    assert len(traces) == first and _generate_jit._cache_size() == size
    generate(counting_step, shift_table(), bigram_cache(2), prompts, lengths, max_new_tokens=5)
    assert len(traces) > first  # a new static configuration does compile


@pytest.mark.parametrize("eos_id", [None, EOS])
def test_only_tokens_cross_decoding_steps(eos_id):
    """The loop carries the chosen tokens, never a [B, V] logits array: each step picks its token
    from the logits it just computed (so XLA reads them in the layout the model wrote them). With
    an EOS id the loop is a while loop that ends once every row is done (a scan with a `lax.cond`
    in it copied every layer's cache each step)."""
    batch, width = 3, 2
    args = (bigram_step, shift_table(), bigram_cache(batch), jnp.full((batch, width), 3),
            jnp.full((batch,), width), jax.random.key(0), 1.0, 1.0, 0, None)
    jaxpr = _generate_jit.trace(*args, max_new_tokens=5, greedy=True, top_k=0, use_top_p=False,
                                eos_id=eos_id, pad_id=PAD).jaxpr
    loops = [eqn for eqn in jaxpr.eqns if eqn.primitive.name in ("scan", "while")]
    assert [loop.primitive.name for loop in loops] == ["scan" if eos_id is None else "while"]
    loop = loops[0]
    if eos_id is None:
        consts, carries = loop.params["num_consts"], loop.params["num_carry"]
        carried = [v.aval for v in loop.invars[consts:consts + carries]]
    else:
        consts = loop.params["cond_nconsts"] + loop.params["body_nconsts"]
        carried = [v.aval for v in loop.invars[consts:]]
        # The cache (the carry's first leaf here) reaches no cond (a platform switch is one).
        body = loop.params["body_jaxpr"].jaxpr
        cache_in = body.invars[loop.params["body_nconsts"]]
        assert not any(cache_in in eqn.invars for eqn in body.eqns if eqn.primitive.name == "cond")
    assert any(a.shape == (batch,) and a.dtype == jnp.int32 for a in carried)  # the tokens
    assert not any(a.shape[-1:] == (V,) for a in carried), carried


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=-3), "max_new_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(min_new_tokens=-1), "min_new_tokens"),
        (dict(temperature=1.0), "rng"),
        (dict(prompt_lengths=[2, 0]), "empty prompt"),
        (dict(prompt_lengths=[2, 3]), "exceed"),
        (dict(prompt_tokens=jnp.zeros((2, 0), jnp.int32)), "length 0"),
        (dict(prompt_tokens=jnp.zeros((2, 2, 1), jnp.int32)), r"\[batch, length\]"),
        (dict(temperature=float("inf"), rng=jax.random.key(0)), "temperature must be finite"),
        (dict(max_new_tokens=None), "max_new_tokens must be a positive integer, got None"),
        (dict(top_k=None), "top_k must be a non-negative integer"),
        # a TypeError ('<' not supported ...) or "truth value of an array is ambiguous" before
        (dict(top_p=None), r"top_p must be one number \(the same for every row\), got None"),
        (dict(temperature="0.7", rng=jax.random.key(0)), r"temperature must be one number .*got '0.7'"),
        (dict(temperature=jnp.array([0.5, 1.0]), rng=jax.random.key(0)),
         r"temperature must be one number \(the same for every row\), got an array of shape \(2,\)"),
        (dict(prompt_lengths=jnp.array([2.0, 1.0])), "prompt_lengths must be integer"),
        (dict(eos_id=-1), r"eos_id=-1 is not a token id of the model: it must lie in >= 0"),
        (dict(pad_id=-2), r"pad_id=-2 is not a token id"),
        (dict(temperature=1.0, rng=jax.random.split(jax.random.key(0), 3)), r"shape \(3,\).*\(2,\)"),
        (dict(temperature=1.0, rng=jnp.zeros(3)), r"rng must be a PRNG key .* got float32\[3\]"),
    ],
)
def test_argument_errors(kwargs, message):
    args = dict(prompt_tokens=jnp.array([[3, 4], [5, 0]]), prompt_lengths=jnp.array([2, 1]), max_new_tokens=3)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        generate(bigram_step, shift_table(), bigram_cache(2), **args)


# ----------------------------------------------------------------------------- beam search


def _peaked_table():
    """From the start token 2, greedy takes 3 (p=.6) but 4 (p=.4) leads on to EOS with p=.95."""
    probs = np.full((V, V), 1e-6)
    probs[2, [3, 4]] = [0.6, 0.4]
    probs[3, [5, 4, EOS, 3]] = [0.3, 0.25, 0.25, 0.2]
    probs[4, EOS] = 0.95
    probs[5, EOS] = 0.9
    probs[[0, 1, 6, 7, 8, 9, 10], EOS] = 1.0
    return jnp.log(jnp.asarray(probs / probs.sum(1, keepdims=True), jnp.float32))


def test_beam_search_beats_greedy():
    table, start = _peaked_table(), jnp.array([[2]])
    greedy = generate(bigram_step, table, bigram_cache(1), start, jnp.array([1]), max_new_tokens=6)
    np.testing.assert_array_equal(greedy.tokens, [[3, 5, EOS, PAD, PAD, PAD]])
    beams = beam_search(
        bigram_step, table, bigram_cache(1), start, jnp.array([1]), max_new_tokens=4, beam_size=2, alpha=0.0
    )
    np.testing.assert_array_equal(beams.tokens[0, 0], [4, EOS, PAD, PAD])
    expected = float(table[2, 4] + table[4, EOS])
    assert float(beams.logprobs[0, 0]) == pytest.approx(expected, abs=1e-4)
    assert float(beams.logprobs[0, 0]) > float(greedy.logprobs.sum()) + 0.5
    np.testing.assert_array_equal(beams.lengths[0], [2, 3])


def test_pad_id_follows_eos_and_lengths_count_the_first_eos():
    """pad_id fills each row after its EOS, in beam search too; a pad id equal to the EOS id
    (GPT-2 style) leaves the lengths at the first EOS."""
    start, one = jnp.array([[8]]), jnp.array([1])
    for pad in (7, EOS):
        out = generate(bigram_step, shift_table(), bigram_cache(1), start, one, max_new_tokens=6, pad_id=pad)
        np.testing.assert_array_equal(out.tokens, [[9, 10, 0, EOS, pad, pad]])
        assert out.lengths.tolist() == [4]
    beams = beam_search(bigram_step, _peaked_table(), bigram_cache(1), jnp.array([[2]]), one,
                        max_new_tokens=4, beam_size=2, alpha=0.0, pad_id=7)
    np.testing.assert_array_equal(beams.lengths[0], [2, 3])
    np.testing.assert_array_equal(beams.tokens[0, 0], [4, EOS, 7, 7])
    assert beams.tokens[0, 1, 2] == EOS and beams.tokens[0, 1, 3] == 7


def test_length_penalty_trades_length_for_probability():
    # From 2: EOS (p=.4) now, or 3 (p=.35) -> 4 (p=.95) -> EOS (p=.95).
    probs = np.full((V, V), 1e-6)
    probs[2, [EOS, 3, 5]] = [0.4, 0.35, 0.25]
    probs[3, 4] = probs[4, EOS] = 0.95
    probs[3, 6] = probs[4, 6] = 0.05
    probs[[0, 1, 5, 6, 7, 8, 9, 10], EOS] = 1.0
    table = jnp.log(jnp.asarray(probs / probs.sum(1, keepdims=True), jnp.float32))
    short, long = math.log(0.4), math.log(0.35 * 0.95 * 0.95)
    for alpha, best in [(0.0, [EOS, PAD, PAD, PAD]), (1.0, [3, 4, EOS, PAD])]:
        out = beam_search(
            bigram_step,
            table,
            bigram_cache(1),
            jnp.array([[2]]),
            jnp.array([1]),
            max_new_tokens=4,
            beam_size=2,
            alpha=alpha,
        )
        np.testing.assert_array_equal(out.tokens[0, 0], best)
        expected = sorted([short / length_penalty(1, alpha), long / length_penalty(3, alpha)])[::-1]
        np.testing.assert_allclose(out.scores[0], expected, atol=1e-4)
    assert float(length_penalty(3, 0.6)) == pytest.approx((8 / 6) ** 0.6)
    # One beam: EOS finishes a hypothesis at step 1, but the live one may still beat it once the
    # length penalty of a longer output applies, so the search must go on (stopping on the bound
    # of the current length returned [EOS]).
    out = beam_search(bigram_step, table, bigram_cache(1), jnp.array([[2]]), jnp.array([1]),
                      max_new_tokens=4, beam_size=1, alpha=1.0)
    np.testing.assert_array_equal(out.tokens[0, 0], [3, 4, EOS, PAD])
    assert float(out.scores[0, 0]) == pytest.approx(long / (8 / 6), abs=1e-4)


def test_two_eos_candidates_do_not_crowd_out_a_live_beam():
    """2K candidates per step: with K = 2, both step-1 candidates ending in EOS and the live [4, 7]
    must all be kept; with K + 1 of them the EOS pair filled the slots and [4, 7, 8, 9, EOS], the
    best under alpha = 1, was lost."""
    probs = np.full((V, V), 1e-9)
    probs[2, [3, 4, 5]] = [0.4, 0.35, 0.25]
    probs[3, [EOS, 6]] = [0.55, 0.45]
    probs[4, [EOS, 7]] = [0.52, 0.48]
    probs[6, [EOS, 10]] = [0.2, 0.8]
    probs[7, 8] = probs[8, 9] = probs[9, EOS] = probs[10, EOS] = 1.0
    probs[[0, 1, 5], EOS] = 1.0
    table = jnp.log(jnp.asarray(probs / probs.sum(1, keepdims=True), jnp.float32))
    out = beam_search(bigram_step, table, bigram_cache(1), jnp.array([[2]]), jnp.array([1]),
                      max_new_tokens=6, beam_size=2, alpha=1.0)
    np.testing.assert_array_equal(out.tokens[0, 0], [4, 7, 8, 9, EOS, PAD])
    assert float(out.scores[0, 0]) == pytest.approx(math.log(0.35 * 0.48) / (10 / 6), abs=1e-4)


@pytest.mark.parametrize(("alpha", "eos_id"), [(0.0, EOS), (0.6, None)])
def test_beam_of_one_is_greedy(alpha, eos_id):
    params = history_params(7)
    tokens, lengths = _ragged_batch(RAGGED)
    greedy = generate(
        history_step, params, history_cache(3), tokens, lengths, max_new_tokens=8, eos_id=eos_id
    )
    beams = beam_search(
        history_step,
        params,
        history_cache(3),
        tokens,
        lengths,
        max_new_tokens=8,
        beam_size=1,
        alpha=alpha,
        eos_id=eos_id,
    )
    # Where greedy ends with EOS it is also the single beam's answer. Where greedy runs to
    # max_new_tokens, beam search may instead keep an EOS-ended prefix it passed on the way:
    # the finished set remembers it, and it is never less probable than greedy's output.
    ended = np.asarray(greedy.lengths) < 8 if eos_id is not None else np.ones(3, bool)
    assert ended.sum() >= 2
    np.testing.assert_array_equal(beams.tokens[ended, 0], greedy.tokens[ended])
    np.testing.assert_array_equal(beams.lengths[ended, 0], greedy.lengths[ended])
    greedy_logp = np.asarray(greedy.logprobs.sum(1))
    np.testing.assert_allclose(beams.logprobs[ended, 0], greedy_logp[ended], atol=1e-4)
    assert np.all(np.asarray(beams.logprobs[:, 0]) >= greedy_logp - 1e-4)


def test_beam_hypotheses_are_consistent_with_the_model():
    """Every hypothesis of a ragged batch rescores to its reported log-probability (so the
    prefill was right and cache rows followed their parent beams); batched == alone."""
    params, beam = history_params(8), 3
    tokens, lengths = _ragged_batch(RAGGED)
    out = beam_search(
        history_step,
        params,
        history_cache(3, 64),
        tokens,
        lengths,
        max_new_tokens=9,
        beam_size=beam,
        alpha=0.6,
    )
    assert out.tokens.shape == (3, beam, 9) and out.scores.shape == (3, beam)
    assert np.all(np.diff(np.asarray(out.scores), axis=1) <= 1e-6)  # best first
    alone = beam_search(
        history_step,
        params,
        history_cache(1, 64),
        jnp.asarray(RAGGED[:1]),
        jnp.asarray([len(RAGGED[0])]),
        max_new_tokens=9,
        beam_size=beam,
    )
    np.testing.assert_array_equal(out.tokens[0], alone.tokens[0])
    for row, prompt in enumerate(RAGGED):
        for k in range(beam):
            length = int(out.lengths[row, k])
            hyp = np.asarray(out.tokens[row, k])
            assert np.all(hyp[length:] == PAD)
            assert EOS not in hyp[: length - 1].tolist()
            logp = rescore(params, prompt, trim(hyp, length))
            assert float(out.logprobs[row, k]) == pytest.approx(logp, abs=1e-4)
            score = logp / float(length_penalty(length, 0.6))
            assert float(out.scores[row, k]) == pytest.approx(score, abs=1e-4)


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_wide_beam_finds_the_exhaustive_best(alpha):
    """With beams wider than the search space, beam search is exact: compare with brute force."""
    params, steps, prompt = history_params(9, scale=2.0), 3, [4, 7]
    out = beam_search(
        history_step,
        params,
        history_cache(1),
        jnp.asarray([prompt]),
        jnp.asarray([2]),
        max_new_tokens=steps,
        beam_size=V * V,
        alpha=alpha,
    )
    best = -np.inf
    for seq in set(itertools.product(range(V), repeat=steps)):
        hyp = list(seq[: seq.index(EOS) + 1]) if EOS in seq else list(seq)
        best = max(best, rescore(params, prompt, hyp) / float(length_penalty(len(hyp), alpha)))
    assert float(out.scores[0, 0]) == pytest.approx(best, abs=1e-4)


def _exhaustive_best(params, prompt, steps, alpha, min_new_tokens=0):
    """The best length-penalised score of any hypothesis of at most ``steps`` tokens (brute force),
    EOS not allowed among the first ``min_new_tokens``."""
    best = -np.inf
    for seq in set(itertools.product(range(V), repeat=steps)):
        hyp = list(seq[: seq.index(EOS) + 1]) if EOS in seq else list(seq)
        if EOS in hyp[:min_new_tokens]:
            continue
        best = max(best, rescore(params, prompt, hyp) / float(length_penalty(len(hyp), alpha)))
    return best


def test_per_row_limits_end_each_row_as_its_own_search_would():
    """A row's hypotheses end at its own limit, exactly: its result is what a search with that
    max_new_tokens alone gives (tokens, scores), and with beams wider than the search space, the
    brute-force best within the limit. Before, a row batched with a longer limit got the first
    tokens of a longer hypothesis."""
    params, prompt, alpha = history_params(9, scale=2.0), [4, 7], 0.6
    start, lengths = jnp.asarray([prompt] * 3), jnp.asarray([2, 2, 2])
    limits = [1, 3, 2]
    out = beam_search(history_step, params, history_cache(3), start, lengths, max_new_tokens=3,
                      beam_size=V * V, alpha=alpha, max_new_tokens_per_row=np.array(limits))
    for row, limit in enumerate(limits):
        best = _exhaustive_best(params, prompt, limit, alpha)
        assert float(out.scores[row, 0]) == pytest.approx(best, abs=1e-4)
        assert int(out.lengths[row].max()) <= limit
        assert np.all(np.asarray(out.tokens[row, :, limit:]) == PAD)
    tokens, lengths = _ragged_batch(RAGGED)
    batched = beam_search(history_step, params, history_cache(3, 64), tokens, lengths, max_new_tokens=9,
                          beam_size=3, max_new_tokens_per_row=[4, 9, 2])
    for row, limit in enumerate([4, 9, 2]):
        alone = beam_search(history_step, params, history_cache(1, 64), tokens[row : row + 1],
                            lengths[row : row + 1], max_new_tokens=limit, beam_size=3)
        np.testing.assert_array_equal(batched.tokens[row, :, :limit], alone.tokens[0])
        np.testing.assert_allclose(batched.scores[row], alone.scores[0], atol=1e-5)
        np.testing.assert_array_equal(batched.lengths[row], alone.lengths[0])


def test_beam_min_new_tokens_forbids_early_eos():
    """min_new_tokens in beam search: the exhaustive best among hypotheses with no EOS in their
    first tokens (the other tokens keep their log-probabilities, as a logits processor would)."""
    params, prompt = history_params(9, scale=2.0), [4, 7]
    for min_new in (0, 2):
        out = beam_search(history_step, params, history_cache(1), jnp.asarray([prompt]), jnp.asarray([2]),
                          max_new_tokens=3, beam_size=V * V, alpha=0.0, min_new_tokens=min_new)
        assert float(out.scores[0, 0]) == pytest.approx(
            _exhaustive_best(params, prompt, 3, 0.0, min_new), abs=1e-4)
        hyps = np.asarray(out.tokens[0])[np.asarray(out.scores[0]) > -1e29]
        assert not np.any(hyps[:, :min_new] == EOS)
    assert _exhaustive_best(params, prompt, 3, 0.0, 2) < _exhaustive_best(params, prompt, 3, 0.0, 0)


def test_beam_search_compiles_once_and_validates():
    traces = []

    def counting_step(params, tokens, cache, num_valid):
        traces.append(1)
        return bigram_step(params, tokens, cache, num_valid)

    start, one = jnp.array([[2], [3]]), jnp.array([1, 1])
    beam_search(counting_step, _peaked_table(), bigram_cache(2), start, one, max_new_tokens=5)
    first, size = len(traces), _beam_search_jit._cache_size()
    for alpha in (0.0, 1.0):
        beam_search(counting_step, shift_table(), bigram_cache(2), start, one, max_new_tokens=5, alpha=alpha)
    assert len(traces) == first and _beam_search_jit._cache_size() == size
    for kwargs, message in [
        (dict(beam_size=0), "beam_size"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(alpha=-1.0), "alpha"),
        (dict(alpha=float("inf")), "alpha must be >= 0 and finite, got inf"),  # every score a -0.0 tie
        (dict(min_new_tokens=-1), "min_new_tokens"),
        (dict(max_new_tokens_per_row=[3]), r"max_new_tokens_per_row must be integers of shape \(2,\)"),
        (dict(max_new_tokens_per_row=[3, 6]), r"max_new_tokens_per_row must lie in \[1, max_new_tokens=5\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            beam_search(
                bigram_step, shift_table(), bigram_cache(2), start, one, **{"max_new_tokens": 5, **kwargs}
            )
    with pytest.raises(ValueError, match="empty prompt"):
        beam_search(bigram_step, shift_table(), bigram_cache(2), start, jnp.array([1, 0]), max_new_tokens=5)


def test_concrete_jax_scalars_are_taken_as_python_ones_and_padding_is_named():
    """temperature / top_p as jnp scalars were unhashable static arguments, min_new_tokens / top_k /
    beam_size as jnp scalars were 'must be an integer, got 2'; a learned position table that only
    the bucketed padding overflowed was blamed on the prompt and max_new_tokens."""
    import transformer_jax as tj

    config = tj.presets.tiny(vocab_size=100, norm="pre", num_encoder_layers=0)
    lm = tj.TransformerLM(config)
    params = lm.init(jax.random.key(0), jnp.ones((1, 8), jnp.int32))["params"]
    tokens, lengths = tj.decoding.pad_prompts([[5, 6, 7], [8, 9, 10, 11, 12]])

    def run(**kw):
        cache = tj.init_cache(config, 2, tokens.shape[1] + 8)
        return tj.decoding.generate(tj.LMStep(lm), params, cache, tokens, lengths, max_new_tokens=8,
                                    rng=jax.random.key(1), **kw).tokens

    python = run(temperature=0.8, top_p=0.9, top_k=5, min_new_tokens=2)
    arrays = run(temperature=jnp.float32(0.8), top_p=jnp.float32(0.9), top_k=jnp.int32(5),
                 min_new_tokens=jnp.int32(2))
    np.testing.assert_array_equal(python, arrays)
    np.testing.assert_array_equal(run(temperature=0.0), run(temperature=jnp.float32(0.0)))
    cache = tj.init_cache(config, 2, tokens.shape[1] + 8)
    beams = tj.decoding.beam_search(tj.LMStep(lm), params, cache, tokens, lengths, beam_size=jnp.int32(2),
                                    max_new_tokens=8)
    assert beams.tokens.shape[:2] == (2, 2)

    learned = tj.presets.tiny(vocab_size=100, num_encoder_layers=0, norm="pre", position="learned",
                              max_len=100)
    lm = tj.TransformerLM(learned)
    params = lm.init(jax.random.key(0), jnp.ones((1, 8), jnp.int32))["params"]
    tokens, lengths = tj.decoding.pad_prompts([list(range(3, 73))])  # 70 tokens, padded to 128
    with pytest.raises(ValueError, match=r"padded to 128 positions: pad_prompts\(\.\.\., buckets=\.\.\.\)"):
        tj.decoding.generate(tj.LMStep(lm), params, tj.init_cache(learned, 1, 144), tokens, lengths,
                             max_new_tokens=16)
