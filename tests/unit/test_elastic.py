"""Servers that fail, restart in place, join and leave a running job (issue 43), without Slurm or vLLM:
the router in run-directory mode against fake servers whose records come and go as the inference role
writes and withdraws them, and the extra replica rows `launch scale` writes (rl.contract.elastic)."""
from __future__ import annotations

import asyncio
import json
import os
import socket

import pytest

from builders import make_run_dir
from test_router_http import FakeServer

from rl.contract import elastic
from rl.contract.plan import Plan, PlanFormatError
from rl.contract.records import ServerRecord
from rl.contract.elastic import server_records as records
from rl.inference.proxy import Router
from rl.contract.routing import RouterConfig


class DyingServer(FakeServer):
    """A fake vLLM whose engine core can die: then /health answers 503 and every request 500, as vLLM's
    API server does after an EngineDeadError."""

    def __init__(self, name):
        super().__init__(name)
        self.dead = False
        self.answered = 0

    async def start(self):
        from aiohttp import web
        app = web.Application()
        app.router.add_post("/inference/v1/generate", self.generate)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def health(self, request):
        from aiohttp import web
        return web.Response(status=503 if self.dead else 200)

    async def generate(self, request):
        from aiohttp import web
        if self.dead:
            return web.json_response({"error": "EngineDeadError"}, status=500)
        self.answered += 1
        return await super().generate(request)


def _run_dir(tmp_path, replicas=1):
    make_run_dir(tmp_path, "cluster=slurm", "inference.host=127.0.0.1", "inference.router=true",
                 f"inference.replicas={replicas}", "inference.startup_timeout_s=30")
    return tmp_path


def _record(run_dir, index, url, pid):
    ServerRecord(url=url, version=0, host=socket.gethostname(), pid=pid, index=index).write(run_dir)


def test_a_failed_server_is_routed_around_and_its_restart_takes_the_held_request(tmp_path):
    run_dir = _run_dir(tmp_path)

    async def case():
        import aiohttp
        fake = await DyingServer("inference_0").start()
        _record(run_dir, 0, fake.url, pid=111)
        router = Router([("inference_0", fake.url, "mixed")], RouterConfig(poll_interval_s=0.05),
                        run_dir=run_dir, log=lambda m: None)
        router.down_wait_s = 30
        url = await router.start()
        try:
            async with aiohttp.ClientSession() as http:
                gen = {"token_ids": list(range(40)), "sampling_params": {"max_tokens": 4}}
                async with http.post(f"{url}/inference/v1/generate", json=gen) as r:
                    assert r.status == 200
                fake.dead = True   # the engine core dies; the role has not noticed yet
                pending = asyncio.create_task(http.post(f"{url}/inference/v1/generate", json=gen))
                while not router.counts["waits_for_server"]:
                    await asyncio.sleep(0.02)
                assert not router.backends["inference_0"].healthy
                # the role withdraws its record: held down, even though /metrics still answers
                (run_dir / "inference" / "server_0.json").unlink()
                while not router.backends["inference_0"].held:
                    await asyncio.sleep(0.02)
                fake.dead = False       # the restarted server is up, but has not written its record
                await asyncio.sleep(2.0)   # many polls and waits (more than the attempts a request has)
                assert not pending.done() and not router.backends["inference_0"].healthy
                _record(run_dir, 0, fake.url, pid=222)    # ... now it has: it takes the held request
                r = await asyncio.wait_for(pending, 20)
                assert r.status == 200 and r.headers["X-Hetrl-Backend"] == "inference_0"
                r.release()
            b = router.backends["inference_0"]
            assert b.healthy and not b.held and b.pid == 222
            assert fake.answered == 2     # the held request was answered once, by the restarted server
            assert router.counts["withdrawn"] == 1 and router.counts["rejoined"] == 1
            assert router.counts["retries"] == 1
        finally:
            await router.stop()
            await fake.runner.cleanup()
    asyncio.run(case())


