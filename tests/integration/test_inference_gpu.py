"""GPU-only paths of rl.inference: FP8 shards loaded as FP8 (no dequantization), routed-expert capture.

Neither runs on the CPU machine (vLLM's block FP8 kernel needs AMX or CUDA >= 8.9; routed-expert
capture needs Model Runner V2), so these are skipped without CUDA; they start the real server.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from omegaconf import OmegaConf  # noqa: E402

from launch.config import ClusterConfig, InferenceConfig  # noqa: E402
from rl import exchange  # noqa: E402
from rl.inference.client import InferenceClient  # noqa: E402
from rl.inference.server import materialize  # noqa: E402
from rl.model.tiny import write_hf_assets  # noqa: E402
from test_inference_server import (MODEL, PROMPTS, REPO, _free_port, _publish_weights,  # noqa: E402
                                   random_hf_state_dict, reference_logprobs)


def _start(root, extra_args=(), fp8_load="auto"):
    run_dir = root / "run"
    run_dir.mkdir()
    icfg = OmegaConf.structured(InferenceConfig(port=_free_port(), dtype="bfloat16", fp8_load=fp8_load,
                                                enforce_eager=True, extra_args=list(extra_args)))
    OmegaConf.save(OmegaConf.create({"run_dir": str(run_dir), "model": MODEL, "inference": icfg,
                                     "cluster": OmegaConf.structured(
                                         ClusterConfig(node_local_dir=str(root / "nl")))}),
                   run_dir / "config.yaml")
    assets = exchange.publish(run_dir, "assets", 0, lambda d: write_hf_assets(d, MODEL), producer="test").path
    sd = random_hf_state_dict(assets, 1)
    w0 = _publish_weights(run_dir, 0, sd)
    proc = subprocess.Popen([sys.executable, "-m", "rl.inference", "--run-dir", str(run_dir)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    info = run_dir / "inference" / "server_0.json"
    t0 = time.monotonic()
    while not info.exists():
        assert proc.poll() is None and time.monotonic() - t0 < 600
        time.sleep(1)
    return run_dir, assets, w0, proc, json.loads(info.read_text())


def _stop(run_dir, proc):
    exchange.atomic_write_json(run_dir / "DONE", {})
    proc.wait(120)


def test_fp8_direct_load_and_reload(tmp_path):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability >= 8.9")
    run_dir, assets, w0, proc, info = _start(tmp_path, fp8_load="fp8")
    try:
        assert info["fp8"] is True
        ref0 = reference_logprobs(materialize(assets, w0, tmp_path / "ref0", dtype=torch.float32, fp8=False),
                                  PROMPTS)
        w1 = _publish_weights(run_dir, 1, random_hf_state_dict(assets, 2))
        ref1 = reference_logprobs(materialize(assets, w1, tmp_path / "ref1", dtype=torch.float32, fp8=False),
                                  PROMPTS)

        async def go():
            async with InferenceClient(info["url"]) as c:
                fresh = [await c.prompt_logprobs(p) for p in PROMPTS]
                r = await c.update_weights(str(w1), 1)
                after = [await c.prompt_logprobs(p) for p in PROMPTS]
                return fresh, r, after

        fresh, r, after = asyncio.run(go())
        assert r["loaded"] and r["version"] == 1
        # FP8 activations + bf16: loose, but far tighter than the gap between two random models
        for got, ref in zip(fresh, ref0):
            assert (torch.tensor(got) - torch.tensor(ref)).abs().mean() < 0.05
        for got, ref in zip(after, ref1):
            assert (torch.tensor(got) - torch.tensor(ref)).abs().mean() < 0.05
    finally:
        _stop(run_dir, proc)


def test_routed_experts_are_returned(tmp_path):
    run_dir, assets, w0, proc, info = _start(tmp_path, extra_args=["--enable-return-routed-experts"])
    try:
        async def go():
            async with InferenceClient(info["url"]) as c:
                return await c.generate(PROMPTS[0], 8, temperature=1.0, seed=0, ignore_eos=True)

        comp = asyncio.run(go())
        rex = comp.routed_experts
        assert rex is not None
        assert rex.shape == (len(PROMPTS[0]) + len(comp.ids) - 1, MODEL.n_layers, MODEL.top_k)
        assert int(rex.max()) < MODEL.num_experts
    finally:
        _stop(run_dir, proc)
