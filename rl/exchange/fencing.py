"""Fencing: a process of an earlier incarnation of the run never publishes after a newer one started.

Every role calls `fence(run_dir, epoch)` once, at start, with the restart count rl.prepare gave its
incarnation; from then on every commit (rl.exchange.steps) and every record outside steps
(`check_fence`) first checks that no newer incarnation has started, and a step's manifest carries the
epoch it was published under, so readers can tell a stale process's late step from the steps
rl.prepare kept (`verify`).

The restart count in `resume.json` is trusted only as far as it is well-formed and never goes
backwards: rl.prepare also leaves one file per incarnation in `incarnations/` (`record_incarnation`,
append-only), and a `resume.json` whose count is lower than the newest of those, or lower than any this
process saw or was launched for, is refused (a rewound count would otherwise let a stale incarnation
publish again).

Someone who rewinds both resume.json and incarnations/ (deletes the newest incarnation's file) still
cannot let a frozen process of an older incarnation publish: the steps the newer incarnation published
carry its epoch in their manifests, and those are not touched by rewinding either record. A strict
`incarnation` (every fence check, rl.prepare, the requeue) therefore also reads the epochs of the newest
steps of each kind (`published_epoch`) and refuses a resume.json below the highest, as it refuses one
below incarnations/. That costs a few stats per kind per check (`_newest_steps`: one listing, then only
the names above the newest steps seen are probed), and a manifest only the first time a step is seen
(cached by inode: a step republished under the same number is a new directory).

That still leaves a rewind before the newer incarnation published anything (its trainer loading a
checkpoint for minutes), or after its steps were discarded: nothing in the run directory that a rewind
must leave alone then says incarnation 1 ever started. What the rewind cannot reach is the kernel's
change time. rl.prepare writes resume.json exactly once per incarnation, before any role starts, and
nothing else writes, renames or links it; so a fenced process notes resume.json's identity when it
fences (`fence`: device, inode and st_ctime, which no unprivileged process can set back) and, while
resume.json still names its own incarnation, publishes only while it is that very file. Restoring an
old copy (a new inode, or the same inode rewritten: a new ctime), deleting it, or a newer prepare's
(then the count is higher and the usual refusal says so) all change it. A rewind then refuses the
frozen process (`Fenced`, one line) and the current one alike: neither can tell it is still the newest,
and that is the safe side (a `chmod` or `touch` of resume.json by hand during a run does it too; the
line says what changed). A process fenced before any resume.json existed (a role started by hand, an
in-process test) keeps the earlier rules.
Split from rl/exchange/__init__.py (issue 23); it reads files through rl.exchange.files.
"""
from __future__ import annotations

import json
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from rl.contract import paths
from rl.contract.atomic import atomic_write_json
from rl.contract.records import RecordError, ResumeState, read_optional

from rl.exchange.files import _STEP_RE, MANIFEST, CorruptStep, read_in_step, read_regular, step_name


class Fenced(RuntimeError):
    """A process of an earlier incarnation of the run tried to publish after a newer one started."""


# Run directories this process publishes into as a role of one incarnation: {resolved run dir: epoch}
_FENCES: dict[str, int] = {}
# The highest restart count this process has seen recorded for a run directory: a resume.json that later
# shows a lower one went backwards (rewound by hand, or an old copy restored) and is not believed.
_SEEN: dict[str, int] = {}
# resume.json as this process fenced on it: {resolved run dir: (st_dev, st_ino, st_ctime_ns) or None
# when there was none}; a different file naming the same incarnation is a rewind (module docstring).
_FENCED_ON: dict[str, tuple[int, int, int] | None] = {}
RESUME = paths.RESUME  # rl.prepare's record of the incarnation (rl.contract.records.ResumeState)
# rl.prepare's append-only record of every incarnation it started, `incarnations/restart_000003.json`:
# resume.json is rewritten each time, so on its own a rewound count would be indistinguishable from an
# old one; these files are only ever added, and the newest of them is a floor resume.json must not go under.
INCARNATIONS = "incarnations"
_INCARNATION_RE = re.compile(r"^restart_(\d{6,})\.json$")


@dataclass(frozen=True)
class Incarnation:
    """The run's newest incarnation: its restart count (the epoch: every job's prepare increments it, so
    it stays monotonic across jobs; a requeue keeps the job id, a resubmission gets a new one), the time
    rl.prepare started it and the Slurm job that runs it."""
    restart: int
    time: float
    job: str | None


