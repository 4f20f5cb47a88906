"""The continuous rollout pool (rl/orchestrator/pool.py) on real files, with the generation replaced.

The orchestrator is the real one (its env, the digits task with its seeded grading latency; its batch
assembly and publishing into a real run directory); only the inference server is not there: a group's
"generation" awaits the prompt's latency and labels its tokens with the policy version current at its
start for its first token and the version current at its end for its second (a generation that spans a
reload), as a server would. A stand-in trainer bumps the version a short while after each published batch.
Every orchestrator.stale_policy (drop, mask, admit) is run through the exactly-once and per-token bound
checks.
The end-to-end runs (real vLLM, real trainer, SIGKILL) are in tests/integration/test_local_run.py.
"""
from __future__ import annotations

import asyncio
import json
import random
import time

import numpy as np
import pytest
from omegaconf import OmegaConf

from builders import compose_cfg
from rl import exchange
from rl.contract.batch import RolloutBatch, Sample
from rl.orchestrator.loop import Orchestrator
from rl.orchestrator import accounting
from rl.orchestrator import pool as poolmod
from rl.orchestrator.grouplog import GroupLog, resume_order, trained_group_ids
from rl.orchestrator.versions import VersionTracker
from rl.runtime import StopFlag, mark_done

P, K = 4, 1
POLICIES = ("drop", "mask", "admit", "release")


def _orchestrator(run_dir, *overrides, spread=0.0):
    """Rollout i of a group takes the prompt's latency times (1 + spread * i): with spread > 0 the
    rollouts of a group finish apart (stale_policy=release trains the early ones first)."""
    cfg = OmegaConf.create(compose_cfg(run_dir, f"orchestrator.prompts_per_step={P}", "orchestrator.group_size=2",
                                       f"orchestrator.max_off_policy={K}", "env.digits.latency_median_s=0.02",
                                       "env.digits.latency_sigma=0.5", *overrides))
    orch = Orchestrator(run_dir, cfg, stop=StopFlag(install=False))
    orch.sampler.tracker = VersionTracker(0)
    orch.played = []   # (group, rollouts asked for) per group played

    async def sample(task, group, step, attempt, rollouts=None):
        orch.played.append((group, rollouts))

        async def one(i):
            accounting.rollout_begin(i)
            v = orch.sampler.tracker.version
            await asyncio.sleep(task.get("latency_s", 0.0) * (1 + spread * i))
            s = Sample(prompt_ids=[1, 2], completion_ids=[3, 4], completion_logprobs=[-1.0, -1.0],
                       completion_versions=[v, orch.sampler.tracker.version], reward=float(i % 3), group=group,
                       info={"finish_reason": "stop"})
            accounting.count_generated(2)
            accounting.rollout_end(i, s)
            return s
        return list(await asyncio.gather(*(one(i) for i in (rollouts or range(cfg.orchestrator.group_size)))))
    orch.sampler.sample_group_or_none = sample
    return orch


async def _trainer(orch, run_dir, max_steps, delay=0.05):
    """Version n+1 appears `delay` after batch n is published (training + reload)."""
    n = orch.sampler.tracker.version
    while n < max_steps:
        if exchange.latest_complete(run_dir, "rollouts") is not None and n in exchange.list_steps(run_dir, "rollouts"):
            await asyncio.sleep(delay)
            n += 1
            orch.sampler.tracker.version = n
        await asyncio.sleep(0.005)
    mark_done(run_dir, step=max_steps)


async def _run(orch, run_dir, max_steps, first=0, restart=0, kill_after=None):
    pool = orch.continuous_pool(first, max_steps, restart)
    nxt = lambda: orch.next_missing(first, max_steps)  # noqa: E731
    trainer = asyncio.create_task(_trainer(orch, run_dir, max_steps))
    job = asyncio.create_task(pool.run(nxt))
    done, _ = await asyncio.wait([job], timeout=kill_after or 60)
    if not done and kill_after is None:
        pytest.fail("the pool did not finish in 60 s")
    if not done:  # a crash at a random moment: nothing of this incarnation's memory survives
        for t in (job, trainer):
            t.cancel()
        await asyncio.gather(job, trainer, return_exceptions=True)
        return pool
    job.result()
    trainer.cancel()
    return pool


def _metas(run_dir):
    return {s: json.loads((exchange.step_dir(run_dir, "rollouts", s) / "meta.json").read_text())
            for s in exchange.list_steps(run_dir, "rollouts")}


