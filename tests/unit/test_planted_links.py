"""Every writer of the run directory refuses a planted symlink or FIFO (docs/run-directory-safety.md).

Static part: the source of rl/ and launch/ is scanned (ast) for every call that writes or creates a file
or directory (open for writing, os.open with O_WRONLY/O_RDWR/O_CREAT, Path.write_text/write_bytes/touch/
mkdir, os.replace/rename, shutil.copy*/move/copytree, save_file, torch.save, os.symlink/link, tarfile
extraction, mkstemp/mkdtemp, ...). Each must be inside rl/contract/safefs.py or its
rl/contract/privdirs.py (the one way to write into the
run directory) or listed in ALLOWLIST, keyed by (file, function, call), with the reason it may write
there without safefs. No file is exempt as a whole (the sandbox service once was, and appended to the run
directory through a planted link): every call is listed on its own. A new writer fails this test until it
goes through safefs or says why it need not; an allowlist entry that matches nothing any more fails it
too (the list stays true).

Dynamic part: each writer of the run directory is called for real with (i) a symlink at its final
component pointing at a victim file outside the run directory, (ii) a symlink at a directory on the way,
(iii) a FIFO at its final component; it must refuse in one line (UnsafePath or its own error), leave the
victim unchanged, and never block.
"""
from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# -- static: every file-writing call ------------------------------------------------------------------
_O_WRITE = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"}
_NAMED = {"write_text", "write_bytes", "touch", "mkdir", "makedirs", "symlink_to", "hardlink_to", "symlink",
          "link", "copy", "copy2", "copyfile", "copytree", "move", "save_file", "save_pretrained", "extractall",
          "extract", "mkfifo", "truncate", "rename", "replace", "save", "ZipFile", "savez", "mknod", "mkstemp",
          "mkdtemp"}

IN_STEP_TMP = ("inside a step's private tmp dir made by exchange.begin (0700, this user's), through the "
               "/proc/self/fd path of privdirs.pinned_dir that exchange.publish hands its writer: a rename "
               "of the name in the kind directory changes nothing")
PINNED = ("through privdirs.pinned_dir: the /proc/self/fd path of a private (0700, this user's) tmp dir this "
          "process opened and checked, never its name")
NODE_LOCAL = ("the node-local model copy: into the pinned path (privdirs.pinned_dir) of its private tmp dir, "
              "below this user's own node-local directory (privdirs.make_trusted_dirs)")
SANDBOX_ROOT = ("the sandbox's new root, a tmpfs in its own mount namespace, built before exec: not the host's "
                "file system, not the run directory")
AGENT_TREE = ("a sandbox's copy of the agent's tree (its private mkdtemp, 0711): every component opened "
              "O_NOFOLLOW below the tree's fd, never through a link the agent made")
SANDBOX_DIRS = "a sandbox's private root (tempfile.mkdtemp, chmod 0711) and what it holds, not the run directory"
REPO_CACHE = ("the built-in repositories' cache (env.swe.repos_dir, default ~/.cache/hetrl/swe_repos): a fresh "
              "mkdtemp there, renamed into place")
IMAGE_CACHE = "the user's apptainer image cache (env.swe.image_cache), not the run directory"
CGROUP = "a cgroup's control file or directory (cgroupfs), not a file of any run"
DOCTOR_TMP = "a private temp directory of the doctor (mkdtemp/TemporaryDirectory), not the run directory"
USER_OUT = "the user's own output path (export --out, doctor --json, a twin's directory), not the run directory"

