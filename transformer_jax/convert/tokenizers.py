"""Tokenizers stored beside a Hugging Face checkpoint, without the transformers library.

* GPT-2: byte-level BPE, from tokenizer.json or vocab.json + merges.txt (the ``tokenizers`` package).
* Marian: SentencePiece models source.spm / target.spm whose pieces are mapped to model ids by
  vocab.json (the ``sentencepiece`` package). The source side is encoded with source.spm, model
  output decoded with target.spm, as ``MarianTokenizer`` does. (``MarianTokenizer`` also applies
  Moses punctuation normalisation when sacremoses is installed; we do not.)

Both give ``encode(text) -> ids`` without special tokens and ``decode(ids) -> text`` without them;
the caller appends EOS to Marian sources (see `HFTokenizer.encode_source`).
"""

from __future__ import annotations

import os
import re

from transformer_jax.config import first_line
from transformer_jax.convert.hf_files import ConversionError, read_config, read_json, require


class HFTokenizer:
    """Common surface of the checkpoint tokenizers (the same methods as `data.Tokenizer`)."""

    eos_id: int | None = None
    special_ids: frozenset = frozenset()

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def max_id(self) -> int:
        """The largest token id the tokenizer can produce."""
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def id_to_piece(self, token_id: int) -> str:
        """The token's piece as the tokenizer writes it (GPT-2: 'Ġ' for a leading space; Marian:
        '▁'); a label for one token, which ``decode([id])`` may strip to nothing."""
        raise NotImplementedError

    def encode_source(self, text: str) -> list[int]:
        """Encoder input: the text's ids followed by EOS."""
        return self.encode(text) + ([] if self.eos_id is None else [self.eos_id])

    def encode_batch(self, texts) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode_batch(self, batch) -> list[str]:
        return [self.decode(ids) for ids in batch]


class ByteLevelBPETokenizer(HFTokenizer):
    """GPT-2's byte-level BPE: any text round-trips (decode(encode(t)) == t)."""

    def __init__(self, tokenizer, eos_id: int | None):
        self._tok = tokenizer
        self.eos_id = eos_id
        self.special_ids = frozenset({eos_id} - {None})

    @classmethod
    def from_directory(cls, directory: str, eos_id: int | None = None) -> ByteLevelBPETokenizer:
        tokenizers = require("tokenizers")
        path = os.path.join(directory, "tokenizer.json")
        if os.path.exists(path):
            try:
                return cls(tokenizers.Tokenizer.from_file(path), eos_id)
            except Exception as e:  # noqa: BLE001 (the tokenizers library raises a bare Exception)
                raise ConversionError(f"{path} is not a readable tokenizer ({first_line(e)})") from e
        vocab, merges = (os.path.join(directory, n) for n in ("vocab.json", "merges.txt"))
        if not (os.path.exists(vocab) and os.path.exists(merges)):
            raise ConversionError(
                f"no tokenizer in {directory!r}: expected tokenizer.json or vocab.json + merges.txt"
            )
        from tokenizers import decoders, models, pre_tokenizers

        try:
            tok = tokenizers.Tokenizer(models.BPE.from_file(vocab, merges))
        except Exception as e:  # noqa: BLE001 (as above)
            raise ConversionError(f"{vocab} and {merges} are not a readable BPE vocabulary "
                                  f"({first_line(e)})") from e
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        if eos_id is None:  # config.json leaves it null: GPT2Tokenizer's own EOS, where the vocabulary has it
            eos_id = tok.token_to_id("<|endoftext|>")
        eos = tok.id_to_token(eos_id) if eos_id is not None else None
        if eos is not None:  # '<|endoftext|>' in a text is one token, as GPT2Tokenizer reads it
            tok.add_special_tokens([eos])
        return cls(tok, eos_id)

    @property
    def max_id(self) -> int:
        return max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def id_to_piece(self, token_id: int) -> str:
        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            raise ValueError(f"token id {token_id} is not in the tokenizer's vocabulary")
        return piece

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids if int(i) not in self.special_ids]
        return self._tok.decode(ids, skip_special_tokens=True)


