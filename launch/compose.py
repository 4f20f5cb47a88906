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
    from hydra.core.override_parser.overrides_parser import OverridesParser
    parser = OverridesParser.create()
    try:
        parsed = parser.parse_overrides(overrides)
    except Exception as e:  # noqa: BLE001 - Hydra raises several types; all are user input errors
        raise ConfigError(f"bad override: {_one_line(e)}") from None
    if not any(o.is_sweep_override() for o in parsed):
        return [list(overrides)]
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
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
    return with_checkpoint(c, overrides)


def _override(overrides: list[str], key: str) -> str | None:
    """The value the last `key=`, `+key=` or `++key=` override sets (None: not set on the command line)."""
    value = None
    for o in overrides:
        k, eq, v = o.lstrip("+").partition("=")
        if eq and k == key:
            value = v.strip().strip("'\"")
    return value


def explicit_family(overrides: list[str]) -> str | None:
    """model.family as the user set it: on the command line, else in the chosen experiment's file. The
    composed value alone cannot tell an explicit `model.family=qwen3` from the schema's default qwen3, and
    rl.contract.hf replaces a default family with the checkpoint's."""
    fam = _override(overrides, "model.family")
    if fam is not None:
        return fam
    exp = _override(overrides, "experiment")
    f = CONF_DIR / "experiment" / f"{exp}.yaml"
    if not exp or "/" in exp or not f.is_file():
        return None
    import yaml
    try:
        model = (yaml.safe_load(f.read_text()) or {}).get("model") or {}
    except yaml.YAMLError:
        return None   # Hydra has read it already; its own error wins
    return model.get("family") if isinstance(model, dict) else None


def with_checkpoint(c: dict, overrides: list[str] | None = None) -> dict:
    """The family and sizes of `model.hf_path`'s config.json written into the config (rl.models.fields: the
    family's own args read it). A family set explicitly (by `overrides` or the experiment they choose) that
    the checkpoint is not is refused, never silently replaced."""
    import dataclasses
    from rl.contract import hf
    from rl.contract.config import ModelConfig
    from rl.models import fields
    m = c.get("model") or {}
    if not m.get("hf_path"):
        return c
    m = dict(m, hf_path=str(Path(m["hf_path"]).expanduser().absolute()))
    if not (Path(m["hf_path"]) / hf.CONFIG).is_file():
        # every family has a tiny twin (rl.tiny_models.twins): name the command that writes the missing one
        fam = m.get("family") if m.get("family") != ModelConfig.family else None
        make = (f"; make the tiny twin with: python -m rl.tiny_models.twins {fam} {m['hf_path']}" if fam else
                "; a tiny twin is made with: python -m rl.tiny_models.twins FAMILY PATH")
        raise ConfigError(f"model.hf_path={m['hf_path']}: no {hf.CONFIG} there{make}")
    try:
        c["model"] = fields.resolve_model(m, dataclasses.asdict(ModelConfig()))
    except ValueError as e:   # CheckpointError, or a family's args refusing a config.json key by name
        raise ConfigError(str(e)) from None
    # rl.models.fields refuses a family other than the schema's default that does not fit; the default itself
    # it replaces, so only then is it asked whether the user wrote it (reading the experiment's file)
    replaced = m.get("family") == ModelConfig.family != c["model"]["family"]
    explicit = explicit_family(overrides or []) if replaced else None
    if explicit is not None and c["model"]["family"] != explicit:
        raise ConfigError(f"model.family={explicit}: {m['hf_path']}/{hf.CONFIG} is a {c['model']['family']} "
                          f"checkpoint; remove model.family (it comes from the checkpoint) or point "
                          f"model.hf_path at a {explicit} checkpoint")
    return c


def default_run_dir(experiment: str, sweep_ts: str | None = None, index: int | None = None) -> str:
    ts = sweep_ts or _dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    if index is None:
        return str(Path("runs") / experiment / ts)
    return str(Path("runs") / "sweeps" / experiment / ts / str(index))


