"""Multi-turn SWE rollouts against a real vLLM CPU server.

1. `python -m launch run +experiment=swe_debug` end to end: it completes its steps and logs per-turn
   metrics; every published rollout batch is multi-turn shaped (observation tokens inside samples,
   masked, version -1).
2. The token ids of multi-turn rollouts in the trained batch (as saved to and loaded from disk) are the
   ids the server generated, each in the exact context it was generated in: checked against the HTTP
   traffic itself, recorded below our client (httpx event hooks), not against our parsed view of it.

The server of 2. is started before 1. (`_booting_server`, module scope, which 1. requests too) and boots
while 1. runs: a vLLM CPU start-up is most of 2.'s time, and 1.'s run leaves a core idle for much of its
own. The two share nothing but the machine: separate run dirs, and 1.'s port picked apart from 2.'s.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow]

from omegaconf import OmegaConf  # noqa: E402

from rl.contract.atomic import atomic_write_json  # noqa: E402
from rl import exchange  # noqa: E402
from rl.metrics import read_metrics  # noqa: E402
from rl.contract.batch import RolloutBatch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PER_TURN = ("turns_per_episode", "tokens_per_turn", "tool_calls", "tool_errors", "turn_env_s", "turn_gen_s",
            "env_time_fraction", "episode_tokens_mean", "obs_tokens_per_turn")


def test_swe_debug_experiment_runs_end_to_end(tmp_path, _booting_server):
    run_dir = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "launch", "run", "+experiment=swe_debug", f"run_dir={run_dir}",
           f"inference.port={_free_port(avoid=_booting_server['port'])}"]
    p = subprocess.Popen(cmd,
                         cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=1500)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"swe_debug did not finish:\n{out[-4000:]}")
    assert p.returncode == 0, out[-5000:]
    print(f"swe_debug: {time.monotonic() - t0:.0f} s")
    cfg = OmegaConf.load(run_dir / "config.yaml")
    steps = int(cfg.trainer.max_steps)
    assert cfg.env.name == "swe" and steps == 3
    assert cfg.env.swe.tasks == "builtin_swebench"  # SWE-bench rows over git repositories
    ms = read_metrics(run_dir)
    assert [m["step"] for m in ms] == list(range(steps))
    for m in ms:
        for k in PER_TURN:
            assert f"orchestrator/{k}" in m, k
        assert 1 <= m["orchestrator/turns_per_episode"] <= cfg.env.max_turns
        assert m["orchestrator/episodes"] == cfg.orchestrator.prompts_per_step * cfg.orchestrator.group_size
        assert 0 <= m["reward_mean"] <= 1
    for s in range(steps):
        b = RolloutBatch.load(exchange.step_dir(run_dir, "rollouts", s))
        assert b.num_samples == cfg.orchestrator.prompts_per_step * cfg.orchestrator.group_size
        assert np.all(b.versions[b.loss_mask == 0] == -1) and np.all(b.logprobs[b.loss_mask == 0] == 0)
        assert np.all(b.versions[b.loss_mask == 1] >= 0)
        lengths = np.diff(b.offsets)
        assert lengths.max() <= cfg.inference.max_model_len
        multi = [i for i in range(b.num_samples)
                 if np.any(np.diff(b.loss_mask[b.sample_slice(i)].astype(int)) == -1)]  # model turn, then env
        assert multi or b.meta["turns_per_episode"] == 1
    assert (run_dir / "DONE").exists()


# --- token ids kept exact, checked against the wire ----------------------------------------------------
def _free_port(avoid: int | None = None) -> int:
    """A free port, never `avoid` (a port another server of this module may not have bound yet)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port != avoid:
            return port


@pytest.fixture(scope="module")
def _booting_server(tmp_path_factory):
    """A run dir with assets and the trainer's own random initial weights, and `python -m rl.inference`
    started on them; not awaited (`server` waits for it). Stopped when the module ends."""
    from rl.tiny_models.tiny import write_hf_assets
    from rl.trainer.train import Trainer

    root = tmp_path_factory.mktemp("mt")
    from builders import make_run_dir
    from rl.contract.config import load
    run_dir = root / "run"
    port = _free_port()
    make_run_dir(run_dir, "model.max_seq_len=2048", "inference.max_model_len=2048",
                 f"inference.port={port}", "inference.startup_timeout_s=500",
                 f"cluster.node_local_dir={root / 'node_local'}", "wandb.mode=disabled")
    (run_dir / "secret").unlink()  # the test's client talks to the server without the run's token
    cfg = load(run_dir)
    exchange.publish(run_dir, "assets", 0, lambda d: write_hf_assets(d, cfg.model), producer="test")
    tr = Trainer(cfg)
    tr.publish_weights(run_dir, 0)
    tr.wait_published()
    log = open(root / "inference.out", "w")
    proc = subprocess.Popen([sys.executable, "-m", "rl.inference", "--run-dir", str(run_dir)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO), "HETRL_UNAUTHENTICATED": "1"},
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        yield {"run_dir": run_dir, "cfg": cfg, "proc": proc, "root": root, "port": port,
               "started": time.monotonic()}
    finally:
        atomic_write_json(run_dir / "DONE", {})
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        log.close()


