"""Every CPU workaround of the trainer's networks, in one place, applied only when the trainer runs on the CPU.

torchtitan 0.3.0 is written for GPUs; on this machine's CPU two of its model pieces do not do what the
trainer needs (docs/cpu.md has the measurements):

1. FlexAttention has no backward on the CPU. `DenseAttention` replaces the inner attention of every
   layer with an eager `scaled_dot_product_attention` under a dense boolean mask. The mask is built by
   evaluating torchtitan's own mask_mods (causal AND same-document, documents starting where
   `positions` resets to 0) over the whole [L, L] grid, so a packed row attends exactly as the flex
   BlockMask would on a GPU. Dense masks are O(L^2) memory: fine for CPU-sized micro-batches.
2. `GroupedExperts` casts tokens and expert weights to bf16 for `torch._grouped_mm`. On this CPU bf16
   matmuls are ~50x slower than fp32, and the cast makes the trainer's numbers differ from an fp32
   inference engine. `LoopedExperts` runs the same SwiGLU experts as a loop of fp32 matmuls, one per
   expert over its contiguous slice of the dispatched tokens (the dispatcher already sorts by expert).

Multi-rank runs on gloo (`trainer.parallel`, see rl.trainer.parallel) need three more:

3. torchtitan resolves its device type once at import, falling back to "cuda" when there is no
   accelerator; `force_cpu_device()` points every module-level copy of it at the CPU.
4. FSDP on gloo: gloo has no PREMUL_SUM, so `fsdp_gloo(model)` asks every FSDP module for plain
   sum reductions (`set_force_sum_reduction_for_comms`).
5. Context parallelism: torchtitan's `apply_cp_to_forward` knows FlexAttention (K/V all-gathered
   across the cp ranks with torch's `flex_cp_allgather`, the query rows and the BlockMask sharded
   head-tail) and SDPA (ring attention, causal only, no document mask). `DenseAttention` is neither;
   `dense_cp(...)` is the same algorithm as torchtitan's Flex path on the dense mask: K/V
   all-gathered with the same op (reduce-scatter in backward), the query rows this rank holds and the
   mask built for exactly those rows against the gathered keys (`cp_document_mask`). This one piece
   also runs on GPUs: with `trainer.parallel.cp > 1` every device uses `dense_attention` + `dense_cp`
   (rl.trainer.model.build_model), so the CP path a cluster runs is the one tested here. Each family's
   parallelize function enters `patch_cp_for_dense_attention` on the torchtitan module whose CP step it uses. Its cost
   is the dense mask, [L/cp, L] booleans per micro-batch row (2 GiB at 128K tokens and cp 8).

`apply(model_config)` rewrites a model config in place before the model is built; the modules keep
torchtitan's parameter names and shapes, so checkpoints and the HF adapter are unaffected.
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
from torch.distributed.tensor import DTensor

# torchtitan's router asks for fp32 autocast around the gate; CPU autocast has no fp32 mode and says so
# on every forward. The gate runs in fp32 anyway on the CPU.
warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """Dense [B, 1, L, L] boolean mask (True = may attend) from per-document positions [B, L]."""
    n = positions.shape[1]
    idx = torch.arange(n, device=positions.device)
    return cp_document_mask(positions, idx, idx)


def cp_document_mask(positions: torch.Tensor, q_index: torch.Tensor, kv_index: torch.Tensor) -> torch.Tensor:
    """[B, 1, len(q_index), len(kv_index)] mask of the rows `q_index` against the keys `kv_index`.

    `positions` is the full (unsharded) row; the indices are positions in it, in the order the
    queries and the (gathered) keys are laid out on this rank. With all of 0..L-1 for both it is the
    plain document mask.
    """
    b = positions.shape[0]
    mod = and_masks(get_causal_mask_mod(), get_document_mask_mod(positions))
    bi = torch.arange(b, device=positions.device)[:, None, None]
    return mod(bi, None, q_index[None, :, None], kv_index[None, None, :]).unsqueeze(1)


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
            raise TypeError("DenseAttention needs the boolean mask of rl.models.cpu.document_mask")
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
        # Under expert parallelism the weights are DTensors over the ep mesh; the tokens here were
        # already sent to this rank's experts, so the local shard is what multiplies them.
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w
                      for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        counts = num_tokens_per_expert_E.tolist()
        outs, start = [], 0
        for e, c in enumerate(counts):
            c = int(c)
            x = x_RD[start:start + c]
            h = F.silu(x @ w1[e].T) * (x @ w3[e].T)
            outs.append(h @ w2[e].T)
            start += c
        if start < x_RD.shape[0]:  # rows the dispatcher padded beyond the routed tokens
            outs.append(torch.zeros_like(x_RD[start:]))
        return torch.cat(outs).type_as(x_RD)


def dense_attention(model_config) -> None:
    """Swap flex attention for DenseAttention in a Decoder config (the CPU, and context parallel anywhere)."""
    for layer in model_config.layers:
        att = getattr(layer, "attention", None)
        if att is not None and isinstance(getattr(att, "inner_attention", None), FlexAttention.Config):
            att.inner_attention = DenseAttention.Config(sharding_config=att.inner_attention.sharding_config)


def apply(model_config) -> None:
    """Swap flex attention and bf16 grouped experts for their CPU versions in a Decoder config."""
    dense_attention(model_config)
    for layer in model_config.layers:
        moe = getattr(layer, "moe", None)
        if moe is not None:
            ie = moe.routed_experts.inner_experts
            if type(ie) is GroupedExperts.Config:
                moe.routed_experts.inner_experts = LoopedExperts.Config(
                    dim=ie.dim, hidden_dim=ie.hidden_dim, num_experts=ie.num_experts,
                    param_init=ie.param_init, sharding_config=ie.sharding_config)


def uses_dense_attention(model) -> bool:
    return any(isinstance(m, DenseAttention) for m in model.modules())


# -- multi-rank (gloo) --------------------------------------------------------------------------------
def force_cpu_device() -> None:
    """Point torchtitan's import-time device type ("cuda" when no accelerator is found) at the CPU."""
    import importlib
    for name in ("torchtitan.tools.utils", "torchtitan.distributed.utils",
                 "torchtitan.distributed.parallel_dims", "torchtitan.models.common.token_dispatcher",
                 "torchtitan.components.metrics"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "device_type"):
            mod.device_type = "cpu"
        if hasattr(mod, "device_module"):
            mod.device_module = torch.cpu


