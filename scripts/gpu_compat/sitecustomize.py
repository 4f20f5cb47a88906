"""Harness-only import shim for running the GPU check on a machine whose torch is older than the project
supports (the lent H200 has torch 2.11; the project needs 2.13). torchtitan 0.3.0 imports
`torch.distributed.fsdp.DataParallelMeshDims` at module level, which torch 2.11 lacks. The trainer on one
GPU never passes `dp_mesh_dims` (no full-DTensor FSDP), so the name only has to exist for the import to
succeed; this defines a placeholder of the same shape. Active only with HETRL_TORCH_SHIM=1
(scripts/gpu_check.sh sets it when the installed torch lacks the name). Never installed with the project:
results measured under it say so (docs/gpu.md)."""
import os

if os.environ.get("HETRL_TORCH_SHIM") == "1":
    import dataclasses

    import torch.distributed.fsdp as _fsdp

    if not hasattr(_fsdp, "DataParallelMeshDims"):
        @dataclasses.dataclass(frozen=True)
        class DataParallelMeshDims:
            shard: object = None
            replicate: object = None

        _fsdp.DataParallelMeshDims = DataParallelMeshDims

    # torchtitan 0.3.0 passes create_block_mask(separate_full_blocks=True); torch 2.11 has no such argument
    # and always separates full blocks, i.e. behaves as True. Anything else is refused, not dropped.
    import inspect

    import torch.nn.attention.flex_attention as _flex

    if "separate_full_blocks" not in inspect.signature(_flex.create_block_mask).parameters:
        _create_block_mask = _flex.create_block_mask

        def create_block_mask(*args, separate_full_blocks=True, **kwargs):
            if not separate_full_blocks:
                raise NotImplementedError("separate_full_blocks=False needs torch >= 2.13")
            return _create_block_mask(*args, **kwargs)

        _flex.create_block_mask = create_block_mask
