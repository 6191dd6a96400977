"""Train and eval steps: pure functions of (state, batch), jitted with shardings by the loop.

Decoder inputs are the targets shifted right inside each packed segment with the decoder start
token at every segment start (``modeling.masks.shift_right``). The loss is label-smoothed
cross-entropy in float32 (``losses.cross_entropy``), summed and divided once by the number of
real (non-pad) target tokens, which is exact across micro-batches and hosts.

With float16 compute that sum overflows: the gradient of a summed loss grows with the batch's token
count, and float16 ends at 65504 (a 2-layer, d_model 128 model's embedding gradient was inf at
131,072 tokens, where float32's largest element was 89,688). Dynamic loss scaling (``TrainState.
loss_scale``, on by default for ``model.dtype='float16'``) differentiates the *mean* token loss times a
scale instead, divides the gradients by that scale in float32, and moves the scale: a step whose
scaled gradients overflow is skipped (parameters and optimizer unchanged) and halves it;
``loss_scale_period`` finite steps in a row double it (PyTorch's GradScaler does the same).
"""

from __future__ import annotations

import contextlib
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from transformer_jax.modeling.masks import shift_right
from transformer_jax.training import losses, optimizer
from transformer_jax.training.state import LossScale, TrainState

LOSS_SCALE_MODES = ("auto", "dynamic", "none")
# Below this an overflow is not the scale's doing (the gradients of the mean loss themselves pass
# 65504): the step is non-finite, as without scaling. Above the other, doubling stops.
MIN_LOSS_SCALE, MAX_LOSS_SCALE = 1.0, 2.0**64


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """What the steps need from the config, unpacked once."""

    label_smoothing: float = 0.1
    z_loss: float = 0.0
    grad_accum_steps: int = 1
    skip_nonfinite: bool = False  # True: a non-finite step leaves the state unchanged
    inject_nan_at_step: int = -1  # testing the guard: the loss of this step is NaN
    loss_scale_period: int = 2000  # finite steps in a row before a dynamic loss scale doubles


def forward(model: nn.Module, params, batch, *, train: bool, rng=None) -> jax.Array:
    """Logits [B, Lt, V] for a packed batch (translation if it has 'inputs', else LM)."""
    cfg = model.config
    seg = batch["targets_segment_ids"]
    tgt_in = shift_right(batch["targets"], seg, cfg.decoder_start_id)
    rngs = {"dropout": rng} if train and rng is not None else None
    if "inputs" in batch:
        return model.apply(
            {"params": params},
            batch["inputs"],
            tgt_in,
            src_segment_ids=batch["inputs_segment_ids"],
            tgt_segment_ids=seg,
            src_positions=batch["inputs_positions"],
            tgt_positions=batch["targets_positions"],
            deterministic=not train,
            rngs=rngs,
        )
    return model.apply(
        {"params": params},
        tgt_in,
        segment_ids=seg,
        positions=batch["targets_positions"],
        deterministic=not train,
        rngs=rngs,
    )


def _loss_sums(model, settings: StepSettings, params, batch, rng=None, train=True):
    logits = forward(model, params, batch, train=train, rng=rng)
    weights = batch["targets_segment_ids"] > 0
    loss_sum, weight_sum, aux = losses.cross_entropy(
        logits, batch["targets"], weights, settings.label_smoothing, settings.z_loss
    )
    return loss_sum, (weight_sum, aux)


def _all_finite(tree) -> jax.Array:
    """Whether every element of every leaf is finite: x * 0 sums to 0, or to NaN where x holds an inf
    or a NaN; the per-leaf sums are stacked and tested once.

    The form decides the compile time. An `all` over per-leaf boolean flags became, in XLA's
    simplifier, a chain of scalar ands, which fusion copied into every consumer of the result (the
    select that keeps or updates each parameter and optimizer leaf): the compiled step grew with the
    square of the number of leaves (XLA:CPU, the 2+2-layer tiny model: 25 s, 3+3 layers: 55 s)."""
    sums = jnp.stack([jnp.sum(x * 0, dtype=jnp.float32) for x in jax.tree.leaves(tree)])
    return jnp.all(jnp.isfinite(sums))