def _check_exactly_once(run_dir, max_steps, group_size=2):
    """Every started group is trained (all its rollouts, once each, over one or more batches) or
    recorded dropped (its rollouts not trained before the drop), and the bound holds per token."""
    metas = _metas(run_dir)
    assert sorted(metas) == list(range(max_steps))
    trained = [g for m in metas.values() for g in m["group_ids"]]
    assert len(trained) == len(set(trained))        # no group completed in two batches
    rollouts = [(g, i) for m in metas.values() for g, idx in m["entries"] for i in idx]
    assert len(rollouts) == len(set(rollouts))      # no rollout in two batches
    for m in metas.values():                         # a batch holds prompts_per_step groups' worth
        assert sum(len(idx) for _, idx in m["entries"]) >= P * group_size or len(m["entries"]) == P
    events = GroupLog.read(run_dir)
    started = {e["group"] for e in events if e["event"] == "start"}
    dropped_r = {(e["group"], i) for e in events if e["event"] == "drop"   # without `rollouts`: the group
                 for i in e.get("rollouts") or range(group_size)}
    dropped = {g for g, _ in dropped_r}
    every = {(g, i) for g in started for i in range(group_size)}
    assert every == set(rollouts) | dropped_r    # every started rollout trained or counted dropped
    assert not set(rollouts) & dropped_r         # never both
    assert started == set(range(len(started)))   # no prompt skipped
    for g in trained:                             # a completed group has no rollout left in flight
        assert {i for h, i in every - dropped_r if h == g} == {i for h, i in rollouts if h == g}
    for n, m in metas.items():                      # staleness bounded on what is trained, per token
        assert m["version_min"] is None or m["version_min"] >= n - K, (n, m)
        b = RolloutBatch.load(exchange.step_dir(run_dir, "rollouts", n))
        trained_versions = b.versions[b.loss_mask > 0]
        assert (trained_versions >= n - K).all(), (n, trained_versions)
        assert m["lag_max"] <= K
    return metas, started, dropped


def test_batches_form_from_what_finishes_and_a_straggler_is_cancelled_not_waited_for(tmp_path):
    orch = _orchestrator(tmp_path, "env.digits.latency_outlier_prob=0.15", "env.digits.latency_outlier_factor=2000",
                         "orchestrator.stale_policy=drop")
    slow = [g for g in range(200) if orch.sampler.env.sample_tasks(1, random.Random(f"{orch.cfg.seed}-group-{g}"))[0]
            ["latency_s"] > 5]
    assert slow and slow[0] < 4 * P  # a straggler (tens of seconds) among the groups played
    t0 = time.monotonic()
    asyncio.run(_run(orch, tmp_path, max_steps=6))
    assert time.monotonic() - t0 < 10  # not one straggler waited for
    metas, started, dropped = _check_exactly_once(tmp_path, 6)
    assert set(slow) & started <= dropped  # the stragglers went stale in flight: cancelled and counted
    reasons = {e["reason"] for e in GroupLog.read(tmp_path) if e["event"] == "drop"}
    assert "stale" in reasons
    assert sum(m["cancelled_groups"] for m in metas.values()) >= 1
    for m in metas.values():
        assert 0 <= m["pool_occupancy"] <= 1 and m["inflight_lag_max"] >= 0 and m["queue_lag_max"] >= 0


