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


def _metas(run_dir: Path):
    """(step, meta) of every published rollout batch (those `rl.prepare` kept)."""
    for s in exchange.list_steps(run_dir, paths.ROLLOUTS):
        try:  # never through a link: a step symlinked from another run is not this run's batch
            yield s, json.loads(exchange.read_in_step(exchange.step_dir(run_dir, paths.ROLLOUTS, s), "meta.json"))
        except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError, exchange.CorruptStep):
            continue  # quarantined, being re-published or not a real step: its groups are not trained


def trained_group_ids(run_dir: Path) -> dict[int, int]:
    """{group id: batch step} over the published rollout batches: the groups they complete."""
    return {int(g): s for s, meta in _metas(run_dir) for g in meta.get("group_ids") or []}


def _covered(run_dir: Path, group_size: int):
    """Per group: rollouts trained in a published batch's part ({index: reward}), rollouts recorded
    dropped, the groups a published batch completes, and the groups' baseline snapshots."""
    parts: dict[int, dict[int, float]] = {}
    snaps: dict[int, dict[int, float]] = {}
    complete: set[int] = set()
    for _, meta in _metas(run_dir):
        complete.update(int(g) for g in meta.get("group_ids") or [])
        for g, snap in (meta.get("snapshots") or {}).items():
            snaps.setdefault(int(g), {int(i): float(r) for i, r in snap.items()})
        for g, part in (meta.get("partial_groups") or {}).items():
            parts.setdefault(int(g), {}).update(zip(map(int, part["rollouts"]), map(float, part["rewards"])))
    dropped: dict[int, set[int]] = {}
    for e in GroupLog.read(run_dir):
        if e.get("event") == "drop":   # a drop without `rollouts` drops the whole group
            dropped.setdefault(int(e["group"]), set()).update(e.get("rollouts") or range(group_size))
    return parts, dropped, complete, snaps


def partial_rollouts(run_dir: Path, group_size: int) -> dict[int, tuple[dict[int, float], set[int], dict | None]]:
    """{group: (rollouts trained in parts {index: reward}, rollouts dropped, its baseline snapshot or
    None)} for the groups to play again that are partly trained or dropped (stale_policy=release): a
    resumed group plays only its other rollouts, against the snapshot its parts were trained against."""
    parts, dropped, complete, snaps = _covered(run_dir, group_size)
    return {g: (parts.get(g, {}), dropped.get(g, set()), snaps.get(g)) for g in set(parts) | set(dropped)
            if g not in complete and set(parts.get(g, {})) | dropped.get(g, set()) != set(range(group_size))}


def unresolved(run_dir: Path, exclude: set[int] = frozenset(), group_size: int | None = None) -> list[int]:
    """Ids started but neither dropped nor completed by a published batch (nor in `exclude`), oldest
    first. With `group_size`, per rollout: a group some of whose rollouts are neither trained in a
    published part nor dropped (a part's batch discarded by `rl.prepare` after the rest was dropped)."""
    events = GroupLog.read(run_dir)
    started = {int(e["group"]) for e in events if e.get("event") == "start"}
    dropped = {int(e["group"]) for e in events if e.get("event") == "drop"}
    if group_size is not None:
        dropped -= set(partial_rollouts(run_dir, group_size))
    return sorted(started - dropped - set(trained_group_ids(run_dir)) - set(exclude))


def resume_order(run_dir: Path, group_size: int | None = None) -> tuple[list[int], int]:
    """(ids to start again first, oldest first; the next fresh id) from the log and the batches."""
    events = GroupLog.read(run_dir)
    started = {int(e["group"]) for e in events if e.get("event") == "start"}
    trained = set(trained_group_ids(run_dir))
    return unresolved(run_dir, group_size=group_size), max(started | trained, default=-1) + 1
