"""The orchestrator's memory at the seed from benchmarks/seed_rehearsal.py's runs: a sum of parts, each
measured in the rehearsal and scaled to the seed by what it grows with, never all of it by one driver.

Why parts: the rehearsal holds 128 episodes of 16k tokens in flight, the seed 2048 of 64k; scaling the whole
growth over the fixed part by tokens in flight (64x) charges to tokens whatever grows with episodes (a task,
an environment, an HTTP connection each), with the size of a turn's answer (the bodies being read and
parsed, a turn's routes as base64 each: bounded per server, rl.orchestrator.client.READ_BODIES), or with
nothing at all, and is then as wrong as the largest of those is large.

The parts, and the run that separates each (all one-step runs of the same code; RssAnon, the anonymous
memory, sampled between builds, so the shard being built is a part of its own):
- fixed `F`: a process that does only the orchestrator's start-up, measured apart;
- per token in flight `b`: the main run against one whose episodes are a quarter as long in a quarter of
  the turns (same episodes in flight, same turn sizes); tokens in flight `T = I x mean tokens / 2` (an
  episode in flight is on average half-way);
- per episode in flight `e`: the main run against one with a quarter of the episodes in flight;
- per byte of the largest answer `c` (how many answers' worth are held at once): the main run against
  one whose episodes are as long in a quarter of the turns (answers four times as large, as many tokens);
- the rest `r`: what the main run holds beyond those (start-up after the servers appear, caches); as is.
The three differences give `e`, `b`, `c` (a 3 x 3 linear system, since each probe's measured means move
the other drivers a little too). A rate the noise makes negative is taken as 0 for the seed (printed as
measured): the growth measured is a few tens of MB, so each rate is uncertain by tens of percent.

At the seed: `F + r + e I + b I T/2 + c x (servers) x (the seed's largest answer) + build x (the seed's
share / the rehearsal's) + waiting`, where the largest answer scales with tokens per turn (the routes of a
turn), the bound on bodies read at once is per server, and `waiting` is the finished samples waiting for
their batch: up to `max_off_policy` batches of `R x T` tokens at 13 B each (the trimmed arrays of
rl.orchestrator.rollout; their routes are mapped files, not anonymous memory). Taking both the episodes in
flight and the batches waiting at their maxima is an upper bound: the pool's room caps the two together
at (max_off_policy + 1) batches of rollouts, plus spare groups under `drop` (rl.orchestrator.pool).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TOKEN_BYTES = 13   # a finished sample's per-token arrays: int32 id, uint8 mask, float32 logprob, int32 version


@dataclass(frozen=True)
class Run:
    """One run's measurements: orchestrator.max_inflight, the mean episode tokens and turns, the largest
    generate answer in bytes (the engine's records), and RssAnon between builds."""
    inflight: int
    mean_tokens: float
    turns: float
    largest_answer: float
    anon_idle: float

    @property
    def tokens_inflight(self) -> float:
        return self.inflight * self.mean_tokens / 2

    @property
    def turn_tokens(self) -> float:
        return self.mean_tokens / max(self.turns, 1.0)


@dataclass(frozen=True)
class Fit:
    fixed: float
    per_episode: float     # bytes per episode in flight
    per_token: float       # bytes per token in flight
    per_answer: float      # answers' worth held (bytes per byte of the largest answer)
    rest: float

    def drivers(self) -> dict:
        return {"per_episode": self.per_episode, "per_token": self.per_token, "per_answer": self.per_answer}


def fit(main: Run, inflight: Run, length: Run, turn: Run, fixed: float) -> Fit:
    """The rates from the main run and its three probes (the module docstring); raw, negatives kept."""
    probes = (inflight, length, turn)
    a = np.array([[main.inflight - p.inflight, main.tokens_inflight - p.tokens_inflight,
                   main.largest_answer - p.largest_answer] for p in probes], float)
    y = np.array([main.anon_idle - p.anon_idle for p in probes], float)
    # each probe must move its own driver well beyond the others' noise, or the rates are noise
    for name, moved in (("inflight", inflight.inflight / main.inflight),
                        ("length", length.tokens_inflight / main.tokens_inflight),
                        ("turn", main.largest_answer / max(turn.largest_answer, 1.0))):
        if not 0 < moved <= 0.75:
            raise ValueError(f"the {name} probe does not separate the drivers (episodes, tokens, answer bytes): "
                             f"its driver is {moved:.2f} of the main run's, want <= 0.75")
    e, b, c = np.linalg.solve(a, y)
    rest = main.anon_idle - fixed - e * main.inflight - b * main.tokens_inflight - c * main.largest_answer
    return Fit(fixed=float(fixed), per_episode=float(e), per_token=float(b), per_answer=float(c), rest=float(rest))


@dataclass(frozen=True)
class SeedVolume:
    inflight: int
    mean_tokens: float
    turns: float
    rollouts: int
    off_policy: int
    servers: int


def at_seed(f: Fit, main: Run, seed: SeedVolume, servers_here: int, build: float, share_ratio: float) -> dict:
    """Each part at the seed (bytes), by its own driver; negative rates and rest taken as 0."""
    largest = main.largest_answer * (seed.mean_tokens / seed.turns) / main.turn_tokens
    parts = {
        "fixed": f.fixed,
        "rest": max(f.rest, 0.0),
        "episodes": max(f.per_episode, 0.0) * seed.inflight,
        "tokens": max(f.per_token, 0.0) * seed.inflight * seed.mean_tokens / 2,
        "answers": max(f.per_answer, 0.0) * largest * seed.servers / max(servers_here, 1),
        "build": max(build, 0.0) * share_ratio,
        "waiting": seed.off_policy * seed.rollouts * seed.mean_tokens * TOKEN_BYTES,
    }
    parts["anon"] = sum(parts.values())
    parts["largest_answer"] = largest
    return parts


def describe(f: Fit, parts: dict, seed: SeedVolume, runs: dict) -> list[str]:
    """The method and the numbers, as the benchmark prints them."""
    g = 2 ** 30
    lines = ["  orchestrator memory, a sum of parts (benchmarks/_rehearsal_memory.py): RssAnon between builds "
             + ", ".join(f"{k} {r.anon_idle / g:.3f} GiB ({r.inflight} in flight x {r.mean_tokens:.0f} tokens in "
                         f"{r.turns:.1f} turns, largest answer {r.largest_answer / 1e6:.2f} MB)"
                         for k, r in runs.items()),
             f"    measured: fixed {f.fixed / g:.3f} GiB (start-up only), {f.per_episode / 2**10:.1f} KiB per episode "
             f"in flight, {f.per_token:.1f} B per token in flight (T = in flight x mean / 2), {f.per_answer:.2f} "
             f"largest answers' worth, rest {f.rest / g:.3f} GiB" + (" (a negative rate is noise: 0 at the seed)"
                                                                   if min(f.drivers().values()) < 0 else ""),
             f"    at the seed: fixed {parts['fixed'] / g:.2f} + rest {parts['rest'] / g:.2f} + episodes "
             f"{parts['episodes'] / g:.2f} ({seed.inflight}) + tokens in flight {parts['tokens'] / g:.2f} "
             f"({seed.inflight} x {seed.mean_tokens:.0f} / 2) + answers {parts['answers'] / g:.2f} (largest "
             f"{parts['largest_answer'] / 1e6:.1f} MB at {seed.mean_tokens / seed.turns:.0f} tokens a turn, "
             f"{seed.servers} servers) + build {parts['build'] / g:.2f} + finished samples waiting "
             f"{parts['waiting'] / g:.2f} "
             f"({seed.off_policy} batches x {seed.rollouts} x {seed.mean_tokens:.0f} x {TOKEN_BYTES} B; with "
             f"all episodes in flight too: an upper bound) = anonymous {parts['anon'] / g:.2f} GiB"]
    return lines
