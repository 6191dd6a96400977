"""Mesh creation, logical axis rules and sharded execution on 8 simulated CPU devices."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from transformer_jax import parallel
from transformer_jax.config import ConfigError
from transformer_jax.parallel import rules as rules_lib

# --- mesh ---------------------------------------------------------------------------------------


def test_default_mesh_is_pure_data_parallel():
    mesh = parallel.create_mesh()
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert dict(mesh.shape) == {"data": 8, "fsdp": 1, "tensor": 1}
    assert mesh.axis_types == (AxisType.Auto,) * 3


@pytest.mark.parametrize(
    "sizes, expected",
    [
        ((2, -1, 2), (2, 2, 2)),
        ((-1, 2, 1), (4, 2, 1)),
        ((1, 1, -1), (1, 1, 8)),
        ((2, 4, 1), (2, 4, 1)),
    ],
)
def test_minus_one_fills_the_remaining_devices(sizes, expected):
    mesh = parallel.create_mesh(*sizes)
    assert tuple(mesh.shape.values()) == expected
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


@pytest.mark.parametrize(
    "sizes, message",
    [
        ((2, 2, 3), r"mesh.data=2, mesh.fsdp=2, mesh.tensor=3 multiply to 12.*8 devices"),
        ((-1, -1, 1), r"mesh.data and mesh.fsdp are both -1"),
        ((-1, 3, 1), r"mesh.data=-1.*does not divide the 8 available devices"),
        ((0, 1, 1), r"positive or -1"),
        ((True, -1, 1), r"mesh.data=True must be an integer"),  # int() took it as 1
        ((2, 2.5, -1), r"mesh.fsdp=2.5 must be an integer"),  # ... and 2.5 as 2
    ],
)
def test_bad_mesh_sizes_fail_with_the_config_keys(sizes, message):
    with pytest.raises(ValueError, match=message):
        parallel.create_mesh(*sizes)


def test_mesh_from_config_and_device_subset():
    config = ml_collections.ConfigDict({"data": 2, "fsdp": -1, "tensor": 1})
    assert tuple(parallel.mesh_from_config(config).shape.values()) == (2, 4, 1)
    assert tuple(parallel.mesh_from_config({"tensor": 4}).shape.values()) == (2, 1, 4)
    mesh = parallel.create_mesh(data=-1, devices=jax.devices()[:4])
    assert mesh.size == 4


def test_describe_mesh():
    text = parallel.describe_mesh(parallel.create_mesh(2, 2, 2))
    assert "data=2 fsdp=2 tensor=2" in text and "8 cpu devices" in text
    assert "batch split 4 ways" in text and "params sharded up to 4 ways" in text


def test_describe_mesh_follows_the_rules_for_a_mesh_with_its_own_axis_names():
    """A mesh named ('dp', 'mp') with rules of its own: the description and the batch checks read the
    rules (they assumed 'data' and 'fsdp' and raised KeyError); default rules name the missing axis."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("dp", "mp"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rules = (("batch", "dp"), ("embed", None), ("heads", "mp"), ("mlp", "mp"), ("vocab", "mp"))
    text = parallel.describe_mesh(mesh, rules)
    assert "batch split 4 ways" in text and "params sharded up to 2 ways" in text
    assert parallel.data_parallel_size(mesh, rules) == 4
    with pytest.raises(ConfigError, match=r"batch_size=6 must be divisible by mesh.dp = 4"):
        parallel.check_batch_divisible(6, mesh, rules)
    with pytest.raises(ConfigError, match=r"mesh axis 'data', which this mesh \(axes \('dp', 'mp'\)\)"):
        parallel.describe_mesh(mesh)


# --- rules --------------------------------------------------------------------------------------

D, F, H, K, V = 16, 24, 8, 5, 32  # d_model, d_ff, heads, head_dim, vocab


WEIGHT_INIT = nn.initializers.normal(0.3)


def _param(module, name, names, shape, init=WEIGHT_INIT):
    return module.param(name, nn.with_logical_partitioning(init, names), shape)


