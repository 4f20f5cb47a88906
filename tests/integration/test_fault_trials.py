"""The CI subset of benchmarks/fault_trials.py: five fault kinds, one after the other, in one real
embedded run (a crash point armed in the first incarnation, a paused role, a second launcher, a flipped
bit in a published step, everything SIGKILLed), then the run completed and checked: every rollout batch
trained exactly once, the off-policy bound held, every remaining step verifies, no hang."""
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
    assert len(t.incarnations) >= 2, t.incarnations  # kill_all at least ended one incarnation
    assert t.incarnations[-1] == 0
