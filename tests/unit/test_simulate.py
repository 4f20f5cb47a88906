"""launch.simulate: the pipeline's rules on a clock (trainer-bound, straggler-bound, concurrency limits,
staleness policies, lag bound), the metrics.jsonl reader, and, at CI size, the simulator against
benchmarks/async_rollouts.py run here: fed that run's component times it reproduces the measured steps per
hour of sync, batch-pipelined and continuous (mask, drop) within 25%."""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest

from launch.simulate import SimConfig, Turn, from_metrics, lognormal_sigma, lognormal_source, simulate

REPO = Path(__file__).resolve().parents[2]


def const(seconds: float, tokens: int = 10, G: int = 4):
    return lambda key: [[Turn(tokens, seconds)] for _ in range(G)]


def sim(**kw):
    base = dict(steps=12, prompts_per_step=4, group_size=4, max_off_policy=2, max_concurrency=64,
                env_concurrency=64, train_s=1.0, token_s=0.001)
    base.update(kw)
    return SimConfig(**base)


def test_continuous_with_short_episodes_is_trainer_bound():
    r = simulate(sim(), const(0.05))
    assert r.steps_per_hour == pytest.approx(3600 / 1.0, rel=0.02)
    assert r.trainer_idle < 0.02 and r.wasted_fraction < 0.05


def test_sync_costs_train_plus_sync_plus_the_slowest_episode():
    # batch n waits for version n (watcher poll 0.1 s), the episode (10 tokens x 1 ms + 2 s), and the
    # trainer's 10 ms poll: 1 + 2.01 + up to 0.1 + 0.01 s per step
    r = simulate(sim(schedule="batch", max_off_policy=0, stale_policy="drop"), const(2.0))
    step = 3600 / r.steps_per_hour
    assert 3.01 <= step <= 3.13, step
    assert r.lags == {0: sum(r.lags.values())} and r.trainer_idle > 0.6


def test_pipelining_hides_the_episode_behind_training():
    sync = simulate(sim(schedule="batch", max_off_policy=0, stale_policy="drop"), const(0.8))
    piped = simulate(sim(schedule="batch", max_off_policy=2, stale_policy="drop"), const(0.8))
    assert piped.steps_per_hour > 1.5 * sync.steps_per_hour
    assert max(piped.lags) <= 2


def test_request_concurrency_limits_generation():
    # 16 rollouts of 2000 tokens x 1 ms: with 4 requests at once a batch takes 4 x 2 s
    fast = simulate(sim(schedule="batch", max_off_policy=0, train_s=0.1), const(0.0, tokens=2000))
    slow = simulate(sim(schedule="batch", max_off_policy=0, train_s=0.1, max_concurrency=4), const(0.0, tokens=2000))
    assert 3600 / slow.steps_per_hour == pytest.approx(4 * (3600 / fast.steps_per_hour), rel=0.15)
    env = simulate(sim(schedule="batch", max_off_policy=0, train_s=0.1, env_concurrency=2), const(1.0, tokens=1))
    assert 3600 / env.steps_per_hour > 8.0   # 16 environment calls of 1 s, 2 at once


def test_drop_wastes_stragglers_and_mask_keeps_them_within_the_bound():
    src = lognormal_source(4, turns_median=3, turns_sigma=0.6, tokens_per_turn=16, env_median_s=0.3,
                           env_sigma=1.0, outlier_prob=0.1, outlier_factor=20, seed=1)
    drop = simulate(sim(steps=20, max_off_policy=1, stale_policy="drop", train_s=0.5), src)
    mask = simulate(sim(steps=20, max_off_policy=1, stale_policy="mask", train_s=0.5), src)
    assert drop.dropped_groups > 0 and mask.dropped_groups == 0
    assert drop.wasted_fraction > mask.wasted_fraction
    for r in (drop, mask):
        assert max(r.lags) <= 1    # every trained token within max_off_policy


