"""Block-scaled FP8 training (`trainer.fp8`), DeepSeek-V3's recipe, with rl.fp8's quantizer.

Which GEMMs: exactly the weights the publisher stores in FP8 (rl.exchange.layout.default_quantize: every
2-D `.weight` but embeddings, LM head, norms and the router gate), per family:
- qwen3: the attention projections q, k, v, o (torchtitan's fused `wqkv` and `wo`) and the routed experts;
- deepseek_v3 / kimi_k2_7 (torchtitan's MLA attention): `wq` (HF q_proj) or `wq_a`/`wq_b` (q_a_proj,
  q_b_proj), `wkv_a` (kv_a_proj_with_mqa), `wkv_b` (kv_b_proj), `wo` (o_proj); the dense layers'
  FeedForward and the MoE shared experts (w1/w3/w2 = gate/up/down_proj); the routed experts;
- glm_moe_dsa: as DeepSeek-V3, plus the DSA indexer's `wq_b` and `wk` (indexer.wq_b / indexer.wk);
- nemotron_h (a plain-torch network, no torchtitan configs): its model config takes the GEMM and the
  publisher's own predicate (`gemm` / `gemm_select`, rl.models.nemotron_h.gemm), so its FP8 set is the
  published one by construction, the start checkpoint's ignore list included: Mamba in_proj / out_proj,
  routed and shared experts, the dense MLP, MTP eh_proj; attention q/k/v/o and the latent projections stay
  high precision with the Mamba conv1d / A_log / D / dt_bias, norms and the router (the family row's
  `fp8_keep_modules`, NVIDIA's own Nemotron 3 FP8 layout; docs/models.md).
This module names no family: GQA and torchtitan's MLA are torchtitan's attention types; a family's own
attention config declares the projections it runs in FP8 (`fp8_linears`, e.g. GLM-5's GlmAttention),
and a plain-torch network's config declares `gemm_select` to receive the GEMM and the predicate.
High precision (the trainer's dtype), as in the published shards: embeddings, LM head, every norm (the MLA
latent norms, the indexer's k_norm), the router gate and its `e_score_correction_bias` (expert_bias_E),
and GLM-5's indexer `weights_proj`. That one is high precision on purpose: vLLM fuses it with `wk` into
an unquantized `wk_weights_proj` (it can only upcast an FP8 `wk`), GLM-5's own FP8 checkpoint keeps it
in bf16 (tests/integration/test_inference_gpu.py), and the indexer reads its weight in fp32 (rl/models/glm_moe_dsa/model.py).
The publisher keeps it high precision when the start checkpoint's quantization_config ignores it (GLM-5's
does); `default_quantize` on its own (a checkpoint without one, e.g. the twins) still writes it as FP8,
the one weight where shards and trainer then differ. More generally the trainer does not read the start
checkpoint's ignore list: a checkpoint that keeps other projections unquantized is not followed here.
The indexer runs without gradients (as HF's), so its FP8 GEMMs only make its key selection the one
inference makes from the dequantized shards.

Per GEMM y = x W^T: weights quantized in 128x128 blocks, activations in 1x128 tiles along the reduction
dim, fp32 scales (rl.fp8.quantize_block / quantize_act). The master weights stay fp32 and the optimizer
updates them; gradients pass the quantizers straight through (STE): dL/dx = g W_q, dL/dW = g^T x_q.

Bit-exactness with inference: the quantization blocks follow the *HF tensors* the publisher writes, not
torchtitan's parameters. torchtitan fuses q/k/v into one `wqkv` (rows interleaved per kv group), whose
128-row blocks would straddle q, k and v when head counts are small; `weight_fp8` splits it into the
HF q/k/v, quantizes each like the publisher, and puts them back. Experts are quantized per expert.
Every MLA parameter (and the indexer's, the FeedForwards') is its HF tensor as it is: torchtitan's
DeepSeek-V3 adapter copies wq_a/wq_b/wkv_a/wkv_b/wo/w1-3 without fusing, splitting or permuting (wkv_a is
kv_a_proj_with_mqa row for row, latent then rope part; HF's rope_interleave de-interleaves activations,
not weights), so they are blocked directly. So what inference dequantizes from `weights/step_N` is bit for
bit the W_q the trainer computed with (tests/unit/test_fp8_training.py checks it per family).

`apply(model_config)` is a separate step on the model config, after rl.models.cpu.apply and before the
build: Linear configs become `Fp8Linear.Config`, routed experts `Fp8Experts.Config`. Attention types it
does not know are a NotImplementedError naming the type (never a silent high-precision projection).

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
from rl.models import cpu
from rl.models.common import hf_state_dict
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


def block_scaled_mm(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """x W^T in bf16 from e4m3 operands: xq [M, K] with 1x128 scales xs [M, L], wq [N, K] with 128x128
    scales ws [ceil(N/128), L] (L = K/128), through cuBLASLt's block-scaled FP8 GEMM.

    cuBLAS reads block scales in its own layouts (measured on an H200, torch 2.11, CUDA 13): A's 1x128
    scales outer-dimension-major (stride (1, M)); B's 128x128 scales K-block-major with the K-block count
    padded to a multiple of 4, which only the explicit-recipe API (`F.scaled_mm`) accepts as a shape.
    `torch._scaled_mm`, which infers the recipe from the shapes, refuses padded scales, and with L not a
    multiple of 4 it either refuses the call or, for L = 1, returns wrong products (relative error ~160
    against the dequantized reference), so it is used only when L is a multiple of 4. M is padded to a
    multiple of 16: M = 7 was refused (CUBLAS_STATUS_NOT_SUPPORTED) by every layout."""
    m, l = xs.shape
    n, nb = wq.shape[0], ws.shape[0]
    mp = -(-m // 16) * 16
    xq, wq = _pad_rows(xq, mp), _pad_rows(wq, nb * q8.BLOCK)
    if mp != m:
        xs = torch.cat([xs, xs.new_ones((mp - m, l))])
    sa = xs.t().contiguous().t()
    if hasattr(F, "scaled_mm"):
        sb = F.pad(ws, (0, -(-l // 4) * 4 - l)).t()
        y = F.scaled_mm(xq, wq.t(), sa, F.ScalingType.BlockWise1x128, sb, F.ScalingType.BlockWise128x128,
                        output_dtype=torch.bfloat16)
    elif l % 4 == 0:
        y = torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=ws.t(), out_dtype=torch.bfloat16)
    else:
        raise NotImplementedError(f"block-scaled FP8 GEMM with K/128 = {l} (not a multiple of 4) needs "
                                  "torch.nn.functional.scaled_mm (torch >= 2.11)")
    return y[:m, :n]


def _pad_rows(q: torch.Tensor, rows: int) -> torch.Tensor:
    """e4m3 rows padded with zeros (the byte 0 is +0.0; padded as bytes: not every torch pads float8)."""
    if q.shape[0] == rows:
        return q
    return F.pad(q.view(torch.uint8), (0, 0, 0, rows - q.shape[0])).view(q.dtype)


def real_fp8_shape_ok(k: int) -> bool:
    """Whether block_scaled_mm takes a reduction dimension of `k` with this torch."""
    return k % q8.BLOCK == 0 and (hasattr(F, "scaled_mm") or (k // q8.BLOCK) % 4 == 0)


class _ScaledMM(torch.autograd.Function):
    """Forward: torch._scaled_mm on e4m3 operands with block scales; backward: the STE."""

    @staticmethod
    def forward(ctx, x2d, w, qkv):
        xq, xs = q8.quantize_act(x2d)                       # [M, K] e4m3, [M, K/128]
        wf = weight_fp8(w, qkv)                             # blocked like the HF tensors
        wq, ws = q8.quantize_block(wf)                      # exact: wf is representable
        y = block_scaled_mm(xq, xs, wq, ws)
        ctx.save_for_backward(q8.dequantize_act(xq, xs, x2d.dtype), wf.to(x2d.dtype))
        return y.to(x2d.dtype)

    @staticmethod
    def backward(ctx, g):
        xf, wf = ctx.saved_tensors
        return g @ wf, g.t() @ xf, None


def gemm(x: torch.Tensor, w: torch.Tensor, qkv=None) -> torch.Tensor:
    """The FP8 GEMM x W^T: real (torch._scaled_mm) on FP8-capable GPUs, emulated elsewhere."""
    # an expert routed no tokens has an empty x: nothing for cuBLAS to do (and M = 0 is not a shape it
    # was measured to take), the emulated path returns the empty product
    if (_cuda_fp8_ok(x) and qkv is None and real_fp8_shape_ok(x.shape[-1]) and w.shape[0] % 16 == 0
            and x.numel() > 0):
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
    """`c` as an Fp8Linear config (all its fields kept); an Fp8Linear config stays as it is."""
    import dataclasses
    if isinstance(c, Fp8Linear.Config):
        return c
    if type(c) is not Linear.Config:
        raise NotImplementedError(f"FP8 for a {type(c).__name__} projection")
    return Fp8Linear.Config(**{f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.init}, qkv=qkv)


# DeepSeek-V3's MLA (torchtitan's Attention): HF q_proj | q_a_proj, q_b_proj; kv_a_proj_with_mqa; kv_b_proj
_MLA_LINEARS = ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b")


def _declared_linears(att) -> tuple[str, ...] | None:
    """The projections (dotted paths in the config, besides `wo`) an MLA-style attention config runs in
    FP8: what its class declares as `fp8_linears` (a family's own attention, e.g. GLM-5's with the DSA
    indexer), torchtitan's MLA ones for its own Attention config, None for a type this does not know."""
    from torchtitan.models.deepseek_v3.model import Attention as MLA
    declared = getattr(type(att), "fp8_linears", None)
    if declared is not None:
        return tuple(declared)
    return _MLA_LINEARS if type(att) is MLA.Config else None


