"""A vocabulary padded to a multiple (`ModelConfig.pad_vocab_multiple`): the same model, with a
table that a tensor mesh axis divides."""

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import transformer_jax as tj
from transformer_jax import parallel
from transformer_jax.params import build_model, convert_params
from transformer_jax.training.losses import cross_entropy

VARIANTS = {
    "lm_tied": dict(num_encoder_layers=0),
    "lm_untied_with_logits_bias": dict(num_encoder_layers=0, tie_output=False, logits_bias=True),
    "encoder_decoder_separate_tables": dict(share_embeddings=False, tie_output=False),
}


def _inputs(config, batch=3, length=7):
    tokens = jax.random.randint(jax.random.key(1), (batch, length), 0, config.vocab_size)
    return (tokens, tokens[:, ::-1]) if config.num_encoder_layers else (tokens,)


def _random_params(config):
    """Initial parameters moved off their initial values (the logits bias starts at zero)."""
    params = nn.unbox(build_model(config).init(jax.random.key(0), *_inputs(config)))["params"]
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def _vocab_axes(config):
    """{path: index of the 'vocab' axis} of every parameter that has one."""
    from transformer_jax.params import _boxed_param_shapes, _logical_names

    names = _logical_names(_boxed_param_shapes(config))
    return {path: axes.index("vocab") for path, axes in names.items() if "vocab" in axes}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_padded_vocabulary_computes_the_same_function_and_gradients(variant):
    config = tj.presets.tiny(vocab_size=61, dropout_rate=0.0, **VARIANTS[variant])
    padded = config.replace(pad_vocab_multiple=16)
    assert padded.padded_vocab_size == 64 and config.padded_vocab_size == 61
    params = _random_params(config)
    padded_params = convert_params(params, config, padded)
    axes = _vocab_axes(padded)
    assert len(axes) == {"lm_tied": 1, "lm_untied_with_logits_bias": 3}.get(variant, 3)
    flat = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(padded_params)}
    for path, axis in axes.items():
        assert flat[path].shape[axis] == 64
        np.testing.assert_array_equal(jax.lax.slice_in_dim(flat[path], 61, 64, axis=axis), 0)

    inputs = _inputs(config)
    targets = inputs[-1]

    def loss(params, model):
        logits = model.apply({"params": params}, *inputs)
        total, count, _ = cross_entropy(logits, targets, label_smoothing=0.1)
        return total / count, logits

    (want, want_logits), want_grads = jax.value_and_grad(loss, has_aux=True)(params, build_model(config))
    (got, got_logits), got_grads = jax.value_and_grad(loss, has_aux=True)(padded_params, build_model(padded))
    assert got_logits.shape == want_logits.shape == (*targets.shape, 61)
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # The padding rows get no gradient (never looked up, logits dropped), so they stay zero under
    # any optimiser; the real rows get the unpadded model's gradients.
    got_grads = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(got_grads)}
    for path, g in jax.tree_util.tree_leaves_with_path(want_grads):
        key = jax.tree_util.keystr(path)
        g_padded = got_grads[key]
        if key in axes:
            np.testing.assert_array_equal(jax.lax.slice_in_dim(g_padded, 61, 64, axis=axes[key]), 0)
            g_padded = jax.lax.slice_in_dim(g_padded, 0, 61, axis=axes[key])
        np.testing.assert_allclose(g_padded, g, rtol=1e-4, atol=1e-6, err_msg=key)


def test_convert_params_pads_and_unpads_with_a_layout_change():
    config = tj.presets.tiny(vocab_size=61, num_encoder_layers=0, tie_output=False, logits_bias=True)
    params = _random_params(config)
    serving = config.replace(pad_vocab_multiple=8, kernel_layout="out_in")
    padded = convert_params(params, config, serving)
    assert padded["decoder"]["output"]["kernel"].shape == (64, config.d_model)  # [V, D] in 'out_in'
    back = convert_params(padded, serving, config)
    jax.tree.map(np.testing.assert_array_equal, back, params)
    inputs = _inputs(config)
    np.testing.assert_allclose(build_model(serving).apply({"params": padded}, *inputs),
                               build_model(config).apply({"params": params}, *inputs), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"has shape \(64,\), but the source config \(kernel_layout="
                       r"'out_in', fused_qkv=False, scan_layers=False, 61 vocabulary rows\) has \(61,\)$"):
        convert_params(padded, config.replace(kernel_layout="out_in"), config)  # the wrong source


def test_a_padded_vocabulary_splits_over_the_tensor_axis_and_decodes_the_same(caplog):
    config = tj.presets.tiny(vocab_size=61, num_encoder_layers=0, norm="pre", dropout_rate=0.0)
    padded = config.replace(pad_vocab_multiple=8)
    mesh = parallel.create_mesh(data=2, fsdp=1, tensor=4)
    embedding = lambda c: parallel.logical_to_sharding(  # noqa: E731
        jax.eval_shape(lambda: build_model(c).init(jax.random.key(0), *_inputs(c))), mesh
    )["params"]["embed"]["embedding"]
    with caplog.at_level(logging.WARNING):
        assert embedding(config).spec[0] is None  # 61 rows: replicated, with a warning
        assert "not divisible" in caplog.text
        assert "Set ModelConfig.pad_vocab_multiple to a multiple of 4 to split it" in caplog.text
        caplog.clear()
        assert embedding(padded).spec[0] == "tensor"  # 64 rows: a quarter per tensor shard
        assert "not divisible" not in caplog.text

    params = _random_params(config)
    prompts = jax.random.randint(jax.random.key(3), (4, 5), 3, config.vocab_size)
    lengths = jnp.array([5, 2, 4, 1], jnp.int32)

    def decode(config, params, prompts, lengths):
        model = build_model(config)
        cache = tj.init_cache(config, 4, 5 + 8)
        return tj.decoding.generate(tj.LMStep(model), params, cache, prompts, lengths, max_new_tokens=8)

    want = decode(config, params, prompts, lengths)
    padded_params = convert_params(params, config, padded)
    boxed = jax.eval_shape(lambda: build_model(padded).init(jax.random.key(0), *_inputs(padded)))
    with parallel.sharding_context(mesh):
        sharded = jax.device_put(padded_params, parallel.logical_to_sharding(boxed, mesh)["params"])
        assert sharded["embed"]["embedding"].sharding.shard_shape((64, config.d_model))[0] == 16
        got = decode(padded, sharded, jax.device_put(prompts, parallel.batch_sharding(mesh)), lengths)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)

    # Training through the vocabulary-sharded table and logits: the unpadded model's loss and
    # gradients, none on the extra rows.
    tokens = jax.random.randint(jax.random.key(4), (4, 9), 0, config.vocab_size)

    def loss(params, config):
        logits = build_model(config).apply({"params": params}, tokens[:, :-1])
        total, count, _ = cross_entropy(logits, tokens[:, 1:], label_smoothing=0.1)
        return total / count

    want_loss, want_grads = jax.value_and_grad(loss)(params, config)
    with parallel.sharding_context(mesh):
        got_loss, got_grads = jax.jit(jax.value_and_grad(loss), static_argnums=1)(sharded, padded)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    table_grad = got_grads["embed"]["embedding"]
    assert table_grad.sharding.shard_shape(table_grad.shape)[0] == 16
    np.testing.assert_array_equal(table_grad[61:], 0)
    np.testing.assert_allclose(table_grad[:61], want_grads["embed"]["embedding"], rtol=1e-4, atol=1e-6)
