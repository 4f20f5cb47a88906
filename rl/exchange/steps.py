"""Publishing, verifying, listing and retiring the step directories of a run.

A producer writes into a private `kind/step_N.tmp-<random>/` (`begin`), fsyncs every file, writes
`manifest.json` (files, sizes, sha256, producer, policy version, epoch, time) last, fsyncs the directory
and renames it into place (`commit`; `publish` does both around a writer callback). rename(2) of a
directory is atomic on POSIX filesystems and on Lustre, so a directory named `step_N` is complete by
construction and readers never look at `*.tmp-*`. Readers still verify sizes (cheap) and, where the data
is about to be trained on or loaded into a server, checksums (`verify`).

A manifest is data from the shared filesystem, so it is checked before it is believed: a JSON object with
a `files` mapping of relative paths confined to the step (no `..`, no absolute path) to non-negative
sizes; anything else is `CorruptStep` naming the entry. A symlink named like a step is still listed
(`list_steps`): it occupies the step's name, so consumers verify it, refuse it and set it aside like any
corrupt step.

An overwrite (`commit(..., overwrite=True)`, the trainer re-saving a checkpoint step) renames the old
step to `step_N.aside-<token>` before renaming the new one in. A crash between the two leaves only the
aside; `restore_asides` (run by rl.prepare, while no producer runs) renames it back when `step_N` is
missing and removes it otherwise. The aside name deliberately lacks `.tmp-`, so `clean_tmp` never
deletes the only copy of a step. A weights step may be a delta against an earlier one (`delta.json`):
`delta_chain` follows the bases down to a full step, refusing loops.

Split from rl/exchange/__init__.py (issue 23): the files are read through rl.exchange.files, the
epoch checks are rl.exchange.fencing's.
"""
from __future__ import annotations

import errno
import json
import os
import re
import socket
import stat
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from rl.contract import paths, privdirs, record_schemas, safefs
from rl.contract.atomic import atomic_write_bytes
from rl.faults import crash_point

from rl.exchange.fencing import _check_fence, check_fence, incarnation
from rl.exchange.files import (MANIFEST, _STEP_RE, CorruptStep, _check_tree, _fsync_path, _remove, _what,
                               open_in_step, read_in_step, rel_ok, sha256_fd, sha256_file, step_dir, step_name)
from rl.exchange.jsonl import append_jsonl, read_jsonl

