"""A discrete-event simulation of the asynchronous pipeline: steps per hour, trainer and inference idle,
the lag of trained tokens and the wasted fraction, from component times and an episode distribution.

Why a simulation beside launch.perf's formulas: with heavy-tailed episodes the step is set by
stragglers, the staleness bound and the scheduling rules, not by means. So this replays the
orchestrator's own rules (rl/orchestrator/pool.py, `_run_batches` in loop.py; docs/async.md) on a clock:
continuous rollouts (`_room`, spare groups under `drop`, `_hold` under mask/admit, `_take` oldest first,
stale groups dropped or cancelled under `drop`, stale tokens masked under mask/admit) or batch mode
(up to `batch_depth` batches sampled together, each awaited whole, published in step order); the
request (`max_concurrency`) and environment (`env_concurrency`) semaphores, FIFO; the pool's loop that
wakes on a finished rollout or every 0.2 s; the trainer polling for its batch every 10 ms; the weight
watcher polling every 0.1 s and the servers' version switch (every generated token takes the version
current when it is produced). Every stale policy is simulated as itself: `admit` holds the next group
while the median of the recent groups' durations does not fit before its last batch is due (the
trainer's step time as the pool measures it, a running mean of version intervals); `release` takes the
finished rollouts of an in-flight group as a part in the last batch within the bound (its snapshot taken
at first eligibility, each part needing a sibling in it), a batch holding prompts_per_step x group_size
rollouts (rl/orchestrator/groups.py `choose`). Time is simulated, so a run of hundreds of steps takes
seconds; standard library only.

Generation can cost more under load (`decode_knee` > 0): a server's decode step takes token_s while at
most decode_knee sequences generate, then grows in proportion (memory-bound decode: the weights are read
once per step whatever the batch, until compute or the KV cache take over), so the servers' tokens per
second saturate at decode_knee / token_s and every wasted token takes time from a useful one. Every running
generation advances one token per decode step (processor sharing), so one clock of tokens per sequence
(`work`) times them all: a generation ends when the clock has advanced its tokens since it started, and
only the next end is scheduled, re-timed when the number decoding changes or a reload pauses decoding.
It reports what a run measures of its servers too (`gen_token_s`, `decode_load`), so that
launch.calibrate can find the knee under which a replay of a pilot measures what the pilot measured.
Generations ending together end in the order they started (they were ordered by memory address, so
two runs of one simulation could differ): a simulation is reproducible.

Episodes come from a `GroupSource`: a callable from a group's key to its rollouts, each a list of
`Turn(tokens, env_s)`: generate `tokens`, then hold an environment slot for `env_s` (a tool call, a
test run, grading). Keys name the group as the orchestrator does: `group-<gid>` (continuous) or
`batch-<step>-<attempt>-<j>` (batch mode), so a source can replay exactly what a run played
(benchmarks/async_rollouts.py does). `lognormal_source` is the stated distribution; `from_metrics` reads
a finished run's metrics.jsonl (episode seconds: mean and p90, tokens, turns, trainer step time).
"""
from __future__ import annotations

import heapq
import math
import time
from collections import deque

# the simulation's inputs and result, and the episode distributions (launch/sim_inputs.py), under the
# names callers have always imported from here
from rl.contract import offpolicy
from launch.sim_inputs import (GroupSource, SimConfig, SimResult, Turn, _median_p90, from_metrics,  # noqa: F401
                               lognormal_sigma, lognormal_source, read_jsonl)
from launch.sim_state import SimGroup as _Group
from launch.sim_state import SimRollout as _Rollout
from launch.sim_state import MAX_EVENTS, PROGRESS_S, SimulationBound, split_versions  # noqa: F401