# (file, function, call) -> why this write may bypass rl.contract.safefs. No file is exempt as a whole:
# each call that writes without safefs is listed here with its reason.
ALLOWLIST: dict[tuple[str, str, str], str] = {
    # rl/contract/secret.py: every call is relative to the run dir's fd that safefs opened (dir_fd=)
    ("rl/contract/secret.py", "create_secret", "os.open"): "dir_fd of the run dir opened by safefs.open_dir; O_EXCL|O_NOFOLLOW",
    ("rl/contract/secret.py", "create_secret", "os.link"): "dir_fd of the run dir opened by safefs.open_dir",
    ("rl/contract/secret.py", "create_secret", "os.replace"): "dir_fd of the run dir opened by safefs.open_dir",
    # libraries that take a path: handed the pinned path of the step's private tmp dir, never its name
    ("rl/trainer/checkpoint.py", "_dcp_save", "dcp.save"): PINNED + " (every rank pins the tmp dir itself)",
    ("rl/trainer/checkpoint.py", "_publish.write", ".write_text"): IN_STEP_TMP,
    ("rl/trainer/checkpoint.py", "_publish.write", "save_file"): IN_STEP_TMP,
    ("rl/trainer/checkpoint.py", "_planner.PlainDataPlanner.load_bytes", "torch.save"): "into an in-memory buffer",
    ("rl/trainer/startup.py", "write_assets", "shutil.copy2"): IN_STEP_TMP + "; copies model.hf_path's files",
    ("rl/tiny_models/tiny.py", "write_hf_assets", ".write_text"): IN_STEP_TMP + " (assets/step_000000)",
    ("rl/tiny_models/tiny.py", "build_tokenizer", "out_dir.mkdir"): IN_STEP_TMP + " (assets/step_000000)",
    ("rl/tiny_models/tiny.py", "build_tokenizer", "fast.save_pretrained"): IN_STEP_TMP + " (assets/step_000000)",
    # the node-local copy of the model (vLLM loads a directory by path)
    ("rl/inference/model_dir.py", "_fill", "save_file"): NODE_LOCAL,
    # the sandboxes (rl/envs/swe): their own trees, roots, caches and cgroups, never the run directory
    ("rl/envs/swe/_sandbox_init.py", "_bind", "os.open"): SANDBOX_ROOT + " (a bind mount's target file)",
    ("rl/envs/swe/_sandbox_init.py", "_dirs", "os.mkdir"): SANDBOX_ROOT,
    ("rl/envs/swe/_pytest_plugin.py", "pytest_configure", "open"): SANDBOX_ROOT + " (the results file, in the sandbox's tree)",
    ("rl/envs/swe/_pytest_plugin.py", "_install", "open"): SANDBOX_ROOT + " (dist-info files in its private /tmp; a generated _version.py in its tree)",
    ("rl/envs/swe/_pytest_plugin.py", "_install", "os.mkdir"): SANDBOX_ROOT + " (the dist-info directory in its private /tmp)",
    ("rl/envs/swe/_pytest_plugin.py", "_install", "os.makedirs"): SANDBOX_ROOT + " (parents of a generated version file in its tree)",
    ("rl/envs/swe/_sandbox_init.py", "_place", "os.symlink"): SANDBOX_ROOT + " (an allowlisted host link, recreated)",
    ("rl/envs/swe/_sandbox_init.py", "setup_filesystem", "os.mkdir"): SANDBOX_ROOT + " (/dev/shm of its private /dev)",
    ("rl/envs/swe/_sandbox_init.py", "setup_filesystem", "os.open"): SANDBOX_ROOT + " (device bind targets in its /dev)",
    ("rl/envs/swe/_sandbox_init.py", "setup_filesystem", "os.symlink"): SANDBOX_ROOT + " (/dev/fd, /dev/stdin, ...)",
    ("rl/envs/swe/env.py", "Episode.__init__", ".open"): "not a file: the sandbox service client's open(instance_id)",
    ("rl/envs/swe/grader.py", "_open_dir", "os.mkdir"): AGENT_TREE + " (the graded copy)",
    ("rl/envs/swe/grader.py", "write_bytes", "os.open"): AGENT_TREE + "; O_EXCL|O_NOFOLLOW (the graded copy)",
    ("rl/envs/swe/grader.py", "_protect", "write_bytes"): "grader.write_bytes (above): the base's files restored in the graded copy",
    ("rl/envs/swe/grader.py", "reset", "write_bytes"): "grader.write_bytes (above): a file reset in the graded copy",
    ("rl/envs/swe/repos.py", "checkout", "tar.extractall"): "a task's repository unpacked into a fresh sandbox tree "
    "(git archive; tarfile's 'data' filter refuses links and paths outside it)",
    ("rl/envs/swe/repos.py", "ensure_builtin", "dest.parent.mkdir"): REPO_CACHE,
    ("rl/envs/swe/repos.py", "ensure_builtin", "tempfile.mkdtemp"): REPO_CACHE,
    ("rl/envs/swe/repos.py", "ensure_builtin", "os.rename"): REPO_CACHE,
    ("rl/envs/swe/repos.py", "make_repo", "dest.mkdir"): REPO_CACHE + " (the new repository inside the mkdtemp)",
    ("rl/envs/swe/repos.py", "make_repo", "p.parent.mkdir"): REPO_CACHE + " (the new repository inside the mkdtemp)",
    ("rl/envs/swe/repos.py", "make_repo", "p.write_text"): REPO_CACHE + " (the new repository inside the mkdtemp)",
    ("rl/envs/swe/runtime_apptainer.py", "sif_for", "path.parent.mkdir"): IMAGE_CACHE,
    ("rl/envs/swe/runtime_apptainer.py", "sif_for", "open"): IMAGE_CACHE + " (its build lock)",
    ("rl/envs/swe/runtime_apptainer.py", "sif_for", "os.replace"): IMAGE_CACHE + " (a built image renamed into place)",
    ("rl/envs/swe/runtime_remote.py", "RemoteRuntime.copy_out", ".mkdir"): "the caller's fresh destination of a remote "
    "sandbox's tree (exist_ok=False: a grading copy), not the run directory",
    ("rl/envs/swe/runtime_remote.py", "RemoteRuntime.copy_out", "tar.extractall"): "the caller's fresh destination "
    "(tarfile's 'tar' filter refuses members landing outside it)",
    ("rl/envs/swe/runtimes.py", "Runtime.__init__", "tempfile.mkdtemp"): SANDBOX_DIRS,
    ("rl/envs/swe/runtimes.py", "Runtime.__init__", "self.tree.mkdir"): SANDBOX_DIRS,
    ("rl/envs/swe/runtimes.py", "_open_beneath", "os.mkdir"): AGENT_TREE,
    ("rl/envs/swe/runtimes.py", "_open_beneath", "os.open"): AGENT_TREE,
    ("rl/envs/swe/sandbox.py", "Sandbox.__init__", "tempfile.mkdtemp"): SANDBOX_DIRS,
    ("rl/envs/swe/sandbox.py", "Sandbox.__init__", "self._newroot.mkdir"): SANDBOX_DIRS + " (its new root's mount point)",
    ("rl/envs/swe/sandbox.py", "Sandbox.__init__", "self.tree.mkdir"): SANDBOX_DIRS,
    ("rl/envs/swe/sandbox.py", "Sandbox.from_files", "p.parent.mkdir"): SANDBOX_DIRS + " (a new sandbox's tree)",
    ("rl/envs/swe/sandbox.py", "Sandbox.from_files", "p.write_text"): SANDBOX_DIRS + " (a new sandbox's tree)",
    ("rl/envs/swe/sandbox_limits.py", "CgroupMemory.__init__", "self.path.mkdir"): CGROUP,
    ("rl/envs/swe/sandbox_limits.py", "CgroupMemory._write", "p.write_text"): CGROUP,
    ("rl/envs/swe/sandbox_limits.py", "CgroupMemory.kill", ".write_text"): CGROUP + " (cgroup.kill)",
    ("rl/envs/swe/sandbox_limits.py", "_try_child", "probe.mkdir"): CGROUP + " (a probe)",
    ("rl/envs/swe/sandbox_limits.py", "_try_child", ".write_text"): CGROUP + " (a probe's memory limit)",
    ("rl/envs/swe/sandbox_limits.py", "_v2_parent", "ctl.write_text"): CGROUP + " (cgroup.subtree_control)",
    ("rl/envs/swe/service.py", "Service.tree.pack", "tarfile.open"): "a tar built in memory (io.BytesIO) and sent "
    "over HTTP; no file",
    ("rl/envs/swe/trees.py", "_copy_file", "os.open"): "a copy of a sandbox tree: O_EXCL|O_NOFOLLOW into the fresh "
    "destination copy_tree made",
    ("rl/envs/swe/trees.py", "copy_tree", "os.mkdir"): "the fresh destination of a sandbox tree's copy (must not "
    "exist), not the run directory",
    ("rl/envs/swe/trees.py", "copy_tree", "os.symlink"): "a link of a sandbox tree copied as a link into its fresh "
    "destination, never followed",
    # tools that write where the user told them, or into their own temp dirs
    ("rl/tiny_models/twins.py", "write_twin", "out.mkdir"): USER_OUT,
    ("rl/tiny_models/twins.py", "write_twin", "model.save_pretrained"): USER_OUT,
    ("rl/tiny_models/twins.py", "write_twin", ".write_text"): USER_OUT,
    ("rl/tiny_models/twins.py", "_add_family_tensors", "save_file"): USER_OUT,
    ("rl/export.py", "export", "os.mkdir"): USER_OUT + " (a fresh 0700 tmp dir beside it)",
    ("rl/export.py", "export", "shutil.copy2"): USER_OUT,
    ("rl/export.py", "export", "os.rename"): USER_OUT,
    ("rl/export.py", "_ShardWriter.finish", "os.rename"): USER_OUT,
    ("rl/export.py", "_ShardWriter.finish", ".write_text"): USER_OUT,
    ("rl/export.py", "_write_config", ".write_text"): USER_OUT,
    ("rl/export.py", "export", ".write_text"): USER_OUT + " (its README.md, inside the 0700 tmp dir)",
    ("launch/doctor.py", "fs_bandwidth", "where.mkdir"): "doctor --fs: the directory the user names to measure",
    ("launch/doctor.py", "fs_bandwidth", "tempfile.mkstemp"): "doctor --fs: a fresh O_EXCL temp file there",
    ("launch/doctor.py", "slurm_row", ".write_text"): DOCTOR_TMP,
    ("launch/doctor.py", "torch_rows", "open"): DOCTOR_TMP + " (its log)",
    ("launch/doctor.py", "run", ".write_text"): USER_OUT + " (doctor --json FILE)",
    ("rl/doctor/__main__.py", "main", ".write_text"): USER_OUT + " (--json)",
    ("rl/doctor/__main__.py", "_gpu_rows", "tempfile.mkdtemp"): DOCTOR_TMP,
    ("rl/doctor/__main__.py", "_gpu_rows", "pub_dir.mkdir"): DOCTOR_TMP,
    ("rl/doctor/publish.py", "_fsync_write", "open"): DOCTOR_TMP,
    ("rl/doctor/publish.py", "_vllm", "assets.mkdir"): DOCTOR_TMP,
    ("rl/doctor/publish.py", "publish_rows.measure", "save_file"): DOCTOR_TMP,
    ("rl/doctor/throughput.py", "Meter.reset_peak", "open"): "/proc/self/clear_refs",
    ("rl/orchestrator/spill.py", "SpillDir.path", "tempfile.mkdtemp"): "the orchestrator's private route-spill "
    "directory (mode 0700, fresh name) under orchestrator.spill_dir or node-local $SLURM_TMPDIR/$TMPDIR; "
    "its parent is made and every file inside written through safefs",
    # data-set builders (offline scripts writing where they are told)
    ("rl/envs/swe/data/make_builtin.py", "main", "out.write_text"): USER_OUT,
    ("rl/envs/swe/data/make_swebench.py", "main", "out.write_text"): USER_OUT,
}


