"""DeepSeek-V3 / Kimi text tower sizes (torch-free): multi-head latent attention, `n_dense_layers` leading
SwiGLU layers, then MoE layers of routed SwiGLU experts and shared experts; untied embedding and LM head.

The sizes are the `model` group's fields (rl.contract.config.ModelConfig). `from_hf` is the one reader of a
DeepSeek-V3 / Kimi config.json (text tower): composition fills the `model` group from its `model_fields()`
(rl.models.fields; `HF_FIELDS` names what it sets), so `from_model` builds the same args of a composed
config without opening a file. `layers()` gives one row per
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
    rope_theta: float = 10000.0   # not a size: the `model` group carries it to the trainer's RoPE

    FAMILY = "deepseek_v3"    # named in a missing key's error
    # the `model` group fields config.json determines (model_fields()); rl.models.fields zeroes the rest
    HF_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "top_k", "rope_theta", "moe_hidden_dim",
                 "n_kv_heads", "head_dim", "num_experts", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                 "qk_rope_head_dim", "v_head_dim", "n_shared_experts", "n_dense_layers", "dense_hidden_dim")

    @property
    def n_kv_heads(self) -> int:
        return self.n_heads          # MLA: every head has its own (latent-derived) keys and values

    @property
    def head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_model(cls, m, hf: Mapping[str, Any] | None = None):
        """The args of the typed `model` group `m` (its fields of the same names)."""
        return cls(**{f.name: getattr(m, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]):
        """The args of a checkpoint's config.json (the text tower of a multimodal one); a missing key is a
        one-line CheckpointError naming it."""
        from rl.contract import hf as hfc
        tc = hfc.text_config(hf)
        need = lambda k: hfc.need(tc, k, cls.FAMILY)  # noqa: E731
        nope, rope = int(need("qk_nope_head_dim")), int(need("qk_rope_head_dim"))
        return cls(vocab_size=int(need("vocab_size")), dim=int(need("hidden_size")),
                   n_layers=int(need("num_hidden_layers")), n_heads=int(need("num_attention_heads")),
                   top_k=int(need("num_experts_per_tok")), rope_theta=hfc.rope_theta(tc),
                   moe_hidden_dim=int(need("moe_intermediate_size")),
                   num_experts=int(tc.get("n_routed_experts") or need("num_local_experts")),
                   q_lora_rank=int(tc.get("q_lora_rank") or 0), kv_lora_rank=int(need("kv_lora_rank")),
                   qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=int(need("v_head_dim")),
                   n_shared_experts=int(tc.get("n_shared_experts") or 0),
                   n_dense_layers=int(tc.get("first_k_dense_replace") or 0),
                   dense_hidden_dim=int(need("intermediate_size")), **cls._hf_extra(tc, need))

    @classmethod
    def _hf_extra(cls, tc: Mapping[str, Any], need) -> dict:
        """The fields a subclass adds (GLM-5's indexer), read from the same config.json."""
        return {}

    def model_fields(self) -> dict:
        """The `model` group values config.json determines (`HF_FIELDS`)."""
        return {k: getattr(self, k) for k in self.HF_FIELDS}

    @classmethod
    def twin_sizes(cls, m: Mapping[str, Any]) -> dict:
        """The transformers config keys of a network created here (no checkpoint) with the sizes of the
        `model` group `m` (rl.tiny_models.tiny): the inverse of `from_hf`."""
        return dict(hidden_size=m["dim"], num_hidden_layers=m["n_layers"], num_attention_heads=m["n_heads"],
                    q_lora_rank=m["q_lora_rank"] or None, kv_lora_rank=m["kv_lora_rank"],
                    qk_rope_head_dim=m["qk_rope_head_dim"], qk_nope_head_dim=m["qk_nope_head_dim"],
                    v_head_dim=m["v_head_dim"], n_routed_experts=m["num_experts"],
                    n_shared_experts=m["n_shared_experts"], num_experts_per_tok=m["top_k"],
                    moe_intermediate_size=m["moe_hidden_dim"], intermediate_size=m["dense_hidden_dim"],
                    first_k_dense_replace=m["n_dense_layers"], max_position_embeddings=m["max_seq_len"],
                    n_group=1, topk_group=1, norm_topk_prob=True, rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": m["rope_theta"]})

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


def twin_sizes(m: Mapping[str, Any]) -> dict:
    """`DeepSeekV3Args.twin_sizes`, by the name rl.tiny_models.tiny looks for in a family's args module."""
    return DeepSeekV3Args.twin_sizes(m)
