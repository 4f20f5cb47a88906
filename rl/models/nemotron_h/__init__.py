"""NemotronH (`nemotron_h`, transformers' `NemotronHForCausalLM`): Nemotron-3 Nano / Super / Ultra.

Hybrid Mamba-2 / GQA attention / LatentMoE (+ frozen MTP layers), in plain torch (torchtitan 0.3 has no Mamba):
- `args`: config.json -> sizes (`NemotronHArgs.from_hf`, torch-free), refusals, `param_counts`;
- `mamba`: the Mamba-2 mixer (chunked SSD scan in torch, packed documents, optional mamba_ssm kernels,
  head-parallel context parallelism: its module docstring has the design);
- `model`: the network, its design and the differences from transformers (module docstring), the
  trainer's `logits` / `token_logprobs`;
- `parallelize`: FSDP2 + expert parallel (latent-width all-to-all) + context parallel (tensor parallel
  refused by name);
- `gemm`: the replaceable projections / experts (FP8 training: the GEMM and the publisher's predicate
  injected by rl.trainer.fp8);
- `state_dict_adapter`: HF names (checkpoint `backbone.*`, experts split; transformers' in-memory names
  accepted), `FP8_KEEP_DTYPE` / `keeps_dtype` for the FP8 publisher.
"""
from __future__ import annotations

from typing import Any, Mapping

NAME = "nemotron_h"


def model_spec(m: Mapping[str, Any], h: Mapping[str, Any], attn_backend: str = "flex"):
    """torchtitan ModelSpec of NemotronH config.json `h` (e.g. `NemotronHConfig(...).to_dict()`).

    `m` (the trainer's model group) and `attn_backend` are accepted for the registry's common signature:
    attention is SDPA under a dense document mask, there is no RoPE cache (NemotronH attention has no
    positional embedding), so neither max_seq_len nor the backend changes the network.
    """
    from torchtitan.protocols.model_spec import ModelSpec
    from rl.models.nemotron_h.model import model_config
    from rl.models.nemotron_h.parallelize import parallelize_nemotron_h
    from rl.models.nemotron_h.state_dict_adapter import NemotronHStateDictAdapter
    return ModelSpec(name=NAME, flavor=f"hetrl:{NAME}", model=model_config(h),
                     parallelize_fn=parallelize_nemotron_h, pipelining_fn=None, post_optimizer_build_fn=None,
                     state_dict_adapter=NemotronHStateDictAdapter)


def twin_tensors(h: Mapping[str, Any], seed: int = 0, dtype: str = "float32") -> dict:
    """The tensors a tiny twin's checkpoint needs beyond what transformers writes (rl.tiny_models.twins): the MTP
    layers' (`mtp.layers.*`, checkpoint names, experts split), random, norms around 1. transformers has no
    MTP module (it ignores `mtp.*` on load), vLLM's NemotronH-MTP and the trainer read them."""
    import torch
    from rl.models.nemotron_h.model import model_config
    from rl.models.nemotron_h.state_dict_adapter import NemotronHStateDictAdapter
    with torch.device("meta"):
        model = model_config(h).build()
    shapes = {k: v for k, v in model.state_dict().items() if k.startswith("mtp.")}
    g = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(tuple(v.shape), generator=g) * 0.05
                + (1.0 if k.endswith("norm.weight") else 0.0)).to(getattr(torch, dtype))
            for k, v in NemotronHStateDictAdapter().to_hf(shapes).items()}


def set_sharding(model_config, ep: int) -> None:
    """No torchtitan sharding configs to fill (plain torch modules): expert parallelism is applied to the
    built model by rl.models.nemotron_h.parallelize."""
