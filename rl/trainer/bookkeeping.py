"""The trainer's end-of-step bookkeeping: publishing the next version and pruning old weights
(`publish_step`), the periodic checkpoint (`checkpoint_due`), and the end of the role (`finish`: the last
publish joined, a final checkpoint, the final sweep that verifies every retained step, `DONE`).

Retention of weights keeps `trainer.keep_weights` verified versions, never the newest checkpoint's (a
restart serves it) nor one a server may still load (rl.exchange.retention.weights_in_use).
"""
from __future__ import annotations

import time
from typing import Callable

from rl import exchange
from rl.exchange import retention
from rl.runtime import EXIT_PREEMPTED, StopFlag, log, mark_done
from rl.trainer import parallel
from rl.trainer.train import ROLE, Trainer


def _prune_weights(run_dir, cfg, last_ckpt: int) -> list[int]:
    """Retention of weights: `keep_weights` verified versions, the newest checkpoint's (a restart
    serves it), and every version a server may still load (rl.exchange.retention.weights_in_use)."""
    protect = {last_ckpt} | retention.weights_in_use(run_dir, int(cfg.orchestrator.max_off_policy))
    return retention.prune(run_dir, "weights", int(cfg.trainer.keep_weights), protect=protect)


def publish_step(run_dir, cfg, tr: Trainer, version: int, last_ckpt: int) -> float:
    """Publish `weights/step_<version>` (every rank), then prune old weights (rank 0). Returns the
    trainer's share of the publish in seconds: the copy-out (and joining the previous publish)."""
    t1 = time.monotonic()
    tr.publish_weights(run_dir, version)
    publish_s = time.monotonic() - t1
    if tr.dist.is_main:
        _prune_weights(run_dir, cfg, last_ckpt)
    return publish_s


def checkpoint_due(cfg, next_step: int, stop: StopFlag) -> bool:
    """A checkpoint every `trainer.checkpoint_every` steps, after the last step, and when asked to stop."""
    return (next_step % int(cfg.trainer.checkpoint_every) == 0 or next_step == int(cfg.trainer.max_steps)
            or stop.is_set())


def _final_sweep(run_dir, tr: Trainer, d, final: int) -> None:
    """Before DONE: every step left in the run directory verifies (checksums, weights' delta chains).

    Damage to a step after it was written (a bit flip, a truncation on the filesystem) is found only when
    something reads it again, and after DONE nothing does. A damaged step is set aside (<kind>/corrupt/);
    the final checkpoint and the final weights are written again from the trainer's state, which is still
    in memory, so a finished run never ends with its result only in a damaged copy. It reads every retained
    byte once, at the end of the run only."""
    from rl.exchange.deltas import stored_tensors
    deep = {"weights": stored_tensors}
    bad = d.broadcast({k: retention.corrupt_steps(run_dir, k, deep.get(k))
                       for k in ("checkpoints", "weights", "rollouts")} if d.is_main else None)
    if d.is_main:
        for kind, steps in bad.items():
            for s, why in sorted(steps.items()):
                dest = exchange.set_aside(run_dir, kind, s)
                log(ROLE, f"final check: {kind}/step_{s:06d} set aside to {dest} ({why})")
    d.barrier()
    if final in bad["weights"]:
        tr.publish_weights(run_dir, final)
        tr.wait_published()
    if final in bad["checkpoints"]:
        tr.save(run_dir, final)


def finish(run_dir, cfg, tr: Trainer, d: parallel.Dist, stop: StopFlag, last_ckpt: int,
           before_done: Callable[[], None] = lambda: None) -> int:
    """After the step loop: 0 with `DONE` when all steps are done, else EXIT_PREEMPTED (checkpointed).
    `before_done` runs on the main rank just before DONE (the final evaluation's wait)."""
    main = d.is_main
    max_steps = int(cfg.trainer.max_steps)
    tr.wait_published()  # the last version is complete before DONE (or before a stopped role exits)
    if main:  # in the loop the newest version was still being written: prune again now it counts
        _prune_weights(run_dir, cfg, last_ckpt)
    if tr.progress.next_step >= max_steps:
        if last_ckpt != tr.progress.next_step:
            tr.save(run_dir, tr.progress.next_step)
        _final_sweep(run_dir, tr, d, tr.progress.next_step)
        if main:
            before_done()
            mark_done(run_dir, step=tr.progress.next_step)
            log(ROLE, f"done: {max_steps} steps")
        return 0
    if last_ckpt != tr.progress.next_step:
        tr.save(run_dir, tr.progress.next_step)
    if main:
        log(ROLE, f"stopped ({stop.reason}) at step {tr.progress.next_step}: checkpointed, exiting")
    return EXIT_PREEMPTED
