"""Routing where the requests start: a rollout worker chooses the server for its own requests.

Why. The router role (rl/inference/proxy.py) is one process on the first inference node that every
generate request and every answer passes through. benchmarks/seed_rehearsal.py runs it in front of the
engines: 0.38-0.51 us of its CPU per context token, 138-217 s per step at the seed's 428 M context tokens,
most of it the HTTP proxying itself (an aiohttp request in and one out per turn, a turn's routes as base64
read and written back: 13 GB per seed step). One process cannot carry that (issue 50 item 6). So with
rollout workers the routing decision is made in each worker and the request goes straight to the server:
the same policy (rl.contract.routing.Policy: sessions, the prefix index, loads, the kv and round_robin
policies, the same `inference.routing` settings) over the servers' own /metrics, polled by the worker
every `poll_interval_s`. The per-context-token work (the prompt's block hashes) is then spread over the
workers, and nothing is proxied.

What is kept and what is not. A group is one session (Sampler.sample_group) and a worker plays whole
groups, so a group's rollouts (which share their prompt) and every turn of each stay on one server, as
through the router. A worker's in-flight counts are its own; the other workers' load reaches it through
the servers' running and waiting counts. Its prefix index holds what it sent, not what other workers
sent: groups of different workers rarely share more than a system prompt. Prefill/decode pools need the
router's two-leg request (a prefill server, then the KV transfer to a decode server), so with those
pools the workers still go through the router; so does the centre's evaluation, and the weight updates
and `reset_index` calls reach the router and the servers as before. `inference.routing.in_workers=false`
sends the workers' requests through the router too. A server whose polls fail `fail_after` times is left
out until a poll answers again; a request whose server fails is an inference error as for a direct client.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from rl.contract.routing import (Backend, NoBackend, Policy, PrefixIndex, RouterConfig, extend_key,
                                  parse_metrics, request_key)
from rl.orchestrator.client import SESSION, InferenceClient, InferenceError


def wanted(cfg: Any, pools: list[str]) -> bool:
    """Route in the workers: inference.router on, `inference.routing.in_workers`, mixed servers only."""
    routing = getattr(cfg.inference, "routing", None)
    return bool(cfg.inference.router) and bool(getattr(routing, "in_workers", True)) and \
        all(p == "mixed" for p in pools)


class LocalRouter:
    """The InferenceClient face the Sampler uses for `router_client` (`generate`, `url`, `aclose`), routing
    each request itself to one of `servers` ([(url, secret)])."""

    def __init__(self, servers: list, cfg: RouterConfig, timeout: float):
        self.cfg = cfg
        self.policy = Policy(cfg)
        self.backends = [Backend(f"server_{i}", url.rstrip("/"), "mixed", PrefixIndex(cfg.index_blocks))
                         for i, (url, _) in enumerate(servers)]
        self.clients = {b.name: InferenceClient(url, secret=sec, timeout=timeout)
                        for b, (url, sec) in zip(self.backends, servers)}
        self.url = "local routing over " + ", ".join(b.url for b in self.backends)
        self._poller: asyncio.Task | None = None

    async def poll_once(self) -> None:
        async def one(b: Backend):
            try:
                r = await self.clients[b.name]._http.get("/metrics", timeout=5.0)
                if r.status_code != 200:
                    raise RuntimeError(f"/metrics -> {r.status_code}")
                if not b.healthy and not await self.clients[b.name].health():
                    raise RuntimeError("/health is not 200")
                b.update_metrics(parse_metrics(r.text), time.monotonic(), self.cfg)
            except Exception:  # noqa: BLE001 - any failure counts against the server
                b.failures += 1
                if b.failures >= self.cfg.fail_after:
                    b.healthy = False
        await asyncio.gather(*(one(b) for b in self.backends))

    async def _poll_loop(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.cfg.poll_interval_s)

    async def generate(self, prompt_ids, max_tokens: int, *args, **kwargs):
        if self._poller is None:
            self._poller = asyncio.create_task(self._poll_loop())
        ids = prompt_ids.tolist() if isinstance(prompt_ids, np.ndarray) else list(prompt_ids)
        sid = SESSION.get()
        key = request_key("/inference/v1/generate", {"token_ids": ids}, None if sid is None else str(sid), self.cfg)
        try:
            d = self.policy.route(self.backends, key, time.monotonic())
        except NoBackend as e:
            raise InferenceError(f"local routing: {e}") from None
        self.policy.dispatched(d, key)
        done = None
        try:
            c = await self.clients[d.backend.name].generate(prompt_ids, max_tokens, *args, **kwargs)
            done = extend_key(key, ids, list(c.ids), self.cfg)
            return c
        finally:
            self.policy.finished(d, key, done, None)

    def reset_index(self) -> None:
        """The servers dropped their prefix caches (a weight update): forget prefixes, keep sessions, as the
        router's /router/reset_index does."""
        for b in self.backends:
            b.index.clear()

    def stats(self) -> dict:
        """Per server: requests sent, sessions, in flight (a worker's own view)."""
        return {b.name: {"requests": b.requests, "sessions": b.sessions, "in_flight": b.in_flight,
                         "healthy": b.healthy} for b in self.backends}

    async def aclose(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        for c in self.clients.values():
            await c.aclose()
