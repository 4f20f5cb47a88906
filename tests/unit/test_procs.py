"""rl.contract.procs: the one home of "is that process there, and which one is it".

On real processes: a live child is alive and has a start time in ticks that a rename (a command name with
spaces and parentheses) does not change, its start time falls between the moments around its start, and
once it exits it is gone, zombie included; values that cannot name a process are not alive. Then, on the
syntax tree, that no other module of rl or launch asks the kernel or /proc itself.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rl.contract import procs

REPO = Path(__file__).resolve().parents[2]

# modules that still ask the kernel themselves, each with its reason (another change edits them now)
NOT_YET = {"launch/status.py": "`launch status`'s alive(host, pid) (edited by another change now)"}

# renames itself to a command name that splits naively, then says so and waits for stdin to close
_RENAME = ("import ctypes, sys\n"
           "ctypes.CDLL(None).prctl(15, b'a) b (c', 0, 0, 0)\n"
           "print('renamed', flush=True)\n"
           "sys.stdin.read()\n")


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_a_live_child_then_a_zombie_then_nothing(tmp_path):
    t0 = time.time()
    p = _child(_RENAME)
    try:
        assert procs.alive(p.pid)
        assert p.stdout.readline().strip() == "renamed"
        assert Path(f"/proc/{p.pid}/comm").read_text().strip() == "a) b (c"   # the rename took
        ticks = procs.start_ticks(p.pid)
        assert isinstance(ticks, int) and ticks > 0
        assert ticks >= procs.start_ticks(os.getpid())   # started after this test process
        started = procs.start_time(p.pid)
        # /proc/stat's boot time is whole seconds and the start whole ticks: a second either way
        assert t0 - 1.5 <= started <= time.time() + 1.5, (t0, started)
        p.stdin.close()   # it exits; unreaped it is a zombie, which is no longer that process
        deadline = time.monotonic() + 60
        while procs.start_ticks(p.pid) is not None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert procs.start_ticks(p.pid) is None and procs.start_time(p.pid) is None
    finally:
        p.kill()
        p.wait()
    assert not procs.alive(p.pid) or procs.start_ticks(p.pid) != ticks   # reaped (or the pid reused)


def test_this_process_and_values_that_name_none():
    assert procs.alive(os.getpid())
    assert procs.alive(1)   # init: another user's process (EPERM) or ours, alive either way
    for bad in (0, -1, -os.getpid(), True, False, 2 ** 40, "1", None, 1.0):
        assert not procs.alive(bad), bad
        assert not procs.is_pid(bad), bad
    assert procs.is_pid(os.getpid())
    assert procs.start_ticks(2 ** 40) is None and procs.start_ticks(-1) is None


def _asks_the_kernel(tree: ast.AST) -> list[int]:
    """Lines that signal 0 (os.kill(pid, 0)) or name a process's /proc stat file."""
    lines = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "kill"
                and len(node.args) == 2 and isinstance(node.args[1], ast.Constant)
                and node.args[1].value == 0):
            lines.add(node.lineno)
        # a literal path or an f-string's literal tail (ast.walk visits an f-string's parts)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.endswith("/stat"):
            lines.add(node.lineno)
    return sorted(lines)


def test_no_other_module_asks_the_kernel_itself():
    bad = []
    for p in sorted([*(REPO / "launch").glob("*.py"), *(REPO / "rl").rglob("*.py")]):
        rel = str(p.relative_to(REPO))
        if rel in NOT_YET or rel == "rl/contract/procs.py":
            continue
        bad += [f"{rel}:{n} checks a process itself (use rl.contract.procs)"
                for n in _asks_the_kernel(ast.parse(p.read_text(), rel))]
    assert not bad, "\n".join(bad)


def test_the_scan_sees_both_forms():
    code = ("import os\n"
            "def a(pid):\n    os.kill(pid, 0)\n"
            "def b(pid):\n    return open(f'/proc/{pid}/stat').read()\n")
    assert _asks_the_kernel(ast.parse(code)) == [3, 5]
    assert _asks_the_kernel(ast.parse((REPO / "rl/contract/procs.py").read_text()))   # the home itself
