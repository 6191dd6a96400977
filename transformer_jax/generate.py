"""Generate text from a trained workdir or a local Hugging Face checkpoint.

    python -m transformer_jax.generate --workdir=DIR --prompt="the tired engineer drank the cold coffee"
    python -m transformer_jax.generate --workdir=DIR --input_file=src.txt --decoding=beam > out.txt
    python -m transformer_jax.generate --hf_checkpoint=gpt2 --prompt="Hello" --decoding=sample --top_p=0.9
    python -m transformer_jax.generate --hf_checkpoint=opus-mt-en-de --prompt="How are you?" --decoding=beam

Encoder-decoder models translate each input (source + EOS -> target); decoder-only models continue
it. One output per input, in input order, one per line (a newline inside an output is written as
the two characters ``\\n``). Inputs are sorted by length and batched, each batch padded to a
power-of-two width, so a file of mixed lengths compiles only a few decoders.

Defaults: greedy decoding; ``--decoding=beam`` uses the paper's beam 4 and length penalty 0.6
(section 6.1). New tokens: at most source length + 50 for translation (the paper's limit), 64 for
continuation, and never past the model's ``max_len`` positions.

Outputs are written as soon as every input before them is decoded (the batches go longest first),
flushed once a batch; Ctrl-C ends with status 130 and the number written, a closed pipe
(``| head``) with status 141 and no message, a write that fails (a full disk) with ``error: ...``
and status 1.
Empty lines at the end of ``--input_file`` are not inputs.

Bad input (an empty prompt, a prompt longer than the model allows without ``--truncate``, bad
sampling settings, a workdir without a checkpoint) ends with ``error: ...`` on stderr, exit code 2.
"""

from __future__ import annotations

import dataclasses
import logging as pylogging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from absl import app, flags, logging

FLAGS = flags.FLAGS
_DECODINGS = ("greedy", "sample", "beam")
_SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "seed")
_BEAM_FLAGS = ("beam_size", "alpha")


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    """Defines the command line's flags on ``flag_values`` (tests pass their own FlagValues)."""

    def string(name, default, help_):
        flags.DEFINE_string(name, default, help_, flag_values=flag_values)

    def integer(name, default, help_):
        flags.DEFINE_integer(name, default, help_, flag_values=flag_values)

    def float_(name, default, help_):
        flags.DEFINE_float(name, default, help_, flag_values=flag_values)

    string("workdir", None, "Training workdir: the latest checkpoint and its tokenizer are used.")
    integer("step", None, "With --workdir: the checkpoint step to load (default: the latest).")
    string("hf_checkpoint", None, "A local Hugging Face GPT-2 or Marian directory (instead of --workdir).")
    flags.DEFINE_multi_string("prompt", [], "Input text (repeatable).", flag_values=flag_values)
    string("input_file", None, "A UTF-8 file with one input per line.")
    string("decoding", "greedy", f"One of {_DECODINGS}.")
    float_("temperature", 1.0, "Sampling temperature (> 0), --decoding=sample.")
    integer("top_k", 0, "Sample among the k most likely tokens (0 = all), --decoding=sample.")
    float_("top_p", 1.0, "Nucleus sampling mass in (0, 1], --decoding=sample.")
    integer("max_new_tokens", None, "Most tokens to generate (default: source length + 50, or 64).")
    integer("min_new_tokens", 0, "EOS is not allowed before this many new tokens.")
    integer("beam_size", 4, "Beam width, --decoding=beam (the paper: 4).")
    float_("alpha", 0.6, "Length penalty exponent, --decoding=beam (the paper: 0.6).")
    integer("seed", 0, "Random seed for --decoding=sample; input i samples with fold_in(key(seed), i).")
    integer("batch_size", 16, "Inputs decoded together.")
    string("dtype", None, "Decode in this compute and weight dtype (e.g. bfloat16; default: the "
                          "checkpoint's).")
    string("kernel_layout", "auto", "Decode with kernels stored this way (ModelConfig.kernel_layout): "
                                    "'auto' converts to 'packed' (bfloat16, where the CPU's bf16 dot "
                                    "product is fast) or 'out_in' where the native "
                                    "CPU kernels will run the steps' products, else keeps the "
                                    "checkpoint's; 'in_out', "
                                    "'out_in' or 'packed' (bf16: tiles the CPU kernel reads fastest) "
                                    "to choose.")
    flags.DEFINE_bool(
        "fused_qkv",
        False,
        "Decode with each self-attention's query, key and value kernels stored as one "
        "(ModelConfig.fused_qkv: one product a step where there were three; the same outputs), "
        "converting the checkpoint's; a checkpoint stored that way stays so either way.",
        flag_values=flag_values,
    )
    flags.DEFINE_bool(
        "huge_pages",
        True,
        "On a CPU, move the parameters onto transparent huge pages before decoding (Linux 6.1+; "
        "each step reads them ~8% faster; transformer_jax.decoding.huge_pages).",
        flag_values=flag_values,
    )
    string("mesh", None, "Decode on a device mesh, e.g. 'tensor=4' or 'data=2,tensor=4': the parameters "
                         "sharded as in training, the batch split over data x fsdp. Axes not named are "
                         "1, but data, which takes the devices left (-1 fills one named axis); their "
                         "product is the number of devices. Default: every device holds the whole model.")
    flags.DEFINE_bool(
        "truncate",
        False,
        "Cut inputs longer than the model allows instead of failing.",
        flag_values=flag_values,
    )


