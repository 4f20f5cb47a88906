"""The cluster-backend table (rl.contract.backends) and its executors (launch/backends.py).

Every row has its executor module `launch.<name>` with the four functions the launcher calls; the
launcher's commands reach a backend only through it, and what else differs between backends is a column
of the row (no module of rl or launch compares backend names, checked on the syntax tree); each column
shows in the plan or in validation as the row says; `launch plan`, `status` and `cancel` behave per row on
real run directories; an unknown name is one line naming the key.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]



def test_every_row_has_an_executor_with_the_interface():
    from launch.backends import INTERFACE, executor
    from rl.contract import backends
    assert backends.NAMES == tuple(b.name for b in backends.ROWS)
    assert len(set(backends.NAMES)) == len(backends.ROWS)
    for b in backends.ROWS:
        mod = executor(b.name)
        assert mod.__name__ == f"launch.{b.name}"
        missing = [f for f in INTERFACE if not callable(getattr(mod, f, None))]
        assert not missing, f"launch.{b.name} lacks {missing}"


def test_validation_allows_exactly_the_table():
    from rl.contract import backends, validation
    assert tuple(validation._CHOICES["cluster.backend"]) == backends.NAMES


def test_no_module_compares_backend_names():
    from rl.contract import backends
    bad = []
    for p in sorted([*(REPO / "launch").glob("*.py"), *(REPO / "rl").rglob("*.py")]):
        rel = str(p.relative_to(REPO))
        for node in ast.walk(ast.parse(p.read_text(), rel)):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                for s in sides:
                    values = [s] + (list(s.elts) if isinstance(s, (ast.Tuple, ast.List, ast.Set)) else [])
                    if any(isinstance(v, ast.Constant) and v.value in backends.NAMES for v in values):
                        bad.append(f"{rel}:{node.lineno} compares a backend name "
                                   "(use launch.backends, or a column of rl.contract.backends.row)")
    assert not bad, "\n".join(bad)


def test_the_name_check_can_fail(tmp_path, monkeypatch):
    probe = REPO / "launch" / "_probe_backend.py"
    probe.write_text("def f(cfg):\n    return cfg['cluster']['backend'] in ('slurm',)\n")
    try:
        with pytest.raises(AssertionError, match="_probe_backend.py:2 compares a backend name"):
            test_no_module_compares_backend_names()
    finally:
        probe.unlink()


@pytest.mark.parametrize("name", ["local", "slurm"])
def test_each_column_shows_in_the_plan_and_validation_as_the_row_says(tmp_path, name):
    from builders import compose_cfg
    from launch.plan import make_plan
    from rl.contract import backends, paths
    from rl.contract.config import ConfigError
    b = backends.row(name)
    plan = make_plan(compose_cfg(tmp_path / "run", f"cluster={name}", "+experiment=debug"))
    r = plan.inference.replicas[0]
    assert (f"${{{paths.NODE_DIR_VAR}}}" in r.model_dir) == b.node_dirs_per_incarnation, r.model_dir
    assert r.host == ("0.0.0.0" if b.binds_all_interfaces else "127.0.0.1")
    assert ("VLLM_HOST_IP" in r.env) != b.binds_all_interfaces, r.env
    # a task path on a filesystem this host does not mount: refused only where the roles run here
    tasks = "/hetrl-not-mounted-here/tasks"
    assert not Path("/hetrl-not-mounted-here").exists()
    over = [f"cluster={name}", "+experiment=swe_debug", f"env.swe.tasks={tasks}"]
    if b.roles_on_launch_host:
        with pytest.raises(ConfigError, match="^env.swe.tasks="):
            compose_cfg(tmp_path / "run2", *over)
    else:
        compose_cfg(tmp_path / "run2", *over)
    # CPU trainer ranks past the row's cap: one line naming the key and the backend
    ranks = (b.max_cpu_ranks or 2) + 2
    over = [f"cluster={name}", "+experiment=debug", f"trainer.parallel.dp_shard={ranks}"]
    if b.max_cpu_ranks is not None:
        with pytest.raises(ConfigError, match=rf"^trainer\.parallel=.*: the {name} backend runs at most "
                                              rf"{b.max_cpu_ranks} CPU ranks$"):
            compose_cfg(tmp_path / "run3", *over)
    else:
        compose_cfg(tmp_path / "run3", *over)


def test_the_contract_row_refuses_an_unknown_name_in_one_line():
    from rl.contract import backends
    from rl.contract.config import ConfigError
    for bad in ("pbs", "", None, ["slurm"]):
        with pytest.raises(ConfigError, match=r"^cluster\.backend=.*: not one of local, slurm$"):
            backends.row(bad)


@pytest.mark.parametrize("name", ["local", "slurm"])
def test_plan_text_status_and_the_frozen_record_per_backend(tmp_path, name):
    from builders import compose_cfg
    from launch.backends import executor, row
    from launch.plan import make_plan
    from launch.rundir import freeze_run_dir
    from launch.status import status
    run = tmp_path / "run"
    cfg = compose_cfg(run, f"cluster={name}")
    plan = make_plan(cfg)
    freeze_run_dir(cfg, run, plan)   # the backend recorded is the config's
    assert json.loads((run / "submissions.jsonl").read_text().splitlines()[-1])["backend"] == name
    text = executor(cfg).plan_text(plan, cfg)
    assert (text is not None) == row(cfg).scheduler
    if text is not None:
        assert text.startswith("#!") and "#SBATCH" in text
    st = status(run)   # nothing started or submitted: no scheduler call is needed to say so
    assert st["backend"] == name
    assert st["job"]["state"] == ("NOT SUBMITTED" if row(cfg).scheduler else "NEVER STARTED"), st["job"]


def test_an_unknown_backend_is_one_line(tmp_path):
    from builders import make_run_dir
    from launch.backends import row
    from rl.contract.config import ConfigError
    with pytest.raises(ConfigError, match=r"^cluster\.backend='pbs': not one of local, slurm$"):
        row("pbs")
    run = tmp_path / "run"
    make_run_dir(run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["cluster"]["backend"] = "pbs"
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    for cmd in ("status", "cancel"):
        r = subprocess.run([sys.executable, "-m", "launch", cmd, str(run)], cwd=REPO, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode in (1, 2) and r.stderr.count("\n") == 1 and "cluster.backend='pbs'" in r.stderr, \
            (cmd, r.stderr)
