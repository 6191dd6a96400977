"""The optimizer: Adam(W) with the paper's settings, clipping, masked weight decay, accumulation.

Gradient accumulation is done in the train step, not in optax: :func:`accumulate_gradients` runs
``optimizer.grad_accum_steps`` micro-batches through a ``lax.scan`` and sums their gradients, and
the optimizer then makes one update. So the optimizer's step count (and the learning-rate
schedule) counts *train steps*, peak memory is one micro-batch of activations, and the result is
the exact full-batch gradient (losses are summed and divided by the total token count once).
:func:`create_optimizer` therefore never wraps the optimizer in ``optax.MultiSteps``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax

from transformer_jax.config import ConfigError
from transformer_jax.training.schedules import config_value, create_schedule

OPTIMIZERS = ("adam", "adamw")
NO_DECAY_LEAF_NAMES = ("scale", "bias")


def default_optimizer_config() -> ml_collections.ConfigDict:
    """``config.optimizer`` with the paper's recipe (section 5.3-5.4)."""
    c = ml_collections.ConfigDict()
    c.name = "adam"  # 'adam' | 'adamw' (decoupled weight decay)
    c.learning_rate = 1.0  # scale for 'rsqrt_paper' (1.0 = paper); peak rate otherwise
    c.schedule = "rsqrt_paper"  # 'rsqrt_paper' | 'cosine' | 'constant'
    c.warmup_steps = 4000
    c.decay_steps = 0  # 'cosine' only; 0 = num_train_steps
    c.end_learning_rate_ratio = 0.0  # 'cosine' only: final rate / peak rate
    c.b1 = 0.9
    c.b2 = 0.98
    c.eps = 1e-9
    c.weight_decay = 0.0  # needs name='adamw'; never applied to norms and biases
    c.decay_embeddings = True  # False also exempts embedding tables from weight decay
    c.grad_clip_norm = 0.0  # clip by global norm; 0 = off (the paper does not clip)
    c.grad_accum_steps = 1  # micro-batches per step, see accumulate_gradients
    c.label_smoothing = 0.1
    c.z_loss = 0.0
    return c


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _decays(path: tuple[Any, ...], decay_embeddings: bool) -> bool:
    names = [_key_name(k) for k in path]
    if names and names[-1] == "value":  # the payload of an nn.Partitioned box
        names = names[:-1]
    if not names:
        return True
    last = names[-1]
    if (last in NO_DECAY_LEAF_NAMES or last.endswith(tuple("_" + n for n in NO_DECAY_LEAF_NAMES))
            or any("norm" in n.lower() for n in names)):
        return False
    return decay_embeddings or not any("embed" in n.lower() for n in names)


def weight_decay_mask(params: Any, decay_embeddings: bool = True) -> Any:
    """Tree of bools, True where weight decay applies.

    Decided by each parameter's path: leaves named ``'scale'`` or ``'bias'`` or ending in
    ``'_scale'`` / ``'_bias'`` (the output layer's ``'final_logits_bias'``) and anything under a
    module whose name contains ``'norm'`` are exempt; with ``decay_embeddings=False`` so is any
    path containing ``'embed'`` (e.g. ``'embedding'`` tables). Works on ``nn.Partitioned``-boxed
    trees too (the mask keeps the boxes).
    """
    return jax.tree_util.tree_map_with_path(lambda p, _: _decays(p, decay_embeddings), params)


