"""`ModelConfig`: every architectural choice of the model, checked when it is built.

Field names follow the paper's symbols (d_model, d_ff, h = num_heads, d_k = head_dim, N = num_*_layers).
The defaults are the paper's base model (Table 3); `presets.py` holds the named sizes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from typing import Any

import jax.numpy as jnp
import numpy as np

NORM_PLACEMENTS = ("post", "pre")
NORM_TYPES = ("layernorm", "rmsnorm")
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu")
POSITIONS = ("sinusoidal", "learned", "rope", "none")
SINUSOIDAL_LAYOUTS = ("interleaved", "concat")
ATTENTION_IMPLS = ("auto", "reference", "xla", "cudnn", "chunked", "flash")
REMAT_POLICIES = ("none", "dots_saveable", "full")
KERNEL_LAYOUTS = ("in_out", "out_in", "packed")
# The order of 'packed' kernels' elements (modeling/native.py, `pack_kernel`), recorded with each
# checkpoint: 1 stored each tile of 16 rows whole (before 2026-12-06); 2 interleaves groups of three.
PACKED_ORDER = 2
CPU_KERNELS = ("auto", "native", "xla")
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the field (``field``, where one field is
    at fault)."""

    field: str | None = None


def first_line(error: BaseException) -> str:
    """An exception as one short line for a message that names what failed: its type and the first
    line of its text (at most 300 characters)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of `Transformer` (encoder-decoder) and `TransformerLM` (decoder-only).

    The defaults reproduce the base model of Vaswani et al. (2017), Table 3: N=6, d_model=512,
    d_ff=2048, h=8, d_k=d_v=64, P_drop=0.1, Post-LN, ReLU, sinusoidal positions, one embedding
    matrix shared by the encoder input, decoder input and output projection (section 3.4).
    """

    vocab_size: int = 37000
    d_model: int = 512
    num_heads: int = 8
    head_dim: int | None = None  # d_k = d_v; default d_model // num_heads
    num_kv_heads: int | None = None  # grouped-query attention; default num_heads (1 = multi-query)
    d_ff: int = 2048
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    dropout_rate: float = 0.1  # P_drop: sub-layer outputs and embedding+position sums (section 5.4)
    attention_dropout_rate: float = 0.0  # on attention probabilities (not in the paper)
    # On the embedding+position sums only; None = dropout_rate, as in the paper (GPT-2's embd_pdrop).
    embedding_dropout_rate: float | None = None
    max_len: int = 512  # longest sequence; sizes the learned position table
    norm: str = "post"  # 'post' (paper: LayerNorm(x + Sublayer(x))) or 'pre'
    norm_type: str = "layernorm"
    norm_eps: float = 1e-6
    final_norm: bool | None = None  # norm after the last block; default: True for 'pre', False for 'post'
    activation: str = "relu"
    position: str = "sinusoidal"
    sinusoidal_layout: str = "interleaved"  # paper: sin on even dims, cos on odd dims
    rope_theta: float = 10000.0
    share_embeddings: bool = True  # one table for encoder and decoder inputs (encoder-decoder only)
    tie_output: bool = True  # output projection = decoder embedding transposed (section 3.4)
    logits_bias: bool = False  # a learned bias added to the final logits (Marian has one)
    scale_embeddings: bool = True  # multiply embeddings by sqrt(d_model) (section 3.4)
    use_bias: bool = True  # biases in attention and feed-forward projections
    attention_impl: str = "auto"
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"
    scan_layers: bool = False  # nn.scan over identical blocks: compile time flat in depth
    remat: str = "none"  # rematerialisation policy for each block
    # Projection kernels stored inputs first ([D, F], Flax's order) or outputs first ([F, D],
    # PyTorch's); 'out_in' decodes faster on CPU. 'packed': out_in's shapes, each kernel's [out, in]
    # matrix (and each token embedding table's) stored in tiles of 16 outputs x 2 inputs, three tiles
    # interleaved line by line, the order in which the bf16 CPU decoding kernel reads it fastest
    # (modeling/native.py, `pack_kernel`; checkpoints record it, PACKED_ORDER);
    # other products read it through a reshaped view, slower. tj.params.convert_params converts.
    kernel_layout: str = "in_out"
    # Self-attention's query, key and value kernels stored as one, `qkv` [d_model, kv_heads,
    # heads / kv_heads + 2, head_dim] (out_in: [kv_heads, ..., d_model]): each call is one product
    # instead of three, which a decoding step, launching one kernel per product, runs faster.
    # Cross-attention keeps its own three. tj.params.convert_params converts.
    fused_qkv: bool = False
    # Decoding steps on a CPU: this package's own AVX-512 / AVX2 kernels for the weight products of
    # 'out_in' kernels and the tied output projection, and for the attention over the KV cache
    # ('auto': where they build and run, outside a multi-device mesh; 'native': an error where they
    # cannot; 'xla': XLA's own). See modeling/native.py; no effect on other platforms.
    cpu_kernels: str = "auto"
    # Rows of the embedding table (and of an untied output projection) rounded up to a multiple of
    # this, so that a tensor mesh axis divides them (128: GPT-2's 50257 -> 50304). The extra rows
    # are never looked up and their logits are dropped: the model computes the same function.
    pad_vocab_multiple: int = 1
    pad_id: int | None = 0
    eos_id: int = 1
    bos_id: int = 2
    decoder_start_id: int = 2  # first decoder input token (Marian uses pad_id)

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            # NumPy scalars (a size computed with numpy, np.int64) as the Python numbers they
            # equal: the checks below take int / float, and to_json cannot write NumPy types.
            if isinstance(value, np.number | np.bool_) and field.name not in ("dtype", "param_dtype"):
                object.__setattr__(self, field.name, value.item())
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, str(value))  # np.str_ as str
                continue
            # A dtype or scalar type (jnp.bfloat16, np.float32) as its name. None and Python's float
            # are refused as given: NumPy reads both as float64, a value nobody passed; so is anything
            # else (np.float32(1.0), an array, a ShapeDtypeStruct), which NumPy reads as its dtype.
            converted = None
            accepted = isinstance(value, np.dtype) or (
                isinstance(value, type) and not any(value is t for t in (float, int, bool, complex)))
            if accepted:
                with contextlib.suppress(TypeError):
                    converted = jnp.dtype(value).name
            if converted not in DTYPES:
                error = ConfigError(f"ModelConfig.{name}={value!r}: must be one of {DTYPES}")
                error.field = name
                raise error
            object.__setattr__(self, name, converted)
        self._validate()

    # ----------------------------------------------------------------- validation
    def _validate(self):
        def fail(field, message):
            error = ConfigError(f"ModelConfig.{field}={getattr(self, field)!r}: {message}")
            error.field = field
            raise error

        # Types first, so that the checks below compare numbers (a string "1e-6" or a True where
        # an int belongs would otherwise pass or fail with a bare TypeError).
        for name in ("share_embeddings", "tie_output", "logits_bias", "scale_embeddings",
                     "use_bias", "scan_layers", "fused_qkv"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "must be True or False")
        if self.final_norm is not None and not isinstance(self.final_norm, bool):
            fail("final_norm", "must be True, False or None")
        for name in ("norm_eps", "rope_theta", "dropout_rate", "attention_dropout_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                fail(name, "must be a number")
        for name in ("eos_id", "bos_id", "decoder_start_id", "pad_id", "head_dim", "num_kv_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, int) or (value is None and name in (
                    "pad_id", "head_dim", "num_kv_heads"))):
                fail(name, "must be an integer" + (" or None" if name not in (
                    "eos_id", "bos_id", "decoder_start_id") else ""))

        positive = ("vocab_size", "pad_vocab_multiple", "d_model", "num_heads", "d_ff", "max_len")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                fail(name, "must be a positive integer")
        for name in ("num_encoder_layers", "num_decoder_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                fail(name, "must be a non-negative integer")
        if self.num_decoder_layers == 0:
            # Every model here ends in the decoder: an encoder-decoder without one would have no
            # cross-attention and ignore its source.
            fail("num_decoder_layers", "must be at least 1 (the decoder holds the cross-attention that "
                                       "reads the source, and a decoder-only model's layers)")
        for name in ("head_dim", "num_kv_heads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                fail(name, "must be a positive integer or None")
        if self.head_dim is None and self.d_model % self.num_heads:
            fail("num_heads", f"d_model={self.d_model} is not divisible by it; set head_dim")
        if self.num_heads % self.kv_heads:
            fail("num_kv_heads", f"must divide num_heads={self.num_heads}")
        if self.position == "rope" and self.qk_dim % 2:
            derived = "" if self.head_dim is not None else f" (d_model / num_heads = {self.qk_dim})"
            fail("head_dim", f"rotary positions need an even head_dim{derived}")
        if self.position == "sinusoidal" and self.d_model % 2:
            fail("d_model", "sinusoidal positions need an even d_model")
        for name in ("dropout_rate", "attention_dropout_rate", "embedding_dropout_rate"):
            value = getattr(self, name)
            if name == "embedding_dropout_rate" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value < 1.0:
                fail(name, "must be in [0, 1)" + (" or None" if name == "embedding_dropout_rate" else ""))
        if not 0 < self.norm_eps < float("inf"):
            fail("norm_eps", "must be > 0 and finite")
        if not 0 < self.rope_theta < float("inf"):
            fail("rope_theta", "must be > 0 and finite")
        choices = {
            "norm": NORM_PLACEMENTS,
            "norm_type": NORM_TYPES,
            "activation": ACTIVATIONS,
            "position": POSITIONS,
            "sinusoidal_layout": SINUSOIDAL_LAYOUTS,
            "attention_impl": ATTENTION_IMPLS,
            "remat": REMAT_POLICIES,
            "kernel_layout": KERNEL_LAYOUTS,
            "cpu_kernels": CPU_KERNELS,
            "dtype": DTYPES,
            "param_dtype": DTYPES,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                fail(name, f"must be one of {allowed}")
        for name in ("eos_id", "bos_id", "decoder_start_id"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value < self.vocab_size:
                fail(name, f"must be a token id in [0, vocab_size={self.vocab_size})")
        if self.pad_id is not None and not 0 <= self.pad_id < self.vocab_size:
            fail("pad_id", f"must be None or a token id in [0, vocab_size={self.vocab_size})")

    # ----------------------------------------------------------------- derived sizes
    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding table: `vocab_size` rounded up to a multiple of `pad_vocab_multiple`."""
        return -(-self.vocab_size // self.pad_vocab_multiple) * self.pad_vocab_multiple

    @property
    def qk_dim(self) -> int:
        """d_k = d_v: the size of each head."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    @property
    def use_final_norm(self) -> bool:
        return self.final_norm if self.final_norm is not None else self.norm == "pre"

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def weights_dtype(self):
        return jnp.dtype(self.param_dtype)

    # ----------------------------------------------------------------- (de)serialisation
    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            import difflib

            guesses = [f"{name!r} -> {close[0]!r}" for name in unknown
                       if (close := difflib.get_close_matches(name, known, n=1))]
            raise ConfigError(f"ModelConfig has no field(s) {unknown}"
                              + (f" (did you mean {', '.join(guesses)}?)" if guesses else "")
                              + f"; known fields: {sorted(known)}")
        return cls(**values)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def diff(self, other: ModelConfig) -> dict[str, tuple[Any, Any]]:
        """Fields whose values differ: {name: (self value, other value)}."""
        a, b = self.to_dict(), other.to_dict()
        return {k: (a[k], b[k]) for k in a if a[k] != b[k]}
