"""Rollout workers in benchmarks/seed_rehearsal.py (`--workers N`, issue 50): start the orchestrator with
N rollout worker processes, measure each process's CPU from /proc, and extrapolate to the seed.

Measured: the centre's CPU as before (all of it after start-up, over the batches) and each worker's the
same way: its CPU (/proc/<pid>/stat utime + stime) when the last batch appeared, less its own start-up
(the CPU seconds it reports when ready: imports, tokenizer, environment), over the batches. A worker
restarted mid-run counts each of its pids.

The centre's `seed_central_cpu_s` is its steady state: its CPU from the first batch to the last, over the
batches between (`central_cpu_s_per_step_all` keeps all of it after the base sample over the batches,
which also holds start-up done after that sample: clients, the router's wait; up to 1 s a step here).
Extrapolated to the seed with the scaling the rehearsal uses for the orchestrator's CPU, linear in tokens
per step (seed tokens / rehearsal tokens, at the rehearsal's turns per episode), for the centre and for
the workers' sum; the busiest worker at the seed is that sum over the seed's worker count
(`--seed-workers`, default 16: one per 128 episodes in flight, as the seed's own recipe runs its 2048
episodes in 16 environment-server workers) times the imbalance measured here (busiest / mean).
`cpu_sum_vs_one_process` is CPU per generated batch token of centre + workers (+ the router, when it ran)
over that of one process (+ its router: a run with rollout_workers = 0 of the same size in the same
invocation, or `--baseline-cpu-per-token`).

The router (`--router`, on with `--workers`): the router role as the plan starts it, in front of the
engines. Its CPU from /proc at the last batch, less its CPU when it wrote router.json (start-up), over the
batches; extrapolated to the seed linearly in context tokens sent per step (every request carries its
episode's context so far and the router decodes and hashes all of it: the engines' records give the
rehearsal's, rollouts x mean tokens x (turns + 1) / 2 the seed's), which also over-counts its per-row
answer work (linear in tokens): `seed_router_cpu_s`, per router process (the plan runs one).
"""
from __future__ import annotations

import re
from pathlib import Path

READY = re.compile(r"rollout-worker-\d+\] ready \(pid (\d+), start-up ([0-9.]+) CPU s\)")


def overrides(n: int) -> list[str]:
    return [f"orchestrator.rollout_workers={n}"] if n else []


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            pass
    return sorted(set(out))


def cpu(pid: int) -> float | None:
    import os
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        f = stat[stat.rindex(")") + 2:].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def sample(orch_pid: int) -> dict[int, float]:
    """{worker pid: CPU s} of the orchestrator's live children now."""
    return {p: c for p in children(orch_pid) if (c := cpu(p)) is not None}


def router_ready(run_dir: Path, pid: int, failed, timeout: float = 120.0) -> float:
    """Wait for the router's record (it serves); its CPU then (its start-up)."""
    import time
    rec = Path(run_dir) / "inference" / "router.json"
    t0 = time.monotonic()
    while not rec.exists():
        if (why := failed()):
            raise RuntimeError(why)
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"the router wrote no {rec} in {timeout:.0f} s")
        time.sleep(0.1)
    return cpu(pid) or 0.0


def router_keys(t: dict, seed: dict) -> dict:
    """The router's CPU per context token over the whole run (after its start-up, every request the
    engines answered) and at the seed (module docstring), when it ran."""
    if "router_pid" not in t or t.get("router_end") is None:
        return {}
    cpu_s = t["router_end"] - t["router_base"]
    context = sum(r["prompt"] for r in t["engine_stats"])
    seed_context = seed["rollouts"] * seed["mean_tokens"] * (seed["turns"] + 1) / 2
    return {"router_cpu_s": cpu_s, "router_context_tokens": context,
            "router_us_per_context_token": cpu_s / max(context, 1) * 1e6,
            "seed_router_cpu_s": cpu_s / max(context, 1) * seed_context}


def startup(log: Path) -> dict[int, float]:
    """{worker pid: start-up CPU s} from the workers' ready lines in the orchestrator's log."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return {int(m[1]): float(m[2]) for m in READY.finditer(text)}


def measure(t: dict, n_steps: int) -> dict:
    """Per batch: each worker's CPU (at the last batch, less its start-up) and the busiest."""
    last = t["steps"][max(t["steps"])].get("workers", {})
    start = t.get("worker_startup", {})
    per = {p: (c - start.get(p, 0.0)) / n_steps for p, c in last.items()}
    return {"per_worker": per, "sum": sum(per.values()), "busiest": max(per.values(), default=0.0),
            "mean": sum(per.values()) / max(len(per), 1)}


def keys(central_cpu: float, t: dict, n_steps: int, tokens: float, seed_tokens: float, seed_workers: int,
         baseline_per_token: float | None) -> dict:
    """The last line's rollout-side keys (see the module docstring for the scaling)."""
    scale = seed_tokens / tokens
    w = measure(t, n_steps) if t.get("workers_n") else {"sum": 0.0, "busiest": 0.0, "mean": 0.0}
    if t.get("workers_n"):
        imbalance = w["busiest"] / max(w["mean"], 1e-9)
        busiest = w["sum"] * scale / seed_workers * imbalance
    else:   # one process does everything
        busiest = central_cpu * scale
    # the router's CPU counts with the rollout side's when it ran (routing moves into the workers with
    # inference.routing.in_workers: the same work in another process)
    router = 0.0
    if "router_pid" in t and t["steps"][max(t["steps"])].get("router") is not None:
        router = (t["steps"][max(t["steps"])]["router"] - t["router_base"]) / n_steps
    per_token = (central_cpu + w["sum"] + router) / tokens
    # the centre's steady state: its CPU from the first batch to the last over the batches between (what
    # it does after the base sample but before its first batch, e.g. clients' TLS contexts and the
    # router's wait, is start-up that does not grow with the step; it was up to 1 s a step here)
    steps = sorted(t["steps"])
    between = ((t["steps"][steps[-1]]["cpu"] - t["steps"][steps[0]]["cpu"]) / (len(steps) - 1)
               if t.get("workers_n") and len(steps) > 1 else central_cpu)
    return {"rollout_workers": int(t.get("workers_n", 0)), "seed_rollout_workers": seed_workers if t.get("workers_n") else 0,
            "seed_busiest_rollout_cpu_s": busiest, "seed_central_cpu_s": between * scale,
            "central_cpu_s_per_step": between, "central_cpu_s_per_step_all": central_cpu,
            "workers_cpu_s_per_step": w["sum"],
            "busiest_worker_cpu_s_per_step": w["busiest"], "cpu_per_token_us": per_token * 1e6,
            "cpu_sum_vs_one_process": per_token / baseline_per_token if baseline_per_token else float("nan")}


def one_process_per_token(t: dict) -> float:
    """A rollout_workers = 0 run's CPU per batch token: all its CPU after start-up over its batches (as
    the report counts the orchestrator's), over the median tokens of a batch."""
    import statistics
    from rl import exchange
    from rl.contract.batch import RolloutBatch
    steps = sorted(t["steps"])
    cpu = (t["steps"][steps[-1]]["cpu"] - t["base"]["cpu"] - t["startup_cpu"]) / len(steps)
    if "router_pid" in t and t["steps"][steps[-1]].get("router") is not None:   # its router too (keys())
        cpu += (t["steps"][steps[-1]]["router"] - t["router_base"]) / len(steps)
    tokens = statistics.median(len(RolloutBatch.load(exchange.step_dir(t["run_dir"], "rollouts", n)).tokens)
                               for n in steps)
    return cpu / tokens
