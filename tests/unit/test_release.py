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


def _snap(r, idx, snapshot, group, kind="grpo", g=G):
    """Expected advantages of an entry (rollout indices `idx`, rewards `r`) of a group with a baseline
    snapshot ({index: reward}); `group`: {index: reward} of the whole group, for a rollout alone in it."""
    out = []
    for i, x in zip(idx, r):
        sib = [v for k, v in snapshot.items() if k != i] or [v for k, v in group.items() if k != i]
        a = (g - 1) / g * (x - np.mean(sib))
        std = np.std(sib + [x])
        out.append(a if kind != "grpo" else (a / (std + 1e-6) if std > 1e-6 else 0.0))
    return np.array(out)


def test_every_rollout_of_a_group_with_a_snapshot_is_taken_against_its_siblings_in_it():
    rewards = np.array([1.0, 0.0, 1.0, 0.5, 0.0, 1.0, 0.0, 1.0, 2.0, 0.0, 1.0, 3.0], np.float64)
    groups = np.array([0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 3, 3])
    refs = {1: ({0: 1.0, 1: 0.0}, [2, 3], {0: 1.0, 1: 0.0}),     # the rest of a group whose part was 0, 1
            2: ({0: 1.0, 1: 0.0, 2: 1.0}, [0, 1, 2], {}),       # a first part: the snapshot itself
            3: ({0: 2.0}, [0, 1, 2, 3], {})}                   # whole, one rollout in the snapshot
    adv = group_advantages(rewards, groups, "grpo", refs=refs, group_size=G)
    np.testing.assert_allclose(adv[:3], _expected(rewards[:3], rewards[:3]), rtol=1e-6)   # no snapshot: unchanged
    np.testing.assert_allclose(adv[3:5], _snap([0.5, 0.0], [2, 3], refs[1][0], {}), rtol=1e-6)
    np.testing.assert_allclose(adv[5:8], _snap([1.0, 0.0, 1.0], [0, 1, 2], refs[2][0], {}), rtol=1e-6)
    whole3 = dict(enumerate(rewards[8:]))
    np.testing.assert_allclose(adv[8:], _snap(rewards[8:], [0, 1, 2, 3], refs[3][0], whole3), rtol=1e-6)
    # Dr. GRPO by hand: (G - 1) / G times the leave-one-out over the siblings in the snapshot
    dr = group_advantages(rewards, groups, "drgrpo", refs=refs, group_size=G)
    np.testing.assert_allclose(dr[3:5], [0.75 * (0.5 - 0.5), 0.75 * (0.0 - 0.5)], atol=1e-7)
    np.testing.assert_allclose(dr[8:], [0.75 * (2.0 - 4.0 / 3), 0.75 * (0.0 - 2.0), 0.75 * (1.0 - 2.0),
                                        0.75 * (3.0 - 2.0)], atol=1e-6)
    # an empty snapshot is the usual formula; a whole group's r - mean(R) is (G - 1) / G its leave-one-out
    np.testing.assert_allclose(group_advantages(rewards[8:], np.zeros(4, int), "grpo", refs={0: ({}, [0, 1, 2, 3], {})},
                                                group_size=G), _expected(rewards[8:], rewards[8:]), rtol=1e-6)
    with pytest.raises(ValueError, match="group size"):
        group_advantages(rewards, groups, "grpo", refs=refs)
    with pytest.raises(ValueError, match="not finite"):
        group_advantages(rewards, groups, "grpo", refs={1: ({0: float("nan")}, [2, 3], {})}, group_size=G)


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
            snap = {int(i): v for i, v in (m["snapshots"].get(str(g)) or {}).items()}
            want = _snap(r, idx, snap, rewards_of[g]) if str(g) in m["snapshots"] else _expected(r, r)
            np.testing.assert_allclose(b.advantages[b.groups == j], want, atol=1e-5)
            checked += str(g) in m["snapshots"] and any(i not in snap for i in idx)
    assert checked, "no rollout was trained against a snapshot it is not in"


