"""The package's own CPU kernels for decoding steps and training's attention, called through the
XLA FFI.

- `rows_matmul(x, w)`: x [R, I] times a weight stored output-major, w [O, I], for R <= 16 rows
  (a decoding step's tokens) -> float32 [R, O], bfloat16 or float32 inputs. XLA:CPU's matmul
  kernels stream a weight at 2-16 rows at ~40% of the memory bandwidth on the CPU measured here;
  this one reads each thread's weight rows front to back with software prefetches and streams at
  about the rate of a plain sum. bf16 runs as bf16 dot products or widened to float32 FMAs,
  whichever is faster on this CPU (`bf16_products`).
- `packed_matmul(x, w)`: the same for a bf16 weight stored in tiles of 16 rows, three tiles to a
  group (``kernel_layout='packed'``, `pack_kernel`), whose dot products each add to 16 outputs; and
  `packed_dense(x, w, bias, activation, dtype)`, that product with `bias_activation`'s bias,
  rounding and activation in the same call.
- `cols_matmul(x, w)`: the same for a weight stored input-major, w [I, O] (the default
  `kernel_layout`), each thread reading a run of input rows.
- `cache_attention(q, k, v, mask)`: softmax(q k^T / sqrt(d)) v for a few queries over the
  heads-first KV cache (float32 or bfloat16), one (row, KV head) per task on every core; XLA:CPU
  runs these small batched products on one core.
- `cache_write(cache, new, index)`: a step's keys or values written into the cache in place;
  XLA:CPU converts a whole bfloat16 cache to float32 and back to write it.
- `cache_reorder(cache, rows, counts)`: beam search's reordering of the cache in place, copying
  only the filled positions of the rows whose parent changed; XLA gathers the whole cache.
- `greedy_choice(logits_t)`: each column's first maximum and log-sum-exp over vocabulary-major
  logits [V, B], in two passes where XLA:CPU makes several.
- `sequence_attention_forward` / `sequence_attention_backward`: attention over whole sequences
  (training), one (batch row, KV head) per task, for `attention.native_attention`.
- `materialize(a)`: the identity as a custom call, in place, so that XLA fuses no producer into the
  transposing copies of the bf16 backward products (`matmul.transposed_copy`).
- `bias_activation(y, bias, activation, dtype)`: a feed-forward layer's first product's bias,
  rounding and activation (ReLU, tanh-GELU, SiLU) in one pass; XLA:CPU's tanh-GELU over a
  decoding step's [8, 3072] took ~50 us.
- `layer_norm(x, scale, bias, eps, kind)`: a decoding step's LayerNorm or RMSNorm over a few rows
  in one call, where XLA:CPU makes five operations (two reductions among them) of each.

`ModelConfig.cpu_kernels` decides where a model uses them (`use_native`); the figures are in
`benchmarks/NOTES.md`.

The C++ source ships with the package and is compiled on first use with the system's C++
compiler (``$CXX``, else ``c++``) against the FFI headers of the installed jaxlib, into
``$TRANSFORMER_JAX_CACHE`` (default ``~/.cache/transformer_jax``), keyed by the source, the
compiler flags and the jaxlib version. It needs Linux on x86-64 with AVX-512 and bfloat16 dot
products (avx512_bf16; `native_avx512.h`), or else AVX2 with FMA (`native_avx2.h`: the same
kernels in 8-lane vectors, bf16 products always widened); `isa()` says which. `available()` says
whether it can run here, and `unavailable_reason()` why not; a model asks for it with
``ModelConfig.cpu_kernels``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shlex
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.config import CPU_KERNELS
from transformer_jax.modeling import derivatives
from transformer_jax.modeling.activations import activation_fn

SOURCE = Path(__file__).with_name("native_kernels.cc")
MAX_ROWS = 16  # tokens per call the weight-product kernel takes (and the attention kernel's queries)
MAX_HEAD_DIM = 256
_TARGETS = {"transformer_jax_rows_matmul": "TjRowsMatmul",
            "transformer_jax_cols_matmul": "TjColsMatmul",
            "transformer_jax_packed_matmul": "TjPackedMatmul",
            "transformer_jax_packed_dense": "TjPackedDense",
            "transformer_jax_cache_attention": "TjCacheAttention",
            "transformer_jax_cache_write": "TjCacheWrite",
            "transformer_jax_cache_reorder": "TjCacheReorder",
            "transformer_jax_greedy_choice": "TjGreedyChoice",
            "transformer_jax_bias_activation": "TjBiasActivation",
            "transformer_jax_attention_fwd": "TjAttentionFwd",
            "transformer_jax_attention_bwd": "TjAttentionBwd",
            "transformer_jax_materialize": "TjMaterialize",
            "transformer_jax_layer_norm": "TjLayerNorm"}
# Activations `bias_activation` computes (the kernel's codes); others run in XLA.
ACTIVATION_CODES = {"none": 0, "relu": 1, "gelu_tanh": 2, "silu": 3}
# Under `jax.vmap` every kernel runs once per element of the mapped axis (they take unbatched
# shapes only).
VMAP = "sequential"
HEADERS = tuple(SOURCE.with_name(name) for name in ("native_avx512.h", "native_avx2.h"))
# The instruction sets the kernels are written for, best first: the CPU features each needs and its
# compiler flags. AVX-512 with bf16 dot products (native_avx512.h), else AVX2 with FMA
# (native_avx2.h: 8-lane vectors, bf16 always widened to float32).
ISAS = {
    "avx512": (("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
               ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma")),
    "avx2": (("avx2", "fma"), ("-mavx2", "-mfma")),
}
_BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC")
# Names an instruction set to build for instead of the best this CPU has (tests and measurements
# of the AVX2 kernels on an AVX-512 CPU).
ISA_ENV = "TRANSFORMER_JAX_NATIVE_ISA"


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


# x86-64 CPU features with which XLA:CPU multiplies bfloat16 matrices at a bf16 rate (AVX-512 bf16
# dot products, AMX). Without them its bf16 x bf16 -> float32 matmul is slower than converting both
# operands to float32 and multiplying those: 0.105 against 0.176 TFLOP/s on an AVX2 CPU (AMD Zen 3,
# 2048 x 768 by 768 x 3072; float32 itself 0.18). See matmul.widen_bf16.
BF16_MATMUL_FEATURES = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_multiplies_bf16() -> bool:
    """Whether XLA:CPU multiplies bf16 matrices natively on this CPU (`BF16_MATMUL_FEATURES`). True
    off x86-64 and where /proc/cpuinfo cannot be read: other CPUs keep the bf16 products unmeasured."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    flags = _cpu_flags()
    return not flags or any(f in flags for f in BF16_MATMUL_FEATURES)


