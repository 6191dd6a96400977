"""The README's Python examples run as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(python_blocks()) >= 1


def test_readme_python_examples_run():
    for block in python_blocks():
        exec(compile(block, str(README), "exec"), {"__name__": "readme_example"})
