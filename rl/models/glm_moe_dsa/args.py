"""GLM-5 sizes (torch-free): DeepSeek-V3's network (rl/models/deepseek_v3/args.py) with DeepSeek sparse
attention, whose indexer scores every key and lets attention see its top `index_topk`.

Only the attention calculator differs (rl.models.layers.DSA), and config.json has three more sizes (the
indexer's heads, head width and top-k) that `from_hf` reads and `model_fields()` hands to the `model` group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from rl.models import layers as L
from rl.models.deepseek_v3.args import DeepSeekV3Args


@dataclass(frozen=True)
class GlmMoeDsaArgs(DeepSeekV3Args):
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0

    FAMILY = "glm_moe_dsa"
    HF_FIELDS = DeepSeekV3Args.HF_FIELDS + ("index_n_heads", "index_head_dim", "index_topk")

    @classmethod
    def _hf_extra(cls, tc: Mapping[str, Any], need) -> dict:
        return dict(index_n_heads=int(need("index_n_heads")), index_head_dim=int(need("index_head_dim")),
                    index_topk=int(need("index_topk")))

    @classmethod
    def twin_sizes(cls, m: Mapping[str, Any]) -> dict:
        return dict(super().twin_sizes(m), index_n_heads=m["index_n_heads"], index_head_dim=m["index_head_dim"],
                    index_topk=m["index_topk"])

    def attention(self) -> L.DSA:
        return L.DSA(dim=self.dim, n_heads=self.n_heads, q_lora_rank=self.q_lora_rank,
                     kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                     qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim,
                     index_n_heads=self.index_n_heads, index_head_dim=self.index_head_dim,
                     index_topk=self.index_topk)


def from_model(m, hf: Mapping[str, Any] | None = None) -> GlmMoeDsaArgs:
    return GlmMoeDsaArgs.from_model(m, hf)


def from_hf(hf: Mapping[str, Any]) -> GlmMoeDsaArgs:
    return GlmMoeDsaArgs.from_hf(hf)


def twin_sizes(m: Mapping[str, Any]) -> dict:
    """`GlmMoeDsaArgs.twin_sizes`, by the name rl.tiny_models.tiny looks for in a family's args module."""
    return GlmMoeDsaArgs.twin_sizes(m)
