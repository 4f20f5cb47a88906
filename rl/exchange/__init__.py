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
object with a `files` mapping of relative paths confined to the step (no `..`, no absolute path, no
symlink that resolves outside) to non-negative sizes; anything else is `CorruptStep` naming the entry,
which every consumer already handles by skipping or setting the step aside.

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
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

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
RESUME = "resume.json"  # rl.contract.paths.RESUME: rl.prepare's record of the incarnation


def _incarnation(run_dir: Path) -> tuple[int, float, str | None] | None:
    """(restart count, the time rl.prepare started it, the Slurm job that runs it) of the run's newest
    incarnation, if recorded. The restart count is the epoch: every job's prepare increments it, so it
    stays monotonic across jobs (a requeue keeps the job id, a resubmission gets a new one)."""
    try:
        r = json.loads((Path(run_dir) / RESUME).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return int(r.get("restart", 0)), float(r.get("time", 0.0)), r.get("slurm_job_id")


def _job_words(job: str | None) -> str:
    return f" (Slurm job {job})" if job else ""


def fence(run_dir: str | os.PathLike, epoch: int) -> None:
    """From now on this process publishes into `run_dir` as incarnation `epoch` (its restart count): a
    publish after a newer incarnation started is refused, and its steps carry the epoch, so readers can
    tell a stale process's late step from the steps rl.prepare kept. Roles call it once, at start."""
    _FENCES[str(Path(run_dir).resolve())] = int(epoch)


def _check_fence(run_dir: str | os.PathLike, kind: str, step: int) -> int | None:
    """check_fence for a step about to be committed; returns the epoch its manifest records."""
    check_fence(run_dir, f"{kind}/{step_name(step)}")
    return _FENCES.get(str(Path(run_dir).resolve()))


def check_fence(run_dir: str | os.PathLike, what: str) -> None:
    """Raise Fenced if this process's incarnation of `run_dir` is no longer the newest: for writes
    outside steps (log records, metrics) and for a role that wakes up (a stopped process continued after
    its successor started must not train, consume or record anything). No-op for unfenced processes."""
    mine = _FENCES.get(str(Path(run_dir).resolve()))
    if mine is None:
        return
    now = _incarnation(Path(run_dir))
    if now is not None and now[0] > mine:
        own = os.environ.get("SLURM_JOB_ID")
        raise Fenced(f"{what}: refused: this process belongs to incarnation {mine}{_job_words(own)} of "
                     f"{run_dir}, and incarnation {now[0]}{_job_words(now[2])} has started since ({RESUME})")


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
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write one text file atomically (tmp + fsync + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    """Write one JSON file atomically (tmp + fsync + rename): for small state files outside steps."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


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
        _atomic_write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
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
            shutil.rmtree(aside, ignore_errors=True)
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
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CorruptStep(f"{path}: no {MANIFEST}") from None
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
        parts = rel.split("/")
        if (not rel or rel.startswith("/") or "\\" in rel or "\0" in rel
                or any(part in ("", ".", "..") for part in parts) or rel == MANIFEST):
            raise CorruptStep(f"{where}: files entry {rel!r} is not a path inside the step")
        size = info.get("size") if isinstance(info, dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise CorruptStep(f"{where}: files entry {rel!r} has no size (a non-negative integer)")
        if "sha256" in info and not (isinstance(info["sha256"], str) and _SHA256_RE.match(info["sha256"])):
            raise CorruptStep(f"{where}: files entry {rel!r} has a malformed sha256")


def verify(path: str | os.PathLike, checksums: bool = True) -> dict:
    """Check every file of a published step against its manifest; return the manifest or raise CorruptStep."""
    path = Path(path)
    manifest = read_manifest(path)
    epoch = manifest.get("epoch")
    if epoch is not None and (now := _incarnation(path.parent.parent)) is not None:
        if epoch < now[0] and now[1] > 0 and manifest.get("time", 0.0) > now[1]:
            # published by an earlier incarnation after rl.prepare started a newer one: a stale process
            raise CorruptStep(f"{path}: published by incarnation {epoch} after incarnation {now[0]} "
                              f"started (a stale process's step)")
    root = path.resolve()
    for rel, info in manifest["files"].items():
        f = path / rel
        try:
            real = f.resolve()
        except (OSError, RuntimeError) as e:  # a symlink loop
            raise CorruptStep(f"{f}: files entry {rel!r} does not resolve ({e})") from None
        if not real.is_relative_to(root):
            raise CorruptStep(f"{f}: files entry {rel!r} leaves the step (resolves to {real})")
        if not f.is_file():
            raise CorruptStep(f"{f}: listed in the manifest but missing")
        size = f.stat().st_size
        if size != info["size"]:
            raise CorruptStep(f"{f}: {size} bytes, manifest says {info['size']} (truncated?)")
        if checksums and "sha256" in info and sha256_file(f) != info["sha256"]:
            raise CorruptStep(f"{f}: sha256 does not match the manifest")
    return manifest


def list_steps(run_dir: str | os.PathLike, kind: str) -> list[int]:
    """Steps of `kind` whose directory is in place (complete by construction), ascending."""
    base = Path(run_dir) / kind
    if not base.is_dir():
        return []
    steps = []
    for entry in os.scandir(base):
        m = _STEP_RE.match(entry.name)
        if m and entry.is_dir():
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
    from rl.contract.paths import corrupt_dir
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
            if final.exists():
                shutil.rmtree(p, ignore_errors=True)
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
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                n += 1
    return n


def discard_after(run_dir: str | os.PathLike, kind: str, step: int) -> list[int]:
    """Remove steps of `kind` newer than `step` (a resume that restarts from an older checkpoint)."""
    gone = [s for s in list_steps(run_dir, kind) if s > step]
    for s in gone:
        p = step_dir(run_dir, kind, s)
        trash = p.with_name(p.name + f".tmp-discard-{uuid.uuid4().hex[:6]}")
        os.rename(p, trash)  # atomic: a reader sees either the whole step or nothing
        shutil.rmtree(trash, ignore_errors=True)
    return gone


class ConsumedLog:
    """Append-only record of consumed steps, `<kind>/consumed.jsonl`, one JSON line per consumption."""

    def __init__(self, run_dir: str | os.PathLike, kind: str, consumer: str):
        from rl.contract.paths import consumed_log
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


def delta_base(path: str | os.PathLike) -> int | None:
    """The step a published step is a delta against (its `delta.json`), or None for a full step."""
    try:
        return int(json.loads((Path(path) / "delta.json").read_text())["base"])
    except FileNotFoundError:
        return None


# Retention lives in its own module; re-exported so every caller keeps spelling it exchange.prune.
from rl.exchange.retention import corrupt_steps, prune, served_versions, weights_in_use  # noqa: E402,F401
