"""The run-directory protocol: how every producer hands data to every consumer.

All hand-offs (rollout batches, weight shards, checkpoints) go through the shared filesystem as
step-versioned directories, `RUN_DIR/<kind>/step_000042/`. A producer writes into a private
`step_000042.tmp-<random>/`, fsyncs every file, writes `manifest.json` (files, sizes, sha256, producer,
policy version, time) last, fsyncs the directory and renames it into place. rename(2) of a directory is
atomic on POSIX filesystems and on Lustre, so a directory named `step_N` is complete by construction and
readers never look at `*.tmp-*`. Readers still verify sizes (cheap) and, where the data is about to be
trained on or loaded into a server, checksums: a corrupted or truncated file raises `CorruptStep` and is
never consumed.

Consumers record what they consumed in `<kind>/consumed.jsonl` so retention never deletes a step a
consumer still needs and a resumed consumer never takes a step twice.

A manifest is data from the shared filesystem, so it is checked before it is believed: it must be a JSON
object with a `files` mapping of relative paths confined to the step (no `..`, no absolute path) to
non-negative sizes; anything else is `CorruptStep` naming the entry, which every consumer already handles
by skipping or setting the step aside.

A step is also what it claims to be on disk: producers only ever write real directories and regular files,
so `verify` refuses a step directory that is a symlink (another run's step linked in would verify against
its own manifest), and any symlink, FIFO, socket or device inside a step, listed or not. Files of a step
are opened through `open_in_step`: every path component without following symlinks, the file itself
non-blocking and checked with fstat to be a regular file, so a FIFO swapped in cannot block a reader and
a link cannot lead it elsewhere. A symlink named like a step is still listed (`list_steps`): it occupies
the step's name, so consumers verify it, refuse it and set it aside like any corrupt step.

Fencing (`fence`, `check_fence`) trusts `resume.json`'s restart count only as far as it is well-formed and
never goes backwards: rl.prepare also leaves one file per incarnation in `incarnations/`
(`record_incarnation`, append-only), and a `resume.json` whose count is lower than the newest of those,
or lower than any this process saw or was launched for, is refused (a rewound count would otherwise let a
stale incarnation publish again).

An overwrite (`commit(..., overwrite=True)`, the trainer re-saving a checkpoint step) renames the old
step to `step_N.aside-<token>` before renaming the new one in. A crash between the two leaves only the
aside; `restore_asides` (run by rl.prepare, while no producer runs) renames it back when `step_N` is
missing and removes it otherwise. The aside name deliberately lacks `.tmp-`, so `clean_tmp` never
deletes the only copy of a step.

Nothing here imports torch: the launcher and the tests use it freely.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from rl.contract import paths
from rl.contract.atomic import atomic_write_bytes, atomic_write_json
from rl.contract.records import RecordError, ResumeState, read_optional
from rl.faults import crash_point

from rl.exchange.jsonl import append_jsonl, read_jsonl

MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step_(\d{6,})$")
_ASIDE_RE = re.compile(r"^(step_\d{6,})\.aside-[0-9a-f]+$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


class CorruptStep(RuntimeError):
    """A published step whose files do not match its manifest."""


class Fenced(RuntimeError):
    """A process of an earlier incarnation of the run tried to publish after a newer one started."""


# Run directories this process publishes into as a role of one incarnation: {resolved run dir: epoch}
_FENCES: dict[str, int] = {}
# The highest restart count this process has seen recorded for a run directory: a resume.json that later
# shows a lower one went backwards (rewound by hand, or an old copy restored) and is not believed.
_SEEN: dict[str, int] = {}
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
    rec = _newest_recorded(run_dir)
    if rec is None:
        return resume
    floor, name = rec
    if resume is not None and resume.restart >= floor.restart:
        return resume
    if strict:
        says = "is missing" if resume is None else f"says restart {resume.restart}"
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


def fence(run_dir: str | os.PathLike, epoch: int) -> None:
    """From now on this process publishes into `run_dir` as incarnation `epoch` (its restart count): a
    publish after a newer incarnation started is refused, and its steps carry the epoch, so readers can
    tell a stale process's late step from the steps rl.prepare kept. Roles call it once, at start."""
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise ValueError(f"fence({run_dir}): epoch {epoch!r} is not a non-negative integer")
    _FENCES[str(Path(run_dir).resolve())] = epoch


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
    known = max(mine, _SEEN.get(key, 0))
    # Missing while this process knows only incarnation 0 is a run before its first prepare (roles started
    # by hand, in-process tests): no older incarnation exists that a missing record could let back in.
    if (now is None and known > 0) or (now is not None and now.restart < known):
        # a count that went backwards: believing it would let a process of an older incarnation (which
        # this one may be: it saw a newer count before) publish again
        says = "is missing" if now is None else f"says restart {now.restart}"
        raise Fenced(f"{what}: refused: {Path(run_dir) / RESUME} {says}, but this process belongs to or has "
                     f"seen incarnation {known} of {run_dir}: the record went backwards")


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def step_dir(run_dir: str | os.PathLike, kind: str, step: int) -> Path:
    return Path(run_dir) / kind / step_name(step)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    fd = _open_regular(Path(path))
    try:
        return sha256_fd(fd, chunk)
    finally:
        os.close(fd)


