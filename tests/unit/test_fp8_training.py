"""Block-scaled FP8 training (emulated on the CPU): GEMM numerics, STE gradients, bit-exact publishing,
for every family (qwen3 GQA, DeepSeek-V3/Kimi MLA, GLM-5 MLA + DSA indexer)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rl import exchange, fp8
from rl.exchange import layout
from rl.exchange import weights as wire
from rl.trainer import fp8 as fp8_training
from rl.trainer.loop import run
from rl.trainer.train import Trainer

from helpers.trainer import examples, fp8_hf_names, publish_batches, synthetic_batch, tiny_cfg


def test_fp8_gemm_is_the_block_quantized_product_with_straight_through_grads():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 160, generator=g, requires_grad=True)   # K = 160: a ragged second 1x128 tile
    w = torch.randn(200, 160, generator=g, requires_grad=True)    # ragged 128x128 blocks both ways
    y = fp8_training.gemm(x, w)
    xq, wq = fp8.fake_quantize_act(x.detach()), fp8.fake_quantize_block(w.detach())
    assert torch.equal(y, F.linear(xq, wq))
    assert not torch.equal(xq, x) and not torch.equal(wq, w)  # really quantized
    gy = torch.randn(y.shape, generator=g)
    y.backward(gy)
    torch.testing.assert_close(x.grad, gy @ wq, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, gy.reshape(-1, 200).T @ xq.reshape(-1, 160), rtol=1e-5, atol=1e-5)


def test_fused_qkv_is_quantized_as_the_separate_hf_tensors():
    n_kv, hpk, hd, d = 2, 3, 48, 64   # 48-row heads: 128-row blocks of the fused matrix would mix q/k/v
    w = torch.randn(n_kv * (hpk + 2) * hd, d, generator=torch.Generator().manual_seed(1))
    got = fp8_training.weight_fp8(w, (n_kv, hpk, hd)).reshape(n_kv, hpk + 2, hd, d)
    v = w.reshape(n_kv, hpk + 2, hd, d)
    assert torch.equal(got[:, :hpk].reshape(-1, d), fp8.fake_quantize_block(v[:, :hpk].reshape(-1, d)))
    assert torch.equal(got[:, hpk].reshape(-1, d), fp8.fake_quantize_block(v[:, hpk].reshape(-1, d)))
    assert torch.equal(got[:, hpk + 1].reshape(-1, d), fp8.fake_quantize_block(v[:, hpk + 1].reshape(-1, d)))
    assert not torch.equal(fp8_training.weight_fp8(w, (n_kv, hpk, hd)), fp8.fake_quantize_block(w))


def test_debug_experiment_trains_with_fp8(tmp_path):
    """The debug model (conf defaults) through the trainer role with trainer.fp8=true."""
    publish_batches(tmp_path, range(2))
    cfg = tiny_cfg(tmp_path, max_steps=2, fp8=True)
    assert run(tmp_path, cfg, examples=examples, poll=0.01) == 0
    from rl.metrics import read_metrics
    ms = read_metrics(tmp_path)
    assert [m["step"] for m in ms] == [0, 1]
    assert all(torch.isfinite(torch.tensor(m["loss"])) and m["grad_norm"] > 0 for m in ms)

    # the FP8 GEMMs are really in the forward: same init, same batch, other loss than fp32
    a, b = Trainer(tiny_cfg(tmp_path, fp8=True)), Trainer(tiny_cfg(tmp_path))
    names = [n for n, _ in fp8_training.fp8_modules(a.model)]
    assert any(n.endswith("wqkv") for n in names) and any(n.endswith("wo") for n in names)
    assert any(n.endswith("inner_experts") for n in names)
    batch = synthetic_batch(0)
    ma, mb = a.train_step(batch, 0), b.train_step(batch, 0)
    assert ma["loss"] != mb["loss"] and ma["loss"] == pytest.approx(mb["loss"], rel=0.2, abs=1e-2)


# -- every family: the FP8 GEMMs are the publisher's FP8 tensors ------------------------------------------
FAMILIES = ["qwen3", "kimi_k2_7", "glm_moe_dsa"]
MLA = ["kimi_k2_7", "glm_moe_dsa"]


def _weights_proj(names) -> set[str]:
    return {n for n in names if n.endswith("indexer.weights_proj.weight")}


def _glm5_fp8_ignores(src: Path, dst: Path) -> Path:
    """The GLM twin with the ignore list of GLM-5's FP8 release (indexer.weights_proj unquantized) in
    the quantization_config of its config.json (the weights stay fp32: the loader reads them as they are).
    Made once per `dst`."""
    import shutil
    if dst.is_dir():
        return dst
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        "modules_to_not_convert": [f"model.layers.{i}.self_attn.indexer.weights_proj"
                                   for i in range(cfg["num_hidden_layers"])]}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _from_twin(path: Path, family: str):
    from rl.trainer import hf_load
    from rl.trainer.model import build_model, materialize_empty
    b = build_model(dict(name="t", family=family, hf_path=str(path), max_seq_len=128), seed=0,
                    materialize=False, fp8=True)
    materialize_empty(b.model, "cpu")
    hf_load.load(b.model, b.spec, path)
    return b


def _publisher_fp8(path: Path, tensors) -> set[str]:
    """What Trainer.publish_weights stores as FP8 for a run started from checkpoint `path`."""
    from rl.contract import hf
    quantize = layout.quantize_except(hf.ignored_modules(hf.read_config(path)))
    return {n for n, t in tensors.items() if quantize(n, t)}


@pytest.mark.parametrize("family", FAMILIES + ["deepseek_v3"])
def test_every_weight_the_publisher_quantizes_is_an_fp8_gemm(tmp_path, twin, family):
    from rl.tiny_models.twins import write_twin
    from rl.models.common import hf_state_dict
    path = (write_twin(tmp_path / "ds", family, sizes=dict(q_lora_rank=None))  # HF q_proj, torchtitan wq
            if family == "deepseek_v3" else twin(family))
    b = _from_twin(path, family)
    sd = hf_state_dict(b)
    covered, published = fp8_hf_names(b), _publisher_fp8(path, sd)
    if family == "glm_moe_dsa":
        # weights_proj stays high precision in the trainer and the publisher (vLLM needs it so), with or
        # without an ignore list naming it as GLM-5's FP8 release does
        assert len(_weights_proj(sd)) == 3 and not _weights_proj(published)
        assert _publisher_fp8(_glm5_fp8_ignores(path, tmp_path / "glm_fp8"), sd) == published
        assert any(".indexer.wq_b." in n for n in covered) and any(".indexer.wk." in n for n in covered)
    assert covered == published
    if family != "qwen3":
        q = ["q_proj"] if family == "deepseek_v3" else ["q_a_proj", "q_b_proj"]
        for part in q + ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "layers.0.mlp.gate_proj",
                         "layers.0.mlp.down_proj", "shared_experts.up_proj", "mlp.experts.7.down_proj"]:
            assert any(part in n for n in covered), part
    high = set(sd) - covered   # norms, embeddings, LM head, the router gate and its bias correction
    assert all(k in ("model.embed_tokens.weight", "lm_head.weight") or "norm" in k or ".mlp.gate." in k
               or k.endswith("weights_proj.weight") for k in high), high
    if family != "qwen3":
        assert any(k.endswith("mlp.gate.e_score_correction_bias") for k in high)


def _trainer(tmp_path, twin, family, fp8_on: bool = True) -> Trainer:
    if family == "qwen3":  # the debug model (conf defaults)
        return Trainer(tiny_cfg(tmp_path, fp8=fp8_on))
    from omegaconf import OmegaConf
    from builders import compose_cfg
    path = twin(family)
    if family == "glm_moe_dsa":  # beside the run dir: a run dir holds only what hetrl puts there
        path = _glm5_fp8_ignores(path, tmp_path.with_name(tmp_path.name + "-glm_fp8"))
    return Trainer(OmegaConf.create(compose_cfg(
        tmp_path, f"model.hf_path={path}", f"model.family={family}", f"trainer.fp8={str(fp8_on).lower()}",
        "trainer.lr=1e-2", "trainer.warm_start.steps=0")))


@pytest.mark.parametrize("family", FAMILIES)
def test_published_shard_dequantizes_to_the_trainers_fp8_weights(tmp_path, twin, family):
    tr = _trainer(tmp_path, twin, family)
    tr.train_step(synthetic_batch(0), 0)
    tr.publish_weights(tmp_path, 1)
    tr.wait_published()
    path = exchange.step_dir(tmp_path, "weights", 1)
    got = dict(wire.iter_tensors(path, dequantize=True))
    ours = fp8_training.trainer_fp8_state_dict(tr.built)     # what the trainer's GEMMs multiply by
    master = tr.full_hf_state_dict()
    quantized = set(json.loads((path / layout.FP8_META).read_text())["quantized"])
    assert got.keys() == ours.keys() == master.keys()
    # the trainer computes in FP8 exactly where the shard stores FP8 ...
    trained_fp8 = {k for k in ours if not torch.equal(ours[k], master[k])}
    assert trained_fp8 == quantized
    assert any(".mlp.experts." in q for q in quantized)
    assert any(("k_proj" if family == "qwen3" else "kv_a_proj_with_mqa") in q for q in quantized)
    if family == "glm_moe_dsa":  # the start checkpoint's ignore list is followed by the publisher
        assert not _weights_proj(quantized) and any(".indexer.wk." in q for q in quantized)
    # ... and inference dequantizes to those values bit for bit (the rest: the trainer's fp32)
    for name in ours:
        assert torch.equal(got[name], ours[name]), name


@pytest.mark.parametrize("family", MLA)
def test_mla_family_trains_with_fp8(tmp_path, twin, family):
    """One step with FP8 on: loss finite, every FP8 master gets a gradient through the STE (the DSA
    indexer none, as in HF), and the FP8 GEMMs are in the forward (same start, same batch, other loss)."""
    a, b = _trainer(tmp_path, twin, family), _trainer(tmp_path, twin, family, fp8_on=False)
    batch = synthetic_batch(0)
    ma, mb = a.train_step(batch, 0), b.train_step(batch, 0)
    assert math.isfinite(ma["loss"]) and ma["grad_norm"] > 0
    assert ma["loss"] != mb["loss"] and ma["loss"] == pytest.approx(mb["loss"], rel=0.2, abs=1e-2)
    mods = dict(fp8_training.fp8_modules(a.model))
    assert any(n.endswith("attention.wkv_a") for n in mods) and any("shared_experts" in n for n in mods)
    for name, m in mods.items():
        for pname, p in m.named_parameters():
            if ".indexer." in name:
                assert p.grad is None, name
            else:
                assert p.grad is not None and p.grad.abs().sum() > 0, f"{name}.{pname}"


def test_unknown_attention_is_a_named_not_implemented_error():
    """Neither GQA nor a known MLA: an error naming the type, never projections left in high precision
    (a subclass of MLA's config is unknown too: it may carry projections of its own)."""
    from dataclasses import dataclass
    from types import SimpleNamespace
    from torchtitan.models.deepseek_v3.model import Attention as MLA

    @dataclass(kw_only=True, slots=True)
    class OtherMLA(MLA.Config):
        pass

    class OddAttention:
        pass
    for att in (OddAttention(), OtherMLA.__new__(OtherMLA)):
        with pytest.raises(NotImplementedError, match=f"FP8 for attention {type(att).__name__} "):
            fp8_training.apply(SimpleNamespace(layers=[SimpleNamespace(attention=att)]))


@pytest.mark.gpu
def test_real_fp8_gemm_on_gpu_matches_the_emulation():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU with FP8 (sm89+)")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 512, device="cuda", generator=g, requires_grad=True)
    w = torch.randn(384, 512, device="cuda", generator=g, requires_grad=True)
    y = fp8_training.gemm(x, w)                        # torch._scaled_mm, block scales
    ref = fp8_training.emulated_gemm(x.detach(), w.detach())
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)   # bf16 output rounding
    y.float().sum().backward()
    assert x.grad is not None and w.grad is not None and torch.isfinite(w.grad).all()


