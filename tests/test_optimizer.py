"""Optimizer: paper Adam settings, masked weight decay, clipping, exact gradient accumulation."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from transformer_jax import parallel
from transformer_jax.training import losses
from transformer_jax.training.optimizer import (
    accumulate_gradients,
    create_optimizer,
    default_optimizer_config,
    weight_decay_mask,
)


def _params():
    return {
        "embed": {"embedding": jnp.ones((5, 4))},
        "layer_0": {
            "attention": {"query": {"kernel": jnp.ones((4, 2, 2))}},
            "mlp": {"wi": {"kernel": jnp.ones((4, 6)), "bias": jnp.ones((6,))}},
            "pre_attention_norm": {"scale": jnp.ones((4,))},
        },
        "final_norm": {"scale": jnp.ones((4,))},
    }


def _config(**overrides):
    config = default_optimizer_config()
    config.update(overrides)
    return config


def test_default_config_is_the_paper_recipe():
    c = default_optimizer_config()
    assert (c.name, c.schedule, c.warmup_steps) == ("adam", "rsqrt_paper", 4000)
    assert (c.b1, c.b2, c.eps, c.label_smoothing) == (0.9, 0.98, 1e-9, 0.1)
    for field in ("learning_rate", "weight_decay", "grad_clip_norm", "grad_accum_steps", "z_loss"):
        assert field in c


def test_weight_decay_mask_by_path():
    mask = weight_decay_mask(_params())
    assert mask["embed"]["embedding"] and mask["layer_0"]["mlp"]["wi"]["kernel"]
    assert mask["layer_0"]["attention"]["query"]["kernel"]
    assert not mask["layer_0"]["mlp"]["wi"]["bias"]
    assert not mask["layer_0"]["pre_attention_norm"]["scale"]
    assert not mask["final_norm"]["scale"]
    assert not weight_decay_mask(_params(), decay_embeddings=False)["embed"]["embedding"]


def test_weight_decay_mask_keeps_partitioned_boxes():
    boxed = {"dense": {"kernel": nn.Partitioned(jnp.ones((2, 2)), ("embed", "mlp"))}}
    boxed["dense"]["scale"] = nn.Partitioned(jnp.ones((2,)), ("embed",))
    mask = weight_decay_mask(boxed)
    assert isinstance(mask["dense"]["kernel"], nn.Partitioned)
    assert mask["dense"]["kernel"].value and not mask["dense"]["scale"].value


def test_adamw_decays_weights_but_not_norms_or_biases():
    lr, wd = 1e-2, 0.1
    tx = create_optimizer(
        _config(name="adamw", schedule="constant", learning_rate=lr, warmup_steps=0, weight_decay=wd),
        d_model=4,
    )
    params = _params()
    zero_grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(tx.update)(zero_grads, tx.init(params), params)
    # With zero gradients the Adam part is 0, so what is left is the decay: -lr * wd * param.
    np.testing.assert_allclose(updates["layer_0"]["mlp"]["wi"]["kernel"], -lr * wd, rtol=1e-6)
    np.testing.assert_allclose(updates["embed"]["embedding"], -lr * wd, rtol=1e-6)
    for leaf in (
        updates["layer_0"]["mlp"]["wi"]["bias"],
        updates["final_norm"]["scale"],
        updates["layer_0"]["pre_attention_norm"]["scale"],
    ):
        np.testing.assert_array_equal(leaf, 0.0)


def test_weight_decay_mask_of_a_real_model_exempts_every_bias_and_norm():
    import flax.linen as nn

    import transformer_jax as tj
    from transformer_jax.params import build_model, dummy_inputs

    config = tj.presets.tiny(logits_bias=True)  # Marian's output bias, 'final_logits_bias'
    params = nn.unbox(build_model(config).init(jax.random.key(0), *dummy_inputs(config))["params"])
    flat = jax.tree_util.tree_flatten_with_path(weight_decay_mask(params))[0]
    decayed = {"/".join(str(getattr(k, "key", k)) for k in path) for path, on in flat if on}
    assert "decoder/final_logits_bias" not in decayed
    assert not [p for p in decayed if p.endswith("bias") or p.endswith("scale")]
    assert all(p.endswith(("kernel", "embedding")) for p in decayed) and decayed


def test_adam_rejects_weight_decay_and_unknown_names():
    with pytest.raises(ValueError, match="name='adamw'"):
        create_optimizer(_config(weight_decay=0.01), d_model=8)
    with pytest.raises(ValueError, match="optimizer.name='sgd'"):
        create_optimizer(_config(name="sgd"), d_model=8)


def test_matches_optax_adam_with_the_paper_schedule():
    params = {"w": jnp.arange(6.0).reshape(2, 3)}
    grads = {"w": jnp.array([[0.1, -0.2, 0.3], [1.0, 0.0, -2.0]])}
    ours = create_optimizer(default_optimizer_config(), d_model=512)
    reference = optax.adam(
        lambda c: 512**-0.5 * jnp.minimum((c + 1.0) ** -0.5, (c + 1.0) * 4000**-1.5),
        b1=0.9,
        b2=0.98,
        eps=1e-9,
    )
    s1, s2 = ours.init(params), reference.init(params)
    for _ in range(3):
        u1, s1 = ours.update(grads, s1, params)
        u2, s2 = reference.update(grads, s2, params)
        np.testing.assert_allclose(u1["w"], u2["w"], rtol=1e-6)


def test_gradient_clipping_by_global_norm():
    config = _config(schedule="constant", learning_rate=1.0, warmup_steps=0, eps=1.0, grad_clip_norm=5.0)
    tx = create_optimizer(config, d_model=8)
    params = {"w": jnp.zeros(2)}
    updates, _ = tx.update({"w": jnp.array([300.0, 400.0])}, tx.init(params), params)
    # clipped to [3, 4]; first bias-corrected Adam step with eps=1: -g / (|g| + 1)
    np.testing.assert_allclose(updates["w"], [-3 / 4, -4 / 5], rtol=1e-6)


def test_optimizer_state_of_boxed_abstract_params():
    boxed = {"kernel": nn.Partitioned(jax.ShapeDtypeStruct((4, 6), jnp.float32), ("embed", "mlp"))}
    tx = create_optimizer(_config(name="adamw", weight_decay=0.1), d_model=4)
    state = jax.eval_shape(tx.init, boxed)
    leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    assert sum(isinstance(x, nn.Partitioned) for x in leaves) == 2  # Adam mu and nu


# --- gradient accumulation ----------------------------------------------------------------------


def _tiny_lm_loss(params, batch, rng=None):
    """Token cross-entropy of a one-layer model; returns sums, as accumulate_gradients expects."""
    x = params["embed"][batch["tokens"]]  # [B, L, D]
    if rng is not None:
        x = x * jax.random.bernoulli(rng, 0.9, x.shape) / 0.9
    logits = jnp.einsum("BLD,DV->BLV", jnp.tanh(x @ params["w"]), params["out"])
    loss_sum, weight_sum, aux = losses.cross_entropy(
        logits, batch["targets"], batch["weights"], label_smoothing=0.1
    )
    return loss_sum, (weight_sum, aux)


def _accumulation_problem():
    rng = np.random.default_rng(0)
    b, length, d, v = 8, 5, 6, 11
    params = {
        "embed": jnp.asarray(rng.normal(size=(v, d)), jnp.float32),
        "w": jnp.asarray(rng.normal(size=(d, d)) / 3, jnp.float32),
        "out": jnp.asarray(rng.normal(size=(d, v)) / 3, jnp.float32),
    }
    lengths = np.array([5, 1, 3, 4, 2, 5, 0, 3])  # ragged rows: a mean of means would be wrong
    batch = {
        "tokens": jnp.asarray(rng.integers(0, v, (b, length)), jnp.int32),
        "targets": jnp.asarray(rng.integers(0, v, (b, length)), jnp.int32),
        "weights": jnp.asarray(np.arange(length)[None, :] < lengths[:, None], jnp.float32),
    }
    return params, batch


def test_accumulate_gradients_equals_full_batch():
    params, batch = _accumulation_problem()
    grad_fn = jax.value_and_grad(_tiny_lm_loss, has_aux=True)

    @jax.jit
    def normalized(params, batch):
        (loss_sum, (weight_sum, _)), grads = accumulate_gradients(grad_fn, params, batch, 4)
        return loss_sum / weight_sum, jax.tree.map(lambda g: g / weight_sum, grads)

    (full_sum, (full_weight, _)), full_grads = jax.jit(grad_fn)(params, batch)
    mesh = parallel.create_mesh(data=4, fsdp=2)
    with jax.set_mesh(mesh):  # batch rows spread over 8 devices, split without moving them
        sharded = jax.device_put(batch, parallel.batch_sharding(mesh))
        for inputs in (batch, sharded):
            loss, grads = normalized(params, inputs)
            np.testing.assert_allclose(loss, full_sum / full_weight, rtol=1e-6)
            jax.tree.map(
                lambda a, b: np.testing.assert_allclose(a, b / full_weight, atol=1e-6),
                grads,
                full_grads,
            )


def test_accumulate_gradients_passes_one_rng_per_micro_batch():
    params, batch = _accumulation_problem()
    grad_fn = jax.value_and_grad(_tiny_lm_loss, has_aux=True)
    run = jax.jit(accumulate_gradients, static_argnums=(0, 3))
    (a, _), grads_a = run(grad_fn, params, batch, 2, jax.random.key(0))
    (b, _), _ = run(grad_fn, params, batch, 2, jax.random.key(1))
    (c, _), grads_c = run(grad_fn, params, batch, 2, jax.random.key(0))
    assert float(a) != float(b)
    np.testing.assert_array_equal(a, c)
    jax.tree.map(np.testing.assert_array_equal, grads_a, grads_c)


def test_each_micro_batch_gets_its_own_key_and_sums_are_kept_in_float32():
    """The keys are jax.random.split(rng, n), one per micro-batch in order (the same key for every
    micro-batch passed the test above); bf16 values are summed in float32: 256 + four 1s is 260,
    where bf16 sums would stay at 256."""
    key, n = jax.random.key(7), 5
    values = jnp.asarray([256.0, 1.0, 1.0, 1.0, 1.0], jnp.bfloat16)

    def fn(params, micro_batch, k):
        return jax.random.uniform(k), values[micro_batch["i"][0]]

    got_keys, got_sum = accumulate_gradients(fn, None, {"i": jnp.arange(n)}, n, key)
    want = sum(float(jax.random.uniform(k)) for k in jax.random.split(key, n))
    np.testing.assert_allclose(got_keys, want, rtol=1e-6)
    assert got_sum.dtype == jnp.bfloat16 and float(got_sum) == 260.0


def test_accumulate_gradients_single_micro_batch_and_bad_split():
    params, batch = _accumulation_problem()
    grad_fn = jax.jit(jax.value_and_grad(_tiny_lm_loss, has_aux=True))
    (one, _), _ = accumulate_gradients(grad_fn, params, batch, 1)
    (full, _), _ = grad_fn(params, batch)
    np.testing.assert_array_equal(one, full)
    with pytest.raises(ValueError, match="grad_accum_steps=3"):
        accumulate_gradients(grad_fn, params, batch, 3)


def test_config_dict_without_optional_fields():
    minimal = ml_collections.ConfigDict(
        {"name": "adam", "learning_rate": 1e-3, "schedule": "constant", "warmup_steps": 0}
    )
    tx = create_optimizer(minimal, d_model=8)
    params = {"w": jnp.ones(3)}
    updates, _ = tx.update({"w": jnp.ones(3)}, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], -1e-3, rtol=1e-5)


def test_adam_moments_use_b1_for_the_mean_and_b2_for_the_variance():
    """Gradient 1 then 0: constant gradients cancel in the bias correction whatever b1 and b2 are,
    so only a gradient that changes tells them apart (b1/b2 swapped gives -0.719, not -0.673)."""
    tx = create_optimizer(_config(schedule="constant", learning_rate=1.0, warmup_steps=0), d_model=8)
    params = {"w": jnp.zeros(())}
    state = tx.init(params)
    first, state = tx.update({"w": jnp.ones(())}, state, params)
    second, _ = tx.update({"w": jnp.zeros(())}, state, params)
    b1, b2 = 0.9, 0.98
    m_hat = b1 * (1 - b1) / (1 - b1**2)
    v_hat = b2 * (1 - b2) / (1 - b2**2)
    np.testing.assert_allclose(first["w"], -1.0, rtol=1e-6)
    np.testing.assert_allclose(second["w"], -m_hat / math.sqrt(v_hat), rtol=1e-5)
    np.testing.assert_allclose(second["w"], -0.673294, rtol=1e-5)


def test_adamw_with_decay_embeddings_false_leaves_embedding_tables_alone():
    lr, wd = 1e-2, 0.1
    config = _config(name="adamw", schedule="constant", learning_rate=lr, warmup_steps=0,
                     weight_decay=wd, decay_embeddings=False)
    tx = create_optimizer(config, d_model=4)
    params = _params()
    updates, _ = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    np.testing.assert_array_equal(updates["embed"]["embedding"], 0.0)
    np.testing.assert_allclose(updates["layer_0"]["mlp"]["wi"]["kernel"], -lr * wd, rtol=1e-6)


def test_micro_batches_are_strided_rows_in_key_order():
    """Micro-batch i holds rows i, i + n, ... and gets the i-th key of jax.random.split(rng, n)."""
    key = jax.random.key(3)

    def fn(params, micro_batch, k):
        return jax.random.uniform(k) * jnp.sum(micro_batch["row"])

    got = accumulate_gradients(fn, None, {"row": jnp.arange(4.0)}, 2, key)
    u0, u1 = (float(jax.random.uniform(k)) for k in jax.random.split(key, 2))
    np.testing.assert_allclose(got, u0 * (0 + 2) + u1 * (1 + 3), rtol=1e-6)  # not rows 0,1 / 2,3
