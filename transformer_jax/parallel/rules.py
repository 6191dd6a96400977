"""Logical axis rules: how named array dimensions map onto the mesh axes.

The model names every parameter dimension (``nn.with_logical_partitioning``) and key activation
dimension (``nn.with_logical_constraint``) with one vocabulary: ``'batch'``, ``'length'``,
``'embed'``, ``'heads'``, ``'kv_heads'``, ``'kv'`` (head_dim), ``'mlp'`` (d_ff), ``'vocab'``,
``'layers'``. This module is the only place that turns those names into mesh axes.

Params and activations share the names (the t5x scheme). Linen walks the rules in order and gives
a mesh axis to the first rule that claims it within one array, and no mesh axis is used twice.
Because ``'batch'`` comes first and takes ``('data', 'fsdp')``:

* a weight ``('embed', 'mlp')`` becomes ``P('fsdp', 'tensor')`` -- FSDP shards params on embed;
* an activation ``('batch', 'length', 'embed')`` becomes ``P(('data', 'fsdp'), None, None)`` --
  ``fsdp`` is already taken by the batch, so the activation's embed dimension stays whole.

So every activation constraint that names ``'embed'`` must also name ``'batch'``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from transformer_jax.config import ConfigError

LogicalRules = Sequence[tuple[str, str | tuple[str, ...] | None]]

DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("length", None),
    ("kv", None),
    ("qkv", None),  # the query/key/value slots of a fused self-attention kernel (fused_qkv)
    ("layers", None),
)


def check_rules(rules: LogicalRules | None, mesh: Mesh) -> tuple:
    """``rules`` (None: `DEFAULT_RULES`) as a tuple of ``(logical name, mesh axes)`` pairs, checked
    against ``mesh``: each pair a logical name (a string) and None, a mesh axis or a tuple of
    distinct mesh axes, every axis one the mesh has. Anything else is a ConfigError naming the
    entry (Flax otherwise failed inside the first traced constraint, or silently ignored a
    malformed pair)."""
    if rules is None:
        rules = DEFAULT_RULES
    if isinstance(rules, str | bytes) or not isinstance(rules, Sequence):
        raise ConfigError(f"logical axis rules must be a sequence of (logical name, mesh axes) pairs, "
                          f"like parallel.DEFAULT_RULES; got {type(rules).__name__}")
    checked = []
    for index, entry in enumerate(rules):
        ok = isinstance(entry, tuple | list) and len(entry) == 2 and isinstance(entry[0], str)
        axes = entry[1] if ok else None
        axes = (axes,) if isinstance(axes, str) else () if axes is None else axes
        if (not ok or not isinstance(axes, tuple | list) or not all(isinstance(a, str) for a in axes)
                or len(set(axes)) != len(axes)):
            raise ConfigError(f"logical axis rules entry {index}, {entry!r}: expected a pair (logical "
                              f"name, None | mesh axis | tuple of distinct mesh axes), e.g. ('batch', "
                              f"('data', 'fsdp'))")
        _check_axes_exist(axes, mesh, f"logical axis rules entry {index}, {tuple(entry)!r},")
        checked.append((entry[0], entry[1] if not isinstance(entry[1], list) else tuple(entry[1])))
    return tuple(checked)


def _are_default(rules) -> bool:
    try:
        return tuple(map(tuple, rules)) == DEFAULT_RULES
    except TypeError:  # malformed: not the default (check_rules names the entry)
        return False


def require_mesh_for(rules: LogicalRules | None, mesh: Mesh | None, what: str) -> None:
    """Rules of one's own name the axes of a mesh of one's own: given without it (``mesh=None``, so
    the default ``data`` / ``fsdp`` / ``tensor`` mesh), a ConfigError saying to pass the mesh."""
    if mesh is None and rules is not None and not _are_default(rules):
        raise ConfigError(f"{what}: rules of your own are given without the mesh whose axes they name; "
                          f"pass mesh= too (without it the mesh is the default rules' data x fsdp x "
                          f"tensor)")


def logical_to_mesh_spec(names: Sequence[str | None], rules: LogicalRules = DEFAULT_RULES):
    """Logical dimension names -> mesh ``PartitionSpec``; names without a rule are replicated."""
    return nn.logical_to_mesh_axes(tuple(names), rules)


@contextlib.contextmanager
def sharding_context(mesh: Mesh, rules: LogicalRules = DEFAULT_RULES) -> Iterator[Mesh]:
    """``with jax.set_mesh(mesh), nn.logical_axis_rules(rules):`` in one line.

    Wrap model init, jit and apply in it: without the rules, Linen's activation constraints
    silently do nothing; without the mesh, parameter boxes are not constrained at all.
    """
    explicit = [name for name, kind in zip(mesh.axis_names, getattr(mesh, "axis_types", ()), strict=False)
                if kind == jax.sharding.AxisType.Explicit]
    if explicit:
        raise ValueError(
            f"mesh axes {explicit} are AxisType.Explicit (jax.make_mesh's default): the model places "
            f"its arrays with logical-axis constraints, which need Auto axes. Build the mesh with "
            f"parallel.create_mesh, or jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,) * "
            f"{len(mesh.axis_names)})")
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield mesh


def _check_axes_exist(axes, mesh: Mesh, what: str) -> None:
    """A ConfigError naming the first of ``axes`` that ``mesh`` lacks (``what`` names the rules)."""
    missing = [a for a in axes if a not in mesh.shape]
    if missing:
        raise ConfigError(
            f"{what} name{'s' if what.endswith(',') else ''} mesh axis {missing[0]!r}, which this mesh "
            f"(axes {tuple(mesh.axis_names)}) does not have: map the logical names onto the mesh's own "
            f"axes (the default rules, parallel.DEFAULT_RULES, name 'data', 'fsdp' and 'tensor')")


def _axis_size(mesh: Mesh, axes: str | tuple[str, ...] | None) -> int:
    if axes is None:
        return 1
    axes = (axes,) if isinstance(axes, str) else axes
    _check_axes_exist(axes, mesh, "the logical axis rules")
    return int(np.prod([mesh.shape[a] for a in axes]))


def _fit_to_shape(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh, where: str,
                  names: Sequence[str | None], replicated: dict):
    """Replicates any dimension whose size the assigned mesh axes do not divide.

    jit refuses uneven shardings, and e.g. a 37,000-token vocabulary is not divisible by a tensor
    axis of 16; replicating that one dimension is the useful fallback (for the vocabulary,
    `ModelConfig.pad_vocab_multiple` avoids it, and the warning says so). Each replicated dimension
    is recorded in ``replicated`` -- ``(size, axes, axes' size, logical name) -> [where, ...]`` -- for
    `_warn_replicated`'s one warning per kind of dimension.
    """
    fitted = []
    names = tuple(names) + (None,) * (len(shape) - len(names))
    for dim, axes, name in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)), names):
        size = _axis_size(mesh, axes)
        if size > 1 and dim % size:
            replicated.setdefault((dim, axes, size, name), []).append(where)
            axes = None
        fitted.append(axes)
    return PartitionSpec(*fitted)


_REPLICATION_HINTS = {
    "vocab": " Set ModelConfig.pad_vocab_multiple to a multiple of {size} to split it.",
    # measured: grouped-query attention with 2 key/value heads on tensor=4 logged XLA's
    # "Involuntary full rematerialization" of the projections' outputs in every step
    "kv_heads": " The queries are split by heads and the keys and values whole: XLA gathers the "
                "attention's activations in every step ('Involuntary full rematerialization'); a "
                "mesh.tensor that divides ModelConfig.num_kv_heads avoids it.",
}


def _warn_replicated(replicated: dict) -> None:
    """One warning per kind of replicated dimension, with how many arrays have it and a few names
    (the layers of a deep model and their optimizer moments would otherwise repeat it hundreds of
    times)."""
    heads_whole = any(name == "heads" for (*_, name) in replicated)
    for (dim, axes, size, name), where in replicated.items():
        shown = ", ".join(where[:3]) + (f" and {len(where) - 3} more" if len(where) > 3 else "")
        logging.warning(
            "%s: dimension of size %d is not divisible by mesh axes %s (size %d); "
            "replicating it instead.%s",
            f"{len(where)} arrays ({shown})" if len(where) > 1 else where[0],
            dim,
            axes,
            size,
            "" if name == "kv_heads" and heads_whole else _REPLICATION_HINTS.get(name, "").format(size=size),
        )


def _leaf_sharding(path, leaf, mesh: Mesh, rules: LogicalRules, replicated: dict) -> NamedSharding:
    if isinstance(leaf, nn.Partitioned):
        spec = logical_to_mesh_spec(leaf.names, rules)
        shape = getattr(leaf.value, "shape", ())
    else:
        spec, shape = PartitionSpec(), getattr(leaf, "shape", ())
    names = tuple(leaf.names) if isinstance(leaf, nn.Partitioned) else ()
    spec = _fit_to_shape(spec, shape, mesh, jax.tree_util.keystr(path), names, replicated)
    return NamedSharding(mesh, spec)


def logical_to_sharding(tree: Any, mesh: Mesh, rules: LogicalRules = DEFAULT_RULES) -> Any:
    """``NamedSharding`` for every array of a (usually abstract) pytree of boxed params/state.

    Args:
      tree: e.g. ``jax.eval_shape(model.init, ...)`` or an abstract train state whose leaves are
        ``nn.Partitioned`` boxes (from ``nn.with_logical_partitioning``) or plain arrays /
        ``ShapeDtypeStruct`` (replicated, e.g. the optimizer step count).
      mesh: from ``create_mesh``.
      rules: logical axis rules, ``DEFAULT_RULES`` unless overridden.

    Returns:
      The same tree *unboxed* (each ``Partitioned`` replaced by one ``NamedSharding``), matching
      ``nn.unbox(tree)`` -- ready for ``jax.jit(..., out_shardings=...)`` or ``jax.device_put``.
      This is ``nn.get_partition_spec`` + ``nn.logical_to_mesh_sharding``, plus replication of
      dimensions the mesh does not divide.
    """
    replicated: dict = {}
    shardings = jax.tree_util.tree_map_with_path(
        lambda path, leaf: _leaf_sharding(path, leaf, mesh, rules, replicated),
        tree,
        is_leaf=lambda x: isinstance(x, nn.Partitioned),
    )
    _warn_replicated(replicated)
    return shardings


def unbox_shapes(tree: Any) -> Any:
    """``nn.unbox`` for an abstract tree (``jax.eval_shape``'s ShapeDtypeStructs): the boxes removed
    without their logical sharding constraint, which Flax applies inside a `sharding_context` and
    JAX refuses on a ShapeDtypeStruct. The library's state and parameter helpers called in a
    user's ``with sharding_context(mesh):`` failed so ("The sharding on the input must be a
    NamedSharding ... Got sharding type NoneType")."""
    return jax.tree.map(lambda x: x.unbox(apply_constraint=False) if isinstance(x, nn.Partitioned) else x,
                        tree, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def batch_sharding(mesh: Mesh, rules: LogicalRules = DEFAULT_RULES) -> NamedSharding:
    """Sharding for ``[B, L, ...]`` inputs: batch over ``('data', 'fsdp')``, the rest whole."""
    return NamedSharding(mesh, logical_to_mesh_spec(("batch",), rules))


def batch_shard_count(mesh: Mesh, rules: LogicalRules = DEFAULT_RULES) -> int:
    """How many pieces the batch dimension is cut into (``mesh.data * mesh.fsdp`` by default)."""
    return _axis_size(mesh, logical_to_mesh_spec(("batch",), rules)[0])


def check_batch_divisible(batch_size: int, mesh: Mesh, rules: LogicalRules = DEFAULT_RULES,
                          grad_accum_steps: int = 1, key: str = "dataset.batch_size"):
    """Fails early, naming the config ``key`` (``dataset.batch_size``, or ``dataset.eval_batch_size``
    for the evaluation batches), if the global batch cannot be split evenly.

    The batch must divide over the batch mesh axes and over the processes (each process loads
    ``batch_size // jax.process_count()`` rows), and so must each of ``grad_accum_steps``
    micro-batches (XLA would otherwise copy a micro-batch to every device: correct, but no data
    parallelism).
    """
    shards = batch_shard_count(mesh, rules)
    processes = jax.process_count()
    axes = logical_to_mesh_spec(("batch",), rules)[0] or ()
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    split = " * ".join(f"mesh.{a}" for a in axes) or "1"
    if batch_size % shards:
        sizes = " * ".join(str(mesh.shape[a]) for a in axes)
        raise ConfigError(
            f"{key}={batch_size} must be divisible by {split} = "
            f"{sizes + ' = ' if len(axes) > 1 else ''}{shards} (the ways the batch is split)."
        )
    if (batch_size // grad_accum_steps) % shards:
        raise ConfigError(
            f"{key}={batch_size} / optimizer.grad_accum_steps={grad_accum_steps} = "
            f"{batch_size // grad_accum_steps} rows per micro-batch, which must be divisible by the "
            f"{shards} ways the batch is split ({split})")
    if batch_size % processes:
        raise ConfigError(
            f"{key}={batch_size} must be divisible by the number of processes "
            f"({processes}); each process loads an equal share of the global batch."
        )
    if processes > 1:
        pieces: dict[int, set[int]] = {}
        for device, index in batch_sharding(mesh, rules).devices_indices_map((batch_size,)).items():
            pieces.setdefault(device.process_index, set()).add(index[0].start or 0)
        check_process_pieces(pieces, mesh)


def check_process_pieces(pieces: dict[int, set[int]], mesh: Mesh) -> None:
    """Each process loads its own ``batch_size / process_count`` rows, which is right only if the
    batch mesh axes give every process as many pieces of the batch as the others and no piece
    held by another process. Where a non-batch axis (e.g. ``tensor``) spans processes, two
    processes hold the same rows: the global batch would be built as if their different rows were
    copies of one another (smaller than asked for, and different on each host).

    ``pieces``: process index -> start rows of the batch pieces its devices hold.
    """
    owner: dict[int, int] = {}
    for process, starts in sorted(pieces.items()):
        for start in starts:
            if start in owner:
                raise ConfigError(
                    f"With mesh {dict(mesh.shape)}, processes {owner[start]} and {process} hold the "
                    f"same rows of the batch (row {start} on), but each process loads rows of its own. "
                    f"The batch axes (mesh.data * mesh.fsdp) must split the batch across the "
                    f"processes: make mesh.data * mesh.fsdp a multiple of the process count and keep "
                    f"mesh.tensor within one host's devices.")
            owner[start] = process
    if len({len(starts) for starts in pieces.values()}) > 1:
        counts = {process: len(starts) for process, starts in sorted(pieces.items())}
        raise ConfigError(
            f"With mesh {dict(mesh.shape)}, the processes hold unequal numbers of batch pieces "
            f"({counts}), but each loads an equal share: make mesh.data * mesh.fsdp a multiple of "
            f"the process count.")


def shard_batch(batch: Mapping[str, Any], mesh: Mesh, rules: LogicalRules = DEFAULT_RULES):
    """Host-local numpy batch -> global ``jax.Array`` batch sharded with ``batch_sharding``.

    Each process passes its own ``[B / process_count, ...]`` rows; the result has the global
    ``[B, ...]`` shape (``jax.make_array_from_process_local_data``). Works unchanged on one host.
    """
    sharding = batch_sharding(mesh, rules)
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), dict(batch)
    )
