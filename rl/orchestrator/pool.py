"""The continuous rollout pool: groups always in flight, batches formed from those that finish.

Agentic episodes vary by orders of magnitude in length. Sampling batch n's groups together and waiting
for all of them (`orchestrator.schedule=batch`) lets one straggler idle the servers and the trainer for
the rest of the step. Here (`schedule=continuous`, the default) up to `orchestrator.max_inflight`
groups generate whatever the batch boundaries are; a finished group joins the ready queue; batch n is
published as soon as `prompts_per_step` ready groups are within the staleness bound of n; a new group
starts whenever a slot frees. Long groups keep generating across weight updates (the servers reload in
flight, every token keeps the version that produced it) and are used while they are within the bound.

Staleness is bounded on what is trained: a group whose oldest policy token comes from version v may go
into batches n <= v + max_off_policy only. When the next batch to publish passes that, the group is
useless: a ready group is dropped, an in-flight one cancelled (its HTTP requests are closed, which
aborts them on the servers; its episodes are closed, which releases their sandboxes). Both are counted.
New groups start only while a batch they could enter still has room, so the pool does not generate
work that could only go stale.

Exactly once across restarts. Groups are numbered in start order; group g plays the prompt drawn from
an RNG seeded by (seed, g), so a group id names its prompt. `rollouts/groups.jsonl` records every start
and every drop (one fsynced JSON line each); every published batch lists the ids it trained
(`group_ids` in its meta). A resumed orchestrator reads the batches that survived `rl.prepare` and the
log: ids started but neither in a surviving batch nor dropped were in flight or queued when the job
died, or went with a discarded batch, and they are started again first, oldest first, before new ids
continue after the highest one started. So every started group ends in exactly one trained batch or
counted as dropped, no prompt is skipped or repeated, and long prompts (those most likely in flight at
a crash) are not lost preferentially.

Drain: once every batch up to trainer.max_steps is published, or on a stop request, in-flight groups
are cancelled (counted as dropped, reason `drain`) and awaited for at most
`orchestrator.drain_timeout_s`.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl import exchange, runtime
from rl.contract import paths
from rl.contract.batch import Sample
from rl.runtime import is_done, log

ROLE = "orchestrator"
GROUPS_LOG = "groups.jsonl"


class IdleClock:
    """Seconds during which no generation request was outstanding on any server (inference idle)."""

    def __init__(self):
        self.outstanding = 0
        self._idle = 0.0
        self._since = time.monotonic()

    def enter(self) -> None:
        if self.outstanding == 0:
            self._idle += time.monotonic() - self._since
        self.outstanding += 1

    def leave(self) -> None:
        self.outstanding -= 1
        if self.outstanding == 0:
            self._since = time.monotonic()

    def idle_s(self) -> float:
        return self._idle + (time.monotonic() - self._since if self.outstanding == 0 else 0.0)


def default_max_inflight(o: Any) -> int:
    return int(o.max_inflight) if o.max_inflight is not None else int(o.prompts_per_step) * (int(o.max_off_policy) + 1)


def min_version(samples: list[Sample], fallback: int) -> int:
    """The oldest policy version of a group's trained tokens (prompt/observation tokens carry none)."""
    vs = [v for s in samples for v, m in zip(s.completion_versions, s.completion_mask or
                                             [1] * len(s.completion_versions)) if m and v >= 0]
    return min(vs) if vs else fallback


class GroupLog:
    """`rollouts/groups.jsonl`: an fsynced line per group start and per group drop."""

    def __init__(self, run_dir: Path, restart: int):
        self.path = Path(run_dir) / paths.ROLLOUTS / GROUPS_LOG
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.restart = restart

    def _append(self, rec: dict) -> None:
        exchange.check_fence(self.path.parent.parent, f"{GROUPS_LOG}: group {rec.get('group')}")
        # rl.exchange's shared appender ends a crash's torn last line first, so this record stands alone
        exchange.append_jsonl(self.path, {**rec, "restart": self.restart, "time": time.time()})

    def started(self, gid: int, version: int) -> None:
        self._append({"event": "start", "group": gid, "version": version})

    def dropped(self, gid: int, reason: str, step: int) -> None:
        self._append({"event": "drop", "group": gid, "reason": reason, "step": step})

    @staticmethod
    def read(run_dir: Path) -> list[dict]:
        return exchange.read_jsonl(Path(run_dir) / paths.ROLLOUTS / GROUPS_LOG)  # torn last line skipped


