"""Argument types of `launch doctor` and `python -m rl.doctor`: a bad value is refused at parse time.

Both commands take sizes, counts, shares, time limits and paths. A value the checks cannot use (a
`--fs-mib 0` that divided by zero after a minute of other checks, a `-5` that came out as a failed row,
a `--json` naming a directory that failed only when the report was written at the very end) is refused
by argparse before anything runs, with its usual one-line `error: argument --fs-mib: ...` naming the
flag and the value. Standard library only (launch doctor is torch-free), shared by both parsers.
"""
from __future__ import annotations

import argparse
import math
import os


def count(lo: int, hi: int):
    """An integer in [lo, hi]."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{v} is not in {lo}..{hi}")
        return v
    parse.__name__ = "count"
    return parse


def number(lo: float, hi: float, *, low_open: bool = True):
    """A finite number in (lo, hi] (or [lo, hi] with low_open=False)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(v) or v > hi or v < lo or (low_open and v == lo):
            span = f"{'(' if low_open else '['}{lo:g}, {hi:g}]"
            raise argparse.ArgumentTypeError(f"{text} is not a finite number in {span}")
        return v
    parse.__name__ = "number"
    return parse


def directory(text: str) -> str:
    """A directory to write into: it may not exist yet (it is made), but if it exists it is a directory."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} exists and is not a directory")
    return text


def existing_dir(text: str) -> str:
    """A directory that exists (one to read)."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    return text


def out_file(text: str) -> str:
    """A file to write: not an existing directory, and in a directory that exists."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a directory, not a file to write")
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{parent} (where {os.path.basename(text)} would go) is not a directory")
    return text


def families(text: str) -> str:
    """A comma-separated list of model families (empty: all of them)."""
    from rl.contract.families import FAMILIES  # torch-free
    unknown = [f for f in text.split(",") if f and f not in FAMILIES]
    if unknown:
        raise argparse.ArgumentTypeError(f"{unknown[0]!r} is not a family (have: {', '.join(FAMILIES)})")
    return text
