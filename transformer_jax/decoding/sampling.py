"""Autoregressive sampling with a KV cache: one prefill call, then a ``lax.while_loop`` over new
tokens that stops once every row has ended (``lax.scan`` of a fixed length without an ``eos_id``).

The sampler knows nothing about the model. It drives a *step function*::

    step_fn(params, tokens [B, L] int32, cache, num_valid [B] int32)
        -> (logits float32 [B, L, V] or [B, 1, V], new_cache)

which appends ``tokens`` to each row of ``cache`` (only the first ``num_valid[b]`` of row ``b`` are
real) and returns next-token logits for every input position, or ([B, 1, V]) only for each row's
last real token, the one the sampler reads. ``params`` is passed through as a
jit argument, never baked into the compiled program as a constant, so one compilation serves any
parameter values of the same shapes. ``step_fn`` itself is a static (hashable) jit argument: pass
the same object (a module-level function, or a frozen dataclass such as ``model_steps.LMStep``) on
every call and nothing recompiles.

Decoding is compiled once per (step_fn, batch, prompt length, max_new_tokens, top_k, eos/pad ids,
greedy or not, top-p on or off) and the shapes of ``params``/``cache``. Temperature, the top-p
mass and ``min_new_tokens`` are traced values: changing them does not recompile. Use
``bucket_length`` / ``pad_prompts`` so prompts of different lengths share a compilation.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.modeling import native

StepFn = Callable[[Any, jax.Array, Any, jax.Array], tuple[jax.Array, Any]]

NEG_INF = -1e30  # finite, so masked rows never produce NaN in softmax


class GenerateOutput(NamedTuple):
    """Result of `generate`.

    tokens:   int32 [B, T] generated tokens (prompt excluded); ``pad_id`` after a row's EOS.
    lengths:  int32 [B] number of generated tokens per row, counting the EOS (T if no EOS).
    logprobs: float32 [B, T] log-probability of each generated token under the model's
              distribution (log-softmax of the raw logits, before temperature, top-k or top-p;
              while ``min_new_tokens`` forbids EOS, over the tokens other than EOS, as
              transformers' ``compute_transition_scores(..., normalize_logits=True)`` gives);
              0 after EOS.
    """

    tokens: jax.Array
    lengths: jax.Array
    logprobs: jax.Array


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to pick each next token. ``temperature=0`` is greedy (argmax) decoding.

    top_k=0 disables top-k; top_p=1.0 disables nucleus (top-p) filtering. They combine:
    logits are divided by the temperature, then cut to the top k, then to the smallest set whose
    probability reaches top_p. ``min_new_tokens`` forbids EOS before that many tokens.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_new_tokens: int = 0

    def __post_init__(self):
        # temperature, top_p and min_new_tokens may be traced (generate called inside a jit of
        # your own): their values are checked when they are concrete.
        for name in ("temperature", "top_p"):  # None, a string or a per-row array: a TypeError in the check
            value = getattr(self, name)
            if not _traced(value) and not _is_real(value):
                shape = getattr(value, "shape", None)
                raise ValueError(f"{name} must be one number (the same for every row), got "
                                 + (f"an array of shape {tuple(shape)}" if shape else repr(value)))
        if not _traced(self.temperature) and not 0.0 <= self.temperature < float("inf"):
            # inf would turn the -1e30 masks (EOS before min_new_tokens, banned tokens) into 0
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature}")
        if not _is_whole(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer (0 = off), got {self.top_k}")
        if not _traced(self.top_p) and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _traced(self.min_new_tokens) and (not _is_whole(self.min_new_tokens)
                                                  or self.min_new_tokens < 0):
            raise ValueError(f"min_new_tokens must be a non-negative integer, got {self.min_new_tokens}")

    @property
    def greedy(self) -> bool | None:
        """Greedy decoding; None for a traced temperature (decided per call, in the program)."""
        if _traced(self.temperature):
            return None
        return bool(self.temperature == 0.0)  # a Python bool from a concrete jax scalar too (static)

    @property
    def filters_top_p(self) -> bool:
        """Whether the top-p filter is compiled in: a traced top_p always is (1.0 keeps every token)."""
        return _traced(self.top_p) or bool(self.top_p < 1.0)


def _traced(value) -> bool:
    return isinstance(value, jax.core.Tracer)


def _sampling_settings(sampling: SamplingConfig | None, **keywords) -> SamplingConfig:
    """``sampling``, or a `SamplingConfig` of the keywords; both at once is a ValueError naming the
    keywords given (a keyword at its default counts as not given)."""
    if sampling is None:
        return SamplingConfig(**keywords)
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    defaults = SamplingConfig()
    given = [name for name, value in keywords.items()
             if _traced(value) or not _same(value, getattr(defaults, name))]
    if given:
        raise ValueError(f"sampling=SamplingConfig(...) and {'=, '.join(given)}= given together: pass the "
                         f"sampling settings one way, e.g. sampling=dataclasses.replace(sampling, "
                         f"{given[0]}=...)")
    return sampling


def _same(value, default) -> bool:
    try:
        return bool(value == default)
    except Exception:  # an array of several values
        return False


# --------------------------------------------------------------------------- prompt bucketing


def bucket_length(length: int, buckets: Sequence[int] | None = None, min_length: int = 8) -> int:
    """Smallest bucket >= ``length``: a power of two (at least ``min_length``) by default.

    Padding prompts up to a few bucket lengths lets prompts of different lengths share one
    compiled decoder instead of compiling once per exact length.
    """
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if buckets is None:
        return max(min_length, 1 << (int(length) - 1).bit_length())
    fitting = [b for b in buckets if b >= length]
    if not fitting:
        raise ValueError(f"length {length} exceeds the largest bucket {max(buckets)}")
    return min(fitting)


def pad_prompts(
    prompts: Sequence[Sequence[int]],
    *,
    pad_id: int = 0,
    buckets: Sequence[int] | None = None,
    min_length: int = 8,
) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads token lists into ``(tokens int32 [B, P], lengths int32 [B])``.

    P is ``bucket_length(longest prompt, buckets, min_length)``. The KV cache given to `generate`
    must hold max(P, longest prompt + max_new_tokens - 1) positions (the padding is written to the
    cache during prefill, then overwritten; the last new token is never fed back).
    """
    if len(prompts) == 0:  # not `not prompts`: a 2-D array of prompts has no truth value
        raise ValueError("no prompts given")
    if any(np.ndim(p) != 1 for p in prompts):
        raise ValueError("pad_prompts takes a list of prompts, each a list of token ids "
                         "(one prompt: pad_prompts([prompt]))")
    lengths = np.array([len(p) for p in prompts], np.int32)
    if lengths.min() < 1:
        raise ValueError(f"empty prompt at index {int(lengths.argmin())}")
    width = bucket_length(int(lengths.max()), buckets, min_length)
    tokens = np.full((len(prompts), width), pad_id, np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    return tokens, lengths


def pad_to_bucket(
    prompt_tokens, *, pad_id: int = 0, buckets: Sequence[int] | None = None, min_length: int = 8
) -> np.ndarray:
    """Right-pads an already batched ``[B, P]`` prompt array along P up to its bucket length."""
    prompt_tokens = np.asarray(prompt_tokens)
    if prompt_tokens.ndim != 2 or prompt_tokens.shape[1] == 0:
        raise ValueError(
            f"prompt_tokens must be [batch, length] with length >= 1, got shape {prompt_tokens.shape}")
    width = bucket_length(prompt_tokens.shape[1], buckets, min_length)
    return np.pad(prompt_tokens, ((0, 0), (0, width - prompt_tokens.shape[1])), constant_values=pad_id)


# --------------------------------------------------------------------------- token choice


def _top_k_mask(logits: jax.Array, k: int) -> jax.Array:
    """Keeps the k largest logits per row [B, V]; ties with the k-th value are kept too."""
    # The k-th largest as the smallest of the top k: XLA turns a slice of top_k's output into a
    # sort of the whole row (GPT-2's [8, 50257] logits: 52 ms against 0.5 ms on CPU).
    kth = jnp.min(jax.lax.top_k(logits, min(k, logits.shape[-1]))[0], axis=-1, keepdims=True)
    return jnp.where(logits < kth, NEG_INF, logits)


def _ordered_bits(x: jax.Array) -> jax.Array:
    """int32 keys that order as the float32 values do, equal for equal values (-0.0 is 0.0)."""
    x = x.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0.0, 0.0, x), jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


# Tokens taken from the top of each row (`lax.top_k`) as the nucleus's candidates: where they hold
# top_p of the probability, the cut-off lies among them and their cumulative sum finds it (GPT-2's
# [8, 50257] logits, one core: ~1.0 ms against ~4.2 ms for the bisection); a row whose nucleus is
# larger sends the step to the bisection (~0.35 ms more than the bisection alone).
TOP_P_CANDIDATES = 128


def _top_p_mask(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """Nucleus filtering (Holtzman et al. 2019) on [B, V]: keep the smallest set of most likely
    tokens whose probability reaches ``top_p``; the most likely token is always kept. Tokens of
    equal logits are ranked by id (the lower first), so ties at the cut-off do not widen the set.

    Without sorting (XLA:CPU sorts GPT-2's [8, 50257] logits in ~60 ms, ten decoding steps): token
    i is kept when the mass ranked before it is below top_p. Where a row's TOP_P_CANDIDATES most
    likely tokens hold top_p of its mass, the kept ones are a prefix of them (`lax.top_k` ranks
    equal values by id); otherwise the last kept logit t is the smallest logit value with
    mass(logits > t) < top_p, found by bisection over the values' ordered bit patterns (32 masked
    sums over the row), and of the tokens tied at t the first ones by id are kept while the mass
    before them stays below top_p."""
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    width = logits.shape[-1]
    values = jnp.where(logits == 0.0, 0.0, logits)  # -0.0 as 0.0: top_k puts it below 0.0
    ids = jnp.arange(width, dtype=jnp.int32)
    top, at = jax.lax.top_k(values, min(TOP_P_CANDIDATES, width))
    p_top = jnp.take_along_axis(probs, at, axis=-1)
    ahead = jnp.cumsum(p_top, axis=-1) - p_top  # the mass ranked before each candidate
    covered = (ahead[:, -1] + p_top[:, -1] >= top_p) | (top.shape[-1] == width)
    last = jnp.sum(ahead < top_p, axis=-1, keepdims=True) - 1  # >= 0: ahead[0] = 0 < top_p

    def among_candidates():
        t = jnp.take_along_axis(top, last, axis=-1)
        t_id = jnp.take_along_axis(at, last, axis=-1)
        return (values > t) | ((values == t) & (ids <= t_id))

    def by_bisection():
        keys = _ordered_bits(logits)
        mass_above = lambda k: jnp.sum(jnp.where(keys > k[:, None], probs, 0.0), axis=-1)  # [B]

        def halve(_, bounds):  # invariant: mass_above(hi) < top_p <= mass_above(lo), or hi = lo + 1
            lo, hi = bounds
            mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
            below = mass_above(mid) < top_p
            return jnp.where(below, lo, mid), jnp.where(below, mid, hi)

        lo = jnp.min(keys, axis=-1) - 1  # (-inf's key is far above int32's minimum: no overflow)
        hi = jnp.max(keys, axis=-1)
        _, cut = jax.lax.fori_loop(0, 32, halve, (lo, hi))
        before = mass_above(cut)[:, None]
        tied = keys == cut[:, None]
        p_tied = jnp.max(jnp.where(tied, probs, 0.0), axis=-1, keepdims=True)
        rank = jnp.cumsum(tied, axis=-1, dtype=jnp.int32) - 1  # among the tied tokens, by id
        return (keys > cut[:, None]) | (tied & (before + rank * p_tied < top_p))

    # A row's nucleus does not depend on the others': where the bisection runs, the rows the
    # candidates cover still take theirs.
    keep = jax.lax.cond(jnp.all(covered), among_candidates,
                        lambda: jnp.where(covered[:, None], among_candidates(), by_bisection()))
    return jnp.where(keep | (top_p >= 1.0), logits, NEG_INF)


def _first_argmax(logits_t: jax.Array, col_max: jax.Array) -> jax.Array:
    """Index of the first maximum of each column of vocabulary-major logits [V, B], given the
    column maxima [1, B].

    Same result as ``jnp.argmax`` over the vocabulary for finite logits. Written as a min over
    matching indices because XLA:CPU runs that as two plain reductions, several times faster than
    argmax's (value, index) reduction (1.3 ms -> 0.4 ms over 8 x 50257 logits).
    """
    vocab = logits_t.shape[0]
    iota = jnp.arange(vocab, dtype=jnp.int32)[:, None]
    index = jnp.min(jnp.where(logits_t == col_max, iota, vocab), axis=0)
    return jnp.minimum(index, vocab - 1)  # a column of NaNs matches nothing


def _greedy_xla(logits_t):
    col_max = jnp.max(logits_t, axis=0, keepdims=True)
    log_total = jnp.log(jnp.sum(jnp.exp(logits_t - col_max), axis=0))  # logsumexp - max
    return _first_argmax(logits_t, col_max), log_total


SAMPLE_BLOCK = 128  # tokens per block of `sample_from_logits`'s cumulative sums


def _last_nonzero(x: jax.Array) -> jax.Array:
    """Index of the last nonzero entry along the last axis (0 where all are zero)."""
    n = x.shape[-1]
    return n - 1 - jnp.argmax(x[..., ::-1] > 0, axis=-1)


def sample_from_logits(u: jax.Array, logits: jax.Array) -> jax.Array:
    """One token per row of ``logits`` [B, V] (taken in float32), drawn with probability
    softmax(logits), from ``u`` [B] uniform in [0, 1): the first token whose cumulative probability
    exceeds ``u`` times the row's total (inverse transform sampling).

    The cumulative sums are taken over blocks of `SAMPLE_BLOCK` tokens, then inside the one block
    that holds the answer: a few passes over the logits and one random number per row, where
    Gumbel-max sampling (`jax.random.categorical`) draws and takes two logarithms of one random
    number per token: [8, 50257] on a CPU ~5.7 against ~0.2 ms. A token whose probability
    underflows to 0 in float32 (e**-104 of the most likely one), or that is masked, is never drawn;
    rounding at a boundary falls back to the last token with nonzero probability.
    """
    batch, vocab = logits.shape
    logits = logits.astype(jnp.float32)  # sums of bf16 probabilities would round at every block
    top = jnp.max(logits, axis=-1, keepdims=True)
    # A +inf logit (a forced token, or a finite one over a tiny temperature) takes all the mass:
    # inf - inf would make every sum from it on NaN.
    p = jnp.where(jnp.isposinf(top), (logits == jnp.inf).astype(jnp.float32), jnp.exp(logits - top))
    blocks = jnp.pad(p, ((0, 0), (0, -vocab % SAMPLE_BLOCK))).reshape(batch, -1, SAMPLE_BLOCK)
    block_mass = jnp.sum(blocks, axis=-1)  # [B, blocks]
    through = jnp.cumsum(block_mass, axis=-1)  # cumulative mass up to each block's end
    target = u.astype(jnp.float32) * through[:, -1]
    # The first block whose cumulative mass exceeds the target (sums only grow, so counting the
    # blocks at or under it finds it); never past the last block with any mass.
    block = jnp.minimum(jnp.sum(through <= target[:, None], axis=-1), _last_nonzero(block_mass))
    previous = jnp.take_along_axis(through, jnp.maximum(block - 1, 0)[:, None], axis=-1)[:, 0]
    before = jnp.where(block > 0, previous, 0.0)  # the mass of the blocks before it
    inside = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]  # [B, SAMPLE_BLOCK]
    within = jnp.cumsum(inside, axis=-1) + before[:, None]
    offset = jnp.minimum(jnp.sum(within <= target[:, None], axis=-1), _last_nonzero(inside))
    return (block * SAMPLE_BLOCK + offset).astype(jnp.int32)


def _choose(logits, rng, step, temperature, top_p, min_new_tokens, *, greedy, top_k, use_top_p, eos_id,
            cpu_kernels="xla"):
    """Picks one token per row from next-token logits [B, V]; returns (tokens [B], logprobs [B]).

    The log-probability is ``logit[token] - logsumexp(logits)``: one pass for the row maximum, one
    for the sum of exponentials, and no [B, V] log-softmax array written out. Greedy choice on a
    CPU runs `native.greedy_choice` where `native.use_native(cpu_kernels)`.
    """
    logits = logits.astype(jnp.float32)
    if eos_id is not None:
        # EOS is forbidden before min_new_tokens generated tokens.
        too_early = step < min_new_tokens
        logits = logits.at[:, eos_id].set(jnp.where(too_early, NEG_INF, logits[:, eos_id]))
    # The maximum and the log-sum-exp are reduced over a [V, B] view: on CPU a decoding step's
    # head product leaves its logits vocabulary-major (see `matmul.contract_transposed`), and XLA
    # then reads them in place instead of transposing 8 x 50257 floats first (~0.3 ms of a 21 ms
    # GPT-2-small step).
    logits_t = logits.T
    if greedy:  # the chosen logit is the maximum: its log-probability is -(logsumexp - max)
        if native.use_native(cpu_kernels):
            tokens, log_total = jax.lax.platform_dependent(logits_t, cpu=native.greedy_choice,
                                                           default=_greedy_xla)
        else:
            tokens, log_total = _greedy_xla(logits_t)
        return tokens, -log_total
    col_max = jnp.max(logits_t, axis=0, keepdims=True)
    log_total = jnp.log(jnp.sum(jnp.exp(logits_t - col_max), axis=0))  # logsumexp - max
    # greedy=None: a traced temperature, which may be 0 (argmax) or not (sampling). One that is 0
    # in float32 (1e-50) divides as its smallest normal number: the limit, argmax.
    divisor = temperature if greedy is not None else jnp.where(temperature > 0, temperature, 1.0)
    divisor = jnp.maximum(divisor, jnp.finfo(jnp.float32).tiny)
    # The row's maximum is taken off before dividing (a finite one; rows with a +inf logit below):
    # the likeliest token's value is 0 and no other overflows to +inf at any
    # temperature, and the others are held at 0.5 * NEG_INF or above, over the masked logits (EOS
    # before min_new_tokens, banned tokens: NEG_INF). Divided by a tiny temperature, real logits
    # fell under NEG_INF and the masked tokens were drawn (1e-29), or overflowed and were drawn
    # alike (1e-38); divided by a huge one, the masked came near 0: they are set back to NEG_INF.
    shift = jnp.where(jnp.isfinite(col_max), col_max, 0.0).T
    scaled = jnp.maximum((logits - shift) / divisor, 0.5 * NEG_INF)
    # A row with a +inf logit: those tokens alone (a finite one over a tiny temperature overflowed
    # to +inf as well and shared the draw).
    forced = jnp.where(logits == jnp.inf, 0.0, 0.5 * NEG_INF)
    scaled = jnp.where(jnp.isposinf(col_max.T), forced, scaled)
    scaled = jnp.where(logits <= NEG_INF, NEG_INF, scaled)
    if top_k:
        scaled = _top_k_mask(scaled, top_k)
    if use_top_p:
        scaled = _top_p_mask(scaled, top_p)
    if rng.ndim:  # one key per row
        u = jax.vmap(lambda key: jax.random.uniform(key, ()))(rng)
    else:
        u = jax.random.uniform(rng, (logits.shape[0],))
    tokens = sample_from_logits(u, scaled)
    if greedy is None:
        tokens = jnp.where(temperature > 0, tokens, _first_argmax(logits_t, col_max))
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    return tokens, chosen - col_max[0] - log_total


# --------------------------------------------------------------------------- the decoding loop


def _cpu_kernels(step_fn) -> str:
    """The model's `ModelConfig.cpu_kernels` for a step function that carries one (`LMStep`,
    `Seq2SeqStep`); 'auto' for any other."""
    return getattr(step_model_config(step_fn), "cpu_kernels", "auto")


def _last_valid(logits: jax.Array, num_valid: jax.Array) -> jax.Array:
    """logits [B, L, V] -> [B, V] at position num_valid - 1 of each row; [B, 1, V] holds only
    those positions already."""
    if logits.shape[1] == 1:
        return logits[:, 0]
    index = (num_valid - 1)[:, None, None]
    return jnp.take_along_axis(logits, index, axis=1)[:, 0]


def _prefill(step_fn, params, prompt_tokens: jax.Array, cache, prompt_lengths: jax.Array):
    """The prompt's one model call, with the padding after each row's length set to token 0: it is
    not read, but it is looked up. An id past the table (a tokenizer's pad id at vocab_size) gave
    NaN keys and values in the masked cache slots, and on XLA's attention a masked probability of
    0 times NaN is NaN: every row's tokens were wrong and its log-probabilities NaN."""
    real = jnp.arange(prompt_tokens.shape[1])[None, :] < prompt_lengths[:, None]
    return step_fn(params, jnp.where(real, prompt_tokens, 0), cache, prompt_lengths)


_GENERATE_STATIC = ("step_fn", "max_new_tokens", "greedy", "top_k", "use_top_p", "eos_id", "pad_id")


def _generate_program(
    step_fn,
    params,
    cache,
    prompt_tokens,
    prompt_lengths,
    rng,
    temperature,
    top_p,
    min_new_tokens,
    limits,
    *,
    max_new_tokens,
    greedy,
    top_k,
    use_top_p,
    eos_id,
    pad_id,
):
    choose = functools.partial(
        _choose,
        temperature=temperature,
        top_p=top_p,
        min_new_tokens=min_new_tokens,
        greedy=greedy,
        top_k=top_k,
        use_top_p=use_top_p,
        eos_id=eos_id,
        cpu_kernels=_cpu_kernels(step_fn),
    )
    batch = prompt_tokens.shape[0]

    # Prefill: the whole (right-padded) prompt in one call; row b's next-token logits sit at
    # position prompt_lengths[b] - 1.
    logits, cache = _prefill(step_fn, params, prompt_tokens, cache, prompt_lengths)
    logits = _last_valid(logits, prompt_lengths).astype(jnp.float32)
    ones = jnp.ones((batch,), jnp.int32)

    # The first token comes from the prefill's logits; each loop step then runs the model on the
    # latest token and picks the next one from the logits it just produced, so only tokens (never
    # a [B, V] logits array) cross from one step to the next: XLA then reads the logits in the
    # layout the head product wrote them.
    def emit(logits, rng, done, step):
        if rng.ndim:  # one key per row: each row's stream is its own
            pairs = jax.vmap(jax.random.split)(rng)
            rng, key = pairs[:, 0], pairs[:, 1]
        else:
            rng, key = jax.random.split(rng)
        token, logprob = choose(logits, key, step)
        token = jnp.where(done, pad_id, token)
        logprob = jnp.where(done, 0.0, logprob)
        done = done if eos_id is None else done | (token == eos_id)
        if limits is not None:  # a row's last allowed token
            done = done | (step + 1 >= limits)
        return token, logprob, rng, done

    token, logprob, rng, done = emit(logits, rng, jnp.zeros((batch,), bool), jnp.int32(0))

    def advance(cache, token, rng, done, step):
        logits, cache = step_fn(params, token[:, None], cache, ones)
        return (cache, *emit(logits[:, 0].astype(jnp.float32), rng, done, step))

    if eos_id is None:
        # No row can stop early: a scan of max_new_tokens - 1 steps.
        def body(carry, _):
            cache, token, rng, done, step = carry
            cache, token, logprob, rng, done = advance(cache, token, rng, done, step)
            return (cache, token, rng, done, step + 1), (token, logprob)

        carry = (cache, token, rng, done, jnp.int32(1))
        (cache, *_), (tokens, logprobs) = jax.lax.scan(body, carry, None, length=max_new_tokens - 1)
        tokens = jnp.concatenate([token[None], tokens], axis=0).T
        logprobs = jnp.concatenate([logprob[None], logprobs], axis=0).T
    else:
        # A while loop that ends once every row is done, writing each step's tokens into buffers
        # that start as padding (what a finished row gets). A scan with the step in a `lax.cond`
        # (skipping the model once all rows are done) made XLA:CPU copy every layer's cache in and
        # out of the cond on every step: a bf16 GPT-2-small step at batch 8 took 10.2 against
        # 7.9 ms with a 96-position cache, 19.8 against 6.5 ms with 544.
        def running(carry):
            step, done = carry[4], carry[3]
            return (step < max_new_tokens) & ~jnp.all(done)

        def step_once(carry):
            cache, token, rng, done, step, tokens, logprobs = carry
            cache, token, logprob, rng, done = advance(cache, token, rng, done, step)
            tokens = jax.lax.dynamic_update_index_in_dim(tokens, token, step, 0)
            logprobs = jax.lax.dynamic_update_index_in_dim(logprobs, logprob, step, 0)
            return cache, token, rng, done, step + 1, tokens, logprobs

        tokens = jnp.full((max_new_tokens, batch), pad_id, jnp.int32).at[0].set(token)
        logprobs = jnp.zeros((max_new_tokens, batch), jnp.float32).at[0].set(logprob)
        carry = (cache, token, rng, done, jnp.int32(1), tokens, logprobs)
        cache, *_, tokens, logprobs = jax.lax.while_loop(running, step_once, carry)
        tokens, logprobs = tokens.T, logprobs.T
    lengths = _lengths(tokens, eos_id)
    if limits is not None:
        lengths = jnp.minimum(lengths, limits)
    return GenerateOutput(tokens, lengths, logprobs), cache


# Two programs from `_generate_program`. `_generate_jit` returns the tokens alone: the cache it
# was given stays the caller's, so the decoding loop works in a copy of it (XLA cannot write into
# an argument's buffers). `_generate_donating` takes the cache's buffers over and hands them back
# as its second result, so the loop decodes in them: one cache in memory, not two.
_generate_jit = jax.jit(functools.wraps(_generate_program)(lambda *a, **k: _generate_program(*a, **k)[0]),
                        static_argnames=_GENERATE_STATIC)
_generate_donating = jax.jit(_generate_program, static_argnames=_GENERATE_STATIC, donate_argnames=("cache",))


def _lengths(tokens: jax.Array, eos_id: int | None) -> jax.Array:
    """Generated length per row [B], counting the first EOS; T when a row has none."""
    steps = tokens.shape[1]
    if eos_id is None:
        return jnp.full(tokens.shape[:1], steps, jnp.int32)
    is_eos = tokens == eos_id
    return jnp.where(is_eos.any(axis=1), jnp.argmax(is_eos, axis=1) + 1, steps).astype(jnp.int32)


def _check_prompt(prompt_tokens, prompt_lengths, step_fn=None) -> None:
    """Shape/dtype checks always; value checks when the lengths are concrete, and, where the step
    function carries its model's config, the prompt's real tokens (not the padding after each
    row's length) against the vocabulary when they are concrete: inside the decoding program an id
    past the table looks up NaN and a negative one counts from its end, silently."""
    if prompt_tokens.ndim != 2:
        raise ValueError(f"prompt_tokens must be [batch, length], got shape {prompt_tokens.shape}")
    if prompt_tokens.shape[1] == 0:
        raise ValueError(
            "prompt_tokens has length 0: every row needs at least one token "
            "(e.g. BOS or the decoder start token)"
        )
    if prompt_lengths.shape != prompt_tokens.shape[:1]:
        raise ValueError(
            f"prompt_lengths must have shape {prompt_tokens.shape[:1]}, got {prompt_lengths.shape}"
        )
    if not jnp.issubdtype(prompt_tokens.dtype, jnp.integer):
        raise ValueError(f"prompt_tokens must be integer, got {prompt_tokens.dtype}")
    if not jnp.issubdtype(prompt_lengths.dtype, jnp.integer):
        raise ValueError(f"prompt_lengths must be integer, got {prompt_lengths.dtype}")
    if isinstance(prompt_lengths, jax.core.Tracer):
        return
    lengths = np.asarray(prompt_lengths)
    if (lengths < 1).any():
        rows = np.flatnonzero(lengths < 1).tolist()
        raise ValueError(
            f"empty prompt (length < 1) in rows {rows}: every row needs at least "
            "one token (e.g. BOS or the decoder start token)"
        )
    if (lengths > prompt_tokens.shape[1]).any():
        raise ValueError(
            f"prompt_lengths exceed the prompt width {prompt_tokens.shape[1]}: {lengths.tolist()}"
        )
    config = step_model_config(step_fn)
    if (config is None or isinstance(prompt_tokens, jax.core.Tracer)
            or not getattr(prompt_tokens, "is_fully_addressable", True)):  # another process holds rows
        return
    tokens = np.asarray(prompt_tokens)
    real = np.arange(tokens.shape[1])[None, :] < lengths[:, None]
    bad = real & ((tokens < 0) | (tokens >= config.vocab_size))
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"prompt_tokens holds token id {int(tokens[row, col])} at row {row}, position {col}, "
            f"outside the model's vocabulary [0, {config.vocab_size})")


