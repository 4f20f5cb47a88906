"""The router's HTTP side (rl/inference/router.py) against fake servers: routing, fan-out and prefix-cache
reset, P/D's KV transfer parameters, retries, the run's secret, the orchestrator's client headers, the CLI,
and the role started from a run directory. The decision logic itself is in test_router.py."""
from __future__ import annotations

import asyncio
import json

import pytest

from rl.inference.proxy import Router
from rl.contract.routing import PREFILL_KV_PARAMS, SESSION_HEADER, RouterConfig
from test_router import METRICS  # a vLLM /metrics page, as the decision tests read it


# -- the HTTP side, against fake servers -------------------------------------------------------------
class FakeServer:
    """Answers like a vLLM server: generate (echo 4 tokens), metrics, admin; P/D kv params."""

    def __init__(self, name, pool="mixed"):
        self.name, self.pool, self.calls, self.url = name, pool, [], None

    async def start(self):
        from aiohttp import web
        app = web.Application()
        app.router.add_post("/inference/v1/generate", self.generate)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_get("/metrics", self.metrics)
        for p in ("/pause", "/resume", "/reset_prefix_cache", "/collective_rpc", "/update_weight_version"):
            app.router.add_post(p, self.admin)
        app.router.add_get("/weight_info", self.weight_info)
        app.router.add_get("/v1/models", self.models)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def generate(self, request):
        from aiohttp import web
        body = await request.json()
        self.calls.append((request.path, body, dict(request.headers)))
        kvp = body.get("kv_transfer_params")
        out = {"choices": [{"token_ids": [7, 7, 7, 7], "text": "x",
                            "logprobs": {"content": [{"logprob": -1.0}] * 4}}],
               "usage": {"prompt_tokens_details": {"cached_tokens": 8}}}
        if kvp and kvp.get("do_remote_decode"):
            out["kv_transfer_params"] = {"do_remote_prefill": True, "remote_engine_id": self.name,
                                         "remote_block_ids": [1, 2], "remote_host": "h", "remote_port": 1}
        return web.json_response(out)

    async def metrics(self, request):
        from aiohttp import web
        return web.Response(text=METRICS)

    async def admin(self, request):
        from aiohttp import web
        self.calls.append((request.path, dict(request.query), None))
        if request.path == "/collective_rpc":
            return web.json_response({"results": [{"worker": self.name}]})
        return web.json_response({"success": True} if request.path == "/reset_prefix_cache" else {})

    async def weight_info(self, request):
        from aiohttp import web
        return web.json_response({"weight_version": "3"})

    async def models(self, request):
        from aiohttp import web
        self.calls.append((request.path, {}, dict(request.headers)))
        return web.json_response({"data": [{"id": "policy"}]})


async def _router_case(pools, fn, **kw):
    import aiohttp
    fakes = [await FakeServer(f"f{i}", pool).start() for i, pool in enumerate(pools)]
    router = Router([(f.name, f.url, f.pool) for f in fakes], RouterConfig(**kw), log=lambda m: None)
    url = await router.start()
    try:
        async with aiohttp.ClientSession() as http:
            return await fn(http, url, router, fakes)
    finally:
        await router.stop()
        for f in fakes:
            await f.runner.cleanup()


def test_http_routing_fanout_and_reset():
    async def case(http, url, router, fakes):
        prompt = list(range(64))
        seen = []
        for turn in range(3):
            async with http.post(f"{url}/inference/v1/generate",
                                 json={"token_ids": prompt, "sampling_params": {"max_tokens": 4},
                                       "session_id": "sess"}) as r:
                assert r.status == 200
                seen.append(r.headers["X-Hetrl-Backend"])
                data = await r.json()
            prompt = prompt + data["choices"][0]["token_ids"] + [1] * 20
        assert len(set(seen)) == 1                          # a session's turns on one server
        server = next(f for f in fakes if f.name == seen[0])
        assert all("session_id" not in body for _, body, _ in server.calls)   # removed before forwarding
        b = router.backends[seen[0]]
        assert b.in_flight == 0 and b.requests == 3 and b.reported_cached == 24
        assert b.running == 4                                # metrics polled
        async with http.post(f"{url}/collective_rpc", json={"method": "x"}) as r:
            out = await r.json()
        assert r.status == 200 and sorted(x["worker"] for x in out["results"]) == ["f0", "f1"]
        async with http.post(f"{url}/pause?mode=keep") as r:
            assert r.status == 200
        assert all(("/pause", {"mode": "keep"}, None) in f.calls for f in fakes)
        async with http.post(f"{url}/reset_prefix_cache") as r:
            assert (await r.json())["success"]
        assert all(len(x.index) == 0 for x in router.backends.values())
        async with http.get(f"{url}/weight_info") as r:
            assert (await r.json())["weight_version"] == "3"
        async with http.get(f"{url}/v1/models") as r:             # anything else: forwarded
            assert (await r.json())["data"][0]["id"] == "policy"
        async with http.get(f"{url}/router/stats") as r:
            st = await r.json()
        assert st["decisions"] and len(st["backends"]) == 2
        async with http.get(f"{url}/metrics") as r:
            assert "hetrl_router_requests_total" in await r.text()
    asyncio.run(_router_case(["mixed", "mixed"], case, block_tokens=16, poll_interval_s=0.05))


