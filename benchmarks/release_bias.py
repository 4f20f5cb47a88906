"""How biased is a group's policy gradient when it is trained in parts (stale_policy=release)?

An exact computation, no sampling: a group of G rollouts of one prompt; each rollout is short with
probability p (the policy's one parameter, p = sigmoid(theta)) and then succeeds (reward 1) with
probability `--good-short`, a long one with `--good-long`. The short ones finish first. When two or
more are short and at least one is long, the shorts are trained first as a part and the longs are the
rest (what `release` does when the batch's time falls between the two); otherwise the group is trained
whole. Over every outcome (2^G lengths times 2^G rewards) it sums

    E[ sum_i A_i * d log P(tau_i) / d theta ]

under both advantage estimators of rl.orchestrator.advantages:
- Dr. GRPO (no std): divided by (G - 1) / G times the true gradient d E[sum_i r_i] / d theta (a whole
  group's `r_i - mean(R)` is (G - 1) / G times its leave-one-out advantage), so an unbiased scheme
  scores 1.0, and `whole` does;
- GRPO (the default, divided by the group's std): the std makes even the whole group a reweighted
  gradient, not the true one, so each scheme is divided by `whole`'s expected gradient under GRPO: 1.0
  means release trains what the barrier would have; the whole group's own ratio to the true gradient is
  printed beside it (`grpo_whole_vs_true`, scaled like Dr. GRPO's).
With `--sweep` (the default) it also runs a grid of group sizes, length probabilities and success rates
and prints each ratio's range over it.

Schemes:
- `whole`:    every group trained whole (the barrier; the reference);
- `release`:  rl.orchestrator.advantages as `release` calls it: a snapshot of the rollouts finished
              when the part is formed (the shorts) is every rollout's baseline set, its siblings in it
              (the whole group for one alone there); the same function of the siblings whatever the
              rollout did;
- `former`:   what `release` did until 2026-12-05: a part against itself, the rest against every
              sibling, so a rollout's baseline depended on whether it was itself short.

    python benchmarks/release_bias.py [--group-size 4] [--p 0.6] [--good-short 0.8] [--good-long 0.2] [--no-sweep]

The last line is machine-readable: `key=value ...`: `drgrpo_<scheme>_ratio` and `grpo_<scheme>_ratio` at
the stated point, then over the grid `<estimator>_<scheme>_min` / `_max`.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rl.orchestrator.advantages import group_advantages  # noqa: E402


def expected_gradients(G: int, p: float, good: dict[bool, float], kind: str = "drgrpo") -> dict[str, float]:
    out = {"whole": 0.0, "release": 0.0, "former": 0.0}
    for short in itertools.product((True, False), repeat=G):
        p_len = np.prod([p if s else 1 - p for s in short])
        score = np.array([1 - p if s else -p for s in short])      # d log P(length) / d theta
        S = [i for i in range(G) if short[i]]
        L = [i for i in range(G) if not short[i]]
        for wins in itertools.product((1.0, 0.0), repeat=G):
            pr = p_len * np.prod([good[s] if w else 1 - good[s] for s, w in zip(short, wins)])
            r = np.array(wins)
            whole = group_advantages(r, np.zeros(G, int), kind).astype(np.float64)
            out["whole"] += pr * whole @ score
            snap = {i: float(r[i]) for i in S}
            former = whole
            if not L:              # finished whole before the snapshot
                rel = whole
            elif len(S) >= 2:      # the shorts as a part, the longs as the rest
                rel = np.empty(G)
                rel[S + L] = group_advantages(r[S + L], np.array([0] * len(S) + [1] * len(L)), kind,
                                              refs={0: (snap, S, {}), 1: (snap, L, snap)}, group_size=G)
                former = np.empty(G)
                former[S] = group_advantages(r[S], np.zeros(len(S), int), kind)
                former[L] = (r[L] - r.mean()) / (_std(r) if kind == "grpo" else 1.0)
            else:                  # at most one short: trained whole, against the snapshot
                rel = group_advantages(r, np.zeros(G, int), kind, refs={0: (snap, list(range(G)), {})},
                                       group_size=G)
            out["release"] += pr * rel @ score
            out["former"] += pr * former @ score
    true = (G - 1) / G * G * (good[True] - good[False]) * p * (1 - p)
    if kind == "drgrpo":
        return {k: v / true for k, v in out.items()}
    return {**{k: v / out["whole"] for k, v in out.items()}, "whole_vs_true": out["whole"] / true}


def _std(r: np.ndarray) -> float:
    s = float(r.std())
    return s + 1e-6 if s > 1e-6 else float("inf")   # a unanimous group: zero advantages, as GRPO gives


GRID = dict(G=(3, 4, 6), p=(0.3, 0.6, 0.8), good=((0.8, 0.2), (0.2, 0.8), (0.6, 0.4), (0.9, 0.5)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--p", type=float, default=0.6)
    ap.add_argument("--good-short", type=float, default=0.8)
    ap.add_argument("--good-long", type=float, default=0.2)
    ap.add_argument("--no-sweep", action="store_true", help="the stated point only")
    a = ap.parse_args(argv)
    if not (0 < a.p < 1) or a.good_short == a.good_long or a.group_size < 2 or a.group_size > 8:
        raise SystemExit("need 0 < --p < 1, --good-short != --good-long and 2 <= --group-size <= 8")
    print(f"group of {a.group_size}: short with p={a.p}, success {a.good_short} if short, {a.good_long} if long")
    line = []
    for kind, ref in (("drgrpo", "the unbiased gradient"), ("grpo", "the whole group's GRPO gradient")):
        res = expected_gradients(a.group_size, a.p, {True: a.good_short, False: a.good_long}, kind)
        for k, v in res.items():
            print(f"  {kind:6s} {k:12s} expected gradient / {'the true one' if k == 'whole_vs_true' else ref} = {v:.4f}")
        line += [f"{kind}_{k}_ratio={v:.4f}" for k, v in res.items()]
    if not a.no_sweep:
        pts = [(G, p, g) for G in GRID["G"] for p in GRID["p"] for g in GRID["good"]]
        print(f"grid: group size {GRID['G']}, p {GRID['p']}, (good short, good long) {GRID['good']}: {len(pts)} points")
        for kind in ("drgrpo", "grpo"):
            rs = [expected_gradients(G, p, {True: g[0], False: g[1]}, kind) for G, p, g in pts]
            for k in rs[0]:
                lo, hi = min(r[k] for r in rs), max(r[k] for r in rs)
                print(f"  {kind:6s} {k:12s} {lo:.4f} .. {hi:.4f}")
                line += [f"{kind}_{k}_min={lo:.4f}", f"{kind}_{k}_max={hi:.4f}"]
    print(" ".join(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
