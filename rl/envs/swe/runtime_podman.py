"""The `podman` runtime: each command in a fresh rootless Podman container of the task's image.

Why one container per command rather than one long-lived container per episode: the wall-clock kill
is then `podman rm -f` of that container (a `podman exec` killed on the host leaves its process running
in the container), limits apply per command as in the other runtimes, and the episode's state is the
host tree, bound at the image's working directory (`/testbed`, as SWE-bench images have it). When the
task has no tree of its own (the repository lives in the image, as for SWE-smith rows), the image's
working directory is copied out once at creation (`podman create` + `podman cp`).

Isolation, all by Podman's own options: `--network=none` (no interface but a loopback), `--read-only`
root with a size-limited tmpfs /tmp, `--cap-drop=all`, `no-new-privileges`, `--userns=keep-id` (the
caller's own uid inside, mapped by the rootless user namespace: nothing of the host but the tree is
mounted, so the run directory, secrets and other trees are absent), `--pids-limit` and `--memory`
(cgroups), `--ulimit` for CPU seconds, file size and open files. Rootless Podman can only enforce
`--pids-limit` and `--memory` on cgroup v2 (on v1 it ignores them with a warning): `check()` refuses to
run there, and refuses root (rootful Podman is not what Slurm sites allow).

The image comes from a dataset row: it must be an OCI reference (tasks.check_image: never option-shaped,
never a host path) and goes after `--` in every podman argv, so no row value is read as a podman option.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid

from rl.envs.swe.runtimes import Runtime, RuntimeUnavailable
from rl.envs.swe.sandbox import Limits, Result, SandboxError
from rl.envs.swe.tasks import check_image

_CHECKED: str | None = None
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class PodmanRuntime(Runtime):
    name = "podman"

    def __init__(self, tree, limits: Limits = Limits(), *, base_dir=None, image: str, workdir: str = "/testbed",
                 podman: str | None = None):
        self.check()
        image = check_image(image)  # before any directory is made: a row's value, never an option
        super().__init__(tree, limits, base_dir=base_dir)
        self.uid = None  # rootless: the user namespace maps the caller's uid; the tree stays the caller's
        self.podman = podman or shutil.which("podman")
        self.image, self.workdir = image, workdir
        if tree is None:
            self._copy_from_image()

    @classmethod
    def check(cls) -> None:
        global _CHECKED
        if _CHECKED is None:
            _CHECKED = _probe()
        if _CHECKED:
            raise RuntimeUnavailable(f"runtime podman: {_CHECKED}")

    def _copy_from_image(self):
        cid = subprocess.run([self.podman, "create", "--", self.image], capture_output=True, text=True)
        if cid.returncode != 0:
            raise SandboxError(f"runtime podman: cannot create a container of image {self.image!r}: "
                               f"{cid.stderr.strip()[-500:]}")
        try:
            r = subprocess.run([self.podman, "cp", "--", f"{cid.stdout.strip()}:{self.workdir}/.",
                                str(self.tree)], capture_output=True, text=True)
            if r.returncode != 0:
                raise SandboxError(f"runtime podman: cannot copy {self.workdir} out of image {self.image!r}: "
                                   f"{r.stderr.strip()[-500:]}")
        finally:
            subprocess.run([self.podman, "rm", "-f", "--", cid.stdout.strip()], capture_output=True)

    def _command(self, argv: list[str], env: dict[str, str]) -> list[str]:
        self._name = f"hetrl-{uuid.uuid4().hex[:16]}"
        return podman_argv(self.podman, self._name, self.image, str(self.tree), self.workdir, self.limits,
                           env, argv)

    def _kill(self, proc):
        subprocess.run([self.podman, "rm", "-f", "-t", "0", self._name], capture_output=True, timeout=60)
        super()._kill(proc)

    def _result(self, returncode, status, out, err, seconds) -> Result:
        if returncode == 125:  # podman's own failure, not the command's
            raise SandboxError(f"runtime podman: container did not start: {err.strip()[-2000:]}")
        return Result(-(returncode - 128) if 128 < returncode < 160 else returncode, out, err, False, seconds)


def podman_argv(podman: str, name: str, image: str, tree: str, workdir: str, limits: Limits,
                env: dict[str, str], argv: list[str]) -> list[str]:
    """`podman run` of one command in a fresh container of `image` over `tree` (bound at workdir).

    The image comes from a dataset row: it must be an OCI reference (never option-shaped: `--volume=/:/host`
    in its place would mount the host) and goes after `--`, where podman stops reading options. Every
    other value here is ours; the environment's names are checked so that none smuggles a second option."""
    check_image(image)
    for k in env:
        if not _ENV_NAME.fullmatch(k):
            raise ValueError(f"environment variable name {k[:80]!r}: letters, digits and '_' only")
    a = [podman, "run", "--rm", "-i", "--name", name, "--network=none", "--read-only",
         "--cap-drop=all", "--security-opt=no-new-privileges", "--userns=keep-id",
         f"--pids-limit={limits.nproc}", f"--memory={limits.memory_bytes}",
         f"--memory-swap={limits.memory_bytes}", f"--ulimit=cpu={limits.cpu_s}:{limits.cpu_s + 1}",
         f"--ulimit=fsize={limits.fsize_bytes}:{limits.fsize_bytes}",
         f"--ulimit=nofile={limits.nofile}:{limits.nofile}", "--ulimit=core=0:0",
         f"--tmpfs=/tmp:rw,size={limits.tmp_bytes},mode=1777",
         f"--volume={tree}:{workdir}:rw", f"--workdir={workdir}", "--env=HOME=/tmp", "--env=TMPDIR=/tmp",
         "--env=PYTHONDONTWRITEBYTECODE=1", "--env=PYTHONUNBUFFERED=1"]
    a += [f"--env={k}={v}" for k, v in env.items()]
    return a + ["--", image, *argv]


def _probe() -> str:
    """Why Podman cannot isolate here ("" if it can)."""
    exe = shutil.which("podman")
    if exe is None:
        return "podman not found (Debian package podman)"
    if os.geteuid() == 0:
        return "runs rootless only (as an unprivileged user with /etc/subuid ranges); this process is root"
    try:
        info = subprocess.run([exe, "info", "--format", "json"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "`podman info` did not answer within 60 s"
    if info.returncode != 0:
        return f"`podman info` failed: {(info.stderr.strip().splitlines() or ['?'])[-1]}"
    host = json.loads(info.stdout).get("host", {})
    if host.get("cgroupVersion") != "v2":
        return (f"cgroup {host.get('cgroupVersion')}: rootless podman enforces --memory and --pids-limit "
                "on cgroup v2 only")
    r = subprocess.run([exe, "run", "--rm", "--network=none", "--read-only", "--pids-limit=16",
                        "--memory=64m", "--rootfs", "/", "true"], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        return f"a probe container failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}"
    return ""


if __name__ == "__main__":  # `python -m rl.envs.swe.runtime_podman`: can Podman isolate on this node?
    print(_probe() or "podman: ok", file=sys.stderr)
