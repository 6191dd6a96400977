"""Parameters moved onto transparent huge pages (`transformer_jax.decoding.huge_pages`): the
pages really are huge afterwards, the values and the decoding do not change, and what cannot be
moved is named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import transformer_jax as tj
from transformer_jax.decoding import huge_pages
from transformer_jax.decoding.huge_pages import HugePages, place_on_huge_pages


def _huge_page_support():
    size = huge_pages.huge_page_size()
    if size is None:
        return None, "no transparent huge pages on this system"
    probe = place_on_huge_pages(jnp.ones((4 * size // 4,), jnp.float32))
    return (size, None) if probe.placed else (None, probe.reason)


SIZE, WHY_NOT = _huge_page_support()
needs_huge_pages = pytest.mark.skipif(SIZE is None, reason=f"no memory moves onto huge pages here: {WHY_NOT}")


def _anon_huge_bytes_around(start: int, end: int) -> int:
    """AnonHugePages of this process's mappings that overlap [start, end), in bytes."""
    total, overlaps = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(a, 16) for a in head.split("-"))
                overlaps = lo < end and start < hi
            elif overlaps and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


@needs_huge_pages
def test_the_memory_under_an_array_is_on_huge_pages_afterwards_with_its_values():
    values = np.random.default_rng(0).standard_normal((48 << 20) // 4).astype(np.float32)
    x = jax.device_put(values)  # its own buffer (jnp.asarray may borrow numpy's)
    address = x.unsafe_buffer_pointer()
    start, end = address // SIZE * SIZE, -(-(address + x.nbytes) // SIZE) * SIZE
    result = place_on_huge_pages({"w": x, "step": 3})
    assert result.requested == end - start and result.page_size == SIZE
    # Every whole huge page inside the array's 48 MiB moves (ranges at its edges may be refused).
    assert result.placed >= x.nbytes - 2 * SIZE, result
    assert _anon_huge_bytes_around(start, end) >= result.placed
    np.testing.assert_array_equal(np.asarray(x), values)
    assert x.unsafe_buffer_pointer() == address
    # Again: what moved stays (a range refused for want of a free huge page may move now).
    assert place_on_huge_pages(x).placed >= result.placed
    np.testing.assert_array_equal(np.asarray(x), values)


@needs_huge_pages
def test_every_shard_of_a_sharded_array_is_placed():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    values = np.arange((32 << 20) // 4, dtype=np.float32)
    x = jax.device_put(values, sharding)
    result = place_on_huge_pages(x)
    for shard in x.addressable_shards:
        p = shard.data.unsafe_buffer_pointer()
        huge = _anon_huge_bytes_around(p // SIZE * SIZE, p + shard.data.nbytes)
        assert huge >= shard.data.nbytes - 2 * SIZE
    assert result.placed >= x.nbytes - 4 * SIZE
    np.testing.assert_array_equal(np.asarray(x), values)


def test_decoding_is_the_same_after_the_parameters_move():
    config = tj.presets.tiny(dropout_rate=0.0, vocab_size=512, d_model=256, d_ff=1024, num_decoder_layers=2)
    model = tj.TransformerLM(config)
    params = model.init(jax.random.key(0), jnp.ones((1, 8), jnp.int32))["params"]
    prompt = jax.random.randint(jax.random.key(1), (2, 8), 3, config.vocab_size)
    lengths = jnp.array([8, 5], jnp.int32)

    def decode():
        out = tj.decoding.generate(tj.LMStep(model), params, tj.init_cache(config, 2, 24), prompt, lengths,
                                   max_new_tokens=16, eos_id=None)
        return np.asarray(out.tokens), np.asarray(out.logprobs)

    before = decode()
    place_on_huge_pages(params)
    after = decode()
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], before[1])


def test_what_cannot_be_placed_is_named(monkeypatch):
    assert place_on_huge_pages({"n": 3, "s": "text"}) in (
        HugePages(0, 0, huge_pages.huge_page_size() or 0, "no arrays in CPU memory"),
        HugePages(0, 0, 0, "this system has no transparent huge pages"),
    )
    deleted = jnp.ones((1024,))
    deleted.delete()
    assert place_on_huge_pages([deleted]).requested == 0
    monkeypatch.setattr(huge_pages, "huge_page_size", lambda: None)
    assert place_on_huge_pages(jnp.ones(8)) == HugePages(0, 0, 0, "this system has no transparent huge pages")


def test_a_kernel_that_refuses_the_call_is_reported_and_nothing_breaks(monkeypatch):
    """On a kernel before Linux 6.1 madvise(MADV_COLLAPSE) fails with EINVAL everywhere."""
    import ctypes
    import errno
    import types

    def refusing_madvise(address, length, advice):
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(huge_pages, "huge_page_size", lambda: 2 << 20)
    libc = types.SimpleNamespace(madvise=refusing_madvise)
    monkeypatch.setattr(ctypes, "CDLL", lambda name, use_errno: libc)
    x = jnp.ones((3 << 20) // 4, jnp.float32)
    result = place_on_huge_pages(x)
    assert result.placed == 0 and result.requested >= 3 << 20
    assert "Linux 6.1" in result.reason and "EINVAL" in result.reason
    np.testing.assert_array_equal(np.asarray(x), 1.0)
