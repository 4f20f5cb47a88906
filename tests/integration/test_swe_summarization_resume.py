"""Segmented episodes across a SIGKILL and `launch resume`, with real processes: `+experiment=swe_debug` (the
tiny model, a vLLM CPU server, real SWE sandboxes) with `env.summarize_at_tokens` low enough that episodes
summarize twice, every process SIGKILLed once the first step is trained, then the run resumed to its end.

What it checks is issue 40's "segments, rewards, versions and exactly-once accounting across a SIGKILL
and resume": benchmarks/_fault_checks.check, the fault trials' judge (consumed.jsonl's lineage and
sha256s, groups.jsonl against every batch's entries, the off-policy bound on every token, every step
hashed against its manifest, no process of the run left), and per batch file: each episode's samples are
its contexts in order (segment 0, 1, ...), consecutive, with one reward, advantage and group; trained
tokens carry a policy version within the bound, the others -1; a later context's prompt opens on the
summary; and the batches the resumed incarnation trained hold summarized episodes too.

Kept short: three steps of 2 tasks x 2 episodes, the kill after the first, no evaluation. Nothing timed
is asserted; the waits are bounded generously for a loaded 2-core machine.
"""
from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]

from rl import exchange  # noqa: E402
from rl.contract import paths  # noqa: E402
from rl.contract.batch import RolloutBatch  # noqa: E402
from rl.metrics import read_metrics  # noqa: E402
from rl.orchestrator.multiturn import SUMMARY_HEADER  # noqa: E402
from test_local_run import _finish, _kill_everything, _launch  # noqa: E402

STEPS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _episodes(segment: list[int]) -> list[list[int]]:
    """Sample indices of each episode: a segment-0 sample and the continuations after it."""
    out: list[list[int]] = []
    for j, k in enumerate(segment):
        if k == 0:
            out.append([j])
        else:
            assert out and k == len(out[-1]), f"sample {j} is segment {k} after {out[-1] if out else 'nothing'}"
            out[-1].append(j)
    return out


def test_segmented_swe_run_sigkilled_and_resumed_trains_every_episode_once(tmp_path):
    import _fault_checks
    from _fault_trial import Trial
    from tokenizers import Tokenizer
    from rl.contract.config import load
    run_dir = tmp_path / "run"
    # the SWE system prompt and task are ~960 tokens of the tiny tokenizer: the first threshold passes after
    # a turn or two and the second right after the first summary's fresh context (test_swe_summarization)
    p = _launch(run_dir, "+experiment=swe_debug", f"inference.port={_free_port()}", f"trainer.max_steps={STEPS}",
                "trainer.checkpoint_every=1", "env.max_turns=6", "env.summarize_at_tokens=[1000,1150]",
                "eval.every=0", "orchestrator.drain_timeout_s=5")
    deadline = time.monotonic() + 1200
    while not read_metrics(run_dir):
        assert p.poll() is None, p.communicate()[0][-4000:]
        assert time.monotonic() < deadline, "the run did not train its first step in 20 minutes"
        time.sleep(0.5)
    servers = _kill_everything(p, run_dir)
    killed_at = len(read_metrics(run_dir))
    assert servers and killed_at < STEPS, (servers, killed_at)
    _finish(_launch(run_dir, resume=True), timeout=1500)

    cfg = load(run_dir)
    trial = Trial(index=0, kind="kill_all", max_off_policy=int(cfg.orchestrator.max_off_policy), run_dir=run_dir,
                  steps=STEPS)
    trial.incarnations = [-9, 0]
    _fault_checks.check(trial, None)
    assert not trial.failures, trial.failures
    resume = json.loads((run_dir / "resume.json").read_text())
    assert resume["restart"] == 1 and resume["checkpoint_step"] is not None and resume["checkpoint_step"] <= killed_at
    resumed = [e["step"] for e in exchange.ConsumedLog(run_dir, "rollouts", "trainer").entries() if e.get("restart") == 1]
    assert resumed == list(range(resume["checkpoint_step"], STEPS)), resumed

    tok = Tokenizer.from_file(str(exchange.step_dir(run_dir, "assets", 0) / "tokenizer.json"))
    G, k = int(cfg.orchestrator.group_size), int(cfg.orchestrator.max_off_policy)
    segmented_after_resume = 0
    for n in range(STEPS):
        b = RolloutBatch.load(exchange.step_dir(run_dir, paths.ROLLOUTS, n))
        meta = b.meta
        assert "segment" in meta, f"step {n}: no episode was summarized"
        eps = _episodes(meta["segment"])
        # one entry per rollout (segment 0), all of an episode's contexts in its batch
        assert sum(len(idx) for _, idx in meta["entries"]) == len(eps) == meta["episodes"], n
        assert meta["num_samples"] == len(meta["segment"]) and meta["summaries"] >= meta["num_samples"] - len(eps)
        for idx in eps:
            for f in ("rewards", "advantages", "groups"):
                assert len({float(getattr(b, f)[j]) for j in idx}) == 1, (n, idx, f)
            for j in idx:
                sl = b.sample_slice(j)
                m, v = b.loss_mask[sl], b.versions[sl]
                assert m.sum() > 0, (n, j)
                assert (v[m == 1] >= max(n - k, 0)).all() and (v[m == 1] <= n).all(), (n, j, sorted(set(v[m == 1])))
                assert (v[m == 0] == -1).all(), (n, j)
            for j in idx[1:]:   # a continuation's prompt opens the fresh context on the summary
                prompt = b.tokens[b.sample_slice(j)][:meta["prompt_tokens"][j]]
                assert SUMMARY_HEADER.strip() in tok.decode(prompt.tolist(), skip_special_tokens=False), (n, j)
        if n >= resume["checkpoint_step"]:
            segmented_after_resume += sum(len(idx) >= 3 for idx in eps)
        assert len(eps) == cfg.orchestrator.prompts_per_step * G, (n, len(eps))
    assert segmented_after_resume, "no episode summarized twice in the batches trained after the resume"
    print(f"killed after {killed_at} step(s), resumed from checkpoint {resume['checkpoint_step']}; started, trained, "
          f"dropped groups {trial.groups}; episodes summarized twice after the resume: {segmented_after_resume}")
    # a drained or stale-cancelled group's drop line counts the contexts its episodes had closed
    for e in exchange.read_jsonl(run_dir / paths.ROLLOUTS / "groups.jsonl"):
        if e.get("event") == "drop" and "segments" in e:
            assert 0 < e["segments"] <= 2 * G and e["segment_tokens"] > 0, e
    assert paths.done_file(run_dir).exists()
