"""Which servers of a run are up: the router's view of the server records (`discover`).

A server's record names the address the run's secret is sent to and whose completions are trained on;
`discover` obeys only records that pass the trust rule (docs/run-directory-safety.md) and says each
refusal once (`Refusals`). Shared by the Router (its polls) and its role (the start's wait).
"""
from __future__ import annotations

from pathlib import Path


def discover(plan, run_dir: Path, refused) -> dict[str, tuple[str, str, int]]:
    """{name: (url, pool, pid)} of the servers up now, planned or added by `launch scale` (extra rows).

    A server's record names the address the run's secret is sent to (every /metrics poll) and whose
    completions are trained on, so it is obeyed only if it passes the trust rule: read through
    rl.contract.records (safefs: owned by this user, writable by nobody else, a regular file; a FIFO
    refused without blocking the event loop). A refused or unreadable record counts as absent (that
    server is down) and is handed to `refused(error)`, which says it once. `plan` is the one read at the
    start: it never changes, and re-reading it at every poll would let a file swapped in later decide."""
    from rl.contract.elastic import replica_row, server_indexes
    from rl.contract.plan import PlanFormatError
    from rl.contract.records import RecordError, ServerRecord
    found = {}
    try:
        indexes = server_indexes(plan, run_dir)
    except OSError as e:   # inference/extra planted as a link or a file: the planned servers only
        refused(e)
        indexes = [r.index for r in plan.inference.replicas]
    for i in indexes:
        try:
            row = replica_row(plan, run_dir, i)
            rec = ServerRecord.read(run_dir, i)
        except (OSError, RecordError, PlanFormatError) as e:
            refused(e)
            continue
        if rec is not None:
            found[row.name] = (rec.url, row.pool, rec.pid)
    return found


class Refusals:
    """`refused(error)` for `discover`: a refused server record said once, in one line naming the file and
    why (the start's wait and every poll see it again; the log shows it once)."""

    def __init__(self, log):
        self.log, self.seen = log, set()

    def __call__(self, error: Exception) -> None:
        line = " ".join(str(error).split())
        if line not in self.seen:
            self.seen.add(line)
            self.log(f"router: refused: {line}; treated as absent (nothing is sent to it, the secret "
                     f"included)")
