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
is derived from its rows (`Family.package`: the folder holding the network), so a family is named in one
place, and its module is imported only when that family is built.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from rl.contract.families import ROWS

# family name -> its builder module, one per row of rl.contract.families (kimi_k2_7's package is
# deepseek_v3: a flavor of the DeepSeek-V3 network)
REGISTRY = {row.name: f"rl.models.{row.package}" for row in ROWS}


def family_module(family: str) -> ModuleType:
    """The builder module of `family` (imported now); an unknown family is a one-line ValueError."""
    name = REGISTRY.get(family)
    if name is None:
        raise ValueError(f"model.family={family!r} is not known (known: {', '.join(REGISTRY)})")
    return importlib.import_module(name)
