"""Opening files in the run directory without following a link someone else planted there.

The run directory sits on a shared filesystem that other users (a group, a team) may be able to write.
Anything found there is data, and a name in it may be a symlink to `~/.ssh/authorized_keys`, to another
run, or a FIFO that blocks whoever opens it. So every writer and every record reader goes through this
module, which opens a path one component at a time from `/` with O_NOFOLLOW (an `openat` walk, so a
link swapped in between a check and the open is refused too), creates missing directories as it goes,
opens the file itself with O_NOFOLLOW | O_NONBLOCK and checks it with fstat to be a regular file. What is
refused raises `UnsafePath` (an OSError) naming the path and what it is, in one line.

The rule is strict on purpose: no component of a written or read path may be a symlink, not only those
below the run directory. Every entry point (the launcher, each role's `--run-dir`, rl.prepare) resolves
the run directory with `resolve_run_dir` first, so a run directory reached through a symlink (`/scratch`
-> `/lustre/scratch`, a `latest` link) is named by its real path and everything under it must be real;
a link found afterwards was put there since, by someone else.

Who wrote a file matters as much as what it is. hetrl's trust boundary is the run's own user: a file in
a run directory is obeyed (read as a record, appended to, handed to a library) only if it is owned by the
user running the process and writable by nobody else (no group or other write bit, one link). Someone
who can write the directory, or a file in it, could otherwise plant a server address that receives the
run's secret, a command a role runs, or a grade it trains on. Every open below checks this with fstat on
the opened fd (no race with a rename), `check_private_dir` checks a run directory and its kind
directories at every entry point, and `private_umask` makes whatever a process and its children create
writable by its user alone. docs/run-directory-safety.md states the threat model.

A leaf of rl.contract: imports nothing of rl. Torch-free.
"""
from __future__ import annotations

import errno
import os
import stat
import uuid
from pathlib import Path

PathLike = str | os.PathLike

_DIR_WALK = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NOFOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnsafePath(OSError):
    """A path in the run directory that is not what hetrl writes there: a symlink, a FIFO, a device."""

    def __init__(self, message: str):
        super().__init__(errno.EPERM, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def what(mode: int) -> str:
    """The kind of a file, in words, from its st_mode."""
    return ("a symlink" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode) else
            "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
            "a regular file" if stat.S_ISREG(mode) else "not a regular file")


def _owner_problem(st: os.stat_result, shown: str, *, write: bool = False) -> UnsafePath | None:
    """Why a file or directory with stat `st` is not this user's own (None if it is)."""
    euid = os.geteuid()
    if st.st_uid != euid:
        return UnsafePath(f"{shown}: owned by uid {st.st_uid}, not by this run's user (uid {euid}); hetrl "
                          f"obeys only what its own user wrote in a run directory")
    if st.st_mode & 0o022:
        return UnsafePath(f"{shown}: mode {stat.S_IMODE(st.st_mode):04o}, writable by group or others; "
                          f"anyone who can write it could plant records there (chmod go-w {shown})")
    if write and stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
        return UnsafePath(f"{shown}: {st.st_nlink} hard links; a write would change the other names' "
                          f"file too (remove it and let hetrl write a new one)")
    return None


def private_umask() -> None:
    """Add 022 to this process's umask: what it and its children (vLLM, torch, Slurm's log files when
    it submits) create is writable by its user alone, whatever the login shell's umask (002 is common
    on group filesystems)."""
    old = os.umask(0o022)
    os.umask(old | 0o022)


def check_private_dir(path: PathLike) -> None:
    """Refuse (UnsafePath, one line) a directory that another user owns or can write: a run directory or
    one of its kind directories that someone else could plant records in. Missing is fine."""
    st = lstat(path)
    if st is None:
        return
    norm = os.path.normpath(os.path.abspath(os.fspath(path)))
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{norm}: {what(st.st_mode)}, not a directory")
    problem = _owner_problem(st, norm)
    if problem is not None:
        raise UnsafePath(f"{problem.message}; a run directory must be its user's alone")


def check_run_dir_private(run_dir: PathLike, subdirs=()) -> None:
    """`check_private_dir` for the run directory and each of `subdirs` (names below it) that exists."""
    check_private_dir(run_dir)
    for sub in subdirs:
        check_private_dir(Path(run_dir) / sub)


