"""What ran on every node of a multi-node vLLM replica is what plan.json planned, on a real Slurm.

The run is submitted by the launcher as it is (`launch.slurm.launch_slurm`: config, plan, batch script,
sbatch) onto the localhost test cluster, with ONE replica spanning 2 nodes (tp 1 x dp 4 on nodes of 2
GPUs each, so vLLM's multi-node data parallel: a serving head and a headless node) and the trainer on
one CPU node. Every role is the real one: rl.prepare, the trainer publishing the first weights, the
orchestrator, and `rl.inference` started by the batch script once per node of the replica.

Only vLLM itself is replaced. It cannot run data-parallel GPU ranks on this CPU, and the point here is
not vLLM but the hand-off to it: `cluster.python` is the stand-in interpreter of
tests/standin/vllm_standin.py, which execs the real Python for every role and intercepts just
`-m vllm.entrypoints...`, recording the argv, environment, host and Slurm ids it was given, then
answering /health and /update_weight_version on the head (headless: it waits to be killed). The
orchestrator cannot generate from the stand-in, which is expected: the test waits for the recordings
and the server record, not for training, checks them against the plan, and then ends the run.

Checked, for every node of the replica: the recorded argv equals `expand(replica.vllm_argv(rank),
recorded env)` exactly; every variable of `replica.env` arrived with its planned value; the node ranks
are 0..N-1 on distinct Slurm nodes of one job step; `--headless` is on the non-head nodes only and the
data-parallel address is the head's node; the model was materialised before vLLM started, in the
node's own node-local directory of this incarnation (the planned path, `${HETRL_NODE_DIR}` expanded); the run's secret reached vLLM as
VLLM_API_KEY, never on the command line. For the
replica: exactly one server record, from the head, whose URL answers from this process, labelled with the
version it loaded. Then DONE stops both nodes' roles and their vLLM processes.
"""
from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

from launch import slurm as ls
from launch.compose import compose_points
from rl.contract import paths
from rl.contract.plan import Plan, expand
from rl.contract.records import ServerRecord
from standin import vllm_standin

pytestmark = pytest.mark.slurm


def _wait(cond, timeout: float, what: str, run_dir: Path, job: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        st = ls.job_state(job)["state"]
        if st not in ls.ACTIVE:
            break
        time.sleep(0.5)
    logs = ""
    for p in sorted((run_dir / "logs").glob("*")):
        logs += f"\n--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-12:])
    raise AssertionError(f"{what}: not after {timeout:.0f} s (job {job}: {ls.job_state(job)}){logs}")


def _recordings(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "standin").glob("vllm-*.json"))]


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"  # exited, unreaped
    except OSError:
        return True


