"""FSDP2 and context parallelism for NemotronH (torchtitan's parallelize_fn signature).

- FSDP2 (`fully_shard`) per block, on the MTP layers (frozen; their parameters are sharded like the rest,
  no gradients), and on the root (embeddings, norm_f, lm_head), over torchtitan's "fsdp" mesh
  (dp_shard * cp ranks), with mixed precision param dtype from `training.mixed_precision_param` and fp32
  reduction and no gradient division (the trainer's loss is already divided by the batch-wide
  token count, torchtitan's `disable_fsdp_gradient_division`), FSDP2 CPU offload from `training.enable_cpu_offload`; activation checkpointing per block via
  torchtitan's `ac_config` when given.
- Context parallel (`parallel_dims.cp_enabled`): `NemotronH.enable_context_parallel(cp group)`: Mamba
  layers head-parallel with an all-to-all (rl.models.nemotron_h.mamba, cp must divide n_groups), attention
  K/V all-gathered against the trainer's mask rows; the trainer's head-tail row layout.
- Expert parallel and tensor parallel: NotImplementedError (named). With ep = 1 the routed experts are
  FSDP-sharded with their block like every other weight.
"""
from __future__ import annotations

import torch


def parallelize_nemotron_h(model, *, parallel_dims, training=None, parallelism=None, compile_config=None,
                           ac_config=None, dump_folder: str = "", **kwargs):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    if parallel_dims.tp_enabled:
        raise NotImplementedError("NemotronH with tensor parallelism: no TP plan for the Mamba mixer")
    if getattr(parallel_dims, "ep_enabled", False):
        raise NotImplementedError("NemotronH with expert parallelism (trainer.parallel.ep > 1) is not built; "
                                  "its routed experts are FSDP-sharded with their block")
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
    for layer in model.layers.values():
        fully_shard(layer, **kw)
    for layer in model.mtp.values():
        fully_shard(layer, **kw)
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


def ep_experts(experts, x, counts, group):
    raise NotImplementedError("NemotronH expert parallelism is not built")
