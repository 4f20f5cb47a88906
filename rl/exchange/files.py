"""Reading a published step's files safely: what is in a step is data from the shared filesystem.

A step is what it claims to be on disk: producers only ever write real directories and regular files, so
a step directory that is a symlink (another run's step linked in would verify against its own manifest),
and any symlink, FIFO, socket or device inside a step, listed or not, is refused (`_check_tree`). Files
of a step are opened through `open_in_step`: every path component without following symlinks, the file
itself non-blocking and checked with fstat to be a regular file, so a FIFO swapped in cannot block a
reader and a link cannot lead it elsewhere. Everything that fails raises `CorruptStep` naming the path,
which every consumer handles by skipping the step or setting it aside.

The leaf of rl.exchange (split from its `__init__`, issue 23): the steps (rl.exchange.steps) and the
fencing (rl.exchange.fencing) read through it; it imports nothing else of the package. Names with a
leading underscore are the package's own (its sibling modules use them), not an API.
"""
from __future__ import annotations

import errno
import hashlib
import os
import re
import stat
from pathlib import Path

from rl.contract import safefs

MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step_(\d{6,})$")


class CorruptStep(RuntimeError):
    """A published step whose files do not match its manifest."""


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


def rel_ok(rel) -> bool:
    """`rel` names a path inside a step: relative, no `.`/`..`/empty component, no backslash or NUL."""
    return (isinstance(rel, str) and bool(rel) and not rel.startswith("/") and "\\" not in rel
            and "\0" not in rel and not any(part in ("", ".", "..") for part in rel.split("/")))


def open_in_step(step: str | os.PathLike, rel: str, *, missing_ok: bool = False) -> int | None:
    """fd (the caller closes it) of the regular file `rel` of the step directory `step`. The step itself
    and every component of `rel` are opened without following symlinks, the file non-blocking and
    fstat-checked, so nothing but a regular file inside the step's own directory tree is ever read:
    CorruptStep naming the path otherwise. A missing file: CorruptStep, or None with `missing_ok`."""
    step = Path(step)
    if not rel_ok(rel):
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
    names; a directory is removed with its contents, relative to its parent opened without following a
    link (rl.contract.safefs.remove: a kind directory swapped for a link is refused, not emptied)."""
    safefs.remove(p)
