"""Routing in the rollout workers (rl/orchestrator/local_routing.py): the router's own policy, run where the
requests start. Servers stand in as httpx transports answering /metrics in vLLM's exposition and a
generate that records where each request went; the client's HTTP and parsing are covered elsewhere
(tests/unit/test_client_*.py), the policy itself in tests/unit/test_router.py.
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from rl.contract.config import RoutingConfig
from rl.contract.routing import request_key
from rl.orchestrator.client import SESSION, Completion
from rl.orchestrator.local_routing import LocalRouter, wanted


def _router(n=2, metrics=None, cfg=None):
    cfg = cfg or RoutingConfig(poll_interval_s=0.05, fail_after=2)
    lr = LocalRouter([(f"http://s{i}:8000", "sekrit") for i in range(n)], cfg, timeout=5.0)
    sent = []
    for i, b in enumerate(lr.backends):
        def handler(request, i=i):
            assert request.headers["Authorization"] == "Bearer sekrit"
            if request.url.path == "/metrics":
                text = (metrics or {}).get(i, "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")
                return httpx.Response(500 if text is None else 200, text=text or "")
            return httpx.Response(200)
        lr.clients[b.name]._http = httpx.AsyncClient(base_url=b.url, transport=httpx.MockTransport(handler),
                                                     headers={"Authorization": "Bearer sekrit"})

        async def generate(prompt_ids, max_tokens, *a, name=b.name, **kw):
            sent.append((name, SESSION.get(), len(prompt_ids)))
            await asyncio.sleep(0.01)
            return Completion(ids=list(range(100, 100 + max_tokens)), logprobs=[0.0] * max_tokens,
                              finish_reason="stop", request_id="r")
        lr.clients[b.name].generate = generate
    return lr, sent


def test_a_session_stays_on_its_server_and_sessions_spread():
    lr, sent = _router()

    async def session(sid, turns=4):
        SESSION.set(sid)
        ids = list(range(64)) if sid == "g0" else [1000 * int(sid[1:]) + x for x in range(64)]
        for _ in range(turns):
            c = await lr.generate(ids, 16)
            ids = ids + c.ids + [7] * 8      # the next turn: the context so far plus an observation

    async def main():
        await asyncio.gather(*(session(f"g{k}") for k in range(4)))   # loads within the policy's slack
        await lr.aclose()
    asyncio.run(main())
    where = {}
    for name, sid, _ in sent:
        where.setdefault(sid, set()).add(name)
    assert all(len(v) == 1 for v in where.values()), where           # every turn of a session on one server
    assert {n for v in where.values() for n in v} == {"server_0", "server_1"}   # sessions spread by load
    assert all(b.in_flight == 0 for b in lr.backends)
    # the index holds the completions' blocks too: a session's next turn finds its whole context
    home = next(b for b in lr.backends if b.name in where["g0"])
    first_turn = request_key("/inference/v1/generate", {"token_ids": list(range(64)) + list(range(100, 116))},
                             None, lr.cfg)
    assert home.index.match(first_turn.hashes) == 5
    lr.reset_index()   # a weight update: the servers' prefix caches are gone, sessions stay
    assert home.index.match(first_turn.hashes) == 0 and lr.policy.sessions


def test_a_server_whose_polls_fail_is_left_out_until_one_answers():
    lr, sent = _router(metrics={1: None})

    async def main():
        await lr.poll_once()
        await lr.poll_once()
        assert [b.healthy for b in lr.backends] == [True, False]
        for k in range(4):
            SESSION.set(f"s{k}")
            await lr.generate(list(range(40)), 4)
        await lr.aclose()
    asyncio.run(main())
    assert {name for name, _, _ in sent} == {"server_0"}


def test_wanted_only_for_mixed_pools_with_the_router_on():
    cfg = SimpleNamespace(inference=SimpleNamespace(router=True, routing=RoutingConfig()))
    assert wanted(cfg, ["mixed", "mixed"])
    assert not wanted(cfg, ["prefill", "decode"])     # the two-leg request is the router's
    cfg.inference.routing = RoutingConfig(in_workers=False)
    assert not wanted(cfg, ["mixed"])
    cfg.inference.router = False
    assert not wanted(cfg, ["mixed"])


def test_no_server_up_is_an_inference_error():
    from rl.orchestrator.client import InferenceError
    lr, _ = _router(n=1)
    lr.backends[0].healthy = False

    async def main():
        try:
            with pytest.raises(InferenceError, match="local routing: no healthy"):
                await lr.generate([1, 2, 3], 4)
        finally:
            await lr.aclose()
    asyncio.run(main())
