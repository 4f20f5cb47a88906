"""Block-scaled FP8 training (`trainer.fp8`), DeepSeek-V3's recipe, with rl.fp8's quantizer.

Which GEMMs: exactly the weights the publisher stores in FP8 (rl.exchange.weights.default_quantize):
the attention projections (q, k, v, o) and the routed experts (gate/up/down per expert). The router
gate, embeddings, norms and LM head stay in the trainer's dtype, as in the published shards.

Per GEMM y = x W^T: weights quantized in 128x128 blocks, activations in 1x128 tiles along the reduction
dim, fp32 scales (rl.fp8.quantize_block / quantize_act). The master weights stay fp32 and the optimizer
updates them; gradients pass the quantizers straight through (STE): dL/dx = g W_q, dL/dW = g^T x_q.

Bit-exactness with inference: the quantization blocks follow the *HF tensors* the publisher writes, not
torchtitan's parameters. torchtitan fuses q/k/v into one `wqkv` (rows interleaved per kv group), whose
128-row blocks would straddle q, k and v when head counts are small; `weight_fp8` splits it into the
HF q/k/v, quantizes each like the publisher, and puts them back. Experts are quantized per expert.
So what inference dequantizes from `weights/step_N` is bit for bit the W_q the trainer computed with.

Backends:
- CPU (and any device without FP8 GEMMs): emulated, quantize-dequantize in fp32 then an fp32 matmul;
  the numerics of the values are exact, the accumulation is fp32.
- CUDA with FP8 support: `torch._scaled_mm` with the e4m3 operands and their block scales (imported
  lazily; covered by a `gpu`-marked test, skipped on this machine). Backward stays emulated (bf16/fp32
  GEMMs on the quantized values), as the STE defines it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rl import fp8 as q8
from torchtitan.models.common.linear import Linear


def weight_fp8(w: torch.Tensor, qkv: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The FP8 values (dequantized, fp32) of weight `w`, blocked like the published HF tensors.

    `qkv` = (n_kv_heads, heads_per_kv, head_dim) for torchtitan's fused wqkv.
    """
    w = w.detach()
    if qkv is None:
        return q8.fake_quantize_block(w)
    n_kv, hpk, hd = qkv
    d = w.shape[1]
    v = w.reshape(n_kv, hpk + 2, hd, d)
    parts = [q8.fake_quantize_block(v[:, :hpk].reshape(-1, d)).reshape(n_kv, hpk, hd, d),
             q8.fake_quantize_block(v[:, hpk].reshape(-1, d)).reshape(n_kv, 1, hd, d),
             q8.fake_quantize_block(v[:, hpk + 1].reshape(-1, d)).reshape(n_kv, 1, hd, d)]
    return torch.cat(parts, 1).reshape(w.shape)


def _ste(x: torch.Tensor, xq: torch.Tensor) -> torch.Tensor:
    """xq in the forward, identity in the backward."""
    return x + (xq.to(x.dtype) - x).detach()


def emulated_gemm(x: torch.Tensor, w: torch.Tensor, qkv=None) -> torch.Tensor:
    """x W^T with x fake-quantized 1x128 and W 128x128, straight-through gradients."""
    return F.linear(_ste(x, q8.fake_quantize_act(x)), _ste(w, weight_fp8(w, qkv)))


def _cuda_fp8_ok(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 9)


class _ScaledMM(torch.autograd.Function):
    """Forward: torch._scaled_mm on e4m3 operands with block scales; backward: the STE."""

    @staticmethod
    def forward(ctx, x2d, w, qkv):
        xq, xs = q8.quantize_act(x2d)                       # [M, K] e4m3, [M, K/128]
        wf = weight_fp8(w, qkv)                             # blocked like the HF tensors
        wq, ws = q8.quantize_block(wf)                      # exact: wf is representable
        y = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16)
        ctx.save_for_backward(q8.dequantize_act(xq, xs, x2d.dtype), wf.to(x2d.dtype))
        return y.to(x2d.dtype)

    @staticmethod
    def backward(ctx, g):
        xf, wf = ctx.saved_tensors
        return g @ wf, g.t() @ xf, None


def gemm(x: torch.Tensor, w: torch.Tensor, qkv=None) -> torch.Tensor:
    """The FP8 GEMM x W^T: real (torch._scaled_mm) on FP8-capable GPUs, emulated elsewhere."""
    if _cuda_fp8_ok(x) and qkv is None and x.shape[-1] % q8.BLOCK == 0 and w.shape[0] % 16 == 0:
        lead = x.shape[:-1]
        return _ScaledMM.apply(x.reshape(-1, x.shape[-1]), w, qkv).reshape(*lead, w.shape[0])
    return emulated_gemm(x, w, qkv)