def sha256_fd(fd: int, chunk: int = 1 << 22) -> str:
    h, off = hashlib.sha256(), 0
    while b := os.pread(fd, chunk, off):
        h.update(b)
        off += len(b)
    return h.hexdigest()


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: should a FIFO be swapped in after the lstat, opening it still returns at once (and fstat
# refuses it); on a regular file the flag changes nothing.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _what(mode: int) -> str:
    return ("a symlink" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode) else
            "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")


def _open_regular(path: Path, dir_fd: int | None = None, name: str | None = None) -> int:
    """fd of the regular file `path` (or `name` in `dir_fd`), never following a final symlink, never
    blocking on a FIFO; CorruptStep naming `path` otherwise (FileNotFoundError when it does not exist)."""
    name = name if name is not None else str(path)
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode):
        raise CorruptStep(f"{path}: {_what(st.st_mode)}, not a regular file")
    fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise CorruptStep(f"{path}: replaced while being opened ({_what(now.st_mode)})")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str | os.PathLike) -> bytes:
    """The bytes of a small regular file (a record, a manifest); CorruptStep for a symlink, FIFO, device
    or directory, without opening it (FileNotFoundError when missing)."""
    fd = _open_regular(Path(path))
    try:
        return _read_fd(fd)
    finally:
        os.close(fd)


def _read_fd(fd: int) -> bytes:
    parts, off = [], 0
    while b := os.pread(fd, 1 << 22, off):
        parts.append(b)
        off += len(b)
    return b"".join(parts)


def _rel_ok(rel) -> bool:
    """`rel` names a path inside a step: relative, no `.`/`..`/empty component, no backslash or NUL."""
    return (isinstance(rel, str) and bool(rel) and not rel.startswith("/") and "\\" not in rel
            and "\0" not in rel and not any(part in ("", ".", "..") for part in rel.split("/")))


def open_in_step(step: str | os.PathLike, rel: str, *, missing_ok: bool = False) -> int | None:
    """fd (the caller closes it) of the regular file `rel` of the step directory `step`. The step itself
    and every component of `rel` are opened without following symlinks, the file non-blocking and
    fstat-checked, so nothing but a regular file inside the step's own directory tree is ever read:
    CorruptStep naming the path otherwise. A missing file: CorruptStep, or None with `missing_ok`."""
    step = Path(step)
    if not _rel_ok(rel):
        raise CorruptStep(f"{step}: {rel!r} is not a path inside the step")
    parts = rel.split("/")
    where = step
    try:
        dfd = os.open(step, _DIR_FLAGS)
    except OSError as e:
        raise _step_dir_error(step, e) from None
    try:
        for part in parts[:-1]:
            where = where / part
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=dfd)
            except OSError as e:
                if e.errno == errno.ENOENT and missing_ok:
                    return None
                raise CorruptStep(f"{where}: {_os_words(e)}, not a directory of the step") from None
            os.close(dfd)
            dfd = nfd
        try:
            return _open_regular(step / rel, dir_fd=dfd, name=parts[-1])
        except FileNotFoundError:
            if missing_ok:
                return None
            raise CorruptStep(f"{step / rel}: missing") from None
    finally:
        os.close(dfd)


