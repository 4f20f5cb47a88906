"""The router's decision logic and bookkeeping (no servers); its HTTP side is in test_router_http.py."""
from __future__ import annotations

import pytest

from rl.contract.routing import (PREFILL_KV_PARAMS, Backend, Policy, PrefixIndex,
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
    ix.insert([4])              # evicts 3: a context's blocks go tail first, as vLLM frees them
    assert ix.match([1, 2, 3]) == 2 and len(ix) == 3
    ix.resize(1)
    assert len(ix) == 1 and ix.match([4]) == 1
    big = PrefixIndex(64)
    for c in range(10):          # chains of 16 blocks sharing their first 4: what is held stays a prefix
        chain = [f"s{k}" for k in range(4)] + [f"c{c}-{k}" for k in range(12)]
        big.insert(chain)
        assert big.match(chain) == 16 and len(big) <= 64
    held = [f"c0-{k}" for k in range(12) if f"c0-{k}" in big._blocks]
    assert held == [f"c0-{k}" for k in range(len(held))], "an evicted chain keeps a prefix, never a hole"


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
    from rl.contract.routing import NoBackend
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


def test_no_session_multi_turn_follows_its_prefix():
    p, pool = Policy(CFG), servers(2)
    d = run_turn(p, pool, tok_key(range(40)))
    p.finished(d, tok_key(range(40)))
    d2 = p.route(pool, tok_key(list(range(40)) + [1] * 8), NOW)
    assert d2.backend is d.backend and d2.reason == "prefix"
