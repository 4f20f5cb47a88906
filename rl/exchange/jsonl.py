"""Append-only JSON-lines records in the run directory (consumed.jsonl, groups.jsonl, metrics.jsonl).

One writer per file appends one line per record with a single write(2) and fsyncs it, so a crash leaves
at most a torn last line. A writer that starts after such a crash first ends the torn line with a
newline: otherwise its first record would be glued onto the fragment and lost too. Checking the last
byte on every append (one pread) rather than once per open also covers a second writer's crash in
between, for the price of a syscall per record, which these once-per-step logs can afford.

Both sides open through rl.contract.safefs: a planted symlink or FIFO in a record's place (or on the way
to it) is refused with UnsafePath, never written through or blocked on. A reader takes a line only when
it parses to a JSON object and, given a `check`, passes it; any other line is skipped with one line on
stderr naming the file, the line number and the reason (once per process and line: readers re-read these
files every step), so a hand-edited or hostile record never crashes a role on every restart. No torch.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable, Optional

from rl.contract import safefs
from rl.faults import crash_point

log = logging.getLogger("hetrl.records")
_warned: set[tuple[str, int, str]] = set()

# A check returns None for a good record, else the reason in a few words.
Check = Callable[[dict], Optional[str]]


def _skip(path: Path, lineno: int, reason: str, last: bool) -> None:
    if last and reason.startswith("not JSON"):
        return  # the torn last line of a crashed writer: expected, not worth a word
    key = (str(path), lineno, reason)
    if key not in _warned:
        _warned.add(key)
        log.warning("%s:%d: record skipped (%s)", path, lineno, reason)


def read_jsonl(path: str | os.PathLike, check: Check | None = None) -> list[dict]:
    """The complete, valid records of `path`, in order ([] when it does not exist). UnsafePath when
    `path` is a symlink, FIFO or device (or reached through a link)."""
    path = Path(path)
    try:
        data = safefs.read_bytes(path)
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    out = []
    for i, raw in enumerate(lines, 1):
        try:
            rec = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            _skip(path, i, f"not JSON: {e.msg if isinstance(e, json.JSONDecodeError) else 'not UTF-8'}",
                  last=i == len(lines))
            continue
        if not isinstance(rec, dict):
            _skip(path, i, f"a JSON {type(rec).__name__}, not an object", last=False)
            continue
        if check is not None and (why := check(rec)) is not None:
            _skip(path, i, why, last=False)
            continue
        out.append(rec)
    return out


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    """Append `record` as one fsynced line, ending a torn last line first."""
    line = (json.dumps(record) + "\n").encode()
    fd = safefs.open_write(path, append=True, readable=True)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line
        crash_point("jsonl.torn", before_exit=lambda: os.write(fd, line[: len(line) // 2]))
        os.write(fd, line)  # one write of one line: a crash leaves at most a torn last line
        os.fsync(fd)
    finally:
        os.close(fd)
