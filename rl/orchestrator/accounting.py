"""What sampling costs and what it yields: per-rollout tokens and seconds, inference idle, waste.

The pool schedules rollouts one by one (a slot frees when its rollout is graded, not when its group
is), and it measures waste and length bias per rollout. The samplers (rl.orchestrator.sampling,
multiturn) run inside a group's asyncio task and do not know the pool; they report through two context
variables set by the pool when it starts a group (`GROUP`) and by the sampler when a rollout begins
(`ROLLOUT`): `rollout_begin`, `count_generated`, `segment_closed`, `rollout_end`. Outside a pool
(schedule=batch, tests) those calls do nothing. The counters and the length statistics the batch meta carries live here too,
so the pool keeps to scheduling.
"""
from __future__ import annotations

import contextvars
import math
import time
from dataclasses import dataclass, field

import numpy as np

from rl.contract.batch import Sample

WASTE = ("stale", "cancelled", "environment", "masked")   # wasted tokens, by cause


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


@dataclass
class RolloutAcct:
    tokens: int = 0                 # policy tokens generated (finished requests; a cancelled one: 0)
    seconds: float | None = None    # from the group's start to this rollout's end (None: unfinished)
    segments: int = 0               # contexts the episode closed by summarizing (rl.orchestrator.multiturn)
    segment_tokens: int = 0         # their policy tokens: what a cancel of the episode loses with them


GROUP: contextvars.ContextVar = contextvars.ContextVar("hetrl_pool_group", default=None)
ROLLOUT: contextvars.ContextVar = contextvars.ContextVar("hetrl_pool_rollout", default=None)


def count_generated(n: int) -> None:
    """Add `n` generated policy tokens to the rollout being played in this context (if any)."""
    r = ROLLOUT.get()
    if r is not None:
        r.tokens += int(n)


def segment_closed(segments: int, tokens: int) -> None:
    """The rollout of this context has closed `segments` contexts so far, `tokens` policy tokens in them."""
    r = ROLLOUT.get()
    if r is not None:
        r.segments, r.segment_tokens = int(segments), int(tokens)


def rollout_begin(i: int) -> None:
    """Called by the group sampler at the start of rollout i (inside its own task)."""
    g = GROUP.get()
    if g is not None and i in g.rollouts:
        ROLLOUT.set(g.rollouts[i])


def rollout_end(i: int, sample: Sample | None = None) -> None:
    """Called by the group sampler when rollout i has its reward: its slot frees now. With its `sample`,
    the pool may train the rollout before its siblings finish (stale_policy=release)."""
    g = GROUP.get()
    r = g.rollouts.get(i) if g is not None else None
    if r is not None and r.seconds is None:
        r.seconds = time.monotonic() - g.started
        if sample is not None:
            g.done[i] = sample
        if g.on_rollout_done is not None:
            g.on_rollout_done()


def _trained(s: Sample) -> np.ndarray:
    """Which completion tokens of `s` are trained (loss mask 1), as a bool array. Sample fields are
    numpy arrays (multi-turn rollouts) or lists; a missing mask means every completion token."""
    if s.completion_mask is None:
        return np.ones(len(s.completion_ids), bool)
    return np.asarray(s.completion_mask) != 0


def policy_tokens(samples: list[Sample]) -> int:
    """Tokens of `samples` that are trained (loss mask 1). Counted, not summed: a uint8 mask's sum wraps."""
    return sum(int(np.count_nonzero(_trained(s))) for s in samples)


def trained_versions(samples: list[Sample]) -> np.ndarray:
    """The policy versions (int64) of the trained tokens of `samples` that some policy generated."""
    parts = []
    for s in samples:
        v = np.asarray(s.completion_versions, np.int64).reshape(-1)
        parts.append(v[_trained(s) & (v >= 0)])
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def min_version(samples: list[Sample], fallback: int) -> int:
    """The oldest policy version of a group's trained tokens (prompt/observation tokens carry none)."""
    vs = trained_versions(samples)
    return int(vs.min()) if len(vs) else fallback


