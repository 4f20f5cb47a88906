"""Every CPU workaround of the trainer, in one place, applied only when the trainer runs on the CPU.

torchtitan 0.3.0 is written for GPUs; on this machine's CPU two of its model pieces do not do what the
trainer needs (see shared/notes/torchtitan-cpu.md for the measurements):

1. FlexAttention has no backward on the CPU. `DenseAttention` replaces the inner attention of every
   layer with an eager `scaled_dot_product_attention` under a dense boolean mask. The mask is built by
   evaluating torchtitan's own mask_mods (causal AND same-document, documents starting where
   `positions` resets to 0) over the whole [L, L] grid, so a packed row attends exactly as the flex
   BlockMask would on a GPU. Dense masks are O(L^2) memory: fine for CPU-sized micro-batches.
2. `GroupedExperts` casts tokens and expert weights to bf16 for `torch._grouped_mm`. On this CPU bf16
   matmuls are ~50x slower than fp32, and the cast makes the trainer's numbers differ from an fp32
   inference engine. `LoopedExperts` runs the same SwiGLU experts as a loop of fp32 matmuls, one per
   expert over its contiguous slice of the dispatched tokens (the dispatcher already sorts by expert).

The remaining notes (forcing the device type in torchtitan's distributed helpers, gloo's missing
PREMUL_SUM, the spmd backend) concern multi-rank runs and belong here too when `trainer.parallel`
lands. `apply(model_config)` rewrites a model config in place before the model is built; the modules
keep torchtitan's parameter names and shapes, so checkpoints and the HF adapter are unaffected.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import and_masks

from torchtitan.models.common.attention import FlexAttention, get_causal_mask_mod, get_document_mask_mod
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.protocols.module import Module

# torchtitan's router asks for fp32 autocast around the gate; CPU autocast has no fp32 mode and says so
# on every forward. The gate runs in fp32 anyway on the CPU.
warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """Dense [B, 1, L, L] boolean mask (True = may attend) from per-document positions [B, L]."""
    b, n = positions.shape
    mod = and_masks(get_causal_mask_mod(), get_document_mask_mod(positions))
    dev = positions.device
    bi = torch.arange(b, device=dev)[:, None, None]
    qi = torch.arange(n, device=dev)[None, :, None]
    ki = torch.arange(n, device=dev)[None, None, :]
    return mod(bi, None, qi, ki).unsqueeze(1)


class DenseAttention(Module):
    """Inner attention with an explicit dense mask; same call signature as torchtitan's FlexAttention."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config):
        super().__init__()

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks: torch.Tensor, scale=None,
                enable_gqa: bool = False, **kwargs) -> torch.Tensor:
        if not isinstance(attention_masks, torch.Tensor) or attention_masks.dtype != torch.bool:
            raise TypeError("DenseAttention needs the boolean mask of rl.trainer.cpu.document_mask")
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_masks, scale=scale,
                                             enable_gqa=enable_gqa)
        return out.transpose(1, 2)


class LoopedExperts(GroupedExperts):
    """GroupedExperts computed in the parameters' dtype, one matmul per expert (no bf16 cast)."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        counts = num_tokens_per_expert_E.tolist()
        outs, start = [], 0
        for e, c in enumerate(counts):
            c = int(c)
            x = x_RD[start:start + c]
            h = F.silu(x @ self.w1_EFD[e].T) * (x @ self.w3_EFD[e].T)
            outs.append(h @ self.w2_EDF[e].T)
            start += c
        if start < x_RD.shape[0]:  # rows the dispatcher padded beyond the routed tokens
            outs.append(torch.zeros_like(x_RD[start:]))
        return torch.cat(outs).type_as(x_RD)


def apply(model_config) -> None:
    """Swap flex attention and bf16 grouped experts for their CPU versions in a Decoder config."""
    for layer in model_config.layers:
        att = getattr(layer, "attention", None)
        if att is not None and isinstance(att.inner_attention, FlexAttention.Config):
            att.inner_attention = DenseAttention.Config()
        moe = getattr(layer, "moe", None)
        if moe is not None:
            ie = moe.routed_experts.inner_experts
            if type(ie) is GroupedExperts.Config:
                moe.routed_experts.inner_experts = LoopedExperts.Config(
                    dim=ie.dim, hidden_dim=ie.hidden_dim, num_experts=ie.num_experts,
                    param_init=ie.param_init, sharding_config=ie.sharding_config)


def uses_dense_attention(model) -> bool:
    return any(isinstance(m, DenseAttention) for m in model.modules())
