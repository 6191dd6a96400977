"""Reading a local Hugging Face model directory: config.json and the weight files.

Weights come from ``model.safetensors`` (or a sharded ``model.safetensors.index.json``), read here
with numpy alone: the format is an 8-byte little-endian header size, a JSON header of
{name: {dtype, shape, data_offsets}}, then the raw bytes. ``pytorch_model.bin`` is read only
through ``torch.load(weights_only=True)``, which refuses any pickle that would run code.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping

import numpy as np

CONFIG_FILENAME = "config.json"
GENERATION_CONFIG_FILENAME = "generation_config.json"
SAFETENSORS_FILENAME = "model.safetensors"
SAFETENSORS_INDEX_FILENAME = "model.safetensors.index.json"
TORCH_FILENAME = "pytorch_model.bin"
TORCH_INDEX_FILENAME = "pytorch_model.bin.index.json"


class ConversionError(ValueError):
    """A checkpoint cannot be loaded: missing files, unsupported options, missing or mis-shaped
    tensors. The message names the file, option or tensor."""


def require(module: str, package: str | None = None):
    """Imports an optional dependency, or fails with the command that installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConversionError(
            f"this needs the optional package {package or module!r}: pip install {package or module}"
        ) from e


def read_json(path: str) -> dict:
    """A JSON object from ``path``; a ConversionError naming the file if it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path}: not valid JSON ({e})") from e
    except OSError as e:  # a directory of that name, no permission
        raise ConversionError(f"{path}: cannot be read ({e.strerror or e})") from e
    if not isinstance(value, dict):
        raise ConversionError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def read_config(directory: str) -> dict:
    """config.json of a checkpoint directory, with a clear error when it is not one."""
    if not os.path.isdir(directory):
        raise ConversionError(
            f"{directory!r} is not a directory (expected a local Hugging Face "
            "checkpoint: config.json + model.safetensors)"
        )
    path = os.path.join(directory, CONFIG_FILENAME)
    if not os.path.lexists(path):
        raise ConversionError(f"no {CONFIG_FILENAME} in {directory!r}: not a Hugging Face checkpoint")
    return read_json(path)


def read_generation_config(directory: str) -> dict:
    """Generation settings (``bad_words_ids``, ...) as transformers reads them: from
    generation_config.json, or, in a checkpoint saved before that file existed (older opus-mt
    snapshots keep ``bad_words_ids=[[pad]]`` in config.json), from config.json."""
    path = os.path.join(directory, GENERATION_CONFIG_FILENAME)
    return read_json(path) if os.path.exists(path) else read_config(directory)


# ----------------------------------------------------------------------------- safetensors

def _safetensors_dtypes() -> dict:
    import ml_dtypes  # a dependency of jax

    return {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
            "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
            "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
            "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_}


class Unreadable:
    """A tensor of a checkpoint that cannot be read as an array (a dtype numpy has no type for):
    an error only where the model needs it, so that one unused tensor does not refuse the rest."""

    def __init__(self, shape, why: str):
        self.shape, self.why = tuple(shape), why


_LFS_POINTER = b"version https://git-lfs"


def _check_not_lfs_pointer(path: str) -> None:
    """A clone made without git-lfs leaves ~130-byte text pointers where the weights should be;
    say so instead of failing to parse them."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(_LFS_POINTER))
    except OSError as e:  # a directory of that name, no permission
        raise ConversionError(f"{path}: cannot be read ({e.strerror or e})") from e
    if head == _LFS_POINTER:
        raise ConversionError(
            f"{path}: a git-lfs pointer file, not the weights (the repository was cloned "
            "without git-lfs): run `git lfs pull` in that directory"
        )


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """{name: array} of one .safetensors file, memory-mapped (read-only, no copy until used).

    A file that is not safetensors, or is cut short (an interrupted download), is a
    ConversionError naming it (and the tensor that does not fit), not a parse error from numpy.
    """
    _check_not_lfs_pointer(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        (header_size,) = struct.unpack("<Q", head) if len(head) == 8 else (size,)
        if 8 + header_size > size:
            raise ConversionError(
                f"{path}: not a safetensors file, or cut short ({size} bytes, its header "
                "claims more); download it again")
        try:
            header = json.loads(f.read(header_size))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConversionError(f"{path}: not a safetensors file (its header is not JSON: {e})") from e
    if not isinstance(header, dict):
        raise ConversionError(f"{path}: not a safetensors file (its header is not a JSON object)")
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_size)
    dtypes = _safetensors_dtypes()
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end, kind, shape = _header_entry(path, name, info)
        if kind not in dtypes:  # a dtype of the format's future, or one numpy has no type for
            tensors[name] = Unreadable(shape, f"{path}: tensor {name!r} has dtype {kind}, which this "
                                              f"reader does not support")
            continue
        dtype = np.dtype(dtypes[kind])
        if end > len(data) or end - start != dtype.itemsize * int(np.prod(shape)):
            raise ConversionError(
                f"{path}: tensor {name!r} ({kind} {list(shape)}) needs bytes {start}-{end} of "
                f"{len(data)}: the file is cut short or corrupt; download it again")
        tensors[name] = data[start:end].view(dtype).reshape(shape)
    return tensors