def read_in_step(step: str | os.PathLike, rel: str, *, missing_ok: bool = False) -> bytes | None:
    """The bytes of the regular file `rel` of `step` (`open_in_step`)."""
    fd = open_in_step(step, rel, missing_ok=missing_ok)
    if fd is None:
        return None
    try:
        return _read_fd(fd)
    finally:
        os.close(fd)


def _os_words(e: OSError) -> str:
    return {errno.ELOOP: "a symlink", errno.ENOTDIR: "not a directory",
            errno.ENOENT: "missing"}.get(e.errno, e.strerror or str(e))


def _step_dir_error(step: Path, e: OSError) -> CorruptStep:
    if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(step):
        # another run's step linked in would verify against its own manifest: not this run's step
        return CorruptStep(f"{step}: a symlink (to {os.readlink(step)}), not a step directory")
    return CorruptStep(f"{step}: {_os_words(e)}, not a step directory")


def _check_tree(step: Path) -> None:
    """Refuse a step holding anything a producer never writes: a symlink, FIFO, socket or device, listed
    in the manifest or not (lstat only: nothing is opened)."""
    todo = [step]
    while todo:
        d = todo.pop()
        with os.scandir(d) as it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    todo.append(Path(e.path))
                elif not e.is_file(follow_symlinks=False):
                    mode = e.stat(follow_symlinks=False).st_mode
                    raise CorruptStep(f"{e.path}: {_what(mode)} inside the step (producers write only "
                                      f"regular files)")


def _remove(p: Path) -> None:
    """Remove a step-like entry: a symlink (a corrupt step) is unlinked, never followed into what it
    names; a directory is removed with its contents."""
    if p.is_symlink() or not p.is_dir():
        p.unlink(missing_ok=True)
    else:
        shutil.rmtree(p, ignore_errors=True)


@dataclass
class Published:
    path: Path
    step: int
    manifest: dict


def publish(run_dir: str | os.PathLike, kind: str, step: int, write: Callable[[Path], None], *,
            producer: str, policy_version: int | None = None, meta: dict | None = None,
            checksum: bool = True, overwrite: bool = False) -> Published:
    """Publish `RUN_DIR/kind/step_N` atomically. `write(tmp_dir)` fills the directory.

    If step_N already exists it is left alone (another incarnation of this producer published it
    before a crash) unless `overwrite`, in which case the old one is moved aside then removed after the
    new one is in place.
    """
    final = step_dir(run_dir, kind, step)
    if final.exists() and not overwrite:
        return Published(final, step, read_manifest(final))
    tmp = begin(run_dir, kind, step)
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return commit(run_dir, kind, step, tmp, producer=producer, policy_version=policy_version, meta=meta,
                  checksum=checksum, overwrite=overwrite)


def begin(run_dir: str | os.PathLike, kind: str, step: int, token: str | None = None) -> Path:
    """The private directory a step is written into before `commit`: `kind/step_N.tmp-<token>`.

    Several writers (the ranks of one trainer) share one directory by passing the same `token`; without
    one, a fresh random directory is made."""
    base = Path(run_dir) / kind
    base.mkdir(parents=True, exist_ok=True)
    tmp = base / f"{step_name(step)}.tmp-{token or uuid.uuid4().hex[:10]}"
    tmp.mkdir(exist_ok=token is not None)
    return tmp


