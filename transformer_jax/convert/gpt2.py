"""GPT-2 (Radford et al. 2019) -> `TransformerLM`: decoder-only, learned positions, Pre-LN with a
final LayerNorm, tanh-approximated GELU, output projection tied to the token embedding.

GPT-2's ``Conv1D`` layers store weights as [in, out] (the transpose of ``nn.Linear``), and one
``c_attn`` holds the query, key and value projections side by side: [D, 3D].
"""

from __future__ import annotations

from transformer_jax.config import ModelConfig
from transformer_jax.convert.mapping import (
    HF_ACTIVATIONS,
    ParamBuilder,
    check_options,
    heads_bias,
    heads_in,
    heads_out,
    strip_prefix,
    untie_a_distinct_head,
)

# The config.json key each token id is read from (decoding starts from the BOS token).
TOKEN_ID_KEYS = {"eos_id": "eos_token_id", "bos_id": "bos_token_id", "decoder_start_id": "bos_token_id",
                 "pad_id": "pad_token_id"}
# The id each key is read into first: an override of it stands in for a null key, and so for the
# ids derived from it (the BOS from the EOS, the decoder's start from the BOS).
ID_SOURCES = {"eos_token_id": "eos_id", "bos_token_id": "bos_id"}


def config_fields(hf: dict) -> dict:
    """The `ModelConfig` fields of a GPT-2 config.json; every option we cannot express is listed in
    one error."""
    problems = []
    if hf.get("activation_function", "gelu_new") not in HF_ACTIVATIONS:
        problems.append(
            f"activation_function={hf['activation_function']!r} (supported: {sorted(HF_ACTIVATIONS)})"
        )
    if not hf.get("scale_attn_weights", True):
        problems.append("scale_attn_weights=False (attention without the 1/sqrt(d_k) scale)")
    if hf.get("scale_attn_by_inverse_layer_idx", False):
        problems.append("scale_attn_by_inverse_layer_idx=True")
    if hf.get("add_cross_attention", False):
        problems.append("add_cross_attention=True")
    d_model, heads = hf.get("n_embd", 768), hf.get("n_head", 12)
    if d_model % heads:
        problems.append(f"n_embd={d_model} not divisible by n_head={heads}")
    check_options("gpt2", problems)
    # transformers writes unset ids as null: GPT2Config's EOS default, and the EOS where no BOS is given
    eos = hf.get("eos_token_id")
    eos = 50256 if eos is None else eos
    bos = hf.get("bos_token_id")
    bos = eos if bos is None else bos
    resid = float(hf.get("resid_pdrop", 0.1))
    embedding = float(hf.get("embd_pdrop", resid))
    return dict(
        vocab_size=hf.get("vocab_size", 50257),
        d_model=d_model,
        num_heads=heads,
        d_ff=hf.get("n_inner") or 4 * d_model,
        num_encoder_layers=0,
        num_decoder_layers=hf.get("n_layer", 12),
        max_len=hf.get("n_positions", 1024),
        dropout_rate=resid,
        # None (= dropout_rate) when they agree, so that a dropout_rate override covers both
        embedding_dropout_rate=None if embedding == resid else embedding,
        attention_dropout_rate=float(hf.get("attn_pdrop", 0.1)),
        norm="pre",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        final_norm=True,
        activation=HF_ACTIVATIONS[hf.get("activation_function", "gelu_new")],
        position="learned",
        scale_embeddings=False,
        tie_output=hf.get("tie_word_embeddings", True),
        logits_bias=False,
        use_bias=True,
        pad_id=hf.get("pad_token_id"),
        eos_id=eos,
        bos_id=bos,
        decoder_start_id=bos,
    )


def config_for_tensors(cfg: ModelConfig, tensors: dict) -> ModelConfig:
    """``tie_output=False`` when the checkpoint's ``lm_head.weight`` differs from ``wte``."""
    return untie_a_distinct_head(cfg, strip_prefix(tensors, "transformer."), "wte.weight")


def _is_buffer(name: str) -> bool:
    # Older checkpoints store the causal mask as attn.bias / attn.masked_bias buffers.
    return name.endswith(("attn.bias", "attn.masked_bias")) or name == "lm_head.weight"


def _norm(b: ParamBuilder, source: str, target: str, d: int) -> None:
    b.put(f"{target}/scale", b.take(f"{source}.weight", (d,)), f"{source}.weight")
    b.put(f"{target}/bias", b.take(f"{source}.bias", (d,)), f"{source}.bias")


def _layer(b: ParamBuilder, cfg: ModelConfig, i: int) -> None:
    d, f, h = cfg.d_model, cfg.d_ff, cfg.num_heads
    src, dst = f"h.{i}", f"decoder/layer_{i}"
    _norm(b, f"{src}.ln_1", f"{dst}/self_attention_norm", d)
    qkv = b.take(f"{src}.attn.c_attn.weight", (d, 3 * d))
    qkv_bias = b.take(f"{src}.attn.c_attn.bias", (3 * d,))
    for j, name in enumerate(("query", "key", "value")):
        part = slice(j * d, (j + 1) * d)
        b.put(f"{dst}/self_attention/{name}/kernel", heads_in(qkv[:, part], h), f"{src}.attn.c_attn.weight")
        b.put(f"{dst}/self_attention/{name}/bias", heads_bias(qkv_bias[part], h), f"{src}.attn.c_attn.bias")
    b.put(
        f"{dst}/self_attention/out/kernel",
        heads_out(b.take(f"{src}.attn.c_proj.weight", (d, d)), h),
        f"{src}.attn.c_proj.weight",
    )
    b.put(
        f"{dst}/self_attention/out/bias", b.take(f"{src}.attn.c_proj.bias", (d,)), f"{src}.attn.c_proj.bias"
    )
    _norm(b, f"{src}.ln_2", f"{dst}/feed_forward_norm", d)
    for name, ours, shape in (("c_fc", "wi", (d, f)), ("c_proj", "wo", (f, d))):
        b.put(
            f"{dst}/feed_forward/{ours}/kernel",
            b.take(f"{src}.mlp.{name}.weight", shape),
            f"{src}.mlp.{name}.weight",
        )
        b.put(
            f"{dst}/feed_forward/{ours}/bias",
            b.take(f"{src}.mlp.{name}.bias", shape[1:]),
            f"{src}.mlp.{name}.bias",
        )


def params_from_hf(tensors: dict, cfg: ModelConfig) -> dict:
    """Our `TransformerLM` parameters from GPT-2 tensors (with or without the 'transformer.' prefix)."""
    b = ParamBuilder(strip_prefix(tensors, "transformer."), cfg, ignore=_is_buffer)
    d, v = cfg.d_model, cfg.vocab_size
    b.put("embed/embedding", b.take("wte.weight", (v, d)), "wte.weight")
    b.put("decoder/position_embed/embedding", b.take("wpe.weight", (cfg.max_len, d)), "wpe.weight")
    for i in range(cfg.num_decoder_layers):
        _layer(b, cfg, i)
    _norm(b, "ln_f", "decoder/final_norm", d)
    if not cfg.tie_output:
        b.put("decoder/output/kernel", b.take("lm_head.weight", (v, d)).T, "lm_head.weight")
    return b.build()
