"""Injecting a local fault into the first incarnation of a trial's run (benchmarks/fault_trials.py).

`inject` waits for a random moment (`moment`: k trained steps plus up to 3 s) and hits the run with the
trial's kind: a SIGKILL, a SIGTERM, a SIGSTOP, a second launcher, a stopped trainer left to wake up
after its successor started (`_zombie_handle`), damage to a file that will be read again
(`inject_damage`), or a SIGKILL to one or all of the orchestrator's rollout workers (`inject_workers`,
whose moment is drawn in groups started). It records in `trial.proof` what shows the fault landed, or in
`trial.not_landed` why not. Crash points are armed through the environment instead (`CRASH_POINTS`, rl.faults), by the caller.
Kept apart from the checks (_fault_checks), which must not share code with what they judge.
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from omegaconf import OmegaConf  # noqa: E402

from rl import exchange  # noqa: E402
from _fault_trial import (BASE, WORKER_KINDS, WORKERS, Trial, _state, alive, batch_groups, kill,  # noqa: E402
                          kill_everything, launch, role_pids, steps_done, wait_exit, wait_until)

# (point, role, largest nth): points a run of the trial size reaches in its first incarnation
CRASH_POINTS = [("commit.before_manifest", "trainer", 6), ("commit.before_rename", "orchestrator", 4),
                ("commit.before_rename", "trainer", 6), ("jsonl.torn", "orchestrator", 20),
                ("jsonl.torn", "trainer", 3), ("checkpoint.save", "trainer", 4), ("prune.mid", "trainer", 3),
                ("weights.publish", "trainer", 4), ("reload.paused", "orchestrator", 3),
                ("prepare.mid", "prepare", 1)]


def moment(trial: Trial, p: subprocess.Popen, rng: random.Random) -> bool:
    """Wait for a random moment of the first incarnation: after k trained steps plus up to 3 s. A campaign
    names k (`trial.at`) and jitters by up to 1 s only: on a quiet machine a step takes about a second, and
    3 s more let its last fault find the run DONE.

    A rollout worker fault draws its moment in groups instead (inject_workers): here only the roles up."""
    worker = trial.kind in WORKER_KINDS and trial.at is None
    k = trial.at if trial.at is not None else 0 if worker else rng.randint(
        1 if trial.kind in ("bitflip", "truncate") else 0, trial.steps - 2)
    ok = wait_until(lambda: len(role_pids(trial.run_dir)) == 3 and steps_done(trial.run_dir) >= k, 300, p)
    time.sleep(0 if worker else rng.uniform(0, 3 if trial.at is None else 1))
    trial.detail += "" if worker else f" after step {k}"
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
    elif kind in WORKER_KINDS:
        inject_workers(trial, rng, p, done_at)
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


# -- rollout workers ----------------------------------------------------------------------------------
# What the centre (rl/orchestrator/workers.py) and a worker (worker.py) write into the orchestrator's log,
# matched here rather than imported: the harness shares no code with what it judges
READY = re.compile(r"rollout-worker-(\d+)\] ready \(pid (\d+),")
LOST = re.compile(r"rollout worker (\d+) \(pid (\d+)\) exited with status (-?\d+): "
                  r"(\d+) episode\(s\) in flight lost")
STARTED = re.compile(r"(\d+) rollout worker\(s\) ready \(pids ")  # once per incarnation, when all are up
WORKER_WAIT_S = 300.0   # the longest wait for each piece of a worker fault's evidence


def orchestrator_log(run_dir: Path) -> str:
    try:
        return (run_dir / "logs" / "orchestrator.log").read_text(errors="replace")
    except OSError:
        return ""


def worker_pids(orchestrator: int | None) -> list[int]:
    """The live rollout worker processes of the orchestrator `orchestrator`: its children running
    `-m rl.orchestrator.worker`, from /proc (zombies excluded)."""
    out = []
    if orchestrator is None:
        return out
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
            if int(ppid) != orchestrator or state in "ZX":
                continue
            if b"rl.orchestrator.worker" in (d / "cmdline").read_bytes():
                out.append(int(d.name))
        except (OSError, ValueError):
            continue
    return sorted(out)


def ready_workers(run_dir: Path, orchestrator: int | None) -> list[int]:
    """The orchestrator's live workers that have said they are ready (their line in its log)."""
    said = {int(m.group(2)) for m in READY.finditer(orchestrator_log(run_dir))}
    return [pid for pid in worker_pids(orchestrator) if pid in said]


def published(run_dir: Path) -> set[int]:
    return set(exchange.list_steps(run_dir, "rollouts"))