def _cache_dir() -> Path:
    root = os.environ.get("TRANSFORMER_JAX_CACHE") or Path.home() / ".cache" / "transformer_jax"
    return Path(root)


def _pick_isa(flags: set[str]) -> tuple[str | None, str]:
    """(the instruction set to build for, '') or (None, why none can be)."""
    wanted = os.environ.get(ISA_ENV, "")
    if wanted and wanted not in ISAS:
        return None, f"${ISA_ENV}={wanted!r}; choose one of {', '.join(ISAS)}"
    for name, (features, _) in ISAS.items():
        if wanted and name != wanted:
            continue
        missing = [f for f in features if f not in flags]
        if not missing:
            return name, ""
        if wanted or name == "avx2":
            return None, f"this CPU lacks {', '.join(missing)}"
    raise AssertionError("unreachable")


def _flags(isa_name: str) -> tuple[str, ...]:
    return (*_BASE_FLAGS, *ISAS[isa_name][1])


def _build(compiler: str, isa_name: str) -> Path:
    import jaxlib

    include = jax.ffi.include_dir()
    flags = _flags(isa_name)
    sources = b"".join(path.read_bytes() for path in (SOURCE, *HEADERS))
    key = hashlib.sha256(sources + " ".join(flags).encode() + jaxlib.__version__.encode()
                         + compiler.encode()).hexdigest()[:16]
    lib = _cache_dir() / f"native_kernels-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    # One build per library: processes starting together (the local processes of a multi-process
    # run, a test suite's workers) wait for the first one's build (~25 s of a core) and load it,
    # instead of each compiling the same code. The lock goes with its holder, killed or not; it is
    # taken on a read-only descriptor, which other users of a shared cache can open too.
    import fcntl  # POSIX only: this module is imported everywhere, and builds only on Linux

    lock = os.open(lib.with_suffix(".lock"), os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not lib.exists():
            _compile(compiler, flags, include, lib)
    finally:
        os.close(lock)
    return lib


def _compile(compiler: str, flags: tuple[str, ...], include: str, lib: Path) -> None:
    # Written under a temporary name and renamed: a build interrupted half-way never leaves a
    # truncated library under the final name.
    fd, tmp = tempfile.mkstemp(dir=lib.parent, prefix=lib.stem + ".", suffix=".tmp.so")
    os.close(fd)
    try:
        cmd = [*shlex.split(compiler), *flags, f"-I{include}", str(SOURCE), "-o", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE.name} failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
        # mkstemp made the file private (0600, the linker adds only execute bits): a cache shared
        # between users (one filled while building an image, say) must stay loadable by them all.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o755 & ~umask)
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_LIBRARY: list = []  # the loaded library, once _load has succeeded
_ISA: list = []  # the instruction set it was built for


@functools.cache
def _load() -> tuple[bool, str]:
    """(True, '') once the kernel is built and registered with XLA, else (False, the reason)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False, f"needs Linux on x86-64 (this is {platform.system()} on {platform.machine()})"
    flags = _cpu_flags()
    isa_name, reason = _pick_isa(flags)
    if isa_name is None:
        return False, reason
    for path in (SOURCE, *HEADERS):
        if not path.is_file():
            return False, f"the kernels' source {path} is missing from this installation"
    compiler = os.environ.get("CXX", "c++")
    # Unless one is named, a build the compiler refuses (an older one without -mavx512bf16, say)
    # falls back to the next instruction set the CPU has.
    names = list(ISAS)
    candidates = [isa_name] + ([] if os.environ.get(ISA_ENV) else
                               [n for n in names[names.index(isa_name) + 1:]
                                if all(f in flags for f in ISAS[n][0])])
    for attempt, isa_name in enumerate(candidates):
        try:
            lib = ctypes.CDLL(str(_build(compiler, isa_name)))
            handlers = {target: getattr(lib, symbol) for target, symbol in _TARGETS.items()}
            _LIBRARY.append(lib)
            break
        except FileNotFoundError:
            return False, f"no C++ compiler found (looked for {compiler!r}; set $CXX)"
        except (OSError, AttributeError, RuntimeError, subprocess.TimeoutExpired) as err:
            # A compiler that is there but fails is worth saying once; the model then runs XLA's
            # kernels (or the next instruction set's).
            last = attempt == len(candidates) - 1
            logging.getLogger(__name__).warning(
                "native CPU decoding kernels for %s unavailable, %s: %s", isa_name,
                "using XLA's" if last else f"trying {candidates[attempt + 1]}", err)
            if last:
                return False, str(err)
    for target, handler in handlers.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    _ISA.append(isa_name)
    return True, ""


def available() -> bool:
    """Whether the kernels can run on this machine (builds them on the first call)."""
    return _load()[0]


def unavailable_reason() -> str:
    return _load()[1]


def isa() -> str | None:
    """The instruction set the kernels run in here ('avx512' or 'avx2'; see `ISAS`), or None where
    they cannot run."""
    return _ISA[0] if available() else None


BF16_PRODUCTS = ("auto", "dot", "widen")


def bf16_products() -> str:
    """How `rows_matmul` multiplies bfloat16 on this CPU: 'dot' (the bf16 dot-product instruction,
    32 multiply-adds each) or 'widen' (weights and activations widened exactly to float32 and
    multiplied by float32 FMAs, 16 each). Decided on first use by timing both instructions, since
    CPUs differ: 'widen' where 2.25 FMAs take less time than one dot product (an Intel Xeon
    measured here: 0.81 against 0.20 ns per instruction), else 'dot'. Both accumulate in float32;
    the sums differ only in rounding order."""
    _check_available()
    return BF16_PRODUCTS[_LIBRARY[0].tj_bf16_products()]


FAR_PREFETCHES = ("auto", "nta", "t1")


def far_prefetch() -> str:
    """Where the AVX-512 kernels' far prefetches of the weights a decoding step streams land: 'nta'
    (non-temporal) on AMD CPUs, where it keeps the KV cache and activations in L2 and L3 (a few
    percent faster on Zen 5), 't1' (L2) elsewhere: on an Intel Xeon with AMX a non-temporal prefetch
    fills L1 alone, and the weights it fetched ahead were evicted before they were read (float32
    GPT-2 small at batch 1: 52.0 against 17.6 ms a step). Decided by the CPU's vendor on first use."""
    _check_available()
    return FAR_PREFETCHES[_LIBRARY[0].tj_far_prefetch()]


def set_far_prefetch(hint: str) -> str:
    """Fixes the far prefetches' hint ('nta' or 't1') for this process, or decides it by the CPU's
    vendor again ('auto'); returns the hint now in use. For tests and measurements: it applies to
    every call from then on. The AVX2 kernels always prefetch into L2."""
    if hint not in FAR_PREFETCHES:
        raise ValueError(f"set_far_prefetch: {hint!r}; choose one of {', '.join(FAR_PREFETCHES)}")
    _check_available()
    return FAR_PREFETCHES[_LIBRARY[0].tj_set_far_prefetch(FAR_PREFETCHES.index(hint))]


def set_bf16_products(path: str) -> str:
    """Fixes how bfloat16 products run in this process ('dot' or 'widen'), or measures again
    ('auto'); returns the path now in use. For tests and measurements: the choice applies to every
    call from then on, including already-compiled programs. The AVX2 build has no bfloat16 dot
    product, so there 'dot' (and 'auto') give 'widen', which the return value says."""
    if path not in BF16_PRODUCTS:
        raise ValueError(f"set_bf16_products: {path!r}; choose one of {', '.join(BF16_PRODUCTS)}")
    _check_available()
    return BF16_PRODUCTS[_LIBRARY[0].tj_set_bf16_products(BF16_PRODUCTS.index(path))]


def use_native(setting: str) -> bool:
    """Whether a model with ``cpu_kernels=setting`` calls the native kernels in the computation
    being traced: 'xla' never; 'auto' where they can run here, unless a mesh of more than one
    device is set (``jax.set_mesh``): the kernels have no sharding rule, so XLA would gather every
    sharded weight for them; 'native' likewise, but an error where they cannot run. Only CPU
    computations call them (the callers branch with `lax.platform_dependent`), and only where the
    CPU is JAX's default backend: on a GPU or TPU host nothing is built."""
    if setting not in CPU_KERNELS:
        raise ValueError(f"cpu_kernels={setting!r}; choose one of {', '.join(CPU_KERNELS)}")
    if setting == "xla" or jax.default_backend() != "cpu":
        return False
    if setting == "native" and not available():
        raise RuntimeError(f"cpu_kernels='native', but the native CPU kernels cannot run here: "
                           f"{unavailable_reason()} (use cpu_kernels='auto' or 'xla')")
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1:
        return False
    return available()


def _check_available():
    if not available():
        raise RuntimeError(f"the native CPU kernels cannot run here: {unavailable_reason()}")


def _rows_matmul_call(x, w):
    # The kernel writes [O, R] (each output's R sums side by side); returned as its [R, O] view.
    # A decoding step's logits then stay vocabulary-major, the layout in which the token choice
    # reduces them (decoding/sampling.py) without a transposed copy.
    out = jax.ShapeDtypeStruct((w.shape[0], x.shape[0]), jnp.float32)
    return jax.ffi.ffi_call("transformer_jax_rows_matmul", out, vmap_method=VMAP)(x, w).T


def _rows_matmul_xla(x, w):
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def rows_matmul(x, w):
    """x [R, I] times w [O, I] over I -> float32 [R, O] on the CPU kernel (1 <= R <= 16).

    Differentiable in both modes (the derivatives are XLA's product's), and `jax.vmap` maps it one
    call per element. Call only where `available()` is True, and only in a computation placed on
    the CPU."""
    _check_product("rows_matmul", "[O, I]", x, w, 1)
    return _rows_matmul_p(x, w)


def _check_product(name, layout, x, w, in_axis):
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[in_axis]:
        raise ValueError(f"{name}: expected x [R, I] and w {layout}, got {x.shape} and {w.shape}")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"{name}: x has {x.shape[0]} rows; the kernel takes 1 to {MAX_ROWS}")
    if x.dtype != w.dtype or x.dtype not in (jnp.bfloat16, jnp.float32):
        raise TypeError(f"{name}: x and w must both be bfloat16 or float32 (got {x.dtype}, {w.dtype})")
    _check_available()


