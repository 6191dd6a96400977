"""Parameter shapes and counts without allocating memory (`jax.eval_shape`), and the key a seed
initialises them from."""

from __future__ import annotations

import math
import operator

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.config import ModelConfig


def key_from_seed(seed: int, *, legacy: bool = False) -> jax.Array:
    """The PRNG key for an integer ``seed`` in [-2**63, 2**63): the key JAX makes for it with 64-bit
    integers on (``jax.random.key(seed)`` for a seed in [0, 2**32), as ever).

    With them off (JAX's default) ``jax.random.key`` keeps a seed's low 32 bits, so seeds 0 and 2**32
    (or -2**63) gave the same key. ``legacy``: the raw uint32 key of ``jax.random.PRNGKey`` instead
    of a typed one.
    """
    seed = operator.index(seed)
    if not -(2**63) <= seed < 2**63:
        raise ValueError(f"seed={seed}: must be in [-2**63, 2**63)")
    make = jax.random.PRNGKey if legacy else jax.random.key
    if 0 <= seed < 2**32:
        return make(seed)
    with jax.enable_x64(True):
        return make(np.int64(seed))


def build_model(config: ModelConfig):
    """The module for a config: `Transformer` when it has an encoder, `TransformerLM` otherwise."""
    from transformer_jax.modeling import Transformer, TransformerLM

    return Transformer(config) if config.num_encoder_layers > 0 else TransformerLM(config)


def dummy_inputs(config, batch_size: int = 1, length: int = 8):
    """Token arrays to initialise a model with (no longer than a learned position table).

    ``config``: a `ModelConfig` (inputs for `build_model(config)`: two for an encoder-decoder,
    one for a decoder-only config), or a module, whose kind decides (a `TransformerLM` takes one
    input even when its config has encoder layers, which it ignores)."""
    from transformer_jax.modeling import TransformerLM

    if isinstance(config, ModelConfig):
        two = config.num_encoder_layers > 0
    else:  # a module
        two, config = not isinstance(config, TransformerLM), config.config
    tokens = jnp.zeros((batch_size, min(length, config.max_len)), jnp.int32)
    return (tokens, tokens) if two else (tokens,)


def _boxed_param_shapes(config: ModelConfig):
    """The parameter pytree as `jax.ShapeDtypeStruct`s inside their logical-partitioning boxes."""
    model = build_model(config)
    return jax.eval_shape(lambda: model.init(jax.random.key(0), *dummy_inputs(config)))["params"]


def param_shapes(config: ModelConfig):
    """The parameter pytree as `jax.ShapeDtypeStruct`s (logical-partitioning boxes removed)."""
    from transformer_jax.parallel.rules import unbox_shapes

    return unbox_shapes(_boxed_param_shapes(config))


def count_params(config: ModelConfig) -> int:
    """Number of parameters (shared embeddings counted once; the extra rows of a padded vocabulary,
    `pad_vocab_multiple`, included). Allocates nothing."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(param_shapes(config)))


def _logical_names(boxed) -> dict:
    """{path: logical axis names} of every boxed parameter (with the 'layers' axis when scanned)."""
    import flax.linen as nn

    is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)
    leaves = jax.tree_util.tree_leaves_with_path(boxed, is_leaf=is_box)
    return {jax.tree_util.keystr(path): tuple(box.names) for path, box in leaves if is_box(box)}


# Fields `convert_params` converts, and fields that do not touch the parameters at all; every
# other field fixes what the parameters mean.
CONVERTIBLE_FIELDS = ("kernel_layout", "param_dtype", "pad_vocab_multiple", "fused_qkv", "scan_layers")
PARAMETER_FREE_FIELDS = ("dtype", "dropout_rate", "attention_dropout_rate", "embedding_dropout_rate",
                         "attention_impl", "remat", "cpu_kernels")


def _shapes(tree) -> dict:
    return {jax.tree_util.keystr(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _check_matches(params, expected, config: ModelConfig, target: ModelConfig) -> None:
    """Raises, naming the parameter, unless `params` has the paths and shapes of `expected`; the
    error also names the layout the parameters do have, where it is the target's or one field away."""
    want, have = _shapes(expected), _shapes(params)
    if have == want:
        return
    source = (f"the source config (kernel_layout={config.kernel_layout!r}, fused_qkv={config.fused_qkv}, "
              f"scan_layers={config.scan_layers}, {config.padded_vocab_size} vocabulary rows)")
    if set(have) != set(want):
        missing, extra = sorted(set(want) - set(have))[:3], sorted(set(have) - set(want))[:3]
        problem = f"params do not match {source}: missing {missing}, unexpected {extra}"
    else:
        key = next(key for key in have if have[key] != want[key])
        problem = f"params{key} has shape {have[key]}, but {source} has {want[key]}"
    raise ValueError(f"convert_params: {problem}{_layout_hint(have, config, target)}")