def test_http_pd_passes_kv_transfer_params():
    async def case(http, url, router, fakes):
        async with http.post(f"{url}/inference/v1/generate",
                              json={"token_ids": list(range(200)), "sampling_params": {"max_tokens": 9}},
                              headers={SESSION_HEADER: "a"}) as r:
            assert r.status == 200 and r.headers["X-Hetrl-Prefill"] == "f0"
            dec = r.headers["X-Hetrl-Backend"]
        _, pbody, _ = fakes[0].calls[-1]
        assert pbody["kv_transfer_params"] == PREFILL_KV_PARAMS
        assert pbody["sampling_params"]["max_tokens"] == 1
        _, dbody, _ = next(f for f in fakes if f.name == dec).calls[-1]
        assert dbody["kv_transfer_params"]["remote_engine_id"] == "f0"
        assert dbody["sampling_params"]["max_tokens"] == 9
        assert router.counts["pd_transfers"] == 1
    asyncio.run(_router_case(["prefill", "decode", "decode"], case, pd_min_prefill_tokens=64))


def test_http_retries_on_a_dead_server_and_checks_the_secret():
    async def case(http, url, router, fakes):
        await fakes[0].runner.cleanup()                 # f0 is gone; the router has not polled yet
        router.backends["f0"].failures = 0
        for i in range(3):
            async with http.post(f"{url}/v1/completions", json={"prompt": [i] * 40, "max_tokens": 2},
                                 headers={"Authorization": "Bearer s3cret"}) as r:
                assert r.status == 200 and r.headers["X-Hetrl-Backend"] == "f1"
        assert not router.backends["f0"].healthy and router.backends["f0"].in_flight == 0
        async with http.post(f"{url}/v1/completions", json={"prompt": [1], "max_tokens": 2}) as r:
            assert r.status == 401
        assert fakes[1].calls[0][2]["Authorization"] == "Bearer s3cret"
    async def with_secret(http, url, router, fakes):
        router.secret = "s3cret"
        return await case(http, url, router, fakes)
    asyncio.run(_router_case(["mixed", "mixed"], with_secret, poll_interval_s=60))


def test_http_secret_guards_every_path_but_health_in_constant_time():
    """With the run's secret every path but GET /health answers 401 without the token or with a wrong
    one of the same length, and nothing reaches a server; with it, the allow-listed paths work and
    carry the secret upstream; anything else is 404, but only to a caller holding the token."""
    secret = "a" * 32
    good, wrong = {"Authorization": f"Bearer {secret}"}, {"Authorization": f"Bearer {'a' * 31}b"}
    gen = {"token_ids": list(range(8)), "sampling_params": {"max_tokens": 2}}
    paths = [("POST", "/inference/v1/generate", gen), ("POST", "/v1/completions", {"prompt": [1]}),
             ("POST", "/collective_rpc", {"method": "x"}), ("POST", "/pause", None),
             ("POST", "/update_weight_version", {"new_version": "1"}), ("POST", "/router/reset_index", None),
             ("GET", "/metrics", None), ("GET", "/router/stats", None), ("GET", "/weight_info", None),
             ("GET", "/v1/models", None), ("GET", "/is_paused", None), ("POST", "/start_profile", None),
             ("DELETE", "/health", None)]

    async def case(http, url, router, fakes):
        router.secret = secret
        for method, path, body in paths:
            for headers in ({}, wrong, {"Authorization": secret}, {"Authorization": f"Basic {secret}"},
                            {"Authorization": f"bearer {secret}x"}):
                async with http.request(method, f"{url}{path}", json=body, headers=headers) as r:
                    assert r.status == 401, (method, path, headers, r.status)
        assert all(f.calls == [] for f in fakes)       # nothing unauthenticated reached a server
        async with http.get(f"{url}/health") as r:     # the readiness probe: no token, a count only
            assert r.status == 200 and await r.json() == {"healthy": 2}
        for method, path, body in paths:
            async with http.request(method, f"{url}{path}", json=body, headers=good) as r:
                want = 404 if path in ("/is_paused", "/start_profile") else \
                    405 if path == "/health" else 200
                assert r.status == want, (method, path, r.status, await r.text())
        sent = [h for f in fakes for _, _, h in f.calls if h is not None]
        assert len(sent) >= 2 and all(h["Authorization"] == f"Bearer {secret}" for h in sent)
        router.secret = None                            # a router without a secret checks nothing
        async with http.get(f"{url}/v1/models", headers={"Authorization": "Bearer theirs"}) as r:
            assert r.status == 200
        assert [h["Authorization"] for f in fakes for p, _, h in f.calls if p == "/v1/models"][-1] == \
            "Bearer theirs"                             # the caller's own header, passed on
        async with http.get(f"{url}/is_paused") as r:
            assert r.status == 404
    asyncio.run(_router_case(["mixed", "mixed"], case, poll_interval_s=60))


