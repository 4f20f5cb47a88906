"""The checks of a trial's finished run directory (benchmarks/fault_trials.py): nothing lost, nothing
doubled, nothing unverifiable, and the proof that the fault landed.

`check` reads only what the roles recorded (consumed.jsonl, groups.jsonl, manifests, metrics.jsonl, the
final checkpoint's state) and hashes the files itself (`step_damage`), never through rl.exchange.verify or
corrupt_steps, which the roles use to find and set aside damage: the judge shares no code with what it
judges. `landed_after` adds the part of the landing proof only the finished run shows (a crash point's
log line, the damaged step set aside, a later incarnation). Split from fault_trials.py (issue 23).
"""
from __future__ import annotations

import hashlib
import json
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from omegaconf import OmegaConf  # noqa: E402

from rl import exchange  # noqa: E402
from rl.contract import paths  # noqa: E402
from rl.contract.batch import RolloutBatch, batch_digest  # noqa: E402
from rl.faults import read_log  # noqa: E402
import _fault_slurm  # noqa: E402
from _fault_trial import (ENDS_INCARNATION, SLURM_KINDS, WORKER_KINDS, Trial, kill,  # noqa: E402
                          leftover_processes, batch_groups, note_resume, wait_until)

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
    lines = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    metric_steps = [m["step"] for m in lines if "loss" in m]   # a trained step's line
    final_eval = [m["step"] for m in lines if "loss" not in m]  # the final version's evaluation, last
    if metric_steps != list(range(steps)) or final_eval not in ([], [steps]) or (final_eval and "loss" in lines[-1]):
        fail(f"metrics.jsonl steps {metric_steps}, evaluation-only lines at steps {final_eval}")
    evals = run_dir / "eval" / "results.jsonl"
    versions = [json.loads(ln)["version"] for ln in evals.read_text().splitlines() if ln.strip()] if evals.exists() else []
    if len(versions) != len(set(versions)):   # online evaluation: no version twice, whatever was killed
        fail(f"eval/results.jsonl evaluated a version twice: {versions}")
    for kind in ("weights", "rollouts", "checkpoints"):  # our own hashing, not rl.exchange.corrupt_steps
        for s in exchange.list_steps(run_dir, kind):
            if why := step_damage(exchange.step_dir(run_dir, kind, s)):
                fail(f"unverifiable step left after DONE: {kind}/step_{s:06d}: {why}")
    check_exactly_once(trial, fail)
    if exchange.latest_complete(run_dir, "weights") != steps:
        fail(f"newest weights {exchange.latest_complete(run_dir, 'weights')}, not {steps}")
    for s in exchange.list_steps(run_dir, "rollouts"):
        v = RolloutBatch.load(exchange.step_dir(run_dir, "rollouts", s)).versions
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
      group was started, every started group trained or recorded as dropped, none both;
    - and in the trained bytes themselves: each batch's samples.safetensors holds, per group (numbered
      densely in the order of the meta's entries), exactly as many samples as its entry lists rollouts (one
      sample per rollout unless an episode was cut into contexts, `segment` in the meta): a rollout played
      again after its rollout worker died, or reported twice, would be a row more."""
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
            files = json.loads((d / "manifest.json").read_text())["files"]
            got = batch_digest({f: {"sha256": _sha256((d / f).read_bytes())} for f in files})
            want = batch_digest(files)
        except (OSError, ValueError, KeyError) as err:
            fail(f"rollouts/step_{e['step']:06d}: {err}")
            continue
        if not (got == want == e.get("sha256")):
            fail(f"rollouts/step_{e['step']:06d}: trained sha256 {str(e.get('sha256'))[:12]}, file {got[:12]}, "
                 f"manifest {want[:12]}")
    # per rollout: under stale_policy=release a group may be trained in parts over several batches
    # (`entries`) and a drop may cover some of its rollouts only (`rollouts`)
    G = int(OmegaConf.load(paths.config_file(run_dir)).orchestrator.group_size)
    events = exchange.read_jsonl(run_dir / "rollouts" / "groups.jsonl")
    started = {int(e["group"]) for e in events if e.get("event") == "start"}
    dropped = {(int(e["group"]), int(i)) for e in events if e.get("event") == "drop"
               for i in (e.get("rollouts") or range(G))}
    trained: dict[tuple[int, int], int] = {}
    for n in range(steps):
        d = exchange.step_dir(run_dir, "rollouts", n)
        meta = json.loads((d / "meta.json").read_text())
        entries = meta.get("entries") or [[g, range(G)] for g in meta.get("group_ids") or []]
        for g, idx in entries:
            for i in idx:
                if (int(g), int(i)) in trained:
                    fail(f"group {g} rollout {i} trained in rollouts/step_{trained[(int(g), int(i))]:06d} and "
                         f"step_{n:06d}")
                trained[(int(g), int(i))] = n
        if "segment" not in meta:   # the file numbers the batch's groups densely, in the order of its entries
            rows = sample_groups(d)
            listed = Counter({j: len(idx) for j, (_, idx) in enumerate(entries)})
            if rows != listed:
                diff = {f"{j} (group {entries[j][0]})" if isinstance(j, int) and j < len(entries) else str(j):
                        (rows[j], listed[j])
                        for j in sorted(set(rows) | set(listed), key=str) if rows[j] != listed[j]}
                fail(f"rollouts/step_{n:06d}: samples per group (in the file, in the meta) differ: {diff}")
    every = {(g, i) for g in started for i in range(G)}
    if lost := sorted(every - dropped - set(trained)):
        fail(f"rollouts (group, index) started but neither trained nor dropped: {lost[:10]}")
    if ghost := sorted({g for g, _ in trained} - started):
        fail(f"trained groups never logged as started: {ghost[:10]}")
    if both := sorted(set(trained) & dropped):
        fail(f"rollouts (group, index) both trained and dropped: {both[:10]}")
    trial.groups = (len(started), len({g for g, _ in trained}), len({g for g, _ in dropped}))


def sample_groups(step: Path) -> Counter:
    """How many samples of each group a rollout batch holds, read from its samples.safetensors (the group
    of every sample) with safetensors itself, not through rl.contract.batch."""
    from safetensors.numpy import load
    try:
        return Counter(int(g) for g in load((step / "samples.safetensors").read_bytes())["groups"])
    except (OSError, KeyError, ValueError) as e:
        return Counter({f"unreadable: {e}": 1})


def landed_after(trial: Trial) -> None:
    """The part of the landing proof only the finished run dir shows: a crash point's log line, what became
    of the damage (`damage_outcome`), a later incarnation."""
    run_dir, kind = trial.run_dir, trial.kind
    note_resume(trial)  # the last incarnation's resume.json
    if trial.armed:
        fired = [e for e in read_log(trial.fault_log) if e.get("fired")]
        if fired:
            e = fired[0]
            trial.proof.append(f"{e['point']} fired ({e['fired']}) in {e['role']} pid {e['pid']}, pass {e['pass']}")
        else:
            trial.not_landed = trial.not_landed or "the armed crash point was never reached"
    if kind in WORKER_KINDS and not trial.parts and trial.at is None and trial.proof:
        # a lost rollout worker is restarted in place: the run must finish in the incarnation it hit
        if trial.incarnations != [0]:
            trial.failures.append(f"launcher runs {trial.incarnations}: the incarnation a rollout worker fault "
                                  f"hit must finish the run (exit 0, DONE) on its own")
    if trial.damaged:
        damage_outcome(trial)
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


def damage_outcome(trial: Trial) -> None:
    """What became of a bit flip or truncation (`trial.damaged`), from the finished run dir:
    - detected: the run set the step aside (<kind>/corrupt/step_N-*): landed;
    - discarded unread: a later incarnation's rl.prepare discarded the step (its resume.json `discarded`,
      kept by note_resume) and the incarnation that was hit never recorded consuming it (consumed.jsonl):
      landed and neutralised, e.g. by a kill before the trainer reached the step; its groups must then be
      trained or dropped elsewhere (named here; check_exactly_once holds every group to it);
    - neither: the damage is unaccounted for (the run may have read it unchecked): a failure, never `not
      landed`, since it was injected."""
    run_dir = trial.run_dir
    k, step, f = trial.damaged
    aside = sorted((run_dir / k / "corrupt").glob(f"step_{step:06d}-*"))
    if aside:
        trial.proof.append(f"damaged {f} detected: set aside to {aside[0].relative_to(run_dir)}")
        return
    r0 = trial.damaged_restart
    by = [r for r, gone in sorted(trial.resumes.items())
          if (r0 is None or r > r0) and step in gone.get(k, [])]
    if not by:
        trial.failures.append(f"the damage on {f} is unaccounted for: not set aside (no "
                              f"{k}/corrupt/step_{step:06d}-*) and no later resume discarded it "
                              f"(resume.json discarded lists seen: {trial.resumes})")
        return
    read = [e for e in exchange.read_jsonl(run_dir / k / "consumed.jsonl") if e.get("consumer") == "trainer"
            and int(e.get("step", -1)) == step and int(e.get("restart", 0)) == r0]
    if read:
        trial.failures.append(f"the damaged {f} was consumed by restart {r0} (consumed.jsonl: {read[0]}) and "
                              f"never set aside: trained from damaged bytes")
        return
    where = ""
    if k == "rollouts" and trial.damaged_groups:
        where = f"; its groups {_span(trial.damaged_groups)} {groups_fate(trial, trial.damaged_groups)}"
    trial.neutralised = f"discarded unread by restart {by[0]}'s resume"
    trial.proof.append(f"damaged {f} discarded unread by restart {by[0]}'s resume (resume.json discarded.{k} "
                       f"{trial.resumes[by[0]][k]}; no consumption of step {step} by restart {r0}){where}")


def _span(ids: list[int]) -> str:
    ids = sorted(ids)
    if len(ids) > 1 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids))


def groups_fate(trial: Trial, groups: list[int]) -> str:
    """Where `groups` ended up in the finished run: the trained batches holding them, the ones dropped."""
    run_dir, want, at = trial.run_dir, set(groups), {}
    for n in exchange.list_steps(run_dir, "rollouts"):
        for g in batch_groups(exchange.step_dir(run_dir, "rollouts", n)):
            at.setdefault(g, []).append(n)
    dropped = {int(e["group"]) for e in exchange.read_jsonl(run_dir / "rollouts" / "groups.jsonl")
               if e.get("event") == "drop"} & want
    steps = sorted({n for g in want for n in at.get(g, [])})
    said = [f"trained again in rollouts/step_{', step_'.join(f'{n:06d}' for n in steps)}"] if steps else []
    if dropped:
        said.append(f"{len(dropped)} dropped")
    if missing := sorted(want - set(at) - dropped):
        said.append(f"{_span(missing)} neither trained nor dropped")
    return ", ".join(said) or "nowhere"
