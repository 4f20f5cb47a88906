"""`rollouts/groups.jsonl`: the continuous pool's record of every group started and dropped.

Exactly once across restarts rests on this log and on the batches: every published batch lists the
group ids it trained (`group_ids` in its meta); the log has an fsynced line per start and per drop. A
resumed orchestrator plays again, first and oldest first, every id started but neither trained nor
dropped (rl.orchestrator.pool explains why). Kept apart from the pool so that a reader of a run
directory (the report, a fault trial's checker) needs the records, not the scheduler.

Both sources are checked before they are believed. A line of the log that does not fit its schema
(rl.contract.record_schemas.group_event) is skipped with one warning naming file:line, so a hand edit
or a hostile line never keeps the orchestrator from resuming. A batch's bookkeeping (`group_ids`,
`entries`, `partial_groups`, `snapshots`) counts only when its step verifies: the manifest, every
file's size and the tree (rl.exchange.verify), and the sha256 of meta.json itself, whose bytes are the
ones believed here; then its schema (record_schemas.batch_meta: a part has one reward per rollout, the
entries are exactly its complete groups and parts). A batch that fails is not trusted, with one
warning: its groups count as neither trained nor dropped and are played again, and the trainer, which
verifies every byte before it trains, sets the same step aside (rl.trainer.loop), so the step is
republished from those groups. The batch file's own checksum is not read here: the trainer checked it
before training, a batch damaged after it was trained does not un-train its groups (counting them
untrained would train them twice), one damaged before is set aside by the trainer and its groups
requeued by the pool (`_requeue_lost`), and hashing every retained batch at each resume would read the
run's whole rollout history.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

from rl import exchange
from rl.contract import paths, record_schemas, safefs

log = logging.getLogger("hetrl.records")
_warned: set[tuple[str, str]] = set()

GROUPS_LOG = "groups.jsonl"


class GroupLog:
    """`rollouts/groups.jsonl`: an fsynced line per group start and per group drop."""

    def __init__(self, run_dir: Path, restart: int):
        self.path = Path(run_dir) / paths.ROLLOUTS / GROUPS_LOG
        safefs.makedirs(self.path.parent)
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
    def read(run_dir: Path, group_size: int | None = None) -> list[dict]:
        """The well-formed lines (record_schemas.group_event); others skipped with a warning each."""
        return exchange.read_jsonl(Path(run_dir) / paths.ROLLOUTS / GROUPS_LOG,
                                   check=record_schemas.group_event(group_size))


def _untrusted(step: Path, why: str) -> None:
    if (str(step), why) not in _warned:   # the pool asks again when a batch goes missing: once is enough
        _warned.add((str(step), why))
        log.warning("%s: its group bookkeeping is not trusted (%s); its groups count as untrained", step, why)


def trusted_meta(step: Path, group_size: int | None = None) -> dict | None:
    """The meta.json of the published rollout step `step` when it can be believed (the module
    docstring), else None with one warning naming the step and the reason."""
    try:
        manifest = exchange.verify(step, checksums=False)  # never through a link; sizes, tree, epoch
        raw = exchange.read_in_step(step, "meta.json")
    except (exchange.CorruptStep, OSError) as e:
        _untrusted(step, str(e))
        return None
    want = manifest["files"].get("meta.json", {}).get("sha256")
    if want != hashlib.sha256(raw).hexdigest():
        _untrusted(step, "meta.json does not match the sha256 in its manifest" if want else
                   "its manifest records no sha256 of meta.json")
        return None
    try:
        meta = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        _untrusted(step, f"meta.json is not JSON ({e})")
        return None
    if (why := record_schemas.batch_meta(meta, group_size=group_size)) is not None:
        _untrusted(step, f"meta.json: {why}")
        return None
    return meta


def _metas(run_dir: Path, group_size: int | None = None) -> list[tuple[int, dict]]:
    """(step, meta) of every published rollout batch (those `rl.prepare` kept) that can be trusted."""
    out = []
    for s in exchange.list_steps(run_dir, paths.ROLLOUTS):
        meta = trusted_meta(exchange.step_dir(run_dir, paths.ROLLOUTS, s), group_size)
        if meta is not None:
            out.append((s, meta))
    return out


def _trained(metas) -> dict[int, int]:
    return {int(g): s for s, meta in metas for g in meta.get("group_ids") or []}


def trained_group_ids(run_dir: Path) -> dict[int, int]:
    """{group id: batch step} over the trusted published rollout batches: the groups they complete."""
    return _trained(_metas(run_dir))


def _covered(metas, events, group_size: int):
    """Per group: rollouts trained in a published batch's part ({index: reward}), rollouts recorded
    dropped, the groups a published batch completes, and the groups' baseline snapshots."""
    parts: dict[int, dict[int, float]] = {}
    snaps: dict[int, dict[int, float]] = {}
    complete: set[int] = set()
    for _, meta in metas:
        complete.update(int(g) for g in meta.get("group_ids") or [])
        for g, snap in (meta.get("snapshots") or {}).items():
            snaps.setdefault(int(g), {int(i): float(r) for i, r in snap.items()})
        for g, part in (meta.get("partial_groups") or {}).items():
            # one reward per rollout: batch_meta refused a part whose lengths differ (zip would truncate)
            parts.setdefault(int(g), {}).update(zip(map(int, part["rollouts"]), map(float, part["rewards"]), strict=True))
    dropped: dict[int, set[int]] = {}
    for e in events:
        if e["event"] == "drop":   # a drop without `rollouts` drops the whole group
            dropped.setdefault(int(e["group"]), set()).update(e.get("rollouts") or range(group_size))
    return parts, dropped, complete, snaps


