"""What travels between the orchestrator (the centre) and its rollout workers, and how.

Transport: one inherited `socket.socketpair` per worker (rl/orchestrator/workers.py makes it, the child
gets its end with `pass_fds`), carrying frames of an 8-byte big-endian length and a pickle (protocol 5:
numpy arrays go as their raw buffers). Why a socketpair and pickle: the worker is a child of the
orchestrator on its node, so nothing else can connect to the pair (no address record, nothing new to
authenticate) and both ends are the same code at the same version; pickle is what Python already has
for dataclasses with numpy fields, and only small messages and finished episodes' token arrays cross it.

Routes never cross it. A finished sample's routed-expert rows are written by the worker as a part file
in the run directory (rl/orchestrator/parts.py: hashed as written); `to_wire` replaces the rows by the
`RoutePart` naming that file, and `from_wire` in the centre claims it: the centre never reads, copies or
hashes the rows, and the batch takes the file by a rename. A multi-turn sample's `Rollout` (in
`info["multiturn"]`) becomes its `EpisodeStats`, since the sample itself already carries the rollout's
token arrays.
"""
from __future__ import annotations

import asyncio
import pickle
import struct
from dataclasses import replace
from typing import Any

from rl.contract.batch import Sample
from rl.orchestrator import parts
from rl.orchestrator.rollout import Rollout

HEADER = struct.Struct(">Q")
MAX_FRAME = 1 << 34   # 16 GiB: a length beyond it is a corrupt stream, not a message


def encode(msg: Any) -> bytes:
    body = pickle.dumps(msg, protocol=5)
    return HEADER.pack(len(body)) + body


async def read(reader: asyncio.StreamReader) -> Any:
    """The next message; raises asyncio.IncompleteReadError at the end of the stream (the peer is gone)."""
    (n,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    if n > MAX_FRAME:
        raise ValueError(f"rollout worker stream: a frame of {n} bytes (corrupt stream)")
    return pickle.loads(await reader.readexactly(n))


def _part(rows: Any, parts_dir: str, worker: int) -> Any:
    """The rows as a RoutePart written into `parts_dir` (None stays None); a spill file's map is dropped."""
    if rows is None or parts.is_part(rows):
        return rows
    return parts.write(rows, parts_dir, worker)


def to_wire(s: Sample, parts_dir: str, worker: int = 0) -> Sample:
    """The worker's finished sample as it travels: routes as RouteParts, the Rollout as its stats."""
    info = dict(s.info)
    r = info.get("multiturn")
    if isinstance(r, Rollout):
        info["multiturn"] = r.stats()
    if info.get("segments"):
        info["segments"] = [(a, b, p, _part(rows, parts_dir, worker), why) for a, b, p, rows, why in info["segments"]]
    return replace(s, routed_experts=_part(s.routed_experts, parts_dir, worker), info=info)


def _claim(rows: Any, parts_dir: str) -> Any:
    if rows is None:
        return rows
    if not parts.is_part(rows):
        raise ValueError(f"a rollout worker sent routed_experts as {type(rows).__name__}, not a route part")
    return parts.claim(rows, parts_dir)


def from_wire(s: Sample, parts_dir: str) -> Sample:
    """The sample as the centre keeps it: each RoutePart claimed (its file goes with the sample unless the
    batch takes it)."""
    if s.info.get("segments"):
        s.info["segments"] = [(a, b, p, _claim(rows, parts_dir), why) for a, b, p, rows, why in s.info["segments"]]
    s.routed_experts = _claim(s.routed_experts, parts_dir)
    return s
