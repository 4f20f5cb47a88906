"""After a stop: may this job requeue itself? `python -m rl.requeue --run-dir D` answers with its exit status.

The batch script asks this once every role has exited after USR1 (time limit) or TERM (preemption) and
none of them failed. A requeue is worth it only if the incarnation that is ending left something to
resume from that the previous one did not have: a checkpoint newer than the one `rl.prepare` resumed
from (resume.json). Without one, the next incarnation would start exactly where this one did, and a run
whose roles cannot reach their first checkpoint before the next signal (a grace period shorter than a
checkpoint, a step longer than the time limit) would requeue forever, holding its place in the queue
and a node each time. `cluster.max_restarts` caps the number of incarnations outright, against every
other way of looping.

Exit status 0: requeue. 1: do not; the one-line reason is printed, with how to continue by hand
(`python -m launch resume RUN_DIR`). A resume.json that is malformed or went backwards (rl.prepare's
docstring) is also a "do not", with its one-line reason: the next prepare would refuse it anyway. No
torch: it runs in the batch shell before the allocation ends.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rl import exchange
from rl.contract import config as _config
from rl.contract import paths, safefs
from rl.contract.records import RecordError, ResumeState
from rl.contract.safefs import resolve_run_dir


def decide(run_dir: str | Path, restart: int | None = None) -> tuple[bool, str]:
    """(requeue?, why). `restart`: the incarnation ending now (Slurm's SLURM_RESTART_COUNT); by default the
    one resume.json records."""
    run_dir = Path(run_dir)
    state = ResumeState.read(run_dir)  # RecordError: malformed
    exchange.incarnation(run_dir)      # RecordError: went backwards
    restart = state.restart if restart is None else restart
    limit = _config.load(run_dir).cluster.max_restarts
    if restart >= limit:
        return False, (f"not requeueing: this was restart {restart} and cluster.max_restarts={limit} "
                       f"(continue with: python -m launch resume {run_dir})")
    newest = exchange.latest_complete(run_dir, paths.CHECKPOINTS)
    before = state.checkpoint_step
    if newest is None or (before is not None and newest <= before):
        since = "from scratch" if before is None else f"from checkpoint step {before}"
        return False, (f"not requeueing: this incarnation (restart {restart}, resumed {since}) wrote no newer "
                       f"checkpoint, so a requeue would start from the same point (continue with: "
                       f"python -m launch resume {run_dir})")
    return True, (f"requeueing: checkpoint step {newest} written since "
                  f"{'the start' if before is None else f'step {before}'} (restart {restart + 1} of at most {limit})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m rl.requeue")
    p.add_argument("--run-dir", required=True, type=Path)
    ns = p.parse_args(argv)
    ns.run_dir = resolve_run_dir(ns.run_dir)  # once, here: below it no link is followed (rl.contract.safefs)
    try:   # the trust boundary: a run directory someone else owns or can write is not obeyed
        safefs.check_run_dir_private(ns.run_dir, paths.PRIVATE_DIRS)
    except safefs.UnsafePath as e:
        print(f"not requeueing: {e}", flush=True)
        return 1
    env_restart = os.environ.get("SLURM_RESTART_COUNT")
    if env_restart and not (env_restart.isascii() and env_restart.isdigit()):
        print(f"not requeueing: SLURM_RESTART_COUNT={env_restart!r} is not a non-negative integer", flush=True)
        return 1
    try:
        ok, why = decide(ns.run_dir, int(env_restart) if env_restart else None)
    except RecordError as e:
        ok, why = False, f"not requeueing: {e} (continue with: python -m launch resume {ns.run_dir})"
    print(why, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
