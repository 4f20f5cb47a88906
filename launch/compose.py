"""Config composition: Hydra's compose API, sweep expansion, validation, one-line errors.

We use Hydra's compose API rather than `@hydra.main` so that every point of a sweep is composed and
validated before anything is submitted (a typo in the third point must not leave two jobs running), and
so that errors come out as one line naming the key instead of a traceback. Sweep syntax is Hydra's own
(`a,b`, `range(...)`, `choice(...)`, `glob(...)`), expanded by Hydra's BasicSweeper.
"""
from __future__ import annotations

import datetime as _dt
import re
from pathlib import Path

from omegaconf import OmegaConf

from rl.contract.config import ConfigError, register, resolve_ports, to_container
from launch.rundir import check_run_dir_choice
from rl.contract.validation import check_run_dir, validate

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def _one_line(e: BaseException) -> str:
    """Hydra and OmegaConf errors span several lines; the key and the reason fit in one."""
    cause = e.__cause__ if e.__cause__ is not None else e
    text = str(cause).strip()
    first = text.splitlines()[0] if text else type(cause).__name__
    full = re.search(r"full_key: (\S+)", text)
    if full and full.group(1) not in first:
        first = f"{full.group(1)}: {first}"
    opts = re.search(r"Available options in '([^']+)':\n((?:\t.*\n?)+)", text)
    if opts:
        first += f" (available {opts.group(1)}: {', '.join(o.strip() for o in opts.group(2).splitlines())})"
    return first


def expand_sweep(overrides: list[str]) -> list[list[str]]:
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    parser = OverridesParser.create()
    try:
        parsed = parser.parse_overrides(overrides)
    except Exception as e:  # noqa: BLE001 - Hydra raises several types; all are user input errors
        raise ConfigError(f"bad override: {_one_line(e)}") from None
    if not any(o.is_sweep_override() for o in parsed):
        return [list(overrides)]
    batches = BasicSweeper.split_arguments(parsed, max_batch_size=None)
    return [list(p) for batch in batches for p in batch]


def compose(overrides: list[str]) -> dict:
    """Compose conf/config.yaml with `overrides`, validate, return a plain dict (run_dir may be '')."""
    from hydra import compose as hcompose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = hcompose(config_name="config", overrides=list(overrides))
    except Exception as e:  # noqa: BLE001
        raise ConfigError(_one_line(e)) from None
    finally:
        GlobalHydra.instance().clear()
    OmegaConf.set_struct(cfg, False)
    cfg.pop("hydra", None)
    if OmegaConf.is_missing(cfg, "run_dir"):
        cfg.run_dir = ""
    try:
        c = to_container(cfg)
    except Exception as e:  # noqa: BLE001 - interpolation errors name the key
        raise ConfigError(_one_line(e)) from None
    return with_checkpoint(c)


def with_checkpoint(c: dict) -> dict:
    """The family and sizes of `model.hf_path`'s config.json written into the config (rl.contract.hf)."""
    import dataclasses
    from rl.contract import hf
    from rl.contract.config import ModelConfig
    m = c.get("model") or {}
    if not m.get("hf_path"):
        return c
    m = dict(m, hf_path=str(Path(m["hf_path"]).expanduser().absolute()))
    if not (Path(m["hf_path"]) / hf.CONFIG).is_file():
        # every family has a tiny twin (rl.model.twins): name the command that writes the missing one
        fam = m.get("family") if m.get("family") != ModelConfig.family else None
        make = (f"; make the tiny twin with: python -m rl.model.twins {fam} {m['hf_path']}" if fam else
                "; a tiny twin is made with: python -m rl.model.twins FAMILY PATH")
        raise ConfigError(f"model.hf_path={m['hf_path']}: no {hf.CONFIG} there{make}")
    try:
        c["model"] = hf.resolve_model(m, dataclasses.asdict(ModelConfig()))
    except hf.CheckpointError as e:
        raise ConfigError(str(e)) from None
    return c


def default_run_dir(experiment: str, sweep_ts: str | None = None, index: int | None = None) -> str:
    ts = sweep_ts or _dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    if index is None:
        return str(Path("runs") / experiment / ts)
    return str(Path("runs") / "sweeps" / experiment / ts / str(index))


def compose_points(overrides: list[str], multirun: bool) -> list[dict]:
    """Every point of the (possibly swept) command line, composed and validated, with its run_dir."""
    points = expand_sweep(overrides)
    if len(points) > 1 and not multirun:
        raise ConfigError("a sweep override (a,b / range / choice) needs -m (--multirun)")
    ts = _dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out = []
    for i, point in enumerate(points):
        c = compose(point)
        if not c.get("run_dir"):
            c["run_dir"] = default_run_dir(c["experiment"], ts if multirun else None, i if multirun else None)
        elif multirun and len(points) > 1:
            c["run_dir"] = str(Path(c["run_dir"]) / str(i))
        try:  # resolved once, here: below it every writer refuses links (docs/run-directory-safety.md)
            c["run_dir"] = str(check_run_dir_choice(c["run_dir"]))
        except ConfigError as e:
            raise ConfigError(f"{e}" + (f" (sweep point {i}: {' '.join(point)})" if len(points) > 1 else "")) from None
        if multirun and len(points) > 1:
            resolve_ports({**c, "run_dir": str(Path(c["run_dir"]).parent)}, offset=i)
        else:
            resolve_ports(c)
        try:
            validate(OmegaConf.create(c))
            check_run_dir(c["run_dir"])
        except ConfigError as e:
            raise ConfigError(f"{e}" + (f" (sweep point {i}: {' '.join(point)})" if len(points) > 1 else "")) from None
        c["_overrides"] = point
        out.append(c)
    return out
