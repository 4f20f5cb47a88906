"""Hostile dataset rows and a damaged run secret (issue 21): what a red-team round broke, reproduced.

- a row's snapshot keys (`files`), test ids and diff headers that leave the task's tree (absolute,
  `..`, option-shaped) are refused when rows load, one line naming the row and the field; a Task made in
  memory is refused again where its files would be written; nothing outside the tree is written, under
  every runtime that runs here (inprocess, bubblewrap);
- a repository checkout holding a link out of the tree is refused, nothing written through it;
- option-shaped values that reach a command line (image, base_commit, repo) are refused at load, and
  podman's / apptainer's argv refuse them and put the image after `--`;
- an empty or short `secret` is replaced when the run directory is frozen, `read_secret` refuses it,
  and the router, the sandbox service and its client do not start on it;
- oversized fields (a 100 MB problem statement) are refused at load naming row, field, size and limit.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from rl.contract.secret import MIN_CHARS, SecretError, create_secret, read_secret, secret_or_none
from rl.envs.swe import repos
from rl.envs.swe import runtime_apptainer as apt
from rl.envs.swe.datasets import load_dataset
from rl.envs.swe.env import EnvConfig, SWEEnv
from rl.envs.swe.runtime_podman import podman_argv
from rl.envs.swe.runtimes import RUNTIMES, RuntimeUnavailable, open_runtime, runtime_class
from rl.envs.swe.sandbox import Limits
from rl.envs.swe.grader import grade
from rl.envs.swe.tasks import ROW_LIMITS, Task, check_image, open_sandbox, runtime_args

REPO = Path(__file__).resolve().parents[2]
DIFF = "diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"
TEST = "from m import x\n\n\ndef test_x():\n    assert x == 2\n"
LIMITS = Limits(cpu_s=20, memory_bytes=1 << 30, nproc=64)


def _runs_here(name):
    try:
        runtime_class(name).check()
    except RuntimeUnavailable:
        return False
    return name in ("inprocess", "bubblewrap")  # podman / apptainer run images: argv tests below


LOCAL = [pytest.param(n, marks=pytest.mark.skipif(not _runs_here(n), reason=f"runtime {n} not here"))
         for n in RUNTIMES if n in ("inprocess", "bubblewrap")]


def _row(**changes):
    """A good SWE-bench row over a snapshot (no repository needed), then `changes`."""
    row = {"instance_id": "hostile__row-1", "repo": "builtin/hostile", "base_commit": "",
           "problem_statement": "x should be 2", "patch": DIFF,
           "test_patch": "diff --git a/tests/test_m.py b/tests/test_m.py\nnew file mode 100644\n"
                         "--- /dev/null\n+++ b/tests/test_m.py\n@@ -0,0 +1,5 @@\n"
                         + "".join("+" + line + "\n" for line in TEST.splitlines()),
           "FAIL_TO_PASS": ["tests/test_m.py::test_x"], "PASS_TO_PASS": [], "files": {"m.py": "x = 1\n"}}
    row.update(changes)
    return row


def _write(rows, path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _refused(tmp_path, row, field, fmt="auto", **kw) -> str:
    """load_dataset of [good row, `row`] raises one line naming row 1, its instance and `field`."""
    f = _write([_row(instance_id="good__row-0"), row], tmp_path / "rows.jsonl")
    with pytest.raises(ValueError) as e:
        load_dataset(f, fmt, **kw)
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert msg.startswith(f"{f}: row 1 ({str(row.get('instance_id', '?'))[:80]}): {field}: "), msg
    return msg


def _listing(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


# -- paths a row names -------------------------------------------------------------------------------
def test_snapshot_keys_outside_the_tree_are_refused_at_load(tmp_path):
    victim = tmp_path / "outside" / "pwned.py"
    victim.parent.mkdir()
    before = _listing(tmp_path)
    for key, why in ((str(victim), "is absolute"), ("../../pwned.py", "'..' component"),
                     ("pkg/../../../pwned.py", "'..' component"), ("-rf", "starts with '-'"),
                     ("a\nb.py", "control character"), ("pkg/", "ends in '/'")):
        msg = _refused(tmp_path, _row(files={"m.py": "x = 1\n", key: "pwned\n"}), "files")
        assert why in msg, msg
    # a file and a directory of other files at once cannot both be written
    assert "both a file and a directory" in _refused(tmp_path, _row(files={"a": "1", "a/b.py": "2"}), "files")
    assert _listing(tmp_path) == before | {"rows.jsonl"} and not victim.exists()


@pytest.mark.parametrize("runtime", LOCAL)
def test_a_hostile_task_in_memory_writes_nothing_outside_its_tree(tmp_path, runtime):
    """A Task that never went through load_dataset (made in memory) is checked again where its files
    would be written: open_sandbox, SWEEnv and grade refuse it and nothing lands on the host."""
    name = f"hetrl-hostile-{uuid.uuid4().hex[:12]}.py"
    absolute = tmp_path / name
    # the sandbox tree is <tmp>/hetrl-<runtime>-XXXX/tree: two levels up is the temp directory itself
    dotdot = Path(tempfile.gettempdir()) / name
    good = Task(instance_id="hostile__mem-1", repo="builtin/hostile", base_commit="", problem_statement="x",
                patch=DIFF, test_patch="", fail_to_pass=["m.py::test_x"], pass_to_pass=[],
                files={"m.py": "x = 1\n"})
    cfg = {"name": runtime}
    for key in (str(absolute), f"../../{name}", f"sub/../../../{name}"):
        bad = Task(**{**good.__dict__, "files": {"m.py": "x = 1\n", key: "pwned\n"}})
        with pytest.raises(ValueError, match=r"^hostile__mem-1 \(hostile__mem-1\): files: path .*"):
            open_sandbox(bad, LIMITS, cfg)
        with pytest.raises(ValueError, match=r"^tasks: row 0 \(hostile__mem-1\): files: "):
            SWEEnv([bad], EnvConfig(runtime=cfg))
        with pytest.raises(ValueError, match=r"files: path"):
            grade(bad, limits=LIMITS, runtime=cfg)
        assert not absolute.exists() and not dotdot.exists(), key
    # test ids and diff headers are files too: grading resets and patches them
    for changes, field in (({"fail_to_pass": [f"{absolute}::test_x"]}, "FAIL_TO_PASS"),
                           ({"pass_to_pass": [f"../../{name}::test_x"]}, "PASS_TO_PASS"),
                           ({"test_patch": f"--- a/../../{name}\n+++ b/../../{name}\n@@ -0,0 +1 @@\n+x\n"},
                            "test_patch")):
        bad = Task(**{**good.__dict__, **changes})
        with pytest.raises(ValueError, match=rf"\(hostile__mem-1\): {field}: "):
            grade(bad, limits=LIMITS, runtime=cfg)
        assert not absolute.exists() and not dotdot.exists(), field
    with open_sandbox(good, LIMITS, cfg) as sb:  # the good one still opens, its file in its tree
        assert sb.read_file("m.py") == "x = 1\n"


def test_test_ids_and_diff_headers_outside_the_tree_are_refused_at_load(tmp_path):
    for ids, why in ((["/etc/passwd::test_x"], "is absolute"), (["../../x.py::test_x"], "'..' component"),
                     (["--rootdir=/::test_x"], "starts with '-'"), (["-p", "evil"], "starts with '-'")):
        assert why in _refused(tmp_path, _row(FAIL_TO_PASS=ids), "FAIL_TO_PASS")
        assert why in _refused(tmp_path, _row(PASS_TO_PASS=ids), "PASS_TO_PASS")
    for header in ("+++ b/../../evil.py", "+++ /etc/cron.d/evil"):
        diff = f"--- a/tests/test_m.py\n{header}\n@@ -0,0 +1 @@\n+x\n"
        assert "diff header" in _refused(tmp_path, _row(test_patch=diff), "test_patch")
        assert "diff header" in _refused(tmp_path, _row(patch=diff), "patch")
    rename = "diff --git a/m.py b/n.py\nrename from m.py\nrename to ../../n.py\n--- a/m.py\n+++ b/m.py\n"
    assert "'..'" in _refused(tmp_path, _row(patch=rename), "patch")
    # Django-style ids (no file part) and a hunk line that only looks like a header stay accepted
    ok = _row(PASS_TO_PASS=["test_view (admin_views.tests.AdminViewTests)"],
              patch=DIFF + "@@ -5 +5 @@\n-a\n+++ /not/a/header\n")
    [t] = load_dataset(_write([ok], tmp_path / "ok.jsonl"))
    assert t.pass_to_pass == ["test_view (admin_views.tests.AdminViewTests)"]


@pytest.mark.parametrize("runtime", LOCAL)
def test_a_checkout_with_a_link_out_of_the_tree_is_refused(tmp_path, runtime):
    """A repository whose base_commit holds a link pointing outside: the checkout refuses it (one line
    naming the instance and base_commit) and nothing is written through it, under every runtime here."""
    outside = tmp_path / "outside"
    outside.mkdir()
    src = tmp_path / "src"
    for target in (str(outside), "../../outside"):
        d = src / uuid.uuid4().hex[:6]
        base = repos.make_repo({"m.py": "x = 1\n"}, d)
        os.symlink(target, d / "tests")
        repos.git("add", "-A", cwd=d)
        repos.git("-c", "commit.gpgsign=false", "commit", "-q", "--no-verify", "-m", "link", cwd=d)
        head = repos.git("rev-parse", "HEAD", cwd=d).decode().strip()
        assert head != base
        t = Task("linked__repo-1", str(d), head, "x", DIFF, "", ["tests/test_m.py::test_x"], [],
                 repo_dir=str(d))
        with pytest.raises(ValueError, match=r"^linked__repo-1: base_commit: the checkout of .* leaves the "
                                             r"task's tree"):
            open_sandbox(t, LIMITS, {"name": runtime})
        with pytest.raises(ValueError, match=r"base_commit: the checkout"):
            grade(t, limits=LIMITS, runtime={"name": runtime})
        assert list(outside.iterdir()) == []


def test_values_that_reach_a_command_line_are_refused_at_load(tmp_path):
    msg = _refused(tmp_path, _row(base_commit="--output=/tmp/pwned", files={}), "base_commit")
    assert "not a git commit id" in msg
    assert "not a git commit id" in _refused(
        tmp_path, _row(environment_setup_commit="-c core.pager=sh"), "environment_setup_commit")
    for repo in ("../../etc", "/srv/../etc", "-upload-pack=touch /tmp/x", "owner/../../x"):
        _refused(tmp_path, _row(repo=repo), "repo")
    smith = {"instance_id": "smith__x-1", "repo": "swesmith/org__proj.abc", "patch": DIFF,
             "FAIL_TO_PASS": ["tests/test_m.py::test_x"], "PASS_TO_PASS": [], "problem_statement": "x"}
    for image in ("--volume=/:/host:rw", "-v /:/host", "ubuntu --privileged", "/srv/images/evil.sif",
                  "docker-archive:///etc/shadow"):
        f = _write([{**smith, "image_name": image}], tmp_path / "smith.jsonl")
        with pytest.raises(ValueError, match=r"row 0 \(smith__x-1\): image: .* is not an image reference"):
            load_dataset(f)
    [t] = load_dataset(_write([{**smith, "image_name": "jyangballin/swesmith.x86_64.org__proj.abc:v1"}],
                              tmp_path / "smith.jsonl"))
    assert t.image == "jyangballin/swesmith.x86_64.org__proj.abc:v1"


def test_podman_argv_takes_no_option_shaped_image():
    hostile = "--volume=/:/host:rw"
    with pytest.raises(ValueError, match="not an image reference"):
        podman_argv("podman", "hetrl-x", hostile, "/t/tree", "/testbed", LIMITS, {}, ["pytest"])
    with pytest.raises(ValueError, match="environment variable name"):
        podman_argv("podman", "hetrl-x", "python:3.11", "/t/tree", "/testbed", LIMITS,
                    {"X --volume=/:/host": "1"}, ["pytest"])
    a = podman_argv("podman", "hetrl-x", "python:3.11", "/t/tree", "/testbed", LIMITS, {"K": "v"},
                    ["-v", "x"])
    cut = a.index("--")  # podman reads no option after it: the image and the command are positional
    assert a[cut + 1:] == ["python:3.11", "-v", "x"]
    assert [w for w in a[:cut] if w.startswith("--volume")] == ["--volume=/t/tree:/testbed:rw"]
    task = Task("img__x-1", "o/p", "", "x", DIFF, "", ["t.py::t"], [], image=hostile)
    with pytest.raises(ValueError, match=r"^img__x-1: image: '--volume=/:/host:rw' is not an image"):
        runtime_args(task, {"name": "podman"})


STANDIN = """#!/bin/sh
echo "$@" >> "$(dirname "$0")/calls"
exit 0
"""


def test_apptainer_takes_no_option_shaped_image(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="starts with '-'"):
        apt.apptainer_argv("/usr/bin/apptainer", "--bind=/:/host", "/t/tree", "/testbed", LIMITS, {}, ["x"],
                           nproc=False)
    a = apt.apptainer_argv("/usr/bin/apptainer", "/c/x.sif", "/t/tree", "/testbed", LIMITS, {"K": "v"},
                           ["-v"], nproc=False)
    ex = a[a.index("--") + 1:]  # after prlimit's own `--`: apptainer's argv
    assert ex[ex.index("--") + 1:] == ["/c/x.sif", "-v"]
    with pytest.raises(ValueError, match="starts with '-'"):
        apt.sif_for("--fakeroot://x", tmp_path / "sifs", "/bin/false")
    # the runtime itself, with a stand-in apptainer: the row's image is refused before anything runs
    exe = tmp_path / "bin" / "apptainer"
    exe.parent.mkdir()
    exe.write_text(STANDIN)
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{exe.parent}:{os.environ['PATH']}")
    if apt.shutil.which("prlimit") is None:
        pytest.skip("prlimit not installed")
    made = set(Path(tempfile.gettempdir()).glob("hetrl-apptainer-*"))
    for image in ("--bind=/:/host", "/srv/images/evil.sif", "docker-archive:///etc/shadow"):
        with pytest.raises(ValueError, match="is not an image reference"):
            open_runtime("apptainer", None, LIMITS, image=image, image_cache="/work/sifs-never-made")
    assert not (exe.parent / "calls").exists()  # apptainer never ran
    assert set(Path(tempfile.gettempdir()).glob("hetrl-apptainer-*")) == made  # no tree left behind
    task = Task("img__x-1", "o/p", "", "x", DIFF, "", ["t.py::t"], [], image="--bind=/:/host")
    with pytest.raises(ValueError, match=r"^img__x-1: image: "):
        runtime_args(task, {"name": "apptainer", "image_cache": "/work/sifs"})


def test_check_image_accepts_the_public_sets_references():
    for ref in ("swebench/sweb.eval.x86_64.astropy__astropy-12907:latest",
                "sweb.eval.x86_64.django__django-11099", "namanjain12/aiohttp_final:" + "f" * 40,
                "swerebench/sweb.eval.x86_64.org_1776_proj-7", "ghcr.io/o/p:1.0",
                "localhost:5000/a/b@sha256:" + "a" * 64, "docker://python:3.11"):
        assert check_image(ref) == ref


# -- the run's secret --------------------------------------------------------------------------------
def test_read_secret_refuses_missing_empty_and_short(tmp_path):
    for content, why in ((None, "missing"), ("", "empty"), ("\n", "empty"), ("abc\n", "short (3 chars")):
        f = tmp_path / "secret"
        f.unlink(missing_ok=True)
        if content is not None:
            f.write_text(content)
            f.chmod(0o600)   # a secret readable by others is refused for that reason first
        with pytest.raises(SecretError) as e:
            read_secret(tmp_path)
        assert why in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "secret").write_text("s" * MIN_CHARS + "\n")
    (tmp_path / "secret").chmod(0o600)
    assert read_secret(tmp_path) == "s" * MIN_CHARS
    # a run without a secret on purpose: a missing file only, and only when it says so
    (tmp_path / "secret").unlink()
    assert secret_or_none(tmp_path, {"HETRL_UNAUTHENTICATED": "1"}) is None
    with pytest.raises(SecretError, match="missing"):
        secret_or_none(tmp_path, {})
    (tmp_path / "secret").write_text("")
    with pytest.raises(SecretError, match="empty"):
        secret_or_none(tmp_path, {"HETRL_UNAUTHENTICATED": "1"})


def test_an_empty_secret_left_by_a_crash_is_replaced(tmp_path):
    from builders import make_run_dir
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "secret").write_text("")  # a crash between create and write
    make_run_dir(run_dir)
    sf = run_dir / "secret"
    assert len(read_secret(run_dir)) >= MIN_CHARS and stat.S_IMODE(sf.stat().st_mode) == 0o600
    kept = sf.read_text()
    assert create_secret(run_dir) is False and sf.read_text() == kept  # a good one is kept
    sf.write_text("short")
    assert create_secret(run_dir) is True and len(read_secret(run_dir)) >= MIN_CHARS
    assert not [p for p in run_dir.iterdir() if p.name.startswith(".secret.tmp")]


def _role(run_dir, *argv, timeout=120):
    return subprocess.run([sys.executable, *argv, "--run-dir", str(run_dir)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_router_and_sandbox_service_do_not_start_on_an_empty_secret(tmp_path):
    from builders import make_run_dir

    from rl.envs.swe.runtime_remote import ServicePool
    run_dir = tmp_path / "run"
    make_run_dir(run_dir, "env=swe", "env.swe.tasks=builtin", "cluster.sandbox_nodes=1",
                 "inference.router=true", "inference.startup_timeout_s=5", "wandb.mode=disabled")
    for content in ("", "short"):
        (run_dir / "secret").write_text(content)
        r = _role(run_dir, "-m", "rl.inference.router")
        assert r.returncode != 0 and "secret" in r.stderr and "servers do not start" in r.stderr, r.stderr
        assert not (run_dir / "inference" / "router.json").exists()
        r = _role(run_dir, "-m", "rl.envs.swe.service", "--index", "0")
        assert r.returncode != 0 and "servers do not start" in r.stderr, r.stderr
        assert not (run_dir / "sandboxes" / "service_0.json").exists()
        with pytest.raises(SecretError, match=r"secret: (empty|short)"):
            ServicePool.from_run_dir(str(run_dir), wait_s=1)


# -- sizes -------------------------------------------------------------------------------------------
def test_oversized_fields_are_refused_at_load(tmp_path):
    n = ROW_LIMITS["problem_statement"] + 1
    msg = _refused(tmp_path, _row(problem_statement="A" * n), "problem_statement")
    assert f"{n} chars, over the limit of {ROW_LIMITS['problem_statement']}" in msg
    big = 100 << 20  # the red team's 100 MB statement: refused before it is parsed or tokenized
    msg = _refused(tmp_path, _row(problem_statement="A" * big), "problem_statement")
    assert f"{big} chars" in msg
    for field, value, limits in (("hints_text", "h" * 11, {"hints_text": 10}),
                                 ("patch", DIFF + "+" * 100 + "\n", {"patch": 100}),
                                 ("FAIL_TO_PASS", [f"tests/t.py::t{i}" for i in range(11)], {"test_ids": 10}),
                                 ("files", {"m.py": "x" * 101}, {"file": 100})):
        field_name = "FAIL_TO_PASS/PASS_TO_PASS" if field == "FAIL_TO_PASS" else field
        msg = _refused(tmp_path, _row(**{field: value}), field_name, limits=limits)
        assert "over the limit of" in msg and "ROW_LIMITS" in msg, msg
    # rows made in memory meet the same limits in SWEEnv (overridable, as env.swe would pass them)
    t = Task("big__x-1", "builtin/x", "", "s" * 11, DIFF, "", ["m.py::t"], [], files={"m.py": "x = 1\n"})
    with pytest.raises(ValueError, match=r"^tasks: row 0 \(big__x-1\): problem_statement: 11 chars, over "
                                         r"the limit of 10"):
        SWEEnv([t], row_limits={"problem_statement": 10})
    assert SWEEnv([t]).tasks == [t]


def test_a_fifo_the_agent_planted_never_hangs_a_host_side_read(tmp_path):
    """Runtime.read_file (the service's /read, grading's reads) opens non-blocking and refuses anything
    but a regular file: a FIFO in the tree used to block the reading thread forever."""
    import errno
    import os
    import threading
    from rl.envs.swe.runtimes import open_runtime
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "ok.txt").write_text("fine")
    sb = open_runtime(tree=tree, name="inprocess")
    try:
        os.mkfifo(sb.tree / "pipe")  # as the agent's code would, inside its tree
        got = {}

        def read():
            try:
                got["r"] = sb.read_file("pipe")
            except OSError as e:
                got["e"] = e
        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(10)
        assert not t.is_alive(), "read_file blocked on a FIFO"
        assert "e" in got and got["e"].errno == errno.EINVAL and "not a regular file" in str(got["e"])
        assert sb.read_file("ok.txt") == "fine"
    finally:
        sb.close()
