"""The encoder-decoder Transformer (Figure 1) and its decoder-only variant.

This is the only file that reads `ModelConfig`; everything below it takes explicit fields.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict

from transformer_jax.config import ModelConfig
from transformer_jax.modeling import masks
from transformer_jax.modeling.attention import projection
from transformer_jax.modeling.blocks import TransformerBlock
from transformer_jax.modeling.cache import KVCache, cache_dtype, empty_layers, empty_lengths
from transformer_jax.modeling.layers import Embed, make_norm
from transformer_jax.modeling.positional import sinusoidal_encoding

_REMAT_POLICIES = {
    # The native attention kernel's output and log-sum-exp are kept too: its backward kernel
    # needs them, and recomputing them would run its forward kernel a second time.
    "dots_saveable": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names("attention_out", "attention_lse")),
    "full": jax.checkpoint_policies.nothing_saveable,
}


def make_embed(config: ModelConfig, name: str) -> Embed:
    scale = config.d_model**0.5 if config.scale_embeddings else 1.0
    return Embed(config.padded_vocab_size, config.d_model, scale=scale, dtype=config.compute_dtype,
                 param_dtype=config.weights_dtype, cpu_kernels=config.cpu_kernels,
                 packed=config.kernel_layout == "packed", valid_rows=config.vocab_size, name=name)


class _LayerStep(TransformerBlock):
    """One block as the body of `nn.scan`: positional arguments only (scan's in_axes are positional)
    and the carry first. `cross_kv_only` (static) computes the cross-attention K/V of `memory` instead
    (how a scanned decoder fills its cache)."""

    def __call__(self, x, deterministic, cross_kv_only, self_mask, positions, memory, cross_mask,
                 cache_index, cross_kv, cache):
        if cross_kv_only:
            k, v = self.cross_kv(memory)
            return x, {"k": k, "v": v}
        cross = None if cross_kv is None else (cross_kv["k"], cross_kv["v"])
        return super().__call__(x, deterministic, self_mask=self_mask, positions=positions,
                                memory=memory, cross_mask=cross_mask, cross_kv=cross, cache=cache,
                                cache_index=cache_index)


def block_kwargs(config: ModelConfig, cross_attention: bool) -> dict:
    return dict(
        d_model=config.d_model, num_heads=config.num_heads, head_dim=config.qk_dim,
        num_kv_heads=config.kv_heads,
        d_ff=config.d_ff, cross_attention=cross_attention, activation=config.activation,
        norm=config.norm, norm_type=config.norm_type, norm_eps=config.norm_eps,
        dropout_rate=config.dropout_rate,
        attention_dropout_rate=config.attention_dropout_rate,
        rope_theta=config.rope_theta if config.position == "rope" else None,
        use_bias=config.use_bias, attention_impl=config.attention_impl,
        dtype=config.compute_dtype, param_dtype=config.weights_dtype,
        kernel_layout=config.kernel_layout, cpu_kernels=config.cpu_kernels, fused_qkv=config.fused_qkv,
    )


def make_blocks(config: ModelConfig, count: int, cross_attention: bool, prefix: str):
    """`count` blocks named prefix_0.. (a list), or with `config.scan_layers` one `nn.scan` over a
    single block named 'layers' whose parameters are stacked on a leading 'layers' axis: the step
    is traced and compiled once, so compile time does not grow with depth."""
    kwargs = block_kwargs(config, cross_attention)
    if config.scan_layers:
        step = _LayerStep
        if config.remat != "none":
            # deterministic and cross_kv_only (arguments 2 and 3 after self, x) are Python flags.
            step = nn.remat(_LayerStep, policy=_REMAT_POLICIES[config.remat], static_argnums=(2, 3),
                            prevent_cse=False)  # scan already keeps the recomputation in place
        scanned = nn.scan(
            step, variable_axes={"params": 0, "intermediates": 0},
            split_rngs={"params": True, "dropout": True},
            in_axes=(nn.broadcast,) * 7 + (1, 1), out_axes=1, length=count,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        return scanned(**kwargs, name="layers")
    block = TransformerBlock
    if config.remat != "none":
        # `deterministic` (argument 2, after self and x) decides Python control flow: static.
        block = nn.remat(TransformerBlock, policy=_REMAT_POLICIES[config.remat],
                         static_argnums=(2,), prevent_cse=True)
    return [block(**kwargs, name=f"{prefix}_{i}") for i in range(count)]


def run_blocks(blocks, x, deterministic, *, self_mask, positions, memory=None, cross_mask=None,
               cross_kv=None, caches=None, cache_index=None):
    """x through every block. Per-layer `cross_kv` / `caches` are tuples of {'k','v'} dicts, or for a
    scanned stack one dict of [B, layers, ...] arrays. Returns (x, new caches in the same layout)."""
    if not isinstance(blocks, list | tuple):
        return blocks(x, deterministic, False, self_mask, positions, memory, cross_mask,
                      cache_index, cross_kv, caches)
    new_caches = []
    for i, block in enumerate(blocks):
        cross = None if cross_kv is None else (cross_kv[i]["k"], cross_kv[i]["v"])
        x, cache = block(x, deterministic, self_mask=self_mask, positions=positions, memory=memory,
                         cross_mask=cross_mask, cross_kv=cross,
                         cache=None if caches is None else caches[i], cache_index=cache_index)
        new_caches.append(cache)
    return x, (None if caches is None else tuple(new_caches))


class _Stack(nn.Module):
    """Shared by Encoder and Decoder: token embedding + positions (section 3.5), dropout, and the
    final norm that Pre-LN stacks need."""

    config: ModelConfig
    embed: Embed

    def setup_positions(self):
        cfg = self.config
        if cfg.position == "learned":
            self.position_embed = Embed(
                cfg.max_len, cfg.d_model, names=("length", "embed"), dtype=cfg.compute_dtype,
                param_dtype=cfg.weights_dtype, name="position_embed",
            )
        rate = cfg.dropout_rate if cfg.embedding_dropout_rate is None else cfg.embedding_dropout_rate
        self.embed_dropout = nn.Dropout(rate)
        if cfg.use_final_norm:
            self.final_norm = make_norm(cfg.norm_type, cfg.norm_eps, cfg.compute_dtype,
                                        cfg.weights_dtype, "final_norm", cfg.cpu_kernels)

    def embed_tokens(self, tokens, positions, deterministic):
        """Token embeddings (times sqrt(d_model)) plus positions, then dropout (section 5.4)."""
        if isinstance(deterministic, jax.core.Tracer):  # it failed inside Flax's dropout
            raise TypeError(
                f"deterministic must be a Python bool (it chooses the program: with dropout or without), "
                f"got {type(deterministic).__name__}; under jax.jit mark it static: "
                f"jax.jit(model.apply, static_argnames='deterministic')")
        cfg = self.config
        x = self.embed(tokens)
        if cfg.position == "sinusoidal":
            pe = sinusoidal_encoding(positions, cfg.d_model, cfg.sinusoidal_layout)
            x = x + pe.astype(x.dtype)
        elif cfg.position == "learned":
            x = x + self.position_embed(positions)
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        return self.embed_dropout(x, deterministic=deterministic)

    def finish(self, x):
        return self.final_norm(x) if self.config.use_final_norm else x


def _check_learned_length(config: ModelConfig, length: int) -> None:
    if config.position == "learned" and length > config.max_len:
        raise ValueError(f"{length} tokens exceed the learned position table's {config.max_len} rows "
                         "(ModelConfig.max_len): positions past it would be NaN")


def _on_host(x) -> np.ndarray | None:
    """``x`` as a NumPy array, or None inside a trace, where its values cannot be read (even
    operations on a concrete array are staged there, so the check runs on the host).

    A global array of a multi-process run (each process holding its rows) is gathered to every
    process, as every process makes the same call: each then finds the same bad value and raises the
    same error, where a check of its own rows only would stop one process and leave the others
    waiting in the next collective."""
    try:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            from jax.experimental import multihost_utils
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _check_cache_layout(config, cache) -> None:
    """A cache built for another config (often: before ``.replace(scan_layers=True)``) failed deep
    inside the model with an unrelated TypeError, KeyError or IndexError, or with more layers than
    the model was read in part without a word: name the field that differs."""
    layers = cache.layers
    scanned = isinstance(layers, dict)
    if scanned != bool(config.scan_layers):
        raise ValueError(f"the KV cache is built for scan_layers={scanned}, the model has "
                         f"scan_layers={config.scan_layers}: build it with tj.init_cache(config, ...) "
                         "from the model's own config")
    count = layers["k"].shape[1] if scanned else len(layers)
    if count != config.num_decoder_layers:
        raise ValueError(f"the KV cache holds {count} decoder layers, the model has "
                         f"num_decoder_layers={config.num_decoder_layers}")
    k = layers["k"] if scanned else layers[0]["k"]
    heads, head_dim = k.shape[-3], k.shape[-1]
    if (heads, head_dim) != (config.kv_heads, config.qk_dim):
        raise ValueError(f"the KV cache holds {heads} key/value heads of {head_dim}, the model "
                         f"{config.kv_heads} of {config.qk_dim} (num_kv_heads, head_dim): build it from "
                         "the model's own config")


def _check_learned_positions(config: ModelConfig, positions, what: str = "positions",
                             offset: int = 0) -> None:
    """Explicit positions (packed rows), or a cache's lengths with ``offset`` = new tokens - 1, must
    be rows of a learned table. Past its end they look up NaN, and the NaN keys and values spread to
    every query of the row (a masked key's weight is 0, but 0 * NaN is NaN; a cache keeps them for
    every later step). Checked when the positions can be read (an eager call); inside jit
    `tj.generate` checks what it reaches. Other position kinds read nothing."""
    if config.position != "learned" or positions is None or not np.size(positions):
        return
    if not jnp.issubdtype(jnp.result_type(positions), jnp.integer):
        raise ValueError(f"{what} must be integers (rows of the learned position table), got "
                         f"{jnp.result_type(positions)}")
    host = _on_host(positions)
    if host is None:
        return
    if int(host.min()) < 0:  # (a negative row counted from the table's end, as NumPy indexing does)
        raise ValueError(f"{what} hold position {int(host.min())}: positions start at 0")
    highest = int(host.max()) + offset
    if highest >= config.max_len:
        raise ValueError(f"{what} reach position {highest}, past the learned position table's "
                         f"{config.max_len} rows (ModelConfig.max_len): positions past it would be NaN")


def _as_tokens(name: str, tokens, vocab_size: int | None = None, **aligned):
    """``tokens`` as an integer [B, L] array; ``aligned`` arrays (segment ids, positions) must have
    its shape. Bad inputs are a ValueError naming the argument, not an error deep in a layer.

    Ids outside ``[0, vocab_size)`` are refused when the ids are concrete (an eager call, or
    ``init``). Inside ``jit`` they cannot be read: there such an id looks up NaN (`layers.Embed`),
    a negative one and one in a padded vocabulary's extra rows included."""
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"{name} must be [batch, length] token ids, got shape {tokens.shape}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"{name} must be integer token ids, got {tokens.dtype}")
    if vocab_size is not None and tokens.size:
        host = _on_host(tokens)
        if host is None:
            return _check_aligned(name, tokens, aligned)
        low, high = int(host.min()), int(host.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            where = tuple(int(i) for i in np.argwhere(host == bad)[0])
            raise ValueError(f"{name} holds token id {bad} (at {where}), outside the model's vocabulary "
                             f"[0, {vocab_size})")
    return _check_aligned(name, tokens, aligned)


def _check_aligned(name: str, tokens, aligned: dict):
    for key, array in aligned.items():
        if array is None:
            continue
        shape = tuple(array.shape if hasattr(array, "shape") else np.shape(array))  # (or a nested list)
        if shape != tokens.shape:
            raise ValueError(f"{key} has shape {shape} but {name} has {tokens.shape}: they must match")
        # (float positions fed sines of fractional positions and rotated RoPE by fractional
        # angles; float segment ids compared by float equality: both silently)
        dtype = array.dtype if hasattr(array, "dtype") else np.asarray(array).dtype  # (a nested list)
        if not jnp.issubdtype(dtype, jnp.integer):
            raise ValueError(f"{key} must be integers (token indices), got {dtype}")
    return tokens


@functools.lru_cache(maxsize=32)
def _param_paths(config: ModelConfig, encoder_decoder: bool) -> frozenset:
    """The parameter paths of a model of ``config``, from an abstract init (nothing allocated)."""
    # (parent=None: a model of its own, not a submodule of the module calling this)
    model = (Transformer if encoder_decoder else TransformerLM)(config, parent=None)
    tokens = jnp.zeros((1, 1), jnp.int32)
    args = (tokens, tokens) if encoder_decoder else (tokens,)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), *args))["params"]
    return frozenset(flatten_dict(shapes))