def test_orchestrator_client_sends_the_secret_and_names_a_refusal():
    from rl.orchestrator.client import InferenceClient, InferenceError

    async def case(http, url, router, fakes):
        router.secret = "s" * 32
        async with InferenceClient(url, secret="s" * 32) as c:
            assert (await c._post("/pause", params={"mode": "keep"}))["success"]
            assert await c.weight_version() == "3" and await c.health()
            assert (await c.generate(list(range(8)), 2)).ids == [7, 7, 7, 7]
        async with InferenceClient(url, secret="t" * 32) as c:
            with pytest.raises(InferenceError, match=r"/pause -> 401: the server refused the run's secret"):
                await c._post("/pause")
        async with InferenceClient(url) as c:
            with pytest.raises(InferenceError, match=r"-> 401: .* this client has none"):
                await c._post("/collective_rpc", {"method": "x"})
            assert await c.health()                      # the readiness probe needs none
    asyncio.run(_router_case(["mixed"], case, poll_interval_s=60))


def test_router_client_sends_the_session_header():
    from rl.orchestrator.client import SESSION, router_client_class

    async def case(http, url, router, fakes):
        client = router_client_class()(url)
        try:
            async def rollout(sid):
                SESSION.set(sid)
                return [(await client.generate(list(range(48)) + [t] * 20, max_tokens=4)).raw
                        for t in range(2)]
            await asyncio.gather(rollout("r1"), rollout("r2"))
        finally:
            await client.aclose()
        assert sorted(router.policy.sessions) == ["r1", "r2"]   # the router saw both sessions
        for sid in ("r1", "r2"):                                  # and kept each on one server
            assert router.policy.sessions[sid]["mixed"].requests >= 2
    asyncio.run(_router_case(["mixed", "mixed"], case))


def test_cli_parses_router_config(tmp_path):
    from rl.inference.router import _parse
    ns = _parse(["--backend", "http://a:1@prefill", "--policy", "round_robin", "--queue-slack", "2.5",
                 "--block-tokens", "32"])
    assert ns.policy == "round_robin" and ns.queue_slack == 2.5 and ns.block_tokens == 32
    assert json.dumps(ns.backend) == '["http://a:1@prefill"]'


