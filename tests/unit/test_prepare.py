"""rl.prepare: where an incarnation resumes, what it sets aside, what it refuses (real files in tmp_path)."""
import io
import json
import os
import pickle
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rl import exchange
from rl.exchange import fencing, retention, steps
from rl.contract.config import Config
from rl.prepare import NoCheckpoint, main, prepare


def _run_dir(tmp_path, max_off_policy=1) -> Path:
    cfg = OmegaConf.structured(Config)
    cfg.run_dir, cfg.orchestrator.max_off_policy = str(tmp_path), max_off_policy
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    return tmp_path


def _publish(run_dir, kind, steps, data=b"payload" * 20):
    for s in steps:
        exchange.publish(run_dir, kind, s, lambda d: (d / "f.bin").write_bytes(data), producer="t")


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_corrupt_newest_checkpoint_is_set_aside_and_the_previous_one_used(tmp_path):
    d = _run_dir(tmp_path)
    _publish(d, "checkpoints", [5, 10])
    _publish(d, "weights", range(12))
    _publish(d, "rollouts", range(11))
    _flip(d / "checkpoints" / "step_000010" / "f.bin")  # same size: only the checksum sees it
    state = prepare(d)
    assert state.checkpoint_step == 5
    # weights from version 5 on: the trainer republishes version 5 from the checkpoint itself
    assert state.discarded == {"weights": [5, 6, 7, 8, 9, 10, 11], "rollouts": [6, 7, 8, 9, 10],
                               "checkpoints": [10]}
    assert exchange.list_steps(d, "checkpoints") == [5]
    (aside,) = (d / "checkpoints" / "corrupt").iterdir()  # renamed, not deleted: kept for inspection
    assert aside.name.startswith("step_000010-") and (aside / "f.bin").is_file()
    assert json.loads((d / "resume.json").read_text())["checkpoint_step"] == 5


@pytest.mark.parametrize("history, says", [
    ("corrupt_checkpoint", "1 checkpoint(s) that do not verify, newest checkpoints/step_000000"),
    ("weights", "weights up to weights/step_000003"),
    ("rollouts", "rollouts up to rollouts/step_000002"),
    ("resume", "resume.json says restart 2 resumed from checkpoint step 5"),
])
def test_a_run_with_history_but_no_verifiable_checkpoint_is_refused(tmp_path, capsys, history, says):
    d = _run_dir(tmp_path, max_off_policy=1)
    _publish(d, "weights", [0])
    if history == "corrupt_checkpoint":
        _publish(d, "checkpoints", [0])
        _flip(d / "checkpoints" / "step_000000" / "f.bin")
    elif history == "weights":
        _publish(d, "weights", [1, 2, 3])
    elif history == "rollouts":
        _publish(d, "rollouts", [0, 1, 2])  # batch 2 needs version >= 1 under max_off_policy=1
    else:
        (d / "resume.json").write_text(json.dumps({"checkpoint_step": 5, "restart": 2}))
    before = sorted(p.relative_to(d).as_posix() for p in d.rglob("*"))
    refused = r"no checkpoint verifies, but the run has history \(.*" + re.escape(says)
    with pytest.raises(NoCheckpoint, match=refused):
        prepare(d)
    assert sorted(p.relative_to(d).as_posix() for p in d.rglob("*")) == before  # nothing discarded
    with pytest.raises(SystemExit) as e:
        main(["--run-dir", str(d)])
    assert str(e.value).startswith("[prepare] error: ") and "\n" not in str(e.value)
    assert "--from-scratch" in str(e.value)
    main(["--run-dir", str(d), "--from-scratch"])  # explicit: discard and start over
    assert "resuming from scratch" in capsys.readouterr().out
    assert exchange.list_steps(d, "weights") == [] and exchange.list_steps(d, "checkpoints") == []
    assert prepare(d).checkpoint_step is None  # the next start sees no history: no refusal loop


def test_a_run_killed_before_its_first_checkpoint_restarts_from_scratch(tmp_path):
    d = _run_dir(tmp_path, max_off_policy=1)
    _publish(d, "weights", [0])
    _publish(d, "rollouts", [0, 1])  # both may come from version 0 before checkpoint 0
    assert prepare(d).checkpoint_step is None  # writes resume.json with no checkpoint
    _publish(d, "weights", [0])
    state = prepare(d)
    assert state.checkpoint_step is None and state.restart == 1


def test_prepare_restores_a_checkpoint_whose_overwrite_was_killed_between_renames(tmp_path, monkeypatch):
    d = _run_dir(tmp_path)
    _publish(d, "checkpoints", [0, 5])
    _publish(d, "weights", range(7))
    real_rename, calls = os.rename, []

    def rename(src, dst, **kw):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("killed")
        return real_rename(src, dst, **kw)
    monkeypatch.setattr(steps.os, "rename", rename)
    tmp = exchange.begin(d, "checkpoints", 5)
    (tmp / "f.bin").write_bytes(b"new")
    with pytest.raises(OSError, match="killed"):
        exchange.commit(d, "checkpoints", 5, tmp, producer="t", overwrite=True)
    monkeypatch.undo()
    assert exchange.list_steps(d, "checkpoints") == [0]
    state = prepare(d)
    assert state.checkpoint_step == 5 and state.discarded["weights"] == [5, 6]  # 5: republished by the trainer
    assert not [p for p in (d / "checkpoints").iterdir() if "step_000005." in p.name]


