"""verifiers (0.4, `verifiers.v1`) environments through rl/envs/verifiers_adapter.py.

The environments are defined here, with in-memory data (no hub), registered as importable modules the
way an installed verifiers environment package is, loaded by `make_env` from `env.name`, and played by
the same multi-turn driver the orchestrator uses, with a scripted policy in place of the server.
"""
from __future__ import annotations

import asyncio
import sys
import types

import pytest
from omegaconf import OmegaConf

vf = pytest.importorskip("verifiers.v1")

from rl.envs import make_env  # noqa: E402
from rl.envs.verifiers_adapter import UnsupportedEnvironment  # noqa: E402
from rl.orchestrator.client import Completion  # noqa: E402
from rl.tiny_models.tiny import build_tokenizer  # noqa: E402
from rl.contract.batch import RolloutBatch  # noqa: E402
from rl.orchestrator.multiturn import ChatBridge, RolloutLimits, batch_metrics, run_episode  # noqa: E402

ROWS = [{"q": "2+3", "a": "5"}, {"q": "4+4", "a": "8"}, {"q": "1+6", "a": "7"}]


# --- a single-turn taskset: question, exact-match reward --------------------------------------------
class QAData(vf.TaskData):
    answer: str = ""


class QATask(vf.Task[QAData]):
    @vf.reward
    async def exact(self, task, trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.5)
    async def short(self, trace) -> float:
        return float(len(trace.last_reply) <= 3)

    @vf.metric
    async def reply_chars(self, trace) -> float:
        return len(trace.last_reply)


class QAConfig(vf.TasksetConfig):
    n: int = 3


class QATaskset(vf.Taskset[QATask, QAConfig]):
    def load(self):
        for r in ROWS[:self.config.n]:
            yield QATask(QAData(prompt=f"What is {r['q']}?", system_prompt="Answer with a number.",
                                answer=r["a"]), self.config.task)


# --- a tool taskset: a calculator toolset, a stop predicate ------------------------------------------
class Calc(vf.Toolset):
    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @vf.tool
    def fail(self) -> str:
        """Always raises."""
        raise RuntimeError("broken tool")


