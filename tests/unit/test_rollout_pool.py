"""The continuous rollout pool (rl/orchestrator/pool.py) on real files, with the generation replaced.

The orchestrator is the real one (its env, the digits task with its seeded grading latency; its batch
assembly and publishing into a real run directory); only the inference server is not there: a group's
"generation" awaits the prompt's latency and labels its tokens with the policy version current at its
start, as a server would. A stand-in trainer bumps the version a short while after each published batch.
The end-to-end runs (real vLLM, real trainer, SIGKILL) are in tests/integration/test_local_run.py.
"""
from __future__ import annotations

import asyncio
import json
import random
import time

import pytest
from omegaconf import OmegaConf

from builders import compose_cfg
from rl import exchange
from rl.contract.batch import Sample
from rl.orchestrator.loop import Orchestrator
from rl.orchestrator.pool import GroupLog, ContinuousPool, resume_order, trained_group_ids
from rl.orchestrator.versions import VersionTracker
from rl.runtime import StopFlag, mark_done

P, K = 4, 1


def _orchestrator(run_dir, *overrides):
    cfg = OmegaConf.create(compose_cfg(run_dir, f"orchestrator.prompts_per_step={P}", "orchestrator.group_size=2",
                                       f"orchestrator.max_off_policy={K}", "env.digits.latency_median_s=0.02",
                                       "env.digits.latency_sigma=0.5", *overrides))
    orch = Orchestrator(run_dir, cfg, stop=StopFlag(install=False))
    orch.tracker = VersionTracker(0)

    async def sample(sem, task, group, step, attempt):
        v = orch.tracker.version
        await asyncio.sleep(task.get("latency_s", 0.0))
        return [Sample(prompt_ids=[1, 2], completion_ids=[3, 4], completion_logprobs=[-1.0, -1.0],
                       completion_versions=[v, v], reward=float(i), group=group, info={"finish_reason": "stop"})
                for i in range(2)]
    orch._sample_group_or_none = sample
    return orch


async def _trainer(orch, run_dir, max_steps, delay=0.05):
    """Version n+1 appears `delay` after batch n is published (training + reload)."""
    n = orch.tracker.version
    while n < max_steps:
        if exchange.latest_complete(run_dir, "rollouts") is not None and n in exchange.list_steps(run_dir, "rollouts"):
            await asyncio.sleep(delay)
            n += 1
            orch.tracker.version = n
        await asyncio.sleep(0.005)
    mark_done(run_dir, step=max_steps)


async def _run(orch, run_dir, max_steps, first=0, restart=0, kill_after=None):
    pool = ContinuousPool(orch, first, max_steps, restart)
    nxt = lambda: orch._next_missing(first, max_steps)  # noqa: E731
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


def _check_exactly_once(run_dir, max_steps):
    metas = _metas(run_dir)
    assert sorted(metas) == list(range(max_steps))
    trained = [g for m in metas.values() for g in m["group_ids"]]
    assert len(trained) == len(set(trained)) == max_steps * P  # no group in two batches
    events = GroupLog.read(run_dir)
    started = {e["group"] for e in events if e["event"] == "start"}
    dropped = {e["group"] for e in events if e["event"] == "drop"}
    assert started == set(trained) | dropped       # every started group trained or counted dropped
    assert not set(trained) & dropped               # never both
    assert started == set(range(len(started)))      # no prompt skipped
    for n, m in metas.items():                      # staleness bounded on what is trained
        assert m["version_min"] >= n - K, (n, m)
    return metas, started, dropped


def test_batches_form_from_what_finishes_and_a_straggler_is_cancelled_not_waited_for(tmp_path):
    orch = _orchestrator(tmp_path, "env.digits.latency_outlier_prob=0.15", "env.digits.latency_outlier_factor=2000")
    slow = [g for g in range(200) if orch.env.sample_tasks(1, random.Random(f"{orch.cfg.seed}-group-{g}"))[0]
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
    orch = _orchestrator(tmp_path)

    async def go():
        pool = ContinuousPool(orch, 0, 10, 0)
        job = asyncio.create_task(pool.run(lambda: orch._next_missing(0, 10)))
        await asyncio.sleep(1.0)
        started = len({e["group"] for e in GroupLog.read(tmp_path) if e["event"] == "start"})
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
        return started
    started = asyncio.run(go())
    assert exchange.list_steps(tmp_path, "rollouts") == list(range(K + 1))
    assert started <= (K + 1) * P + (pool_spare := (K + 1) * P - P), (started, pool_spare)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_killed_at_random_moments_every_started_group_is_trained_once_or_counted_dropped(tmp_path, seed):
    """Crash the orchestrator at random moments (its memory lost; a torn last log line), discard the
    batches after a random checkpoint as rl.prepare does, resume; repeat; then run to the end."""
    rng = random.Random(seed)
    max_steps, restart = 8, 0
    for _ in range(3):
        first = (exchange.list_steps(tmp_path, "rollouts") or [0])[-1]  # the checkpoint resumed from
        orch = _orchestrator(tmp_path, "env.digits.latency_outlier_prob=0.1", "env.digits.latency_outlier_factor=20")
        orch.tracker.version = first
        asyncio.run(_run(orch, tmp_path, max_steps, first=first, restart=restart, kill_after=rng.uniform(0.05, 0.6)))
        with open(tmp_path / "rollouts" / "groups.jsonl", "a") as f:
            f.write('{"event": "start", "gro')  # the write a SIGKILL interrupted
        have = exchange.list_steps(tmp_path, "rollouts")
        if have:
            exchange.discard_after(tmp_path, "rollouts", rng.choice(have))
        restart += 1
    in_flight_at_crash, _ = resume_order(tmp_path)
    first = (exchange.list_steps(tmp_path, "rollouts") or [0])[-1]
    orch = _orchestrator(tmp_path, "env.digits.latency_outlier_prob=0.1", "env.digits.latency_outlier_factor=20")
    orch.tracker.version = first
    pool = asyncio.run(_run(orch, tmp_path, max_steps, first=first, restart=restart))
    metas, started, dropped = _check_exactly_once(tmp_path, max_steps)
    # the groups the crashes interrupted were played again (first), not skipped
    trained = trained_group_ids(tmp_path)
    assert all(g in trained or g in dropped for g in in_flight_at_crash)
    assert pool.totals["retried"] == len(in_flight_at_crash)


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
    orch.clients, orch.reload_backoff_s = [_FlakyServer(failures)], 0.01
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
        assert asyncio.run(go()) and orch.tracker.version == 1 and orch.clients[0].calls == failures + 1


def test_a_stop_leaves_the_groups_it_interrupts_to_be_played_again(tmp_path):
    """A stop (preemption, Ctrl-C) cancels what is in flight without judging it: no drop lines, so the
    next incarnation plays those groups first, the prompts an uninterrupted run would have played."""
    orch = _orchestrator(tmp_path, "env.digits.latency_median_s=5")

    async def go():
        pool = ContinuousPool(orch, 0, 10, 0)
        job = asyncio.create_task(pool.run(lambda: orch._next_missing(0, 10)))
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
