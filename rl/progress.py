"""Did this incarnation train anything? `python -m rl.progress --run-dir D` answers with its exit status.

The batch script asks this before it requeues a job that stopped because too many inference servers were
lost (sbatch/job.sbatch.j2, docs/elastic.md). Such a stop is a fault, not a preemption: when the lost
server fails deterministically (a bad config, a broken node that Slurm hands out again), every
incarnation loses it the same way. A requeue is worth it only if the incarnation that is ending moved
the run forward, i.e. the trainer trained at least one step and checkpointed it. rl.requeue's own rule
(a checkpoint newer than the one resumed from) counts the trainer's initial checkpoint of a run started
from scratch (step 0, written before any training) as new, which is right for a preemption (the next
incarnation skips the warm start) but would buy a crash loop one more incarnation for nothing here; this
check does not count it. Without progress the job ends FAILED with the one-line reason printed here.

Exit status 0: a step was trained and checkpointed since this incarnation started. 1: nothing was (or
the records cannot be read), with the one-line reason. No torch: it runs in the batch shell.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rl import exchange
from rl.contract import paths, safefs
from rl.contract.records import RecordError, ResumeState
from rl.contract.safefs import resolve_run_dir


def trained_since_start(run_dir: str | Path) -> tuple[bool, str]:
    """(progress?, why): is the newest complete checkpoint past the step this incarnation started from?"""
    state = ResumeState.read(run_dir)   # RecordError: malformed
    start = state.checkpoint_step or 0  # from scratch: the trainer's step-0 checkpoint is no progress
    newest = exchange.latest_complete(run_dir, paths.CHECKPOINTS)
    since = "from scratch" if state.checkpoint_step is None else f"from checkpoint step {start}"
    if newest is None or newest <= start:
        return False, f"no step trained and checkpointed since this incarnation started (restart {state.restart}, {since})"
    return True, f"checkpoint step {newest} trained since this incarnation started (restart {state.restart}, {since})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m rl.progress")
    p.add_argument("--run-dir", required=True, type=Path)
    ns = p.parse_args(argv)
    run_dir = resolve_run_dir(ns.run_dir)
    try:   # the trust boundary: a run directory someone else owns or can write is not obeyed
        safefs.check_run_dir_private(run_dir, paths.PRIVATE_DIRS)
    except safefs.UnsafePath as e:
        print(f"progress unknown: {e}", flush=True)
        return 1
    try:
        ok, why = trained_since_start(run_dir)
    except RecordError as e:
        ok, why = False, f"progress unknown: {e}"
    print(why, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
