"""Parity with PyTorch's `torch.nn.Transformer` (Post-LN with ReLU, and Pre-LN with the exact GELU;
dropout 0) on random weights.

Both models get the same weights; ours adds the embedding, sinusoidal positions and tied output
projection around the encoder-decoder body, so the reference applies those by hand. Sizes are
distinct primes where the architecture allows (B=3, S=11, L=7, H=5 heads of K=2 (D=10 must be
even for sinusoids), F=13, V=37, 2 encoder and 3 decoder layers).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import transformer_jax as tj
from transformer_jax.modeling import sinusoidal_encoding

torch = pytest.importorskip("torch")

B, S, L, H, K, F, V = 3, 11, 7, 5, 2, 13, 37
D = H * K


def make_config(norm="post", activation="relu"):
    return tj.ModelConfig(
        vocab_size=V, d_model=D, num_heads=H, d_ff=F, num_encoder_layers=2, num_decoder_layers=3,
        dropout_rate=0.0, norm=norm, final_norm=True, norm_eps=1e-5, activation=activation,
        max_len=64,
    )


def attention_params(mha):
    """torch MultiheadAttention (in_proj stacked q, k, v as [3D, D]) -> our projections."""
    w = mha.in_proj_weight.detach().numpy()
    b = mha.in_proj_bias.detach().numpy()
    out = {}
    for i, name in enumerate(("query", "key", "value")):
        out[name] = {"kernel": w[i * D : (i + 1) * D].T.reshape(D, H, K),
                     "bias": b[i * D : (i + 1) * D].reshape(H, K)}
    out["out"] = {"kernel": mha.out_proj.weight.detach().numpy().T.reshape(H, K, D),
                  "bias": mha.out_proj.bias.detach().numpy()}
    return out


def norm_params(ln):
    return {"scale": ln.weight.detach().numpy(), "bias": ln.bias.detach().numpy()}


def ffn_params(layer):
    return {
        "wi": {"kernel": layer.linear1.weight.detach().numpy().T,
               "bias": layer.linear1.bias.detach().numpy()},
        "wo": {"kernel": layer.linear2.weight.detach().numpy().T,
               "bias": layer.linear2.bias.detach().numpy()},
    }


def params_from_torch(ref, embedding):
    encoder = {"final_norm": norm_params(ref.encoder.norm)}
    for i, layer in enumerate(ref.encoder.layers):
        encoder[f"layer_{i}"] = {
            "self_attention": attention_params(layer.self_attn),
            "self_attention_norm": norm_params(layer.norm1),
            "feed_forward": ffn_params(layer),
            "feed_forward_norm": norm_params(layer.norm2),
        }
    decoder = {"final_norm": norm_params(ref.decoder.norm)}
    for i, layer in enumerate(ref.decoder.layers):
        decoder[f"layer_{i}"] = {
            "self_attention": attention_params(layer.self_attn),
            "self_attention_norm": norm_params(layer.norm1),
            "cross_attention": attention_params(layer.multihead_attn),
            "cross_attention_norm": norm_params(layer.norm2),
            "feed_forward": ffn_params(layer),
            "feed_forward_norm": norm_params(layer.norm3),
        }
    return {"embed": {"embedding": embedding}, "encoder": encoder, "decoder": decoder}


@pytest.mark.parametrize("norm_first, activation", [(False, "relu"), (True, "gelu")],
                         ids=["post_ln_relu", "pre_ln_gelu"])
def test_encoder_decoder_matches_torch_nn_transformer(norm_first, activation):
    torch.manual_seed(0)
    ref = torch.nn.Transformer(  # odd head count: torch warns it skips its nested-tensor path
        d_model=D, nhead=H, num_encoder_layers=2, num_decoder_layers=3, dim_feedforward=F,
        dropout=0.0, activation=activation, batch_first=True, norm_first=norm_first,
    ).eval()
    with torch.no_grad():  # LayerNorm weights start at one and attention biases at zero: random
        for p in ref.parameters():  # ones, so that a swapped norm or a dropped bias shows
            if p.ndim == 1:
                p.add_(0.5 * torch.randn_like(p))
    rng = np.random.default_rng(0)
    embedding = rng.normal(0, D**-0.5, (V, D)).astype(np.float32)
    src = rng.integers(3, V, (B, S))
    src[0, 8:] = 0  # padded source rows (pad_id = 0)
    src[2, 5:] = 0
    tgt = rng.integers(3, V, (B, L))

    # Reference: embeddings * sqrt(d_model) + PE, torch's body, tied output projection.
    pe = np.asarray(sinusoidal_encoding(jnp.arange(max(S, L)), D))
    embed = lambda ids: torch.tensor(embedding[ids] * D**0.5 + pe[: ids.shape[1]])
    pad = torch.tensor(src == 0)
    with torch.no_grad():
        out = ref(
            embed(src), embed(tgt),
            tgt_mask=torch.nn.Transformer.generate_square_subsequent_mask(L),
            src_key_padding_mask=pad, memory_key_padding_mask=pad, tgt_is_causal=True,
        )
    expected = out.numpy() @ embedding.T

    model = tj.Transformer(make_config("pre" if norm_first else "post", activation))
    ours_init = jax.eval_shape(lambda: model.init(jax.random.key(0), src, tgt))["params"]
    params = params_from_torch(ref, embedding)
    # Same tree, same shapes as our own initialisation: nothing missing, nothing extra.
    shapes = lambda tree: jax.tree.map(lambda x: tuple(x.shape), tree)
    assert shapes(params) == shapes(nn.unbox(ours_init))
    logits = jax.jit(model.apply)({"params": params}, jnp.asarray(src), jnp.asarray(tgt))
    np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-5, rtol=1e-5)
