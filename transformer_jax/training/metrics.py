"""Training feedback: a progress bar, ``DIR/metrics.jsonl``, TensorBoard events, optional W&B.

TensorBoard's event files are written here without TensorFlow or the ``tensorboard`` package:
an event file is a sequence of TFRecords (length, masked CRC-32C of the length, payload, masked
CRC-32C of the payload) whose payloads are ``Event`` protocol buffers; we encode the few fields a
scalar needs by hand (``Event.wall_time/step/file_version/summary``, ``Summary.Value.tag/
simple_value``). Only process 0 writes anything.
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp

from transformer_jax.config import ModelConfig

# ------------------------------------------------------------------------------------ TensorBoard


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), the checksum TFRecord uses."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        bits, n = n & 0x7F, n >> 7
        out.append(bits | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire_type) + payload


def _length_delimited(number: int, data: bytes) -> bytes:
    return _field(number, 2, _varint(len(data)) + data)


_FLOAT32_MAX = 3.4028234663852886e38


def _float32(value) -> float:
    """``value`` as TensorBoard's float32 field holds it: beyond its range (a diverging run's
    perplexity, exp of a loss of 500) it is infinite, as a cast to float32 makes it
    (``struct.pack('<f')`` raised OverflowError, which ended the run with a traceback)."""
    value = float(value)
    return value if abs(value) <= _FLOAT32_MAX else math.copysign(math.inf, value)


def _json_value(value):
    """A value for metrics.jsonl, strict JSON: a non-finite number as the string "NaN",
    "Infinity" or "-Infinity" (``float()`` reads each back), where ``json.dumps`` wrote the bare
    NaN and Infinity that strict readers (jq, JavaScript, pandas' strict mode) refuse."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_value(v) for k, v in value.items()}
    return value


def encode_event(
    wall_time: float, step: int, *, scalars: dict[str, float] | None = None, file_version: str | None = None,
    session_start: bool = False,
) -> bytes:
    """An ``Event`` proto: wall_time=1 (double), step=2 (int64), file_version=3, summary=5,
    session_log=7 (``SessionLog.status`` START = 1: TensorBoard drops the steps from it on that
    earlier files logged, i.e. what a resumed run logs again)."""
    out = _field(1, 1, struct.pack("<d", wall_time)) + _field(2, 0, _varint(step))
    if file_version is not None:
        out += _length_delimited(3, file_version.encode())
    if session_start:
        out += _length_delimited(7, _field(1, 0, _varint(1)))
    if scalars:
        values = b"".join(
            _length_delimited(
                1, _length_delimited(1, tag.encode()) + _field(2, 5, struct.pack("<f", _float32(value)))
            )
            for tag, value in scalars.items()
        )
        out += _length_delimited(5, values)
    return out


def tfrecord(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", _masked_crc(length)) + data + struct.pack("<I", _masked_crc(data))


class EventWriter:
    """Appends scalar summaries to ``logdir/events.out.tfevents.<time>.<host>``."""

    def __init__(self, logdir: str):
        os.makedirs(logdir, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
        self.path = os.path.join(logdir, name)
        self._file = open(self.path, "ab")  # noqa: SIM115 (kept open for the run)
        self._file.write(tfrecord(encode_event(time.time(), 0, file_version="brain.Event:2")))

    def session_start(self, step: int) -> None:
        """Marks a restart from the checkpoint of ``step`` (a resumed run): TensorBoard forgets the
        steps after it that earlier files logged (it purges steps >= the marker's, hence step + 1)."""
        self._file.write(tfrecord(encode_event(time.time(), step + 1, session_start=True)))
        self._file.flush()

    def scalars(self, step: int, values: dict[str, float]) -> None:
        finite = {k: v for k, v in values.items() if isinstance(v, int | float)}
        self._file.write(tfrecord(encode_event(time.time(), step, scalars=finite)))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_events(path: str) -> list[bytes]:
    """The payloads of a TFRecord file, checksums verified (for tests)."""
    out = []
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        (length,) = struct.unpack_from("<Q", data, pos)
        (crc,) = struct.unpack_from("<I", data, pos + 8)
        if crc != _masked_crc(data[pos : pos + 8]):
            raise ValueError("bad length checksum")
        payload = data[pos + 12 : pos + 12 + length]
        (crc,) = struct.unpack_from("<I", data, pos + 12 + length)
        if crc != _masked_crc(payload):
            raise ValueError("bad payload checksum")
        out.append(payload)
        pos += 16 + length
    return out


# ------------------------------------------------------------------------------------ MFU

PEAK_TFLOPS = {  # dense bf16 per device, from the vendors' data sheets; keys are device_kind prefixes
    "TPU v4": 275.0,
    "TPU v5": 459.0,  # v5p reports itself as "TPU v5"
    "TPU v5p": 459.0,
    "TPU v5 lite": 197.0,
    "TPU v5e": 197.0,
    "TPU v6 lite": 918.0,
    "TPU v6e": 918.0,
    "NVIDIA H100": 989.0,  # SXM ("NVIDIA H100 80GB HBM3")
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA H100 NVL": 835.0,
    "NVIDIA H200": 989.0,
    "NVIDIA GH200": 989.0,
    "NVIDIA A100": 312.0,
}


def peak_tflops_per_device(override: float = 0.0, dtype="bfloat16") -> float | None:
    """``override`` if > 0, else looked up by ``jax.devices()[0].device_kind``; None if unknown.

    The table holds 16-bit peaks. A TPU runs float32 matmuls at the default precision as bf16
    passes, so they apply there to any compute ``dtype``; a GPU's float32 rate is another figure,
    so a float32 model on a GPU gets None (no MFU) unless ``override`` gives its peak."""
    if override > 0:
        return override
    kind = jax.devices()[0].device_kind
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16) and not kind.startswith("TPU"):
        return None
    # The longest matching prefix: "NVIDIA H100 PCIe" is not the SXM part, "TPU v5 lite" not v5p.
    names = [n for n in PEAK_TFLOPS if kind == n or kind[: len(n) + 1] in (n + " ", n + "-")]
    return PEAK_TFLOPS[max(names, key=len)] if names else None


def train_flops_per_step(cfg: ModelConfig, batch_size: int, target_len: int, source_len: int = 0) -> float:
    """Model FLOPs of one training step over padded rows: 6 x multiply-adds (forward 2, backward 4).

    Per token: projections ``2 D HK`` (q, o) + ``2 D GK`` (k, v; G = ``num_kv_heads``, so
    grouped-query attention's smaller k and v count at their size) + feed-forward ``2 D F`` (x1.5
    gated) per self-attention layer, attention ``2 L HK``; cross-attention ``2 D HK`` (q, o) per
    target token plus ``2 D GK`` (k, v) per source token and ``2 S HK``; the output projection
    ``D V``, V with any padding rows (``pad_vocab_multiple``), which the product computes (as
    `benchmarks/` counts them: the matmul parameters a token passes through).
    """
    d, hk, f = cfg.d_model, cfg.num_heads * cfg.qk_dim, cfg.d_ff
    gk = cfg.kv_heads * cfg.qk_dim  # the width of the k and v projections
    proj = 2 * d * hk + 2 * d * gk
    ff = 2 * d * f * (1.5 if cfg.activation in ("swiglu", "geglu") else 1.0)
    enc = cfg.num_encoder_layers * source_len * (proj + ff + 2 * source_len * hk)
    dec_self = target_len * (proj + ff + 2 * target_len * hk)
    cross = (target_len * (2 * d * hk + 2 * source_len * hk) + source_len * 2 * d * gk) if source_len else 0
    dec = cfg.num_decoder_layers * (dec_self + cross)
    return 6.0 * batch_size * (enc + dec + target_len * d * cfg.padded_vocab_size)


# ------------------------------------------------------------------------------------ the logger


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced by an object without it, or closed
        return False


class MetricsLogger:
    """Writes logged steps to metrics.jsonl, TensorBoard and (if enabled) W&B; drives the bar."""

    def __init__(
        self,
        workdir: str,
        total_steps: int,
        start_step: int = 0,
        *,
        use_wandb: bool = False,
        config: Any = None,
        progress: bool = True,
    ):
        self.primary = jax.process_index() == 0
        self._bar = self._events = self._wandb = self._jsonl = None
        if not self.primary:
            return
        os.makedirs(workdir, exist_ok=True)
        path = os.path.join(workdir, "metrics.jsonl")
        # Resumed, or started from step 0 over the records of a run killed before its first
        # checkpoint: the steps after start_step are trained (and logged) again, so their old
        # records go, or each would appear twice.
        restarted = start_step > 0 or os.path.exists(path)
        events = os.path.join(workdir, "tensorboard")
        try:
            if restarted:
                _drop_records_after(path, start_step)
            self._jsonl = open(path, "a")  # noqa: SIM115
            self._events = EventWriter(events)
            if restarted:
                self._events.session_start(start_step)
        except OSError as e:  # a full disk at a resume: one line naming the file, as in write()
            from transformer_jax.training.integrity import CheckpointWriteError

            if self._jsonl is not None:
                self._jsonl.close()
            raise CheckpointWriteError(
                e.errno, f"Cannot write the metrics log {path} or {events} ({e.strerror or e}). "
                f"Nothing was trained and the checkpoints are intact: free space (or fix permissions) "
                f"and rerun to resume."
            ) from e
        if use_wandb:
            self._wandb = _start_wandb(workdir, config)
        # A bar only on a terminal: written to a file (nohup, a batch scheduler's log) its frames
        # are carriage returns on one line, and the training figures were nowhere else on screen.
        if progress and _is_terminal(sys.stderr):
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                unit="step",
                dynamic_ncols=True,
                mininterval=1.0,
                smoothing=0.1,
            )

    def logged(self, step: int, prefix: str) -> bool:
        """Whether ``metrics.jsonl`` already holds a value named ``prefix...`` at ``step`` (a finished
        run started again evaluates its final step again; the record is written once)."""
        if self._jsonl is None:
            return False
        with open(self._jsonl.name) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if (isinstance(record, dict) and record.get("step") == step
                        and any(str(k).startswith(prefix) for k in record)):
                    return True
        return False

    def progress(self, step: int, **values: float) -> None:
        """The bar's figures, or without a bar one line: ``step N: loss 2.345, ...``."""
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in values.items()}, refresh=False)
            self._bar.refresh()
        else:
            self.message(f"step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in values.items()))

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.primary:
            return
        clean = {k: _plain(v) for k, v in metrics.items()}
        try:
            record = {"step": step, **{k: _json_value(v) for k, v in clean.items()}}
            self._jsonl.write(json.dumps(record, allow_nan=False) + "\n")
            self._jsonl.flush()
            self._events.scalars(step, {k: v for k, v in clean.items() if _is_number(v)})
        except OSError as e:  # disk full, or the workdir gone: one line naming the file, no traceback
            from transformer_jax.training.integrity import CheckpointWriteError

            raise CheckpointWriteError(
                e.errno, f"Cannot write the metrics of step {step} to {self._jsonl.name} or "
                f"{self._events.path} ({e.strerror or e}). The checkpoints written so far are intact "
                f"(a torn last metrics line is repaired on restart): free space and rerun to resume."
            ) from e
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def message(self, text: str) -> None:
        if not self.primary:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        for thing in (self._bar, self._events, self._jsonl):
            if thing is not None:
                thing.close()
        if self._wandb is not None:
            self._wandb.finish()


def _drop_records_after(path: str, step: int) -> None:
    """Rewrites metrics.jsonl without the records of steps after ``step`` (atomically)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    keep = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a torn last line (repair_jsonl has normally removed it)
        if not (isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step):
            keep.append(line if line.endswith("\n") else line + "\n")
    if len(keep) == len(lines):
        return
    from transformer_jax.training.integrity import write_atomically

    write_atomically(path, lambda f: f.writelines(keep))  # a full disk leaves no .tmp file behind


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    return value


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _start_wandb(workdir: str, config: Any):
    try:
        import wandb
    except ImportError:
        print("config.use_wandb=True but wandb is not installed (pip install wandb); skipping it.")
        return None
    return wandb.init(
        dir=workdir,
        config=config.to_dict() if config is not None else None,
        name=os.path.basename(os.path.abspath(workdir)),
        resume="allow",
    )
