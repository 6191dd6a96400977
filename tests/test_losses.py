"""Cross-entropy with label smoothing (tensor2tensor convention), pad masking, z-loss, metrics."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.training import losses

EPS = 0.1  # the paper's ε_ls
RNG = np.random.default_rng(0)


def _logits(*shape, scale=1.0):
    return jnp.asarray(RNG.normal(size=shape) * scale, jnp.float32)


def _targets(*shape, vocab):
    return jnp.asarray(RNG.integers(0, vocab, size=shape), jnp.int32)


# jit keeps these tests fast: eager dispatch over 8 simulated devices is slow.
cross_entropy = jax.jit(losses.cross_entropy, static_argnames=("label_smoothing", "z_loss"))


def _hand_smoothed_kl(logits_row, target, eps):
    """KL(q || softmax(logits)) written out term by term for one token."""
    v = len(logits_row)
    z = math.log(sum(math.exp(x) for x in logits_row))
    total = 0.0
    for k, x in enumerate(logits_row):
        q = 1.0 - eps if k == target else eps / (v - 1)
        total += q * (math.log(q) - (x - z))
    return total


def test_label_smoothing_matches_hand_computation():
    logits = np.array([[[2.0, -1.0, 0.5, 0.0, 1.5], [0.1, 0.2, 0.3, 0.4, 0.5]]], np.float32)
    targets = np.array([[0, 3]])
    loss_sum, weight_sum, _ = cross_entropy(logits, targets, label_smoothing=EPS)
    expected = _hand_smoothed_kl(logits[0, 0], 0, EPS) + _hand_smoothed_kl(logits[0, 1], 3, EPS)
    np.testing.assert_allclose(loss_sum, expected, rtol=1e-6)
    assert float(weight_sum) == 2.0


def test_label_smoothing_worked_example():
    # V=3, uniform prediction p = 1/3, target 0, ε=0.1 -> q = [0.9, 0.05, 0.05]:
    # KL = 0.9 ln(0.9 * 3) + 2 * 0.05 ln(0.05 * 3) = 0.9 ln 2.7 + 0.1 ln 0.15 = 0.7042150
    loss_sum, _, aux = cross_entropy(jnp.zeros((1, 1, 3)), jnp.array([[0]]), None, EPS)
    np.testing.assert_allclose(loss_sum, 0.9 * math.log(2.7) + 0.1 * math.log(0.15), rtol=1e-6)
    np.testing.assert_allclose(loss_sum, 0.7042150, rtol=1e-6)
    np.testing.assert_allclose(aux["nll"], math.log(3), rtol=1e-6)


def test_loss_is_zero_at_the_smoothed_distribution_and_positive_elsewhere():
    v = 7
    q = np.full(v, EPS / (v - 1))
    q[4] = 1 - EPS
    logits = np.log(q)[None, None, :].astype(np.float32)
    loss_sum, _, aux = cross_entropy(logits, np.array([[4]]), label_smoothing=EPS)
    np.testing.assert_allclose(loss_sum, 0.0, atol=1e-6)
    np.testing.assert_allclose(aux["nll"], -math.log(1 - EPS), rtol=1e-6)  # unsmoothed NLL
    sharper, _, _ = cross_entropy(logits * 3, np.array([[4]]), label_smoothing=EPS)
    assert float(sharper) > 0.01


def test_gradient_is_softmax_minus_smoothed_targets():
    logits = _logits(2, 3, 11)
    targets = _targets(2, 3, vocab=11)
    grad = jax.grad(lambda x: cross_entropy(x, targets, label_smoothing=EPS)[0])(logits)
    q = jax.nn.one_hot(targets, 11) * (1 - EPS - EPS / 10) + EPS / 10
    np.testing.assert_allclose(grad, jax.nn.softmax(logits) - q, atol=1e-6)


def test_no_smoothing_is_negative_log_likelihood():
    logits = _logits(3, 5, 13)
    targets = _targets(3, 5, vocab=13)
    loss_sum, weight_sum, aux = cross_entropy(logits, targets)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1).sum()
    np.testing.assert_allclose(loss_sum, nll, rtol=1e-6)
    np.testing.assert_allclose(aux["nll"], nll, rtol=1e-6)
    assert float(weight_sum) == 15.0


def test_weights_mask_padding():
    logits = _logits(2, 4, 9)
    targets = jnp.array([[5, 6, 1, 0], [3, 1, 0, 0]])
    weights = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]], jnp.float32)
    loss_sum, weight_sum, aux = cross_entropy(logits, targets, weights, EPS, 1e-3)
    garbage = logits.at[0, 3].set(100.0).at[1, 2:].set(-50.0)
    loss2, weight2, aux2 = cross_entropy(garbage, targets, weights, EPS, 1e-3)
    assert float(weight_sum) == float(weight2) == 5.0
    np.testing.assert_allclose(loss_sum, loss2, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), aux, aux2)


def test_padding_may_hold_any_id():
    """-100 (PyTorch's ignore_index) or vocab_size at weight 0 changes nothing; it gave NaN (an
    out-of-range gather fills NaN, and NaN x 0 is NaN), gradients included."""
    logits = _logits(2, 4, 9)
    weights = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]], jnp.float32)
    clean = jnp.array([[5, 6, 1, 0], [3, 1, 0, 0]])
    want = cross_entropy(logits, clean, weights, EPS, 1e-3)
    grad = lambda t: jax.grad(lambda x: cross_entropy(x, t, weights, EPS, 1e-3)[0])(logits)
    for fill in (-100, 9, 12345):
        targets = jnp.where(weights > 0, clean, fill)
        got = cross_entropy(logits, targets, weights, EPS, 1e-3)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, want)
        np.testing.assert_allclose(grad(targets), grad(clean), rtol=1e-6)


def test_z_loss_adds_coefficient_times_log_z_squared():
    logits = _logits(2, 3, 8, scale=3)
    targets = _targets(2, 3, vocab=8)
    base, _, _ = cross_entropy(logits, targets, label_smoothing=EPS)
    with_z, _, aux = cross_entropy(logits, targets, label_smoothing=EPS, z_loss=1e-2)
    expected = 1e-2 * jnp.sum(jax.nn.logsumexp(logits, -1) ** 2)
    np.testing.assert_allclose(aux["z_loss"], expected, rtol=1e-6)
    np.testing.assert_allclose(with_z - base, expected, rtol=1e-5)


def test_bfloat16_logits_are_computed_in_float32():
    logits = _logits(2, 3, 32)
    targets = _targets(2, 3, vocab=32)
    low, _, _ = cross_entropy(logits.astype(jnp.bfloat16), targets, label_smoothing=EPS)
    high, _, _ = cross_entropy(logits.astype(jnp.bfloat16).astype(jnp.float32), targets, label_smoothing=EPS)
    assert low.dtype == jnp.float32
    np.testing.assert_allclose(low, high, rtol=1e-6)


def test_compute_metrics():
    logits = jnp.log(jnp.array([[[0.7, 0.2, 0.1], [0.2, 0.5, 0.3], [0.1, 0.1, 0.8]]]))
    targets = jnp.array([[0, 2, 1]])
    weights = jnp.array([[1.0, 1.0, 0.0]])
    m = losses.compute_metrics(logits, targets, weights)
    nll = -(math.log(0.7) + math.log(0.3)) / 2
    np.testing.assert_allclose(m["loss"], nll, rtol=1e-6)
    np.testing.assert_allclose(m["perplexity"], math.exp(nll), rtol=1e-6)
    np.testing.assert_allclose(m["accuracy"], 0.5)
    assert float(m["num_tokens"]) == 2.0
    empty = losses.compute_metrics(logits, targets, jnp.zeros_like(weights))
    assert float(empty["loss"]) == 0.0 and float(empty["accuracy"]) == 0.0


@pytest.mark.parametrize("v, eps", [(2, 0.1), (37000, 0.1), (100, 0.0)])
def test_smoothing_entropy(v, eps):
    q = np.full(v, eps / (v - 1))
    q[0] = 1 - eps
    q = q[q > 0]
    np.testing.assert_allclose(losses.smoothing_entropy(v, eps), -np.sum(q * np.log(q)), rtol=1e-9)


def _step_problem(dropout_rate):
    """A tiny encoder-decoder, a packed batch of two rows (one with padding) and its parameters."""
    import transformer_jax as tj

    model = tj.Transformer(tj.presets.tiny(vocab_size=16, dropout_rate=dropout_rate))
    seg = jnp.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]], jnp.int32)
    pos = jnp.array([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]], jnp.int32)
    ids = jax.random.randint(jax.random.key(0), (2, 6), 3, 16) * (seg > 0)
    batch = {"inputs": ids, "inputs_segment_ids": seg, "inputs_positions": pos,
             "targets": ids[:, ::-1] * (seg > 0), "targets_segment_ids": seg, "targets_positions": pos}
    return model, batch, model.init(jax.random.key(1), ids, ids)["params"]


def test_train_and_eval_steps_pass_z_loss_and_label_smoothing_to_the_loss():
    """StepSettings reach the loss of the train and eval steps (one function computes it for both):
    every end-to-end config has z_loss = 0, so a step that dropped it passed (the loss itself is
    tested above)."""
    from transformer_jax.training import steps

    model, batch, params = _step_problem(dropout_rate=0.0)
    seg = batch["targets_segment_ids"]
    logits = jax.jit(lambda p, b: steps.forward(model, p, b, train=False))(params, batch)
    weights = np.asarray(seg > 0, np.float32)
    settings = steps.StepSettings(label_smoothing=0.1, z_loss=1e-2)
    sums = jax.jit(lambda p, b: steps.eval_step(p, b, model=model, settings=settings))(params, batch)
    z = float(np.sum(weights * np.asarray(jax.nn.logsumexp(logits, -1)) ** 2))
    np.testing.assert_allclose(sums["z_loss"], 1e-2 * z, rtol=1e-5)
    plain, _, _ = cross_entropy(logits, batch["targets"], weights, label_smoothing=0.1)
    np.testing.assert_allclose(sums["loss_sum"], plain + 1e-2 * z, rtol=1e-5)


def test_train_step_accumulates_micro_batches_with_a_key_each():
    """grad_accum_steps=2 with dropout: the step's loss is the token-weighted loss of rows 0 and 1
    run as two micro-batches, with keys split(fold_in(rng, step), 2) (a step that ignored the
    setting ran one batch with one key: equal losses without dropout, so only dropout shows it)."""
    import optax

    from transformer_jax.training import steps
    from transformer_jax.training.state import TrainState

    model, batch, params = _step_problem(dropout_rate=0.3)
    rng, step = jax.random.key(5), 3
    state = TrainState(step=jnp.int32(step), params=params, opt_state=optax.sgd(0.0).init(params), rng=rng)
    settings = steps.StepSettings(label_smoothing=0.1, grad_accum_steps=2)
    train = lambda st, b: steps.train_step(st, b, model=model, tx=optax.sgd(0.0), schedule=lambda c: 0.0,
                                           settings=settings)
    _, metrics = jax.jit(train)(state, batch)
    keys = jax.random.split(jax.random.fold_in(rng, step), 2)
    loss_sum = weight = 0.0
    for row, key in zip((0, 1), keys):  # micro-batch i holds rows i, i + 2, ...: here row i alone
        micro = {k: v[row:row + 1] for k, v in batch.items()}
        logits = steps.forward(model, params, micro, train=True, rng=key)
        w = micro["targets_segment_ids"] > 0
        total, count, _ = cross_entropy(logits, micro["targets"], w, label_smoothing=0.1)
        loss_sum, weight = loss_sum + float(total), weight + float(count)
    np.testing.assert_allclose(metrics["loss"], loss_sum / weight, rtol=1e-5)


def test_eval_step_runs_the_model_without_dropout():
    """With P_drop = 0.3 the eval step's sums are those of the deterministic model (decoder fed the
    targets shifted right), while the training forward pass does drop: every end-to-end config
    trains tiny models with dropout 0, where an eval step with dropout on passed."""
    from transformer_jax.modeling.masks import shift_right
    from transformer_jax.training import steps

    model, batch, params = _step_problem(dropout_rate=0.3)
    seg, pos = batch["targets_segment_ids"], batch["targets_positions"]
    tgt_in = shift_right(batch["targets"], seg, model.config.decoder_start_id)
    apply = jax.jit(lambda p, deterministic, key: model.apply(
        {"params": p}, batch["inputs"], tgt_in, src_segment_ids=batch["inputs_segment_ids"],
        tgt_segment_ids=seg, src_positions=batch["inputs_positions"], tgt_positions=pos,
        deterministic=deterministic, rngs={"dropout": key}), static_argnums=1)
    clean = apply(params, True, jax.random.key(0))
    assert not np.allclose(apply(params, False, jax.random.key(0)), clean)  # dropout is on in training
    settings = steps.StepSettings(label_smoothing=0.1)
    sums = jax.jit(lambda p, b: steps.eval_step(p, b, model=model, settings=settings))(params, batch)
    want, count, _ = cross_entropy(clean, batch["targets"], seg > 0, label_smoothing=0.1)
    assert float(sums["weight_sum"]) == float(count) == 11.0  # the 11 real target tokens
    np.testing.assert_allclose(sums["loss_sum"], want, rtol=1e-5)


@jax.custom_vjp
def _nan_gradient(x):
    return x


_nan_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.full_like(g, jnp.nan),))


class _BroadcastLM:
    """A decoder-only 'model' whose logits at every position are its parameter vector w, passed
    through ``through`` (e.g. `_nan_gradient`: finite logits and loss, a NaN gradient, as when only
    the backward pass overflows)."""

    config = type("Config", (), {"decoder_start_id": 2})()

    def __init__(self, through=lambda w: w):
        self.through = through

    def apply(self, variables, tokens, **kwargs):
        w = variables["params"]["w"]
        return jnp.broadcast_to(self.through(w), tokens.shape + w.shape)


def _broadcast_lm_step(model, tx, w):
    """One train_step of ``model`` from w at step 7 on one row: targets 3, 4, 1 and a padding slot."""
    from transformer_jax.training import steps
    from transformer_jax.training.state import TrainState

    params = {"w": jnp.asarray(w, jnp.float32)}
    state = TrainState(step=jnp.int32(7), params=params, opt_state=tx.init(params), rng=jax.random.key(0))
    batch = {"targets": jnp.array([[3, 4, 1, 0]], jnp.int32),
             "targets_segment_ids": jnp.array([[1, 1, 1, 0]], jnp.int32),
             "targets_positions": jnp.array([[0, 1, 2, 0]], jnp.int32)}
    train = jax.jit(lambda st, b: steps.train_step(st, b, model=model, tx=tx, schedule=lambda c: 0.1 * c,
                                                   settings=steps.StepSettings(label_smoothing=0.0)))
    return state, *train(state, batch)


def test_train_step_applies_the_update_for_the_mean_loss_over_real_tokens():
    """With uniform logits (w = 0) the loss of each of the 3 real tokens is log 5 and its gradient
    softmax(w) - onehot(target) = 0.2 - onehot: summed over targets 3, 4, 1 that is
    (0.6, -0.4, 0.6, -0.4, -0.4), divided by the 3 real tokens, not the 4 slots. SGD with rate 0.5
    then moves w by -0.5 times that."""
    import optax

    state, new, metrics = _broadcast_lm_step(_BroadcastLM(), optax.sgd(0.5), np.zeros(5))
    grad = np.array([0.6, -0.4, 0.6, -0.4, -0.4]) / 3
    assert float(metrics["loss"]) == pytest.approx(math.log(5), rel=1e-6)
    assert float(metrics["num_tokens"]) == 3.0 and float(metrics["finite"]) == 1.0
    assert float(metrics["learning_rate"]) == pytest.approx(0.7)  # the schedule (0.1 * count) at step 7
    assert float(metrics["grad_norm"]) == pytest.approx(np.linalg.norm(grad), rel=1e-6)
    np.testing.assert_allclose(new.params["w"], -0.5 * grad, rtol=1e-6)
    assert int(new.step) == 8


def test_a_step_with_a_finite_loss_but_non_finite_gradients_changes_nothing_but_the_step():
    """The guard looks at the gradients too, not only the loss: the step is reported not finite and
    neither the parameters nor the Adam moments and count take the NaN update."""
    import optax

    state, new, metrics = _broadcast_lm_step(_BroadcastLM(_nan_gradient), optax.adam(0.1), np.arange(5))
    params = state.params
    # each of the 3 real tokens: -log softmax(0..4)[target] = logsumexp(0..4) - target
    lse = math.log(sum(math.exp(i) for i in range(5)))
    assert float(metrics["loss"]) == pytest.approx(lse - (3 + 4 + 1) / 3, rel=1e-5)
    assert float(metrics["finite"]) == 0.0 and int(new.step) == 8
    np.testing.assert_array_equal(new.params["w"], params["w"])
    for got, old in zip(jax.tree.leaves(new.opt_state), jax.tree.leaves(state.opt_state)):
        np.testing.assert_array_equal(got, old)


def test_a_step_with_finite_gradients_but_a_non_finite_update_changes_nothing_but_the_step():
    """Adam with eps = 0 turns a gradient that is exactly 0 (here w[0], which the logits ignore: as a
    dead ReLU unit or an unused embedding row) into 0 / 0 = NaN. Loss and gradients are finite, so a
    guard on them alone let the NaN into the parameters, reported the step as finite and checkpointed
    it as good; the guard checks the update too."""
    import optax

    model = _BroadcastLM(lambda w: w.at[0].set(0.0))
    state, new, metrics = _broadcast_lm_step(model, optax.adam(0.1, eps=0.0), np.arange(5))
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
    assert float(metrics["finite"]) == 0.0 and int(new.step) == 8
    np.testing.assert_array_equal(new.params["w"], state.params["w"])
    for got, old in zip(jax.tree.leaves(new.opt_state), jax.tree.leaves(state.opt_state)):
        np.testing.assert_array_equal(got, old)


def test_perplexity_is_of_the_unsmoothed_nll_not_the_smoothed_loss():
    # V=3, uniform prediction: nll = ln 3, so perplexity is 3 whatever the smoothing (the smoothed
    # loss is 0.704, whose exp would be 2.02).
    metrics = jax.jit(losses.compute_metrics, static_argnames=("label_smoothing",))
    m = metrics(jnp.zeros((1, 2, 3)), jnp.array([[0, 2]]), label_smoothing=EPS)
    np.testing.assert_allclose(m["perplexity"], 3.0, rtol=1e-6)
    np.testing.assert_allclose(m["loss"], 0.7042150, rtol=1e-6)
