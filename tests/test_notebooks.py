"""Executes every notebook in notebooks/ top to bottom, headless, in small mode; fails on any error.

Each notebook runs in a fresh Jupyter kernel (nbclient, kernel 'python3': ipykernel's native kernel
on this interpreter when no kernelspec is installed) with
``TJ_NOTEBOOK_SMALL=1``, the repository on ``PYTHONPATH`` and a temporary working directory shared
by the notebooks of one session (so 02 reuses the model 01 trained, as a user's would). The kernels
get one CPU device and XLA's default compilation: conftest.py's 8 simulated devices and
``processes.FAST_COMPILE_FLAGS`` are removed from ``XLA_FLAGS`` (04_scaling_out sets its own devices
before importing jax). The notebooks that compile more than they run keep those flags:
02_anatomy_of_attention (it computes gradients of two 6-layer models once each and reuses 01's
model, 50 -> 34 s) and 04_scaling_out (a program per mesh, each run a few steps, 38 -> 24 s).
Outputs are never written back.
"""

from __future__ import annotations

import os
import pathlib
import resource
import time

import nbclient  # requirements-test.txt: nbclient, nbformat, ipykernel, matplotlib
import nbformat
import pytest
from processes import is_fast_compile_flag

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 600


# keep the suite's FAST_COMPILE_FLAGS (see above)
COMPILE_BOUND = {"02_anatomy_of_attention", "04_scaling_out"}


def _kernel_env(tmp: pathlib.Path, compile_bound: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    # as a user's kernel: one device, XLA's default compilation (the suite's FAST_COMPILE_FLAGS
    # make slower code, and these notebooks train and decode more than they compile)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if "device_count" not in f and (compile_bound or not is_fast_compile_flag(f))]
    env["XLA_FLAGS"] = " ".join(flags)
    env["TJ_NOTEBOOK_SMALL"] = "1"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["TFDS_DATA_DIR"] = str(tmp / "tensorflow_datasets")
    return env


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("notebooks")


def test_notebooks_exist():
    names = [p.name for p in NOTEBOOKS]
    assert names == [
        "01_quickstart.ipynb",
        "02_anatomy_of_attention.ipynb",
        "03_generation.ipynb",
        "04_scaling_out.ipynb",
    ], names


def test_the_colab_install_asks_for_the_jax_this_library_needs_with_its_accelerator_plugin():
    """On Colab each notebook installs the library with jax in pyproject.toml's range, and with the
    GPU or TPU plugin where the runtime has one: installing the library alone replaced an older
    Colab jax by a CPU-only one on a GPU runtime (the plugin stayed behind), without a word."""
    import re
    import tomllib

    with open(REPO / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    (jax_range,) = [d[len("jax"):] for d in deps if re.match(r"jax[<>=]", d)]
    for path in NOTEBOOKS:
        install = [line.strip() for cell in nbformat.read(path, as_version=4).cells
                   for line in cell.source.splitlines() if line.strip().startswith("%pip install")]
        assert install == ["%pip install -q git+https://github.com/transformer-jax/transformer_jax "
                           f'"jax{{accel}}{jax_range}"'], (path.name, install)


def test_every_module_a_notebook_imports_is_installed_by_the_documented_extras():
    """The notebooks import matplotlib, which the library's install left out: run locally after
    `pip install -e .`, 01 failed at its plot, after minutes of training. Every top-level module
    a notebook imports is the standard library's, the package's, or named by pyproject.toml's
    dependencies or its `notebooks` extra."""
    import re
    import sys
    import tomllib

    with open(REPO / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    named = project["dependencies"] + project["optional-dependencies"]["notebooks"]
    installed = {re.split(r"[<>=\[ ]", d)[0].replace("-", "_").lower() for d in named}
    # Modules the named distributions bring with them (jax's numpy and jaxlib, orbax-checkpoint's
    # orbax, Jupyter's IPython).
    installed |= {"jaxlib", "numpy", "orbax", "ipython"}
    for path in NOTEBOOKS:
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type != "code":
                continue
            for module in re.findall(r"^\s*(?:from|import)\s+([A-Za-z_]\w*)", cell.source, flags=re.M):
                if module in sys.stdlib_module_names or module == "transformer_jax":
                    continue
                assert module.lower() in installed, (path.name, module)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: pathlib.Path, workdir: pathlib.Path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:  # outputs are stripped before committing
        assert cell.cell_type != "code" or not cell.get("outputs"), f"{path.name} has saved outputs"
    env = _kernel_env(workdir, compile_bound=path.stem in COMPILE_BOUND)
    for key, value in env.items():  # the kernel inherits the environment of this process
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MPLBACKEND", raising=False)  # plots go through the inline backend, as in Jupyter
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}
    )
    start, cpu = time.time(), _children_cpu_seconds()
    client.execute()  # raises CellExecutionError on the first failing cell
    print(
        f"{path.name}: {time.time() - start:.1f} s wall, "
        f"{_children_cpu_seconds() - cpu:.1f} s CPU in the kernel"
    )


def _children_cpu_seconds() -> float:
    """User + system CPU time of finished child processes (the kernels, once shut down)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
