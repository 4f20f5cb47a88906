"""Multi-rank training: `trainer.parallel` (dp_shard x ep x cp = world size) on torchtitan.

Mapping onto torchtitan's `ParallelDims` (legacy "partial_dtensor" SPMD backend, see
docs/cpu.md): expert parallelism borrows its ranks from data parallelism, as in
torchtitan, so the trainer's `dp_shard * ep` ranks are torchtitan's `dp_shard`, and its `ep` divides it:

    ParallelDims(dp_replicate=1, dp_shard=dp_shard*ep, cp=cp, tp=1, pp=1, ep=ep)

- dense parameters are FSDP-sharded over all dp_shard*ep*cp ranks (torchtitan's "fsdp" mesh),
- routed experts are split over `ep` ranks (tokens exchanged by all-to-all) and FSDP-sharded over
  the remaining dp_shard*cp ranks ("efsdp"),
- the *data* is split over the dp_shard*ep ranks ("batch" mesh): whole micro-batches, round robin;
  ranks with fewer micro-batches run an empty one (loss mask 0) so FSDP's and EP's collectives stay in
  lockstep;
- each micro-batch row is split over the `cp` ranks (head-tail load balanced, as torchtitan's
  `_HeadTailLoadBalancer`): rank r holds chunks r and 2cp-1-r of 2cp; K/V are all-gathered in attention
  (rl.models.cpu.dense_cp; the row layout is rl.models.common.headtail_index).

The loss of every rank is its *local sum* divided by the batch-wide number of loss tokens, and FSDP's
gradient division is off (torchtitan's `disable_fsdp_gradient_division`), so the summed gradients equal
the single-process gradient of the same batch.

`parallelize_fn` is the family's (`built.spec.parallelize_fn`, rl/models/<family>). Every rank first materialises
the whole model with the run's seed (the same initial weights as a single-process run), then FSDP/EP
keep each rank's shard. That costs a full model per rank at start: fine for the models this trainer
creates from scratch; an `hf_path` start would load the shards through DCP instead.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from rl.models import cpu

SPMD_BACKEND = "partial_dtensor"   # "spmd_types" (0.3.0's default) fails with torch 2.13 (notes)


@dataclass
class Dist:
    """Where this process sits. world == 1: a plain single-process trainer (no process group)."""
    world: int = 1
    rank: int = 0
    dp_shard: int = 1
    ep: int = 1
    cp: int = 1
    dims: Any = None          # torchtitan ParallelDims when world > 1
    dp_rank: int = 0          # index in the data ("batch") mesh: dp_shard * ep ranks
    cp_rank: int = 0
    owns_pg: bool = False
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def dp_size(self) -> int:
        return self.dp_shard * self.ep

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- collectives (no-ops on one process) ----------------------------------------------------------
    def broadcast(self, obj):
        """rank 0's `obj` on every rank (small Python objects: paths, flags)."""
        if not self.distributed:
            return obj
        import torch.distributed as dist
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, obj) -> list:
        """Every rank's `obj` (small Python objects: a verdict, an error line), in rank order."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist
            dist.barrier()

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            import torch.distributed as dist
            t = t.clone()
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def max(self, t: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            import torch.distributed as dist
            t = t.clone()
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def close(self) -> None:
        if self.owns_pg:
            import torch.distributed as dist
            if dist.is_initialized():
                # Every rank past its last collective before any tears the group down: a rank whose
                # peer closed its gloo sockets mid-collective aborts in C++ ("terminate called without
                # an active exception"), seen once in CI-like runs.
                # (Not while an exception unwinds: a failed peer would never arrive; torchrun ends us.)
                import sys
                try:
                    if sys.exc_info()[0] is None:
                        dist.barrier()
                finally:
                    dist.destroy_process_group()
            self.owns_pg = False


def check_dims(p, world: int) -> tuple[int, int, int]:
    dp, ep, cp = int(p.dp_shard), int(p.ep), int(p.cp)
    if dp * ep * cp != world:
        raise ValueError(f"trainer.parallel dp_shard*ep*cp = {dp}*{ep}*{cp} = {dp * ep * cp} must equal the "
                         f"trainer's world size {world} (torchrun --nproc-per-node x nodes)")
    return dp, ep, cp


def init(parallel_cfg, device: torch.device) -> Dist:
    """Join (or create) the process group of a torchrun launch and build torchtitan's meshes."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp, ep, cp = check_dims(parallel_cfg, world)
    if world == 1:
        return Dist(device=device)
    import torch.distributed as dist
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    if device.type == "cpu":
        cpu.force_cpu_device()
    owns = False
    if not dist.is_initialized():
        # Ranks other than 0 wait in a broadcast while rank 0 polls for rollouts: a long timeout.
        dist.init_process_group("gloo" if device.type == "cpu" else "cuda:nccl,cpu:gloo",
                                timeout=timedelta(hours=6))
        owns = True
    dist_utils.set_spmd_backend(SPMD_BACKEND)
    dims = ParallelDims(dp_replicate=1, dp_shard=dp * ep, cp=cp, tp=1, pp=1, ep=ep, world_size=world,
                        spmd_backend=SPMD_BACKEND)
    dims.build_mesh()
    dp_rank = dims.get_mesh("batch").get_local_rank() if dp * ep > 1 else 0
    cp_rank = dims.get_mesh("cp").get_local_rank() if cp > 1 else 0
    return Dist(world=world, rank=dist.get_rank(), dp_shard=dp, ep=ep, cp=cp, dims=dims, dp_rank=dp_rank,
                cp_rank=cp_rank, owns_pg=owns, device=device)


