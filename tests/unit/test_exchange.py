"""The run-directory protocol: atomic publish, verification, corruption, retention, consumption."""
import json
import os
import re
from pathlib import Path

import pytest

from rl import exchange
from rl.exchange import fencing, retention, steps
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

    def rename(src, dst, **kw):
        if not raced and Path(dst).name == "step_000001":
            raced.append(1)
            exchange.publish(tmp_path, "rollouts", 1, _write({"f": b"first"}), producer="other")
        return real_rename(src, dst, **kw)
    monkeypatch.setattr(steps.os, "rename", rename)
    got = exchange.publish(tmp_path, "rollouts", 1, _write({"f": b"second"}), producer="t")
    assert raced and (tmp_path / "rollouts" / "step_000001" / "f").read_bytes() == b"first"
    assert got.manifest["producer"] == "other"
    assert not list((tmp_path / "rollouts").glob("*.tmp-*"))
    exchange.verify(tmp_path / "rollouts" / "step_000001")


def test_prune_keeps_newest_and_protected(tmp_path):
    for s in range(6):
        exchange.publish(tmp_path, "weights", s, _write({"f": b"1"}), producer="t")
    gone = retention.prune(tmp_path, "weights", keep_last=2, protect=[1])
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
    from rl.contract.atomic import atomic_write_json
    atomic_write_json(tmp_path / "a" / "s.json", {"x": 1})
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
    monkeypatch.setattr(fencing, "_FENCES", {})  # this test's fences only
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
    monkeypatch.setattr(steps, "_check_fence", lambda *a: 0)
    exchange.publish(tmp_path, "weights", 3, _write({"f": b"zombie"}), producer="trainer")
    with pytest.raises(exchange.CorruptStep, match="published by incarnation 0 after incarnation 1 started"):
        exchange.verify(tmp_path / "weights" / "step_000003")
    assert exchange.latest_complete(tmp_path, "weights") == 2   # the zombie's step is skipped
    exchange.verify(tmp_path / "weights" / "step_000001")       # incarnation 0's step from before is kept



def _manifest(step_path):
    return json.loads((step_path / "manifest.json").read_text())