def commit(run_dir: str | os.PathLike, kind: str, step: int, tmp: Path, *, producer: str,
           policy_version: int | None = None, meta: dict | None = None, checksum: bool = True,
           overwrite: bool = False, known: dict[str, dict] | None = None) -> Published:
    """Write the manifest of the filled `tmp` (from `begin`) and rename it to `kind/step_N`.

    Every file is fsynced and listed with its size and, with `checksum`, its sha256; `known` gives the
    entries of files whose writer already fsynced them and recorded how to verify them (the weight
    shards: a size here, per-tensor digests in a file of their own), so they are not read again. A step
    that appeared meanwhile is kept and `tmp` dropped, unless `overwrite`. On any error `tmp` is removed.
    """
    base = Path(run_dir) / kind
    final = base / step_name(step)
    known = known or {}
    try:
        files = {}
        for p in sorted(tmp.rglob("*")):
            if p.is_symlink() or not (p.is_file() or p.is_dir()):
                # verify refuses these in a published step: refuse them here, where the producer is named
                raise ValueError(f"{p}: {_what(p.lstat().st_mode)} in a step being published; producers "
                                 f"write regular files only")
            if p.is_file():
                rel = p.relative_to(tmp).as_posix()
                if rel == MANIFEST:
                    raise ValueError(f"{kind}/{step_name(step)}: producer wrote {MANIFEST} itself")
                if rel in known:
                    files[rel] = dict(known[rel])
                    if files[rel].get("size") != p.stat().st_size:
                        raise ValueError(f"{p}: {p.stat().st_size} bytes, its writer recorded "
                                         f"{files[rel].get('size')}")
                    continue
                _fsync_path(p)
                files[rel] = {"size": p.stat().st_size, **({"sha256": sha256_file(p)} if checksum else {})}
        if missing := sorted(set(known) - set(files)):
            raise ValueError(f"{kind}/{step_name(step)}: {len(missing)} recorded file(s) missing, "
                             f"first {missing[0]}")
        crash_point("commit.before_manifest")
        epoch = _check_fence(run_dir, kind, step)
        manifest = {
            "kind": kind, "step": step, "policy_version": policy_version, "producer": producer,
            "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), "files": files,
            "meta": meta or {}, **({"epoch": epoch} if epoch is not None else {}),
            **({"slurm_job_id": os.environ["SLURM_JOB_ID"]} if os.environ.get("SLURM_JOB_ID") else {}),
        }
        atomic_write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        _fsync_path(tmp)
        _check_fence(run_dir, kind, step)  # again just before the rename: the window is the rename itself
        crash_point("commit.before_rename")
        if final.exists():
            if not overwrite:
                shutil.rmtree(tmp, ignore_errors=True)
                return Published(final, step, read_manifest(final))
            # not `.tmp-`: until the new step is in place the aside is the only copy (restore_asides)
            aside = base / f"{step_name(step)}.aside-{uuid.uuid4().hex[:8]}"
            os.rename(final, aside)
            crash_point("commit.between_renames")
            os.rename(tmp, final)
            _remove(aside)
        else:
            try:
                os.rename(tmp, final)  # onto a step that appeared since the check: refused (not empty)
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not final.exists():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
                return Published(final, step, read_manifest(final))
        _fsync_path(base)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Published(final, step, manifest)


def read_manifest(path: str | os.PathLike) -> dict:
    """The step's manifest, checked for shape (not against the files: `verify`); CorruptStep if malformed."""
    path = Path(path)
    try:
        raw = read_in_step(path, MANIFEST, missing_ok=True)
        if raw is None:
            raise CorruptStep(f"{path}: no {MANIFEST}")
        manifest = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptStep(f"{path}/{MANIFEST}: not valid JSON ({e})") from None
    _check_manifest(path, manifest)
    return manifest