def test_no_group_starts_that_could_only_go_stale(tmp_path):
    """With the trainer stalled at version 0, at most batches 0..k can be formed; the pool stops
    starting groups once those have room no more, and nothing is published beyond them."""
    orch = _orchestrator(tmp_path, "orchestrator.stale_policy=drop")

    async def go():
        pool = orch.continuous_pool(0, 10, 0)
        job = asyncio.create_task(pool.run(lambda: orch.next_missing(0, 10)))
        await asyncio.sleep(1.0)
        started = len({e["group"] for e in GroupLog.read(tmp_path) if e["event"] == "start"})
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
        return started
    started = asyncio.run(go())
    assert exchange.list_steps(tmp_path, "rollouts") == list(range(K + 1))
    assert started <= (K + 1) * P + (pool_spare := (K + 1) * P - P), (started, pool_spare)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_killed_at_random_moments_every_started_group_is_trained_once_or_counted_dropped(tmp_path, seed, policy):
    """Crash the orchestrator at random moments (its memory lost; a torn last log line), discard the
    batches after a random checkpoint as rl.prepare does, resume; repeat; then run to the end. Under
    every stale policy."""
    rng = random.Random(seed)
    pol = f"orchestrator.stale_policy={policy}"
    max_steps, restart = 8, 0
    # release: groups of 4 whose rollouts finish apart, so parts are trained before their stragglers
    G, spread = (4, 1.5) if policy == "release" else (2, 0.0)
    pol = (pol, f"orchestrator.group_size={G}")
    for _ in range(3):
        first = (exchange.list_steps(tmp_path, "rollouts") or [0])[-1]  # the checkpoint resumed from
        orch = _orchestrator(tmp_path, "env.digits.latency_outlier_prob=0.1", "env.digits.latency_outlier_factor=20",
                             *pol, spread=spread)
        orch.sampler.tracker.version = first
        asyncio.run(_run(orch, tmp_path, max_steps, first=first, restart=restart, kill_after=rng.uniform(0.05, 0.6)))
        with open(tmp_path / "rollouts" / "groups.jsonl", "a") as f:
            f.write('{"event": "start", "gro')  # the write a SIGKILL interrupted
        have = exchange.list_steps(tmp_path, "rollouts")
        if have:
            exchange.discard_after(tmp_path, "rollouts", rng.choice(have))
            # a run that had finished before the crash is not done once batches are discarded (a fast
            # incarnation can reach max_steps, and write DONE, within the kill window)
            from rl.contract import paths
            paths.done_file(tmp_path).unlink(missing_ok=True)
        restart += 1
    in_flight_at_crash, _ = resume_order(tmp_path, G)
    first = (exchange.list_steps(tmp_path, "rollouts") or [0])[-1]
    orch = _orchestrator(tmp_path, "env.digits.latency_outlier_prob=0.1", "env.digits.latency_outlier_factor=20",
                         *pol, spread=spread)
    orch.sampler.tracker.version = first
    pool = asyncio.run(_run(orch, tmp_path, max_steps, first=first, restart=restart))
    metas, started, dropped = _check_exactly_once(tmp_path, max_steps, G)
    # the groups the crashes interrupted were played again (first), not skipped
    trained = trained_group_ids(tmp_path)
    assert all(g in trained or g in dropped for g in in_flight_at_crash)
    assert pool.totals["retried"] == len(in_flight_at_crash)
    if policy != "drop":  # nothing goes stale whole: only the end-of-run drain drops groups
        assert {e["reason"] for e in GroupLog.read(tmp_path) if e["event"] == "drop"} <= {"drain"}
    if policy == "release":  # groups were trained in parts, across the kills too
        assert any(m["partial_groups"] for m in metas.values())


def test_resume_order_reads_the_log_and_the_surviving_batches(tmp_path):
    log = GroupLog(tmp_path, restart=0)
    for g in range(10):
        log.started(g, 0)
    log.dropped(3, "stale", 2)
    d = tmp_path / "rollouts"
    for step, ids in ((0, [0, 1]), (1, [2, 4, 5])):
        exchange.publish(tmp_path, "rollouts", step,
                         lambda p, ids=ids: (p / "meta.json").write_text(json.dumps({"group_ids": ids})),
                         producer="test")
    with open(d / "groups.jsonl", "a") as f:
        f.write('{"event": "drop", "group": 6')  # torn: group 6 was never dropped
    assert resume_order(tmp_path) == ([6, 7, 8, 9], 10)


class _FlakyServer:
    """Stands in for one server's reload endpoint: fails the first `failures` reloads."""

    def __init__(self, failures):
        self.failures, self.calls = failures, 0

    async def update_weights(self, path, version, **kw):
        from rl.orchestrator.client import InferenceError
        self.calls += 1
        if self.calls <= self.failures:
            raise InferenceError(f"http://server:0: worker dp0000-rank0000 refused {path}")
        return {"in_flight": {}}