def _check_params(module: nn.Module) -> None:
    """Parameters that this config's model does not have, such as a deeper model's extra layers,
    an untied output projection or an encoder, were ignored without a word (Flax reads only the
    entries it asks for): the model ran as another one. Missing entries and other shapes are
    Flax's own errors."""
    if module.is_initializing():
        return
    params = module.variables.get("params")
    if not params:
        return
    expected = _param_paths(module.config, isinstance(module, Transformer))
    extra = set(flatten_dict(params)) - expected
    if extra:
        named = ", ".join("/".join(path) for path in sorted(extra)[:3])
        other = module.config.replace(scan_layers=not module.config.scan_layers)
        # one stack or both in the other layer layout
        if extra <= _param_paths(other, isinstance(module, Transformer)):
            have = "stacked" if other.scan_layers else "one by one"
            convert = "scan_params" if module.config.scan_layers else "unscan_params"
            raise ValueError(
                f"the params hold their layers {have}, as scan_layers={other.scan_layers} makes them, but "
                f"this {type(module).__name__}'s config has scan_layers={module.config.scan_layers}: "
                f"convert them with transformer_jax.modeling.{convert}(params, config) (or "
                f"transformer_jax.params.convert_params), or build the model with "
                f"scan_layers={other.scan_layers}")
        if {path[:-1] for path in extra if path[-1] == "value"} >= expected:
            raise ValueError(  # each leaf a dict {'value': array}: how orbax gives boxes back
                f"the params hold every parameter one level deeper, under 'value' ({named}, ...): "
                f"nn.LogicallyPartitioned boxes saved as they are and restored without a target. "
                f"Save nn.unbox(params), or restore with the abstract params as the target")
        raise ValueError(f"the params hold {len(extra)} entries that a {type(module).__name__} of this "
                         f"config does not have ({named}{', ...' if len(extra) > 3 else ''}): they are "
                         f"another config's (num_encoder_layers, num_decoder_layers, share_embeddings, "
                         f"tie_output, ...); build the model from the config the params were made with")


