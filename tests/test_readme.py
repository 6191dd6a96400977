"""The README's Python examples run as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(python_blocks()) >= 1


def test_readme_python_examples_run():
    """Every block runs, except those marked as needing a trained workdir: those must compile."""
    for block in python_blocks():
        code = compile(block, str(README), "exec")
        if not block.startswith("# needs a trained workdir"):
            exec(code, {"__name__": "readme_example"})
