"""KV-aware router in front of the vLLM servers: the HTTP side (its role: `python -m rl.inference.router`).

An asyncio HTTP proxy (aiohttp). The turns of one rollout go to the server that holds the rollout's KV
prefix while that server's queue allows; otherwise the request goes to the server where it is cheapest
(least load plus the prompt tokens it would have to prefill). Loads come from the router's own in-flight
counts and from each server's Prometheus `/metrics` (polled): `vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, `vllm:prefix_cache_queries` /
`vllm:prefix_cache_hits` (counters, `_total` in the exposition) and `vllm:cache_config_info` (KV
capacity: num_gpu_blocks x block_size, which bounds the router's prefix index per server).

The decision logic (prefix bookkeeping, scores, prefill/decode) is rl.contract.routing.

HTTP API (the router speaks the servers' API, so `InferenceClient(router_url)` works unchanged):
  POST /inference/v1/generate, /v1/completions, /v1/chat/completions   routed (stream passes through)
  POST /pause, /resume, /collective_rpc, /update_weight_version, /reset_prefix_cache, /sleep, /wake_up
       fanned out to every server: {"success", "results" (concatenated), "servers": [...]}; a
       successful /reset_prefix_cache also clears the router's index of that server
  GET  /health (200 when a server is healthy, else 503; the body says only how many are)
  GET  /weight_info (every server's), /v1/models and /version (FORWARDED_PATHS: to the least loaded server)
  GET  /metrics (the router's own, Prometheus text), /router/stats (JSON: per server load, index,
       prefix hit rate since start, predicted vs reported cached tokens; decisions by reason)
  POST /router/reset_index (forget prefixes, keep sessions: after a weight update)
  Responses carry `X-Hetrl-Backend` (and `X-Hetrl-Prefill` for P/D) naming the server(s) used.
With the run's secret (`D/secret`), every path but `GET /health` needs `Authorization: Bearer <secret>`
(compared in constant time, rl.inference.auth.token_ok) and answers 401 without it; that is checked
once, in an aiohttp middleware, before any handler, so the router adds the secret to its requests to the
servers only for a caller who presented it. Any other path answers 404 (to an authenticated caller:
an unauthenticated one learns nothing about which paths exist); nothing else is forwarded, so the router
never opens a server path the servers themselves guard (rl.inference.auth) to whoever reaches it.
Without a secret (`--backend` mode, or a run dir without one) nothing is checked and the caller's own
`Authorization` header, if any, is passed on.
The orchestrator loads new weights into the servers directly (per-server in-flight counts matter
there); it sends generation through the router and calls /router/reset_index after each update.

Servers that fail, restart and join (issue 43): a request whose server fails under it (the connection
lost, or a 5xx while the server's /health is down: a dead engine core) is sent again to another server;
its caller gets one answer, so nothing is doubled. With no server up, a request waits for one (up to
inference.startup_timeout_s) instead of failing: a server restarting in place takes it. A server whose
record disappears is down at once and held down until a record with a new pid appears (its role writes
it only once it serves the newest weights); a server marked down by failed polls comes back only when
/health answers 200 again. Records of extra servers (`launch scale`, rl.contract.elastic) are followed
the same way.

Run-dir mode (the role, rl.inference.router): waits for `D/inference/server_<i>.json` of every planned replica (pools from
`D/plan.json`), re-reads them while it runs (a restarted server is picked up, its index cleared),
serves on `inference.host`:`inference.router_port`, writes `D/inference/router.json` {"url", ...},
and exits when `D/DONE` appears or it is signalled. `--backend URL[@pool]` runs it without a run dir.
A server record names where the run's secret goes (every poll) and whose completions are trained on, so
it is obeyed only if this run's user wrote it (docs/run-directory-safety.md): read through safefs (owned
by this user, writable by nobody else, a regular file; a FIFO is refused without blocking the event
loop), a refused one is a server that is not up, said once in the log. plan.json is read once, at the
start; `--run-dir` is checked as every role's is (rl.runtime.parse_role_args).
"""
from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import msgspec

from rl.inference.discovery import Refusals, discover
from rl.inference.auth import bearer, is_open, token_ok
from rl.contract.routing import (BACKEND_HEADER, FANOUT_PATHS, PREFILL_HEADER, ROUTED_PATHS,
                                  SESSION_HEADER, Backend, Decision, NoBackend, Policy, PrefixIndex,
                                  RequestKey, RouterConfig, Unreachable, completion_key, decode_answer,
                                  decode_body, parse_metrics, prefill_body, reported_cached_tokens, request_key)

