"""Token-level cross-entropy with label smoothing and z-loss, and the metrics built from it.

Label smoothing (section 5.4 of the paper, ε_ls = 0.1) uses the tensor2tensor convention, the code
the paper's results came from: the target token gets probability ``1 - ε`` and the remaining ``ε``
is spread evenly over the other ``V - 1`` tokens,

    q_k = 1 - ε              if k == target
    q_k = ε / (V - 1)        otherwise.

The loss is the KL divergence ``KL(q || p) = Σ_k q_k (log q_k - log p_k)``: the cross-entropy
``-Σ q_k log p_k`` minus the constant entropy of ``q``. Subtracting that constant changes no
gradient, but makes the loss 0 when the model predicts exactly ``q`` (and ``ε = 0`` gives plain
negative log-likelihood). PyTorch's ``label_smoothing`` differs: it spreads ``ε / V`` over all V
tokens and keeps the entropy term, so its numbers are not comparable.

Everything is computed in float32 whatever the logits' dtype. Functions return *sums* over tokens;
the caller divides by the number of real (non-pad) tokens, which stays exact across gradient
accumulation and across hosts.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def _xlogx(x: float) -> float:
    return 0.0 if x <= 0.0 else x * math.log(x)


def smoothing_entropy(vocab_size: int, label_smoothing: float) -> float:
    """Entropy of the smoothed target distribution ``q`` (the constant subtracted per token)."""
    confidence = 1.0 - label_smoothing
    low = label_smoothing / (vocab_size - 1)
    return -(_xlogx(confidence) + (vocab_size - 1) * _xlogx(low))


def cross_entropy(
    logits: jax.Array,
    targets: jax.Array,
    weights: jax.Array | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Summed, weighted token cross-entropy.

    Args:
      logits: ``[B, L, V]``, any float dtype (upcast to float32).
      targets: ``[B, L]`` int token ids; where the weight is 0 any value (e.g. -100) is ignored.
      weights: ``[B, L]``, 1 for real tokens and 0 for padding (``targets_segment_ids > 0``);
        None means every token counts.
      label_smoothing: ε_ls; see the module docstring for the convention.
      z_loss: coefficient of the auxiliary ``(log Z)^2`` penalty (PaLM, t5x), which keeps the
        softmax normaliser near 1 and helps bfloat16 stability; 0 disables it.

    Returns:
      ``(loss_sum, weight_sum, aux)``: ``loss_sum`` = Σ weight * (smoothed KL + z_loss term),
      ``weight_sum`` = Σ weight, and ``aux`` with weighted sums ``'nll'`` (unsmoothed negative
      log-likelihood, for perplexity), ``'z_loss'`` (the z-loss term alone) and ``'correct'``
      (argmax hits, for accuracy).
    """
    logits = logits.astype(jnp.float32)
    vocab_size = logits.shape[-1]
    weights = jnp.ones(targets.shape, jnp.float32) if weights is None else weights
    weights = weights.astype(jnp.float32)

    log_z = jax.nn.logsumexp(logits, axis=-1)  # [B, L]
    # Padding may hold any id (-100, PyTorch's ignore_index, or vocab_size): it is read as id 0,
    # since an out-of-range gather gives NaN, and NaN x weight 0 is NaN.
    targets = jnp.where(weights > 0, targets, 0)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    nll = log_z - target_logit  # -log p_target
    if label_smoothing > 0.0:
        # -Σ_k q_k log p_k without a one-hot: Σ_k log p_k = Σ_k logits_k - V log Z.
        confidence = 1.0 - label_smoothing
        low = label_smoothing / (vocab_size - 1)
        sum_neg_log_p = vocab_size * log_z - jnp.sum(logits, axis=-1)
        smoothed = confidence * nll + low * (sum_neg_log_p - nll)
        loss = smoothed - smoothing_entropy(vocab_size, label_smoothing)
    else:
        loss = nll
    z_term = z_loss * jnp.square(log_z)
    loss = loss + z_term

    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    aux = {
        "nll": jnp.sum(nll * weights),
        "z_loss": jnp.sum(z_term * weights),
        "correct": jnp.sum(correct * weights),
    }
    return jnp.sum(loss * weights), jnp.sum(weights), aux


def _safe_div(x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.where(y > 0, x / jnp.where(y > 0, y, 1.0), 0.0)


def normalize_metrics(
    loss_sum: jax.Array, weight_sum: jax.Array, aux: dict[str, jax.Array]
) -> dict[str, jax.Array]:
    """Per-token means from (possibly accumulated) sums of :func:`cross_entropy`.

    Returns ``loss`` (what is optimised), ``nll``, ``perplexity`` = exp(nll) (unsmoothed, as the
    paper reports it), ``accuracy``, ``z_loss`` and ``num_tokens``.
    """
    nll = _safe_div(aux["nll"], weight_sum)
    return {
        "loss": _safe_div(loss_sum, weight_sum),
        "nll": nll,
        "perplexity": jnp.exp(nll),
        "accuracy": _safe_div(aux["correct"], weight_sum),
        "z_loss": _safe_div(aux["z_loss"], weight_sum),
        "num_tokens": weight_sum,
    }


def compute_metrics(
    logits: jax.Array,
    targets: jax.Array,
    weights: jax.Array | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
) -> dict[str, jax.Array]:
    """Per-token loss, nll, perplexity, accuracy, z_loss and num_tokens for one batch.

    To average over many eval batches, sum :func:`cross_entropy`'s outputs and call
    :func:`normalize_metrics` once at the end instead.
    """
    return normalize_metrics(*cross_entropy(logits, targets, weights, label_smoothing, z_loss))