def _newest_recorded(run_dir: Path) -> tuple[Incarnation, str] | None:
    """The newest entry of `incarnations/` and its name. The count comes from the name (what rl.prepare
    created exclusively); time and job from its content, which is informational: unreadable gives 0/None,
    which only switches off the late-step check in `verify`."""
    try:
        names = [e.name for e in os.scandir(Path(run_dir) / INCARNATIONS)
                 if _INCARNATION_RE.match(e.name) and e.is_file(follow_symlinks=False)]
    except FileNotFoundError:
        return None
    if not names:
        return None
    name = max(names, key=lambda n: int(_INCARNATION_RE.match(n).group(1)))
    restart, t, job = int(_INCARNATION_RE.match(name).group(1)), 0.0, None
    try:
        rec = json.loads(read_regular(Path(run_dir) / INCARNATIONS / name))
        if isinstance(rec.get("time"), (int, float)) and not isinstance(rec.get("time"), bool):
            t = float(rec["time"])
        job = rec.get("slurm_job_id") if isinstance(rec.get("slurm_job_id"), str) else None
    except (OSError, ValueError, AttributeError, CorruptStep):
        pass
    return Incarnation(restart, t, job), name


# Per published step (kind directory, name, inode): the epoch its manifest records (None: none, unreadable).
_STEP_EPOCHS: dict[tuple[str, str, int], int | None] = {}
# Per kind directory: its inode and mtime when last looked at, and its newest steps then [(step, inode)].
_LISTED: dict[str, tuple[tuple[int, int], list[tuple[int, int]]]] = {}
_NEWEST = 4          # steps per kind whose manifests are read: a stale process may have published above
_RACY_S = 3.0        # a look at a directory modified this recently is not reused (mtime granularity)


def _step_epoch(base: Path, name: str, ino: int) -> int | None:
    key = (str(base), name, ino)
    if key not in _STEP_EPOCHS:
        epoch = None
        try:
            m = json.loads(read_in_step(base / name, MANIFEST, missing_ok=True) or b"null")
            e = m.get("epoch") if isinstance(m, dict) else None
            epoch = e if isinstance(e, int) and not isinstance(e, bool) and e >= 0 else None
        except (CorruptStep, OSError, ValueError):
            pass  # unreadable: says nothing; verify sets such a step aside
        if len(_STEP_EPOCHS) > 100_000:
            _STEP_EPOCHS.clear()
        _STEP_EPOCHS[key] = epoch
    return _STEP_EPOCHS[key]


