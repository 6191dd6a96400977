"""Masks written out as literal matrices (1 = may attend)."""

import jax.numpy as jnp
import numpy as np

from transformer_jax.modeling import masks


def test_causal_mask_literal():
    expected = np.array([
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 1, 1, 0],
        [1, 1, 1, 1],
    ], bool)
    np.testing.assert_array_equal(masks.causal_mask(4)[0, 0], expected)


def test_padding_mask_literal():
    q = jnp.array([[True, True, False]])
    kv = jnp.array([[True, False]])
    expected = np.array([[1, 0], [1, 0], [0, 0]], bool)
    np.testing.assert_array_equal(masks.padding_mask(q, kv)[0, 0], expected)


def test_segment_mask_literal():
    seg = jnp.array([[1, 1, 2, 2, 2, 0]])
    expected = np.array([
        [1, 1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 0],
    ], bool)
    np.testing.assert_array_equal(masks.segment_mask(seg, seg)[0, 0], expected)


def test_packed_causal_combination_literal():
    seg = jnp.array([[1, 1, 2, 2]])
    m = masks.combine_masks(masks.causal_mask(4), masks.segment_mask(seg, seg), None)
    expected = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], bool)
    np.testing.assert_array_equal(m[0, 0], expected)
    assert masks.combine_masks(None, None) is None


def test_cache_mask_literal():
    # Row 0 has 2 tokens cached, row 1 has 0; two new queries each, cache of 4 slots.
    m = masks.cache_mask(jnp.array([2, 0]), 2, 4)
    np.testing.assert_array_equal(m[0, 0], np.array([[1, 1, 1, 0], [1, 1, 1, 1]], bool))
    np.testing.assert_array_equal(m[1, 0], np.array([[1, 0, 0, 0], [1, 1, 0, 0]], bool))


def test_shift_right_plain_and_packed():
    t = jnp.array([[5, 6, 7, 1]])
    np.testing.assert_array_equal(masks.shift_right(t, start_id=2), [[2, 5, 6, 7]])
    t = jnp.array([[5, 6, 1, 8, 1, 0]])
    seg = jnp.array([[1, 1, 1, 2, 2, 0]])
    np.testing.assert_array_equal(masks.shift_right(t, seg, start_id=2), [[2, 5, 6, 2, 8, 0]])