class GenerateError(ValueError):
    """Bad input to the command line; printed without a traceback, exit code 2."""


# ----------------------------------------------------------------------------- the model to use


@dataclasses.dataclass
class Generator:
    """Everything decoding needs: a model config, its parameters and a tokenizer with
    ``encode(text) -> ids`` and ``decode(ids) -> text``.

    banned_ids: tokens never generated (a checkpoint's single-token ``bad_words_ids``).
    prompt_prefix: ids put before every decoder-only prompt (our training starts each example with
    ``decoder_start_id``; GPT-2 checkpoints use none).
    """

    config: Any
    params: Any
    tokenizer: Any
    banned_ids: tuple[int, ...] = ()
    prompt_prefix: tuple[int, ...] = ()

    @property
    def is_seq2seq(self) -> bool:
        return self.config.num_encoder_layers > 0

    def input_ids(self, text: str) -> list[int]:
        """Encoder input (text + EOS) for translation, the prompt for continuation."""
        ids = list(self.tokenizer.encode(text))
        return ids + [self.config.eos_id] if self.is_seq2seq else [*self.prompt_prefix, *ids]


def load_hf_generator(path: str) -> Generator:
    """A `Generator` for a local Hugging Face checkpoint (weights, tokenizer, banned tokens)."""
    from transformer_jax.convert import load_hf_checkpoint, load_hf_tokenizer
    from transformer_jax.convert.hf_files import read_generation_config

    path = os.path.expanduser(path)
    config, params = load_hf_checkpoint(path, dropout_rate=0.0, attention_dropout_rate=0.0)
    banned = _banned_ids(read_generation_config(path).get("bad_words_ids"), config.vocab_size, path)
    return Generator(config, params, load_hf_tokenizer(path), banned)


def _banned_ids(bad_words_ids, vocab_size: int, path: str) -> tuple[int, ...]:
    """The single-token entries of a checkpoint's ``bad_words_ids`` (a list of token-id lists, as
    transformers takes it; longer sequences are not banned here), or an error naming the entry."""
    from transformer_jax.convert import ConversionError

    if not bad_words_ids:
        return ()
    where = f"{path}: bad_words_ids in its generation config"
    if not isinstance(bad_words_ids, list):
        raise ConversionError(f"{where} is {bad_words_ids!r}, not a list of token-id lists")
    banned = set()
    for i, words in enumerate(bad_words_ids):
        if (not isinstance(words, list) or not words
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in words)):
            raise ConversionError(f"{where}: entry {i} is {words!r}, not a list of token ids")
        outside = [t for t in words if not 0 <= t < vocab_size]
        if outside:
            raise ConversionError(f"{where}: entry {i} has token ids outside the vocabulary "
                                  f"[0, {vocab_size}): {outside}")
        if len(words) == 1:
            banned.add(words[0])
    return tuple(sorted(banned))


def load_workdir_generator(workdir: str, step: int | None = None, mesh=None, rules=None) -> Generator:
    """A `Generator` for a training workdir's latest (or given) checkpoint, its parameters sharded
    over ``mesh`` (default: whole on every device) by the logical axis ``rules`` (None: the
    default rules)."""
    workdir = os.path.expanduser(workdir)  # `--workdir=~/run`: the shell leaves a '~' after '='
    if not os.path.isdir(workdir):
        raise GenerateError(f"--workdir={workdir!r} is not a directory")
    try:
        from transformer_jax.training.checkpoint import restore_for_inference
    except ImportError as e:
        raise GenerateError(f"cannot restore a workdir in this build ({e})") from e
    try:
        bundle = restore_for_inference(workdir, step=step, mesh=mesh, rules=rules)
    except (ValueError, FileNotFoundError) as e:
        raise GenerateError(str(e)) from e
    cfg = bundle.model_config
    prefix = () if cfg.num_encoder_layers > 0 else (cfg.decoder_start_id,)
    return Generator(cfg, bundle.params, bundle.tokenizer, prompt_prefix=prefix)


def for_decoding(gen: Generator, *, dtype: str | None = None, kernel_layout: str | None = None,
                 fused_qkv: bool | None = None) -> Generator:
    """`gen` with its parameters converted to another compute/weight dtype, kernel layout and
    `fused_qkv` storage (`params.convert_params`); None keeps the checkpoint's."""
    from transformer_jax.params import convert_params

    changes = {}
    if dtype is not None:
        changes.update(dtype=dtype, param_dtype=dtype)
    if kernel_layout is not None:
        changes.update(kernel_layout=kernel_layout)
    if fused_qkv is not None:
        changes.update(fused_qkv=fused_qkv)
    if not changes:
        return gen
    target = gen.config.replace(**changes)  # ConfigError names a bad value
    return dataclasses.replace(gen, config=target, params=convert_params(gen.params, gen.config, target))


