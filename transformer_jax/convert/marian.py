"""Marian / opus-mt (Junczys-Dowmunt et al. 2018) -> `Transformer`: the paper's encoder-decoder
with three details of its own, each a `ModelConfig` option:

* sinusoidal positions in the 'concat' layout (all sines, then all cosines), counted from 0;
* a learned bias on the final logits (``final_logits_bias`` -> ``logits_bias=True``);
* the decoder starts from the pad token (``decoder_start_id = pad_id``).

Post-LN with LayerNorm eps 1e-5, no final norm, ``nn.Linear`` weights stored [out, in].
"""

from __future__ import annotations

import numpy as np
from absl import logging

from transformer_jax.config import ModelConfig
from transformer_jax.convert.hf_files import Unreadable
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

_LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which MarianEncoderLayer/DecoderLayer use


# Dropout after the feed-forward activation and dropping whole layers: used only in training.
TRAINING_ONLY = ("activation_dropout", "encoder_layerdrop", "decoder_layerdrop")


def _shown(hf: dict, key: str, default) -> str:
    """``key=value`` as the check used it: config.json's, or MarianConfig's default it stands for."""
    if key in hf:
        return f"{key}={hf[key]}"
    return f"{key}={default} (config.json has none: MarianConfig's default)"


def _unsupported(hf: dict) -> list[str]:
    problems = []
    act = hf.get("activation_function", "gelu")
    if act not in HF_ACTIVATIONS:
        problems.append(f"activation_function={act!r} (supported: {sorted(HF_ACTIVATIONS)})")
    pairs = (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim"))
    for enc, dec in pairs:
        if hf.get(enc, 16) != hf.get(dec, 16):
            problems.append(f"{_shown(hf, enc, 16)} != {_shown(hf, dec, 16)} (one size for both stacks)")
    if "vocab_size" not in hf:
        raise KeyError("vocab_size")
    decoder_vocab = hf.get("decoder_vocab_size") or hf.get("vocab_size")
    if decoder_vocab != hf.get("vocab_size"):
        problems.append(
            f"decoder_vocab_size={decoder_vocab} != vocab_size={hf.get('vocab_size')} "
            "(separate target vocabulary)"
        )
    if hf.get("d_model", 1024) % hf.get("encoder_attention_heads", 16):
        problems.append(f"{_shown(hf, 'd_model', 1024)} not divisible by "
                        f"{_shown(hf, 'encoder_attention_heads', 16)}")
    if hf.get("pad_token_id") is None:
        problems.append("pad_token_id=None (Marian starts decoding from the pad token)")
    return problems


# The config.json key each token id is read from (decoding starts from the pad token by default).
TOKEN_ID_KEYS = {"eos_id": "eos_token_id", "bos_id": "decoder_start_token_id",
                 "decoder_start_id": "decoder_start_token_id", "pad_id": "pad_token_id"}
# The id each key is read into first (see gpt2.ID_SOURCES); not the pad id, which no override may
# change (the encoder masks the source by it).
ID_SOURCES = {"eos_token_id": "eos_id", "decoder_start_token_id": "decoder_start_id"}


def config_fields(hf: dict) -> dict:
    """The `ModelConfig` fields of a Marian config.json; every option we cannot express is listed in
    one error."""
    check_options("marian", _unsupported(hf))
    left_out = [f"{name}={hf[name]}" for name in TRAINING_ONLY if hf.get(name)]
    if left_out:  # they change nothing at inference; fine-tuning here runs without them
        logging.warning("Marian options with no ModelConfig counterpart left out: %s (training "
                        "regularisers: decoding is unchanged, and fine-tuning runs without them)",
                        ", ".join(left_out))
    # transformers writes unset ids as null: MarianConfig's defaults then (EOS 0, start from the pad)
    start = hf.get("decoder_start_token_id")
    start = hf["pad_token_id"] if start is None else start
    eos = hf.get("eos_token_id")
    return dict(
        vocab_size=hf["vocab_size"],
        d_model=hf.get("d_model", 1024),
        num_heads=hf.get("encoder_attention_heads", 16),
        d_ff=hf.get("encoder_ffn_dim", 4096),
        num_encoder_layers=hf.get("encoder_layers", 12),
        num_decoder_layers=hf.get("decoder_layers", 12),
        dropout_rate=float(hf.get("dropout", 0.1)),
        attention_dropout_rate=float(hf.get("attention_dropout", 0.0)),
        max_len=hf.get("max_position_embeddings", 1024),
        norm="post",
        norm_eps=_LAYER_NORM_EPS,
        final_norm=False,
        activation=HF_ACTIVATIONS[hf.get("activation_function", "gelu")],
        position="sinusoidal",
        sinusoidal_layout="concat",
        share_embeddings=hf.get("share_encoder_decoder_embeddings", True),
        tie_output=hf.get("tie_word_embeddings", True),
        logits_bias=True,
        scale_embeddings=hf.get("scale_embedding", False),
        use_bias=True,
        pad_id=hf["pad_token_id"],
        eos_id=0 if eos is None else eos,
        bos_id=start,
        decoder_start_id=start,
    )


def config_for_tensors(cfg: ModelConfig, tensors: dict) -> ModelConfig:
    """``share_embeddings=False`` when the checkpoint's per-stack token embeddings differ from
    ``shared`` (transformers unties them from it when ``tie_word_embeddings`` is false, though
    ``share_encoder_decoder_embeddings`` stays true): each stack then has its own table; and
    ``tie_output=False`` when a stored ``lm_head.weight`` differs from the table a tied head reuses."""
    t = strip_prefix(tensors, "model.")
    readable = {k: v for k, v in t.items() if not isinstance(v, Unreadable)}  # (reading one names it)
    if cfg.share_embeddings and "shared.weight" in readable:
        shared = np.asarray(readable["shared.weight"])
        for stack in ("encoder", "decoder"):
            own = readable.get(f"{stack}.embed_tokens.weight")
            if own is not None and not np.array_equal(np.asarray(own), shared):
                cfg = cfg.replace(share_embeddings=False)
                break
    # The table a tied output head reuses (see `_embeddings`): a stored head that differs from it
    # is used as it is, as transformers does.
    if cfg.share_embeddings:
        table = "shared.weight" if "shared.weight" in t else "encoder.embed_tokens.weight"
    else:
        table = "decoder.embed_tokens.weight"
    return untie_a_distinct_head(cfg, t, table)


def _is_buffer(name: str) -> bool:
    # Fixed sinusoid tables (recomputed by us), and tied copies of the shared embedding.
    return (
        name.endswith("embed_positions.weight")
        or name.endswith("embed_tokens.weight")
        or (name == "lm_head.weight")
    )


def _norm(b: ParamBuilder, source: str, target: str, d: int) -> None:
    b.put(f"{target}/scale", b.take(f"{source}.weight", (d,)), f"{source}.weight")
    b.put(f"{target}/bias", b.take(f"{source}.bias", (d,)), f"{source}.bias")


def _attention(b: ParamBuilder, cfg: ModelConfig, source: str, target: str) -> None:
    d, h = cfg.d_model, cfg.num_heads
    for hf_name, ours in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")):
        name = f"{source}.{hf_name}"
        b.put(f"{target}/{ours}/kernel", heads_in(b.take(f"{name}.weight", (d, d)).T, h), f"{name}.weight")
        b.put(f"{target}/{ours}/bias", heads_bias(b.take(f"{name}.bias", (d,)), h), f"{name}.bias")
    name = f"{source}.out_proj"
    b.put(f"{target}/out/kernel", heads_out(b.take(f"{name}.weight", (d, d)).T, h), f"{name}.weight")
    b.put(f"{target}/out/bias", b.take(f"{name}.bias", (d,)), f"{name}.bias")


def _layer(b: ParamBuilder, cfg: ModelConfig, stack: str, i: int) -> None:
    d, f = cfg.d_model, cfg.d_ff
    src, dst = f"{stack}.layers.{i}", f"{stack}/layer_{i}"
    _attention(b, cfg, f"{src}.self_attn", f"{dst}/self_attention")
    _norm(b, f"{src}.self_attn_layer_norm", f"{dst}/self_attention_norm", d)
    if stack == "decoder":
        _attention(b, cfg, f"{src}.encoder_attn", f"{dst}/cross_attention")
        _norm(b, f"{src}.encoder_attn_layer_norm", f"{dst}/cross_attention_norm", d)
    for hf_name, ours, shape in (("fc1", "wi", (f, d)), ("fc2", "wo", (d, f))):
        name = f"{src}.{hf_name}"
        b.put(f"{dst}/feed_forward/{ours}/kernel", b.take(f"{name}.weight", shape).T, f"{name}.weight")
        b.put(f"{dst}/feed_forward/{ours}/bias", b.take(f"{name}.bias", shape[:1]), f"{name}.bias")
    _norm(b, f"{src}.final_layer_norm", f"{dst}/feed_forward_norm", d)


def _embeddings(b: ParamBuilder, cfg: ModelConfig) -> None:
    shape = (cfg.vocab_size, cfg.d_model)
    if cfg.share_embeddings:
        # Newer saves keep only `shared`; older ones also store the tied per-stack copies.
        name = "shared.weight" if b.has("shared.weight") else "encoder.embed_tokens.weight"
        b.put("embed/embedding", b.take(name, shape), name)
        return
    for stack, ours in (("encoder", "source_embed"), ("decoder", "target_embed")):
        name = f"{stack}.embed_tokens.weight"
        b.put(f"{ours}/embedding", b.take(name, shape), name)


def params_from_hf(tensors: dict, cfg: ModelConfig) -> dict:
    """Our `Transformer` parameters from Marian tensors (with or without the 'model.' prefix)."""
    # Stacks with their own tables leave `shared` unread, as transformers' forward pass does: not
    # worth a warning that a tensor went unused.
    unread = set() if cfg.share_embeddings else {"shared.weight"}
    b = ParamBuilder(strip_prefix(tensors, "model."), cfg, ignore=lambda n: _is_buffer(n) or n in unread)
    _embeddings(b, cfg)
    for stack, count in (("encoder", cfg.num_encoder_layers), ("decoder", cfg.num_decoder_layers)):
        for i in range(count):
            _layer(b, cfg, stack, i)
    v = cfg.vocab_size
    bias_name = "final_logits_bias"
    if b.has(bias_name):
        b.put("decoder/final_logits_bias", b.take(bias_name, (1, v))[0], bias_name)
    else:  # HF lists it as optional on load (missing means zeros)
        import numpy as np

        b.put("decoder/final_logits_bias", np.zeros((v,), np.float32), bias_name)
    if not cfg.tie_output:
        b.put("decoder/output/kernel", b.take("lm_head.weight", (v, cfg.d_model)).T, "lm_head.weight")
    return b.build()
