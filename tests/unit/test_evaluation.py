"""Online evaluation (rl/orchestrator/evaluation.py) on real files with a stand-in server.

The stand-in answers like a policy that copies the prompt's digits with probability `skill` (the
digits environment grades the copy), so rewards and pass@k are real numbers of real completions; the
full path through vLLM is the embedded run's (tests/integration/test_local_run.py). Checked here: the
held-out split leaves training, the file source, pass@k arithmetic, one row per version across a
restart, the trainer's folding into metrics.jsonl, the resume's truncation and one-line config errors.
"""
from __future__ import annotations

import asyncio
import json
import random

import pytest
from omegaconf import OmegaConf

from rl.contract.batch import Sample
from rl.contract.config import Config, ConfigError, structured
from rl.contract.validation import validate
from rl.metrics import EvalFold, is_eval_only, read_metrics, truncate_eval
from rl.orchestrator import evaluation
from rl.orchestrator.client import Completion
from rl.orchestrator.sampling import Sampler
from rl.orchestrator.versions import VersionTracker
from rl.runtime import StopFlag


class Copier:
    """A server whose completion repeats the prompt's digits, each right with probability `skill` when it
    samples; greedy (temperature 0) it answers its mode, which is the right digit whenever skill > 0.5."""

    def __init__(self, tok, skill: float):
        self.tok, self.skill, self.requests = tok, skill, []

    async def generate(self, prompt_ids, max_tokens, temperature=1.0, top_p=1.0, seed=None, request_id=None, **kw):
        self.requests.append({"temperature": temperature, "max_tokens": max_tokens})
        rng = random.Random(seed)
        text = self.tok.decode(prompt_ids)
        digits = text.split("repeat ")[-1].split("<")[0].split()
        skill = float(self.skill > 0.5) if temperature == 0 else self.skill
        out = [d if rng.random() < skill else str((int(d) + 1) % 10) for d in digits]
        ids = self.tok.encode(" ".join(out), add_special_tokens=False) + [self.tok.eos_token_id]
        await asyncio.sleep(0)
        return Completion(ids=ids, logprobs=[-0.1] * len(ids), finish_reason="stop", request_id=request_id,
                          versions=None)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from rl.tiny_models.tiny import build_tokenizer
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def _cfg(run_dir, **eval_kw):
    cfg = OmegaConf.structured(Config(run_dir=str(run_dir)))
    cfg.trainer.max_steps = 4
    for k, v in eval_kw.items():
        cfg.eval[k] = v
    return cfg


def _sampler(cfg, tok, skill=1.0):
    from rl.envs import make_env
    sp = Sampler(cfg, make_env(cfg))
    sp.clients, sp.tokenizer, sp.tracker = [Copier(tok, skill)], tok, VersionTracker(0)
    return sp


def test_due_every_nth_version_and_the_final_one():
    assert [v for v in range(8) if evaluation.due(v, 3, 7)] == [0, 3, 6, 7]
    assert not any(evaluation.due(v, 0, 7) for v in range(8))  # eval.every=0: off


def test_a_task_list_environment_loses_its_held_out_tasks_to_evaluation():
    class ListEnv:
        def __init__(self):
            self.tasks = [{"id": i} for i in range(10)]

        def sample_tasks(self, n, rng):
            return rng.sample(self.tasks, n)
    env = ListEnv()
    ecfg = OmegaConf.structured(Config(run_dir="/x")).eval
    ecfg.tasks = 3
    held = evaluation.hold_out(env, ecfg, seed=1)
    assert len(held) == 3 and len(env.tasks) == 7
    assert not {t["id"] for t in held} & {t["id"] for t in env.tasks}
    assert held == evaluation.hold_out(ListEnv(), ecfg, seed=1)  # the same split on every restart
    ecfg.tasks = 10
    with pytest.raises(ValueError, match="eval.tasks=10: the environment has 10 tasks"):
        evaluation.hold_out(ListEnv(), ecfg, seed=1)


def test_digits_tasks_from_a_file_and_its_one_line_errors(tmp_path):
    from rl.envs.digits import DigitsEnv
    env = DigitsEnv(OmegaConf.structured(Config(run_dir="/x")).env.digits)
    f = tmp_path / "held.jsonl"
    f.write_text('{"digits": [1, 2, 3]}\n\n{"digits": [4, 5]}\n')
    ecfg = OmegaConf.structured(Config(run_dir="/x")).eval
    ecfg.tasks_file, ecfg.tasks = str(f), 8
    assert evaluation.hold_out(env, ecfg, seed=0) == [{"digits": [1, 2, 3]}, {"digits": [4, 5]}]
    f.write_text('{"digits": [1, 2, 3]}\n{"digits": [12]}\n')
    with pytest.raises(ValueError, match=r"held.jsonl:2: digits must be"):
        evaluation.hold_out(env, ecfg, seed=0)


def test_pass_at_k_and_pass_at_1_from_the_rewards():
    def g(*rewards):
        return [Sample(prompt_ids=[1], completion_ids=[2, 3], completion_logprobs=[0.0, 0.0],
                       completion_versions=[3, 4], reward=r, group=0) for r in rewards]
    row = evaluation.summarize([g(1.0, 0.0), g(0.5, 0.5), None], solved_reward=1.0)
    assert row["eval/pass@2"] == 0.5 and row["eval/pass@1"] == 0.25 and row["eval/reward_mean"] == 0.5
    assert row["eval/failed_tasks"] == 1 and row["eval/tasks"] == 3
    assert (row["eval/version_min"], row["eval/version_max"]) == (3, 4)


