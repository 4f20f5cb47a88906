"""SWEEnv episodes: a scripted agent that applies the reference patch scores 1, one that does nothing
scores below 1; turn limits end episodes; episodes clean up their sandboxes."""
import json
import random

import pytest

from rl.envs.swe.env import EnvConfig, SWEEnv


def call(name, **args):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


@pytest.fixture(scope="module")
def env():
    return SWEEnv(config=EnvConfig(max_turns=6, wall_s=120))


def test_swe_env_sample_tasks(env):
    a = env.sample_tasks(5, random.Random(0))
    assert len({t.instance_id for t in a}) == 5
    assert [t.instance_id for t in a] == [t.instance_id for t in env.sample_tasks(5, random.Random(0))]
    assert len(env.sample_tasks(len(env.tasks) + 3, random.Random(1))) == len(env.tasks) + 3


def test_swe_env_scripted_episode_solves_task(env):
    task = env.tasks[0]
    with env.start(task) as ep:
        msgs = ep.initial_messages()
        assert msgs[0]["role"] == "system" and "apply_patch" in msgs[0]["content"]
        assert task.problem_statement in msgs[1]["content"]
        obs, done = ep.step("Let me look.\n" + call("list_files"))
        assert not done and all(p in obs for p in task.files)
        obs, done = ep.step(call("apply_patch", diff=task.patch))
        assert not done and not obs.startswith("error"), obs
        obs, done = ep.step(call("run_tests"))
        assert "passed" in obs and not done
        assert ep.step(call("submit")) == (None, True)
        with pytest.raises(RuntimeError):
            ep.step(call("submit"))
        assert ep.reward() == 1.0
        tree = ep.sandbox.tree
    assert not tree.exists()


def test_swe_env_turn_limit_and_bad_calls(env):
    with env.start(env.tasks[1]) as ep:
        for i in range(5):
            obs, done = ep.step("I will just talk.")
            assert obs.startswith("error: no tool call") and not done
        obs, done = ep.step(call("read_file", path="../../etc/passwd"))
        assert "refused" in obs and done and ep.end_reason == "max_turns"
        assert ep.reward() < 1.0
        assert ep.tool_message("x")["content"] == "<tool_response>\nx\n</tool_response>"
