"""A group of rollouts in the continuous pool, and the parts it may be trained in.

A group is `orchestrator.group_size` rollouts of one prompt; their advantages are relative to each
other, so the pool trains a group whole, in the first batch that takes it. That is a barrier: the short
rollouts of a group wait, finished, while its longest one runs, and their tokens age. Under
`stale_policy=mask` the tokens that pass the staleness bound while waiting are masked, and that barrier
was most of mask's waste (docs/async.md).

`stale_policy=release` lifts it. When batch n is formed and an in-flight group's finished rollouts
would pass the bound after n (n is the last batch their oldest token may enter), those rollouts are
trained in n as a *part* of the group, with the siblings finished by then as their baseline; the
group's other rollouts go on and are trained when they finish (the *rest*), with every sibling's reward
as their baseline, the earlier part's included. The baseline of a rollout stays independent of its own
actions: which siblings are finished is decided by the batch's time (the group's start version and the
trainer) and by the siblings themselves, which are independent samples of the same prompt. With the
advantage `r_i - mean(R)` over the reference set R of finished siblings (`rl.orchestrator.advantages`),
that is the leave-one-out baseline scaled by (|R| - 1) / |R|, a constant given the others. A part needs
at least one sibling for its baseline: a first part holds at least two rollouts.

While the trainer waits for batch n (`orchestrator.release_on_wait`, on by default), n does not wait for
whole groups either: after the ready groups and the due parts, the finished rollouts of any in-flight
group fill it (the groups with the most finished rollouts first, so groups are split as little as
possible). Those rollouts are as fresh as any (their group started within the bound of n); the trainer
does not idle while a batch's worth of rollouts is finished somewhere.

Exactly once, per rollout: a batch's meta lists, per entry (its dense group number), the group id and
the rollout indices it trains (`entries`); `group_ids` lists the groups the batch completes, and
`partial_groups` the rollout indices and rewards of parts that do not. A group resumed after a restart
with a part in a surviving batch plays only its other rollouts, with that part's rewards in its
baseline (rl.orchestrator.grouplog.partial_rollouts).
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
    def baseline(self) -> list[float]:
        """Rewards of siblings trained in earlier parts: part of this entry's advantage reference."""
        return list(self.released.values())

    def lengths(self, now: float) -> list[tuple[float, int]]:
        """(seconds, tokens) per rollout; an unfinished one counts the time it ran so far."""
        return [(r.seconds if r.seconds is not None else now - self.started, r.tokens)
                for r in self.rollouts.values()]

    def finish(self, samples: list[Sample], played: list[int]) -> None:
        """The group's task returned `samples` for the rollouts `played`: keep those not released."""
        self.samples = [s for i, s in zip(played, samples) if i not in self.released]

    def releasable(self, n: int, k: int, early: bool = False) -> list[int]:
        """Finished rollouts to train in batch n as a part (stale_policy=release): n is the last batch
        their oldest token may enter (any batch with `early`: the trainer waits), a sibling is still
        running (a group finishing whole joins the ready queue instead), and the part has a baseline (two
        rollouts, or siblings trained earlier)."""
        if not early and offpolicy.last_batch(self.start_version, k) > n:   # no token is older than the start
            return []
        idx = [i for i in self.rollouts if i in self.done]
        if not idx or len(idx) == len(self.rollouts) or (len(idx) < 2 and not self.released):
            return []
        for i in idx:   # per rollout once (episodes are long): its oldest version, and whether it is finite
            if i not in self._checked:
                s = self.done[i]
                self._checked[i] = (min_version([s], self.start_version), check_finite([s]) is None)
        if not early and offpolicy.last_batch(min(self._checked[i][0] for i in idx), k) > n:
            return []
        return idx if all(self._checked[i][1] for i in idx) else []   # a bad one fails its group at the end

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
    the finished rollouts of the other in-flight groups, the largest parts first. None: not enough yet."""
    usable: list[tuple[Group, list[int] | None]] = [(g, None) for g in ready]
    due = set()
    for g in inflight:
        if idx := g.releasable(n, k):
            usable.append((g, idx))
            due.add(g.gid)
    usable.sort(key=lambda e: (e[0].oldest if e[1] is None else e[0].oldest_of(e[1]), e[0].gid))
    if early:
        more = [(g, idx) for g in inflight if g.gid not in due and (idx := g.releasable(n, k, early=True))]
        usable += sorted(more, key=lambda e: (-len(e[1]), e[0].oldest_of(e[1]), e[0].gid))
    need = per_batch * (group_size or 1)
    taken, have = [], 0
    for g, idx in usable:
        if have >= need:
            break
        taken.append((g, idx))
        have += 1 if group_size is None else len(g.rollouts) if idx is None else len(idx)
    return taken if have >= need else None


def entries_meta(groups: list[Group]) -> dict:
    """What a batch trains, per rollout (see the module docstring): `entries`, `group_ids`, `partial_groups`."""
    return {"group_ids": [g.gid for g in groups if g.complete],
            "entries": [[g.gid, g.indices] for g in groups],
            "partial_groups": {str(g.gid): {"rollouts": g.indices, "rewards": [s.reward for s in g.samples]}
                               for g in groups if not g.complete}}