# The packed layout of a weight [O, I] (``kernel_layout='packed'``): where I is even, its first
# `packed_rows(O, I)` rows as tiles of PACK_TILE rows, then the other rows as they are; where I is
# odd, every row as it is. The tiles go in groups of PACK_GROUP (the last group holds what is
# left: one or two tiles), and a group of g tiles is stored [I / 2, g, PACK_TILE, 2]: one 64-byte
# line of bf16 holds a pair of inputs for all of a tile's outputs, and the group's tiles take their
# lines in turn, pair by pair. The kernel reads a group's tiles side by side (a decoding step's
# sums of three tiles share each broadcast activation), so each task reads one run of memory: with
# each tile stored whole, a task read three runs at once, which streamed slower (AMD Zen 5, two
# threads, the two orders alternated in one process, 8 rows: GPT-2-small's 50257-row head 1.54
# against 1.74 ms, a [3072, 768] weight 107 against 112 us). The same shape as the weight: only the
# order of its elements changes. Checkpoints record the order (config.PACKED_ORDER).
PACK_TILE = 16
PACK_GROUP = 3


def packed_rows(out_size: int, in_size: int) -> int:
    """How many of a packed [out_size, in_size] weight's rows are stored as tiles."""
    return out_size // PACK_TILE * PACK_TILE if in_size % 2 == 0 else 0