def resolve_run_dir(run_dir: PathLike) -> Path:
    """The run directory by its real path: the one place a symlink on the way to it is followed."""
    return Path(os.path.realpath(Path(run_dir).expanduser()))


def _parts(path: PathLike) -> tuple[str, list[str]]:
    norm = os.path.normpath(os.path.abspath(os.fspath(path)))
    return norm, [c for c in norm.split("/") if c]


def _describe(dir_fd: int, name: str, shown: str) -> UnsafePath:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError as e:
        return UnsafePath(f"{shown}: cannot be opened ({e.strerror})")
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(name, dir_fd=dir_fd)
        except OSError:
            target = "?"
        return UnsafePath(f"{shown}: a symlink (to {target}); hetrl never follows links in a run "
                          f"directory: remove it")
    return UnsafePath(f"{shown}: {what(st.st_mode)}, not what hetrl writes there")


def open_dir(path: PathLike, *, create: bool = False) -> int:
    """An O_PATH fd of directory `path`, every component opened without following a symlink; with
    `create`, missing directories are made (0o755, less the umask). UnsafePath for a link or a
    non-directory on the way; FileNotFoundError for a missing one without `create`. A path below
    `/proc/self/fd/<fd>` of a directory `pinned_dir` holds open is walked from that fd (the rest of the
    path without following a link), so every function here works on what a pinned writer is handed."""
    norm, comps = _parts(path)
    pinned = _pinned_start(comps)
    if pinned is not None:  # below a directory pinned_dir opened: walked from its fd, not from /proc
        fd, comps, shown = pinned
    else:
        fd = os.open("/", _DIR_WALK)
        shown = ""
    try:
        for c in comps:
            shown += "/" + c
            try:
                nfd = os.open(c, _DIR_WALK, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise FileNotFoundError(errno.ENOENT, "no such directory", shown) from None
                try:
                    os.mkdir(c, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass  # made by another process meanwhile: opened (and checked) below
                try:
                    nfd = os.open(c, _DIR_WALK, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise _not_dir(fd, c, shown) from None
                    raise
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _not_dir(fd, c, shown) from None
                raise
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _not_dir(dir_fd: int, name: str, shown: str) -> UnsafePath:
    e = _describe(dir_fd, name, shown)
    if "symlink" in e.message:
        return e
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    return UnsafePath(f"{shown}: {what(st.st_mode)}, not a directory")


def makedirs(path: PathLike) -> Path:
    """`mkdir -p` that refuses a symlink or non-directory on the way (UnsafePath); returns `path`."""
    os.close(open_dir(path, create=True))
    return Path(path)


def _open_file(path: PathLike, flags: int, mode: int, *, create_dirs: bool, foreign: bool = False) -> int:
    norm, comps = _parts(path)
    if not comps:
        raise UnsafePath(f"{path}: not a file path")
    dfd = open_dir("/" + "/".join(comps[:-1]), create=create_dirs)
    try:
        try:
            fd = os.open(comps[-1], flags | _NOFOLLOW, mode, dir_fd=dfd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.ENODEV, errno.ETXTBSY):
                st = os.stat(comps[-1], dir_fd=dfd, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    raise _describe(dfd, comps[-1], norm) from None
                raise UnsafePath(f"{norm}: {what(st.st_mode)}, not a regular file") from None
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise UnsafePath(f"{norm}: {what(st.st_mode)}, not a regular file")
        writing = bool(flags & (os.O_WRONLY | os.O_RDWR))
        problem = None if foreign and not writing else _owner_problem(st, norm, write=writing)
        if problem is not None:
            os.close(fd)
            raise problem
        if not flags & os.O_NONBLOCK:
            os.set_blocking(fd, True)
        return fd
    finally:
        os.close(dfd)


def open_read(path: PathLike, *, foreign: bool = False) -> int:
    """fd of the regular file `path` for reading (the caller closes it): no link followed anywhere on the
    path, a FIFO or device refused without blocking, a file another user owns or can write refused
    (UnsafePath), FileNotFoundError when missing. `foreign=True` skips the owner check for data the user
    named from elsewhere on purpose (a teammate's pilot run read by `--calibrate`), never for a record a
    role obeys."""
    return _open_file(path, os.O_RDONLY, 0, create_dirs=False, foreign=foreign)


def read_bytes(path: PathLike, limit: int | None = None, *, foreign: bool = False) -> bytes:
    """The bytes of the regular file `path` (open_read); with `limit`, UnsafePath past that many bytes."""
    fd = open_read(path, foreign=foreign)
    try:
        parts, off = [], 0
        while b := os.pread(fd, 1 << 22, off):
            parts.append(b)
            off += len(b)
            if limit is not None and off > limit:
                raise UnsafePath(f"{os.fspath(path)}: larger than {limit} bytes")
        return b"".join(parts)
    finally:
        os.close(fd)


def read_text(path: PathLike, limit: int | None = None, *, foreign: bool = False) -> str:
    return read_bytes(path, limit, foreign=foreign).decode()


def open_write(path: PathLike, *, append: bool = False, exclusive: bool = False, truncate: bool = False,
               mode: int = 0o644, create_dirs: bool = True, readable: bool = False) -> int:
    """fd of the regular file `path` for writing, created if missing (the caller closes it). Never
    follows a link, never opens a FIFO or device (UnsafePath); `exclusive` refuses an existing file."""
    flags = (os.O_RDWR if readable else os.O_WRONLY) | os.O_CREAT
    flags |= (os.O_APPEND if append else 0) | (os.O_EXCL if exclusive else 0) | (os.O_TRUNC if truncate else 0)
    return _open_file(path, flags, mode, create_dirs=create_dirs)


def append_bytes(path: PathLike, data: bytes, *, fsync: bool = True) -> None:
    """Append `data` to the regular file `path` in one write(2) (O_APPEND), creating it if missing."""
    fd = open_write(path, append=True)
    try:
        os.write(fd, data)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: PathLike, data: bytes, *, mode: int = 0o644) -> None:
    """Replace `path` by `data` atomically: a fresh temp file beside it (O_EXCL | O_NOFOLLOW, fsynced),
    renamed over it within the directory opened by the walk. An existing `path` that is a symlink,
    directory or FIFO is refused (UnsafePath), never replaced or written through."""
    norm, comps = _parts(path)
    dfd = open_dir("/" + "/".join(comps[:-1]), create=True)
    name = comps[-1]
    try:
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):
            if stat.S_ISLNK(st.st_mode):
                raise _describe(dfd, name, norm)
            raise UnsafePath(f"{norm}: {what(st.st_mode)}, not a regular file")
        if st is not None and (problem := _owner_problem(st, norm)) is not None:
            raise problem
        tmp = f".{name}.tmp-{uuid.uuid4().hex[:8]}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, mode, dir_fd=dfd)
        try:
            with os.fdopen(fd, "wb", closefd=True) as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise
    finally:
        os.close(dfd)


def check_path(path: PathLike, *, kind: str = "file") -> None:
    """Refuse (UnsafePath) a path with a link on the way or, if it exists, not of `kind` ("file" or
    "dir"): for writers that must hand a path to a library (safetensors, torch) after checking it."""
    norm, comps = _parts(path)
    try:
        dfd = open_dir("/" + "/".join(comps[:-1]))
    except FileNotFoundError:
        return
    try:
        try:
            st = os.stat(comps[-1], dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        ok = stat.S_ISREG(st.st_mode) if kind == "file" else stat.S_ISDIR(st.st_mode)
        if not ok:
            if stat.S_ISLNK(st.st_mode):
                raise _describe(dfd, comps[-1], norm)
            raise UnsafePath(f"{norm}: {what(st.st_mode)}, not a {'regular file' if kind == 'file' else 'directory'}")
    finally:
        os.close(dfd)


# -- directory operations: each opens the parent by the walk above and acts on one name inside it ------
def _parent(path: PathLike, create: bool = False) -> tuple[int, str, str]:
    """(O_PATH fd of the parent, final name, normalised path); the caller closes the fd."""
    norm, comps = _parts(path)
    if not comps:
        raise UnsafePath(f"{path}: not a path below /")
    return open_dir("/" + "/".join(comps[:-1]), create=create), comps[-1], norm


def lstat(path: PathLike) -> os.stat_result | None:
    """The stat of `path` itself (a final symlink is described, not followed), None when it or its parent
    is missing; UnsafePath for a link or non-directory on the way to it."""
    try:
        dfd, name, _ = _parent(path)
    except FileNotFoundError:
        return None
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    finally:
        os.close(dfd)


def is_dir(path: PathLike) -> bool:
    """`path` is a real directory (False when missing); UnsafePath when it, or anything on the way, is a
    symlink, or it is something other than a directory."""
    st = lstat(path)
    if st is None:
        return False
    if not stat.S_ISDIR(st.st_mode):
        dfd, name, norm = _parent(path)
        try:
            raise _not_dir(dfd, name, norm)
        finally:
            os.close(dfd)
    return True


def mkdir(path: PathLike, *, mode: int = 0o755) -> Path:
    """Make the directory `path` (its parents as `makedirs`); FileExistsError when it exists (a fresh,
    private directory: a step's tmp dir), UnsafePath for a link on the way."""
    dfd, name, _ = _parent(path, create=True)
    try:
        os.mkdir(name, mode, dir_fd=dfd)
    finally:
        os.close(dfd)
    return Path(path)


def scandir(path: PathLike) -> list[tuple[str, int]]:
    """[(name, st_mode of the entry itself)] of the real directory `path` ([] when missing); UnsafePath
    when it, or a component on the way, is a symlink or not a directory. Entries are not followed."""
    try:
        pfd = open_dir(path)
    except FileNotFoundError:
        return []
    try:
        fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=pfd)
    finally:
        os.close(pfd)
    out = []
    try:
        for name in os.listdir(fd):
            try:
                out.append((name, os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode))
            except FileNotFoundError:
                continue  # removed meanwhile
    finally:
        os.close(fd)
    return out


def rename(src: PathLike, dst: PathLike) -> None:
    """rename(2) of `src` to `dst` within their parent directories, each opened by the walk: a link on the
    way to either is refused (UnsafePath); the entries themselves are moved, never followed."""
    sfd, sname, _ = _parent(src)
    try:
        dfd, dname, _ = _parent(dst)
        try:
            os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)


def remove(path: PathLike) -> None:
    """Remove `path`: a directory with its contents (rmtree relative to its opened parent; links inside are
    unlinked, never followed), anything else unlinked. Missing is fine; a link on the way is UnsafePath."""
    import shutil
    try:
        dfd, name, _ = _parent(path)
    except FileNotFoundError:
        return
    try:
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=dfd, ignore_errors=True)
        else:
            try:
                os.unlink(name, dir_fd=dfd)
            except FileNotFoundError:
                pass
    finally:
        os.close(dfd)


