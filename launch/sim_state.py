"""The state launch/simulate.py keeps per simulated rollout and group: a rollout's turns, the versions of
its generated tokens, its slot and pending event; a group's rollouts, when it started and finished, its
oldest version and, under stale_policy=release, the rollouts trained as parts and the snapshot of those
finished at its first eligibility; and how a generation's tokens split over the versions it spanned.
Plain records and one pure function, apart from the event loop so that module stays one
readable file; standard library only.
"""
from __future__ import annotations

import math

MAX_EVENTS = 50_000_000   # a simulation's events before it stops (SimulationBound); launch.calibrate: fewer
PROGRESS_S = 2.0          # wall seconds between two progress calls


class SimulationBound(RuntimeError):
    """A simulation stopped at a bound (events, wall time) or that cannot finish; the message is one line."""


class SimRollout:
    def __init__(self, group, turns, index=0):
        self.group, self.turns, self.index = group, turns, index
        self.turn, self.versions, self.done, self.cancelled = 0, {}, False, False
        self.done_at = None
        self.gen_start, self.w_end = None, 0.0   # the running generation: its start (None: none), its end on the work clock
        self.queued = None                       # "gen" | "env" while waiting for a slot
        self.handle = None                       # the pending event's token (a stale event is ignored)
        self.uid = 0                             # start order: breaks ties between equal ends reproducibly

    @property
    def tokens(self) -> int:
        return sum(self.versions.values())


class SimGroup:
    def __init__(self, gid, version, t, step=-1):
        self.gid, self.start_version, self.started, self.step = gid, version, t, step
        self.rollouts: list[SimRollout] = []
        self.finished, self.oldest = None, version
        self.released: set[int] = set()          # rollouts trained as parts (release)
        self.snapshot: set[int] | None = None    # finished at the group's first eligibility for a part

    @property
    def live(self) -> list[SimRollout]:
        return [r for r in self.rollouts if r.index not in self.released]

    @property
    def open(self) -> int:
        return sum(not r.done for r in self.live)

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.live)


def split_versions(r: SimRollout, history: list, start: float, end: float, n: int) -> int:
    """Per-token versions of n tokens generated from start to end: token m = 1..n is produced at
    start + m (end - start) / n and takes the version the servers had then (`history`: (time, version)
    switches; a switch at exactly that time counts). Adds them to r.versions; returns n (0 if none)."""
    if n <= 0:
        return 0
    dt, done = max((end - start) / n, 1e-15), 0
    v = max((vv for tt, vv in history if tt <= start + dt), default=0)
    for ts, nv in history:
        if ts <= start + dt:
            continue
        upto = min(n, max(done, math.ceil((ts - start) / dt - 1e-9) - 1))   # tokens before the switch
        r.versions[v] = r.versions.get(v, 0) + upto - done
        done, v = upto, nv
    r.versions[v] = r.versions.get(v, 0) + n - done
    return n
