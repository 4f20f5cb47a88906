"""Block-scaled FP8 training (emulated on the CPU): GEMM numerics, STE gradients, bit-exact publishing."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rl import exchange, fp8
from rl.exchange import weights as wire
from rl.trainer import fp8 as fp8_training
from rl.trainer.train import Trainer, run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from _trainer_helpers import examples, publish_batches, synthetic_batch, tiny_cfg  # noqa: E402


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


def test_published_shard_dequantizes_to_the_trainers_fp8_weights(tmp_path):
    tr = Trainer(tiny_cfg(tmp_path, fp8=True))
    tr.train_step(synthetic_batch(0), 0)
    tr.publish_weights(tmp_path, 1)
    path = exchange.step_dir(tmp_path, "weights", 1)
    got = dict(wire.iter_tensors(path, dequantize=True))
    ours = fp8_training.trainer_fp8_state_dict(tr.built)     # what the trainer's GEMMs multiply by
    master = tr.full_hf_state_dict()
    quantized = set(json.loads((path / wire.FP8_META).read_text())["quantized"])
    assert got.keys() == ours.keys() == master.keys()
    # the trainer computes in FP8 exactly where the shard stores FP8 ...
    trained_fp8 = {k for k in ours if not torch.equal(ours[k], master[k])}
    assert trained_fp8 == quantized
    assert any(".mlp.experts." in q for q in quantized) and any("k_proj" in q for q in quantized)
    # ... and inference dequantizes to those values bit for bit (the rest: the trainer's fp32)
    for name in ours:
        assert torch.equal(got[name], ours[name]), name


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