def compose_points(overrides: list[str], multirun: bool, check: bool = True) -> list[dict]:
    """Every point of the (possibly swept) command line, composed and validated, with its run_dir.
    `check=False` (`--cfg`) skips validation: the config is shown as composed, right or wrong."""
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
            if not check:
                raise _Unchecked
            validate(c)
            check_run_dir(c["run_dir"])
        except _Unchecked:
            pass
        except ConfigError as e:
            raise ConfigError(f"{e}" + (f" (sweep point {i}: {' '.join(point)})" if len(points) > 1 else "")) from None
        c["_overrides"] = point
        out.append(c)
    return out


class _Unchecked(Exception):
    pass


# -- Hydra's command-line conventions: --cfg job|hydra|all [--package P], --info [WHAT] ----------------------
CFG_TYPES = ("job", "hydra", "all")
INFO_TYPES = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")


def _hydra_node(overrides: list[str]):
    """The config composed with Hydra's own (`hydra:`, help texts removed, as `--cfg hydra` shows it)."""
    from hydra import compose as hcompose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = hcompose(config_name="config", overrides=list(overrides), return_hydra_config=True)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(_one_line(e)) from None
    finally:
        GlobalHydra.instance().clear()
    from omegaconf import flag_override
    with flag_override(cfg.hydra, ["struct", "readonly"], False):
        for k in ("help", "hydra_help"):
            del cfg.hydra[k]
    return cfg


def show_cfg(overrides: list[str], multirun: bool, cfg_type: str, package: str | None = None) -> str:
    """The text `--cfg` prints: each point's config as YAML, as Hydra's `--cfg` does, but the config shown
    for `job` is the one the run would freeze (checkpoint sizes, run_dir and ports filled in), not yet
    validated. Reads the checkpoint's config.json; writes and starts nothing."""
    if cfg_type not in CFG_TYPES:
        raise ConfigError(f"--cfg {cfg_type}: must be one of {', '.join(CFG_TYPES)}")
    docs = []
    points = compose_points(overrides, multirun, check=False)
    for c in points:
        point = c.pop("_overrides")
        job = OmegaConf.create(c)
        if cfg_type == "job":
            tree = job
        else:
            # unresolved, as Hydra prints it: its ${now:...} and ${hydra.job.num} belong to a Hydra app's
            # own output directories, which the launcher does not use (run_dir is the run's directory)
            h = OmegaConf.to_container(_hydra_node(point).hydra, resolve=False)
            tree = OmegaConf.create({"hydra": h} if cfg_type == "hydra" else {"hydra": h, **c})
        head = f"# sweep point: {' '.join(point)}\n" if len(points) > 1 else ""
        if package and package != "_global_":
            sel = OmegaConf.select(tree, package)
            if sel is None:
                raise ConfigError(f"--package {package}: not found in the {cfg_type} config")
            text = f"# @package {package}\n" + (OmegaConf.to_yaml(sel) if OmegaConf.is_config(sel) else f"{sel}\n")
        else:
            text = OmegaConf.to_yaml(tree)
        docs.append(head + text)
    return "---\n".join(docs)


def show_info(overrides: list[str], multirun: bool, what: str = "all") -> None:
    """`--info`: Hydra's own report (its version, the config search path, the defaults tree and list, the
    config as Hydra composed it; `plugins` its plugins), printed by Hydra for the first point."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode
    if what not in INFO_TYPES:
        raise ConfigError(f"--info {what}: must be one of {', '.join(INFO_TYPES)}")
    points = expand_sweep(overrides)
    if len(points) > 1 and not multirun:
        raise ConfigError("a sweep override (a,b / range / choice) needs -m (--multirun)")
    import logging
    root = logging.getLogger()
    saved = root.level, list(root.handlers)   # Hydra points the root logger at stdout, at DEBUG, to print
    register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            GlobalHydra.instance().hydra.show_info(what, config_name="config", overrides=points[0],
                                                   run_mode=RunMode.RUN)
    except Exception as e:  # noqa: BLE001 - Hydra raises several types; all are user input errors
        raise ConfigError(_one_line(e)) from None
    finally:
        GlobalHydra.instance().clear()
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