def _dotted(f) -> str:
    parts = []
    while isinstance(f, ast.Attribute):
        parts.append(f.attr)
        f = f.value
    if isinstance(f, ast.Name):
        parts.append(f.id)
        return ".".join(reversed(parts))
    return "." + ".".join(reversed(parts))


def _names(node, consts) -> set[str]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.Name):
            out.add(n.id)
            if n.id in consts:
                out |= _names(consts[n.id], {})
    return out


def _mode(call, pos):
    for k in call.keywords:
        if k.arg == "mode":
            return k.value
    return call.args[pos] if len(call.args) > pos else None


def _writes(m) -> bool:
    if m is None:
        return False
    if isinstance(m, ast.Constant) and isinstance(m.value, str):
        return any(c in m.value for c in "wax+")
    return True  # not a literal: it may write


def classify(call: ast.Call, consts: dict) -> str | None:
    """The kind of file write `call` is ("open", "os.rename", ".write_text", ...), None if it is none."""
    d = _dotted(call.func)
    last = d.rsplit(".", 1)[-1]
    if d.startswith("safefs."):
        return None  # the safe API itself
    if d == "os.open":
        fl = call.args[1] if len(call.args) > 1 else None
        names = _names(fl, consts) if fl is not None else set()
        return d if names & _O_WRITE or (fl is not None and not names & {"O_RDONLY", "O_PATH"}) else None
    if d in ("open", "io.open", "builtins.open"):
        return "open" if _writes(_mode(call, 1)) else None
    if d == "tarfile.open":
        return d if _mode(call, 1) is not None and _writes(_mode(call, 1)) else None
    if last == "open":
        if d.endswith("safe_open"):
            return None
        return ".open" if _writes(_mode(call, 0)) else None
    if last not in _NAMED:
        return None
    if last == "replace":
        return d if d == "os.replace" else (".replace" if len(call.args) == 1 and not call.keywords else None)
    if last == "rename":
        return d if d == "os.rename" else (".rename" if len(call.args) == 1 else None)
    if last == "save":
        return d if d.split(".")[0] in ("torch", "dcp", "np", "numpy") else None
    if last in ("copy", "move") and not d.startswith("shutil"):
        return None
    if last in ("link", "symlink", "truncate", "mkfifo", "mknod", "makedirs") and not d.startswith("os"):
        return None
    return d if not d.startswith(".") else "." + last


