"""Context summarization: an episode whose context passes `env.summarize_at_tokens` summarizes (a trained
policy turn) and goes on in a fresh context; each context is one training sample with the episode's
reward and advantage, its own tokens, versions, mask and routed-expert rows, and the segments of an
episode are accounted as one rollout (exactly once across kills and resumes).

The engine is test_multiturn_r3's FakeVLLM: vLLM's own request/response types over the real
InferenceClient, routes encoded as vLLM encodes them; everything after it is real (the Sampler, the
multi-turn driver, the Orchestrator's batch, the batch checks, the Trainer).
"""
from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from test_multiturn_r3 import FakeVLLM, ToolEnv, _build_batch, _cfg, tok  # noqa: F401 (tok: a fixture)

from rl.contract import record_schemas
from rl.contract.batch import InvalidBatch, RolloutBatch, Sample, check_meta
from rl.orchestrator import accounting, multiturn
from rl.orchestrator.multiturn import SUMMARY_HEADER, ChatBridge, Rollout


class RewardedToolEnv(ToolEnv):
    """ToolEnv whose rewards differ inside a group (episode j of a task: reward j % 3), so advantages
    are not all zero."""

    def __init__(self):
        self.started = 0

    def start(self, task):
        ep = super().start(task)
        j, self.started = self.started, self.started + 1
        ep.reward = lambda: float(j % 3)
        return ep


def _summarized(tok, tmp_path, thresholds=(100, 150), max_turns=8):
    cfg = _cfg(tmp_path)
    cfg.env.max_turns = max_turns
    cfg.env.summarize_at_tokens = list(thresholds)
    m = cfg.model
    engine = FakeVLLM(tok, m.n_layers, m.top_k, m.num_experts)
    import test_multiturn_r3
    orig = test_multiturn_r3.ToolEnv
    test_multiturn_r3.ToolEnv = RewardedToolEnv   # _build_batch's env
    try:
        draft = _build_batch(cfg, engine)
    finally:
        test_multiturn_r3.ToolEnv = orig
    return cfg, engine, draft


def _runs(mask):
    """[start, end) of each run of 1s in `mask`."""
    m = np.r_[0, np.asarray(mask, np.int8), 0]
    d = np.diff(m)
    return list(zip(np.flatnonzero(d == 1).tolist(), np.flatnonzero(d == -1).tolist()))


