"""The CI subset of benchmarks/fault_trials.py: five fault kinds, one after the other, in one real
embedded run (a crash point armed in the first incarnation, a paused role, a second launcher, a flipped
bit in a rollout batch the trainer has not read yet, everything SIGKILLed), then the run completed and
checked: every rollout batch trained exactly once (consumed.jsonl's lineage and sha256s, groups.jsonl
against the batches' group ids), the off-policy bound held, every remaining step verifies (hashed by the
harness), no hang; and every fault landed (the crash point's log line, the process alive when hit, the
damaged batch set aside). The Slurm-level kinds are not in this subset: one Slurm trial took 135-230 s
on 2 cores beside another trial (two hetjob incarnations; a requeue alone waits ~20 s), which with this
run would put the test past its ~4 minute budget."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

KINDS = ["crash_point", "sigstop", "second_launcher", "bitflip", "kill_all"]


@pytest.mark.slow
def test_five_fault_kinds_in_one_run_lose_and_double_nothing(tmp_path):
    import fault_trials
    t = fault_trials.run_campaign(KINDS, seed=3, out=tmp_path)
    assert not t.failures, f"{t.detail}: {t.failures} (run dir {t.run_dir})"
    assert t.status == "passed", f"{t.detail}: not landed: {t.not_landed} (proof so far: {t.proof})"
    assert len(t.incarnations) >= 2, t.incarnations  # kill_all at least ended one incarnation
    assert t.incarnations[-1] == 0