class TinyBlock(nn.Module):
    """A fake model using the agreed logical names: embed, attention projection, MLP, norm."""

    @nn.compact
    def __call__(self, tokens):  # [B, L]
        table = _param(self, "embedding", ("vocab", "embed"), (V, D))
        q_proj = _param(self, "q_proj", ("embed", "heads", "kv"), (D, H, K))
        wi = _param(self, "wi", ("embed", "mlp"), (D, F))
        wo = _param(self, "wo", ("mlp", "embed"), (F, D))
        bias = _param(self, "bias", ("mlp",), (F,), nn.initializers.normal(0.1))
        scale = _param(self, "scale", ("embed",), (D,), nn.initializers.ones)
        x = nn.with_logical_constraint(table[tokens], ("batch", "length", "embed"))
        q = nn.with_logical_constraint(
            jnp.einsum("BLD,DHK->BLHK", x, q_proj), ("batch", "length", "heads", "kv")
        )
        h = jax.nn.relu(jnp.einsum("BLD,DF->BLF", x, wi) + bias)
        h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
        y = (jnp.einsum("BLF,FD->BLD", h, wo) + q.sum(axis=(2, 3))[..., None]) * scale
        y = nn.with_logical_constraint(y, ("batch", "length", "embed"))
        logits = jnp.einsum("BLD,VD->BLV", y, table)
        return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))


def _abstract_params():
    tokens = jnp.zeros((8, 3), jnp.int32)
    return jax.eval_shape(TinyBlock().init, jax.random.key(0), tokens)


def test_rules_give_the_expected_param_specs():
    mesh = parallel.create_mesh(2, 2, 2)
    shardings = parallel.logical_to_sharding(_abstract_params(), mesh)["params"]
    specs = {name: s.spec for name, s in shardings.items()}
    assert specs == {
        "embedding": P("tensor", "fsdp"),
        "q_proj": P("fsdp", "tensor", None),
        "wi": P("fsdp", "tensor"),
        "wo": P("tensor", "fsdp"),
        "bias": P("tensor"),
        "scale": P("fsdp"),
    }
    assert all(s.mesh is mesh for s in shardings.values())


def test_rules_for_activations_leave_embed_whole():
    spec = parallel.logical_to_mesh_spec
    assert spec(("batch", "length", "embed")) == P(("data", "fsdp"), None, None)
    assert spec(("batch", "length", "mlp")) == P(("data", "fsdp"), None, "tensor")
    assert spec(("batch", "length", "heads", "kv")) == P(("data", "fsdp"), None, "tensor", None)
    assert spec(("batch", "length", "vocab")) == P(("data", "fsdp"), None, "tensor")
    assert spec(("layers", "embed", "kv_heads", "kv")) == P(None, "fsdp", "tensor", None)
    assert spec(("unknown_axis",)) == P(None)


def test_non_divisible_dimension_is_replicated():
    mesh = parallel.create_mesh(1, 2, 4)
    boxed = {
        "odd_vocab": nn.Partitioned(jax.ShapeDtypeStruct((37, 16), jnp.float32), ("vocab", "embed")),
        "step": jax.ShapeDtypeStruct((), jnp.int32),
    }
    shardings = parallel.logical_to_sharding(boxed, mesh)
    assert shardings["odd_vocab"].spec == P(None, "fsdp")
    assert shardings["step"].spec == P()


def test_optimizer_state_of_boxed_params_gets_param_shardings():
    import optax

    mesh = parallel.create_mesh(1, 4, 2)
    abstract = _abstract_params()
    state = jax.eval_shape(optax.adam(1e-3).init, abstract)
    shardings = parallel.logical_to_sharding(state, mesh)
    assert shardings[0].mu["params"]["wi"].spec == P("fsdp", "tensor")
    assert shardings[0].count.spec == P()


def test_batch_sharding_and_divisibility():
    mesh = parallel.create_mesh(2, 2, 2)
    assert parallel.batch_sharding(mesh).spec == P(("data", "fsdp"))
    assert parallel.batch_shard_count(mesh) == 4
    parallel.check_batch_divisible(12, mesh)
    with pytest.raises(ValueError, match=r"dataset.batch_size=6 .* mesh.data \* mesh.fsdp"):
        parallel.check_batch_divisible(6, mesh)
    # a mesh and rules of your own: the message names your axes (it read mesh.shape['data'])
    own = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("dp", "mp"),
                            axis_types=(AxisType.Auto,) * 2)
    rules = (("batch", "dp"), ("embed", None), ("mlp", "mp"))
    with pytest.raises(ValueError, match=r"batch_size=6 must be divisible by mesh.dp = 4 "):
        parallel.check_batch_divisible(6, own, rules)