class Simulation:
    def __init__(self, cfg: SimConfig, source: GroupSource):
        self.c, self.source = cfg, source
        self.policy = offpolicy.stale_policy(cfg.stale_policy)   # its flags, never its name (rl.contract.offpolicy)
        self.now, self._seq, self._q, self._uid = 0.0, 0, [], 0
        self.version, self.history = 0, [(0.0, 0)]
        self.gen_active, self.env_active = 0, 0
        self.gen_wait, self.env_wait = deque(), deque()
        self.idle_since, self.gen_idle = 0.0, 0.0
        self.published: dict[int, float] = {}    # step -> time its file appears
        self.inflight: dict[int, _Group] = {}
        self.ready: list[_Group] = []
        self.next_gid, self.tick_token, self.waiting = 0, 0, False
        self.generated, self.trained, self.masked, self.dropped, self.lost = 0, 0, 0, 0, 0
        self.masked_waiting, self.sibling_waits = 0, []
        self.lags: dict[int, int] = {}
        self.metric_times: list[float] = []
        self.waits: list[float] = []
        self.builds: dict[int, dict] = {}
        self.done = False
        self.trainer_waits_for: tuple | None = None
        self.generating: list = []               # heap of (work clock at its end, id, rollout)
        self.work, self.work_t, self.gen_token = 0.0, 0.0, 0   # tokens per sequence so far, as of work_t
        self.pause_from, self.pause_until = 0.0, 0.0
        self.trained_version = 0                 # the newest version the trainer published
        self.step_s, self.version_t = None, 0.0  # admit: the pool's running step time, when v appeared
        self.durations: deque = deque(maxlen=256)
        self.admit_waits = 0
        self.gen_busy_s, self.gen_done_tokens = 0.0, 0   # finished requests: decode seconds, tokens
        self.version_waits: dict[int, float] = {}  # batch mode: step -> when its build began to wait

    # -- the clock ----------------------------------------------------------------------------------
    def at(self, t: float, fn, *args) -> int:
        self._seq += 1
        heapq.heappush(self._q, (t, self._seq, fn, args))
        return self._seq

    def run(self, max_events: int = MAX_EVENTS, deadline: float | None = None, progress=None,
            progress_s: float = PROGRESS_S) -> SimResult:
        """Play the events in time order until the last step is trained. Bounded: more than `max_events`
        events, or the wall clock (time.monotonic) past `deadline`, raise SimulationBound in one line;
        `progress(events, simulated_s, steps_trained)` is called every `progress_s` wall seconds.

        Work follows events, not simulated time: the pool's tick (every pool_tick_s) that finds the state
        its previous look left (no other event since, and not stale_policy=admit, whose holds are counted
        per look) is moved to the first tick at or after the next event, where the original loop would
        have looked in vain every 0.2 s; a pilot carried to a model 10^7 times slower (a debug pilot
        for Kimi) otherwise spent 10^8 such looks a simulation. A quiet tick with nothing left to happen
        is a pipeline that cannot finish: refused at once rather than after max_events."""
        self.at(0.0, self._trainer_poll, 0, 0.0)
        self.at(0.0, self._orchestrate)
        n, quiet, tick = 0, False, self.c.pool_tick_s
        look = time.monotonic() + progress_s
        while self._q and not self.done:
            t, seq, fn, args = heapq.heappop(self._q)
            if fn == self._orchestrate and args:
                if args[0] != self.tick_token:
                    continue                     # a tick a wake-up replaced: nothing to do
                if quiet and not self.policy.admits:
                    if not self._q:
                        raise SimulationBound(f"simulation: no end: nothing left to happen at t={t:.1f} s with "
                                              f"{len(self.metric_times)} of {self.c.steps} steps trained")
                    nxt = self._q[0][0]
                    if nxt > t and tick > 0:     # the looks before the next event would find nothing
                        self._seq += 1
                        k = max(1, math.ceil((nxt - t) / tick - 1e-9))
                        heapq.heappush(self._q, (t + k * tick, self._seq, fn, args))
                        continue
            self.now = t
            fn(*args)
            quiet = fn == self._orchestrate
            n += 1
            if n > max_events:
                raise SimulationBound(f"simulation: stopped at the bound of {max_events} events (t={self.now:.1f} "
                                      f"simulated s, {len(self.metric_times)} of {self.c.steps} steps trained)")
            if not n & 255 and (deadline is not None or progress is not None):
                wall = time.monotonic()
                if deadline is not None and wall > deadline:
                    raise SimulationBound(f"simulation: stopped at the wall-time bound after {n} events (t="
                                          f"{self.now:.1f} simulated s, {len(self.metric_times)} of "
                                          f"{self.c.steps} steps trained)")
                if progress is not None and wall >= look:
                    progress(n, self.now, len(self.metric_times))
                    look = wall + progress_s
        return self._result()

    # -- servers: generation and environment slots ----------------------------------------------------
    def _next_turn(self, r: _Rollout) -> None:
        if r.cancelled:
            return
        if r.turn >= len(r.turns):
            self._rollout_done(r)
            return
        if self.gen_active < self.c.max_concurrency:
            self._gen_start(r)
        else:
            r.queued = "gen"
            self.gen_wait.append(r)

    def _step_s(self, b: int) -> float:
        k = self.c.decode_knee
        return self.c.token_s * max(1.0, b / k) if k > 0 else self.c.token_s

    def _advance(self) -> None:
        """Move the work clock to now at the step time of the sequences decoding (none during a pause)."""
        dt = self.now - self.work_t
        dt -= max(0.0, min(self.now, self.pause_until) - max(self.work_t, self.pause_from))
        if self.gen_active > 0 and dt > 0 and self.c.token_s > 0:   # token_s 0: generations take no time
            self.work += dt / self._step_s(self.gen_active)
        self.work_t = self.now

    def _schedule_gen(self) -> None:
        """(Re)schedule the next generation's end; an earlier scheduled one is ignored (gen_token)."""
        while self.generating and self.generating[0][2].gen_start is None:   # cancelled: lazily removed
            heapq.heappop(self.generating)
        self.gen_token += 1
        if not self.generating:
            return
        left = max(0.0, self.generating[0][0] - self.work) * self._step_s(self.gen_active)
        self.at(max(self.now, self.pause_until) + left, self._gen_next, self.gen_token)

    def _gen_next(self, token: int) -> None:
        if token != self.gen_token:
            return
        self._advance()
        # done: within 1e-9 tokens, or within what the clock can still resolve at this time (a few ulps of
        # `now`, in tokens): late in a long simulation (t ~ 1e7 s, 1 ms a token) the rest of a generation
        # can be shorter than the clock's step, its end rescheduled at `now` forever without this
        step = self._step_s(max(self.gen_active, 1))
        eps = 1e-9 + (4 * math.ulp(max(self.now, self.pause_until, 1.0)) / step if step > 0 else 0.0)
        done = []
        while self.generating and (self.generating[0][2].gen_start is None
                                   or self.generating[0][0] <= self.work + eps):
            _, _, r = heapq.heappop(self.generating)
            if r.gen_start is not None:
                done.append(r)
        for r in done:
            self._gen_done(r)
        self._schedule_gen()

    def _gen_start(self, r: _Rollout) -> None:
        self._advance()
        if self.gen_active == 0:
            self.gen_idle += self.now - self.idle_since
        self.gen_active += 1
        r.queued = None
        r.gen_start = self.now
        r.w_end = self.work + r.turns[r.turn].tokens
        heapq.heappush(self.generating, (r.w_end, r.uid, r))
        self._schedule_gen()

    def _count(self, r: _Rollout, start: float, end: float, n: int) -> None:
        self.generated += split_versions(r, self.history, start, end, n)

    def _gen_done(self, r: _Rollout) -> None:
        if r.cancelled:
            return
        self._count(r, r.gen_start, self.now, r.turns[r.turn].tokens)
        self.gen_busy_s += self.now - r.gen_start
        self.gen_done_tokens += r.turns[r.turn].tokens
        r.gen_start = None
        self._release_gen()
        if self.env_active < self.c.env_concurrency:
            self._env_start(r)
        else:
            r.queued = "env"
            self.env_wait.append(r)

    def _release_gen(self) -> None:
        self._advance()
        self.gen_active -= 1
        self._schedule_gen()
        if self.gen_active == 0:
            self.idle_since = self.now
        while self.gen_wait and self.gen_active < self.c.max_concurrency:
            nxt = self.gen_wait.popleft()
            if not nxt.cancelled:
                self._gen_start(nxt)

    def _env_start(self, r: _Rollout) -> None:
        self.env_active += 1
        r.queued = None
        r.handle = self.at(self.now + r.turns[r.turn].env_s, self._env_done, r, self._seq + 1)

    def _env_done(self, r: _Rollout, token: int) -> None:
        if r.cancelled or token != r.handle:
            return
        self._release_env()
        r.turn += 1
        self._next_turn(r)

    def _release_env(self) -> None:
        self.env_active -= 1
        while self.env_wait and self.env_active < self.c.env_concurrency:
            nxt = self.env_wait.popleft()
            if not nxt.cancelled:
                self._env_start(nxt)

    def _switch(self, v: int) -> None:
        """The servers load version v; a reload pauses the generations in flight."""
        if v <= self.version:
            return
        if self.version_t and self.now > self.version_t:   # the pool's running step time (admit)
            dt = (self.now - self.version_t) / (v - self.version)
            self.step_s = dt if self.step_s is None else 0.7 * self.step_s + 0.3 * dt
        self.version, self.version_t = v, self.now
        self.history.append((self.now, v))
        for s, t0 in list(self.version_waits.items()):   # batch mode's _wait_version: its next poll sees v
            if self.builds.get(s) is not None and self.builds[s]["need"] <= v:
                p = self.c.version_poll_s
                k = max(1, math.ceil((self.now - t0) / p - 1e-9)) if p > 0 else 0
                self.at(t0 + k * p, self._build_start, s)
                del self.version_waits[s]
        if self.c.reload_pause_s > 0:   # the servers decode nothing while they load it
            self._advance()
            self.pause_from, self.pause_until = self.now, self.now + self.c.reload_pause_s
            self._schedule_gen()
        self._wake()

    # -- groups ---------------------------------------------------------------------------------------
    def _start_group(self, key: str, gid: int, step: int = -1) -> _Group:
        g = _Group(gid, self.version, self.now, step)
        g.rollouts = [_Rollout(g, list(turns), i) for i, turns in enumerate(self.source(key))]
        if not g.rollouts:   # never finishes and fills no room: the pool would start such groups forever
            raise SimulationBound(f"simulation: the episode source gave {key} no rollouts")
        for r in g.rollouts:   # ties between generations ending together: in start order, not by address
            self._uid += 1
            r.uid = self._uid
        for r in g.rollouts:
            self._next_turn(r)
        return g

    def _rollout_done(self, r: _Rollout) -> None:
        r.done, r.done_at = True, self.now
        g = r.group
        if g.open == 0 and g.finished is None:
            g.finished = self.now
            self.durations.append(self.now - g.started)
            vs = [v for rr in g.live for v in rr.versions]
            g.oldest = min(vs) if vs else g.start_version
            if self.c.schedule == "continuous":
                self.inflight.pop(g.gid, None)
                self.ready.append(g)
            else:
                self._build_progress(g)
        self._wake()

    def _cancel(self, g: _Group) -> None:
        for r in g.rollouts:
            if r.done or r.cancelled:
                continue
            r.cancelled = True
            if r.gen_start is not None:     # the request is aborted: what it generated so far counts
                self._advance()
                total = r.turns[r.turn].tokens
                n = int(total - max(0.0, r.w_end - self.work))
                self._count(r, r.gen_start, self.now, min(max(n, 0), total))
                r.gen_start = None     # its heap entry is skipped
                self._release_gen()
            elif r.queued is None and r.turn < len(r.turns):
                self._release_env()
        self.inflight.pop(g.gid, None)

    def _train_batch(self, n: int, groups: list) -> None:
        """Train batch n: its entries, each a whole group (or the rest of one) or (group, part indices)."""
        k, masking = self.c.max_off_policy, self.policy.keeps_groups
        for e in groups:
            g, idx = e if isinstance(e, tuple) else (e, None)
            rs = g.live if idx is None else [g.rollouts[i] for i in idx]
            if idx is not None:
                g.released.update(idx)
            for r in rs:
                waited = g.finished - r.done_at if idx is None else 0.0
                self.sibling_waits.append(waited)
                for v, c in r.versions.items():
                    if masking and v < n - k:
                        self.masked += c
                        self.masked_waiting += c if waited > 0 else 0
                        continue
                    self.trained += c
                    self.lags[n - v] = self.lags.get(n - v, 0) + c
        self.published[n] = self.now + self.c.publish_s
        if self.trainer_waits_for and self.trainer_waits_for[0] == n:
            self._trainer_poll(*self.trainer_waits_for)
            self.trainer_waits_for = None

    # -- the orchestrator -----------------------------------------------------------------------------
    def _next_missing(self) -> int | None:
        for n in range(self.c.steps):
            if n not in self.published:
                return n
        return None

    def _wake(self) -> None:
        if self.waiting:
            self.waiting = False
            self.tick_token += 1
            self.at(self.now, self._orchestrate)

    def _orchestrate(self, token: int | None = None) -> None:
        if token is not None and token != self.tick_token:
            return
        self.waiting = False
        if self.c.schedule == "continuous":
            self._pool()
        else:
            self._batches()
        if not self.done:
            self.waiting = True
            self.tick_token += 1
            self.at(self.now + self.c.pool_tick_s, self._orchestrate, self.tick_token)

    def _pool(self) -> None:
        c, k, P, G = self.c, self.c.max_off_policy, self.c.prompts_per_step, self.c.group_size
        masking = self.policy.keeps_groups
        while True:
            n = self._next_missing()
            if n is None:   # drain: what is left in flight or ready
                self.lost += sum(g.tokens for g in list(self.inflight.values()) + self.ready)
                for g in list(self.inflight.values()):
                    self._cancel(g)
                self.ready.clear()
                return
            if not masking:
                bound = n - k
                for g in [g for g in self.ready if g.oldest < bound]:
                    self.ready.remove(g)
                    self.dropped += 1
                for g in [g for g in self.inflight.values() if g.start_version < bound]:
                    self.dropped += 1
                    self._cancel(g)
            last = min(self.version + k, c.steps - 1)
            spare = max(c.inflight // G - P, 0) if n <= self.version and not masking else 0
            while True:   # in rollouts, not groups: under release a group may hold what its parts left
                room = (last - n + 1) * P * G - sum(len(g.live) for g in self.ready) if last >= n else 0
                if room <= 0 or sum(len(g.live) for g in self.inflight.values()) >= room + spare * G:
                    break
                if sum(g.open for g in self.inflight.values()) + G > c.inflight:
                    break
                if not self._admits(n):
                    self.admit_waits += 1
                    break
                gid = self.next_gid
                self.next_gid += 1
                self.inflight[gid] = self._start_group(f"group-{gid}", gid)
            hold = masking and n > self.trained_version and any(g.start_version + k <= n
                                                                 for g in self.inflight.values())
            usable = sorted((g for g in self.ready if masking or g.oldest >= n - k), key=lambda g: (g.oldest, g.gid))
            if hold:
                return
            if self.policy.trains_parts:
                taken = self._choose(n, usable)
                if taken is None:
                    return
            elif len(usable) < P:
                return
            else:
                taken = usable[:P]
            for e in taken:
                if not isinstance(e, tuple):
                    self.ready.remove(e)
            self._train_batch(n, taken)

    def _admits(self, n: int) -> bool:
        """stale_policy=admit (rl/orchestrator/pool.py `_admits`): the next group's predicted duration, the
        median of the recent groups' (from 8 on), fits before the last batch it may enter is due, or never
        fits; every group starts while the trainer waits for batch n."""
        if not self.policy.admits or self.step_s is None or n <= self.trained_version:
            return True
        if len(self.durations) < 8:
            return True
        pred = sorted(self.durations)[len(self.durations) // 2]
        budget = self.c.max_off_policy * self.step_s
        return pred <= self.version_t + budget - self.now or pred > budget

    def _choose(self, n: int, ready: list) -> list | None:
        """stale_policy=release (rl/orchestrator/groups.py `choose`): ready groups and the parts of in-flight
        groups for which n is the last batch within the bound, the oldest first, until the batch holds
        prompts_per_step x group_size rollouts; None: not enough yet."""
        k = self.c.max_off_policy
        entries = [(g.oldest, g.gid, g, None) for g in ready]
        for g in self.inflight.values():
            if g.start_version + k > n:
                continue
            if g.snapshot is None:
                g.snapshot = {r.index for r in g.live if r.done}
            live = g.live
            idx = [r.index for r in live if r.done and g.snapshot - {r.index}]
            if not idx or len(idx) >= len(live):
                continue
            oldest = min(min(g.rollouts[i].versions, default=g.start_version) for i in idx)
            if oldest + k > n:
                continue
            entries.append((oldest, g.gid, g, idx))
        entries.sort(key=lambda e: (e[0], e[1]))
        need, have, taken = self.c.prompts_per_step * self.c.group_size, 0, []
        for _, _, g, idx in entries:
            if have >= need:
                break
            taken.append(g if idx is None else (g, idx))
            have += len(g.live) if idx is None else len(idx)
        return taken if have >= need else None

    def _batches(self) -> None:
        c, k, P, G = self.c, self.c.max_off_policy, self.c.prompts_per_step, self.c.group_size
        depth = max(1, min(k + 1, c.inflight // (P * G)))
        while True:
            missing = [s for s in range(c.steps) if s not in self.published]
            if not missing:
                return
            for s in missing[:depth]:
                if s not in self.builds:
                    self.builds[s] = {"kept": [], "groups": [], "attempt": 0, "need": max(s - k, 0),
                                      "started": False, "done": False}
                    self._build_start(s)
            head = missing[0]
            b = self.builds[head]
            if not b["done"]:
                return
            self.builds.pop(head)
            self._train_batch(head, b["kept"])

    def _build_start(self, s: int) -> None:
        b = self.builds.get(s)
        if b is None or b["started"]:
            return
        if self.version < b["need"]:       # _wait_version polls: the look that sees the version (_switch)
            self.version_waits[s] = self.now
            return
        b["started"] = True
        self._sample(s, self.c.prompts_per_step)

    def _sample(self, s: int, need: int) -> None:
        a = self.builds[s]["attempt"]
        self.builds[s]["groups"] = [self._start_group(f"batch-{s}-{a}-{j}", -1, s) for j in range(need)]

    def _build_progress(self, g: _Group) -> None:
        s = g.step
        b = self.builds.get(s)
        if b is None or any(x.finished is None for x in b["groups"]):
            return
        k, masking = self.c.max_off_policy, self.policy.keeps_groups
        for x in b["groups"]:
            if masking or x.oldest >= s - k:
                b["kept"].append(x)
            else:
                self.dropped += 1
                self.lost += x.tokens
        b["groups"] = []
        if len(b["kept"]) < self.c.prompts_per_step:
            b["attempt"] += 1
            self._sample(s, self.c.prompts_per_step - len(b["kept"]))
        else:
            b["done"] = True

    # -- the trainer and the weight watcher -----------------------------------------------------------
    def _trainer_poll(self, n: int, t_wait: float) -> None:
        t = self.published.get(n)
        if t is None:                       # woken by _train_batch when batch n is published
            self.trainer_waits_for = (n, t_wait)
            return
        poll = self.c.trainer_poll_s        # it looks every poll_s from t_wait: the first look after t
        start = t_wait + math.ceil(max(t - t_wait, 0.0) / poll - 1e-9) * poll if poll > 0 else max(t, t_wait)
        self.waits.append(start - t_wait)
        self.at(start + self.c.train_s, self._trained, n)

    def _trained(self, n: int) -> None:
        self.metric_times.append(self.now)
        self.trained_version = n + 1
        poll = math.ceil(self.now / self.c.watch_poll_s) * self.c.watch_poll_s   # the watcher's next look
        self.at(poll + self.c.sync_s, self._switch, n + 1)
        self.done = n + 1 >= self.c.steps
        if self.done:   # what is still in flight or ready is the drain, left out of the waste
            self.lost += sum(g.tokens for g in list(self.inflight.values()) + self.ready)
        else:
            self._trainer_poll(n + 1, self.now)

    def _result(self) -> SimResult:
        ts = self.metric_times
        span = max(ts[-1] - ts[0], 1e-9) if len(ts) > 1 else 1e-9
        gen_idle = self.gen_idle + (self.now - self.idle_since if self.gen_active == 0 else 0.0)
        denom = max(self.generated - self.lost, 1)
        return SimResult(steps_per_hour=(len(ts) - 1) / span * 3600, trainer_idle=sum(self.waits[1:]) / span,
                         inference_idle=gen_idle / max(self.now, 1e-9), lags=dict(sorted(self.lags.items())),
                         wasted_fraction=max(0.0, (self.generated - self.lost - self.trained) / denom),
                         dropped_groups=self.dropped, masked_tokens=self.masked, masked_waiting=self.masked_waiting,
                         sibling_wait_s=_median_p90(self.sibling_waits), waiting_fraction=self.masked_waiting / denom,
                         admit_waits=self.admit_waits, gen_token_s=self.gen_busy_s / max(self.gen_done_tokens, 1),
                         decode_load=self.gen_busy_s / max(self.now - gen_idle, 1e-9),
                         step_times=[b - a for a, b in zip(ts, ts[1:])])


def simulate(cfg: SimConfig, source: GroupSource) -> SimResult:
    return Simulation(cfg, source).run()
