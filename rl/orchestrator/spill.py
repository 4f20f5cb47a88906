"""Routed-expert rows of in-flight episodes, spilled to disk as they arrive.

Router replay (R3) gives every token of a rollout one row of expert ids, [layers, top_k]: for GLM-5 that
is 75 x 8 = 600 bytes a token, forty times the token's other per-token fields. An orchestrator with 2048
episodes in flight at 32k tokens would hold ~40 GB of them if they stayed in memory until the episode
ends. So each in-flight episode appends the rows of every turn (decoded from vLLM's base64 `.npy`) to
its own file as soon as the turn returns, and keeps only the row count, the row shape and the dtype.

Where. One private directory per orchestrator process, made with `tempfile.mkdtemp` (mode 0700, a fresh
name `hetrl-spill-<host>-<pid>-<random>`) under `orchestrator.spill_dir`, or when that is "" (the
default) under `$SLURM_TMPDIR`, else `$TMPDIR`, else the system's temp directory: node-local disk, since
the rows are written once and read once by the same process and nobody else needs them. The directory is
removed at exit; a directory of this host whose pid no longer runs (a killed orchestrator) is removed
when the next one starts. Every file inside is written, renamed and removed through rl.contract.safefs,
so a spill_dir inside the run directory gets the run directory's rules (no link followed, no FIFO).

Lifecycle. When the episode ends, `seal(n)` writes the missing tail rows (the final sampled token and an
observation a timed-out turn never read were never forwarded: they repeat the last row), maps the file
read-only (`np.memmap`) and unlinks it: Linux keeps the mapping, so the finished sample carries its rows
without any bookkeeping, and the disk space is freed when the last reference to the map goes. An episode
that fails or is cancelled removes its file (`discard`, and a `weakref.finalize` for an episode dropped
without either). The file's dtype is what `rl.contract.batch.expert_ids` would choose for all rows: uint8
while every id fits, else uint16; a turn that first needs uint16 after uint8 rows were written rewrites
the file once as uint16.

Rollout workers (rl/orchestrator/workers.py) seal the same way; the worker then writes the sealed rows
once more, as a part file in the run directory that the batch takes by a rename (rl/orchestrator/parts.py).

Memory bound. Per in-flight token the orchestrator holds the rollout's compact arrays (int32 id, uint8
loss mask, float32 logprob, int32 version: 13 bytes, at most 16.25 with the arrays' spare capacity;
rl.orchestrator.rollout.Rollout) and no route bytes at all: routes cost `layers x top_k x (1 or 2)` bytes
of spill disk per token and none of memory. A request's context is encoded to JSON when it is sent and
not kept after (rl.orchestrator.client), and the responses being read and parsed, a turn's routes each,
are bounded per server (`InferenceClient.READ_BODIES`), not per episode. So the rollout state is <= 32
bytes per in-flight token whatever the routes' shape, with a request out as well
(tests/unit/test_orchestrator_memory.py, tests/unit/test_client_memory.py). What else the process holds
(per episode, per turn being parsed, finished samples waiting for their batch, start-up) is measured by
benchmarks/seed_rehearsal.py and summed in docs/perf.md, "Data plane at the seed's volume".
"""
from __future__ import annotations

import atexit
import itertools
import os
import re
import socket
import tempfile
import weakref
from pathlib import Path

import numpy as np

from rl.contract import procs, safefs
from rl.contract.batch import expert_ids

PREFIX = "hetrl-spill-"
_NAME = re.compile(rf"^{re.escape(PREFIX)}(?P<host>.+)-(?P<pid>\d+)-[^-]+$")
_dirs: dict[str, "SpillDir"] = {}
_serial = itertools.count()


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def default_parent() -> str:
    """Node-local scratch: Slurm's per-job `$SLURM_TMPDIR`, else `$TMPDIR`, else the system default."""
    return os.environ.get("SLURM_TMPDIR") or os.environ.get("TMPDIR") or tempfile.gettempdir()


def clean_stale(parent: str | Path) -> list[str]:
    """Remove the spill directories under `parent` left by dead orchestrators of this host (their pid
    runs no more); returns their names. Directories of other hosts (a shared $TMPDIR) are left alone."""
    removed, host = [], _host()
    for name, _mode in safefs.scandir(parent):
        m = _NAME.match(name)
        if m and m["host"] == host and int(m["pid"]) != os.getpid() and not procs.alive(int(m["pid"])):
            safefs.remove(Path(parent) / name)
            removed.append(name)
    return removed