def test_two_summaries_give_three_segments_each_a_sample_with_its_own_context(tok, tmp_path):
    from rl.trainer.train import Trainer
    cfg, engine, draft = _summarized(tok, tmp_path)
    meta, samples = draft.meta, draft.samples
    bridge = ChatBridge(tok)
    # 2 groups x 2 episodes, each summarized at both thresholds: 3 samples per episode, in order
    assert meta["segment"] == [0, 1, 2] * 4 and meta["num_samples"] == 12
    assert meta["summaries"] == 8 and meta["segments_per_episode"] == 3.0
    assert meta["turns_per_episode"] == cfg.env.max_turns      # summary turns do not count as turns
    assert record_schemas.batch_meta(meta, num_samples=12, group_size=2) is None
    batch = draft.batch()
    batch.validate_meta(group_size=2)
    batch.validate()
    assert batch.routed_experts is not None and len(batch.routed_experts) == len(batch.tokens)
    assert len({s.advantage for s in samples}) > 1            # rewards differ inside the groups

    used = set()
    for e in range(4):
        segs = samples[3 * e:3 * e + 3]
        assert [s.info["segment"] for s in segs] == [0, 1, 2]
        # the episode's reward, advantage, group and rollout on every segment
        for k in ("reward", "advantage", "group"):
            assert len({getattr(s, k) for s in segs}) == 1, k
        assert len({s.info["rollout"] for s in segs}) == 1
        for k, s in enumerate(segs):
            mask = np.asarray(s.completion_mask)
            vers = np.asarray(s.completion_versions)
            assert set(vers[mask == 1].tolist()) == {0} and set(vers[mask == 0].tolist()) <= {-1}
            if k < 2:
                # the segment ends with the summary turn: the summary request (not trained), then the
                # policy's summary (trained), and the next segment's prompt carries that summary
                (a, b) = _runs(mask)[-1]
                assert b == len(mask)
                assert cfg.env.summary_prompt in tok.decode(np.asarray(s.completion_ids)[:a])
                summary = bridge.decode(list(np.asarray(s.completion_ids)[a:b]))
                nxt = samples[3 * e + k + 1]
                task = ToolEnv().start({"id": 0}).initial_messages()  # same shape as every task's
                assert SUMMARY_HEADER.strip() in tok.decode(nxt.prompt_ids) and summary in tok.decode(nxt.prompt_ids)
                assert len(nxt.prompt_ids) >= len(bridge.prompt_ids(task))
            # the engine's requests of this segment: each prompt is a prefix of the segment, the first
            # asks for routes from 0 (a fresh context), the others from the rows held
            toks = list(s.prompt_ids) + list(s.completion_ids)
            turns = sorted((q for q, r in enumerate(engine.requests)
                            if toks[:len(r["prompt"]) + len(r["ids"])] == r["prompt"] + r["ids"]),
                           key=lambda q: len(engine.requests[q]["prompt"]))
            assert turns and engine.requests[turns[0]]["prompt"] == list(s.prompt_ids)
            held, want, prev = 0, [], 0
            for q in turns:
                r = engine.requests[q]
                assert r["asked"] == held
                held += r["rows"]
                end = len(r["prompt"]) + len(r["ids"]) - 1
                want += [engine.route(q, p) for p in range(prev, end)]
                prev = end
            want += [want[-1]] * (len(toks) - len(want))   # never forwarded: repeat the last row
            assert np.array_equal(np.asarray(s.routed_experts), np.stack(want))
            used.update(turns)
    assert used == set(range(len(engine.requests)))            # every request belongs to one segment

    # the trainer trains the segments with their routes replayed
    metrics = Trainer(cfg).train_step(batch, 0)
    assert metrics["router_replay"] == 1 and np.isfinite(metrics["loss"])


def test_summary_off_by_default_and_thresholds_are_validated(tok, tmp_path):
    from rl.contract.validation import ConfigError, validate
    cfg, engine, draft = _summarized(tok, tmp_path, thresholds=())
    assert "segment" not in draft.meta and draft.meta["num_samples"] == 4
    for bad, why in (([150, 100], "increasing"), ([0], "increasing"), ([5000], "below the context budget")):
        c = _cfg(tmp_path)
        c.env.max_turns = 8
        c.env.summarize_at_tokens = bad
        with pytest.raises(ConfigError, match=f"env.summarize_at_tokens.*{why}"):
            validate(c)


def test_meta_with_segments_is_checked_per_rollout():
    """`segment` lets a rollout span samples; a continuation that changes group or reward, or skips a
    segment, is refused with one line naming it."""
    meta = {"num_samples": 5, "entries": [[7, [0, 1]]], "group_ids": [7], "segment": [0, 1, 2, 0, 1]}
    groups, rewards = np.zeros(5, np.int32), np.array([1, 1, 1, 0, 0], np.float32)
    check_meta(meta, groups, rewards, group_size=2)
    assert record_schemas.batch_meta(meta, num_samples=5, group_size=2) is None
    bad = {**meta, "segment": [0, 2, 1, 0, 1]}
    assert "segment[1]=2 does not follow segment 1" in record_schemas.batch_meta(bad, num_samples=5)
    bad = {**meta, "segment": [0, 1, 2, 0, 0]}   # three rollouts, the entry lists two
    assert "entries hold 2 rollouts for 3 samples with segment 0" in record_schemas.batch_meta(bad, num_samples=5)
    with pytest.raises(InvalidBatch, match="sample 2 .segment 2. has reward 0.0, its episode's is 1.0"):
        check_meta(meta, groups, np.array([1, 1, 0, 0, 0], np.float32), group_size=2)
    two = {"num_samples": 5, "entries": [[7, [0]], [8, [0, 1]]], "group_ids": [7, 8], "segment": [0, 1, 0, 1, 0]}
    with pytest.raises(InvalidBatch, match="sample 1 continues an episode of another group"):
        check_meta(two, np.array([0, 1, 1, 1, 1], np.int32), rewards, group_size=2)