def _layout_hint(have: dict, config: ModelConfig, target: ModelConfig) -> str:
    """'; ...' naming the layout whose parameters have the shapes `have`: the source config with one
    of kernel_layout, fused_qkv or scan_layers changed, else the target; '' if none of them."""
    # 'packed' has the shapes of 'out_in', and is not told apart from it here
    shaped = lambda c, field: "out_in" if getattr(c, field) == "packed" else getattr(c, field)
    candidates = []
    for field, values in (("kernel_layout", ("in_out", "out_in")), ("fused_qkv", (False, True)),
                          ("scan_layers", (False, True))):
        for value in values:
            if value == shaped(config, field):
                continue
            name = f"{field}={value!r}" + (" (or 'packed', the same shapes)" if value == "out_in" else "")
            if value == shaped(target, field):
                hint = f"they are the parameters of {name}, the target's: converted already?"
            else:
                hint = f"they are the parameters of {name}: give that as the source config"
            candidates.append((lambda field=field, value=value: config.replace(**{field: value}), hint))
    candidates.append((lambda: target, "they are in the target's layout already: converted before?"))
    for candidate, hint in candidates:
        try:
            shapes = _shapes(param_shapes(candidate()))
        except Exception:  # noqa: BLE001 - a combination the model refuses; the hint is best-effort
            continue
        if shapes == have:
            return f"; {hint}"
    return ""


def _relayout(params, source_names: dict, target_names: dict):
    """Every kernel's axes permuted so that its logical axis names follow the target's."""

    def move(path, x):
        key = jax.tree_util.keystr(path)
        src, dst = source_names.get(key), target_names.get(key)
        if src is None or src == dst:
            return x
        if len(set(src)) != len(src):
            raise ValueError(f"convert_params: params{key} repeats an axis name: {src}")
        return jnp.transpose(x, [src.index(name) for name in dst])

    return jax.tree_util.tree_map_with_path(move, params)


def _convert_qkv(params, names: dict, to_fused: bool):
    """Every self-attention's `query`, `key` and `value` parameters fused into `qkv`
    (`attention.fuse_qkv`), or `qkv` split back into them. `names`: the source's logical axis names
    by parameter path. Cross-attention keeps its three projections either way."""
    from transformer_jax.modeling.attention import fuse_qkv, split_qkv

    def key(path):
        return jax.tree_util.keystr(tuple(jax.tree_util.DictKey(k) for k in path))

    def walk(tree, path):
        if not isinstance(tree, dict):
            return tree
        tree = {k: walk(v, path + (k,)) for k, v in tree.items()}
        if not path or path[-1] != "self_attention":
            return tree
        if to_fused and "query" in tree:
            parts = {leaf: fuse_qkv(*(tree[p][leaf] for p in ("query", "key", "value")),
                                    axis=names[key(path + ("query", leaf))].index("heads"))
                     for leaf in tree["query"]}
            rest = {k: v for k, v in tree.items() if k not in ("query", "key", "value")}
            return {"qkv": parts, **rest}
        if not to_fused and "qkv" in tree:
            split = {leaf: split_qkv(x, axis=names[key(path + ("qkv", leaf))].index("kv_heads"))
                     for leaf, x in tree["qkv"].items()}
            parts = {p: {leaf: qkv[i] for leaf, qkv in split.items()}
                     for i, p in enumerate(("query", "key", "value"))}
            return {**parts, **{k: v for k, v in tree.items() if k != "qkv"}}
        return tree

    return walk(params, ())


def _resize_vocab(params, names: dict, rows: int, rows_before: int):
    """Every array with a 'vocab' axis padded with zero rows, or cut, to `rows` along it. Only
    padding rows are cut: they are never looked up and their logits are dropped."""

    def resize(path, x):
        axes = names.get(jax.tree_util.keystr(path), ())
        if "vocab" not in axes:
            return x
        axis = axes.index("vocab")
        if rows < rows_before:
            return jax.lax.slice_in_dim(x, 0, rows, axis=axis)
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, rows - rows_before)
        return jnp.pad(x, widths)

    return jax.tree_util.tree_map_with_path(resize, params)


def _packed_views(config: ModelConfig) -> dict:
    """{path: (leading axes, output axes)} of the arrays ``kernel_layout='packed'`` stores packed:
    every projection kernel (its output axes first, as 'out_in'; after the 'layers' axis of a
    scanned stack) and every token embedding table (its 'vocab' axis)."""
    out_in = _logical_names(_boxed_param_shapes(config.replace(kernel_layout="out_in")))
    in_out = _logical_names(_boxed_param_shapes(config.replace(kernel_layout="in_out")))
    views = {}
    for key, names in out_in.items():
        lead = 1 if names[:1] == ("layers",) else 0
        body, other = names[lead:], in_out[key][lead:]
        if key.endswith("['embedding']"):
            if "vocab" in body:
                views[key] = (lead, 1)
        elif key.endswith("['kernel']"):
            n_out = next((n for n in range(1, len(body)) if body[n:] + body[:n] == other), None)
            if n_out is None:
                raise ValueError(f"convert_params: params{key} has no output axes to pack: {body}")
            views[key] = (lead, n_out)
    return views