_MESH_AXES = ("data", "fsdp", "tensor")


def parse_mesh(value: str | None):
    """The device mesh ``--mesh`` names (``'tensor=4'``, ``'data=2,fsdp=2,tensor=2'``), None without
    it. Axes not named are 1 but ``data``, which takes the devices left unless another axis is -1."""
    if value is None:
        return None
    from transformer_jax import parallel
    from transformer_jax.config import ConfigError

    sizes: dict[str, int] = {}
    for part in value.split(","):
        name, equals, size = (t.strip() for t in part.partition("="))
        if not equals or name not in _MESH_AXES:
            raise GenerateError(f"--mesh={value!r}: {part.strip()!r} is not AXIS=SIZE with AXIS one of "
                                f"{', '.join(_MESH_AXES)}")
        if name in sizes:
            raise GenerateError(f"--mesh={value!r} names {name} twice")
        try:
            sizes[name] = int(size)
        except ValueError:
            raise GenerateError(f"--mesh={value!r}: {name}={size!r} is not an integer (a size, or -1 for "
                                f"the devices left)") from None
    if "data" not in sizes and -1 not in sizes.values():
        sizes["data"] = -1
    try:
        return parallel.create_mesh(**{"data": 1, "fsdp": 1, "tensor": 1, **sizes})
    except ConfigError as e:
        raise GenerateError(f"--mesh={value!r}: {e}") from None


def on_mesh(gen: Generator, mesh, rules=None) -> Generator:
    """`gen` with its parameters sharded over ``mesh`` as training shards them, by the logical axis
    ``rules`` (None: the default rules; a dimension the mesh does not divide stays whole, with a
    warning)."""
    import jax

    from transformer_jax.training.checkpoint import abstract_params

    shardings = jax.tree.map(lambda leaf: leaf.sharding, abstract_params(gen.config, mesh, rules))
    return dataclasses.replace(gen, params=jax.device_put(gen.params, shardings))


def _batch_size(opts: DecodeOptions, num_inputs: int, mesh=None, rules=None) -> int:
    """Inputs decoded together: ``opts.batch_size``, or fewer inputs rounded up to a power of two
    (fewer distinct shapes to compile); on a ``mesh``, a multiple of the pieces its data axes cut
    the batch into: rounded down (``batch_size`` may be what fits in memory), or up to one row per
    piece (filler rows repeat the first input)."""
    batch = min(opts.batch_size, 1 << (max(num_inputs, 1) - 1).bit_length())
    if mesh is not None:
        from transformer_jax import parallel

        pieces = parallel.batch_shard_count(mesh, parallel.check_rules(rules, mesh))
        batch = max(batch - batch % pieces, pieces)
    return batch


def _available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes; None where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _packed_is_fast() -> bool:
    """Whether the 'packed' tiles decode faster here than 'out_in'. The AVX-512 kernel reads them
    with the bf16 dot-product instruction only; on a CPU where that instruction is slow, where
    `native.bf16_products()` widens to float32 FMAs instead (an Intel Xeon with AMX measured here:
    GPT-2 small in bf16 at batch 1 9.2 ms a step 'packed' against 7.1 'out_in'; at batch 8 20.8
    against 12.7 ms), 'out_in' on the widening kernel is the faster."""
    from transformer_jax.modeling import native

    return not (native.isa() == "avx512" and native.bf16_products() == "widen")


def auto_kernel_layout(config, opts: DecodeOptions, num_inputs: int, param_bytes: int = 0,
                       dtype: str | None = None) -> str | None:
    """The layout ``--kernel_layout=auto`` decodes with where the decoding steps' weight products
    will run on the native CPU kernels (a CPU they run on, ``config.cpu_kernels`` allowing them, at
    most `native.MAX_ROWS` rows a step: the batch, times the beams for beam search): 'packed' for a
    bfloat16 compute dtype (`dtype`, the ``--dtype`` flag, or the checkpoint's), whose tiles the
    bf16 kernel reads fastest (its prefill runs on the same kernel, as fast as XLA's product), and
    'out_in' otherwise, which the kernels stream faster than kernels stored input axes first
    (README, "From the command line"). None (the checkpoint's layout) where that is the layout
    already, elsewhere, and where the converted copy of the `param_bytes` of parameters would not
    fit in the memory available (the conversion holds both copies for a moment). The outputs are
    the same function of the same weights; only the float32 order of summation differs. 'packed'
    only where the bf16 kernel reads it fast (`_packed_is_fast`), else 'out_in' for bfloat16 too."""
    from transformer_jax.modeling import native

    rows = _batch_size(opts, num_inputs) * (opts.beam_size if opts.decoding == "beam" else 1)
    if rows > native.MAX_ROWS or not native.use_native(config.cpu_kernels):
        return None
    layout = "packed" if (dtype or config.dtype) == "bfloat16" and _packed_is_fast() else "out_in"
    if config.kernel_layout == layout:
        return None
    available = _available_memory()
    if available is not None and param_bytes * 5 // 4 > available:
        logging.warning("--kernel_layout=auto keeps the checkpoint's layout: converting the parameters "
                        "needs another %.1f GiB, and %.1f GiB are available", param_bytes / 2**30,
                        available / 2**30)
        return None
    return layout


