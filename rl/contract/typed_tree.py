"""A plain dict as the schema's dataclasses, without OmegaConf, when the dict already fits the schema.

`rl.contract.config.typed` and `rl.contract.validation.validate` used to merge every dict onto
`OmegaConf.structured(Config)` and convert back: ~45 ms of CPU each for a large experiment, and `launch
plan` did it seven times for one config (validation twice, plan, memory, perf, the batch script), a third
of its time. Almost every such dict is a composed config that is already exactly typed, so this module
builds the dataclass instances directly and OmegaConf is used only for what it does better: `build`
returns None for anything it is not sure of (an unknown key, a value of another type that OmegaConf would
convert or refuse, an interpolation, a missing mandatory value), and the caller then takes OmegaConf's
path, with its conversions and its error messages naming the key. So the fast path never accepts what OmegaConf refuses and never types a value
differently: tests/unit/test_cli.py compares both on every experiment.

Imports nothing of rl: it works on any dataclass tree (the schema lives in rl.contract.config).
"""
from __future__ import annotations

import dataclasses
import functools
import typing

_NONE = type(None)


@functools.lru_cache(maxsize=None)
def _fields(cls) -> tuple:
    """(name, type, default or MISSING, default_factory or MISSING) per field, type hints resolved once."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name], f.default, f.default_factory) for f in dataclasses.fields(cls))


def _plain(v):
    """A JSON-like value copied (callers may mutate what they get), or raise _Unsure."""
    if isinstance(v, str):
        if "${" in v or v == "???":   # an interpolation (OmegaConf resolves it) or a missing value
            raise _Unsure
        return v
    if v is None or type(v) in (int, float, bool):
        return v
    if type(v) is list:
        return [_plain(x) for x in v]
    if type(v) is dict and all(type(k) is str for k in v):
        return {k: _plain(x) for k, x in v.items()}
    raise _Unsure


class _Unsure(Exception):
    pass


def _value(tp, v):
    """`v` as a field of type `tp` holds it, exactly as OmegaConf would; _Unsure where OmegaConf would
    convert, refuse or resolve something."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = typing.get_args(tp)
        if v is None and _NONE in args:
            return None
        rest = [a for a in args if a is not _NONE]
        if len(rest) != 1:
            raise _Unsure
        tp, origin = rest[0], typing.get_origin(rest[0])
    if v is None:
        raise _Unsure   # None in a non-Optional field: OmegaConf's error
    if dataclasses.is_dataclass(tp):
        if type(v) is not dict:
            raise _Unsure
        return _build(tp, v)
    if tp is bool:
        if type(v) is not bool:
            raise _Unsure
        return v
    if tp is int:
        if type(v) is not int:
            raise _Unsure
        return v
    if tp is float:
        if type(v) is float:
            return v
        if type(v) is int:   # OmegaConf's FloatNode takes an int as its float
            return float(v)
        raise _Unsure
    if tp is str:
        if type(v) is not str:
            raise _Unsure
        return _plain(v)
    if tp is list or origin is list:
        if type(v) is not list:
            raise _Unsure
        (elem,) = typing.get_args(tp) or (None,)
        if elem is None:
            return _plain(v)
        return [_value(elem, x) for x in v]
    if tp is dict:
        if type(v) is not dict:
            raise _Unsure
        return _plain(v)
    raise _Unsure


def _build(cls, data: dict):
    fields = _fields(cls)
    names = {f[0] for f in fields}
    if any(k not in names for k in data):
        raise _Unsure   # unknown key: OmegaConf names it
    kw = {}
    for name, tp, default, factory in fields:
        if name in data:
            kw[name] = _value(tp, data[name])
        elif factory is not dataclasses.MISSING:
            kw[name] = factory()
        elif default is dataclasses.MISSING or default == "???":
            raise _Unsure   # a mandatory value left out: OmegaConf's MissingMandatoryValue
    return cls(**kw)


def build(cls, data: dict):
    """`data` as an instance of dataclass `cls` (nested dicts as nested dataclasses, defaults for what is
    left out), or None if OmegaConf must decide (see the module docstring)."""
    if type(data) is not dict:
        return None
    try:
        return _build(cls, data)
    except _Unsure:
        return None