def segment_positions(segment_ids):
    """[B, S] positions counted from the start of each run of equal segment ids."""
    index = jnp.arange(segment_ids.shape[1])
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def default_positions(tokens, segment_ids=None, name: str = "positions"):
    """[B, L] positions 0..L-1; packed rows must pass their own, named by ``name`` (an encoder-
    decoder has two sets, and the error says which one is missing)."""
    if segment_ids is not None:
        raise ValueError(f"packed inputs (segment ids given) need their positions too: pass {name} "
                         "(int [B, L], counted from each segment's start)")
    return jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)


class Encoder(_Stack):
    """N blocks of bidirectional self-attention + feed-forward (section 3.1)."""

    def setup(self):
        self.setup_positions()
        cfg = self.config
        self.blocks = make_blocks(cfg, cfg.num_encoder_layers, False, "layer")

    def valid_tokens(self, tokens, segment_ids=None):
        """bool [B, S]: True on real tokens (segment id > 0, or not the pad id)."""
        if segment_ids is not None:
            return segment_ids != 0
        if self.config.pad_id is None:
            return jnp.ones(tokens.shape, bool)
        return tokens != self.config.pad_id

    def __call__(self, tokens, *, segment_ids=None, positions=None, deterministic=True):
        """tokens: int [B, S] -> encoder output [B, S, D]."""
        tokens = _as_tokens("src", tokens, self.config.vocab_size, src_segment_ids=segment_ids,
                            src_positions=positions)
        if positions is None:
            _check_learned_length(self.config, tokens.shape[1])
            positions = default_positions(tokens, segment_ids, "src_positions")
        else:
            _check_learned_positions(self.config, positions, "src_positions")
        S = tokens.shape[1]
        if segment_ids is not None:
            mask = masks.bidirectional_spec(S, S, q_segment_ids=segment_ids,
                                            kv_segment_ids=segment_ids)
        else:
            mask = masks.bidirectional_spec(S, S, kv_valid=self.valid_tokens(tokens))
        x = self.embed_tokens(tokens, positions, deterministic)
        x, _ = run_blocks(self.blocks, x, deterministic, self_mask=mask, positions=positions)
        return self.finish(x)