def _packed_groups(rows: int, size: int) -> list[tuple[int, int, int]]:
    """(first row, groups, tiles per group) of each run of equal groups in a packed [rows, size]
    weight's tiles: the full groups, then the group of the tiles left over, if any."""
    tiles = packed_rows(rows, size) // PACK_TILE
    full, left = divmod(tiles, PACK_GROUP)
    runs = [(0, full, PACK_GROUP)] if full else []
    return runs + ([(full * PACK_GROUP * PACK_TILE, 1, left)] if left else [])


def packed_group_views(w) -> list[tuple[int, object]]:
    """(first row, view [groups, I / 2, tiles, PACK_TILE, 2]) of each run of `_packed_groups` in a
    packed weight w [O, I]: reshapes, no copy. Row first + (g * tiles + t) * PACK_TILE + j is
    view[g, :, t, j, :]."""
    rows, size = w.shape
    return [(first, w[first:first + n * g * PACK_TILE].reshape(n, size // 2, g, PACK_TILE, 2))
            for first, n, g in _packed_groups(rows, size)]


# Rows up to which a model's product of a packed weight takes `packed_matmul` (a prefill); more take
# `packed_matmul_xla`. See `packed_fits`.
PACKED_MAX_ROWS = 4096


def packed_fits(rows: int, dtype) -> bool:
    """Whether a model's product of `rows` rows by a packed weight takes `packed_matmul` (bfloat16,
    1 to PACKED_MAX_ROWS rows); elsewhere `packed_matmul_xla`."""
    return 1 <= rows <= PACKED_MAX_ROWS and jnp.dtype(dtype) == jnp.bfloat16


def _array_module(a):
    return np if isinstance(a, np.ndarray) else jnp


def pack_kernel(w):
    """A weight [O, I] (numpy or JAX) in the packed layout (see PACK_TILE); `unpack_kernel` inverts it."""
    xp, (rows, size) = _array_module(w), w.shape
    tiled = packed_rows(rows, size)
    if tiled == 0:
        return w
    parts = [w[first:first + n * g * PACK_TILE].reshape(n, g, PACK_TILE, size // 2, 2)
             .transpose(0, 3, 1, 2, 4).reshape(n * g * PACK_TILE, size)
             for first, n, g in _packed_groups(rows, size)]
    return xp.concatenate([*parts, w[tiled:]], axis=0)


def unpack_kernel(w):
    """The weight [O, I] that `pack_kernel` packed into w."""
    xp, (rows, size) = _array_module(w), w.shape
    tiled = packed_rows(rows, size)
    if tiled == 0:
        return w
    parts = [view.transpose(0, 2, 3, 1, 4).reshape(-1, size) for _, view in packed_group_views(w)]
    return xp.concatenate([*parts, w[tiled:]], axis=0)


def packed_matmul_xla(x, w):
    """x [R, I] times a packed weight w [O, I] (see PACK_TILE) -> float32 [R, O], in XLA's ops: the
    weight put back in its [O, I] order (`unpack_kernel`, a transposing copy), then one product.
    A product over the packed [groups, I / 2, tiles, 16, 2] view itself (`packed_group_views`) was
    no faster on a CPU (1.1-2.7x `out_in`'s time at 256-4096 rows, against 1.0-1.9x), and XLA's
    SPMD partitioner computed it wrongly for a weight sharded over the tensor and fsdp axes of a
    mesh whose data axis also splits the rows (2 x 2 x 2: logits off by up to 2.6)."""
    return _rows_matmul_xla(x, unpack_kernel(w))


def _packed_matmul_call(x, w):
    # Up to MAX_ROWS rows the kernel writes [O, R], as `rows_matmul` (a decoding step's logits stay
    # vocabulary-major); above, [R, O].
    if x.shape[0] > MAX_ROWS:
        out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
        return jax.ffi.ffi_call("transformer_jax_packed_matmul", out, vmap_method=VMAP)(x, w)
    out = jax.ShapeDtypeStruct((w.shape[0], x.shape[0]), jnp.float32)
    return jax.ffi.ffi_call("transformer_jax_packed_matmul", out, vmap_method=VMAP)(x, w).T


def packed_matmul(x, w):
    """x [R, I] times a bfloat16 weight stored packed, w [O, I] (see PACK_TILE), over I -> float32
    [R, O] on the CPU kernel, any R >= 1: up to MAX_ROWS rows a decoding step's product, above a
    prefill's, each group of tiles then going through the rows in chunks while it is in cache. As
    `rows_matmul`: differentiable in both modes (XLA's product's derivatives), mapped by `jax.vmap`
    one call per element; call only where `available()` is True, in a computation placed on the
    CPU."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"packed_matmul: expected x [R, I] and w [O, I], got {x.shape} and {w.shape}")
    if x.shape[0] < 1:
        raise ValueError("packed_matmul: x has no rows")
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        raise TypeError(f"packed_matmul: bfloat16 only (got {x.dtype}, {w.dtype})")
    _check_available()
    return _packed_matmul_p(x, w)


def packed_dense_xla(x, w, bias, activation, dtype):
    """What `packed_dense` computes, in XLA's ops (its derivatives, and the path off the CPU)."""
    return bias_activation_xla(packed_matmul_xla(x, w), bias, activation, dtype)


def _packed_dense_call(x, w, bias, activation, dtype, shape):
    out = jax.ShapeDtypeStruct(shape, dtype)
    return jax.ffi.ffi_call("transformer_jax_packed_dense", out, vmap_method=VMAP)(
        x, w, bias.astype(jnp.float32), activation=np.int32(ACTIVATION_CODES[activation]))


def _packed_dense_reshaped_xla(x, w, bias, activation, dtype, shape):
    return packed_dense_xla(x, w, bias, activation, dtype).reshape(shape)


def packed_dense(x, w, bias, activation: str, dtype, shape=None):
    """act(round(x W^T + bias)) for x bf16 [R, I] (1 <= R <= 16) and a bf16 weight stored packed,
    w [O, I], bias [O] -> [R, O] in `dtype` (float32 or bfloat16): `packed_matmul` and
    `bias_activation` in one call, each group of tiles' sums biased, rounded and activated while
    they are in cache (the same numbers as the two calls, and as `packed_dense_xla` within
    `bias_activation`'s tolerance). `shape`, any of R * O elements, returns the result reshaped
    so (a decoding step's [B, 1, heads, head_dim]): the kernel writes it in that shape, where a
    reshape afterwards can cost XLA:CPU a copy. Differentiable in both modes (`packed_dense_xla`'s
    derivatives); `jax.vmap` maps it one call per element. Call only where `available()` is True,
    on the CPU."""
    dtype = jnp.dtype(dtype)
    shape = (x.shape[0], w.shape[0]) if shape is None else tuple(int(d) for d in shape)
    if math.prod(shape) != x.shape[0] * w.shape[0]:
        raise ValueError(f"packed_dense: shape {shape} does not hold the {x.shape[0]} x {w.shape[0]} result")
    if activation not in ACTIVATION_CODES:
        raise ValueError(f"packed_dense: activation {activation!r}; the kernel computes "
                         f"{', '.join(ACTIVATION_CODES)}")
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1] or bias.shape != w.shape[:1]:
        raise ValueError(f"packed_dense: expected x [R, I], w [O, I] and bias [O], got {x.shape}, "
                         f"{w.shape} and {bias.shape}")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"packed_dense: x has {x.shape[0]} rows; the kernel takes 1 to {MAX_ROWS}")
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        raise TypeError(f"packed_dense: x and w bfloat16 only (got {x.dtype}, {w.dtype})")
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise TypeError(f"packed_dense: output float32 or bfloat16, not {dtype}")
    _check_available()
    return _packed_dense_p(x, w, bias, activation=activation, dtype=dtype, shape=shape)


# Where a model's products of [in, out] weights take `cols_matmul`: up to COLS_MAX_ROWS rows, and
# outputs of at most COLS_MAX_ROW_BYTES per input row. The kernel's tasks are runs of whole input
# rows of ~128 KB, each adding into its group's [R, O] partial sums once per block of columns; a
# wider row leaves too few input rows per task (at O = 8192 float32, one), and at more rows the two
# passes over each block read the partial sums twice: there XLA's product was faster (one core
# of the AMD Zen 5 host, per call: float32 [768, 8192] at 8 rows 0.70 against 0.42 ms, at 16 rows
# 1.44 against 0.67; bf16 [768, 16384] at 8 rows 1.52 against 0.62; GPT-2's 50257-wide head untied,
# bf16 at 8 rows 18.4 against 6.5 ms; float32 [768, 3072] at 16 rows 0.31 against 0.25, at 8 rows
# 0.16 against 0.28).
COLS_MAX_ROWS = 8
COLS_MAX_ROW_BYTES = 16 * 1024


def cols_fit(rows: int, out_size: int, dtype) -> bool:
    """Whether a model's product of `rows` rows by an [in, out] weight of `out_size` outputs takes
    `cols_matmul` (see COLS_MAX_ROWS): the kernel itself takes any width and up to MAX_ROWS rows."""
    return 1 <= rows <= COLS_MAX_ROWS and out_size * jnp.dtype(dtype).itemsize <= COLS_MAX_ROW_BYTES


def _cols_matmul_xla(x, w):
    return jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _cols_matmul_call(x, w):
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32)
    return jax.ffi.ffi_call("transformer_jax_cols_matmul", out, vmap_method=VMAP)(x, w)


