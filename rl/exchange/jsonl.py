"""Append-only JSON-lines records in the run directory (consumed.jsonl, groups.jsonl, metrics.jsonl).

One writer per file appends one line per record with a single write(2) and fsyncs it, so a crash leaves
at most a torn last line. Readers skip lines that do not parse to a JSON object (that record never
completed). A writer that starts after such a crash first ends the torn line with a newline: otherwise
its first record would be glued onto the fragment and lost too. Checking the last byte on every append
(one pread) rather than once per open also covers a second writer's crash in between, for the price of
a syscall per record, which these once-per-step logs can afford. No torch.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from rl.faults import crash_point


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The complete records of `path`, in order ([] when it does not exist)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn line of a crashed writer
        if isinstance(rec, dict):
            out.append(rec)
    return out


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    """Append `record` as one fsynced line, ending a torn last line first."""
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line
        crash_point("jsonl.torn", before_exit=lambda: os.write(fd, line[: len(line) // 2]))
        os.write(fd, line)  # one write of one line: a crash leaves at most a torn last line
        os.fsync(fd)
    finally:
        os.close(fd)
