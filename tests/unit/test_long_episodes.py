"""Long agent episodes (issue 40, item 2: hundreds of turns, hour-long timeouts) in the continuous pool:
what a cancel loses is counted, and a pool waiting on episodes that still take turns is not stalled.

- The contexts an episode closed by summarizing are lost when its group is cancelled (no reward, no
  training: rl.orchestrator.segments): a stale or drained group's drop line and the batch meta count
  them, a stop (preemption) names them in the log and writes no drop line.
- The no-progress watchdog (cluster.stall_timeout_s) is for servers that stopped answering: a finished
  turn of an episode in flight is progress, so an orchestrator waiting hours for a batch of long episodes
  is not ended as stalled.

The samplers play the pool's accounting calls as the multi-turn driver makes them
(tests/unit/test_summarization.py checks that the driver makes them); the pool, group log and batches
are real.
"""
from __future__ import annotations

import asyncio

from rl.contract.batch import Sample
from rl.orchestrator import accounting


def _sampler_with_long_episodes(orch, group_size, slow):
    """Groups `slow(gid)` play episodes that close two contexts (as the driver reports them) and then
    run for a minute (cancelled first); the others finish at once, unsegmented."""
    async def sample(task, group, step, attempt, rollouts=None):
        async def one(i):
            accounting.rollout_begin(i)
            v = orch.sampler.tracker.version
            if slow(group):
                accounting.segment_closed(2, 10)
                await asyncio.sleep(60)
            s = Sample(prompt_ids=[1, 2], completion_ids=[3, 4], completion_logprobs=[-1.0, -1.0],
                       completion_versions=[v, v], reward=float(i % 2), group=group, info={"finish_reason": "stop"})
            accounting.count_generated(2)
            accounting.rollout_end(i, s)
            return s
        return list(await asyncio.gather(*(one(i) for i in (rollouts or range(group_size)))))
    orch.sampler.sample_group_or_none = sample


def test_stale_and_drained_episodes_count_the_contexts_they_lose(tmp_path):
    """stale_policy=drop: a long episode's group goes stale in flight and is cancelled; the contexts its
    episodes closed are counted in its drop line and in the next batch's meta (since the previous batch
    and in all), as they are for the groups the end-of-run drain cancels (drop line only: no batch
    follows)."""
    from test_rollout_pool import _check_exactly_once, _metas, _orchestrator, _run
    from rl.orchestrator.grouplog import GroupLog
    orch = _orchestrator(tmp_path, "orchestrator.stale_policy=drop")
    _sampler_with_long_episodes(orch, 2, slow=lambda g: g % 3 == 1)
    asyncio.run(_run(orch, tmp_path, max_steps=6))
    _check_exactly_once(tmp_path, 6)
    drops = [e for e in GroupLog.read(tmp_path) if e["event"] == "drop"]
    stale = [e for e in drops if e["reason"] == "stale"]
    assert stale and all(e["group"] % 3 == 1 for e in stale)
    # 2 episodes x 2 contexts per long group cancelled; a short group the drain drops lost none
    assert all(e["segments"] == 4 and e["segment_tokens"] == 20 for e in drops if e["group"] % 3 == 1)
    assert not [e for e in drops if e["group"] % 3 != 1 and "segments" in e]
    metas = [m for _, m in sorted(_metas(tmp_path).items())]
    assert sum(m["lost_segments"] for m in metas) == metas[-1]["lost_segments_total"] == sum(e["segments"] for e in stale)
    assert sum(m["lost_segment_tokens"] for m in metas) == sum(e["segment_tokens"] for e in stale)


def test_a_stop_logs_the_contexts_it_interrupts_and_writes_no_drop(tmp_path, capsys):
    """A stop (preemption) writes no drop line, so the group is played again from its start; what its
    episodes had closed is named in the orchestrator's log."""
    from test_rollout_pool import _orchestrator
    from rl.orchestrator.grouplog import GroupLog, resume_order
    orch = _orchestrator(tmp_path)
    _sampler_with_long_episodes(orch, 2, slow=lambda g: True)

    async def go():
        pool = orch.continuous_pool(0, 10, 0)
        job = asyncio.create_task(pool.run(lambda: orch.next_missing(0, 10)))
        while not pool.inflight:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        in_flight = set(pool.inflight)
        orch.stop.set("SIGTERM")
        await asyncio.wait_for(job, 60)
        return in_flight
    in_flight = asyncio.run(go())
    assert not [e for e in GroupLog.read(tmp_path) if e["event"] == "drop"]
    assert in_flight <= set(resume_order(tmp_path)[0])
    out = capsys.readouterr().out
    for g in in_flight:
        assert (f"group {g} cancelled (stop): its episodes had closed 4 context(s) by summarizing (20 policy "
                "tokens), lost untrained; the group is played again from its start after the restart") in out


