"""swe_debug on the real localhost Slurm with its sandboxes on a third heterogeneous component.

`python -m launch run +experiment=swe_debug cluster=slurm cluster.sandbox_nodes=2` submits one job of
three components on the 4-node test cluster: the trainer (group 0), vLLM + orchestrator (group 1) and two
CPU nodes running the sandbox service (group 2). Checked from what ran, not from the plan alone:
- every role ran in its planned het group, on a node of its own (roles/history.jsonl: SLURMD_NODENAME);
- each service recorded itself on its group-2 node, and its log says it served there;
- every episode's sandbox was opened, used and graded by a service on a sandbox node, never on the
  orchestrator's node: one per-sandbox record per episode (at least as many as the trained episodes),
  every record on a group-2 node, every episode graded there, and the episodes' tool calls (those the
  untrained model got right) went there too.
One trainer step of one task x 2 episodes keeps it short.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch import slurm as ls
from rl.metrics import read_metrics

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slurm, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def _wait(cond, timeout: float, what: str, run_dir: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(1)
    logs = ""
    for p in sorted((run_dir / "logs").glob("*.out")) + sorted((run_dir / "logs").glob("*.log")):
        logs += f"\n--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
    raise AssertionError(f"timed out after {timeout} s waiting for {what}{logs}")


def test_swe_debug_runs_its_sandboxes_on_the_sandbox_nodes(slurm, tmp_path):
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "launch", "run", "+experiment=swe_debug", "cluster=slurm",
                          f"run_dir={run_dir}", "cluster.sandbox_nodes=2", "env.swe.runtime=bubblewrap",
                          "trainer.max_steps=1", "trainer.checkpoint_every=1", "orchestrator.prompts_per_step=1",
                          "cluster.time=00:20:00", "wandb.mode=disabled"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr + out.stdout
    job = ls.current_job(run_dir)
    st = _wait(lambda: (lambda s: s if s["state"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "GONE")
                        else None)(ls.job_state(job)), 900, "the job to end", run_dir)
    print(f"swe_debug on Slurm with 2 sandbox nodes: {time.monotonic() - t0:.0f} s")
    assert st["state"] in ("COMPLETED", "GONE"), st
    assert (run_dir / "DONE").exists()

    hist = [json.loads(x) for x in (run_dir / "roles" / "history.jsonl").read_text().splitlines()]
    where = {h["role"]: (h["slurm_het_group"], h["slurm_nodename"]) for h in hist}
    assert where["trainer"][0] == "0" and where["orchestrator"][0] == "1"
    sandbox_nodes = {where[f"sandbox_{i}"][1] for i in range(2)}
    assert {where[f"sandbox_{i}"][0] for i in range(2)} == {"2"} and len(sandbox_nodes) == 2
    orch_node = where["orchestrator"][1]
    assert orch_node not in sandbox_nodes and where["trainer"][1] not in sandbox_nodes

    for i in range(2):  # the service records itself where Slurm ran it (the record is removed at exit)
        log = (run_dir / "logs" / f"sandbox_{i}.log").read_text()
        assert f"(node {where[f'sandbox_{i}'][1]}, runtime bubblewrap)" in log, log[-2000:]
        assert "stopped" in log
    recs = [json.loads(x) for i in range(2) if (run_dir / "sandboxes" / f"sandboxes_{i}.jsonl").exists()
            for x in (run_dir / "sandboxes" / f"sandboxes_{i}.jsonl").read_text().splitlines()]
    episodes = sum(m["orchestrator/episodes"] for m in read_metrics(run_dir))
    assert episodes == 2 and len(recs) >= episodes
    assert all(r["node"] in sandbox_nodes and r["node"] != orch_node for r in recs)
    assert all(r["runtime"] == "bubblewrap" for r in recs)
    graded = [r for r in recs if r["graded"]]
    assert len(graded) >= episodes and all(0 <= r["reward"] <= 1 for r in graded)  # graded on its service
    turns = sum(m["orchestrator/turns_per_episode"] * m["orchestrator/episodes"] for m in read_metrics(run_dir))
    assert sum(r["tool_calls"] for r in recs) <= turns  # tool calls that parsed, all served there