@pytest.mark.parametrize("failures,fails", [(2, False), (4, True)])
def test_a_failed_reload_is_retried_then_fails_the_role_instead_of_hanging(tmp_path, failures, fails):
    from rl.orchestrator import loop
    orch = _orchestrator(tmp_path)
    orch.sampler.clients, orch.reload_backoff_s = [_FlakyServer(failures)], 0.01
    exchange.publish(tmp_path, "weights", 1, lambda d: (d / "x").write_text("w"), producer="test")

    async def go():
        orch.watcher = asyncio.create_task(orch._weight_watcher())
        try:
            return await asyncio.wait_for(orch._wait_version(1), 20)
        finally:
            orch.watcher.cancel()
    if fails:
        with pytest.raises(RuntimeError, match=rf"weights/step_000001: loading into the servers failed "
                                               rf"{loop.RELOAD_RETRIES + 1} times; last error: InferenceError"):
            asyncio.run(go())
    else:
        assert asyncio.run(go()) and orch.sampler.tracker.version == 1 and orch.sampler.clients[0].calls == failures + 1


def test_a_stop_leaves_the_groups_it_interrupts_to_be_played_again(tmp_path):
    """A stop (preemption, Ctrl-C) cancels what is in flight without judging it: no drop lines, so the
    next incarnation plays those groups first, the prompts an uninterrupted run would have played."""
    orch = _orchestrator(tmp_path, "env.digits.latency_median_s=5")

    async def go():
        pool = orch.continuous_pool(0, 10, 0)
        job = asyncio.create_task(pool.run(lambda: orch.next_missing(0, 10)))
        await asyncio.sleep(0.5)
        in_flight = set(pool.inflight)
        orch.stop.set("SIGTERM")
        await asyncio.wait_for(job, 30)
        return in_flight
    in_flight = asyncio.run(go())
    assert in_flight
    assert not [e for e in GroupLog.read(tmp_path) if e["event"] == "drop"]
    retry, _ = resume_order(tmp_path)
    assert in_flight <= set(retry)


# --- stale policies (issue 25) ----------------------------------------------------------------------
def test_mask_keeps_the_straggler_and_masks_only_its_tokens_beyond_the_bound(tmp_path):
    """stale_policy=mask: a group spanning versions is trained, not cancelled: its tokens older than
    n - k get loss mask 0 (and no version), the rest keep the group's reward; nothing is dropped stale."""
    orch = _orchestrator(tmp_path, "env.digits.latency_outlier_prob=0.15", "env.digits.latency_outlier_factor=30",
                         "orchestrator.stale_policy=mask")
    asyncio.run(_run(orch, tmp_path, max_steps=8))
    metas, started, dropped = _check_exactly_once(tmp_path, 8)
    assert {e["reason"] for e in GroupLog.read(tmp_path) if e["event"] == "drop"} <= {"drain"}
    masked = sum(m["masked_tokens"] for m in metas.values())
    assert masked > 0  # some straggler's first token was beyond the bound when its batch took it
    last = metas[7]
    assert last["wasted_tokens_masked_total"] == masked and last["wasted_tokens_cancelled_total"] == 0
    assert last["wasted_token_fraction"] == pytest.approx(masked / last["generated_tokens_total"])
    assert last["length_ratio"] > 0 and last["trained_episode_s_p90"] >= last["trained_episode_s_mean"] * 0.5


def test_drop_accounts_waste_and_the_bias_against_long_episodes(tmp_path):
    orch = _orchestrator(tmp_path, "env.digits.latency_outlier_prob=0.15", "env.digits.latency_outlier_factor=2000",
                         "orchestrator.stale_policy=drop")

    async def sample(task, group, step, attempt):  # tokens counted as generated, before the wait
        async def one(i):
            accounting.rollout_begin(i)
            v = orch.sampler.tracker.version
            accounting.count_generated(2)
            await asyncio.sleep(task.get("latency_s", 0.0))
            accounting.rollout_end(i)
            return Sample(prompt_ids=[1, 2], completion_ids=[3, 4], completion_logprobs=[-1.0, -1.0],
                          completion_versions=[v, v], reward=float(i), group=group, info={"finish_reason": "stop"})
        return list(await asyncio.gather(one(0), one(1)))
    orch.sampler.sample_group_or_none = sample
    asyncio.run(_run(orch, tmp_path, max_steps=8))
    metas, started, dropped = _check_exactly_once(tmp_path, 8)
    last = metas[7]
    lost = last["wasted_tokens_cancelled_total"] + last["wasted_tokens_stale_total"]
    assert last["wasted_tokens_cancelled_total"] > 0 and last["wasted_tokens_masked_total"] == 0
    assert last["wasted_token_fraction"] > 0
    assert last["generated_tokens_total"] == last["trained_tokens_total"] + lost + last["wasted_tokens_environment_total"]
    assert last["started_episode_s_mean"] > last["trained_episode_s_mean"]  # the long ones went stale
    drops = [e for e in GroupLog.read(tmp_path) if e["event"] == "drop" and e["reason"] == "stale"]
    assert drops and all("tokens" in e and e["where"] in ("ready", "inflight") for e in drops)