@pytest.mark.parametrize("m,k,n", [(96, 128, 336), (7, 384, 256), (256, 512, 384), (4096, 2048, 1536)])
def test_block_scaled_mm_passes_torchs_own_shape_and_layout_checks(m, k, n):
    """The real GEMM cannot run here, but torch's meta kernel checks what cuBLAS needs (scale shapes,
    outer-major A scales, B's K-blocks padded to 4): every shape the trainer makes must pass it, including
    ragged M and K/128 of 1 and 3 (on an H200 those were refused or wrong before the padding)."""
    meta = dict(device="meta")
    xq = torch.empty(m, k, dtype=torch.float8_e4m3fn, **meta)
    wq = torch.empty(n, k, dtype=torch.float8_e4m3fn, **meta)
    y = fp8_training.block_scaled_mm(xq, torch.empty(m, k // 128, **meta), wq,
                                     torch.empty(-(-n // 128), k // 128, **meta))
    assert y.shape == (m, n) and y.dtype == torch.bfloat16


def test_fp8_rows_are_padded_with_exact_zeros():
    q = torch.randn(5, 128).to(torch.float8_e4m3fn)
    p = fp8_training._pad_rows(q, 16)
    assert p.dtype == q.dtype and p.shape == (16, 128)
    assert torch.equal(p[:5].float(), q.float()) and not p[5:].float().any()
