"""The fault-trial harness's verdicts (benchmarks/_fault_checks.py, fault_trials.settle) on real files:
damage a later fault neutralised (a resume discarded the step unread) is "landed, neutralised", not "not
landed"; damage neither set aside nor discarded, or consumed by the incarnation it hit, is a failure; and a
campaign does not inject its next fault before the previous one settled. Issue 36 item 7: the CI campaign
failed under load when kill_all came before the trainer reached a flipped batch, which the resume then
discarded."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import fault_trials   # benchmarks/ is on sys.path under pytest (setup.cfg's pythonpath)
from _fault_checks import landed_after
from _fault_trial import LANDED, NEUTRALISED, NOT_INJECTED, Trial, launch, note_resume

G = 8  # rollouts per group


def _resume(run_dir: Path, restart: int, ckpt: int, rollouts: list[int]) -> None:
    (run_dir / "resume.json").write_text(json.dumps({
        "checkpoint_step": ckpt, "cleaned_tmp": 0, "restart": restart, "slurm_job_id": None, "time": 0.0,
        "discarded": {"checkpoints": [], "rollouts": rollouts, "weights": [ckpt]}}))


def _run(tmp_path: Path, consumed_by_hit: bool = False) -> Trial:
    """A finished 8-step run: restart 1 trained steps 0-4, step 5 was flipped while restart 1 ran, every
    process was killed, restart 2 resumed from checkpoint 4 discarding rollouts 5 (unread) and trained 5-7
    from fresh batches holding the discarded batch's groups 40-47 again (in steps 5 and 6)."""
    run_dir = tmp_path / "run"
    for n in range(8):
        d = run_dir / "rollouts" / f"step_{n:06d}"
        d.mkdir(parents=True)
        groups = {5: [*range(44, 52)], 6: [*range(40, 44), *range(52, 56)]}.get(n, range(8 * n, 8 * n + 8))
        (d / "meta.json").write_text(json.dumps({"entries": [[g, list(range(G))] for g in groups]}))
    log = [{"step": n, "consumer": "trainer", "restart": 1, "sha256": "x"} for n in range(5)]
    if consumed_by_hit:
        log.append({"step": 5, "consumer": "trainer", "restart": 1, "sha256": "x"})
    log += [{"step": n, "consumer": "trainer", "restart": 2, "sha256": "x"} for n in range(5, 8)]
    (run_dir / "rollouts" / "consumed.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log))
    (run_dir / "rollouts" / "groups.jsonl").write_text(
        "".join(json.dumps({"event": "start", "group": g, "restart": 1}) + "\n" for g in range(64)))
    t = Trial(0, "bitflip", 1, run_dir, steps=8, incarnations=[-9, 0])
    t.damaged = ("rollouts", 5, "rollouts/step_000005/meta.json")
    t.damaged_restart, t.damaged_groups = 1, list(range(40, 48))
    _resume(run_dir, 2, 4, [5])
    note_resume(t)  # what launch() does before the next incarnation's prepare rewrites resume.json
    _resume(run_dir, 3, 7, [])  # a later incarnation: its resume.json no longer names step 5
    return t


def test_damage_discarded_unread_by_a_resume_is_landed_and_neutralised(tmp_path):
    t = _run(tmp_path)
    landed_after(t)
    assert not t.failures, t.failures
    assert (t.status, t.verdict) == ("passed", NEUTRALISED), (t.not_landed, t.proof)
    said = "; ".join(t.proof)
    assert "discarded unread by restart 2's resume" in said, said
    assert "no consumption of step 5 by restart 1" in said, said
    assert "groups 40-47 trained again in rollouts/step_000005, step_000006" in said, said


def test_damage_consumed_by_the_incarnation_it_hit_is_a_failure(tmp_path):
    t = _run(tmp_path, consumed_by_hit=True)
    landed_after(t)
    assert t.status == "failed" and "consumed by restart 1" in t.failures[0], t.failures


def test_damage_neither_set_aside_nor_discarded_is_a_failure_not_a_miss(tmp_path):
    t = _run(tmp_path)
    t.resumes.clear()
    (t.run_dir / "resume.json").unlink()
    landed_after(t)
    assert t.status == "failed" and "unaccounted for" in t.failures[0], t.failures


def test_damage_set_aside_is_landed(tmp_path):
    t = _run(tmp_path)
    (t.run_dir / "rollouts" / "corrupt" / "step_000005-1a2b3c").mkdir(parents=True)
    landed_after(t)
    assert (t.status, t.verdict) == ("passed", LANDED)
    assert "set aside to rollouts/corrupt/step_000005-1a2b3c" in t.proof[0]


def test_no_damage_is_not_injected(tmp_path):
    t = Trial(0, "bitflip", 1, tmp_path / "run")
    landed_after(t)
    assert (t.status, t.verdict) == ("not_landed", NOT_INJECTED)


def test_launch_keeps_each_incarnations_resume_before_the_next_rewrites_it(tmp_path):
    """launch() notes resume.json before its prepare can replace it (here the launcher fails at once on
    a bad override, a real process: what matters is that the note was taken first)."""
    t = Trial(0, "kill_all", 1, tmp_path / "run", extra=["no_such_key_at_all=1"])
    t.run_dir.mkdir()
    _resume(t.run_dir, 4, 3, [4, 5])
    launch(t).wait(60)
    assert t.resumes == {4: {"checkpoints": [], "rollouts": [4, 5], "weights": [3]}}


def _sleeper(tmp_path: Path, script: str) -> subprocess.Popen:
    return subprocess.Popen(["sh", "-c", script], cwd=tmp_path, start_new_session=True)


def test_settle_waits_until_the_damaged_batch_is_set_aside(tmp_path):
    """The next fault of a campaign waits for the trainer to set the damaged batch aside (here a real
    process does it after 1 s), so a kill cannot pre-empt the proof."""
    t = _run(tmp_path)
    aside = t.run_dir / "rollouts" / "corrupt" / "step_000005-9f8e7d"
    p = _sleeper(tmp_path, f"sleep 1; mkdir -p {aside}; sleep 60")
    try:
        t0 = time.monotonic()
        fault_trials.settle(t, p, timeout=30)
        waited = time.monotonic() - t0
        assert aside.is_dir() and p.poll() is None and 0.8 < waited < 20, waited
        assert "settled in" in t.detail
    finally:
        p.kill()
        p.wait()


def test_settle_lets_the_next_fault_go_when_the_incarnation_ends_and_says_so(tmp_path):
    t = _run(tmp_path)
    p = _sleeper(tmp_path, "sleep 0.5")
    t0 = time.monotonic()
    fault_trials.settle(t, p, timeout=30)
    assert time.monotonic() - t0 < 10
    assert "not set aside" in t.detail and "incarnation ended" in t.detail, t.detail


def test_settle_waits_for_a_kill_or_crash_point_to_end_its_incarnation(tmp_path):
    t = Trial(0, "crash_point", 1, tmp_path / "run", armed=True)
    p = _sleeper(tmp_path, "sleep 1")
    fault_trials.settle(t, p, timeout=30)
    assert p.poll() == 0 and "settled in" in t.detail and not t.failures
    q = _sleeper(tmp_path, "sleep 60")
    try:
        fault_trials.settle(t, q, timeout=1)
        assert q.poll() is not None and "hang" in t.failures[0], t.failures
    finally:
        q.kill()
        q.wait()