def create_optimizer(
    optimizer_config: Any, d_model: int, num_train_steps: int | None = None
) -> optax.GradientTransformation:
    """Adam or AdamW from ``config.optimizer`` (see :func:`default_optimizer_config`).

    Chain: clip by global norm (if ``grad_clip_norm > 0``) -> Adam moments (b1, b2, eps) ->
    decoupled weight decay on the masked params (``'adamw'``) -> learning-rate schedule.
    """
    cfg = default_optimizer_config()
    get = lambda name: config_value(optimizer_config, name, cfg[name])
    name, weight_decay = get("name"), float(get("weight_decay"))
    if name not in OPTIMIZERS:
        raise ConfigError(f"Unknown optimizer.name={name!r}; expected one of {OPTIMIZERS}.")
    if name == "adam" and weight_decay > 0:
        raise ConfigError(
            f"optimizer.weight_decay={weight_decay} needs optimizer.name='adamw' "
            "(decoupled weight decay); plain 'adam' has none."
        )
    chain = []
    if float(get("grad_clip_norm")) > 0:
        chain.append(optax.clip_by_global_norm(float(get("grad_clip_norm"))))
    chain.append(optax.scale_by_adam(b1=float(get("b1")), b2=float(get("b2")), eps=float(get("eps"))))
    if weight_decay > 0:
        decay_embeddings = bool(get("decay_embeddings"))
        mask = lambda params: weight_decay_mask(params, decay_embeddings)
        chain.append(optax.add_decayed_weights(weight_decay, mask=mask))
    schedule = create_schedule(optimizer_config, d_model, num_train_steps)
    chain.append(optax.scale_by_learning_rate(schedule))
    return optax.chain(*chain)


def schedule_count(opt_state: Any) -> jax.Array | None:
    """The step count of the learning-rate schedule in ``opt_state`` (optax's own count: it does
    not advance on a skipped non-finite step, unlike ``TrainState.step``), or None if it has none."""
    is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=is_schedule) if is_schedule(s)]
    return found[0].count if found else None


def _split_micro_batches(batch: Any, num_micro_batches: int) -> Any:
    """``[B, ...]`` -> ``[n, B / n, ...]`` with micro-batch ``i`` = rows ``i, i + n, i + 2n, ...``.

    The strided split keeps every device's rows spread over all micro-batches, so a batch sharded
    along B needs no communication to be cut up.
    """

    def split(x):
        if x.shape[0] % num_micro_batches:
            raise ValueError(
                f"Batch size {x.shape[0]} is not divisible by optimizer.grad_accum_steps={num_micro_batches}."
            )
        x = x.reshape((x.shape[0] // num_micro_batches, num_micro_batches) + x.shape[1:])
        return jnp.swapaxes(x, 0, 1)

    return jax.tree.map(split, batch)


def accumulate_gradients(
    loss_and_grad_fn: Callable[..., tuple[Any, Any]],
    params: Any,
    batch: Any,
    num_micro_batches: int,
    rng: jax.Array | None = None,
) -> tuple[Any, Any]:
    """Sums ``loss_and_grad_fn`` over ``num_micro_batches`` slices of ``batch`` with ``lax.scan``.

    Args:
      loss_and_grad_fn: ``(params, micro_batch[, rng]) -> (values, grads)``, e.g.
        ``jax.value_and_grad(loss_fn, has_aux=True)``. Return *sums* (``loss_sum``, token count,
        metric sums as from ``losses.cross_entropy``), not means, so the total is exact.
      params: passed unchanged to every call.
      batch: pytree of arrays with the batch as leading axis ``B`` (divisible by the count).
      num_micro_batches: 1 calls ``loss_and_grad_fn`` once on the whole batch.
      rng: if given, split into one key per micro-batch and passed as the third argument.

    Returns:
      ``(values, grads)`` summed over micro-batches; divide by the summed token count afterwards.
      Sums are kept in float32 for lower-precision gradients and cast back at the end.
    """
    rngs = None if rng is None else jax.random.split(rng, num_micro_batches)
    call = lambda mb, key: loss_and_grad_fn(params, mb) if key is None else loss_and_grad_fn(params, mb, key)
    if num_micro_batches == 1:
        return call(batch, None if rngs is None else rngs[0])

    micro = _split_micro_batches(batch, num_micro_batches)
    first = jax.tree.map(lambda x: x[0], micro)
    shapes = jax.eval_shape(call, first, None if rngs is None else rngs[0])
    wide = lambda s: jnp.promote_types(s.dtype, jnp.float32)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, wide(s)), shapes)

    def body(total, xs):
        mb, key = xs
        out = call(mb, key)
        return jax.tree.map(lambda t, o: t + o.astype(t.dtype), total, out), None

    total, _ = jax.lax.scan(body, zeros, (micro, rngs))
    return jax.tree.map(lambda t, s: t.astype(s.dtype), total, shapes)
