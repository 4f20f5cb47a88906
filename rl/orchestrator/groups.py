"""A group of rollouts in the continuous pool, and the parts it may be trained in.

A group is `orchestrator.group_size` rollouts of one prompt; their advantages are relative to each
other, so the pool trains a group whole, in the first batch that takes it. That is a barrier: the short
rollouts of a group wait, finished, while its longest one runs, and their tokens age. Under
`stale_policy=mask` the tokens that pass the staleness bound while waiting are masked, and that barrier
was most of mask's waste (docs/async.md).

`stale_policy=release` lifts it. When batch n is formed and an in-flight group's finished rollouts
would pass the bound after n (n is the last batch their oldest token may enter), those rollouts are
trained in n as a *part* of the group; its other rollouts go on and are trained when they finish (the
*rest*), or in later parts.

The baseline: at the first batch a group is eligible for a part (n its last batch within the bound,
or the trainer waiting, below), the rewards of its finished rollouts are kept as its *snapshot*, and
every rollout of the group is taken against its siblings in the snapshot (`rl.orchestrator.advantages`),
one that is alone there against every sibling once the group is complete (it waits for that). Why not
"the siblings finished by the time the rollout is trained", which an earlier version used: whether a
rollout is trained early depends on its own length, so its baseline depended on its own actions, and
where reward and length go together (an agent that fails often runs to the turn limit) the gradient
was biased, a third too small in benchmarks/release_bias.py's example. The snapshot's time is set by
the group's start version and the trainer, not by the group's rollouts, so "my siblings in the
snapshot" is the same function of the siblings whatever a rollout did: unbiased, at the cost of a
smaller baseline set for the group's later rollouts.

While the trainer waits for batch n (with `orchestrator.release_on_wait`, off by default), n does not wait for
whole groups either: after the ready groups and the due parts, the finished rollouts of any in-flight
group fill it (the oldest groups first; each gets its snapshot as it is looked at). Those rollouts are
as fresh as any (their group started within the bound of n); the trainer does not idle while a batch's
worth of rollouts is finished somewhere.

Exactly once, per rollout: a batch's meta lists, per entry (its dense group number), the group id and
the rollout indices it trains (`entries`); `group_ids` lists the groups the batch completes, and
`partial_groups` the rollout indices and rewards of parts that do not. A group resumed after a restart
with a part in a surviving batch plays only its other rollouts, against the snapshot the batch's meta
recorded (`snapshots`; rl.orchestrator.grouplog.partial_rollouts).
"""
from __future__ import annotations

import asyncio
import json
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from rl.contract import offpolicy
from rl.contract.batch import Sample
from rl.orchestrator.accounting import RolloutAcct, check_finite, min_version


def default_max_inflight(o: Any) -> int:
    """Rollouts in flight (orchestrator.max_inflight; None = prompts_per_step * group_size * (k + 1))."""
    if o.max_inflight is not None:
        return int(o.max_inflight)
    return int(o.prompts_per_step) * int(o.group_size) * (int(o.max_off_policy) + 1)


def stale_policy(o: Any) -> offpolicy.StalePolicy:
    """The row of `o.stale_policy` (rl.contract.offpolicy.STALE_POLICIES: the one place the names live)."""
    return offpolicy.stale_policy(o.stale_policy)


