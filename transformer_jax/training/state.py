"""The train state and its sharded initialisation.

``TrainState`` holds everything a step changes: ``step``, ``params``, ``opt_state`` and the base
``rng`` (a raw uint32 key; each step folds the step number into it, so the dropout key of step n
does not depend on how many times training was restarted -- the basis of bit-for-bit resume), and,
when float16 gradients are scaled, the dynamic ``loss_scale``.

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
import numpy as np
import optax

from transformer_jax import parallel
from transformer_jax.parallel.rules import DEFAULT_RULES, LogicalRules, unbox_shapes
from transformer_jax.params import dummy_inputs, key_from_seed


@flax.struct.dataclass
class LossScale:
    """Dynamic loss scaling (``steps.train_step``): the gradients are taken of the mean token loss
    times ``scale``, so that float16's range holds them, and divided by it in float32."""

    scale: jax.Array  # float32 scalar
    good_steps: jax.Array  # int32 scalar: finite steps since the scale last changed

    @classmethod
    def initial(cls, scale: float) -> LossScale:
        return cls(scale=jnp.asarray(scale, jnp.float32), good_steps=jnp.zeros((), jnp.int32))


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer updates applied so far
    params: Any
    opt_state: Any
    rng: jax.Array  # uint32 [2] base key; step keys are fold_in(rng, step)
    loss_scale: LossScale | None = None  # None: the gradients are not scaled


def _init_fn(model: nn.Module, tx: optax.GradientTransformation, seed: int, loss_scale: float | None):
    """() -> TrainState with ``nn.Partitioned`` boxes still on params and moments."""

    key = np.asarray(key_from_seed(seed, legacy=True))  # a constant of the program, on every host

    def init():
        params_key, dropout_key = jax.random.split(key)
        params = model.init(params_key, *dummy_inputs(model))["params"]
        return TrainState(
            step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), rng=dropout_key,
            loss_scale=None if loss_scale is None else LossScale.initial(loss_scale),
        )

    return init


def state_shardings(model: nn.Module, tx: optax.GradientTransformation, mesh, seed: int = 0,
                    loss_scale: float | None = None, rules: LogicalRules = DEFAULT_RULES):
    """(abstract unboxed TrainState of ShapeDtypeStructs with shardings, TrainState of shardings).
    ``loss_scale``: the initial scale of dynamic loss scaling, None without it. ``rules``: the
    logical axis rules that place the arrays on ``mesh`` (`parallel.DEFAULT_RULES` by default)."""
    rules = parallel.check_rules(rules, mesh)
    with parallel.sharding_context(mesh, rules):
        boxed = jax.eval_shape(_init_fn(model, tx, seed, loss_scale))
    shardings = parallel.logical_to_sharding(boxed, mesh, rules)
    abstract = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), unbox_shapes(boxed), shardings
    )
    return abstract, shardings


def create_train_state(model: nn.Module, tx: optax.GradientTransformation, mesh, seed: int = 0,
                       loss_scale: float | None = None, shardings: Any = None,
                       rules: LogicalRules = DEFAULT_RULES):
    """A freshly initialised TrainState, every array created sharded. -> (state, shardings).
    ``shardings``: `state_shardings`' second result for these arguments, if already at hand;
    ``rules``: as for `state_shardings`."""
    rules = parallel.check_rules(rules, mesh)  # (None, or unchecked where ``shardings`` is given)
    if shardings is None:
        _, shardings = state_shardings(model, tx, mesh, seed, loss_scale, rules)
    init = _init_fn(model, tx, seed, loss_scale)
    with parallel.sharding_context(mesh, rules):
        state = jax.jit(lambda: nn.unbox(init()), out_shardings=shardings)()
    return state, shardings


def count_params(params: Any) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))
