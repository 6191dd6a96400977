"""Parallelism: the device mesh, logical axis rules and multi-process start-up.

Mesh axes ``('data', 'fsdp', 'tensor')`` appear only in this package; the model speaks in logical
axis names (``'batch'``, ``'embed'``, ``'mlp'``, ...) and :data:`DEFAULT_RULES` maps them.
"""

from transformer_jax.parallel.distributed import (
    config_differences,
    from_process_0,
    initialize,
    is_primary,
    leave_and_exit,
    on_every_process,
    one_program_at_a_time,
    same_on_every_process,
    stop_child_processes,
    sync_global,
)
from transformer_jax.parallel.mesh import (
    MESH_AXES,
    create_mesh,
    data_parallel_size,
    describe_mesh,
    mesh_from_config,
)
from transformer_jax.parallel.rules import (
    DEFAULT_RULES,
    LogicalRules,
    batch_shard_count,
    batch_sharding,
    check_batch_divisible,
    check_rules,
    logical_to_mesh_spec,
    logical_to_sharding,
    shard_batch,
    sharding_context,
)

__all__ = [
    "DEFAULT_RULES",
    "LogicalRules",
    "MESH_AXES",
    "batch_shard_count",
    "batch_sharding",
    "check_batch_divisible",
    "check_rules",
    "config_differences",
    "create_mesh",
    "from_process_0",
    "data_parallel_size",
    "describe_mesh",
    "initialize",
    "is_primary",
    "leave_and_exit",
    "on_every_process",
    "one_program_at_a_time",
    "same_on_every_process",
    "stop_child_processes",
    "logical_to_mesh_spec",
    "logical_to_sharding",
    "mesh_from_config",
    "shard_batch",
    "sharding_context",
    "sync_global",
]