def test_explicit_mesh_axes_are_refused_with_the_fix():
    mesh = jax.make_mesh((4, 1, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 3)
    with pytest.raises(ValueError, match=r"AxisType.Explicit .*parallel.create_mesh"), \
            parallel.sharding_context(mesh):
        pass


def test_shard_batch_builds_global_arrays():
    mesh = parallel.create_mesh(4, 2, 1)
    local = {"targets": np.arange(16 * 3, dtype=np.int32).reshape(16, 3)}
    batch = parallel.shard_batch(local, mesh)
    assert batch["targets"].shape == (16, 3)
    assert batch["targets"].sharding.spec == P(("data", "fsdp"))
    assert len(batch["targets"].addressable_shards) == 8
    np.testing.assert_array_equal(np.asarray(batch["targets"]), local["targets"])


def _loss_and_logits(params, tokens):
    logits = TinyBlock().apply(params, tokens)
    return jnp.mean(jnp.tanh(logits)), logits


@pytest.fixture(scope="module")
def reference():
    """Unsharded params, logits and gradients (one device, no mesh)."""
    tokens = jax.random.randint(jax.random.key(1), (8, 3), 0, V)
    params = jax.jit(lambda k: nn.unbox(TinyBlock().init(k, tokens)))(jax.random.key(0))
    (_, logits), grads = jax.jit(jax.value_and_grad(_loss_and_logits, has_aux=True))(params, tokens)
    return tokens, params, logits, grads


@pytest.mark.parametrize("sizes", [(1, 8, 1), (1, 1, 8), (2, 2, 2)])
def test_sharded_forward_and_grad_match_unsharded(reference, sizes):
    tokens, ref_params, ref_logits, ref_grads = reference
    mesh = parallel.create_mesh(*sizes)
    shardings = parallel.logical_to_sharding(_abstract_params(), mesh)
    with jax.set_mesh(mesh), nn.logical_axis_rules(parallel.DEFAULT_RULES):
        params = jax.device_put(ref_params, shardings)
        batch = jax.device_put(tokens, parallel.batch_sharding(mesh))
        step = jax.jit(
            jax.value_and_grad(_loss_and_logits, has_aux=True),
            out_shardings=(None, shardings),
        )
        (_, logits), grads = step(params, batch)

    assert grads["params"]["wi"].sharding.spec == shardings["params"]["wi"].spec
    expected = NamedSharding(mesh, P(("data", "fsdp"), None, "tensor"))
    assert logits.sharding.is_equivalent_to(expected, logits.ndim)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads, ref_grads)