def cols_matmul(x, w):
    """x [R, I] times w [I, O] over I -> float32 [R, O] on the CPU kernel (1 <= R <= 16), for
    weights stored input-major (``kernel_layout='in_out'``). As `rows_matmul`: differentiable in
    both modes (XLA's product's derivatives), mapped by `jax.vmap` one call per element; call only
    where `available()` is True, in a computation placed on the CPU."""
    _check_product("cols_matmul", "[I, O]", x, w, 0)
    return _cols_matmul_p(x, w)


CACHE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def attention_fits(q, k, v, mask) -> bool:
    """Whether `cache_attention` takes these: a few queries, float32 or bfloat16 K/V of one dtype,
    a dense bool mask or none, a head dimension up to MAX_HEAD_DIM."""
    return (q.shape[1] <= MAX_ROWS and k.dtype in CACHE_DTYPES and v.dtype == k.dtype
            and q.shape[-1] <= MAX_HEAD_DIM
            and (mask is None or (hasattr(mask, "dtype") and mask.dtype == jnp.bool_)))


def cache_attention(q, k, v, mask):
    """Attention of q [B, L, H, K] over a heads-first cache k, v [B, N, S, K] (float32 or
    bfloat16, one dtype; N divides H), mask bool broadcastable to [B, H, L, S] or None -> float32
    [B, L, H, K]. Logits and softmax in float32 (a bf16 cache is widened exactly); a query that sees
    no key gets zeros (as `attention.dot_product_attention`). Not differentiable: decoding only.
    Call only where `available()` is True, on the CPU."""
    B, L, H, K = q.shape
    S = k.shape[2]
    _check_available()
    if mask is None:
        mask = jnp.ones((B, 1, 1, S), jnp.bool_)
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    # Batch and key axes in full; a head or query axis of 1 stays broadcast (the kernel reads it so).
    heads = 1 if mask.shape[1] == 1 else H
    queries = 1 if mask.shape[2] == 1 else L
    mask = jnp.broadcast_to(mask, (B, heads, queries, S))
    q = q.astype(jnp.float32) / jnp.sqrt(jnp.float32(K))
    if k.dtype not in CACHE_DTYPES or v.dtype != k.dtype:
        k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    out = jax.ShapeDtypeStruct((B, L, H, K), jnp.float32)
    return jax.ffi.ffi_call("transformer_jax_cache_attention", out, vmap_method=VMAP)(q, k, v, mask)


# Keys above which `sequence_attention_fits` refuses: a task keeps [64, S] blocks of logits and the
# probabilities' gradient, and its head's keys and values, in its own buffers.
SEQUENCE_ATTENTION_MAX_KEYS = 16384


