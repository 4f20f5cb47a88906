"""Rollout workers, the centre's side: the episode loop in N child processes, one scheduler here.

Why. One orchestrator process spends nearly all its CPU on per-episode work (HTTP client and asyncio,
route decode, tokenizer and chat template, answer and request JSON, the multi-turn driver and route
spill; docs/perf.md) and the seed's 2048 episodes in flight need ~300 CPU s per 300 s step of it
(issue 50). That work is independent per group, so with `orchestrator.rollout_workers` = N > 0 the
orchestrator starts N rollout worker processes (rl/orchestrator/worker.py) and hands each group to the
least loaded one (fewest rollouts in flight); the worker plays the group with its own `Sampler` and
returns its samples one by one as their rewards come in. N = 0 (the default) plays every group in the
orchestrator's own process, as before: this module is then never imported.

What stays in the centre, because it must be one: the pool (admission, staleness, cancellation,
release and partial groups), the group log (exactly once across restarts), advantages, evaluation
(played in the centre's own sampler, as before), the weight watcher and the version it loads (forwarded
to the workers: `gate` while the servers reload, then `reload` with the servers' in-flight counts for
the workers' version trackers) and batch publication. `RolloutWorkers` is what the pool and the batch
schedule see instead of the `Sampler`: the same `sample_group_or_none`, `tracker`, `idle`, `env`, `cfg`.

Placement: the workers are children of the orchestrator on its node, started with the same Python, the
same environment and working directory, connected by an inherited socketpair (rl/orchestrator/wire.py:
nothing to plant, nothing new to authenticate). Placing them on the inference or sandbox nodes through
the plan is a later step (it needs an address record and the run secret on the connection, and a spill
directory the centre can read: the run directory).

Faults. A worker that dies (killed, out of memory, a crash) ends its socket; the centre sees the end of
the stream, counts the episodes it had in flight (`lost_episodes`), restarts it in place and plays again,
on the least loaded live worker, only the rollouts of each of its groups that had not reported their
sample (the seeds depend on the rollout index, so a replayed rollout samples what it would have). A
rollout's sample is accepted once, by index, so nothing is trained twice, and the pool sees a group that
took longer: the stale policy applies to it as to any other (under drop it may be cancelled as stale).
A worker that dies before it is ready, or more than `MAX_RESTARTS` times in `RESTART_WINDOW_S`, fails
the role with one line naming it (an environment that cannot start is not retried for ever).

The idle clock: the centre cannot see the workers' requests one by one, so inference counts as busy
while any group is out at a worker (coarser than in-process, where it is per request).
"""
from __future__ import annotations

import asyncio
import itertools
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import rl
from rl.orchestrator import accounting, wire
from rl.orchestrator.client import InferenceError
from rl.runtime import log

ROLE = "orchestrator"
MAX_RESTARTS = 5          # restarts of one worker within RESTART_WINDOW_S before the role fails
RESTART_WINDOW_S = 60.0
MAX_REPLAYS = 5           # times one group is replayed after losing its worker
START_TIMEOUT_S = 300.0


def rollout_workers(cfg: Any) -> int:
    """orchestrator.rollout_workers (0 = episodes in the orchestrator's process)."""
    n = int(getattr(cfg.orchestrator, "rollout_workers", 0) or 0)
    if n < 0:
        raise ValueError(f"orchestrator.rollout_workers={n}: must be >= 0")
    return n


class WorkerLost(Exception):
    """The worker playing a group died; its unfinished rollouts are played again."""


@dataclass
class Pending:
    """A group out at a worker: the pool's Group (or None in batch mode) and the samples received."""
    group: Any
    left: list[int]
    got: dict
    future: asyncio.Future
    worker: "Child"
    replay: bool = False   # a replay after a lost worker
    acked: bool = False    # the worker has said anything about it (it acknowledges a `play` at once)


@dataclass
class Child:
    index: int
    proc: subprocess.Popen | None = None
    writer: asyncio.StreamWriter | None = None
    reader_task: asyncio.Task | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    pending: dict = field(default_factory=dict)
    restarts: list = field(default_factory=list)
    pid: int = 0

    @property
    def load(self) -> int:
        return sum(len(p.left) - len(p.got) for p in self.pending.values())

    def send(self, msg: Any) -> None:
        if self.writer is not None and not self.writer.is_closing():
            self.writer.write(wire.encode(msg))


