"""What travels between the orchestrator (the centre) and its rollout workers, and how.

Transport: one inherited `socket.socketpair` per worker (rl/orchestrator/workers.py makes it, the child
gets its end with `pass_fds`), carrying frames of an 8-byte big-endian length and a pickle (protocol 5:
numpy arrays go as their raw buffers). Why a socketpair and pickle: the worker is a child of the
orchestrator on its node, so nothing else can connect to the pair (no address record, nothing new to
authenticate) and both ends are the same code at the same version; pickle is what Python already has
for dataclasses with numpy fields, and only small messages and finished episodes' token arrays cross it.

Routes never cross it. A sample's routed-expert rows are a sealed spill file in the worker
(rl/orchestrator/spill.py, hand-off mode); `to_wire` replaces the map by a `RouteRef` (path, dtype,
shape) and `from_wire` in the centre maps the same file (`spill.adopt`): no base64, no Python list, no
decode or copy of the rows in the centre; the batch writer copies them from the map into the shard as it
does for the centre's own episodes. Single-turn routes (decoded arrays, not spilled) are spilled here
first. A multi-turn sample's `Rollout` (in `info["multiturn"]`) becomes its `EpisodeStats`, since the
sample itself already carries the rollout's token arrays.
"""
from __future__ import annotations

import asyncio
import pickle
import struct
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from rl.contract.batch import Sample
from rl.orchestrator import spill
from rl.orchestrator.rollout import Rollout

HEADER = struct.Struct(">Q")
MAX_FRAME = 1 << 34   # 16 GiB: a length beyond it is a corrupt stream, not a message


@dataclass(frozen=True)
class RouteRef:
    """A sealed spill file of routed-expert rows, handed from a rollout worker to the centre."""
    path: str
    dtype: str
    shape: tuple


def encode(msg: Any) -> bytes:
    body = pickle.dumps(msg, protocol=5)
    return HEADER.pack(len(body)) + body


async def read(reader: asyncio.StreamReader) -> Any:
    """The next message; raises asyncio.IncompleteReadError at the end of the stream (the peer is gone)."""
    (n,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    if n > MAX_FRAME:
        raise ValueError(f"rollout worker stream: a frame of {n} bytes (corrupt stream)")
    return pickle.loads(await reader.readexactly(n))


def _ref(rows: Any, spill_dir: str) -> Any:
    """The rows as a RouteRef (spilled first if they are a plain array); None stays None."""
    if rows is None or isinstance(rows, RouteRef):
        return rows
    path = spill.route_file(rows)
    if path is None:   # decoded in memory (single-turn): spill them so the rows travel as a file
        rows = np.asarray(rows)
        if rows.ndim != 3:
            raise ValueError(f"routed_experts has shape {rows.shape}, expected [tokens, layers, top_k]")
        s = spill.directory(spill_dir).new(rows.shape[1:])
        s.append(rows)
        rows = s.seal(len(rows))
        path = spill.route_file(rows)
    return RouteRef(path, np.dtype(rows.dtype).str, tuple(int(x) for x in rows.shape))


def to_wire(s: Sample, spill_dir: str = "") -> Sample:
    """The worker's finished sample as it travels: routes as RouteRefs, the Rollout as its stats."""
    info = dict(s.info)
    r = info.get("multiturn")
    if isinstance(r, Rollout):
        info["multiturn"] = r.stats()
    if info.get("segments"):
        info["segments"] = [(a, b, p, _ref(rows, spill_dir), why) for a, b, p, rows, why in info["segments"]]
    return replace(s, routed_experts=_ref(s.routed_experts, spill_dir), info=info)


def _adopt(rows: Any) -> Any:
    return spill.adopt(rows.path, rows.dtype, rows.shape) if isinstance(rows, RouteRef) else rows


def from_wire(s: Sample) -> Sample:
    """The sample as the centre keeps it: each RouteRef mapped read-only (its file unlinked)."""
    if s.info.get("segments"):
        s.info["segments"] = [(a, b, p, _adopt(rows), why) for a, b, p, rows, why in s.info["segments"]]
    s.routed_experts = _adopt(s.routed_experts)
    return s