def _check_manifest(path: Path, manifest) -> None:
    where = f"{path}/{MANIFEST}"
    if not isinstance(manifest, dict):
        raise CorruptStep(f"{where}: not a JSON object")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CorruptStep(f"{where}: `files` must map file names to their size and checksum, "
                          f"found {type(files).__name__}")
    for rel, info in files.items():
        if not _rel_ok(rel) or rel == MANIFEST:
            raise CorruptStep(f"{where}: files entry {rel!r} is not a path inside the step")
        size = info.get("size") if isinstance(info, dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise CorruptStep(f"{where}: files entry {rel!r} has no size (a non-negative integer)")
        if "sha256" in info and not (isinstance(info["sha256"], str) and _SHA256_RE.match(info["sha256"])):
            raise CorruptStep(f"{where}: files entry {rel!r} has a malformed sha256")


def verify(path: str | os.PathLike, checksums: bool = True) -> dict:
    """Check every file of a published step against its manifest; return the manifest or raise CorruptStep."""
    path = Path(path)
    manifest = read_manifest(path)  # opens the step without following it: a linked-in step is refused
    epoch = manifest.get("epoch")
    if epoch is not None and (now := incarnation(path.parent.parent, strict=False)) is not None:
        if epoch < now.restart and now.time > 0 and manifest.get("time", 0.0) > now.time:
            # published by an earlier incarnation after rl.prepare started a newer one: a stale process
            raise CorruptStep(f"{path}: published by incarnation {epoch} after incarnation {now.restart} "
                              f"started (a stale process's step)")
    for rel, info in manifest["files"].items():
        f = path / rel
        if os.path.islink(f):
            try:
                real = f.resolve()
            except (OSError, RuntimeError):  # a symlink loop
                real = f
            leaves = "" if real.is_relative_to(path.resolve()) else f" leaves the step (resolves to {real}) and"
            raise CorruptStep(f"{f}: files entry {rel!r}{leaves} is a symlink, not a file of the step")
        try:
            fd = open_in_step(path, rel)
        except CorruptStep as e:
            raise CorruptStep(f"files entry {rel!r}: {e}") from None
        try:
            size = os.fstat(fd).st_size
            if size != info["size"]:
                raise CorruptStep(f"{f}: {size} bytes, manifest says {info['size']} (truncated?)")
            if checksums and "sha256" in info and sha256_fd(fd) != info["sha256"]:
                raise CorruptStep(f"{f}: sha256 does not match the manifest")
        finally:
            os.close(fd)
    _check_tree(path)
    return manifest


def list_steps(run_dir: str | os.PathLike, kind: str) -> list[int]:
    """Steps of `kind` whose directory is in place (complete by construction), ascending."""
    base = Path(run_dir) / kind
    if not base.is_dir():
        return []
    steps = []
    for entry in os.scandir(base):
        m = _STEP_RE.match(entry.name)
        # a symlink named like a step is listed (it occupies the name) so that readers verify it, refuse
        # it and set it aside; what it points to is never looked at
        if m and (entry.is_dir(follow_symlinks=False) or entry.is_symlink()):
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest_complete(run_dir: str | os.PathLike, kind: str, checksums: bool = False) -> int | None:
    """Newest step of `kind` that verifies; corrupted ones are skipped (and reported once)."""
    for step in reversed(list_steps(run_dir, kind)):
        try:
            verify(step_dir(run_dir, kind, step), checksums=checksums)
            return step
        except CorruptStep as e:
            print(f"[exchange] skipping {kind}/{step_name(step)}: {e}", flush=True)
    return None


def set_aside(run_dir: str | os.PathLike, kind: str, step: int) -> Path:
    """Move a step that failed verification to `<kind>/corrupt/step_N-<time>`: out of every reader's
    sight (one atomic rename), kept for inspection, never deleted here."""
    corrupt_dir = paths.corrupt_dir
    src = step_dir(run_dir, kind, step)
    dest = corrupt_dir(run_dir, kind) / f"{src.name}-{int(time.time())}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    while dest.exists():
        dest = dest.with_name(f"{dest.name}-{uuid.uuid4().hex[:4]}")
    os.rename(src, dest)
    return dest


def restore_asides(run_dir: str | os.PathLike, kinds: Iterable[str]) -> list[str]:
    """Finish overwrites a crash interrupted (see the module docstring): an aside whose step is missing
    is renamed back (the old, complete step returns), one whose step is in place is removed. Call only
    when no producer of `kinds` runs (rl.prepare): a live overwrite sits between its renames for a moment.
    Returns what was done, one entry per aside: 'restored kind/step_N' or 'removed kind/<aside>'."""
    done = []
    for kind in kinds:
        base = Path(run_dir) / kind
        if not base.is_dir():
            continue
        for p in sorted(base.iterdir()):
            m = _ASIDE_RE.match(p.name)
            if not m:
                continue
            final = base / m.group(1)
            if os.path.lexists(final):
                _remove(p)
                done.append(f"removed {kind}/{p.name}")
            else:
                os.rename(p, final)
                done.append(f"restored {kind}/{final.name}")
    return done


def wait_for(run_dir: str | os.PathLike, kind: str, step: int, *, timeout: float | None = None,
             poll: float = 0.2, should_stop: Callable[[], bool] | None = None) -> Path | None:
    """Block until `kind/step_N` exists. Returns None on timeout or when should_stop() says so."""
    path = step_dir(run_dir, kind, step)
    deadline = None if timeout is None else time.monotonic() + timeout
    while not path.is_dir():
        if should_stop is not None and should_stop():
            return None
        if deadline is not None and time.monotonic() > deadline:
            return None
        time.sleep(poll)
    return path


def clean_tmp(run_dir: str | os.PathLike, kinds: Iterable[str]) -> int:
    """Remove `*.tmp-*` leftovers of crashed producers. Call only when no producer of `kinds` is running."""
    n = 0
    for kind in kinds:
        base = Path(run_dir) / kind
        if not base.is_dir():
            continue
        for p in base.iterdir():
            if ".tmp-" in p.name:
                _remove(p)
                n += 1
    return n


def discard_after(run_dir: str | os.PathLike, kind: str, step: int) -> list[int]:
    """Remove steps of `kind` newer than `step` (a resume that restarts from an older checkpoint)."""
    gone = [s for s in list_steps(run_dir, kind) if s > step]
    for s in gone:
        p = step_dir(run_dir, kind, s)
        trash = p.with_name(p.name + f".tmp-discard-{uuid.uuid4().hex[:6]}")
        os.rename(p, trash)  # atomic: a reader sees either the whole step or nothing
        _remove(trash)
    return gone


class ConsumedLog:
    """Append-only record of consumed steps, `<kind>/consumed.jsonl`, one JSON line per consumption."""

    def __init__(self, run_dir: str | os.PathLike, kind: str, consumer: str):
        consumed_log = paths.consumed_log
        self.path = consumed_log(run_dir, kind)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.consumer = consumer

    def record(self, step: int, **extra) -> None:
        check_fence(self.path.parent.parent, f"{self.path.name}: step {step}")
        append_jsonl(self.path, {"step": step, "consumer": self.consumer, "time": time.time(), **extra})

    def entries(self) -> list[dict]:
        return [e for e in read_jsonl(self.path) if e.get("consumer") == self.consumer]

    def steps(self) -> list[int]:
        return [e["step"] for e in self.entries()]


DELTA = "delta.json"  # rl.exchange.shards.DELTA
# A chain longer than this is refused outright. Real chains are at most trainer.weights_full_every long
# (a full version comes that often); the bound keeps a crafted one from costing more than a refusal.
MAX_DELTA_CHAIN = 10_000


def parse_delta(path: str | os.PathLike, data: bytes) -> int:
    """The base of the delta step at `path` from the bytes of its delta.json: a JSON object whose `base`
    is a step number below the step's own (a delta only ever applies to an earlier version, so a chain
    strictly descends and cannot loop); CorruptStep naming the file and value otherwise."""
    path = Path(path)
    try:
        base = json.loads(data).get("base")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        raise CorruptStep(f"{path / DELTA}: not a JSON object") from None
    if not isinstance(base, int) or isinstance(base, bool) or base < 0:
        raise CorruptStep(f"{path / DELTA}: base={base!r} is not a step number")
    m = _STEP_RE.match(path.name)
    if m and base >= int(m.group(1)):
        raise CorruptStep(f"{path / DELTA}: base={base} is not an earlier step than {path.name} (a delta "
                          f"chain that loops)")
    return base


def delta_base(path: str | os.PathLike) -> int | None:
    """The step a published step is a delta against (its `delta.json`), or None for a full step."""
    data = read_in_step(path, DELTA, missing_ok=True)
    return None if data is None else parse_delta(path, data)


def delta_chain(path: str | os.PathLike) -> list[Path]:
    """The step at `path` and the steps its delta chain goes through, newest first, down to a full one.
    Iterated (never recursed) with a visited set and `MAX_DELTA_CHAIN`: a cycle or an endless chain is
    CorruptStep naming the step where it closes. Bases live beside `path`, in the same kind directory."""
    chain, seen = [Path(path)], {Path(path).name}
    while (b := delta_base(chain[-1])) is not None:
        nxt = chain[-1].parent / step_name(b)
        if nxt.name in seen:
            raise CorruptStep(f"{chain[-1] / DELTA}: base {b} is already in the chain of {chain[0].name} "
                              f"(a delta chain that loops)")
        if len(chain) >= MAX_DELTA_CHAIN:
            raise CorruptStep(f"{chain[0]}: delta chain longer than {MAX_DELTA_CHAIN} steps")
        seen.add(nxt.name)
        chain.append(nxt)
    return chain
