"""DeepSeek-V3 (`deepseek_v3`) and Kimi's text tower (`kimi_k2_7`, a flavor of it): torchtitan's
DeepSeekV3Model built from an HF config.json, its sharding and HF adapter.

MLA attention, shared expert, sigmoid (or softmax) routing with `e_score_correction_bias`, group-limited
routing, dense first layers, yarn RoPE; torchtitan's `DeepSeekV3StateDictAdapter` gives the HF names.
The MLA latent norms keep eps 1e-6 whatever rms_norm_eps says (rl.models.common.LATENT_NORM_EPS).

Parallelize: torchtitan's `parallelize_deepseekv3`, with context parallel on DenseAttention redirected to
rl.models.cpu.dense_cp (the dense-mask CP every device runs).
"""
from __future__ import annotations

from typing import Any, Mapping

# rl.models.common / cpu import torch: imported where used, so that this package's torch-free
# `args` (the plan arithmetic's) imports without them

# the torchtitan module whose CP step (`apply_cp_to_forward`) the parallelize function uses
CP_PARALLELIZE_MODULE = "torchtitan.models.deepseek_v3.parallelize"


def _flavor(m: Mapping[str, Any], h: Mapping[str, Any]):
    """DeepSeek-V3 / Kimi text tower (torchtitan's DeepSeekV3Model) for HF config `h`."""
    from rl.models import common
    from rl.models.deepseek_v3.args import DeepSeekV3Args
    from torchtitan.models import deepseek_v3 as ds
    from torchtitan.models.common import Embedding, Linear, RMSNorm

    f = DeepSeekV3Args.from_hf(h).model_fields()
    if h.get("scoring_func", "sigmoid") not in ("sigmoid", "softmax"):
        raise ValueError(f"config.json scoring_func={h.get('scoring_func')!r} is not supported")
    if h.get("topk_method", "noaux_tc") not in ("noaux_tc", "greedy", "group_limited_greedy"):
        raise ValueError(f"config.json topk_method={h.get('topk_method')!r} is not supported")
    rope, mscale = common.mla_rope(m, h, f["qk_rope_head_dim"])
    n_group, topk_group = int(h.get("n_group") or 1), int(h.get("topk_group") or 1)

    def build(attn_backend: str, moe_comm_backend: str = "standard"):
        dim, vocab = f["dim"], f["vocab_size"]
        layers = ds._build_dsv3_layers(
            n_layers=f["n_layers"], n_dense_layers=f["n_dense_layers"], dim=dim, n_heads=f["n_heads"],
            q_lora_rank=f["q_lora_rank"], kv_lora_rank=f["kv_lora_rank"],
            qk_nope_head_dim=f["qk_nope_head_dim"], qk_rope_head_dim=f["qk_rope_head_dim"],
            v_head_dim=f["v_head_dim"], mscale=mscale,
            dense_hidden_dim=f["dense_hidden_dim"], moe_hidden_dim=f["moe_hidden_dim"],
            num_experts=f["num_experts"], num_shared_experts=max(f["n_shared_experts"], 1),
            router_top_k=f["top_k"], router_score_func=h.get("scoring_func", "sigmoid"),
            router_num_expert_groups=n_group if n_group > 1 else None,
            router_num_limited_groups=topk_group if n_group > 1 else None,
            router_route_scale=float(h.get("routed_scaling_factor", 1.0)),
            router_route_norm=bool(h.get("norm_topk_prob", True)),
            attn_backend=attn_backend, moe_comm_backend=moe_comm_backend, non_blocking_capacity_factor=None,
            rope=rope)
        for layer in layers:
            if layer.moe is not None:
                if f["n_shared_experts"] == 0:
                    layer.moe.shared_experts = None
                # noaux_tc: the checkpoint's e_score_correction_bias is the expert bias; it is loaded and
                # published, never updated by the trainer (no load-balancing hook is registered)
                if h.get("topk_method", "noaux_tc") != "noaux_tc":
                    layer.moe.load_balance_coeff = None
        cfg = ds.DeepSeekV3Model.Config(
            vocab_size=vocab, dim=dim,
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=ds._EMBEDDING_INIT),
            norm=RMSNorm.Config(normalized_shape=dim, param_init=ds._NORM_INIT),
            lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=ds._output_linear_init(dim)),
            layers=layers, mtp_layers=[])
        common.rms_eps(cfg, float(h.get("rms_norm_eps", 1e-6)))
        for layer in layers:  # the MLA latent norms keep 1e-6 whatever rms_norm_eps says (LATENT_NORM_EPS)
            layer.attention.q_norm.eps = layer.attention.kv_norm.eps = common.LATENT_NORM_EPS
        return cfg
    return build


def parallelize(model, **kwargs):
    """torchtitan's `parallelize_deepseekv3` (FSDP2 x EP x CP, AC), CP on DenseAttention by rl.models.cpu."""
    from rl.models import cpu
    from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3
    with cpu.patch_cp_for_dense_attention(CP_PARALLELIZE_MODULE):
        return parallelize_deepseekv3(model, **kwargs)


def model_spec(m: Mapping[str, Any], h: Mapping[str, Any], attn_backend: str = "flex"):
    """The torchtitan ModelSpec of config.json `h` (named after `m`'s family: deepseek_v3 or kimi_k2_7)."""
    from torchtitan.models.deepseek_v3 import DeepSeekV3StateDictAdapter
    from torchtitan.protocols.model_spec import ModelSpec
    return ModelSpec(name=m["family"], flavor=f"hetrl:{m['name']}", model=_flavor(m, h)(attn_backend),
                     parallelize_fn=parallelize, pipelining_fn=None, post_optimizer_build_fn=None,
                     state_dict_adapter=DeepSeekV3StateDictAdapter)


def set_sharding(model_config, ep: int) -> None:
    """torchtitan's sharding configs (its Trainer does this in update_from_config)."""
    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config
    set_deepseek_v3_sharding_config(model_config, enable_sp=False, enable_ep=ep > 1)
