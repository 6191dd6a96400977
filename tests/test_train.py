"""Training: one step, a falling loss, equal losses on 1 device and on data / FSDP / tensor meshes,
the non-finite guard, config errors, TensorBoard files, and two processes running train.py."""

import copy
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from full_disk import full_disk_open
from processes import GLOO_DEADLINE, child_xla_flags, free_port

from configs import tiny
from transformer_jax import host_memory, parallel
from transformer_jax.config import ConfigError, ModelConfig
from transformer_jax.data import build_datasets
from transformer_jax.params import build_model
from transformer_jax.training import check_config, evaluate, loop, metrics, steps, train_and_evaluate
from transformer_jax.training.checkpoint import Checkpointer
from transformer_jax.training.optimizer import create_optimizer
from transformer_jax.training.schedules import create_schedule
from transformer_jax.training.state import create_train_state
from transformer_jax.training.steps import settings_from_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(tempfile.gettempdir(), "transformer_jax_test_xla_cache")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


def tiny_config(data_dir, **overrides):
    config = tiny.get_config()
    config.dataset.data_dir = data_dir
    config.compilation_cache_dir = CACHE  # shared by the tests: each program compiles once
    for key, value in overrides.items():
        target = config
        *parents, leaf = key.split(".")
        for p in parents:
            target = target[p]
        target[leaf] = value
    return config


def read_jsonl(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_losses(workdir):
    """{step: loss}, the last record of each step (a resumed run logs some steps twice)."""
    return {r["step"]: r["loss"] for r in read_jsonl(workdir) if "loss" in r}


def _pieces(config, mesh):
    """(model, initial state, jitted train step, jitted eval step), as the training loop builds them."""
    model_cfg = ModelConfig.from_dict(config.model.to_dict())
    model = build_model(model_cfg)
    tx = create_optimizer(config.optimizer, model_cfg.d_model, config.num_train_steps)
    schedule = create_schedule(config.optimizer, model_cfg.d_model, config.num_train_steps)
    state, shardings = create_train_state(model, tx, mesh, config.seed)
    step, eval_step = loop._compile_steps(model, tx, schedule, settings_from_config(config), shardings, mesh)
    return model, state, step, eval_step


def _unpack(batch):
    """Every packed segment as its own zero-padded row: (sources, targets, source and target lengths)."""
    seg = batch["targets_segment_ids"]
    rows = [(r, s) for r in range(seg.shape[0]) for s in np.unique(seg[r]) if s > 0]
    width = batch["targets"].shape[1]
    src = np.zeros((len(rows), width), np.int32)
    tgt = np.zeros((len(rows), width), np.int32)
    src_len, tgt_len = np.zeros(len(rows), np.int32), np.zeros(len(rows), np.int32)
    for i, (r, s) in enumerate(rows):
        a = batch["inputs"][r][batch["inputs_segment_ids"][r] == s]
        b = batch["targets"][r][batch["targets_segment_ids"][r] == s]
        src[i, : len(a)], tgt[i, : len(b)], src_len[i], tgt_len[i] = a, b, len(a), len(b)
    return src, tgt, src_len, tgt_len


def _paper_loss(model, params, batch, label_smoothing):
    """(summed loss, token count) of a packed batch written out from the paper, sharing nothing with
    training/steps.py or losses.py but the model: each segment unpacked into its own row, the decoder
    fed <start> + the target but its last token (by hand), and the label-smoothed loss as
    KL(q || p) with q = 1 - eps on the target and eps / (V - 1) elsewhere, over an explicit q."""
    import jax.numpy as jnp

    src, tgt, src_len, tgt_len = _unpack(batch)
    dec_in = np.concatenate([np.full((len(tgt), 1), model.config.decoder_start_id, np.int32), tgt[:, :-1]], 1)
    width = tgt.shape[1]
    src_seg = (np.arange(width) < src_len[:, None]).astype(np.int32)
    tgt_seg = (np.arange(width) < tgt_len[:, None]).astype(np.int32)
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), src.shape)
    logits = model.apply({"params": params}, src, dec_in, src_segment_ids=src_seg, tgt_segment_ids=tgt_seg,
                         src_positions=positions, tgt_positions=positions)
    log_p = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    vocab = log_p.shape[-1]
    q = jnp.where(jax.nn.one_hot(tgt, vocab) > 0, 1.0 - label_smoothing, label_smoothing / (vocab - 1))
    per_token = jnp.sum(jnp.where(q > 0, q * jnp.log(q), 0.0) - q * log_p, axis=-1)
    return jnp.sum(per_token * tgt_seg), int(tgt_seg.sum())


def test_train_and_eval_losses_and_gradient_norm_equal_the_paper_written_out(data_dir, tmp_path):
    """One train step: its loss and gradient norm, and evaluate_loss over two batches, against the
    loss of section 5.4 computed by hand on unpacked rows; the step's learning rate; every parameter
    moved. Training on unshifted targets (the decoder seeing the token it predicts), no label
    smoothing, counted padding, per-batch means or gradients left unnormalised each passed every
    other training test."""
    config = tiny_config(data_dir)
    eps = config.optimizer.label_smoothing
    assert eps == 0.1
    data = build_datasets(config.dataset, str(tmp_path))
    mesh = parallel.create_mesh(1, 1, 1, jax.devices()[:1])
    model, state, step, eval_step = _pieces(config, mesh)
    batches = [next(data.train_iter) for _ in range(2)]
    params = nn.unbox(jax.device_get(state.params))  # without the logical-partitioning boxes

    def mean_loss(p, batch):
        total, count = _paper_loss(model, p, batch, eps)
        return total / count

    want_loss, grads = jax.jit(jax.value_and_grad(lambda p: mean_loss(p, batches[0])))(params)
    with parallel.sharding_context(mesh):
        got_eval = evaluate.evaluate_loss(eval_step, state.params, batches, mesh)
        new, m = step(state, parallel.shard_batch(batches[0], mesh))  # (donates state)
    m = jax.device_get(m)
    assert int(new.step) == 1 and m["finite"] == 1.0
    assert m["learning_rate"] == pytest.approx(3e-3 / 5)  # step 1 of a 5-step warm-up
    changed = jax.tree.map(lambda a, b: not np.allclose(a, b), params, nn.unbox(jax.device_get(new.params)))
    assert all(jax.tree.leaves(changed))
    assert m["num_tokens"] == np.count_nonzero(batches[0]["targets_segment_ids"])
    assert m["real_tokens"] == m["num_tokens"] + np.count_nonzero(batches[0]["inputs_segment_ids"])
    np.testing.assert_allclose(m["loss"], want_loss, rtol=1e-5)
    np.testing.assert_allclose(m["grad_norm"], float(optax_global_norm(grads)), rtol=1e-4)
    sums = [(jax.jit(lambda p, b=b: _paper_loss(model, p, b, eps)[0])(params), _paper_loss_count(b))
            for b in batches]
    want_eval = sum(float(t) for t, _ in sums) / sum(n for _, n in sums)  # token-weighted, not per batch
    np.testing.assert_allclose(got_eval["eval_loss"], want_eval, rtol=1e-5)


def _paper_loss_count(batch):
    return int(np.count_nonzero(batch["targets_segment_ids"]))


def optax_global_norm(tree):
    return np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(tree)))


def test_the_seed_sets_the_initial_parameters_and_the_dropout_key(tmp_path, monkeypatch):
    """config.seed decides the initial state (create_train_state's init, compiled once with the seed
    as an argument): the same seed gives the same parameters and base dropout key, another seed
    other parameters and another key (a run whose seed was ignored could not be varied); and
    train_and_evaluate builds its state with config.seed."""
    import optax

    from transformer_jax.training import state as state_lib

    model = build_model(ModelConfig(vocab_size=16, d_model=8, num_heads=2, d_ff=16, num_encoder_layers=1,
                                    num_decoder_layers=1, max_len=8))
    mesh = parallel.create_mesh(data=-1)
    states = [jax.device_get(state_lib.create_train_state(model, optax.sgd(0.1), mesh, seed)[0])
              for seed in (0, 0, 1, 2**32, -(2**63))]
    same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    assert same(states[0], states[1])
    # Seeds that differ only above the low 32 bits differ too (jax.random.PRNGKey kept those alone).
    for other in states[2:]:
        assert not np.allclose(states[0].params["embed"]["embedding"], other.params["embed"]["embedding"])
        assert not np.array_equal(states[0].rng, other.rng)
    assert int(states[2].step) == 0

    seeds = []

    def record(model, tx, mesh, seed=0, loss_scale=None, shardings=None, rules=None):
        seeds.append(seed)
        raise KeyboardInterrupt  # the run ends here

    monkeypatch.setattr(loop, "create_train_state", record)
    config = tiny.get_config()
    config.seed = 7
    with pytest.raises(KeyboardInterrupt):
        train_and_evaluate(config, str(tmp_path))
    assert seeds == [7]


def _losses_on(mesh, config, batches):
    _, state, step, _ = _pieces(config, mesh)
    out = []
    with parallel.sharding_context(mesh):
        for batch in batches:
            state, m = step(state, parallel.shard_batch(batch, mesh))
            out.append(float(m["loss"]))
    return out


def test_meshes_give_the_same_losses(data_dir, tmp_path):
    config = tiny_config(data_dir)
    data = build_datasets(config.dataset, str(tmp_path))
    batches = [next(data.train_iter) for _ in range(4)]
    devices = jax.devices()
    reference = _losses_on(parallel.create_mesh(1, 1, 1, devices[:1]), config, batches)
    assert reference[-1] < reference[0]
    # data + FSDP + tensor parallel at once (pure data parallelism over 8 devices is compared with
    # one device in test_checkpoint.py's restore onto another mesh)
    mesh = parallel.create_mesh(2, 2, 2)
    losses = _losses_on(mesh, config, batches)
    np.testing.assert_allclose(losses, reference, rtol=2e-5, err_msg="mesh (2, 2, 2)")
    # No activation is gathered whole across the batch: the embedding lookup from a table split over
    # fsdp and tensor once came out split on its embedding axis, and XLA replicated it (and its
    # gradient) to reach the batch's sharding ("Involuntary full rematerialization").
    _, state, step, _ = _pieces(config, mesh)
    with parallel.sharding_context(mesh):
        hlo = step.lower(state, parallel.shard_batch(batches[0], mesh)).compile().as_text()
    global_batch = "{},{}".format(*batches[0]["targets"].shape)
    kinds = "all-gather|all-reduce|all-to-all|collective-permute"
    collectives = re.findall(rf"= \w+\[([\d,]*)\][^=]*? (?:{kinds})\(", hlo)
    assert collectives and not [c for c in collectives if c.startswith(global_batch)], collectives


