"""Tiny, randomly initialised Hugging Face checkpoints (with tokenizers) written to temporary
directories, shared by test_convert.py and test_generate_cli.py. No network: models are built
from configs, tokenizers trained on a few sentences here."""

from __future__ import annotations

import atexit
import functools
import io
import json
import os
import shutil
import tempfile

CORPUS = [
    "the tired engineer drank the cold coffee",
    "your cat is a great cat",
    "hello world, hello there!",
    "a box of chocolates on the table",
] * 10

# Two shapes per architecture: different head counts and head sizes, tied and untied heads,
# Marian with swish and relu, shared and separate embeddings.
GPT2_CONFIGS = {
    "gpt2_a": dict(n_embd=24, n_head=3, n_layer=2, n_positions=64),
    "gpt2_b": dict(
        n_embd=32,
        n_head=8,
        n_layer=3,
        n_positions=48,
        n_inner=40,
        tie_word_embeddings=False,
        activation_function="gelu",
        resid_pdrop=0.1,
        attn_pdrop=0.05,
        embd_pdrop=0.2,
    ),
}
MARIAN_CONFIGS = {
    "marian_swish": dict(
        d_model=24,
        encoder_attention_heads=3,
        decoder_attention_heads=3,
        encoder_layers=2,
        decoder_layers=2,
        encoder_ffn_dim=40,
        decoder_ffn_dim=40,
        activation_function="swish",
        scale_embedding=True,
    ),
    "marian_relu": dict(
        d_model=32,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_layers=1,
        decoder_layers=3,
        encoder_ffn_dim=24,
        decoder_ffn_dim=24,
        activation_function="relu",
        scale_embedding=False,
        share_encoder_decoder_embeddings=False,
    ),
    # Shared encoder/decoder embeddings in config.json, but with untied output embeddings
    # transformers saves separate per-stack tables that differ from `shared`.
    "marian_untied_output": dict(
        d_model=16,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_layers=1,
        decoder_layers=1,
        encoder_ffn_dim=24,
        decoder_ffn_dim=24,
        activation_function="gelu",
        scale_embedding=True,
        tie_word_embeddings=False,
    ),
}


_SCRATCH: list[str] = []


def scratch_directory() -> str:
    """A new directory under one per-process root that is removed when the process exits (the
    fixtures are cached across tests, so pytest's per-test tmp_path would not outlive them)."""
    if not _SCRATCH:
        _SCRATCH.append(tempfile.mkdtemp(prefix="tj_convert_"))
        atexit.register(shutil.rmtree, _SCRATCH[0], True)
    return tempfile.mkdtemp(dir=_SCRATCH[0])


def write_bpe_tokenizer(directory: str) -> int:
    """A byte-level BPE (GPT-2 style) as tokenizer.json + vocab.json + merges.txt; returns the
    id of <|endoftext|>."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(
        CORPUS, vocab_size=300, min_frequency=1, special_tokens=["<|endoftext|>"], show_progress=False
    )
    tok.save_model(directory)
    tok.save(os.path.join(directory, "tokenizer.json"))
    return tok.token_to_id("<|endoftext|>")


def write_marian_tokenizer(directory: str) -> dict[str, int]:
    """source.spm / target.spm (tiny unigram models) and a vocab.json in Marian's id order
    (</s> = 0, <unk> = 1, pieces, <pad> last); returns the vocabulary."""
    import sentencepiece as spm

    models = []
    for corpus in (CORPUS, [s.upper() for s in CORPUS]):
        buf = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(corpus),
            model_writer=buf,
            vocab_size=30,
            hard_vocab_limit=False,
            minloglevel=2,
        )
        models.append(buf.getvalue())
    for name, proto in zip(("source.spm", "target.spm"), models, strict=True):
        with open(os.path.join(directory, name), "wb") as f:
            f.write(proto)
    vocab = {"</s>": 0, "<unk>": 1}
    for proto in models:
        sp = spm.SentencePieceProcessor(model_proto=proto)
        for i in range(sp.get_piece_size()):
            if not sp.is_control(i) and not sp.is_unknown(i):
                vocab.setdefault(sp.id_to_piece(i), len(vocab))
    vocab[">>fr<<"] = len(vocab)
    vocab["<pad>"] = len(vocab)
    with open(os.path.join(directory, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "MarianTokenizer", "separate_vocabs": False}, f)
    return vocab


def _spread(model, torch) -> None:
    """Larger weights than the default init (and non-zero biases), so greedy paths vary."""
    for name, p in model.named_parameters():
        if "embed_positions" in name:  # Marian's fixed sinusoids: not saved, recomputed on load
            continue
        p.mul_(4.0) if p.ndim == 2 else p.add_(0.1 * torch.randn_like(p))


@functools.cache
def gpt2_checkpoint(name: str, safe_serialization: bool = True) -> str:
    """A saved random GPT2LMHeadModel with a BPE tokenizer; returns its directory."""
    import torch
    import transformers

    directory = scratch_directory()
    eos = write_bpe_tokenizer(directory)
    config = transformers.GPT2Config(vocab_size=300, bos_token_id=eos, eos_token_id=eos, **GPT2_CONFIGS[name])
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        _spread(model, torch)
    model.save_pretrained(directory, safe_serialization=safe_serialization)
    return directory


@functools.cache
def marian_checkpoint(name: str) -> str:
    """A saved random MarianMTModel (non-zero final_logits_bias) with its tokenizer files."""
    import torch
    import transformers

    directory = scratch_directory()
    vocab = write_marian_tokenizer(directory)
    pad = vocab["<pad>"]
    config = transformers.MarianConfig(
        vocab_size=len(vocab),
        pad_token_id=pad,
        decoder_start_token_id=pad,
        eos_token_id=0,
        forced_eos_token_id=None,
        max_position_embeddings=64,
        **MARIAN_CONFIGS[name],
    )
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.MarianMTModel(config).eval()
    with torch.no_grad():
        _spread(model, torch)
        model.final_logits_bias.normal_()
    model.save_pretrained(directory)
    return directory


def hf_model(directory: str):
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory)
    cls = transformers.MarianMTModel if config.model_type == "marian" else transformers.GPT2LMHeadModel
    return cls.from_pretrained(directory).eval()