def test_checkpoint_metadata_is_unpickled_only_from_verified_bytes_and_known_classes(tmp_path):
    """DCP's `.metadata` (a pickle): a real one loads through the allowlist; bytes that differ from the
    manifest are refused before unpickling; a pickle naming anything else is refused."""
    import torch
    import torch.distributed.checkpoint as dcp
    from rl.trainer.checkpoint import _MetadataUnpickler, _quiet, _reader

    def write(step_dir):
        with _quiet():
            dcp.save({"w": torch.arange(6.0), "lr": 0.5}, checkpoint_id=str(step_dir / "dcp"))
    pub = exchange.publish(tmp_path, "checkpoints", 1, write, producer="t")
    path = pub.path.resolve()
    manifest = exchange.verify(path)
    md = _reader(path, manifest).read_metadata()
    assert set(md.state_dict_metadata) == {"w", "lr"}
    out = {"w": torch.zeros(6), "lr": 0.0}
    from rl.trainer.checkpoint import _planner
    with _quiet():
        dcp.load(out, storage_reader=_reader(path, manifest), planner=_planner())
    assert torch.equal(out["w"], torch.arange(6.0)) and out["lr"] == 0.5
    bad = json.loads(json.dumps(manifest))
    bad["files"]["dcp/.metadata"]["sha256"] = "0" * 64
    with pytest.raises(exchange.CorruptStep, match="refusing to unpickle it"):
        _reader(path, bad).read_metadata()
    with pytest.raises(pickle.UnpicklingError, match=r"names (posix|os)\.system"):
        _MetadataUnpickler(io.BytesIO(pickle.dumps(os.system))).load()


def test_keep_checkpoints_1_with_a_corrupt_newest_still_resumes_from_the_good_one(tmp_path):
    """The issue's probe: the trainer prunes with keep_checkpoints=1 right after a checkpoint that turns
    out corrupt; retention keeps the good one, and the next prepare resumes from it (not from scratch)."""
    d = _run_dir(tmp_path)
    _publish(d, "weights", range(11))
    _publish(d, "checkpoints", [5, 10])
    _flip(d / "checkpoints" / "step_000010" / "f.bin")
    assert retention.prune(d, "checkpoints", keep_last=1, checksums=True) == []
    state = prepare(d)
    assert state.checkpoint_step == 5 and exchange.list_steps(d, "weights") == list(range(5))  # 5 republished


def test_the_epoch_names_the_slurm_job_of_each_incarnation(tmp_path, monkeypatch):
    """The epoch is the restart count (monotonic across jobs: every job's prepare increments it) with
    the job that runs it: a refusal names both jobs, a step records its job."""
    run_dir = _run_dir(tmp_path)
    monkeypatch.setattr(fencing, "_FENCES", {})
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    assert prepare(run_dir).slurm_job_id == "41"
    exchange.fence(run_dir, 0)
    assert exchange.publish(run_dir, "weights", 1, _write(b"0"), producer="t").manifest["slurm_job_id"] == "41"
    monkeypatch.setenv("SLURM_JOB_ID", "57")   # the job resubmitted after 41 was lost
    assert prepare(run_dir, from_scratch=True).restart == 1   # (no checkpoint in this test)
    monkeypatch.setenv("SLURM_JOB_ID", "41")   # 41's trainer, still flushing
    with pytest.raises(exchange.Fenced, match=r"incarnation 0 \(Slurm job 41\) of .*, and incarnation 1 "
                                              r"\(Slurm job 57\) has started"):
        exchange.publish(run_dir, "weights", 2, _write(b"z"), producer="t")


def _write(data):
    return lambda d: (d / "f").write_bytes(data)


def test_a_role_takes_the_epoch_it_was_launched_for_not_the_newest(tmp_path, monkeypatch):
    """A role stopped before it recorded itself and continued after the next incarnation's prepare must
    not take the newer epoch for its own: the launcher hands each role its epoch (HETRL_EPOCH)."""
    from rl import runtime
    run_dir = _run_dir(tmp_path)
    monkeypatch.setattr(fencing, "_FENCES", {})
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    prepare(run_dir)
    monkeypatch.setenv("HETRL_EPOCH", "0")               # what the launcher of incarnation 0 handed out
    prepare(run_dir, from_scratch=True)                  # incarnation 1 started meanwhile
    assert runtime.own_epoch(run_dir) == 0
    with pytest.raises(exchange.Fenced, match="starting trainer: refused: .*incarnation 0 .*incarnation 1"):
        runtime.record_role(run_dir, "trainer")
    monkeypatch.setenv("HETRL_EPOCH", "1")
    runtime.record_role(run_dir, "trainer")              # the current incarnation's own role starts
    monkeypatch.delenv("HETRL_EPOCH")
    assert runtime.own_epoch(run_dir) == 1               # no launcher: resume.json
