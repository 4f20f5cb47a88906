"""Route parts: a rollout worker's finished routes, written once into the run directory, moved into the batch.

Why. Routed-expert rows are ~97% of a batch's bytes (GLM-5: 600 bytes a token beside 13 of token ids,
mask, logprob and version). When the centre copied every sample's rows into the trainer's shards and
hashed them, the batch's bytes went through one process: ~2.8 of the centre's 3.4 CPU s per step in
benchmarks/seed_rehearsal.py, 62 s per step at the seed's volume (issue 50 item 2). So a rollout worker
writes each finished sample's rows itself, as a one-tensor safetensors file (`routed_experts`,
[tokens, layers, top_k], uint8 or uint16) hashed as it is written (rl.contract.batch.write_arrays), in
`rollouts/.parts/` of the run directory, and sends the centre a `RoutePart`: the file's name, dtype,
shape, size and sha256. The centre never opens it. When the batch is published, each sample's part is
renamed into the step's private directory as `routes_<sample>.safetensors` (a rename in one file
system: no byte moves) and listed in the manifest with the worker's size and digest; each trainer data
rank reads and verifies the route files of its own samples (rl.contract.batch.load_share). The workers'
CPU grows by one read, write and hash of their own rows, spread over the workers.

Lifecycle. The centre empties and makes `rollouts/.parts` (mode 0700) before it starts its workers: a
part left by an earlier incarnation belongs to no sample of this one. A part the centre receives is
`claim`ed: its path must be a plain name in that directory, and a finalizer removes the file when the
sample is dropped (a cancelled or stale group, a rollout already received) unless the batch took it
(`move_to`). Parts are in the run directory, so the trust rules are the run directory's: files are
written, renamed and removed through rl.contract.safefs.
"""
from __future__ import annotations

import itertools
import os
import re
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from rl.contract import paths, safefs
from rl.contract.batch import expert_ids, write_arrays

DIR = ".parts"
_NAME = re.compile(r"^w\d+-\d+-\d+\.safetensors$")
_serial = itertools.count()


def parts_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / paths.ROLLOUTS / DIR


def reset(run_dir: str | os.PathLike) -> Path:
    """The centre's start: `rollouts/.parts` emptied and made again, private (its parts are all gone)."""
    d = parts_dir(run_dir)
    safefs.remove(d)
    safefs.mkdir(d, mode=0o700)
    return d


class RoutePart:
    """One sample's routed-expert rows as a file in the parts directory (what the worker sends, what the
    centre's sample carries in place of the rows). Array-like enough for the batch's checks: len, shape,
    dtype, ndim; `np.asarray` reads the file (tests, RolloutBatch.from_samples)."""

    __slots__ = ("path", "dtype", "shape", "size", "sha256", "_fin", "__weakref__")

    def __init__(self, path: str, dtype: str, shape: tuple, size: int, sha256: str):
        self.path, self.dtype = str(path), np.dtype(dtype)
        self.shape, self.size, self.sha256 = tuple(int(x) for x in shape), int(size), str(sha256)
        self._fin = None

    def __reduce__(self):
        return RoutePart, (self.path, self.dtype.str, self.shape, self.size, self.sha256)

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"RoutePart({Path(self.path).name}, {self.dtype}, {list(self.shape)})"

    def __array__(self, dtype=None, copy=None):
        from rl.contract.batch import read_file, read_safetensors
        data, _ = read_file(Path(self.path), self.sha256, self.size)
        a = read_safetensors(Path(self.path), data)["routed_experts"]
        return a if dtype is None else a.astype(dtype)

    def move_to(self, dst: str | os.PathLike) -> dict:
        """Rename the file to `dst` (a step's tmp directory: the batch takes it); its manifest entry."""
        safefs.rename(Path(self.path), Path(dst))
        if self._fin is not None:
            self._fin.detach()
        self.path = str(dst)
        return {"size": self.size, "sha256": self.sha256}


def write(rows: Any, where: str | os.PathLike, worker: int = 0) -> RoutePart:
    """A worker's sample rows ([tokens, layers, top_k], an array or a spill file's map) as a part file
    in `where` (the run's parts directory), written and hashed once."""
    rows = expert_ids(np.asarray(rows))
    if rows.ndim != 3:
        raise ValueError(f"routed_experts has shape {rows.shape}, expected [tokens, layers, top_k]")
    path = Path(where) / f"w{int(worker)}-{os.getpid()}-{next(_serial)}.safetensors"
    entry = write_arrays(path, {"routed_experts": rows})
    return RoutePart(str(path), rows.dtype.str, rows.shape, entry["size"], entry["sha256"])


def claim(part: RoutePart, where: str | os.PathLike) -> RoutePart:
    """The centre's side of a part received from a worker: it must name a part file in `where`; the file
    goes with the part unless the batch takes it."""
    p = Path(part.path)
    if p.parent != Path(where) or not _NAME.match(p.name):
        raise ValueError(f"a rollout worker sent route part {part.path!r}: not a part file in {where}")
    part._fin = weakref.finalize(part, safefs.remove, p)
    return part


def is_part(rows: Any) -> bool:
    return isinstance(rows, RoutePart)
