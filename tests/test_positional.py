"""Sinusoidal encodings (section 3.5) and rotary embeddings."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import transformer_jax as tj
from transformer_jax.modeling import apply_rope, sinusoidal_encoding


def test_sinusoidal_equals_the_formula():
    d = 22
    pe = np.asarray(sinusoidal_encoding(jnp.arange(13), d))
    for pos in range(13):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert math.isclose(pe[pos, 2 * i], math.sin(angle), abs_tol=1e-5)
            assert math.isclose(pe[pos, 2 * i + 1], math.cos(angle), abs_tol=1e-5)


def test_sinusoidal_encoding_names_a_width_or_layout_it_cannot_make():
    """An odd d_model failed inside JAX (cannot reshape (3, 3, 2) into (3, 7)), positions given as a
    list with an AttributeError, and a misspelt layout gave the interleaved one."""
    np.testing.assert_array_equal(sinusoidal_encoding([0, 1, 2], np.int64(8)),
                                  sinusoidal_encoding(jnp.arange(3), 8))
    for width in (7, 0, -2, 8.0, "8"):
        with pytest.raises(ValueError, match=rf"d_model must be a positive even integer, got {width!r}"):
            sinusoidal_encoding(jnp.arange(3), width)
    with pytest.raises(ValueError, match="layout must be 'interleaved' or 'concat', got 'interleave'"):
        sinusoidal_encoding(jnp.arange(3), 8, "interleave")


def test_concat_layout_is_a_permutation_of_interleaved():
    inter = sinusoidal_encoding(jnp.arange(7), 10)
    concat = sinusoidal_encoding(jnp.arange(7), 10, layout="concat")
    np.testing.assert_allclose(concat[:, :5], inter[:, 0::2])
    np.testing.assert_allclose(concat[:, 5:], inter[:, 1::2])


def test_position_one_gets_the_same_vector_in_any_sentence():
    """'Cat drinks milk' and 'I love chocolates': what the model adds at position 1 is the same
    vector in both sentences, whatever the words."""
    cfg = tj.presets.tiny(dropout_rate=0.0)
    model = tj.TransformerLM(cfg)
    cat_drinks_milk, i_love_chocolates = jnp.array([[7, 8, 9]]), jnp.array([[11, 12, 13, 14]])
    params = model.init(jax.random.key(0), cat_drinks_milk)["params"]

    def position_part(tokens):
        def added(m, t):
            positions = jnp.arange(t.shape[1])[None]
            return m.decoder.embed_tokens(t, positions, True) - m.embed(t)

        return model.apply({"params": params}, tokens, method=added)[0]

    a, b = position_part(cat_drinks_milk), position_part(i_love_chocolates)
    np.testing.assert_allclose(a[1], b[1], atol=1e-6)
    np.testing.assert_allclose(a[1], sinusoidal_encoding(jnp.array(1), cfg.d_model), atol=1e-6)
    assert not np.allclose(a[1], a[2])


def test_rope_depends_only_on_relative_position():
    q = jax.random.normal(jax.random.key(0), (1, 1, 1, 16))
    k = jax.random.normal(jax.random.key(1), (1, 1, 1, 16))

    def score(m, n):
        qm = apply_rope(q, jnp.array([[m]]))
        kn = apply_rope(k, jnp.array([[n]]))
        return float(jnp.sum(qm * kn))

    assert math.isclose(score(3, 1), score(10, 8), rel_tol=1e-4)
    assert math.isclose(score(0, 0), float(jnp.sum(q * k)), rel_tol=1e-5)
    assert not math.isclose(score(3, 1), score(3, 2), rel_tol=1e-3)


def test_rope_attention_without_positions_is_an_error_naming_them():
    """MultiHeadAttention with rope_theta called without q_positions failed on `None.astype`."""
    from transformer_jax.modeling import MultiHeadAttention

    x = jax.random.normal(jax.random.key(0), (2, 5, 16))
    mha = MultiHeadAttention(d_model=16, num_heads=4, head_dim=4, num_kv_heads=2, rope_theta=1e4)
    with pytest.raises(ValueError, match="pass q_positions"):
        mha.init(jax.random.key(1), x)
    positions = jnp.arange(5)[None]
    variables = mha.init(jax.random.key(1), x, q_positions=positions)
    out, _ = mha.apply(variables, x, q_positions=positions)
    assert out.shape == (2, 5, 16)
    with pytest.raises(ValueError, match=r"need positions int \[B, L\].*got \(5,\)"):
        apply_rope(jnp.ones((2, 5, 4, 4)), jnp.arange(5))