def _check_cache(step_fn, cache, prompt_tokens, prompt_lengths, max_new_tokens: int, limits=None) -> None:
    """Checks, before tracing, that ``cache`` is built for this batch and has room for the prompt
    and ``max_new_tokens``, and that the positions decoding reaches are ones the model has.

    A `KVCache` too small would not fail by itself: the cache write clamps its start index, so a
    step past the end would overwrite the last slots and decode wrong tokens silently. A learned
    position table looked up past its end gives NaN logits.
    """
    batch, width = prompt_tokens.shape
    for leaf in jax.tree.leaves(cache):
        if getattr(leaf, "ndim", 0) and leaf.shape[0] != batch:
            raise ValueError(
                f"the cache is built for batch size {leaf.shape[0]}, the prompts have {batch} rows: "
                f"build it for {batch}")
    if isinstance(prompt_lengths, jax.core.Tracer):
        longest = width
    else:
        longest = int(np.max(np.asarray(prompt_lengths)))
    # The prefill writes the whole padded prompt; the last decoding step writes the token before
    # the last one generated (the last one is never fed back).
    needed = max(width, longest + max_new_tokens - 1)
    capacity = getattr(cache, "max_length", None)
    if capacity is None and isinstance(cache, dict) and set(cache) == {"tokens", "lengths"}:
        # `recompute_cache`'s token buffer: writes past its end would be dropped and the logits
        # read from its last slot
        capacity = cache["tokens"].shape[1]
    if capacity is not None and needed > capacity:
        kind = "KV cache" if hasattr(cache, "max_length") else "token buffer"
        raise ValueError(
            f"the {kind} holds {capacity} positions per row, but a prompt of {longest} tokens "
            f"(padded to {width}) and max_new_tokens={max_new_tokens} need {needed}: build the "
            f"cache with max_length >= {needed}, or generate fewer tokens")
    # A learned position table looked up past its end gives NaN; computed positions extend.
    config = step_model_config(step_fn)
    if config is None or config.position != "learned":
        return
    positions = config.max_len
    reached = needed
    if limits is not None and not isinstance(limits, jax.core.Tracer) and not isinstance(
            prompt_lengths, jax.core.Tracer):
        # A row stops at its own limit; the steps after it compute padding that is thrown away.
        reached = max(width, int(np.max(np.asarray(prompt_lengths) + np.asarray(limits))) - 1)
    if reached > positions:
        raise ValueError(
            f"decoding would reach position {reached - 1}, but the model's learned position table "
            f"has {positions} rows (ModelConfig.max_len): shorten the prompt or max_new_tokens so "
            f"that they fit in {positions} positions"
            + (f" (the prompts are padded to {width} positions: pad_prompts(..., buckets=...) with a "
               f"bucket of at most {positions} pads them less)" if width > longest else ""))