# ----------------------------------------------------------------------------- decoding settings


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """How to decode. ``max_new_tokens=None`` picks the default (source length + 50, or 64)."""

    decoding: str = "greedy"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    beam_size: int = 4
    alpha: float = 0.6
    seed: int = 0
    batch_size: int = 16
    truncate: bool = False

    def check(self) -> None:
        """Raises GenerateError naming the first bad setting."""
        problems = [
            (self.decoding not in _DECODINGS, f"--decoding={self.decoding!r}: must be one of {_DECODINGS}"),
            (
                self.max_new_tokens is not None and self.max_new_tokens <= 0,
                f"--max_new_tokens={self.max_new_tokens}: must be a positive integer",
            ),
            (self.min_new_tokens < 0, f"--min_new_tokens={self.min_new_tokens}: must be >= 0"),
            (
                self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens,
                f"--min_new_tokens={self.min_new_tokens} exceeds --max_new_tokens={self.max_new_tokens}",
            ),
            (
                not 0 < self.temperature < float("inf"),
                f"--temperature={self.temperature}: must be > 0 and finite (use --decoding=greedy for argmax "
                "decoding)",
            ),
            (self.top_k < 0, f"--top_k={self.top_k}: must be >= 0 (0 = off)"),
            (not 0.0 < self.top_p <= 1.0, f"--top_p={self.top_p}: must be in (0, 1]"),
            (self.beam_size < 1, f"--beam_size={self.beam_size}: must be >= 1"),
            (not 0.0 <= self.alpha < float("inf"), f"--alpha={self.alpha}: must be >= 0 and finite"),
            (self.batch_size < 1, f"--batch_size={self.batch_size}: must be >= 1"),
            (not -2**63 <= self.seed < 2**63, f"--seed={self.seed}: must be in [-2**63, 2**63)"),
        ]
        for bad, message in problems:
            if bad:
                raise GenerateError(message)


# ----------------------------------------------------------------------------- inputs and lengths


_LM_LIMIT = "its max_len, less the new tokens fed back: all but the last"


def _fit_input(
    ids: list[int], limit: int, index: int, opts: DecodeOptions, seq2seq: bool, eos: int, prefix=()
):
    """Checks one encoded input against the longest the model allows (cutting it with --truncate)."""
    if len(ids) - int(seq2seq) == 0:
        raise GenerateError(f"input {index + 1} is empty")
    if len(ids) <= limit:
        return ids
    if not opts.truncate:
        why = "its max_len" if seq2seq else _LM_LIMIT
        if not seq2seq and opts.max_new_tokens is None and opts.min_new_tokens > 1:
            why += f" of the --min_new_tokens={opts.min_new_tokens}"
        raise GenerateError(
            f"input {index + 1} has {len(ids)} tokens{' with the start token' if prefix else ''}, "
            f"more than the {limit} this model allows ({why}); shorten it or pass --truncate"
        )
    # Translation keeps the start of the source (and its EOS); continuation keeps the end.
    if seq2seq:
        return ids[: limit - 1] + [eos]
    return [*prefix, *ids[len(ids) - limit + len(prefix) :]]


