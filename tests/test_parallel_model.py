"""The real model under the logical axis rules: sharded forward passes equal unsharded ones."""

import flax.linen as nn
import jax
import numpy as np
import pytest

import transformer_jax as tj
from transformer_jax import parallel


def _model_and_inputs(kind):
    config = tj.presets.tiny()
    tokens = jax.random.randint(jax.random.key(1), (4, 7), 3, config.vocab_size)
    if kind == "lm":
        return tj.TransformerLM(config), (tokens,)
    return tj.Transformer(config), (tokens, tokens[:, ::-1])


@pytest.mark.parametrize("kind", ["lm", "encoder_decoder"])
def test_sharded_model_matches_unsharded(kind):
    model, inputs = _model_and_inputs(kind)
    params = jax.jit(lambda k: nn.unbox(model.init(k, *inputs)))(jax.random.key(0))
    reference = jax.jit(model.apply)(params, *inputs)

    mesh = parallel.create_mesh(2, 2, 2)
    abstract = jax.eval_shape(lambda k: model.init(k, *inputs), jax.random.key(0))
    shardings = parallel.logical_to_sharding(abstract, mesh)
    specs = [s.spec for s in jax.tree.leaves(shardings)]
    assert any("fsdp" in spec for spec in specs) and any("tensor" in spec for spec in specs)
    with jax.set_mesh(mesh), nn.logical_axis_rules(parallel.DEFAULT_RULES):
        sharded_params = jax.device_put(params, shardings)
        batch = [jax.device_put(x, parallel.batch_sharding(mesh)) for x in inputs]
        logits = jax.jit(model.apply)(sharded_params, *batch)
    np.testing.assert_allclose(logits, reference, rtol=1e-5, atol=1e-5)


def test_the_state_and_parameter_helpers_work_inside_a_sharding_context():
    """`parallel.sharding_context`'s docstring says to wrap model init, jit and apply in it; the
    library's own helpers called there unboxed jax.eval_shape's ShapeDtypeStructs with the logical
    constraint applied, which JAX refused: "The sharding on the input must be a NamedSharding ...
    Got sharding type NoneType". They now give what they give outside it."""
    from transformer_jax.training import checkpoint, optimizer, state

    config = tj.presets.tiny(num_encoder_layers=0)
    model = tj.TransformerLM(config)
    tx = optimizer.create_optimizer(optimizer.default_optimizer_config(), config.d_model, 10)
    mesh = parallel.create_mesh(2, 2, 2)
    outside = (state.state_shardings(model, tx, mesh)[1], checkpoint.abstract_params(config, mesh),
               tj.params.param_shapes(config))
    with parallel.sharding_context(mesh):
        inside = (state.state_shardings(model, tx, mesh)[1], checkpoint.abstract_params(config, mesh),
                  tj.params.param_shapes(config))
        created, _ = state.create_train_state(model, tx, mesh)
    assert jax.tree.structure(inside) == jax.tree.structure(outside)
    for a, b in zip(jax.tree.leaves(inside), jax.tree.leaves(outside), strict=True):
        assert a == b
    kernel = created.params["decoder"]["layer_0"]["feed_forward"]["wi"]["kernel"]
    assert kernel.sharding.spec == parallel.logical_to_mesh_spec(("embed", "mlp"))