def _header_entry(path: str, name: str, info) -> tuple[int, int, str, tuple[int, ...]]:
    """(start, end, dtype name, shape) of one safetensors header entry, checked: a header written
    wrong is a ConversionError naming the file and the tensor, not a KeyError or a numpy error."""
    def is_count(x):
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    offsets = info.get("data_offsets") if isinstance(info, dict) else None
    shape = info.get("shape") if isinstance(info, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(is_count, offsets))
            and offsets[0] <= offsets[1] and isinstance(shape, list) and all(map(is_count, shape))
            and isinstance(info.get("dtype"), str)):
        raise ConversionError(
            f"{path}: not a safetensors file, or a corrupt one: the header's entry for tensor {name!r} "
            f"is {json.dumps(info)[:200]}, not {{dtype, shape: [sizes], data_offsets: [start, end]}}")
    return offsets[0], offsets[1], info["dtype"], tuple(shape)


def _torch_file_problem(path: str) -> str | None:
    """Why ``path`` cannot be a PyTorch weights file, judged from its bytes, or None: torch.save
    writes a zip archive (a legacy file is a pickle, starting with its protocol byte 0x80), and a
    zip archive keeps its directory at the end, so a download cut short has none."""
    import zipfile

    with open(path, "rb") as f:
        head = f.read(4)
    if zipfile.is_zipfile(path) or head[:1] == b"\x80":
        return None
    if head[:2] == b"PK":
        return "a zip archive without its directory at the end: cut short"
    return (f"not a PyTorch weights file (it starts with {head!r}: a web page or an error message saved "
            f"in its place?)")


def read_torch_bin(path: str) -> dict[str, np.ndarray]:
    """{name: array} of a PyTorch pickle, loaded with ``weights_only=True`` (never arbitrary code)."""
    import pickle

    torch = require("torch")
    _check_not_lfs_pointer(path)
    problem = _torch_file_problem(path)
    if problem:
        raise ConversionError(f"{path}: {problem}; download it again")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        first = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if isinstance(e, pickle.UnpicklingError) and "weights only load failed" in str(e).lower():
            raise ConversionError(  # a well-formed file holding more than tensors
                f"{path}: refused to load: torch.load(weights_only=True) failed ({first}). Only plain "
                "tensor state dicts are accepted; convert the file to safetensors if you trust it."
            ) from e
        raise ConversionError(f"{path}: torch.load(weights_only=True) could not read it ({first}): cut "
                              f"short, corrupt, or written by a newer PyTorch; download it again, or "
                              f"convert it to safetensors") from e
    if not isinstance(state, Mapping):
        raise ConversionError(f"{path}: expected a state dict of tensors, got {type(state).__name__}")
    out = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ConversionError(f"{path}: entry {name!r} is a {type(value).__name__}, not a tensor")
        value = value.detach()
        if value.dtype == torch.bfloat16:
            value = value.float()
        try:
            out[name] = value.numpy()
        except TypeError as e:  # a dtype numpy has no type for (float8, ...): an error only if used
            out[name] = Unreadable(value.shape, f"{path}: tensor {name!r} has dtype {value.dtype}, which "
                                                f"numpy cannot hold ({e})")
    return out


def _sharded(directory: str, index_name: str, reader) -> dict[str, np.ndarray]:
    index = read_json(os.path.join(directory, index_name))
    if not isinstance(index.get("weight_map"), dict):
        raise ConversionError(f"{os.path.join(directory, index_name)}: no 'weight_map' of tensor -> file")
    if not all(isinstance(v, str) for v in index["weight_map"].values()):
        raise ConversionError(f"{os.path.join(directory, index_name)}: 'weight_map' must map each tensor "
                              f"to a file name")
    filenames = sorted(set(index["weight_map"].values()))
    missing = [name for name in filenames if not os.path.exists(os.path.join(directory, name))]
    if missing:  # an interrupted or partial download
        raise ConversionError(
            f"{directory!r}: weight files listed in {index_name} are missing: {missing}")
    tensors = {}
    for filename in filenames:
        tensors.update(reader(os.path.join(directory, filename)))
    return tensors


def read_weights(directory: str) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint directory; safetensors preferred over PyTorch pickles."""

    def exists(name):  # (a directory of that name is read, and named as not a file)
        return os.path.lexists(os.path.join(directory, name))

    if exists(SAFETENSORS_FILENAME):
        return read_safetensors(os.path.join(directory, SAFETENSORS_FILENAME))
    if exists(SAFETENSORS_INDEX_FILENAME):
        return _sharded(directory, SAFETENSORS_INDEX_FILENAME, read_safetensors)
    if exists(TORCH_FILENAME):
        return read_torch_bin(os.path.join(directory, TORCH_FILENAME))
    if exists(TORCH_INDEX_FILENAME):
        return _sharded(directory, TORCH_INDEX_FILENAME, read_torch_bin)
    raise ConversionError(
        f"no weights in {directory!r}: expected {SAFETENSORS_FILENAME}, {SAFETENSORS_INDEX_FILENAME}, "
        f"{TORCH_FILENAME} or {TORCH_INDEX_FILENAME}"
    )