def test_max_inflight_counts_rollouts_that_finish_apart(tmp_path):
    """max_inflight is in rollouts: a group whose other rollouts finished holds one slot, so new groups
    start beside its straggler."""
    orch = _orchestrator(tmp_path, "orchestrator.max_inflight=4", "orchestrator.stale_policy=mask")
    slow_gid = 0

    async def sample(task, group, step, attempt):
        async def one(i):
            accounting.rollout_begin(i)
            await asyncio.sleep(2.0 if (group == slow_gid and i == 0) else 0.02)
            accounting.count_generated(2)
            accounting.rollout_end(i)
            v = orch.sampler.tracker.version
            return Sample(prompt_ids=[1, 2], completion_ids=[3, 4], completion_logprobs=[-1.0, -1.0],
                          completion_versions=[v, v], reward=float(i), group=group, info={"finish_reason": "stop"})
        return list(await asyncio.gather(one(0), one(1)))
    orch.sampler.sample_group_or_none = sample

    async def go():
        pool = orch.continuous_pool(0, 50, 0)
        job = asyncio.create_task(pool.run(lambda: orch.next_missing(0, 50)))
        await asyncio.sleep(0.5)
        rollouts = pool.open_rollouts()
        started = len({e["group"] for e in GroupLog.read(tmp_path) if e["event"] == "start"})
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
        return started, rollouts
    started, rollouts = asyncio.run(go())
    assert rollouts <= 4
    assert started >= 3  # groups 1, 2 ... started while group 0's straggler (one slot) ran


def test_admission_waits_for_a_group_that_would_not_fit_and_starts_a_hopeless_one(tmp_path):
    orch = _orchestrator(tmp_path, "orchestrator.stale_policy=admit", "orchestrator.max_off_policy=2")
    pool = orch.continuous_pool(0, 10, 0)
    task = {"digits": [1, 2, 3], "latency_s": 0.1}
    assert pool._admits(task)  # no history: admitted
    for _ in range(3):
        pool.durations.add(poolmod.task_key(task), 1.5)
    pool.step_s, pool._version_t = 1.0, time.monotonic()
    assert pool._admits(task)                      # 1.5 s fits in the 2 steps (2 s) just begun
    pool._version_t = time.monotonic() - 1.0
    assert not pool._admits(task)                  # 1 s left: wait for the next version
    for _ in range(30):
        pool.durations.add(poolmod.task_key(task), 5.0)
    assert pool._admits(task)                      # can never fit: started anyway (masked at the bound)
    other = {"digits": [4, 5, 6]}
    for _ in range(10):
        pool.durations.add(poolmod.task_key({"x": _}), 0.2)
    assert pool.durations.predict(poolmod.task_key(other)) is not None  # no history: the running median


def test_mask_stale_masks_policy_tokens_only():
    s = Sample([1], [5, 6, 7, 8], [-1.0] * 4, [3, -1, 4, 5], 1.0, 0, completion_mask=[1, 0, 1, 1])
    assert accounting.mask_stale([s], oldest=5) == 2
    assert s.completion_mask == [0, 0, 0, 1]
    t = Sample([1], [5, 6], [-1.0] * 2, [2, 5], 1.0, 0)
    assert accounting.mask_stale([t], oldest=5) == 1 and t.completion_mask == [0, 1]


