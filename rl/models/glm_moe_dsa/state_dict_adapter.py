"""GLM-5's HF names: torchtitan's DeepSeek-V3 adapter plus the DSA indexer's weights."""
from __future__ import annotations

import re
from typing import Any

from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

_INDEXER_KEYS = {f"model.layers.{{}}.self_attn.indexer.{n}": f"layers.{{}}.attention.indexer.{n}"
                 for n in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")}
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


class GlmMoeDsaStateDictAdapter(DeepSeekV3StateDictAdapter):
    """DeepSeek-V3's adapter plus the indexer's weights. `to_hf` writes the checkpoint layout (experts
    split per expert); `from_hf` also takes transformers' in-memory fused experts (gate_up_proj [E, 2F, D],
    down_proj [E, D, F]) and drops layers beyond num_hidden_layers (the checkpoint's MTP layer)."""

    def __init__(self, model_config, hf_assets_path: str | None):
        super().__init__(model_config, hf_assets_path)
        self.from_hf_map.update(_INDEXER_KEYS)

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        n_layers, out, rest = len(self.model_config.layers), {}, {}
        for key, value in hf_state_dict.items():
            m = re.match(r"model\.layers\.(\d+)\.", key)
            if m and int(m.group(1)) >= n_layers and not self.model_config.mtp_layers:
                continue
            f = _FUSED.match(key)
            if f is None:
                rest[key] = value
                continue
            prefix = f"layers.{f.group(1)}.moe.routed_experts.inner_experts."
            if f.group(2) == "down_proj":
                out[prefix + "w2_EDF"] = value
            else:
                w1, w3 = value.chunk(2, dim=1)  # HF: gate, up = linear(x, gate_up_proj[e]).chunk(2)
                out[prefix + "w1_EFD"], out[prefix + "w3_EFD"] = w1.contiguous(), w3.contiguous()
        out.update(super().from_hf(rest))
        return out
