"""Multi-turn rollouts without a server: a scripted policy stands in for vLLM (tokens in, tokens out).

Checks that the trained sequence is, token for token, the context each turn was generated in plus the
generated ids; that observation tokens are masked with version -1; the limits; the SWE environment
driven through the same path; and the orchestrator's batch for a multi-turn env (per-turn metrics).
"""
from __future__ import annotations

import asyncio
import json
import random

import numpy as np
import pytest
from omegaconf import OmegaConf

from rl.contract.config import Config
from rl.envs.base import chat_prompt_ids
from rl.orchestrator.client import Completion
from rl.tiny_models.tiny import build_tokenizer
from rl.contract.batch import RolloutBatch
from rl.orchestrator.multiturn import ChatBridge, RolloutLimits, batch_metrics, run_episode


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


class CountEnv:
    """Toy multi-turn env: every turn is answered with "seen <n>"; done when the model says "submit"."""

    def __init__(self):
        self.closed = 0

    def sample_tasks(self, n, rng):
        return [{"id": i} for i in range(n)]

    def start(self, task):
        env = self

        class Ep:
            turns = 0

            def initial_messages(self):
                return [{"role": "system", "content": "count"},
                        {"role": "user", "content": f"task {task['id']}"}]

            def step(self, text):
                self.turns += 1
                if "submit" in text:
                    return None, True
                return f"seen {self.turns}", False

            def tool_message(self, obs):
                return {"role": "user", "content": f"<tool_response>\n{obs}\n</tool_response>"}

            def reward(self):
                return self.turns / 10

            def close(self):
                env.closed += 1

        return Ep()


class ScriptedPolicy:
    """Answers turn k with script[k] (text; tokenized here, once, like a server sampling them), with
    logprob -(k+1)/100 per token and version 7 + k; records every prompt it was sent."""

    def __init__(self, tok, script, eos=True, delay=0.0):
        self.tok, self.script, self.eos, self.delay = tok, script, eos, delay
        self.prompts, self.outputs = [], []

    async def __call__(self, ids, max_tokens, turn):
        await asyncio.sleep(self.delay)
        self.prompts.append(list(ids))
        out = self.tok.encode(self.script[min(turn, len(self.script) - 1)], add_special_tokens=False)
        if self.eos:
            out.append(self.tok.eos_token_id)
        finish = "stop"
        if len(out) > max_tokens:
            out, finish = out[:max_tokens], "length"
        self.outputs.append(out)
        c = Completion(ids=out, logprobs=[-(turn + 1) / 100] * len(out), finish_reason=finish, request_id="x")
        return c, [7 + turn] * len(out)


def _limits(**kw):
    return RolloutLimits(**{"max_turns": 8, "max_tokens_per_turn": 64, "max_total_tokens": 512, **kw})


def test_bridge_renders_the_templates_markup(tok):
    b = ChatBridge(tok)
    assert b.closer == "<|im_end|>\n"
    msgs = [{"role": "user", "content": "obs"}]
    assert (b.observation_text(msgs, ended_with_eos=True)
            == "\n<|im_start|>user\nobs<|im_end|>\n<|im_start|>assistant\n")
    assert b.observation_text(msgs, ended_with_eos=False).startswith("<|im_end|>\n<|im_start|>user")
    first = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert b.prompt_ids(first) == chat_prompt_ids(tok, first)