def test_short_run_loss_falls_and_writes_everything(data_dir, tmp_path):
    workdir = str(tmp_path / "run")
    config = tiny_config(
        data_dir,
        num_train_steps=40,
        log_every_steps=5,
        eval_every_steps=20,
        checkpoint_every_steps=20,
        test_split="test",
    )
    config.dataset.max_eval_examples = 16
    final = train_and_evaluate(config, workdir)
    losses = train_losses(workdir)
    assert losses[40] < 0.7 * losses[5], losses
    records = read_jsonl(workdir)
    assert {"learning_rate", "grad_norm", "tokens_per_sec", "accuracy"} <= set(records[0])
    assert any("eval_loss" in r for r in records) and "test_bleu" in final
    assert 0.0 <= final["test_exact_match"] <= 1.0 and final["test_examples"] == 16
    assert final["step"] == 40 and final["eval_loss"] < losses[5]
    with open(os.path.join(workdir, "config.json")) as f:
        assert json.load(f)["model"]["d_model"] == 32
    assert os.path.exists(os.path.join(workdir, "tokenizer.model"))
    (events,) = os.listdir(os.path.join(workdir, "tensorboard"))
    payloads = metrics.read_events(os.path.join(workdir, "tensorboard", events))
    assert b"brain.Event:2" in payloads[0] and any(b"eval_loss" in p for p in payloads)


def test_logging_evaluation_and_checkpoints_follow_their_periods_and_the_last_step(data_dir, tmp_path):
    """7 steps, logging every 3, evaluating every 4, checkpointing every 3: each happens at its
    multiples and at the last step. A window's tokens_per_sec / steps_per_sec is its mean count of
    real (non-padding) source and target tokens per step, counted here from the same batches."""
    workdir = str(tmp_path / "run")
    config = tiny_config(data_dir, num_train_steps=7, log_every_steps=3, eval_every_steps=4,
                         checkpoint_every_steps=3, max_checkpoints_to_keep=None)
    config.dataset.max_eval_examples = 16
    train_and_evaluate(config, workdir)
    records = read_jsonl(workdir)
    logged = {r["step"]: r for r in records if "loss" in r}
    assert sorted(logged) == [3, 6, 7]
    assert [r["step"] for r in records if "eval_loss" in r] == [4, 7]
    assert Checkpointer(workdir, read_only=True).all_steps() == [3, 6, 7]
    data = build_datasets(config.dataset, workdir)
    per_step = []
    for _ in range(7):
        batch = next(data.train_iter)
        per_step.append(sum(int((batch[k] > 0).sum()) for k in ("inputs_segment_ids", "targets_segment_ids")))
    assert min(per_step) < batch["inputs"].size + batch["targets"].size  # padding to leave out
    for step, first in [(3, 0), (6, 3), (7, 6)]:
        ratio = logged[step]["tokens_per_sec"] / logged[step]["steps_per_sec"]
        assert ratio == pytest.approx(np.mean(per_step[first:step]), rel=1e-9), step


def test_a_window_times_its_steps_without_an_evaluation_or_the_compilation_in_it(
        data_dir, tmp_path, monkeypatch, caplog):
    """Logging every 3 steps, evaluating every 4 (not a multiple): the window of steps 4..6 holds an
    evaluation. On a clock that moves 1 s per train step and 100 s per evaluation, every window ran
    at 1 step/s; resetting the window's start after the evaluation timed steps 4..6 over 2 s (the
    steps after it) and logged 1.5 steps/s, and tokens/s and MFU as much too high.

    The train step's compilation (50 s on this clock) is timed apart and logged with the first
    window as compile_seconds; counted in it, the first window logged 3 steps over 53 s. The step is
    lowered once: its first call finds the ahead-of-time compiled program."""

    class Clock:
        now = 0.0

        def time(self):
            return self.now

    clock = Clock()
    to_global_batch, evaluate_loss = loop.to_global_batch, loop.evaluate.evaluate_loss

    def one_step(*args, **kwargs):  # called once per train step
        clock.now += 1.0
        return to_global_batch(*args, **kwargs)

    def slow_evaluation(*args, **kwargs):
        result = evaluate_loss(*args, **kwargs)
        clock.now += 100.0
        return result

    compile_program = jax.stages.Lowered.compile

    def slow_compile(self, *args, **kwargs):
        result = compile_program(self, *args, **kwargs)
        clock.now += 50.0
        return result

    save = loop.ckpt_lib.Checkpointer.save

    def slow_save(*args, **kwargs):  # the save's blocking part (200 s) fell in the next window
        result = save(*args, **kwargs)
        clock.now += 200.0
        return result

    monkeypatch.setattr(loop, "time", clock)
    monkeypatch.setattr(loop, "to_global_batch", one_step)
    monkeypatch.setattr(loop.evaluate, "evaluate_loss", slow_evaluation)
    monkeypatch.setattr(jax.stages.Lowered, "compile", slow_compile)
    monkeypatch.setattr(loop.ckpt_lib.Checkpointer, "save", slow_save)
    workdir = str(tmp_path / "run")
    config = tiny_config(data_dir, num_train_steps=7, log_every_steps=3, eval_every_steps=4,
                         checkpoint_every_steps=4, test_split="", peak_tflops=1.0)
    config.dataset.max_eval_examples = 16
    with jax.log_compiles(), caplog.at_level("WARNING"):
        train_and_evaluate(config, workdir)
    logged = {r["step"]: r for r in read_jsonl(workdir) if "loss" in r}
    assert sorted(logged) == [3, 4, 6, 7]  # (a checkpoint ends a window)
    for step in (3, 4, 6, 7):
        assert logged[step]["steps_per_sec"] == pytest.approx(1.0), step
    assert logged[6]["mfu"] == pytest.approx(logged[3]["mfu"])
    assert logged[3]["compile_seconds"] == 50.0
    assert "compile_seconds" not in logged[6] and "compile_seconds" not in logged[7]
    messages = [r.getMessage() for r in caplog.records]
    lowered = [m for m in messages if m.startswith("Compiling jit(train_step)")]
    assert len(lowered) == 1, lowered


def test_mfu_of_a_run_on_part_of_the_devices_divides_by_the_mesh_s_devices(data_dir, tmp_path):
    """train_and_evaluate(mesh=...) over 1 of the 8 devices: the MFU is the model FLOPs per second
    over that one device's peak; dividing by all 8 devices' peak logged it 8x too low."""
    workdir = str(tmp_path / "run")
    config = tiny_config(data_dir, num_train_steps=2, log_every_steps=2, eval_every_steps=2,
                         checkpoint_every_steps=2, test_split="", peak_tflops=0.5)
    config.dataset.max_eval_examples = 16
    one = parallel.create_mesh(1, 1, 1, jax.devices()[:1])
    train_and_evaluate(config, workdir, mesh=one)
    (record,) = [r for r in read_jsonl(workdir) if "loss" in r]
    ds = config.dataset
    flops = metrics.train_flops_per_step(ModelConfig.from_dict(config.model.to_dict()), ds.batch_size,
                                         ds.max_target_len, ds.max_source_len)
    assert jax.device_count() == 8
    assert record["mfu"] == pytest.approx(flops * record["steps_per_sec"] / 0.5e12, rel=1e-6)


def test_a_profile_window_past_the_last_step_still_writes_its_trace(data_dir, tmp_path):
    """The trace is written only when stopped: a window reaching past num_train_steps (steps 1..10 of
    a 3-step run) was never stopped and left DIR/profile without a trace; a window of 0 steps
    stopped a trace not yet started (RuntimeError at that step), now a config error."""
    workdir = str(tmp_path / "run")
    config = tiny_config(data_dir, num_train_steps=3, profile_start_step=1, profile_num_steps=10)
    train_and_evaluate(config, workdir)
    written = [f for _, _, files in os.walk(os.path.join(workdir, "profile")) for f in files]
    assert any(f.endswith(".xplane.pb") for f in written), written
    config.profile_num_steps = 0
    with pytest.raises(ConfigError, match=r"config.profile_num_steps=0 must be an integer >= 1"):
        check_config(config)


def test_bleu_references_and_sources_are_not_cut_at_the_training_lengths(data_dir, tmp_path,
                                                                         monkeypatch):
    """BLEU and exact match compare with the whole reference, not the reference cut at the
    training targets' max_target_len (sacreBLEU scores the real text); and translate the whole
    source, not the source cut at max_source_len (half a sentence scored against a whole one):
    only at the model's own max_len, and then the log says how many were cut."""
    import types

    from transformer_jax.training import evaluate

    seen, sources, messages = [], [], []

    def fake_translate(model, params, batches, tokenizer, mesh, **kwargs):
        def texts(key):
            return [t for t in (tokenizer.decode([int(i) for i in row if i > 1])
                                for b in batches for row in b[key]) if t]
        seen.append(texts("targets"))
        sources.append(texts("inputs"))
        settings.append(kwargs)
        return evaluate.Translations(seen[-1], seen[-1], seen[-1])

    settings = []

    monkeypatch.setattr(evaluate, "translate", fake_translate)
    log = type("Log", (), {"message": lambda self, text: messages.append(text)})()
    for max_len in (64, 6):
        config = tiny_config(data_dir, **{"dataset.max_target_len": max_len,
                                          "dataset.max_source_len": max_len, "dataset.max_eval_examples": 16})
        data = build_datasets(config.dataset, str(tmp_path))
        model = types.SimpleNamespace(config=types.SimpleNamespace(max_len=64))
        out = loop._translation_eval(config, str(tmp_path), model, None, data, None, "test", log, 1)
        assert out["test_examples"] == 16
    assert seen[1] == seen[0] and max(len(r.split()) for r in seen[0]) > 5
    assert sources[1] == sources[0] and max(len(r.split()) for r in sources[0]) > 5
    assert "were cut" not in messages[-1]
    model = types.SimpleNamespace(config=types.SimpleNamespace(max_len=5))  # a model of 5 positions
    loop._translation_eval(config, str(tmp_path), model, None, data, None, "test", log, 1)
    assert sources[-1] != sources[0]
    assert re.search(r"; \d+ sources cut to 6 tokens\n", messages[-1]), messages[-1]
    # the decoding settings: decode_max_len (0: max_target_len) and decode_extra_len (-1: None)
    assert [s["max_new_tokens"] for s in settings] == [64, 6, 6] and settings[0]["extra_len"] is None
    config.decode_max_len, config.decode_extra_len, config.beam_size, config.beam_alpha = 40, 50, 3, 0.7
    loop._translation_eval(config, str(tmp_path), model, None, data, None, "test", log, 1)
    assert settings[-1] == dict(max_new_tokens=40, beam_size=3, alpha=0.7, extra_len=50, stop=None,
                                rules=None)


def test_a_test_split_the_dataset_lacks_is_an_error_before_training(data_dir, tmp_path):
    from transformer_jax.data import DataError

    config = tiny_config(data_dir, test_split="newstest2099")
    with pytest.raises(DataError, match=r"no split 'newstest2099' \(config.test_split\); it has"):
        train_and_evaluate(config, str(tmp_path))
    assert not os.path.exists(tmp_path / "checkpoints")


def test_tfrecord_checksums():
    assert metrics.crc32c(b"123456789") == 0xE3069283  # the standard CRC-32C check value
    assert metrics.encode_event(0.0, 5)[:9] == b"\x09" + b"\x00" * 8  # field 1, double 0.0
    assert metrics.train_flops_per_step(ModelConfig(), 1, 10, 10) > 0


