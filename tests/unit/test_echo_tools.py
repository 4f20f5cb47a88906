"""rl/envs/echo_tools.py: the rehearsal's environment answers `echo(words=n)` with n one-token words,
refuses anything else with an `error:` observation naming the call, ends the episode on a turn without a
call, and rewards by the parity of task id and turns."""
import random

from omegaconf import OmegaConf

from rl.contract.config import Config
from rl.contract.validation import validate
from rl.envs import make_env
from rl.envs.base import default_turn_info, observation_messages
from rl.tiny_models.tiny import build_tokenizer


def test_echo_tools_sizes_observations_and_refuses_bad_calls(tmp_path):
    cfg = OmegaConf.structured(Config(run_dir=str(tmp_path)))
    cfg.env.name, cfg.env.max_turns = "echo_tools", 3
    validate(cfg)
    env = make_env(cfg)
    (task,) = env.sample_tasks(1, random.Random(0))
    ep = env.start(task)
    assert "task" in ep.initial_messages()[0]["content"]
    obs, done = ep.step('<tool_call>{"name": "echo", "arguments": {"words": 300}}</tool_call>')
    assert not done and ep.turn_info() == {"tool_calls": 1, "tool_errors": 0}
    tok = build_tokenizer(tmp_path / "tok")
    assert len(tok.encode(obs, add_special_tokens=False)) == 300
    msg = observation_messages(ep, obs)[0]
    assert msg["content"].startswith("<tool_response>")
    obs, done = ep.step('<tool_call>{"name": "echo", "arguments": {"words": -1}}</tool_call>'
                        '<tool_call>{"name": "cat", "arguments": {}}</tool_call>')
    assert not done and ep.turn_info() == {"tool_calls": 0, "tool_errors": 2}
    assert obs.count("error:") == 2 and "echo({'words': -1})" in obs and "cat({})" in obs
    assert default_turn_info("", observation_messages(ep, obs))["tool_errors"] == 1   # the SWE convention
    obs, done = ep.step("no call")
    assert done and obs is None
    assert ep.reward() == float(task["id"] % 2 == 1) and ep.metrics() == {"echo_words": 300}