def test_multi_node_replica_runs_the_plan_on_every_node(slurm, tmp_path):
    run_dir = tmp_path / "run"
    python = vllm_standin.write_interpreter(tmp_path / "bin" / "python", sys.executable)
    (cfg,) = compose_points([
        "cluster=slurm", f"run_dir={run_dir}", f"cluster.python={python}",
        f"cluster.node_local_dir={tmp_path / 'node_local'}", "cluster.time=00:10:00",
        "trainer.gpus_per_node=0", "trainer.warm_start.steps=0", "wandb.mode=disabled",
        "inference.nodes=2", "inference.gpus_per_node=2", "inference.tp=1", "inference.dp=4",
        "inference.replicas=1"], multirun=False)
    t0 = time.monotonic()
    job = ls.launch_slurm(cfg, run_dir)
    try:
        plan = Plan.read(run_dir)
        assert len(plan.inference.replicas) == 1
        replica = plan.replica(0)
        n = replica.nodes
        assert n == 2 and len(replica.node_args) == n, replica

        recs = _wait(lambda: (r := _recordings(run_dir)) and len(r) >= n and r, 150,
                     f"{n} vLLM stand-in recordings", run_dir, job)
        server = _wait(lambda: ServerRecord.read(run_dir, 0), 60, "the server record", run_dir, job)
        print(f"recordings and server record after {time.monotonic() - t0:.0f} s")
        assert len(recs) == n, [r["argv"] for r in recs]  # one vLLM per node, none restarted

        # each node ran exactly its planned command, with the planned environment
        by_rank = {r["node_rank"]: r for r in recs}
        assert sorted(by_rank) == list(range(n)), [r["slurm"].get("SLURM_PROCID") for r in recs]
        secret = paths.secret_file(run_dir).read_text().strip()
        for rank, r in by_rank.items():
            assert r["argv"] == expand(replica.vllm_argv(rank), r["env"]), (rank, r["argv"])
            assert r["argv"][0] == str(python)
            for k, v in replica.env.items():
                assert r["env"].get(k) == v, (rank, k, r["env"].get(k), v)
            assert ("--headless" in r["argv"]) == (rank != 0), (rank, r["argv"])
            assert r["env"]["VLLM_API_KEY"] == secret and "--api-key" not in r["argv"]
            # the model dir is this node's of this incarnation (rl.contract.paths.node_dir), not the run's
            model_dir = paths.node_model_dir(paths.node_dir(plan.node_local_dir, r["slurm"]["SLURMD_NODENAME"],
                                                            paths.incarnation(job, 0)), 0)
            assert expand([replica.model_dir], r["env"]) == [model_dir], (rank, r["env"].get(paths.NODE_DIR_VAR))
            assert r["model_materialised"], f"node {rank}: {model_dir} missing when vLLM started"
            # multi-node replicas run `vllm serve MODEL_DIR` (only that entry point knows --headless)
            assert r["argv"][1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", model_dir], r["argv"][:6]
        nodes = [by_rank[k]["slurm"]["SLURMD_NODENAME"] for k in range(n)]
        assert len(set(nodes)) == n, nodes
        steps = {(r["slurm"]["SLURM_JOB_ID"], r["slurm"]["SLURM_STEP_ID"]) for r in recs}
        assert len(steps) == 1, steps  # one srun step spans the replica's nodes
        head = by_rank[0]
        for r in recs:  # every rank meets the head's node for vLLM's data-parallel handshake
            assert r["env"]["HETRL_ROLE_ADDR"] == nodes[0]
            assert r["argv"][r["argv"].index("--data-parallel-address") + 1] == nodes[0]

        # one server record, written by the head, reachable, labelled with the version it loaded
        assert sorted(p.name for p in (run_dir / "inference").glob("server_*.json")) == ["server_0.json"]
        assert server.pid == head["pid"] and server.nodes == n and server.index == 0
        assert server.url == f"http://{socket.gethostname()}:{replica.port}"  # bound to 0.0.0.0 on Slurm
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        label = json.loads((run_dir / "standin" / f"label-{head['pid']}.json").read_text())
        assert label == {"new_version": str(server.version)}
        assert head["env"]["HETRL_POLICY_VERSION"] == str(server.version)
        roles = {n_: json.loads(paths.role_record(run_dir, n_).read_text())
                 for n_ in ("inference_0", "inference_0.node1")}
        assert roles["inference_0"]["extra"]["vllm_pid"] == head["pid"]
        assert roles["inference_0.node1"]["extra"]["vllm_pid"] == by_rank[1]["pid"]
        assert (run_dir / "logs" / "inference_0.node1.vllm.log").exists()

        # both nodes stay up until DONE, then stop their vLLM and exit
        assert not any(_gone(r["pid"]) for r in recs)
        (run_dir / paths.DONE).write_text("{}")
        _wait(lambda: all(_gone(r["pid"]) for r in recs), 30, "both vLLM stand-ins to stop after DONE",
              run_dir, job)
        batch_log = lambda: (run_dir / "logs" / f"slurm-{job}.out").read_text()  # noqa: E731
        _wait(lambda: "inference_0 exited with status 0" in batch_log(), 30, "the inference role to exit",
              run_dir, job)
        print(f"done after {time.monotonic() - t0:.0f} s")
    finally:
        ls.cancel(job)