_ASIDE_RE = re.compile(r"^(step_\d{6,})\.aside-[0-9a-f]+$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


@dataclass
class Published:
    path: Path
    step: int
    manifest: dict


def publish(run_dir: str | os.PathLike, kind: str, step: int, write: Callable[[Path], "dict | None"], *,
            producer: str, policy_version: int | None = None, meta: dict | None = None,
            checksum: bool = True, overwrite: bool = False, hashed: bool = False,
            named: bool = False) -> Published:
    """Publish `RUN_DIR/kind/step_N` atomically. `write(tmp_dir)` fills the directory; with `hashed` it
    returns the manifest entries {size, sha256} of the files it fsynced and hashed as it wrote them
    (rl.contract.batch.write_arrays), which are not read again. `tmp_dir` is the `/proc/self/fd/<fd>`
    path of the private directory `begin` made (rl.contract.privdirs.pinned_dir): whatever `write` hands a
    library lands in that directory even if someone renames it and plants a link at its name meanwhile;
    rl.contract.safefs functions accept it like any other path. With `named`, `write(tmp_dir, name)`
    also gets the directory's name in the run directory (for other processes, which pin it themselves).

    If step_N already exists it is left alone (another incarnation of this producer published it
    before a crash) unless `overwrite`, in which case the old one is moved aside then removed after the
    new one is in place.
    """
    final = step_dir(run_dir, kind, step)
    if safefs.lstat(final) is not None and not overwrite:  # a link in its place: read_manifest refuses it
        return Published(final, step, read_manifest(final))
    tmp = begin(run_dir, kind, step)
    ident = None
    try:
        with privdirs.pinned_dir(tmp) as pinned:  # the writer is handed the opened directory, not its name
            ident = _ident(pinned)
            known = write(pinned, tmp) if named else write(pinned)
    except BaseException:
        _drop(tmp, ident)
        raise
    return commit(run_dir, kind, step, tmp, producer=producer, policy_version=policy_version, meta=meta,
                  checksum=checksum, overwrite=overwrite, known=known if hashed else None)


def begin(run_dir: str | os.PathLike, kind: str, step: int, token: str | None = None) -> Path:
    """The private directory a step is written into before `commit`: `kind/step_N.tmp-<token>`.

    Several writers (the ranks of one trainer) share one directory by passing the same `token`; without
    one, a fresh random directory is made. Both are made through rl.contract.safefs: a symlink at the kind
    directory or anywhere on the way is refused (UnsafePath), so the private directory a producer hands
    to its libraries (safetensors, torch) is a real directory of this run and nothing inside it existed
    before (a fresh name, or the shared token's directory, which is itself refused if it is a link).

    The directory is mode 0700 and this user's own: a writer pins it (rl.contract.privdirs.pinned_dir,
    which refuses anything else) and hands libraries the pinned path, never this name, which someone who
    can write the kind directory could rename and replace while the library writes."""
    base = Path(run_dir) / kind
    tmp = base / f"{step_name(step)}.tmp-{token or uuid.uuid4().hex[:10]}"
    if token is None:
        safefs.mkdir(tmp, mode=0o700)
    else:
        privdirs.make_private_dir(tmp)
    return tmp


def commit(run_dir: str | os.PathLike, kind: str, step: int, tmp: Path, *, producer: str,
           policy_version: int | None = None, meta: dict | None = None, checksum: bool = True,
           overwrite: bool = False, known: dict[str, dict] | None = None) -> Published:
    """Write the manifest of the filled `tmp` (from `begin`) and rename it to `kind/step_N`.

    Every file is fsynced and listed with its size and, with `checksum`, its sha256; `known` gives the
    entries of files whose writer already fsynced them and recorded how to verify them (the weight
    shards: a size here, per-tensor digests in a file of their own), so they are not read again. A step
    that appeared meanwhile is kept and `tmp` dropped, unless `overwrite`. On any error `tmp` is removed.

    `tmp` is read and the manifest written through the directory pinned by its fd
    (rl.contract.privdirs.pinned_dir: this user's, mode 0700), and the rename by name is checked to have
    moved that very directory: should someone who can write the kind directory have renamed it and put
    something else at its name, that is refused (UnsafePath) and whatever took the step's name removed,
    never published.
    """
    base = Path(run_dir) / kind
    final = base / step_name(step)
    known = known or {}
    aside = ident = None
    try:
        if not _inside(tmp, base) or not safefs.is_dir(tmp):
            raise ValueError(f"{tmp}: not a step directory made by begin() in {base}")
        with privdirs.pinned_dir(tmp) as pinned:
            ident = _ident(pinned)
            manifest = _manifest(run_dir, kind, step, pinned, tmp, known, checksum=checksum,
                                 producer=producer, policy_version=policy_version, meta=meta)
            os.chmod(pinned, _published_mode())  # private while written; published as mkdir would make it
            _check_fence(run_dir, kind, step)  # again just before the rename: the window is the rename itself
            crash_point("commit.before_rename")
            if not privdirs.same_dir(tmp, pinned):
                raise _replaced(tmp, base)
            if safefs.lstat(final) is not None:
                if not overwrite:
                    _drop(tmp, ident)
                    return Published(final, step, read_manifest(final))
                # not `.tmp-`: until the new step is in place the aside is the only copy (restore_asides)
                aside = base / f"{step_name(step)}.aside-{uuid.uuid4().hex[:8]}"
                safefs.rename(final, aside)
                crash_point("commit.between_renames")
                safefs.rename(tmp, final)
            else:
                try:
                    safefs.rename(tmp, final)  # onto a step that appeared since: refused (not empty)
                except OSError as e:
                    if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or safefs.lstat(final) is None:
                        raise
                    _drop(tmp, ident)
                    return Published(final, step, read_manifest(final))
            if not privdirs.same_dir(final, pinned):
                # renamed in between the check and the rename: what now has the step's name is not ours
                _remove(final)
                if aside is not None:
                    safefs.rename(aside, final)
                    aside = None
                raise _replaced(tmp, base)
        if aside is not None:
            _remove(aside)
        safefs.fsync_dir(base)
    except BaseException:
        if _inside(tmp, base):
            try:
                _drop(tmp, ident)
            except OSError:
                pass  # the error being raised says more than a failed cleanup (rl.prepare removes tmp dirs)
        raise
    return Published(final, step, manifest)


def _manifest(run_dir, kind: str, step: int, pinned: Path, tmp: Path, known: dict, *, checksum: bool,
              producer: str, policy_version, meta) -> dict:
    """List, fsync and hash the files of the pinned tmp dir (`tmp` is its name, for messages) and write
    its manifest.json there; the manifest."""
    files = {}
    for p in sorted(pinned.rglob("*")):
        rel = p.relative_to(pinned).as_posix()
        shown = tmp / rel
        if p.is_symlink() or not (p.is_file() or p.is_dir()):
            # verify refuses these in a published step: refuse them here, where the producer is named
            raise ValueError(f"{shown}: {_what(p.lstat().st_mode)} in a step being published; producers "
                             f"write regular files only")
        if p.is_file():
            if rel == MANIFEST:
                raise ValueError(f"{kind}/{step_name(step)}: producer wrote {MANIFEST} itself")
            if rel in known:
                files[rel] = dict(known[rel])
                if files[rel].get("size") != p.stat().st_size:
                    raise ValueError(f"{shown}: {p.stat().st_size} bytes, its writer recorded "
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
    atomic_write_bytes(pinned / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    safefs.fsync_dir(pinned)
    return manifest


def _published_mode() -> int:
    """The mode mkdir gives a directory under this process's umask, never group/other-writable: a
    published step can be read by whoever could read it before (nobody else can write it either way);
    only while it is written is it private (0700)."""
    umask = 0o022
    try:
        with open("/proc/self/status") as f:  # the umask, read without setting it (os.umask would race)
            umask = next((int(x.split()[1], 8) for x in f if x.startswith("Umask:")), umask)
    except OSError:
        pass
    return 0o777 & ~umask & ~0o022


def _replaced(tmp: Path, base: Path) -> safefs.UnsafePath:
    return safefs.UnsafePath(f"{tmp}: renamed and replaced while being published (someone else can write "
                             f"{base}); not published")


def _ident(pinned: Path) -> tuple[int, int]:
    st = os.stat(pinned)
    return st.st_dev, st.st_ino


def _drop(tmp: Path, ident: tuple[int, int] | None = None) -> None:
    """Remove a tmp step directory by name, only if the name is still ours: the directory `ident`
    (device, inode) names when given, else anything this user owns. What someone else put at the name
    is theirs, never followed or emptied; a tmp dir renamed away is left to clean_tmp."""
    st = safefs.lstat(tmp)
    if st is None:
        return
    if (st.st_dev, st.st_ino) == ident or (ident is None and st.st_uid == os.geteuid()):
        safefs.remove(tmp)


def _inside(tmp, base: Path) -> bool:
    return os.path.dirname(os.path.abspath(tmp)) == os.path.abspath(base)


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
        if not rel_ok(rel) or rel == MANIFEST:
            raise CorruptStep(f"{where}: files entry {rel!r} is not a path inside the step")
        size = info.get("size") if isinstance(info, dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise CorruptStep(f"{where}: files entry {rel!r} has no size (a non-negative integer)")
        if "sha256" in info and not (isinstance(info["sha256"], str) and _SHA256_RE.match(info["sha256"])):
            raise CorruptStep(f"{where}: files entry {rel!r} has a malformed sha256")


def verify(path: str | os.PathLike, checksums: bool = True, only=None) -> dict:
    """Check every file of a published step against its manifest (sizes, the tree; sha256 with
    `checksums`, of the files named in `only` when given: a trainer rank hashes its share, not the
    batch); return the manifest or raise CorruptStep."""
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
            if checksums and "sha256" in info and (only is None or rel in only) and sha256_fd(fd) != info["sha256"]:
                raise CorruptStep(f"{f}: sha256 does not match the manifest")
        finally:
            os.close(fd)
    _check_tree(path)
    return manifest


def list_steps(run_dir: str | os.PathLike, kind: str) -> list[int]:
    """Steps of `kind` whose directory is in place (complete by construction), ascending. The kind
    directory itself is opened through rl.contract.safefs: `RUN/rollouts` linked to another run's is
    UnsafePath, never listed as this run's own."""
    steps = []
    for name, mode in safefs.scandir(Path(run_dir) / kind):
        m = _STEP_RE.match(name)
        # a symlink named like a step is listed (it occupies the name) so that readers verify it, refuse
        # it and set it aside; what it points to is never looked at
        if m and (stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
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
    safefs.makedirs(dest.parent)
    while safefs.lstat(dest) is not None:
        dest = dest.with_name(f"{dest.name}-{uuid.uuid4().hex[:4]}")
    safefs.rename(src, dest)
    return dest


def restore_asides(run_dir: str | os.PathLike, kinds: Iterable[str]) -> list[str]:
    """Finish overwrites a crash interrupted (see the module docstring): an aside whose step is missing
    is renamed back (the old, complete step returns), one whose step is in place is removed. Call only
    when no producer of `kinds` runs (rl.prepare): a live overwrite sits between its renames for a moment.
    Returns what was done, one entry per aside: 'restored kind/step_N' or 'removed kind/<aside>'."""
    done = []
    for kind in kinds:
        base = Path(run_dir) / kind
        for name, _ in sorted(safefs.scandir(base)):
            m = _ASIDE_RE.match(name)
            if not m:
                continue
            p, final = base / name, base / m.group(1)
            if safefs.lstat(final) is not None:
                _remove(p)
                done.append(f"removed {kind}/{p.name}")
            else:
                safefs.rename(p, final)
                done.append(f"restored {kind}/{final.name}")
    return done


def wait_for(run_dir: str | os.PathLike, kind: str, step: int, *, timeout: float | None = None,
             poll: float = 0.2, should_stop: Callable[[], bool] | None = None) -> Path | None:
    """Block until `kind/step_N` exists. Returns None on timeout or when should_stop() says so. Whatever
    occupies the name ends the wait (a symlink or file in a step's place included: the consumer's verify
    refuses it and sets it aside); a link on the way to it is UnsafePath."""
    path = step_dir(run_dir, kind, step)
    deadline = None if timeout is None else time.monotonic() + timeout
    while safefs.lstat(path) is None:
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
        for name, _ in safefs.scandir(base):
            if ".tmp-" in name:
                _remove(base / name)
                n += 1
    return n


def discard_after(run_dir: str | os.PathLike, kind: str, step: int) -> list[int]:
    """Remove steps of `kind` newer than `step` (a resume that restarts from an older checkpoint)."""
    gone = [s for s in list_steps(run_dir, kind) if s > step]
    for s in gone:
        p = step_dir(run_dir, kind, s)
        trash = p.with_name(p.name + f".tmp-discard-{uuid.uuid4().hex[:6]}")
        safefs.rename(p, trash)  # atomic: a reader sees either the whole step or nothing
        _remove(trash)
    return gone


class ConsumedLog:
    """Append-only record of consumed steps, `<kind>/consumed.jsonl`, one JSON line per consumption."""

    def __init__(self, run_dir: str | os.PathLike, kind: str, consumer: str):
        consumed_log = paths.consumed_log
        self.path = consumed_log(run_dir, kind)
        safefs.makedirs(self.path.parent)
        self.consumer = consumer

    def record(self, step: int, **extra) -> None:
        check_fence(self.path.parent.parent, f"{self.path.name}: step {step}")
        append_jsonl(self.path, {"step": step, "consumer": self.consumer, "time": time.time(), **extra})

    def entries(self) -> list[dict]:
        return [e for e in read_jsonl(self.path, check=record_schemas.consumed) if e.get("consumer") == self.consumer]

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
