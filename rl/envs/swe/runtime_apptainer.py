"""The `apptainer` runtime: each command in `apptainer exec` of the task's image, built once into a SIF.

Apptainer (or Singularity, its older name: either binary is used) is what most Slurm sites allow: no
daemon, no root, images as single SIF files. An image reference (`docker://...`, a plain registry name,
a `docker-archive` tarball, or a .sif file used as is: the last two for the operator's own `sif_for`
calls only, since a dataset row's image must be a registry reference, checked by tasks.check_image) is
built once per image into `env.swe.image_cache`
on the shared filesystem, so every node reuses it: `sif_for` takes an exclusive `flock` on
`<sif>.lock` (concurrent episodes and nodes wait for the one build), builds into `<sif>.tmp-<random>` and
renames it into place, so a reader never sees a half-written SIF. A cache under /tmp, /var/tmp or
/dev/shm is refused: node-local, and wiped between jobs, it would rebuild every image on every node.

Each command runs as `apptainer exec --containall --no-privs --net --network none`: private pid and
ipc namespaces, a clean environment, no $HOME or host /tmp, no network but loopback (the SIF after `--`,
so nothing reaches apptainer as an option); the tree is bound
read-write at the image's working directory (`/testbed`) and nothing else of the host is mounted, so
the run directory, its secret, host sockets and other trees are absent. Limits are rlimits set by
`prlimit` (CPU seconds, address space, file size, open files, no core; processes when the caller's uid
is not shared with other work), since Apptainer's `--memory`/`--pids-limit` need cgroup v2 delegation
that sites rarely give; the wall clock kills the process group, and `--containall`'s pid namespace
takes every descendant with it. When the task has no tree of its own the image's working directory is
copied out once at creation.

Not testable on this machine: Apptainer is not packaged in Debian 12 (`apt-get install
singularity-container` has no candidate), so the tests check the argv and the SIF cache logic with a
stand-in `apptainer` program that records its calls; docs/sandboxes.md says so.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path

from rl.envs.swe.runtimes import Runtime, RuntimeUnavailable
from rl.envs.swe.sandbox import Limits, Result, SandboxError
from rl.envs.swe.tasks import check_image

_SCRATCH = ("/tmp", "/var/tmp", "/dev/shm")


def apptainer_exe() -> str | None:
    return shutil.which("apptainer") or shutil.which("singularity")


def sif_path(image: str, cache: str | os.PathLike) -> Path:
    """Where the SIF of `image` lives in the cache: a readable name plus a hash of the full reference."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", image.split("://", 1)[-1]).strip("_")[-80:]
    return Path(cache) / f"{stem}-{hashlib.sha256(image.encode()).hexdigest()[:12]}.sif"


def build_source(image: str) -> str:
    """The `apptainer build` source of an image reference."""
    if "://" in image:
        return image
    if image.endswith((".tar", ".tar.gz")) and Path(image).is_file():
        return f"docker-archive://{os.path.abspath(image)}"
    return f"docker://{image}"


def sif_for(image: str, cache: str | os.PathLike, exe: str | None = None) -> Path:
    """The SIF of `image`, built into `cache` on first use (once, under a lock). A local .sif or
    docker-archive is for the operator's own calls: images from dataset rows are registry references
    (ApptainerRuntime checks them), never host paths."""
    if image.startswith("-"):  # a positional argument of `apptainer build`: never an option
        raise ValueError(f"image {image[:80]!r}: starts with '-' (it would read as an option)")
    if image.endswith(".sif") and Path(image).is_file():
        return Path(image)
    real = os.path.realpath(cache)
    if not os.path.isabs(str(cache)) or any(real == d or real.startswith(d + "/") for d in _SCRATCH):
        raise ValueError(f"env.swe.image_cache={str(cache)!r}: must be an absolute path on the shared "
                         "filesystem, not node-local scratch (/tmp, /var/tmp, /dev/shm)")
    path = sif_path(image, cache)
    if path.is_file():
        return path
    exe = exe or apptainer_exe()
    if exe is None:
        raise RuntimeUnavailable("runtime apptainer: neither apptainer nor singularity is on PATH")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build per image; the others wait and then find it
        if path.is_file():
            return path
        tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:8]}")
        r = subprocess.run([exe, "build", str(tmp), build_source(image)], capture_output=True, text=True)
        if r.returncode != 0 or not tmp.is_file():
            tmp.unlink(missing_ok=True)
            tail = (r.stderr.strip().splitlines() or ["?"])[-1]
            raise SandboxError(f"runtime apptainer: building {image!r} into {path} failed: {tail}")
        os.replace(tmp, path)
    return path


