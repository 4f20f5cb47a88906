"""NemotronH HF names <-> the trainer's module names, and the tensors FP8 shards keep in the checkpoint dtype.

Module names here are transformers' names below its `model.` prefix (checkpoints write `backbone.`), so
the mapping is a prefix rename plus the routed experts' layout:
- checkpoint (safetensors, what `to_hf` writes and vLLM / `from_pretrained` read):
  `backbone.layers.{i}.mixer.experts.{e}.up_proj.weight` [F, latent] / `.down_proj.weight` [latent, F];
- transformers in memory (`NemotronHForCausalLM.state_dict()`, also accepted by `from_hf`):
  `model.layers.{i}.mixer.experts.up_proj` [E, F, latent] / `.down_proj` [E, latent, F];
- here: `layers.{i}.mixer.experts.up_proj` / `.down_proj`, stacked as transformers keeps them.
`backbone.embeddings.weight` <-> `embeddings.weight`, `backbone.norm_f.weight` <-> `norm_f.weight`,
`lm_head.weight` unchanged, `mtp.layers.{j}.*` <-> `mtp.{j}.*` (frozen MTP layers, rl.models.nemotron_h.model; their experts
split per expert as well, the layout vLLM's NemotronH-MTP loader reads).
`to_hf(from_hf(sd))` returns the checkpoint's tensors bit for bit (the stacking is a copy, no arithmetic).
"""
from __future__ import annotations

import re
from typing import Any

import torch

# Tensors of a NemotronH checkpoint that an FP8 publisher must leave in the checkpoint's dtype (BF16 for
# Nemotron-3): name suffixes / fragments, matched with `keeps_dtype(name)`. Everything the Mamba scan
# reads outside the two big GEMMs is tiny and precision-critical (A_log and dt_bias enter exp/softplus,
# D the skip path, conv1d is a 4-tap depthwise filter with no GEMM to quantize), all norms (the block
# pre-norms, norm_f, the Mamba gated RMSNorm `mixer.norm`, the MTP enorm/hnorm/final_layernorm), the
# router gate and its expert-bias correction (routing decisions), embeddings and the LM head; and, as
# NVIDIA's Nemotron 3 FP8 checkpoint does, the attention q/k/v/o (8 of Ultra's 108 layers) and the
# LatentMoE latent projections fc1/fc2_latent_proj (GEMMs, but BF16 in NVIDIA's FP8 layout).
# Quantized (e4m3, 128x128 blocks): Mamba in_proj / out_proj, dense MLP up/down, routed experts up/down,
# shared experts up/down, MTP eh_proj.
FP8_KEEP_DTYPE = (
    ".mixer.A_log", ".mixer.D", ".mixer.dt_bias", ".mixer.conv1d.weight", ".mixer.conv1d.bias",
    ".mixer.norm.weight", ".norm.weight", "norm_f.weight", ".enorm.weight", ".hnorm.weight",
    ".final_layernorm.weight", ".mixer.gate.weight", ".mixer.gate.e_score_correction_bias",
    ".mixer.q_proj.weight", ".mixer.k_proj.weight", ".mixer.v_proj.weight", ".mixer.o_proj.weight",
    ".mixer.fc1_latent_proj.weight", ".mixer.fc2_latent_proj.weight",
    "embeddings.weight", "lm_head.weight",
)


def keeps_dtype(hf_name: str) -> bool:
    """True if the FP8 publisher must write `hf_name` in the checkpoint dtype (not e4m3)."""
    return hf_name.endswith(FP8_KEEP_DTYPE) or hf_name.endswith(".bias")


_SPLIT = re.compile(r"^(backbone\.|model\.|mtp\.)layers\.(\d+)\.mixer\.experts\.(\d+)\.(up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(backbone\.|model\.|mtp\.)layers\.(\d+)\.mixer\.experts\.(up_proj|down_proj)$")



def _ours_prefix(hf_prefix: str) -> str:
    return "mtp." if hf_prefix == "mtp." else "layers."


class NemotronHStateDictAdapter:
    """torchtitan's StateDictAdapter protocol (`to_hf`, `from_hf`) for NemotronH."""

    def __init__(self, model_config=None, hf_assets_path: str | None = None):
        self.model_config = model_config
        self.hf_assets_path = hf_assets_path

    # checkpoint layout out
    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for k, v in state_dict.items():
            if k == "lm_head.weight":
                out[k] = v
                continue
            mtp = k.startswith("mtp.")
            name = "mtp.layers." + k[len("mtp."):] if mtp else "backbone." + k
            m = _FUSED.match(name)
            if m:
                for e in range(v.shape[0]):
                    out[f"{m.group(1)}layers.{m.group(2)}.mixer.experts.{e}.{m.group(3)}.weight"] = v[e]
            else:
                out[name] = v
        return out

    # checkpoint or in-memory transformers layout in
    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        out, split = {}, {}
        for k, v in hf_state_dict.items():
            k = k.removeprefix("language_model.")
            if k == "lm_head.weight":
                out[k] = v
                continue
            m = _SPLIT.match(k)
            if m:
                split.setdefault((_ours_prefix(m.group(1)) + m.group(2), m.group(4)), {})[int(m.group(3))] = v
                continue
            m = _FUSED.match(k)
            if m:
                out[f"{_ours_prefix(m.group(1))}{m.group(2)}.mixer.experts.{m.group(3)}"] = v
                continue
            if k.startswith("mtp.layers."):
                out["mtp." + k[len("mtp.layers."):]] = v
                continue
            for p in ("backbone.", "model."):
                if k.startswith(p):
                    out[k[len(p):]] = v
                    break
            else:
                raise KeyError(f"not a NemotronH checkpoint tensor: {k}")
        for (layer, kind), experts in split.items():
            if sorted(experts) != list(range(len(experts))):
                raise KeyError(f"{layer} {kind}: experts {sorted(experts)} are not 0..E-1")
            out[f"{layer}.mixer.experts.{kind}"] = torch.stack([experts[e] for e in range(len(experts))])
        return out
