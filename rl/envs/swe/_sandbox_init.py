"""The init process of one sandboxed command; `sandbox.py` starts it, nothing imports it.

It runs as `python -I -S _sandbox_init.py SPEC_JSON` under `unshare` (new mount, network, pid, ipc and
uts namespaces; in "userns" mode also a user namespace), so it is pid 1 of a fresh pid namespace and
still holds the privileges needed to build a filesystem. Stdlib only, and only modules loaded before
the filesystem is replaced, because the host's directories are gone afterwards.

The filesystem is an allowlist, built from nothing (as bubblewrap does): whatever is not named here is
absent, wherever on the host it lives (a run directory, the task rows or other repositories' clones on
/scratch, sockets anywhere). Steps, in order (each failure raises: a sandbox that half-applied its
isolation must not run anything):
1. make every mount private (nothing propagates back to the host), mount an empty tmpfs at
   spec["newroot"] (a directory of this sandbox) and build the new root there:
   - read-only binds of spec["ro"]: /usr, the top-level /bin, /lib... (recreated as links when they are
     links), a few /etc files the toolchain reads, this Python's prefixes (a venv and its base);
   - /dev with only null, zero, full, random, urandom, tty and a private /dev/shm;
   - private size-limited tmpfs on /tmp and /var/tmp;
   - the tree read-write at its own path (parents on the private /tmp are 0711: no listing);
   - a fresh /proc of this pid namespace (host processes are invisible);
2. pivot_root into it and detach the old root entirely (not merely hidden: unmounted from this
   namespace), then make the new root itself read-only;
3. fork the command: rlimits (RLIMIT_NPROC too: in root mode it counts the sandbox's own uid, in userns
   mode the kernel counts it per user namespace, so for this sandbox alone; `Sandbox.capabilities()`
   checks that at start and refuses a mode where it does not hold), then `setpriv` drops to the sandbox
   uid (root mode) or drops every capability (userns mode), sets no_new_privs, and execs the argv in
   the tree.
pid 1 reaps orphans and exits when the command exits; the kernel then SIGKILLs every process left in the
namespace, so nothing the command started can outlive it. The exit status goes to spec["status_fd"] as
"exit N" / "signal N" so the host can tell setup failures from the command's own codes.
"""
import ctypes
import json
import os
import resource
import stat
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
MNT_DETACH = 2
_OPT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
              "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
# pivot_root has no glibc wrapper on older systems: its syscall number per architecture
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41, "riscv64": 41, "loongarch64": 41,
                   "ppc64le": 203, "ppc64": 203, "s390x": 217}
_DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")
_DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
              "stderr": "/proc/self/fd/2"}

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src, target, fstype, flags, data=None):
    enc = (lambda s: None if s is None else s.encode())
    _check(_libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount({src!r}, {target!r}, {fstype!r}, {flags:#x})")


def _mounts():
    """{mount point: per-mount flags} of each visible mount, the last one per path."""
    out = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")
            flags = 0
            for o in fields[5].split(","):
                flags |= _OPT_FLAGS.get(o, 0)
            out[point] = flags
    return out


def _under(path, roots):
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _remount(target, add):
    """Remount target and every mount under it with `add` on top of its own flags: in a user namespace
    the host's nosuid/nodev/noexec/atime flags are locked and must be repeated, never dropped."""
    for point, flags in _mounts().items():
        if _under(point, [target]):
            _mount(None, point, None, MS_BIND | MS_REMOUNT | flags | add)


def _dirs(path, mode):
    """Make path and its missing parents as directories of `mode` (the new root's tmpfs, or /tmp's)."""
    missing = []
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    for p in reversed(missing):
        os.mkdir(p)
        os.chmod(p, mode)


def _bind(src, target, ro):
    """Bind src (following links: the host's path is trusted, the agent never wrote it) at target,
    recursively (submounts of /usr come along; a user namespace forbids splitting them off anyway)."""
    if os.path.isdir(src):
        _dirs(target, 0o755)
    else:
        _dirs(os.path.dirname(target), 0o755)
        if not os.path.lexists(target):
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o644))
    _mount(src, target, None, MS_BIND | MS_REC)
    _remount(target, (MS_RDONLY if ro else 0) | MS_NOSUID | MS_NODEV)


def _place(src, new):
    """One allowlisted host path at the same path under the new root: a link is recreated as the link
    (its target must itself be allowed to resolve), anything else is bound read-only."""
    target = new + src
    if os.path.lexists(target):
        return
    st = os.lstat(src)
    if stat.S_ISLNK(st.st_mode):
        _dirs(os.path.dirname(target), 0o755)
        os.symlink(os.readlink(src), target)
    else:
        _bind(src, target, ro=True)


def setup_filesystem(spec):
    new, tree, tmp = spec["newroot"], spec["tree"], spec["tmp_bytes"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=755")
    scratch = ("/tmp", "/var/tmp")
    for p in scratch:
        _dirs(new + p, 0o755)
        _mount("tmpfs", new + p, "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmp},mode=1777")
    # longest paths last: a parent's bind must not cover a child bound before it
    ro = [p for p in spec["ro"] if os.path.lexists(p)]
    for p in sorted(ro, key=lambda p: p.count("/")):
        if not any(q != p and _under(p, [q]) for q in ro):  # inside another allowed path: already there
            _place(p, new)
    dev = new + "/dev"
    _dirs(dev, 0o755)
    _mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=755")
    for name in _DEV_NODES:
        if os.path.exists("/dev/" + name):
            os.close(os.open(f"{dev}/{name}", os.O_WRONLY | os.O_CREAT, 0o666))
            _mount("/dev/" + name, f"{dev}/{name}", None, MS_BIND)
    for name, target in _DEV_LINKS.items():
        os.symlink(target, f"{dev}/{name}")
    os.mkdir(dev + "/shm")
    _mount("tmpfs", dev + "/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmp},mode=1777")
    _mount(None, dev, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    # the tree's parents: 0711 on the private /tmp (no listing, like the host's), else 0755
    parent = os.path.dirname(tree)
    _dirs(new + parent, 0o711 if _under(parent, scratch) else 0o755)
    _dirs(new + tree, 0o700)
    _mount(tree, new + tree, None, MS_BIND)
    _remount(new + tree, MS_NOSUID | MS_NODEV)
    _dirs(new + "/proc", 0o555)
    _mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chdir(new)
    _check(_libc.syscall(ctypes.c_long(_SYS_PIVOT_ROOT[os.uname().machine]), b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "umount2(old root)")  # the host's tree is gone, not hidden
    os.chdir("/")
    _mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    host = b"sandbox"
    _libc.sethostname(host, len(host))


def _child(spec, argv):
    lim = spec["limits"]
    for name, value in (("RLIMIT_CPU", lim["cpu_s"]), ("RLIMIT_AS", lim["memory_bytes"]),
                        ("RLIMIT_FSIZE", lim["fsize_bytes"]), ("RLIMIT_NOFILE", lim["nofile"]),
                        ("RLIMIT_CORE", 0)):
        soft = value
        hard = value + 1 if name == "RLIMIT_CPU" else value  # SIGXCPU first, SIGKILL one second later
        resource.setrlimit(getattr(resource, name), (soft, hard))
    if spec["nproc"]:
        resource.setrlimit(resource.RLIMIT_NPROC, (lim["nproc"], lim["nproc"]))
    os.chdir(spec["tree"])
    os.execve(spec["setpriv"][0], spec["setpriv"] + ["--"] + argv, spec["env"])


def main():
    spec = json.loads(sys.argv[1])
    status = os.fdopen(spec["status_fd"], "w")
    if spec["mode"] != "none":
        setup_filesystem(spec)
    pid = os.fork()
    if pid == 0:
        status.close()
        try:
            _child(spec, spec["argv"])
        except OSError as e:  # exec failed: report like a shell would
            os.write(2, f"sandbox: cannot run {spec['argv'][0]!r}: {e.strerror}\n".encode())
        os._exit(127)
    while True:  # pid 1 reaps every orphan; the command's own status ends the sandbox
        wpid, wstatus = os.wait()
        if wpid == pid:
            break
    if os.WIFSIGNALED(wstatus):
        status.write(f"signal {os.WTERMSIG(wstatus)}\n")
    else:
        status.write(f"exit {os.WEXITSTATUS(wstatus)}\n")
    status.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
