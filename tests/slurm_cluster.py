"""A real multi-node Slurm on localhost for the `slurm` tests: munged, slurmctld and 4 slurmd.

Everything lives in one temporary directory (config, munge key and socket, state, spool, logs), the
clients find the cluster through `SLURM_CONF`, and free TCP ports are picked at start, so several test
sessions on one machine do not collide and /etc/slurm is never touched. The measured facts behind the
settings are in the shared notes (slurm-local-cluster.md): Debian's build runs several slurmd on one host
(`-N nX`), components of a heterogeneous job never share a node (hence 4 nodes), `cred_expire=10` makes a
requeued job start again after ~11 s instead of ~121 s, and two partitions over the same nodes give
partition preemption (`debug` is preempted by `high`). Each node declares GPUS_PER_NODE GPUs (counted,
not real: see GRES_CONF) so that plans with GPU replicas can be submitted as they are.

Stopping cancels every job first (killing slurmd would orphan job processes), then kills the daemons and
any leftover slurmstepd of this cluster by process id, so nothing is left behind.

The node names resolve (`ensure_node_names`): torchrun's rendezvous and anything else given a Slurm
node name (HETRL_TRAINER_ADDR is the first trainer node's name) must reach it, so n1..nN are added to
/etc/hosts as 127.0.0.1, the address every slurmd here has. Not a distinct 127.0.0.x each: torch's c10d
rendezvous lets the agent whose own addresses include the endpoint's host the store, and this
machine's hostname resolves to 127.0.0.1 only, so with 127.0.0.2 for n1 no agent would host it. The
lines are added once, under a lock, only for names that do not resolve yet, and left in place when the
cluster stops: every test cluster on the machine uses the same names with the same address, and
another session may be using them.

Binaries missing: the fixture fails under CI (env CI set) and skips otherwise.
"""
from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

NODES = 4
GPUS_PER_NODE = 2  # declared per node, no device behind them (GRES_CONF)
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo")
INSTALL_HINT = "install with .ci/install_slurm.sh (Debian: slurmctld slurmd slurm-client munge)"


def _which(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}")
                                       if os.access(p, os.X_OK)), None)


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if _which(b) is None]


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


HOSTS_FILE = "/etc/hosts"
HOSTS_MARK = "# hetrl localhost test Slurm cluster (tests/slurm_cluster.py)"


def ensure_node_names(names: list[str], hosts_file: str = HOSTS_FILE) -> list[str]:
    """Make every name in `names` resolve, adding `127.0.0.1 NAME` lines to `hosts_file` for those that do
    not yet; returns the names added. Idempotent, and safe with other sessions doing the same (flock)."""
    import fcntl
    added = []
    with open(hosts_file, "a+") as f:  # appended in place: /etc/hosts may be a bind mount
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        listed = {w for line in f.read().splitlines() for w in line.split("#", 1)[0].split()[1:]}
        for name in names:
            if name in listed:
                continue
            try:
                socket.gethostbyname(name)
                continue  # resolves already (DNS, another hosts line): leave it alone
            except OSError:
                pass
            f.write(f"127.0.0.1 {name}  {HOSTS_MARK}\n")
            added.append(name)
        f.flush()
        fcntl.flock(f, fcntl.LOCK_UN)
    return added


SLURM_CONF = """\
ClusterName=hetrltest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire=10
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/slurmd.%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={d}/jobcomp.log
MpiDefault=none
GresTypes=gpu
SwitchType=switch/none
MailProg=/bin/true
ReturnToService=2
SlurmdParameters=config_overrides
JobRequeue=1
KillWait=2
MinJobAge=600
InactiveLimit=0
SlurmdTimeout=30
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=2,bf_interval=1,bf_hetjob_immediate,preempt_send_user_signal
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName=n[1-{n}] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[{p0}-{pn}] CPUs=4 RealMemory=2000 Gres=gpu:{gpus} State=UNKNOWN
PartitionName=debug Nodes=n[1-{n}] Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=10 OverSubscribe=NO
PartitionName=high Nodes=n[1-{n}] Default=NO MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF OverSubscribe=NO
"""
# GPUs by count, with no device behind them: enough for the scheduler to accept and place the GPU requests
# (--gpus-per-node, --gres=gpu:N) of the plans under test. Slurm 22.05's gres/gpu drops GPUs without a
# File= ("Removing file-less GPU"), so they are empty regular files in the cluster dir, one set for every
# node (they share the host; no cgroup binds them). slurmd logs "... is not a valid character or block
# device" for each and counts them anyway; it sets no CUDA_VISIBLE_DEVICES.
GRES_CONF = """\
Name=gpu File={d}/gpu[0-{last}]
"""