def sequence_attention_fits(q, k, v, mask) -> bool:
    """Whether `sequence_attention_forward` takes these: q [B, T, H, D] and k, v [B, S, N, D] (float32,
    or bfloat16 that the caller widens), N dividing H, D a multiple of 16 up to MAX_HEAD_DIM, at most
    SEQUENCE_ATTENTION_MAX_KEYS keys, and None or an `masks.AttentionMask` with no dense part and no
    causal offset (`sequence_attention_mask_args` folds the rest into segment ids)."""
    from transformer_jax.modeling import masks

    if mask is not None and (not isinstance(mask, masks.AttentionMask) or mask.dense is not None
                             or mask.causal_offset is not None
                             or (mask.causal and q.shape[1] != k.shape[1])):
        return False
    return (all(x.dtype in (jnp.float32, jnp.bfloat16) for x in (q, k, v))
            and q.shape[-1] % 16 == 0 and q.shape[-1] <= MAX_HEAD_DIM
            and k.shape[1] <= SEQUENCE_ATTENTION_MAX_KEYS
            and k.shape[2] > 0 and q.shape[2] % k.shape[2] == 0)


def sequence_attention_mask_args(mask, batch: int, q_length: int, kv_length: int):
    """(causal, q_seg int32 [B, T], kv_seg int32 [B, S]) for `sequence_attention_forward` from None
    or an `masks.AttentionMask` that `sequence_attention_fits` accepts. Key j is visible to query i
    when kv_seg[j] != 0 and q_seg[i] == kv_seg[j] (and j <= i if causal): segment ids, key validity,
    key lengths and a key limit all fold into these two arrays."""
    q_seg = jnp.ones((batch, q_length), jnp.int32)
    kv_seg = jnp.ones((batch, kv_length), jnp.int32)
    if mask is None:
        return False, q_seg, kv_seg
    if mask.q_segment_ids is not None:
        q_seg = jnp.broadcast_to(mask.q_segment_ids.astype(jnp.int32), (batch, q_length))
        kv_seg = jnp.broadcast_to(mask.kv_segment_ids.astype(jnp.int32), (batch, kv_length))
    keys = jnp.arange(kv_length)[None, :]
    if mask.kv_valid is not None:
        kv_seg = jnp.where(mask.kv_valid, kv_seg, 0)
    if mask.kv_lengths is not None:
        kv_seg = jnp.where(keys < jnp.reshape(mask.kv_lengths, (-1, 1)), kv_seg, 0)
    if mask.kv_limit is not None:
        kv_seg = jnp.where(keys < mask.kv_limit, kv_seg, 0)
    return mask.causal, q_seg, kv_seg


def _scale(head_dim: int) -> np.float32:
    return np.float32(1.0 / np.sqrt(head_dim))


def sequence_attention_forward(q, k, v, q_seg, kv_seg, causal: bool):
    """softmax(q k^T / sqrt(D)) v for float32 q [B, T, H, D] and k, v [B, S, N, D], key j visible to
    query i as `sequence_attention_mask_args` says -> (out [B, T, H, D], lse [B, H, T]: the
    log-sum-exp of each query's visible logits, -inf where it sees no key, whose output is zero)."""
    _check_available()
    B, T, H, D = q.shape
    out = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct((B, H, T), jnp.float32))
    return jax.ffi.ffi_call("transformer_jax_attention_fwd", out, vmap_method=VMAP)(
        q, k, v, q_seg, kv_seg, causal=bool(causal), scale=_scale(D))


def sequence_attention_backward(q, k, v, out, lse, g, q_seg, kv_seg, causal: bool):
    """(dq, dk, dv) of `sequence_attention_forward` for the cotangent g of its output, from the
    forward's out and lse (nothing of size [T, S] is kept between the two)."""
    _check_available()
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v))
    return jax.ffi.ffi_call("transformer_jax_attention_bwd", shapes, vmap_method=VMAP)(
        q, k, v, out, g, lse, q_seg, kv_seg, causal=bool(causal), scale=_scale(q.shape[-1]))


def differentiable_call(name: str, call, tangent):
    """A JAX primitive for ``call(*arrays, **params) -> tuple of arrays`` (a custom call, as a rule):
    it runs ``call`` (lowered inline, so the program holds the same custom call), and its JVP is
    ``(bind(*primals), tangent(primals, tangents, **params))`` with ``tangents`` instantiated (zeros
    where JAX has none). `jax.vmap` maps it one call per element, as ``vmap_method='sequential'``.

    A `jax.custom_jvp` does the same in most programs, but not inside a custom VJP's forward pass
    under `lax.scan`: JAX's linearization of the scan inlines it, and forward over reverse (a
    Hessian-vector product) then meets the bare custom call. A primitive's JVP rule is always used."""
    from jax.extend.core import Primitive
    from jax.interpreters import ad, batching, mlir

    def run(*args, **params):
        return tuple(call(*args, **params))

    prim = Primitive(name)
    prim.multiple_results = True
    prim.def_impl(run)

    @functools.lru_cache(maxsize=512)
    def shapes_of(signature, params):
        shapes = jax.eval_shape(functools.partial(call, **dict(params)),
                                *(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in signature))
        return tuple((o.shape, o.dtype) for o in shapes)

    def abstract(*avals, **params):
        # Traced once per combination of operand types and parameters (a model binds the same
        # kernels in every layer), not at every bind.
        shapes = shapes_of(tuple((a.shape, a.dtype) for a in avals), tuple(sorted(params.items())))
        # The first operand's type but for shape and dtype: inside `jax.shard_map` the manual mesh
        # axes it varies over (`derivatives.bind` made every operand's alike); no sharding of its own.
        first = avals[0]
        return tuple(first.update(shape=shape, dtype=dtype, weak_type=False,
                                  sharding=first.sharding.update(spec=jax.sharding.PartitionSpec()))
                     for shape, dtype in shapes)

    prim.def_abstract_eval(abstract)
    mlir.register_lowering(prim, mlir.lower_fun(run, multiple_results=True))

    def jvp(primals, tangents, **params):
        tangents = [ad.instantiate_zeros(t) for t in tangents]
        return derivatives.bind(prim, *primals, **params), tuple(tangent(primals, tangents, **params))

    ad.primitive_jvps[prim] = jvp
    # The mapped arguments are sliced per element; the others are captured whole (stacking
    # copies of them would hold one copy per element).
    batching.primitive_batchers[prim] = derivatives.map_over_mapped(prim)
    return prim