def _is_real(value) -> bool:
    """A real number, not a bool, None or a string; a concrete 0-d array holding one is one too."""
    if isinstance(value, jax.Array | np.ndarray) and value.ndim == 0:
        value = value.item()
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _is_whole(value) -> bool:
    """An integer (or a float with an integer value), not a bool, None or a string; a concrete
    0-d jax array holding one is one too."""
    if isinstance(value, jax.Array) and not _traced(value) and value.ndim == 0:
        value = value.item()
    return (isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
            and float(value).is_integer())


def _check_rng(rng, batch: int):
    """``rng`` as typed keys: one key (shape ()) or one per row ([batch]); raw uint32 keys are
    wrapped. Anything else is an error naming it."""
    if not jax.dtypes.issubdtype(getattr(rng, "dtype", None), jax.dtypes.prng_key):
        what = f"{getattr(rng, 'dtype', type(rng).__name__)}{list(getattr(rng, 'shape', ()))}"
        try:
            rng = jax.random.wrap_key_data(rng)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"rng must be a PRNG key (jax.random.key(seed)) or one key per row; got {what}"
            ) from e
    if rng.shape not in ((), (batch,)):
        raise ValueError(
            f"rng holds keys of shape {rng.shape}: give one key, or one per row (shape ({batch},))"
        )
    return rng


