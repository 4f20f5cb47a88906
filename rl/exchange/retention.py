"""Retention: which published steps may be deleted, and which must stay.

Rules (docs/internals.md, "Run directory: retention, set-aside, resume"):
- only steps that verify count as kept: `prune(kind, keep_last)` keeps the newest `keep_last` steps that
  verify, so a corrupt newest step never displaces the good one before it. Steps newer than the newest
  verified one are left in place whatever their state (rl.prepare sets a corrupt checkpoint aside);
  older steps that are neither kept nor protected go, corrupt ones included, since no reader takes them.
- a kept step's delta chain (down to a full step) is kept with it.
- checksums where they are worth their cost: the trainer prunes checkpoints with `checksums=True` (a
  checkpoint is what a restart stands on, and one is written only every `checkpoint_every` steps), and
  each checkpoint is hashed once per process: a step already hashed here whose manifest is unchanged is
  only size-checked again. Weights are pruned on sizes (every step, and their manifests carry sizes
  only; their per-tensor digests are checked by the servers that load them).
- weights a consumer may still load are protected, derived from the off-policy bound rather than from
  `keep_weights`: with the newest verified version V, a server that is loading, or is about to load,
  version L has L >= V - max_off_policy (while it loads it generates nothing, and batch n needs tokens
  of versions >= n - max_off_policy, so the trainer cannot publish past L + max_off_policy), and the
  versions the servers are recorded to serve (`served_versions`) are kept too.
No torch.
"""
from __future__ import annotations

import fnmatch
import json
import os
import uuid
from pathlib import Path
from typing import Callable, Iterable

from rl.contract import offpolicy, safefs
from rl.faults import crash_point
from rl.exchange.files import MANIFEST, CorruptStep, _remove, step_dir
from rl.exchange.steps import delta_base, latest_complete, list_steps, verify

# step path -> (inode, mtime_ns) of the manifest it was hashed against, in this process
_HASHED: dict[str, tuple[int, int]] = {}
_REFUSED: set[str] = set()   # records served_versions refused (safefs), each said once in this process


def _refused(error: safefs.UnsafePath) -> None:
    line = " ".join(str(error).split())
    if line not in _REFUSED:
        _REFUSED.add(line)
        print(f"[exchange] retention: refused: {line}; not counted as a server's version", flush=True)


def _verifies(path: Path, checksums: bool) -> bool:
    key = None
    try:
        if checksums:
            st = safefs.lstat(path / MANIFEST)
            if st is None:
                raise CorruptStep(f"{path}: no {MANIFEST}")
            key = (st.st_ino, st.st_mtime_ns)
            checksums = _HASHED.get(str(path)) != key
        verify(path, checksums=checksums)
    except (CorruptStep, OSError) as e:
        print(f"[exchange] retention does not count {path.parent.name}/{path.name}: {e}", flush=True)
        return False
    if key is not None:
        _HASHED[str(path)] = key
    return True


def prune(run_dir: str | os.PathLike, kind: str, keep_last: int, protect: Iterable[int] = (),
          checksums: bool = False) -> list[int]:
    """Delete the steps of `kind` that neither retention rule keeps (module docstring); return them."""
    steps = list_steps(run_dir, kind)
    kept: list[int] = []
    for s in reversed(steps):
        if len(kept) >= max(keep_last, 0):
            break
        if _verifies(step_dir(run_dir, kind, s), checksums):
            kept.append(s)
    if not kept:
        return []  # nothing verifies: deleting anything could delete the last usable step
    keep = set(kept) | set(protect)
    for s in list(keep):
        # every base is an earlier step (delta_base refuses anything else), so this walk ends
        while s in steps:
            try:
                b = delta_base(step_dir(run_dir, kind, s))
            except CorruptStep as e:  # readers refuse this step; its chain is unknown, so nothing is freed
                print(f"[exchange] retention: {e}", flush=True)
                return []
            if b is None or b in keep:
                break
            keep.add(b)
            s = b
    gone = []
    for s in steps:
        if s not in keep and s < kept[0]:
            p = step_dir(run_dir, kind, s)
            trash = p.with_name(p.name + f".tmp-prune-{uuid.uuid4().hex[:6]}")
            safefs.rename(p, trash)  # atomic: a reader sees the whole step or nothing
            _remove(trash)  # a symlink in a step's place is unlinked, never followed
            gone.append(s)
            crash_point("prune.mid")
    return gone


