"""What an HF checkpoint directory says about the network: family, sizes, quantization (torch-free).

An experiment names its checkpoint (`model.hf_path`), not hand-copied sizes: `launch` reads the
checkpoint's config.json once, at composition, and writes the sizes into the run's frozen config, so the
memory estimate, the plan and every role see the checkpoint's architecture. The trainer builds its network
from the same config.json (rl.trainer.model), so the yaml sizes matter only for models created locally.

This module holds the readers every family shares (the file, the text tower, the family, RoPE,
quantization, a required key). Which keys are a family's sizes is the family's own business: its torch-free
`rl/models/<package>/args.py` (`from_hf`, `model_fields()`), which rl.models.fields finds through the
family's row and which writes them into the `model` group (`resolve_model`). rl.contract imports no family.

Families and the config.json shapes they accept are rows of rl.contract.families (`model_types`, and
`also_model_types`: a config format of another family that this one may be asked for explicitly, as
`model.family=kimi_k2_7` on the deepseek_v3 config of its tiny twin). Kimi's multimodal releases
(`kimi_k25`) keep the text tower's config in `text_config` and its tensors under `language_model.*`;
the trainer trains the text tower only.

A value the yaml sets that contradicts the checkpoint is an error naming both; a value left at the
schema default is replaced. `model.max_seq_len` is a usage limit, not a size: it may be set below the
checkpoint's `max_position_embeddings`, never above.

Quantization: block-FP8 checkpoints (`quant_method: fp8`, e4m3, 128x128 `weight_block_size`, the format
DeepSeek, Kimi and GLM-5.1-FP8 publish) load; any other `quant_method` is a one-line error naming it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from rl.contract import families

CONFIG = "config.json"
SUPPORTED_QUANT = ("fp8",)


class CheckpointError(ValueError):
    """An HF checkpoint directory the trainer cannot start from (one line, naming file and key)."""


def read_config(hf_path: str | Path) -> dict:
    f = Path(hf_path) / CONFIG
    if not f.is_file():
        raise CheckpointError(f"model.hf_path={hf_path}: no {CONFIG} there")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: not JSON ({e})") from None


def text_config(cfg: Mapping[str, Any]) -> dict:
    """The language model's config: `text_config` of a multimodal checkpoint, else the config itself."""
    if cfg.get("model_type") == "kimi_k25" or ("text_config" in cfg and "hidden_size" not in cfg):
        tc = dict(cfg.get("text_config") or {})
        if not tc:
            raise CheckpointError(f"model_type={cfg.get('model_type')!r} has no text_config")
        tc.setdefault("quantization_config", cfg.get("quantization_config"))
        return tc
    return dict(cfg)


def weight_prefix(cfg: Mapping[str, Any]) -> str:
    """Prefix of the text tower's tensor names in the checkpoint ('' for text-only checkpoints)."""
    return "language_model." if cfg.get("model_type") == "kimi_k25" else ""


def family_of(cfg: Mapping[str, Any], requested: str | None = None) -> str:
    mt = cfg.get("model_type")
    fam = families.BY_MODEL_TYPE.get(mt)
    if fam is None:
        raise CheckpointError(f"config.json model_type={mt!r} is not a known family (known model types: "
                              f"{', '.join(sorted(families.BY_MODEL_TYPE))})")
    if requested and requested != fam:
        row = families.BY_NAME.get(requested)
        if row is None or mt not in row.also_model_types:
            raise CheckpointError(f"model.family={requested!r} does not fit the checkpoint (model_type={mt!r}, "
                                  f"family {fam!r})")
        return requested
    return fam


def rope_theta(tc: Mapping[str, Any]) -> float:
    rp = tc.get("rope_parameters") or {}
    theta = rp.get("rope_theta", tc.get("rope_theta"))
    if theta is None:
        raise CheckpointError("config.json has neither rope_parameters.rope_theta nor rope_theta")
    return float(theta)


def rope_scaling(tc: Mapping[str, Any]) -> dict:
    """The rope scaling settings, whichever spelling the config uses ({} = none)."""
    rp = dict(tc.get("rope_parameters") or {})
    rs = dict(tc.get("rope_scaling") or {})
    merged = {**rs, **{k: v for k, v in rp.items() if k != "rope_theta"}}
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind in (None, "default"):
        return {}
    merged["rope_type"] = kind
    return merged


def quantization(cfg: Mapping[str, Any]) -> dict | None:
    """The checkpoint's quantization_config if it is one the loader reads; None if unquantized."""
    q = text_config(cfg).get("quantization_config") or cfg.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method not in SUPPORTED_QUANT:
        algo = f" (quant_algo={q['quant_algo']!r})" if q.get("quant_algo") else ""  # e.g. modelopt NVFP4
        raise CheckpointError(f"config.json quantization_config.quant_method={method!r}{algo} is not supported "
                              f"(the loader reads {', '.join(SUPPORTED_QUANT)}: block-scaled e4m3)")
    block = q.get("weight_block_size")
    if block is not None and list(block) != [128, 128]:
        raise CheckpointError(f"config.json quantization_config.weight_block_size={block}: only [128, 128]")
    if q.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"config.json quantization_config.fmt={q.get('fmt')!r}: only e4m3")
    return dict(q)


def ignored_modules(cfg: Mapping[str, Any]) -> list[str]:
    """Modules the FP8 publisher keeps unquantized: the checkpoint's quantization_config ignore list, as
    written, plus its family's `fp8_keep_modules` (rl.contract.families; e.g. NemotronH's Mamba conv1d,
    router gate and embeddings, which rl.exchange.layout.default_quantize's names do not cover)."""
    q = text_config(cfg).get("quantization_config") or cfg.get("quantization_config") or {}
    out = []
    for key in ("modules_to_not_convert", "ignored_layers", "ignore"):
        out += [str(x) for x in (q.get(key) or [])]
    family = families.BY_MODEL_TYPE.get(cfg.get("model_type"))
    if family is not None:
        out += [m for m in families.BY_NAME[family].fp8_keep_modules if m not in out]
    return out


def is_ignored(tensor_name: str, ignored: list[str]) -> bool:
    """Whether HF tensor `tensor_name` belongs to a module of the ignore list (exact module, a module
    prefix, or a `re:` pattern as compressed-tensors writes them)."""
    import re
    module = tensor_name.rsplit(".", 1)[0]
    for ig in ignored:
        if ig.startswith("re:"):
            if re.fullmatch(ig[3:], module):
                return True
        elif module == ig or module.startswith(ig + ".") or module.endswith("." + ig):
            return True
    return False


def need(tc: Mapping[str, Any], key: str, family: str):
    """`tc[key]`, or a one-line CheckpointError naming the key (a family's args read sizes through it)."""
    if tc.get(key) is None:
        raise CheckpointError(f"config.json: {key} is missing (needed for family {family})")
    return tc[key]
