"""What the agent (or a row) plants for the host side of the SWE sandbox (issue 36, item 6 and its Low
items): a FIFO, a symlink loop or a tree nested thousands deep in the episode's tree gets a clean tool
error and grades 0 with the reason, never a traceback and never a partial copy; the literal text
`{status_fd}` in a command runs unchanged; a test_patch that is not a diff, or names a path outside the
tree only in a `diff --git` header, is refused when the rows load."""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from rl.envs.swe.datasets import load_dataset
from rl.envs.swe.env import EnvConfig, SWEEnv
from rl.envs.swe.grader import grade
from rl.envs.swe.runtimes import RuntimeUnavailable, open_runtime, runtime_class
from rl.envs.swe.sandbox import Limits
from rl.envs.swe.tasks import Task
from rl.envs.swe.tools import Tools

LIMITS = Limits(cpu_s=20, memory_bytes=1 << 30)
TEST = "from m import x\n\n\ndef test_x():\n    assert x == 2\n"
TEST_PATCH = ("diff --git a/tests/test_m.py b/tests/test_m.py\nnew file mode 100644\n--- /dev/null\n"
              "+++ b/tests/test_m.py\n@@ -0,0 +1,5 @@\n" + "".join("+" + ln + "\n" for ln in TEST.splitlines()))
DIFF = "diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"


def _why_not(name: str) -> str:
    try:
        runtime_class(name).check()
        return ""
    except RuntimeUnavailable as e:
        return str(e)


RUNTIMES = [pytest.param(n, marks=pytest.mark.skipif(bool(_why_not(n)), reason=_why_not(n) or "-"))
            for n in ("inprocess", "bubblewrap")]


def _task(**changes) -> Task:
    t = Task("hostile__tree-1", "builtin/hostile", "", "x should be 2", DIFF, TEST_PATCH,
             ["tests/test_m.py::test_x"], [], files={"m.py": "x = 1\n"})
    return Task(**{**t.__dict__, **changes})


@pytest.fixture
def private_tmp(monkeypatch):
    """Sandboxes made from here on go under their own temp dir, so leftovers can be counted (0711,
    as /tmp is to them: a sandbox's own uid must be able to reach its tree)."""
    d = Path(tempfile.mkdtemp(prefix="hetrl-test-hostile-"))
    d.chmod(0o711)
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    yield d
    subprocess.run(["rm", "-rf", "--", str(d)])  # whatever depth a failing test left there


# -- {status_fd} -------------------------------------------------------------------------------------
@pytest.mark.parametrize("runtime", RUNTIMES[1:])  # bubblewrap: the runtime that has the placeholder
def test_status_fd_text_in_the_command_runs_unchanged(runtime):
    with open_runtime(runtime, None, LIMITS) as rt:
        r = rt.run(["echo", "{status_fd}", "a{status_fd}b"], timeout_s=10)
    assert r.returncode == 0 and r.stdout == "{status_fd} a{status_fd}b\n", r


