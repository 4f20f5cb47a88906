"""The contract between the processes (rl/contract): import directions, typed records, strict plan.

- Import directions: rl.contract is torch-free and imports no role; no role package (rl.trainer,
  rl.orchestrator, rl.inference) imports another; `launch` imports no role and no torch stack; nothing
  in rl imports the launcher. Checked statically and followed to the end: every module a module imports,
  what those import, and so on (function-level imports and `importlib.import_module` names included, a
  parent package's function bodies not), so neither a lazy import nor a module in between can hide one.
  The torch side of a launch command runs as a child process (`python -m rl.doctor`, `python -m
  rl.export`), named in an argv, never imported.
- Every key of the schema is read by some code outside the schema module (validation alone is not a
  use), so a key that nothing reads cannot linger.
- plan.json round-trips through the typed Plan, which refuses unknown or missing fields; `${HETRL_...}`
  references expand from the environment or fail naming the variable.
"""
from __future__ import annotations

import ast
import dataclasses
import fnmatch
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROLES = ("rl.trainer", "rl.orchestrator", "rl.inference")
HEAVY = ("torch", "vllm", "torchtitan", "transformers", "safetensors.torch")


def _module_name(path: Path, repo: Path = REPO) -> str:
    rel = path.relative_to(repo).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(*roots: str, repo: Path = REPO):
    for root in roots:
        for p in sorted((repo / root).rglob("*.py")):
            if "data" in p.relative_to(repo).parts:
                continue
            yield _module_name(p, repo), p


def _under(name: str, pkgs) -> str | None:
    return next((p for p in pkgs if name == p or name.startswith(p + ".")), None)


