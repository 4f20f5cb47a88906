"""GLM-5's parallelize function: torchtitan's DeepSeek-V3 one, with its own context-parallel gathering."""
from __future__ import annotations

from rl.models import cpu
from rl.models.glm_moe_dsa.model import GlmAttention

# the torchtitan module whose CP step (`apply_cp_to_forward`) the parallelize function uses
CP_PARALLELIZE_MODULE = "torchtitan.models.deepseek_v3.parallelize"


def parallelize(model, *, parallel_dims, **kwargs):
    """`parallelize_glm5` with context parallel on any DenseAttention left to rl.models.cpu.dense_cp."""
    with cpu.patch_cp_for_dense_attention(CP_PARALLELIZE_MODULE):
        return parallelize_glm5(model, parallel_dims=parallel_dims, **kwargs)


def parallelize_glm5(model, *, parallel_dims, **kwargs):
    """torchtitan's DeepSeek-V3 parallelize (FSDP2 per block, EP over routed experts, AC): the indexer is
    plain Linears/LayerNorm inside the attention module, sharded with its block like wq_a/wkv_a.

    Context parallel: the trainer splits each row head-tail over the cp ranks and passes the dense mask
    rows [B, 1, L/cp, L] of its local queries against the gathered keys (rl.trainer.packing._cp_shard).
    The gather cannot live in the inner attention as for the other families, since the indexer needs
    every key of the row too: each `GlmAttention` all-gathers its MLA K/V and its indexer keys itself
    (`enable_context_parallel`), and torchtitan's CP step on the inner attentions is skipped.
    """
    import importlib
    ds_parallelize = importlib.import_module(CP_PARALLELIZE_MODULE)
    if parallel_dims.tp_enabled:
        raise NotImplementedError("GLM-5 with tensor parallelism: the DSA indexer has no TP sharding plan")
    if not parallel_dims.cp_enabled:
        return ds_parallelize.parallelize_deepseekv3(model, parallel_dims=parallel_dims, **kwargs)
    attention = [block.attention for block in model.layers.values()]
    if not all(isinstance(a, GlmAttention) for a in attention):
        raise TypeError("GLM-5 context parallel: every layer's attention must be a GlmAttention")
    cp_mesh = parallel_dims.get_mesh("cp")
    for a in attention:
        a.enable_context_parallel(cp_mesh)
    inner = {id(a.inner_attention) for a in attention}
    orig = ds_parallelize.apply_cp_to_forward  # (whatever rl.models.cpu's CP patch made it)

    def apply_cp_to_forward(modules, mesh, *args, **kwargs):
        modules = list(modules)
        if all(id(m) in inner for m in modules):
            return None  # GlmAttention gathers K/V before its inner attention
        return orig(modules, mesh, *args, **kwargs)

    ds_parallelize.apply_cp_to_forward = apply_cp_to_forward
    try:
        return ds_parallelize.parallelize_deepseekv3(model, parallel_dims=parallel_dims, **kwargs)
    finally:
        ds_parallelize.apply_cp_to_forward = orig