def test_trained_ids_are_the_generated_ids_in_their_context(tok):
    env = CountEnv()
    policy = ScriptedPolicy(tok, ["read 1", "read 2 <tool_call>{\"name\": \"x\"}</tool_call>", "submit"])
    r = asyncio.run(run_episode(env, env.sample_tasks(1, None)[0], policy, ChatBridge(tok), _limits()))
    assert r.end_reason == "env_done" and len(r.turns) == 3 and env.closed == 1
    assert r.reward == pytest.approx(0.3)
    batch = RolloutBatch.from_samples([r.sample(0)])
    toks, mask = batch.tokens.tolist(), batch.loss_mask.tolist()
    # every request's prompt is exactly the batch's sequence up to that turn
    starts = [len(p) for p in policy.prompts]
    for p in policy.prompts:
        assert toks[:len(p)] == p
    # the trained (mask 1) tokens are the generated ids, turn by turn, at the position they were made
    for s, out in zip(starts, policy.outputs):
        assert toks[s:s + len(out)] == out
        assert mask[s:s + len(out)] == [1] * len(out)
    assert [t for t, m in zip(toks, mask) if m] == sum(policy.outputs, [])
    # observation tokens: masked, version -1, logprob 0; model tokens: their logprob and version
    vers, lps = batch.versions.tolist(), batch.logprobs.tolist()
    for k, (s, out) in enumerate(zip(starts, policy.outputs)):
        assert vers[s:s + len(out)] == [7 + k] * len(out)
        assert lps[s:s + len(out)] == pytest.approx([-(k + 1) / 100] * len(out))
    assert all(v == -1 and lp == 0 for v, lp, m in zip(vers, lps, mask) if not m)
    # the whole sequence reads as the chat template's rendering of the conversation
    conv = [{"role": "system", "content": "count"}, {"role": "user", "content": "task 0"},
            {"role": "assistant", "content": "read 1"},
            {"role": "user", "content": "<tool_response>\nseen 1\n</tool_response>"},
            {"role": "assistant", "content": "read 2 <tool_call>{\"name\": \"x\"}</tool_call>"},
            {"role": "user", "content": "<tool_response>\nseen 2\n</tool_response>"},
            {"role": "assistant", "content": "submit"}]
    assert tok.decode(toks) + "\n" == tok.apply_chat_template(conv, tokenize=False)  # but the final newline
    assert r.turns[1].tool_calls == 1 and r.turns[0].tool_calls == 0


def test_truncated_turn_is_closed_by_the_environment(tok):
    env = CountEnv()
    policy = ScriptedPolicy(tok, ["a long answer that goes on and on and on"] * 2 + ["submit"])
    r = asyncio.run(run_episode(env, {"id": 0}, policy, ChatBridge(tok), _limits(max_tokens_per_turn=4)))
    assert [t.finish_reason for t in r.turns[:2]] == ["length", "length"]
    im_end = tok.eos_token_id
    first_obs = r.ids[len(policy.outputs[0]):]
    assert first_obs[0] == im_end and r.mask[len(policy.outputs[0])] == 0  # env's <|im_end|>, not trained


def test_limits_turns_tokens_wall_time(tok):
    env = CountEnv()
    forever = ["more"]
    r = asyncio.run(run_episode(env, {"id": 0}, ScriptedPolicy(tok, forever), ChatBridge(tok),
                                _limits(max_turns=3)))
    assert r.end_reason == "max_turns" and len(r.turns) == 3
    assert r.mask[-1] == 1  # no observation after the last turn: nobody would read it
    budget = 60
    p = ScriptedPolicy(tok, forever)
    r = asyncio.run(run_episode(env, {"id": 0}, p, ChatBridge(tok), _limits(max_total_tokens=budget)))
    assert r.end_reason == "max_total_tokens" and len(r.prompt_ids) + len(r.ids) <= budget
    r = asyncio.run(run_episode(env, {"id": 0}, ScriptedPolicy(tok, forever, delay=0.05), ChatBridge(tok),
                                _limits(max_turns=1000, wall_s=0.3)))
    assert r.end_reason == "wall_time" and 1 <= len(r.turns) < 10
    assert len(r.ids) == len(r.mask) == len(r.versions) == len(r.logprobs)
    assert env.closed == 3


def test_swe_episode_through_the_multiturn_driver(tok):
    from rl.envs.swe.env import EnvConfig, SWEEnv
    env = SWEEnv(config=EnvConfig(max_turns=6, output_chars=300))
    task = env.tasks[0]
    script = ['<tool_call>{"name": "list_files", "arguments": {}}</tool_call>',
              "no tool here",
              '<tool_call>{"name": "read_file", "arguments": {"path": "../etc/passwd"}}</tool_call>',
              '<tool_call>{"name": "submit", "arguments": {}}</tool_call>']
    policy = ScriptedPolicy(tok, script)
    r = asyncio.run(run_episode(env, task, policy, ChatBridge(tok), _limits(max_total_tokens=4096)))
    assert r.end_reason == "submitted" and len(r.turns) == 4
    assert [t.tool_calls for t in r.turns] == [1, 0, 1, 1]
    assert [t.tool_errors for t in r.turns] == [0, 1, 1, 0]
    assert 0 <= r.reward < 1  # the unmodified repo
    assert r.env_metrics["turns"] == 4
    text = tok.decode(r.ids)
    assert "<tool_response>" in text and "error: no tool call found" in text
    m = batch_metrics([r.sample(0)])
    assert m["tool_calls"] == 3 and m["tool_errors"] == 2 and m["end/submitted"] == 1
    assert all(isinstance(v, (int, float)) for v in m.values())
    assert m["swe/grading_errors"] == 0.0 and not [k for k in m if k.endswith("/swe/grading_errors")]


