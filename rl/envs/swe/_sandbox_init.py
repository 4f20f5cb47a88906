"""The init process of one sandboxed command; `sandbox.py` starts it, nothing imports it.

It runs as `python -I -S _sandbox_init.py SPEC_JSON` under `unshare` (new mount, network, pid, ipc and
uts namespaces; in "userns" mode also a user namespace), so it is pid 1 of a fresh pid namespace and
still holds the privileges needed to shape the filesystem view. Stdlib only, and only modules loaded
before the filesystem is reshaped, because the interpreter's own directories may be masked afterwards.

Steps, in order (each failure raises: a sandbox that half-applied its isolation must not run anything):
1. open O_PATH handles on the tree and on the paths to keep visible, before anything hides them;
2. remount every writable mount read-only (per-mount flag in this private namespace only: the host's
   mounts are untouched);
3. fresh tmpfs on /tmp, /var/tmp, /dev/shm (private scratch), and tmpfs over the masked paths (the
   host's home and the hetrl checkout, which holds the hidden tests), then bind the kept paths back
   read-only and the tree read-write at its own path;
4. a fresh /proc for this pid namespace (host processes are invisible);
5. fork the command: rlimits, then `setpriv` drops to the sandbox uid (root mode) or drops every
   capability (userns mode), sets no_new_privs, and execs the argv in the tree.
pid 1 reaps orphans and exits when the command exits; the kernel then SIGKILLs every process left in the
namespace, so nothing the command started can outlive it. The exit status goes to spec["status_fd"] as
"exit N" / "signal N" so the host can tell setup failures from the command's own codes.
"""
import ctypes
import json
import os
import resource
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
_OPT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
              "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}

_libc = ctypes.CDLL(None, use_errno=True)


def _mount(src, target, fstype, flags, data=None):
    enc = (lambda s: None if s is None else s.encode())
    if _libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount({src!r}, {target!r}, {fstype!r}, {flags:#x}): {os.strerror(err)}")


def _mounts():
    """(mount point, per-mount flags, read-only?) of each visible mount, the last one per path."""
    out = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")
            opts = fields[5].split(",")
            flags = 0
            for o in opts:
                flags |= _OPT_FLAGS.get(o, 0)
            out[point] = (flags, "ro" in opts)
    return out


def _under(path, roots):
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _bind(fd, target, flags):
    os.makedirs(target, exist_ok=True)
    _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND)
    # A bind mount inherits the source mount's flags (read-only after step 2): set them explicitly.
    _mount(None, target, None, MS_BIND | MS_REMOUNT | flags)


def setup_filesystem(spec):
    tree = spec["tree"]
    tree_fd = os.open(tree, os.O_PATH | os.O_DIRECTORY)
    keep = [(p, os.open(p, os.O_PATH)) for p in spec["expose"] if os.path.exists(p)]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    for point, (flags, ro) in sorted(_mounts().items()):
        if not ro:
            _mount(None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | flags)
    scratch = [p for p in ("/tmp", "/var/tmp", "/dev/shm") if os.path.isdir(p)]
    for p in scratch:
        _mount("tmpfs", p, "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['tmp_bytes']},mode=1777")
    masks = [p for p in spec["mask"] if os.path.isdir(p) and not _under(p, scratch)]
    for p in masks:
        _mount("tmpfs", p, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for p, fd in keep:
        if _under(p, masks + scratch):
            _bind(fd, p, MS_RDONLY | MS_NOSUID | MS_NODEV)
    for p in masks:
        _mount(None, p, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    _bind(tree_fd, tree, MS_NOSUID | MS_NODEV)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
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