class SpillDir:
    """This process's private spill directory under `parent` (made on first use, removed at exit)."""

    def __init__(self, parent: str | Path):
        self.parent = Path(parent)
        self._path: Path | None = None

    @property
    def path(self) -> Path:
        if self._path is None:
            try:
                safefs.makedirs(self.parent)
            except (OSError, safefs.UnsafePath) as e:
                raise ValueError(f"orchestrator.spill_dir={str(self.parent)!r}: cannot be used as the "
                                 f"routes' spill directory ({e})") from None
            clean_stale(self.parent)
            self._path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{_host()}-{os.getpid()}-", dir=self.parent))
            atexit.register(safefs.remove, self._path)
        return self._path

    def new(self, shape: tuple[int, int]) -> "RouteSpill":
        return RouteSpill(self, shape)

    def remove(self) -> None:
        """Remove the directory now (tests; the process removes it at exit anyway)."""
        if self._path is not None:
            safefs.remove(self._path)
            self._path = None


def directory(configured: str = "") -> SpillDir:
    """The process's spill directory for `orchestrator.spill_dir` = `configured` ("" = node-local default)."""
    parent = str(configured) if configured else default_parent()
    if parent not in _dirs:
        _dirs[parent] = SpillDir(parent)
    return _dirs[parent]


class RouteSpill:
    """One episode's routed-expert rows, [rows, layers, top_k], appended to a file of raw rows."""

    def __init__(self, where: SpillDir, shape: tuple[int, int]):
        self.where, self.shape = where, tuple(int(x) for x in shape)
        self.rows = 0
        self.dtype: np.dtype | None = None
        self.file: Path | None = None
        self._map: np.memmap | None = None
        self._finalizer = None

    def _open(self) -> Path:
        if self.file is None:
            self.file = self.where.path / f"{next(_serial)}.routes"
            # an episode dropped without seal/discard (a failed group, garbage-collected) takes its file along
            self._finalizer = weakref.finalize(self, safefs.remove, self.file)
        return self.file

    def append(self, rows: np.ndarray) -> None:
        """Append `rows` ([n, layers, top_k] expert ids) after the rows held."""
        if self._map is not None:
            raise ValueError("routed experts appended after the episode's rows were sealed")
        rows = np.asarray(rows)
        if rows.ndim != 3 or tuple(rows.shape[1:]) != self.shape:
            raise ValueError(f"routed_experts rows have shape {tuple(rows.shape)}, the episode's rows are "
                             f"[n, {self.shape[0]}, {self.shape[1]}]")
        if not len(rows):
            return
        rows = expert_ids(rows)
        path = self._open()
        if self.dtype is None:
            self.dtype = rows.dtype
        elif rows.dtype.itemsize > self.dtype.itemsize:
            self._widen(rows.dtype)
        # the array's own buffer, not a bytes copy of it: one turn-sized buffer less per response
        safefs.append_bytes(path, memoryview(np.ascontiguousarray(rows, dtype=self.dtype)).cast("B"), fsync=False)
        self.rows += len(rows)

    def _widen(self, dtype: np.dtype) -> None:
        """Rewrite the rows held in the wider `dtype` (once per episode: uint8 -> uint16)."""
        safefs.write_atomic(self.file, self.read().astype(dtype).tobytes(), mode=0o600)
        self.dtype = np.dtype(dtype)

    def read(self) -> np.ndarray:
        """The rows held, read into memory (a copy; for checks and the one-time widening)."""
        if self.file is None:
            return np.zeros((0, *self.shape), np.uint8)
        data = safefs.read_bytes(self.file)
        return np.frombuffer(data, self.dtype).reshape(-1, *self.shape).copy()

    def seal(self, n: int) -> np.memmap:
        """The episode's `n` rows, read-only and mapped: the rows held, then the last row repeated up to
        `n` (written into the file), after which the file is unlinked (the mapping stays valid)."""
        if self._map is not None:
            if len(self._map) != n:
                raise ValueError(f"routed experts were sealed at {len(self._map)} rows, asked for {n}")
            return self._map
        if not self.rows:
            raise ValueError("no routed-expert rows to seal")
        if self.rows > n:
            raise ValueError(f"routed experts cover {self.rows} tokens, the sample has {n}")
        if self.rows < n:
            row = self.dtype.itemsize * self.shape[0] * self.shape[1]
            fd = safefs.open_read(self.file)
            try:
                last = os.pread(fd, row, (self.rows - 1) * row)
            finally:
                os.close(fd)
            safefs.append_bytes(self.file, last * (n - self.rows), fsync=False)
            self.rows = n
        fd = safefs.open_read(self.file)  # opened without following links; np.memmap maps this fd's file
        try:
            with os.fdopen(fd, "rb") as f:
                self._map = np.memmap(f, dtype=self.dtype, mode="r", shape=(n, *self.shape))
        finally:
            self.discard()
        return self._map

    def discard(self) -> None:
        """Remove the file (a failed or cancelled episode; after mapping, the unlink)."""
        if self._finalizer is not None:
            self._finalizer()  # runs safefs.remove once