def _partials(metas, events, group_size: int) -> dict[int, tuple[dict[int, float], set[int], dict | None]]:
    parts, dropped, complete, snaps = _covered(metas, events, group_size)
    return {g: (parts.get(g, {}), dropped.get(g, set()), snaps.get(g)) for g in set(parts) | set(dropped)
            if g not in complete and set(parts.get(g, {})) | dropped.get(g, set()) != set(range(group_size))}


def partial_rollouts(run_dir: Path, group_size: int) -> dict[int, tuple[dict[int, float], set[int], dict | None]]:
    """{group: (rollouts trained in parts {index: reward}, rollouts dropped, its baseline snapshot or
    None)} for the groups to play again that are partly trained or dropped (stale_policy=release): a
    resumed group plays only its other rollouts, against the snapshot its parts were trained against."""
    return _partials(_metas(run_dir, group_size), GroupLog.read(run_dir, group_size), group_size)


def _unresolved(metas, events, exclude, group_size: int | None) -> list[int]:
    started = {int(e["group"]) for e in events if e["event"] == "start"}
    dropped = {int(e["group"]) for e in events if e["event"] == "drop"}
    if group_size is not None:
        dropped -= set(_partials(metas, events, group_size))
    return sorted(started - dropped - set(_trained(metas)) - set(exclude))


def unresolved(run_dir: Path, exclude: set[int] = frozenset(), group_size: int | None = None) -> list[int]:
    """Ids started but neither dropped nor completed by a trusted published batch (nor in `exclude`),
    oldest first. With `group_size`, per rollout: a group some of whose rollouts are neither trained in a
    published part nor dropped (a part's batch discarded by `rl.prepare` after the rest was dropped)."""
    return _unresolved(_metas(run_dir, group_size), GroupLog.read(run_dir, group_size), exclude, group_size)


def resume_order(run_dir: Path, group_size: int | None = None) -> tuple[list[int], int]:
    """(ids to start again first, oldest first; the next fresh id) from the log and the trusted batches."""
    retry, next_gid, _ = resume_plan(run_dir, group_size)
    return retry, next_gid


def resume_plan(run_dir: Path, group_size: int | None = None):
    """`resume_order` and (with `group_size`) `partial_rollouts` from one read of the log and the batches:
    (ids to start again first, the next fresh id, {group: (parts, dropped, snapshot)})."""
    metas, events = _metas(run_dir, group_size), GroupLog.read(run_dir, group_size)
    started = {int(e["group"]) for e in events if e["event"] == "start"}
    return (_unresolved(metas, events, frozenset(), group_size),
            max(started | set(_trained(metas)), default=-1) + 1,
            _partials(metas, events, group_size) if group_size is not None else {})