def apptainer_argv(exe: str, sif: str, tree: str, workdir: str, limits: Limits, env: dict[str, str],
                   argv: list[str], nproc: bool) -> list[str]:
    """One command in a fresh `apptainer exec` of `sif` over `tree` (bound at workdir), under rlimits.
    The SIF goes after `--` (apptainer's end of options), and the environment's names are checked, so no
    value reaches apptainer as an option of its own."""
    if sif.startswith("-"):
        raise ValueError(f"SIF {sif[:80]!r}: starts with '-' (it would read as an option)")
    for k in env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise ValueError(f"environment variable name {k[:80]!r}: letters, digits and '_' only")
    a = [shutil.which("prlimit") or "prlimit", f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",
         f"--as={limits.memory_bytes}", f"--fsize={limits.fsize_bytes}", f"--nofile={limits.nofile}",
         "--core=0"] + ([f"--nproc={limits.nproc}"] if nproc else []) + ["--"]
    a += [exe, "exec", "--containall", "--no-privs", "--no-home", "--net", "--network", "none",
          "--bind", f"{tree}:{workdir}:rw", "--pwd", workdir]
    for k, v in {"HOME": "/tmp", "TMPDIR": "/tmp", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1",
                 **env}.items():
        a += ["--env", f"{k}={v}"]
    return a + ["--", sif, *argv]


class ApptainerRuntime(Runtime):
    name = "apptainer"

    def __init__(self, tree, limits: Limits = Limits(), *, base_dir=None, image: str, image_cache: str,
                 workdir: str = "/testbed"):
        self.check()
        image = check_image(image)  # before any directory is made: a row's registry reference, no option
        super().__init__(tree, limits, base_dir=base_dir)
        self.uid = None  # apptainer runs as the caller; no uid of its own to hand the tree to
        self.exe = apptainer_exe()
        self.sif = str(sif_for(image, image_cache, self.exe))
        self.workdir = workdir
        if tree is None:
            r = subprocess.run(apptainer_argv(self.exe, self.sif, str(self.tree), "/hetrl-out", limits, {},
                                              ["cp", "-a", f"{workdir}/.", "/hetrl-out/"], nproc=False),
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise SandboxError(f"runtime apptainer: cannot copy {workdir} out of {self.sif}: "
                                   f"{(r.stderr.strip().splitlines() or ['?'])[-1]}")

    @classmethod
    def check(cls) -> None:
        if apptainer_exe() is None:
            raise RuntimeUnavailable("runtime apptainer: neither apptainer nor singularity is on PATH "
                                     "(Debian 12 does not package it: install Apptainer from its releases)")
        if shutil.which("prlimit") is None:
            raise RuntimeUnavailable("runtime apptainer: prlimit (util-linux) not found: it sets the limits")

    def _command(self, argv: list[str], env: dict[str, str]) -> list[str]:
        return apptainer_argv(self.exe, self.sif, str(self.tree), self.workdir, self.limits, env, argv,
                              nproc=False)

    def _result(self, returncode, status, out, err, seconds) -> Result:
        return Result(-(returncode - 128) if 128 < returncode < 160 else returncode, out, err, False, seconds)