def served_versions(run_dir: str | os.PathLike) -> set[int]:
    """The policy version each running server is recorded to serve: its `inference/server_<i>.json`
    (the version it started on), or the newest successful reload reported in
    `inference/reloads/server_<i>/` since that record was written. rl.prepare deletes the server
    records of a previous incarnation, so only this incarnation's servers count. Every record and report
    is read through safefs: one another user owns or can write, a link or a FIFO is refused without
    blocking, said once, and counts for nothing."""
    inference = Path(run_dir) / "inference"
    out = set()
    for name, _ in sorted(safefs.scandir(inference)):
        if not fnmatch.fnmatchcase(name, "server_*.json"):
            continue
        rec = inference / name
        try:  # through safefs: a link or FIFO in a record's place is refused (UnsafePath), not followed
            r = json.loads(safefs.read_bytes(rec, limit=1 << 20))
            version, index, since = int(r["version"]), int(r["index"]), safefs.lstat(rec).st_mtime
        except safefs.UnsafePath as e:
            _refused(e)
            continue
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # being rewritten, or not a server record: the bound below still holds
        reloads = inference / "reloads" / f"server_{index}"
        try:
            entries = safefs.scandir(reloads)
        except safefs.UnsafePath as e:
            _refused(e)
            entries = []
        except OSError:
            entries = []
        for rname, _ in entries:
            if not rname.endswith(".json"):
                continue
            try:
                rr = json.loads(safefs.read_bytes(reloads / rname, limit=1 << 20))
                if rr.get("loaded") and safefs.lstat(reloads / rname).st_mtime >= since:
                    version = max(version, int(rr["version"]))
            except safefs.UnsafePath as e:
                _refused(e)
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue
        out.add(version)
    return out


def weights_in_use(run_dir: str | os.PathLike, max_off_policy: int) -> set[int]:
    """Weight versions a consumer may still load (module docstring): the newest verified version V and
    the `max_off_policy` before it, and every version a server is recorded to serve."""
    newest = latest_complete(run_dir, "weights")
    # the batches still to come may hold tokens as old as the newest version allows (rl.contract.offpolicy)
    use = (set(range(max(0, offpolicy.oldest_version(newest, max_off_policy)), newest + 1))
           if newest is not None else set())
    return use | served_versions(run_dir)



def corrupt_steps(run_dir: str | os.PathLike, kind: str,
                  deep: "Callable[[Path], object] | None" = None) -> dict[int, str]:
    """{step: why} for every step of `kind` that does not verify with checksums, and every weights step
    whose delta chain passes through a step that does not (or is missing): it could not be rebuilt.
    `deep(step_path)` is a further check that raises CorruptStep: weight shards are listed in the
    manifest by size only, their digests are per tensor (checksums.json), and reading those needs torch
    (rl.exchange.deltas.stored_tensors, which also rebuilds a delta from its chain and verifies the result).
    Reads every byte of every step: for the end of a run (DONE) and for tools, not for hot paths."""
    steps = list_steps(run_dir, kind)
    bad: dict[int, str] = {}
    for s in steps:
        try:
            verify(step_dir(run_dir, kind, s), checksums=True)
            if deep is not None:
                deep(step_dir(run_dir, kind, s))
        except CorruptStep as e:
            bad[s] = str(e)
    for s in steps:  # ascending, so a base is judged before the deltas on it
        if s in bad:
            continue
        try:
            b = delta_base(step_dir(run_dir, kind, s))  # an earlier step, or CorruptStep: no loops
        except (CorruptStep, OSError) as e:
            bad[s] = f"delta.json unreadable ({e})"
            continue
        if b is not None and (b in bad or b not in steps):
            bad[s] = f"its delta base step {b} {'does not verify' if b in bad else 'is missing'}"
    return bad