def fsync_dir(path: PathLike) -> None:
    """fsync the real directory `path` (its entries: a rename into it is durable)."""
    pfd = open_dir(path)
    try:
        fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=pfd)
    finally:
        os.close(pfd)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- directories a library is handed by path: pinned by an fd ------------------------------------------
# A library (torch's distributed checkpoint, safetensors' save_file, a tokenizer's save_pretrained) takes
# a path and resolves it again at every file it writes. If someone who can write the directory above
# renames the directory it writes into and puts a symlink (or a directory of their own) at the old name,
# the rest of the library's files land wherever that points: a polling attacker in a kind directory
# others can write won that race against `dcp.save` every time. `pinned_dir` opens the directory once
# (the walk above, no link followed), checks it is this user's own and private, and hands out
# `/proc/self/fd/<fd>`: the kernel resolves that through the open fd to the very inode that was checked,
# whatever the name in the parent has become since. Nothing anyone else does to names outside it changes
# where a byte goes, and inside it (mode 0700, this user's) nobody else can create or rename anything.
_PINNED: dict[int, str] = {}   # fd held by pinned_dir -> the path it was opened as (for messages)


def _pinned_start(comps: list[str]) -> tuple[int, list[str], str] | None:
    """(fd to walk from, the components left, the path shown) for a path below a pinned directory."""
    if len(comps) < 4 or comps[:3] != ["proc", "self", "fd"] or not comps[3].isdigit():
        return None
    fd = int(comps[3])
    shown = _PINNED.get(fd)
    if shown is None:
        return None
    return os.open(".", _DIR_WALK, dir_fd=fd), comps[4:], shown