def test_masked_stale_tokens_never_reach_the_trainers_loss(tmp_path, monkeypatch):
    """A batch the pool published under stale_policy=mask, read and trained by the real trainer (tiny
    model, CPU): every token with loss mask 1 in the loss input is within the bound."""
    from test_batch_guard import tiny_cfg

    from rl.trainer import train as train_mod
    orch = _orchestrator(tmp_path / "run", "env.digits.latency_outlier_prob=0.15",
                         "env.digits.latency_outlier_factor=30", "orchestrator.stale_policy=mask")
    asyncio.run(_run(orch, tmp_path / "run", max_steps=6))
    metas = _metas(tmp_path / "run")
    n = max(metas, key=lambda s: (metas[s]["masked_tokens"] > 0 and metas[s]["gen_tokens"] > 0, metas[s]["masked_tokens"]))
    assert metas[n]["masked_tokens"] > 0 and metas[n]["gen_tokens"] > 0  # some tokens masked, some trained
    b = RolloutBatch.load(exchange.step_dir(tmp_path / "run", "rollouts", n))
    seen = []
    real = train_mod.rows_for_rank

    def spy(mbs, dist, *share):
        rows = list(real(mbs, dist, *share))
        seen.extend(rows)
        return rows
    monkeypatch.setattr(train_mod, "rows_for_rank", spy)
    tr = train_mod.Trainer(tiny_cfg(tmp_path / "tr"))
    m = tr.train_step(b, n)
    assert seen and m["lag_max"] <= K
    for row in seen:
        lag, mask = (row.per_token[k] for k in ("lag", "mask"))
        lag, mask = np.asarray(lag), np.asarray(mask)
        assert (lag[mask > 0] <= K).all()
    assert sum(float(np.asarray(r.per_token["mask"]).sum()) for r in seen) == int(b.loss_mask.sum())


def test_stale_policy_and_max_inflight_in_rollouts_are_checked(tmp_path):
    from rl.contract.config import ConfigError
    assert compose_cfg(tmp_path, "orchestrator.stale_policy=admit")["orchestrator"]["stale_policy"] == "admit"
    with pytest.raises(ConfigError, match="must be one of drop, mask, admit, release"):
        compose_cfg(tmp_path, "orchestrator.stale_policy=keep")
    with pytest.raises(ConfigError, match="counts rollouts"):  # an old value in groups below group_size
        compose_cfg(tmp_path, "orchestrator.group_size=8", "orchestrator.max_inflight=4")


@pytest.mark.parametrize("policy", POLICIES)
def test_a_batch_the_trainer_sets_aside_has_its_groups_played_again_not_lost(tmp_path, policy):
    """The trainer sets aside rollouts/step_1 unconsumed (a corrupt or invalid batch) while the pool runs:
    the step is published again, and the groups of the set-aside copy are played again first, never
    replaced by fresh ones and forgotten (a fault trial found groups 8-15 in rollouts/corrupt/ and 16-23
    in the republished step, the first neither trained nor dropped)."""
    max_steps = 4
    orch = _orchestrator(tmp_path, f"orchestrator.stale_policy={policy}")
    set_aside = {}

    async def trainer():
        n = 0
        while n < max_steps:
            if n in exchange.list_steps(tmp_path, "rollouts"):
                if n == 1 and not set_aside:
                    meta = json.loads((exchange.step_dir(tmp_path, "rollouts", 1) / "meta.json").read_text())
                    set_aside["groups"] = meta["group_ids"]
                    exchange.set_aside(tmp_path, "rollouts", 1)
                    continue
                await asyncio.sleep(0.05)
                n += 1
                orch.sampler.tracker.version = n
            await asyncio.sleep(0.005)
        mark_done(tmp_path, step=max_steps)

    async def case():
        pool = orch.continuous_pool(0, max_steps, 0)
        t = asyncio.create_task(trainer())
        await asyncio.wait_for(pool.run(lambda: orch.next_missing(0, max_steps)), 60)
        t.cancel()
        return pool
    pool = asyncio.run(case())
    assert set_aside, "the stand-in trainer never set step 1 aside"
    metas, started, dropped = _check_exactly_once(tmp_path, max_steps)
    trained = trained_group_ids(tmp_path)
    assert all(g in trained or g in dropped for g in set_aside["groups"]), (set_aside, trained, dropped)
    assert pool.totals["retried"] >= len(set_aside["groups"])


def test_groups_queued_again_that_no_batch_takes_are_counted_dropped_at_the_end(tmp_path):
    """An incarnation resumes with more groups to play again than its remaining batches take (the CI
    fault campaign: a set-aside batch's groups, then a kill): the leftovers are recorded as dropped when
    everything is published, never left started and neither trained nor dropped."""
    log = GroupLog(tmp_path, 0)
    for gid in range(20):                 # started by a crashed incarnation, none trained
        log.started(gid, 0)
    orch = _orchestrator(tmp_path)
    pool = asyncio.run(_run(orch, tmp_path, max_steps=2, restart=1))
    assert pool.totals["retried"] == 20
    metas, started, dropped = _check_exactly_once(tmp_path, 2)
    assert started == set(range(20)) and len(dropped) == 12
    assert {e["where"] for e in GroupLog.read(tmp_path) if e["event"] == "drop"} == {"retry"}