def _check_max_new_tokens(max_new_tokens) -> None:
    if not _is_whole(max_new_tokens) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")


def _row_limits(max_new_tokens_per_row, batch: int, max_new_tokens: int):
    """``max_new_tokens_per_row`` checked and as int32 [B]; None stays None."""
    if max_new_tokens_per_row is None:
        return None
    limits = jnp.asarray(max_new_tokens_per_row)
    if limits.shape != (batch,) or not jnp.issubdtype(limits.dtype, jnp.integer):
        raise ValueError(f"max_new_tokens_per_row must be integers of shape ({batch},), got "
                         f"{limits.dtype} {limits.shape}")
    if not isinstance(limits, jax.core.Tracer):
        values = np.asarray(limits)
        if (values < 1).any() or (values > max_new_tokens).any():
            raise ValueError(f"max_new_tokens_per_row must lie in [1, max_new_tokens="
                             f"{max_new_tokens}], got {values.tolist()}")
    return limits.astype(jnp.int32)


# The default of `eos_id` / `pad_id`: the model's own (``ModelConfig.eos_id`` / ``pad_id``) when the
# step function carries one (`LMStep`, `Seq2SeqStep` and wrappers with a ``step`` attribute), else 1 / 0.
# A model without a pad id (GPT-2) pads finished rows with its EOS, as Hugging Face's generate does:
# 0 is a real token there ('!'), so a row printed whole would end in '!!!!'.
FROM_MODEL = "model"
DEFAULT_EOS_ID, DEFAULT_PAD_ID = 1, 0


