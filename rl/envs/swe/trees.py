"""An episode's tree on the host: walking it, measuring it and copying it, never trusting what is in it.

The agent's commands shape the tree freely: they can plant a FIFO (opening one for reading blocks until
a writer comes), a socket or a device node, a symlink loop, links out of the tree, hard links to one big
file, or directories nested thousands deep (Python 3.11's `os.walk` and `shutil.copytree` recurse and
end in RecursionError). Every host-side pass over a tree goes through here instead:

- `walk(root)` is iterative (a stack, not recursion), never follows a link and never opens anything
  but directories (O_NOFOLLOW | O_DIRECTORY), so neither a loop nor a FIFO nor depth can stop it;
- `tree_bytes(root)` sums the blocks allocated to the tree (hard links counted once, links not
  followed): what the disk limit measures;
- `copy_tree(src, dest)` copies directories, regular files (opened O_NOFOLLOW | O_NONBLOCK and checked
  to be regular after opening, so a file swapped for a FIFO cannot hang it) and symlinks as symlinks.
  Anything else, or a tree deeper than `MAX_DEPTH`, is refused with a `TreeError` (an OSError whose
  text is one line naming the path and what it is), and `dest` is removed before it is raised: a
  refused copy leaves nothing behind.
"""
from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path

MAX_DEPTH = 256          # directories below the root; real repositories stay far under it
_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device"}


class TreeError(OSError):
    """The tree holds something a host-side copy refuses (one line: the path and what it is)."""

    def __str__(self) -> str:  # the line itself, without OSError's "[Errno N]" in front
        return self.strerror if self.strerror else super().__str__()


def kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file, directory or link")


def walk(root: str | Path, max_depth: int | None = None):
    """(relative dir, [(name, lstat result)] by name) for every directory of the tree, top down and
    depth first in name order (as os.walk), iteratively;
    links are listed, never followed. Past `max_depth` a TreeError is raised; entries that vanish
    while walking (the command is still running) are skipped."""
    root = os.fspath(root)
    stack = [("", 0)]
    while stack:
        rel, depth = stack.pop()
        path = os.path.join(root, rel) if rel else root
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as e:
            if e.errno == errno.ELOOP:  # swapped for a link since it was listed
                continue
            raise
        entries = []
        try:
            with os.scandir(fd) as it:
                for e in it:
                    try:
                        entries.append((e.name, e.stat(follow_symlinks=False)))
                    except FileNotFoundError:
                        pass
        finally:
            os.close(fd)
        entries.sort(key=lambda e: e[0])
        yield rel, entries
        for name, st in reversed(entries):
            if stat.S_ISDIR(st.st_mode):
                if max_depth is not None and depth + 1 > max_depth:
                    where = os.path.join(rel, name)
                    where = where if len(where) <= 80 else where[:40] + "..." + where[-20:]
                    raise TreeError(errno.ELOOP, f"{where}: directories nested deeper than {max_depth} "
                                                 "levels")
                stack.append((os.path.join(rel, name) if rel else name, depth + 1))


def tree_bytes(root: str | Path) -> int:
    """Disk allocated to the tree: blocks of every entry, each inode once, links not followed."""
    seen, total = set(), 0
    for _, entries in walk(root):
        for _, st in entries:
            if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def _copy_file(src: str, dst: str, rel: str) -> None:
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise TreeError(e.errno, f"{rel}: cannot be read ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped between the listing and the open
            raise TreeError(errno.EINVAL, f"{rel}: {kind(st.st_mode)}, not a regular file")
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                      stat.S_IMODE(st.st_mode) & 0o777)
        try:
            while True:
                if os.sendfile(out, fd, None, 1 << 24) == 0:
                    break
            os.fchmod(out, stat.S_IMODE(st.st_mode) & 0o777)
            os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(out)
    finally:
        os.close(fd)


def copy_tree(src: str | Path, dest: str | Path, max_depth: int = MAX_DEPTH) -> Path:
    """Copy the tree at src to dest (which must not exist): directories, regular files (mode and
    mtime kept), symlinks as symlinks. A FIFO, socket or device, or nesting past max_depth, raises
    TreeError and dest is removed first."""
    src, dest = os.fspath(src), os.fspath(dest)
    st = os.lstat(src)
    if not stat.S_ISDIR(st.st_mode):
        what = "a symlink" if stat.S_ISLNK(st.st_mode) else kind(st.st_mode)
        raise TreeError(errno.ENOTDIR, f"{src}: the tree is {what}, not a directory")
    os.mkdir(dest, 0o755)
    try:
        for rel, entries in walk(src, max_depth):
            d = os.path.join(dest, rel) if rel else dest
            for name, est in entries:
                r = os.path.join(rel, name) if rel else name
                s, t = os.path.join(src, r), os.path.join(d, name)
                mode = est.st_mode
                if stat.S_ISDIR(mode):
                    os.mkdir(t, 0o700)
                    os.chmod(t, stat.S_IMODE(mode) & 0o777 | 0o700)  # the host must be able to fill it
                elif stat.S_ISLNK(mode):
                    os.symlink(os.readlink(s), t)
                elif stat.S_ISREG(mode):
                    _copy_file(s, t, r)
                else:
                    raise TreeError(errno.EINVAL, f"{r}: {kind(mode)}, not a regular file (the tree cannot "
                                                  "be copied with it; remove it)")
        return Path(dest)
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise


def remove_tree(path: str | Path) -> None:
    """Remove a tree whatever it holds; one nested too deep for shutil's recursion goes to `rm -rf`
    (fts: no depth limit). Errors are ignored, as shutil.rmtree(ignore_errors=True) does."""
    try:
        shutil.rmtree(path, ignore_errors=True)
    except RecursionError:
        import subprocess
        subprocess.run(["rm", "-rf", "--one-file-system", "--", os.fspath(path)], capture_output=True)
