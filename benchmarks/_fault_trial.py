"""A fault trial of benchmarks/fault_trials.py: its kinds, its record (`Trial`) and the processes it drives.

Split from fault_trials.py along its seams (issue 23: no module over about 500 lines): this module is what
the injection (_fault_inject), the checks of the finished run directory (_fault_checks) and the Slurm
kinds (_fault_slurm, which reads `steps_done` from here) all share; it imports none of them but
_fault_slurm's kind list, so the harness stays a tree: fault_trials -> _fault_inject, _fault_checks ->
_fault_trial -> _fault_slurm.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import _fault_slurm  # noqa: E402

LOCAL_KINDS = ("kill_role", "kill_all", "stop", "crash_point", "disk_full", "bitflip", "truncate", "sigstop",
               "zombie", "second_launcher", "worker_kill", "worker_node_lost")
# kinds that hit the orchestrator's rollout worker processes (rl/orchestrator/workers.py); their runs, and a
# campaign holding one, play with WORKERS of them. The centre restarts a lost worker in place: the
# incarnation goes on, so these are not in ENDS_INCARNATION (a second incarnation is a failure for them)
WORKER_KINDS = ("worker_kill", "worker_node_lost")
WORKERS = 2
SLURM_KINDS = _fault_slurm.KINDS
KINDS = LOCAL_KINDS + SLURM_KINDS
# kinds whose fault ends the incarnation it hits: a later incarnation must have run
ENDS_INCARNATION = ("kill_role", "kill_all", "stop", "crash_point", "zombie",
                    *(k for k in SLURM_KINDS if k not in _fault_slurm.ELASTIC_KINDS))
STEPS = 4
LANDED, NEUTRALISED, NOT_INJECTED = "landed", "landed, neutralised", "not injected"
BASE = ["trainer.checkpoint_every=1", "trainer.keep_checkpoints=1", "trainer.warm_start.steps=30",
        "orchestrator.prompts_per_step=8", "orchestrator.drain_timeout_s=5", "cluster.stall_timeout_s=300"]


@dataclass
class Trial:
    index: int
    kind: str
    max_off_policy: int
    run_dir: Path
    detail: str = ""
    incarnations: list = field(default_factory=list)   # exit status of each launcher run
    armed: bool = False                                 # a crash point is armed in the first incarnation
    steps: int = STEPS
    at: int | None = None                               # inject after this many steps (default: random)
    failures: list = field(default_factory=list)
    seconds: float = 0.0
    cpus: list | None = None                            # the cores its processes are pinned to
    proof: list = field(default_factory=list)           # how we know the fault landed
    not_landed: str | None = None                       # why it did not (then the trial is not a pass)
    extra: list = field(default_factory=list)           # overrides of this trial only
    damaged: tuple | None = None                        # (kind, step, file) a bitflip/truncate hit
    damaged_restart: int | None = None                  # the incarnation (resume.json restart) it hit
    damaged_groups: list = field(default_factory=list)  # the damaged batch's group ids, read before the hit
    neutralised: str | None = None                      # landed, then removed unread (by what, the proof)
    groups: tuple | None = None                         # (started, trained, dropped) group ids
    resumes: dict = field(default_factory=dict)         # restart -> discarded lists, each resume.json seen
    parts: list = field(default_factory=list)           # a campaign's faults, one Trial each, in order
    workers_lost: dict = field(default_factory=dict)    # worker kinds: {"killed", "lost", "restarts"}, by inject

    def overrides(self) -> list[str]:
        # a worker kind, or a campaign ("a+b+...") holding one, plays with rollout workers
        workers = set(self.kind.split("+")) & set(WORKER_KINDS)
        return [*BASE, *([f"orchestrator.rollout_workers={WORKERS}"] if workers else []), f"trainer.max_steps={self.steps}", f"orchestrator.max_off_policy={self.max_off_policy}",
                *self.extra, f"run_dir={self.run_dir}"]

    @property
    def fault_log(self) -> Path:
        return self.run_dir.parent / f"{self.run_dir.name}.faults.jsonl"

    @property
    def status(self) -> str:
        if self.failures:
            return "failed"
        return "not_landed" if self.not_landed or not self.proof else "passed"

    @property
    def verdict(self) -> str:
        """What became of the fault: LANDED (it hit, and its effect was seen), NEUTRALISED (it hit, then
        a later fault removed its target before the run read it, shown unread: handled, not missing) or
        NOT_INJECTED (it never hit: no moment, nothing to damage, a crash point never reached)."""
        if self.not_landed or not self.proof:
            return NOT_INJECTED
        return NEUTRALISED if self.neutralised else LANDED


# -- processes -----------------------------------------------------------------------------------------
def launch(trial: Trial, env_extra: dict | None = None) -> subprocess.Popen:
    note_resume(trial)  # the previous incarnation's resume.json, before this one's prepare replaces it
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    for k in ("HETRL_FAULT", "HETRL_FAULT_LOG"):  # armed for the first incarnation only, not the reruns
        env.pop(k, None)
    env.update(env_extra or {})
    trial.run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = open(trial.run_dir.parent / f"{trial.run_dir.name}.launcher.log", "ab")
    pin = ["taskset", "-c", ",".join(map(str, trial.cpus))] if trial.cpus else []
    return subprocess.Popen([*pin, sys.executable, "-m", "launch", "run", *trial.overrides()], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def note_resume(trial: Trial) -> None:
    """Keep what the newest incarnation's rl.prepare discarded (resume.json: restart, `discarded`), before
    a later prepare rewrites the file: a damaged step that a resume discarded unread is shown from here.
    Called before every launch and once after the run; read with json, not rl.contract.records (the harness
    shares no code with what it judges)."""
    try:
        state = json.loads((trial.run_dir / "resume.json").read_text())
        trial.resumes[int(state["restart"])] = {k: [int(s) for s in v] for k, v in state["discarded"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # no incarnation got through prepare yet


def batch_groups(step_path: Path) -> list[int]:
    """The group ids of a rollout batch (meta.json `entries` or `group_ids`), [] if unreadable."""
    try:
        meta = json.loads((step_path / "meta.json").read_text())
        ids = {int(g) for g, _ in meta.get("entries") or []}
        return sorted(ids | {int(g) for g in meta.get("group_ids") or []})
    except (OSError, ValueError, TypeError, AttributeError):
        return []


def role_pids(run_dir: Path) -> dict[str, int]:
    try:
        return dict(json.loads((run_dir / "local.json").read_text())["roles"])
    except (OSError, ValueError, KeyError):
        return {}


def kill(pid: int, sig=signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def wait_exit(p: subprocess.Popen, timeout: float) -> int | None:
    try:
        return p.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def steps_done(run_dir: Path) -> int:
    try:
        return sum(1 for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in ln)
    except OSError:
        return 0


def wait_until(pred, timeout: float, p: subprocess.Popen | None = None, every: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        if p is not None and p.poll() is not None:
            return False
        time.sleep(every)
    return False


def kill_everything(run_dir: Path, p: subprocess.Popen) -> None:
    kill(p.pid)
    for pid in role_pids(run_dir).values():
        kill(pid)
    p.wait()


def launcher_pid(run_dir: Path) -> int | None:
    try:
        return int(json.loads((run_dir / "local.json").read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def alive(pid: int) -> bool:
    """A live process that is not a zombie."""
    return _fault_slurm.alive(pid)


def _state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return stat[stat.rindex(")") + 2]


def leftover_processes(run_dir: Path) -> list[tuple[int, str]]:
    """Live processes whose environment names this run (every role and every vLLM process inherits
    HETRL_RUN_DIR), zombies excluded."""
    tag = f"HETRL_RUN_DIR={run_dir}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if tag not in (d / "environ").read_bytes().split(b"\0"):
                continue
            stat = (d / "stat").read_text()
            if stat[stat.rindex(")") + 2] in "ZX":
                continue
            out.append((int(d.name), (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]))
        except OSError:
            continue
    return out
