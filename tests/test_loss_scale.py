"""Dynamic loss scaling for float16 compute (training/steps.py, TrainState.loss_scale)."""

import contextlib
import io
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train import read_jsonl, tiny_config

from transformer_jax import parallel
from transformer_jax.config import ConfigError, ModelConfig
from transformer_jax.params import build_model
from transformer_jax.training import steps
from transformer_jax.training.checkpoint import Checkpointer
from transformer_jax.training.config_checks import check_config
from transformer_jax.training.loop import train_and_evaluate
from transformer_jax.training.optimizer import create_optimizer, default_optimizer_config
from transformer_jax.training.schedules import create_schedule
from transformer_jax.training.state import LossScale, create_train_state, state_shardings

# A decoder-only model small enough for a batch of 65,536 tokens on a CPU in a second or two.
MODEL = dict(vocab_size=64, d_model=32, num_heads=2, d_ff=64, num_encoder_layers=0, num_decoder_layers=1,
             max_len=512, dropout_rate=0.0, cpu_kernels="xla")


def _setup(dtype: str, loss_scale, period: int = 2000, **settings):
    """(jitted step, initial state) for MODEL in `dtype` on one device."""
    config = ModelConfig(**MODEL, dtype=dtype)
    model = build_model(config)
    opt = default_optimizer_config()
    opt.schedule, opt.learning_rate, opt.warmup_steps = "constant", 1e-3, 0
    tx, schedule = create_optimizer(opt, config.d_model, 10), create_schedule(opt, config.d_model, 10)
    mesh = parallel.mesh_from_config({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
    state, _ = create_train_state(model, tx, mesh, 0, loss_scale)
    step_settings = steps.StepSettings(label_smoothing=0.0, loss_scale_period=period, **settings)
    step = jax.jit(lambda s, b: steps.train_step(s, b, model=model, tx=tx, schedule=schedule,
                                                 settings=step_settings))
    return step, state


def _batch(rows: int, length: int = 64, seed: int = 0):
    """LM rows whose targets are mostly one token: the gradient of its output row then sums over
    nearly every token of the batch, as the most frequent word's does over a large real batch."""
    rng = np.random.default_rng(seed)
    targets = np.where(rng.random((rows, length)) < 0.9, 5, rng.integers(0, 64, (rows, length)))
    positions = np.tile(np.arange(length), (rows, 1))
    return {"targets": jnp.asarray(targets, jnp.int32),
            "targets_segment_ids": jnp.ones((rows, length), jnp.int32),
            "targets_positions": jnp.asarray(positions, jnp.int32)}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


def _same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_float16_gradients_of_a_large_batch_overflow_unscaled_and_equal_float32_scaled():
    """65,536 tokens: the summed loss's float16 gradient passes 65504 (inf; the step is non-finite),
    while the scaled mean's equals float32's."""
    batch = _batch(1024)
    step32, state32 = _setup("float32", None)
    _, want = step32(state32, batch)
    assert want["finite"] == 1 and float(want["grad_norm"]) * 65_536 > 65_504  # the sum's own gradient
    step16, state16 = _setup("float16", None)
    _, unscaled = step16(state16, batch)
    assert unscaled["finite"] == 0 and not np.isfinite(float(unscaled["grad_norm"]))
    step16, state16 = _setup("float16", 2.0**10)
    new, got = step16(state16, batch)
    assert got["finite"] == 1 and got["overflow"] == 0 and got["loss_scale"] == 2.0**10
    np.testing.assert_allclose(float(got["grad_norm"]), float(want["grad_norm"]), rtol=2e-2)
    np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-2)
    assert not _same(new.params, state16.params) and int(new.loss_scale.good_steps) == 1


def test_the_scale_halves_on_an_overflow_and_doubles_after_its_period(monkeypatch):
    batch = _batch(2)
    step, state = _setup("float16", 2.0**40, period=2)
    new, metrics = step(state, batch)  # 2**40 times any gradient overflows float16
    assert (metrics["overflow"], metrics["finite"], metrics["loss_scale"]) == (1, 0, 2.0**40)
    assert _same((new.params, new.opt_state), (state.params, state.opt_state)) and int(new.step) == 1
    assert (float(new.loss_scale.scale), int(new.loss_scale.good_steps)) == (2.0**39, 0)
    state = new.replace(loss_scale=LossScale.initial(2.0**8))
    scales = []
    for _ in range(3):
        state, metrics = step(state, batch)
        assert metrics["finite"] == 1 and metrics["overflow"] == 0
        scales.append((float(state.loss_scale.scale), int(state.loss_scale.good_steps)))
    assert scales == [(2.0**8, 1), (2.0**9, 0), (2.0**9, 1)]
    # Micro-batches scale by the whole batch's token count: the same gradients as one call
    whole, halves = (_setup("float16", 2.0**8, grad_accum_steps=n) for n in (1, 2))
    np.testing.assert_allclose(float(whole[0](whole[1], batch)[1]["grad_norm"]),
                               float(halves[0](halves[1], batch)[1]["grad_norm"]), rtol=1e-2)
    # A non-finite loss is not the scale's doing: the guard's (stop or skip), the scale kept
    step, _ = _setup("float16", None, period=2, inject_nan_at_step=4)
    new, metrics = step(state, batch)
    assert (metrics["overflow"], metrics["finite"]) == (0, 0)
    assert (float(new.loss_scale.scale), int(new.loss_scale.good_steps)) == (2.0**9, 0)
    # The scale stops at its floor, and an overflow there is not the scale's doing either (the mean
    # loss's gradients themselves pass 65504)
    floor = 1.5 * 2.0**39
    monkeypatch.setattr(steps, "MIN_LOSS_SCALE", floor)
    step, state = _setup("float16", 2.0**40)
    state, metrics = step(state, batch)
    assert (metrics["overflow"], metrics["finite"], float(state.loss_scale.scale)) == (1, 0, floor)
    state, metrics = step(state, batch)
    assert (metrics["overflow"], metrics["finite"], float(state.loss_scale.scale)) == (0, 0, floor)


def test_the_checkpoint_keeps_the_scale_and_a_run_without_one_ignores_it(tmp_path):
    config = ModelConfig(**MODEL, dtype="float16")
    model = build_model(config)
    tx = create_optimizer(default_optimizer_config(), config.d_model, 10)
    mesh = parallel.mesh_from_config({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
    state, _ = create_train_state(model, tx, mesh, 0, 2.0**12)
    state = state.replace(step=jnp.int32(3), loss_scale=LossScale(jnp.float32(2.0**11), jnp.int32(7)))
    plain, _ = create_train_state(model, tx, mesh, 0)
    for name, saved in (("scaled", state), ("plain", plain)):
        saving = Checkpointer(str(tmp_path / name), model_config=config)
        saving.save(saved)
        saving.close()
    scaled_abstract, _ = state_shardings(model, tx, mesh, 0, 2.0**15)
    plain_abstract, _ = state_shardings(model, tx, mesh, 0)
    restore = lambda name, abstract: Checkpointer(str(tmp_path / name), model_config=config).restore(abstract)
    restored = restore("scaled", scaled_abstract)
    assert (float(restored.loss_scale.scale), int(restored.loss_scale.good_steps)) == (2.0**11, 7)
    assert restore("scaled", plain_abstract).loss_scale is None
    assert restore("plain", scaled_abstract).loss_scale is None


def test_a_float16_run_resumed_from_float32_skips_overflows_without_stopping(data_dir, tmp_path):
    """A float32 run's checkpoint resumed in float16 starts the scale at loss_scale_init; overflowed
    steps neither stop the run nor count as skipped; the checkpoints hold the scale, and a resume
    goes on from it."""
    workdir = str(tmp_path / "run")
    train_and_evaluate(tiny_config(data_dir, num_train_steps=2, checkpoint_every_steps=2, log_every_steps=1),
                       workdir)
    config = tiny_config(data_dir, num_train_steps=5, checkpoint_every_steps=2, log_every_steps=1,
                         loss_scale_init=2.0**40, **{"model.dtype": "float16"})
    assert config.skip_nonfinite is False and config.loss_scale == "auto"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        final = train_and_evaluate(config, workdir)
    assert "written without dynamic loss scaling: its scale starts at config.loss_scale_init=1.09951e+12" in (
        out.getvalue())
    records = {r["step"]: r for r in read_jsonl(workdir) if "loss" in r}
    assert [records[s].get("loss_scale") for s in range(1, 6)] == [None, None, 2.0**40, 2.0**39, 2.0**38]
    assert all(records[s]["loss_scale_skipped"] == 1 and records[s]["skipped"] == 0 for s in (3, 4, 5))
    assert final["skipped_steps"] == 0 and np.isfinite(final["loss"]) and final["step"] == 5
    assert os.path.isdir(os.path.join(workdir, "checkpoints", "4", "loss_scale"))
    # Resumed from step 5's checkpoint, the run goes on from its scale (2**38 overflowed at step 5)
    config.num_train_steps = 6
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train_and_evaluate(config, workdir)
    assert "without dynamic loss scaling" not in out.getvalue()
    assert {r["step"]: r for r in read_jsonl(workdir) if "loss" in r}[6]["loss_scale"] == 2.0**37


@pytest.mark.parametrize("key,value,message", [
    ("loss_scale", "static", "config.loss_scale='static' is not one of ['auto', 'dynamic', 'none']"),
    ("loss_scale_init", 0.5, "config.loss_scale_init=0.5 must be a number in [1, "),
    ("loss_scale_period", 0, "config.loss_scale_period=0 must be an integer >= 1"),
    ("loss_scale_period", 2**31, "config.loss_scale_period=2147483648 must be below 2**31"),
])
def test_loss_scale_settings_are_checked(key, value, message):
    config = tiny_config("/nonexistent")
    config[key] = value
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_config(config)


def test_auto_scales_float16_only():
    config = tiny_config("/nonexistent")
    assert steps.initial_loss_scale(config) is None  # float32
    config.model.dtype = "bfloat16"
    assert steps.initial_loss_scale(config) is None  # bfloat16 has float32's range
    config.model.dtype = "float16"
    assert steps.initial_loss_scale(config) == 2.0**15
    config.loss_scale = "none"
    assert steps.initial_loss_scale(config) is None
    config.model.dtype, config.loss_scale = "float32", "dynamic"
    assert steps.initial_loss_scale(config) == 2.0**15
    with config.unlocked():  # a dtype object, as a config file may give it (ModelConfig takes it)
        config.model = dict(config.model.to_dict(), dtype=jnp.float16)
    config.loss_scale = "auto"
    assert steps.initial_loss_scale(config) == 2.0**15