class Decoder(_Stack):
    """N blocks of masked self-attention (+ cross-attention over the encoder output when
    `cross_attention`) + feed-forward, then the pre-softmax linear map (section 3.4)."""

    cross_attention: bool = False

    def setup(self):
        self.setup_positions()
        cfg = self.config
        self.blocks = make_blocks(cfg, cfg.num_decoder_layers, self.cross_attention, "layer")
        if not cfg.tie_output:
            self.output = projection(
                cfg.padded_vocab_size, ("embed", "vocab"), use_bias=False, dtype=cfg.compute_dtype,
                param_dtype=cfg.weights_dtype, kernel_layout=cfg.kernel_layout,
                cpu_kernels=cfg.cpu_kernels, kernel_init=nn.initializers.normal(cfg.d_model**-0.5),
                out_dtype=jnp.float32,  # logits accumulate and stay in float32 (bf16 inputs)
                name="output",
            )
        if cfg.logits_bias:
            self.final_logits_bias = self.param(
                "final_logits_bias",
                nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",)),
                (cfg.padded_vocab_size,), cfg.weights_dtype,
            )

    def logits(self, x):
        """[B, L, D] -> float32 logits [B, L, V] (a padded table's extra rows dropped)."""
        cfg = self.config
        logits = self.embed.attend(x) if cfg.tie_output else self.output(x)
        logits = logits.astype(jnp.float32)
        if cfg.logits_bias:
            logits = logits + self.final_logits_bias.astype(jnp.float32)
        logits = nn.with_logical_constraint(logits, ("batch", "length", "vocab"))
        return logits[..., : cfg.vocab_size] if cfg.padded_vocab_size != cfg.vocab_size else logits

    def cross_kv(self, memory):
        """Every layer's cross-attention K/V of `memory`, heads first: a tuple of {'k','v'}
        [B, N, S, K], or for a scanned stack one dict of [B, layers, N, S, K]."""
        if self.config.scan_layers:
            return self.blocks(memory, True, True, None, None, memory, None, None, None, None)[1]
        return tuple(
            dict(zip(("k", "v"), block.cross_kv(memory), strict=True)) for block in self.blocks
        )

    def __call__(
        self, tokens, *, memory=None, memory_valid=None, segment_ids=None, positions=None,
        memory_segment_ids=None, cache: KVCache | None = None, num_valid=None,
        deterministic=True, last_only=False,
    ):
        """tokens: int [B, L] -> (logits [B, L, V], updated cache or None).

        Without a cache, query i sees tokens j <= i of its own segment. Right padding needs no
        mask: real tokens never look right. With a cache, the tokens are appended at each row's
        `cache.lengths` and `num_valid` [B] (default L) of them are counted as real; with
        `last_only=True` only the logits of each row's last real token are computed ([B, 1, V]:
        a prompt prefill needs no more, and skips a [B, L, V] product and array).
        """
        tokens = _as_tokens("tokens", tokens, self.config.vocab_size, segment_ids=segment_ids,
                            positions=positions)
        if num_valid is not None:
            num_valid = jnp.asarray(num_valid)
            if num_valid.shape != tokens.shape[:1]:
                raise ValueError(f"num_valid must have shape {tokens.shape[:1]} (one count per row), got "
                                 f"{num_valid.shape}")
            if not jnp.issubdtype(num_valid.dtype, jnp.integer):
                raise ValueError(f"num_valid must be integer counts, got {num_valid.dtype}")
            host = _on_host(num_valid)  # (inside jit the counts cannot be read)
            if host is not None and host.size and not (host.min() >= 0 and host.max() <= tokens.shape[1]):
                bad = int(host.min()) if host.min() < 0 else int(host.max())
                raise ValueError(f"num_valid holds {bad}: each row counts 0 to {tokens.shape[1]} of its "
                                 f"{tokens.shape[1]} new tokens as real")
        if memory is not None and memory.shape[0] != tokens.shape[0]:
            raise ValueError(f"the source has {memory.shape[0]} rows but the target {tokens.shape[0]}: "
                             "they must match")
        if cache is not None:
            if segment_ids is not None or positions is not None or memory is not None:
                raise ValueError("with a cache, positions follow cache.lengths and the source is the "
                                 "cache's: segment_ids, positions and memory cannot be given")
            return self._decode_cached(tokens, cache, num_valid, deterministic, last_only)
        if last_only:
            raise ValueError("last_only=True needs a cache (it picks each row's last of num_valid tokens)")
        if num_valid is not None:  # checked above, and then it was ignored
            raise ValueError("num_valid needs a cache (it counts the tokens appended to it that are real); "
                             "without one, right padding needs no count (real tokens never look right) "
                             "and packed rows take segment_ids")
        if self.cross_attention and memory is None:
            # Without it, each block's cross-attention would attend over the target itself.
            raise ValueError("this decoder has cross-attention: pass memory (the encoder output)")
        if positions is None:
            _check_learned_length(self.config, tokens.shape[1])
            name = "tgt_positions" if self.cross_attention else "positions"
            positions = default_positions(tokens, segment_ids, name)
        else:
            _check_learned_positions(self.config, positions)
        L = tokens.shape[1]
        self_mask = masks.causal_spec(L, segment_ids)
        cross_mask = None
        if memory is not None:
            S = memory.shape[1]
            if segment_ids is not None and memory_segment_ids is not None:
                cross_mask = masks.bidirectional_spec(L, S, q_segment_ids=segment_ids,
                                                      kv_segment_ids=memory_segment_ids)
            else:
                cross_mask = masks.bidirectional_spec(L, S, kv_valid=memory_valid)
        x = self.embed_tokens(tokens, positions, deterministic)
        x, _ = run_blocks(self.blocks, x, deterministic, self_mask=self_mask, positions=positions,
                          memory=memory, cross_mask=cross_mask)
        return self.logits(self.finish(x)), None

    def _decode_cached(self, tokens, cache, num_valid, deterministic, last_only=False):
        B, L = tokens.shape
        _check_cache_layout(self.config, cache)
        if cache.max_length < L:  # the write would clamp and overwrite earlier slots
            raise ValueError(f"{L} tokens do not fit in a KV cache of {cache.max_length} positions "
                             "per row: build the cache with a larger max_length")
        if cache.lengths.shape != (B,):
            raise ValueError(f"the KV cache is built for batch size {cache.lengths.shape[0]}, the "
                             f"tokens have {B} rows")
        if self.cross_attention and cache.cross is None:
            # A cache without the source's K/V would turn each block's cross-attention into an
            # unmasked attention over the new target tokens: logits that ignore the source.
            raise ValueError(
                "an encoder-decoder decodes from a cache that holds the encoded source: build it "
                "with tj.encode_source(model, params, src, max_length) or model.apply(variables, "
                "src, max_length, method='init_cache'); tj.init_cache builds a TransformerLM's "
                "cache, which has no cross-attention keys and values")
        if not self.cross_attention and cache.cross is not None:
            # The encoded source would be carried along unread: a decoder-only model's tokens
            # decoded as if no source had been given, without a word.
            raise ValueError(
                "a TransformerLM decodes from tj.init_cache(config, batch, max_length); this cache "
                "holds an encoded source (tj.encode_source's), which only an encoder-decoder "
                "tj.Transformer reads, with tj.Seq2SeqStep")
        lengths = cache.lengths
        _check_learned_positions(self.config, lengths, "the cached tokens", offset=L - 1)
        positions = lengths[:, None] + jnp.arange(L)[None, :]
        self_mask = masks.cache_spec(lengths, L, cache.max_length)
        cross_mask = None
        if cache.source_mask is not None:
            cross_mask = masks.bidirectional_spec(L, cache.source_mask.shape[1],
                                                  kv_valid=cache.source_mask)
        x = self.embed_tokens(tokens, positions, deterministic)
        x, new_layers = run_blocks(self.blocks, x, deterministic, self_mask=self_mask,
                                   positions=positions, cross_mask=cross_mask, cross_kv=cache.cross,
                                   caches=cache.layers, cache_index=lengths)
        if num_valid is None:
            num_valid = jnp.full((B,), L, jnp.int32)
        num_valid = num_valid.astype(jnp.int32)
        new_cache = cache.replace(layers=new_layers, lengths=lengths + num_valid)
        if last_only and L > 1:
            x = jnp.take_along_axis(x, (num_valid - 1)[:, None, None], axis=1)
        # A row whose L tokens do not fit after its cache.lengths had its write clamped onto earlier
        # slots: its logits are NaN rather than silently wrong (the decoders check sizes first).
        # Marked on the [B, L, D] activations: the [B, L, V] logits are wider.
        overflow = lengths + L > cache.max_length
        x = jnp.where(overflow[:, None, None], jnp.asarray(jnp.nan, x.dtype), x)
        return self.logits(self.finish(x)), new_cache


