"""Safety of loading: nothing in the program unpickles. An AST scan of every shipped Python file
(library, train.py, configs, benchmarks) rejects the calls that can run code from a data file:
pickle/cloudpickle/dill/joblib/marshal/shelve loads, ``np.load(allow_pickle=True)``,
``torch.load`` without ``weights_only=True`` and ``yaml.load`` without a safe loader.
(Config files *are* Python and run when loaded: they must come from trusted sources, as the README
says. The malicious-pickle refusal itself is tested in test_convert.py.)"""

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = ["transformer_jax", "configs", "benchmarks", "train.py"]
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "joblib", "marshal", "shelve"}
UNSAFE_FUNCTIONS = {"load", "loads", "Unpickler", "open"}


def _keyword(call: ast.Call, name: str):
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def unsafe_calls(source: str, filename: str = "<string>") -> list[str]:
    """``'file:line: why'`` for every call that could unpickle."""
    tree = ast.parse(source, filename)
    aliases = {}  # local name -> module, for `import pickle as p` / `from pickle import loads`
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            root = node.module.split(".")[0]
            for a in node.names:
                if root in UNSAFE_MODULES and a.name in UNSAFE_FUNCTIONS:
                    found.append(f"{filename}:{node.lineno}: imports {node.module}.{a.name}")
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            module, name = aliases.get(func.value.id, func.value.id), func.attr
        elif isinstance(func, ast.Name):
            module, _, name = aliases.get(func.id, func.id).rpartition(".")
        else:
            continue
        root = module.split(".")[0]
        where = f"{filename}:{node.lineno}"
        if root in UNSAFE_MODULES and name in UNSAFE_FUNCTIONS:
            found.append(f"{where}: {module}.{name} can run code from the file")
        elif root in ("numpy", "np") and name == "load" and _is_true(_keyword(node, "allow_pickle")):
            found.append(f"{where}: np.load(allow_pickle=True)")
        elif root == "torch" and name == "load" and not _is_true(_keyword(node, "weights_only")):
            found.append(f"{where}: torch.load without weights_only=True")
        elif root == "yaml" and name in ("load", "unsafe_load", "full_load", "load_all"):
            loader = _keyword(node, "Loader")
            if name != "load" or loader is None or "Safe" not in ast.unparse(loader):
                found.append(f"{where}: yaml.{name} without SafeLoader")
    return found


def _shipped_files():
    for entry in SHIPPED:
        path = os.path.join(REPO, entry)
        if os.path.isfile(path):
            yield path
        for root, dirs, names in os.walk(path):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__pycache__"))]
            yield from (os.path.join(root, n) for n in names if n.endswith(".py"))


def test_nothing_shipped_unpickles():
    files = list(_shipped_files())
    assert len(files) > 30
    problems = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            problems += unsafe_calls(f.read(), os.path.relpath(path, REPO))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "source",
    [
        "import pickle\npickle.load(f)",
        "import pickle as p\np.loads(b)",
        "from pickle import loads\nloads(b)",
        "import dill\ndill.load(f)",
        "import numpy as np\nnp.load('x.npy', allow_pickle=True)",
        "import torch\ntorch.load('x.bin')",
        "import torch\ntorch.load('x.bin', weights_only=False)",
        "import yaml\nyaml.load(s)",
        "import shelve\nshelve.open('db')",
    ],
)
def test_the_scan_catches_unsafe_loads(source):
    assert unsafe_calls(source)


@pytest.mark.parametrize(
    "source",
    [
        "import numpy as np\nnp.load('x.npy')",
        "import torch\ntorch.load('x.bin', map_location='cpu', weights_only=True)",
        "import yaml\nyaml.load(s, Loader=yaml.SafeLoader)",
        "import json\njson.load(f)",
        "import pickle\npickle.dumps(x)",
    ],
)
def test_the_scan_allows_safe_loads(source):
    assert not unsafe_calls(source)