class RolloutWorkers:
    """N rollout worker processes playing the groups of `local` (the centre's own Sampler: its tracker,
    idle clock, environment and config are shared; its clients and tokenizer stay for evaluation)."""

    def __init__(self, local: Any, n: int, stop: Any = None):
        self.local, self.n, self.stop = local, int(n), stop
        self.cfg, self.o, self.env, self.multi_turn = local.cfg, local.o, local.env, local.multi_turn
        self.children = [Child(i) for i in range(self.n)]
        self._keys = itertools.count(1)
        self.hello: dict = {}
        self.parts_dir = ""
        self.error: BaseException | None = None
        self.closing = False
        self.totals = {"worker_restarts": 0, "lost_episodes": 0, "replayed_groups": 0}

    # the Sampler's face, as the pool and the batch schedule use it
    @property
    def tracker(self):
        return self.local.tracker

    @property
    def idle(self):
        return self.local.idle

    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.children if c.proc is not None and c.proc.poll() is None]

    # --- processes -----------------------------------------------------------------------------
    async def start(self, *, servers: list, router: Any, tokenizer: str, timeout: float, parts_dir: str,
                    local_routing: bool = False) -> None:
        """Start every worker and wait until each is ready. `servers`: [(url, secret)]; `router`:
        (url, secret) or None; `tokenizer`: the directory to load it from; `parts_dir`: where the workers
        write their samples' routes (rl.orchestrator.parts); `local_routing`: each worker routes its own
        requests over `servers` instead of sending them through the router (rl.orchestrator.local_routing)."""
        self.parts_dir = str(parts_dir)
        self.hello = {"cfg": self.cfg, "servers": list(servers), "router": router, "tokenizer": str(tokenizer),
                      "timeout": float(timeout), "parts": self.parts_dir, "local_routing": bool(local_routing)}
        for c in self.children:
            self._spawn(c)
        await asyncio.gather(*(self._wait_ready(c) for c in self.children))
        log(ROLE, f"{self.n} rollout worker(s) ready (pids {', '.join(str(c.pid) for c in self.children)})")

    def _spawn(self, c: Child) -> None:
        mine, theirs = socket.socketpair()
        env = dict(os.environ)
        root = str(Path(rl.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        try:
            c.proc = subprocess.Popen([sys.executable, "-m", "rl.orchestrator.worker", "--fd", str(theirs.fileno()),
                                       "--index", str(c.index)], pass_fds=[theirs.fileno()], env=env)
        finally:
            theirs.close()
        c.ready = asyncio.Event()
        c.reader_task = asyncio.create_task(self._serve(c, mine))

    async def _wait_ready(self, c: Child) -> None:
        t0 = time.monotonic()
        while not c.ready.is_set():
            if self.error is not None:
                raise self.error
            if time.monotonic() - t0 > START_TIMEOUT_S:
                raise RuntimeError(f"rollout worker {c.index}: not ready after {START_TIMEOUT_S:.0f} s")
            try:
                async with asyncio.timeout(0.2):
                    await c.ready.wait()
            except TimeoutError:
                pass

    async def _serve(self, c: Child, sock: socket.socket) -> None:
        """Read worker c's messages until its stream ends; then fail its groups over and restart it."""
        reader, c.writer = await asyncio.open_connection(sock=sock)
        c.send({**self.hello, "version": self.tracker.version})
        try:
            while True:
                self._handle(c, await wire.read(reader))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception as e:  # noqa: BLE001 - a corrupt stream: the worker is treated as lost
            log(ROLE, f"rollout worker {c.index}: bad message ({type(e).__name__}: {e}); restarting it")
            if c.proc is not None:
                c.proc.kill()
        await self._lost(c)

    def _handle(self, c: Child, msg: Any) -> None:
        kind = msg[0]
        if kind == "ready":
            c.pid = int(msg[1])
            c.ready.set()
            return
        p = c.pending.get(msg[1])
        if p is not None:
            p.acked = True
        if kind == "end":
            _, _, i, tokens, segs, segtoks, s = msg
            s = wire.from_wire(s, self.parts_dir)   # claims the route parts: unwanted, their files go with it
            if p is None or i in p.got or i not in p.left:
                return
            p.got[i] = s
            g = p.group
            r = g.rollouts.get(i) if g is not None else None
            if r is not None and r.seconds is None:   # accounting.rollout_end, for the pool's group
                r.tokens, r.segments, r.segment_tokens = int(tokens), int(segs), int(segtoks)
                r.seconds = time.monotonic() - g.started
                g.done[i] = s
                if g.on_rollout_done is not None:
                    g.on_rollout_done()
        elif kind == "acct":
            g = p.group if p is not None else None
            for i, (tokens, segs, segtoks) in msg[2].items():
                r = g.rollouts.get(i) if g is not None else None
                if r is not None and r.seconds is None:
                    r.tokens, r.segments, r.segment_tokens = int(tokens), int(segs), int(segtoks)
        elif kind == "done":
            if p is not None and not p.future.done():
                p.future.set_result(msg[2])
        else:
            raise ValueError(f"unknown message {kind!r}")

    async def _lost(self, c: Child) -> None:
        # Taken out of `_pick` and its groups failed over before the wait for its exit status: while that
        # wait ran, a new group could be handed to the dead worker and then counted as lost and replayed.
        was_ready = c.ready.is_set()
        c.ready = asyncio.Event()
        # A replay the worker never acknowledged never ran there: when several workers die at once (a
        # node's), one's groups can be handed to another that is already dying before its end of stream
        # is read; counting them again counted the same episodes lost twice (192 of 128 in flight, measured)
        lost = sum(len(p.left) - len(p.got) for p in c.pending.values() if p.acked or not p.replay)
        for p in c.pending.values():
            if not p.future.done():
                p.future.set_exception(WorkerLost())
        c.pending.clear()
        proc = c.proc
        rc = await asyncio.to_thread(proc.wait) if proc is not None else None
        if self.closing:
            return
        if not was_ready:
            self.error = RuntimeError(f"rollout worker {c.index} exited with status {rc} before it was ready "
                                      f"(see its lines in the orchestrator's log)")
            return
        now = time.monotonic()
        c.restarts = [t for t in c.restarts if now - t < RESTART_WINDOW_S] + [now]
        self.totals["worker_restarts"] += 1
        self.totals["lost_episodes"] += lost
        if len(c.restarts) > MAX_RESTARTS:
            self.error = RuntimeError(f"rollout worker {c.index} died {len(c.restarts)} times in "
                                      f"{RESTART_WINDOW_S:.0f} s (last status {rc})")
            return
        log(ROLE, f"rollout worker {c.index} (pid {c.pid}) exited with status {rc}: {lost} episode(s) in flight "
                  f"lost, their groups' unfinished rollouts played again; restarting it")
        self._spawn(c)

    async def aclose(self) -> None:
        """Stop every worker (after the pool drained): `stop`, then SIGKILL after 10 s."""
        self.closing = True
        for c in self.children:
            c.send(("stop",))
        for c in self.children:
            if c.proc is None:
                continue
            try:
                await asyncio.wait_for(asyncio.to_thread(c.proc.wait), 10)
            except TimeoutError:
                c.proc.kill()
                await asyncio.to_thread(c.proc.wait)
        for c in self.children:
            if c.reader_task is not None:
                c.reader_task.cancel()
        await asyncio.gather(*(c.reader_task for c in self.children if c.reader_task), return_exceptions=True)

    # --- the weight watcher's messages ---------------------------------------------------------
    def gate(self, open_: bool) -> None:
        for c in self.children:
            c.send(("gate", bool(open_)))

    def reload(self, version: int, in_flight: dict) -> None:
        for c in self.children:
            c.send(("reload", int(version), dict(in_flight)))

    def meta(self) -> dict:
        return {"rollout_workers": self.n, **{f"{k}_total": v for k, v in self.totals.items()}}

    # --- groups --------------------------------------------------------------------------------
    async def _pick(self) -> Child:
        """The least loaded ready worker (waits while every one is restarting)."""
        while True:
            if self.error is not None:
                raise self.error
            # and alive: a worker that died with another (one node's workers at once) is not handed the
            # other's groups before its own end of stream is read, to be counted lost a second time
            ready = [c for c in self.children if c.ready.is_set() and c.writer is not None
                     and (c.proc is None or c.proc.poll() is None)]
            if ready:
                return min(ready, key=lambda c: (c.load, c.index))
            await asyncio.sleep(0.05)

    async def sample_group_or_none(self, task: Any, group: int, step: int, attempt: int,
                                   rollouts: list[int] | None = None):
        """The Sampler's `sample_group_or_none`, played by a worker: the group's samples in the order of
        `rollouts`, or None when its environment failed; an inference error propagates."""
        want = list(rollouts or range(int(self.o.group_size)))
        got: dict = {}
        g = accounting.GROUP.get()
        start_version = int(g.start_version) if g is not None else int(self.tracker.version)
        self.idle.enter()
        try:
            for replay in itertools.count():
                left = [i for i in want if i not in got]
                c = await self._pick()
                key = next(self._keys)
                p = Pending(g, left, got, asyncio.get_running_loop().create_future(), c, replay=replay > 0)
                c.pending[key] = p
                c.send(("play", key, task, group, step, attempt,
                        None if len(left) == int(self.o.group_size) else left, start_version))
                try:
                    why = await p.future
                except WorkerLost:
                    if replay >= MAX_REPLAYS:
                        raise RuntimeError(f"group {group}: lost its rollout worker {replay + 1} times") from None
                    self.totals["replayed_groups"] += 1
                    continue
                except asyncio.CancelledError:
                    c.send(("cancel", key))
                    raise
                finally:
                    c.pending.pop(key, None)
                if why is None:
                    return [got[i] for i in want]
                kind, msg = why
                if kind == "inference":
                    raise InferenceError(f"rollout worker {c.index}: {msg}")
                log(ROLE, f"step {step} group {group}: environment failed, group dropped: {msg}")
                return None
        finally:
            self.idle.leave()