def test_lognormal_sigma_and_metrics_reader(tmp_path):
    s = lognormal_sigma(2.0, 4.0)
    mu = math.log(2.0) - s * s / 2
    assert math.exp(mu + 1.2815515655446004 * s) == pytest.approx(4.0, rel=1e-9)
    assert lognormal_sigma(2.0, 1.0) == 0.0
    rows = [{"step": n, "step_time_s": 1.5, "publish_s": 0.1, "time": n,
             "orchestrator/started_episode_s_mean": 3.0, "orchestrator/started_episode_s_p90": 6.0,
             "orchestrator/completion_len_mean": 300.0, "orchestrator/turns_per_episode": 3.0} for n in range(4)]
    p = tmp_path / "metrics.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n{torn")
    source, train_s = from_metrics(p, 4, token_s=0.001)
    assert train_s == pytest.approx(1.6)
    eps = [e for k in range(300) for e in source(f"group-{k}")]
    assert all(len(e) == 3 and e[0].tokens == 100 for e in eps)
    totals = sorted(sum(t.env_s for t in e) + 0.3 for e in eps)
    assert sum(totals) / len(totals) == pytest.approx(3.0, rel=0.1)
    with pytest.raises(ValueError, match="no orchestrator episode times"):
        (tmp_path / "empty.jsonl").write_text('{"step": 0}\n')
        from_metrics(tmp_path / "empty.jsonl", 4, 0.001)


def test_simulator_reproduces_the_async_benchmark_measured_here(capsys):
    """benchmarks/async_rollouts.py at CI size (agentic episodes, 6 steps): the simulator, fed the
    trainer step, the seconds per generated token and the tool latencies measured in the same run,
    predicts each mode's steps/h within 25%."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import async_rollouts
    modes = "sync,batch_pipelined,mask,drop"
    assert async_rollouts.main(["--models", "agentic", "--modes", modes, "--steps", "6", "--prompts", "4",
                                "--group-size", "4", "--max-concurrency", "16", "--env-concurrency", "64",
                                "--train-s", "0.5", "--async-steps", "1"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    ratios = dict(re.findall(r"sim_ratio_(\w+)=([\d.]+)", last))
    assert set(ratios) == set(modes.split(",")), last
    for mode, r in ratios.items():
        assert 0.75 <= float(r) <= 1.25, f"{mode}: simulated / measured steps/h = {r} ({last})"
    waits = dict(re.findall(r"sim_sibling_wait_waste_(\w+)=([\d.]+)", last))
    assert set(waits) == set(modes.split(",")) and all(0 <= float(x) < 1 for x in waits.values()), last


def test_the_group_barrier_is_counted_apart():
    """A group is trained whole: its short rollouts age while the longest runs. Half the groups here have
    one rollout of 20 turns (0.2 s of tool each) beside three of one turn; the short groups keep the
    trainer stepping, so the waiting siblings' tokens pass the bound and are masked, and counted as
    masked while waiting. Rollouts of equal length never wait."""
    def source(key):
        gid = int(key.split("-")[1])
        long = [Turn(2, 0.2) for _ in range(20)] if gid % 2 else [Turn(2, 0.01)]
        return [long] + [[Turn(10, 0.01)] for _ in range(3)]
    r = simulate(sim(steps=30, max_off_policy=1, stale_policy="mask", train_s=0.3), source)
    assert 0 < r.masked_waiting <= r.masked_tokens
    assert r.masked_waiting >= 0.5 * r.masked_tokens   # the siblings' 30 tokens, against the long one's first few
    assert r.waiting_fraction <= r.wasted_fraction and r.sibling_wait_s[1] > 2.0
    even = simulate(sim(steps=30, max_off_policy=1, stale_policy="mask", train_s=0.3), const(0.5))
    assert even.masked_waiting == 0 and even.sibling_wait_s == (0.0, 0.0)
