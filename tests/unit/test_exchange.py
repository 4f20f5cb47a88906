"""The run-directory protocol: atomic publish, verification, corruption, retention, consumption."""
import json
import os
from pathlib import Path

import pytest

from rl import exchange
from rl.exchange import CorruptStep


def _write(files):
    def w(d):
        for name, data in files.items():
            p = d / name
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
    return w


def test_publish_writes_manifest_and_renames(tmp_path):
    pub = exchange.publish(tmp_path, "rollouts", 3, _write({"a.bin": b"x" * 10, "sub/b.json": b"{}"}),
                           producer="test", policy_version=2)
    assert pub.path == tmp_path / "rollouts" / "step_000003"
    m = exchange.verify(pub.path)
    assert m["policy_version"] == 2 and m["producer"] == "test"
    assert set(m["files"]) == {"a.bin", "sub/b.json"}
    assert m["files"]["a.bin"]["size"] == 10
    assert not [p for p in (tmp_path / "rollouts").iterdir() if ".tmp-" in p.name]


def test_failed_writer_leaves_nothing(tmp_path):
    def bad(d):
        (d / "half.bin").write_bytes(b"1234")
        raise RuntimeError("producer crashed")
    with pytest.raises(RuntimeError):
        exchange.publish(tmp_path, "weights", 1, bad, producer="t")
    assert list((tmp_path / "weights").iterdir()) == []
    assert exchange.list_steps(tmp_path, "weights") == []


def test_tmp_dirs_are_invisible_to_readers(tmp_path):
    (tmp_path / "weights" / "step_000005.tmp-abc").mkdir(parents=True)
    exchange.publish(tmp_path, "weights", 4, _write({"w": b"1"}), producer="t")
    assert exchange.list_steps(tmp_path, "weights") == [4]
    assert exchange.latest_complete(tmp_path, "weights") == 4
    assert exchange.clean_tmp(tmp_path, ["weights"]) == 1


def test_truncated_file_is_detected(tmp_path):
    pub = exchange.publish(tmp_path, "rollouts", 0, _write({"batch": b"a" * 100}), producer="t")
    with open(pub.path / "batch", "r+b") as f:
        f.truncate(50)
    with pytest.raises(CorruptStep, match="truncated"):
        exchange.verify(pub.path)


def test_flipped_byte_is_detected_by_checksum(tmp_path):
    pub = exchange.publish(tmp_path, "rollouts", 0, _write({"batch": b"a" * 100}), producer="t")
    data = bytearray((pub.path / "batch").read_bytes())
    data[10] ^= 0xFF
    (pub.path / "batch").write_bytes(bytes(data))
    exchange.verify(pub.path, checksums=False)  # sizes alone cannot see it
    with pytest.raises(CorruptStep, match="sha256"):
        exchange.verify(pub.path)


def test_latest_complete_skips_corrupt(tmp_path):
    for s in range(3):
        exchange.publish(tmp_path, "checkpoints", s, _write({"f": b"abc"}), producer="t")
    (tmp_path / "checkpoints" / "step_000002" / "manifest.json").write_text("{not json")
    assert exchange.latest_complete(tmp_path, "checkpoints") == 1


def test_existing_step_is_not_overwritten_unless_asked(tmp_path):
    exchange.publish(tmp_path, "rollouts", 1, _write({"f": b"old"}), producer="t")
    exchange.publish(tmp_path, "rollouts", 1, _write({"f": b"new"}), producer="t")
    assert (tmp_path / "rollouts" / "step_000001" / "f").read_bytes() == b"old"
    exchange.publish(tmp_path, "rollouts", 1, _write({"f": b"new"}), producer="t", overwrite=True)
    assert (tmp_path / "rollouts" / "step_000001" / "f").read_bytes() == b"new"
    exchange.verify(tmp_path / "rollouts" / "step_000001")


def test_a_step_published_between_the_check_and_the_rename_is_kept(tmp_path, monkeypatch):
    """Two producers race for step_N (a zombie of an earlier incarnation and its successor): the other
    one renames its step into place just after this one checked that there was none. This one's rename
    must not replace it: its tmp is dropped and the other's step is returned, nothing half-written."""
    real_rename, raced = os.rename, []

    def rename(src, dst):
        if not raced and Path(dst).name == "step_000001":
            raced.append(1)
            exchange.publish(tmp_path, "rollouts", 1, _write({"f": b"first"}), producer="other")
        return real_rename(src, dst)
    monkeypatch.setattr(exchange.os, "rename", rename)
    got = exchange.publish(tmp_path, "rollouts", 1, _write({"f": b"second"}), producer="t")
    assert raced and (tmp_path / "rollouts" / "step_000001" / "f").read_bytes() == b"first"
    assert got.manifest["producer"] == "other"
    assert not list((tmp_path / "rollouts").glob("*.tmp-*"))
    exchange.verify(tmp_path / "rollouts" / "step_000001")


