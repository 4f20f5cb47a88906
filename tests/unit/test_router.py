"""The router's decision logic and bookkeeping (no servers), and its HTTP side against fake servers."""
from __future__ import annotations

import asyncio
import json

import pytest

from rl.inference.router import Router
from rl.inference.routing import (PREFILL_KV_PARAMS, SESSION_HEADER, Backend, Policy, PrefixIndex,
                                  RequestKey, RouterConfig, completion_key, decode_body, parse_metrics,
                                  prefill_body, request_key, token_block_hashes)

NOW = 100.0
CFG = RouterConfig(block_tokens=4, min_affinity_tokens=4, queue_slack=2, queue_slack_ratio=0.0, max_queue=8,
                   miss_tokens_per_load=100.0, pd_min_prefill_tokens=32)


def servers(n=2, pool="mixed", cfg=CFG, prefix="s"):
    return [Backend(f"{prefix}{i}", f"http://h:{8000 + i}", pool, PrefixIndex(1000)) for i in range(n)]


def tok_key(tokens, session=None, cfg=CFG):
    return request_key("/inference/v1/generate", {"token_ids": list(tokens)}, session, cfg)


def set_metrics(b, running=0, waiting=0, kv=0.0, at=NOW):
    b.update_metrics({"running": running, "waiting": waiting, "kv_usage": kv}, at, CFG)


# -- keys and hashes ---------------------------------------------------------------------------------
def test_block_hashes_are_chained_prefix_hashes():
    a, ends = token_block_hashes(list(range(10)), 4)
    assert len(a) == 2 and ends == [4, 8]                # only full blocks
    b, _ = token_block_hashes(list(range(8)) + [99, 98, 97, 96], 4)
    assert b[:2] == a                                    # a longer prompt shares the prefix hashes
    c, _ = token_block_hashes([0, 1, 2, 3, 0, 1, 2, 3], 4)
    assert c[0] != c[1]                                  # same tokens at another position: another hash
    d, _ = token_block_hashes([9, 1, 2, 3, 4, 5, 6, 7], 4)
    assert d[1] != a[1]                                  # a different first block changes every later hash


def test_request_key_per_endpoint():
    k = request_key("/inference/v1/generate", {"token_ids": list(range(9))}, "s1", CFG)
    assert (k.kind, k.n_tokens, len(k.hashes), k.session) == ("tokens", 9, 2, "s1")
    k2 = request_key("/v1/completions", {"prompt": list(range(9))}, None, CFG)
    assert k2.hashes == k.hashes and k2.kind == "tokens"
    k3 = request_key("/v1/completions", {"prompt": [list(range(9))]}, None, CFG)   # batch of one
    assert k3.hashes == k.hashes
    t = request_key("/v1/completions", {"prompt": "x" * 200}, None, CFG)
    assert t.kind == "text" and len(t.hashes) == 200 // CFG.text_block_chars and t.n_tokens == 50
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    c = request_key("/v1/chat/completions", {"messages": msgs}, None, CFG)
    c2 = request_key("/v1/chat/completions", {"messages": msgs + [{"role": "assistant", "content": "yo"},
                                                                   {"role": "user", "content": "more"}]},
                     None, CFG)
    assert c.kind == "chat" and len(c.hashes) == 2 and c2.hashes[:2] == c.hashes
    assert request_key("/v1/completions", {}, None, CFG).hashes == ()


