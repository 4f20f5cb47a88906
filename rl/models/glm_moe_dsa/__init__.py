"""GLM-5 (`glm_moe_dsa`, transformers' `GlmMoeDsaForCausalLM`): DeepSeek-V3 pieces plus the DSA indexer.

- `model`: the network (`GlmAttention` = torchtitan's MLA attention + the indexer, `model_config` from
  config.json; its module docstring has the design and the differences from HF);
- `parallelize`: torchtitan's DeepSeek-V3 parallelize, GLM-5's own context-parallel gathering;
- `state_dict_adapter`: the HF names (DeepSeek-V3's adapter plus the indexer's weights).
"""
from __future__ import annotations

from typing import Any, Mapping

NAME = "glm_moe_dsa"


def model_spec(m: Mapping[str, Any], h: Mapping[str, Any], attn_backend: str = "flex"):
    """torchtitan ModelSpec of GLM-5 config.json `h` (a dict, e.g. `GlmMoeDsaConfig(...).to_dict()`).

    `m["max_seq_len"]`, when given: the RoPE cache length (default: the checkpoint's
    max_position_embeddings).
    """
    from torchtitan.protocols.model_spec import ModelSpec
    from rl.models.glm_moe_dsa.model import model_config
    from rl.models.glm_moe_dsa.parallelize import parallelize
    from rl.models.glm_moe_dsa.state_dict_adapter import GlmMoeDsaStateDictAdapter
    seq = m.get("max_seq_len")
    return ModelSpec(name=NAME, flavor=f"hetrl:{NAME}",
                     model=model_config(h, attn_backend, int(seq) if seq else None),
                     parallelize_fn=parallelize, pipelining_fn=None, post_optimizer_build_fn=None,
                     state_dict_adapter=GlmMoeDsaStateDictAdapter)


def set_sharding(model_config, ep: int) -> None:
    """torchtitan's DeepSeek-V3 sharding configs (GLM-5's layers have its shapes)."""
    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config
    set_deepseek_v3_sharding_config(model_config, enable_sp=False, enable_ep=ep > 1)