def _repack(params, views: dict, pack: bool):
    """The arrays of `views` packed (`attention.pack_kernel`), or unpacked."""
    from transformer_jax.modeling.attention import pack_kernel, unpack_kernel

    fn = pack_kernel if pack else unpack_kernel

    def move(path, x):
        view = views.get(jax.tree_util.keystr(path))
        if view is None:
            return x
        lead, n_out = view
        one = lambda a: fn(a, n_out)  # noqa: E731
        for _ in range(lead):
            one = jax.vmap(one)
        if isinstance(x, jax.Array):  # the same shape: the result keeps the array's sharding
            return jax.jit(one, out_shardings=x.sharding)(x)
        return one(jnp.asarray(x))

    return jax.tree_util.tree_map_with_path(move, params)


def convert_params(params, config: ModelConfig, target: ModelConfig):
    """`params` of a model built from `config`, as the parameters of `target`, which may differ
    from it in `CONVERTIBLE_FIELDS` (and `PARAMETER_FREE_FIELDS`) only: the same function with
    kernels stored in another `kernel_layout` (each kernel's axes permuted so that its logical
    axis names follow), cast to another `param_dtype`, with the vocabulary padded to another
    `pad_vocab_multiple` (zero rows added or padding rows removed), or with self-attention's
    query, key and value kernels stored as one (`fused_qkv`) or three, or with the layers stacked
    for `scan_layers` or one by one (`modeling.scan_params` / `unscan_params`, exact); 'packed'
    goes through 'out_in', whose shapes it has. For decoding on CPU, e.g.::

        serving = config.replace(kernel_layout="out_in", dtype="bfloat16", param_dtype="bfloat16")
        serving_params = tj.params.convert_params(params, config, serving)

    `model.init`'s partitioning boxes are removed. Sharded arrays keep each axis's sharding through
    the transposes, and a packed (or unpacked) array keeps its array's sharding. Errors name the
    parameter that does not match `config`."""
    import flax
    import flax.linen as nn

    changed = sorted(set(config.diff(target)) - set(CONVERTIBLE_FIELDS + PARAMETER_FREE_FIELDS))
    if changed:
        raise ValueError(f"convert_params converts {CONVERTIBLE_FIELDS} only; the configs also "
                         f"differ in {changed}, which change what the parameters mean")
    params = flax.core.unfreeze(nn.unbox(params))  # a FrozenDict as dicts, which the steps below walk
    if not set(config.diff(target)) & set(CONVERTIBLE_FIELDS):
        return params
    boxed = _boxed_param_shapes(config)
    _check_matches(params, nn.unbox(boxed), config, target)
    if config.scan_layers != target.scan_layers:  # the rest one layer at a time, then stacked
        from transformer_jax.modeling.transformer import scan_params, unscan_params

        if config.scan_layers:
            params, config = unscan_params(params, config), config.replace(scan_layers=False)
        params = convert_params(params, config, target.replace(scan_layers=False))
        return scan_params(params, target) if target.scan_layers else params
    if config.kernel_layout == "packed":  # through 'out_in', the same shapes
        params = _repack(params, _packed_views(config), pack=False)
        config = config.replace(kernel_layout="out_in")
        boxed = _boxed_param_shapes(config)
    layout = "out_in" if target.kernel_layout == "packed" else target.kernel_layout
    if target.fused_qkv != config.fused_qkv:
        params = _convert_qkv(params, _logical_names(boxed), target.fused_qkv)
        config = config.replace(fused_qkv=target.fused_qkv)
        boxed = _boxed_param_shapes(config)
    if layout != config.kernel_layout:
        target_boxed = _boxed_param_shapes(config.replace(kernel_layout=layout))
        params = _relayout(params, _logical_names(boxed), _logical_names(target_boxed))
    if target.padded_vocab_size != config.padded_vocab_size:
        names = _logical_names(_boxed_param_shapes(config.replace(kernel_layout=layout)))
        params = _resize_vocab(params, names, target.padded_vocab_size, config.padded_vocab_size)
    if target.kernel_layout == "packed":
        params = _repack(params, _packed_views(target), pack=True)
    dtype = target.weights_dtype
    return jax.tree.map(lambda x: x if x.dtype == dtype else x.astype(dtype), params)
