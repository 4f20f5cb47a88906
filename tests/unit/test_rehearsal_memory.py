"""benchmarks/_rehearsal_memory.py: the orchestrator's memory as a sum of parts, each scaled by its own driver.

Runs are made from known rates (what a process with those rates would show between builds), so the fit must
give the rates back, and the seed's figure must scale each part by its driver only: tokens in flight,
episodes in flight, the largest answer per server, and the finished samples waiting max_off_policy batches.
"""
from __future__ import annotations

import pytest

import _rehearsal_memory as mem

FIXED, E, B, C, REST = 0.25 * 2**30, 200e3, 21.0, 6.0, 30e6


def _run(inflight, mean, turns, answer):
    r = mem.Run(inflight, mean, turns, answer, 0.0)
    anon = FIXED + REST + E * inflight + B * r.tokens_inflight + C * answer
    return mem.Run(inflight, mean, turns, answer, anon)


# the probes of seed_rehearsal.main, with measured means and answers a little off their targets (as measured)
MAIN = _run(128, 16370, 19.8, 1.9e6)
PROBES = (_run(32, 16100, 19.9, 1.85e6), _run(128, 4120, 4.9, 1.95e6), _run(128, 16500, 5.0, 7.4e6))
SEED = mem.SeedVolume(inflight=2048, mean_tokens=65536, turns=50, rollouts=256, off_policy=8, servers=3)


def test_the_three_probes_give_each_rate_back():
    f = mem.fit(MAIN, *PROBES, fixed=FIXED)
    assert f.per_episode == pytest.approx(E, rel=1e-6) and f.per_token == pytest.approx(B, rel=1e-6)
    assert f.per_answer == pytest.approx(C, rel=1e-6) and f.rest == pytest.approx(REST, rel=1e-6)


def test_each_part_scales_by_its_own_driver_at_the_seed():
    f = mem.fit(MAIN, *PROBES, fixed=FIXED)
    parts = mem.at_seed(f, MAIN, SEED, servers_here=1, build=50e6, share_ratio=4.0)
    assert parts["tokens"] == pytest.approx(B * 2048 * 65536 / 2)
    assert parts["episodes"] == pytest.approx(E * 2048)
    largest = MAIN.largest_answer * (65536 / 50) / (16370 / 19.8)   # answers grow with tokens per turn
    assert parts["largest_answer"] == pytest.approx(largest)
    assert parts["answers"] == pytest.approx(C * largest * 3)        # bounded per server, not per episode
    assert parts["waiting"] == 8 * 256 * 65536 * 13
    assert parts["build"] == pytest.approx(200e6)
    assert parts["anon"] == pytest.approx(sum(v for k, v in parts.items() if k not in ("anon", "largest_answer")))
    # a rate the noise made negative is not subtracted at the seed
    neg = mem.Fit(FIXED, -1e5, B, -2.0, -1e6)
    p = mem.at_seed(neg, MAIN, SEED, 1, 0.0, 1.0)
    assert p["episodes"] == p["answers"] == p["rest"] == 0.0 and p["tokens"] == parts["tokens"]
    assert "noise" in mem.describe(neg, p, SEED, {"main": MAIN})[1]


def test_probes_that_do_not_separate_the_drivers_are_refused():
    same_turns = _run(128, 16500, 19.8, MAIN.largest_answer)     # the turn probe changed nothing
    with pytest.raises(ValueError, match="the turn probe does not separate the drivers"):
        mem.fit(MAIN, PROBES[0], PROBES[1], same_turns, fixed=FIXED)