def test_completion_key_is_the_next_turns_prefix():
    body = {"token_ids": list(range(6))}
    done = completion_key("/inference/v1/generate", body, {"choices": [{"token_ids": [50, 51, 52]}]}, CFG)
    nxt = tok_key(list(range(6)) + [50, 51, 52] + [7, 7, 7, 7])
    assert done.hashes == nxt.hashes[:len(done.hashes)] and len(done.hashes) == 2
    chat = {"messages": [{"role": "user", "content": "q"}]}
    ck = completion_key("/v1/chat/completions", chat,
                        {"choices": [{"message": {"role": "assistant", "content": "a"}}]}, CFG)
    nxt = request_key("/v1/chat/completions", {"messages": chat["messages"] + [
        {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]}, None, CFG)
    assert ck.hashes == nxt.hashes[:2]
    assert completion_key("/inference/v1/generate", body, {"error": "x"}, CFG) is None


# -- metrics -----------------------------------------------------------------------------------------
METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="policy"} 3.0
vllm:num_requests_running{engine="1",model_name="policy"} 1.0
vllm:num_requests_waiting{engine="0",model_name="policy"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="policy",reason="capacity"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="policy"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="policy"} 0.5
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="policy"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="policy"} 1.7e9
vllm:prefix_cache_hits_total{engine="0",model_name="policy"} 640.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="policy"} 5.0
vllm:prompt_tokens_total{engine="0",model_name="policy"} 1200.0
vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0",num_gpu_blocks="2048"} 1.0
"""


def test_parse_metrics():
    m = parse_metrics(METRICS)
    assert m["running"] == 4 and m["waiting"] == 2            # summed over engines; by_reason ignored
    assert m["kv_usage"] == 0.5                                # the fullest engine
    assert m["prefix_queries"] == 1000 and m["prefix_hits"] == 640   # _created and external ignored
    assert m["prompt_tokens"] == 1200 and m["kv_capacity_tokens"] == 2048 * 32


def test_backend_load_and_index_capacity_from_metrics():
    b = servers(1)[0]
    b.in_flight = 2
    assert b.load(CFG, NOW) == 2                               # no metrics yet: own count only
    b.update_metrics(parse_metrics(METRICS), NOW, CFG)
    assert b.load(CFG, NOW) == max(2, 4 + 2) + 2               # running + waiting, plus waiting again
    assert b.load(CFG, NOW + CFG.metrics_stale_s + 1) == 2     # stale metrics are ignored
    assert b.index.capacity == 2048 * 32 // CFG.block_tokens
    b.update_metrics({"prefix_hits": 700, "prefix_queries": 1100}, NOW, CFG)
    assert b.hit_rate() == pytest.approx(60 / 100)             # since the first metrics seen
    set_metrics(b, kv=0.97)
    assert b.full(CFG, NOW)
    b.in_flight = CFG.max_queue
    set_metrics(b)
    assert b.full(CFG, NOW)


def test_restarted_server_loses_its_index():
    b = servers(1)[0]
    b.update_metrics({"prefix_queries": 100, "prefix_hits": 10}, NOW, CFG)
    b.index.insert([1, 2])
    b.update_metrics({"prefix_queries": 150, "prefix_hits": 20}, NOW, CFG)
    assert len(b.index) == 2
    b.update_metrics({"prefix_queries": 5, "prefix_hits": 0}, NOW, CFG)      # counters reset: restarted
    assert len(b.index) == 0 and b.hit_rate() is None                         # new baseline
    b.index.insert([1])
    b.healthy = False                                                          # down, then back
    b.update_metrics({"prefix_queries": 50, "prefix_hits": 0}, NOW, CFG)
    assert len(b.index) == 0 and b.healthy


def test_prefix_index_lru():
    ix = PrefixIndex(3)
    ix.insert([1, 2, 3])
    assert ix.match([1, 2, 3, 4]) == 3 and ix.match([2, 3]) == 2 and ix.match([9, 1]) == 0
    ix.insert([1])              # 1 is now the most recent
    ix.insert([4])              # evicts 2
    assert ix.match([1, 2, 3]) == 1 and len(ix) == 3
    ix.resize(1)
    assert len(ix) == 1 and ix.match([4]) == 1


# -- decisions ---------------------------------------------------------------------------------------
def run_turn(policy, pool, key, done_extra=()):
    d = policy.route(pool, key, NOW)
    policy.dispatched(d, key)
    return d


def test_turns_of_a_session_stay_on_the_server_with_their_prefix():
    p, pool = Policy(CFG), servers(3)
    prompt = list(range(40))
    d1 = run_turn(p, pool, tok_key(prompt, "a"))
    assert d1.reason.startswith("least_cost")
    p.finished(d1, tok_key(prompt, "a"), tok_key(prompt + [100] * 8))
    for s in pool:                       # other traffic makes the home server the busiest, within slack
        s.in_flight = 0
    d1.backend.in_flight = 2
    prompt2 = prompt + [100] * 8 + [5] * 12
    d2 = p.route(pool, tok_key(prompt2, "a"), NOW)
    assert d2.backend is d1.backend and d2.reason == "prefix"
    assert d2.matched_tokens == 48       # prompt + completion blocks


def test_session_affinity_without_a_known_prefix():
    p, pool = Policy(CFG), servers(2)
    d = run_turn(p, pool, RequestKey(session="s"))          # a request whose prompt the router cannot hash
    d2 = p.route(pool, RequestKey(session="s"), NOW)
    assert d2.backend is d.backend and d2.reason == "session"


def test_busy_home_falls_back_to_least_cost():
    p, pool = Policy(CFG), servers(2)
    k = tok_key(range(40), "a")
    d = run_turn(p, pool, k)
    home, other = d.backend, next(b for b in pool if b is not d.backend)
    home.in_flight, other.in_flight = 1 + CFG.queue_slack + 1, 1      # beyond the slack
    d2 = p.route(pool, tok_key(range(44), "a"), NOW)
    assert d2.backend is other and d2.reason == "least_cost_busy_home"
    home.in_flight = 1 + CFG.queue_slack                              # within the slack again
    assert p.route(pool, tok_key(range(44), "a"), NOW).backend is home


def test_slack_grows_with_load():
    cfg = RouterConfig(block_tokens=4, queue_slack=2, queue_slack_ratio=0.5, max_queue=100)
    p, (a, b) = Policy(cfg), servers(2, cfg=cfg)
    d = run_turn(p, [a, b], tok_key(range(40), "s"))
    home, other = d.backend, (b if d.backend is a else a)
    other.in_flight, home.in_flight = 10, 17                  # 17 <= 10 * 1.5 + 2
    assert p.route([a, b], tok_key(range(44), "s"), NOW).backend is home
    home.in_flight = 18
    assert p.route([a, b], tok_key(range(44), "s"), NOW).backend is other


def test_full_home_loses_affinity_by_kv_usage_or_queue():
    p, pool = Policy(CFG), servers(2)
    d = run_turn(p, pool, tok_key(range(40), "a"))
    home = d.backend
    for b in pool:
        set_metrics(b)
    set_metrics(home, kv=0.99)
    home.in_flight = 0
    assert p.route(pool, tok_key(range(44), "a"), NOW).backend is not home
    set_metrics(home, kv=0.1)
    assert p.route(pool, tok_key(range(44), "a"), NOW).backend is home
    set_metrics(home, waiting=CFG.max_queue)
    other = next(b for b in pool if b is not home)
    other.in_flight = CFG.max_queue   # both full: still routed, to the cheaper one, flagged
    d = p.route(pool, tok_key(range(44), "a"), NOW)
    assert d.reason.endswith("_all_full") and d.backend is other


def test_new_sessions_spread_and_shared_system_prompt_is_no_affinity():
    p, pool = Policy(CFG), servers(2)
    system = list(range(1000, 1032))
    used = []
    for s in range(6):
        k = tok_key(system + [s] * 16, f"s{s}")
        used.append(run_turn(p, pool, k).backend.name)
    # every server holds the system prompt after the first two; the rest spread by load
    assert used.count("s0") == 3 and used.count("s1") == 3
    assert [b.sessions for b in pool] == [3, 3]


def test_cost_trades_uncached_tokens_against_load():
    cfg = RouterConfig(block_tokens=4, min_affinity_tokens=10_000, miss_tokens_per_load=100.0, queue_slack=0)
    p, (a, b) = Policy(cfg), servers(2, cfg=cfg)
    k = tok_key(range(400), cfg=cfg)
    a.index.insert(k.hashes[:50])            # a holds 200 of the 400 tokens
    a.in_flight, b.in_flight = 1, 0          # cost a = 1 + 200/100 = 3, b = 0 + 400/100 = 4
    d = p.route([a, b], k, NOW)
    assert d.backend is a and d.reason == "least_cost"
    a.in_flight = 3                          # 3 + 2 = 5 > 4
    assert p.route([a, b], k, NOW).backend is b


def test_round_robin_ignores_prefixes():
    p, pool = Policy(RouterConfig(policy="round_robin")), servers(2)
    k = tok_key(range(64), "a")
    names = [run_turn(p, pool, k).backend.name for _ in range(4)]
    assert names == ["s0", "s1", "s0", "s1"]
    with pytest.raises(ValueError):
        Policy(RouterConfig(policy="random"))


def test_unhealthy_and_excluded_servers_are_skipped():
    from rl.inference.routing import NoBackend
    p, pool = Policy(CFG), servers(2)
    d = run_turn(p, pool, tok_key(range(40), "a"))
    d.backend.healthy = False
    assert p.route(pool, tok_key(range(40), "a"), NOW).backend is not d.backend
    with pytest.raises(NoBackend):
        p.route(pool, tok_key(range(40), "a"), NOW, exclude=[b.name for b in pool])


def test_bookkeeping_in_flight_sessions_reported_cache():
    p, pool = Policy(CFG), servers(2)
    k = tok_key(range(40), "a")
    d = run_turn(p, pool, k)
    assert d.backend.in_flight == 1 and d.backend.sessions == 1 and len(d.backend.index) == 10
    p.finished(d, k, reported_cached=32)
    assert d.backend.in_flight == 0 and d.backend.reported_cached == 32
    d2 = run_turn(p, pool, k)
    assert d2.backend is d.backend and d2.backend.sessions == 1           # same session, counted once
    p.forget_session("a")
    assert d.backend.sessions == 0 and not p.sessions


# -- prefill / decode --------------------------------------------------------------------------------
def pd_pool():
    return servers(1, "prefill", prefix="p") + servers(2, "decode", prefix="d")


def test_pd_long_uncached_prompt_goes_prefill_then_decode():
    p, pool = Policy(CFG), pd_pool()
    k = tok_key(range(100), "a")
    d = run_turn(p, pool, k)
    assert d.disaggregated and d.prefill.pool == "prefill" and d.backend.pool == "decode"
    assert d.prefill.in_flight == 1 and d.backend.in_flight == 1
    p.finished(d, k, tok_key(list(range(100)) + [7] * 8))
    # the next turn adds fewer than pd_min_prefill_tokens the decode server lacks: it prefills locally
    k2 = tok_key(list(range(100)) + [7] * 8 + [3] * 20, "a")
    d2 = p.route(pool, k2, NOW)
    assert not d2.disaggregated and d2.backend is d.backend and d2.reason == "prefix_local_prefill"
    # a long new observation: prefill pool again, same decode server (its prefix), same prefill server
    k3 = tok_key(list(range(100)) + [7] * 8 + [3] * 200, "a")
    d3 = p.route(pool, k3, NOW)
    assert d3.disaggregated and d3.backend is d.backend and d3.prefill is d.prefill
    assert d3.reason == "prefix+prefill_session"   # one prefill server: no prefix advantage to name
    assert p.sessions["a"]["decode"] is d.backend and p.sessions["a"]["prefill"] is d.prefill


def test_pd_balances_decode_servers_and_falls_back_when_a_pool_is_down():
    p, pool = Policy(CFG), pd_pool()
    decs = [run_turn(p, pool, tok_key([s] * 100, f"s{s}")) for s in range(4)]
    assert sorted(d.backend.name for d in decs) == ["d0", "d0", "d1", "d1"]
    assert all(d.prefill.name == "p0" for d in decs)
    pool[0].healthy = False                  # prefill pool gone: decode servers do both phases
    d = p.route(pool, tok_key([9] * 100, "z"), NOW)
    assert not d.disaggregated and d.backend.pool == "decode" and d.reason.endswith("_pd_fallback")


def test_pd_request_bodies():
    gen = {"request_id": "r", "token_ids": [1, 2], "sampling_params": {"max_tokens": 50, "min_tokens": 5},
           "stream": True}
    pb = prefill_body("/inference/v1/generate", gen)
    assert pb["sampling_params"] == {"max_tokens": 1} and pb["stream"] is False
    assert pb["kv_transfer_params"] == PREFILL_KV_PARAMS and gen["sampling_params"]["max_tokens"] == 50
    comp = {"prompt": [1, 2], "max_tokens": 50, "max_completion_tokens": 50, "stream_options": {}}
    pc = prefill_body("/v1/chat/completions", comp)
    assert pc["max_tokens"] == 1 and pc["max_completion_tokens"] == 1 and "stream_options" not in pc
    kvp = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1]}
    db = decode_body(gen, kvp)
    assert db["kv_transfer_params"] == kvp and db["sampling_params"]["max_tokens"] == 50
    assert "kv_transfer_params" not in gen


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


def test_no_session_multi_turn_follows_its_prefix():
    p, pool = Policy(CFG), servers(2)
    d = run_turn(p, pool, tok_key(range(40)))
    p.finished(d, tok_key(range(40)))
    d2 = p.route(pool, tok_key(list(range(40)) + [1] * 8), NOW)
    assert d2.backend is d.backend and d2.reason == "prefix"


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