def encode_inputs(gen: Generator, texts: Sequence[str], opts: DecodeOptions) -> list[list[int]]:
    """Token ids of every input, checked (empty, too long) against the model's ``max_len``."""
    max_len = gen.config.max_len
    if gen.is_seq2seq:
        limit = max_len
    else:
        start = len(gen.prompt_prefix)
        flag = "--max_new_tokens" if opts.max_new_tokens is not None else "--min_new_tokens"
        if opts.max_new_tokens is not None:
            new = opts.max_new_tokens
        elif opts.truncate:
            # Cut to leave room for the default continuation (64 tokens, or half the positions
            # after the start token in a shorter model), not for a single token, and for at
            # least --min_new_tokens.
            new = max(1, opts.min_new_tokens, min(DEFAULT_CONTINUATION, (max_len - start) // 2))
        else:
            new = max(1, opts.min_new_tokens)  # a prompt with less room is refused, not cut short
        # A prompt of P tokens and N new ones take P + N - 1 positions (the last new token is never
        # fed back). The start token takes a position too: with only it left, --truncate would cut
        # every prompt down to the start token alone and continue from nothing, silently.
        if new + start > max_len:
            held = f" ({start} of them for the start token)" if start else ""
            raise GenerateError(
                f"{flag}={new} leaves no room for a prompt within the model's {max_len} "
                f"positions{held}"
            )
        limit = max_len - new + 1
    if gen.is_seq2seq:
        for flag, value in (("--max_new_tokens", opts.max_new_tokens),
                            ("--min_new_tokens", opts.min_new_tokens)):
            if value is not None and value > max_len:
                raise GenerateError(f"{flag}={value} exceeds the model's {max_len} target positions")
    out = []
    for i, text in enumerate(texts):
        if not text.strip():
            raise GenerateError(f"input {i + 1} is empty")
        ids = gen.input_ids(text)
        out.append(_fit_input(ids, limit, i, opts, gen.is_seq2seq, gen.config.eos_id, gen.prompt_prefix))
    return out


# New tokens after a prompt of a decoder-only model when --max_new_tokens is not given.
DEFAULT_CONTINUATION = 64


def _new_tokens_limit(gen: Generator, opts: DecodeOptions, length: int) -> int:
    """New tokens allowed after an input of ``length`` tokens: --max_new_tokens, or by default
    the source length + 50 (translation) or 64 (continuation), raised to --min_new_tokens, within
    the model's positions."""
    max_len = gen.config.max_len
    if opts.max_new_tokens:
        return opts.max_new_tokens
    if gen.is_seq2seq:
        return min(max(length + 50, opts.min_new_tokens), max_len)
    return max(1, min(max(DEFAULT_CONTINUATION, opts.min_new_tokens), max_len - length + 1))


# ----------------------------------------------------------------------------- decoding


@dataclasses.dataclass(frozen=True)
class BanTokensStep:
    """Wraps a step function so that ``banned`` tokens get -inf logits (never generated)."""

    step: Callable
    banned: tuple[int, ...]

    def __call__(self, params, tokens, cache, num_valid):
        logits, cache = self.step(params, tokens, cache, num_valid)
        return logits.at[..., list(self.banned)].set(-1e30), cache


def _pad_rows(rows: list[list[int]], width: int, pad: int, batch: int):
    import numpy as np

    tokens = np.full((batch, width), pad, np.int32)
    lengths = np.ones((batch,), np.int32)
    for r in range(batch):
        row = rows[r] if r < len(rows) else rows[0]  # filler rows keep one compiled batch size
        tokens[r, : len(row)] = row
        lengths[r] = len(row)
    return tokens, lengths


def _decode_batch(gen: Generator, rows: list[list[int]], opts: DecodeOptions, batch: int, keys, mesh=None,
                  rules=None):
    """Generated token lists (EOS and padding removed) for up to ``batch`` encoded inputs, the
    batch split over ``mesh``'s data axes where there is one (the parameters placed on it already).

    Every row stops at its own limit (`_new_tokens_limit`) and samples with its own key
    (``keys[r]``), so an output does not depend on the inputs batched with it, and a long prompt
    next to a short one never runs past a learned position table while the short one goes on.
    """
    if mesh is None:
        return _decode_rows(gen, rows, opts, batch, keys, None)
    from transformer_jax import parallel

    rules = parallel.check_rules(rules, mesh)
    with parallel.sharding_context(mesh, rules):
        return _decode_rows(gen, rows, opts, batch, keys, parallel.batch_sharding(mesh, rules))


def _decode_rows(gen: Generator, rows: list[list[int]], opts: DecodeOptions, batch: int, keys, placement):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from transformer_jax import decoding
    from transformer_jax.decoding import model_steps
    from transformer_jax.modeling import init_cache
    from transformer_jax.params import build_model

    cfg = gen.config
    model = build_model(cfg)
    pad = cfg.pad_id if cfg.pad_id is not None else 0
    longest = max(len(r) for r in rows)
    width = min(decoding.bucket_length(longest), cfg.max_len)
    tokens, lengths = _pad_rows(rows, width, pad, batch)
    if placement is not None:
        tokens = jax.device_put(tokens, placement)
    limits = [_new_tokens_limit(gen, opts, len(r)) for r in rows]
    if gen.is_seq2seq:
        steps = max(limits) if opts.max_new_tokens else max(min(width + 50, cfg.max_len), max(limits))
        step_fn = model_steps.Seq2SeqStep(model)
        # Each source's own tokens marked explicitly: a model without a pad id would otherwise take
        # the padding for tokens, and a real token equal to the pad id would be masked.
        segments = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int32)
        cache = model_steps.encode_source(model, gen.params, jnp.asarray(tokens), max_length=steps + 1,
                                          src_segment_ids=jnp.asarray(segments))
        prompt = jnp.full((batch, 1), cfg.decoder_start_id, jnp.int32)
        prompt_lengths = jnp.ones((batch,), jnp.int32)
    else:
        steps = max(limits)
        step_fn = model_steps.LMStep(model)
        cache = init_cache(cfg, batch, width + steps)
        prompt, prompt_lengths = tokens, lengths
    if gen.banned_ids:
        step_fn = BanTokensStep(step_fn, gen.banned_ids)
    row_limits = [limits[r] if r < len(rows) else limits[0] for r in range(batch)]  # fillers: row 0
    common = dict(max_new_tokens=steps, min_new_tokens=min(opts.min_new_tokens, steps),
                  max_new_tokens_per_row=np.asarray(row_limits, np.int32), eos_id=cfg.eos_id, pad_id=pad)
    if opts.decoding == "beam":
        out = decoding.beam_search(
            step_fn,
            gen.params,
            cache,
            prompt,
            prompt_lengths,
            beam_size=opts.beam_size,
            alpha=opts.alpha,
            **common,
        )
        new_tokens, new_lengths = out.tokens[:, 0], out.lengths[:, 0]
    else:
        sample = opts.decoding == "sample"
        out = decoding.generate(
            step_fn,
            gen.params,
            cache,
            prompt,
            prompt_lengths,
            rng=jnp.stack([keys[r] if r < len(rows) else keys[0] for r in range(batch)]) if sample else None,
            temperature=opts.temperature if sample else 0.0,
            top_k=opts.top_k if sample else 0,
            top_p=opts.top_p if sample else 1.0,
            donate_cache=True,  # made above for this call alone: decode in it, not in a copy
            **common,
        )
        new_tokens, new_lengths = out.tokens, out.lengths
    new_tokens, new_lengths = np.asarray(jax.device_get(new_tokens)), np.asarray(new_lengths)
    results = []
    for r in range(len(rows)):
        ids = new_tokens[r, : min(int(new_lengths[r]), limits[r])].tolist()
        results.append(ids[:-1] if ids and ids[-1] == cfg.eos_id else ids)
    return results


def generate_texts(
    gen: Generator, texts: Sequence[str], opts: DecodeOptions = DecodeOptions(), *, progress: bool = False,
    mesh=None, rules=None,
) -> list[str]:
    """Decodes every input; returns the outputs in input order.

    Inputs are sorted by length and decoded ``opts.batch_size`` at a time. With a ``mesh`` (the
    parameters placed on it, `on_mesh`), each batch is split over its data axes, or over the axes
    the logical axis ``rules`` give the batch (None: the default rules).
    """
    outputs: list[str] = [""] * len(texts)
    for batch in iter_generated(gen, texts, opts, progress=progress, mesh=mesh, rules=rules):
        for i, text in batch:
            outputs[i] = text
    return outputs


def iter_generated(
    gen: Generator, texts: Sequence[str], opts: DecodeOptions = DecodeOptions(), *, progress: bool = False,
    mesh=None, rules=None,
) -> Iterator[list[tuple[int, str]]]:
    """`generate_texts` one batch at a time: yields each batch's ``[(input index, output), ...]``
    as it is decoded, longest inputs first."""
    import jax

    from transformer_jax.params import key_from_seed

    opts.check()
    encoded = encode_inputs(gen, texts, opts)
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]), reverse=True)
    batch = _batch_size(opts, len(encoded), mesh, rules)
    chunks = [order[i : i + batch] for i in range(0, len(order), batch)]
    if progress:
        from tqdm import tqdm

        chunks = tqdm(chunks, desc="generate", unit="batch", file=sys.stderr)
    rng = key_from_seed(opts.seed)  # all 64 bits: seeds 0 and 2**32 differ
    for chunk in chunks:
        # Input i samples with fold_in(key(seed), i): its draws do not depend on --batch_size or on
        # the inputs that share its batch (its logits may, by float rounding: see the README).
        keys = [jax.random.fold_in(rng, i) for i in chunk]
        ids = _decode_batch(gen, [encoded[i] for i in chunk], opts, batch, keys, mesh, rules)
        yield [(i, gen.tokenizer.decode(out)) for i, out in zip(chunk, ids, strict=True)]


