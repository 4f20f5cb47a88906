"""The networks the trainer builds, one folder per family (torchtitan's layout), behind one registry.

`rl/models/<package>/` holds a family's network builder, its sharding (parallelize function) and its
state-dict adapter (HF names); families that torchtitan already has reuse its pieces. Each family module
offers the same two functions:

    model_spec(m, h, attn_backend="flex") -> torchtitan ModelSpec   # m: the `model` group (name,
        family, max_seq_len), h: the HF config.json (text tower) that defines the network
    set_sharding(model_config, ep) -> None                          # torchtitan's sharding configs

Shared pieces are leaves here: `common` (forward helpers, HF names, MLA RoPE), `cpu` (the CPU swaps),
`replay` (the replaying MoE router). Nothing in rl/models imports rl/trainer; rl/trainer imports this.
Which family exists, and what torch-free readers know about it, is rl.contract.families; this registry
maps each of its rows to the module holding the network, imported only when that family is built.
"""
from __future__ import annotations

import importlib
from types import ModuleType

# family name -> its builder module (kimi_k2_7 is a flavor of the DeepSeek-V3 network)
REGISTRY = {
    "qwen3": "rl.models.qwen3",
    "deepseek_v3": "rl.models.deepseek_v3",
    "kimi_k2_7": "rl.models.deepseek_v3",
    "glm_moe_dsa": "rl.models.glm_moe_dsa",
    "nemotron_h": "rl.models.nemotron_h",
}


def family_module(family: str) -> ModuleType:
    """The builder module of `family` (imported now); an unknown family is a one-line ValueError."""
    name = REGISTRY.get(family)
    if name is None:
        raise ValueError(f"model.family={family!r} is not known (known: {', '.join(REGISTRY)})")
    return importlib.import_module(name)