def test_role_from_run_dir_writes_router_json_and_stops_on_done(tmp_path):
    """`python -m rl.inference.router --run-dir D` against fake servers recorded in D/inference."""
    import os
    import socket
    import sys
    import time

    import aiohttp

    from rl.orchestrator.client import wait_for_router

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from builders import make_run_dir
    from rl.contract.records import ServerRecord
    # a P/D plan (its pools need GPU servers on paper; the servers below are fakes)
    make_run_dir(tmp_path, "cluster=slurm", "inference.host=127.0.0.1", "inference.router=true",
                 f"inference.router_port={port}", "inference.nodes=2", "inference.gpus_per_node=1",
                 "inference.prefill_nodes=1", "inference.decode_nodes=1", "inference.replicas=2",
                 "inference.startup_timeout_s=30")
    (tmp_path / "secret").unlink()  # the fakes take no token

    async def case():
        fakes = [await FakeServer(f"inference_{i}", pool).start()
                 for i, pool in enumerate(["prefill", "decode"])]
        for i, f in enumerate(fakes):
            ServerRecord(url=f.url, version=0, host=socket.gethostname(), pid=os.getpid(), index=i).write(tmp_path)
        repo = str(__import__("pathlib").Path(__file__).resolve().parents[2])
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rl.inference.router", "--run-dir", str(tmp_path),
            "--pd-min-prefill-tokens", "8", cwd=repo,
            env={**os.environ, "PYTHONPATH": repo, "HETRL_UNAUTHENTICATED": "1"})  # without a secret on purpose
        try:
            url = await asyncio.wait_for(wait_for_router(tmp_path, timeout=30), 40)
            assert url == f"http://127.0.0.1:{port}"
            rec = json.loads((tmp_path / "inference" / "router.json").read_text())
            assert [b[2] for b in rec["backends"]] == ["prefill", "decode"]
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{url}/inference/v1/generate",
                                     json={"token_ids": list(range(32)), "sampling_params": {}}) as r:
                    assert r.status == 200
                    assert (r.headers["X-Hetrl-Prefill"], r.headers["X-Hetrl-Backend"]) == \
                        ("inference_0", "inference_1")
            (tmp_path / "DONE").write_text("{}")
            t0 = time.monotonic()
            assert await asyncio.wait_for(proc.wait(), 20) == 0
            assert time.monotonic() - t0 < 10
            assert not (tmp_path / "inference" / "router.json").exists()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            for f in fakes:
                await f.runner.cleanup()
    asyncio.run(case())


def test_wait_for_router_skips_a_stale_record(tmp_path):
    import os
    import socket
    import subprocess

    from rl.orchestrator.client import wait_for_router

    (tmp_path / "inference").mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    rec = {"url": "http://old:1", "host": socket.gethostname(), "pid": dead.pid}
    (tmp_path / "inference" / "router.json").write_text(json.dumps(rec))
    with pytest.raises(TimeoutError):
        asyncio.run(wait_for_router(tmp_path, timeout=0.6))
    rec.update(url="http://new:2", pid=os.getpid())
    (tmp_path / "inference" / "router.json").write_text(json.dumps(rec))
    assert asyncio.run(wait_for_router(tmp_path, timeout=5)) == "http://new:2"
    (tmp_path / "DONE").write_text("{}")
    (tmp_path / "inference" / "router.json").unlink()
    assert asyncio.run(wait_for_router(tmp_path, timeout=5)) is None


def test_role_from_run_dir_starts_without_a_server_the_job_gave_up(tmp_path):
    """A server lost before its first record (its step cancelled a second into the job) is named in
    inference/given_up by the batch script's supervisor: the router starts with the others at once instead
    of waiting inference.startup_timeout_s for a record that will not come (the orchestrator needs it)."""
    import os
    import socket
    import sys

    from rl.orchestrator.client import wait_for_router

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from builders import make_run_dir
    from rl.contract.records import ServerRecord
    make_run_dir(tmp_path, "cluster=slurm", "inference.host=127.0.0.1", "inference.router=true",
                 f"inference.router_port={port}", "inference.replicas=2", "inference.startup_timeout_s=600")
    (tmp_path / "secret").unlink()

    async def case():
        fake = await FakeServer("inference_0", "mixed").start()
        ServerRecord(url=fake.url, version=0, host=socket.gethostname(), pid=os.getpid(), index=0).write(tmp_path)
        (tmp_path / "inference" / "given_up").write_text("inference_1\n")
        repo = str(__import__("pathlib").Path(__file__).resolve().parents[2])
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rl.inference.router", "--run-dir", str(tmp_path), cwd=repo,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": repo, "HETRL_UNAUTHENTICATED": "1"})
        try:
            # far below the 600 s a wait for inference_1 would take
            assert await asyncio.wait_for(wait_for_router(tmp_path, timeout=120), 130) == f"http://127.0.0.1:{port}"
            rec = json.loads((tmp_path / "inference" / "router.json").read_text())
            assert [b[0] for b in rec["backends"]] == ["inference_0"]
            (tmp_path / "DONE").write_text("{}")
            assert await asyncio.wait_for(proc.wait(), 30) == 0
            out = (await proc.stdout.read()).decode()
            assert "starting with 1 of 2 servers: inference_1 given up by the job" in out
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await fake.runner.cleanup()
    asyncio.run(case())