@pytest.fixture(scope="module")
def server(_booting_server):
    """The booting server, awaited: {run_dir, cfg, url} once its record is written."""
    b = _booting_server
    info = b["run_dir"] / "inference" / "server_0.json"
    while not info.exists():
        assert b["proc"].poll() is None, (b["root"] / "inference.out").read_text()[-3000:]
        assert time.monotonic() - b["started"] < 550, "server did not come up"
        time.sleep(1)
    return {"run_dir": b["run_dir"], "cfg": b["cfg"], "url": json.loads(info.read_text())["url"]}


def test_multiturn_ids_in_the_trained_batch_equal_the_servers(server, tmp_path):
    from transformers import AutoTokenizer

    from rl.envs.swe.env import EnvConfig, SWEEnv
    from rl.orchestrator.client import InferenceClient
    from rl.orchestrator.multiturn import ChatBridge, RolloutLimits, run_episode

    run_dir = server["run_dir"]
    tok = AutoTokenizer.from_pretrained(str(exchange.step_dir(run_dir, "assets", 0)))
    env = SWEEnv(config=EnvConfig(max_turns=4, output_chars=300, tool_timeout_s=30))
    limits = RolloutLimits(max_turns=4, max_tokens_per_turn=40, max_total_tokens=2048)
    wire: list[tuple[dict, dict]] = []  # (request body, response body) of every generate call

    async def on_request(request):
        # the client may stream a body and let its bytes go once sent: read here, the request keeps them
        if request.url.path.endswith("/inference/v1/generate"):
            await request.aread()

    async def on_response(response):
        if response.request.url.path.endswith("/inference/v1/generate"):
            await response.aread()
            wire.append((json.loads(response.request.content), response.json()))

    async def main():
        client = InferenceClient(server["url"])
        client._http.event_hooks["request"].append(on_request)
        client._http.event_hooks["response"].append(on_response)
        try:
            async def generate(ids, max_tokens, turn):
                c = await client.generate(ids, max_tokens=max_tokens, temperature=1.0, seed=1000 + len(wire))
                return c, c.versions
            tasks = env.tasks[:2]
            return await asyncio.gather(*(run_episode(env, t, generate, ChatBridge(tok), limits)
                                          for t in tasks for _ in range(2)))
        finally:
            await client.aclose()

    rollouts = asyncio.run(main())
    samples = [r.sample(i) for i, r in enumerate(rollouts)]
    out = tmp_path / "batch"
    out.mkdir()
    RolloutBatch.from_samples(samples).save(out)
    batch = RolloutBatch.load(out)  # what the trainer reads
    seqs = [batch.tokens[batch.sample_slice(i)].tolist() for i in range(batch.num_samples)]
    masks = [batch.loss_mask[batch.sample_slice(i)].tolist() for i in range(batch.num_samples)]
    lps = [batch.logprobs[batch.sample_slice(i)] for i in range(batch.num_samples)]
    vers = [batch.versions[batch.sample_slice(i)].tolist() for i in range(batch.num_samples)]
    assert len(wire) == sum(len(r.turns) for r in rollouts) and len(wire) > len(rollouts)  # multi-turn
    covered = [np.zeros(len(s), bool) for s in seqs]
    for req, resp in wire:
        prompt = req["token_ids"]
        ch = resp["choices"][0]
        gen = ch["token_ids"]
        # the sample this request belongs to: its sequence starts with the request's prompt and continues
        # with the response (several rollouts of one task share the first prompt, not the continuation)
        a, b = len(prompt), len(prompt) + len(gen)
        hits = [i for i, s in enumerate(seqs)
                if s[:a] == prompt and s[a:b] == gen and not covered[i][a:b].any()]
        assert hits, "a generated turn is not in the batch, in the context it was generated in"
        i = hits[0]
        assert masks[i][a:b] == [1] * len(gen)
        wire_lps = [c["logprob"] for c in ch["logprobs"]["content"]]
        np.testing.assert_allclose(lps[i][a:b], np.asarray(wire_lps, np.float32), rtol=0, atol=1e-6)
        assert vers[i][a:b] == [0] * len(gen)  # the server's weight_versions spans: version 0
        covered[i][a:b] = True
    for i in range(len(seqs)):  # every trained token came from the server, every other one is masked
        assert [bool(m) for m in masks[i]] == covered[i].tolist()
        assert all(v == -1 for v, m in zip(vers[i], masks[i]) if not m)
    print(f"{len(wire)} server turns over {len(rollouts)} rollouts, "
          f"{sum(int(c.sum()) for c in covered)} generated tokens checked")
