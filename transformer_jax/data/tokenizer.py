"""SentencePiece tokenizers (BPE or unigram) that round-trip any text exactly.

The special ids are fixed for the whole project (see ``ModelConfig.pad_id`` etc.)::

    PAD_ID = 0   padding, never predicted (loss weight 0)
    EOS_ID = 1   ends every source and target example
    BOS_ID = 2   decoder start token (inserted by ``shift_right``, never stored in data)
    UNK_ID = 3   unused in practice: byte fallback spells any unknown character as UTF-8 bytes

Training settings chosen so that ``decode(encode(text)) == text`` for every valid Unicode string:
``normalization_rule_name="identity"`` (no NFKC), ``remove_extra_whitespaces=False`` (keeps
runs of spaces, leading and trailing spaces) and ``byte_fallback=True`` (no ``<unk>``). The one
character SentencePiece cannot keep is U+2581 (``▁``), its own internal spelling of a space;
:meth:`Tokenizer.encode` spells it with byte pieces instead (see ``_encode_one``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import sentencepiece as spm
from absl import logging

from transformer_jax.data.errors import DataError

PAD_ID = 0
EOS_ID = 1
BOS_ID = 2
UNK_ID = 3

MODEL_FILENAME = "tokenizer.model"
METADATA_FILENAME = "tokenizer.json"
# training/checkpoint.py's CHECKPOINT_DIRNAME (data/ does not import training/).
CHECKPOINT_DIRNAME = "checkpoints"

# SentencePiece's meta symbol for a space. Literal occurrences in the input are spelled with byte
# pieces so that they do not come back as spaces.
_SPACE_SYMBOL = "\u2581"
# 256 byte-fallback pieces, the 4 special ids and room for a few merges.
MIN_VOCAB_SIZE = 300
TOKENIZER_TYPES = ("bpe", "unigram")
# Bumped whenever the training settings below change, so that cached tokenizers are retrained.
_SETTINGS_VERSION = 1


@dataclasses.dataclass(frozen=True)
class TokenizerSettings:
    """What determines a trained tokenizer (besides the corpus)."""

    vocab_size: int = 8000
    model_type: str = "bpe"  # 'bpe' | 'unigram'
    max_training_chars: int = 20_000_000
    max_sentence_chars: int = 4096

    def __post_init__(self):
        if self.model_type not in TOKENIZER_TYPES:
            raise DataError(f"tokenizer model_type must be 'bpe' or 'unigram', got "
                            f"{self.model_type!r}")
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise DataError(f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 byte pieces + specials), "
                            f"got {self.vocab_size}")


class Tokenizer:
    """A SentencePiece model with the project's fixed special ids.

    ``encode`` returns plain token ids (no EOS/BOS); the pipeline appends ``EOS_ID`` itself.
    """

    def __init__(self, model_proto: bytes):
        self._proto = bytes(model_proto)
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=self._proto)
        except RuntimeError as e:  # the protobuf does not parse
            raise DataError(f"not a SentencePiece model ({str(e).strip()})") from e
        if self._sp.get_piece_size() == 0:  # an empty file parses as an empty model
            raise DataError("not a SentencePiece model (empty, no pieces)")
        self._sp_no_prefix = None  # built lazily, only needed for text containing U+2581
        ids = (self._sp.pad_id(), self._sp.eos_id(), self._sp.bos_id(), self._sp.unk_id())
        if ids != (PAD_ID, EOS_ID, BOS_ID, UNK_ID):
            raise DataError(f"SentencePiece model has special ids (pad, eos, bos, unk)={ids}, "
                            f"expected {(PAD_ID, EOS_ID, BOS_ID, UNK_ID)} (as Tokenizer.train sets them)")
        self._space_bytes = [self._sp.piece_to_id(f"<0x{b:02X}>")
                             for b in _SPACE_SYMBOL.encode("utf-8")]

    def __getstate__(self):  # picklable, for grain worker processes
        return {"model_proto": self._proto}

    def __setstate__(self, state):
        self.__init__(state["model_proto"])

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """Reads a model file; a :class:`DataError` naming ``path`` if it is not a usable one."""
        with open(path, "rb") as f:
            proto = f.read()
        try:
            return cls(proto)
        except DataError as e:
            raise DataError(
                f"Cannot use tokenizer {os.fspath(path)}: {e}. Put back the tokenizer.model the "
                f"run was trained with; in a workdir without checkpoints you may instead delete it "
                f"and {METADATA_FILENAME} so that training writes a new one.") from e

    def save(self, path: str | os.PathLike) -> None:
        _atomic_write(path, self._proto)

    @classmethod
    def train(cls, texts: Iterable[str], settings: TokenizerSettings) -> Tokenizer:
        """Trains a tokenizer on ``texts`` (any iterable of strings; long ones are cut)."""
        sentences = list(_training_sentences(texts, settings))
        if not sentences:
            raise DataError("no text to train the tokenizer on")
        # Every character seen gets its own piece (coverage 1.0) unless there are too many for
        # the vocabulary; then the rarest are left to byte fallback, which still spells them.
        # SentencePiece takes no coverage below 0.98.
        coverages = (1.0, 0.9999, 0.9995, 0.999, 0.995, 0.99, 0.98)
        for coverage in coverages:
            buf = io.BytesIO()
            try:
                _train(sentences, buf, settings, coverage)
                break
            except RuntimeError as e:
                if "required_chars" not in str(e):
                    raise
                if coverage == coverages[-1]:
                    found = re.search(r"required_chars\. \d+ vs (\d+)", str(e))
                    need = f"{found.group(1)} pieces" if found else f"more pieces ({str(e).strip()})"
                    raise DataError(
                        f"vocab_size={settings.vocab_size} is too small for this text: the characters "
                        f"that make up {coverage:.0%} of it need {need} with the special tokens; raise "
                        f"dataset.vocab_size") from e
        return cls(buf.getvalue())

    # -- properties ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def model_proto(self) -> bytes:
        return self._proto

    def id_to_piece(self, token_id: int) -> str:
        return self._sp.id_to_piece(int(token_id))

    # -- encode / decode ----------------------------------------------------------------------

    def encode(self, text: str | bytes) -> list[int]:
        """Text (str, or bytes decoded as UTF-8 with replacement) -> token ids, no EOS/BOS."""
        return self._encode_one(_as_text(text))

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[list[int]]:
        texts = [_as_text(t) for t in texts]
        if any(_SPACE_SYMBOL in t for t in texts):
            return [self._encode_one(t) for t in texts]
        return self._sp.encode(texts)

    def decode(self, ids: Iterable[int]) -> str:
        """Token ids -> text. PAD/EOS/BOS and out-of-range ids are dropped; stops at nothing."""
        return self._sp.decode(self._clean(ids))

    def decode_batch(self, batch: Iterable[Iterable[int]]) -> list[str]:
        batch = [self._clean(ids) for ids in batch]
        return self._sp.decode(batch) if batch else []  # (SentencePiece decodes [] to '')

    def _clean(self, ids: Iterable[int]) -> list[int]:
        n = self.vocab_size
        return [int(i) for i in ids if UNK_ID <= int(i) < n]

    def _encode_one(self, text: str) -> list[int]:
        if _SPACE_SYMBOL not in text:
            return self._sp.encode(text)
        # Encode the pieces between literal U+2581 separately and join them with the byte
        # pieces of U+2581. Later pieces must not get the dummy-prefix space.
        if self._sp_no_prefix is None:
            from sentencepiece import sentencepiece_model_pb2

            proto = sentencepiece_model_pb2.ModelProto()
            proto.ParseFromString(self._proto)
            proto.normalizer_spec.add_dummy_prefix = False
            self._sp_no_prefix = spm.SentencePieceProcessor(
                model_proto=proto.SerializeToString())
        first, *rest = text.split(_SPACE_SYMBOL)
        ids = self._sp.encode(first) if first else []
        for part in rest:
            ids += self._space_bytes
            ids += self._sp_no_prefix.encode(part) if part else []
        return ids


def _train(sentences, buf, settings: TokenizerSettings, coverage: float) -> None:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=buf,
        model_type=settings.model_type,
        vocab_size=settings.vocab_size,
        # A small corpus may not support the requested size; take what it has.
        hard_vocab_limit=False,
        character_coverage=coverage,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        byte_fallback=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        max_sentence_length=settings.max_sentence_chars * 4,
        pad_id=PAD_ID, eos_id=EOS_ID, bos_id=BOS_ID, unk_id=UNK_ID,
        pad_piece="<pad>", eos_piece="</s>", bos_piece="<s>", unk_piece="<unk>",
        num_threads=max(1, os.cpu_count() or 1),
        minloglevel=2,
    )


def _as_text(text: str | bytes) -> str:
    if isinstance(text, bytes | bytearray | memoryview):
        return bytes(text).decode("utf-8", errors="replace")
    # Lone surrogates cannot be written as UTF-8; spell them as U+FFFD.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text)
    return text


def training_lines(text: str | bytes, max_sentence_chars: int = TokenizerSettings.max_sentence_chars
                   ) -> Iterator[str]:
    """The sentences tokenizer training takes from one text: its non-blank lines, each cut to
    ``max_sentence_chars`` (long lines are cut, not skipped)."""
    for line in _as_text(text).split("\n"):
        if line.strip():
            yield line[:max_sentence_chars]


def _training_sentences(texts: Iterable[str], settings: TokenizerSettings) -> Iterator[str]:
    budget = settings.max_training_chars
    for text in texts:
        for line in training_lines(text, settings.max_sentence_chars):  # SentencePiece's sentences
            budget -= len(line)
            yield line
            if budget <= 0:
                return


def _atomic_write(path: str | os.PathLike, data: bytes) -> None:
    """Writes ``data`` to a temporary file beside ``path`` and renames it into place; a file-system
    failure (a full disk, no permission) is a DataError naming the file, with nothing left behind."""
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    tmp = None
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-" + os.path.basename(path))
        # mkstemp's file is the owner's alone (0600): as open() would make it, so that whoever
        # may read the rest of the workdir may read the tokenizer too
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, OSError):
            raise DataError(f"Could not write {path}: {e.strerror or e}. Free space (or fix permissions) "
                            f"and rerun") from e
        raise


def _metadata(corpus_key: str, settings: TokenizerSettings) -> dict:
    return {"corpus_key": corpus_key, "settings_version": _SETTINGS_VERSION,
            **dataclasses.asdict(settings)}


def _read_metadata(meta_path: str) -> dict | None:
    """``tokenizer.json``'s record, or None where it is missing or unreadable (not JSON, or JSON
    that is not an object: `null`, a list, a string)."""
    try:
        with open(meta_path) as f:
            stored = json.load(f)
    except (OSError, ValueError):
        return None
    return stored if isinstance(stored, dict) else None


def _matching_model(workdir: str, metadata: dict) -> Tokenizer | None:
    model_path = os.path.join(workdir, MODEL_FILENAME)
    stored = _read_metadata(os.path.join(workdir, METADATA_FILENAME))
    if stored is None or stored.get("settings") != metadata:
        return None
    try:
        tok = Tokenizer.load(model_path)
    except (OSError, ValueError, RuntimeError):
        return None
    digest = hashlib.sha256(tok.model_proto).hexdigest()
    return tok if stored.get("model_sha256") == digest else None


def recorded_model_differs(workdir: str | os.PathLike, tok: Tokenizer) -> str | None:
    """The path of ``workdir/tokenizer.json`` when the SHA-256 recorded there (as training wrote it
    with the tokenizer) is not ``tok``'s, else None (the same, or nothing readable recorded)."""
    meta_path = os.path.join(workdir, METADATA_FILENAME)
    recorded = (_read_metadata(meta_path) or {}).get("model_sha256")
    if recorded is None or recorded == hashlib.sha256(tok.model_proto).hexdigest():
        return None
    return meta_path