class Transformer(nn.Module):
    """The paper's encoder-decoder (Figure 1).

    apply({'params': p}, src [B, S], tgt [B, L]) -> float32 logits [B, L, V], where `tgt` is the
    decoder input (targets shifted right, see `masks.shift_right`). With `cache=` (from
    `method='init_cache'`), `src` is ignored and the call returns (logits, cache).
    """

    config: ModelConfig

    def setup(self):
        cfg = self.config
        if cfg.share_embeddings:
            self.embed = make_embed(cfg, "embed")
            source_embed = target_embed = self.embed
        else:
            source_embed = self.source_embed = make_embed(cfg, "source_embed")
            target_embed = self.target_embed = make_embed(cfg, "target_embed")
        self.encoder = Encoder(cfg, source_embed, name="encoder")
        self.decoder = Decoder(cfg, target_embed, cross_attention=True, name="decoder")

    def encode(self, src, *, src_segment_ids=None, src_positions=None, deterministic=True):
        """src: int [B, S] -> encoder output [B, S, D]."""
        return self.encoder(src, segment_ids=src_segment_ids, positions=src_positions,
                            deterministic=deterministic)

    def __call__(
        self, src, tgt, *, src_segment_ids=None, tgt_segment_ids=None, src_positions=None,
        tgt_positions=None, cache: KVCache | None = None, num_valid=None, deterministic=True,
        last_only=False,
    ):
        _check_params(self)
        vocab = self.config.vocab_size
        tgt = _as_tokens("tgt", tgt, vocab, tgt_segment_ids=tgt_segment_ids, tgt_positions=tgt_positions)
        if src is None and cache is None:
            raise ValueError("src is None: without a cache the encoder-decoder needs the source tokens "
                             "(src=None is for decoding steps from a cache that holds the encoded source)")
        if cache is None:
            src = _as_tokens("src", src, vocab, src_segment_ids=src_segment_ids, src_positions=src_positions)
        _check_learned_positions(self.config, tgt_positions, "tgt_positions")
        if cache is not None:
            given = [name for name, value in (
                ("src", src), ("src_segment_ids", src_segment_ids), ("src_positions", src_positions),
                ("tgt_segment_ids", tgt_segment_ids), ("tgt_positions", tgt_positions)) if value is not None]
            if given:  # each was ignored: the cache holds the encoded source, and positions follow it
                raise ValueError(f"with a cache the source is the one it was built from and the target "
                                 f"positions follow cache.lengths: {', '.join(given)} cannot be given "
                                 f"(pass src=None)")
            return self.decoder(tgt, cache=cache, num_valid=num_valid, deterministic=deterministic,
                                last_only=last_only)
        if last_only or num_valid is not None:  # raises: each needs a cache
            return self.decoder(tgt, num_valid=num_valid, last_only=last_only)
        memory = self.encode(src, src_segment_ids=src_segment_ids, src_positions=src_positions,
                             deterministic=deterministic)
        logits, _ = self.decoder(
            tgt, memory=memory, memory_valid=self.encoder.valid_tokens(src, src_segment_ids),
            segment_ids=tgt_segment_ids, positions=tgt_positions,
            memory_segment_ids=src_segment_ids, deterministic=deterministic,
        )
        return logits

    def init_cache(self, src, max_length: int, *, src_segment_ids=None, dtype=None) -> KVCache:
        """Encode `src` once and return a decoding cache for up to `max_length` target tokens,
        holding every decoder layer's cross-attention K/V of the source.

        One source per row: `src_segment_ids` (optional, [B, S]) marks its tokens with a non-zero
        id and padding with 0, where the pad id cannot (positions count from each segment's
        start; the target attends to every non-zero token of its row)."""
        _check_params(self)
        src = _as_tokens("src", src, self.config.vocab_size, src_segment_ids=src_segment_ids)
        _check_learned_length(self.config, src.shape[1])  # (positions given below skip the encoder's)
        positions = None if src_segment_ids is None else segment_positions(src_segment_ids)
        memory = self.encode(src, src_segment_ids=src_segment_ids, src_positions=positions)
        dtype = cache_dtype(self.config) if dtype is None else dtype
        cross = jax.tree.map(lambda a: a.astype(dtype), self.decoder.cross_kv(memory))
        return KVCache(
            layers=empty_layers(self.config, src.shape[0], max_length, dtype),
            lengths=empty_lengths(src.shape[0]),
            cross=cross,
            source_mask=self.encoder.valid_tokens(src, src_segment_ids),
        )