def write_sites(path: Path) -> list[tuple[str, str, int]]:
    """[(function qualname, call kind, line)] of the file-writing calls in the module at `path`."""
    tree = ast.parse(path.read_text())
    consts = {n.targets[0].id: n.value for n in tree.body
              if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)}
    out = []

    def visit(node, scope):
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(ch, scope + [ch.name])
                continue
            if isinstance(ch, ast.Call) and (kind := classify(ch, consts)):
                out.append((".".join(scope) or "<module>", kind, ch.lineno))
            visit(ch, scope)
    visit(tree, [])
    return out


def _all_sites() -> dict[tuple[str, str, str], list[int]]:
    found: dict[tuple[str, str, str], list[int]] = {}
    for base in ("rl", "launch"):
        for p in sorted((REPO / base).rglob("*.py")):
            rel = p.relative_to(REPO).as_posix()
            if rel in ("rl/contract/safefs.py", "rl/contract/privdirs.py"):   # the walk itself, and its
                continue                                                   # private directories built on it
            for fn, kind, line in write_sites(p):
                found.setdefault((rel, fn, kind), []).append(line)
    return found


def test_the_scanner_sees_the_kinds_of_writes():
    src = ("import os, shutil\nfrom pathlib import Path\nFL = os.O_WRONLY | os.O_CREAT\n"
           "def f(p):\n    open(p, 'a')\n    open(p)\n    os.open(p, FL)\n    os.open(p, os.O_RDONLY)\n"
           "    Path(p).write_text('x')\n    os.replace(p, p)\n    'a'.replace('a', 'b')\n"
           "    shutil.copy2(p, p)\n    safefs.append_bytes(p, b'')\n    Path(p).open('wb')\n")
    tree = ast.parse(src)
    consts = {n.targets[0].id: n.value for n in tree.body if isinstance(n, ast.Assign)}
    kinds = [classify(c, consts) for c in ast.walk(tree) if isinstance(c, ast.Call)]
    assert sorted(k for k in kinds if k) == sorted(["open", "os.open", ".write_text", "os.replace",
                                                     "shutil.copy2", ".open"])