class SlurmCluster:
    """Start/stop a localhost Slurm whose state lives in `self.dir`; `self.env` points clients at it."""

    def __init__(self, nodes: int = NODES, base: str | None = None):
        self.nodes = nodes
        self.dir = Path(tempfile.mkdtemp(prefix="hetrl-slurm-", dir=base))
        self.dir.chmod(0o755)  # munged (user munge) must traverse it
        self.conf = self.dir / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.procs: list[subprocess.Popen] = []

    # -- helpers -------------------------------------------------------------------------------------
    def run(self, *args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True, check=check,
                              timeout=timeout)

    def _pid(self, name: str) -> int | None:
        try:
            return int((self.dir / name).read_text().strip())
        except (OSError, ValueError):
            return None

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self, timeout: float = 30) -> "SlurmCluster":
        d = self.dir
        ensure_node_names([f"n{i}" for i in range(1, self.nodes + 1)])
        (d / "state").mkdir()
        munge = d / "munge"
        munge.mkdir()
        munge.chmod(0o755)  # munged insists that every client can reach its socket
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        mu = pwd.getpwnam("munge")
        for p in (munge, key):
            os.chown(p, mu.pw_uid, mu.pw_gid)
        self.munge_socket = munge / "munge.socket"
        subprocess.run(
            ["runuser", "-u", "munge", "--", _which("munged"), f"--socket={self.munge_socket}",
             f"--key-file={key}", f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
             f"--seed-file={munge}/munged.seed", "--num-threads=2"],
            check=True, capture_output=True, text=True, timeout=20)
        ctld_port, *node_ports = self._contiguous_ports(self.nodes)
        self.conf.write_text(SLURM_CONF.format(
            host=socket.gethostname(), ctld_port=ctld_port, munge_socket=self.munge_socket, d=d,
            n=self.nodes, p0=node_ports[0], pn=node_ports[-1], gpus=GPUS_PER_NODE))
        for g in range(GPUS_PER_NODE):
            (d / f"gpu{g}").touch()
        (d / "gres.conf").write_text(GRES_CONF.format(d=d, last=GPUS_PER_NODE - 1))
        log = open(d / "daemons.out", "ab")
        self.procs.append(subprocess.Popen([_which("slurmctld"), "-D", "-i", "-f", str(self.conf)],
                                           env=self.env, stdout=log, stderr=log))
        for i in range(1, self.nodes + 1):
            self.procs.append(subprocess.Popen([_which("slurmd"), "-D", "-f", str(self.conf), "-N", f"n{i}"],
                                               env=self.env, stdout=log, stderr=log))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a Slurm daemon exited ({p.args}); see {d}/*.log")
            r = self.run("sinfo", "-h", "-p", "debug", "-t", "idle", "-o", "%D", check=False)
            if r.returncode == 0 and r.stdout.strip() == str(self.nodes):
                return self
            time.sleep(0.3)
        raise RuntimeError(f"Slurm nodes not idle after {timeout}s; see {d}/slurmctld.log")

    def _contiguous_ports(self, n: int) -> list[int]:
        """slurmctld port + n consecutive free slurmd ports (the node line takes a port range)."""
        for _ in range(50):
            ctld, first = _free_ports(2)
            ports = list(range(first, first + n))
            ok = True
            for p in ports[1:]:
                with socket.socket() as s:
                    try:
                        s.bind(("127.0.0.1", p))
                    except OSError:
                        ok = False
                        break
            if ok and ctld not in ports:
                return [ctld, *ports]
        raise RuntimeError("no run of free TCP ports found")

    def job_ids(self) -> list[str]:
        r = self.run("squeue", "-h", "-o", "%A", check=False)
        return r.stdout.split() if r.returncode == 0 else []

    def cancel_all(self, wait: float = 20) -> None:
        ids = self.job_ids()
        if ids:
            self.run("scancel", *ids, check=False)
        deadline = time.monotonic() + wait
        while self.job_ids() and time.monotonic() < deadline:
            time.sleep(0.3)

    def _stepd_pids(self) -> list[int]:
        """slurmstepd processes of this cluster: their command line or environment names our conf."""
        pids = []
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            try:
                if not (p / "comm").read_text().startswith("slurmstepd"):
                    continue
                pids.append(int(p.name))
            except OSError:
                continue
        mine = []
        for pid in pids:
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue
            if str(self.conf).encode() in env or str(self.dir).encode() in env:
                mine.append(pid)
        return mine

    def _leftover_pids(self) -> list[int]:
        """Any live process that belongs to this cluster: batch scripts, sruns and job tasks orphaned
        when their slurmstepd died (their command line or environment names our directory)."""
        keep, pid = set(), os.getpid()
        while pid > 1:  # never this test process or its ancestors
            keep.add(pid)
            try:
                pid = int(Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[1])
            except (OSError, ValueError, IndexError):
                break
        marker = str(self.dir).encode()
        out = []
        for p in Path("/proc").iterdir():
            if not p.name.isdigit() or int(p.name) in keep:
                continue
            try:
                if (p / "stat").read_text().split(")")[-1].split()[0] == "Z":
                    continue
                if marker in (p / "cmdline").read_bytes() or marker in (p / "environ").read_bytes():
                    out.append(int(p.name))
            except OSError:
                continue
        return out

    def stop(self) -> None:
        try:
            self.cancel_all()
        except Exception:
            pass
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for pid in self._stepd_pids():
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except OSError:
                pass
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        munged = self._pid("munge/munged.pid")
        if munged:
            try:
                os.kill(munged, signal.SIGTERM)
            except OSError:
                pass
        # A job whose slurmstepd was killed leaves its batch script and sruns behind (children of a
        # dead parent are not killed by the kernel); hunt them down by our directory.
        for _ in range(3):
            left = self._leftover_pids()
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.2)
        if os.environ.get("HETRL_KEEP_SLURM_DIR") is None:
            shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster():
    """The running localhost cluster; its `env` carries SLURM_CONF for subprocess calls."""
    missing = missing_binaries()
    if missing:
        msg = f"Slurm binaries missing: {', '.join(missing)}; {INSTALL_HINT}"
        if os.environ.get("CI"):
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    if os.geteuid() != 0:
        msg = "the local Slurm cluster needs root (slurmd runs jobs as their users)"
        if os.environ.get("CI"):
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    cluster = SlurmCluster()
    old = os.environ.get("SLURM_CONF")
    try:
        cluster.start()
        os.environ["SLURM_CONF"] = str(cluster.conf)  # launch.slurm's subprocesses inherit it
        yield cluster
    finally:
        cluster.stop()
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


@pytest.fixture
def slurm(slurm_cluster):
    """Per test: the cluster, with every job of the previous test cancelled."""
    slurm_cluster.cancel_all()
    yield slurm_cluster
    slurm_cluster.cancel_all()


if __name__ == "__main__":  # manual check: python tests/slurm_cluster.py
    c = SlurmCluster()
    t = time.monotonic()
    try:
        c.start()
        print(f"up in {time.monotonic() - t:.1f}s at {c.dir}")
        print(c.run("sinfo").stdout)
        print(c.run("srun", "-N2", "hostname").stdout)
    finally:
        c.stop()
