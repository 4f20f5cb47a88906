"""The one config builder of the tests: compose like the launcher does, freeze a run directory.

`compose_cfg(run_dir, *overrides)` is what `python -m launch run OVERRIDES run_dir=...` validates;
`make_run_dir(run_dir, *overrides)` also plans it and writes config.yaml, plan.json and the secret, as
the launcher does before any role starts, so a role started on that directory reads exactly what it
would read on a cluster.
"""
from __future__ import annotations

from pathlib import Path


def compose_cfg(run_dir, *overrides: str) -> dict:
    from launch.compose import compose_points
    (cfg,) = compose_points([*overrides, f"run_dir={Path(run_dir).absolute()}"], multirun=False)
    cfg.pop("_overrides", None)
    return cfg


def make_run_dir(run_dir, *overrides: str) -> tuple[dict, dict]:
    """(cfg, plan) of a frozen run directory at `run_dir`."""
    from launch.plan import make_plan
    from launch.rundir import freeze_run_dir
    cfg = compose_cfg(run_dir, *overrides)
    plan = make_plan(cfg)
    freeze_run_dir(cfg, run_dir, plan, backend=cfg["cluster"]["backend"])
    return cfg, plan


def why_runtime_unavailable(name: str) -> str:
    """Why sandbox runtime `name` cannot run here ("" when it can): its own check's one-line reason."""
    from rl.envs.swe.runtimes import RuntimeUnavailable, runtime_class
    try:
        runtime_class(name).check()
    except RuntimeUnavailable as e:
        return str(e)
    return ""


def runtime_params(names):
    """pytest params over sandbox runtimes, each skipped with its reason where it cannot run here."""
    import pytest
    return [pytest.param(n, marks=pytest.mark.skipif(bool(why_runtime_unavailable(n)),
                                                     reason=why_runtime_unavailable(n) or "-"))
            for n in names]
