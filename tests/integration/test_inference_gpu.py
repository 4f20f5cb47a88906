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

from rl.contract.atomic import atomic_write_json  # noqa: E402
from rl import exchange  # noqa: E402
from rl.contract import paths  # noqa: E402
from rl.contract.plan import expand  # noqa: E402
from rl.inference.model_dir import materialize  # noqa: E402
from rl.tiny_models.tiny import write_hf_assets  # noqa: E402
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
    atomic_write_json(run_dir / "DONE", {})
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


# -- FP8 published shards of real families, served natively in FP8 -------------------------------------
# Twin sizes vLLM's block-FP8 layers accept (vllm/model_executor/layers/quantization/fp8.py and
# utils/fp8_utils.py, vllm 0.32): a fused MoE's moe_intermediate_size must be a multiple of block_n=128
# (validate_fp8_block_shape_moe), and every part but the last of a merged GEMM too (qkv_proj: heads *
# head_dim and kv_heads * head_dim; gate_up_proj: intermediate_size; DeepSeek's fused_qkv_a_proj:
# q_lora_rank). GLM-5's sparse MLA on the GPU wants DeepSeek's latent size (512 + 64) and the indexer's
# head_dim of 128, as in the real checkpoint.
GPU_TWIN_SIZES = {
    "qwen3": dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                  moe_intermediate_size=128, intermediate_size=128),
    "kimi_k2_7": dict(q_lora_rank=128, moe_intermediate_size=128, intermediate_size=128),
    "glm_moe_dsa": dict(q_lora_rank=128, kv_lora_rank=512, qk_rope_head_dim=64, moe_intermediate_size=128,
                        intermediate_size=128, index_head_dim=128, index_n_heads=32, index_topk=128),
}


def _start_twin(root, family, fp8_load, twin):
    from test_inference_mla import copy_assets, twin_state_dict
    from rl.exchange.weights import write_shards

    run_dir, plan = make_run_dir_hf(root, f"model.hf_path={twin}", f"model.family={family}",
                                    f"inference.fp8_load={fp8_load}")
    assets = exchange.publish(run_dir, "assets", 0, lambda d: copy_assets(twin, d), producer="test").path
    sd = twin_state_dict(twin)  # the publisher's default FP8 choice (GLM's indexer weights_proj kept bf16)
    w0 = exchange.publish(run_dir, "weights", 0, lambda d: write_shards(d, sd),
                          producer="test", policy_version=0).path
    out = root / "inference.out"
    proc = start_role(run_dir, plan, open(out, "w"))
    info = wait_server(run_dir, proc, 600, out)
    return run_dir, plan, assets, w0, proc, info, paths.secret_file(run_dir).read_text().strip()


def make_run_dir_hf(root, *overrides):
    """make_run_dir for an hf_path twin (test_inference_server's asserts the default model)."""
    from launch.compose import compose
    from launch.plan import make_plan
    from launch.rundir import freeze_run_dir
    from rl.contract.plan import Plan
    from test_inference_server import _free_port

    run_dir = root / "run"
    cfg = compose([f"run_dir={run_dir}", f"inference.port={_free_port()}", "wandb.mode=disabled",
                   f"cluster.node_local_dir={root / 'node_local'}", *GPU_HALF, *overrides])
    freeze_run_dir(cfg, run_dir, make_plan(cfg), backend="local")
    return run_dir, Plan.read(run_dir)


# two engines side by side on one GPU
GPU_HALF = ["inference.gpus_per_node=1", "inference.dtype=bfloat16", "inference.gpu_memory_utilization=0.3"]


@pytest.mark.parametrize("family", ["qwen3", "kimi_k2_7", "glm_moe_dsa"])
def test_fp8_shards_of_family_load_natively(tmp_path, family):
    """The twin of `family`, published as the trainer publishes (FP8 e4m3 128x128 + `_scale_inv`),
    materialised with fp8=True (its config.json's quantization_config derived by
    `rl.inference.model_dir.fp8_quant_config`: the modules fp8.json kept in bf16, e.g. embed_tokens, lm_head,
    the router gate, in its ignore list) and served by the plan's vLLM command with fp8_load=fp8.

    Checks: (1) the engine loads it natively in FP8: the model config's quantization is "fp8", linear
    layers run `Fp8LinearMethod` and the experts `Fp8MoEMethod`, and float8_e4m3fn weights are held
    (worker extension `quantization_report`); the bf16 router gate / embeddings load unquantized (a gate
    built with the FP8 config would need a `weight_scale_inv` the shards do not have, and loading would
    fail). (2) A second engine started from the same published step with fp8_load=dequantize (bf16,
    no quantization) gives prompt logprobs close to the FP8 engine's: mean |diff| below 0.05 nats
    (FP8 activations vs bf16 activations on the same dequantized weights; two random twins differ by
    far more). For glm_moe_dsa this is the sparse-attention (DSA indexer) path, which has no CPU kernel.
    """
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability >= 8.9")
    from rl.tiny_models.twins import write_twin

    twin = write_twin(tmp_path / "twin", family, seed=0, sizes=GPU_TWIN_SIZES[family])
    started = []
    try:
        for mode in ("fp8", "dequantize"):
            (tmp_path / mode).mkdir()
            started.append(_start_twin(tmp_path / mode, family, mode, twin))

        async def measure(info, secret):
            async with InferenceClient(info.url, secret=secret) as c:
                rep = (await c._post("/collective_rpc", {"method": "quantization_report"}))["results"][0]
                return rep, [await c.prompt_logprobs(p) for p in PROMPTS]

        (_, _, _, _, _, info8, s8), (_, _, _, _, _, info16, s16) = started
        assert info8.fp8 is True and info16.fp8 is False
        rep8, lp8 = asyncio.run(measure(info8, s8))
        rep16, lp16 = asyncio.run(measure(info16, s16))
        assert rep8["quantization"] == "fp8", rep8
        assert rep8["methods"].get("Fp8LinearMethod", 0) > 0 and rep8["methods"].get("Fp8MoEMethod", 0) > 0, rep8
        assert rep8["weight_dtypes"].get("float8_e4m3fn", 0) > 0, rep8
        assert rep16["quantization"] is None and "float8_e4m3fn" not in rep16["weight_dtypes"], rep16
        for a, b in zip(lp8, lp16):
            assert (torch.tensor(a) - torch.tensor(b)).abs().mean() < 0.05
    finally:
        for run_dir, _, _, _, proc, _, _ in started:
            _stop(run_dir, proc)