def test_prune_keeps_newest_and_protected(tmp_path):
    for s in range(6):
        exchange.publish(tmp_path, "weights", s, _write({"f": b"1"}), producer="t")
    gone = exchange.prune(tmp_path, "weights", keep_last=2, protect=[1])
    assert gone == [0, 2, 3]
    assert exchange.list_steps(tmp_path, "weights") == [1, 4, 5]


def test_discard_after(tmp_path):
    for s in range(5):
        exchange.publish(tmp_path, "rollouts", s, _write({"f": b"1"}), producer="t")
    assert exchange.discard_after(tmp_path, "rollouts", 2) == [3, 4]
    assert exchange.list_steps(tmp_path, "rollouts") == [0, 1, 2]


def test_consumed_log_survives_torn_line(tmp_path):
    log = exchange.ConsumedLog(tmp_path, "rollouts", "trainer")
    log.record(0)
    log.record(1, tokens=5)
    with open(log.path, "a") as f:
        f.write('{"step": 2, "consu')  # killed mid-write
    assert log.steps() == [0, 1]
    assert exchange.ConsumedLog(tmp_path, "rollouts", "other").steps() == []


def test_wait_for_times_out_and_stops(tmp_path):
    assert exchange.wait_for(tmp_path, "rollouts", 0, timeout=0.3, poll=0.05) is None
    assert exchange.wait_for(tmp_path, "rollouts", 0, should_stop=lambda: True) is None
    exchange.publish(tmp_path, "rollouts", 0, _write({"f": b"1"}), producer="t")
    assert exchange.wait_for(tmp_path, "rollouts", 0, timeout=1) == tmp_path / "rollouts" / "step_000000"


def test_atomic_write_json(tmp_path):
    exchange.atomic_write_json(tmp_path / "a" / "s.json", {"x": 1})
    assert json.loads((tmp_path / "a" / "s.json").read_text()) == {"x": 1}
    assert os.listdir(tmp_path / "a") == ["s.json"]


def _incarnation(run_dir, restart, t):
    (run_dir / "resume.json").write_text(json.dumps({"restart": restart, "time": t}))


def test_a_stale_incarnation_cannot_publish_and_its_late_steps_are_ignored(tmp_path, monkeypatch):
    """Fencing: a process of incarnation 0 (a preempted job's trainer still flushing) after incarnation
    1 started is refused before its rename, with an error naming both; readers ignore a step an older
    incarnation managed to rename after the newer one started, and keep the ones from before it."""
    import time as _time
    _incarnation(tmp_path, 0, _time.time() - 10)
    monkeypatch.setattr(exchange, "_FENCES", {})  # this test's fences only
    exchange.fence(tmp_path, 0)
    kept = exchange.publish(tmp_path, "weights", 1, _write({"f": b"0"}), producer="trainer")
    assert kept.manifest["epoch"] == 0
    _incarnation(tmp_path, 1, _time.time())   # rl.prepare of the successor
    with pytest.raises(exchange.Fenced, match=r"^weights/step_000002: refused: this process belongs to "
                                              r"incarnation 0 of .*, and incarnation 1 has started"):
        exchange.publish(tmp_path, "weights", 2, _write({"f": b"zombie"}), producer="trainer")
    assert exchange.list_steps(tmp_path, "weights") == [1] and not list((tmp_path / "weights").glob("*.tmp-*"))
    # the successor publishes as incarnation 1
    exchange.fence(tmp_path, 1)
    exchange.publish(tmp_path, "weights", 2, _write({"f": b"1"}), producer="trainer")
    # a zombie whose rename won the race: its step names epoch 0 and a time after the successor's start
    exchange.fence(tmp_path, 0)
    monkeypatch.setattr(exchange, "_check_fence", lambda *a: 0)
    exchange.publish(tmp_path, "weights", 3, _write({"f": b"zombie"}), producer="trainer")
    with pytest.raises(exchange.CorruptStep, match="published by incarnation 0 after incarnation 1 started"):
        exchange.verify(tmp_path / "weights" / "step_000003")
    assert exchange.latest_complete(tmp_path, "weights") == 2   # the zombie's step is skipped
    exchange.verify(tmp_path / "weights" / "step_000001")       # incarnation 0's step from before is kept