# --- exactly once across kills, with segmented episodes -----------------------------------------------

def _segmented_sampler(orch, group_size):
    """A group sampler whose every episode has three contexts (two summaries), built by the real Rollout."""
    async def sample(task, group, step, attempt, rollouts=None):
        orch.played.append((group, rollouts))

        async def one(i):
            accounting.rollout_begin(i)
            v = orch.sampler.tracker.version
            await asyncio.sleep(task.get("latency_s", 0.0) * (1 + 1.5 * i))
            r = Rollout(prompt_ids=[1, 2])
            for k in range(3):
                if k:
                    r.add_env([5])                       # the summary request
                    r.add_model([6], [-1.0], [v])       # the summary
                    r.new_segment([1, 7 + k])
                r.add_model([3, 4], [-1.0, -1.0], [v, orch.sampler.tracker.version])
            r.reward = float(i % 3)
            s = r.sample(group, rollout=i)
            accounting.count_generated(8)
            accounting.rollout_end(i, s)
            return s
        return list(await asyncio.gather(*(one(i) for i in (rollouts or range(group_size)))))
    orch.sampler.sample_group_or_none = sample


@pytest.mark.parametrize("policy", ["drop", "release"])
def test_killed_and_resumed_segmented_episodes_are_trained_exactly_once(tmp_path, policy):
    """test_rollout_pool's kill/resume trial with every episode in three segments: every started rollout
    is trained once (all its segments, in one batch, consecutive) or counted dropped."""
    from test_rollout_pool import _check_exactly_once, _metas, _orchestrator, _run
    from rl import exchange
    from rl.contract import paths
    from rl.orchestrator.grouplog import resume_order
    rng = random.Random(0)
    G = 4 if policy == "release" else 2
    pol = (f"orchestrator.stale_policy={policy}", f"orchestrator.group_size={G}")
    max_steps, restart = 6, 0
    for _ in range(2):
        first = (exchange.list_steps(tmp_path, "rollouts") or [0])[-1]
        orch = _orchestrator(tmp_path, *pol)
        _segmented_sampler(orch, G)
        orch.sampler.tracker.version = first
        asyncio.run(_run(orch, tmp_path, max_steps, first=first, restart=restart, kill_after=rng.uniform(0.1, 0.5)))
        if have := exchange.list_steps(tmp_path, "rollouts"):
            exchange.discard_after(tmp_path, "rollouts", rng.choice(have))
            paths.done_file(tmp_path).unlink(missing_ok=True)
        restart += 1
    resume_order(tmp_path, G)
    first = (exchange.list_steps(tmp_path, "rollouts") or [0])[-1]
    orch = _orchestrator(tmp_path, *pol)
    _segmented_sampler(orch, G)
    orch.sampler.tracker.version = first
    asyncio.run(_run(orch, tmp_path, max_steps, first=first, restart=restart))
    _check_exactly_once(tmp_path, max_steps, G)
    for n, m in _metas(tmp_path).items():
        rollouts = sum(len(idx) for _, idx in m["entries"])
        assert m["segment"] == [0, 1, 2] * rollouts and m["num_samples"] == 3 * rollouts, n
        b = RolloutBatch.load(exchange.step_dir(tmp_path, "rollouts", n))   # check_meta with segments
        assert np.array_equal(b.rewards[0::3], b.rewards[1::3]) and np.array_equal(b.advantages[0::3], b.advantages[2::3])
        for j in range(b.num_samples):   # a later segment's prompt is its own: [1, 7 + k]
            toks = b.tokens[b.sample_slice(j)]
            assert toks[:2].tolist() == ([1, 2] if j % 3 == 0 else [1, 7 + j % 3])
    if policy == "release":
        assert any(m["partial_groups"] for m in _metas(tmp_path).values())