def step_model_config(step_fn) -> Any | None:
    """The `ModelConfig` behind ``step_fn`` (``step_fn.model.config``, looking through wrappers that
    keep the wrapped step function as ``.step``), or None."""
    for _ in range(16):
        model = getattr(step_fn, "model", None)
        if model is not None and hasattr(model, "config"):
            return model.config
        step_fn = getattr(step_fn, "step", None)
        if step_fn is None:
            return None
    return None


def resolve_special_ids(step_fn, eos_id, pad_id) -> tuple[int | None, int]:
    """(eos_id, pad_id) with `FROM_MODEL` replaced by the model's ids (see `FROM_MODEL`)."""
    config = step_model_config(step_fn)
    if isinstance(eos_id, str):
        if eos_id != FROM_MODEL:
            raise ValueError(f"eos_id must be an integer, None or {FROM_MODEL!r}, got {eos_id!r}")
        eos_id = config.eos_id if config is not None else DEFAULT_EOS_ID
    if isinstance(pad_id, str):
        if pad_id != FROM_MODEL:
            raise ValueError(f"pad_id must be an integer or {FROM_MODEL!r}, got {pad_id!r}")
        if config is None:
            pad_id = DEFAULT_PAD_ID
        elif config.pad_id is not None:
            pad_id = config.pad_id
        else:
            pad_id = eos_id if eos_id is not None else DEFAULT_PAD_ID
    eos_id = None if eos_id is None else _token_id("eos_id", eos_id, config)
    return eos_id, _token_id("pad_id", pad_id, config)