# Server paths the router forwards as they are (GET, to the least loaded healthy server); read-only.
FORWARDED_PATHS = ("/v1/models", "/version")
_JSON = {"Content-Type": "application/json"}
_DECODE = msgspec.json.Decoder()


# -- the HTTP side -----------------------------------------------------------------------------------
class Router:
    """The proxy: an aiohttp app around a Policy, polling the servers' /metrics."""

    def __init__(self, backends: list[tuple[str, str, str]], cfg: RouterConfig | None = None, *,
                 secret: str | None = None, run_dir: Path | None = None, log=print, plan=None,
                 refused: "Refusals | None" = None):
        self.cfg = cfg or RouterConfig()
        self.policy = Policy(self.cfg)
        self.backends: dict[str, Backend] = {}
        for name, url, pool in backends:
            self.backends[name] = Backend(name, url.rstrip("/"), pool, PrefixIndex(self.cfg.index_blocks))
        self.secret = secret  # a property: setting it also sets the digest the middleware compares
        self.run_dir = run_dir
        self._plan = plan     # run-dir mode: the plan read at the start (read here on first use if not given)
        self.log = log
        self.refused = refused or Refusals(lambda msg: self.log(msg))
        self.started = time.time()
        # How long a request waits for a server when none is up (all down or restarting in place) before
        # it is answered 503; in run-dir mode inference.startup_timeout_s, a restart's worst case.
        self.down_wait_s = 60.0
        self.counts: Counter = Counter()
        self._http = None
        self._runner = None
        self._poller: asyncio.Task | None = None
        self.url: str | None = None

    # lifecycle
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        import aiohttp
        from aiohttp import web
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
            timeout=aiohttp.ClientTimeout(total=self.cfg.request_timeout_s, sock_connect=10))
        app = web.Application(client_max_size=1 << 30, middlewares=[self._auth])
        for p in ROUTED_PATHS:
            app.router.add_post(p, self._routed)
        for p in FANOUT_PATHS:
            app.router.add_post(p, self._fanout)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/router/stats", self._stats)
        app.router.add_post("/router/reset_index", self._reset_index)
        app.router.add_get("/weight_info", self._weight_info)
        for p in FORWARDED_PATHS:
            app.router.add_get(p, self._passthrough)
        # Anything else: 404 from aiohttp, after the middleware's 401 for a caller without the token.
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://{host if host not in ('0.0.0.0', '') else socket.gethostname()}:{port}"
        await self.poll_once()
        self._poller = asyncio.create_task(self._poll_loop())
        return self.url

    async def stop(self) -> None:
        if self._poller:
            self._poller.cancel()
            try:
                await self._poller
            except (asyncio.CancelledError, Exception):
                pass
        if self._runner:
            await self._runner.cleanup()
        if self._http:
            await self._http.close()

    # the run's secret
    @property
    def secret(self) -> str | None:
        return self._secret

    @secret.setter
    def secret(self, value: str | None) -> None:
        import hashlib
        self._secret = value or None
        self._secret_digest = hashlib.sha256(value.encode()).digest() if value else None

    def _authorized(self, request) -> bool:
        return self._secret_digest is None or token_ok(request.headers.get("Authorization"),
                                                       self._secret_digest)

    async def _auth(self, request, handler):
        """aiohttp middleware: the one place where a request is let in (see the module docstring)."""
        from aiohttp import web
        if not is_open(request.method, request.path) and not self._authorized(request):
            self.counts["status_401"] += 1
            return web.json_response({"error": "unauthorized: this path needs the run's bearer token"},
                                     status=401, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    _auth.__middleware_version__ = 1  # what aiohttp.web.middleware marks (aiohttp is imported lazily here)

    # upstream helpers
    def _headers(self, request=None) -> dict:
        """Headers to a server: the secret (the caller passed `_auth`, or the request is the router's
        own), or without a secret the caller's own Authorization; the caller's request id."""
        h = {}
        if self._secret:
            h.update(bearer(self._secret))
        elif request is not None and "Authorization" in request.headers:
            h["Authorization"] = request.headers["Authorization"]
        if request is not None and "X-Request-Id" in request.headers:
            h["X-Request-Id"] = request.headers["X-Request-Id"]
        return h

    def _down(self, b: Backend, why: str) -> None:
        if b.healthy:
            self.log(f"router: {b.name} ({b.url}) marked down: {why}")
        b.healthy = False

    async def poll_once(self) -> None:
        import aiohttp
        if self.run_dir is not None:
            self._rediscover()

        async def one(b: Backend):
            try:
                async with self._http.get(f"{b.url}/metrics", headers=self._headers(),
                                          timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status != 200:
                        raise RuntimeError(f"/metrics -> {r.status}")
                    text = await r.text()
                if not b.healthy:   # a dead engine core leaves /metrics up: back only when /health says so
                    await self._check_health(b)
                b.update_metrics(parse_metrics(text), time.monotonic(), self.cfg)
            except Exception as e:  # noqa: BLE001  any failure counts against the server
                b.failures += 1
                if b.failures >= self.cfg.fail_after:
                    self._down(b, f"{type(e).__name__}: {e}")

        await asyncio.gather(*(one(b) for b in self.backends.values()))
        self.counts["polls"] += 1

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.poll_interval_s)
            try:
                await self.poll_once()
            except Exception as e:  # noqa: BLE001  keep polling
                self.log(f"router: poll failed: {e}")

    async def _check_health(self, b: Backend) -> None:
        """Raise unless the server's /health answers 200 (vLLM answers 503 once its engine core is dead)."""
        import aiohttp
        async with self._http.get(f"{b.url}/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
            if r.status != 200:
                raise RuntimeError(f"/health -> {r.status}")

    def _rediscover(self) -> None:
        """Follow the server records: a record that disappears is a server that failed (its role withdrew
        it and is being restarted in place): down at once, and held down, whatever its polls say, until a
        record appears again. A record with another pid or URL is a restarted server: up, its index cleared
        (its cache is empty), since its role writes the record only once it serves the newest weights.
        A refused record (`discover`) is one that disappeared."""
        if self._plan is None:
            from rl.contract.plan import Plan
            self._plan = Plan.read(self.run_dir)
        found = discover(self._plan, self.run_dir, self.refused)
        for name, b in self.backends.items():
            if name not in found and not b.held:
                b.held = True
                self._down(b, "its server record is gone (failed, its role restarting; or draining)")
                self.counts["withdrawn"] += 1
        for name, (url, pool, pid) in found.items():
            url = url.rstrip("/")
            b = self.backends.get(name)
            if b is None:
                self.backends[name] = Backend(name, url, pool, PrefixIndex(self.cfg.index_blocks), pid=pid)
                self.log(f"router: {name} ({pool}) at {url}")
            elif b.pid is None and b.url == url and not b.held:
                b.pid = pid   # the record the router started from
            elif b.url != url or b.pid != pid or b.held:
                what = f"moved {b.url} -> {url}" if b.url != url else f"restarted (pid {b.pid} -> {pid})"
                self.log(f"router: {name} {what}; up again, its prefix index cleared")
                b.url, b.pid, b.held, b.healthy, b.failures, b.baseline = url, pid, False, True, 0, {}
                b.metrics_time = float("-inf")
                b.index.clear()
                self.counts["rejoined"] += 1

    # routed requests
    async def _routed(self, request):
        from aiohttp import web
        # The body is parsed once (msgspec) for its key and forwarded as the caller's bytes unless the
        # router changes it (a body `session_id` removed, a P/D leg): a 64k-token context is not encoded
        # again (benchmarks/request_codec.py: the router's CPU per context token).
        raw = await request.read()
        try:
            body = _DECODE.decode(raw)
        except ValueError:   # msgspec.DecodeError
            return web.json_response({"error": "body must be JSON"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "body must be a JSON object"}, status=400)
        if "session_id" in body:
            raw = None       # changed: encoded again when sent
        session = body.pop("session_id", None)
        session = request.headers.get(SESSION_HEADER) or (str(session) if session is not None else None)
        path = request.path
        key = request_key(path, body, session, self.cfg)
        # A server that fails under a request (connection lost, or a 5xx with /health down: a dead engine)
        # gets the request sent again elsewhere: its answer never reached the caller, so the caller sees
        # one answer (the request is re-sampled, not doubled). With no server up the request waits for one
        # (a server restarting in place) up to down_wait_s. Attempts are bounded against a loop.
        tried: set[str] = set()
        waited_since = None
        attempts = 0
        while attempts < 8 + 2 * len(self.backends):
            try:
                d = self.policy.route(list(self.backends.values()), key, time.monotonic(), exclude=tried)
            except NoBackend as e:
                now = time.monotonic()
                if waited_since is None:
                    waited_since = now
                    self.counts["waits_for_server"] += 1
                if now - waited_since > self.down_wait_s:
                    return web.json_response({"error": f"router: {e} after waiting {self.down_wait_s:.0f} s"},
                                             status=503)
                tried.clear()   # those are down now; one that comes back may take the request again
                await asyncio.sleep(0.25)
                continue
            if waited_since is not None:
                self.counts["wait_for_server_ms"] += int(1000 * (time.monotonic() - waited_since))
                waited_since = None
            self.policy.dispatched(d, key)
            attempts += 1
            outcome: dict = {}
            try:
                return await self._execute(request, path, body, raw, d, key, outcome)
            except Unreachable as e:
                tried.add(e.backend.name)
                self._down(e.backend, str(e))
                self.counts["retries"] += 1
            finally:
                self.policy.finished(d, key, outcome.get("done"), outcome.get("cached"))
        return web.json_response({"error": f"router: {path} failed on every attempt"}, status=502)

    async def _post(self, b: Backend, path: str, body: dict | bytes, request):
        """POST `body` (a dict, encoded here; or bytes, sent as they are) to server `b`."""
        import aiohttp
        data = body if isinstance(body, bytes) else msgspec.json.encode(body)
        try:
            return await self._http.post(f"{b.url}{path}", data=data, headers={**self._headers(request), **_JSON},
                                         params=request.query)
        except (aiohttp.ClientConnectionError, ConnectionError) as e:   # refused, reset, disconnected
            raise Unreachable(b, f"{type(e).__name__}: {e}") from e

    async def _failed_server(self, b: Backend, status: int) -> bool:
        """A 5xx from `b`: is the server failing (its /health is not 200), not just this request?"""
        if status < 500:
            return False
        try:
            await self._check_health(b)
        except Exception:  # noqa: BLE001  unreachable or unhealthy alike
            return True
        return False

    async def _execute(self, request, path: str, body: dict, wire: bytes | None, d: Decision, key: RequestKey,
                       outcome: dict):
        """Send the request to `d`'s server(s); `wire`: the caller's body as received, when it is `body`."""
        import aiohttp
        from aiohttp import web
        extra = {BACKEND_HEADER: d.backend.name}
        send = wire if wire is not None else body
        if d.prefill is not None:
            extra[PREFILL_HEADER] = d.prefill.name
            r = await self._post(d.prefill, path, prefill_body(path, body), request)
            async with r:
                raw = await r.read()
                if r.status >= 400:
                    return web.Response(body=raw, status=r.status, content_type=r.content_type,
                                        headers={PREFILL_HEADER: d.prefill.name})
            kvp = json.loads(raw).get("kv_transfer_params")
            if kvp:
                send = decode_body(body, kvp)
                self.counts["pd_transfers"] += 1
            else:  # a server without a KV connector: the decode server prefills itself
                self.counts["pd_no_kv_params"] += 1
        r = await self._post(d.backend, path, send, request)
        if body.get("stream"):
            out = web.StreamResponse(status=r.status, headers={**extra, "Content-Type": r.headers.get(
                "Content-Type", "text/event-stream")})
            await out.prepare(request)
            async with r:
                async for chunk in r.content.iter_any():
                    await out.write(chunk)
            await out.write_eof()
            return out
        try:
            async with r:
                raw = await r.read()
                status, ctype = r.status, r.content_type
        except aiohttp.ClientPayloadError as e:   # the server died while sending the answer
            raise Unreachable(d.backend, f"{type(e).__name__}: {e}") from e
        if await self._failed_server(d.backend, status):
            raise Unreachable(d.backend, f"{path} -> {status} and /health is down: {raw[:200]!r}")
        if status == 200:
            try:
                data = decode_answer(raw)   # the token ids and usage only: routes and logprobs skipped
                outcome["done"] = completion_key(path, body, data, self.cfg, key)
                outcome["cached"] = reported_cached_tokens(data)
            except ValueError:   # msgspec.DecodeError: not an answer of that shape
                pass
        self.counts[f"status_{status}"] += 1
        return web.Response(body=raw, status=status, content_type=ctype, headers=extra)

    # admin fan-out and the rest
    async def _fanout(self, request):
        from aiohttp import web
        raw = await request.read()
        body = json.loads(raw) if raw else None
        targets = [b for b in self.backends.values() if b.healthy]

        async def one(b: Backend):
            try:
                async with self._http.post(f"{b.url}{request.path}", json=body, params=request.query,
                                           headers=self._headers(request)) as r:
                    text = await r.text()
                    try:
                        data = json.loads(text) if text else {}
                    except json.JSONDecodeError:
                        data = {"text": text}
                    return {"name": b.name, "url": b.url, "status": r.status, "body": data}
            except Exception as e:  # noqa: BLE001
                return {"name": b.name, "url": b.url, "status": 502, "body": {"error": str(e)}}

        res = await asyncio.gather(*(one(b) for b in targets))
        if request.path == "/reset_prefix_cache":
            for r in res:
                if r["status"] == 200 and (r["body"] or {}).get("success", True):
                    self.backends[r["name"]].index.clear()
        results = [x for r in res for x in ((r["body"] or {}).get("results") or [])
                   if isinstance(r["body"], dict)]
        ok = bool(res) and all(r["status"] < 400 for r in res)
        success = ok and all((r["body"] or {}).get("success", True)
                             for r in res if isinstance(r["body"], dict))
        out = {"success": success, "servers": res}
        if results:
            out["results"] = results
        return web.json_response(out, status=200 if ok else 502)

    async def _health(self, request):
        from aiohttp import web
        up = sum(b.healthy for b in self.backends.values())  # open to anyone (is_open): a count only
        return web.json_response({"healthy": up}, status=200 if up else 503)

    async def _weight_info(self, request):
        from aiohttp import web
        infos = []
        for b in self.backends.values():
            try:
                async with self._http.get(f"{b.url}/weight_info", headers=self._headers(request)) as r:
                    infos.append({"name": b.name, **(await r.json())})
            except Exception as e:  # noqa: BLE001
                infos.append({"name": b.name, "error": str(e)})
        versions = [i["weight_version"] for i in infos if "weight_version" in i]
        first = versions[0] if versions else None
        return web.json_response({"weight_version": first, "consistent": len(set(versions)) <= 1,
                                  "servers": infos}, status=200 if versions else 502)

    async def _reset_index(self, request):
        from aiohttp import web
        for b in self.backends.values():
            b.index.clear()
        return web.json_response({"success": True})

    async def _passthrough(self, request):
        from aiohttp import web
        up = [b for b in self.backends.values() if b.healthy]
        if not up:
            return web.json_response({"error": "router: no healthy server"}, status=503)
        now = time.monotonic()
        b = min(up, key=lambda b: b.load(self.cfg, now))
        raw = await request.read()
        async with self._http.request(request.method, f"{b.url}{request.path}", data=raw or None,
                                      params=request.query, headers={
                                          **self._headers(request),
                                          **({"Content-Type": request.content_type} if raw else {})}) as r:
            data = await r.read()
            return web.Response(body=data, status=r.status, content_type=r.content_type,
                                headers={BACKEND_HEADER: b.name})

    def stats(self) -> dict:
        now = time.monotonic()
        return {"policy": self.cfg.policy, "uptime_s": round(time.time() - self.started, 1),
                "decisions": dict(self.policy.decisions), "counts": dict(self.counts),
                "sessions": len(self.policy.sessions),
                "backends": [b.stats(self.cfg, now) for b in self.backends.values()],
                "config": asdict(self.cfg)}

    async def _stats(self, request):
        from aiohttp import web
        return web.json_response(self.stats())

    async def _metrics(self, request):
        from aiohttp import web
        now = time.monotonic()
        lines = ["# TYPE hetrl_router_requests_total counter"]
        for b in self.backends.values():
            lab = f'backend="{b.name}",pool="{b.pool}"'
            lines += [f"hetrl_router_requests_total{{{lab}}} {b.requests}",
                      f"hetrl_router_in_flight{{{lab}}} {b.in_flight}",
                      f"hetrl_router_load{{{lab}}} {b.load(self.cfg, now)}",
                      f"hetrl_router_healthy{{{lab}}} {int(b.healthy)}",
                      f"hetrl_router_sessions{{{lab}}} {b.sessions}",
                      f"hetrl_router_index_blocks{{{lab}}} {len(b.index)}",
                      f"hetrl_router_predicted_cached_tokens_total{{{lab}}} {b.predicted_cached}",
                      f"hetrl_router_reported_cached_tokens_total{{{lab}}} {b.reported_cached}"]
        for reason, n in sorted(self.policy.decisions.items()):
            lines.append(f'hetrl_router_decisions_total{{reason="{reason}"}} {n}')
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")