def trained_group_ids(run_dir: Path) -> dict[int, int]:
    """{group id: batch step} over the published rollout batches (those `rl.prepare` kept)."""
    out: dict[int, int] = {}
    for s in exchange.list_steps(run_dir, paths.ROLLOUTS):
        try:
            meta = json.loads((exchange.step_dir(run_dir, paths.ROLLOUTS, s) / "meta.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            continue  # quarantined or being re-published: its groups are not trained
        for g in meta.get("group_ids") or []:
            out[int(g)] = s
    return out


def resume_order(run_dir: Path) -> tuple[list[int], int]:
    """(ids to start again first, oldest first; the next fresh id) from the log and the batches."""
    events = GroupLog.read(run_dir)
    started = {int(e["group"]) for e in events if e.get("event") == "start"}
    dropped = {int(e["group"]) for e in events if e.get("event") == "drop"}
    trained = set(trained_group_ids(run_dir))
    retry = sorted(started - dropped - trained)
    return retry, max(started | trained, default=-1) + 1


@dataclass
class Group:
    gid: int
    task: Any
    start_version: int
    started: float
    handle: asyncio.Task | None = None
    samples: list[Sample] | None = None
    finished: float | None = None
    finish_version: int | None = None
    oldest: int = 0          # oldest policy version among its trained tokens (start_version until done)


@dataclass
class PoolStats:
    """Counters between two published batches (reset after each)."""
    dropped: int = 0         # ready groups that went stale
    cancelled: int = 0       # in-flight groups that went stale (requests aborted)
    failed: int = 0          # the environment failed
    occupancy_area: float = 0.0
    idle0: float = 0.0       # the servers' idle seconds so far, at the start
    t0: float = field(default_factory=time.monotonic)
    last: float = field(default_factory=time.monotonic)


class ContinuousPool:
    """Drives `orch` (rl.orchestrator.loop.Orchestrator): its servers, tracker, env and group sampler."""

    def __init__(self, orch: Any, first: int, max_steps: int, restart: int):
        self.orch, self.o = orch, orch.o
        self.max_steps = max_steps
        self.k = int(self.o.max_off_policy)
        self.per_batch = int(self.o.prompts_per_step)
        self.max_inflight = default_max_inflight(self.o)
        self.log = GroupLog(orch.run_dir, restart)
        self.retry, self.next_gid = resume_order(orch.run_dir)
        self.inflight: dict[int, Group] = {}
        self.ready: list[Group] = []
        self.wake = asyncio.Event()
        self.error: BaseException | None = None
        self.fail_streak = 0
        self.sem = asyncio.Semaphore(int(self.o.max_concurrency))
        self.stats = PoolStats(idle0=orch.idle.idle_s())
        self.totals = {"dropped": 0, "cancelled": 0, "failed": 0, "retried": len(self.retry)}
        if self.retry:
            log(ROLE, f"resuming the pool: {len(self.retry)} group(s) started before the restart and never "
                      f"trained or dropped are played again first ({self.retry[:8]}{'...' if len(self.retry) > 8 else ''})")

    # --- the pool ------------------------------------------------------------------------------
    def _task_of(self, gid: int):
        rng = random.Random(f"{self.orch.cfg.seed}-group-{gid}")
        return self.orch.env.sample_tasks(1, rng)[0]

    def _last_batch(self, version: int) -> int:
        """The last batch a group started now (at `version`) may enter."""
        return min(version + self.k, self.max_steps - 1)

    def _room(self, n: int) -> int:
        """Groups a batch still needs that a group started now could enter."""
        last = self._last_batch(self.orch.tracker.version)
        return (last - n + 1) * self.per_batch - len(self.ready) if last >= n else 0

    def _account(self) -> None:
        now = time.monotonic()
        self.stats.occupancy_area += len(self.inflight) * (now - self.stats.last)
        self.stats.last = now

    def _fill(self, n: int) -> None:
        """Start groups while a slot is free and a batch they could enter has room. While the trainer
        waits for batch n (the servers are on version n: it has trained n - 1), up to
        max_inflight - prompts_per_step groups beyond that room run as well, so the fastest fill batch n
        and the stragglers go on towards later batches instead of holding this one. While the trainer is
        busy (the pool is ahead), groups are started only for the room there is: a spare one could only
        be cancelled once the batches it may enter are full."""
        spare = self.max_inflight - self.per_batch if n <= self.orch.tracker.version else 0
        while True:
            room = self._room(n)
            if room <= 0 or len(self.inflight) >= min(self.max_inflight, room + spare):
                return
            gid = self.retry.pop(0) if self.retry else self._fresh_gid()
            v = self.orch.tracker.version
            g = Group(gid=gid, task=self._task_of(gid), start_version=v, started=time.monotonic(), oldest=v)
            self.log.started(gid, v)
            self._account()
            g.handle = asyncio.create_task(self._play(g))
            g.handle.add_done_callback(self._done)
            self.inflight[gid] = g

    def _done(self, handle: asyncio.Task) -> None:
        if not handle.cancelled() and handle.exception() is not None and self.error is None:
            self.error = handle.exception()  # an inference error: the role fails (and is restarted)
        self.wake.set()

    def _fresh_gid(self) -> int:
        gid = self.next_gid
        self.next_gid += 1
        return gid

    async def _play(self, g: Group) -> None:
        samples = await self.orch._sample_group_or_none(self.sem, g.task, g.gid, g.gid, 0)
        self._account()
        self.inflight.pop(g.gid, None)
        g.finished, g.finish_version = time.monotonic(), self.orch.tracker.version
        if samples is None:
            self.stats.failed += 1
            self.totals["failed"] += 1
            self.fail_streak += 1
            self.log.dropped(g.gid, "environment", -1)
            if self.fail_streak > self.per_batch and self.error is None:
                self.error = RuntimeError(f"{self.fail_streak} groups in a row failed in the environment "
                                          f"(see the log above)")
        else:
            self.fail_streak = 0
            g.samples = samples
            g.oldest = min_version(samples, g.start_version)
            self.ready.append(g)
        self.wake.set()

    def _drop_stale(self, n: int) -> None:
        """Groups that can no longer enter batch n or later (oldest token older than n - k)."""
        bound = n - self.k
        for g in [g for g in self.ready if g.oldest < bound]:
            self.ready.remove(g)
            self.stats.dropped += 1
            self.totals["dropped"] += 1
            self.log.dropped(g.gid, "stale", n)
        for g in [g for g in self.inflight.values() if g.start_version < bound]:
            self._cancel(g, "stale", n)

    def _cancel(self, g: Group, reason: str, n: int) -> None:
        self._account()
        self.inflight.pop(g.gid, None)
        g.handle.cancel()
        self.stats.cancelled += 1
        self.totals["cancelled"] += 1
        if reason != "stop":
            self.log.dropped(g.gid, reason, n)
        # A stop interrupts a group, it does not judge it: left without a drop line, the group is played
        # again first by the next incarnation (resume_order), as after a crash, so a stopped and resumed
        # run samples the same prompts as one that was never stopped.

    async def drain(self, reason: str, n: int) -> None:
        """Cancel everything in flight; wait for the cancellations at most drain_timeout_s."""
        handles = [g.handle for g in self.inflight.values()]
        for g in list(self.inflight.values()):
            self._cancel(g, reason, n)
        if handles:
            t0 = time.monotonic()
            done, pending = await asyncio.wait(handles, timeout=float(self.o.drain_timeout_s))
            log(ROLE, f"drained {len(handles)} group(s) in flight ({reason}) in {time.monotonic() - t0:.1f} s"
                      + (f"; {len(pending)} did not finish cancelling" if pending else ""))

    # --- batches -------------------------------------------------------------------------------
    def _take(self, n: int) -> list[Group] | None:
        """prompts_per_step ready groups for batch n, the oldest versions first (they go stale first)."""
        usable = sorted((g for g in self.ready if g.oldest >= n - self.k), key=lambda g: (g.oldest, g.gid))
        if len(usable) < self.per_batch:
            return None
        taken = usable[:self.per_batch]
        for g in taken:
            self.ready.remove(g)
        return taken

    def _meta(self, n: int, groups: list[Group]) -> dict:
        self._account()
        st, now, v = self.stats, time.monotonic(), self.orch.tracker.version
        span = max(now - st.t0, 1e-9)
        flight = [g.finish_version - g.start_version for g in groups]
        queue = [v - g.finish_version for g in groups]
        meta = {"group_ids": [g.gid for g in groups], "cancelled_groups": st.cancelled,
                "dropped_groups": st.dropped, "failed_groups": st.failed,
                "cancelled_groups_total": self.totals["cancelled"], "dropped_groups_total": self.totals["dropped"],
                "inflight_lag_mean": sum(flight) / len(flight), "inflight_lag_max": max(flight),
                "queue_lag_mean": sum(queue) / len(queue), "queue_lag_max": max(queue),
                "group_s_mean": sum(g.finished - g.started for g in groups) / len(groups),
                "group_s_max": max(g.finished - g.started for g in groups),
                "pool_occupancy": st.occupancy_area / span / self.max_inflight,
                "pool_inflight": len(self.inflight), "pool_ready": len(self.ready),
                "inference_idle_fraction": (self.orch.idle.idle_s() - st.idle0) / span, "gen_s": span,
                "retried_groups": self.totals["retried"], "schedule": "continuous"}
        self.stats = PoolStats(idle0=self.orch.idle.idle_s())
        return meta

    async def run(self, next_missing) -> None:
        """Publish batches until every step up to max_steps is published and DONE, or a stop."""
        orch = self.orch
        try:
            while not orch.stop.is_set() and not is_done(orch.run_dir):
                n = next_missing()
                if n is None:
                    runtime.progress()  # everything is published: waiting for DONE is the trainer's turn
                    # everything is published; the trainer may still quarantine a corrupt batch, which
                    # makes its step missing again, so keep watching until it is done
                    if self.inflight:
                        await self.drain("drain", self.max_steps)
                    for g in self.ready:  # finished, but no batch is left to take them
                        self.log.dropped(g.gid, "drain", self.max_steps)
                    self.ready.clear()
                    await asyncio.sleep(0.5)
                    continue
                if self.error is not None:
                    raise self.error
                orch.check_watcher()
                self._drop_stale(n)
                self._fill(n)
                groups = self._take(n)
                if groups is None:
                    runtime.waiting(f"rollout groups for rollouts/step_{n:06d} (finished by the servers, within "
                                    f"max_off_policy of it: needs weights/step_{max(n - self.k, 0):06d})")
                    self.wake.clear()
                    # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancellation that
                    # arrives as the wake fires, and a cancelled pool then never ends (a CI hang)
                    try:
                        async with asyncio.timeout(0.2):
                            await self.wake.wait()
                    except TimeoutError:
                        pass
                    continue
                orch.publish_batch(n, orch.finish_batch(n, [g.samples for g in groups], self._meta(n, groups)))
                runtime.progress()
        finally:
            runtime.progress()
            if self.inflight:
                await self.drain("stop" if orch.stop.is_set() else "drain", next_missing() or self.max_steps)

