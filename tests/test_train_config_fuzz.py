"""Property-based: a generated training config (configs/tiny.py with fields changed) either passes
every check and traces a full training step on 8 devices, or is refused with a ConfigError/ValueError
that names the config key — never an error from inside JAX or XLA."""

import jax
import jax.numpy as jnp
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from configs import tiny
from transformer_jax import parallel
from transformer_jax.config import ModelConfig
from transformer_jax.params import build_model
from transformer_jax.training import steps
from transformer_jax.training.config_checks import check_config
from transformer_jax.training.optimizer import create_optimizer
from transformer_jax.training.schedules import create_schedule
from transformer_jax.training.state import state_shardings

odd = st.sampled_from([0, -1, 1.5, "3", True, None])
FIELDS = {
    "num_train_steps": st.one_of(st.integers(1, 50), odd),
    "log_every_steps": st.one_of(st.integers(1, 5), odd),
    "dataset.name": st.sampled_from(["enfr_builtin", "stdlib_lm", "wmt15", ""]),
    "dataset.batch_size": st.one_of(st.sampled_from([8, 16, 12, 6]), odd),
    "dataset.eval_batch_size": st.one_of(st.sampled_from([8, 16]), odd),
    "optimizer.name": st.sampled_from(["adam", "adamw", "sgd"]),
    "optimizer.schedule": st.sampled_from(["constant", "cosine", "rsqrt_paper", "linear"]),
    "optimizer.grad_accum_steps": st.one_of(st.sampled_from([1, 2, 4, 3]), odd),
    "optimizer.label_smoothing": st.sampled_from([0.0, 0.1, 1.0, -0.2]),
    "mesh.data": st.sampled_from([-1, 1, 2, 8, 3, 0]),
    "mesh.fsdp": st.sampled_from([1, 2, 4, -1, 0]),
    "mesh.tensor": st.sampled_from([1, 2, 3]),
    "model.d_model": st.sampled_from([32, 24, 30, 0]),
    "model.num_heads": st.sampled_from([4, 2, 8, 7]),
    "model.norm": st.sampled_from(["post", "pre", "sandwich"]),
    "beam_size": st.sampled_from([1, 4, 0]),
    "model.dtype": st.sampled_from(["float32", "bfloat16", "float16"]),  # float16: the loss scaled
}


def _apply(config, overrides):
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        target = config
        for p in parents:
            target = target[p]
        with target.unlocked():
            target[leaf] = value
    return config


def _validate_and_trace(config):
    """What train_and_evaluate does before any data is read, then one abstract training step."""
    check_config(config)
    mesh = parallel.mesh_from_config(config.mesh)
    parallel.check_batch_divisible(config.dataset.batch_size, mesh)
    model_cfg = ModelConfig.from_dict(config.model.to_dict())
    model = build_model(model_cfg)
    tx = create_optimizer(config.optimizer, model_cfg.d_model, config.num_train_steps)
    schedule = create_schedule(config.optimizer, model_cfg.d_model, config.num_train_steps)
    abstract, _ = state_shardings(model, tx, mesh, config.seed, loss_scale=steps.initial_loss_scale(config))
    B, L = config.dataset.batch_size, config.dataset.max_target_len
    batch = {k: jax.ShapeDtypeStruct((B, L), jnp.int32) for k in (
        "inputs", "inputs_segment_ids", "inputs_positions",
        "targets", "targets_segment_ids", "targets_positions")}
    settings_ = steps.settings_from_config(config)
    with parallel.sharding_context(mesh):
        new_state, metrics = jax.eval_shape(
            lambda s, b: steps.train_step(s, b, model=model, tx=tx, schedule=schedule, settings=settings_),
            abstract, batch)
    assert metrics["loss"].shape == ()
    assert ("loss_scale" in metrics) == (model_cfg.dtype == "float16")
    assert jax.tree.structure(new_state) == jax.tree.structure(abstract)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({}, optional=FIELDS))
def test_training_config_traces_a_step_or_names_the_key(overrides):
    try:
        config = _apply(tiny.get_config(), overrides)
    except TypeError as error:  # ml_collections refuses a wrong type (as --config.KEY=... would)
        assert any(k.split(".")[-1] in str(error) for k in overrides), str(error)
        event("refused on assignment")
        return
    try:
        _validate_and_trace(config)
        event("traced a training step" + (" with the loss scaled" if config.model.dtype == "float16" else ""))
    except ValueError as error:
        event("refused with a ValueError")  # ConfigError is a ValueError
        message = str(error)
        named = [k for k in overrides if k.split(".")[-1] in message or k in message]
        assert named or "config." in message or "ModelConfig." in message, (
            f"{overrides} -> error names no config key: {message}")