class TransformerLM(nn.Module):
    """Decoder-only language model (GPT-style) from the same blocks, without cross-attention.

    apply({'params': p}, tokens [B, L]) -> float32 logits [B, L, V];
    with `cache=` (from `init_cache`) it returns (logits, cache).

    It ignores the config's encoder fields. Helpers that take only a config (`tj.count_params`,
    `build_model`, `convert_params`, `restore_for_inference`) read ``num_encoder_layers > 0`` as an
    encoder-decoder: give a decoder-only model ``num_encoder_layers=0``.
    """

    config: ModelConfig

    def setup(self):
        self.embed = make_embed(self.config, "embed")
        self.decoder = Decoder(self.config, self.embed, cross_attention=False, name="decoder")

    def __call__(self, tokens, *, segment_ids=None, positions=None, cache=None, num_valid=None,
                 deterministic=True, last_only=False):
        _check_params(self)
        logits, new_cache = self.decoder(tokens, segment_ids=segment_ids, positions=positions,
                                         cache=cache, num_valid=num_valid,
                                         deterministic=deterministic, last_only=last_only)
        return logits if cache is None else (logits, new_cache)


# ----------------------------------------------------------------------------- checkpoint layouts
def _stacks(config: ModelConfig):
    """(stack name, depth) of every block stack in the parameter tree."""
    return (("encoder", config.num_encoder_layers), ("decoder", config.num_decoder_layers))


