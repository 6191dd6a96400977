"""Learning-rate schedules (``optax.Schedule``: optimizer update count -> learning rate).

Step numbering: optax calls a schedule with the number of updates already applied, so the first
update sees ``count = 0``. Every schedule here uses ``step = count + 1``, the paper's 1-based step:
the first update gets a small positive rate (never 0, never the ``0^-0.5 = inf`` of the raw
formula) and warm-up ends exactly at ``step == warmup_steps``, i.e. ``count == warmup_steps - 1``.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import optax

from transformer_jax.config import ConfigError

SCHEDULES = ("rsqrt_paper", "cosine", "constant")


def _step(count) -> jnp.ndarray:
    return jnp.asarray(count, jnp.float32) + 1.0


def _warmup_fraction(step: jnp.ndarray, warmup_steps: int) -> jnp.ndarray:
    return jnp.minimum(1.0, step / max(warmup_steps, 1))


def rsqrt_paper(d_model: int, warmup_steps: int = 4000, scale: float = 1.0) -> optax.Schedule:
    """Section 5.3, Eq. 3: ``lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)``.

    Linear warm-up for ``warmup_steps`` steps, then decay with the inverse square root of the step.
    The peak, at ``step == warmup_steps``, is ``scale * (d_model * warmup_steps)^-0.5``: about
    7.0e-4 for the base model (d_model=512, warmup 4000) and 4.9e-4 for big (d_model=1024).
    """
    warmup_steps = max(int(warmup_steps), 1)

    def schedule(count):
        step = _step(count)
        return scale * d_model**-0.5 * jnp.minimum(step**-0.5, step * warmup_steps**-1.5)

    return schedule


def warmup_cosine(
    peak_value: float, warmup_steps: int, decay_steps: int, end_value: float = 0.0
) -> optax.Schedule:
    """Linear warm-up to ``peak_value`` over ``warmup_steps``, then a half cosine to ``end_value``.

    ``decay_steps`` is the total length including warm-up (usually ``num_train_steps``); after it
    the rate stays at ``end_value``.
    """
    decay_len = max(int(decay_steps) - int(warmup_steps), 1)

    def schedule(count):
        step = _step(count)
        progress = jnp.clip((step - warmup_steps) / decay_len, 0.0, 1.0)
        cosine = end_value + (peak_value - end_value) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
        return jnp.where(step < warmup_steps, peak_value * _warmup_fraction(step, warmup_steps), cosine)

    return schedule


def warmup_constant(peak_value: float, warmup_steps: int = 0) -> optax.Schedule:
    """Linear warm-up to ``peak_value`` over ``warmup_steps`` (0 = none), then constant."""

    def schedule(count):
        return peak_value * _warmup_fraction(_step(count), warmup_steps)

    return schedule


def config_value(config: Any, name: str, default: Any = None) -> Any:
    """``config.name`` for a ConfigDict, dataclass or plain dict; ``default`` when absent."""
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def create_schedule(
    optimizer_config: Any, d_model: int, num_train_steps: int | None = None
) -> optax.Schedule:
    """The schedule named by ``optimizer.schedule``.

    ``optimizer.learning_rate`` is the *scale* for ``'rsqrt_paper'`` (1.0 = the paper) and the
    *peak* rate for ``'cosine'`` and ``'constant'``. ``'cosine'`` decays over
    ``optimizer.decay_steps`` if set (> 0), else over ``num_train_steps``, to
    ``learning_rate * optimizer.end_learning_rate_ratio`` (0 if the field is absent).
    """
    name = config_value(optimizer_config, "schedule", "rsqrt_paper")
    lr = float(config_value(optimizer_config, "learning_rate"))
    warmup = int(config_value(optimizer_config, "warmup_steps", 0))
    if warmup < 0:
        raise ConfigError(f"optimizer.warmup_steps={warmup} must be >= 0.")
    if name == "rsqrt_paper":
        return rsqrt_paper(d_model, warmup, scale=lr)
    if name == "constant":
        return warmup_constant(lr, warmup)
    if name == "cosine":
        decay_steps = int(config_value(optimizer_config, "decay_steps", 0) or 0) or num_train_steps
        if not decay_steps:
            raise ConfigError(
                "optimizer.schedule='cosine' needs optimizer.decay_steps > 0 or num_train_steps."
            )
        if warmup >= decay_steps:
            source = ("optimizer.decay_steps" if config_value(optimizer_config, "decay_steps", 0)
                      else "num_train_steps")
            raise ConfigError(
                f"optimizer.schedule='cosine': optimizer.warmup_steps={warmup} must be below "
                f"{source}={decay_steps}, the length of warm-up and decay together (the run would "
                f"never finish warming up, let alone decay).")
        end = lr * float(config_value(optimizer_config, "end_learning_rate_ratio", 0.0) or 0.0)
        return warmup_cosine(lr, warmup, decay_steps, end)
    raise ConfigError(f"Unknown optimizer.schedule={name!r}; expected one of {SCHEDULES}.")