def _has_checkpoints(workdir: str | os.PathLike) -> bool:
    """Whether ``workdir/checkpoints`` holds a committed training step.

    training/checkpoint.py keeps orbax steps as ``DIR/checkpoints/<step>/``; a save in progress
    (``<step>.orbax-checkpoint-tmp-*``) does not count.
    """
    try:
        with os.scandir(os.path.join(workdir, CHECKPOINT_DIRNAME)) as entries:
            return any(e.name.isdigit() and e.is_dir() for e in entries)
    except OSError:  # no such directory
        return False


# The training config's names of the settings (what a user sets back), for the messages.
_SETTING_KEYS = {"vocab_size": "dataset.vocab_size", "model_type": "dataset.tokenizer_type",
                 "max_training_chars": "dataset.tokenizer_max_chars"}


def _checkpointed_model(workdir: str, metadata: dict) -> Tokenizer:
    """The workdir's tokenizer, which its checkpoints were trained with; never retrained.

    A :class:`DataError` if the corpus or settings recorded with it differ from ``metadata``
    (retraining would silently change the vocabulary under the checkpoints).
    """
    model_path = os.path.join(workdir, MODEL_FILENAME)
    meta_path = os.path.join(workdir, METADATA_FILENAME)
    tok = Tokenizer.load(model_path)
    stored = _read_metadata(meta_path)
    if stored is None:
        logging.warning("Using %s as it is (no readable %s): %s has checkpoints, so it is not "
                        "retrained.", model_path, METADATA_FILENAME, workdir)
        return tok
    fresh = f"use a fresh workdir, or delete {workdir}/{CHECKPOINT_DIRNAME} to start over"
    if stored.get("model_sha256") != hashlib.sha256(tok.model_proto).hexdigest():
        raise DataError(
            f"{model_path} is not the tokenizer recorded in {meta_path} (sha256 differs), and "
            f"{workdir} has checkpoints, so it is unknown which vocabulary they were trained "
            f"with. Put back the tokenizer.model the run was trained with, or {fresh}.")
    old = stored.get("settings") if isinstance(stored.get("settings"), dict) else {}
    # settings_version alone changes with the library, not the data: keep the tokenizer.
    changed = [f"{_SETTING_KEYS.get(k, k)} {old.get(k)!r} (tokenizer) -> {v!r} (now)"
               for k, v in metadata.items()
               if k not in ("settings_version", "corpus_key") and old.get(k) != v]
    if changed:
        raise DataError(
            f"{workdir} has checkpoints trained with its {MODEL_FILENAME}, but the tokenizer "
            f"settings have changed since it was trained: {'; '.join(changed)}. Retraining it "
            f"would change the vocabulary under the checkpoints, so it is kept and training "
            f"stops here. To resume, set the tokenizer settings the run was started with; to "
            f"train with the new ones, {fresh}.")
    if old.get("corpus_key") != metadata["corpus_key"]:
        # The data changed (new files, or edited ones: the key names the build, a hash of the
        # files' contents). The checkpoints' vocabulary still applies to any text: keep it,
        # as a fixed tokenizer file would be kept.
        logging.warning(
            "The training data of %s changed since its tokenizer was trained (corpus key %r -> "
            "%r); keeping %s, which its checkpoints were trained with. A resumed input pipeline "
            "starts at the position saved for the data it read then (config.resume_data_position"
            "=False starts it afresh on this data).", workdir,
            old.get("corpus_key"), metadata["corpus_key"], model_path)
    return tok