def with_xla_derivatives(name: str, kernel, xla):
    """``kernel(*arrays, **params) -> array`` (a custom call) as a `differentiable_call` primitive
    whose value is the kernel's and whose tangent is that of ``xla(*arrays, **params)``, the same
    computation in XLA's ops: derivatives of any order in both modes, inside `lax.scan` too (as a
    `jax.custom_jvp` they failed there under forward over reverse), and `jax.vmap` one call per
    element. ``params`` are static (hashable) values."""
    def tangent(primals, tangents, **params):
        return (jax.jvp(functools.partial(xla, **params), tuple(primals), tuple(tangents))[1],)

    prim = differentiable_call(name, lambda *arrays, **params: (kernel(*arrays, **params),), tangent)

    def bind(*arrays, **params):
        return derivatives.bind(prim, *arrays, **params)[0]
    return bind


@jax.custom_jvp
def materialize(a):
    """a itself, by a custom call that returns its input buffer in place: XLA fuses no producer into
    the operation that reads the result. XLA:CPU fuses a transposed operand's producer (a ReLU or GELU
    recomputed under remat) into its transposing copy, which then runs ~10x slower than a copy of an
    array (bf16 [2048, 3072]: 8.8 against 0.9 ms). Call only where `available()` is True, on the CPU."""
    _check_available()
    return jax.ffi.ffi_call("transformer_jax_materialize", jax.ShapeDtypeStruct(a.shape, a.dtype),
                            input_output_aliases={0: 0}, vmap_method="broadcast_all")(a)


@materialize.defjvp
def _materialize_jvp(primals, tangents):
    return materialize(primals[0]), tangents[0]


def cache_write_xla(cache, new, index):
    """What `cache_write` computes, in XLA ops (the path off the CPU)."""
    write = jax.vmap(lambda c, x, i: jax.lax.dynamic_update_slice_in_dim(c, x, i, 1))
    return write(cache, jnp.swapaxes(new, 1, 2).astype(cache.dtype), index)


def cache_write(cache, new, index):
    """`new` [B, L, N, K] written into the heads-first cache [B, N, S, K] (float32 or bfloat16) at
    positions index[b] .. index[b] + L - 1 of each row b, a negative start counted from the end
    and a start past S - L moved back to S - L (as JAX's `dynamic_update_slice`): the updated
    cache, in the cache's own buffer where XLA can give it (only the new entries are written).
    Call only where `available()` is True, on the CPU (the model's path, with derivatives and
    other platforms, is `attention._native_cache_write`)."""
    if (cache.ndim != 4 or new.ndim != 4 or new.shape[0] != cache.shape[0] or new.shape[2] != cache.shape[1]
            or new.shape[3] != cache.shape[3] or new.shape[1] > cache.shape[2]):
        raise ValueError(f"cache_write: expected cache [B, N, S, K] and new [B, L, N, K] with L <= S, "
                         f"got {cache.shape} and {new.shape}")
    if cache.dtype not in CACHE_DTYPES:
        raise TypeError(f"cache_write: a float32 or bfloat16 cache, not {cache.dtype}")
    _check_available()
    index = jnp.broadcast_to(jnp.asarray(index, jnp.int32), (cache.shape[0],))
    out = jax.ShapeDtypeStruct(cache.shape, cache.dtype)
    return jax.ffi.ffi_call("transformer_jax_cache_write", out, input_output_aliases={0: 0},
                            vmap_method=VMAP)(
        cache, new.astype(cache.dtype), index)


def cache_reorder_xla(cache, rows, counts):
    """What `cache_reorder` computes, in XLA ops (the path off the CPU, and its derivative)."""
    rows, counts = jnp.asarray(rows), jnp.asarray(counts)
    positions = jnp.arange(cache.shape[-2])
    moved = (rows != jnp.arange(cache.shape[0]))[:, None] & (positions < counts[:, None])  # [R, S]
    moved = moved.reshape(moved.shape[:1] + (1,) * (cache.ndim - 3) + moved.shape[1:] + (1,))
    return jnp.where(moved, cache[rows], cache)


def cache_reorder(cache, rows, counts):
    """Row i of the cache [R, ..., S, K] (positions second to last) takes row ``rows[i]``'s first
    ``counts[i]`` positions (clipped to [0, S]), as ``cache[rows]`` would, in the cache's own
    buffer where XLA can give it: rows with ``rows[i] == i`` are not touched, nor are positions at
    or past ``counts[i]``, which keep row i's old entries (beam search gives each row its parent's
    length, and no step reads a position before writing it). A row index is taken as JAX's
    indexing takes it: negative from the end, then clamped. Any dtype. Call only where
    `available()` is True, on the CPU (the model's path, with derivatives and other platforms, is
    `KVCache.reorder_beams`)."""
    rows, counts = jnp.asarray(rows), jnp.asarray(counts)
    if cache.ndim < 3 or rows.shape != cache.shape[:1] or counts.shape != cache.shape[:1]:
        raise ValueError(f"cache_reorder: expected a cache [R, ..., S, K], rows [R] and counts [R], got "
                         f"{cache.shape}, {rows.shape} and {counts.shape}")
    _check_available()
    shape = cache.shape
    flat = cache.reshape(shape[0], -1, shape[-2], shape[-1])
    out = jax.ffi.ffi_call("transformer_jax_cache_reorder", jax.ShapeDtypeStruct(flat.shape, flat.dtype),
                           input_output_aliases={0: 0}, vmap_method=VMAP)(
        flat, rows.astype(jnp.int32), counts.astype(jnp.int32))
    return out.reshape(shape)


def greedy_choice(logits_t):
    """For float32 logits [V, B] (vocabulary-major): (index int32 [B] of each column's first
    maximum, log(sum(exp(logits - max))) float32 [B]), as decoding/sampling.py's XLA path for
    finite logits. A NaN makes the column's sum NaN and is passed over in the search for the
    maximum (V - 1 for a column of NaN). Call only where `available()` is True, on the CPU."""
    _check_available()
    if logits_t.ndim != 2 or logits_t.dtype != jnp.float32 or logits_t.shape[0] < 1:
        raise ValueError(f"greedy_choice: expected float32 logits [V, B], got "
                         f"{logits_t.dtype}{logits_t.shape}")
    batch = logits_t.shape[1]
    out = (jax.ShapeDtypeStruct((batch,), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.float32))
    return jax.ffi.ffi_call("transformer_jax_greedy_choice", out, vmap_method=VMAP)(logits_t)


