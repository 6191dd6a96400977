"""Decoding on a device mesh: batch split over the data axes, parameters sharded as in training,
the same tokens as on one device."""

import flax.linen as nn
import jax
import numpy as np
import pytest

import transformer_jax as tj
from transformer_jax import parallel


# 'out_in' kernels take the weights-first decoding products, and shard by their reordered names.
@pytest.mark.parametrize("kernel_layout", ["in_out", "out_in"])
def test_sharded_generate_and_beam_search_equal_unsharded(kernel_layout):
    config = tj.presets.tiny(norm="pre", num_encoder_layers=0, kernel_layout=kernel_layout)
    model = tj.TransformerLM(config)
    prompts = jax.random.randint(jax.random.key(1), (8, 6), 3, config.vocab_size)
    lengths = np.array([6, 3, 5, 1, 6, 2, 4, 6], np.int32)
    boxed = jax.jit(model.init)(jax.random.key(0), prompts)
    params = nn.unbox(boxed)["params"]

    def decode(params, prompts, lengths):
        cache = tj.init_cache(config, 8, 6 + 10)
        greedy = tj.decoding.generate(tj.LMStep(model), params, cache, prompts, lengths,
                                      max_new_tokens=10)
        beams = tj.beam_search(tj.LMStep(model), params, cache, prompts, lengths,
                               max_new_tokens=10, beam_size=3)
        return greedy.tokens, beams.tokens

    expected = decode(params, prompts, lengths)

    mesh = parallel.create_mesh(data=2, fsdp=2, tensor=2)
    shardings = parallel.logical_to_sharding(jax.eval_shape(lambda: boxed), mesh)["params"]
    with parallel.sharding_context(mesh):
        sharded_params = jax.device_put(params, shardings)
        batch = jax.device_put(prompts, parallel.batch_sharding(mesh))
        assert len(batch.sharding.device_set) == 8
        got = decode(sharded_params, batch, jax.device_put(lengths))
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])


def test_caches_on_a_mesh_are_split_as_their_activations_are():
    """Under sharding_context a decoding cache's keys and values are split over the batch (data x
    fsdp) and the key/value heads (tensor): they were whole on every device (GPT-2 small, batch 64 x
    1024 positions: ~4.8 GB per device against ~0.6 GB on 8). A dimension the mesh does not divide
    stays whole. Both the decoder-only cache and the encoder-decoder's, from encode_source."""
    mesh = parallel.create_mesh(data=2, fsdp=2, tensor=2)
    lm_config = tj.presets.tiny(norm="pre", num_encoder_layers=0)
    config = tj.presets.tiny()
    model = tj.Transformer(config)
    src = jax.random.randint(jax.random.key(1), (8, 6), 3, config.vocab_size)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), src, src))["params"]
    with parallel.sharding_context(mesh):
        for batch_size, rows in ((8, 2), (3, 3)):
            for cfg, cache in ((lm_config, tj.init_cache(lm_config, batch_size, 16)),
                               (config, tj.encode_source(model, params, src[:batch_size], max_length=16))):
                for leaf in jax.tree.leaves(cache.layers):
                    assert {s.data.shape for s in leaf.addressable_shards} == {
                        (rows, cfg.kv_heads // 2, 16, cfg.qk_dim)}, (batch_size, leaf.sharding)


def test_a_cache_made_inside_shard_map_takes_no_constraint():
    """Inside jax.shard_map the mesh's axes are Manual: the cache's placement (for Auto axes only)
    is left out there; a constraint naming a Manual axis is an error."""
    from jax.sharding import PartitionSpec as P

    config = tj.presets.tiny(norm="pre", num_encoder_layers=0)
    mesh = parallel.create_mesh(data=4, tensor=2)
    with parallel.sharding_context(mesh):
        per_shard = jax.shard_map(lambda x: x + tj.init_cache(config, 2, 4).lengths, mesh=mesh,
                                  in_specs=P("data"), out_specs=P("data"))
        np.testing.assert_array_equal(jax.jit(per_shard)(np.arange(8, dtype=np.int32)), np.arange(8))


@pytest.mark.parametrize("batch", [8, 5])  # 5: rows the mesh's batch axes do not divide
def test_sharded_translation_decoding_equals_unsharded(batch):
    """The BLEU evaluation's decoder (encoder-decoder, greedy and beam search, a vocabulary the
    tensor axis does not divide) on a mesh gives one device's tokens."""
    from transformer_jax.training.evaluate import decode_batch

    config = tj.presets.tiny(vocab_size=61)
    model = tj.Transformer(config)
    src = np.array(jax.random.randint(jax.random.key(1), (batch, 7), 3, config.vocab_size))
    src[1, 4:] = 0  # a shorter source
    boxed = jax.jit(model.init)(jax.random.key(0), src, src)
    params = nn.unbox(boxed)["params"]
    expected = [decode_batch(model, params, src, None, max_new_tokens=8, beam_size=k) for k in (1, 3)]
    mesh = parallel.create_mesh(data=1, fsdp=2, tensor=4)
    shardings = parallel.logical_to_sharding(jax.eval_shape(lambda: boxed), mesh)["params"]
    with parallel.sharding_context(mesh):
        sharded = jax.device_put(params, shardings)
        rows = jax.device_put(src, parallel.batch_sharding(mesh)) if batch % 2 == 0 else src
        got = [decode_batch(model, sharded, rows, None, max_new_tokens=8, beam_size=k) for k in (1, 3)]
    for want, have in zip(expected, got, strict=True):
        np.testing.assert_array_equal(jax.device_get(have), jax.device_get(want))


def test_sharded_sampling_with_scanned_layers_equals_unsharded():
    """Temperature and top-p sampling (tokens and log-probabilities) with stacked layers."""
    config = tj.presets.tiny(norm="pre", num_encoder_layers=0, scan_layers=True)
    model = tj.TransformerLM(config)
    prompts = np.asarray(jax.random.randint(jax.random.key(1), (8, 6), 3, config.vocab_size))
    lengths = np.array([6, 3, 5, 1, 6, 2, 4, 6], np.int32)
    boxed = jax.jit(model.init)(jax.random.key(0), prompts)
    params = nn.unbox(boxed)["params"]

    def sample(params, prompts):
        out = tj.decoding.generate(tj.LMStep(model), params, tj.init_cache(config, 8, 16), prompts,
                                   lengths, max_new_tokens=10, rng=jax.random.key(3), temperature=0.9,
                                   top_p=0.9)
        return jax.device_get(out.tokens), jax.device_get(out.logprobs)

    expected = sample(params, prompts)
    mesh = parallel.create_mesh(data=2, fsdp=2, tensor=2)
    shardings = parallel.logical_to_sharding(jax.eval_shape(lambda: boxed), mesh)["params"]
    with parallel.sharding_context(mesh):
        got = sample(jax.device_put(params, shardings),
                     jax.device_put(prompts, parallel.batch_sharding(mesh)))
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_allclose(got[1], expected[1], atol=1e-5)
    assert len(set(expected[0].ravel().tolist())) > 5  # sampled, not one token over and over
