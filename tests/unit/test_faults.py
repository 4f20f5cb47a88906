"""Named crash points (rl.faults): armed by HETRL_FAULT, fire once at the nth pass, in the named role only."""
from __future__ import annotations

import errno
import subprocess
import sys

import pytest

from rl import exchange, faults


def test_a_point_fires_at_its_nth_pass_as_enospc_and_only_in_its_role(monkeypatch, tmp_path):
    monkeypatch.setenv(faults.ENV, "commit.before_rename@trainer:2:enospc")
    faults.reset()
    faults.set_role("orchestrator")
    for s in range(3):  # another role: never fires
        exchange.publish(tmp_path, "rollouts", s, lambda d: (d / "x").write_text("x"), producer="o")
    faults.set_role("trainer")
    faults.reset()
    exchange.publish(tmp_path, "weights", 0, lambda d: (d / "x").write_text("x"), producer="t")
    with pytest.raises(OSError) as e:
        exchange.publish(tmp_path, "weights", 1, lambda d: (d / "x").write_text("x"), producer="t")
    assert e.value.errno == errno.ENOSPC
    assert exchange.list_steps(tmp_path, "weights") == [0]
    assert not [p for p in (tmp_path / "weights").iterdir() if ".tmp-" in p.name]  # the tmp was removed
    exchange.publish(tmp_path, "weights", 2, lambda d: (d / "x").write_text("x"), producer="t")  # fired once
    monkeypatch.delenv(faults.ENV)
    faults.reset()
    faults.set_role(None)


def test_an_exit_point_dies_there_leaving_a_torn_record(tmp_path):
    code = ("import sys; from rl.exchange import append_jsonl\n"
            "append_jsonl(sys.argv[1], {'a': 1}); append_jsonl(sys.argv[1], {'b': 2})")
    log = tmp_path / "log.jsonl"
    r = subprocess.run([sys.executable, "-c", code, str(log)], env={"HETRL_FAULT": "jsonl.torn:2", "PATH": "/usr/bin"},
                       capture_output=True, text=True)
    assert r.returncode == faults.EXIT_FAULT and "jsonl.torn reached" in r.stderr
    assert log.read_text().startswith('{"a": 1}\n{"b"') and not log.read_text().endswith("\n")
    exchange.append_jsonl(log, {"c": 3})
    assert exchange.read_jsonl(log) == [{"a": 1}, {"c": 3}]


def test_a_misspelt_point_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv(faults.ENV, "commit.before_renam:1")
    faults.reset()
    with pytest.raises(ValueError, match="HETRL_FAULT='commit.before_renam:1': expected"):
        faults.crash_point("commit.before_rename")
    monkeypatch.delenv(faults.ENV)
    faults.reset()


def test_a_logged_point_counts_passes_across_processes_and_records_the_one_that_fired(tmp_path):
    """HETRL_FAULT_LOG: the nth pass of the whole run fires, not of each process (a Slurm job's requeued
    incarnation inherits the armed environment and must not fire again), and the log is the proof."""
    code = "import sys; from rl.exchange import append_jsonl; append_jsonl(sys.argv[1], {'a': 1})"
    log, flog = tmp_path / "log.jsonl", tmp_path / "faults.jsonl"
    env = {"HETRL_FAULT": "jsonl.torn:2", faults.LOG_ENV: str(flog), "PATH": "/usr/bin"}
    first = subprocess.run([sys.executable, "-c", code, str(log)], env=env, capture_output=True, text=True)
    second = subprocess.run([sys.executable, "-c", code, str(log)], env=env, capture_output=True, text=True)
    third = subprocess.run([sys.executable, "-c", code, str(log)], env=env, capture_output=True, text=True)
    assert (first.returncode, second.returncode, third.returncode) == (0, faults.EXIT_FAULT, 0)
    passes = faults.read_log(flog)
    assert [p["pass"] for p in passes] == [1, 2, 3]
    assert [p["fired"] for p in passes] == [None, "exit", None]
    assert passes[1]["pid"] != passes[0]["pid"] and passes[1]["point"] == "jsonl.torn"


def test_a_stall_point_sleeps_there_then_goes_on(monkeypatch, tmp_path):
    monkeypatch.setenv(faults.ENV, "prune.mid:1:stall")
    monkeypatch.setenv(faults.STALL_ENV, "0.2")
    monkeypatch.setenv(faults.LOG_ENV, str(tmp_path / "f.jsonl"))
    faults.reset()
    import time
    t0 = time.monotonic()
    faults.crash_point("prune.mid")  # returns after the stall
    assert time.monotonic() - t0 >= 0.2
    assert faults.read_log(tmp_path / "f.jsonl")[0]["fired"] == "stall"
    for k in (faults.ENV, faults.STALL_ENV, faults.LOG_ENV):
        monkeypatch.delenv(k)
    faults.reset()