def _step_ino(base: Path, step: int) -> int | None:
    try:
        st = os.stat(base / step_name(step), follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_ino if stat.S_ISDIR(st.st_mode) else None


def _newest_steps(base: Path) -> list[tuple[int, int]] | None:
    """The newest `_NEWEST` steps of a kind directory as [(step, inode)], ascending; None if it is missing.

    A full listing the first time; after that, while the newest steps seen are still in place (same
    inodes), only the names above them are probed (steps are published in increasing order), so a check
    costs a few stats however many steps the directory holds. A step gone or replaced (a resume's
    discard, a republish) makes it list the directory again."""
    try:
        st = os.stat(base, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return None
    stamp = (st.st_ino, st.st_mtime_ns)
    cached = _LISTED.get(str(base))
    if cached is not None and cached[0] == stamp and time.time() - st.st_mtime > _RACY_S:
        return cached[1]
    newest = None
    if cached is not None and cached[1] and all(_step_ino(base, s) == ino for s, ino in cached[1]):
        newest, s = list(cached[1]), cached[1][-1][0] + 1
        while (ino := _step_ino(base, s)) is not None:
            newest.append((s, ino))
            s += 1
        newest = newest[-_NEWEST:]
    if newest is None:
        try:
            newest = sorted((int(m.group(1)), e.inode()) for e in os.scandir(base)
                            if (m := _STEP_RE.match(e.name)) and e.is_dir(follow_symlinks=False))[-_NEWEST:]
        except (FileNotFoundError, NotADirectoryError):
            return None
    _LISTED[str(base)] = (stamp, newest)
    return newest


def published_epoch(run_dir: str | os.PathLike) -> tuple[int, str] | None:
    """The highest epoch in the manifests of the newest published steps of each kind, and that step
    (`kind/step_N`); None when no step records one. The module docstring says why."""
    best = None
    for kind in paths.KINDS:
        base = Path(run_dir) / kind
        for step, ino in _newest_steps(base) or []:
            e = _step_epoch(base, step_name(step), ino)
            if e is not None and (best is None or e > best[0]):
                best = (e, f"{kind}/{step_name(step)}")
    return best


def incarnation(run_dir: str | os.PathLike, *, strict: bool = True) -> Incarnation | None:
    """The run's newest incarnation (resume.json, floored by `incarnations/`), None before the first
    prepare. `strict`: a malformed resume.json, or one whose restart count is below the newest recorded
    incarnation (or missing while incarnations are recorded), raises rl.contract.records.RecordError in
    one line. Not strict (verify's late-step check): the best of what is readable."""
    run_dir = Path(run_dir)
    try:
        r = read_optional(ResumeState, run_dir / RESUME)
    except RecordError:
        if strict:
            raise
        r = None
    resume = None if r is None else Incarnation(r.restart, float(r.time), r.slurm_job_id)
    says = "is missing" if resume is None else f"says restart {resume.restart}"
    if strict and (pub := published_epoch(run_dir)) is not None and pub[0] > (0 if resume is None else resume.restart):
        # both records rewound: the steps the newer incarnation published still carry its epoch
        raise RecordError(f"{run_dir / RESUME} {says}, but {pub[1]} was published by incarnation {pub[0]} "
                          f"(its manifest): the record went backwards; refused")
    rec = _newest_recorded(run_dir)
    if rec is None:
        return resume
    floor, name = rec
    if resume is not None and resume.restart >= floor.restart:
        return resume
    if strict:
        raise RecordError(f"{run_dir / RESUME} {says}, but incarnation {floor.restart} was started "
                          f"({INCARNATIONS}/{name}): the record went backwards; refused")
    return floor


def record_incarnation(run_dir: str | os.PathLike, restart: int, started: float, job: str | None) -> None:
    """rl.prepare, after writing resume.json: add `incarnations/restart_<restart>.json` (never rewritten
    or removed; after resume.json, so a crash in between leaves the floor below resume.json, never above)."""
    path = Path(run_dir) / INCARNATIONS / f"restart_{int(restart):06d}.json"
    atomic_write_json(path, {"restart": int(restart), "time": started, "slurm_job_id": job})


def _job_words(job: str | None) -> str:
    return f" (Slurm job {job})" if job else ""


def _resume_identity(run_dir: str | os.PathLike) -> tuple[int, int, int] | None:
    """resume.json's (device, inode, change time in ns), None when it is missing."""
    try:
        st = os.stat(Path(run_dir) / RESUME, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


def fence(run_dir: str | os.PathLike, epoch: int) -> None:
    """From now on this process publishes into `run_dir` as incarnation `epoch` (its restart count): a
    publish after a newer incarnation started is refused, and its steps carry the epoch, so readers can
    tell a stale process's late step from the steps rl.prepare kept. Roles call it once, at start; it
    notes resume.json's identity then (kept by a second call for the same epoch), so a rewind of it is
    seen (module docstring)."""
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise ValueError(f"fence({run_dir}): epoch {epoch!r} is not a non-negative integer")
    key = str(Path(run_dir).resolve())
    if _FENCES.get(key) != epoch or key not in _FENCED_ON:
        _FENCED_ON[key] = _resume_identity(run_dir)
    _FENCES[key] = epoch


def _check_fence(run_dir: str | os.PathLike, kind: str, step: int) -> int | None:
    """check_fence for a step about to be committed; returns the epoch its manifest records."""
    check_fence(run_dir, f"{kind}/{step_name(step)}")
    return _FENCES.get(str(Path(run_dir).resolve()))


def check_fence(run_dir: str | os.PathLike, what: str) -> None:
    """Raise Fenced if this process's incarnation of `run_dir` is no longer the newest: for writes
    outside steps (log records, metrics) and for a role that wakes up (a stopped process continued after
    its successor started must not train, consume or record anything). No-op for unfenced processes."""
    key = str(Path(run_dir).resolve())
    mine = _FENCES.get(key)
    if mine is None:
        return
    try:
        now = incarnation(run_dir)
    except RecordError as e:  # malformed or rewound: this process cannot tell it is still current
        raise Fenced(f"{what}: refused: {e}") from None
    if now is not None and now.restart > mine:
        _SEEN[key] = max(_SEEN.get(key, 0), now.restart)
        own = os.environ.get("SLURM_JOB_ID")
        raise Fenced(f"{what}: refused: this process belongs to incarnation {mine}{_job_words(own)} of "
                     f"{run_dir}, and incarnation {now.restart}{_job_words(now.job)} has started since ({RESUME})")
    fenced_on = _FENCED_ON.get(key)
    if fenced_on is not None and (got := _resume_identity(run_dir)) != fenced_on:
        # the same incarnation named by another file than the one this process started from: a rewind
        what_now = "is missing" if got is None else (
            "is another file (inode %d, was %d)" % (got[1], fenced_on[1]) if got[:2] != fenced_on[:2] else
            "was rewritten (its change time moved)")
        raise Fenced(f"{what}: refused: {Path(run_dir) / RESUME} {what_now} since this process of "
                     f"incarnation {mine} started from it; only rl.prepare writes it, once per incarnation, so "
                     f"it was rewound or restored by hand and this process cannot tell it is still the newest")
    known = max(mine, _SEEN.get(key, 0))
    # Missing while this process knows only incarnation 0 is a run before its first prepare (roles started
    # by hand, in-process tests): no older incarnation exists that a missing record could let back in.
    if (now is None and known > 0) or (now is not None and now.restart < known):
        # a count that went backwards: believing it would let a process of an older incarnation (which
        # this one may be: it saw a newer count before) publish again
        says = "is missing" if now is None else f"says restart {now.restart}"
        raise Fenced(f"{what}: refused: {Path(run_dir) / RESUME} {says}, but this process belongs to or has "
                     f"seen incarnation {known} of {run_dir}: the record went backwards")