def test_a_pool_waiting_on_long_episodes_counts_their_turns_as_progress(tmp_path, monkeypatch):
    """No batch can form (every episode is long), yet every pool wait after a finished turn reports
    progress, so the watchdog's wait restarts with each turn; without turns it would run out."""
    from test_rollout_pool import _orchestrator
    from rl.orchestrator import pool as poolmod
    calls: list[int] = []
    monkeypatch.setattr(poolmod.runtime, "progress", lambda: calls.append(1))
    orch = _orchestrator(tmp_path)
    turns = 5

    async def sample(task, group, step, attempt, rollouts=None):
        async def one(i):
            accounting.rollout_begin(i)
            for _ in range(turns):
                await asyncio.sleep(0.05)
                accounting.count_generated(3)     # one finished turn
            await asyncio.sleep(600)              # then a long tool run
        return list(await asyncio.gather(*(one(i) for i in (rollouts or range(2)))))
    orch.sampler.sample_group_or_none = sample

    async def go():
        pool = orch.continuous_pool(0, 10, 0)
        job = asyncio.create_task(pool.run(lambda: orch.next_missing(0, 10)))
        for _ in range(600):    # until every episode took its turns and the pool waited once more
            await asyncio.sleep(0.05)
            done = pool.inflight and all(g.tokens == 2 * 3 * turns for g in pool.inflight.values())
            if done and pool._turn_tokens == sum(g.tokens for g in pool.inflight.values()):
                break
        seen = len(calls)
        orch.stop.set("SIGTERM")
        await asyncio.wait_for(job, 60)
        return seen, pool
    seen, pool = asyncio.run(go())
    assert seen >= 1 and pool._turn_tokens > 0
    from rl import exchange
    assert not exchange.list_steps(tmp_path, "rollouts")   # every call came from a wait, none from a batch


def test_a_300_turn_episode_runs_to_its_turn_cap_through_two_summaries(tmp_path):
    """The recipe's max_turns=300 through the real driver, tokenizer and chat template: the episode takes
    all 300 environment turns (the summary turns do not count), summarizes at both thresholds, and
    becomes three samples whose tokens add up to the episode's."""
    import time
    from types import SimpleNamespace
    import numpy as np
    from rl.tiny_models.tiny import build_tokenizer
    from test_multiturn_r3 import ToolEnv
    from rl.orchestrator import multiturn, segments
    tok = build_tokenizer(tmp_path / "tok")
    bridge = multiturn.ChatBridge(tok)
    reply = bridge.encode("ran the tests") + [bridge.eos_id]
    limits = multiturn.RolloutLimits(max_turns=300, max_tokens_per_turn=16, max_total_tokens=6000,
                                     summarize_at=(2000, 4000), summary_prompt="Summarize your progress.")

    async def generate(ids, max_tokens, turn, routed_start=0):
        return SimpleNamespace(ids=reply, logprobs=[-0.5] * len(reply), finish_reason="stop"), [0] * len(reply)
    t0 = time.monotonic()
    r = asyncio.run(multiturn.run_episode(ToolEnv(), {"id": 1}, generate, bridge, limits))
    took = time.monotonic() - t0
    assert r.end_reason == "max_turns" and sum(not t.summary for t in r.turns) == 300
    assert sum(t.summary for t in r.turns) == 2 and r.segments == 3
    samples = segments.expand([r.sample(0, rollout=0)])
    assert [s.info["segment"] for s in samples] == [0, 1, 2]
    assert all(len(s.prompt_ids) + len(s.completion_ids) < limits.max_total_tokens for s in samples)
    trained = sum(int(np.count_nonzero(s.completion_mask)) for s in samples)
    assert trained == len(reply) * len(r.turns)     # every model turn, summaries included, trained once
    print(f"300-turn episode: {len(r)} tokens in 3 contexts, {took:.2f} s in the driver")