def test_the_default_evaluation_is_sampled_and_sees_what_greedy_cannot(tmp_path, tok):
    """The embedded default's greedy pass@1 hit 1.0 at version 14 of 40: a policy whose mode is right but
    which samples a wrong digit one time in five looks solved to a greedy evaluation. The default samples
    several completions per task at the rollouts' temperature, so its pass@1 is the solved fraction of
    what the policy really samples (0.8^3 = 0.51 per completion here)."""
    def one(cfg):
        sp = _sampler(cfg, tok, skill=0.8)
        ev = evaluation.Evaluator(sp, tmp_path / str(id(cfg)), cfg, evaluation.hold_out(sp.env, cfg.eval, 0))
        return asyncio.run(ev.evaluate(0)), sp.clients[0].requests
    default = _cfg(tmp_path)
    row, reqs = one(default)
    n = default.eval.tasks * default.eval.samples
    assert default.eval.samples >= 4 and row["eval/samples"] == len(reqs) == n
    assert {r["temperature"] for r in reqs} == {default.orchestrator.temperature}
    assert 0.2 < row["eval/pass@1"] < 0.8 and row[f"eval/pass@{default.eval.samples}"] > row["eval/pass@1"]
    greedy, _ = one(_cfg(tmp_path, samples=1, temperature=0.0))
    assert greedy["eval/pass@1"] == 1.0   # the same policy, saturated


def test_evaluation_uses_its_own_settings_and_never_repeats_a_version(tmp_path, tok):
    cfg = _cfg(tmp_path, every=2, tasks=5, samples=3, temperature=0.0, max_tokens=7)
    sp = _sampler(cfg, tok, skill=1.0)
    tasks = evaluation.hold_out(sp.env, cfg.eval, 0)
    ev = evaluation.Evaluator(sp, tmp_path, cfg, tasks)
    stop = StopFlag(install=False)

    async def trainer():  # versions appear one by one; the evaluator sees each as the servers would
        for v in range(1, 5):
            await asyncio.sleep(0.3)
            sp.tracker.version = v
    async def both():
        await asyncio.wait_for(asyncio.gather(ev.run(stop), trainer()), 30)
    asyncio.run(both())
    rows = evaluation.read_results(tmp_path)
    assert [r["version"] for r in rows] == [0, 2, 4]
    assert all(r["eval/pass@3"] == 1.0 and r["eval/reward_mean"] == 1.0 and r["eval/samples"] == 15 for r in rows)
    reqs = sp.clients[0].requests
    assert len(reqs) == 3 * 15 and {(r["temperature"], r["max_tokens"]) for r in reqs} == {(0.0, 7)}
    assert cfg.orchestrator.temperature == 1.0 and sp.o.group_size == cfg.orchestrator.group_size  # untouched
    # a restarted orchestrator (same run dir) evaluates nothing again
    again = evaluation.Evaluator(_sampler(cfg, tok), tmp_path, cfg, tasks)
    again.sampler.tracker.version = 4
    asyncio.run(asyncio.wait_for(again.run(stop), 10))
    assert [r["version"] for r in evaluation.read_results(tmp_path)] == [0, 2, 4]


def test_the_trainer_folds_each_row_in_once_and_a_resume_drops_the_discarded_versions(tmp_path):
    p = tmp_path / "eval" / "results.jsonl"
    p.parent.mkdir()
    p.write_text("".join(json.dumps({"version": v, "eval/version": v, "eval/reward_mean": v / 10}) + "\n"
                         for v in (0, 2)))
    fold = EvalFold(tmp_path)
    assert fold.new() == {"eval/version": 2, "eval/reward_mean": 0.2}  # two arrived: the newest wins
    assert fold.new() == {}
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 2, "loss": 0.1, "eval/version": 2}) + "\n"
                                            + json.dumps({"step": 4, "eval/version": 4}) + "\n")
    assert EvalFold(tmp_path).seen == {2, 4}   # a restarted trainer knows what it already logged
    assert [m["step"] for m in read_metrics(tmp_path)] == [2]
    assert is_eval_only(read_metrics(tmp_path, final_eval=True)[-1])
    truncate_eval(tmp_path, 1)
    assert [r["version"] for r in evaluation.read_results(tmp_path)] == [0]


@pytest.mark.parametrize("key,value,msg", [
    ("eval.every", -1, "eval.every=-1: must be >= 0"),
    ("eval.samples", 0, "eval.samples=0: must be at least 1"),
    ("eval.top_p", 0.0, "eval.top_p=0.0: must be in"),
    ("eval.tasks_file", "/nonexistent.jsonl", "eval.tasks_file='/nonexistent.jsonl': is not a readable file"),
])
def test_bad_eval_keys_are_refused_in_one_line(key, value, msg):
    cfg = structured({"run_dir": "/tmp/x"})
    OmegaConf.update(cfg, key, value)
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert msg in str(e.value) and "\n" not in str(e.value)