def test_a_grading_error_is_counted_and_its_reason_logged(tok, capsys):
    class Graded(CountEnv):
        def start(self, task):
            ep = super().start(task)
            ep.metrics = lambda: {"swe/grading_errors": 1, "grading_error": "none of the graded tests ran",
                                  "turns": ep.turns}
            return ep
    r = asyncio.run(run_episode(Graded(), {"id": 7}, ScriptedPolicy(tok, ["submit"]), ChatBridge(tok), _limits()))
    assert r.env_metrics == {"swe/grading_errors": 1.0, "turns": 1.0}
    assert "task 7: grading error (reward 0.1 kept): none of the graded tests ran" in capsys.readouterr().out
    m = batch_metrics([r.sample(0)])
    assert m["swe/grading_errors"] == 1.0 and m["env/turns"] == 1.0


class FakeClient:
    def __init__(self, tok):
        self.tok = tok
        self.n = 0

    async def generate(self, prompt_ids, max_tokens, temperature=1.0, top_p=1.0, seed=None, request_id=None,
                       **kw):
        self.n += 1
        rng = random.Random(seed)
        text = rng.choice(["hello", "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>", "submit"])
        ids = self.tok.encode(text, add_special_tokens=False)[:max_tokens] + [self.tok.eos_token_id]
        return Completion(ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop", request_id=request_id,
                          versions=[0] * len(ids))


def test_orchestrator_builds_a_multiturn_batch(tok):
    from rl.orchestrator.loop import Orchestrator
    from rl.orchestrator.versions import VersionTracker
    import rl.orchestrator.loop as loop

    cfg = OmegaConf.structured(Config(run_dir="/nonexistent"))
    cfg.env.max_turns = 4
    cfg.orchestrator.prompts_per_step = 2
    cfg.orchestrator.group_size = 3
    cfg.orchestrator.max_tokens = 16
    env = CountEnv()
    orig = loop.make_env
    loop.make_env = lambda c: env
    try:
        o = Orchestrator("/nonexistent", cfg)
    finally:
        loop.make_env = orig
    assert o.sampler.multi_turn
    o.sampler.clients, o.sampler.tokenizer, o.sampler.tracker = [FakeClient(tok)], tok, VersionTracker(0)
    batch = asyncio.run(o.build_batch(0)).batch()
    assert batch.num_samples == 6 and env.closed == 6
    m = batch.meta
    for key in ("turns_per_episode", "tokens_per_turn", "tool_calls", "tool_errors", "turn_env_s",
                "turn_gen_s",
                "env_time_fraction", "episode_tokens_mean"):
        assert key in m, key
    assert m["version_min"] == 0 and m["dropped_groups"] == 0
    assert m["gen_tokens"] == int(batch.loss_mask.sum())
    json.dumps(m)  # the meta stays JSON
    assert set(np.unique(batch.versions[batch.loss_mask == 0])) == {-1}


def test_a_failing_environment_drops_its_group_not_the_run(tok):
    from rl.orchestrator.loop import Orchestrator
    from rl.orchestrator.versions import VersionTracker
    import rl.orchestrator.loop as loop

    class FlakyEnv(CountEnv):
        calls = 0

        def start(self, task):
            FlakyEnv.calls += 1
            if FlakyEnv.calls == 1:  # the first episode's sandbox cannot be created
                raise OSError("sandbox setup failed")
            return super().start(task)

    cfg = OmegaConf.structured(Config(run_dir="/nonexistent"))
    cfg.env.max_turns = 2
    cfg.orchestrator.prompts_per_step = 2
    cfg.orchestrator.group_size = 2
    env = FlakyEnv()
    orig = loop.make_env
    loop.make_env = lambda c: env
    try:
        o = Orchestrator("/nonexistent", cfg)
    finally:
        loop.make_env = orig
    o.sampler.clients, o.sampler.tokenizer, o.sampler.tracker = [FakeClient(tok)], tok, VersionTracker(0)
    batch = asyncio.run(o.build_batch(0)).batch()
    assert batch.num_samples == 4 and batch.meta["failed_groups"] == 1
