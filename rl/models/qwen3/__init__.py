"""Qwen3-MoE (`qwen3`): torchtitan's Qwen3-MoE built from an HF config.json, its sharding and HF adapter.

The config.json (`h`) becomes a torchtitan qwen3 *flavor* registered under `hetrl:<model.name>` and
assembled with torchtitan's own qwen3 layer builders, so the ModelSpec that comes back carries
torchtitan's parallelize function and state-dict adapter (Qwen3StateDictAdapter).

Differences from torchtitan's stock MoE flavors, all to be the exact network of the HF config
(Qwen3MoeForCausalLM, which is what vLLM serves):
- no weight tying unless config.json asks for it (tie_word_embeddings);
- softmax router with top-k renormalisation (norm_topk_prob), as torchtitan's qwen3 MoE already is;
- no auxiliary-loss-free expert bias (`load_balance_coeff=None`): HF Qwen3-MoE has no such bias, and a
  bias only the trainer saw would route tokens differently from inference.

Parallelize: torchtitan's `parallelize_qwen3`, with context parallel on DenseAttention redirected to
rl.models.cpu.dense_cp (the dense-mask CP every device runs).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

# rl.models.common / cpu import torch: imported where used, so that this package's torch-free
# `args` (the plan arithmetic's) imports without them

# the torchtitan module whose CP step (`apply_cp_to_forward`) the parallelize function uses
CP_PARALLELIZE_MODULE = "torchtitan.models.qwen3.parallelize"


def _flavor(m: Mapping[str, Any], h: Mapping[str, Any]):
    """torchtitan qwen3 flavor function (attn_backend, moe_comm_backend) -> Qwen3Model.Config for HF `h`."""
    from rl.models import common
    from rl.contract.hf import rope_scaling, rope_theta
    from rl.models.qwen3.args import Qwen3Args
    from torchtitan.models import qwen3 as q3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    if rope_scaling(h):
        raise ValueError(f"config.json rope scaling {rope_scaling(h)} is not supported for family qwen3")
    f = Qwen3Args.from_hf(h).model_fields()

    def build(attn_backend: str, moe_comm_backend: str = "standard"):
        dim, vocab = f["dim"], f["vocab_size"]
        cfg = q3.Qwen3Model.Config(
            vocab_size=vocab, dim=dim, norm=q3._qwen3_norm(dim), enable_weight_tying=bool(h.get("tie_word_embeddings")),
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                            param_init=q3._EMBEDDING_INIT),
            lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=q3._LINEAR_INIT),
            layers=q3._build_qwen3_moe_layers(
                n_layers=f["n_layers"], dim=dim, n_heads=f["n_heads"], n_kv_heads=f["n_kv_heads"],
                head_dim=f["head_dim"], moe_hidden_dim=f["moe_hidden_dim"], num_experts=f["num_experts"],
                top_k=f["top_k"], attn_backend=attn_backend, moe_comm_backend=moe_comm_backend,
                rope=CosSinRoPE.Config(dim=f["head_dim"], max_seq_len=int(m["max_seq_len"]),
                                       theta=rope_theta(h))))
        for layer in cfg.layers:
            # HF Qwen3-MoE has no expert bias: one only the trainer saw would route unlike inference
            layer.moe.load_balance_coeff = None
            layer.moe.router.route_norm = bool(h.get("norm_topk_prob", True))
        common.rms_eps(cfg, float(h.get("rms_norm_eps", 1e-6)))
        return cfg
    return build


def parallelize(model, **kwargs):
    """torchtitan's `parallelize_qwen3` (FSDP2 x EP x CP, AC), CP on DenseAttention by rl.models.cpu."""
    from rl.models import cpu
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3
    with cpu.patch_cp_for_dense_attention(CP_PARALLELIZE_MODULE):
        return parallelize_qwen3(model, **kwargs)


def model_spec(m: Mapping[str, Any], h: Mapping[str, Any], attn_backend: str = "flex"):
    """The torchtitan ModelSpec of config.json `h` with the usage limits of model group `m`."""
    from torchtitan.models.qwen3 import model_registry, qwen3_configs
    name = f"hetrl:{m['name']}"
    qwen3_configs[name] = _flavor(m, h)  # re-registering the same name replaces it (tests use several sizes)
    return dataclasses.replace(model_registry(name, attn_backend=attn_backend), parallelize_fn=parallelize)


def set_sharding(model_config, ep: int) -> None:
    """torchtitan's sharding configs (its Trainer does this in update_from_config)."""
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config
    set_qwen3_sharding_config(model_config, enable_sp=False, enable_ep=ep > 1)
