"""`python -m launch report RUN_DIR`: one self-contained HTML page, from the run directory alone.

- A finished local run of the embedded default (real vLLM, trainer and orchestrator, a few steps): the
  page has a chart per quantity with one point per logged step and the values of metrics.jsonl in its
  tooltips, no script and no outside reference, and its trajectory view shows episodes of the rollout
  batches decoded with the run's tokenizer (checked against transformers' tokenizer on the same assets)
  with every policy token's version.
- A Slurm run on the local cluster, asked to stop mid-run (USR1) so that it requeues: the restart is
  marked at the first step the second incarnation trained, and both incarnations are listed with their
  Slurm job and nodes.
- A multi-turn episode (the real batch format, published like the orchestrator publishes it, tokenizer
  of the tiny model): turns, the tool call, the tool output between the turns, and version spans.
"""
from __future__ import annotations

import html
import json
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from rl import exchange
from rl.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}


def _report(run_dir: Path, out: Path, *args) -> str:
    r = subprocess.run([sys.executable, "-m", "launch", "report", str(run_dir), "--out", str(out), *args],
                       cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out.read_text()


class _Page(HTMLParser):
    """Tags, attributes and the chart tooltips of a page; refuses anything fetched or scripted."""

    def __init__(self):
        super().__init__()
        self.tags, self.titles, self.stack, self.charts = [], [], [], {}
        self._caption = None
        self._in = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        assert tag not in ("script", "link", "img", "iframe"), tag
        for k in ("src", "href"):
            assert k not in a or a[k].startswith("#"), (tag, a)
        if tag == "figcaption":
            self._in = "caption"
        elif tag == "title" and self._caption:
            self._in = "title"

    def handle_endtag(self, tag):
        if tag in ("figcaption", "title"):
            self._in = None

    def handle_data(self, data):
        if self._in == "caption":
            self._caption = data
            self.charts[data] = []
        elif self._in == "title":
            self.charts[self._caption].append(data)


def _parse(text: str) -> _Page:
    p = _Page()
    p.feed(text)
    return p


def _points(page: _Page, caption: str, label: str) -> dict[float, str]:
    """{x: shown value} of series `label` in the chart captioned `caption` (from the point tooltips)."""
    out = {}
    for t in page.charts[caption]:
        m = re.fullmatch(re.escape(label) + r" @ \S+ (\S+): (\S+)", t)
        if m:
            out[float(m.group(1))] = m.group(2)
    return out


@pytest.fixture
def local_run(debug_run):
    return debug_run[0]   # the session's finished embedded run (tests/conftest.py), read only


@pytest.mark.slow
def test_report_of_a_finished_local_run(local_run, tmp_path):
    from launch.report_svg import fmt
    text = _report(local_run, tmp_path / "r.html")
    page = _parse(text)
    rows = read_metrics(local_run, final_eval=True)   # the final evaluation has a line of its own
    ms = [m for m in rows if "loss" in m]  # trainer steps (evaluation results may share their lines)
    from conftest import DEBUG_RUN_STEPS
    assert [m["step"] for m in ms] == list(range(DEBUG_RUN_STEPS))
    # every quantity the issue names has a chart, with the logged values
    for caption, label, key in [("Reward", "reward mean", "reward_mean"),
                                ("Mismatch KL (inference vs trainer logprobs)", "mismatch KL", "mismatch_kl"),
                                ("Lag (trainer step - policy version of the tokens)", "lag mean", "lag"),
                                ("Trainer throughput", "trainer tokens/s", "tokens_per_s"),
                                ("Inference throughput", "inference gen tokens/s", "orchestrator/gen_tokens_per_s"),
                                ("Idle fraction", "trainer (waiting for rollouts)", "idle_fraction"),
                                ("Idle fraction", "inference", "orchestrator/inference_idle_fraction"),
                                ("Dropped and wasted work per step", "dropped groups", "orchestrator/dropped_groups")]:
        assert _points(page, caption, label) == {float(m["step"]): fmt(m[key]) for m in ms}, (caption, label)
    assert _points(page, "Restarts", "incarnation that trained the step") == {float(s): "0" for s in
                                                                               range(DEBUG_RUN_STEPS)}
    assert "finished (DONE)" in text and f"{DEBUG_RUN_STEPS} of {DEBUG_RUN_STEPS}" in text
    # evaluation results, when the run evaluated, per evaluated policy version
    evals = [m for m in rows if "eval/reward_mean" in m]
    assert _points(page, "eval: reward_mean", "eval/reward_mean") == {
        float(m["eval/version"]): fmt(m["eval/reward_mean"]) for m in evals} if evals else "No <code>eval/" in text
    # trajectories: decoded with the run's tokenizer; the text shown is what transformers decodes
    from transformers import AutoTokenizer

    from rl.contract.batch import RolloutBatch
    tok = AutoTokenizer.from_pretrained(str(exchange.step_dir(local_run, "assets", 0)))
    last = exchange.list_steps(local_run, "rollouts")[-1]
    batch = RolloutBatch.load(exchange.step_dir(local_run, "rollouts", last))
    assert batch.meta["prompt_tokens"] and len(batch.meta["prompt_tokens"]) == batch.num_samples
    best = max(range(batch.num_samples), key=lambda i: (float(batch.rewards[i]), -i))
    sl = batch.sample_slice(best)
    n_p = batch.meta["prompt_tokens"][best]
    prompt = tok.decode(batch.tokens[sl][:n_p].tolist(), skip_special_tokens=False)
    completion = batch.tokens[sl][n_p:]
    v = batch.versions[sl][n_p:]
    step_html = text[text.index(f"<summary>step {last}:"):]
    step_html = step_html[: step_html.index("</details><details") if "</details><details" in step_html else None]
    episode = step_html[step_html.index(f"episode {best} |"):]
    span = re.search(rf'title="tokens {n_p}\.\.(\d+): policy version (\d+), lag (\d+)">', episode)
    assert html.escape(prompt, quote=True) in episode
    assert span and int(span.group(2)) == int(v[0]) and int(span.group(3)) == last - int(v[0])
    assert f"episode {best} | group {int(batch.groups[best])} | reward <b>{fmt(float(batch.rewards[best]))}</b>" in text
    assert len(completion) and "model turn 1" in text


@pytest.mark.slurm
@pytest.mark.slow
def test_report_of_a_slurm_run_that_requeued(usr1_requeued_run, tmp_path):
    from conftest import USR1_RUN_STEPS
    run_dir, job = usr1_requeued_run["run_dir"], usr1_requeued_run["job"]
    assert usr1_requeued_run["state"]["state"] in ("COMPLETED", "GONE"), usr1_requeued_run["state"]
    text = _report(run_dir, tmp_path / "r.html")
    page = _parse(text)
    consumed = exchange.ConsumedLog(run_dir, "rollouts", "trainer")
    lines = [json.loads(ln) for ln in (run_dir / "rollouts" / "consumed.jsonl").read_text().splitlines()]
    first_after = min(c["step"] for c in lines if c["restart"] == 1)
    assert consumed.steps() == list(range(USR1_RUN_STEPS))
    assert f"restart 1: resumed, first trained step {first_after}" in text
    assert _points(page, "Restarts", "incarnation that trained the step") == {
        float(c["step"]): str(c["restart"]) for c in lines}
    rows = re.findall(r"<tr><td>(\d)</td><td>[^<]+</td><td>(\d+)</td><td>(\d+|-)</td><td>([^<]*)</td></tr>", text)
    assert [r[0] for r in rows] == ["0", "1"] and {r[1] for r in rows} == {job}
    assert all("trainer@" in r[3] and "orchestrator@" in r[3] for r in rows), rows
    assert f"<summary>step {USR1_RUN_STEPS - 1}:" in text  # the trajectory view reads the Slurm run's batches too


def test_multi_turn_episode_shows_turns_tool_calls_outputs_and_versions(tmp_path):
    pytest.importorskip("tokenizers")
    from builders import make_run_dir

    from rl.contract import config
    from rl.contract.batch import RolloutBatch, Sample
    from rl.tiny_models.tiny import write_hf_assets
    run = tmp_path / "run"
    make_run_dir(run, "wandb.mode=disabled")
    cfg = config.load(run)
    exchange.publish(run, "assets", 0, lambda p: write_hf_assets(p, cfg.model), producer="test")
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(exchange.step_dir(run, "assets", 0) / "tokenizer.json"))

    def ids(text):
        return tok.encode(text, add_special_tokens=False).ids
    prompt = ids("<|im_start|>user\nfix the bug<|im_end|>\n<|im_start|>assistant\n")
    turn1 = ids('read the file <tool_call>{"name": "read_file", "arguments": {"path": "a.py"}}</tool_call><|im_end|>')
    obs = ids("\n<|im_start|>user\n<tool_response>def f(): return 1</tool_response><|im_end|>\n"
              "<|im_start|>assistant\n")
    turn2 = ids("submit<|im_end|>")
    # turn 1 generated by versions 3 and 4 (a weight update landed mid-turn), turn 2 by version 5
    vers1 = [3] * (len(turn1) // 2) + [4] * (len(turn1) - len(turn1) // 2)
    s = Sample(prompt, turn1 + obs + turn2, [-0.5] * (len(turn1) + len(obs) + len(turn2)),
               vers1 + [-1] * len(obs) + [5] * len(turn2), reward=0.75, group=0,
               completion_mask=[1] * len(turn1) + [0] * len(obs) + [1] * len(turn2))
    other = Sample(prompt, turn2, [-0.1] * len(turn2), [5] * len(turn2), reward=0.25, group=1)
    batch = RolloutBatch.from_samples([s, other], meta={"prompt_tokens": [len(prompt), len(prompt)]})
    exchange.publish(run, "rollouts", 5, batch.save, producer="test")
    text = _report(run, tmp_path / "r.html")
    _parse(text)
    assert "model turn 1" in text and "model turn 2" in text
    assert "observation / tool output" in text
    assert html.escape("<tool_response>def f(): return 1</tool_response>") in text
    assert "tool call: " + html.escape('{"name": "read_file", "arguments": {"path": "a.py"}}', quote=True) in text
    n = len(prompt)
    half = n + len(turn1) // 2
    for lo, hi, v in [(n, half - 1, 3), (half, n + len(turn1) - 1, 4)]:
        assert f'title="tokens {lo}..{hi}: policy version {v}, lag {5 - v}"' in text, (lo, hi, v)
    start2 = n + len(turn1) + len(obs)
    assert f'title="tokens {start2}..{start2 + len(turn2) - 1}: policy version 5, lag 0"' in text
    assert "reward <b>0.75</b>" in text and "reward <b>0.25</b>" in text
    assert "No <code>eval/...</code> rows" in text and "metrics.jsonl has no trainer steps yet" in text
