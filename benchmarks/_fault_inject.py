"""Injecting a local fault into the first incarnation of a trial's run (benchmarks/fault_trials.py).

`inject` waits for a random moment (`moment`: k trained steps plus up to 3 s) and hits the run with the
trial's kind: a SIGKILL, a SIGTERM, a SIGSTOP, a second launcher, a stopped trainer left to wake up
after its successor started (`_zombie_handle`), or damage to a file that will be read again
(`inject_damage`). It records in `trial.proof` what shows the fault landed, or in `trial.not_landed` why
not. Crash points are armed through the environment instead (`CRASH_POINTS`, rl.faults), by the caller.
Kept apart from the checks (_fault_checks), which must not share code with what they judge.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from rl import exchange  # noqa: E402
from _fault_trial import (Trial, _state, alive, batch_groups, kill, kill_everything, launch,  # noqa: E402
                          role_pids, steps_done, wait_exit, wait_until)

# (point, role, largest nth): points a run of the trial size reaches in its first incarnation
CRASH_POINTS = [("commit.before_manifest", "trainer", 6), ("commit.before_rename", "orchestrator", 4),
                ("commit.before_rename", "trainer", 6), ("jsonl.torn", "orchestrator", 20),
                ("jsonl.torn", "trainer", 3), ("checkpoint.save", "trainer", 4), ("prune.mid", "trainer", 3),
                ("weights.publish", "trainer", 4), ("reload.paused", "orchestrator", 3),
                ("prepare.mid", "prepare", 1)]


def moment(trial: Trial, p: subprocess.Popen, rng: random.Random) -> bool:
    """Wait for a random moment of the first incarnation: after k trained steps plus up to 3 s. A campaign
    names k (`trial.at`) and jitters by up to 1 s only: on a quiet machine a step takes about a second, and
    3 s more let its last fault find the run DONE."""
    k = trial.at if trial.at is not None else rng.randint(1 if trial.kind in ("bitflip", "truncate") else 0,
                                                         trial.steps - 2)
    ok = wait_until(lambda: len(role_pids(trial.run_dir)) == 3 and steps_done(trial.run_dir) >= k, 300, p)
    time.sleep(rng.uniform(0, 3 if trial.at is None else 1))
    trial.detail += f" after step {k}"
    return ok and p.poll() is None


# -- faults ------------------------------------------------------------------------------------------
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


def resume_restart(run_dir: Path) -> int | None:
    """The incarnation running now (resume.json's restart), read with json like the checks do."""
    try:
        return int(json.loads((run_dir / "resume.json").read_text())["restart"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


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
                    where = exchange.step_dir(run_dir, "rollouts", step)
                    f = rng.choice(damage_step_files(where))
                    trial.damaged_groups = batch_groups(where)  # if discarded unread: where they went
                    trial.damaged_restart = resume_restart(run_dir)
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
        trial.damaged_restart = resume_restart(run_dir)
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
