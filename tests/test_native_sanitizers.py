"""The native CPU kernels under AddressSanitizer, UndefinedBehaviorSanitizer and ThreadSanitizer.

Apart from tests/test_native_kernels.py so that the two CI workers can run its long builds and
sweeps (the longest file of the suite) beside the other kernel tests, not after them."""

import os
import re
import subprocess
import sys

import jax
import pytest

from transformer_jax.modeling import native


@pytest.mark.parametrize("isa,sanitizers", [("avx512", "address,undefined"), ("avx2", "address,undefined"),
                                             ("avx512", "thread")])
def test_every_kernel_under_the_sanitizers(tmp_path, isa, sanitizers):
    """tests/native_sanitizer.cc runs every kernel (the products of [out, in] and [in, out] weights at
    1-16 rows on both bf16 paths and of packed bf16 weights, alone and with a bias and activation
    after them, the cache attention, the cache write,
    beam search's cache reordering, the greedy choice, the bias and activation, the training
    attention forward and backward, the in-place identity, the norms) over ~50,000 awkward shapes
    (~38,500 on AVX2, which has one bf16 path) on buffers of exactly their size, some flush against a
    no-access page, with the work split over threads as XLA's pool splits it, and checks each result against
    a scalar reference: under AddressSanitizer and UndefinedBehaviorSanitizer for each instruction set
    (one case in three for AVX-512; AddressSanitizer alone, over one case in four, for AVX2 where the
    CPU runs AVX-512), and
    under ThreadSanitizer one in four of the ~17,700 cases whose work can be split over threads,
    picked by a hash of each case's parameters (one in four rather than two: ThreadSanitizer's run
    22.6 -> 12.1 s here; the three took 109 s, ~40 s of it the build of the full run; pools of one
    thread run a kernel inline, as a product of [out, in] weights with one task's output rows does,
    and the values in a product's operands do not change its split; the
    references and the drawing of operands run uninstrumented: 99 -> 37 s here). It found the
    greedy choice naming token V past the vocabulary when every logit is negative (fixed; the tests
    above cover it too)."""
    import platform
    import shutil

    needed = native.ISAS[isa][0]
    if sys.platform != "linux" or platform.machine() != "x86_64" or not set(needed) <= native._cpu_flags():
        pytest.skip(f"this CPU cannot run the {isa} kernels")
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        pytest.skip("no C++ compiler")
    secondary = isa == "avx2" and set(native.ISAS["avx512"][0]) <= native._cpu_flags()
    if secondary:
        # A CPU that runs the AVX-512 kernels checks the code both builds share under
        # UndefinedBehaviorSanitizer there; the AVX2 build, which runs nowhere else in the suite,
        # under AddressSanitizer alone: 64 -> 41 s (an AVX2-only CPU keeps both), over one in four
        # cases of the sweep (an AVX2-only CPU runs them all).
        sanitizers = "address"
    here = os.path.dirname(os.path.abspath(__file__))
    binary = tmp_path / f"sanitized_{isa}"
    # -Og: with the sanitizers, 25 s to build and 39 s to run here, against 44 and 36 s at -O1
    command = [compiler, "-std=c++17", f"-fsanitize={sanitizers}", "-fno-omit-frame-pointer", "-Og",
               *native.ISAS[isa][1], f"-I{jax.ffi.include_dir()}", f"-I{native.SOURCE.parent}",
               os.path.join(here, "native_sanitizer.cc"), "-o", str(binary), "-lpthread"]
    probe = tmp_path / "probe.cc"
    probe.write_text("int main() { return 0; }\n")
    trivial = subprocess.run([compiler, f"-fsanitize={sanitizers}", str(probe), "-o", str(tmp_path / "a")],
                             capture_output=True, text=True, timeout=120)
    if trivial.returncode:  # no runtime for these sanitizers here (libasan, libubsan, libtsan)
        pytest.skip(f"{compiler} cannot build with -fsanitize={sanitizers}: {trivial.stderr[-300:]}")
    built = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    env = dict(os.environ, UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1", TSAN_OPTIONS="halt_on_error=1")
    threads = sanitizers == "thread"
    if threads:  # only the cases whose work can be split over threads (17,695 of 51,082 on AVX-512)
        env["SANITIZER_SWEEP"] = "threads"
    # races need the splits, not every shape; AVX-512 under ASan and UBSan takes one case in three
    # (the suite's longest test: 72 s here over every case, 56-61 s over one in two, 48 s over one in
    # three, ~25 s of it the build; ~17,000 cases still)
    stride = 4 if threads or secondary else 3
    env["SANITIZER_STRIDE"] = str(stride)
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = re.search(r": (\d+) cases, (\d+) mismatches, (\d+) on several threads", run.stdout)
    # ~51,000 cases; ~38,500 on AVX2, where bf16 products have one path (widened), not two. Of those,
    # ~7,800 (~5,900 with one kind of product data) hand work to another thread.
    assert summary, run.stdout[-2000:]
    cases, mismatches, parallel = (int(g) for g in summary.groups())
    assert cases * stride > (15_000 if threads else 45_000 if isa == "avx512" else 34_000), run.stdout[-2000:]
    assert parallel * stride > (4_000 if isa == "avx2" else 5_000 if threads else 7_500), run.stdout[-2000:]
    assert mismatches == 0, run.stdout[-2000:]
    if threads:  # the check itself: a deliberate data race is reported
        probe = subprocess.run([str(binary), "selftest", "3"], capture_output=True, text=True, timeout=60,
                               env=env)
        assert probe.returncode != 0 and "data race" in probe.stderr, (probe.stdout, probe.stderr[-2000:])
    # The check itself: an unmasked overread is reported by ASan, a masked one faults on the page.
    for mode in ("0", "2") if "address" in sanitizers else ():
        probe = subprocess.run([str(binary), "selftest", mode], capture_output=True, text=True, timeout=60,
                               env=env)
        assert probe.returncode != 0 and "no report" not in probe.stdout, (mode, probe.stdout, probe.stderr)
