"""Qwen3-MoE sizes (torch-free): grouped-query attention with per-head q/k RMSNorms and RoPE, every layer
an MoE of routed SwiGLU experts (no shared expert; rl.contract.hf refuses Qwen3-MoE's dense layers);
untied embedding and LM head.

The sizes are the `model` group's fields (rl.contract.config.ModelConfig; rl.contract.hf fills them from
config.json, `from_hf` reads one the same way); `layers()` gives the rows rl.models.layers computes.
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

    @classmethod
    def from_model(cls, m, hf: Mapping[str, Any] | None = None) -> "Qwen3Args":
        return cls(**{f.name: getattr(m, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "Qwen3Args":
        from types import SimpleNamespace

        from rl.contract import hf as hfc
        return cls.from_model(SimpleNamespace(**hfc.model_fields(hf, "qwen3")))

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