# ----------------------------------------------------------------------------- command line


def _read_inputs(prompts: Sequence[str], input_file: str | None) -> list[str]:
    if prompts and input_file:
        raise GenerateError("give --prompt or --input_file, not both")
    if input_file is None:
        if not prompts:
            raise GenerateError("nothing to generate from: give --prompt=TEXT or --input_file=FILE")
        lines = list(prompts)
    else:
        lines = _read_file(input_file)
    for i, text in enumerate(lines):
        where = f"line {i + 1} of --input_file" if input_file else f"--prompt number {i + 1}"
        if not text.strip():
            raise GenerateError(f"empty input ({where})")
        if input_file is None:
            _check_prompt_is_utf8(text, where)
    return lines


def _check_prompt_is_utf8(text: str, where: str) -> None:
    """Command-line bytes that are not UTF-8 (a prompt typed in a Latin-1 terminal, ``$(cat f)``
    of a Latin-1 file) reach ``sys.argv`` as lone surrogates (Python's ``surrogateescape``), which
    the Hugging Face tokenizers cannot encode (GPT-2: TypeError, Marian: RuntimeError, deep inside
    them): named here, as an ``--input_file`` that is not UTF-8 is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise GenerateError(f"{where} is not UTF-8 text ({what} at character {e.start + 1})") from e


def _line_of(data: bytes, offset: int) -> int:
    """The line (from 1) that byte ``offset`` of ``data`` is on, lines ending at LF, CR LF or CR."""
    head = data[:offset]
    return head.count(b"\n") + head.count(b"\r") - head.count(b"\r\n") + 1


def _read_file(input_file: str) -> list[str]:
    """The lines of ``input_file``, one input each: split at line ends only (\\n, \\r\\n or
    \\r), not at the other characters ``str.splitlines`` breaks at (form feed, U+2028, U+0085,
    ...), which would give more outputs than input lines; a UTF-8 byte-order mark is dropped."""
    try:
        if input_file == "-":  # standard input, as for most tools that read files
            data = sys.stdin.buffer.read()
        else:
            with open(os.path.expanduser(input_file), "rb") as f:
                data = f.read()
    except OSError as e:
        raise GenerateError(f"cannot read --input_file={input_file!r}: {e.strerror or e}") from e
    data = data.removeprefix(b"\xef\xbb\xbf")
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):  # UTF-16's byte-order marks (Windows' "Unicode")
        raise GenerateError(f"--input_file={input_file!r} is UTF-16 text (it starts with a UTF-16 "
                            f"byte-order mark), not UTF-8: convert it, e.g. iconv -f UTF-16 -t UTF-8")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GenerateError(f"--input_file={input_file!r} is not UTF-8 text ({e.reason} at line "
                            f"{_line_of(data, e.start)})") from e
    nul = data.find(b"\0")
    if nul >= 0:  # valid UTF-8, never text: UTF-16 without a byte-order mark, or a binary file
        raise GenerateError(f"--input_file={input_file!r} is not UTF-8 text (a NUL character at line "
                            f"{_line_of(data, nul)}; UTF-16?)")
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    while lines and lines[-1] == "":  # the file's last line end, and empty lines after the last input
        lines.pop()
    if not lines:
        raise GenerateError(f"--input_file={input_file!r} is empty")
    return lines


def _check_flag_combinations(flag_values: flags.FlagValues) -> None:
    fv = flag_values
    if bool(fv.workdir) == bool(fv.hf_checkpoint):
        raise GenerateError("give exactly one of --workdir=DIR and --hf_checkpoint=DIR")
    if fv["step"].present and fv.hf_checkpoint:  # it would be ignored: one set of weights there
        raise GenerateError("--step applies only to --workdir (a Hugging Face checkpoint has one step)")
    groups = ((_SAMPLING_FLAGS, "sample"), (_BEAM_FLAGS, "beam"))
    for names, decoding in groups:
        given = [f"--{n}" for n in names if fv[n].present]
        if given and fv.decoding != decoding:
            raise GenerateError(
                f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only to "
                f"--decoding={decoding} (got --decoding={fv.decoding})"
            )


def options_from_flags(flag_values: flags.FlagValues = FLAGS) -> DecodeOptions:
    fv = flag_values
    opts = DecodeOptions(
        decoding=fv.decoding,
        temperature=fv.temperature,
        top_k=fv.top_k,
        top_p=fv.top_p,
        max_new_tokens=fv.max_new_tokens,
        min_new_tokens=fv.min_new_tokens,
        beam_size=fv.beam_size,
        alpha=fv.alpha,
        seed=fv.seed,
        batch_size=fv.batch_size,
        truncate=fv.truncate,
    )
    opts.check()
    return opts


# Written as \xNN: the control characters other than tab and the line ends (a terminal acts on
# them: ESC and CSI start commands; NUL makes the output a file --input_file refuses), DEL, the C1
# controls (NEL among them, a line end to some programs), and LINE and PARAGRAPH SEPARATOR.
_ESCAPED = {c: f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"
            for c in [*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029] if chr(c) not in "\t\n\r"}


def _escape_newlines(text: str) -> str:
    """One output on one line, of printable text: a line end inside it written as backslash-n,
    other control characters (tab apart) and other line separators as backslash-x or -u and their
    hex code, and a backslash as two, so that a literal backslash-n in the text stays
    distinguishable (read back in one pass over the backslashes: ``\\\\``, ``\\n``, ``\\xNN``,
    ``\\uNNNN``)."""
    text = text.replace("\\", "\\\\")
    text = text.replace("\r\n", "\\n").replace("\n", "\\n").replace("\r", "\\n")
    return text.translate(_ESCAPED)


def run(flag_values: flags.FlagValues = FLAGS, out=None) -> None:
    """Generates for the parsed flags and writes one line per input to ``out`` (stdout)."""

    from transformer_jax.config import ConfigError
    from transformer_jax.convert import ConversionError

    fv = flag_values
    if out is None:
        out = sys.stdout
        if out is None:  # started with its standard output closed (`>&-`): checked before decoding
            print("error: standard output is closed: nowhere to write the outputs (redirect it to a "
                  "file)", file=sys.stderr)
            sys.exit(2)
        # The outputs are any Unicode text, which an ASCII or Latin-1 locale's encoding cannot hold.
        encoding = (getattr(out, "encoding", None) or "").lower().replace("-", "")
        if encoding != "utf8" and hasattr(out, "reconfigure"):
            out.reconfigure(encoding="utf-8")
    texts: list[str] = []
    writer = _InOrderWriter(out)
    try:
        _check_flag_combinations(fv)
        opts = options_from_flags(fv)
        texts = _read_inputs(fv.prompt, fv.input_file)
        gen, mesh = _generator_for_flags(fv, opts, len(texts))
        progress = fv.input_file is not None and len(texts) > opts.batch_size
        for batch in iter_generated(gen, texts, opts, progress=progress, mesh=mesh):
            writer.add(batch)
    except (GenerateError, ConversionError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"error: interrupted; {writer.account(len(texts))}" if texts
              else "error: interrupted before the inputs were read", file=sys.stderr)
        sys.exit(130)
    except _OutputError as e:
        if out is sys.stdout:  # nothing more to write there, at exit either (Python would try)
            _silence_stdout()
        if isinstance(e.__cause__, BrokenPipeError):  # `| head`: the reader has what it wanted
            sys.exit(141)  # as a program the pipe's end killed (128 + SIGPIPE)
        print(f"error: cannot write the outputs ({e.__cause__.strerror or e.__cause__}); "
              f"{writer.account(len(texts))}", file=sys.stderr)
        sys.exit(1)
    except Exception:  # not ours to name (out of memory, say): its traceback, and what was kept
        if writer.flushed:
            print(f"note: {writer.account(len(texts))} before the error below", file=sys.stderr)
        raise


def _generator_for_flags(fv: flags.FlagValues, opts: DecodeOptions, num_inputs: int):
    """The flags' model, converted and placed for decoding, and their mesh (or None)."""
    import jax

    mesh = parse_mesh(fv.mesh)
    if fv.hf_checkpoint:
        gen = load_hf_generator(fv.hf_checkpoint)
    else:
        gen = load_workdir_generator(fv.workdir, fv.step, mesh)
    layout = fv.kernel_layout
    if layout == "auto" and mesh is not None and mesh.size > 1:
        layout = None  # the native CPU kernels stay out of a mesh of several devices
    elif layout == "auto":
        param_bytes = sum(x.nbytes for x in jax.tree.leaves(gen.params))
        layout = auto_kernel_layout(gen.config, opts, num_inputs, param_bytes, fv.dtype)
        logging.info("kernel layout: %s (--kernel_layout=auto)", layout or gen.config.kernel_layout)
    loaded = gen
    gen = for_decoding(gen, dtype=fv.dtype, kernel_layout=layout, fused_qkv=fv.fused_qkv or None)
    if mesh is not None and (fv.hf_checkpoint or gen is not loaded):  # a workdir's restores onto it
        gen = on_mesh(gen, mesh)
    if fv.huge_pages:
        from transformer_jax.decoding.huge_pages import place_on_huge_pages

        placed = place_on_huge_pages(gen.params)
        logging.info("parameters on huge pages: %d of %d MiB (%s)", placed.placed >> 20,
                     placed.requested >> 20, placed.reason or "all moved")
    return gen, mesh