def ac_config(mode: str):
    """torchtitan's activation-checkpointing policy for trainer.activation_checkpointing."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    if mode == "none":
        return None
    return {"full": FullAC.Config, "selective": SelectiveAC.Config}[mode]()


def parallelize(model, spec, d: Dist, dtype: torch.dtype, *, activation_checkpointing: str = "none",
                cpu_offload: bool = False):
    """Apply torchtitan's parallelize function (FSDP2 x EP x CP, activation checkpointing, FSDP2's CPU
    offload of parameters, gradients and optimizer states) to a materialised model. One process: only
    activation checkpointing applies (there is nothing to shard or offload to)."""
    ac = ac_config(activation_checkpointing)
    if not d.distributed:
        if ac is not None:
            ac.build(dump_folder="").apply(model)
        return model
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig

    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    training = TrainingConfig(mixed_precision_param=name, mixed_precision_reduce="float32",
                              enable_cpu_offload=cpu_offload)
    parallelism = ParallelismConfig(data_parallel_shard_degree=d.dp_size, context_parallel_degree=d.cp,
                                    expert_parallel_degree=d.ep, spmd_backend=SPMD_BACKEND)
    kwargs = dict(parallel_dims=d.dims, training=training, parallelism=parallelism,
                  compile_config=CompileConfig(enable=False), ac_config=ac, dump_folder="")
    # the family's parallelize function (rl/models/<family>): CP runs dense-mask attention on every device
    model = spec.parallelize_fn(model, **kwargs)
    if d.device.type == "cpu":
        cpu.fsdp_gloo(model)
    return model


def full_state_dict(model, d: Dist) -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors of the model's state dict on rank 0; {} elsewhere.

    Every rank takes part in the all-gathers, one tensor at a time (so peak memory off rank 0 is one
    tensor, not the model).
    """
    from torch.distributed.tensor import DTensor
    out = {}
    for k, v in model.state_dict().items():
        if isinstance(v, DTensor):
            v = v.full_tensor()
        if d.is_main:
            out[k] = v.detach()
    return out


def clip_grad_norm(model, max_norm: float, d: Dist) -> float:
    if not d.distributed:
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    from torchtitan.distributed import utils as dist_utils
    return float(dist_utils.clip_grad_norm_(list(model.parameters()), max_norm, foreach=None,
                                            ep_enabled=d.ep > 1))