class Fp8Linear(Linear):
    """torchtitan Linear (no bias) computed by `gemm`; `qkv` marks the fused q/k/v projection."""

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        qkv: tuple | None = None

    def __init__(self, config: Config):
        super().__init__(config)
        self.qkv = tuple(config.qkv) if config.qkv is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            raise NotImplementedError("Fp8Linear has no bias (none of the FP8 projections has one)")
        return gemm(x, self.weight, self.qkv)

    def weight_fp8(self) -> torch.Tensor:
        return weight_fp8(self.weight, self.qkv)


def _fp8_linear_config(c: Linear.Config, qkv=None) -> Fp8Linear.Config:
    return Fp8Linear.Config(in_features=c.in_features, out_features=c.out_features, bias=c.bias,
                            param_init=c.param_init, sharding_config=c.sharding_config, qkv=qkv)


def apply(model_config) -> None:
    """Route the attention projections and the experts of a Decoder config through FP8 GEMMs.

    The experts (GroupedExperts, or the CPU's LoopedExperts) become Fp8Experts on every device.
    """
    from torchtitan.models.common.attention import FusedQKVLinear, QKVLinear
    from torchtitan.models.common.moe import GroupedExperts
    from rl.trainer import cpu

    for layer in model_config.layers:
        att = getattr(layer, "attention", None)
        if att is not None:
            qc = att.qkv_linear
            if isinstance(qc, FusedQKVLinear.Config):
                qc.wqkv = _fp8_linear_config(
                    qc.wqkv, qkv=(qc.n_kv_heads, qc.n_heads // qc.n_kv_heads, qc.head_dim))
            elif type(qc) is QKVLinear.Config:
                qc.wq, qc.wk, qc.wv = (_fp8_linear_config(c) for c in (qc.wq, qc.wk, qc.wv))
            else:
                raise NotImplementedError(f"FP8 for {type(qc).__name__}")
            att.wo = _fp8_linear_config(att.wo)
        moe = getattr(layer, "moe", None)
        if moe is not None:
            ie = moe.routed_experts.inner_experts
            if type(ie) not in (GroupedExperts.Config, cpu.LoopedExperts.Config):
                raise NotImplementedError(f"FP8 for {type(ie).__name__}")
            moe.routed_experts.inner_experts = Fp8Experts.Config(
                dim=ie.dim, hidden_dim=ie.hidden_dim, num_experts=ie.num_experts,
                param_init=ie.param_init, sharding_config=ie.sharding_config)


def fp8_modules(model):
    """(module, kind) of every FP8 GEMM owner: Fp8Linear, or experts with FP8 on."""
    for name, m in model.named_modules():
        if isinstance(m, (Fp8Linear, Fp8Experts)):
            yield name, m


@torch.no_grad()
def trainer_fp8_state_dict(built) -> dict[str, torch.Tensor]:
    """HF-named weights with every FP8 weight replaced by the values the trainer's GEMMs use.

    (Single process.) The FP8 values are swapped into the parameters, read through the HF adapter,
    and the master weights are put back.
    """
    from rl.trainer.model import hf_state_dict
    saved = []
    for _, m in fp8_modules(built.model):
        if isinstance(m, Fp8Linear):
            saved.append((m.weight, m.weight.detach().clone()))
            m.weight.copy_(m.weight_fp8())
        else:
            for p in (m.w1_EFD, m.w2_EDF, m.w3_EFD):
                saved.append((p, p.detach().clone()))
                p.copy_(torch.stack([weight_fp8(p[e]) for e in range(p.shape[0])]))
    try:
        return {k: v.clone() for k, v in hf_state_dict(built).items()}  # views of the params otherwise
    finally:
        for p, v in saved:
            p.copy_(v)


from torchtitan.models.common.moe import GroupedExperts as _GroupedExperts  # noqa: E402


class Fp8Experts(_GroupedExperts):
    """Routed experts with every expert's three GEMMs through `gemm` (fp32 master weights, quantized
    per expert like the published `mlp.experts.<e>.*_proj` tensors). A loop over experts: there is no
    block-scaled FP8 grouped GEMM here (DeepGEMM's would slot in on a GPU)."""
    fp8 = True

    @dataclass(kw_only=True, slots=True)
    class Config(_GroupedExperts.Config):
        pass

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w
                      for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        outs, start = [], 0
        for e, c in enumerate(num_tokens_per_expert_E.tolist()):
            x = x_RD[start:start + int(c)]
            h = F.silu(gemm(x, w1[e])) * gemm(x, w3[e])
            outs.append(gemm(h, w2[e]))
            start += int(c)
        if start < x_RD.shape[0]:  # rows the dispatcher padded beyond the routed tokens
            outs.append(torch.zeros_like(x_RD[start:]))
        return torch.cat(outs).type_as(x_RD)
