"""Rollout workers in a real run (benchmarks/seed_rehearsal.py at a tiny size: the real orchestrator process,
mock engines speaking vLLM's wire format, the trainer's data ranks): with orchestrator.rollout_workers=2
the batches are the same kind as in-process (every group once, versions, masks, rewards, advantages,
routes one row per token, taken from the workers' part files), the router role in front of the engines,
the orchestrator's CPU is split across processes (measured from /proc by the
benchmark; reported, not asserted as a speed), and a worker killed with SIGKILL after the first batch is
restarted in place, its episodes in flight counted, and no group is trained twice or lost.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from rl import exchange
from rl.contract.batch import RolloutBatch
from rl.orchestrator.grouplog import GroupLog

REPO = Path(__file__).resolve().parents[2]


def _rehearse(work: Path, *extra: str) -> dict:
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "seed_rehearsal.py"),
                        "--rollouts-per-step", "8", "--group-size", "4", "--tokens-per-episode", "1024",
                        "--turns", "4", "--data-ranks", "2", "--steps", "3", "--work-dir", str(work),
                        "--timeout-s", "300", "--no-probe", "--replays", "1", "--baseline-cpu-per-token", "1e-4",
                        *extra], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    kv = dict(item.split("=", 1) for item in r.stdout.strip().splitlines()[-1].split())
    return {"kv": kv, "stdout": r.stdout, "log": (work / "out" / "orchestrator.log").read_text()}


def _check_batches(run_dir: Path, steps: int) -> list[dict]:
    metas = []
    for n in range(steps):
        d = exchange.step_dir(run_dir, "rollouts", n)
        m = json.loads((d / "meta.json").read_text())
        b = RolloutBatch.load(d)
        assert b.num_samples == m["num_samples"] and np.isfinite(b.advantages).all()
        assert m["version_min"] is not None and m["rollout_workers"] == 2
        # the workers' route part files, taken by the batch: one per sample, none left behind
        files = exchange.read_manifest(d)["files"]
        assert m["route_files"] and sorted(f for f in files if f.startswith("routes_")) == \
            [f"routes_{i:06d}.safetensors" for i in range(m["num_samples"])]
        assert len(b.routed_experts) == len(b.tokens)
        metas.append(m)
    trained = [g for m in metas for g in m["group_ids"]]
    assert len(trained) == len(set(trained)), "a group trained twice"
    events = GroupLog.read(run_dir)
    started = {e["group"] for e in events if e["event"] == "start"}
    dropped = {e["group"] for e in events if e["event"] == "drop"}
    assert started == set(trained) | dropped and not set(trained) & dropped
    return metas


def test_two_workers_then_one_killed(tmp_path):
    out = _rehearse(tmp_path / "w", "--workers", "2", "--kill-worker")
    kv = out["kv"]
    assert kv["routes_rows_eq_tokens"] == "1" and kv["episodes_matched"] == kv["episodes"]
    assert kv["rollout_workers"] == "2"
    for key in ("seed_busiest_rollout_cpu_s", "seed_central_cpu_s", "cpu_sum_vs_one_process",
                "central_cpu_s_per_step", "workers_cpu_s_per_step"):
        float(kv[key])
    assert float(kv["workers_cpu_s_per_step"]) > 0
    assert float(kv["seed_router_cpu_s"]) > 0, "the router ran in front of the engines (on with --workers)"
    assert "killed rollout worker" in out["stdout"]
    metas = _check_batches(tmp_path / "w" / "run", 3)
    assert metas[-1]["worker_restarts_total"] >= 1, out["log"][-3000:]
    assert "episode(s) in flight lost" in out["log"]