def _is_box(x):
    return isinstance(x, nn.Partitioned)


def _stack_leaves(*leaves):
    if _is_box(leaves[0]):
        return leaves[0].replace(value=jnp.stack([x.value for x in leaves]),
                                 names=("layers",) + tuple(leaves[0].names))
    return jnp.stack(leaves)


def _leaf_at(x, i):
    if _is_box(x):
        return x.replace(value=x.value[i], names=tuple(x.names[1:]))
    return x[i]


def scan_params(params, config: ModelConfig):
    """Per-layer parameters ('layer_0', 'layer_1', ...) -> the `scan_layers=True` layout: one 'layers'
    subtree whose leaves are stacked on a leading axis (logical name 'layers' on boxed params).
    A stack with another number of layers than `config` says is a ValueError naming the field."""
    params = dict(params)
    for stack, depth in _stacks(config):
        if stack not in params or "layer_0" not in params[stack]:
            continue
        tree = dict(params[stack])
        found = {k for k in tree if k.startswith("layer_") and k[len("layer_"):].isdigit()}
        if found != {f"layer_{i}" for i in range(depth)}:
            # A config of another depth would leave the extra layers behind, or fail on a missing one.
            raise ValueError(f"scan_params: params['{stack}'] has {len(found)} layers (layer_0, ...), "
                             f"but config.num_{stack}_layers={depth}")
        layers = [tree.pop(f"layer_{i}") for i in range(depth)]
        tree["layers"] = jax.tree.map(_stack_leaves, *layers, is_leaf=_is_box)
        params[stack] = tree
    return params


def unscan_params(params, config: ModelConfig):
    """The inverse of `scan_params`: a stacked 'layers' subtree -> 'layer_0', 'layer_1', ...
    A stack of another depth than `config` says is a ValueError naming the field."""
    params = dict(params)
    for stack, depth in _stacks(config):
        if stack not in params or "layers" not in params[stack]:
            continue
        tree = dict(params[stack])
        stacked = tree.pop("layers")
        sizes = {(x.value if _is_box(x) else x).shape[0] for x in jax.tree.leaves(stacked, is_leaf=_is_box)}
        if sizes != {depth}:
            # Indexing past the stack clamps to its last layer: another depth would copy that
            # layer into the missing ones (or drop layers) without an error.
            raise ValueError(f"unscan_params: params['{stack}']['layers'] stacks {sorted(sizes)} "
                             f"layers, but config.num_{stack}_layers={depth}")
        for i in range(depth):
            tree[f"layer_{i}"] = jax.tree.map(lambda x, i=i: _leaf_at(x, i), stacked, is_leaf=_is_box)
        params[stack] = tree
    return params