def test_tfrecord_checksums_are_masked_as_tensorflow_masks_them():
    """TFRecord stores masked CRC-32C values: rotated right by 15 bits, plus 0xa282ead8 (TensorFlow's
    crc32c::Mask). read_events unmasks with the same code, so only fixed bytes catch a wrong mask
    (which TensorBoard would refuse as corrupt)."""
    record = metrics.tfrecord(b"123456789")
    assert record[:8] == struct.pack("<Q", 9) and record[12:21] == b"123456789"
    # crc32c = 0xe3069283 -> rotated right 15 bits: 0x2507c60d -> + 0xa282ead8 = 0xc78ab0e5
    assert record[21:] == struct.pack("<I", 0xC78AB0E5)


def test_train_flops_count_every_matmul():
    """6 x the multiply-adds of D=4, h*d_k=4, d_ff=8, V=10, one encoder and one decoder layer, S=5
    source and T=3 target tokens, counted matmul by matmul:
    encoder, per source token: q, k, v, o 4*4*4 = 64, feed-forward 2*4*8 = 64, QK^T and AV
    2*5*4 = 40: 168 * 5 = 840; decoder self-attention, per target token 64 + 64 + 2*3*4 = 152:
    456; cross-attention: q, o 2*4*4 = 32 plus QK^T, AV 2*5*4 = 40 per target token (216) and k, v
    32 per source token (160): 376; output projection 3*4*10 = 120. Together 1792."""
    cfg = ModelConfig(vocab_size=10, d_model=4, num_heads=2, d_ff=8, num_encoder_layers=1,
                      num_decoder_layers=1)
    assert metrics.train_flops_per_step(cfg, 2, 3, 5) == 6 * 2 * 1792
    lm = cfg.replace(num_encoder_layers=0)  # decoder-only: self-attention blocks and the output
    assert metrics.train_flops_per_step(lm, 1, 3) == 6 * (456 + 120)
    # a gated feed-forward (three D x F matrices) adds 2*4*8 / 2 = 32 per token
    assert metrics.train_flops_per_step(lm.replace(activation="swiglu"), 1, 3) == 6 * (456 + 120 + 3 * 32)


def test_train_flops_count_grouped_query_key_and_value_projections_at_their_size():
    """The model above with num_kv_heads=1 (multi-query: k and v are D x 1*d_k = 4 x 2): per token
    q, o 2*4*4 = 32 and k, v 2*4*2 = 16, 48 instead of 64. Encoder 5 source tokens save 16 each
    (80), decoder self-attention 3 target tokens 48, cross-attention k, v of the 5 source tokens
    80: 1792 - 208 = 1584. Counting k and v at the query heads' width gave 1792, an MFU 13% too
    high here; the count agrees with the model's own kernel sizes."""
    cfg = ModelConfig(vocab_size=10, d_model=4, num_heads=2, d_ff=8, num_encoder_layers=1,
                      num_decoder_layers=1, num_kv_heads=1)
    assert metrics.train_flops_per_step(cfg, 2, 3, 5) == 6 * 2 * 1584
    lm = cfg.replace(num_encoder_layers=0)
    assert metrics.train_flops_per_step(lm, 1, 3) == 6 * (456 - 48 + 120)
    # the same from the model's kernels: per token its q, k, v, o parameters, feed-forward 2*4*8,
    # QK^T and AV 2*3*4, output projection 4*10
    model = build_model(lm)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), np.ones((1, 3), np.int32)))["params"]
    attention = nn.meta.unbox(params)["decoder"]["layer_0"]["self_attention"]
    kernels = sum(int(np.prod(p["kernel"].shape)) for p in attention.values())
    assert kernels == 48
    assert metrics.train_flops_per_step(lm, 1, 3) == 6 * 3 * (kernels + 2 * 4 * 8 + 2 * 3 * 4 + 4 * 10)


def test_non_finite_values_reach_metrics_jsonl_but_not_tensorboard(tmp_path):
    """metrics.jsonl is strict JSON: a non-finite value is the string "NaN" / "Infinity" (bare
    NaN, which strict readers refuse, before). A finite value beyond float32's range (a diverging
    run's perplexity) is infinite in TensorBoard's float32 field: it ended the run with an
    OverflowError traceback, its jsonl record written and its event not."""
    log = metrics.MetricsLogger(str(tmp_path), 10, progress=False)
    log.write(3, {"loss": float("nan"), "learning_rate": 0.5, "grad_norm": float("-inf")})
    log.write(4, {"loss": 477.0, "perplexity": 6.8e217})
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    refuse = lambda constant: pytest.fail(f"not strict JSON: {constant}")  # noqa: E731
    first, second = (json.loads(line, parse_constant=refuse) for line in lines)
    assert first == {"step": 3, "loss": "NaN", "learning_rate": 0.5, "grad_norm": "-Infinity"}
    assert np.isnan(float(first["loss"])) and second["perplexity"] == 6.8e217
    (events,) = os.listdir(tmp_path / "tensorboard")
    third, fourth = metrics.read_events(str(tmp_path / "tensorboard" / events))[-2:]
    assert b"learning_rate" in third and struct.pack("<f", 0.5) in third and b"loss" not in third
    assert struct.pack("<f", float("inf")) in fourth and struct.pack("<f", 477.0) in fourth


def test_a_resume_on_a_full_disk_is_one_error_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    """A resume drops the records logged after its checkpoint by rewriting metrics.jsonl. On a full
    disk that was an OSError traceback, and metrics.jsonl.tmp stayed behind holding the last free
    space, so every rerun failed the same way. Now one CheckpointWriteError names the file."""
    import builtins

    from transformer_jax.training.integrity import CheckpointWriteError

    path = tmp_path / "metrics.jsonl"
    records = [json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)]
    path.write_text("".join(records))
    # a part reaches the disk, then it is full
    monkeypatch.setattr(builtins, "open", full_disk_open(lambda path: path.endswith(".tmp"), fits=5))
    with pytest.raises(CheckpointWriteError, match=r"metrics log .*metrics.jsonl.*No space left on device"
                                                   r".*checkpoints are intact"):
        metrics.MetricsLogger(str(tmp_path), 10, start_step=2, progress=False)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"] and path.read_text() == "".join(records)
    log = metrics.MetricsLogger(str(tmp_path), 10, start_step=2, progress=False)  # space freed: resumes
    log.close()
    assert path.read_text() == "".join(records[:2])


def test_training_figures_are_a_line_each_where_no_bar_is_drawn(tmp_path, capsys, monkeypatch):
    """Without a terminal (a log file, a batch scheduler, a notebook) the bar's frames were carriage
    returns on one line, and with progress_bar=False no training figure reached the screen at all:
    each logging window is now a line. On a terminal the bar shows them."""
    import sys
    import types

    for progress in (True, False):
        log = metrics.MetricsLogger(str(tmp_path / str(progress)), 10, progress=progress)
        log.progress(5, loss=2.5, lr=0.001, tok_s=1234.0)
        log.close()
        assert capsys.readouterr().out == "step 5: loss 2.5, lr 0.001, tok_s 1234\n"
    stream = types.SimpleNamespace(isatty=lambda: True, write=sys.stderr.write, flush=sys.stderr.flush)
    monkeypatch.setattr(sys, "stderr", stream)
    log = metrics.MetricsLogger(str(tmp_path / "tty"), 10, progress=True)
    log.progress(5, loss=2.5)
    log.close()
    assert capsys.readouterr().out == ""  # on the bar


def test_mfu_counts_the_output_product_over_a_padded_table():
    flops = lambda cfg: metrics.train_flops_per_step(cfg, 1, 10, 10)
    # 6 x 10 target tokens x d_model 512 x (37008 - 37000) padding rows, which the product computes
    assert flops(ModelConfig(pad_vocab_multiple=16)) - flops(ModelConfig()) == 6 * 10 * 512 * 8


def test_mfu_peak_is_a_16_bit_figure_except_on_tpu(monkeypatch):
    device = lambda kind: [type("Device", (), {"device_kind": kind})()]
    monkeypatch.setattr(metrics.jax, "devices", lambda: device("NVIDIA H100 80GB HBM3"))
    assert metrics.peak_tflops_per_device(0.0, "bfloat16") == 989.0
    # the table's figure is the bf16 one: a float32 model on a GPU gets no MFU unless told its peak
    assert metrics.peak_tflops_per_device(0.0, "float32") is None
    assert metrics.peak_tflops_per_device(60.0, "float32") == 60.0
    # a TPU runs float32 matmuls at the default precision as bf16 passes
    monkeypatch.setattr(metrics.jax, "devices", lambda: device("TPU v4"))
    assert metrics.peak_tflops_per_device(0.0, "float32") == 275.0
    monkeypatch.setattr(metrics.jax, "devices", lambda: device("cpu"))
    assert metrics.peak_tflops_per_device(0.0, "bfloat16") is None
    # the longest matching name wins: a PCIe H100 is not the SXM part, a v5 lite (v5e) not a v5p
    expected = {"NVIDIA H100 PCIe": 756.0, "NVIDIA H100 NVL": 835.0, "NVIDIA H200": 989.0,
                "NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA A100 80GB PCIe": 312.0, "TPU v5": 459.0,
                "TPU v5 lite": 197.0, "TPU v6 lite": 918.0, "TPU v7x": None, "NVIDIA H1000": None}
    for kind, peak in expected.items():
        monkeypatch.setattr(metrics.jax, "devices", lambda kind=kind: device(kind))
        assert metrics.peak_tflops_per_device(0.0, "bfloat16") == peak, kind


def _old_all_finite(tree):  # the guard's former form: an `all` over per-leaf boolean flags
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def test_the_finite_guard_finds_any_inf_or_nan_and_passes_large_finite_values():
    check = jax.jit(steps._all_finite)
    tree = {"w": jnp.ones((5, 7)), "b": jnp.ones(3, jnp.bfloat16), "h": jnp.ones((2, 2), jnp.float16)}
    assert bool(check(tree))
    for leaf, value, finite in [("w", 3.4e38, True), ("w", -1e-45, True), ("b", 3.3e38, True),
                                ("h", 65504.0, True), ("w", np.inf, False), ("w", -np.inf, False),
                                ("w", np.nan, False), ("b", np.nan, False), ("h", -np.inf, False)]:
        bad = dict(tree, **{leaf: tree[leaf].ravel().at[-1].set(value).reshape(tree[leaf].shape)})
        assert bool(check(bad)) is finite, (leaf, value)


