"""The device mesh: three named axes, ``('data', 'fsdp', 'tensor')``.

* ``data``   -- pure data parallelism: params replicated, batch split (this is what ``jax.pmap``
  used to do; ``mesh.data=-1`` gives it over every device).
* ``fsdp``   -- fully sharded data parallelism: batch split *and* params/optimizer state sharded
  along their ``'embed'`` dimension (ZeRO-3 style; XLA all-gathers weights when used).
* ``tensor`` -- tensor (Megatron) parallelism: heads, d_ff and vocab dimensions split.

How logical array dimensions map onto these axes lives in :mod:`transformer_jax.parallel.rules`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from transformer_jax.config import ConfigError

MESH_AXES = ("data", "fsdp", "tensor")


def resolve_mesh_shape(data: int, fsdp: int, tensor: int, num_devices: int) -> tuple[int, int, int]:
    """Fills in at most one ``-1`` and checks the product equals ``num_devices``.

    Raises a ConfigError (a ValueError) naming the config keys (``mesh.data``, ``mesh.fsdp``,
    ``mesh.tensor``) and the device count, so a bad config fails before anything is compiled.
    """
    raw = {"data": data, "fsdp": fsdp, "tensor": tensor}
    for key, value in raw.items():  # int() would take True as 1 and 2.5 as 2
        if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
            raise ConfigError(f"mesh.{key}={value!r} must be an integer (a size, or -1 to fill "
                              f"with the remaining devices)")
    sizes = {k: int(v) for k, v in raw.items()}
    shown = ", ".join(f"mesh.{k}={v}" for k, v in sizes.items())
    bad = [k for k, v in sizes.items() if v == 0 or v < -1]
    if bad:
        raise ConfigError(
            f"Mesh sizes must be positive or -1 (fill with the remaining devices); got {shown}."
        )
    fill = [k for k, v in sizes.items() if v == -1]
    if len(fill) > 1:
        raise ConfigError(
            f"At most one mesh axis may be -1; got {shown} "
            f"({' and '.join('mesh.' + k for k in fill)} are both -1)."
        )
    known = math.prod(v for v in sizes.values() if v != -1)
    if fill:
        if num_devices % known:
            raise ConfigError(
                f"Cannot fill mesh.{fill[0]}=-1: the other axes ({shown}) multiply to {known}, "
                f"which does not divide the {num_devices} available devices."
            )
        sizes[fill[0]] = num_devices // known
    elif known != num_devices:
        raise ConfigError(
            f"mesh.data * mesh.fsdp * mesh.tensor must equal the number of devices: "
            f"{shown} multiply to {known}, but there are {num_devices} devices. "
            f"Set one of them to -1 to use all remaining devices."
        )
    return sizes["data"], sizes["fsdp"], sizes["tensor"]


def _num_slices(devices: Sequence[Any]) -> int:
    """Number of TPU slices (multi-slice / DCN-connected pods); 1 everywhere else."""
    indices = {getattr(d, "slice_index", 0) for d in devices}
    return len(indices)


def _device_array(shape: tuple[int, int, int], devices: Sequence[Any]) -> np.ndarray:
    """Orders devices so that neighbouring mesh coordinates are close on the interconnect.

    ``mesh_utils.create_device_mesh`` knows the TPU/GPU topologies; on multi-slice TPU the
    ``data`` axis is laid over the slow DCN links with ``create_hybrid_device_mesh`` (only data
    parallelism crosses slices). Any topology the helpers reject falls back to plain order.
    """
    num_slices = _num_slices(devices)
    try:
        if num_slices > 1 and shape[0] % num_slices == 0:
            ici_shape = (shape[0] // num_slices, shape[1], shape[2])
            return mesh_utils.create_hybrid_device_mesh(ici_shape, (num_slices, 1, 1), devices=devices)
        return mesh_utils.create_device_mesh(shape, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):
        return np.asarray(devices, dtype=object).reshape(shape)


def create_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """Builds a ``Mesh`` with axes ``('data', 'fsdp', 'tensor')`` over ``devices``.

    Args:
      data, fsdp, tensor: axis sizes; at most one may be -1 and is filled with the devices left.
      devices: defaults to every device of every process, ``jax.devices()``.

    The axes are ``AxisType.Auto`` so Linen logical partitioning and ``with_sharding_constraint``
    work (``jax.make_mesh`` defaults to Explicit axes). Use it as ``with jax.set_mesh(mesh):``.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(data, fsdp, tensor, len(devices))
    return Mesh(_device_array(shape, devices), MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def mesh_from_config(mesh_config: Any, devices: Sequence[Any] | None = None) -> Mesh:
    """``create_mesh`` from a config section with fields ``data``, ``fsdp``, ``tensor``.

    Accepts an ``ml_collections.ConfigDict``, a dict or any object with those attributes; missing
    fields take ``create_mesh``'s defaults (data=-1, fsdp=1, tensor=1).
    """
    defaults = {"data": -1, "fsdp": 1, "tensor": 1}
    if isinstance(mesh_config, Mapping):
        sizes = {k: mesh_config.get(k, v) for k, v in defaults.items()}
    else:
        sizes = {k: getattr(mesh_config, k, v) for k, v in defaults.items()}
    return create_mesh(**sizes, devices=devices)


def data_parallel_size(mesh: Mesh, rules=None) -> int:
    """How many ways the batch is split: the mesh axes ``rules`` give the ``'batch'`` dimension
    (``mesh.data * mesh.fsdp`` with the default rules)."""
    from transformer_jax.parallel import rules as _rules

    return _rules.batch_shard_count(mesh, _rules.DEFAULT_RULES if rules is None else rules)


def _param_shard_count(mesh: Mesh, rules) -> int:
    """The product of the mesh axes that some parameter dimension is sharded over (every rule but
    ``'batch'`` and ``'length'``, which name activation dimensions only)."""
    axes = set()
    for name, target in rules:
        if name in ("batch", "length") or target is None:
            continue
        axes.update((target,) if isinstance(target, str) else target)
    return math.prod(mesh.shape[a] for a in sorted(axes) if a in mesh.shape)


def describe_mesh(mesh: Mesh, rules=None) -> str:
    """One line for the startup log, e.g.

    ``mesh data=4 fsdp=2 tensor=1 | 8 cpu devices, 1 process | batch split 8 ways, params sharded
    up to 2 ways``

    The splits follow ``rules`` (default: ``parallel.DEFAULT_RULES``), so a mesh with axis names of
    its own is described by the rules that name them.
    """
    from transformer_jax.parallel import rules as _rules

    rules = _rules.DEFAULT_RULES if rules is None else rules
    axes = " ".join(f"{name}={size}" for name, size in mesh.shape.items())
    devices = list(mesh.devices.flat)
    kinds = sorted({d.platform for d in devices})
    processes = len({d.process_index for d in devices})
    return (
        f"mesh {axes} | {mesh.size} {'/'.join(kinds)} devices, "
        f"{processes} process{'es' if processes != 1 else ''} | "
        f"batch split {data_parallel_size(mesh, rules)} ways, "
        f"params sharded up to {_param_shard_count(mesh, rules)} ways"
    )
