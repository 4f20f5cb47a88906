"""A checkpoint's config.json -> the `model` group's values, through the family's own args (torch-free).

Each family's `rl/models/<package>/args.py` is the one reader of its config.json: `Args.from_hf(cfg)` reads
it (refusing, in one line, a missing key or a shape it does not build), `args.model_fields()` gives the
`model` group values it determines and `Args.HF_FIELDS` names them. This module only finds that args
module through the family's row (rl.contract.families: `package`), by name, so a new family is a row and a
folder and nothing here changes; it never asks what kind of attention or layers a family has.

It lives here, not in rl.contract, because rl.contract imports nothing else of rl; it is torch-free (the
args modules and their packages' `__init__` are), so the launcher calls it on a login node at composition
(launch.compose) and rl.doctor before building a trainer.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping

from rl.contract import families
from rl.contract import hf as hfc

# Fields of the `model` group a family has no value for are 0 (a GQA family's MLA ranks, a family without
# DSA's indexer sizes), so a config composed for one family and re-pointed at another's checkpoint keeps
# no stale sizes. rope_theta is not a size: a family without RoPE leaves it as the yaml has it.
_KEPT_WHEN_ABSENT = ("rope_theta",)


def family_args(family: str) -> ModuleType:
    """The torch-free args module of `family` (`rl.models.<package>.args`); an unknown family is the
    one-line ValueError of rl.contract.families.get."""
    return importlib.import_module(f"rl.models.{families.get(family).package}.args")


def model_fields(cfg: Mapping[str, Any], family: str) -> dict:
    """The `model` group values checkpoint config.json `cfg` determines for `family`: the family args'
    `model_fields()`, every other checkpoint-derived field (families.DERIVED) 0 except rope_theta."""
    values = family_args(family).from_hf(cfg).model_fields()
    zero = {k: 0 for k in families.DERIVED if k not in values and k not in _KEPT_WHEN_ABSENT}
    return {**zero, **values}


def resolve_model(model: dict, defaults: Mapping[str, Any]) -> dict:
    """`model` (a config group as composed) with family and sizes taken from its `hf_path` checkpoint.

    `defaults` is the schema's ModelConfig as a dict: a value equal to its default was not asked for and
    is replaced; any other value must agree with the checkpoint (else a one-line CheckpointError naming
    the field and the file).
    """
    path = model.get("hf_path")
    if not path:
        return model
    cfg = hfc.read_config(path)
    hfc.quantization(cfg)  # an unknown format fails here, before anything is submitted
    requested = model.get("family")
    family = hfc.family_of(cfg, None if requested == defaults.get("family") else requested)
    fields = model_fields(cfg, family)
    out = dict(model, family=family)
    for k, v in fields.items():
        have = model.get(k)
        if have is not None and have != defaults.get(k) and have != v:
            raise hfc.CheckpointError(f"model.{k}={have} contradicts {Path(path) / hfc.CONFIG} ({v}); sizes "
                                      f"come from the checkpoint: remove model.{k}")
        out[k] = v
    limit = hfc.text_config(cfg).get("max_position_embeddings")
    if limit is not None:
        if model.get("max_seq_len") in (None, defaults.get("max_seq_len")):
            out["max_seq_len"] = int(limit)
        elif int(model["max_seq_len"]) > int(limit):
            raise hfc.CheckpointError(f"model.max_seq_len={model['max_seq_len']} exceeds the checkpoint's "
                                      f"max_position_embeddings={limit}")
    return out
