"""Qwen3-MoE sizes (torch-free): grouped-query attention with per-head q/k RMSNorms and RoPE, every layer
an MoE of routed SwiGLU experts (no shared expert; `from_hf` refuses Qwen3-MoE's dense layers); untied
embedding and LM head.

The sizes are the `model` group's fields (rl.contract.config.ModelConfig). `from_hf` is the one reader of a
Qwen3-MoE config.json: composition fills the `model` group from its `model_fields()` (rl.models.fields;
`HF_FIELDS` names what it sets). `layers()` gives the rows rl.models.layers computes. A model created here
(no checkpoint) has its config.json written key by key by rl.tiny_models.tiny, so there is no `twin_sizes`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from rl.models import layers as L


@dataclass(frozen=True)
class Qwen3Args:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    moe_hidden_dim: int
    num_experts: int
    top_k: int
    rope_theta: float = 1000000.0   # not a size: the `model` group carries it to the trainer's RoPE

    FAMILY = "qwen3"     # named in a missing key's error
    # the `model` group fields config.json determines (model_fields()); rl.models.fields zeroes the rest
    HF_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "top_k", "rope_theta", "moe_hidden_dim",
                 "n_kv_heads", "head_dim", "num_experts")

    @classmethod
    def from_model(cls, m, hf: Mapping[str, Any] | None = None) -> "Qwen3Args":
        return cls(**{f.name: getattr(m, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "Qwen3Args":
        """The args of a Qwen3-MoE config.json; a missing key or dense layers are a one-line
        CheckpointError naming the key."""
        from rl.contract import hf as hfc
        tc = hfc.text_config(hf)
        need = lambda k: hfc.need(tc, k, cls.FAMILY)  # noqa: E731
        if tc.get("mlp_only_layers") or int(tc.get("decoder_sparse_step", 1)) != 1:
            raise hfc.CheckpointError("config.json: Qwen3-MoE with dense layers (mlp_only_layers / "
                                      "decoder_sparse_step) is not supported")
        dim, n_heads = int(need("hidden_size")), int(need("num_attention_heads"))
        return cls(vocab_size=int(need("vocab_size")), dim=dim, n_layers=int(need("num_hidden_layers")),
                   n_heads=n_heads, top_k=int(need("num_experts_per_tok")), rope_theta=hfc.rope_theta(tc),
                   moe_hidden_dim=int(need("moe_intermediate_size")),
                   n_kv_heads=int(need("num_key_value_heads")), head_dim=int(tc.get("head_dim") or dim // n_heads),
                   num_experts=int(tc.get("num_experts") or need("num_local_experts")))

    def model_fields(self) -> dict:
        """The `model` group values config.json determines (`HF_FIELDS`)."""
        return {k: getattr(self, k) for k in self.HF_FIELDS}

    def layers(self) -> tuple[L.Layer, ...]:
        attn = L.GQA(dim=self.dim, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
                     qk_norm=True)
        moe = L.MoE(dim=self.dim, hidden=self.moe_hidden_dim, n_experts=self.num_experts, top_k=self.top_k)
        return (L.Layer(self.dim, (attn, moe)),) * self.n_layers

    def mtp_layers(self) -> tuple[L.Layer, ...]:
        return ()


def from_model(m, hf: Mapping[str, Any] | None = None) -> Qwen3Args:
    return Qwen3Args.from_model(m, hf)


def from_hf(hf: Mapping[str, Any]) -> Qwen3Args:
    return Qwen3Args.from_hf(hf)