def _fp8_attention(att) -> None:
    """The FP8 projections of one attention config: GQA (qkv_linear + wo), or an MLA-style attention
    whose projections `_declared_linears` names (each its HF tensor as it is)."""
    from torchtitan.models.common.attention import FusedQKVLinear, GQAttention, QKVLinear

    linears = None if isinstance(att, GQAttention.Config) else _declared_linears(att)
    if isinstance(att, GQAttention.Config):
        qc = att.qkv_linear
        if isinstance(qc, FusedQKVLinear.Config):
            qc.wqkv = _fp8_linear_config(
                qc.wqkv, qkv=(qc.n_kv_heads, qc.n_heads // qc.n_kv_heads, qc.head_dim))
        elif type(qc) is QKVLinear.Config:
            qc.wq, qc.wk, qc.wv = (_fp8_linear_config(c) for c in (qc.wq, qc.wk, qc.wv))
        else:
            raise NotImplementedError(f"FP8 for {type(qc).__name__}")
    elif linears is not None:
        for path in linears:
            *parents, name = path.split(".")
            owner = att
            for p in parents:
                owner = getattr(owner, p)
            if getattr(owner, name) is not None:
                setattr(owner, name, _fp8_linear_config(getattr(owner, name)))
    else:
        raise NotImplementedError(f"FP8 for attention {type(att).__name__} (known: GQA, DeepSeek-V3 MLA, "
                                  f"and attention configs declaring `fp8_linears`)")
    att.wo = _fp8_linear_config(att.wo)


def _fp8_feed_forward(ff) -> None:
    """A SwiGLU FeedForward (dense layer, shared experts): w1, w2, w3 = HF gate_proj, down_proj, up_proj."""
    from torchtitan.models.common.feed_forward import FeedForward
    if type(ff) is not FeedForward.Config:
        raise NotImplementedError(f"FP8 for feed-forward {type(ff).__name__}")
    ff.w1, ff.w2, ff.w3 = (_fp8_linear_config(c) for c in (ff.w1, ff.w2, ff.w3))


def apply(model_config) -> None:
    """Route every GEMM the publisher stores in FP8 through `gemm`: attention projections, dense and
    shared-expert FeedForwards, routed experts (GroupedExperts, or the CPU's LoopedExperts, become
    Fp8Experts on every device). In place, on a Decoder config; applying twice changes nothing."""
    from torchtitan.models.common.moe import GroupedExperts

    if hasattr(model_config, "gemm_select"):
        # a plain-torch network swaps its own GEMMs at build: exactly the weights the publisher quantizes
        from rl.exchange.layout import quantize_except
        model_config.gemm = gemm
        model_config.gemm_select = quantize_except(list(getattr(model_config, "fp8_ignored", ())))
        return
    for layer in model_config.layers:
        if getattr(layer, "attention", None) is not None:
            _fp8_attention(layer.attention)
        if getattr(layer, "feed_forward", None) is not None:
            _fp8_feed_forward(layer.feed_forward)
        moe = getattr(layer, "moe", None)
        if moe is not None:
            if moe.shared_experts is not None:
                _fp8_feed_forward(moe.shared_experts)
            ie = moe.routed_experts.inner_experts
            if type(ie) is Fp8Experts.Config:
                continue
            if type(ie) not in (GroupedExperts.Config, cpu.LoopedExperts.Config):
                raise NotImplementedError(f"FP8 for {type(ie).__name__}")
            moe.routed_experts.inner_experts = Fp8Experts.Config(
                dim=ie.dim, hidden_dim=ie.hidden_dim, num_experts=ie.num_experts,
                param_init=ie.param_init, sharding_config=ie.sharding_config)
    if getattr(model_config, "mtp_layers", None):
        raise NotImplementedError("FP8 for multi-token-prediction layers")


def fp8_modules(model):
    """(name, module) of every FP8 GEMM owner: Fp8Linear, experts with FP8 on, or a plain-torch module
    given `gemm` (rl.models.nemotron_h.gemm)."""
    for name, m in model.named_modules():
        if isinstance(m, (Fp8Linear, Fp8Experts)) or getattr(m, "gemm", None) is gemm:
            yield name, m


def _fp8_params(m) -> list[torch.Tensor]:
    """The FP8 weights of an FP8 GEMM owner: 2-D (one matrix) or 3-D (stacked experts, one per row)."""
    if isinstance(m, Fp8Linear):
        return [m.weight]
    if isinstance(m, Fp8Experts):
        return [m.w1_EFD, m.w2_EDF, m.w3_EFD]
    return [getattr(m, p) for p in m.fp8_params]


@torch.no_grad()
def trainer_fp8_state_dict(built) -> dict[str, torch.Tensor]:
    """HF-named weights with every FP8 weight replaced by the values the trainer's GEMMs use.

    (Single process.) The FP8 values are swapped into the parameters, read through the HF adapter,
    and the master weights are put back.
    """
    saved = []
    for _, m in fp8_modules(built.model):
        if isinstance(m, Fp8Linear):
            saved.append((m.weight, m.weight.detach().clone()))
            m.weight.copy_(m.weight_fp8())
            continue
        for p in _fp8_params(m):
            saved.append((p, p.detach().clone()))
            p.copy_(weight_fp8(p) if p.dim() == 2 else torch.stack([weight_fp8(p[e]) for e in range(p.shape[0])]))
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
