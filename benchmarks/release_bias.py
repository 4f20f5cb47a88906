"""How biased is a group's policy gradient when it is trained in parts (stale_policy=release)?

An exact computation, no sampling: a group of G rollouts of one prompt; each rollout is short with
probability p (the policy's one parameter, p = sigmoid(theta)) and then succeeds (reward 1) with
probability `--good-short`, a long one with `--good-long`. The short ones finish first. When two or
more are short and at least one is long, the shorts are trained first as a part and the longs are the
rest (what `release` does when the batch's time falls between the two); otherwise the group is trained
whole. Over every outcome (2^G lengths times 2^G rewards) it sums

    E[ sum_i A_i * d log P(tau_i) / d theta ]

and divides it by (G - 1) / G times the true gradient d E[sum_i r_i] / d theta: a whole group's
`r_i - mean(R)` is (G - 1) / G times its leave-one-out advantage, so an unbiased scheme scores 1.0.
Dr. GRPO advantages (no std: GRPO's division by the std is a biased heuristic of its own).

Schemes:
- `whole`:    every group trained whole (the barrier; the reference);
- `release`:  rl.orchestrator.advantages as `release` calls it: a snapshot of the rollouts finished
              when the part is formed (the shorts) is every rollout's baseline set, its siblings in it
              (the whole group for one alone there); the same function of the siblings whatever the
              rollout did;
- `former`:   what `release` did until 2026-12-05: a part against itself, the rest against every
              sibling, so a rollout's baseline depended on whether it was itself short.

    python benchmarks/release_bias.py [--group-size 4] [--p 0.6] [--good-short 0.8] [--good-long 0.2]

The last line is machine-readable: `key=value ...` with each scheme's ratio to the unbiased gradient.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rl.orchestrator.advantages import group_advantages  # noqa: E402


def expected_gradients(G: int, p: float, good: dict[bool, float]) -> dict[str, float]:
    out = {"whole": 0.0, "release": 0.0, "former": 0.0}
    for short in itertools.product((True, False), repeat=G):
        p_len = np.prod([p if s else 1 - p for s in short])
        score = np.array([1 - p if s else -p for s in short])      # d log P(length) / d theta
        S = [i for i in range(G) if short[i]]
        L = [i for i in range(G) if not short[i]]
        for wins in itertools.product((1.0, 0.0), repeat=G):
            pr = p_len * np.prod([good[s] if w else 1 - good[s] for s, w in zip(short, wins)])
            r = np.array(wins)
            whole = group_advantages(r, np.zeros(G, int), "drgrpo").astype(np.float64)
            out["whole"] += pr * whole @ score
            snap = {i: float(r[i]) for i in S}
            former = whole
            if not L:              # finished whole before the snapshot
                rel = whole
            elif len(S) >= 2:      # the shorts as a part, the longs as the rest
                rel = np.empty(G)
                rel[S + L] = group_advantages(r[S + L], np.array([0] * len(S) + [1] * len(L)), "drgrpo",
                                              refs={0: (snap, S, {}), 1: (snap, L, snap)}, group_size=G)
                former = np.empty(G)
                former[S], former[L] = r[S] - r[S].mean(), r[L] - r.mean()
            else:                  # at most one short: trained whole, against the snapshot
                rel = group_advantages(r, np.zeros(G, int), "drgrpo", refs={0: (snap, list(range(G)), {})},
                                       group_size=G)
            out["release"] += pr * rel @ score
            out["former"] += pr * former @ score
    true = G * (good[True] - good[False]) * p * (1 - p)
    return {k: v / ((G - 1) / G * true) for k, v in out.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--p", type=float, default=0.6)
    ap.add_argument("--good-short", type=float, default=0.8)
    ap.add_argument("--good-long", type=float, default=0.2)
    a = ap.parse_args(argv)
    if not (0 < a.p < 1) or a.good_short == a.good_long or a.group_size < 2 or a.group_size > 8:
        raise SystemExit("need 0 < --p < 1, --good-short != --good-long and 2 <= --group-size <= 8")
    print(f"group of {a.group_size}: short with p={a.p}, success {a.good_short} if short, {a.good_long} if long")
    res = expected_gradients(a.group_size, a.p, {True: a.good_short, False: a.good_long})
    for k, v in res.items():
        print(f"  {k:9s} expected gradient / unbiased = {v:.4f}")
    print(" ".join(f"{k}_ratio={v:.4f}" for k, v in res.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
