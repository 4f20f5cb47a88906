"""DeepSeek-V3 / Kimi text tower sizes (torch-free): multi-head latent attention, `n_dense_layers` leading
SwiGLU layers, then MoE layers of routed SwiGLU experts and shared experts; untied embedding and LM head.

The sizes are the `model` group's fields (rl.contract.config.ModelConfig), which rl.contract.hf fills
from the checkpoint's config.json at composition (`from_hf` reads a config.json the same way), so
`from_model` builds the args of a composed config without opening a file. `layers()` gives one row per
block (rl.models.layers), what the plan arithmetic sums over. GLM-5 (rl/models/glm_moe_dsa/args.py)
extends these args with DeepSeek sparse attention's indexer.

Torch-free, as is this package's import: the launcher reads it on a login node.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from rl.models import layers as L


@dataclass(frozen=True)
class DeepSeekV3Args:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    moe_hidden_dim: int
    num_experts: int
    top_k: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_shared_experts: int = 0
    n_dense_layers: int = 0
    dense_hidden_dim: int = 0

    FAMILY = "deepseek_v3"    # whose config.json fields rl.contract.hf reads for `from_hf`

    @classmethod
    def from_model(cls, m, hf: Mapping[str, Any] | None = None):
        """The args of the typed `model` group `m` (its fields of the same names)."""
        return cls(**{f.name: getattr(m, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]):
        """The args of a checkpoint's config.json (the text tower of a multimodal one)."""
        from types import SimpleNamespace

        from rl.contract import hf as hfc
        return cls.from_model(SimpleNamespace(**hfc.model_fields(hf, cls.FAMILY)))

    def attention(self) -> L.MLA:
        return L.MLA(dim=self.dim, n_heads=self.n_heads, q_lora_rank=self.q_lora_rank,
                     kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                     qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim)

    def layers(self) -> tuple[L.Layer, ...]:
        """One row per block: attention, then a dense SwiGLU (the first n_dense_layers) or the MoE."""
        attn = self.attention()
        dense = L.MLP(dim=self.dim, hidden=self.dense_hidden_dim)
        moe = L.MoE(dim=self.dim, hidden=self.moe_hidden_dim, n_experts=self.num_experts, top_k=self.top_k,
                    n_shared=self.n_shared_experts)
        return tuple(L.Layer(self.dim, (attn, dense if i < self.n_dense_layers else moe))
                     for i in range(self.n_layers))

    def mtp_layers(self) -> tuple[L.Layer, ...]:
        return ()    # the MTP layer is not loaded (the twins drop num_nextn_predict_layers)


def from_model(m, hf: Mapping[str, Any] | None = None) -> DeepSeekV3Args:
    return DeepSeekV3Args.from_model(m, hf)


def from_hf(hf: Mapping[str, Any]) -> DeepSeekV3Args:
    return DeepSeekV3Args.from_hf(hf)
