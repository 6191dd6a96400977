"""Training-step throughput and model FLOPs utilisation (MFU) of the library's models.

    python benchmarks/bench_model.py --model gpt2_small --dtype float32 --batch 8 --length 256

One step = forward, backward and an Adam update (optax), jitted, params and optimizer state donated,
dropout off (the step is deterministic; dropout adds RNG work but no matmul FLOPs). Random weights.

Model FLOPs (the MFU numerator, PaLM appendix B convention, counted per step):
    6 * (N_enc * source_tokens + N_dec * target_tokens)                       (matmuls, fwd + bwd)
  + 12 * layers * D * (keys seen) per query token for each attention kind     (QK^T and PV, fwd + bwd)
where N_* = the matmul parameters a token passes through (the tied embedding counts once, as the
output projection; the cross-attention key and value kernels count for source tokens; position
tables and norms are excluded), and 'keys seen' = the full key length
(causal masking is not discounted). For a decoder-only model this is 6*N*T + 12*layers*L*D*T.
MFU = model FLOPs / step time / the peak matmul FLOP/s measured in the same run and dtype.
`causal_share` = the same count with a causal self-attention's keys seen (L+1)/2 on average (the
work left to a kernel that skips masked blocks) over the count above: `mfu * causal_share` is
the MFU by that count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# The checkout ahead of any installed copy: `python benchmarks/<script>.py` runs this tree's code.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import transformer_jax as tj
from benchmarks.cli import positive_int
from benchmarks.hardware import peak_matmul_flops
from transformer_jax.params import build_model
from transformer_jax.training import losses


def _size(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def _keys(path) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", k))) for k in path]


def matmul_params(abstract_params, config) -> tuple[int, int, int]:
    """(N_enc, N_dec, N_cross_kv): matmul parameters of the encoder side, of the decoder side (with
    the output projection: the tied embedding, or the untied output matrix) and, among the latter,
    the cross-attention key and value kernels, which the source tokens pass through."""
    def is_cross_kv(keys):
        return "cross_attention" in keys and keys[-2] in ("key", "value")

    def stack(name, cross_kv=False):  # the kernels of one side: no norms, biases or position tables
        leaves = jax.tree_util.tree_leaves_with_path(abstract_params.get(name, {}))
        return sum(int(np.prod(x.shape)) for path, x in leaves
                   if _keys(path)[-1] == "kernel" and (not cross_kv or is_cross_kv(_keys(path))))

    embed = _size(abstract_params.get("embed", abstract_params.get("target_embed", {})))
    cross_kv = stack("decoder", cross_kv=True)
    return stack("encoder"), stack("decoder") + (embed if config.tie_output else 0), cross_kv


def model_flops(config, abstract_params, batch: int, source_len: int, target_len: int,
                causal: bool = False) -> float:
    """FLOPs of one training step (see the module docstring); `causal`: the decoder's
    self-attention counts only the keys a query may see, (target_len + 1) / 2 on average."""
    n_enc, n_dec, n_cross_kv = matmul_params(abstract_params, config)
    src_tokens, tgt_tokens = batch * source_len, batch * target_len
    # The cross-attention keys and values are projections of the source tokens.
    n_enc, n_dec = n_enc + n_cross_kv, n_dec - n_cross_kv
    HK = config.num_heads * config.qk_dim  # the width of the scores' products (d_model in the paper)
    keys_seen = (target_len + 1) / 2 if causal else target_len
    attention = 12 * config.num_decoder_layers * HK * keys_seen * tgt_tokens  # decoder self
    if config.num_encoder_layers:
        attention += 12 * config.num_encoder_layers * HK * source_len * src_tokens  # encoder self
        attention += 12 * config.num_decoder_layers * HK * source_len * tgt_tokens  # cross
    return 6 * (n_enc * src_tokens + n_dec * tgt_tokens) + attention


def make_batch(config, batch: int, length: int):
    rng = np.random.default_rng(0)
    draw = lambda: jnp.asarray(rng.integers(3, config.vocab_size, (batch, length), dtype=np.int32))
    if config.num_encoder_layers:
        return dict(inputs=draw(), targets=draw())
    return dict(targets=draw())


def make_train_step(model, tx, encoder_decoder: bool):
    def loss_fn(params, batch):
        targets = batch["targets"]
        decoder_in = jnp.pad(targets, ((0, 0), (1, 0)), constant_values=2)[:, :-1]
        if encoder_decoder:
            logits = model.apply({"params": params}, batch["inputs"], decoder_in)
        else:
            logits = model.apply({"params": params}, decoder_in)
        loss_sum, weight_sum, _ = losses.cross_entropy(logits, targets)  # the library's loss
        return loss_sum / weight_sum

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def abstract_state(model, config, batch):
    args = (batch["inputs"], batch["targets"]) if config.num_encoder_layers else (batch["targets"],)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), *args)["params"])
    return nn.meta.unbox(params)


def random_params(abstract_params, dtype):
    rng = np.random.default_rng(0)
    return jax.tree.map(
        lambda s: jnp.asarray((rng.standard_normal(s.shape, np.float32) * 0.02).astype(dtype)),
        abstract_params)


def bench_train(config, batch: int, length: int, *, steps: int = 5, peak_flops: float | None = None):
    """tokens/s (target tokens; source tokens too for encoder-decoder), step time, MFU."""
    model = build_model(config)
    data = make_batch(config, batch, length)
    abstract = abstract_state(model, config, data)
    params = random_params(abstract, config.param_dtype)
    tx = optax.adam(1e-4)
    opt_state = tx.init(params)
    step = make_train_step(model, tx, bool(config.num_encoder_layers))
    start = time.perf_counter()
    params, opt_state, loss = jax.block_until_ready(step(params, opt_state, data))
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        params, opt_state, loss = jax.block_until_ready(step(params, opt_state, data))
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    source_len = length if config.num_encoder_layers else 0
    flops = model_flops(config, abstract, batch, source_len, length)
    causal_flops = model_flops(config, abstract, batch, source_len, length, causal=True)
    tokens = batch * length * (2 if config.num_encoder_layers else 1)
    if peak_flops is None:
        peak_flops = peak_matmul_flops(config.dtype)
    return dict(
        dtype=config.dtype, batch=batch, length=length, params=_size(abstract),
        step_ms=round(step_s * 1e3, 1), step_ms_all=[round(t * 1e3, 1) for t in times],
        tokens_per_s=round(tokens / step_s, 1), model_tflops_per_step=round(flops / 1e12, 4),
        achieved_tflops=round(flops / step_s / 1e12, 4), mfu=round(flops / step_s / peak_flops, 3),
        achieved_flops=flops / step_s,  # unrounded, for ratios computed later
        causal_share=causal_flops / flops,
        first_step_s=round(compile_s, 2), loss=round(float(loss), 3),
    )


# The settings for speed. Layers under nn.scan: on XLA:CPU an unscanned stack's backward pass fuses
# the residual-stream gradient chain of every later layer into each earlier one and recomputes it per
# layer (GPT-2 small, f32: ~12.5 s against ~9.5 s per 8x256 step). remat='dots_saveable': recomputing
# the elementwise work in the backward pass is cheaper than stacking it in the scan (~8.4 s).
FAST = dict(dropout_rate=0.0, attention_dropout_rate=0.0, scan_layers=True, remat="dots_saveable")
PRESETS = {
    "gpt2_small": lambda **kw: tj.presets.gpt2_small(**FAST, **kw),
    "transformer_base": lambda **kw: tj.presets.transformer_base(**FAST, **kw),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2_small", choices=sorted(PRESETS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=positive_int, default=8)
    parser.add_argument("--length", type=positive_int, default=256)
    parser.add_argument("--steps", type=positive_int, default=5)
    args = parser.parse_args()
    config = PRESETS[args.model](dtype=args.dtype)
    print(json.dumps(dict(model=args.model, **bench_train(config, args.batch, args.length,
                                                            steps=args.steps)), indent=1))


if __name__ == "__main__":
    main()