def started_groups(run_dir: Path) -> set[int]:
    return {int(e["group"]) for e in exchange.read_jsonl(run_dir / "rollouts" / "groups.jsonl")
            if e.get("event") == "start"}


def groups_in(run_dir: Path) -> set[int]:
    """Groups in a published batch or recorded as dropped. Read each time, like the checks do: json
    lines, the batches' meta."""
    gone = {int(e["group"]) for e in exchange.read_jsonl(run_dir / "rollouts" / "groups.jsonl")
            if e.get("event") == "drop"}
    for n in published(run_dir):
        gone.update(batch_groups(exchange.step_dir(run_dir, "rollouts", n)))
    return gone


def groups_out(run_dir: Path) -> list[int]:
    """Groups started (rollouts/groups.jsonl) and in no published batch nor dropped: in flight, or played
    and waiting for their batch."""
    return sorted(started_groups(run_dir) - groups_in(run_dir))


def inject_workers(trial: Trial, rng: random.Random, p: subprocess.Popen, done_at: int) -> None:
    """worker_kill: SIGKILL one rollout worker of the orchestrator; worker_node_lost: SIGKILL every one of
    them at once (the workers are the orchestrator's children on its node, so a lost node takes the centre
    too, which kill_all covers; what can die without it is its workers: the OOM killer or a cgroup kill of
    their processes, or, once they run on other nodes, their connections ending. The centre has no liveness
    check of a worker that stops answering, so a SIGSTOP past a bound is not detected: not tried here).

    The moment, drawn in rollout work rather than in time: the first instant (polled every 50 ms) at which
    g groups have started (groups.jsonl) and one is in no published batch, g uniform in 1..the groups of
    every batch but the last (a campaign's part: after its step, then the first group out). Drawn in time
    (k trained steps plus up to 3 s, as the other kinds), 3 of 20 trials found every group in or the run
    DONE: the 4 steps' sampling and training take 3-5 s here, after a minute of start-up.

    The proof it landed: every worker hit was alive and had said it was ready when killed, the run not DONE,
    groups out. Then, from what the centre recorded (each a failure if missing within WORKER_WAIT_S while
    the incarnation runs): its log line for each killed worker (status and episodes in flight lost), the
    first rollout batch published after that line counting it in its meta (`worker_restarts_total`,
    `lost_episodes_total`, as this incarnation's lines sum them; a batch not yet out when the line was seen
    was built after it: the centre writes both from one event loop and publishes synchronously), and a
    worker of the same index ready again under a new pid (restarted in place; a run that finishes first is
    said so). Kept in trial.workers_lost; landed_after requires the run to finish in this incarnation."""
    run_dir, kind = trial.run_dir, trial.kind
    orch = role_pids(run_dir).get("orchestrator")
    if not wait_until(lambda: len(ready_workers(run_dir, orch)) >= WORKERS, WORKER_WAIT_S, p):
        trial.not_landed = (f"the orchestrator (pid {orch}) had {len(ready_workers(run_dir, orch))} ready rollout "
                            f"worker(s), not {WORKERS}, {WORKER_WAIT_S:.0f} s after the moment")
        return
    per = int(next(o for o in BASE if o.startswith("orchestrator.prompts_per_step=")).split("=")[1])
    g = 1 if trial.at is not None else rng.randint(1, max(1, (trial.steps - 1) * per))
    out: list[int] = []

    def due() -> bool:
        if (run_dir / "DONE").exists():
            return True
        if len(started_groups(run_dir)) >= g:
            out.extend(groups_out(run_dir))
        return bool(out)

    if not wait_until(due, WORKER_WAIT_S, p, every=0.05) or not out:
        trial.not_landed = (f"no group out (started, not in a published batch) after group {g} started, "
                            f"before the run ended")
        return
    if trial.at is None:
        trial.detail += f" after group {g} started"
    log_before = orchestrator_log(run_dir)
    # this incarnation's worker losses so far (the meta's totals count from its start), then this fault's
    start = max((m.end() for m in STARTED.finditer(log_before)), default=0)
    earlier = [(int(m.group(2)), int(m.group(4))) for m in LOST.finditer(log_before, start)]
    pids = ready_workers(run_dir, orch)
    victims = [rng.choice(pids)] if kind == "worker_kill" else pids
    have, done_at, gone = published(run_dir), steps_done(run_dir), groups_in(run_dir)
    live = [pid for pid in victims if alive(pid)]
    for pid in victims:   # back to back: a node's workers die together
        kill(pid)
    trial.detail += f": SIGKILL rollout worker{'s' if len(victims) > 1 else ''} {victims} of {pids}"
    if live != victims or p.poll() is not None or (run_dir / "DONE").exists():
        trial.not_landed = f"worker(s) {sorted(set(victims) - set(live))} gone before the kill, or the run ended"
        return
    trial.proof.append(f"rollout worker(s) {victims} of {pids} alive and ready when killed at step {done_at}, "
                       f"{len(out)} group(s) out, batches {len(have)} of {trial.steps} published")

    def lines() -> dict[int, tuple[int, int, int]]:
        return {int(m.group(2)): (int(m.group(1)), int(m.group(3)), int(m.group(4)))
                for m in LOST.finditer(orchestrator_log(run_dir), len(log_before))}

    if not wait_until(lambda: set(victims) <= set(lines()), WORKER_WAIT_S, p):
        state = f"ended, exit {p.returncode}" if p.poll() is not None else "running"
        trial.failures.append(f"the orchestrator logged no loss of worker(s) "
                              f"{sorted(set(victims) - set(lines()))} (incarnation {state})")
        return
    seen_at = published(run_dir)
    got = lines()
    after = len(orchestrator_log(run_dir))
    lost = {pid: got[pid][2] for pid in victims}
    trial.workers_lost = {"killed": victims, "lost": lost, "restarts": len(earlier) + len(victims),
                          "lost_total": sum(n for _, n in earlier) + sum(lost.values())}
    trial.proof.append("the centre saw " + ", ".join(f"worker {got[pid][0]} pid {pid} exit {got[pid][1]} with "
                                                     f"{lost[pid]} episode(s) in flight" for pid in victims))
    # each episode counted lost once: no more than the rollouts of the groups out (started by the time the
    # centre logged the loss, in no batch published and not dropped before the kill)
    G = int(OmegaConf.load(run_dir / "config.yaml").orchestrator.group_size)
    could = started_groups(run_dir) - gone
    if sum(lost.values()) > G * len(could):
        trial.failures.append(f"{sum(lost.values())} episodes counted lost, more than the {G} x {len(could)} "
                              f"rollouts of the groups out at the kill: some counted twice")
    fresh: list[int] = []
    if not wait_until(lambda: bool(fresh.extend(sorted(published(run_dir) - seen_at)) or fresh), WORKER_WAIT_S, p):
        if (run_dir / "DONE").exists() or len(seen_at) >= trial.steps:
            trial.not_landed = "every rollout batch was out before the centre logged the loss: nothing to count it in"
        else:
            trial.failures.append(f"no rollout batch published within {WORKER_WAIT_S:.0f} s of the worker loss")
        return
    step = fresh[0]
    try:
        meta = json.loads((exchange.step_dir(run_dir, "rollouts", step) / "meta.json").read_text())
    except (OSError, ValueError) as e:
        trial.failures.append(f"rollouts/step_{step:06d}/meta.json after the worker loss: {e}")
        return
    want = {"rollout_workers": WORKERS, "worker_restarts_total": trial.workers_lost["restarts"],
            "lost_episodes_total": trial.workers_lost["lost_total"]}
    if bad := {k: meta.get(k) for k, v in want.items() if meta.get(k) != v}:
        trial.failures.append(f"rollouts/step_{step:06d} meta {bad}, the centre's log says {want}")
        return
    trial.proof.append(f"rollouts/step_{step:06d} meta counts it: worker_restarts_total "
                       f"{meta['worker_restarts_total']}, lost_episodes_total {meta['lost_episodes_total']}, "
                       f"replayed_groups_total {meta.get('replayed_groups_total')}")
    index = {got[pid][0]: pid for pid in victims}

    def back() -> dict[int, int]:
        """Killed indices ready again (a `ready` line after the loss lines), with their new pids."""
        return {int(m.group(1)): int(m.group(2)) for m in READY.finditer(orchestrator_log(run_dir), after)
                if int(m.group(1)) in index and int(m.group(2)) != index[int(m.group(1))]}

    if wait_until(lambda: set(back()) == set(index), WORKER_WAIT_S, p) or set(back()) == set(index):
        trial.proof.append("restarted in place: " + ", ".join(f"worker {i} ready again as pid {q}"
                                                              for i, q in sorted(back().items())))
    elif p.poll() is not None and (run_dir / "DONE").exists():
        trial.proof.append(f"the run finished before worker(s) {sorted(set(index) - set(back()))} were ready again")
    else:
        trial.failures.append(f"worker(s) {sorted(set(index) - set(back()))} not ready again "
                              f"{WORKER_WAIT_S:.0f} s after the loss (incarnation "
                              f"{'ended' if p.poll() is not None else 'running'})")


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
