"""Agent tools: the call format, path checks (`..`, absolute, symlinks out), patching, visible tests."""
import json
import os

import pytest

from rl.envs.swe.runtimes import InprocessRuntime
from rl.envs.swe.tools import Tools, parse_tool_call


def call(text_name, **args):
    return f"<tool_call>{json.dumps({'name': text_name, 'arguments': args})}</tool_call>"


def test_swe_parse_tool_call():
    assert parse_tool_call("hmm\n" + call("read_file", path="a.py")) == ("read_file", {"path": "a.py"})
    assert parse_tool_call('<tool_call>{"name": "submit"}') == ("submit", {})  # stop token ate the close
    as_string = '<tool_call>{"name": "x", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert parse_tool_call(as_string) == ("x", {"a": 1})
    for bad in ("no call here", "<tool_call>{nope</tool_call>", '<tool_call>["a"]</tool_call>',
                '<tool_call>{"name": "x", "arguments": 3}</tool_call>'):
        out = parse_tool_call(bad)
        assert isinstance(out, str) and out.startswith("error:"), bad


@pytest.fixture
def tools(tmp_path):
    files = {"pkg/__init__.py": "", "pkg/m.py": "def f():\n    return 1\n",
             "tests/test_m.py": "from pkg.m import f\n\n\ndef test_f():\n    assert f() == 2\n"}
    tree = tmp_path / "tree"
    for rel, text in files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)
    rt = InprocessRuntime(tree)
    try:
        yield Tools(rt, output_chars=2000, timeout_s=30)
    finally:
        rt.close()


def test_swe_tools_paths_are_confined(tools, tmp_path):
    outside = tmp_path / "secret.txt"
    outside.write_text("secret")
    os.symlink(tmp_path, tools.sb.tree / "link")
    for path in ("../x", "/etc/passwd", "pkg/../../x", "link/secret.txt", str(outside)):
        for name, args in (("read_file", {"path": path}), ("write_file", {"path": path, "content": "x"}),
                           ("list_files", {"path": path})):
            out = tools.call(name, args)
            assert out.startswith("error:") and "refused" in out, (name, path, out)
    assert outside.read_text() == "secret"
    diff = "--- a/../evil.py\n+++ b/../evil.py\n@@ -0,0 +1 @@\n+x\n"
    assert "refused" in tools.call("apply_patch", {"diff": diff})


def test_swe_tools_read_write_list(tools):
    assert tools.call("list_files", {}).split() == ["pkg/__init__.py", "pkg/m.py", "tests/test_m.py"]
    assert tools.call("read_file", {"path": "pkg/m.py", "start": 2}).strip() == "2      return 1"
    assert "wrote" in tools.call("write_file", {"path": "pkg/new/n.py", "content": "X = 1\n"})
    assert (tools.sb.tree / "pkg/new/n.py").read_text() == "X = 1\n"
    assert tools.call("read_file", {"path": "nope.py"}).startswith("error:")
    assert tools.call("read_file", {"pth": "x"}).startswith("error: bad arguments")
    assert tools.call("frobnicate", {}).startswith("error: unknown tool")


def test_swe_tools_patch_and_tests(tools):
    assert "1 failed" in tools.call("run_tests", {})
    bad = "--- a/pkg/m.py\n+++ b/pkg/m.py\n@@ -1,2 +1,2 @@\n def g():\n-    return 1\n+    return 2\n"
    assert tools.call("apply_patch", {"diff": bad}).startswith("error: the patch does not apply")
    good = bad.replace("def g", "def f")
    assert not tools.call("apply_patch", {"diff": good}).startswith("error")
    assert "1 passed" in tools.call("run_tests", {})
    assert tools.call("submit", {}) == "submitted" and tools.submitted


def test_swe_tools_truncate_output(tools):
    tools.call("write_file", {"path": "big.txt", "content": "y\n" * 5000})
    out = tools.call("read_file", {"path": "big.txt"})
    assert len(out) < 2100 and "chars cut" in out


def test_write_file_never_writes_through_a_hard_link_to_a_host_file(tools, tmp_path):
    host = tmp_path / "host.txt"  # same filesystem as the tree: the agent's code could link it
    host.write_text("host data\n")
    os.link(host, tools.sb.tree / "pkg" / "hl.txt")
    assert tools.call("write_file", {"path": "pkg/hl.txt", "content": "agent\n"}).startswith("wrote")
    assert host.read_text() == "host data\n"
    assert (tools.sb.tree / "pkg" / "hl.txt").read_text() == "agent\n"


def test_swe_run_tests_paths(tools):
    """run_tests on chosen files or ids; a path out of the tree or shaped like an option is refused."""
    (tools.sb.tree / "tests" / "test_n.py").write_text("def test_n():\n    pass\n")
    out = tools.call("run_tests", {"paths": ["tests/test_n.py"]})
    assert "1 passed" in out and "test_m" not in out
    assert "1 failed" in tools.call("run_tests", {"paths": "tests/test_m.py::test_f"})
    for bad in ("../x.py", "/etc/passwd", "-p evil", ""):
        assert tools.call("run_tests", {"paths": [bad]}).startswith("error:"), bad
