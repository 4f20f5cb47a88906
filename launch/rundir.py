"""Creating and reopening run directories.

A run directory is frozen at its first submission: `config.yaml` (the composed, resolved config),
`plan.json`, `job.sbatch` (Slurm only) and `submissions.jsonl` (one line per submission). Submitting
again into the same directory is a resume: the new config must equal the frozen one except for keys
that may change between incarnations (more steps, other cluster settings); anything else is an error
that names the first differing key, so a resume never silently trains a different run.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import yaml

from rl.contract import paths
from rl.contract.config import ConfigError
from rl.contract.plan import Plan
from rl.contract.secret import create_secret
from rl.contract.atomic import atomic_write_json, atomic_write_text

# Keys a resume may change. Everything else must match the frozen config.
RESUMABLE_PREFIXES = ("trainer.max_steps", "cluster.", "wandb.", "inference.startup_timeout_s",
                      "inference.port", "hydra")


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_diff(old: dict, new: dict) -> list[str]:
    fo, fn = _flatten(old), _flatten(new)
    keys = sorted(set(fo) | set(fn))
    return [k for k in keys if fo.get(k, "<unset>") != fn.get(k, "<unset>")
            and not k.startswith(RESUMABLE_PREFIXES)]


def load_frozen(run_dir: Path) -> dict | None:
    p = paths.config_file(run_dir)
    return yaml.safe_load(p.read_text()) if p.exists() else None


def check_resume(cfg: dict, run_dir: str | os.PathLike) -> bool:
    """Refuse a config that differs from the run's frozen one in a key a resume may not change (one line
    naming the key). Returns True if `run_dir` holds a frozen run (this is a resume). Writes nothing."""
    run_dir = Path(run_dir).absolute()
    cfg = {k: v for k, v in cfg.items() if k != "_overrides"}
    try:
        old = load_frozen(run_dir)
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{paths.config_file(run_dir)}: cannot be read ({' '.join(str(e).split())})") from None
    if old is None:
        return False
    diff = config_diff(old, cfg)
    if diff:
        k = diff[0]
        raise ConfigError(f"{k}: differs from the frozen config of {run_dir} "
                          f"({_flatten(old).get(k, '<unset>')!r} -> {_flatten(cfg).get(k, '<unset>')!r}); "
                          f"a resume cannot change it (use a new run_dir)")
    return True


def freeze_run_dir(cfg: dict, run_dir: str | os.PathLike, plan: Plan, script: str | None = None,
                   backend: str = "local") -> bool:
    """Write (or check) the frozen files. Returns True if this is a resume of an existing run."""
    run_dir = Path(run_dir).absolute()
    cfg = {k: v for k, v in cfg.items() if k != "_overrides"}  # the command line, not config
    resuming = check_resume(cfg, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for sub in paths.SUBDIRS:
        (run_dir / sub).mkdir(exist_ok=True)
    # The resumable keys may change, so the frozen files always hold the newest submission's values.
    atomic_write_text(paths.config_file(run_dir), yaml.safe_dump(cfg, sort_keys=False))
    atomic_write_json(paths.plan_file(run_dir), plan.to_dict())
    if script is not None:
        atomic_write_text(paths.p(run_dir, paths.JOB_SCRIPT), script)
    # written whole or not at all (temp 0600 + fsync + link/rename); an empty or short one a crash left
    # behind is replaced, since servers would otherwise refuse to start (rl/contract/secret.py)
    create_secret(run_dir)
    with open(paths.p(run_dir, paths.SUBMISSIONS), "a") as f:
        f.write(json.dumps({"time": time.time(), "backend": backend, "resume": resuming}) + "\n")
    return resuming