def _rewrite_manifest(step_path, m):
    (step_path / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("entry", ["../x", "/etc/passwd", "a/../../x", "./f", "sub//f", "manifest.json"])
def test_a_manifest_entry_outside_the_step_is_refused(tmp_path, entry):
    pub = exchange.publish(tmp_path, "rollouts", 0, _write({"f": b"abc"}), producer="t")
    (tmp_path / "rollouts" / "x").write_bytes(b"abc")  # what `../x` would name: it exists and matches
    m = _manifest(pub.path)
    m["files"][entry] = dict(m["files"]["f"])
    _rewrite_manifest(pub.path, m)
    with pytest.raises(CorruptStep, match=f"files entry '{re.escape(entry)}' is not a path inside the step"):
        exchange.verify(pub.path)
    assert exchange.latest_complete(tmp_path, "rollouts") is None


def test_a_symlink_leaving_the_step_is_refused(tmp_path):
    secret = tmp_path / "outside.bin"
    secret.write_bytes(b"abc")
    pub = exchange.publish(tmp_path, "rollouts", 0, _write({"f": b"abc"}), producer="t")
    (pub.path / "f").unlink()
    (pub.path / "f").symlink_to(secret)  # same size, same sha256: only the confinement check sees it
    with pytest.raises(CorruptStep, match=r"files entry 'f' leaves the step \(resolves to .*outside.bin\)"):
        exchange.verify(pub.path)
    (pub.path / "f").unlink()
    (pub.path / "f").symlink_to("g")  # a link that stays inside is refused too: producers write no links
    (pub.path / "g").write_bytes(b"abc")
    with pytest.raises(CorruptStep, match=r"files entry 'f' is a symlink, not a file of the step"):
        exchange.verify(pub.path)


@pytest.mark.parametrize("files, says", [
    (None, "`files` must map file names"), ([["f", 3]], "`files` must map file names"),
    ({"f": 3}, "files entry 'f' has no size"), ({"f": {"size": "3"}}, "files entry 'f' has no size"),
    ({"f": {"size": -1}}, "files entry 'f' has no size"),
    ({"f": {"size": 3, "sha256": 7}}, "files entry 'f' has a malformed sha256"),
])
def test_a_malformed_manifest_is_corrupt_not_a_crash(tmp_path, files, says):
    pub = exchange.publish(tmp_path, "rollouts", 0, _write({"f": b"abc"}), producer="t")
    m = _manifest(pub.path)
    if files is None:
        del m["files"]
    else:
        m["files"] = files
    _rewrite_manifest(pub.path, m)
    with pytest.raises(CorruptStep, match=re.escape(says)):
        exchange.verify(pub.path)
    (pub.path / "manifest.json").write_text("[1, 2]")
    with pytest.raises(CorruptStep, match="not a JSON object"):
        exchange.read_manifest(pub.path)


def test_the_trainer_sets_a_batch_with_a_malformed_manifest_aside(tmp_path):
    """rl.trainer.loop.next_batch: a batch whose manifest has no file list is moved to rollouts/corrupt/
    (not trained on, no crash) and the trainer waits for it again; a good republished one is taken."""
    from rl.contract.batch import RolloutBatch, Sample
    from rl.runtime import StopFlag
    from rl.trainer.loop import next_batch
    batch = RolloutBatch.from_samples([Sample([1, 2], [3, 4], [-1.0, -1.0], [0, 0], 1.0, 0)])
    pub = exchange.publish(tmp_path, "rollouts", 0, batch.save, producer="orchestrator")
    m = _manifest(pub.path)
    del m["files"]
    _rewrite_manifest(pub.path, m)
    polls = []

    def stop():  # the orchestrator republishes the missing step on the trainer's next poll
        polls.append(1)
        if len(polls) == 1:
            exchange.publish(tmp_path, "rollouts", 0, batch.save, producer="orchestrator")
        return len(polls) > 50
    flag = StopFlag(install=False)
    flag.is_set = stop
    got = next_batch(tmp_path, 0, flag, poll=0.01)
    assert got is not None and got[1]["producer"] == "orchestrator" and "files" in got[1]
    (aside,) = (tmp_path / "rollouts" / "corrupt").iterdir()
    assert aside.name.startswith("step_000000-") and "files" not in _manifest(aside)


def _crash_after_first_rename(monkeypatch):
    real_rename, calls = os.rename, []

    def rename(src, dst, **kw):
        calls.append((Path(src).name, Path(dst).name))
        if len(calls) == 2:
            raise OSError("killed between the two renames")
        return real_rename(src, dst, **kw)
    monkeypatch.setattr(steps.os, "rename", rename)
    return calls


def test_an_overwrite_killed_between_its_renames_is_recovered(tmp_path, monkeypatch):
    exchange.publish(tmp_path, "checkpoints", 5, _write({"f": b"old"}), producer="t")
    calls = _crash_after_first_rename(monkeypatch)
    with pytest.raises(OSError, match="killed between"):
        exchange.publish(tmp_path, "checkpoints", 5, _write({"f": b"new"}), producer="t", overwrite=True)
    monkeypatch.undo()
    assert calls[0][0] == "step_000005" and ".aside-" in calls[0][1]
    assert exchange.list_steps(tmp_path, "checkpoints") == []  # the step is gone from its name...
    exchange.clean_tmp(tmp_path, ["checkpoints"])              # ...and cleaning tmp leftovers keeps it
    assert exchange.restore_asides(tmp_path, ["checkpoints"]) == ["restored checkpoints/step_000005"]
    assert (tmp_path / "checkpoints" / "step_000005" / "f").read_bytes() == b"old"
    exchange.verify(tmp_path / "checkpoints" / "step_000005")
    # killed after both renames, before removing the aside: the new step stands, the aside goes
    aside = tmp_path / "checkpoints" / "step_000005.aside-0123abcd"
    aside.mkdir()
    assert exchange.restore_asides(tmp_path, ["checkpoints"]) == ["removed checkpoints/step_000005.aside-0123abcd"]
    assert not aside.exists() and exchange.list_steps(tmp_path, "checkpoints") == [5]


def _flip(path):
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))


def test_prune_counts_only_verified_steps(tmp_path):
    """keep_checkpoints=1 with a bit-flipped newest checkpoint: the good one before it is what is kept
    (today's code kept the corrupt one and deleted the good one); the corrupt one is left for prepare."""
    for s in (5, 10, 15):
        exchange.publish(tmp_path, "checkpoints", s, _write({"f": b"state" * 10}), producer="t")
    _flip(tmp_path / "checkpoints" / "step_000015" / "f")
    assert retention.prune(tmp_path, "checkpoints", keep_last=1, checksums=True) == [5]
    assert exchange.list_steps(tmp_path, "checkpoints") == [10, 15]
    # nothing verifies: nothing is deleted
    _flip(tmp_path / "checkpoints" / "step_000010" / "f")
    assert retention.prune(tmp_path, "checkpoints", keep_last=1, checksums=True) == []
    # sizes only (weights): a truncated newest step does not count either
    for s in range(4):
        exchange.publish(tmp_path, "weights", s, _write({"f": b"w" * 8}), producer="t")
    with open(tmp_path / "weights" / "step_000003" / "f", "r+b") as f:
        f.truncate(4)
    assert retention.prune(tmp_path, "weights", keep_last=2) == [0]
    assert exchange.list_steps(tmp_path, "weights") == [1, 2, 3]


