"""Context summarization end to end on the CPU: `+experiment=swe_debug` (the tiny model, a vLLM CPU server,
real SWE sandboxes) with `env.summarize_at_tokens` low enough that every episode summarizes twice. The run
completes and its batches, as read back from disk, hold one sample per context: three per episode,
consecutive, with the episode's reward, the later ones' prompts opening on the summary."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow]

from rl import exchange  # noqa: E402
from rl.contract.batch import RolloutBatch  # noqa: E402
from rl.orchestrator.multiturn import SUMMARY_HEADER  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_swe_episodes_summarized_twice_train_one_sample_per_context(tmp_path):
    run_dir = tmp_path / "run"
    # the SWE system prompt and task are ~960 tokens of the tiny tokenizer: the first threshold passes after
    # a turn or two, and the second right after the first summary's fresh context
    cmd = [sys.executable, "-m", "launch", "run", "+experiment=swe_debug", f"run_dir={run_dir}",
           f"inference.port={_free_port()}", "trainer.max_steps=1", "trainer.checkpoint_every=1",
           "env.max_turns=6", "env.summarize_at_tokens=[1000,1150]", "eval.every=0"]
    p = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=1500)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"the run did not finish:\n{out[-4000:]}")
    assert p.returncode == 0, out[-5000:]
    b = RolloutBatch.load(exchange.step_dir(run_dir, "rollouts", 0))
    seg = b.meta["segment"]
    episodes = seg.count(0)
    assert episodes == 4 and b.meta["summaries"] == 2 * episodes and seg == [0, 1, 2] * episodes
    assert b.meta["num_samples"] == 3 * episodes and b.meta["turns_per_episode_max"] <= 6
    for e in range(episodes):
        idx = [3 * e + k for k in range(3)]
        assert len({float(b.rewards[j]) for j in idx}) == 1 and len({float(b.advantages[j]) for j in idx}) == 1
        assert len({int(b.groups[j]) for j in idx}) == 1
        for j in idx:
            sl = b.sample_slice(j)
            m, v = b.loss_mask[sl], b.versions[sl]
            assert m.sum() > 0 and (v[m == 1] >= 0).all() and (v[m == 0] == -1).all()
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(exchange.step_dir(run_dir, "assets", 0) / "tokenizer.json"))
    for j in (1, 2):
        sl = b.sample_slice(j)
        prompt = b.tokens[sl][:b.meta["prompt_tokens"][j]]
        assert SUMMARY_HEADER.strip() in tok.decode(prompt.tolist(), skip_special_tokens=False)
    from rl.contract import paths
    assert paths.done_file(run_dir).exists()      # the trainer trained the step and finished
