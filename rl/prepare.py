"""Before the roles start: decide where this incarnation of the run resumes from.

`python -m rl.prepare --run-dir D` runs once per job start (local backend and batch script alike), while
no role is running. In order:
1. finishes overwrites a crash interrupted (`exchange.restore_asides`: an old step renamed aside comes
   back when the new one never arrived), then removes `*.tmp-*` leftovers of crashed producers and the
   server records of the previous incarnation;
2. finds the newest checkpoint c that verifies with checksums. Newer checkpoints that do not verify are
   set aside to `checkpoints/corrupt/step_N-<time>` (renamed, never deleted: someone may want to look);
3. discards weights and rollout batches newer than c: weights after c came from optimizer steps the
   checkpoint does not hold, and a rollout batch after c may have been sampled from such weights.
   Rollout batches up to c stay: they were sampled from versions <= c, which the restored lineage
   reproduces. The decision is written to `D/resume.json` so every role acts on the same one.

Without a checkpoint the trainer starts from scratch and everything downstream of version 0 goes. That
is right for a run that never checkpointed, and wrong for one that lost its checkpoints, so prepare
refuses (`NoCheckpoint`, one line) when no checkpoint verifies but the run has history, unless asked
with `--from-scratch` (which nobody passes by default). History is evidence that a checkpoint existed
or optimizer steps were taken; none of it can appear before the trainer's first checkpoint
(`checkpoints/step_000000`, saved right after `weights/step_000000`):
- a `checkpoints/step_N` directory (one that does not verify: a verified one would have been used);
- `weights/step_N` with N >= 1 (published after an optimizer step);
- `rollouts/step_N` with N > orchestrator.max_off_policy (batch N needs a version >= N - max_off_policy,
  so >= 1: batches 0..max_off_policy may legitimately be sampled from version 0 before checkpoint 0);
- `resume.json` of an earlier incarnation that resumed from a checkpoint.
A run killed before its first checkpoint has only `weights/step_000000`, early batches and a
`resume.json` without a checkpoint, and restarts from scratch as before. With `--from-scratch` the
checkpoints that do not verify are set aside too, so the next prepare sees no history.

The restart count written to resume.json is the epoch every role fences its publishing with, so prepare
refuses, in one line and before it changes anything, a resume.json that is malformed (a restart that is
not a non-negative integer, fields of the wrong type, not an object) or that went backwards (its restart
below the newest incarnation recorded in `incarnations/`, or missing while some are recorded): numbering
on from a rewound count would hand out an epoch a stale process already holds. After writing resume.json
it records the new incarnation there (rl.exchange.record_incarnation). A resume.json rewound together
with incarnations/ is refused too: the steps the newer incarnation published carry its epoch
(rl.exchange.fencing.published_epoch). Truncating metrics.jsonl and eval/results.jsonl reads them
through their schemas (rl.contract.record_schemas): a malformed line is skipped with one warning naming
file:line, never a traceback; a record that is a link or a FIFO is refused in one line. No torch.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from rl import exchange
from rl.faults import crash_point, set_role
from rl.contract import config as _config
from rl.contract import offpolicy, paths, safefs
from rl.contract.records import RecordError, ResumeState, read_optional

KINDS = paths.KINDS


class NoCheckpoint(RuntimeError):
    """The run has history but no checkpoint that verifies: restarting from scratch would lose it."""


def prepare(run_dir: str | Path, from_scratch: bool = False) -> ResumeState:
    run_dir = Path(run_dir)
    prev = read_optional(ResumeState, paths.resume_file(run_dir))  # RecordError: malformed
    newest = exchange.incarnation(run_dir)  # RecordError: went backwards (below incarnations/)
    exchange.restore_asides(run_dir, KINDS)  # before clean_tmp: an aside may be a step's only copy
    cleaned = exchange.clean_tmp(run_dir, KINDS)
    # Server records of the previous incarnation point at dead processes.
    for stale in [*(run_dir / "inference").glob("server_*.json"), paths.router_record(run_dir)]:
        stale.unlink(missing_ok=True)
    ckpt, corrupt = _newest_verified_checkpoint(run_dir)
    if ckpt is None and not from_scratch and (found := history(run_dir, prev)):
        raise NoCheckpoint(
            f"{run_dir}: no checkpoint verifies, but the run has history "
            f"({'; '.join(found)}); refusing to restart it from scratch silently: repair or restore a "
            f"checkpoint, or discard the run's progress with `python -m rl.prepare --run-dir {run_dir} "
            f"--from-scratch` and resume")
    set_aside = [exchange.set_aside(run_dir, paths.CHECKPOINTS, s) for s in corrupt]
    for dest in set_aside:
        print(f"[prepare] set aside a checkpoint that does not verify: {dest}", flush=True)
    # No checkpoint: the trainer starts from scratch, so nothing downstream of version 0 is valid.
    keep = ckpt if ckpt is not None else -1
    # Weights from the checkpoint's version on go too: the trainer republishes version c from the
    # checkpoint itself, so the servers of this incarnation start from bytes that match the lineage even if
    # the published copy was damaged (hashing it here instead would cost a read of the whole model by one
    # process; a publish is spread over every trainer rank).
    discarded = {paths.WEIGHTS: exchange.discard_after(run_dir, paths.WEIGHTS, keep - 1 if ckpt is not None else -1),
                 paths.ROLLOUTS: exchange.discard_after(run_dir, paths.ROLLOUTS, keep)}
    discarded[paths.CHECKPOINTS] = list(corrupt)  # set aside, not deleted: checkpoints/corrupt/
    from rl.metrics import truncate_eval, truncate_metrics
    truncate_metrics(run_dir, ckpt if ckpt is not None else 0)
    truncate_eval(run_dir, ckpt if ckpt is not None else 0)   # weights after the checkpoint are trained again
    crash_point("prepare.mid")
    state = ResumeState(checkpoint_step=ckpt, restart=newest.restart + 1 if newest else 0,
                        discarded=discarded, cleaned_tmp=cleaned, time=time.time(),
                        slurm_job_id=os.environ.get("SLURM_JOB_ID") or None)
    state.write(run_dir)
    exchange.record_incarnation(run_dir, state.restart, state.time, state.slurm_job_id)
    if _more_steps_wanted(run_dir, ckpt):
        paths.done_file(run_dir).unlink(missing_ok=True)
    return state


def _newest_verified_checkpoint(run_dir: Path) -> tuple[int | None, list[int]]:
    """(newest checkpoint that verifies with checksums, the newer ones that do not), without moving any."""
    corrupt = []
    for step in reversed(exchange.list_steps(run_dir, paths.CHECKPOINTS)):
        try:
            exchange.verify(exchange.step_dir(run_dir, paths.CHECKPOINTS, step), checksums=True)
            return step, corrupt
        except exchange.CorruptStep as e:
            print(f"[prepare] checkpoints/{exchange.step_name(step)} does not verify: {e}", flush=True)
            corrupt.append(step)
    return None, corrupt


def history(run_dir: Path, prev: ResumeState | None) -> list[str]:
    """What shows that this run checkpointed or trained before (module docstring), one phrase each."""
    found = []
    if ckpts := exchange.list_steps(run_dir, paths.CHECKPOINTS):
        found.append(f"{len(ckpts)} checkpoint(s) that do not verify, newest "
                     f"checkpoints/{exchange.step_name(ckpts[-1])}")
    if (w := exchange.list_steps(run_dir, paths.WEIGHTS)) and w[-1] >= 1:
        found.append(f"weights up to weights/{exchange.step_name(w[-1])}")
    k = int(_config.load(run_dir).orchestrator.max_off_policy)
    # batches 0..k may be sampled from version 0 before any checkpoint; a later one needs newer weights
    if (r := exchange.list_steps(run_dir, paths.ROLLOUTS)) and offpolicy.needed_version(r[-1], k) >= 1:
        found.append(f"rollouts up to rollouts/{exchange.step_name(r[-1])}")
    if prev is not None and prev.checkpoint_step is not None:
        found.append(f"{paths.RESUME} says restart {prev.restart} resumed from checkpoint step "
                     f"{prev.checkpoint_step}")
    return found


def _more_steps_wanted(run_dir: Path, ckpt: int | None) -> bool:
    """A finished run resubmitted with a larger trainer.max_steps continues: its DONE marker goes."""
    return ckpt is None or ckpt < _config.load(run_dir).trainer.max_steps


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m rl.prepare")
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--from-scratch", action="store_true",
                   help="restart from scratch even though the run has history but no checkpoint that "
                        "verifies (its weights and rollouts are discarded, its checkpoints set aside)")
    ns = p.parse_args(argv)
    set_role("prepare")
    try:
        state = prepare(safefs.resolve_run_dir(ns.run_dir), from_scratch=ns.from_scratch)
    except (NoCheckpoint, RecordError, safefs.UnsafePath) as e:
        # a record that is malformed, went backwards or is not a regular file (a link, a FIFO): one line
        sys.exit(f"[prepare] error: {e}")
    where = "from scratch" if state.checkpoint_step is None else f"from checkpoint step {state.checkpoint_step}"
    gone = {k: v for k, v in state.discarded.items() if v}
    print(f"[prepare] restart {state.restart}: resuming {where}"
          + (f"; discarded {gone}" if gone else ""), flush=True)


if __name__ == "__main__":
    main()