def test_weights_in_use_follow_the_off_policy_bound_and_the_servers(tmp_path):
    for s in range(8):
        exchange.publish(tmp_path, "weights", s, _write({"f": b"w"}), producer="t")
    assert retention.weights_in_use(tmp_path, max_off_policy=2) == {5, 6, 7}
    inference = tmp_path / "inference"
    inference.mkdir()
    (inference / "server_0.json").write_text(json.dumps({"version": 1, "index": 0}))
    (inference / "server_1.json").write_text(json.dumps({"version": 2, "index": 1}))
    assert retention.weights_in_use(tmp_path, max_off_policy=0) == {1, 2, 7}
    # server 1 has since reloaded version 3 (its worker's report); a refused load does not count
    (inference / "reloads" / "server_1").mkdir(parents=True)
    (inference / "reloads" / "server_1" / "dp0000-rank0000.json").write_text(json.dumps(
        {"version": 3, "loaded": True}))
    (inference / "reloads" / "server_1" / "dp0000-rank0001.json").write_text(json.dumps(
        {"version": 2, "loaded": False, "error": "refused"}))
    assert retention.served_versions(tmp_path) == {1, 3}
    gone = retention.prune(tmp_path, "weights", keep_last=1,
                          protect=retention.weights_in_use(tmp_path, max_off_policy=1))
    assert gone == [0, 2, 4, 5] and exchange.list_steps(tmp_path, "weights") == [1, 3, 6, 7]


def test_jsonl_append_ends_a_torn_line(tmp_path):
    path = tmp_path / "log.jsonl"
    exchange.append_jsonl(path, {"a": 1})
    with open(path, "a") as f:
        f.write('{"a": 2, "b"')  # a writer killed mid-line
    exchange.append_jsonl(path, {"a": 3})  # today's GroupLog-less appenders glued this onto the fragment
    assert exchange.read_jsonl(path) == [{"a": 1}, {"a": 3}]
    assert path.read_text().endswith('{"a": 3}\n')
    assert exchange.read_jsonl(tmp_path / "missing.jsonl") == []


def test_consumed_log_records_after_a_torn_line(tmp_path):
    log = exchange.ConsumedLog(tmp_path, "rollouts", "trainer")
    log.record(0)
    with open(log.path, "a") as f:
        f.write('{"step": 1, "consu')  # killed mid-write
    log.record(1)  # the resumed trainer's record must not be lost to the fragment
    assert log.steps() == [0, 1]


def test_a_stale_incarnation_cannot_record_or_log_either(tmp_path, monkeypatch):
    """A stopped process continued after its successor started (a zombie) must not add log records or
    metrics lines: the successor's lineage owns them (seen in a fault trial: a zombie trainer appended
    four metrics lines)."""
    import time as _time
    from rl.metrics import MetricsLogger
    from builders import make_run_dir
    make_run_dir(tmp_path / "run")
    run = tmp_path / "run"
    _incarnation(run, 0, _time.time() - 10)
    monkeypatch.setattr(fencing, "_FENCES", {})
    exchange.fence(run, 0)
    log = exchange.ConsumedLog(run, "rollouts", "trainer")
    log.record(0)
    _incarnation(run, 1, _time.time())
    with pytest.raises(exchange.Fenced, match="consumed.jsonl: step 1: refused"):
        log.record(1)
    from rl.contract.config import load
    from omegaconf import OmegaConf
    # the fence is on metrics.jsonl; a wandb run started here would outlive the test (its teardown at exit)
    cfg = OmegaConf.merge(load(run), {"wandb": {"mode": "disabled"}})
    with pytest.raises(exchange.Fenced, match="metrics.jsonl: step 1: refused"):
        MetricsLogger(run, cfg, "trainer").log(1, {"loss": 0.0})
    assert log.steps() == [0] and not (run / "metrics.jsonl").exists()
    with pytest.raises(exchange.Fenced, match="training on rollouts/step_000001: refused"):
        exchange.check_fence(run, "training on rollouts/step_000001")