def test_unsegmented_samples_pass_through_unchanged():
    from rl.orchestrator import segments
    s = Sample(prompt_ids=[1], completion_ids=[2], completion_logprobs=[-1.0], completion_versions=[0],
               reward=1.0, group=0)
    assert segments.expand([s]) == [s] and segments.meta([s]) == {}
    assert multiturn.RolloutLimits(1, 1, 1).summarize_at == ()


def test_glm5_seed_keeps_the_recipes_long_episodes():
    """The seed's episodes: 300 turns, six hours (the driver's limit and the SWE environment's own), and
    summarization at the recipe's thresholds, all reaching the multi-turn driver's limits."""
    from pathlib import Path
    from launch.compose import compose_points
    from rl.contract.config import typed
    card = Path(__file__).resolve().parents[2] / "conf" / "checkpoints" / "glm_moe_dsa"
    (c,) = compose_points(["+experiment=glm5_seed", "cluster=slurm", f"model.hf_path={card}",
                           "run_dir=/tmp/hetrl-summary-test"], multirun=False)
    cfg = typed(c)
    lim = multiturn.RolloutLimits.from_config(cfg)
    assert (lim.max_turns, lim.wall_s, lim.summarize_at) == (300, 21600.0, (35000, 80000))
    assert lim.max_total_tokens == 131072 and lim.summary_prompt
    assert cfg.env.swe.wall_s >= lim.wall_s          # the environment does not end an episode first
    assert cfg.orchestrator.request_timeout_s >= 3600  # one long turn is not cut by the HTTP timeout
    # the no-progress watchdog outwaits a whole episode (a trainer waiting for a batch of six-hour episodes)
    assert cfg.cluster.stall_timeout_s > lim.wall_s


def test_report_shows_an_episodes_contexts_in_order():
    from launch.report_episodes import contexts
    seg = [0, 1, 2, 0, 0, 1]
    assert [contexts(seg, i) for i in range(6)] == [[0, 1, 2]] * 3 + [[3], [4, 5], [4, 5]]
    assert contexts(None, 4) == [4]


# --- what a cancelled episode had closed (long episodes: drain, stale, stop) ---------------------------

def test_a_cancelled_episode_reports_the_contexts_it_closed(tok):
    """The driver reports each context it closes to the pool's account of the rollout, so a cancel after
    two summaries knows it loses two contexts and their policy tokens (every model token generated so
    far: the third context has no model turn yet when the episode is cancelled)."""
    from types import SimpleNamespace
    from test_multiturn_r3 import ToolEnv
    bridge = ChatBridge(tok)
    reply = bridge.encode("ok, next") + [bridge.eos_id]
    limits = multiturn.RolloutLimits(max_turns=50, max_tokens_per_turn=16, max_total_tokens=2048,
                                     summarize_at=(100, 150), summary_prompt="Summarize your progress.")
    acct, generated, blocked = accounting.RolloutAcct(), [], asyncio.Event()

    async def generate(ids, max_tokens, turn, routed_start=0):
        if acct.segments == 2:           # the third context's first turn: the episode is cancelled here
            blocked.set()
            await asyncio.Event().wait()
        generated.append(len(reply))
        return SimpleNamespace(ids=reply, logprobs=[-0.5] * len(reply), finish_reason="stop"), [0] * len(reply)

    async def go():
        async def episode():
            accounting.ROLLOUT.set(acct)     # what rollout_begin does inside a pool's group
            return await multiturn.run_episode(ToolEnv(), {"id": 0}, generate, bridge, limits)
        task = asyncio.create_task(episode())
        await asyncio.wait_for(blocked.wait(), 60)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(go())
    assert acct.segments == 2 and acct.segment_tokens == sum(generated) > 0