def test_a_resumed_group_plays_only_the_rollouts_no_surviving_batch_trained(tmp_path):
    """Group 0's rollouts 0 and 1 are in a surviving batch's part, group 1's rollout 3 was dropped and
    its part's batch discarded: the resumed pool plays group 0's rollouts 2, 3 (their advantages count
    the part's rewards) and group 1's 0, 1, 2, and every rollout ends trained or dropped once."""
    log = GroupLog(tmp_path, restart=0)
    log.started(0, 0)
    log.started(1, 0)
    log.dropped(1, "drain", 1, rollouts=[3])
    meta = {"group_ids": [], "entries": [[0, [0, 1]]], "partial_groups": {"0": {"rollouts": [0, 1], "rewards": [2.0, 0.0]}},
            "snapshots": {"0": {"0": 2.0, "1": 0.0}}}
    exchange.publish(tmp_path, "rollouts", 0, lambda p: (p / "meta.json").write_text(json.dumps(meta)), producer="test")
    assert partial_rollouts(tmp_path, G) == {0: ({0: 2.0, 1: 0.0}, set(), {0: 2.0, 1: 0.0}), 1: ({}, {3}, None)}
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
    np.testing.assert_allclose(b.advantages[b.groups == j], _snap(r, [2, 3], {0: 2.0, 1: 0.0}, {}), atol=1e-5)
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
    finished rollouts of younger groups fill it too, after the due ones."""
    from rl.orchestrator.groups import choose
    due, older, larger, lone = _inflight(1, 3, 3), _inflight(2, 4, 2), _inflight(3, 5, 3), _inflight(4, 4, 1)
    groups = [older, lone, larger, due]
    assert choose([], groups, 5, 2, per_batch=2, group_size=4) is None   # the trainer busy: n waits
    assert (due.snapshot, older.snapshot) == ({0: 0.0, 1: 1.0, 2: 2.0}, None)   # only a due group: snapshotted
    taken = choose([], groups, 5, 2, per_batch=2, group_size=4, early=True)
    # the oldest groups first (not the largest parts: which groups get a snapshot must not depend on
    # their own rollouts), the lone rollout has no sibling in its snapshot and waits
    assert [(g.gid, idx) for g, idx in taken] == [(1, [0, 1, 2]), (2, [0, 1]), (3, [0, 1, 2])]
    assert lone.snapshot == {0: 0.0} and lone.releasable(5, 2, early=True) == []
    assert choose([], [_inflight(5, 4, 1), _inflight(6, 4, 2)], 5, 2, per_batch=1, group_size=4, early=True) is None


def test_the_snapshot_baseline_leaves_the_policy_gradient_unbiased_when_reward_follows_length():
    """Exact expectation over every outcome of a group of 4 (benchmarks/release_bias.py prints it for
    other settings): a rollout is short with probability p (the policy's one parameter), short ones
    succeed with 0.8, long ones with 0.2; the shorts finish before the group's snapshot, the longs after.
    E[sum_i A_i d log P(tau_i)] must be (G - 1) / G times the true gradient, as for whole groups."""
    import itertools
    p, good = 0.6, {True: 0.8, False: 0.2}
    true = G * (good[True] - good[False]) * p * (1 - p)     # d/dtheta E[sum r], p = sigmoid(theta)
    got = 0.0
    for short in itertools.product((True, False), repeat=G):
        p_len = np.prod([p if s else 1 - p for s in short])
        score = np.array([1 - p if s else -p for s in short])   # d log P(length) / d theta
        S, L = [i for i in range(G) if short[i]], [i for i in range(G) if not short[i]]
        for wins in itertools.product((1.0, 0.0), repeat=G):
            pr = p_len * np.prod([good[s] if w else 1 - good[s] for s, w in zip(short, wins)])
            r = np.array(wins)
            snap = {i: r[i] for i in S}
            if not L:            # finished whole before the snapshot: the usual formula
                a = group_advantages(r, np.zeros(G, int), "drgrpo")
            elif len(S) >= 2:    # the shorts as a part, the longs as the rest
                a = np.empty(G)
                a[S + L] = group_advantages(r[S + L], np.array([0] * len(S) + [1] * len(L)), "drgrpo", group_size=G,
                                            refs={0: (snap, S, {}), 1: (snap, L, snap)})
            else:                # at most one short: no part, trained whole against the snapshot
                a = group_advantages(r, np.zeros(G, int), "drgrpo", refs={0: (snap, list(range(G)), {})}, group_size=G)
            got += pr * a @ score
    np.testing.assert_allclose(got, (G - 1) / G * true, rtol=1e-9)