def check_finite(samples: list[Sample]) -> str | None:
    """None when every reward and every trained token's logprob is finite as a float32, else why not
    (one NaN reward would make its whole group's advantages NaN; the trainer sets such a batch aside)."""
    f32_max = 3.4028234663852886e38
    for i, s in enumerate(samples):
        if not (math.isfinite(s.reward) and abs(s.reward) <= f32_max):
            return f"sample {i}: reward {s.reward!r} is not finite (float32)"
        lp = np.asarray(s.completion_logprobs, np.float64).reshape(-1)
        with np.errstate(invalid="ignore"):
            bad = _trained(s) & ~(np.isfinite(lp) & (np.abs(lp) <= f32_max))
        if bad.any():
            j = int(np.flatnonzero(bad)[0])
            return f"sample {i}: logprob {float(lp[j])!r} of completion token {j} is not finite (float32)"
    return None


def mask_stale(samples: list[Sample], oldest: int) -> int:
    """Give loss mask 0 to every policy token of `samples` generated by a version older than `oldest`
    (stale_policy mask/admit); returns how many were masked. Observation tokens are untouched. A numpy
    mask is edited in place (a multi-turn sample's mask is a view of its rollout's); a list mask is
    replaced by an edited list, a missing one by a list."""
    masked = 0
    for s in samples:
        v = np.asarray(s.completion_versions, np.int64).reshape(-1)
        stale = _trained(s) & (v >= 0) & (v < oldest)
        k = int(np.count_nonzero(stale))
        masked += k
        if isinstance(s.completion_mask, np.ndarray):
            if k:
                s.completion_mask[stale] = 0
            continue
        m = list(s.completion_mask) if s.completion_mask is not None else [1] * len(s.completion_ids)
        for j in np.flatnonzero(stale).tolist():
            m[j] = 0
        s.completion_mask = m
    return masked


@dataclass
class PoolStats:
    """Counters between two published batches (reset after each)."""
    dropped: int = 0         # ready groups that went stale
    cancelled: int = 0       # in-flight groups that went stale (requests aborted)
    failed: int = 0          # the environment failed
    parts: int = 0           # parts of in-flight groups trained before their siblings (stale_policy=release)
    parts_early: int = 0     # of them, released before their last batch: the trainer waited (release_on_wait)
    tokens: dict = field(default_factory=lambda: dict.fromkeys(WASTE + ("generated", "trained"), 0))
    occupancy_area: float = 0.0
    idle0: float = 0.0       # the servers' idle seconds so far, at the start
    t0: float = field(default_factory=time.monotonic)
    last: float = field(default_factory=time.monotonic)


def p90(xs: list[float]) -> float:
    if not xs:
        return 0.0
    ys = sorted(xs)
    return float(ys[min(len(ys) - 1, int(0.9 * len(ys)))])


def length_stats(started: list[tuple[float, int]], trained: list[tuple[float, int]]) -> dict:
    """Mean and p90 of episode seconds and tokens, started versus trained, and their ratios.

    `length_ratio` (trained mean / started mean, the smaller of the seconds and tokens ratios) is the
    length bias: below 1, what is trained is shorter than what was started."""
    def mean(xs):
        return sum(xs) / len(xs) if xs else 0.0
    out = {}
    for which, xs in (("started", started), ("trained", trained)):
        for j, unit in ((0, "s"), (1, "tokens")):
            vals = [x[j] for x in xs]
            out[f"{which}_episode_{unit}_mean"] = mean(vals)
            out[f"{which}_episode_{unit}_p90"] = p90(vals)
    ratio_s = out["trained_episode_s_mean"] / max(out["started_episode_s_mean"], 1e-9)
    ratio_t = out["trained_episode_tokens_mean"] / max(out["started_episode_tokens_mean"], 1e-9)
    return {**out, "length_ratio": min(ratio_s, ratio_t), "length_ratio_s": ratio_s, "length_ratio_tokens": ratio_t}
