"""Learning-rate schedules at known steps (optax count = paper step - 1)."""

import math

import ml_collections
import numpy as np
import pytest

from transformer_jax.training import schedules
from transformer_jax.training.optimizer import default_optimizer_config


def _paper(step, d_model=512, warmup=4000):
    return d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def test_paper_schedule_peaks_at_warmup():
    lr = schedules.rsqrt_paper(512, 4000)
    peak = float(lr(3999))  # paper step 4000
    np.testing.assert_allclose(peak, 512**-0.5 * 4000**-0.5, rtol=1e-6)
    np.testing.assert_allclose(peak, 6.988e-4, rtol=1e-3)
    assert float(lr(3998)) < peak and float(lr(4000)) < peak


@pytest.mark.parametrize("count", [0, 1, 99, 3999, 15999, 99999])
def test_paper_schedule_matches_formula(count):
    lr = schedules.rsqrt_paper(512, 4000)
    np.testing.assert_allclose(float(lr(count)), _paper(count + 1), rtol=1e-6)


def test_paper_schedule_first_step_is_small_and_finite():
    first = float(schedules.rsqrt_paper(512, 4000)(0))
    assert math.isfinite(first) and first > 0
    np.testing.assert_allclose(first, 512**-0.5 * 4000**-1.5, rtol=1e-6)


def test_paper_schedule_big_model_and_scale():
    lr = schedules.rsqrt_paper(1024, 4000, scale=2.0)
    np.testing.assert_allclose(float(lr(3999)), 2.0 * (1024 * 4000) ** -0.5, rtol=1e-6)


def test_warmup_cosine():
    lr = schedules.warmup_cosine(1e-3, warmup_steps=10, decay_steps=110, end_value=1e-4)
    np.testing.assert_allclose(float(lr(0)), 1e-4, rtol=1e-6)  # step 1 of 10
    np.testing.assert_allclose(float(lr(9)), 1e-3, rtol=1e-6)  # warm-up ends at step 10
    np.testing.assert_allclose(float(lr(59)), 0.5 * (1e-3 + 1e-4), rtol=1e-5)  # half way
    np.testing.assert_allclose(float(lr(109)), 1e-4, rtol=1e-5)
    np.testing.assert_allclose(float(lr(500)), 1e-4, rtol=1e-5)


def test_warmup_constant():
    lr = schedules.warmup_constant(3e-4, warmup_steps=4)
    np.testing.assert_allclose([float(lr(c)) for c in range(6)], [7.5e-5, 1.5e-4, 2.25e-4] + [3e-4] * 3)
    np.testing.assert_allclose(float(schedules.warmup_constant(3e-4, 0)(0)), 3e-4)


def test_create_schedule_from_config():
    config = default_optimizer_config()
    np.testing.assert_allclose(float(schedules.create_schedule(config, 512)(3999)), 6.988e-4, rtol=1e-3)
    config.schedule = "cosine"
    config.learning_rate = 1e-3
    config.warmup_steps = 10
    lr = schedules.create_schedule(config, 512, num_train_steps=110)
    np.testing.assert_allclose(float(lr(109)), 0.0, atol=1e-9)
    config.end_learning_rate_ratio = 0.1  # the floor is a fraction of learning_rate
    lr = schedules.create_schedule(config, 512, num_train_steps=110)
    np.testing.assert_allclose([float(lr(59)), float(lr(109))], [5.5e-4, 1e-4], rtol=1e-5)
    config.schedule = "constant"
    assert float(schedules.create_schedule(config, 512)(1000)) == pytest.approx(1e-3)
    plain = {"schedule": "constant", "learning_rate": 0.5, "warmup_steps": 0}
    assert float(schedules.create_schedule(plain, 512)(0)) == pytest.approx(0.5)


def test_create_schedule_errors():
    config = ml_collections.ConfigDict({"schedule": "cosine", "learning_rate": 1e-3, "warmup_steps": 1})
    with pytest.raises(ValueError, match="decay_steps"):
        schedules.create_schedule(config, 512)
    # the paper's 4000 warm-up steps with cosine over a 1000-step run would never reach the peak
    config.warmup_steps = 4000
    with pytest.raises(ValueError, match=r"warmup_steps=4000 must be below num_train_steps=1000"):
        schedules.create_schedule(config, 512, num_train_steps=1000)
    config.decay_steps = 4000
    with pytest.raises(ValueError, match=r"warmup_steps=4000 must be below optimizer.decay_steps=4000"):
        schedules.create_schedule(config, 512, num_train_steps=10_000)
    config.warmup_steps, config.schedule = -1, "constant"
    with pytest.raises(ValueError, match=r"optimizer.warmup_steps=-1 must be >= 0"):
        schedules.create_schedule(config, 512)
    config.warmup_steps, config.schedule = 1, "cosine"
    config.schedule = "linear"
    with pytest.raises(ValueError, match="optimizer.schedule='linear'"):
        schedules.create_schedule(config, 512)


def test_paper_schedule_without_warmup_and_learning_rate_as_its_scale():
    """warmup_steps=0 (allowed by the config) is read as 1, not 0^-1.5; learning_rate scales the
    paper schedule when it comes from the config."""
    lr = schedules.rsqrt_paper(512, 0)
    np.testing.assert_allclose([float(lr(0)), float(lr(3))], [512**-0.5, 512**-0.5 * 0.5], rtol=1e-6)
    config = default_optimizer_config()
    config.learning_rate, config.warmup_steps = 2.0, 0
    np.testing.assert_allclose(float(schedules.create_schedule(config, 512)(3)), 512**-0.5, rtol=1e-6)