class _Imports(ast.NodeVisitor):
    """The imports of one module as (target, at_import_time): function bodies are lazy (False), the rest
    runs when the module is imported (True); `if TYPE_CHECKING:` blocks never run and are skipped.
    `importlib.import_module(...)` with a literal or f-string name is an import too, its formatted parts
    a wildcard (`f"rl.models.{row.package}.args"` -> `rl.models.*.args`), so a dynamic load cannot hide."""

    def __init__(self, pkg: str):
        self.pkg, self.depth, self.out = pkg, 0, []

    def visit_FunctionDef(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_Lambda = visit_FunctionDef

    def visit_If(self, node):
        t = node.test
        if (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
                isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"):
            for n in node.orelse:
                self.visit(n)
            return
        self.generic_visit(node)

    def visit_Import(self, node):
        self.out += [((a.name,), self.depth == 0) for a in node.names]

    def visit_ImportFrom(self, node):
        if node.level:
            base = self.pkg.split(".")[: len(self.pkg.split(".")) - node.level + 1]
            mod = ".".join(base + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        # `from a import b`: the module a.b when there is one, else a (the caller resolves which)
        self.out += [((f"{mod}.{a.name}", mod), self.depth == 0) for a in node.names]

    def visit_Call(self, node):
        f = node.func
        if (isinstance(f, ast.Attribute) and f.attr == "import_module") or (
                isinstance(f, ast.Name) and f.id == "import_module"):
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                self.out.append(((node.args[0].value,), self.depth == 0))
            elif node.args and isinstance(node.args[0], ast.JoinedStr):
                pat = "".join(v.value if isinstance(v, ast.Constant) else "*" for v in node.args[0].values)
                self.out.append((("pattern:" + pat,), self.depth == 0))
        self.generic_visit(node)


def _imports(name: str, path: Path, known: set[str]) -> list[tuple[str, bool]]:
    """(module, at_import_time) for every import of module `name` at `path`: a module of `known` (the most
    specific one named), or the top-level name of an outside package (`torch`, `safetensors.torch`)."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    v = _Imports(pkg)
    v.visit(ast.parse(path.read_text(), str(path)))
    out = []
    for cands, now in v.out:
        if cands[0].startswith("pattern:"):
            pat = cands[0][len("pattern:"):]
            out += [(m, now) for m in sorted(known) if fnmatch.fnmatchcase(m, pat)]
            continue
        target = next((c for c in cands if c in known), None)
        if target is None:   # a package of ours named by a longer path, or an outside package
            parts = cands[-1].split(".")
            target = next((m for m in (".".join(parts[:i]) for i in range(len(parts), 0, -1)) if m in known),
                          None)
        if target is None:
            ext = cands[-1]
            target = next((h for h in HEAVY if ext == h or ext.startswith(h + ".")), ext.split(".")[0])
        out.append((target, now))
    return out


def _parents(mod: str) -> list[str]:
    """The packages whose `__init__` runs when `mod` is imported: a.b.c -> a, a.b."""
    parts = mod.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _reach(start: str, edges: dict[str, list[tuple[str, bool]]], stop=()) -> dict[str, list[str]]:
    """Every module (ours or outside) that can run once `start` is imported and used, with the chain
    that reaches it. A module that is named is used: all its imports count, lazy ones included. A parent
    package runs only because a submodule was imported: its import-time imports count, its functions'
    imports do not (nothing named it, so nothing calls them). Modules in `stop` are not entered."""
    chain = {start: [start]}
    todo = [(start, True)]
    seen = {(start, True)}
    while todo:
        mod, named = todo.pop()
        for target, now in edges.get(mod, ()):
            if not named and not now:
                continue
            for t, t_named in [(p, False) for p in _parents(target)] + [(target, True)]:
                if t in stop or (t, t_named) in seen:
                    continue
                seen.add((t, t_named))
                chain.setdefault(t, chain[mod] + [t])
                if t in edges:
                    todo.append((t, t_named))
    return chain


# Modules `launch` may reach although they import a role or the torch stack, each with its reason. The
# torch side of a launch command runs as a child process (`python -m rl.doctor`, `python -m rl.export`)
# named in an argv, never imported, so nothing needs listing today.
LAUNCH_MAY_REACH: dict[str, str] = {}


def test_import_directions(repo: Path = REPO):
    """Followed to the end: what a module imports, what those import, and so on (function-level imports
    included), so a role or torch reached through a torch-free module in between is seen."""
    mods = dict(_modules("rl", "launch", repo=repo))
    edges = {n: _imports(n, p, set(mods)) for n, p in mods.items()}
    bad = []
    for name in sorted(mods):
        own_role = _under(name, ROLES)
        stop = LAUNCH_MAY_REACH if name.startswith("launch") else ()
        for reached, chain in sorted(_reach(name, edges, stop).items()):
            other, heavy = _under(reached, ROLES), _under(reached, HEAVY)
            via = " -> ".join(chain)
            if name.startswith("rl.contract") and (other or heavy or _under(reached, ("launch",)) or (
                    reached.startswith("rl.") and not reached.startswith("rl.contract"))):
                bad.append(f"{name} reaches {reached} ({via}): rl.contract must stay torch-free and "
                           f"role-free")
            elif name.startswith("launch") and (other or heavy):
                bad.append(f"{name} reaches {reached} ({via}): launch must not import a role or the torch "
                           f"stack (run it as a child process, as launch doctor and launch export do)")
            elif own_role and other and other != own_role:
                bad.append(f"{name} reaches {reached} ({via}): role {own_role} must not import role {other} "
                           f"(what they share belongs in rl.contract)")
            elif name.startswith("rl.") and _under(reached, ("launch",)):
                bad.append(f"{name} reaches {reached} ({via}): rl must not import the launcher")
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


def test_import_directions_follow_imports_to_the_end(tmp_path):
    """launch -> a torch-free module -> (lazily) a module that imports torch is seen, with its chain; so
    is a dynamic `importlib.import_module(f"...")`, and a parent package's lazy imports are not."""
    for d in ("launch", "rl/tool", "rl/quiet"):
        (tmp_path / d).mkdir(parents=True)
    files = {"launch/__init__.py": "", "rl/__init__.py": "",
             "launch/cli.py": "from rl.tool import light\n",
             "rl/tool/__init__.py": "def f():\n    import vllm\n",      # a parent: its lazy import never runs
             "rl/tool/light.py": "def f():\n    from rl.tool import heavy\n",
             "rl/tool/heavy.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import vllm\n"
                                 "import torch.distributed\n",
             "launch/dyn.py": "import importlib\ndef g(x):\n    importlib.import_module(f'rl.quiet.{x}')\n",
             "rl/quiet/__init__.py": "", "rl/quiet/mod.py": "import torchtitan\n",
             "rl/tool/up.py": "def f():\n    from launch import cli\n"}     # a tool importing the launcher
    for rel, text in files.items():
        (tmp_path / rel).write_text(text)
    with pytest.raises(AssertionError) as e:
        test_import_directions(tmp_path)
    msg = str(e.value)
    assert "launch.cli reaches torch (launch.cli -> rl.tool.light -> rl.tool.heavy -> torch)" in msg, msg
    assert "launch.dyn reaches torchtitan (launch.dyn -> rl.quiet.mod -> torchtitan)" in msg, msg
    assert "rl.tool.up reaches launch.cli (rl.tool.up -> launch.cli): rl must not import the launcher" in msg, msg
    assert "vllm" not in msg, msg   # TYPE_CHECKING and a parent package's function body never run
    (tmp_path / "rl/tool/up.py").unlink()
    (tmp_path / "rl/tool/light.py").write_text("X = 1\n")
    (tmp_path / "rl/quiet/mod.py").write_text("import json\n")
    test_import_directions(tmp_path)


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
