"""`rollouts/groups.jsonl`: the continuous pool's record of every group started and dropped.

Exactly once across restarts rests on this log and on the batches: every published batch lists the
group ids it trained (`group_ids` in its meta); the log has an fsynced line per start and per drop. A
resumed orchestrator plays again, first and oldest first, every id started but neither trained nor
dropped (rl.orchestrator.pool explains why). Kept apart from the pool so that a reader of a run
directory (the report, a fault trial's checker) needs the records, not the scheduler.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from rl import exchange
from rl.contract import paths

GROUPS_LOG = "groups.jsonl"


class GroupLog:
    """`rollouts/groups.jsonl`: an fsynced line per group start and per group drop."""

    def __init__(self, run_dir: Path, restart: int):
        self.path = Path(run_dir) / paths.ROLLOUTS / GROUPS_LOG
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.restart = restart

    def _append(self, rec: dict) -> None:
        exchange.check_fence(self.path.parent.parent, f"{GROUPS_LOG}: group {rec.get('group')}")
        # rl.exchange's shared appender ends a crash's torn last line first, so this record stands alone
        exchange.append_jsonl(self.path, {**rec, "restart": self.restart, "time": time.time()})

    def started(self, gid: int, version: int) -> None:
        self._append({"event": "start", "group": gid, "version": version})

    def dropped(self, gid: int, reason: str, step: int, **extra) -> None:
        """`extra`: where (ready | inflight | retry), tokens (generated, lost), seconds (the group ran)."""
        self._append({"event": "drop", "group": gid, "reason": reason, "step": step, **extra})

    @staticmethod
    def read(run_dir: Path) -> list[dict]:
        return exchange.read_jsonl(Path(run_dir) / paths.ROLLOUTS / GROUPS_LOG)  # torn last line skipped


def trained_group_ids(run_dir: Path) -> dict[int, int]:
    """{group id: batch step} over the published rollout batches (those `rl.prepare` kept)."""
    out: dict[int, int] = {}
    for s in exchange.list_steps(run_dir, paths.ROLLOUTS):
        try:  # never through a link: a step symlinked from another run is not this run's batch
            meta = json.loads(exchange.read_in_step(exchange.step_dir(run_dir, paths.ROLLOUTS, s), "meta.json"))
        except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError, exchange.CorruptStep):
            continue  # quarantined, being re-published or not a real step: its groups are not trained
        for g in meta.get("group_ids") or []:
            out[int(g)] = s
    return out


def unresolved(run_dir: Path, exclude: set[int] = frozenset()) -> list[int]:
    """Ids started but neither dropped nor in a published batch (nor in `exclude`), oldest first."""
    events = GroupLog.read(run_dir)
    started = {int(e["group"]) for e in events if e.get("event") == "start"}
    dropped = {int(e["group"]) for e in events if e.get("event") == "drop"}
    return sorted(started - dropped - set(trained_group_ids(run_dir)) - set(exclude))


def resume_order(run_dir: Path) -> tuple[list[int], int]:
    """(ids to start again first, oldest first; the next fresh id) from the log and the batches."""
    events = GroupLog.read(run_dir)
    started = {int(e["group"]) for e in events if e.get("event") == "start"}
    trained = set(trained_group_ids(run_dir))
    return unresolved(run_dir), max(started | trained, default=-1) + 1
