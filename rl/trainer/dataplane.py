"""The trainer's side of the data plane: each rank reads and verifies only the rollouts it trains on.

The orchestrator publishes a step as meta.json, a small per-sample index and one shard per data rank,
cut by the trainer's own packing rule (rl.contract.batch). Here rank 0 waits for the step and broadcasts
its path; every rank then checks the step's tree and sizes against the manifest (rl.exchange.verify
without checksums: a stat per file) and reads meta.json, the index and its own shard once each, hashing
the bytes as they arrive against the manifest (rl.contract.batch.load_share). So a rank's read, hash and
host memory are its share of the batch, and the step's cost on the trainer's critical path falls as
data ranks are added, instead of every rank reading the whole batch.

The ranks decide together: each contributes its verdict (all_gather of one line), and if any rank found
its part corrupt or invalid, rank 0 moves the step aside (rl.exchange.set_aside) and logs the first
reason, and every rank waits for the step to be published again; none trains on a batch another rank
refused. A rank whose data-rank count or micro-batch size differs from the batch's layout (a run resumed
with another parallelism) reads the whole batch and packs it as before; the step still trains right.
"""
from __future__ import annotations

import time
from pathlib import Path

from rl import exchange, runtime
from rl.contract.batch import ChecksumMismatch, InvalidBatch, RolloutBatch, ShardPlan, load_share
from rl.runtime import StopFlag, log
from rl.trainer import parallel

ROLE = "trainer"


def next_share(run_dir, step: int, stop: StopFlag, poll: float, d: parallel.Dist, vocab_size: int | None = None,
               set_aside: list[str] | None = None, *, plan: ShardPlan | None = None
               ) -> tuple[RolloutBatch, dict, dict] | None:
    """Wait for `rollouts/step_<step>` and return this rank's verified, validated share of it, the
    manifest and timings ({"read_s", "bytes_read"}); None when stopped. A step any rank refuses is set
    aside (by rank 0) with its reason appended to `set_aside`, and waited for again. `plan`: this
    trainer's layout (data ranks, micro_batch_tokens); a batch cut otherwise is read whole."""
    plan = plan or ShardPlan(d.dp_size, None)
    while True:
        path = None
        if d.is_main:
            with runtime.waiting_for(f"rollouts/step_{step:06d} from the orchestrator"):
                got = exchange.wait_for(run_dir, "rollouts", step, poll=poll, should_stop=stop.is_set)
            path = None if got is None else str(got)
        path = d.broadcast(path)
        if path is None:
            return None
        t0 = time.monotonic()
        verdict, result = None, None
        try:
            manifest = exchange.verify(path, checksums=False)   # the tree and every size: a stat per file
            share, n = load_share(Path(path), d.dp_rank, vocab_size, files=manifest["files"], plan=plan)
            result = (share, manifest, {"read_s": time.monotonic() - t0, "bytes_read": n})
        except (exchange.CorruptStep, InvalidBatch, OSError) as e:
            kind = "INVALID" if isinstance(e, InvalidBatch) and not isinstance(e, ChecksumMismatch) else "CORRUPT"
            verdict = (kind, f"{e}")
        bad = [v for v in d.all_gather(verdict) if v is not None]
        if not bad:
            return result
        kind, why = bad[0]
        if d.is_main:
            try:  # atomic: the step is now missing, the orchestrator republishes it
                dest = exchange.set_aside(run_dir, "rollouts", step)
            except FileNotFoundError:
                dest = "(someone else moved it already)"
            log(ROLE, f"{kind} rollouts/step_{step:06d}, not consumed: {why}; moved to {dest}, "
                      f"waiting for it to be published again")
        if set_aside is not None:
            set_aside.append(why)
        d.barrier()   # the step is aside before any rank looks for it again