class _InOrderWriter:
    """Writes outputs in input order as soon as every input before them is decoded (the batches go
    longest first), flushing once a batch: a long job's finished lines are not held back.
    ``flushed``: how many lines have reached the stream's file."""

    def __init__(self, out):
        self.out, self.ready, self.next, self.flushed = out, {}, 0, 0

    def add(self, batch: list[tuple[int, str]]) -> None:
        self.ready.update(batch)
        while self.next in self.ready:
            _write(self.out, _escape_newlines(self.ready.pop(self.next)) + "\n")
            self.next += 1
        _write(self.out, "", flush=True)
        self.flushed = self.next

    def account(self, total: int) -> str:
        return f"the outputs of the first {self.flushed} of {total} inputs were written"


class _OutputError(Exception):
    """Writing an output failed (a closed pipe, a full disk): raised from the OSError."""


def _write(out, text: str, flush: bool = False) -> None:
    try:
        out.write(text)
        if flush:
            out.flush()
    except OSError as e:
        raise _OutputError from e


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no descriptor behind it (a test's stream)
        pass


def _hide_checkpoint_library_warnings(record) -> bool:
    """Drops orbax's notices below ERROR ("Given directory is read only", ...) from the log."""
    return record.levelno >= pylogging.ERROR or "orbax" not in record.pathname


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        print(f"error: unexpected arguments {list(argv[1:])} (flags are --name=value)", file=sys.stderr)
        sys.exit(2)
    if not FLAGS["verbosity"].present:  # library logs only on request: stderr stays for our errors
        logging.set_verbosity(logging.WARNING)
        logging.get_absl_handler().addFilter(_hide_checkpoint_library_warnings)
    run()


def _parse_flags(argv: Sequence[str]) -> list[str]:
    """absl's flag parsing with one 'error: ...' line and status 2 for an unknown flag or a value
    of the wrong type, as for every other bad input (absl alone prints 'FATAL Flags parsing error'
    and exits 1)."""
    try:
        return FLAGS(argv)
    except flags.Error as e:
        print(f"error: {e} (--helpshort lists the flags)", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    define_flags()  # only when run as a program: importing this module defines no global flags
    app.run(main, flags_parser=_parse_flags)