def fsdp_gloo(model) -> None:
    """gloo has no PREMUL_SUM: every FSDP module reduces with plain sums."""
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)


def dense_cp(attention_modules, cp_mesh) -> None:
    """Context parallel for DenseAttention: gather K/V over the cp ranks (torchtitan's Flex path).

    The queries stay local (this rank's head-tail chunks); the mask passed in is already the
    [B, 1, L_local, L] slice of rl.trainer.parallel's CP sharding, keys in gathered order.
    """
    import torch.distributed as dist
    from torch.distributed.tensor.experimental._context_parallel._cp_custom_ops import flex_cp_allgather

    pg_name = dist._get_process_group_name(cp_mesh.get_group())
    for mod in attention_modules:
        if not isinstance(mod, DenseAttention):
            raise TypeError(f"dense_cp wraps DenseAttention, got {type(mod).__name__}")

        def cp_forward(q, k, v, *, _orig=mod.forward, **kwargs):
            gk, gv = flex_cp_allgather(k.contiguous(), v.contiguous(), 1, pg_name)
            return _orig(q, gk, gv, **kwargs)

        mod.forward = cp_forward


def patch_cp_for_dense_attention(*modules: str):
    """A context in which the torchtitan parallelize modules named (their CP step `apply_cp_to_forward`,
    imported by name) apply `dense_cp` to DenseAttention layers (and torchtitan's own CP to anything else)."""
    import contextlib
    import importlib

    @contextlib.contextmanager
    def ctx():
        mods = [importlib.import_module(n) for n in modules]
        origs = [m.apply_cp_to_forward for m in mods]

        def redirect(orig):
            def apply(attention, mesh, *args, **kwargs):
                attention = list(attention)
                if attention and isinstance(attention[0], DenseAttention):
                    return dense_cp(attention, mesh)
                return orig(attention, mesh, *args, **kwargs)
            return apply

        for m, orig in zip(mods, origs):
            m.apply_cp_to_forward = redirect(orig)
        try:
            yield
        finally:
            for m, orig in zip(mods, origs):
                m.apply_cp_to_forward = orig
    return ctx()
