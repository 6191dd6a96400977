"""RoPE, RMSNorm, SwiGLU and grouped-query attention against a reference implementation:
transformers' LlamaForCausalLM, whose architecture is a configuration of ours (pre-norm RMSNorm,
SwiGLU, rotary positions, no biases, unscaled embeddings, an untied output projection). Random
weights are copied across by hand (PyTorch's [out, in] matrices are our 'out_in' kernels), so the
only thing shared is the weights. Before this test, those four features were tested only against
themselves (cache against no cache, scanned against unscanned), so wrong rotary frequencies or an
RMSNorm that subtracted the mean passed."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import transformer_jax as tj  # noqa: E402
from transformer_jax.decoding import generate  # noqa: E402
from transformer_jax.decoding.model_steps import LMStep  # noqa: E402
from transformer_jax.modeling import apply_rope  # noqa: E402


def _llama(theta, kv_heads, tie):
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, rms_norm_eps=1e-5, rope_theta=theta, tie_word_embeddings=tie,
        max_position_embeddings=64, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():  # RMSNorm weights start at one: random ones, so that a wrong norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
    return model


def _ours(model, theta, kv_heads, tie):
    config = tj.ModelConfig(
        vocab_size=97, d_model=32, num_heads=4, num_kv_heads=kv_heads, d_ff=48, num_encoder_layers=0,
        num_decoder_layers=2, dropout_rate=0.0, max_len=64, norm="pre", norm_type="rmsnorm", norm_eps=1e-5,
        activation="swiglu", position="rope", rope_theta=theta, use_bias=False, scale_embeddings=False,
        tie_output=tie, kernel_layout="out_in", pad_id=None)
    w = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    heads, head_dim = 4, 8
    layers = {}
    for i in range(2):
        pre = f"model.layers.{i}."
        layers[f"layer_{i}"] = {
            "self_attention_norm": {"scale": w[pre + "input_layernorm.weight"]},
            "self_attention": {
                "query": {"kernel": w[pre + "self_attn.q_proj.weight"].reshape(heads, head_dim, 32)},
                "key": {"kernel": w[pre + "self_attn.k_proj.weight"].reshape(kv_heads, head_dim, 32)},
                "value": {"kernel": w[pre + "self_attn.v_proj.weight"].reshape(kv_heads, head_dim, 32)},
                "out": {"kernel": w[pre + "self_attn.o_proj.weight"].reshape(32, heads, head_dim)},
            },
            "feed_forward_norm": {"scale": w[pre + "post_attention_layernorm.weight"]},
            "feed_forward": {
                "wi": {"kernel": w[pre + "mlp.up_proj.weight"]},
                "wi_gate": {"kernel": w[pre + "mlp.gate_proj.weight"]},
                "wo": {"kernel": w[pre + "mlp.down_proj.weight"]},
            },
        }
    params = {"embed": {"embedding": w["model.embed_tokens.weight"]},
              "decoder": {**layers, "final_norm": {"scale": w["model.norm.weight"]}}}
    if not tie:
        params["decoder"]["output"] = {"kernel": w["lm_head.weight"]}
    model_ours = tj.TransformerLM(config)
    expected = jax.eval_shape(model_ours.init, jax.random.key(0), jnp.ones((1, 4), jnp.int32))["params"]
    shapes = jax.tree.map(np.shape, nn.unbox(expected))
    assert jax.tree.map(np.shape, params) == shapes  # every parameter mapped, none left over
    return model_ours, jax.tree.map(jnp.asarray, params)


@pytest.mark.parametrize("theta, kv_heads, tie",
                         [(10000.0, 4, False), (500000.0, 2, False), (10000.0, 1, True)],
                         ids=["mha", "gqa_theta5e5", "mqa_tied"])
def test_llama_shaped_model_matches_transformers(theta, kv_heads, tie):
    hf = _llama(theta, kv_heads, tie)
    model, params = _ours(hf, theta, kv_heads, tie)
    tokens = np.random.default_rng(0).integers(0, 97, (2, 40))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(tokens, jnp.int32)))
    assert np.abs(ref).max() > 0.5  # random weights give non-trivial logits
    np.testing.assert_allclose(ours, ref, atol=2e-5, rtol=0)
    # Greedy decoding with the KV cache gives transformers' greedy continuation.
    prompt = tokens[:, :6]
    with torch.no_grad():
        # (an explicit mask: given only pad_token_id, transformers masks every prompt token equal to it)
        mask = torch.ones(prompt.shape, dtype=torch.long)
        want = hf.generate(torch.tensor(prompt), attention_mask=mask, max_new_tokens=12, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[:, 6:].numpy()
    out = generate(LMStep(model), params, tj.init_cache(model.config, 2, 18),
                      jnp.asarray(prompt, jnp.int32), jnp.full((2,), 6, jnp.int32), max_new_tokens=12,
                      eos_id=None)
    np.testing.assert_array_equal(np.asarray(out.tokens), want)


def test_rope_equals_the_formula():
    """Pairs (k, k + K/2) rotated by position * theta^(-2k/K), for two values of theta."""
    x = np.random.default_rng(1).standard_normal((1, 5, 2, 12)).astype(np.float32)
    positions = np.array([[0, 1, 7, 30, 511]])
    for theta in (10000.0, 500000.0):
        got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions), theta))
        want = np.empty_like(x, dtype=np.float64)
        for j, m in enumerate(positions[0]):
            for k in range(6):
                angle = m * theta ** (-2 * k / 12)
                a, b = x[0, j, :, k].astype(np.float64), x[0, j, :, k + 6].astype(np.float64)
                want[0, j, :, k] = a * np.cos(angle) - b * np.sin(angle)
                want[0, j, :, k + 6] = b * np.cos(angle) + a * np.sin(angle)
        np.testing.assert_allclose(got, want, atol=2e-5)


def test_gated_feed_forwards_equal_their_formulas():
    """SwiGLU and GeGLU (Shazeer 2020): act(x W_gate) * (x W_1), then W_2; GeGLU with the tanh GELU."""
    from transformer_jax.modeling.layers import FeedForward

    x = jax.random.normal(jax.random.key(0), (2, 3, 8))
    gelu_tanh = lambda z: 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))
    for name, act in [("swiglu", lambda z: z / (1 + np.exp(-z))), ("geglu", gelu_tanh)]:
        ff = FeedForward(d_ff=16, activation=name, use_bias=False)
        params = ff.init(jax.random.key(1), x)["params"]
        p = jax.tree.map(lambda v: np.asarray(v, np.float64), nn.unbox(params))
        x64 = np.asarray(x, np.float64)
        want = (act(x64 @ p["wi_gate"]["kernel"]) * (x64 @ p["wi"]["kernel"])) @ p["wo"]["kernel"]
        np.testing.assert_allclose(np.asarray(ff.apply({"params": params}, x)), want, atol=1e-5)