def get_or_train_tokenizer(
    workdir: str | os.PathLike,
    corpus_key: str,
    texts_fn: Callable[[], Iterable[str]],
    vocab_size: int = 8000,
    model_type: str = "bpe",
    *,
    process_index: int | None = None,
    wait_timeout_s: float = 1800.0,
    max_training_chars: int = 20_000_000,
) -> Tokenizer:
    """Loads ``workdir/tokenizer.model`` if it was trained on the same corpus and settings.

    Once the workdir has checkpoints (see :func:`_has_checkpoints`) its tokenizer is never
    retrained: it is kept when the corpus changed (with a warning), and different settings are a
    :class:`DataError` naming the old and new values.
    Otherwise process 0 trains one on ``texts_fn()`` and writes the model, then
    ``tokenizer.json`` (the corpus key, the settings and the model's sha256) last, each by atomic
    rename; ``tokenizer.json`` is the commit marker. Other processes wait until a matching
    ``tokenizer.json`` and model appear, so the workdir must be on a filesystem all hosts share.
    """
    workdir = os.fspath(workdir)
    settings = TokenizerSettings(vocab_size=vocab_size, model_type=model_type,
                                 max_training_chars=max_training_chars)
    metadata = _metadata(corpus_key, settings)
    tok = _matching_model(workdir, metadata)
    if tok is not None:
        logging.info("Reusing tokenizer %s (corpus %s).", workdir, corpus_key)
        return tok
    if _has_checkpoints(workdir):
        if os.path.exists(os.path.join(workdir, MODEL_FILENAME)):
            return _checkpointed_model(workdir, metadata)
        logging.warning("%s has checkpoints but no %s: training a new tokenizer. If the "
                        "checkpoints were trained with another one, put it back.", workdir,
                        MODEL_FILENAME)
    if process_index is None:
        import jax

        process_index = jax.process_index()
    if process_index != 0:
        return _wait_for_tokenizer(workdir, metadata, wait_timeout_s)

    start = time.time()
    tok = Tokenizer.train(texts_fn(), settings)
    logging.info("Trained %s tokenizer for %s: %d pieces in %.1f s.", model_type, corpus_key,
                 tok.vocab_size, time.time() - start)
    if tok.vocab_size < vocab_size:  # the text holds no more pieces (hard_vocab_limit=False)
        # (the advice never below the smallest vocab_size the settings take, which it named before)
        fewest = max(tok.vocab_size, MIN_VOCAB_SIZE)
        advice = ("to leave them out" if fewest == tok.vocab_size else
                  f"to leave out most of them ({MIN_VOCAB_SIZE} is the smallest dataset.vocab_size)")
        if fewest < vocab_size:
            logging.warning("The tokenizer has %d pieces, fewer than dataset.vocab_size=%d: the text "
                            "holds no more to learn. Rows of the model's embedding table past %d are "
                            "never used (%s, set dataset.vocab_size and model.vocab_size to %d before "
                            "the workdir holds checkpoints).",
                            tok.vocab_size, vocab_size, tok.vocab_size, advice, fewest)
        else:
            logging.warning("The tokenizer has %d pieces, fewer than dataset.vocab_size=%d (the "
                            "smallest it takes): the text holds no more to learn. Rows of the model's "
                            "embedding table past %d are never used.", tok.vocab_size, vocab_size,
                            tok.vocab_size)
    model_path = os.path.join(workdir, MODEL_FILENAME)
    if os.path.exists(model_path):  # not this corpus's and settings' (else it was reused above)
        logging.warning("Replaced %s by a tokenizer trained now: %s does not record it as trained on "
                        "this data with these settings, and %s has no checkpoints yet", model_path,
                        METADATA_FILENAME, workdir)
    tok.save(model_path)
    record = {"settings": metadata, "vocab_size": tok.vocab_size,
              "model_sha256": hashlib.sha256(tok.model_proto).hexdigest()}
    _atomic_write(os.path.join(workdir, METADATA_FILENAME),
                  json.dumps(record, indent=2).encode())
    return tok


def _wait_for_tokenizer(workdir: str, metadata: dict, timeout_s: float) -> Tokenizer:
    deadline = time.time() + timeout_s
    delay = 0.05
    while time.time() < deadline:
        tok = _matching_model(workdir, metadata)
        if tok is not None:
            return tok
        time.sleep(delay)
        delay = min(2.0, delay * 1.5)
    raise TimeoutError(
        f"Waited {timeout_s:.0f} s for process 0 to write {workdir}/{MODEL_FILENAME} "
        f"for corpus {metadata['corpus_key']!r}. The workdir must be shared by all hosts.")
