"""The explicit KV cache: an argument and a return value of the decoder, never hidden state.

Every leaf has the batch as its leading axis, so decoding code can repeat rows (beam expansion)
and gather them (beam reordering) with one `jax.tree.map`.
"""

from __future__ import annotations

import operator

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.config import ModelConfig
from transformer_jax.modeling import native


@flax.struct.dataclass
class KVCache:
    """Keys and values of every decoder layer for the tokens seen so far.

    layers:  per decoder layer, {'k', 'v'}: [B, N, S_max, K] self-attention keys and values, heads
             before positions (the layout the attention matmuls read without a copy: a decoding
             step reads each layer's cache once instead of transposing it); with `scan_layers`
             one {'k', 'v'} dict of [B, layers, N, S_max, K] (batch still leading).
    lengths: int32 [B]: how many slots of each row hold real tokens. New tokens are written from
             there, so a batch may hold prompts of different lengths.
    cross:   encoder-decoder only: per layer, {'k', 'v'}: [B, N, S_src, K], the source's
             cross-attention keys and values, computed once when the cache is built, heads first
             like `layers` (scanned: one dict of [B, layers, N, S_src, K]).
    source_mask: encoder-decoder only: bool [B, S_src], True on real source tokens.
    """

    layers: tuple
    lengths: jax.Array
    cross: tuple | None = None
    source_mask: jax.Array | None = None

    @property
    def max_length(self) -> int:
        k = self.layers["k"] if isinstance(self.layers, dict) else self.layers[0]["k"]
        return k.shape[-2]  # [B, (layers,) N, S_max, K]

    def reorder_beams(self, rows: jax.Array, cpu_kernels: str = "xla") -> KVCache:
        """Row i of the result holds row ``rows[i]``'s self-attention state, for beam search.

        ``rows`` must map every row to a row of the same source (the beams of one input), so the
        source's cross-attention K/V and mask, identical across those rows, are kept as they are
        rather than gathered on every step.

        ``cpu_kernels`` as `ModelConfig.cpu_kernels` (beam search passes the model's): where
        `native.use_native` says yes, a CPU computation reorders the cache in place with
        `native.cache_reorder`, copying only the first ``lengths[rows[i]]`` positions of the rows
        whose parent changed; positions past a row's length then keep their old entries rather
        than the parent's (every step writes a position before reading it); a computation placed off
        the CPU gets the same values from `native.cache_reorder_xla`. Otherwise every leaf is
        gathered whole.
        """
        lengths = self.lengths[rows]  # each row's parent's: the positions it takes
        if native.use_native(cpu_kernels):
            layers = jax.tree.map(lambda x: _reorder_in_place(x, rows, lengths), self.layers)
        else:
            layers = jax.tree.map(lambda x: x[rows], self.layers)
        return self.replace(layers=layers, lengths=lengths)


_reorder_in_place = native.with_xla_derivatives(
    "transformer_jax_cache_reorder",
    lambda x, rows, counts: jax.lax.platform_dependent(x, rows, counts, cpu=native.cache_reorder,
                                                       default=native.cache_reorder_xla),
    native.cache_reorder_xla)


def cache_dtype(config: ModelConfig):
    """The KV cache's default dtype (self- and cross-attention): the compute dtype, except float32
    for a 16-bit compute dtype when the default backend is CPU and the model runs XLA's kernels
    there. XLA:CPU has neither a bf16 scatter (the cache write) nor a bf16 batched matmul (the
    attention products): with a bf16 cache it converts every layer's whole cache to float32 and
    back on every decoding step. The package's CPU kernels (`ModelConfig.cpu_kernels`, decided as
    `native.use_native` does where the cache is made) write and read a bf16 cache in place, half
    the bytes. The values are the same either way: keys and values leave their projections already
    rounded to the compute dtype."""
    dtype = config.compute_dtype
    if dtype.itemsize == 2 and jax.default_backend() == "cpu":
        if dtype == jnp.bfloat16 and native.use_native(config.cpu_kernels):
            return dtype
        return jnp.dtype(jnp.float32)
    return dtype


def _count(name: str, value) -> int:
    """A size given as a Python or NumPy integer (or a concrete integer array), at least 1."""
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return value


def _split_over_mesh(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """``x`` split by the logical axis ``names`` under `parallel.sharding_context` (a mesh and its
    rules in scope), as the activations that fill it are; ``x`` as it is without them. A dimension
    the mesh does not divide (a batch of 3 on 8 devices, one key/value head on a tensor axis of 2)
    stays whole. Without this a decoding cache was whole on every device of the mesh."""
    rules, mesh = nn.get_logical_axis_rules(), jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return x
    # Only Auto axes take a constraint (not the Manual axes inside a shard_map, nor Explicit ones).
    auto = {name for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
            if kind == jax.sharding.AxisType.Auto}
    spec = []
    for dim, axes in zip(x.shape, nn.logical_to_mesh_axes(names, rules), strict=True):
        named = (axes,) if isinstance(axes, str) else tuple(axes or ())
        size = int(np.prod([mesh.shape[a] for a in named])) if set(named) <= auto else 0
        spec.append(axes if named and size and dim % size == 0 else None)
    if not any(spec):
        return x
    return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(*spec))


def empty_layers(config: ModelConfig, batch_size: int, max_length: int, dtype=None):
    batch_size, max_length = _count("batch_size", batch_size), _count("max_length", max_length)
    dtype = cache_dtype(config) if dtype is None else dtype
    if not jnp.issubdtype(dtype, jnp.floating):  # an integer cache truncated every key and value
        raise ValueError(f"the cache dtype must be a floating-point type, got {jnp.dtype(dtype).name}")
    shape = (batch_size, config.kv_heads, max_length, config.qk_dim)
    names = ("batch", "kv_heads", "length", "kv")
    if config.scan_layers:
        shape, names = (batch_size, config.num_decoder_layers) + shape[1:], ("batch", "layers") + names[1:]
    zeros = lambda: _split_over_mesh(jnp.zeros(shape, dtype), names)  # noqa: E731
    if config.scan_layers:
        return {"k": zeros(), "v": zeros()}
    return tuple({"k": zeros(), "v": zeros()} for _ in range(config.num_decoder_layers))


def empty_lengths(batch_size: int) -> jax.Array:
    """The tokens held per row of an empty cache: zeros [batch_size], split over the batch axes."""
    return _split_over_mesh(jnp.zeros((batch_size,), jnp.int32), ("batch",))


def init_cache(config: ModelConfig, batch_size: int, max_length: int, dtype=None) -> KVCache:
    """An empty cache for `TransformerLM` holding up to `max_length` tokens per row.

    (For `Transformer`, build it with `model.apply(variables, src, max_length, method='init_cache')`,
    which also encodes the source.)
    """
    return KVCache(
        layers=empty_layers(config, batch_size, max_length, dtype),
        lengths=empty_lengths(batch_size),
    )
