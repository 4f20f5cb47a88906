"""Before the roles start: decide where this incarnation of the run resumes from.

`python -m rl.prepare --run-dir D` runs once per job start (local backend and batch script alike), while
no role is running. It finds the newest complete checkpoint c (verified against its manifest), removes
`*.tmp-*` leftovers of producers that crashed mid-publish, and discards weights and rollout batches
newer than c: weights after c came from optimizer steps the checkpoint does not hold, and a rollout batch
after c may have been sampled from such weights. Rollout batches up to c stay: they were sampled from
versions <= c, which the restored lineage reproduces. The decision is written to `D/resume.json` so
every role acts on the same one. No torch.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from rl import exchange
from rl.contract import config as _config
from rl.contract import paths
from rl.contract.records import ResumeState, read_optional

KINDS = paths.KINDS


def prepare(run_dir: str | Path) -> ResumeState:
    run_dir = Path(run_dir)
    cleaned = exchange.clean_tmp(run_dir, KINDS)
    # Server records of the previous incarnation point at dead processes.
    for stale in [*(run_dir / "inference").glob("server_*.json"), paths.router_record(run_dir)]:
        stale.unlink(missing_ok=True)
    ckpt = exchange.latest_complete(run_dir, paths.CHECKPOINTS, checksums=True)
    # No checkpoint: the trainer starts from scratch, so nothing downstream of version 0 is valid.
    keep = ckpt if ckpt is not None else -1
    discarded = {kind: exchange.discard_after(run_dir, kind, keep) for kind in (paths.WEIGHTS, paths.ROLLOUTS)}
    from rl.metrics import truncate_metrics
    truncate_metrics(run_dir, ckpt if ckpt is not None else 0)
    prev = read_optional(ResumeState, paths.resume_file(run_dir))
    state = ResumeState(checkpoint_step=ckpt, restart=prev.restart + 1 if prev else 0,
                        discarded=discarded, cleaned_tmp=cleaned, time=time.time())
    state.write(run_dir)
    if _more_steps_wanted(run_dir, ckpt):
        paths.done_file(run_dir).unlink(missing_ok=True)
    return state


def _more_steps_wanted(run_dir: Path, ckpt: int | None) -> bool:
    """A finished run resubmitted with a larger trainer.max_steps continues: its DONE marker goes."""
    return ckpt is None or ckpt < _config.load(run_dir).trainer.max_steps


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m rl.prepare")
    p.add_argument("--run-dir", required=True, type=Path)
    ns = p.parse_args(argv)
    state = prepare(ns.run_dir)
    where = "from scratch" if state.checkpoint_step is None else f"from checkpoint step {state.checkpoint_step}"
    gone = {k: v for k, v in state.discarded.items() if v}
    print(f"[prepare] restart {state.restart}: resuming {where}"
          + (f"; discarded {gone}" if gone else ""), flush=True)


if __name__ == "__main__":
    main()