class MarianSentencePieceTokenizer(HFTokenizer):
    """source.spm / target.spm pieces <-> ids of vocab.json (pieces missing from it are <unk>).

    A leading language code such as ``>>fr<<`` (multilingual opus-mt models) is one token, and so is
    each special token written out in the text (``</s>``, ``<unk>``, ``<pad>``), as in transformers'
    MarianTokenizer: the text is split at them and each piece between is encoded on its own.
    """

    def __init__(
        self, source_spm: str, target_spm: str, vocab: dict[str, int], *, eos="</s>", unk="<unk>", pad="<pad>"
    ):
        spm = require("sentencepiece")
        try:
            self._source = spm.SentencePieceProcessor(model_file=source_spm)
            self._target = spm.SentencePieceProcessor(model_file=target_spm)
        except (RuntimeError, OSError) as e:
            raise ConversionError(f"{source_spm} or {target_spm} is not a readable SentencePiece model "
                                  f"({first_line(e)})") from e
        if unk not in vocab:
            raise ConversionError(f"vocab.json has no {unk!r} entry")
        self._vocab = dict(vocab)
        self._pieces = {i: p for p, i in vocab.items()}
        self.unk_id = vocab[unk]
        self.eos_id = vocab.get(eos)
        self.pad_id = vocab.get(pad)
        self.special_ids = frozenset({self.eos_id, self.pad_id, self.unk_id} - {None})
        written = sorted({t for t in (eos, unk, pad) if t in vocab}, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, written)) + ")")

    @classmethod
    def from_directory(cls, directory: str) -> MarianSentencePieceTokenizer:
        paths = {n: os.path.join(directory, n) for n in ("source.spm", "target.spm", "vocab.json")}
        missing = [n for n, p in paths.items() if not os.path.exists(p)]
        if missing:
            raise ConversionError(f"Marian tokenizer files missing from {directory!r}: {missing}")
        options = {}
        if os.path.exists(os.path.join(directory, "tokenizer_config.json")):
            options = read_json(os.path.join(directory, "tokenizer_config.json"))
        if options.get("separate_vocabs"):
            raise ConversionError(
                "Marian tokenizers with separate source/target vocabularies are not supported"
            )
        names = {
            k: options[f"{k}_token"]
            for k in ("eos", "unk", "pad")
            if isinstance(options.get(f"{k}_token"), str)
        }
        return cls(paths["source.spm"], paths["target.spm"], read_json(paths["vocab.json"]), **names)

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def id_to_piece(self, token_id: int) -> str:
        if int(token_id) not in self._pieces:
            raise ValueError(f"token id {token_id} is not in vocab.json")
        return self._pieces[int(token_id)]

    @property
    def max_id(self) -> int:
        return max(self._vocab.values(), default=-1)

    def encode(self, text: str) -> list[int]:
        ids = []
        for i, part in enumerate(self._split.split(text)):
            if i % 2:  # a special token written out
                ids.append(self._vocab[part])
            elif part:
                ids.extend(self._encode_plain(part))
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        code = []
        if text.startswith(">>") and (end := text.find("<<")) != -1:
            code, text = [text[: end + 2]], text[end + 2 :]
        pieces = code + self._source.encode(text, out_type=str)
        return [self._vocab.get(p, self.unk_id) for p in pieces]

    def decode(self, ids) -> str:
        pieces = [
            self._pieces[int(i)] for i in ids if int(i) not in self.special_ids and int(i) in self._pieces
        ]
        return self._target.decode_pieces(pieces).replace("\u2581", " ").strip()


def load_hf_tokenizer(path: str | os.PathLike) -> HFTokenizer:
    """The tokenizer stored with a GPT-2 or Marian checkpoint (dispatch on config.json's
    model_type; a directory without config.json is tried as GPT-2-style BPE files)."""
    directory = os.fspath(path)
    model_type = "gpt2"
    config = {}
    if os.path.exists(os.path.join(directory, "config.json")):
        config = read_config(directory)
        model_type = config.get("model_type")
    if model_type == "gpt2":
        eos_id = config.get("eos_token_id")
        if eos_id is not None and (isinstance(eos_id, bool) or not isinstance(eos_id, int)):
            raise ConversionError(f"{os.path.join(directory, 'config.json')}: eos_token_id={eos_id!r} is not "
                                  f"a token id (an integer, or null)")
        tokenizer = ByteLevelBPETokenizer.from_directory(directory, eos_id)
    elif model_type == "marian":
        tokenizer = MarianSentencePieceTokenizer.from_directory(directory)
    else:
        raise ConversionError(
            f"{directory}: no tokenizer for model_type {model_type!r}; supported: ['gpt2', 'marian']"
        )
    # Tokenizer files of another model give ids past the embedding table, which a jitted lookup
    # does not refuse (it reads NaN or a clamped row): the output would be silently wrong.
    vocab_size = config.get("vocab_size")
    if isinstance(vocab_size, int) and tokenizer.max_id >= vocab_size:
        raise ConversionError(
            f"{directory}: the tokenizer files give token ids up to {tokenizer.max_id}, but config.json "
            f"has vocab_size={vocab_size}: they belong to another model"
        )
    return tokenizer
