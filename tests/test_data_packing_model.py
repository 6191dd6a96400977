"""A packed row gives every example the same loss as the example alone in its own row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import transformer_jax as tj
from transformer_jax.data import packing
from transformer_jax.modeling.masks import shift_right

RNG = np.random.default_rng(0)


def _examples(n, lo, hi, vocab):
    return [list(RNG.integers(4, vocab, RNG.integers(lo, hi))) + [1] for _ in range(n)]


def _token_nll(logits, targets):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]


def _per_example(nll, seg):
    nll, seg = np.asarray(nll), np.asarray(seg)
    return [nll[r][seg[r] == s].sum() for r in range(len(seg)) for s in range(1, seg[r].max() + 1)]


def _rows(examples, lengths, pack):
    if pack:
        groups, cur, used = [], [], dict.fromkeys(lengths, 0)
        for ex in examples:  # greedy: fill a row, then start the next
            if any(used[k] + len(ex[k]) > lengths[k] for k in lengths):
                groups.append(cur)
                cur, used = [], dict.fromkeys(lengths, 0)
            cur.append(ex)
            used = {k: used[k] + len(ex[k]) for k in lengths}
        groups.append(cur)
    else:
        groups = [[ex] for ex in examples]
    rows = [packing.make_row(g, lengths) for g in groups]
    return {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}


@pytest.mark.parametrize("position", ["sinusoidal", "rope"])
def test_decoder_only_packed_equals_unpacked(position):
    cfg = tj.presets.tiny(position=position)
    lm = tj.TransformerLM(cfg)
    examples = [{"targets": t} for t in _examples(6, 3, 9, cfg.vocab_size)]
    params = jax.jit(lm.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    losses = []
    for pack in (True, False):
        b = _rows(examples, {"targets": 24}, pack)
        seg = b["targets_segment_ids"]
        inputs = shift_right(b["targets"], seg, start_id=cfg.decoder_start_id)
        logits = jax.jit(lm.apply)({"params": params}, inputs, segment_ids=seg,
                                   positions=b["targets_positions"])
        losses.append(_per_example(_token_nll(logits, b["targets"]), seg))
    assert len(_rows(examples, {"targets": 24}, True)["targets"]) < len(examples)
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5, atol=1e-5)


def test_encoder_decoder_packed_equals_unpacked():
    cfg = tj.presets.tiny()
    model = tj.Transformer(cfg)
    srcs, tgts = _examples(5, 2, 8, cfg.vocab_size), _examples(5, 2, 7, cfg.vocab_size)
    examples = [{"inputs": s, "targets": t} for s, t in zip(srcs, tgts)]
    lengths = {"inputs": 20, "targets": 18}
    params = jax.jit(model.init)(jax.random.key(1), jnp.zeros((1, 8), jnp.int32),
                                 jnp.zeros((1, 8), jnp.int32))["params"]
    losses = []
    for pack in (True, False):
        b = _rows(examples, lengths, pack)
        seg = b["targets_segment_ids"]
        tgt_in = shift_right(b["targets"], seg, start_id=cfg.decoder_start_id)
        logits = jax.jit(model.apply)({"params": params}, b["inputs"], tgt_in,
                             src_segment_ids=b["inputs_segment_ids"], tgt_segment_ids=seg,
                             src_positions=b["inputs_positions"],
                             tgt_positions=b["targets_positions"])
        losses.append(_per_example(_token_nll(logits, b["targets"]), seg))
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5, atol=1e-5)