def test_every_writer_goes_through_safefs_or_says_why_not():
    found = _all_sites()
    unlisted = [f"{rel}:{lines[0]} {fn}: {kind}" for (rel, fn, kind), lines in sorted(found.items())
                if (rel, fn, kind) not in ALLOWLIST]
    assert not unlisted, ("writes that bypass rl.contract.safefs (use safefs.open_write / append_bytes / "
                          "write_atomic / makedirs / rename, or add the site to ALLOWLIST with the reason):\n  "
                          + "\n  ".join(unlisted))


def test_the_allowlist_names_only_writes_that_exist():
    found = _all_sites()
    stale = [k for k in ALLOWLIST if k not in found]
    assert not stale, f"ALLOWLIST entries that match no write any more (remove them): {stale}"
    whole = [k for k in ALLOWLIST if len(k) != 3 or not all(k)]
    assert not whole, f"ALLOWLIST entries that name no call (no file is exempt as a whole): {whole}"
    assert all(isinstance(v, str) and len(v) > 10 for v in ALLOWLIST.values()), "every entry says why"


# -- dynamic: plant links and FIFOs, call the real writers ----------------------------------------------
VICTIM = b"the user's own file\n"


@pytest.fixture(scope="module")
def frozen(tmp_path_factory):
    """config.yaml and plan.json of a composed run (composed once: Hydra takes a second)."""
    from builders import make_run_dir
    run = tmp_path_factory.mktemp("template") / "run"
    make_run_dir(run, "wandb.mode=disabled")
    return {n: (run / n).read_bytes() for n in ("config.yaml", "plan.json")}