@pytest.mark.parametrize("form", ["current", "former"])
def test_the_finite_guard_compiles_in_size_linear_in_the_leaves(form, monkeypatch):
    """The step's guard (is every gradient and update finite?) is read by the select of every
    parameter and optimizer leaf. In the former form XLA copied the whole per-leaf test into each of
    those fusions: a compiled step quadratic in the number of leaves (the 2+2-layer tiny model took
    25 s to compile on XLA:CPU, 3+3 layers 55 s; now 4.4 s and 5.9 s)."""
    if form == "former":
        monkeypatch.setattr(steps, "_all_finite", _old_all_finite)
    config = tiny.get_config()
    config.model.num_encoder_layers = config.model.num_decoder_layers = 1  # the former form: 8 s
    mesh = parallel.create_mesh(1, 1, 1, jax.devices()[:1])
    _, state, step, _ = _pieces(config, mesh)
    B, L = config.dataset.batch_size, config.dataset.max_target_len
    batch = {k: np.ones((B, L), np.int32) for k in (
        "inputs", "targets", "inputs_segment_ids", "targets_segment_ids", "inputs_positions",
        "targets_positions")}
    hlo = step.lower(state, batch).compile().as_text()
    leaves = len(jax.tree.leaves(state.params))
    ands = hlo.count(" and(")  # the former form: the chain of ands, once per select fusion
    if form == "current":
        assert ands <= 5 * leaves, (ands, leaves)
    else:  # the check can fail
        assert ands > 50 * leaves, (ands, leaves)


def test_non_finite_stops_or_skips(data_dir, tmp_path, monkeypatch):
    """Also: the run closes its training input pipeline, whether it ends in an error or not (left
    to garbage collection, input workers and their shared memory outlived it)."""
    closed = []

    def recording_build_datasets(*args, **kwargs):
        data = build_datasets(*args, **kwargs)
        close = data.train_iter.close
        data.train_iter.close = lambda: (closed.append(len(closed)), close())
        return data

    monkeypatch.setattr(loop, "build_datasets", recording_build_datasets)
    config = tiny_config(
        data_dir, num_train_steps=8, log_every_steps=1, checkpoint_every_steps=2, inject_nan_at_step=5
    )
    config.optimizer.warmup_steps = 10  # a rising rate: the rate of each step differs
    # Numbered from 1, as metrics.jsonl numbers the step (its records[5] below): "step 5 (0-based)"
    with pytest.raises(FloatingPointError, match=r"at step 6\. Last good checkpoint: step 4"):
        train_and_evaluate(config, str(tmp_path / "stop"))
    assert closed, "the input pipeline of a run that failed was left open"
    closed.clear()
    config.skip_nonfinite = True
    final = train_and_evaluate(config, str(tmp_path / "skip"))
    assert closed, "the input pipeline of a finished run was left open"
    records = [r for r in read_jsonl(str(tmp_path / "skip")) if "loss" in r]
    assert records[5]["loss"] == "NaN" and np.isfinite(final["loss"]) and final["step"] == 8
    assert final["skipped_steps"] == 1
    assert [r["skipped"] for r in records] == [0, 0, 0, 0, 0, 1, 0, 0]
    # The skipped step did not advance the optimizer: the next step applies the same rate.
    rates = [r["learning_rate"] for r in records]
    assert rates[6] == rates[5] and rates[4] < rates[5] < rates[7]


def test_log_window_leaves_out_skipped_steps():
    step = lambda loss, finite, lr=0.1: {"loss": loss, "learning_rate": lr, "finite": float(finite),
                                         "real_tokens": 10}
    window = loop._summarise([step(2.0, 1, 0.1), step(np.nan, 0, 0.2), step(4.0, 1, 0.3)], 1.0, 0.0, None)
    assert (window["loss"], window["skipped"]) == (3.0, 1)
    assert window["learning_rate"] == pytest.approx(0.3)  # the logged step's rate, not a warm-up mean
    assert window["tokens_per_sec"] == 30 and "real_tokens" not in window  # skipped steps ran
    only_skipped = loop._summarise([step(np.nan, 0)], 1.0, 0.0, None)
    assert np.isnan(only_skipped["loss"]) and only_skipped["skipped"] == 1
    # The window's perplexity is exp of its nll, as each step's is (the mean of exp(nll) exceeds it).
    nll = lambda value: {**step(value, 1), "nll": value, "perplexity": np.exp(value)}
    window = loop._summarise([nll(5.0), nll(7.0), nll(6.24)], 1.0, 0.0, None)
    assert window["nll"] == pytest.approx(6.08) and window["perplexity"] == pytest.approx(np.exp(6.08))
    # Per-token figures are weighted by each step's tokens, as the window's own per-token means: a
    # plain mean of steps gave 75 tokens the weight of 96.
    tokens = lambda value, n: {**nll(value), "accuracy": value / 10, "num_tokens": float(n)}  # noqa: E731
    skipped = {**tokens(np.nan, 50), "finite": 0.0}
    window = loop._summarise([tokens(2.0, 75), tokens(1.0, 96), skipped], 1.0, 0.0, None)
    want = (2.0 * 75 + 1.0 * 96) / 171
    assert window["loss"] == pytest.approx(want) and window["nll"] == pytest.approx(want)
    assert window["accuracy"] == pytest.approx(want / 10)
    assert window["perplexity"] == pytest.approx(np.exp(want))
    assert window["num_tokens"] == pytest.approx(85.5)  # the mean step's, as before


def test_window_throughput_counts_real_tokens_and_mfu_every_step_of_it():
    batch = {"inputs_segment_ids": np.array([[1, 1, 2, 0], [1, 0, 0, 0]]),
             "targets_segment_ids": np.array([[1, 1, 1, 0], [0, 0, 0, 0]]),
             "targets": np.ones((2, 4), np.int32)}
    assert int(steps.real_tokens(batch)) == 7  # 4 source and 3 target tokens; the padding is left out
    step = {"loss": 1.0, "finite": 1.0, "real_tokens": 15}
    window = loop._summarise([step, step], 4.0, 1e12, 0.5)
    assert (window["tokens_per_sec"], window["steps_per_sec"]) == (7.5, 0.5)
    # 2 steps of 1e12 FLOPs in 4 s, on 8 devices of 0.5 TFLOP/s: 0.5e12 / 4e12
    assert window["mfu"] == pytest.approx(0.125)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("mesh.data", 3, "mesh.data"),
        ("dataset.batch_size", 12, "dataset.batch_size"),
        ("dataset.eval_batch_size", 12, r"dataset.eval_batch_size=12 must be divisible by mesh.data"),
        ("model.num_heads", 5, "config.model"),
        ("optimizer.name", "sgd", "config.optimizer.name"),
        ("num_train_steps", 0, "config.num_train_steps"),
        ("optimizer.grad_accum_steps", 3, "grad_accum_steps"),
        ("optimizer.grad_accum_steps", 4, r"grad_accum_steps=4 = 4 rows per micro-batch"),
        ("dataset.name", "stdlib_lm", r"dataset.name='stdlib_lm' is a language-modelling dataset"),
        ("model.num_encoder_layers", 0, r"dataset.name='enfr_builtin' is a translation dataset"),
        ("keep_best_mode", "mean", r"config.keep_best_mode='mean' must be one of \['auto', 'min', 'max'\]"),
        ("seed", 2**65, r"config.seed=36893488147419103232 must be an integer in \[-2\*\*63, 2\*\*63\)"),
        ("keep_best_metric", "loss", r"config.keep_best_metric='loss' .*\['eval_loss', 'eval_nll'"),
        ("model.vocab_size", 100, r"config.model.vocab_size=100 is smaller than the tokenizer's 320"),
        ("optimizer.weight_decay", 0.1, r"optimizer.weight_decay=0.1 needs optimizer.name='adamw'"),
    ],
)
def test_bad_config_fails_before_compiling(data_dir, tmp_path, key, value, message):
    """Each is one of USER_ERRORS, which train.py prints as one 'error: ...' line (exit status 2)."""
    config = tiny_config(data_dir, **{key: value})
    with pytest.raises(loop.USER_ERRORS, match=message):
        train_and_evaluate(config, str(tmp_path))
    assert not os.path.exists(tmp_path / "checkpoints")


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("optimizer.learning_rate", -1.0, r"optimizer.learning_rate=-1.0 must be a number in \(0, inf\)"),
        ("optimizer.learning_rate", float("nan"), r"config.optimizer.learning_rate=nan must be a number"),
        ("optimizer.b2", 2.0, r"config.optimizer.b2=2.0 must be a number in \[0, 1\)"),
        ("optimizer.eps", -1e-8, r"config.optimizer.eps=-1e-08 must be a number in \[0, inf\)"),
        ("optimizer.eps", 0.0, r"config.optimizer.eps=0.0 is 0 in float32: Adam's update .* 0/0 = NaN"),
        ("optimizer.eps", 1e-50, r"config.optimizer.eps=1e-50 is 0 in float32"),
        ("optimizer.weight_decay", -1.0, r"optimizer.weight_decay=-1.0 must be a number in \[0, inf\)"),
        # above 1 the cosine "decay" climbed to 10 x the peak, silently
        ("optimizer.end_learning_rate_ratio", 10.0,
         r"optimizer.end_learning_rate_ratio=10.0 must be a number in \[0, 1\]"),
        ("optimizer.grad_clip_norm", -1.0, r"config.optimizer.grad_clip_norm=-1.0"),
        ("optimizer.warmup_steps", -5, r"config.optimizer.warmup_steps=-5 must be an integer >= 0"),
        # int32 step counter: an OverflowError traceback from a compiled schedule, after the setup
        ("num_train_steps", 2**63, r"config.num_train_steps=9223372036854775808 must be at most 2147483647"),
        ("optimizer.warmup_steps", 2**31, r"config.optimizer.warmup_steps=2147483648 must be at most"),
        ("max_checkpoints_to_keep", 0, r"config.max_checkpoints_to_keep=0 must be an integer >= 1"),
        ("dataset.max_eval_examples", -5, r"config.dataset.max_eval_examples=-5 must be an integer >= 0"),
        ("dataset.num_workers", -1, r"config.dataset.num_workers=-1 must be an integer >= 0"),
        ("dataset.max_source_len", 0, r"config.dataset.max_source_len=0 must be an integer >= 1"),
        ("decode_max_len", -1, r"config.decode_max_len=-1 must be an integer >= 0"),
        ("decode_extra_len", -2, r"config.decode_extra_len=-2 must be an integer >= -1"),
        ("dataset.batch_size", 0, r"config.dataset.batch_size=0 must be an integer >= 1"),
        ("optimizer.grad_accum_steps", 0, r"config.optimizer.grad_accum_steps=0 must be an integer >= 1"),
        ("optimizer.b2", 1.0, r"config.optimizer.b2=1.0 must be a number in \[0, 1\)"),
        ("optimizer.label_smoothing", 1.0, r"config.optimizer.label_smoothing=1.0 must be in \[0, 1\)"),
        ("beam_size", 0, r"config.beam_size=0 must be an integer >= 1"),
        # read only by the BLEU evaluation after training: the whole run trained, then a traceback
        ("beam_alpha", -0.6, r"config.beam_alpha=-0.6 must be a number in \[0, inf\)"),
        ("beam_alpha", float("nan"), r"config.beam_alpha=nan must be a number"),
        ("num_printed_examples", -1, r"config.num_printed_examples=-1 must be an integer >= 0"),
        # a model smaller than the tokenizer: said only once the tokenizer was trained
        ("model.vocab_size", 300, r"config.model.vocab_size=300 is smaller than the tokenizer's 320 "
                                  r"tokens \(config.dataset.vocab_size\).*--config.model.vocab_size=320"),
        # a backend this machine cannot run: a traceback from the first model call
        ("model.attention_impl", "flash", r"config.model.attention_impl='flash': 'flash' needs a TPU"),
        ("model.attention_impl", "cudnn", r"config.model.attention_impl='cudnn': 'cudnn' needs an NVIDIA"),
        # Adam's state in float16: NaN updates at step 0, blamed on the learning rate
        ("model.param_dtype", "float16", r"config.model.param_dtype='float16' cannot be trained with Adam"),
        # Refused by the tokenizer and the pipeline too, but only after the dataset is built and
        # without naming the key.
        ("dataset.vocab_size", 100, r"config.dataset.vocab_size=100 must be an integer >= 300"),
        ("dataset.tokenizer_type", "wordpiece", r"config.dataset.tokenizer_type='wordpiece' is not"),
        ("dataset.length_policy", "split", r"config.dataset.length_policy='split' is not one of "
                                           r"\['truncate', 'drop'\] for dataset 'enfr_builtin'"),
        ("dataset.length_policy", "cut", r"config.dataset.length_policy='cut' is not one of"),
        # grain's shuffle, the packer and the tokenizer's trainer: tracebacks that named no key
        ("dataset.seed", -1, r"config.dataset.seed=-1 must be an integer >= 0"),
        ("dataset.seed", 2**32, r"config.dataset.seed=4294967296 must be below 2\*\*32"),
        ("dataset.pack_bins", -1, r"config.dataset.pack_bins=-1 must be an integer >= 0"),
        ("dataset.tokenizer_max_chars", 0, r"config.dataset.tokenizer_max_chars=0 must be an integer >= 1"),
        # the pipeline ends every example with id 1 and pads with 0: another EOS id never stopped
        # greedy decoding or finished a beam
        ("model.eos_id", 3, r"config.model.eos_id=3 differs from the id the input pipeline uses \(1\)"),
        ("model.pad_id", 5, r"config.model.pad_id=5 differs from the id the input pipeline uses \(0\)"),
    ],
)
def test_numeric_settings_out_of_range_are_named(key, value, message):
    """Values that would otherwise run wrongly (a negative rate ascends the loss; keeping 0
    checkpoints leaves nothing to resume from) or fail deep inside a later step."""
    config = tiny.get_config()
    section, _, field = key.rpartition(".")
    (config[section] if section else config)[field] = value
    with pytest.raises(ConfigError, match=message):
        check_config(config)


