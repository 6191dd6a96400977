"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
# The suite compiles faster with processes.FAST_COMPILE_FLAGS (the reasons are there);
# TJ_TEST_XLA_OPT=default tests with XLA's own settings.
from processes import FAST_COMPILE_FLAGS  # noqa: E402  (tests/ is on sys.path; it imports no jax)

if os.environ.get("TJ_TEST_XLA_OPT") != "default":
    for flag in FAST_COMPILE_FLAGS:
        if flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
            os.environ["XLA_FLAGS"] += " " + flag
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Scripts the tests start in child processes import the package from this checkout, installed or
# not (the README's test command installs only the requirements).
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join([_REPO, *filter(None, [os.environ.get("PYTHONPATH")])])
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import gc  # noqa: E402

import jax  # noqa: E402

# Parity tests compare against float32 references; keep matmuls exact on CPU.
jax.config.update("jax_default_matmul_precision", "highest")

# `--dist loadfile` gives each of the two workers whole files. xdist hands out the files with the
# most tests first, which leaves files of a few long tests (the SIGKILL chaos run, multi-process
# training) for the end, where one worker runs them while the other idles. The longest files go
# first instead (seconds of test time on the 2-core CI machine in parentheses); the rest follow in
# collection order. Each file's own test order is kept.
LONGEST_FILES_FIRST = (  # measured 2026-12-07 on an Intel Xeon host with AMX (AVX-512)
    "test_native_kernels.py",  # 226
    "test_train.py",  # 176
    "test_checkpoint.py",  # 138
    "test_native_sanitizers.py",  # 127 (three builds; two of the three runs sampled)
    "test_kernel_layout.py",  # 92
    "test_benchmarks.py",  # 75
    "test_fault_checkpoint.py",  # 73
    "test_generate_cli.py",  # 70
    "test_notebooks.py",  # 68
    "test_transformer.py",  # 67
    "test_chunked_attention.py",  # 51
    "test_fault_chaos.py",  # 39 (3 kills)
    "test_fault_multihost.py",  # 38
    "test_matmul.py",  # 38
    "test_decoding_model.py",  # 34
    "test_decoding.py",  # 34
    "test_convert.py",  # 28
)


# Each worker builds up a heap of over a million long-lived objects (JAX's tracing and compilation
# caches), and every full collection walks all of it again: 20-35 of 0.5-2 s per worker over a run,
# and at exit five more (pytest collects five times to report unraisable exceptions), long enough
# that xdist's shutdown, which gives a finished worker 5 s, interrupted it with a KeyboardInterrupt.
# What survives a full collection moves to the permanent generation as the collection ends (nothing
# garbage is left at that moment), so later collections walk only what came after: full collections
# 55 -> 19 s over the two workers of a run, and the five at exit 1.6-2 s -> ~2 ms each. Frozen
# objects are still freed when their last reference goes.
def _freeze_survivors(phase, info):
    if phase == "stop" and info["generation"] == 2:
        gc.freeze()


gc.callbacks.append(_freeze_survivors)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a file
