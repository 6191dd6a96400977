"""Command-line helpers shared by the benchmark scripts: argument types and checks that refuse a bad
value with a one-line usage error before anything compiles or runs."""

import argparse
import json
import os


def _integer(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{value}: must be at least {minimum}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1, so a bad count is refused before anything compiles."""
    return _integer(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an integer of at least 0 (where 0 has a meaning of its own, such as a default)."""
    return _integer(text, 0)


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number above 0 (a time between samples, a memory budget)."""
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value:g}: must be more than 0")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number of at least 0 (where 0 has a meaning of its own: no limit)."""
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value:g}: must be at least 0")
    return value


def check_out_file(parser: argparse.ArgumentParser, path: str | None, flag: str = "--out") -> None:
    """Refuses an output path that cannot be written, before the benchmark runs (minutes) rather
    than after it: a missing folder is made, a folder or a path under a file or an unwritable
    folder is a usage error naming `flag`."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        parser.error(f"{flag} {path}: {e}")
    if os.path.isdir(path) or not os.access(folder, os.W_OK):
        parser.error(f"{flag} {path}: not a writable file path")


def write_json(path: str, report) -> None:
    """Writes the report to a temporary file beside `path` and renames it over `path`: a run killed
    mid-write leaves the previous complete report, never half a file."""
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        f.write(json.dumps(report, indent=1, default=str))
    os.replace(partial, path)
