"""The sandbox service (rl.envs.swe.service) and its client runtime (rl.envs.swe.runtime_remote), as real
processes on this machine: a frozen run directory with `cluster.sandbox_nodes=2`, two services started
as the plan says, and the SWE environment the orchestrator would make from that run directory.

- episodes open their sandboxes on the services, spread by open count; a scripted episode that applies
  the reference patch scores 1 (tools and grading ran on the service), one that does nothing less;
- the runtime interface over HTTP: run with stdin and exit codes, read/write without following a link
  (an error of the same kind as locally), copy_out keeps links as links;
- no token or a wrong one: 401 and nothing created; /health open;
- per-sandbox records name the service's node, count the commands, and the records match what ran.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


def call(name, **args):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    from builders import make_run_dir
    run_dir = tmp_path_factory.mktemp("svc") / "run"
    cfg, plan = make_run_dir(run_dir, "env=swe", "env.swe.tasks=builtin", "env.max_turns=6",
                             "cluster.sandbox_nodes=2", "wandb.mode=disabled")
    assert [g.het_group for g in plan.groups] == [0, 1, 2]
    procs = []
    for r in plan.roles:
        if r.name.startswith("sandbox_"):
            log = open(run_dir / "logs" / f"{r.name}.log", "ab")
            procs.append(subprocess.Popen(r.command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                          env={**os.environ, **r.env, "PYTHONPATH": str(REPO)}))
    try:
        t0 = time.monotonic()
        while not all((run_dir / "sandboxes" / f"service_{i}.json").exists() for i in range(2)):
            assert all(p.poll() is None for p in procs), (run_dir / "logs" / "sandbox_0.log").read_text()
            assert time.monotonic() - t0 < 60, "services did not come up"
            time.sleep(0.2)
        yield run_dir
    finally:
        (run_dir / "DONE").write_text("{}")
        for p in procs:
            assert p.wait(30) == 0


def test_episodes_run_on_the_services_and_score(services):
    from rl.contract.config import load
    from rl.envs import make_env
    env = make_env(load(services))
    assert env.sandboxes is not None and "2 sandbox service" in env.describe()
    task = env.tasks[0]
    with env.start(task) as ep, env.start(env.tasks[1]) as other:
        assert ep.sandbox.service != other.sandbox.service  # spread: one open sandbox on each service
        assert ep.sandbox.tree is None  # nothing of the sandbox lives on this host
        obs, done = ep.step(call("list_files"))
        assert all(p in obs for p in task.files)
        obs, done = ep.step(call("apply_patch", diff=task.patch))
        assert not obs.startswith("error"), obs
        obs, _ = ep.step(call("read_file", path="../../etc/passwd"))
        assert "refused" in obs
        assert ep.step(call("submit")) == (None, True)
        assert ep.reward() == 1.0
        assert other.reward() < 1.0
    lines = [json.loads(x) for i in range(2)
             for x in (services / "sandboxes" / f"sandboxes_{i}.jsonl").read_text().splitlines()]
    recs = {r["instance_id"]: r for r in lines}
    node = json.loads((services / "sandboxes" / "service_0.json").read_text())["node"]
    assert recs[task.instance_id]["tool_calls"] == 4 and recs[task.instance_id]["commands"] == 2  # dry run + patch
    assert recs[task.instance_id]["graded"] and recs[env.tasks[1].instance_id]["graded"]
    assert {r["service"] for r in recs.values()} == {0, 1} and node


def test_runtime_interface_over_http(services, tmp_path):
    from rl.envs.swe.runtime_remote import ServicePool
    pool = ServicePool.from_run_dir(str(services), wait_s=10)
    with pool.open("builtin__stats-median-even") as rt:
        r = rt.run([sys.executable, "-c", "import sys; print(sys.stdin.read()[::-1]); sys.exit(3)"], 20,
                   input="abc")
        assert r.returncode == 3 and r.stdout.strip() == "cba" and not r.timed_out
        rt.write_file("pkg/new.py", "X = 1\n")
        assert rt.read_file("pkg/new.py") == "X = 1\n" and rt.read_file("nope.py") is None
        assert rt.run(["ln", "-s", "/etc", "up"], 10).returncode == 0
        with pytest.raises(OSError):
            rt.read_file("up/hostname")  # a link on the path: refused, never followed
        with pytest.raises(OSError):
            rt.write_file("up/x", "no")
        with pytest.raises(ValueError, match="without '..'"):
            rt.read_file("../x")
        out = rt.copy_out(tmp_path / "copy")
        assert (out / "pkg/new.py").read_text() == "X = 1\n" and os.readlink(out / "up") == "/etc"
    with pytest.raises(ValueError, match="instance_id='nope': not among this run's"):
        pool.open("nope")
    assert pool.counts == [0, 0]
    url = json.loads((services / "sandboxes" / "service_0.json").read_text())["url"]
    assert httpx.get(url + "/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer " + "x" * 43}):
        r = httpx.post(url + "/sandboxes", json={"instance_id": "builtin__stats-median-even"}, headers=headers)
        assert r.status_code == 401
    pool.close()
