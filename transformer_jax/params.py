"""Parameter shapes and counts without allocating memory (`jax.eval_shape`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from transformer_jax.config import ModelConfig


def build_model(config: ModelConfig):
    """The module for a config: `Transformer` when it has an encoder, `TransformerLM` otherwise."""
    from transformer_jax.modeling import Transformer, TransformerLM

    return Transformer(config) if config.num_encoder_layers > 0 else TransformerLM(config)


def dummy_inputs(config: ModelConfig, batch_size: int = 1, length: int = 8):
    tokens = jnp.zeros((batch_size, length), jnp.int32)
    return (tokens, tokens) if config.num_encoder_layers > 0 else (tokens,)


def param_shapes(config: ModelConfig):
    """The parameter pytree as `jax.ShapeDtypeStruct`s (logical-partitioning boxes removed)."""
    import flax.linen as nn

    model = build_model(config)
    variables = jax.eval_shape(
        lambda: model.init(jax.random.key(0), *dummy_inputs(config))
    )
    return nn.unbox(variables["params"])


def count_params(config: ModelConfig) -> int:
    """Number of trainable parameters (shared embeddings counted once). Allocates nothing."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(param_shapes(config)))


def _logical_names(config: ModelConfig) -> dict:
    """{path: logical axis names} of every parameter (the 'layers' axis included when scanned)."""
    import flax.linen as nn

    model = build_model(config)
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), *dummy_inputs(config)))["params"]
    is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)
    leaves = jax.tree_util.tree_leaves_with_path(boxed, is_leaf=is_box)
    return {jax.tree_util.keystr(path): tuple(box.names) for path, box in leaves if is_box(box)}


def convert_kernel_layout(params, config: ModelConfig, kernel_layout: str):
    """`params` of a model built from `config`, with every projection kernel stored in
    `kernel_layout` ('in_out' or 'out_in', see `ModelConfig.kernel_layout`): the parameters of
    ``config.replace(kernel_layout=kernel_layout)``, computing the same function. Each kernel's axes
    are permuted so that its logical axis names follow the target layout; other parameters are
    returned as they are (without `model.init`'s partitioning boxes). Works on sharded arrays (the
    transpose keeps each axis's sharding)."""
    import flax.linen as nn

    target = config.replace(kernel_layout=kernel_layout)
    if target == config:
        return params
    params = nn.unbox(params)  # straight from `model.init`: logical-partitioning boxes removed
    source_names, target_names = _logical_names(config), _logical_names(target)
    expected = param_shapes(config)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    want = dict((jax.tree_util.keystr(p), s) for p, s in jax.tree_util.tree_leaves_with_path(expected))
    have = {jax.tree_util.keystr(p) for p, _ in flat}
    if have != set(want):
        missing, extra = sorted(set(want) - have)[:3], sorted(have - set(want))[:3]
        raise ValueError(f"convert_kernel_layout: params do not match config (kernel_layout="
                         f"{config.kernel_layout!r}): missing {missing}, unexpected {extra}")
    out = []
    for path, x in flat:
        key = jax.tree_util.keystr(path)
        if tuple(x.shape) != tuple(want[key].shape):
            raise ValueError(f"convert_kernel_layout: params{key} has shape {tuple(x.shape)}, but "
                             f"a model with kernel_layout={config.kernel_layout!r} has "
                             f"{tuple(want[key].shape)}")
        src, dst = source_names.get(key), target_names.get(key)
        if src is None or src == dst:
            out.append(x)
            continue
        if len(set(src)) != len(src):
            raise ValueError(f"convert_kernel_layout: params{key} repeats an axis name: {src}")
        out.append(jnp.transpose(x, [src.index(name) for name in dst]))
    return jax.tree_util.tree_unflatten(treedef, out)
