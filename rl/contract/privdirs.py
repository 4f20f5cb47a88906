"""Private directories: the ones a library is handed by path, and the node-local base.

A library (torch's distributed checkpoint, safetensors, a tokenizer's save_pretrained) takes a path and
resolves it again for every file it writes, so the directory it writes into must be one nobody else can
rename or replace while it writes. `pinned_dir` opens such a directory once through rl.contract.safefs's
walk, checks it is this user's own with mode 0700, and hands out `/proc/self/fd/<fd>`: the kernel
resolves that through the open fd to the checked inode, whatever happened to its name since
(rl.contract.safefs walks paths below it from the same fd). `make_private_dir` makes a step's tmp
directory so; `make_trusted_dirs` makes the node-local copy's directory under a shared base such as /tmp,
where every directory on the way must be root's or this user's and sticky where others can write.

Imports nothing of rl but its sibling rl.contract.safefs. Torch-free.
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path
from typing import Iterator

from rl.contract.safefs import (_DIR_WALK, _PINNED, PathLike, UnsafePath, _not_dir, _owner_problem, _parent,
                                _parts, lstat, open_dir, what)


def _private_problem(st: os.stat_result, shown: str) -> UnsafePath | None:
    """Why the directory with stat `st` is not one only this user can use (None if it is: mode 0700 or
    less, owned by this user)."""
    if not stat.S_ISDIR(st.st_mode):
        return UnsafePath(f"{shown}: {what(st.st_mode)}, not a directory")
    euid = os.geteuid()
    if st.st_uid != euid:
        return UnsafePath(f"{shown}: owned by uid {st.st_uid}, not by this process's user (uid {euid}); "
                          f"hetrl writes only into private directories of its own")
    if st.st_mode & 0o077:
        return UnsafePath(f"{shown}: mode {stat.S_IMODE(st.st_mode):04o}, not private (0700); hetrl writes "
                          f"through a path only into directories nobody else can use")
    return None


def make_private_dir(path: PathLike) -> Path:
    """Make the directory `path` mode 0700 (its parents as `makedirs`), or accept an existing one that is
    this user's own and writable by nobody else (tightened to 0700: nobody else could have put anything
    in it): the shared tmp directory of a step the ranks of one producer write into (`exchange.begin`
    with a token). UnsafePath, one line naming it, for a link, a non-directory, a directory another
    user owns or can write."""
    dfd, name, norm = _parent(path, create=True)
    try:
        try:
            os.mkdir(name, 0o700, dir_fd=dfd)
        except FileExistsError:
            pass
        try:
            fd = os.open(name, _DIR_WALK, dir_fd=dfd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise _not_dir(dfd, name, norm) from None
            raise
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        problem = _owner_problem(st, norm)
        if problem is not None:
            raise problem
        if st.st_mode & 0o077:
            os.chmod(f"/proc/self/fd/{fd}", 0o700)
    finally:
        os.close(fd)
    return Path(path)


def open_private_dir(path: PathLike) -> int:
    """O_PATH fd of the directory `path` (the walk above: no link followed on the way), refused with
    UnsafePath (one line naming it) unless it is this user's own with mode 0700 or less."""
    norm = os.path.normpath(os.path.abspath(os.fspath(path)))
    fd = open_dir(path)
    try:
        problem = _private_problem(os.fstat(fd), norm)
        if problem is not None:
            raise problem
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def pinned_dir(path: PathLike) -> Iterator[Path]:
    """`/proc/self/fd/<fd>` of the private directory `path` (`open_private_dir`), valid inside the
    `with`: the path to hand a library that writes by path (see above). Every process (every rank of a
    multi-process writer) opens and checks the directory itself: the fd path names it in this process
    only. The functions of this module accept paths below it."""
    fd = open_private_dir(path)
    try:
        pinned = Path(f"/proc/self/fd/{fd}")
        try:
            same = os.stat(pinned)
        except OSError:
            same = None
        mine = os.fstat(fd)
        if same is None or (same.st_dev, same.st_ino) != (mine.st_dev, mine.st_ino):
            raise UnsafePath(f"{os.fspath(path)}: /proc/self/fd does not name the opened directory (is /proc "
                             f"mounted?); hetrl hands libraries that path to write into it")
        _PINNED[fd] = os.path.normpath(os.path.abspath(os.fspath(path)))
        try:
            yield pinned
        finally:
            _PINNED.pop(fd, None)
    finally:
        os.close(fd)


def same_dir(path: PathLike, pinned: PathLike) -> bool:
    """Whether the entry at `path` (not followed) is the directory `pinned` (a `pinned_dir` path) names:
    after a rename by name, that what was renamed is what was written."""
    st = lstat(path)
    if st is None or not stat.S_ISDIR(st.st_mode):
        return False
    mine = os.stat(pinned)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def make_trusted_dirs(path: PathLike, *, mode: int = 0o700) -> Path:
    """Make (`mode`, 0700 by default) or accept the directory `path` outside any run directory (a
    node-local copy under a shared base such as /tmp) where nobody but this user could have put or could
    rename anything: walked from / without following a link, every directory on the way owned by root or
    this user and writable by group or others only with the sticky bit (as /tmp: then nobody else can
    rename what this user made there), and `path` itself this user's own and writable by nobody else.
    UnsafePath, one line naming the first directory that fails, otherwise."""
    norm, comps = _parts(path)
    euid = os.geteuid()
    fd = os.open("/", _DIR_WALK)
    shown = ""
    try:
        for i, c in enumerate(comps):
            shown += "/" + c
            try:
                nfd = os.open(c, _DIR_WALK, dir_fd=fd)
            except FileNotFoundError:
                try:
                    os.mkdir(c, mode, dir_fd=fd)
                except FileExistsError:
                    pass  # made meanwhile (by whom: checked below)
                nfd = None
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _not_dir(fd, c, shown) from None
                raise
            if nfd is None:
                try:
                    nfd = os.open(c, _DIR_WALK, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise _not_dir(fd, c, shown) from None
                    raise
            os.close(fd)
            fd = nfd
            st = os.fstat(fd)
            last = i == len(comps) - 1
            if last:
                problem = _owner_problem(st, shown)
                if problem is not None:
                    raise UnsafePath(f"{problem.message}; a node-local copy lives only in a directory of "
                                     f"this user's own")
            elif st.st_uid not in (0, euid):
                raise UnsafePath(f"{shown}: owned by uid {st.st_uid}, neither root nor this user (uid "
                                 f"{euid}); its owner could rename what hetrl makes below it (pick another "
                                 f"cluster.node_local_dir)")
            elif st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
                raise UnsafePath(f"{shown}: mode {stat.S_IMODE(st.st_mode):04o}, writable by group or others "
                                 f"without the sticky bit; anyone could rename what hetrl makes below it "
                                 f"(chmod +t {shown}, or pick another cluster.node_local_dir)")
    finally:
        os.close(fd)
    return Path(path)
