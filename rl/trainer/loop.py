"""The trainer role: warm start, then one optimizer step per rollout batch, publishing every version.

`run(run_dir)` is the whole role (docs/internals.md, "Trainer"); `python -m rl.trainer --run-dir D`
calls it, and the tests call it in-process with their own stop flag and warm-start examples.

Run-directory use, in order:
- `roles/trainer.json` (record_role); `config.yaml` and `resume.json` are read;
- start-up (rl.trainer.startup): `assets/step_000000`, then the warm start and version 0 on a first
  start, or `checkpoints/step_c` on a resume;
- per step n: waits for `rollouts/step_n`, verifies its share with checksums, trains, appends to
  `rollouts/consumed.jsonl`, publishes `weights/step_{n+1}`, logs a line to `metrics.jsonl`, prunes old
  weights (never the newest checkpoint's), checkpoints every `trainer.checkpoint_every` steps, at the
  end and when asked to stop; `DONE` after the last step.

A rollout batch that fails verification (truncated, checksum mismatch, unreadable) or validation (a
malformed header or meta.json, non-finite floats, token ids outside the vocabulary, inconsistent offsets
or lengths, versions below -1, numbers that are not logprobs, group bookkeeping in meta.json that does
not describe the arrays, such as a part with fewer rewards than rollouts: rl.contract.batch.RolloutBatch
.validate and .validate_meta) is never trained on. The orchestrator's resume judges the same meta.json
the same way (rl.orchestrator.grouplog.trusted_meta), so the groups of a batch set aside here are
played again, never counted trained. The trainer logs the one-line
reason, moves the step aside to `rollouts/corrupt/step_N-<time>` (rl.exchange.set_aside: out of every
reader's sight, kept for inspection) and waits for the step to be published again: the orchestrator
produces every missing step, and exiting instead would not help, since a restart keeps rollout steps up
to the checkpoint and would find the same file. The step that finally trains counts the versions set
aside before it (`rollouts_set_aside` in its metrics); consumed.jsonl lists only the trained one.

An update that would make the weights non-finite is never applied (rl.trainer.train.Trainer.train_step):
the batch still counts as consumed, with `update_skipped` 1 in its metrics and `applied: false` in
consumed.jsonl. The end of each step (publishing, pruning, checkpoints) and of the role (the final sweep,
DONE) is rl.trainer.bookkeeping.

Multi-rank (`trainer.parallel`, dp_shard x ep x cp = world size, launched by torchrun): see
rl.trainer.parallel. Rank 0 waits for each rollout step and broadcasts its path; every rank then verifies
and reads only its own share of it (rl.trainer.dataplane: the orchestrator cuts the batch into one shard
per data rank by the trainer's packing rule), and a step any rank refuses is set aside by rank 0. Rank 0
commits the weights every rank wrote (rl.exchange.publisher) and logs metrics; every rank trains and
writes its DCP shard of each checkpoint. Rank 0's stop flag decides for all ranks at step boundaries.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from rl import exchange, runtime
from rl.contract import paths
from rl.contract.batch import RolloutBatch, ShardPlan, batch_digest
from rl.metrics import EvalFold
from rl.runtime import StopFlag, load_config, log, resume_state
from rl.trainer import bookkeeping, dataplane, parallel, startup
from rl.trainer.train import ROLE, Examples


def next_batch(run_dir, step: int, stop: StopFlag, poll: float = 0.2, *, vocab_size: int | None = None,
               set_aside: list[str] | None = None) -> tuple[RolloutBatch, dict] | None:
    """One process: wait for `rollouts/step_<step>`, verified with checksums and validated (token ids
    below `vocab_size`), read whole; set it aside and re-wait if corrupt or invalid, appending the reason
    to `set_aside` (rl.trainer.dataplane.next_share, on one rank)."""
    got = dataplane.next_share(run_dir, step, stop, poll, parallel.Dist(), vocab_size, set_aside)
    return None if got is None else got[:2]


def _metrics_logger(run_dir, cfg):
    from rl.metrics import MetricsLogger
    return MetricsLogger(run_dir, cfg)


def run(run_dir, cfg=None, *, stop: StopFlag | None = None, examples: Examples | None = None,
        after_step: Callable[[int, dict], None] | None = None, poll: float = 0.2,
        device: str | None = None) -> int:
    """The trainer role. Returns 0 when all steps are done, EXIT_PREEMPTED when stopped early.

    Under torchrun every rank calls this; the return value is the same on every rank. `device`
    defaults to the plan's (rl.trainer.startup.planned_device).
    """
    run_dir = Path(run_dir)
    cfg = load_config(run_dir) if cfg is None else cfg
    stop = StopFlag(install=False) if stop is None else stop
    max_steps = int(cfg.trainer.max_steps)
    device = device or startup.planned_device(run_dir)
    d = parallel.init(cfg.trainer.parallel, torch.device(device))
    try:
        rc = _run(run_dir, cfg, d, stop, examples, after_step, poll, device, max_steps)
    finally:
        d.close()
    if d.is_main:  # for rl.trainer.torchrun: torchrun itself reports any non-zero worker status as 1
        from rl.contract.records import ExitRecord
        ExitRecord(rc=rc, reason=stop.reason).write(run_dir)
    return rc


def _run(run_dir, cfg, d, stop, examples, after_step, poll, device, max_steps) -> int:
    main = d.is_main
    tr, last_ckpt = startup.start(run_dir, cfg, d, device, examples)
    metrics = _metrics_logger(run_dir, cfg) if main else None
    evals = EvalFold(run_dir) if main and int(cfg.eval.every) else None   # online evaluation's rows
    consumed = exchange.ConsumedLog(run_dir, "rollouts", ROLE) if main else None
    restart = resume_state(run_dir).restart
    vocab = tr.vocab_size
    plan = ShardPlan.from_config(cfg)
    for n in range(tr.progress.next_step, max_steps):
        t_wait = time.monotonic()
        set_aside: list[str] = []
        got = dataplane.next_share(run_dir, n, stop, poll, d, vocab, set_aside, plan=plan)
        if got is None:
            break
        batch, manifest, read = got
        exchange.check_fence(run_dir, f"training on rollouts/step_{n:06d}")  # a continued stale process stops here
        t0 = time.monotonic()
        m = tr.train_step(batch, n)
        step_s = time.monotonic() - t0
        tr.progress.consumed.append(n)
        tr.progress.next_step = n + 1
        if main:  # consumed even when the update was skipped: the batch is never trained again
            consumed.record(n, restart=restart, sha256=batch_digest(manifest["files"]),
                            **({"applied": False} if m["update_skipped"] else {}))
        publish_s = bookkeeping.publish_step(run_dir, cfg, tr, n + 1, last_ckpt)
        m.update(step_time_s=step_s, tokens_per_s=m["tokens"] / max(step_s, 1e-9), publish_s=publish_s,
                 publish_background_s=tr.publish_background_s,
                 wait_s=t0 - t_wait, policy_version=n + 1, rollouts_set_aside=len(set_aside),
                 batch_read_s=read["read_s"], batch_read_bytes=read["bytes_read"],
                 # the share of this step's wall time spent waiting for its rollout batch
                 idle_fraction=(t0 - t_wait) / max(time.monotonic() - t_wait, 1e-9), time=time.time())
        m.update({f"orchestrator/{k}": v for k, v in batch.meta.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool)})
        if evals is not None:
            m.update(evals.new())
        if main:
            metrics.log(n, m)
            log(ROLE, f"step {n}: loss {m['loss']:.4f} reward {m['reward_mean']:.3f} "
                      f"kl {m.get('mismatch_kl', 0):.2e} lag {m['lag']:.2f} {step_s:.2f} s")
        stopping = d.broadcast(stop.reason if main else None)  # rank 0's flag decides for every rank
        if stopping is not None:
            stop.set(stopping)
        if bookkeeping.checkpoint_due(cfg, n + 1, stop):
            tr.save(run_dir, n + 1)
            last_ckpt = n + 1
        if after_step is not None:
            after_step(n, m)
        if d.distributed:
            stopping = d.broadcast(stop.reason if main else None)
            if stopping is not None:
                stop.set(stopping)
        if stop.is_set():
            break
    return bookkeeping.finish(run_dir, cfg, tr, d, stop, last_ckpt,
                              before_done=lambda: _final_eval(run_dir, cfg, evals, metrics, stop))


def _final_eval(run_dir, cfg, evals, metrics, stop: StopFlag) -> None:
    """Before DONE: wait (at most eval.final_timeout_s) for the orchestrator's evaluation of the final
    version and log it as the line of step max_steps; the only time the trainer waits for evaluation."""
    if evals is None or not paths.role_record(run_dir, "orchestrator").exists():
        return   # no orchestrator in this run (a trainer on its own): nothing evaluates
    final, deadline = int(cfg.trainer.max_steps), time.monotonic() + float(cfg.eval.final_timeout_s)
    with runtime.waiting_for(f"the orchestrator's evaluation of policy version {final}"):
        while not evals.has(final) and time.monotonic() < deadline and not stop.is_set():
            time.sleep(0.2)
    row = evals.new()
    if not evals.has(final):
        log(ROLE, f"no evaluation of the final policy version {final} after {cfg.eval.final_timeout_s:.0f} s "
                  f"(eval.final_timeout_s); finishing without it")
    if row:
        metrics.log(final, row)
