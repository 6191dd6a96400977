"""Hugging Face checkpoint import: logits and greedy generations equal transformers' own on random
GPT-2 and Marian models (two shapes each); tokenizers equal transformers'; bad checkpoints fail
with errors that name the problem; pickles are only read with weights_only=True."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch  # noqa: E402
from test_convert_fixtures import (  # noqa: E402
    GPT2_CONFIGS,
    MARIAN_CONFIGS,
    gpt2_checkpoint,
    hf_model,
    marian_checkpoint,
    scratch_directory,
)

from transformer_jax.convert import (  # noqa: E402
    ConversionError,
    load_hf_checkpoint,
    load_hf_config,
    load_hf_tokenizer,
)
from transformer_jax.convert.hf_files import read_safetensors  # noqa: E402
from transformer_jax.decoding import generate, model_steps, pad_prompts  # noqa: E402
from transformer_jax.modeling import init_cache  # noqa: E402
from transformer_jax.params import build_model  # noqa: E402

NEW_TOKENS = 24


def _ragged(rng, lengths, width, low, high, pad):
    """Right-padded random token rows [B, width] and their 0/1 mask."""
    tokens = np.full((len(lengths), width), pad, np.int64)
    mask = np.zeros_like(tokens)
    for r, n in enumerate(lengths):
        tokens[r, :n] = rng.integers(low, high, n)
        mask[r, :n] = 1
    return tokens, mask


# ----------------------------------------------------------------------------- configs


def test_gpt2_config_maps_every_option():
    config, _ = load_hf_checkpoint(gpt2_checkpoint("gpt2_b"))
    assert (config.d_model, config.num_heads, config.num_decoder_layers, config.d_ff) == (32, 8, 3, 40)
    assert (config.norm, config.final_norm, config.position, config.activation) == (
        "pre",
        True,
        "learned",
        "gelu",
    )
    assert config.num_encoder_layers == 0 and config.max_len == 48 and not config.tie_output
    assert not config.scale_embeddings and config.norm_eps == 1e-5 and not config.logits_bias
    # the three dropout rates of the checkpoint's config, each where GPT-2 applies it
    with open(os.path.join(gpt2_checkpoint("gpt2_b"), "config.json")) as f:
        hf = json.load(f)
    assert (config.dropout_rate, config.attention_dropout_rate, config.embedding_dropout_rate) == (
        hf["resid_pdrop"], hf["attn_pdrop"], hf["embd_pdrop"])
    # equal rates stay one setting, so that dropout_rate=0.0 (for evaluation) turns both off
    same, _ = load_hf_checkpoint(gpt2_checkpoint("gpt2_a"), dropout_rate=0.0)
    assert same.embedding_dropout_rate is None and same.dropout_rate == 0.0


def test_marian_config_maps_every_option(caplog):
    config, _ = load_hf_checkpoint(marian_checkpoint("marian_swish"))
    pad = config.vocab_size - 1
    assert (config.norm, config.use_final_norm, config.position, config.sinusoidal_layout) == (
        "post",
        False,
        "sinusoidal",
        "concat",
    )
    assert config.activation == "silu" and config.scale_embeddings and config.logits_bias
    assert (config.pad_id, config.decoder_start_id, config.eos_id) == (pad, pad, 0)
    relu, _ = load_hf_checkpoint(marian_checkpoint("marian_relu"))
    assert relu.activation == "relu" and not relu.share_embeddings and not relu.scale_embeddings
    # config.json says shared, but the saved per-stack tables differ from `shared`: each stack
    # gets its own (before, both took `shared`, silently; logits parity below).
    untied = marian_checkpoint("marian_untied_output")
    assert load_hf_config(untied).share_embeddings
    caplog.clear()
    config, params = load_hf_checkpoint(untied)
    assert not config.share_embeddings and {"source_embed", "target_embed"} <= set(params)
    assert "not used" not in caplog.text  # `shared` is not read then, by transformers either


def test_gpt2_layer_norm_epsilon_and_token_ids_are_carried_over(tmp_path):
    """Values other than GPT-2's defaults (the fixtures keep them): a LayerNorm epsilon large
    enough to change every norm (logits equal transformers'), and bos != eos, for the model and
    for the tokenizer stored beside it."""
    import transformers

    hf_config = transformers.GPT2Config(vocab_size=300, n_embd=16, n_head=2, n_layer=2, n_positions=16,
                                        layer_norm_epsilon=0.01, bos_token_id=3, eos_token_id=7)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(hf_config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0) if p.ndim == 2 else p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    shutil.copy(os.path.join(gpt2_checkpoint("gpt2_a"), "tokenizer.json"), tmp_path / "tokenizer.json")
    config, params = load_hf_checkpoint(tmp_path)
    assert config.norm_eps == model.transformer.ln_f.eps == 0.01
    assert (config.bos_id, config.eos_id, config.decoder_start_id) == (3, 7, 3)
    tokens = np.random.default_rng(0).integers(0, 300, (2, 9))
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(build_model(config).apply({"params": params}, jnp.asarray(tokens, jnp.int32)))
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
    tokenizer = load_hf_tokenizer(tmp_path)
    assert tokenizer.eos_id == 7 and tokenizer.decode(tokenizer.encode("the cat") + [7]) == "the cat"


def test_marian_training_only_options_are_left_out_with_a_warning(caplog):
    """A fine-tuned Marian with activation dropout or layer drop (regularisers that change nothing
    at inference) was refused outright; it loads with a warning naming them, and its eval-mode
    logits are transformers'. Marian takes "gelu_fast" as GPT-2 does."""
    import logging

    def edit(c):
        c.update(activation_function="gelu_fast", activation_dropout=0.1, encoder_layerdrop=0.05)

    directory = _copy_checkpoint(marian_checkpoint("marian_swish"), edit)
    with caplog.at_level(logging.WARNING, logger="absl"):
        config, params = load_hf_checkpoint(directory)
    assert "activation_dropout=0.1, encoder_layerdrop=0.05" in caplog.text
    assert "decoder_layerdrop" not in caplog.text and config.activation == "gelu_tanh"
    rng = np.random.default_rng(2)
    src = rng.integers(1, config.vocab_size - 1, (2, 6))
    src[:, -1] = config.eos_id
    tgt = rng.integers(1, config.vocab_size - 1, (2, 5))
    tgt[:, 0] = config.decoder_start_id
    with torch.no_grad():
        ref = hf_model(directory)(input_ids=torch.tensor(src), decoder_input_ids=torch.tensor(tgt)).logits
    ours = build_model(config).apply({"params": params}, jnp.asarray(src, jnp.int32),
                                     jnp.asarray(tgt, jnp.int32))
    np.testing.assert_allclose(np.asarray(ours), ref.numpy(), atol=1e-4, rtol=0)


def test_marian_token_ids_and_layer_norm_epsilon_follow_transformers():
    """decoder_start_token_id and eos_token_id other than the fixtures' (pad, 0) are read from
    config.json, as transformers reads them; every LayerNorm gets torch's epsilon."""

    def edit(c):
        c.update(decoder_start_token_id=5, eos_token_id=2)

    directory = _copy_checkpoint(marian_checkpoint("marian_swish"), edit)
    config = load_hf_config(directory)
    model = hf_model(directory)
    hf = model.config
    assert (config.decoder_start_id, config.bos_id) == (hf.decoder_start_token_id,) * 2 == (5, 5)
    assert (config.eos_id, config.pad_id) == (hf.eos_token_id, hf.pad_token_id) == (2, config.vocab_size - 1)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(norms) == 2 * 2 + 2 * 3 and {m.eps for m in norms} == {config.norm_eps}


# ----------------------------------------------------------------------------- logits parity


@pytest.mark.parametrize("name", sorted(GPT2_CONFIGS))
def test_gpt2_logits_match_transformers(name):
    directory = gpt2_checkpoint(name)
    config, params = load_hf_checkpoint(directory)
    tokens, mask = _ragged(np.random.default_rng(0), [11, 7, 3], 11, 0, config.vocab_size, 0)
    with torch.no_grad():
        ref = hf_model(directory)(torch.tensor(tokens), attention_mask=torch.tensor(mask)).logits.numpy()
    ours = np.asarray(jax.jit(build_model(config).apply)({"params": params}, jnp.asarray(tokens, jnp.int32)))
    real = mask.astype(bool)
    assert np.abs(ref).max() > 1.0  # the random weights give non-trivial logits
    np.testing.assert_allclose(ours[real], ref[real], atol=1e-4, rtol=0)
    # Loaded straight into the other kernel layout: other shapes, the same logits.
    config, params = load_hf_checkpoint(directory, kernel_layout="out_in")
    assert params["decoder"]["layer_0"]["self_attention"]["out"]["kernel"].shape == (
        config.d_model, config.num_heads, config.qk_dim)
    ours = np.asarray(jax.jit(build_model(config).apply)({"params": params}, jnp.asarray(tokens, jnp.int32)))
    np.testing.assert_allclose(ours[real], ref[real], atol=1e-4, rtol=0)
    # Scanned layers (stacked after conversion): the same logits; and with GPT-2's own fused c_attn
    # kept as one kernel (fused_qkv).
    config, params = load_hf_checkpoint(directory, scan_layers=True)
    assert "layers" in params["decoder"] and "layer_0" not in params["decoder"]
    ours = np.asarray(jax.jit(build_model(config).apply)({"params": params}, jnp.asarray(tokens, jnp.int32)))
    np.testing.assert_allclose(ours[real], ref[real], atol=1e-4, rtol=0)
    config, params = load_hf_checkpoint(directory, scan_layers=True, fused_qkv=True)
    assert set(params["decoder"]["layers"]["self_attention"]) == {"qkv", "out"}
    ours = np.asarray(jax.jit(build_model(config).apply)({"params": params}, jnp.asarray(tokens, jnp.int32)))
    np.testing.assert_allclose(ours[real], ref[real], atol=1e-4, rtol=0)
    # With the table padded for an even tensor split: zero rows added, the same logits, as wide.
    config, params = load_hf_checkpoint(directory, pad_vocab_multiple=64)
    assert params["embed"]["embedding"].shape[0] == config.padded_vocab_size == 320
    np.testing.assert_array_equal(params["embed"]["embedding"][config.vocab_size:], 0)
    ours = np.asarray(jax.jit(build_model(config).apply)({"params": params}, jnp.asarray(tokens, jnp.int32)))
    assert ours.shape[-1] == config.vocab_size
    np.testing.assert_allclose(ours[real], ref[real], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["gpt2", "marian"])
def test_a_stored_head_that_differs_from_the_tied_table_is_used(kind):
    """A config that ties the output head to the token table, with a distinct ``lm_head.weight``
    stored: transformers uses the stored head (and warns); the head was dropped and the table
    reused, logits off by up to ~70."""
    from safetensors.torch import load_file, save_file

    first = sorted(GPT2_CONFIGS if kind == "gpt2" else MARIAN_CONFIGS)[0]
    directory = _copy_checkpoint(gpt2_checkpoint(first) if kind == "gpt2" else marian_checkpoint(first))
    weights = os.path.join(directory, "model.safetensors")
    tensors = load_file(weights)
    table = next(k for k in tensors if k.endswith(("wte.weight", "embed_tokens.weight")))
    tensors["lm_head.weight"] = torch.randn_like(tensors[table]) * 4
    save_file(tensors, weights, metadata={"format": "pt"})
    config, params = load_hf_checkpoint(directory)
    assert not config.tie_output
    model = hf_model(directory)
    assert not torch.equal(model.get_output_embeddings().weight, model.get_input_embeddings().weight)
    tokens = np.random.default_rng(0).integers(3, config.vocab_size, (2, 6))
    with torch.no_grad():
        if kind == "gpt2":
            ref = model(torch.tensor(tokens)).logits.numpy()
            ours = build_model(config).apply({"params": params}, jnp.asarray(tokens, jnp.int32))
        else:
            ref = model(input_ids=torch.tensor(tokens), decoder_input_ids=torch.tensor(tokens)).logits.numpy()
            ours = build_model(config).apply({"params": params}, jnp.asarray(tokens, jnp.int32),
                                              jnp.asarray(tokens, jnp.int32))
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", sorted(MARIAN_CONFIGS))
def test_marian_logits_match_transformers(name):
    directory = marian_checkpoint(name)
    config = load_hf_config(directory)
    rng = np.random.default_rng(1)
    pad, v = config.pad_id, config.vocab_size
    src, src_mask = _ragged(rng, [9, 4, 6], 9, 1, v - 1, pad)
    src[np.arange(3), src_mask.sum(1) - 1] = config.eos_id
    tgt, tgt_mask = _ragged(rng, [7, 2, 5], 7, 0, v - 1, pad)
    tgt[:, 0] = config.decoder_start_id
    with torch.no_grad():
        ref = hf_model(directory)(
            input_ids=torch.tensor(src),
            attention_mask=torch.tensor(src_mask),
            decoder_input_ids=torch.tensor(tgt),
            decoder_attention_mask=torch.tensor(tgt_mask),
        ).logits.numpy()
    real = tgt_mask.astype(bool)
    for pad_multiple in (1, 16):  # the padded table and logits bias give the same logits
        config, params = load_hf_checkpoint(directory, pad_vocab_multiple=pad_multiple)
        assert params["decoder"]["final_logits_bias"].shape == (config.padded_vocab_size,)
        forward = jax.jit(build_model(config).apply)
        ours = np.asarray(forward({"params": params}, jnp.asarray(src, jnp.int32),
                                  jnp.asarray(tgt, jnp.int32)))
        np.testing.assert_allclose(ours[real], ref[real], atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------- greedy generation


def _hf_greedy(model, input_ids, **kwargs):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([input_ids]),
            attention_mask=torch.ones(1, len(input_ids), dtype=torch.long),
            do_sample=False,
            num_beams=1,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=20,
            **kwargs,
        )
    return out[0].tolist()


def _ours_until_eos(tokens, lengths):
    return [row[:n] for row, n in zip(np.asarray(tokens).tolist(), np.asarray(lengths).tolist(), strict=True)]


@pytest.mark.parametrize("name", sorted(GPT2_CONFIGS))
def test_gpt2_greedy_generation_matches_transformers(name):
    directory = gpt2_checkpoint(name)
    config, params = load_hf_checkpoint(directory)
    prompts = [[5, 17, 200, 31, 9, 77], [250, 3]]  # ragged: one right-padded batch for us
    tokens, lengths = pad_prompts(prompts)
    cache = init_cache(config, len(prompts), tokens.shape[1] + NEW_TOKENS)
    out = generate(
        model_steps.LMStep(build_model(config)),
        params,
        cache,
        tokens,
        lengths,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=20,
        eos_id=config.eos_id,
    )
    ours = _ours_until_eos(out.tokens, out.lengths)
    model = hf_model(directory)
    for p, mine in zip(prompts, ours, strict=True):
        theirs = _hf_greedy(model, p, pad_token_id=config.eos_id)[len(p) :]
        assert mine == theirs
        assert len(mine) >= 20


@pytest.mark.parametrize("name", sorted(MARIAN_CONFIGS))
def test_marian_greedy_generation_matches_transformers(name):
    directory = marian_checkpoint(name)
    config, params = load_hf_checkpoint(directory)
    sources = [[7, 12, 3, 20, 0], [9, 0]]
    src, _ = pad_prompts(sources, pad_id=config.pad_id)
    model = build_model(config)
    cache = model_steps.encode_source(model, params, jnp.asarray(src, jnp.int32), max_length=NEW_TOKENS + 1)
    start = jnp.full((len(sources), 1), config.decoder_start_id, jnp.int32)
    out = generate(
        model_steps.Seq2SeqStep(model),
        params,
        cache,
        start,
        jnp.ones(len(sources), jnp.int32),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=20,
        eos_id=config.eos_id,
        pad_id=config.pad_id,
    )
    ours = _ours_until_eos(out.tokens, out.lengths)
    hf = hf_model(directory)
    for s, mine in zip(sources, ours, strict=True):
        theirs = _hf_greedy(hf, s)[1:]  # drop the decoder start token
        assert mine == theirs
        assert len(mine) >= 20


# ----------------------------------------------------------------------------- weight files


def test_pytorch_bin_loads_the_same_params(tmp_path):
    directory = gpt2_checkpoint("gpt2_b")
    _, from_safetensors = load_hf_checkpoint(directory)
    shutil.copy(os.path.join(directory, "config.json"), tmp_path / "config.json")
    torch.save(hf_model(directory).state_dict(), tmp_path / "pytorch_model.bin")
    _, from_bin = load_hf_checkpoint(tmp_path)
    for a, b in zip(_leaves(from_safetensors), _leaves(from_bin), strict=True):
        np.testing.assert_array_equal(a, b)


def test_sharded_checkpoints_load_the_same_params(tmp_path):
    directory = gpt2_checkpoint("gpt2_b")
    _, whole = load_hf_checkpoint(directory)
    # safetensors shards as transformers writes them (model.safetensors.index.json)
    hf_model(directory).save_pretrained(tmp_path / "st", max_shard_size="20KB")
    with open(tmp_path / "st" / "model.safetensors.index.json") as f:
        assert len(set(json.load(f)["weight_map"].values())) > 2
    # and pytorch_model.bin shards with their index, split by hand
    (tmp_path / "bin").mkdir()
    shutil.copy(os.path.join(directory, "config.json"), tmp_path / "bin" / "config.json")
    state = {k: v.contiguous() for k, v in hf_model(directory).state_dict().items()}
    names = sorted(state)
    weight_map = {}
    for n, part in enumerate((names[::3], names[1::3], names[2::3])):
        filename = f"pytorch_model-{n:05d}-of-00003.bin"
        torch.save({k: state[k] for k in part}, tmp_path / "bin" / filename)
        weight_map.update(dict.fromkeys(part, filename))
    with open(tmp_path / "bin" / "pytorch_model.bin.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    for sub in ("st", "bin"):
        _, sharded = load_hf_checkpoint(tmp_path / sub)
        assert jax.tree.structure(sharded) == jax.tree.structure(whole)
        for a, b in zip(_leaves(sharded), _leaves(whole), strict=True):
            np.testing.assert_array_equal(a, b)


def test_bfloat16_pytorch_bin_loads_its_values(tmp_path):
    directory = gpt2_checkpoint("gpt2_a")
    shutil.copy(os.path.join(directory, "config.json"), tmp_path / "config.json")
    state = {k: v.to(torch.bfloat16) for k, v in hf_model(directory).state_dict().items()}
    torch.save(state, tmp_path / "pytorch_model.bin")
    _, params = load_hf_checkpoint(tmp_path)
    assert params["embed"]["embedding"].dtype == jnp.float32
    np.testing.assert_array_equal(params["embed"]["embedding"],
                                  state["transformer.wte.weight"].float().numpy())
    np.testing.assert_array_equal(params["decoder"]["layer_1"]["feed_forward"]["wo"]["kernel"],
                                  state["transformer.h.1.mlp.c_proj.weight"].float().numpy())


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


class _Payload:
    """Unpickling this would run code (here: create a marker file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_malicious_pickle_is_refused(tmp_path):
    shutil.copy(os.path.join(gpt2_checkpoint("gpt2_a"), "config.json"), tmp_path / "config.json")
    marker = tmp_path / "pwned"
    with open(tmp_path / "pytorch_model.bin", "wb") as f:
        pickle.dump({"transformer.wte.weight": _Payload(str(marker))}, f)
    with pytest.raises(ConversionError, match="weights_only=True"):
        load_hf_checkpoint(tmp_path)
    assert not marker.exists()
    torch.save({"transformer.wte.weight": _Payload(str(marker))}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ConversionError, match="refused"):
        load_hf_checkpoint(tmp_path)
    assert not marker.exists()


def test_safetensors_reader_handles_bfloat16_and_float16(tmp_path):
    from safetensors.torch import save_file

    values = {"a": torch.randn(3, 5).to(torch.bfloat16), "b": torch.randn(7).half(), "c": torch.arange(4)}
    save_file(values, str(tmp_path / "x.safetensors"))
    ours = read_safetensors(str(tmp_path / "x.safetensors"))
    for k, v in values.items():
        np.testing.assert_array_equal(np.asarray(ours[k], np.float64), v.double().numpy())


# ----------------------------------------------------------------------------- bad checkpoints


def _copy_checkpoint(src, edit_config=None):
    directory = scratch_directory()
    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), directory)
    if edit_config:
        path = os.path.join(directory, "config.json")
        with open(path) as f:
            config = json.load(f)
        edit_config(config)
        with open(path, "w") as f:
            json.dump(config, f)
    return directory


def test_overrides_that_change_the_function_are_refused():
    """The weights would still fit a checkpoint loaded with another norm placement, activation,
    epsilon or embedding scale, but compute another function: refused, naming the field."""
    directory = gpt2_checkpoint("gpt2_b")
    for field, value in (("norm", "post"), ("activation", "relu"), ("norm_eps", 0.5),
                         ("scale_embeddings", True), ("max_len", 4096)):
        with pytest.raises(ConversionError, match=rf"cannot override \['{field}'\].*Overridable"):
            load_hf_config(directory, **{field: value})
    assert load_hf_config(directory, dtype="bfloat16", eos_id=3, scan_layers=True).scan_layers
    own = load_hf_config(directory)  # a field's own value is no change: allowed
    assert load_hf_config(directory, max_len=own.max_len, norm_eps=own.norm_eps, norm="pre") == own
    # Marian's positions are computed: a longer max_len is fine there.
    assert load_hf_config(marian_checkpoint("marian_relu"), max_len=4096).max_len == 4096


def test_unsupported_model_type_names_the_supported_ones():
    directory = _copy_checkpoint(gpt2_checkpoint("gpt2_a"), lambda c: c.update(model_type="bert"))
    with pytest.raises(ConversionError, match=r"unsupported model_type 'bert'.*\['gpt2', 'marian'\]"):
        load_hf_checkpoint(directory)


def test_unsupported_options_are_all_listed():
    def edit(c):
        c.update(scale_attn_by_inverse_layer_idx=True, add_cross_attention=True, activation_function="mish",
                 scale_attn_weights=False)

    directory = _copy_checkpoint(gpt2_checkpoint("gpt2_a"), edit)
    with pytest.raises(ConversionError) as e:
        load_hf_checkpoint(directory)
    for option in ("scale_attn_weights=False", "scale_attn_by_inverse_layer_idx", "add_cross_attention",
                   "activation_function='mish'"):
        assert option in str(e.value)
    # the converter's own list, not wrapped as "a value of the wrong type or out of range"
    assert str(e.value).startswith(f"{directory}/config.json: unsupported gpt2 checkpoint options")
    directory = _copy_checkpoint(
        marian_checkpoint("marian_swish"), lambda c: c.update(decoder_attention_heads=6, decoder_vocab_size=7)
    )
    with pytest.raises(ConversionError, match="decoder_attention_heads=6.*\n.*decoder_vocab_size=7") as e:
        load_hf_checkpoint(directory)
    assert str(e.value).startswith(f"{directory}/config.json: unsupported marian checkpoint options")
    # A size config.json lacks is shown as the default the check used, not as None.
    directory = _copy_checkpoint(marian_checkpoint("marian_swish"),
                                 lambda c: c.pop("decoder_attention_heads"))
    with pytest.raises(ConversionError, match=r"encoder_attention_heads=\d+ != decoder_attention_heads=16 "
                                              r"\(config.json has none: MarianConfig's default\)"):
        load_hf_checkpoint(directory)


def test_null_or_out_of_range_token_ids_in_config_json():
    """transformers writes an unset id as null ("bos_token_id": null, which took the place of the
    EOS default and was refused), and loads a small-vocabulary GPT-2 whose ids keep GPT2Config's
    50256: such an id is named with the key it came from, and a token id override loads it."""
    gpt2 = _copy_checkpoint(gpt2_checkpoint("gpt2_a"), lambda c: c.update(bos_token_id=None, eos_token_id=5))
    config = load_hf_config(gpt2)
    assert (config.eos_id, config.bos_id, config.decoder_start_id) == (5, 5, 5)
    vocab = load_hf_config(gpt2).vocab_size
    outside = _copy_checkpoint(gpt2_checkpoint("gpt2_a"), lambda c: c.update(bos_token_id=vocab,
                                                                              eos_token_id=vocab))
    with pytest.raises(ConversionError, match=rf"token ids outside the vocabulary \[0, {vocab}\): "
                                              rf"eos_id={vocab} \(config.json's eos_token_id\): set "
                                              rf"config.json's eos_token_id to a token id, or give "
                                              rf"eos_id=<token id> to load_hf_checkpoint; bos_id={vocab} "
                                              rf"\(config.json's bos_token_id\): set .*give bos_id=.*; "
                                              rf"decoder_start_id={vocab} \(config.json's bos_token_id\)"):
        load_hf_config(outside)
    with pytest.raises(ConversionError, match=r"bos_id=.*config.json's bos_token_id\): set config.json's "
                                              r"bos_token_id to a token id, or give bos_id="):
        load_hf_config(outside, eos_id=3)
    config, _ = load_hf_checkpoint(outside, eos_id=3, bos_id=3, decoder_start_id=3)
    assert (config.eos_id, config.bos_id, config.decoder_start_id) == (3, 3, 3)
    with pytest.raises(ConversionError, match=r"bad override .*eos_id"):
        load_hf_config(outside, eos_id=vocab + 1, bos_id=3, decoder_start_id=3)
    marian = _copy_checkpoint(marian_checkpoint("marian_swish"),
                              lambda c: c.update(decoder_start_token_id=None, eos_token_id=None))
    config = load_hf_config(marian)
    assert (config.eos_id, config.decoder_start_id, config.bos_id) == (0, config.pad_id, config.pad_id)
    # Both ids null: GPT-2's BOS (and so the decoder's start) comes from its EOS, GPT2Config's 50256
    # here; one override of the EOS stood in for it alone, and BOS, then the start failed in turn.
    null = _copy_checkpoint(gpt2_checkpoint("gpt2_a"),
                            lambda c: c.update(bos_token_id=None, eos_token_id=None))
    with pytest.raises(ConversionError, match=r"eos_id=50256 \(config.json has no eos_token_id: derived\)"):
        load_hf_config(null)
    config = load_hf_config(null, eos_id=4)
    assert (config.eos_id, config.bos_id, config.decoder_start_id) == (4, 4, 4)
    # ...but an id that only shares or follows a null key changes nothing else: Marian's BOS and
    # decoder start both read decoder_start_token_id (null: the pad id), and a BOS override leaves
    # the start at the pad id (it moved it too); nor is Marian's pad id overridable through its
    # null key (it was).
    marian = _copy_checkpoint(marian_checkpoint("marian_swish"),
                              lambda c: c.update(decoder_start_token_id=None))
    pad = load_hf_config(marian).pad_id
    config = load_hf_config(marian, bos_id=5)
    assert (config.bos_id, config.decoder_start_id) == (5, pad)
    config = load_hf_config(marian, decoder_start_id=5)
    assert (config.bos_id, config.decoder_start_id) == (5, 5)  # the BOS follows the start it reads
    no_pad = _copy_checkpoint(marian_checkpoint("marian_swish"), lambda c: c.update(pad_token_id=None))
    with pytest.raises(ConversionError, match=r"pad_token_id=None \(Marian starts decoding from the pad"):
        load_hf_config(no_pad, pad_id=7)
    # A Marian pad id outside the vocabulary cannot be overridden (its encoder masks by it): said,
    # not offered as the way out.
    broken = _copy_checkpoint(marian_checkpoint("marian_swish"),
                              lambda c: c.update(pad_token_id=999, decoder_start_token_id=None))
    with pytest.raises(ConversionError, match=r"pad_id=999 \(config.json's pad_token_id\): it cannot "
                                              r"be overridden \(the encoder masks the source tokens "
                                              r"equal to it\): fix config.json$"):
        load_hf_config(broken, bos_id=3, decoder_start_id=3)


def test_pad_id_is_overridable_only_where_no_encoder_masks_by_it():
    """An encoder masks the source tokens equal to pad_id: another pad_id on a Marian checkpoint
    changed its logits (0.015 off with pad_id=0) though the README lists token ids as safe."""
    marian = marian_checkpoint("marian_swish")
    pad = load_hf_config(marian).pad_id
    with pytest.raises(ConversionError, match=r"cannot override \['pad_id'\].*the encoder masks the source "
                                              r"tokens equal to pad_id\)\. Overridable: \[[^]]*\]\.$") as e:
        load_hf_config(marian, pad_id=(pad + 1) % 16)
    assert "'pad_id'" not in str(e.value).split("Overridable")[1]
    assert load_hf_config(marian, pad_id=pad, eos_id=1).pad_id == pad  # its own value is no change
    assert load_hf_config(gpt2_checkpoint("gpt2_a"), pad_id=7).pad_id == 7  # decoder-only: unused


@pytest.mark.parametrize("kind, edit, message", [
    ("gpt2", {"n_embd": "24"}, "value of the wrong type"),
    ("gpt2", {"n_head": 0}, "value of the wrong type or out of range"),
    ("gpt2", {"layer_norm_epsilon": "x"}, "value of the wrong type"),
    ("marian", {"d_model": "24"}, "value of the wrong type"),
    ("marian", {"encoder_attention_heads": 0, "decoder_attention_heads": 0}, "out of range"),
    ("marian", {"vocab_size": None}, "config.json has no 'vocab_size'"),
])
def test_config_json_values_of_the_wrong_type_are_named(kind, edit, message):
    """Hand-edited config.json values gave TypeError / ZeroDivisionError / KeyError tracebacks; a
    Marian config without vocab_size was called a separate target vocabulary."""
    def change(config):
        for key, value in edit.items():
            if value is None:
                config.pop(key, None)
                config.pop("decoder_vocab_size", None)
            else:
                config[key] = value

    source = gpt2_checkpoint("gpt2_a") if kind == "gpt2" else marian_checkpoint("marian_swish")
    with pytest.raises(ConversionError, match=message):
        load_hf_checkpoint(_copy_checkpoint(source, change))


@pytest.mark.parametrize("kind, name", [("gpt2", "tokenizer.json"), ("gpt2", "vocab.json"),
                                        ("marian", "source.spm")])
def test_damaged_tokenizer_files_are_named(kind, name):
    source = gpt2_checkpoint("gpt2_a") if kind == "gpt2" else marian_checkpoint("marian_swish")
    directory = _copy_checkpoint(source)
    path = os.path.join(directory, name)
    if name == "vocab.json":  # read only without tokenizer.json
        os.remove(os.path.join(directory, "tokenizer.json"))
        if not os.path.exists(os.path.join(directory, "merges.txt")):
            pytest.skip("this fixture has no merges.txt")
    with open(path, "rb") as f:
        head = f.read(200)
    with open(path, "wb") as f:
        f.write(head)
    with pytest.raises(ConversionError, match=re.escape(path) + ".* not a readable"):
        load_hf_tokenizer(directory)


def test_mis_shaped_and_missing_tensors_are_named(tmp_path):
    from safetensors.numpy import save_file

    src = gpt2_checkpoint("gpt2_a")
    tensors = {k: np.array(v) for k, v in read_safetensors(os.path.join(src, "model.safetensors")).items()}
    shutil.copy(os.path.join(src, "config.json"), tmp_path / "config.json")
    bad = dict(tensors, **{"transformer.h.1.mlp.c_fc.weight": np.zeros((24, 95), np.float32)})
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ConversionError, match=r"'h.1.mlp.c_fc.weight' has shape \(24, 95\), expected \(24, 96\)"
    ):
        load_hf_checkpoint(tmp_path)
    missing = {k: v for k, v in tensors.items() if k != "transformer.h.0.attn.c_proj.bias"}
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ConversionError, match=r"'h.0.attn.c_proj.bias' \(expected shape \(24,\)\) is missing"
    ):
        load_hf_checkpoint(tmp_path)


def test_not_a_checkpoint_directory(tmp_path):
    with pytest.raises(ConversionError, match="no config.json"):
        load_hf_checkpoint(tmp_path)
    shutil.copy(os.path.join(gpt2_checkpoint("gpt2_a"), "config.json"), tmp_path / "config.json")
    with pytest.raises(ConversionError, match="no weights"):
        load_hf_checkpoint(tmp_path)


def test_damaged_weight_files_are_named(tmp_path):
    """A git-lfs pointer left by a clone without git-lfs, a file cut short by an interrupted
    download, and a shard index naming absent files are ConversionErrors naming the file, not a
    MemoryError, a numpy reshape error or a FileNotFoundError from deep in the reader."""
    src = gpt2_checkpoint("gpt2_a")
    pointer = b"version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 45180\n"
    with open(os.path.join(src, "model.safetensors"), "rb") as f:
        whole = f.read()
    cases = {
        "model.safetensors": (pointer, "git-lfs pointer"),
        "pytorch_model.bin": (pointer, "git-lfs pointer"),
        "model.safetensors ": (whole[: len(whole) // 2], r"tensor '.*' .* cut short"),
        "model.safetensors  ": (whole[:4], "not a safetensors file, or cut short"),
    }
    for n, (name, (data, message)) in enumerate(cases.items()):
        directory = tmp_path / str(n)
        directory.mkdir()
        shutil.copy(os.path.join(src, "config.json"), directory / "config.json")
        (directory / name.strip()).write_bytes(data)
        with pytest.raises(ConversionError, match=rf"{name.strip()}: .*{message}"):
            load_hf_checkpoint(directory)
    directory = tmp_path / "shards"
    directory.mkdir()
    shutil.copy(os.path.join(src, "config.json"), directory / "config.json")
    shutil.copy(os.path.join(src, "model.safetensors"), directory / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"wte.weight": "model-00001-of-00002.safetensors",
                            "wpe.weight": "model-00002-of-00002.safetensors"}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConversionError, match=r"missing: \['model-00002-of-00002.safetensors'\]"):
        load_hf_checkpoint(directory)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ConversionError, match="no 'weight_map'"):
        load_hf_checkpoint(directory)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"wte.weight": 3}}))
    with pytest.raises(ConversionError, match="'weight_map' must map each tensor to a file name"):
        load_hf_checkpoint(directory)


def _safetensors_bytes(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def test_damaged_pytorch_files_and_safetensors_headers_are_named_as_such(tmp_path):
    """A .bin cut short or replaced by a web page was reported as a security refusal ("convert the
    file to safetensors if you trust it"); a safetensors header entry written wrong raised KeyError,
    TypeError or a numpy error; a config.json that is a directory, IsADirectoryError."""
    src = gpt2_checkpoint("gpt2_a")
    directory = tmp_path / "ckpt"
    directory.mkdir()
    shutil.copy(os.path.join(src, "config.json"), directory / "config.json")
    buffer = io.BytesIO()
    torch.save(hf_model(src).state_dict(), buffer)
    whole = buffer.getvalue()
    page = b"<html><body>502 Bad Gateway</body></html>"
    for data, message in ((whole[: len(whole) // 2],
                           "a zip archive without its directory at the end: cut short; download it again"),
                          (page, r"not a PyTorch weights file \(it starts with b'<htm': a web page or an "
                                 r"error message saved in its place\?\); download it again")):
        (directory / "pytorch_model.bin").write_bytes(data)
        with pytest.raises(ConversionError, match=rf"pytorch_model.bin: {message}$"):
            load_hf_checkpoint(directory)
    (directory / "pytorch_model.bin").unlink()
    for entry in ({"dtype": "F32", "shape": [3]}, [1, 2],
                  {"dtype": "F32", "shape": "3", "data_offsets": [0, 12]},
                  {"dtype": "F32", "shape": [3], "data_offsets": [-12, 0]},
                  {"dtype": "F32", "shape": [3], "data_offsets": [12, 0]}):
        (directory / "model.safetensors").write_bytes(_safetensors_bytes({"x": entry}, bytes(12)))
        with pytest.raises(ConversionError, match=r"model.safetensors: not a safetensors file, or a corrupt "
                                                  r"one: the header's entry for tensor 'x' is "):
            load_hf_checkpoint(directory)
    (directory / "model.safetensors").unlink()
    (directory / "config.json").unlink()
    (directory / "config.json").mkdir()
    with pytest.raises(ConversionError, match=r"config.json: cannot be read \(Is a directory\)"):
        load_hf_checkpoint(directory)


def test_a_tensor_of_a_dtype_numpy_lacks_is_an_error_only_if_the_model_reads_it(tmp_path, caplog):
    """One unused tensor of a valid dtype the reader lacked (U32, float8) refused the whole file."""
    from transformer_jax.convert.hf_files import Unreadable, read_safetensors

    src = gpt2_checkpoint("gpt2_a")
    _, want = load_hf_checkpoint(src)
    shutil.copy(os.path.join(src, "config.json"), tmp_path / "config.json")
    tensors = {**read_safetensors(os.path.join(src, "model.safetensors")), "step": np.array([7], np.uint32)}
    header, data = {}, b""
    for name, value in tensors.items():
        raw = np.ascontiguousarray(value).tobytes()
        header[name] = {"dtype": {"float32": "F32", "uint32": "U32"}[str(value.dtype)],
                        "shape": list(value.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    (tmp_path / "model.safetensors").write_bytes(_safetensors_bytes(header, data))
    with caplog.at_level("WARNING"):
        _, got = load_hf_checkpoint(tmp_path)
    assert "checkpoint tensors not used: ['step']" in caplog.text
    for a, b in zip(_leaves(got), _leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    (tmp_path / "model.safetensors").unlink()
    state = hf_model(src).state_dict()
    torch.save({**state, "scale": torch.ones(2).to(torch.float8_e4m3fn)}, tmp_path / "pytorch_model.bin")
    _, got = load_hf_checkpoint(tmp_path)  # unused: loads
    for a, b in zip(_leaves(got), _leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    name = next(k for k in state if k.endswith("wte.weight"))
    # a tied head stored in float8: not read (the table is), and not compared with the table either
    assert "lm_head.weight" in state
    torch.save({**state, "lm_head.weight": state[name].to(torch.float8_e4m3fn)},
               tmp_path / "pytorch_model.bin")
    _, got = load_hf_checkpoint(tmp_path)
    for a, b in zip(_leaves(got), _leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    torch.save({**state, name: state[name].to(torch.float8_e4m3fn)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ConversionError, match=rf"pytorch_model.bin: tensor '{name}' has dtype "
                                              r"torch.float8_e4m3fn, which numpy cannot hold"):
        load_hf_checkpoint(tmp_path)
    # safetensors' float8 reads through ml_dtypes, as float32 values
    (tmp_path / "pytorch_model.bin").unlink()
    header = {"x": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]},
              "y": {"dtype": "F4_E2M1", "shape": [2], "data_offsets": [2, 3]}}
    (tmp_path / "t.safetensors").write_bytes(_safetensors_bytes(header, bytes([0x38, 0xB8, 0])))
    read = read_safetensors(str(tmp_path / "t.safetensors"))
    np.testing.assert_array_equal(np.asarray(read["x"], np.float32), [1.0, -1.0])
    assert isinstance(read["y"], Unreadable)
    assert "dtype F4_E2M1, which this reader does not support" in read["y"].why


def test_misspelt_override_is_not_called_a_trained_value():
    with pytest.raises(ConversionError, match=r"\['dropuot_rate'\] is not a ModelConfig field"):
        load_hf_config(gpt2_checkpoint("gpt2_a"), dropuot_rate=0.0)


# ----------------------------------------------------------------------------- tokenizers

TEXTS = ["the cold coffee", "Hello world, hello there!", "a great cat drank", "unseen ünïcode 🙂 text"]


def test_gpt2_tokenizer_matches_transformers(tmp_path):
    import transformers

    directory = gpt2_checkpoint("gpt2_a")
    ours = load_hf_tokenizer(directory)
    fast = transformers.GPT2TokenizerFast(tokenizer_file=os.path.join(directory, "tokenizer.json"))
    # Without tokenizer.json: vocab.json + merges.txt, as the slow GPT2Tokenizer reads them.
    for name in ("vocab.json", "merges.txt", "config.json"):
        shutil.copy(os.path.join(directory, name), tmp_path / name)
    from_merges = load_hf_tokenizer(tmp_path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == fast(text).input_ids == from_merges.encode(text)
        assert ours.decode(ids) == text == from_merges.decode(ids)
    assert ours.decode(ours.encode("the cat") + [ours.eos_id]) == "the cat"
    # a token's piece as transformers writes it (the label notebook 03 plots), as data.Tokenizer has
    ids = ours.encode(" the cat")
    assert [ours.id_to_piece(i) for i in ids] == fast.convert_ids_to_tokens(ids)
    with pytest.raises(ValueError, match=r"token id 1000000 is not in the tokenizer's vocabulary"):
        ours.id_to_piece(1_000_000)


def test_marian_tokenizer_matches_transformers():
    import transformers

    directory = marian_checkpoint("marian_swish")
    ours = load_hf_tokenizer(directory)
    theirs = transformers.MarianTokenizer(
        os.path.join(directory, "source.spm"),
        os.path.join(directory, "target.spm"),
        os.path.join(directory, "vocab.json"),
    )
    # Special tokens written in the text are single tokens, and the text between them is encoded
    # piece by piece (a language code may follow one).
    written = ["the cat </s> sat", "a  </s>  b<unk>", "<pad>", "</s>>>fr<< x", "", " "]
    for text in TEXTS[:3] + [">>fr<< the cat", "zzz qqq"] + written:
        ids = theirs(text).input_ids
        assert ours.encode_source(text) == ids
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.encode("zzz")[-1] == ours.unk_id
    ids = theirs(TEXTS[0]).input_ids
    assert [ours.id_to_piece(i) for i in ids] == theirs.convert_ids_to_tokens(ids)


def test_missing_tokenizer_files_are_named(tmp_path):
    shutil.copy(os.path.join(marian_checkpoint("marian_swish"), "config.json"), tmp_path / "config.json")
    with pytest.raises(ConversionError, match=r"missing .*\['source.spm', 'target.spm', 'vocab.json'\]"):
        load_hf_tokenizer(tmp_path)


def test_marian_tokenizer_takes_special_token_names_from_its_config(tmp_path):
    """tokenizer_config.json may name the special tokens otherwise; ids, EOS and decoding then
    follow those names, as in transformers' MarianTokenizer."""
    import transformers

    src = marian_checkpoint("marian_swish")
    for name in ("source.spm", "target.spm", "config.json"):
        shutil.copy(os.path.join(src, name), tmp_path / name)
    renamed = {"</s>": "<EOS>", "<unk>": "<UNK>", "<pad>": "<PAD>"}
    with open(os.path.join(src, "vocab.json")) as f:
        vocab = {renamed.get(k, k): v for k, v in json.load(f).items()}
    with open(tmp_path / "vocab.json", "w") as f:
        json.dump(vocab, f)
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump({"tokenizer_class": "MarianTokenizer", "separate_vocabs": False, "eos_token": "<EOS>",
                   "unk_token": "<UNK>", "pad_token": "<PAD>"}, f)
    ours = load_hf_tokenizer(tmp_path)
    theirs = transformers.MarianTokenizer.from_pretrained(str(tmp_path))
    assert (ours.eos_id, ours.unk_id, ours.pad_id) == (
        theirs.eos_token_id, theirs.unk_token_id, theirs.pad_token_id) == (0, 1, len(vocab) - 1)
    for text in ("the cold coffee", "zzz qqq", "the <EOS> cat</s>"):
        ids = theirs(text).input_ids
        assert ours.encode_source(text) == ids
        padded = ids + [theirs.pad_token_id] * 2
        assert ours.decode(padded) == theirs.decode(padded, skip_special_tokens=True)


def test_tokenizer_of_another_model_is_refused():
    """Tokenizer files whose ids run past config.json's vocab_size belong to another model: a
    jitted embedding lookup would not refuse those ids (transformers' would), so the outputs
    would be silently wrong."""
    for src in (gpt2_checkpoint("gpt2_a"), marian_checkpoint("marian_swish")):
        directory = _copy_checkpoint(src, lambda c: c.update(vocab_size=40))
        with pytest.raises(ConversionError, match=r"token ids up to \d+, but config.json has vocab_size=40"):
            load_hf_tokenizer(directory)


def test_gpt2_tokenizer_from_merges_keeps_endoftext_one_token(tmp_path):
    """From vocab.json + merges.txt, '<|endoftext|>' inside a text is the EOS token, as in
    transformers' GPT2Tokenizer (and in tokenizer.json), not seven byte-level pieces."""
    import transformers

    directory = gpt2_checkpoint("gpt2_a")
    for name in ("vocab.json", "merges.txt", "config.json"):
        shutil.copy(os.path.join(directory, name), tmp_path / name)
    ours = load_hf_tokenizer(tmp_path)
    slow = transformers.GPT2Tokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    text = "the cat<|endoftext|>the dog"
    assert ours.encode(text) == slow(text).input_ids == load_hf_tokenizer(directory).encode(text)
    assert ours.eos_id in ours.encode(text)
    # config.json's eos_token_id null (transformers writes unset ids so): GPT2Tokenizer's own
    # '<|endoftext|>' still, where it was split into byte pieces; a list there is named as such.
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": None}))
    assert load_hf_tokenizer(tmp_path).encode(text) == slow(text).input_ids
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": [0, 1]}))
    with pytest.raises(ConversionError, match=r"config.json: eos_token_id=\[0, 1\] is not a token id"):
        load_hf_tokenizer(tmp_path)
