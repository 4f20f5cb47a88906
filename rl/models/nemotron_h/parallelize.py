"""FSDP2, expert parallelism and context parallelism for NemotronH (torchtitan's parallelize_fn signature).

- Expert parallel (`parallel_dims.ep_enabled`, torchtitan's "ep" mesh): the routed experts of every
  LatentMoE (main layers and the frozen MTP layers) become DTensors `Shard(0)` over the ep ranks, E/ep
  experts each, as torchtitan's GroupedExperts are placed. The experts run at the *latent* width, so what
  the all-to-all carries is the `fc1_latent_proj` output (moe_latent_size columns, 1024 for Ultra against
  hidden 8192): the router and both latent projections are dense (FSDP-sharded over all ranks) and run on
  the rank's own tokens before and after the exchange; the shared expert never leaves the rank.
  `ep_experts` is torchtitan's AllToAllTokenDispatcher in plain torch (token counts exchanged first,
  variable-split all-to-all of the sorted tokens, rank-major -> expert-major permutation, the reverse on
  the way back; the all-to-all's backward is the reverse exchange of the gradients). Routing weights are
  applied on the token's own rank after the return trip, as in the ep = 1 path, so the two give the same
  sums in the same order up to the experts' GEMMs.
- FSDP2 (`fully_shard`) per block, on the MTP layers (frozen; their parameters are sharded like the rest,
  no gradients), and on the root (embeddings, norm_f, lm_head), over torchtitan's "fsdp" mesh
  (dp_shard * cp ranks); with EP the expert parameters of a block go on the "efsdp" mesh instead
  (torchtitan's `apply_fsdp_to_decoder` per-parameter placement: Shard(0), or Shard(1) when efsdp * ep
  exceeds the expert count). Mixed precision param dtype from `training.mixed_precision_param`, fp32
  reduction and no gradient division (the trainer's loss is already divided by the batch-wide token
  count, torchtitan's `disable_fsdp_gradient_division`), FSDP2 CPU offload from
  `training.enable_cpu_offload`; activation checkpointing per block via torchtitan's `ac_config`.
- Context parallel (`parallel_dims.cp_enabled`): `NemotronH.enable_context_parallel(cp group)`: Mamba
  layers head-parallel with an all-to-all (rl.models.nemotron_h.mamba, cp must divide n_groups), attention
  K/V all-gathered against the trainer's mask rows; the trainer's head-tail row layout.
- Tensor parallel: NotImplementedError (named): no TP plan for the Mamba mixer.
"""
from __future__ import annotations

import torch


def parallelize_nemotron_h(model, *, parallel_dims, training=None, parallelism=None, compile_config=None,
                           ac_config=None, dump_folder: str = "", **kwargs):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    if parallel_dims.tp_enabled:
        raise NotImplementedError("NemotronH with tensor parallelism: no TP plan for the Mamba mixer")
    ep = bool(getattr(parallel_dims, "ep_enabled", False))
    if ep:
        apply_expert_parallel(model, parallel_dims.get_mesh("ep"))
    if parallel_dims.cp_enabled:
        model.enable_context_parallel(parallel_dims.get_mesh("cp").get_group())
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    mp = MixedPrecisionPolicy(
        param_dtype=dtypes[getattr(training, "mixed_precision_param", "float32") or "float32"],
        reduce_dtype=dtypes[getattr(training, "mixed_precision_reduce", "float32") or "float32"])
    kw = dict(mesh=fsdp_mesh(parallel_dims), mp_policy=mp)
    if training is not None and getattr(training, "enable_cpu_offload", False):
        kw["offload_policy"] = CPUOffloadPolicy()
    placement = _expert_placement_fn(model, parallel_dims, kw["mesh"]) if ep else None
    for layer in list(model.layers.values()) + list(model.mtp.values()):
        fully_shard(layer, **kw, **({"shard_placement_fn": placement} if placement is not None else {}))
    fully_shard(model, **kw)
    # the trainer divides by the batch-wide token count itself: FSDP sums, as torchtitan's apply_fsdp sets
    from torchtitan.distributed.fsdp import disable_fsdp_gradient_division
    disable_fsdp_gradient_division(model)
    return model


def fsdp_mesh(parallel_dims):
    """torchtitan's FSDP mesh (dp_shard x cp ranks)."""
    for name in ("fsdp", "dp_shard_cp"):
        try:
            return parallel_dims.get_mesh(name)
        except Exception:
            continue
    raise ValueError("no FSDP mesh in parallel_dims")