def test_jitted_init_places_params_by_the_rules(reference):
    tokens, ref_params, _, _ = reference
    mesh = parallel.create_mesh(2, 2, 2)
    shardings = parallel.logical_to_sharding(_abstract_params(), mesh)
    with parallel.sharding_context(mesh):
        init = jax.jit(lambda k: nn.unbox(TinyBlock().init(k, tokens)), out_shardings=shardings)
        params = init(jax.random.key(0))
    assert params["params"]["embedding"].sharding.spec == P("tensor", "fsdp")
    assert params["params"]["embedding"].addressable_shards[0].data.shape == (V // 2, D // 2)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), params, ref_params)


def test_a_model_whose_axes_the_mesh_does_not_divide_initialises_as_the_readme_shows():
    """The README's sharded init (unboxed inside the jit) with one key/value head and an unpadded
    vocabulary of 61 on a tensor axis of 2: those axes are replicated, with a warning, and the
    logits are one device's. Unboxed outside the jit, flax constrained them by the raw rules and
    raised an IndivisibleError."""
    import transformer_jax as tj

    config = tj.presets.tiny(num_encoder_layers=0, vocab_size=61, num_kv_heads=1, norm="pre")
    model = tj.TransformerLM(config)
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % 61
    boxed = jax.eval_shape(model.init, jax.random.key(0), tokens)
    mesh = parallel.create_mesh(data=1, fsdp=1, tensor=2, devices=jax.devices()[:2])
    with parallel.sharding_context(mesh):
        init = jax.jit(lambda key, x: nn.unbox(model.init(key, x)),
                       out_shardings=parallel.logical_to_sharding(boxed, mesh))
        params = init(jax.random.key(0), tokens)["params"]
        logits = jax.jit(model.apply)({"params": params}, tokens)
    layer = params["decoder"]["layer_0"]["self_attention"]
    assert layer["key"]["kernel"].sharding.spec[1] is None  # its one head: replicated
    assert layer["query"]["kernel"].sharding.spec[1] == "tensor"  # four heads: split
    assert params["embed"]["embedding"].sharding.spec[0] is None  # 61 rows: replicated
    single = model.apply({"params": jax.device_get(params)}, tokens)
    np.testing.assert_allclose(logits, single, rtol=1e-5, atol=1e-5)


def test_rules_module_has_no_mesh_axes_outside_the_table():
    used = {axis for _, axes in rules_lib.DEFAULT_RULES for axis in np.atleast_1d(axes) if axis}
    assert used <= set(parallel.MESH_AXES)


def test_processes_with_unequal_shares_of_the_batch_are_refused():
    """Each process loads batch_size / process_count rows: pieces split 2 to 1 would not add up."""
    mesh = parallel.create_mesh(4, 1, 2)
    with pytest.raises(ConfigError, match=r"unequal numbers of batch pieces \(\{0: 2, 1: 1\}\)"):
        rules_lib.check_process_pieces({0: {0, 4}, 1: {8}}, mesh)
    rules_lib.check_process_pieces({0: {0, 4}, 1: {8, 12}}, mesh)  # equal and distinct: fine
    with pytest.raises(ConfigError, match=r"processes 0 and 1 hold the same rows of the batch \(row 4 on\)"):
        rules_lib.check_process_pieces({0: {0, 4}, 1: {4, 8}}, mesh)


def test_any_non_divisible_dimension_is_replicated_not_only_the_vocabulary():
    mesh = parallel.create_mesh(1, 4, 2)
    boxed = {"wi": nn.Partitioned(jax.ShapeDtypeStruct((6, 16), jnp.float32), ("embed", "mlp"))}
    assert parallel.logical_to_sharding(boxed, mesh)["wi"].spec == P(None, "tensor")  # 6 % 4


def test_a_dimension_replicated_in_many_arrays_is_one_warning_naming_how_many(caplog):
    import logging

    import optax

    mesh = parallel.create_mesh(1, 1, 8)
    layer = lambda: {"wi": nn.Partitioned(jax.ShapeDtypeStruct((16, 12), jnp.float32), ("embed", "mlp"))}  # noqa: E731
    params = {"embedding": nn.Partitioned(jax.ShapeDtypeStruct((37, 16), jnp.float32), ("vocab", "embed")),
              **{f"layer_{i}": layer() for i in range(6)}}
    state = {"params": params, "opt_state": jax.eval_shape(optax.adam(1e-3).init, params)}
    with caplog.at_level(logging.WARNING):
        shardings = parallel.logical_to_sharding(state, mesh)
    assert shardings["opt_state"][0].mu["layer_5"]["wi"].spec == P("fsdp", None)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines  # 18 [16, 12] arrays (weights, mu, nu) and 3 vocabulary tables
    assert lines[0].startswith("3 arrays (['opt_state'][0].mu['embedding'], "
                               "['opt_state'][0].nu['embedding'], ['params']['embedding']): "
                               "dimension of size 37 is not "
                               "divisible by mesh axes tensor (size 8); replicating it instead. Set "
                               "ModelConfig.pad_vocab_multiple to a multiple of 8")
    assert lines[1].startswith("18 arrays (['opt_state'][0].mu['layer_0']['wi'], "
                               "['opt_state'][0].mu['layer_1']['wi'], "
                               "['opt_state'][0].mu['layer_2']['wi'] and 15 more): dimension of size "
                               "12 is not divisible by mesh axes tensor (size 8)")


def test_key_value_heads_the_tensor_axis_does_not_divide_are_named_with_the_cost(caplog):
    """Grouped-query attention with 2 key/value heads on tensor=4 (queries split, keys and values
    whole) made XLA gather the attention's activations in every step; the replication warning says
    so, and names the setting. Heads that are whole too cost nothing of the kind: no such hint."""
    import logging

    mesh = parallel.create_mesh(1, 2, 4)
    box = lambda shape, names: nn.Partitioned(jax.ShapeDtypeStruct(shape, jnp.float32), names)  # noqa: E731
    for heads, hinted in ((8, True), (6, False)):
        params = {"query": box((16, heads, 4), ("embed", "heads", "kv")),
                  "key": box((16, 2, 4), ("embed", "kv_heads", "kv"))}
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            parallel.logical_to_sharding(params, mesh)
        kv = [r.getMessage() for r in caplog.records if "['key']" in r.getMessage()]
        assert len(kv) == 1 and kv[0].startswith("['key']: dimension of size 2 is not divisible by mesh "
                                                 "axes tensor (size 4); replicating it instead.")
        assert ("a mesh.tensor that divides ModelConfig.num_kv_heads avoids it" in kv[0]) == hinted


def test_sharding_context_installs_the_rules_for_activation_constraints():
    mesh = parallel.create_mesh(2, 2, 2)
    with parallel.sharding_context(mesh):
        assert tuple(nn.get_logical_axis_rules()) == parallel.DEFAULT_RULES
        y = jax.jit(lambda x: nn.with_logical_constraint(x, ("batch", "length", "mlp")))(
            jnp.zeros((8, 2, 4)))
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(("data", "fsdp"), None, "tensor")), 3)
