"""The contract between the processes (rl/contract): import directions, typed records, strict plan.

- Import directions: rl.contract is torch-free and imports no role; no role package (rl.trainer,
  rl.orchestrator, rl.inference) imports another; `launch` imports no role and no torch stack. Checked
  statically on every module's imports (function-level imports included), so a lazy import cannot hide.
- Every key of the schema is read by some code outside the schema module (validation alone is not a
  use), so a key that nothing reads cannot linger.
- plan.json round-trips through the typed Plan, which refuses unknown or missing fields; `${HETRL_...}`
  references expand from the environment or fail naming the variable.
"""
from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROLES = ("rl.trainer", "rl.orchestrator", "rl.inference")
HEAVY = ("torch", "vllm", "torchtitan", "transformers", "safetensors.torch")


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    pkg = _module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else _module_name(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                out.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                out.add(node.module)
                out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _modules(*roots: str):
    for root in roots:
        for p in sorted((REPO / root).rglob("*.py")):
            if "data" in p.relative_to(REPO).parts:
                continue
            yield _module_name(p), p


def _under(name: str, pkgs) -> str | None:
    return next((p for p in pkgs if name == p or name.startswith(p + ".")), None)


def test_import_directions():
    bad = []
    for name, path in _modules("rl", "launch"):
        imports = _imports(path)
        own_role = _under(name, ROLES)
        for imp in imports:
            other = _under(imp, ROLES)
            if name.startswith("rl.contract") and (other or _under(imp, HEAVY) or _under(imp, ("launch",))):
                bad.append(f"{name} imports {imp}: rl.contract must stay torch-free and role-free")
            elif name.startswith("launch") and (other or _under(imp, HEAVY)):
                bad.append(f"{name} imports {imp}: launch must not import a role or the torch stack")
            elif own_role and other and other != own_role:
                bad.append(f"{name} imports {imp}: role {own_role} must not import role {other} "
                           f"(what they share belongs in rl.contract)")
    assert not bad, "\n".join(bad)


def test_import_directions_check_can_fail(tmp_path):
    """The checker sees a function-level import of another role."""
    p = REPO / "rl" / "trainer" / "_probe_import.py"
    p.write_text("def f():\n    from rl.orchestrator.loop import Orchestrator\n")
    try:
        with pytest.raises(AssertionError, match="role rl.trainer must not import role rl.orchestrator"):
            test_import_directions()
    finally:
        p.unlink()


def test_contract_imports_no_torch():
    code = ("import sys, rl.contract.config, rl.contract.plan, rl.contract.paths, rl.contract.records, "
            "rl.contract.batch, rl.contract.http, rl.runtime, rl.prepare; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'torchtitan', 'transformers')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# -- every schema key is read ----------------------------------------------------------------------
def _leaves(cls, prefix=""):
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            yield from _leaves(type(default), key + ".")
        else:
            yield key


def _sources() -> str:
    files = [p for root in ("rl", "launch") for p in (REPO / root).rglob("*.py")
             if p != REPO / "rl" / "contract" / "config.py" and "data" not in p.parts]
    files.append(REPO / "sbatch" / "job.sbatch.j2")
    return "\n".join(p.read_text() for p in files)


def test_every_schema_key_is_read_by_code():
    from rl.contract.config import Config
    src = _sources()
    unread = []
    for key in _leaves(Config):
        leaf = key.rsplit(".", 1)[-1]
        if key in ("run_dir", "seed", "experiment"):
            pat = rf"\[[\"']{leaf}[\"']\]|\.{leaf}\b|get\([\"']{leaf}[\"']"
        else:
            pat = rf"\.{leaf}\b|\[[\"']{leaf}[\"']\]|[\"']{leaf}[\"']"
        if not re.search(pat, src):
            unread.append(key)
    assert not unread, f"schema keys read by no code (remove them or use them): {unread}"


# -- the typed plan --------------------------------------------------------------------------------
def test_plan_round_trips_and_refuses_unknown_fields(tmp_path):
    from builders import make_run_dir
    from rl.contract.plan import Plan, PlanFormatError
    _, planned = make_run_dir(tmp_path / "run")
    typed = Plan.read(tmp_path / "run")
    assert typed == planned
    plan = planned.to_dict()   # plan.json's form
    assert typed.to_dict() == plan
    assert typed.replica(0).vllm_argv(0) == plan["inference"]["replicas"][0]["vllm_command"]
    bad = dict(plan, inference=dict(plan["inference"], replicas=[dict(plan["inference"]["replicas"][0], gpu=1)]))
    with pytest.raises(PlanFormatError, match=r"^plan\.inference\.replicas\[0\]\.gpu: unknown field"):
        Plan.from_dict(bad)
    missing = {k: v for k, v in plan.items() if k != "trainer"}
    with pytest.raises(PlanFormatError, match=r"^plan\.trainer: missing"):
        Plan.from_dict(missing)
    with pytest.raises(PlanFormatError, match=r"^plan\.version=1"):
        Plan.from_dict(dict(plan, version=1))
    with pytest.raises(PlanFormatError, match="no replica 3"):
        typed.replica(3)


def test_expand_substitutes_run_time_addresses_or_names_the_missing_one():
    from rl.contract.plan import PlanFormatError, expand
    assert expand(["--a", "${HETRL_ROLE_ADDR}:13345", "x"], {"HETRL_ROLE_ADDR": "n7"}) == ["--a", "n7:13345", "x"]
    with pytest.raises(PlanFormatError, match=r"\$\{HETRL_TRAINER_ADDR\}: not set"):
        expand(["${HETRL_TRAINER_ADDR}"], {})


def test_records_refuse_files_of_another_layout(tmp_path):
    from rl.contract import paths
    from rl.contract.records import RecordError, ResumeState, RoleRecord, ServerRecord
    (tmp_path / "roles").mkdir()
    (tmp_path / "inference").mkdir()
    assert ResumeState.read(tmp_path) == ResumeState()   # before prepare: the first start
    ResumeState(checkpoint_step=5, restart=2).write(tmp_path)
    assert ResumeState.read(tmp_path).checkpoint_step == 5
    paths.server_record(tmp_path, 0).write_text('{"url": "http://x:1"}')
    with pytest.raises(RecordError, match="server_0.json: not a ServerRecord record"):
        ServerRecord.read(tmp_path, 0)
    assert ServerRecord.read(tmp_path, 1) is None
    RoleRecord.here("trainer").write(tmp_path)
    paths.role_record(tmp_path, "old").write_text('{"role": "old"}')   # an older layout: skipped
    assert [r.role for r in RoleRecord.read_all(tmp_path)] == ["trainer"]


def test_roles_read_the_config_through_the_schema(tmp_path):
    """The frozen config on the schema: typed, the schema's defaults for what the file omits, unknown
    keys refused, read-only."""
    import yaml
    from omegaconf import OmegaConf
    from rl.contract import config as C
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"run_dir": str(tmp_path), "trainer": {"lr": 0.5}}))
    cfg = C.load(tmp_path)
    assert cfg.trainer.lr == 0.5 and cfg.trainer.max_steps == C.TrainerConfig.max_steps
    assert OmegaConf.is_readonly(cfg)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"run_dir": str(tmp_path), "trainer": {"lr_typo": 1}}))
    with pytest.raises(C.ConfigError, match="lr_typo"):
        C.load(tmp_path)


def test_records_refuse_unknown_keys_and_the_start_record_is_typed(tmp_path):
    from rl.contract import paths
    from rl.contract.records import RecordError, ReplicaStart
    ReplicaStart(version=3, fp8=True, restart=1, job=None).write(tmp_path, 0)
    assert ReplicaStart.read(tmp_path, 0) == ReplicaStart(3, True, 1, None)
    paths.replica_start_record(tmp_path, 1).write_text('{"version": 3, "fp8": true, "restart": 1, "extra": 0}')
    with pytest.raises(RecordError, match=r"unknown keys \['extra'\]"):
        ReplicaStart.read(tmp_path, 1)
    paths.replica_start_record(tmp_path, 2).write_text('{"version": "3", "fp8": true, "restart": 1}')
    with pytest.raises(RecordError, match="version='3' is not a policy version"):
        ReplicaStart.read(tmp_path, 2)
