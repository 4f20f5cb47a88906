"""Resume after SIGKILL of every process stays exactly once with rollout workers (issue 50 item 3).

tests/integration/test_local_run.py::test_sigkill_everything_then_rerun_trains_every_batch_once with
`orchestrator.rollout_workers=2`: the embedded default (real vLLM, real trainer), episodes of very uneven
length played by two rollout worker processes, the launcher and every role's process group SIGKILLed at a
random step (the workers are in the orchestrator's group, so they die with it: no process of the run is
left to finish or report anything), then `launch resume`. The run must finish with every rollout batch
trained exactly once in the surviving lineage, every group that started in exactly one trained batch or
counted dropped, the interrupted groups played again, and the rollout workers stopped within the drain
timeout of DONE like the roles.
"""
import json
import os
import random
import time
from collections import Counter

import pytest

from rl import exchange
from rl.contract.batch import RolloutBatch
from rl.contract.config import load
from rl.metrics import read_metrics
from _fault_inject import worker_pids  # benchmarks/ (on sys.path): the fault trials' own count of workers
# the sibling's helpers (tests/integration is on sys.path in pytest's default import mode, as conftest uses)
from test_local_run import DRAIN_S, _alive, _eval_tasks, _finish, _kill_everything, _launch, _launch_until, _newest_state

pytestmark = [pytest.mark.slow]
WORKERS = 2


def test_sigkill_everything_with_rollout_workers_then_rerun_trains_every_batch_once(tmp_path):
    from rl.orchestrator.grouplog import GroupLog, trained_group_ids
    steps = 8
    run_dir = tmp_path / "run"
    # the sibling's overrides (it says why each), with the episodes played by rollout workers
    overrides = (f"trainer.max_steps={steps}", "trainer.checkpoint_every=2", "trainer.warm_start.steps=30",
                 "env.digits.latency_median_s=0.2", "env.digits.latency_outlier_prob=0.1",
                 "env.digits.latency_outlier_factor=300", f"orchestrator.drain_timeout_s={DRAIN_S}",
                 "orchestrator.stale_policy=drop", "orchestrator.env_concurrency=64",
                 f"eval.tasks_file={_eval_tasks(tmp_path)}", "eval.tasks=4",
                 f"orchestrator.rollout_workers={WORKERS}")
    rng = random.Random(os.getpid())
    kill_after = rng.randint(2, 5)
    p = _launch_until(run_dir, overrides, kill_after, rng)
    orch = json.loads((run_dir / "roles" / "orchestrator.json").read_text())["pid"]
    workers = worker_pids(orch)
    assert len(workers) == WORKERS, f"orchestrator pid {orch} has rollout workers {workers}, not {WORKERS}"
    servers = _kill_everything(p, run_dir)
    killed_at = len(read_metrics(run_dir))
    t_kill = time.monotonic()
    while any(map(_alive, servers + workers)) and time.monotonic() - t_kill < 30:
        time.sleep(0.2)
    assert not any(map(_alive, workers)), f"rollout workers {workers} outlived the SIGKILL of their group"
    assert not any(map(_alive, servers)), f"vLLM server(s) {servers} outlived their killed role by 30 s"
    out = _finish(_launch(run_dir, resume=True), timeout=900)
    drain_s = time.time() - (run_dir / "DONE").stat().st_mtime
    print(f"killed after step {killed_at}; roles and workers gone {drain_s:.1f} s after DONE")
    assert drain_s < DRAIN_S + 20, out[-3000:]
    orch_log = (run_dir / "logs" / "orchestrator.log").read_text()
    assert orch_log.count(f"{WORKERS} rollout worker(s) ready") == 2, orch_log[-3000:]   # one start each
    events = GroupLog.read(run_dir)
    started = {e["group"] for e in events if e["event"] == "start"}
    dropped = {e["group"] for e in events if e["event"] == "drop"}
    trained = trained_group_ids(run_dir)
    metas = [json.loads((exchange.step_dir(run_dir, "rollouts", s) / "meta.json").read_text())
             for s in exchange.list_steps(run_dir, "rollouts")]
    assert all(m["rollout_workers"] == WORKERS for m in metas)
    ids = [g for m in metas for g in m["group_ids"]]
    assert len(ids) == len(set(ids))                   # no group in two batches
    assert started == set(trained) | dropped and not set(trained) & dropped
    assert started == set(range(len(started)))        # no prompt skipped
    # in the trained bytes, group_size samples of each listed group (stale_policy=drop: whole groups only):
    # a rollout a worker reported twice, or played again after a kill, would be a row more
    group_size = load(run_dir).orchestrator.group_size
    for s in exchange.list_steps(run_dir, "rollouts"):
        b = RolloutBatch.load(exchange.step_dir(run_dir, "rollouts", s))
        rows = Counter(int(g) for g in b.groups)
        assert rows == {j: group_size for j in range(len(b.meta["group_ids"]))}, (s, rows)   # numbered densely
    second = {e["group"] for e in events if e["event"] == "start" and e["restart"] == 1}
    first_only = {e["group"] for e in events if e["event"] == "start" and e["restart"] == 0}
    assert first_only & second, "no group interrupted by the kill was played again"
    resume = json.loads((run_dir / "resume.json").read_text())
    assert resume["restart"] == 1 and resume["checkpoint_step"] is not None
    assert resume["checkpoint_step"] <= killed_at
    assert _newest_state(run_dir)["consumed"] == list(range(steps))
    ms = read_metrics(run_dir, final_eval=True)
    assert [m["step"] for m in ms] == list(range(steps)) + [steps]
    versions = [json.loads(x)["version"] for x in (run_dir / "eval" / "results.jsonl").read_text().splitlines()]
    assert len(versions) == len(set(versions)) and steps in versions, versions
    entries = exchange.ConsumedLog(run_dir, "rollouts", "trainer").entries()
    assert [e["step"] for e in entries if e.get("restart") == 1] == list(range(resume["checkpoint_step"], steps))
    assert exchange.latest_complete(run_dir, "weights") == steps