@pytest.mark.parametrize(
    "section, key, message",
    [
        ("", "evaluate_every_steps", r"config.evaluate_every_steps .*did you mean config.eval_every_steps"),
        ("optimizer", "learning_rat", r"config.optimizer.learning_rat .*config.optimizer.learning_rate"),
        ("dataset", "batchsize", r"config.dataset.batchsize .*did you mean config.dataset.batch_size"),
        ("mesh", "model", r"config.mesh.model is not a setting the training program reads"),
    ],
)
def test_a_key_no_code_reads_is_named(section, key, message):
    """A typo in a config file used to train silently with the default in its place (the model's own
    fields were already checked by ModelConfig)."""
    config = tiny.get_config()
    (config[section] if section else config)[key] = 1
    with pytest.raises(ConfigError, match=message):
        check_config(config)


def test_numeric_settings_keep_their_none_and_zero_meanings():
    config = tiny.get_config()
    config.max_checkpoints_to_keep = None  # keep every checkpoint
    config.optimizer.decay_steps = None  # num_train_steps
    config.optimizer.eps = 1e-30  # tiny, but not 0 in float32
    check_config(config)


@pytest.mark.parametrize("metric", ["eval_loss", "eval_perplexity", "eval_accuracy"])
def test_keep_best_metric_is_checked(metric):
    config = tiny.get_config()
    config.keep_best_metric = metric
    check_config(config)  # tiny checkpoints where it evaluates, every 10 steps
    config.keep_best_mode = "max" if metric == "eval_accuracy" else "min"
    check_config(config)
    config.keep_best_mode = "min" if metric == "eval_accuracy" else "max"
    with pytest.raises(ConfigError, match=r"would keep the worst checkpoints"):
        check_config(config)
    config.keep_best_mode = "auto"
    config.checkpoint_every_steps = 5
    message = r"checkpoint_every_steps=5 is not a multiple of config.eval_every_steps=10"
    with pytest.raises(ConfigError, match=message):
        check_config(config)


def test_keep_best_metric_names_are_what_evaluation_produces():
    batch = {"targets": np.zeros((8, 4), np.int32)}
    sums = {"loss_sum": 2.0, "weight_sum": 4.0, "nll": 2.0, "z_loss": 0.0, "correct": 1.0}
    produced = evaluate.evaluate_loss(lambda p, b: sums, None, [batch], parallel.create_mesh(data=-1))
    assert set(evaluate.EVAL_METRICS) <= set(produced)


@pytest.mark.parametrize("one_at_a_time", [True, False])
def test_evaluation_runs_one_batch_at_a_time_where_queued_programs_would_hang(one_at_a_time, monkeypatch):
    """In a multi-process run on CPUs, queued evaluation programs hung both processes for ever in
    their cross-process all-reduces (two processes of two devices: 5 runs of 9 with 20 to 200
    queued batches; a two-process language-model run hung in 3 of 4 tries). There each batch's sums
    are waited for before the next batch is queued; elsewhere the batches stay queued together."""
    import jax

    events = []
    monkeypatch.setattr(parallel, "one_program_at_a_time", lambda: one_at_a_time)
    monkeypatch.setattr(jax, "block_until_ready", lambda x: events.append("wait") or x)

    def eval_step(params, batch):
        events.append("queue")
        return {"loss_sum": jnp.float32(2.0), "weight_sum": jnp.float32(4.0), "nll": jnp.float32(2.0),
                "z_loss": jnp.float32(0.0), "correct": jnp.float32(1.0)}

    batches = [{"targets": np.zeros((8, 4), np.int32)}] * 3
    metrics = evaluate.evaluate_loss(eval_step, None, batches, parallel.create_mesh(data=-1))
    assert metrics["eval_loss"] == 0.5 and metrics["eval_accuracy"] == 0.25
    assert events == (["queue", "wait"] * 3 if one_at_a_time else ["queue"] * 3)


def test_lengths_past_a_learned_position_table_are_config_errors():
    """Rows or decoded outputs longer than a learned table would read past its end (NaN)."""
    config = tiny.get_config()
    config.model.position = "learned"
    config.model.max_len = 64
    check_config(config)
    for key, value in (("dataset.max_target_len", 80), ("decode_max_len", 65)):
        bad = copy.deepcopy(config)
        bad.update_from_flattened_dict({key: value})
        with pytest.raises(ConfigError, match=rf"config.{key}={value} exceeds config.model.max_len=64"):
            check_config(bad)
    config.model.position = "sinusoidal"  # computed for any position
    config.decode_max_len = 65
    check_config(config)


def test_a_config_file_s_partial_sections_and_a_tilde_workdir_train(data_dir, tmp_path, monkeypatch):
    """A config file that replaces config.optimizer with a few keys (after with_defaults), or drops
    a dataset or mesh key, failed with a KeyError traceback: the rest comes from the defaults. A
    workdir of '~/run' (the shell leaves '~' after '=') was a directory named '~' in the current one."""
    import ml_collections

    config = tiny_config(data_dir, num_train_steps=1, eval_every_steps=1, checkpoint_every_steps=1)
    config.optimizer = ml_collections.ConfigDict({"learning_rate": 1e-3, "schedule": "constant",
                                                  "warmup_steps": 0})
    del config.dataset["eval_batch_size"]
    del config.mesh["tensor"]
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert train_and_evaluate(config, "~/run")["step"] == 1
    assert os.path.isdir(tmp_path / "home" / "run" / "checkpoints") and not os.path.exists(tmp_path / "~")
    saved = json.loads((tmp_path / "home" / "run" / "config.json").read_text())
    assert saved["optimizer"]["grad_accum_steps"] == 1 and saved["optimizer"]["b2"] == 0.98
    assert saved["optimizer"]["learning_rate"] == 1e-3 and saved["mesh"]["tensor"] == 1
    assert saved["dataset"]["eval_batch_size"] == 64  # enfr_builtin's default


@pytest.mark.parametrize("key, value", [("skip_nonfinite", "no"), ("checkpoint_fallback", "False"),
                                        ("dataset.pack", 0), ("optimizer.decay_embeddings", "yes"),
                                        ("progress_bar", None)])
def test_on_off_settings_must_be_booleans(key, value):
    """A config file's 'no' for skip_nonfinite is truthy: the run skipped non-finite steps."""
    import ml_collections

    values = tiny.get_config().to_dict()
    section = values if "." not in key else values[key.split(".")[0]]
    section[key.split(".")[-1]] = value
    config = ml_collections.ConfigDict(values)  # as a config file building its own dict has it
    with pytest.raises(ConfigError, match=rf"config.{re.escape(key)}={re.escape(repr(value))} must be True "
                                          "or False"):
        check_config(config)


@pytest.mark.parametrize("value", ["4", 2.0, True, 0])
def test_beam_size_must_be_a_positive_integer(value):
    import ml_collections

    config = ml_collections.ConfigDict(dict(tiny.get_config().to_dict(), beam_size=value))
    with pytest.raises(ConfigError, match=rf"config.beam_size={re.escape(repr(value))} must be an integer"):
        check_config(config)


def test_a_resume_names_the_training_settings_that_changed(data_dir, tmp_path, capsys):
    """Another learning rate, label smoothing or seed on a resume trained on without a word: a config file
    edited meanwhile went unnoticed. They are named (not refused: a lower rate is a common choice);
    num_train_steps, which a resume raises to train on, is not among them."""
    workdir = str(tmp_path / "run")
    config = tiny_config(data_dir, num_train_steps=2, checkpoint_every_steps=2, eval_every_steps=2)
    train_and_evaluate(config, workdir)
    assert "NOTE: resuming" not in capsys.readouterr().out
    resumed = tiny_config(data_dir, num_train_steps=3, checkpoint_every_steps=2, eval_every_steps=2)
    train_and_evaluate(resumed, workdir)
    assert "NOTE: resuming" not in capsys.readouterr().out  # the same settings, more steps
    resumed.optimizer.learning_rate = 1e-3
    resumed.optimizer.label_smoothing = 0.0
    resumed.seed = 7
    resumed.num_train_steps = 4
    train_and_evaluate(resumed, workdir)
    [note] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("NOTE: resuming")]
    head = "NOTE: resuming with training settings other than those of the run that wrote the checkpoints: "
    assert note.startswith(head) and sorted(note[len(head):].split(", ")) == [
        "optimizer.label_smoothing (0.1 -> 0.0)", "optimizer.learning_rate (0.003 -> 0.001)", "seed (0 -> 7)"]