# -- a FIFO, a link loop, a deep tree ----------------------------------------------------------------
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_fifo_gets_a_tool_error_and_grades_zero_without_copies(runtime, tmp_path, private_tmp):
    task = _task()
    cfg = {"name": runtime}
    with SWEEnv([task], EnvConfig(runtime=cfg, limits=LIMITS)).start(task) as ep:
        tree = ep.sandbox.tree
        assert ep.sandbox.run(["mkfifo", "pipe"], timeout_s=10).returncode == 0
        tools = ep.tools
        assert tools.call("read_file", {"path": "pipe"}).startswith("error:")
        assert "pipe" in tools.call("list_files", {})
        assert tools.call("write_file", {"path": "pipe", "content": "x"}).startswith("wrote")
        assert ep.sandbox.read_file("pipe") == "x"  # replaced, not written through
        assert ep.sandbox.run(["sh", "-c", "rm pipe && mkfifo pipe"], timeout_s=10).returncode == 0
        with pytest.raises(OSError, match=r"^pipe: a FIFO, not a regular file"):
            ep.sandbox.copy_out(tmp_path / "out")
        assert not (tmp_path / "out").exists()
        before = set(os.listdir(private_tmp))
        g = grade(task, tree, limits=LIMITS, runtime=cfg)
        assert g.reward == 0 and g.failed == task.graded and "a FIFO" in g.output, g
        assert "\n" not in g.output
        assert set(os.listdir(private_tmp)) == before  # no grading copy left behind
        assert ep.reward() == 0


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_symlink_loop_gets_tool_errors_and_grades(runtime, private_tmp):
    task = _task()
    cfg = {"name": runtime}
    with SWEEnv([task], EnvConfig(runtime=cfg, limits=LIMITS)).start(task) as ep:
        r = ep.sandbox.run(["sh", "-c", "ln -s loop loop && ln -s b a && ln -s a b"], timeout_s=10)
        assert r.returncode == 0, r
        for name, args in (("read_file", {"path": "loop"}), ("read_file", {"path": "a/x.py"}),
                           ("write_file", {"path": "b/x.py", "content": "x"}),
                           ("apply_patch", {"diff": "--- a/loop\n+++ b/loop\n@@ -0,0 +1 @@\n+x\n"})):
            obs = ep.tools.call(name, args)
            assert obs.startswith("error:") and "loop" in obs, (name, obs)
        assert "loop" in ep.tools.call("list_files", {})
        assert ep.tools.call("apply_patch", {"diff": DIFF}).startswith("patching file")
        g = grade(task, ep.sandbox.tree, limits=LIMITS, runtime=cfg)
        assert g.reward == 1.0, g.output  # the links are copied as links and do not stop grading
        assert not os.listdir(private_tmp)[1:]  # only the episode's own sandbox


def test_a_tree_nested_past_the_depth_limit_is_listed_with_an_error_and_grades_zero(private_tmp):
    task = _task()
    with SWEEnv([task], EnvConfig(limits=LIMITS)).start(task) as ep:
        r = ep.sandbox.run(["python3", "-c", "import os\nfor i in range(1200):\n    os.mkdir('d')\n"
                                             "    os.chdir('d')\nopen('f', 'w').close()"], timeout_s=20)
        assert r.returncode == 0, r
        obs = ep.tools.call("list_files", {})
        assert obs.startswith("error:") and "deeper than" in obs, obs[:300]
        assert ep.tools.call("read_file", {"path": "m.py"}).endswith("x = 1")
        assert ep.sandbox.run(["true"], timeout_s=10).returncode == 0  # handing the tree over walks it
        g = grade(task, ep.sandbox.tree, limits=LIMITS)
        assert g.reward == 0 and "deeper than" in g.output, g
        root = ep.sandbox.tree.parent
    assert not root.exists()  # closed, however deep


# -- test_patch ----------------------------------------------------------------------------------------
GARBAGE = [
    ("--- a/tests/test_m.py\n+++ b/tests/test_m.py\nthis is not a hunk\n", "has no hunk"),
    ("--- a/tests/test_m.py\n+++ b/tests/test_m.py\n@@ -1,3 +1,3 @@\n-a\n+b\n", "does not match"),
    ("rm -rf / # no diff at all\n", "not a unified diff"),
    ("diff --git a/../../evil b/../../evil\nnew file mode 100644\nGIT binary patch\nliteral 1\nIcmV?d00001\n\n",
     "'..' component"),
]


@pytest.mark.parametrize("diff,why", GARBAGE, ids=["no-hunk", "bad-count", "no-diff", "binary-outside"])
def test_a_garbage_test_patch_is_refused_at_load(diff, why, tmp_path):
    row = {"instance_id": "hostile__tp-1", "repo": "builtin/hostile", "base_commit": "",
           "problem_statement": "x should be 2", "patch": DIFF, "test_patch": diff,
           "FAIL_TO_PASS": ["tests/test_m.py::test_x"], "PASS_TO_PASS": [], "files": {"m.py": "x = 1\n"}}
    f = tmp_path / "rows.jsonl"
    f.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError) as e:
        load_dataset(str(f))
    msg = str(e.value)
    assert "\n" not in msg and "hostile__tp-1" in msg and "test_patch: " in msg and why in msg, msg
    with pytest.raises(ValueError, match=r"\(hostile__tp-1\): test_patch: .*" + why.replace("'", ".")):
        SWEEnv([_task(instance_id="hostile__tp-1", test_patch=diff)])  # a row made in memory too