def test_a_request_that_fails_on_a_healthy_server_is_answered_not_retried(tmp_path):
    class Refusing(DyingServer):
        async def generate(self, request):
            from aiohttp import web
            self.calls.append(request.path)
            return web.json_response({"error": "bad request inside the engine"}, status=500)

    async def case():
        import aiohttp
        fake = await Refusing("f0").start()
        router = Router([("f0", fake.url, "mixed")], RouterConfig(poll_interval_s=60), log=lambda m: None)
        url = await router.start()
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{url}/inference/v1/generate", json={"token_ids": [1, 2]}) as r:
                    assert r.status == 500
            assert fake.calls == ["/inference/v1/generate"] and router.backends["f0"].healthy
        finally:
            await router.stop()
            await fake.runner.cleanup()
    asyncio.run(case())


def test_no_server_for_longer_than_the_wait_is_a_503_naming_the_wait(tmp_path):
    async def case():
        import aiohttp
        router = Router([("f0", "http://127.0.0.1:9", "mixed")], RouterConfig(poll_interval_s=60),
                        log=lambda m: None)
        router.backends["f0"].healthy = False
        router.down_wait_s = 0.5
        url = await router.start()
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{url}/inference/v1/generate", json={"token_ids": [1]}) as r:
                    assert r.status == 503 and "after waiting 0 s" in (await r.json())["error"]
        finally:
            await router.stop()
    asyncio.run(case())


def test_extra_rows_copy_a_plan_row_and_are_found_like_planned_ones(tmp_path):
    run_dir = _run_dir(tmp_path)
    plan = Plan.read(run_dir)
    base = plan.replica(0)
    row = elastic.extra_row(base, 3, base.port + 3)
    assert (row.index, row.name, row.port) == (3, "inference_3", base.port + 3)
    cmd = row.vllm_command
    assert cmd[cmd.index("--port") + 1] == str(base.port + 3)
    assert row.model_dir.endswith("model3") and row.model_dir in cmd and base.model_dir not in cmd
    assert row.command[row.command.index("--index") + 1] == "3"
    assert [a for a in cmd if a not in (str(base.port + 3), row.model_dir)] == \
        [a for a in base.vllm_command if a not in (str(base.port), base.model_dir)]   # nothing else differs
    elastic.write_row(run_dir, elastic.ExtraRow(template=0, index=3, port=base.port + 3, job="77"))
    assert elastic.replica_row(plan, run_dir, 3) == row and elastic.row_job(run_dir, 3) == "77"
    assert elastic.server_indexes(plan, run_dir) == [0, 3]
    with pytest.raises(PlanFormatError, match="replica 4: not in the plan"):
        elastic.replica_row(plan, run_dir, 4)
    # the router finds the extra server by its record, and forgets it once it drains
    _record(run_dir, 0, "http://127.0.0.1:1", os.getpid())
    _record(run_dir, 3, "http://127.0.0.1:3", os.getpid())
    assert sorted(records(run_dir)[0]) == ["inference_0", "inference_3"]
    elastic.request_drain(run_dir, 3)
    assert elastic.server_indexes(plan, run_dir) == [0] and sorted(records(run_dir)[0]) == ["inference_0"]
    (elastic.row_file(run_dir, 5)).write_text("{not json")
    with pytest.raises(PlanFormatError, match="replica_5.json: not an extra replica row"):
        elastic.read_row(run_dir, 5)
    assert elastic.server_indexes(plan, run_dir) == [0]   # a row that does not read names no server


