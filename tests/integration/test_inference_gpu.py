"""GPU-only paths of rl.inference: FP8 shards loaded as FP8 (no dequantization), routed-expert capture.

Neither runs on the CPU machine (vLLM's block FP8 kernel needs AMX or CUDA >= 8.9; routed-expert
capture needs Model Runner V2), so these are skipped without CUDA. They start the real role from a run
directory made like the launcher makes it (one GPU replica on this machine), so the vLLM command,
including `--enable-return-routed-experts` when `trainer.router_replay` is on, is the plan's.
"""
from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from rl import exchange  # noqa: E402
from rl.contract import paths  # noqa: E402
from rl.contract.plan import expand  # noqa: E402
from rl.inference.server import materialize  # noqa: E402
from rl.model.tiny import write_hf_assets  # noqa: E402
from rl.orchestrator.client import InferenceClient  # noqa: E402
from test_inference_server import (MODEL, PROMPTS, _proc_argv_env, _publish_weights,  # noqa: E402
                                   make_run_dir, random_hf_state_dict, reference_logprobs, start_role,
                                   wait_server)

GPU = ["inference.gpus_per_node=1", "inference.dtype=bfloat16", "inference.gpu_memory_utilization=0.5"]


def _start(root, *overrides):
    run_dir, plan = make_run_dir(root, *GPU, *overrides)
    assets = exchange.publish(run_dir, "assets", 0, lambda d: write_hf_assets(d, MODEL), producer="test").path
    w0 = _publish_weights(run_dir, 0, random_hf_state_dict(assets, 1))
    out = root / "inference.out"
    proc = start_role(run_dir, plan, open(out, "w"))
    info = wait_server(run_dir, proc, 600, out)
    argv, env = _proc_argv_env(info.pid)
    assert argv == expand(plan.replica(0).vllm_argv(0), env)  # what runs is what was planned
    secret = paths.secret_file(run_dir).read_text().strip()
    return run_dir, plan, assets, w0, proc, info, secret


def _stop(run_dir, proc):
    exchange.atomic_write_json(run_dir / "DONE", {})
    proc.wait(120)


def test_fp8_direct_load_and_reload(tmp_path):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability >= 8.9")
    run_dir, plan, assets, w0, proc, info, secret = _start(tmp_path, "inference.fp8_load=fp8")
    try:
        assert info.fp8 is True
        ref0 = reference_logprobs(materialize(assets, w0, tmp_path / "ref0", dtype=torch.float32, fp8=False),
                                  PROMPTS)
        w1 = _publish_weights(run_dir, 1, random_hf_state_dict(assets, 2))
        ref1 = reference_logprobs(materialize(assets, w1, tmp_path / "ref1", dtype=torch.float32, fp8=False),
                                  PROMPTS)

        async def go():
            async with InferenceClient(info.url, secret=secret) as c:
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
    run_dir, plan, assets, w0, proc, info, secret = _start(tmp_path, "trainer.router_replay=true")
    try:
        assert "--enable-return-routed-experts" in plan.replica(0).vllm_command

        async def go():
            async with InferenceClient(info.url, secret=secret) as c:
                return await c.generate(PROMPTS[0], 8, temperature=1.0, seed=0, ignore_eos=True)

        comp = asyncio.run(go())
        rex = comp.routed_experts
        assert rex is not None
        assert rex.shape == (len(PROMPTS[0]) + len(comp.ids) - 1, MODEL.n_layers, MODEL.top_k)
        assert int(rex.max()) < MODEL.num_experts
    finally:
        _stop(run_dir, proc)
