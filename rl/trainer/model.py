"""The trainer's network: the family's torchtitan model (rl/models) built from `cfg.model`.

`model_spec` finds the family's builder module through the registry of rl/models (rl.models.qwen3,
rl.models.deepseek_v3 for deepseek_v3 and kimi_k2_7, rl.models.glm_moe_dsa) and gets back torchtitan's
ModelSpec, which carries the family's parallelize function and state-dict adapter: FSDP / EP / CP
(`trainer.parallel`, rl.trainer.parallel) go through `spec.parallelize_fn` without touching this module.

The model is built on the meta device, moved with `to_empty` and initialised by torchtitan's
`init_weights` under `set_default_dtype` (casting afterwards with `.to(dtype)` breaks the RoPE cache).
Before the build the config is transformed, whatever the family: every router becomes
`rl.models.replay.ReplayRouter` (able to replay recorded expert ids); on the CPU the flex attention and
bf16 grouped experts are swapped for `rl.models.cpu`'s versions; `fp8=True` routes attention and expert
GEMMs through `rl.trainer.fp8`. The forward helpers (logits, logprobs) and the HF names are
rl.models.common's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from rl import models
from rl.models import cpu, replay
from rl.trainer import fp8 as fp8_training

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def network_config(m: Mapping[str, Any]) -> dict:
    """The HF config.json (text tower) that defines the network of model config `m`.

    With `model.hf_path` it is the checkpoint's; otherwise the one `rl.tiny_models.tiny.write_hf_assets` writes
    for a model created here (the same architecture keys; token ids do not change the network).
    """
    from rl.contract import hf
    if m.get("hf_path"):
        return hf.text_config(hf.read_config(m["hf_path"]))
    from rl.tiny_models.tiny import hf_config
    return hf_config(m, int(m["vocab_size"]), 0, 0)


def model_spec(m: Mapping[str, Any], attn_backend: str = "flex", hf_config: Mapping[str, Any] | None = None):
    """The torchtitan ModelSpec (model config, parallelize function, HF adapter) of `m`'s family.

    The network comes from `hf_config` (default: `network_config(m)`): a checkpoint's config.json, or the
    one written for a model created here.
    """
    family = models.family_module(m["family"])
    h = dict(hf_config) if hf_config is not None else network_config(m)
    return family.model_spec(m, h, attn_backend=attn_backend)


@dataclass
class Built:
    model: torch.nn.Module
    spec: Any                      # torchtitan ModelSpec (parallelize_fn, state_dict_adapter, ...)
    device: torch.device
    dtype: torch.dtype             # compute dtype; the parameters (masters) are always fp32


def build_model(m: Mapping[str, Any], *, seed: int, device: str | torch.device = "cpu",
                dtype: str | torch.dtype = "float32", parallel: Mapping[str, int] | None = None,
                fp8: bool = False, hf_config: Mapping[str, Any] | None = None,
                materialize: bool = True) -> Built:
    """Build the model of config `m`; with `materialize`, initialise it with torch's RNG seeded by `seed`.

    Parameters are fp32 master weights whatever `dtype` is: `dtype` is the compute dtype (FSDP2's
    mixed-precision param dtype on several ranks, autocast on one; rl.trainer.train). bf16 masters would
    lose most small updates to rounding: at lr 1e-6 one Adam step changes ~1e-6 relative, far below
    bf16's 2^-8 spacing.

    `parallel` ({"ep": ..., "cp": ...}, given for multi-rank runs): fill torchtitan's sharding configs first, as its
    Trainer does through `update_from_config`, so that `parallelize_fn` can shard experts over ep.
    `fp8`: block-scaled FP8 GEMMs in attention and experts (rl.trainer.fp8; emulated on the CPU).
    `materialize=False` leaves the model on the meta device, to be parallelized first and then filled by
    `materialize_empty` + rl.trainer.hf_load (a checkpoint start: no rank holds the whole model).
    """
    device = torch.device(device)
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    spec = model_spec(m, hf_config=hf_config)
    if parallel is not None:  # torchtitan's sharding configs, as its Trainer fills them in update_from_config
        models.family_module(m["family"]).set_sharding(spec.model, int(parallel["ep"]))
    replay.apply(spec.model)  # routers that can replay recorded expert ids (a no-op until asked to)
    if device.type == "cpu":
        cpu.apply(spec.model)
    elif parallel is not None and int(parallel.get("cp", 1)) > 1:
        # context parallel on a GPU takes the CPU's tested path: K/V all-gathered, dense document mask
        # for the local query rows (torchtitan's Flex CP needs a BlockMask sharded its own way)
        cpu.dense_attention(spec.model)
    if fp8:
        fp8_training.apply(spec.model)
    from torchtitan.tools.utils import set_default_dtype
    with set_default_dtype(torch.float32), torch.device("meta"):
        model = spec.model.build()
    built = Built(model, spec, device, dtype)
    if materialize:
        torch.manual_seed(seed)
        materialize_empty(model, device)
    return built


def materialize_empty(model, device: str | torch.device, buffer_device: str | torch.device | None = None) -> None:
    """Meta -> `device` storage, initialised by torchtitan's `init_weights` (buffers such as the RoPE cache
    are computed there; under set_default_dtype, since casting afterwards breaks the RoPE cache)."""
    from torchtitan.tools.utils import set_default_dtype
    model.to_empty(device=device)
    with set_default_dtype(torch.float32), torch.no_grad():
        model.init_weights(buffer_device=buffer_device or device)