def _token_id(name: str, value, config) -> int:
    """``value`` as a token id: an integer, in [0, vocab_size) where the model's config is known
    (an id past the vocabulary would never be emitted, so rows would never stop; a negative one
    would mask the last tokens of the vocabulary instead)."""
    if not _is_whole(value):
        raise ValueError(f"{name} must be an integer token id, got {value!r}")
    value = int(value)
    limit = config.vocab_size if config is not None else None
    if value < 0 or (limit is not None and value >= limit):
        where = f"[0, vocab_size={limit})" if limit is not None else ">= 0"
        raise ValueError(f"{name}={value} is not a token id of the model: it must lie in {where}")
    return value


def generate(
    step_fn: StepFn,
    params: Any,
    cache: Any,
    prompt_tokens,
    prompt_lengths,
    *,
    max_new_tokens: int,
    rng: jax.Array | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_new_tokens: int = 0,
    max_new_tokens_per_row=None,
    eos_id: int | None | str = FROM_MODEL,
    pad_id: int | str = FROM_MODEL,
    donate_cache: bool = False,
    sampling: SamplingConfig | None = None,
) -> GenerateOutput:
    """Samples up to ``max_new_tokens`` tokens after each prompt.

    Args:
      step_fn: ``step_fn(params, tokens [B, L], cache, num_valid [B])``
        ``-> (logits [B, L, V] or [B, 1, V] at each row's last real token, cache)``;
        hashable (it is a static jit argument).
      params: passed to ``step_fn`` unchanged (any pytree, may be None).
      cache: the step function's state, empty, with room for max(P, longest prompt + max_new_tokens
        - 1) positions (checked for a `KVCache`); every leaf has the batch as its leading axis.
      prompt_tokens: int32 [B, P], right-padded. Prefilled in one ``step_fn`` call.
      prompt_lengths: int32 [B], each in [1, P].
      max_new_tokens: T, the number of decoding steps (static).
      rng: PRNG key, or one key per row (typed keys [B], or raw uint32 keys [B, 2]); required
        when temperature > 0 (or traced). The same key gives the same tokens. With one key per row,
        a row's tokens depend on its own key and logits only, not on the rows batched with it.
      temperature: 0 = greedy argmax; otherwise logits are divided by it before sampling.
        temperature, top_p, min_new_tokens and max_new_tokens_per_row may be traced (generate
        inside a jit of your own); a traced temperature picks argmax or samples at run time, and a
        traced top_p compiles the top-p filter in (1.0 keeps every token).
      top_k: sample only among the k most likely tokens (0 = off).
      top_p: sample only from the smallest set of tokens with total probability >= top_p.
      min_new_tokens: EOS is masked out for the first ``min_new_tokens`` steps.
      max_new_tokens_per_row: optional int [B], each in [1, T]: row b stops after that many
        tokens (``pad_id`` after them, ``lengths`` at most it), as if it had reached T. Traced:
        no recompilation. With learned positions, only the positions a row reaches before its
        limit must exist: the steps after it compute padding that is thrown away.
      eos_id: a row stops after emitting it (later tokens are ``pad_id``); None never stops.
        Default: the model's ``eos_id`` (`FROM_MODEL`: from ``step_fn.model.config``, so a
        checkpoint imported with its own ids stops at its own EOS), else 1.
      pad_id: the token written after EOS. Default: the model's ``pad_id`` (if it has none, the EOS
        id, as Hugging Face does; 0 without either).
      donate_cache: give ``cache``'s buffers to the decoding program, which then decodes in them:
        decoding holds one cache instead of ``cache`` and a copy of it. ``cache`` cannot be used
        afterwards (its arrays are deleted), so make a fresh one for each call. Off by default,
        which leaves ``cache`` as it was, ready for another call.
      sampling: the four settings above as one `SamplingConfig`, in place of their keywords (one
        object to keep in your own config and pass to each call); giving it with any of them at
        another value than its default is a ValueError (one at its default is taken as not given).

    Returns:
      GenerateOutput(tokens [B, T], lengths [B], logprobs [B, T]).
    """
    sampling = _sampling_settings(sampling, temperature=temperature, top_k=top_k, top_p=top_p,
                                  min_new_tokens=min_new_tokens)
    temperature, top_k, top_p, min_new_tokens = (sampling.temperature, sampling.top_k, sampling.top_p,
                                                 sampling.min_new_tokens)
    eos_id, pad_id = resolve_special_ids(step_fn, eos_id, pad_id)
    _check_max_new_tokens(max_new_tokens)
    prompt_tokens = jnp.asarray(prompt_tokens)
    prompt_lengths = jnp.asarray(prompt_lengths)
    _check_prompt(prompt_tokens, prompt_lengths, step_fn)
    limits = _row_limits(max_new_tokens_per_row, prompt_tokens.shape[0], int(max_new_tokens))
    _check_cache(step_fn, cache, prompt_tokens, prompt_lengths, int(max_new_tokens), limits)
    if rng is None:
        if not sampling.greedy:
            raise ValueError("rng (a PRNG key) is required when temperature > 0")
        rng = jax.random.key(0)  # unused by greedy decoding; keeps one traced signature
    rng = _check_rng(rng, prompt_tokens.shape[0])
    args = (step_fn, params, cache, prompt_tokens.astype(jnp.int32), prompt_lengths.astype(jnp.int32), rng,
            jnp.float32(sampling.temperature if not sampling.greedy else 1.0), jnp.float32(top_p),
            jnp.int32(min_new_tokens), limits)
    static = dict(max_new_tokens=int(max_new_tokens), greedy=sampling.greedy, top_k=int(top_k),
                  use_top_p=sampling.filters_top_p, eos_id=eos_id, pad_id=pad_id)
    if donate_cache:
        return _generate_donating(*args, **static)[0]
    return _generate_jit(*args, **static)
