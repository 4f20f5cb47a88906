"""The real trainer as 2 nodes x 2 gloo ranks through the real batch script on the localhost Slurm.

The plan is the launcher's own for `trainer.nodes=2` on CPU ranks (4 ranks, FSDP over all of them): the
batch script starts `rl.trainer.torchrun` once per trainer node, and the two torchrun agents meet at
`${HETRL_TRAINER_ADDR}:trainer.master_port` (c10d rendezvous), the first trainer node's Slurm name,
which resolves on this cluster because the fixture maps the node names to loopback
(tests/slurm_cluster.py). rl.prepare and rl.requeue are the real ones too. Only the inference group is
replaced, by this file run as a script: the "orchestrator" publishes synthetic rollout batches
(the trainer tests' own) and the "inference" replica idles; both stop when asked or at DONE, like the
real roles. The first incarnation gets rollouts for STOP_AT steps only, so the trainer is waiting for
more when `scancel --signal=USR1 --batch` asks the job to stop: every rank checkpoints, the script
requeues the job, and the second incarnation's 4 ranks meet again, resume from that checkpoint and finish.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from launch import slurm as ls
from rl.contract import paths

pytestmark = [pytest.mark.slurm, pytest.mark.distributed, pytest.mark.slow]
THIS = str(Path(__file__).resolve())
STOP_AT, STEPS = 2, 4


def standin(name: str) -> int:
    """The orchestrator / inference stand-in of one incarnation (run by the batch script)."""
    import signal
    got = []
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda s, f: got.append(s))
    run_dir = Path(os.environ["HETRL_RUN_DIR"])
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    if name == "orchestrator":
        from helpers.trainer import publish_batches   # tests/ is on the stand-in's PYTHONPATH
        from rl import exchange
        limit = STOP_AT if restart == 0 else STEPS  # prepare discarded what the checkpoint did not cover
        publish_batches(run_dir, [n for n in range(limit)
                                  if not exchange.step_dir(run_dir, paths.ROLLOUTS, n).is_dir()])
        print(f"orchestrator stand-in: rollouts up to step {limit - 1} (restart {restart})", flush=True)
    while not got and not paths.done_file(run_dir).exists():
        time.sleep(0.2)
    return paths.EXIT_PREEMPTED if got else 0


def _wait(cond, timeout: float, what: str, run_dir: Path, job: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.5)
    logs = ""
    for p in sorted((run_dir / "logs").glob("*")):
        logs += f"\n--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-25:])
    raise AssertionError(f"{what}: not after {timeout:.0f} s (job {job}: {ls.job_state(job)}){logs}")


def test_two_node_trainer_rendezvous_checkpoints_requeues_and_resumes_the_same_world(slurm, tmp_path):
    import yaml
    from launch.compose import compose
    from launch.plan import make_plan
    from rl.contract.plan import Plan
    from slurm_cluster import _free_ports
    from rl.metrics import read_metrics
    run_dir = tmp_path / "run"
    (port,) = _free_ports(1)
    cfg = compose(["cluster=slurm", f"run_dir={run_dir}", f"cluster.node_local_dir={tmp_path / 'nl'}",
                   "trainer.nodes=2", "trainer.gpus_per_node=0", "trainer.parallel.dp_shard=4",
                   f"trainer.master_port={port}", f"trainer.max_steps={STEPS}", "trainer.checkpoint_every=100",
                   "trainer.warm_start.steps=0", "trainer.micro_batch_tokens=96", "model.max_seq_len=128",
                   "inference.max_model_len=128",
                   "wandb.mode=disabled", "cluster.signal_grace_s=30", "cluster.time=00:10:00"])
    plan = make_plan(cfg).to_dict()   # plan.json's form: the commands are rewritten below
    t = plan["trainer"]
    assert (t["nodes"], t["nproc_per_node"], t["world_size"], t["backend"]) == (2, 2, 4, "gloo")
    assert f"--rdzv-endpoint=${{HETRL_TRAINER_ADDR}}:{port}" in t["command"]
    for r in plan["roles"]:
        if r["name"] != "trainer":
            r["command"] = [sys.executable, THIS, r["name"]]
        r["env"]["PYTHONPATH"] = os.pathsep.join([plan["workdir"], str(Path(plan["workdir"]) / "tests")])
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({k: v for k, v in cfg.items() if k != "_overrides"}))
    (run_dir / "plan.json").write_text(json.dumps(plan))
    (run_dir / "job.sbatch").write_text(ls.render_script(Plan.from_dict(plan), cfg))
    t0 = time.monotonic()
    job = ls.submit(run_dir, run_dir / "job.sbatch")
    trainer_log = run_dir / "logs" / "trainer.log"
    metrics = lambda: [m["step"] for m in read_metrics(run_dir)] if paths.metrics_file(run_dir).exists() else []  # noqa: E731
    _wait(lambda: len(metrics()) >= STOP_AT, 150, f"{STOP_AT} steps on 4 ranks", run_dir, job)
    print(f"{STOP_AT} steps after {time.monotonic() - t0:.0f} s")
    ls.cancel(job, signal="USR1", batch=True)  # what Slurm sends before the time limit
    st = _wait(lambda: (s := ls.job_state(job))["state"] not in ls.ACTIVE and s, 200,
               "the job to requeue and finish", run_dir, job)
    print(f"job ended after {time.monotonic() - t0:.0f} s")
    batch_log = (run_dir / "logs" / f"slurm-{job}.out").read_text()
    assert st["state"] == "COMPLETED" and st["restarts"] == 1, batch_log
    assert "requeueing job" in batch_log and "run complete" in batch_log, batch_log

    # both incarnations: one torchrun agent per trainer node, 4 ranks that met at the first node's name
    hist = [json.loads(x) for x in paths.role_history(run_dir).read_text().splitlines()]
    trainer = [h for h in hist if h["role"] == "trainer"]
    assert [h["slurm_restart_count"] for h in trainer] == [0, 1], trainer
    assert all(h["extra"]["world_size"] == 4 for h in trainer), trainer
    log = trainer_log.read_text()
    incarnations = log.split("=== job ")[1:]
    assert len(incarnations) == 2, log[-3000:]
    for text in incarnations:
        assert {m for m in re.findall(r"^([01]): ", text, re.M)} == {"0", "1"}, text[-3000:]  # both nodes
    addr = re.search(r"trainer nodes: (\S+) (\S+);", batch_log)
    assert addr and addr.group(1) != addr.group(2), batch_log

    # the checkpoint taken on the stop, resumed by the same world, every step trained exactly once
    assert f"resumed from checkpoints/step_{STOP_AT:06d} on 4 ranks" in incarnations[1], incarnations[1][-3000:]
    assert metrics() == list(range(STEPS))
    assert paths.done_file(run_dir).exists()
    resume = json.loads(paths.resume_file(run_dir).read_text())
    assert resume["checkpoint_step"] == STOP_AT and resume["restart"] == 1, resume


if __name__ == "__main__":  # a stand-in role: python test_slurm_trainer_rendezvous.py NAME
    sys.exit(standin(sys.argv[1]))