def task_key(task: Any) -> str:
    try:
        return json.dumps(task, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return repr(task)


class DurationModel:
    """Running distribution of group durations: per task where the task has history, else the median of
    the recent groups of every task."""

    def __init__(self, window: int = 256):
        self.recent: deque[float] = deque(maxlen=window)
        self.per_task: dict[str, tuple[int, float]] = {}

    def add(self, key: str, seconds: float) -> None:
        self.recent.append(seconds)
        n, mean = self.per_task.get(key, (0, 0.0))
        self.per_task[key] = (n + 1, mean + (seconds - mean) / (n + 1))

    def predict(self, key: str) -> float | None:
        if key in self.per_task:
            return self.per_task[key][1]
        if len(self.recent) < 8:
            return None
        xs = sorted(self.recent)
        return xs[len(xs) // 2]


@dataclass
class Group:
    """A group in flight or ready, or one entry of a batch (a whole group, a part or the rest)."""
    gid: int
    task: Any
    start_version: int
    started: float
    handle: asyncio.Task | None = None
    samples: list[Sample] | None = None
    finished: float | None = None
    finish_version: int | None = None
    oldest: int = 0          # oldest policy version among its trained tokens (start_version until done)
    # the rollouts this group (or entry) still owns, by index: trained in an earlier part they leave it
    rollouts: dict[int, RolloutAcct] = field(default_factory=dict)
    on_rollout_done: Any = None
    done: dict[int, Sample] = field(default_factory=dict)       # finished rollouts' samples, as reported
    released: dict[int, float] = field(default_factory=dict)    # index -> reward, trained in an earlier part
    # index -> reward of the rollouts finished when the group was first eligible for a part: the baseline
    # of every rollout of the group (None: never eligible while in flight, the usual group baseline)
    snapshot: dict[int, float] | None = None
    complete: bool = True    # as a batch entry: the group has no rollout left after it
    _checked: dict[int, tuple[int, bool]] = field(default_factory=dict, repr=False)   # releasable()'s cache

    @property
    def open(self) -> int:
        """Rollouts still running (the slots this group holds)."""
        return sum(r.seconds is None for r in self.rollouts.values()) if self.finished is None else 0

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.rollouts.values())

    @property
    def indices(self) -> list[int]:
        return list(self.rollouts)

    @property
    def baseline(self) -> tuple[dict[int, float], list[int], dict[int, float]] | None:
        """This entry's advantage reference (rl.orchestrator.advantages): None for the usual group
        baseline, else (the group's snapshot, this entry's rollout indices, rewards trained earlier)."""
        return None if self.snapshot is None else (dict(self.snapshot), self.indices, dict(self.released))

    def _check(self, i: int) -> tuple[int, bool]:
        """Finished rollout i's oldest version and whether it is finite, computed once (episodes are long)."""
        if i not in self._checked:
            s = self.done[i]
            self._checked[i] = (min_version([s], self.start_version), check_finite([s]) is None)
        return self._checked[i]

    def _finished_now(self) -> dict[int, float]:
        """What a snapshot taken now would hold: the finished rollouts' rewards (finite ones: a non-finite
        reward fails its group)."""
        return {i: s.reward for i, s in self.done.items() if self._check(i)[1]}

    def take_snapshot(self) -> None:
        """At the first batch the group is eligible for a part: its finished rollouts' rewards become
        every rollout's baseline set."""
        if self.snapshot is None:
            self.snapshot = self._finished_now()

    def _candidates(self, snapshot: dict[int, float]) -> list[int]:
        """Finished rollouts with a sibling in `snapshot` (one alone there waits for the whole group);
        none while the group is finishing whole (it joins the ready queue instead)."""
        idx = [i for i in self.rollouts if i in self.done and set(snapshot) - {i}]
        return idx if len(idx) < len(self.rollouts) else []

    def lengths(self, now: float) -> list[tuple[float, int]]:
        """(seconds, tokens) per rollout; an unfinished one counts the time it ran so far."""
        return [(r.seconds if r.seconds is not None else now - self.started, r.tokens)
                for r in self.rollouts.values()]

    def finish(self, samples: list[Sample], played: list[int]) -> None:
        """The group's task returned `samples` for the rollouts `played`: keep those not released."""
        self.samples = [s for i, s in zip(played, samples) if i not in self.released]

    def would_release(self) -> int:
        """How many rollouts releasable(early=True) would give now, without taking a snapshot."""
        return len(self._candidates(self.snapshot if self.snapshot is not None else self._finished_now()))

    def releasable(self, n: int, k: int, early: bool = False) -> list[int]:
        """Finished rollouts to train in batch n as a part (stale_policy=release): n is the last batch
        their oldest token may enter (any batch with `early`: the trainer waits), a sibling is still
        running (a group finishing whole joins the ready queue instead), and each has a sibling in the
        group's snapshot, taken here the first time the group is eligible."""
        if not early and offpolicy.last_batch(self.start_version, k) > n:   # no token is older than the start
            return []
        self.take_snapshot()
        idx = self._candidates(self.snapshot)
        if not idx or (not early and offpolicy.last_batch(min(self._check(i)[0] for i in idx), k) > n):
            return []
        return idx if all(self._check(i)[1] for i in idx) else []   # a bad one fails its group at the end

    def oldest_of(self, idx: list[int]) -> int:
        """The oldest version among rollouts `idx` (those releasable() returned)."""
        return min(self._checked[i][0] for i in idx)

    def split(self, idx: list[int], version: int) -> "Group":
        """Release rollouts `idx` into a part (a batch entry) and keep the others in flight."""
        samples = [self.done.pop(i) for i in idx]
        accts = {i: self.rollouts.pop(i) for i in idx}
        part = replace(self, handle=None, samples=samples, rollouts=accts, done={}, released=dict(self.released),
                       _checked={},
                       finished=self.started + max(a.seconds or 0.0 for a in accts.values()),
                       finish_version=version, oldest=min_version(samples, self.start_version),
                       complete=False, on_rollout_done=None)
        self.released.update({i: s.reward for i, s in zip(idx, samples)})
        return part


def choose(ready: list[Group], inflight: list[Group], n: int, k: int, per_batch: int,
           group_size: int | None, early: bool = False) -> list[tuple[Group, list[int] | None]] | None:
    """Batch n's entries, the oldest first (they go stale first): (ready group, None) or (in-flight
    group, the rollouts to release as a part). With `group_size` None, prompts_per_step whole groups;
    else (release) entries until the batch holds per_batch * group_size rollouts, the in-flight groups'
    releasable rollouts competing with the ready groups; with `early` (the trainer waits for n), then
    the finished rollouts of the other in-flight groups, the oldest groups first. None: not enough yet."""
    usable: list[tuple[Group, list[int] | None]] = [(g, None) for g in ready]
    due = set()
    for g in inflight:
        if idx := g.releasable(n, k):
            usable.append((g, idx))
            due.add(g.gid)
    usable.sort(key=lambda e: (e[0].oldest if e[1] is None else e[0].oldest_of(e[1]), e[0].gid))
    need = per_batch * (group_size or 1)
    taken, have = [], 0
    for g, idx in usable:
        if have >= need:
            break
        taken.append((g, idx))
        have += 1 if group_size is None else len(g.rollouts) if idx is None else len(idx)
    # The trainer waits: the other in-flight groups, the oldest first, each snapshotted as it is looked
    # at (not the ones with the most finished rollouts first: which groups get a snapshot would then
    # depend on their own rollouts' lengths), until the batch is full; none is snapshotted when they
    # cannot fill it (a snapshot taken with nothing finished would keep its group from parts for good).
    others = sorted((g for g in inflight if g.gid not in due), key=lambda g: (g.start_version, g.gid)) if early else []
    if have < need and have + sum(g.would_release() for g in others) >= need:
        for g in others:
            if have >= need:
                break
            if idx := g.releasable(n, k, early=True):
                taken.append((g, idx))
                have += len(idx)
    return taken if have >= need else None


def entries_meta(groups: list[Group]) -> dict:
    """What a batch trains, per rollout (see the module docstring): `entries`, `group_ids`, `partial_groups`,
    and `snapshots` (the baseline set of each group that has one: a resumed group needs it)."""
    return {"group_ids": [g.gid for g in groups if g.complete],
            "snapshots": {str(g.gid): {str(i): r for i, r in g.snapshot.items()} for g in groups if g.snapshot},
            "entries": [[g.gid, g.indices] for g in groups],
            "partial_groups": {str(g.gid): {"rollouts": g.indices, "rewards": [s.reward for s in g.samples]}
                               for g in groups if not g.complete}}
