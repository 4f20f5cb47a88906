"""Atomic small-file writes (tmp + fsync + rename): the one way a record or state file is written.

A leaf: the records of rl.contract.records and the run-directory exchange (rl.exchange) both write
through it, and it imports nothing of rl but its sibling rl.contract.safefs, which makes the temp file
and the rename refuse a planted symlink, FIFO or directory anywhere on the path (UnsafePath).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from rl.contract.safefs import write_atomic


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` atomically, creating missing parent directories."""
    write_atomic(Path(path), data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write one text file atomically (tmp + fsync + rename)."""
    write_atomic(Path(path), text.encode())


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    """Write one JSON file atomically (tmp + fsync + rename): for small state files outside steps."""
    write_atomic(Path(path), (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())
