"""Command-line helpers shared by the benchmark scripts."""

import argparse


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1, so a bad count is refused before anything compiles."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be at least 1")
    return value