def bias_activation_xla(y, bias, activation, dtype):
    """What `bias_activation` computes, in XLA ops: a projection's bias, its rounding to `dtype` and
    the activation after it (the kernel's gradient, and the path off the CPU)."""
    return activation_fn(activation)((y + bias.astype(jnp.float32)).astype(dtype))


def _bias_activation_call(y, bias, activation, dtype, rows_first):
    # The kernel reads the product's [O, R] output (y.T of `rows_matmul`'s result: no copy), or
    # with rows_first y [R, O] as `cols_matmul` writes it, and writes [R, O].
    return jax.ffi.ffi_call("transformer_jax_bias_activation", jax.ShapeDtypeStruct(y.shape, dtype),
                            vmap_method=VMAP)(
        y if rows_first else y.T, bias.astype(jnp.float32),
        activation=np.int32(ACTIVATION_CODES[activation]), rows_first=np.int32(rows_first))


def _bias_activation_any_layout_xla(y, bias, activation, dtype, rows_first):
    return bias_activation_xla(y, bias, activation, dtype)


def bias_activation(y, bias, activation: str, dtype, *, rows_first: bool = False):
    """act(round(y + bias)) for a product's float32 output y [R, O] (from `rows_matmul`, or with
    ``rows_first=True`` from `cols_matmul`, whose output is laid out rows first), bias [O]:
    the bias added in float32, the sum rounded to `dtype` (float32 or bfloat16), then the activation
    ('none', 'relu', 'gelu_tanh', 'silu'), as `bias_activation_xla` computes it: in bf16 bit for bit
    (every step rounded to bf16, as XLA does), in float32 within ~1e-6. Differentiable in both modes
    (the derivatives are `bias_activation_xla`'s); `jax.vmap` maps it one call per element.
    Call only where `available()` is True, on the CPU."""
    dtype = jnp.dtype(dtype)
    if activation not in ACTIVATION_CODES:
        raise ValueError(f"bias_activation: activation {activation!r}; the kernel computes "
                         f"{', '.join(ACTIVATION_CODES)}")
    if y.ndim != 2 or y.dtype != jnp.float32 or bias.shape != y.shape[1:]:
        raise ValueError(f"bias_activation: expected float32 y [R, O] and bias [O], got "
                         f"{y.dtype}{y.shape} and {bias.shape}")
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise TypeError(f"bias_activation: output float32 or bfloat16, not {dtype}")
    _check_available()
    return _bias_activation_p(y, bias, activation=activation, dtype=dtype, rows_first=bool(rows_first))


NORM_KINDS = ("layernorm", "rmsnorm")


def layer_norm_xla(x, scale, bias, eps: float, kind: str, dtype):
    """What `layer_norm` computes, in XLA ops, as the model's norms do (flax's LayerNorm with
    `use_fast_variance=False`; layers.RMSNorm): statistics in float32, the result rounded once."""
    x32 = x.astype(jnp.float32)
    scale = scale.astype(jnp.float32)
    if kind == "rmsnorm":
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return (y * scale).astype(dtype)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    centered = x32 - mean
    var = jnp.mean(centered * centered, axis=-1, keepdims=True)
    return (centered * (jax.lax.rsqrt(var + eps) * scale) + bias.astype(jnp.float32)).astype(dtype)


def _layer_norm_call(x, scale, bias, eps, kind, dtype):
    return jax.ffi.ffi_call("transformer_jax_layer_norm", jax.ShapeDtypeStruct(x.shape, dtype),
                            vmap_method=VMAP)(
        x, scale.astype(jnp.float32), bias.astype(jnp.float32), eps=np.float32(eps),
        rms=np.int32(kind == "rmsnorm"))


def layer_norm(x, scale, bias, eps: float, kind: str = "layernorm", dtype=None):
    """A few rows of x [R, D] (float32 or bfloat16) normalised over D with scale [D] and bias [D]
    (unused by 'rmsnorm'), as `layer_norm_xla` computes it: statistics in float32, the result
    rounded to `dtype` (x's by default; float32 or bfloat16) once. The sums run in another order
    than XLA's, so a bf16 result can differ from the XLA path's by one rounding step (rarely; see
    the tests). Differentiable in both modes (the derivatives are `layer_norm_xla`'s); `jax.vmap`
    maps it one call per element. Call only where `available()` is True, on the CPU."""
    dtype = jnp.dtype(dtype or x.dtype)
    if kind not in NORM_KINDS:
        raise ValueError(f"layer_norm: kind {kind!r}; the kernel computes {', '.join(NORM_KINDS)}")
    if x.ndim != 2 or scale.shape != x.shape[1:] or bias.shape != x.shape[1:]:
        raise ValueError(f"layer_norm: expected x [R, D], scale [D] and bias [D], got {x.shape}, "
                         f"{scale.shape} and {bias.shape}")
    if x.dtype not in CACHE_DTYPES or dtype not in CACHE_DTYPES:
        raise TypeError(f"layer_norm: x and the result must be float32 or bfloat16 (got {x.dtype}, {dtype})")
    _check_available()
    return _layer_norm_p(x, scale, bias, eps=float(eps), kind=kind, dtype=dtype)


# The kernels above as primitives whose derivatives are their XLA twins' (see with_xla_derivatives):
# the tangents (and, transposed, the gradients) are those of `cpu_kernels='xla'`.
_rows_matmul_p = with_xla_derivatives("transformer_jax_rows_matmul", _rows_matmul_call, _rows_matmul_xla)
_cols_matmul_p = with_xla_derivatives("transformer_jax_cols_matmul", _cols_matmul_call, _cols_matmul_xla)
_packed_matmul_p = with_xla_derivatives("transformer_jax_packed_matmul", _packed_matmul_call,
                                        packed_matmul_xla)
_packed_dense_p = with_xla_derivatives("transformer_jax_packed_dense", _packed_dense_call,
                                       _packed_dense_reshaped_xla)
_bias_activation_p = with_xla_derivatives("transformer_jax_bias_activation", _bias_activation_call,
                                          _bias_activation_any_layout_xla)
_layer_norm_p = with_xla_derivatives("transformer_jax_layer_norm", _layer_norm_call, layer_norm_xla)
