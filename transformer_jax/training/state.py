"""The train state and its sharded initialisation.

``TrainState`` holds everything a step changes: ``step``, ``params``, ``opt_state`` and the base
``rng`` (a raw uint32 key; each step folds the step number into it, so the dropout key of step n
does not depend on how many times training was restarted -- the basis of bit-for-bit resume).

Initialisation never materialises an unsharded copy: ``jax.eval_shape`` gives the shapes and the
logical-axis boxes, ``parallel.logical_to_sharding`` turns the boxes into ``NamedSharding`` s, and
a ``jax.jit`` with those ``out_shardings`` creates every array directly on its devices.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax

from transformer_jax import parallel
from transformer_jax.params import dummy_inputs


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer updates applied so far
    params: Any
    opt_state: Any
    rng: jax.Array  # uint32 [2] base key; step keys are fold_in(rng, step)


def _init_fn(model: nn.Module, tx: optax.GradientTransformation, seed: int):
    """() -> TrainState with ``nn.Partitioned`` boxes still on params and moments."""

    def init():
        params_key, dropout_key = jax.random.split(jax.random.PRNGKey(seed))
        params = model.init(params_key, *dummy_inputs(model))["params"]
        return TrainState(
            step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), rng=dropout_key
        )

    return init


def state_shardings(model: nn.Module, tx: optax.GradientTransformation, mesh, seed: int = 0):
    """(abstract unboxed TrainState of ShapeDtypeStructs with shardings, TrainState of shardings)."""
    with parallel.sharding_context(mesh):
        boxed = jax.eval_shape(_init_fn(model, tx, seed))
    shardings = parallel.logical_to_sharding(boxed, mesh)
    abstract = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), nn.unbox(boxed), shardings
    )
    return abstract, shardings


def create_train_state(model: nn.Module, tx: optax.GradientTransformation, mesh, seed: int = 0):
    """A freshly initialised TrainState, every array created sharded. -> (state, shardings)."""
    _, shardings = state_shardings(model, tx, mesh, seed)
    init = _init_fn(model, tx, seed)
    with parallel.sharding_context(mesh):
        state = jax.jit(lambda: nn.unbox(init()), out_shardings=shardings)()
    return state, shardings


def count_params(params: Any) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))