def test_the_scale_jobs_script_passes_shellcheck_and_runs_the_rows(tmp_path):
    import shutil
    import subprocess

    from launch import scale
    run_dir = _run_dir(tmp_path)
    plan = Plan.read(run_dir)
    base = scale.template_row(plan)
    rows = [elastic.extra_row(base, i, base.port + i) for i in (1, 2)]
    script = scale.scale_script(run_dir, plan, base, rows)
    assert "#SBATCH --nodes=2 " in script and "#SBATCH --no-requeue" in script
    for r in rows:
        assert f"--index {r.index}" in script and f"HETRL_INFERENCE_INDEX={r.index}" in script
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed")
    (tmp_path / "scale.sbatch").write_text(script)
    out = subprocess.run(["shellcheck", "-S", "warning", str(tmp_path / "scale.sbatch")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout


def test_scale_refuses_a_run_without_the_router_and_bad_deltas(tmp_path):
    from launch import scale
    from rl.contract.config import ConfigError
    make_run_dir(tmp_path, "cluster=slurm", "inference.host=127.0.0.1")
    with pytest.raises(ConfigError, match="inference.router=false"):
        scale.scale_up(tmp_path, 1)
    for bad in ("1", "+0", "-x", "+10000"):
        with pytest.raises(ConfigError, match="--inference="):
            scale.parse_delta(bad)
    assert scale.scale_down(tmp_path, 1) == []


def test_scale_up_is_bounded_and_writes_nothing_past_the_cap(tmp_path):
    """The cap counts the extra servers serving (drained ones not): --max-servers, by default
    MAX_SERVERS_PER_REPLICA x the plan's replicas; a refused +N writes no row."""
    from launch import scale
    from rl.contract.config import ConfigError
    run_dir = _run_dir(tmp_path, replicas=1)
    plan = Plan.read(run_dir)
    assert scale.max_servers(plan, None)[0] == scale.MAX_SERVERS_PER_REPLICA   # Slurm: no CPU bound
    assert scale.max_servers(plan, 9)[0] == 9
    for i in (1, 2):
        elastic.write_row(run_dir, elastic.ExtraRow(template=0, index=i, port=19000 + i, job="5"))
    with pytest.raises(ConfigError, match=r"--inference=\+2: 2 extra server\(s\) serve now and at most 3 may "
                                          r"\(--max-servers\)"):
        scale.scale_up(run_dir, 2, max_extra=3)
    assert elastic.extra_indexes(run_dir) == [1, 2]
    elastic.request_drain(run_dir, 1)   # drained: no longer counted, but its index is never reused
    with pytest.raises(ConfigError, match="1 extra server"):
        scale.scale_up(run_dir, 3, max_extra=3)
    assert elastic.extra_indexes(run_dir) == [1, 2]


def test_extra_rows_are_checked_field_by_field(tmp_path):
    run_dir = _run_dir(tmp_path)
    plan = Plan.read(run_dir)
    elastic.extra_dir(run_dir).mkdir(parents=True, exist_ok=True)
    good = {"template": 0, "index": 4, "port": 19004, "job": None}
    for change, match in (({"template": 1}, r"replica_4.json: template=1: not a replica of the plan \(0 to 0"),
                          ({"template": "0"}, r"template='0': not an integer"),
                          ({"index": 5}, r"index=5: not 4, the file's own"),
                          ({"port": 80}, r"port=80: not an integer from 1024 to 65535"),
                          ({"port": True}, r"port=True"),
                          ({"job": "1; rm -rf ~"}, r"job='1; rm -rf ~': not a Slurm job id"),
                          ({"extra": 1}, r"extra: not a key of an extra replica row"),
                          ({"vllm_command": ["touch", "x"]}, r"earlier hetrl .* re-run `launch scale`")):
        elastic.row_file(run_dir, 4).write_text(json.dumps({**good, **change}))
        with pytest.raises(PlanFormatError, match=match) as e:
            elastic.replica_row(plan, run_dir, 4)
        assert "\n" not in str(e.value)
    elastic.row_file(run_dir, 4).write_text(json.dumps({k: v for k, v in good.items() if k != "port"}))
    with pytest.raises(PlanFormatError, match="port: missing"):
        elastic.replica_row(plan, run_dir, 4)
    with pytest.raises(PlanFormatError, match="not an integer"):
        elastic.write_row(run_dir, elastic.ExtraRow(template=0, index=4, port=99999))


def test_a_port_that_keeps_refusing_health_is_a_dead_server(tmp_path):
    """An API server whose engine core died during a weight load closed its port and hung in its shutdown
    (a fault trial): REFUSED_LIMIT refused looks in a row end the role; one refused look, then an answer,
    starts the count again."""
    import http.server
    import threading

    from rl.inference.server import REFUSED_LIMIT, check_engine_alive

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    log, refused = tmp_path / "inference_0.vllm.log", [0]
    log.write_text("")
    check_engine_alive(url, "inference_0", log, refused)
    srv.shutdown()
    srv.server_close()
    for _ in range(REFUSED_LIMIT - 1):
        check_engine_alive(url, "inference_0", log, refused)     # refused: not yet
    assert refused == [REFUSED_LIMIT - 1]
    with pytest.raises(RuntimeError, match=rf"inference_0\): server dead: its port refused /health {REFUSED_LIMIT} "
                                           rf"times in a row"):
        check_engine_alive(url, "inference_0", log, refused)


def _start(run_dir, fraction, timeout=30.0):
    """rl.orchestrator.servers.wait_for_start on the run directory's view: (records it starts with, log)."""
    from rl.contract.plan import Plan
    from rl.orchestrator import servers as srv
    from rl.runtime import StopFlag
    lines = []
    log, srv.log = srv.log, lambda role, msg: lines.append(msg)
    try:
        got = asyncio.run(srv.wait_for_start(srv.RunDirServers(run_dir), run_dir, Plan.read(run_dir),
                                             StopFlag(install=False), timeout, fraction))
    finally:
        srv.log = log
    return got, lines


def test_the_orchestrator_starts_without_a_server_given_up_above_the_floor_naming_it(tmp_path):
    from rl.contract.records import RouterRecord
    run_dir = _run_dir(tmp_path, replicas=3)
    _record(run_dir, 0, "http://127.0.0.1:1", pid=os.getpid())
    _record(run_dir, 2, "http://127.0.0.1:3", pid=os.getpid())   # inference_1 never wrote one
    # above the floor, but inference_1 may only be slow and there is no router: wait, then fail naming both
    with pytest.raises(TimeoutError, match=r"no server record of inference_1 after 1 s .*2 of 3 up, 2 needed, "
                                           r"and no router"):
        _start(run_dir, 0.5, timeout=1.0)
    RouterRecord(url="http://127.0.0.1:9", host=socket.gethostname(), port=9, pid=os.getpid()).write(run_dir)
    # the supervisor gives inference_1 up (sbatch/job.sbatch.j2): the orchestrator starts at once
    (run_dir / "inference" / "given_up").write_text("inference_1\n")
    got, lines = _start(run_dir, 0.5, timeout=300)
    assert sorted(got) == [0, 2] and got[2].url == "http://127.0.0.1:3"
    assert len(lines) == 1 and "starting with 2 of 3 inference servers (at least 2" in lines[0]
    assert "missing: inference_1 (given up by the job)" in lines[0]
    # not given up (only slow): at the timeout it starts all the same, above the floor, instead of failing
    (run_dir / "inference" / "given_up").unlink()
    got, lines = _start(run_dir, 0.5, timeout=1.0)
    assert sorted(got) == [0, 2] and "missing: inference_1 (no record after 1 s)" in lines[0]
    # below the floor (1.0 of 3 = 3) it fails at the timeout, naming the missing server
    (run_dir / "inference" / "given_up").write_text("inference_1\n")
    with pytest.raises(TimeoutError, match=r"no server record of inference_1 after 1 s .*3 needed\)"):
        _start(run_dir, 1.0, timeout=1.0)
    _record(run_dir, 1, "http://127.0.0.1:2", pid=os.getpid())
    got, lines = _start(run_dir, 1.0)
    assert sorted(got) == [0, 1, 2] and not lines


def test_without_the_router_every_planned_server_is_waited_for(tmp_path):
    make_run_dir(tmp_path, "cluster=slurm", "inference.host=127.0.0.1", "inference.replicas=2")
    _record(tmp_path, 0, "http://127.0.0.1:1", pid=os.getpid())
    with pytest.raises(TimeoutError, match=r"inference_1 after 1 s .*1 of 2 up, 2 needed"):
        _start(tmp_path, 0.5, timeout=1.0)


def test_the_orchestrator_loads_weights_into_the_servers_its_view_shows_up(tmp_path):
    """A planned server missing at the start, a withdrawn one and a drained extra one: the weight watcher's
    targets follow the records (the default view), and a view passed in replaces the run directory's."""
    from rl.contract.config import load as load_config
    from rl.orchestrator.loop import Orchestrator
    run_dir = _run_dir(tmp_path, replicas=2)
    orch = Orchestrator(run_dir, load_config(run_dir))
    _record(run_dir, 1, "http://127.0.0.1:2", pid=1)
    assert {i: c.url for i, c in orch._up_clients().items()} == {1: "http://127.0.0.1:2"}
    _record(run_dir, 0, "http://127.0.0.1:1", pid=2)           # the late planned server comes up
    first = orch._up_clients()
    assert sorted(first) == [0, 1]
    (run_dir / "inference" / "server_1.json").unlink()       # restarting in place: no weights for it
    assert sorted(orch._up_clients()) == [0]
    _record(run_dir, 1, "http://127.0.0.1:2", pid=3)         # back: the same client again
    assert orch._up_clients()[1] is first[1]
    plan = Plan.read(run_dir)
    row = elastic.extra_row(plan.replica(0), 2, 18999)
    elastic.write_row(run_dir, elastic.ExtraRow(template=0, index=2, port=18999))
    _record(run_dir, 2, "http://127.0.0.1:7", pid=4)
    assert sorted(orch._up_clients()) == [0, 1, 2] and orch.servers.workers(2) == row.dp * row.tp
    elastic.request_drain(run_dir, 2)
    assert sorted(orch._up_clients()) == [0, 1]
    assert orch.servers.metrics() == {"servers_up": 2, "servers_planned": 2}

    class Fixed:
        def up(self):
            return {5: None}

        def connect(self, index, record):
            return f"client {index}"
    assert Orchestrator(run_dir, orch.cfg, servers=Fixed())._up_clients() == {5: "client 5"}


def test_cancel_also_cancels_the_runs_scale_jobs_naming_them(tmp_path, monkeypatch, capsys):
    """`launch cancel` with Slurm's commands as scripts that record their calls: the run's job, then every
    scale job still running (named with its servers); an ended one is said so, a bad row is named."""
    from launch import slurm as ls
    run_dir = _run_dir(tmp_path / "run", replicas=1)
    ls.record_job(run_dir, "40")
    plan = Plan.read(run_dir)
    for index, job in ((1, "41"), (2, "41"), (3, "42"), (4, "local:123")):
        elastic.write_row(run_dir, elastic.ExtraRow(template=0, index=index, port=19000 + index, job=job))
    # a row the launcher would not write (write_row refuses the job), edited by hand: cancel names it
    elastic.row_file(run_dir, 5).write_text(json.dumps({"template": 0, "index": 5, "port": 19005,
                                                         "job": "7 --user=x"}))
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    (bin_dir / "scancel").write_text(f'#!/bin/bash\necho "scancel $*" >>{calls}\n')
    (bin_dir / "scontrol").write_text(   # job 42 has ended; the others run
        '#!/bin/bash\n[[ $4 == 42 ]] && s=COMPLETED || s=RUNNING\necho "JobId=$4 JobState=$s Reason=None"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert ls.cancel_command(run_dir) == 1     # the bad row
    out, err = capsys.readouterr()
    assert calls.read_text().splitlines() == ["scancel -- 40", "scancel -- 41"]
    assert f"cancelled job 40 of {run_dir}" in out
    assert "cancelled scale job 41 (inference_1, inference_2)" in out
    assert "scale job 42 (inference_3): already ended (COMPLETED)" in out and "local" not in out + err
    assert "replica_5.json: job='7 --user=x' is not a Slurm job id (digits only); not cancelled" in err