def test_a_unit_learning_rate_outside_the_paper_s_schedule_is_flagged():
    """learning_rate=1.0 is the paper's multiplier under 'rsqrt_paper'; left in place when switching
    to 'constant' or 'cosine', it is Adam's step size itself."""
    config = tiny.get_config()
    config.optimizer.learning_rate = 1.0
    assert "optimizer.learning_rate=1.0 is the peak rate itself under schedule 'constant'" in (
        loop.unit_rate_as_peak(config))
    config.optimizer.schedule = "rsqrt_paper"
    assert loop.unit_rate_as_peak(config) is None
    config.optimizer.schedule, config.optimizer.learning_rate = "cosine", 2e-3
    assert loop.unit_rate_as_peak(config) is None
    # The opposite: a peak-sized rate as the paper schedule's multiplier trained at ~1e-9, silently.
    config.optimizer.schedule, config.optimizer.warmup_steps = "rsqrt_paper", 4000
    config.model.d_model = 512
    warning = loop.unit_rate_as_peak(config)
    assert "optimizer.learning_rate=0.002 is a multiplier under schedule 'rsqrt_paper'" in warning
    assert f"peaks at {2e-3 * 512 ** -0.5 * 4000 ** -0.5:.2g}" in warning and "1.4e-06" in warning
    config.optimizer.learning_rate = 2.0  # tensor2tensor's multiplier
    assert loop.unit_rate_as_peak(config) is None


def test_train_and_evaluate_takes_a_dict_a_frozen_config_and_a_model_config(tmp_path):
    """A plain dict failed with "'dict' object has no attribute 'to_dict'", a FrozenConfigDict
    with a partial section with "FrozenConfigDict is immutable", a ModelConfig as config.model with
    an AttributeError after the data was prepared, a section of None or a string with a TypeError
    or AttributeError: tracebacks, none of them a ConfigError."""
    from ml_collections import ConfigDict, FrozenConfigDict

    from transformer_jax.training.config_checks import as_run_config

    config = tiny.get_config()
    plain = as_run_config(config.to_dict())
    assert isinstance(plain, ConfigDict) and plain.to_dict() == config.to_dict()
    assert isinstance(plain.model, ConfigDict)
    frozen = as_run_config(FrozenConfigDict(config))
    assert isinstance(frozen, ConfigDict) and frozen.to_dict() == config.to_dict()
    frozen.optimizer.learning_rate = 0.5  # a copy the run may fill in
    model = ModelConfig.from_dict(config.model.to_dict())
    given = ConfigDict({**config, "model": model})
    converted = as_run_config(given)
    assert converted.model.to_dict() == model.to_dict() and given.model is model  # the caller's, as it was
    assert as_run_config(config) is config
    # NumPy scalars (a step count computed with NumPy): "must be an integer", where ModelConfig takes
    # them; as Python numbers in a copy, the caller's config left as it was
    fields = tiny.get_config().to_dict()
    fields["num_train_steps"] = np.int64(40)
    fields["optimizer"]["learning_rate"] = np.float32(0.5)
    fields["dataset"]["pack"] = np.bool_(True)
    fields["model"]["d_model"] = np.int32(32)
    numbers = ConfigDict(fields)
    run = as_run_config(numbers)
    got = (run.num_train_steps, run.optimizer.learning_rate, run.dataset.pack, run.model.d_model)
    assert got == (40, 0.5, True, 32) and [type(v) for v in got] == [int, float, bool, int]
    assert isinstance(numbers.num_train_steps, np.int64)
    from transformer_jax.training.config_checks import check_config
    check_config(run)
    for section, value in (("model", None), ("mesh", None), ("optimizer", "adam"), ("dataset", 3)):
        broken = tiny.get_config()
        with broken.ignore_type():
            broken[section] = value
        with pytest.raises(ConfigError, match=rf"config.{section} must be a section of its fields .*got "
                                              rf"{type(value).__name__}"):
            train_and_evaluate(broken, str(tmp_path))
    with pytest.raises(ConfigError, match="config must be an ml_collections.ConfigDict .*got list"):
        train_and_evaluate([("seed", 0)], str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_a_url_workdir_is_refused_before_anything_is_written(data_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"workdir 'gs://bucket/run': URLs are not supported"):
        train_and_evaluate(tiny_config(data_dir), "gs://bucket/run")
    assert os.listdir(tmp_path) == []  # no local folder named 'gs:'


def _train_py_error(cwd, *flags):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "train.py"), *flags], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240)
    return proc.returncode, proc.stderr.strip().splitlines()


def test_train_py_reports_user_errors_in_one_line_and_names_runs_after_the_config(data_dir, tmp_path):
    """Config, data and workdir problems end train.py with status 2 and one 'error: ...' line, no
    traceback. `--config X.py` (a space, not '=') still names the default workdir runs/X."""
    code, lines = _train_py_error(tmp_path, "--config", os.path.join(REPO, "configs", "tiny.py"),
                                  f"--config.dataset.data_dir={data_dir}", "--config.dataset.name=tsv")
    assert code == 2, lines
    assert lines[-1] == "error: dataset 'tsv' needs dataset.train_files", lines
    assert not any("Traceback" in line for line in lines), lines
    assert os.path.isdir(tmp_path / "runs" / "tiny")  # the workdir was created before the data check
    code, lines = _train_py_error(tmp_path, "--config=" + os.path.join(REPO, "configs", "tiny.py"),
                                  "--config.optimizer.label_smoothing=1.0")
    assert (code, lines[-1]) == (2, "error: config.optimizer.label_smoothing=1.0 must be in [0, 1)")


def test_train_py_config_file_and_override_mistakes_are_one_line(tmp_path):
    """Errors ml_collections raises while reading --config (before main runs) get the same
    treatment: status 2, one 'error: ...' line naming the problem."""
    tiny_py = "--config=" + os.path.join(REPO, "configs", "tiny.py")
    (tmp_path / "no_get.py").write_text("x = 1\n")
    (tmp_path / "base.yml").write_text("run_name: test\nsteps: 10\n")
    (tmp_path / "as_dict.py").write_text("def get_config():\n    return {'seed': 1}\n")
    (tmp_path / "as_none.py").write_text("def get_config():\n    pass\n")
    (tmp_path / "as_list.py").write_text("def get_config():\n    return [1, 2]\n")
    returned = lambda name, kind: (f"error: get_config() in {tmp_path / name} returned {kind}, not an "  # noqa: E731
                                   "ml_collections.ConfigDict (return ml_collections.ConfigDict({...}))")
    shutil.copy(os.path.join(REPO, "configs", "tiny.py"), tmp_path / "tinycfg")
    (tmp_path / "broken.py").write_text("def get_config():\n    return undefined_name\n")
    (tmp_path / "keyed.py").write_text("BASE = {}\n\n\ndef get_config():\n    return BASE['model']\n")
    (tmp_path / "env.py").write_text("import os\n\n\ndef get_config():\n"
                                     "    return os.environ['TJ_NO_SUCH']\n")
    # a preset's ConfigError and a value of another type, raised inside get_config(): ml_collections
    # wraps these two kinds with their traceback, which was printed whole (16-21 lines)
    (tmp_path / "preset.py").write_text("from transformer_jax import presets\n\n\ndef get_config():\n"
                                        "    return presets.tiny(num_heads=5)\n")
    (tmp_path / "typed.py").write_text(f"import sys\nsys.path.insert(0, {os.path.join(REPO, 'configs')!r})\n"
                                       "import tiny\n\n\ndef get_config():\n    c = tiny.get_config()\n"
                                       "    c.num_train_steps = '2'\n    return c\n")
    cases = {
        ("--config.num_train_stepz=3",):  # the default config file, read as the flag is defined
            "error: a --config.* override names a field the config does not have: 'num_train_stepz' "
            "(did you mean 'num_train_steps'?)",
        ("--config=" + str(tmp_path / "env.py"),):  # a KeyError of get_config() is no override's
            f"error: reading --config failed (at {tmp_path / 'env.py'}:5): KeyError: 'TJ_NO_SUCH'",
        # ... also where an override names the same key: it was blamed on the override
        ("--config=" + str(tmp_path / "keyed.py"), "--config.model.d_model=64"):
            f"error: reading --config failed (at {tmp_path / 'keyed.py'}:5): KeyError: 'model'",
        (tiny_py, "--config.optimizer.learning_rte=1e-3"):
            "error: a --config.* override names a field the config does not have: 'learning_rte' "
            "(did you mean 'learning_rate'?)",
        ("--config=" + str(tmp_path / "missing.py"),): "error: cannot load the --config file: [Errno 2] "
            f"No such file or directory: '{tmp_path / 'missing.py'}'",
        ("--config=" + str(tmp_path / "no_get.py"),):
            "error: the --config file defines no get_config() function",
        ("--config=" + str(tmp_path / "broken.py"),):
            f"error: reading --config failed (at {tmp_path / 'broken.py'}:2): "
            "NameError: name 'undefined_name' is not defined",
        ("--config=" + str(tmp_path / "preset.py"),):
            f"error: reading --config failed (at {tmp_path / 'preset.py'}:5): ConfigError: "
            "ModelConfig.num_heads=5: d_model=32 is not divisible by it; set head_dim",
        ("--config=" + str(tmp_path / "typed.py"),):
            f"error: reading --config failed (at {tmp_path / 'typed.py'}:8): TypeError: Could not override "
            "field 'num_train_steps' (reference). 2 is of original type <class 'str'> and cannot be casted "
            "to type <class 'int'>",
        (tiny_py.replace("tiny.py", "tiny.py:extra"),):  # an argument get_config() does not take
            "error: reading --config failed: TypeError: get_config() takes 0 positional arguments but 1 "
            "was given",
        # a value of the wrong type, and a flag train.py does not have: absl alone exits 1
        (tiny_py, "--config.num_train_steps=abc"):
            "error: flag --config.num_train_steps=abc: invalid literal for int() with base 10: 'abc' "
            "(--helpshort lists the flags)",
        ("--wrkdir=x",): "error: Unknown command line flag 'wrkdir'. Did you mean: workdir ? "
            "(--helpshort lists the flags)",
        # two config files: the last one was read without a word, or with overrides absl said
        # "The flag 'config.num_train_steps' is defined twice"
        (tiny_py, "--config", "configs/lm_stdlib.py", "--config.num_train_steps=1"):
            f"error: --config is given 2 times ({tiny_py.split('=', 1)[1]}, configs/lm_stdlib.py): give "
            "one config file and change its fields with --config.FIELD=VALUE",
        # a MaxText-style YAML config (NameError: name 'test' is not defined), and a get_config()
        # returning a dict (a traceback from the config checks) or nothing
        ("--config=" + str(tmp_path / "base.yml"),):
            f"error: --config={tmp_path / 'base.yml'} is not a Python file: a config here is a .py file "
            "whose get_config() returns an ml_collections.ConfigDict (see configs/); YAML, gin and JSON "
            "configs are not read",
        ("--config=" + str(tmp_path / "as_dict.py"),): returned("as_dict.py", "dict"),
        ("--config=" + str(tmp_path / "as_list.py"),): returned("as_list.py", "list"),
        # a Python config without .py loads; its other mistakes are named as they are
        ("--config=" + str(tmp_path / "tinycfg"), "--config.num_train_steps=abc"):
            "error: flag --config.num_train_steps=abc: invalid literal for int() with base 10: 'abc' "
            "(--helpshort lists the flags)",
    }
    for flags, expected in cases.items():
        code, lines = _train_py_error(tmp_path, *flags)
        assert (code, lines) == (2, [expected]), (flags, lines)
    # ml_collections warns first, itself
    code, lines = _train_py_error(tmp_path, "--config=" + str(tmp_path / "as_none.py"))
    assert (code, lines[-1]) == (2, returned("as_none.py", "NoneType"))
    assert "did you forget a return statement?" in lines[-2]