def train_step(
    state: TrainState,
    batch: dict[str, jax.Array],
    *,
    model: nn.Module,
    tx: optax.GradientTransformation,
    schedule,
    settings: StepSettings,
):
    """One optimizer update. -> (new state, metrics of this step, as device scalars)."""
    rng = jax.random.fold_in(state.rng, state.step)
    scaler = state.loss_scale
    if scaler is not None:  # d(mean loss * scale): independent of the token count, in float16's range
        factor = scaler.scale / jnp.maximum(jnp.count_nonzero(batch["targets_segment_ids"]), 1)

    def loss_and_grad(params, micro_batch, key):
        fn = lambda p: _loss_sums(model, settings, p, micro_batch, key)
        if scaler is None:
            return jax.value_and_grad(fn, has_aux=True)(params)

        def scaled(p):
            loss_sum, aux = fn(p)
            return loss_sum * factor, (loss_sum, aux)

        (_, (loss_sum, aux)), grads = jax.value_and_grad(scaled, has_aux=True)(params)
        return (loss_sum, aux), grads

    (loss_sum, (weight_sum, aux)), grads = optimizer.accumulate_gradients(
        loss_and_grad, state.params, batch, settings.grad_accum_steps, rng
    )
    if settings.inject_nan_at_step >= 0:
        loss_sum = jnp.where(state.step == settings.inject_nan_at_step, jnp.nan, loss_sum)
        grads = jax.tree.map(
            lambda g: jnp.where(state.step == settings.inject_nan_at_step, jnp.nan, g), grads
        )
    if scaler is None:
        denom = jnp.maximum(weight_sum, 1.0)
        grads = jax.tree.map(lambda g: g / denom.astype(g.dtype), grads)
    else:  # an overflow stays inf
        grads = jax.tree.map(lambda g: (g.astype(jnp.float32) / scaler.scale).astype(g.dtype), grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # The update too, not only its inputs: finite gradients can still give a non-finite update
    # (Adam's 0 / (0 + eps) with eps = 0 where a gradient is exactly 0 -- a dead ReLU unit, an unused
    # embedding row), which the guard let into the parameters and a checkpoint as a good step.
    if scaler is None:
        finite = jnp.isfinite(loss_sum) & _all_finite((grads, updates))
    else:
        grads_finite = _all_finite(grads)
        finite = jnp.isfinite(loss_sum) & grads_finite & _all_finite(updates)
        # The scale's doing: a finite loss whose scaled gradients overflowed, while it can still fall
        overflow = jnp.isfinite(loss_sum) & ~grads_finite & (scaler.scale > MIN_LOSS_SCALE)
        grow = finite & (scaler.good_steps + 1 >= settings.loss_scale_period)
        new_scaler = LossScale(
            scale=jnp.where(overflow, jnp.maximum(scaler.scale / 2, MIN_LOSS_SCALE),
                            jnp.where(grow, jnp.minimum(scaler.scale * 2, MAX_LOSS_SCALE), scaler.scale)),
            good_steps=jnp.where(finite & ~grow, scaler.good_steps + 1, 0).astype(jnp.int32),
        )
    # A non-finite step changes nothing but the step counter (the loop stops or carries on).
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    new_state = state.replace(
        step=state.step + 1, params=keep(params, state.params), opt_state=keep(opt_state, state.opt_state)
    )
    if scaler is not None:
        new_state = new_state.replace(loss_scale=new_scaler)
    metrics = losses.normalize_metrics(loss_sum, weight_sum, aux)
    # The rate this update applies: the optimizer's count lags state.step after skipped steps.
    count = optimizer.schedule_count(state.opt_state)
    metrics.update(
        grad_norm=optax.tree.norm(grads),
        learning_rate=schedule(state.step if count is None else count),
        finite=finite.astype(jnp.float32),
        real_tokens=real_tokens(batch),
    )
    if scaler is not None:  # the scale this step used; an overflow is skipped, and not an error
        metrics.update(loss_scale=scaler.scale, overflow=overflow.astype(jnp.float32))
    return new_state, metrics


def real_tokens(batch: dict[str, jax.Array]) -> jax.Array:
    """Source + target tokens that are not padding (segment id > 0) in the whole global batch.

    Counted inside the step, over the global arrays, so that a multi-process run's tokens/s is the
    sum of every process's rows and not process 0's count times the number of processes."""
    keys = [k for k in ("inputs_segment_ids", "targets_segment_ids") if k in batch]
    return sum(jnp.count_nonzero(batch[k]) for k in keys).astype(jnp.int32)


def eval_step(params, batch: dict[str, jax.Array], *, model: nn.Module, settings: StepSettings):
    """Summed loss, token count and metric sums over one eval batch (normalise after summing)."""
    loss_sum, (weight_sum, aux) = _loss_sums(model, settings, params, batch, train=False)
    return {"loss_sum": loss_sum, "weight_sum": weight_sum, **aux}


def settings_from_config(config) -> StepSettings:
    opt = config.optimizer
    return StepSettings(
        label_smoothing=float(opt.label_smoothing),
        z_loss=float(opt.z_loss),
        grad_accum_steps=int(opt.grad_accum_steps),
        skip_nonfinite=bool(config.get("skip_nonfinite", False)),
        inject_nan_at_step=int(config.get("inject_nan_at_step", -1)),
        loss_scale_period=int(config.get("loss_scale_period", 2000)),
    )


def initial_loss_scale(config) -> float | None:
    """The starting scale of dynamic loss scaling, or None where the run does not scale:
    ``loss_scale`` 'dynamic', or 'auto' (the default) with float16 compute."""
    mode, dtype = config.get("loss_scale", "auto"), config.model.get("dtype")
    if not isinstance(dtype, str):  # a dtype object (jnp.float16), as ModelConfig takes it
        with contextlib.suppress(TypeError):
            dtype = jnp.dtype(dtype).name
    if mode == "dynamic" or (mode == "auto" and dtype == "float16"):
        return float(config.get("loss_scale_init", 2.0**15))
    return None