def _moes(model):
    """The LatentMoE modules (those with an `ep_group`; model.py imports this module, not the reverse)."""
    return [m for m in model.modules() if hasattr(m, "ep_group") and hasattr(m, "experts")]


def apply_expert_parallel(model, ep_mesh) -> None:
    """Each LatentMoE's routed experts as DTensors Shard(0) over `ep_mesh`, its dispatch over that group."""
    from torch import nn
    from torch.distributed.tensor import Shard, distribute_tensor
    ep = ep_mesh.size()
    for moe in _moes(model):
        if moe.n_experts % ep:
            raise ValueError(f"trainer.parallel.ep={ep} must divide n_routed_experts={moe.n_experts}")
        ex = moe.experts
        for name in ("up_proj", "down_proj"):
            p = getattr(ex, name)
            setattr(ex, name, nn.Parameter(distribute_tensor(p.data, ep_mesh, [Shard(0)]),
                                           requires_grad=p.requires_grad))
        moe.ep_group = ep_mesh.get_group()


def _expert_placement_fn(model, parallel_dims, dp_mesh):
    """FSDP2 shard placement: expert parameters on the efsdp mesh, the rest on the fsdp mesh (torchtitan's
    apply_fsdp_to_decoder with ep > 1)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    from torch.distributed.tensor import Shard
    edp_mesh = parallel_dims.get_mesh("efsdp")
    edp_info, dp_info = _get_mesh_info(edp_mesh, None), _get_mesh_info(dp_mesh, None)
    experts = {p for moe in _moes(model) for p in moe.experts.parameters()}
    n_experts = min(moe.n_experts for moe in _moes(model))
    # fewer experts than efsdp x ep ranks: shard the expert's rows instead of padding whole experts
    dim = 1 if edp_mesh.size() * parallel_dims.ep > n_experts else 0

    def fn(param):
        if param in experts:
            return ShardPlacementResult(placement=Shard(dim), mesh_info=edp_info)
        return ShardPlacementResult(placement=Shard(0), mesh_info=dp_info)
    return fn


def ep_experts(experts, x: torch.Tensor, counts: torch.Tensor, group) -> torch.Tensor:
    """The routed experts under expert parallelism: `x` [N, latent] this rank's (token, expert) pairs
    sorted by global expert id, `counts` [E] how many per expert; returns the experts' outputs for those
    pairs in the same order (torchtitan's AllToAllTokenDispatcher dispatch -> experts -> combine)."""
    import torch.distributed as dist
    ep = dist.get_world_size(group)
    n_local = counts.numel() // ep
    counts = counts.to(torch.int64)
    with torch.no_grad():  # recv[r, e]: tokens rank r sends to this rank's local expert e
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts.contiguous(), group=group)
    recv = recv.view(ep, n_local)
    send_splits = counts.view(ep, n_local).sum(1).tolist()
    recv_splits = recv.sum(1).tolist()
    xr = _VarAllToAll.apply(x.contiguous(), recv_splits, send_splits, group)
    # rank-major (r0 e0, r0 e1, .., r1 e0, ..) -> expert-major (e0 r0, e0 r1, .., e1 r0, ..), on the device
    # without a host sync per segment (torchtitan's AllToAllTokenDispatcher._permute)
    flat = recv.reshape(-1)
    in_starts = (torch.cumsum(flat, 0) - flat).view(ep, n_local).t().reshape(-1)
    seg_lens = recv.t().reshape(-1)
    total = sum(recv_splits)
    seg = torch.repeat_interleave(torch.arange(seg_lens.numel(), device=x.device), seg_lens, output_size=total)
    out_starts = torch.cumsum(seg_lens, 0) - seg_lens
    perm = in_starts[seg] + torch.arange(total, device=x.device) - out_starts[seg]
    y = experts(xr[perm], recv.sum(0).tolist())
    back = torch.empty_like(perm)
    back[perm] = torch.arange(perm.numel(), device=perm.device)
    return _VarAllToAll.apply(y[back].contiguous(), send_splits, recv_splits, group)


class _VarAllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits (rows); the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        import torch.distributed as dist
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        import torch.distributed as dist
        g = g.contiguous()
        out = g.new_empty((sum(ctx.in_splits),) + tuple(g.shape[1:]))
        dist.all_to_all_single(out, g, ctx.in_splits, ctx.out_splits, group=ctx.group)
        return out, None, None, None
