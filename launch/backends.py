"""The executor of each cluster backend (rl.contract.backends has the rows), found by its name.

submitit's executor registry maps a name to the class that submits there; here the row's name is the
module, `launch.<name>` (launch.local, launch.slurm), imported only when that backend is used (the
Slurm module is never imported by a local run). Every executor module offers:

    submit_run(cfg, plan) -> (exit status, job id or None)   run the composed config, or submit it
    cancel_command(run_dir) -> exit status                    `launch cancel`
    job_status(run_dir, unreadable) -> dict                    the "job" entry of `launch status`
                                                               (id, state, reason; problems appended
                                                               to `unreadable`, one line each)
    plan_text(plan, cfg) -> str | None                         what `launch plan` prints after its
                                                               tables (the Slurm batch script)

so the launcher's commands call `executor(cfg)` instead of comparing backend names.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from rl.contract import backends
from rl.contract.config import ClusterConfig

INTERFACE = ("submit_run", "cancel_command", "job_status", "plan_text")


def row(cfg_or_name) -> backends.Backend:
    """The backend row of a composed config (or of a name); an unknown one is a one-line ConfigError."""
    name = cfg_or_name if isinstance(cfg_or_name, str) else (
        (cfg_or_name.get("cluster") or {}).get("backend", ClusterConfig.backend))
    return backends.row(name)


def executor(cfg_or_name) -> ModuleType:
    """The executor module of a composed config's backend (or of a backend name)."""
    return importlib.import_module(f"launch.{row(cfg_or_name).name}")