class ToolTask(vf.Task[QAData]):
    @vf.reward
    async def used_the_tool_and_answered(self, task, trace) -> float:
        tool_results = [m.content for m in trace.tool_messages]
        return 0.5 * (task.answer in tool_results) + 0.5 * (trace.last_reply == task.answer)

    @vf.stop
    async def too_many_turns(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 3

    @classmethod
    def toolsets(cls, config):
        return [Calc(vf.ToolsetConfig())]


class ToolTaskset(vf.Taskset[ToolTask]):
    def load(self):
        for r in ROWS:
            yield ToolTask(QAData(prompt=f"Compute {r['q']} with the tool.", answer=r["a"]), self.config.task)


# --- what the adapter refuses -------------------------------------------------------------------------
class BoxTask(vf.Task[QAData]):
    NEEDS_CONTAINER = True


class BoxTaskset(vf.Taskset[BoxTask]):
    def load(self):
        yield BoxTask(QAData(prompt="x"))


class RuntimeRewardTask(vf.Task[QAData]):
    @vf.reward
    async def tests_pass(self, trace, runtime) -> float:
        return 1.0


class RuntimeRewardTaskset(vf.Taskset[RuntimeRewardTask]):
    def load(self):
        yield RuntimeRewardTask(QAData(prompt="x"))


def _register(name, cls):
    mod = types.ModuleType(name)
    setattr(mod, cls.__name__, cls)
    mod.__all__ = [cls.__name__]
    sys.modules[name] = mod


for _name, _cls in [("hetrl_test_qa", QATaskset), ("hetrl_test_tools", ToolTaskset),
                    ("hetrl_test_box", BoxTaskset), ("hetrl_test_runtime", RuntimeRewardTaskset)]:
    _register(_name, _cls)


def _cfg(name, **args):
    return OmegaConf.create({"env": {"name": name, "max_turns": 4, "args": args}})


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


class Scripted:
    def __init__(self, tok, script):
        self.tok, self.script, self.outputs = tok, script, []

    async def __call__(self, ids, max_tokens, turn):
        out = self.tok.encode(self.script[min(turn, len(self.script) - 1)], add_special_tokens=False)
        out = out[:max_tokens - 1] + [self.tok.eos_token_id]
        self.outputs.append(out)
        c = Completion(ids=out, logprobs=[-0.1] * len(out), finish_reason="stop", request_id="x")
        return c, [0] * len(out)


def _play(env, task, tok, script, max_turns=4):
    policy = Scripted(tok, script)
    limits = RolloutLimits(max_turns=max_turns, max_tokens_per_turn=200, max_total_tokens=2048)
    return asyncio.run(run_episode(env, task, policy, ChatBridge(tok), limits)), policy


def test_single_turn_taskset_scored_by_its_own_rewards(tok):
    env = make_env(_cfg("verifiers:hetrl_test_qa", taskset={"n": 2}))
    assert len(env.tasks) == 2  # the taskset's own config field, from env.args.taskset
    task = env.tasks[0]
    r, _ = _play(env, task, tok, ["5"])
    assert r.end_reason == "no_tool_call" and len(r.turns) == 1
    assert r.reward == pytest.approx(1.0 + 0.5)  # exact + 0.5 * short (weighted sum, as verifiers sums)
    assert r.env_metrics["reply_chars"] == 1 and r.env_metrics["reward_error"] == 0
    r, _ = _play(env, task, tok, ["it is 6"])
    assert r.reward == 0.0
    m = batch_metrics([r.sample(0)])
    assert m["env/reply_chars"] == 7 and m["end/no_tool_call"] == 1


def test_tool_taskset_runs_tools_in_process_and_stops(tok):
    env = make_env(_cfg("verifiers:hetrl_test_tools"))
    task = env.tasks[0]  # 2+3
    call = '<tool_call>{"name": "calc_add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    r, policy = _play(env, task, tok, [call, "5"])
    assert r.end_reason == "no_tool_call" and len(r.turns) == 2
    assert r.reward == pytest.approx(1.0)
    assert [t.tool_calls for t in r.turns] == [1, 0] and sum(t.tool_errors for t in r.turns) == 0
    text = tok.decode(r.ids)
    assert "<tool_response>\n5\n</tool_response>" in text
    # the tool list reached the system prompt
    assert "calc_add" in tok.decode(r.prompt_ids) and "Add two integers." in tok.decode(r.prompt_ids)
    # trained tokens are the policy's, observations masked
    b = RolloutBatch.from_samples([r.sample(0)])
    assert [t for t, m in zip(b.tokens.tolist(), b.loss_mask.tolist()) if m] == sum(policy.outputs, [])

    bad = ['<tool_call>{"name": "calc_nope", "arguments": {}}</tool_call>',
           '<tool_call>{"name": "calc_fail", "arguments": {}}</tool_call>',
           '<tool_call>{"name": "calc_add", "arguments": {"a": "x"}}</tool_call>'
           ' <tool_call>not json</tool_call>']
    r, _ = _play(env, task, tok, bad, max_turns=10)
    assert r.end_reason == "too_many_turns" and len(r.turns) == 3  # the @vf.stop predicate
    assert [t.tool_errors for t in r.turns] == [1, 1, 2]
    assert [t.tool_calls for t in r.turns] == [1, 1, 1]
    text = tok.decode(r.ids)
    assert "unknown tool 'calc_nope'" in text and "broken tool" in text  # the stopped turn's results
    assert r.mask[-1] == 1                                                 # are not sent: nobody reads them
    assert r.reward == 0.0


def test_unsupported_environments_are_refused_with_the_reason():
    with pytest.raises(UnsupportedEnvironment, match="needs a container"):
        make_env(_cfg("verifiers:hetrl_test_box"))
    with pytest.raises(UnsupportedEnvironment, match="need a runtime"):
        make_env(_cfg("verifiers:hetrl_test_runtime"))
    with pytest.raises(UnsupportedEnvironment, match="unknown for verifiers"):
        make_env(_cfg("verifiers:hetrl_test_qa", bogus=1))
    with pytest.raises(ModuleNotFoundError):
        make_env(_cfg("verifiers:no_such_env_module"))


def test_class_path_form():
    env = make_env(_cfg(f"verifiers:{__name__}:QATaskset"))
    assert len(env.tasks) == 3