_FAKE_TRAINING = """
import importlib.util, json, os, runpy, sys
# train.py restarts itself before importing jax; so does this wrapper, which imports it first
spec = importlib.util.spec_from_file_location(
    "host_memory", os.path.join(os.path.dirname(sys.argv[1]), "transformer_jax", "host_memory.py"))
host_memory = importlib.util.module_from_spec(spec)
spec.loader.exec_module(host_memory)
host_memory.restart_with_huge_page_malloc()
import transformer_jax.training as training

def train_and_evaluate(config, workdir):
    record = {"workdir": workdir, "steps": config.num_train_steps, "d_model": config.model.d_model,
              "profile": [config.profile_start_step, config.profile_num_steps],
              "tunables": os.environ.get("GLIBC_TUNABLES"), "pid": os.getpid()}
    print("called " + json.dumps(record), flush=True)
    return {"step": config.num_train_steps, "loss": 0.25}

training.train_and_evaluate = train_and_evaluate
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path(sys.argv.pop(1), run_name="__main__")
"""


def test_a_second_ctrl_c_leaves_at_once_with_one_line(tmp_path):
    """The second Ctrl-C while a checkpoint write ran in its threads: status 130 and one line. The
    threads went on while the interpreter shut down under them, each printing a traceback (~550
    lines after the message); here one such thread, which fails after the interrupt."""
    interrupted = _FAKE_TRAINING.replace(
        '    return {"step": config.num_train_steps, "loss": 0.25}\n',
        '    import threading, time\n'
        '    def writer():\n'
        '        time.sleep(1.0)\n'
        '        raise RuntimeError("Event loop is closed")\n'
        '    threading.Thread(target=writer).start()\n'
        '    raise KeyboardInterrupt\n')
    assert interrupted != _FAKE_TRAINING
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    proc = subprocess.run(
        [sys.executable, "-c", interrupted, os.path.join(REPO, "train.py"),
         "--config=" + os.path.join(REPO, "configs", "tiny.py"), f"--workdir={tmp_path / 'w'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 130, proc.stderr[-3000:]
    last = "interrupted: stopped without saving; the run resumes from its latest checkpoint"
    assert proc.stderr.strip().splitlines()[-1] == last, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "called " in proc.stdout


def test_train_py_passes_workdir_overrides_and_profile_flags_and_refuses_stray_arguments(tmp_path):
    """train.py with train_and_evaluate replaced (no training): the --workdir given, the config with
    its --config.* overrides and the --profile_* flags reach it, the final metrics are printed and
    the status is 0; an unexpected positional argument is refused before anything runs."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    command = lambda *flags: [sys.executable, "-c", _FAKE_TRAINING, os.path.join(REPO, "train.py"),
                              "--config=" + os.path.join(REPO, "configs", "tiny.py"), *flags]
    run = lambda *flags: subprocess.run(command(*flags), cwd=tmp_path, env=env, capture_output=True,
                                        text=True, timeout=240)
    workdir = str(tmp_path / "elsewhere")
    # Without GLIBC_TUNABLES the wrapper (as train.py, whose own restart
    # tests/test_host_memory.py checks) starts itself again with malloc's huge pages, where the
    # system has them: the same process, so the same pid.
    unset = {k: v for k, v in env.items() if k != host_memory.ENV}
    flags = (f"--workdir={workdir}", "--config.num_train_steps=3", "--config.model.d_model=48",
             "--profile_start_step=7", "--profile_num_steps=2")
    proc = subprocess.Popen(command(*flags), cwd=tmp_path, env=unset, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr[-3000:]
    (called,) = [json.loads(line[len("called "):]) for line in stdout.splitlines()
                 if line.startswith("called ")]
    restarted = host_memory.huge_page_malloc_problem() is None
    assert called == {"workdir": workdir, "steps": 3, "d_model": 48, "profile": [7, 2], "pid": proc.pid,
                      "tunables": host_memory.TUNABLE if restarted else None}
    assert stdout.splitlines()[-1] == "final: loss 0.25, step 3"
    proc = run(f"--workdir={workdir}", "stray")
    assert proc.returncode == 2 and "called" not in proc.stdout
    assert proc.stderr.strip().splitlines() == [
        "error: unexpected arguments ['stray'] (a config file is given as --config=FILE; --helpshort lists "
        "the flags)"]
    # Multi-process flags JAX would refuse with a traceback (or after a wait): one line, status 2.
    for flags, message in (
            (["--num_processes=2", "--process_id=5", "--coordinator_address=localhost:1"],
             "error: --process_id ($JAX_PROCESS_ID)=5 must be below num_processes=2"),
            (["--num_processes=0", "--process_id=0", "--coordinator_address=localhost:1"],
             "error: --num_processes ($JAX_NUM_PROCESSES)=0 must be >= 1"),
            (["--num_processes=1", "--process_id=7"],
             "error: --process_id ($JAX_PROCESS_ID)=7 must be below num_processes=1"),
            # Paths with a comma between them do not parse as ml_collections' tuple: the form that does.
            (["--config.dataset.train_files=/x/p.tsv,/x/q.tsv"],
             "error: --config.dataset.train_files=/x/p.tsv,/x/q.tsv is not a tuple of paths: give several "
             "files as a Python tuple, e.g. --config.dataset.train_files=\"('a.tsv', 'b.tsv')\""),
            # A whole section replaced the file's: d_model=64 on a default 6+6-layer, 37k-vocabulary
            # model (5.8M parameters for tiny's 54k), the schedule back to the paper's.
            (["--config.model={'d_model': 64}"],
             "error: --config.model=... would replace the whole config.model section"),
            (["--config.optimizer={'learning_rate': 3e-3}"],
             "error: --config.optimizer=... would replace the whole config.optimizer section"),
            (["--process_id=1"], "error: several processes need --coordinator_address "
                                 "($JAX_COORDINATOR_ADDRESS), --num_processes ($JAX_NUM_PROCESSES) as well")):
        proc = run(f"--workdir={workdir}", *flags)
        assert proc.returncode == 2 and "called" not in proc.stdout, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1].startswith(message), proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("signal_name, status", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_run_stopped_by_a_signal_exits_with_its_status(tmp_path, signal_name, status):
    """A run stopped by SIGTERM (preemption) or a first Ctrl-C saves, says "stopped:", and exits
    128 + the signal's number: it printed "final:" and exited 0, so `train.py && generate` decoded a
    half-trained model and a batch job's restart policy took the run for finished."""
    stopped = _FAKE_TRAINING.replace(
        '    return {"step": config.num_train_steps, "loss": 0.25}\n',
        f'    return {{"step": 2, "loss": 0.25, "stopped_by": "{signal_name}"}}\n')
    assert stopped != _FAKE_TRAINING
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, "-c", stopped, os.path.join(REPO, "train.py"),
                           "--config=" + os.path.join(REPO, "configs", "tiny.py"), f"--workdir={tmp_path}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == status, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "stopped: loss 0.25, step 2"


def test_a_closed_stdout_ends_train_py_as_sigpipe_would(tmp_path):
    """`train.py | head`: once head has left, the next line printed was a BrokenPipeError traceback
    (exit status 1); now the run ends quietly with 141 (128 + SIGPIPE), as other programs do."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    try:
        proc = subprocess.run([sys.executable, "-c", _FAKE_TRAINING, os.path.join(REPO, "train.py"),
                               "--config=" + os.path.join(REPO, "configs", "tiny.py"),
                               f"--workdir={tmp_path}"], cwd=tmp_path, env=env, stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=240)
    finally:
        os.close(write)
    assert proc.returncode == 141 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    # a broken pipe of another kind (a socket, a worker's pipe) is an error as any other
    other = _FAKE_TRAINING.replace('    return {"step": config.num_train_steps, "loss": 0.25}\n',
                                   '    raise BrokenPipeError(32, "Broken pipe (a socket)")\n')
    proc = subprocess.run([sys.executable, "-c", other, os.path.join(REPO, "train.py"),
                           "--config=" + os.path.join(REPO, "configs", "tiny.py"), f"--workdir={tmp_path}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1 and "BrokenPipeError: [Errno 32] Broken pipe (a socket)" in proc.stderr


def _run_two_processes(command, env, logs_dir, timeout=240, grace=20, attempts=3):
    """Runs `command(port) + ['--process_id=i']` for i in 0, 1 with their output in files (a full pipe
    would block a process while the other waits for it in a collective). Once one fails, the other
    gets `grace` seconds; at `timeout` both are killed. A start that missed gloo's deadline is stopped
    as soon as a log shows it (the failed process may hang on its way out, its peer waits for ever)
    and tried again on a fresh port, up to `attempts` starts in all. Returns (the attempt that
    counted, return codes, outputs)."""
    for attempt in range(attempts):
        port = free_port()
        logs = [logs_dir / f"attempt{attempt}_process{i}.log" for i in range(2)]
        procs = []
        for i, log in enumerate(logs):
            with open(log, "w") as out:
                procs.append(subprocess.Popen(command(port, attempt) + [f"--process_id={i}"], env=env,
                                              cwd=REPO, stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        missed = False
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + grace)
            texts = [log.read_text(errors="replace") for log in logs]
            if attempt < attempts - 1 and any(GLOO_DEADLINE in text for text in texts):
                missed = True
                break
            time.sleep(0.5)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        outputs = [log.read_text() for log in logs]
        if missed or (attempt < attempts - 1 and any(GLOO_DEADLINE in out for out in outputs)):
            continue
        return attempt, [p.returncode for p in procs], outputs
    raise AssertionError("unreachable")


def test_the_compilation_cache_is_refused_only_to_several_cpu_processes(tmp_path, monkeypatch, capsys):
    assert loop.compilation_cache_conflict("cpu", 1) is None
    assert loop.compilation_cache_conflict("gpu", 4) is None
    assert loop.compilation_cache_conflict("tpu", 2) is None
    assert "2 CPU processes" in loop.compilation_cache_conflict("cpu", 2)

    def stop(*args):  # the next setup step: the run ends here, after the cache decision
        raise KeyboardInterrupt

    # train_and_evaluate asks with this run's process count: two CPU processes print the NOTE and
    # leave the cache off; one process turns it on.
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(parallel, "config_differences", lambda *a, **k: [])  # one real process
    monkeypatch.setattr(loop, "enable_compilation_cache", lambda *a: pytest.fail("cache enabled"))
    monkeypatch.setattr(parallel, "mesh_from_config", stop)
    with pytest.raises(KeyboardInterrupt):
        train_and_evaluate(tiny.get_config(), str(tmp_path))
    assert "NOTE: config.compilation_cache is off for this run: 2 CPU processes" in capsys.readouterr().out
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    enabled = []

    def enable(*args):
        enabled.append(args)
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "enable_compilation_cache", enable)
    # Reaching the mesh means the cache was skipped (the mesh comes after it).
    monkeypatch.setattr(parallel, "mesh_from_config", lambda *a: pytest.fail("cache not enabled"))
    config = tiny.get_config()
    config.compilation_cache_dir = str(tmp_path / "xla_cache")
    with pytest.raises(KeyboardInterrupt):  # one process: the cache is enabled, in the directory set
        train_and_evaluate(config, str(tmp_path))
    assert enabled == [(str(tmp_path / "xla_cache"),)]


def test_two_processes_train_and_one_restores(data_dir, tmp_path):
    env = {
        **os.environ,
        "XLA_FLAGS": child_xla_flags(2),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": REPO,
    }

    def command(port, attempt):
        return [
            sys.executable,
            os.path.join(REPO, "train.py"),
            "--config=" + os.path.join(REPO, "configs/tiny.py"),
            f"--workdir={tmp_path / f'multi{attempt}'}",
            f"--config.dataset.data_dir={data_dir}",
            "--config.num_train_steps=4",
            "--config.checkpoint_every_steps=4",
            "--config.mesh.fsdp=2",
            f"--coordinator_address=127.0.0.1:{port}",
            "--num_processes=2",
        ]

    attempt, codes, outputs = _run_two_processes(command, env, tmp_path)
    for code, out in zip(codes, outputs):
        assert code == 0, out[-3000:]
    workdir = str(tmp_path / f"multi{attempt}")
    assert "2 processes" in outputs[0] and "parameters:" in outputs[0]
    # compilation_cache is on by default: train.py turns it off for several CPU processes, which
    # would otherwise compile unevenly (see compilation_cache_conflict) and miss gloo's deadline.
    assert "NOTE: config.compilation_cache is off for this run: 2 CPU processes" in outputs[0]
    assert "parameters:" not in outputs[1]  # only process 0 prints and writes logs
    from transformer_jax.training import restore_for_inference

    bundle = restore_for_inference(workdir)  # one process, 8 devices
    assert bundle.step == 4 and bundle.model_config.d_model == 32
    assert len(train_losses(workdir)) >= 1


def test_resuming_with_another_length_names_the_restretched_cosine_schedule(tmp_path):
    """A cosine schedule without optimizer.decay_steps decays over num_train_steps, so raising it on
    resume (as the 'nothing to train' warning suggests) moved the rate at the resumed step from near
    its end value back up the curve, without a word."""
    from configs import default
    from transformer_jax.training.checkpoint import save_config

    config = default.get_config()
    config.num_train_steps = 400
    save_config(config, str(tmp_path))
    longer = copy.deepcopy(config)
    longer.num_train_steps = 800
    warning = loop.restretched_schedule(str(tmp_path), longer, 400)
    was = float(create_schedule(config.optimizer, 128, 400)(400))
    now = float(create_schedule(config.optimizer, 128, 800)(400))
    assert was < 1e-6 < now, (was, now)  # the end of the old curve, the middle of the new one
    assert warning == (
        f"WARNING: num_train_steps changed (400 -> 800) and the cosine schedule decays over it "
        f"(optimizer.decay_steps is 0): the learning rate at step 400 goes from {was:.3g} to {now:.3g}, "
        f"as if the run had been planned this long from the start; set "
        f"--config.optimizer.decay_steps=400 to keep the schedule it trained with")
    assert loop.restretched_schedule(str(tmp_path), config, 400) is None  # the same length
    fixed = copy.deepcopy(longer)
    fixed.optimizer.decay_steps = 400  # the schedule it trained with, kept
    assert loop.restretched_schedule(str(tmp_path), fixed, 400) is None
    constant = copy.deepcopy(longer)
    constant.optimizer.schedule = "constant"
    assert loop.restretched_schedule(str(tmp_path), constant, 400) is None
    assert loop.restretched_schedule(str(tmp_path / "fresh"), longer, 0) is None  # no config.json


def test_a_warm_up_longer_than_the_run_is_named():
    """'constant' and 'rsqrt_paper' ran silently, their rate never reaching its peak (tiny with 2
    steps and 100 of warm-up ended at 6e-05 against a configured 3e-3); so did 'cosine' with a
    decay_steps longer than the warm-up (it refuses a shorter one)."""
    config = tiny.get_config()
    config.num_train_steps, config.optimizer.warmup_steps = 2, 100
    assert loop.unfinished_warmup(config) == (
        "WARNING: optimizer.warmup_steps=100 is longer than num_train_steps=2: the run ends during the "
        "warm-up, its learning rate reaching 2% of the 'constant' schedule's peak")
    config.optimizer.schedule = "rsqrt_paper"
    assert "'rsqrt_paper' schedule's peak" in loop.unfinished_warmup(config)
    config.optimizer.warmup_steps = 2  # warm-up ends with the run: the peak is reached
    assert loop.unfinished_warmup(config) is None
    config.optimizer.schedule, config.optimizer.warmup_steps = "cosine", 100
    config.optimizer.decay_steps = 400
    assert "reaching 2% of the 'cosine' schedule's peak" in loop.unfinished_warmup(config)


def test_dataset_settings_the_dataset_does_not_read_are_named():
    """Known keys pass the typo check, so train_files given to the built-in corpus, or a translation
    direction given to a language model, used to be dropped without a word."""
    from transformer_jax.training.config_checks import unread_dataset_settings

    config = tiny.get_config()  # enfr_builtin, builder_config 'small' (which it reads)
    assert unread_dataset_settings(config) == []
    config.dataset.train_files = ("/no/such.tsv",)
    config.dataset.reverse = True  # read: enfr_builtin is a translation dataset
    assert unread_dataset_settings(config) == [
        "WARNING: config.dataset.train_files=('/no/such.tsv',) is not read for dataset "
        "'enfr_builtin' (only for tsv, text): the run goes on without it"]
    config.dataset.name = "stdlib_lm"
    config.dataset.train_files = ()
    warnings = unread_dataset_settings(config)
    assert len(warnings) == 1 and warnings[0].startswith(
        "WARNING: config.dataset.reverse=True is not read for dataset 'stdlib_lm' "
        "(only for enfr_builtin, tsv,"), warnings
    config.dataset.name = "text"
    config.dataset.reverse = False
    assert [w.split("=")[0] for w in unread_dataset_settings(config)] == [
        "WARNING: config.dataset.builder_config"]


def test_training_settings_nothing_reads_are_named():
    """Settings nothing in the run reads (decay settings of a schedule that does not decay, a
    keep-best mode without its metric, the after-training evaluation's settings without it, a
    profiler window after the last step) were accepted without a word; a negative peak_tflops, a
    config mistake, was ignored (the MFU took the device's peak)."""
    from transformer_jax.training.config_checks import check_config, unread_training_settings

    config = tiny.get_config()  # enfr_builtin (translation), test_split 'test'
    assert unread_training_settings(config) == []
    config.optimizer.schedule, config.optimizer.decay_steps = "constant", 400
    config.optimizer.end_learning_rate_ratio = 0.1
    config.keep_best_mode = "min"
    config.profile_start_step = config.num_train_steps
    config.beam_size = 4
    config.test_split = ""
    tail = "; the run goes on without it"
    assert unread_training_settings(config) == [
        "WARNING: config.optimizer.decay_steps=400 is not read: only the 'cosine' schedule decays "
        "(optimizer.schedule is 'constant')" + tail,
        "WARNING: config.optimizer.end_learning_rate_ratio=0.1 is not read: only the 'cosine' schedule "
        "decays (optimizer.schedule is 'constant')" + tail,
        "WARNING: config.keep_best_mode='min' is not read: it ranks checkpoints by "
        "config.keep_best_metric, which is unset (the newest are kept)" + tail,
        "WARNING: config.beam_size=4 is not read: it is a setting of the translation evaluation after "
        "training, and config.test_split is unset" + tail,
        f"WARNING: config.profile_start_step={config.num_train_steps} is not read: the run's last step "
        f"is {config.num_train_steps - 1} (config.num_train_steps={config.num_train_steps}), so no "
        "profiler trace is captured" + tail]
    config.optimizer.schedule, config.keep_best_metric = "cosine", "eval_loss"
    config.test_split, config.profile_start_step = "test", config.num_train_steps - 1
    assert unread_training_settings(config) == []  # each read now
    config.dataset.name = "stdlib_lm"
    assert [w.split(" is not read")[0] for w in unread_training_settings(config)] == [
        "WARNING: config.test_split='test'", "WARNING: config.beam_size=4"]
    assert unread_training_settings(config)[1].endswith(
        "translation evaluation after training, and dataset 'stdlib_lm' is a language model's, which "
        "has none" + tail)
    config = tiny.get_config()
    config.peak_tflops = -100.0
    with pytest.raises(ConfigError, match=r"config.peak_tflops=-100.0 must be a number in \[0, inf\)"):
        check_config(config)


def test_key_from_seed_uses_all_64_bits_of_the_seed():
    """`key_from_seed` is JAX's key for the seed with 64-bit integers on: jax.random.key(seed) in
    [0, 2**32), and distinct keys where JAX's default keeps the low 32 bits (0, 2**32, -2**63 and
    -1, 2**32 - 1 fell together)."""
    from transformer_jax.params import key_from_seed

    seeds = (0, 1, 2**32 - 1, 2**32, 2**32 + 1, -1, -(2**63), 2**63 - 1)
    data = [tuple(np.asarray(jax.random.key_data(key_from_seed(s))).tolist()) for s in seeds]
    assert len(set(data)) == len(seeds), data
    assert data[3] == (1, 0) and data[5] == (2**32 - 1, 2**32 - 1)
    for s in (0, 1, 2**31, 2**32 - 1):
        np.testing.assert_array_equal(jax.random.key_data(key_from_seed(s)),
                                      jax.random.key_data(jax.random.key(s)))
        np.testing.assert_array_equal(key_from_seed(s, legacy=True), jax.random.PRNGKey(s))
    assert key_from_seed(2**32).dtype == jax.random.key(0).dtype
    for bad in (2**63, -(2**63) - 1):
        with pytest.raises(ValueError, match=r"must be in \[-2\*\*63, 2\*\*63\)"):
            key_from_seed(bad)