def _run_dir(tmp_path: Path, frozen: dict) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    for n, data in frozen.items():
        (run / n).write_bytes(data)
    cfg = (run / "config.yaml").read_text()
    import yaml
    c = yaml.safe_load(cfg)
    c["run_dir"] = str(run)
    (run / "config.yaml").write_text(yaml.safe_dump(c, sort_keys=False))
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(c, sort_keys=False))  # for _freeze, outside the run
    return run


def _publish(run):
    from rl import exchange
    exchange.publish(run, "rollouts", 1, lambda d: (d / "f").write_bytes(b"x"), producer="test")


def _freeze(run):
    import yaml
    from launch.plan import make_plan
    from launch.rundir import freeze_run_dir
    cfg = yaml.safe_load((run.parent / "cfg.yaml").read_text())
    freeze_run_dir(cfg, run, make_plan(cfg))


def _report(run):
    import argparse
    import contextlib
    import io
    from launch import report
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = report.run(argparse.Namespace(run_dir=str(run), out=None, steps=2, episodes=1))
    if rc != 0:  # the command's own refusal: its one line on stderr
        raise RuntimeError(err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {rc}")


def _metrics(run):
    from rl import runtime
    from rl.metrics import MetricsLogger
    MetricsLogger(run, runtime.load_config(run)).log(0, {"loss": 1.0})


def _shard_part(run):
    import torch
    from rl import exchange
    from rl.exchange import shards
    tmp = exchange.begin(run, "weights", 1, token="shared")
    shards.write_part(tmp, 0, {"w": torch.zeros(2, 2)}, fp8_enabled=False)


def _take_lock(run):
    from launch.local import _take_run_dir
    _take_run_dir(run).close()


def _role_log(run):
    from launch.local import open_role_log
    os.close(open_role_log(run, "trainer"))


def _verified(run):
    from rl.exchange.shard_reader import VerifiedOnNode
    VerifiedOnNode(run / "verified" / "step_000001.txt").add(["k"])


def _faults_log(run):
    from rl import faults
    faults._write_pass(str(run / "logs" / "faults.jsonl"), {"point": "x"})


def _append(rel):
    def f(run):
        from rl.exchange import append_jsonl
        append_jsonl(run / rel, {"version": 0, "eval/version": 0})
    return f


def _grouplog(run):
    from rl.orchestrator.grouplog import GroupLog
    GroupLog(run, 0).started(1, 0)


def _consumed(run):
    from rl.exchange import ConsumedLog
    ConsumedLog(run, "rollouts", "trainer").record(1)


def _role_record(run):
    from rl.contract.records import RoleRecord
    RoleRecord.here("trainer").write(run)


def _resume_state(run):
    from rl.contract.records import ResumeState
    ResumeState(restart=0).write(run)


def _done(run):
    from rl import runtime
    runtime.mark_done(run)


def _secret(run):
    from rl.contract.secret import create_secret
    create_secret(run)


def _slurm_job(run):
    from launch.slurm import record_job
    record_job(run, "4242")


def _submissions(run):
    _freeze(run)


def _sandbox_log(run):
    from rl.envs.swe.service import log_closed
    log_closed(run, 0, {"id": "x", "instance_id": "t", "commands": 0})


# (writer, the path it writes below the run dir); every one is planted three ways
WRITERS = {
    "record resume.json": (_resume_state, "resume.json"),
    "record roles/trainer.json": (_role_record, "roles/trainer.json"),
    "record roles/history.jsonl": (_role_record, "roles/history.jsonl"),
    "DONE": (_done, "DONE"),
    "groups.jsonl": (_grouplog, "rollouts/groups.jsonl"),
    "eval/results.jsonl": (_append("eval/results.jsonl"), "eval/results.jsonl"),
    "metrics.jsonl": (_metrics, "metrics.jsonl"),
    "rollouts/consumed.jsonl": (_consumed, "rollouts/consumed.jsonl"),
    "report page": (_report, "report.html"),
    "slurm jobs file": (_slurm_job, "slurm_jobs.jsonl"),
    "submissions.jsonl": (_submissions, "submissions.jsonl"),
    "freeze config.yaml": (_freeze, "config.yaml"),
    "freeze plan.json": (_freeze, "plan.json"),
    "freeze logs/": (_freeze, "logs/"),     # a directory: planted as a link only
    "secret": (_secret, "secret"),
    "faults log": (_faults_log, "logs/faults.jsonl"),
    "publish a step": (_publish, "rollouts/step_000001"),
    "weights part in a shared tmp step": (_shard_part, "weights/step_000001.tmp-shared/model-r00000-00001.safetensors"),
    "launcher lock": (_take_lock, "launcher.lock"),
    "role log": (_role_log, "logs/trainer.log"),
    "verified-on-node log": (_verified, "verified/step_000001.txt"),
    "sandbox service log": (_sandbox_log, "sandboxes/sandboxes_0.jsonl"),
}


# what a refusal says (UnsafePath, CorruptStep, SecretError, ConfigError all name what they found)
REFUSALS = ("symlink", "FIFO", "not a regular file", "not a directory", "not a step directory")


class _Blocked(Exception):
    pass


def _call(fn, run, seconds: float = 20.0):
    """fn(run) with an alarm: a writer that opens a FIFO for writing blocks until a reader comes."""
    def alarm(signum, frame):
        raise _Blocked(f"{fn.__name__} blocked for {seconds:.0f} s")
    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        fn(run)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _snapshot(p: Path) -> dict:
    return {str(x.relative_to(p)): (x.read_bytes() if x.is_file() else None) for x in sorted(p.rglob("*"))}


@pytest.mark.skipif(sys.platform != "linux", reason="FIFOs and O_NOFOLLOW semantics of Linux")
@pytest.mark.parametrize("plant", ["final link", "directory link", "final fifo"])
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_planted_link_or_fifo_is_refused(writer, plant, tmp_path, frozen):
    fn, rel = WRITERS[writer]
    parts = [x for x in rel.split("/") if x]
    if plant == "directory link" and len(parts) == 1 and not rel.endswith("/"):
        pytest.skip("a file at the top of the run directory: its only directory is the run dir itself, "
                    "resolved once at the entry point")
    if plant != "directory link" and rel.endswith("/"):
        pytest.skip("a directory the writer makes: planted as a link only")
    run = _run_dir(tmp_path, frozen)
    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    (victim_dir / "f").write_bytes(VICTIM)
    if len(parts) > 1:
        (victim_dir / Path(*parts[1:])).parent.mkdir(parents=True, exist_ok=True)
        (victim_dir / Path(*parts[1:])).write_bytes(VICTIM)
    victim = tmp_path / "victim_file"
    victim.write_bytes(VICTIM)
    target = run / rel
    if plant == "directory link":
        shutil.rmtree(run / parts[0], ignore_errors=True)
        (run / parts[0]).symlink_to(victim_dir, target_is_directory=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.unlink(missing_ok=True)
        if plant == "final link":
            target.symlink_to(victim)
        else:
            os.mkfifo(target)
    before = _snapshot(victim_dir), victim.read_bytes()
    try:
        _call(fn, run)
    except _Blocked as e:
        pytest.fail(f"{writer}: {e} on a FIFO")
    except (OSError, ValueError, RuntimeError) as e:  # UnsafePath, or the writer's own one-line error
        msg = str(e)
        assert "\n" not in msg and any(w in msg for w in REFUSALS), \
            f"{writer}: not a one-line refusal of the planted {plant}: {type(e).__name__}: {msg!r}"
    else:
        pytest.fail(f"{writer}: wrote through a {plant} at {rel} without refusing")
    assert (_snapshot(victim_dir), victim.read_bytes()) == before, f"{writer}: the victim changed"
    if plant == "final link":
        assert target.is_symlink(), f"{writer}: the planted link was replaced silently"


def test_a_kind_directory_linked_to_another_runs_is_not_read_as_this_runs(tmp_path):
    """`RUN/rollouts -> OTHER/rollouts`: the other run's batches are refused, not listed as this run's."""
    from rl import exchange
    from rl.contract.safefs import UnsafePath
    other, run = tmp_path / "other", tmp_path / "run"
    for s in (1, 2):
        exchange.publish(other, "rollouts", s, lambda d: (d / "f").write_bytes(b"x"), producer="test")
    run.mkdir()
    (run / "rollouts").symlink_to(other / "rollouts")
    for read in (lambda: exchange.list_steps(run, "rollouts"), lambda: exchange.latest_complete(run, "rollouts"),
                 lambda: exchange.wait_for(run, "rollouts", 1, timeout=0.1),
                 lambda: exchange.clean_tmp(run, ["rollouts"]), lambda: exchange.discard_after(run, "rollouts", 0)):
        with pytest.raises(UnsafePath, match="symlink"):
            read()
    assert exchange.list_steps(other, "rollouts") == [1, 2]


def test_the_batch_script_refuses_a_linked_log_before_appending(tmp_path):
    """bash's >> follows links: the script checks each log it appends to first (own_file)."""
    from builders import compose_cfg
    from launch import slurm
    run = tmp_path / "run"
    cfg = compose_cfg(run, "cluster=slurm")
    script = slurm.prepare_run(cfg, run)[1]
    head = script[script.index("log() {"):script.index('mkdir -p "$LOGS"')]
    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM)
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "prepare.log").symlink_to(victim)
    test = f'RUN_DIR={run}\nLOGS="$RUN_DIR/logs"\n{head}\nown_file "$LOGS/prepare.log"\necho written >>"$LOGS/prepare.log"\n'
    import subprocess
    r = subprocess.run(["bash", "-c", test], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "refusing" in r.stdout, (r.stdout, r.stderr)
    assert victim.read_bytes() == VICTIM
    (run / "logs" / "prepare.log").unlink()
    shutil.rmtree(run / "logs")
    (run / "logs").symlink_to(tmp_path)
    r = subprocess.run(["bash", "-c", f'RUN_DIR={run}\nLOGS="$RUN_DIR/logs"\n{head}\necho ok'],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "refusing" in r.stdout and "ok" not in r.stdout, (r.stdout, r.stderr)
