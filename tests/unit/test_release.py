"""stale_policy=release (rl/orchestrator/groups.py): a group's finished rollouts are trained before
their straggling sibling, with the siblings finished by then as baseline; the rest when it finishes,
with every sibling as baseline; per rollout exactly once across restarts.

The pool, the orchestrator's batch assembly and the batch files are real (tests/unit/test_rollout_pool.py
explains the stand-in generation and trainer)."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from rl import exchange
from rl.contract.batch import RolloutBatch
from rl.orchestrator.advantages import group_advantages
from rl.orchestrator.grouplog import GroupLog, partial_rollouts, resume_order
from test_rollout_pool import _check_exactly_once, _orchestrator, _run

G = 4
STRAGGLER = ("env.digits.latency_outlier_prob=0.0", "env.digits.latency_median_s=0.03",
             f"orchestrator.group_size={G}")


def _batches(run_dir):
    return {n: RolloutBatch.load(exchange.step_dir(run_dir, "rollouts", n))
            for n in exchange.list_steps(run_dir, "rollouts")}


def _expected(r, ref, kind="grpo"):
    ref = np.asarray(ref, np.float64)
    c = np.asarray(r, np.float64) - ref.mean()
    return c / (ref.std() + 1e-6) if ref.std() > 1e-6 else np.zeros_like(c)


def test_a_part_is_trained_against_the_siblings_finished_and_the_rest_against_all():
    rewards = np.array([1.0, 0.0, 1.0, 0.5, 0.0, 2.0], np.float64)
    groups = np.array([0, 0, 0, 1, 1, 2])
    adv = group_advantages(rewards, groups, "grpo", baselines={1: [1.0, 0.0], 2: [0.0, 2.0, 1.0]})
    np.testing.assert_allclose(adv[:3], _expected(rewards[:3], rewards[:3]), rtol=1e-6)   # a whole group: unchanged
    np.testing.assert_allclose(adv[3:5], _expected(rewards[3:5], [0.5, 0.0, 1.0, 0.0]), rtol=1e-6)
    np.testing.assert_allclose(adv[5:], _expected([2.0], [2.0, 0.0, 2.0, 1.0]), rtol=1e-6)
    # Dr. GRPO: the leave-one-out baseline scaled by (|R| - 1) / |R|
    dr = group_advantages(rewards, groups, "drgrpo", baselines={1: [1.0, 0.0]})
    ref = [0.5, 0.0, 1.0, 0.0]
    loo = [0.5 - np.mean([0.0, 1.0, 0.0]), 0.0 - np.mean([0.5, 1.0, 0.0])]
    np.testing.assert_allclose(dr[3:5], np.array(loo) * (len(ref) - 1) / len(ref), rtol=1e-6)
    with pytest.raises(ValueError, match="baseline reward"):
        group_advantages(rewards, groups, "grpo", baselines={1: [float("nan")]})


def test_finished_rollouts_go_before_their_straggler_and_fewer_tokens_are_masked(tmp_path):
    """Rollout i of a group takes (1 + 6 i) times its prompt's latency: the last one spans versions.
    Under mask the group waits for it and its early rollouts' tokens age past the bound; under
    release they are trained first. Advantages are checked against the batch files."""
    masked = {}
    for policy in ("mask", "release"):
        run_dir = tmp_path / policy
        orch = _orchestrator(run_dir, *STRAGGLER, f"orchestrator.stale_policy={policy}", spread=6.0)
        asyncio.run(_run(orch, run_dir, max_steps=8))
        metas, _, _ = _check_exactly_once(run_dir, 8, G)
        masked[policy] = sum(m["masked_tokens"] for m in metas.values())
    assert masked["mask"] > 0 and masked["release"] < masked["mask"], masked
    metas = {n: json.loads((exchange.step_dir(tmp_path / "release", "rollouts", n) / "meta.json").read_text())
             for n in range(8)}
    assert sum(m["released_parts"] for m in metas.values()) > 0
    batches = _batches(tmp_path / "release")
    rewards_of: dict[int, dict[int, float]] = {}
    for n, m in metas.items():
        b = batches[n]
        for j, (g, idx) in enumerate(m["entries"]):
            rewards_of.setdefault(g, {}).update(zip(idx, b.rewards[b.groups == j].tolist()))
    checked = 0
    for n, m in metas.items():
        b = batches[n]
        for j, (g, idx) in enumerate(m["entries"]):
            r = b.rewards[b.groups == j]
            earlier = [rewards_of[g][i] for n2 in range(n) for g2, idx2 in metas[n2]["entries"] if g2 == g
                       for i in idx2]
            np.testing.assert_allclose(b.advantages[b.groups == j], _expected(r, list(r) + earlier), atol=1e-5)
            checked += bool(earlier)
    assert checked, "no rest of a group was trained after its part"


def test_a_resumed_group_plays_only_the_rollouts_no_surviving_batch_trained(tmp_path):
    """Group 0's rollouts 0 and 1 are in a surviving batch's part, group 1's rollout 3 was dropped and
    its part's batch discarded: the resumed pool plays group 0's rollouts 2, 3 (their advantages count
    the part's rewards) and group 1's 0, 1, 2, and every rollout ends trained or dropped once."""
    log = GroupLog(tmp_path, restart=0)
    log.started(0, 0)
    log.started(1, 0)
    log.dropped(1, "drain", 1, rollouts=[3])
    meta = {"group_ids": [], "entries": [[0, [0, 1]]], "partial_groups": {"0": {"rollouts": [0, 1], "rewards": [2.0, 0.0]}}}
    exchange.publish(tmp_path, "rollouts", 0, lambda p: (p / "meta.json").write_text(json.dumps(meta)), producer="test")
    assert partial_rollouts(tmp_path, G) == {0: ({0: 2.0, 1: 0.0}, set()), 1: ({}, {3})}
    assert resume_order(tmp_path, G) == ([0, 1], 2)
    assert resume_order(tmp_path) == ([0], 2)   # per group, without the group size: the drop resolves 1

    orch = _orchestrator(tmp_path, *STRAGGLER, "orchestrator.stale_policy=release")
    orch.sampler.tracker.version = 1
    pool = asyncio.run(_run(orch, tmp_path, max_steps=3, first=1, restart=1))
    assert (0, [2, 3]) in orch.played and (1, [0, 1, 2]) in orch.played
    assert pool.totals["retried"] == 2
    entries = {n: m for n in (1, 2) for m in [json.loads(
        (exchange.step_dir(tmp_path, "rollouts", n) / "meta.json").read_text())]}
    n, j = next((n, j) for n, m in entries.items() for j, (g, idx) in enumerate(m["entries"]) if g == 0)
    b = RolloutBatch.load(exchange.step_dir(tmp_path, "rollouts", n))
    r = b.rewards[b.groups == j]
    np.testing.assert_allclose(b.advantages[b.groups == j], _expected(r, list(r) + [2.0, 0.0]), atol=1e-5)
    assert 0 in entries[n]["group_ids"]


def _inflight(gid, start_version, finished, size=4):
    """An in-flight group of `size` rollouts of which `finished` are done (generated at start_version)."""
    from rl.contract.batch import Sample
    from rl.orchestrator.accounting import RolloutAcct
    from rl.orchestrator.groups import Group
    g = Group(gid=gid, task={}, start_version=start_version, started=0.0, oldest=start_version,
              rollouts={i: RolloutAcct(tokens=2, seconds=(1.0 if i < finished else None)) for i in range(size)})
    g.done = {i: Sample([1], [2, 3], [-0.5, -0.5], [start_version] * 2, float(i), gid) for i in range(finished)}
    return g


def test_while_the_trainer_waits_any_groups_finished_rollouts_fill_the_batch():
    """release_on_wait: batch 5 (k = 2) is due only for groups started at version 3; with `early` the
    finished rollouts of younger groups fill it too, after the due ones, the largest parts first, and a
    lone finished rollout with no trained sibling never goes."""
    from rl.orchestrator.groups import choose
    due, older, larger, lone = _inflight(1, 3, 3), _inflight(2, 4, 2), _inflight(3, 5, 3), _inflight(4, 4, 1)
    groups = [older, lone, larger, due]
    assert choose([], groups, 5, 2, per_batch=2, group_size=4) is None   # the trainer busy: n waits
    taken = choose([], groups, 5, 2, per_batch=2, group_size=4, early=True)
    assert [(g.gid, idx) for g, idx in taken] == [(1, [0, 1, 2]), (3, [0, 1, 2]), (2, [0, 1])]
    assert choose([], [lone, older], 5, 2, per_batch=1, group_size=4, early=True) is None
