"""Async HTTP client of one policy server (or of the router), for the orchestrator: tokens in, tokens +
logprobs out.

Light on purpose (httpx + asyncio, no torch, no vllm): the orchestrator is a CPU process. Prompts go in
as token ids and completions come back as token ids with the sampled token's logprob, so nothing is
re-tokenized between inference and training.

Per-token policy versions come from two independent sources, and `Completion.versions` uses the
first available:
1. vLLM 0.32's own spans. The engine core stamps every output with its weight-version label
   (`POST /update_weight_version`, which `update_weights` sets while the engine is paused), and the
   token-in/token-out endpoint `/inference/v1/generate` (server flag `--enable-scale-out`, which
   rl.inference.server passes) returns `weight_versions: [{version, start, end}]` over the completion
   tokens. Exact, and free of races: the label travels with the tokens.
2. The in-flight counts `update_weights` returns (taken by the worker extension while paused):
   `{request key: completion tokens generated before the new weights}`. `/v1/completions` does not
   return spans, so `versions_from_updates` rebuilds them from those counts. Caveat: a request that
   finished just before the pause but whose response had not yet arrived is not in the counts; that is
   why (1) is the default path.

Request keys: the engine-side id of a completion request is `cmpl-<request_id>-0`, of a chat
request `chatcmpl-<request_id>`, of a generate request `generate-tokens-<request_id>`;
`Completion.request_id` holds that key, which is what `update_weights()["in_flight"]` is keyed by.
"""
from __future__ import annotations

import asyncio
import base64
import contextvars
import io
import itertools
import json
import math
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec
import pybase64

from rl.faults import crash_point
from rl.contract import procs, safefs
from rl.contract.http import ROUTED_PATHS, ROUTER_RESET_INDEX, SESSION_HEADER
from rl.contract.plan import SERVED_MODEL_NAME as MODEL_NAME


class InferenceError(RuntimeError):
    """A policy server answered with an error."""


_MAX_RECORD = 1 << 20   # a reload report or router.json is a few KiB: a huge file in its place is refused
# Request and answer JSON through msgspec (C): 3-4x less CPU than the json module on a context's token ids
# and an answer's logprobs (benchmarks/request_codec.py); the same Python values out, compact JSON in.
_ENCODE = msgspec.json.Encoder()
_DECODE = msgspec.json.Decoder()


def completion_key(request_id: str) -> str:
    return f"cmpl-{request_id}-0"


def chat_key(request_id: str) -> str:
    return f"chatcmpl-{request_id}"


def generate_key(request_id: str) -> str:
    return f"generate-tokens-{request_id}"


def versions_from_spans(spans: list[dict], n: int) -> list[int]:
    """Per-token versions from vLLM's [{version, start, end}] spans (version labels are ints as text)."""
    out = [-1] * n
    for s in spans:
        v = int(s["version"]) if str(s["version"]).lstrip("-").isdigit() else -1
        for i in range(int(s["start"]), min(int(s["end"]), n)):
            out[i] = v
    if -1 in out:
        raise InferenceError(f"weight version spans {spans} do not label all {n} tokens")
    return out


def versions_from_updates(n: int, start_version: int, updates: list[tuple[int, int]]) -> list[int]:
    """Per-token versions of an n-token completion from in-flight counts.

    `start_version` was loaded when the request was submitted; `updates` lists, in order,
    (new version, tokens the request had when it was loaded) for every reload during the request.
    """
    out, v, pos = [], start_version, 0
    for new_version, count in updates:
        count = min(max(count, pos), n)
        out += [v] * (count - pos)
        pos, v = count, new_version
    return out + [v] * (n - pos)


def b64decode(b64) -> bytes:
    """Base64 text as bytes: pybase64's strict decoder (SIMD, ~50x the stdlib's on a turn's routes); text
    with characters outside the alphabet goes the stdlib's way (they are discarded), so anything the old
    path accepted decodes the same."""
    try:
        return pybase64.b64decode(b64, validate=True)
    except ValueError:   # binascii.Error: not strict base64 (padding, newlines, other characters)
        return base64.b64decode(b64)


def decode_routed_experts(b64: str | None):
    """vLLM's base64 `.npy` of routed experts as a numpy array: [tokens - 1 - routed_experts_prompt_start,
    layers, top_k], the rows of positions routed_experts_prompt_start .. tokens - 2 (the last token sampled
    was never forwarded)."""
    if b64 is None:
        return None
    import numpy as np
    raw = b64decode(b64)
    # the array is a read-only view of the decoded bytes (np.load would copy them: one more turn-sized
    # buffer per response being parsed); the header is read as np.load reads it, objects refused
    f = io.BytesIO(raw)
    try:
        version = np.lib.format.read_magic(f)
        header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = header(f)
    except ValueError as e:
        raise InferenceError(f"routed_experts is not a .npy array ({e})") from None
    if dtype.hasobject:
        raise InferenceError(f"routed_experts has dtype {dtype}: object arrays are refused")
    count = math.prod(shape)
    if len(raw) - f.tell() != count * dtype.itemsize:
        raise InferenceError(f"routed_experts: {len(raw) - f.tell()} data bytes for shape {shape} of {dtype}")
    return np.frombuffer(raw, dtype, count, f.tell()).reshape(shape, order="F" if fortran else "C")


def token_list(ids) -> list[int]:
    """Token ids as plain ints for JSON: a list, or a numpy array (a multi-turn episode's context)."""
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)


async def _sent_once(data: bytes):
    """A request body httpx sends and then lets go: the request keeps this spent generator, not the bytes
    (with `content=bytes` httpx's Request holds them until the response is done, which for a request
    waiting on generation is the whole turn: its context as JSON, ~7 bytes a token)."""
    yield data


def json_body(body: dict) -> bytes:
    """`body` as compact JSON bytes. A request's token list exists only while this runs: what a request
    holds while it waits for the engine is these bytes (~7 a token), not a list of ints (~44 a token),
    which for thousands of long episodes in flight is most of the orchestrator's memory. msgspec writes
    it straight from the objects (json.dumps: ~4x the CPU, through an intermediate str)."""
    return _ENCODE.encode(body)


def parse_generate(data: dict):
    """(data, choice, ids, logprobs, versions) of a /inference/v1/generate answer."""
    ch = data["choices"][0]
    ids = ch["token_ids"] or []
    lps = [c["logprob"] for c in (ch.get("logprobs") or {}).get("content") or []]
    spans = ch.get("weight_versions")
    versions = versions_from_spans(spans, len(ids)) if spans is not None else None
    return data, ch, ids, lps, versions


def completion(data: dict, parse, key: str) -> "Completion":
    """The Completion of a parsed answer. Built while the body is held (InferenceClient.READ_BODIES): the
    routes' base64 text is decoded and dropped here, so it is never alive outside that bound, nor kept in
    `raw`."""
    data, ch, ids, lps, versions = parse(data)
    if len(lps) != len(ids):
        raise InferenceError(f"{key}: {len(ids)} tokens but {len(lps)} logprobs")
    routed = decode_routed_experts(ch.pop("routed_experts", None))
    return Completion(ids=ids, logprobs=[float(x) for x in lps], finish_reason=ch.get("finish_reason"),
                      request_id=key, versions=versions, prompt_ids=ch.get("prompt_token_ids"),
                      routed_experts=routed, raw=data)


def decode_answer(content: bytes):
    """An answer's JSON as Python values (msgspec; the json module's values for any valid JSON)."""
    return _DECODE.decode(content) if content else {}


@dataclass
class Completion:
    ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    request_id: str                      # engine-side key, as in update_weights()["in_flight"]
    versions: list[int] | None = None    # per token, when the server reported spans
    prompt_ids: list[int] | None = None
    routed_experts: object | None = None  # numpy [prompt+completion-1-start, layers, top_k] when enabled
    raw: dict = field(default_factory=dict, repr=False)   # the answer's JSON, less the routes' base64


class InferenceClient:
    """One server. `url` like http://host:port; `secret` (the run's) is sent as a Bearer token on every
    request when set: the servers (rl.inference.auth) and the router require it on every path but /health."""

    # Connections per httpx client. httpcore's pool scans every connection of its client at each request
    # event (`_assign_requests_to_connections`), so one client holding hundreds of requests in flight
    # spends time quadratic in them: profiled in benchmarks/seed_rehearsal.py with 128 episodes in flight,
    # 31 of the orchestrator's 113 CPU seconds. Requests are dealt round robin over clients of this many.
    SHARD_CONNECTIONS = 16
    # Response bodies read and parsed at once per server. A generate response carries a turn's routes as
    # base64 (~1 MB at the seed's turn sizes); httpx reads a body as its bytes arrive, so with the event loop
    # busy every answered request of hundreds in flight accumulated its whole body at once, and held it until
    # parsed. Reading under this bound leaves the rest in the socket (the kernel's buffers, then the server
    # waits): the orchestrator holds at most this many bodies and their parsed routes per server, whatever
    # the number in flight (tests/unit/test_client_memory.py).
    READ_BODIES = 4

    def __init__(self, url: str, secret: str | None = None, timeout: float = 300.0,
                 max_connections: int = 256):
        self._headers = {"Authorization": f"Bearer {secret}"} if secret else {}
        self.url = url.rstrip("/")
        self._sends_secret = bool(secret)
        self._timeout = timeout
        self._shards = max(1, -(-max_connections // self.SHARD_CONNECTIONS))
        self._pool = [self._new_client(min(max_connections, self.SHARD_CONNECTIONS))]
        self._next = itertools.count()
        self._reading = asyncio.Semaphore(self.READ_BODIES)

    def _new_client(self, connections: int) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers=self._headers, timeout=self._timeout,
                                 limits=httpx.Limits(max_connections=connections,
                                                     max_keepalive_connections=connections))

    @property
    def _http(self) -> httpx.AsyncClient:
        """The first client (health, weight info; tests put a transport of their own here)."""
        return self._pool[0]

    @_http.setter
    def _http(self, client: httpx.AsyncClient) -> None:
        self._pool, self._shards = [client], 1

    def _client(self) -> httpx.AsyncClient:
        """The client for the next request, round robin; the others are made when first needed."""
        i = next(self._next) % self._shards
        while len(self._pool) <= i:
            c = self._new_client(self.SHARD_CONNECTIONS)
            c.event_hooks = self._pool[0].event_hooks   # hooks set on the first (tools, tests) see every request
            self._pool.append(c)
        return self._pool[i]

    async def aclose(self) -> None:
        for c in self._pool:
            await c.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()

    async def _post(self, path: str, json: dict | None = None, params: dict | None = None,
                    headers: dict | None = None, attempts: int = 4, content=None, parse=None):
        """POST and return the parsed JSON answer, or `parse(answer)` (run while the body is held, so what it
        keeps is all that stays of a large answer). `content`: the body already encoded (bytes), or a
        function making it, called once per attempt: then no copy of it is held after it is sent."""
        # A pooled keep-alive connection may be closed by the server just as it is reused (uvicorn
        # closes idle connections after 5 s): the request never reached the engine, so send it again.
        http = self._client()
        for attempt in range(attempts):
            try:
                if content is not None:  # a body already encoded (json_body)
                    body = content() if callable(content) else content
                    hdr = {"Content-Type": "application/json", "Content-Length": str(len(body)), **(headers or {})}
                    req = http.build_request("POST", path, content=_sent_once(body), params=params, headers=hdr)
                    del body
                else:
                    req = http.build_request("POST", path, json=json, params=params, headers=headers)
                r = await http.send(req, stream=True)
                try:
                    async with self._reading:
                        await r.aread()   # the whole body; httpx closes the response once it is read
                        out = self._answer(r, path, parse)
                finally:
                    await r.aclose()      # cancelled or failed before that: the connection goes back
                break
            except (httpx.ReadError, httpx.RemoteProtocolError, httpx.ConnectError, httpx.WriteError) as e:
                if attempt == attempts - 1:
                    raise InferenceError(f"POST {self.url}{path}: {type(e).__name__} after {attempts} attempts "
                                         f"(is the server up? see its log)") from e
                await asyncio.sleep(0.2 * 2 ** attempt)
        return out

    def _answer(self, r: httpx.Response, path: str, parse):
        if r.status_code == 401:
            raise InferenceError(f"POST {self.url}{path} -> 401: " + (
                "the server refused the run's secret (is it another run's server?)" if self._sends_secret else
                "the server wants a token and this client has none (the run directory has no secret)"))
        if r.status_code >= 400:
            raise InferenceError(f"POST {self.url}{path} -> {r.status_code}: {r.text[:1000]}")
        data = decode_answer(r.content)
        # httpx's Response and its stream refer to each other, so a response (its body: a turn's routes as
        # base64, ~0.3-1 MB) waited for the cyclic garbage collector: under tracemalloc in the seed
        # rehearsal 432 bodies (149 MiB) were alive with 128 episodes in flight. Replacing the spent stream
        # and the read body breaks the cycle and frees the body now.
        r.stream, r._content = httpx.ByteStream(b""), b""
        return parse(data) if parse is not None else data

    async def health(self) -> bool:
        try:
            r = await self._http.get("/health", timeout=5.0)
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    async def weight_version(self) -> str:
        r = await self._http.get("/weight_info")
        r.raise_for_status()
        return r.json()["weight_version"]

    async def generate(self, prompt_ids, max_tokens: int, temperature: float = 1.0,
                       top_p: float = 1.0, seed: int | None = None, request_id: str | None = None,
                       *, ignore_eos: bool = False, endpoint: str = "generate",
                       extra: dict | None = None, priority: int | None = None) -> Completion:
        """Sample one completion. endpoint="generate" (token-in/token-out, per-token versions) or
        "completions" (OpenAI /v1/completions, versions from update_weights counts). `priority`: vLLM's
        request priority (lower is served first; the server must run `--scheduling-policy priority`).
        `extra`: more sampling parameters, e.g. `routed_experts_prompt_start` (a multi-turn episode asks
        only for the routed-expert rows it does not hold). `prompt_ids`: a list or a numpy array of ids."""
        request_id = request_id or uuid.uuid4().hex
        prio = {"priority": int(priority)} if priority is not None else {}
        sp = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "logprobs": 0,
              "ignore_eos": ignore_eos, **({"seed": seed} if seed is not None else {}), **(extra or {})}
        if endpoint == "generate":
            # the body is made per attempt from the context (a view nothing appends to while the request is
            # out) and not kept once sent
            def body():
                return json_body({"request_id": request_id, "token_ids": token_list(prompt_ids),
                                  "sampling_params": sp, "model": MODEL_NAME, **prio})

            parse = parse_generate
            path, key = "/inference/v1/generate", generate_key(request_id)
        elif endpoint == "completions":
            def body():
                return json_body({"model": MODEL_NAME, "prompt": token_list(prompt_ids), "return_token_ids": True,
                                  "request_id": request_id, **sp, **prio})

            def parse(data):
                ch = data["choices"][0]
                return data, ch, ch["token_ids"] or [], (ch.get("logprobs") or {}).get("token_logprobs") or [], None
            path, key = "/v1/completions", completion_key(request_id)
        else:
            raise ValueError(f"endpoint must be 'generate' or 'completions', got {endpoint!r}")

        return await self._post(path, content=body, parse=lambda data: completion(data, parse, key))

    async def chat(self, messages: list[dict], max_tokens: int, temperature: float = 1.0,
                   top_p: float = 1.0, seed: int | None = None, request_id: str | None = None,
                   extra: dict | None = None) -> Completion:
        """Multi-turn: /v1/chat/completions with the server's chat template; token ids come back."""
        request_id = request_id or uuid.uuid4().hex
        body = {"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens,
                "temperature": temperature, "top_p": top_p, "logprobs": True, "top_logprobs": 0,
                "return_token_ids": True, "request_id": request_id,
                **({"seed": seed} if seed is not None else {}), **(extra or {})}
        data = await self._post("/v1/chat/completions", body)
        ch = data["choices"][0]
        ids = ch.get("token_ids") or []
        lps = [c["logprob"] for c in ((ch.get("logprobs") or {}).get("content") or [])]
        return Completion(ids=ids, logprobs=[float(x) for x in lps], finish_reason=ch.get("finish_reason"),
                          request_id=chat_key(request_id), prompt_ids=data.get("prompt_token_ids"),
                          raw=data)

    async def prompt_logprobs(self, prompt_ids: list[int]) -> list[float]:
        """Logprob of every prompt token after the first under the loaded policy (for checks)."""
        body = {"model": MODEL_NAME, "prompt": list(prompt_ids), "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": 0, "return_token_ids": True}
        data = await self._post("/v1/completions", body)
        plp = data["choices"][0]["prompt_logprobs"]
        return [float(d[str(t)]["logprob"]) for d, t in zip(plp[1:], prompt_ids[1:])]

    async def update_weights(self, weights_dir: str, version: int, *, recompute_kv: bool = False,
                             timeout: float | None = None, report_dir: str | Path | None = None,
                             workers: int | None = None) -> dict:
        """Load a published weights/step_N in flight: pause (keep), load_policy, reset caches, resume.

        Returns {"version", "previous_version", "in_flight", "seconds", ...} merged over every worker
        (in_flight: the union of every engine's requests; seconds: the slowest) plus "workers",
        "bytes_read", "prefix_cache_reset" and "wall_seconds". With `report_dir` and `workers` (data-parallel
        engines x tensor-parallel workers of the server) every worker's result is read from the reports
        the workers write there, since vLLM answers `/collective_rpc` with the first DP engine's workers
        only; any worker's error, or a missing report, fails the reload naming that worker. With
        `recompute_kv` the in-flight requests are
        preempted so their KV cache is recomputed with the new weights; otherwise they keep the KV of
        the tokens they already have (made by the old weights) and only the prefix cache of finished
        requests is dropped (which fails, harmlessly reported, while requests hold blocks).
        """
        t0 = asyncio.get_running_loop().time()
        await self._post("/pause", params={"mode": "keep"})
        try:
            crash_point("reload.paused")
            kwargs = {"weights_dir": str(weights_dir), "version": int(version)}
            if report_dir is not None:
                # a retried reload must not read old reports; in the run directory, so removed and made
                # through safefs: a planted `inference/reloads` link is refused, never followed (rmtree)
                safefs.remove(report_dir)
                safefs.makedirs(report_dir)
                kwargs["report_dir"] = str(report_dir)
            rpc = {"method": "load_policy", "kwargs": kwargs}
            if timeout is not None:
                rpc["timeout"] = timeout
            results = (await self._post("/collective_rpc", rpc))["results"]
            if not results or not all(isinstance(r, dict) for r in results):
                raise InferenceError(f"load_policy returned {results!r}")
            if report_dir is not None and workers is not None:
                results = collect_reports(report_dir, workers, self.url, version)
            if errors := [r["error"] for r in results if r.get("error")]:
                raise InferenceError(f"{self.url}: {errors[0]}")
            await self._post("/update_weight_version", {"new_version": str(int(version))})
            reset = await self._post("/reset_prefix_cache",
                                     params={"reset_running_requests": str(recompute_kv).lower()})
        finally:
            await self._post("/resume")
        out = merge_results(results)
        out["prefix_cache_reset"] = bool(reset.get("success"))
        out["wall_seconds"] = asyncio.get_running_loop().time() - t0
        return out


def collect_reports(report_dir: str | Path, workers: int, url: str, version: int) -> list[dict]:
    """Every worker's load_policy result from `report_dir`; a missing or unreadable one is an error.

    Read while every server is paused, so nothing here may block: the directory is listed and each report
    read through safefs (no link followed; a FIFO, a file another user owns or can write refused at once,
    without blocking), and a refused report fails the reload in one line naming it (the retry removes the
    directory and asks again)."""
    results = []
    for name in sorted(n for n, _ in safefs.scandir(report_dir) if n.endswith(".json")):
        p = Path(report_dir) / name
        try:
            r = json.loads(safefs.read_bytes(p, limit=_MAX_RECORD))
        except (OSError, ValueError) as e:
            raise InferenceError(f"{url}: reload report {p} unreadable ({e})") from None
        if not isinstance(r, dict):
            raise InferenceError(f"{url}: reload report {p} is {type(r).__name__}, not an object")
        if r.get("error"):
            r["error"] = f"worker {p.stem}: {r['error']}"
        results.append(r)
    if len(results) < workers:
        raise InferenceError(f"{url}: only {len(results)} of {workers} inference workers reported loading "
                             f"version {version} (reports in {report_dir})")
    return results


def merge_results(results: list[dict]) -> dict:
    """One reload result for a server from its workers' (all loaded the same version)."""
    versions = {r.get("version") for r in results}
    if len(versions) != 1:
        raise InferenceError(f"workers disagree on the loaded version: {sorted(map(str, versions))}")
    out = dict(results[0])
    out["in_flight"] = {k: v for r in results for k, v in r.get("in_flight", {}).items()}
    out["seconds"] = max(float(r.get("seconds", 0.0)) for r in results)
    out["bytes_read"] = sum(int(r.get("bytes_read", 0)) for r in results)
    out["workers"] = len(results)
    return out


# -- through the router ------------------------------------------------------------------------------
SESSION = contextvars.ContextVar("hetrl_router_session", default=None)


def router_client_class():
    """InferenceClient that tags its requests with the session in SESSION (set it per rollout task)."""
    class RouterClient(InferenceClient):
        async def _post(self, path, json=None, params=None, headers=None, attempts=4, content=None, parse=None):
            sid = SESSION.get()
            if sid is not None and path in ROUTED_PATHS:
                headers = {**(headers or {}), SESSION_HEADER: str(sid)}
            return await super()._post(path, json, params, headers, attempts, content, parse)

    return RouterClient


class Refusals:
    """Records refused by the trust rule (docs/run-directory-safety.md), each said once.

    A record that names an address is obeyed only if this run's user wrote it (rl.contract.safefs: owned
    by this user, writable by nobody else, a regular file). One that fails is treated as absent (that
    server is not up), but not silently: `note` says it in one line naming the file and why, the first
    time it is seen, so a planted record shows in the log without repeating at every poll."""

    def __init__(self, say):
        self.say = say
        self.seen: set[str] = set()

    def note(self, error: Exception) -> str:
        """Say `error` (a RecordError or OSError naming the file) unless already said; returns its line."""
        line = " ".join(str(error).split())
        if line not in self.seen:
            self.seen.add(line)
            self.say(f"refused: {line}; treated as absent")
        return line


def _orchestrator_log(msg: str) -> None:
    from rl.runtime import log
    log("orchestrator", msg)


ROUTER_REFUSALS = Refusals(_orchestrator_log)   # router.json as the orchestrator reads it


async def wait_for_router(run_dir: Path, stop=None, timeout: float = 600.0) -> str | None:
    """The router's URL from `D/inference/router.json` once it is up; None when stopped or DONE.

    The record is read through safefs: a FIFO in its place is refused without blocking, so the wait
    keeps its own timeout, and a record another user wrote or can write is refused (ROUTER_REFUSALS says
    so once): the run's secret goes with every request to this URL."""
    from rl import runtime
    from rl.contract import paths
    path = paths.router_record(run_dir)
    deadline = time.monotonic() + timeout
    while True:
        refused = None
        try:
            url, host, pid = router_address(path)
            # a record left by an earlier incarnation on this node names a dead pid
            if not (host == socket.gethostname() and not procs.alive(pid)):
                return url
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:
            refused = ROUTER_REFUSALS.note(e)
        if (stop is not None and stop.is_set()) or runtime.is_done(run_dir):
            return None
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} missing after {timeout:.0f} s" + (f" ({refused})" if refused else "")
                               + f"; see {run_dir}/logs/router.log")
        await asyncio.sleep(0.5)


def router_address(path: Path) -> tuple[str, object, object]:
    """(url, host, pid) of the router record at `path`, read through safefs (owner and mode checked, no
    link followed, a FIFO refused): UnsafePath when the trust rule refuses it, ValueError naming the file
    when it is not a record with a URL, FileNotFoundError when there is none."""
    try:
        rec = json.loads(safefs.read_bytes(path, limit=_MAX_RECORD))
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    url = rec.get("url") if isinstance(rec, dict) else None
    if not (isinstance(url, str) and url.startswith(("http://", "https://"))):
        raise ValueError(f"{path}: not a router record (url={str(url)[:80]!r}, not an http(s) URL)")
    return rec["url"], rec.get("host"), rec.get("pid")


async def router_reset_index(client) -> bool:
    """Tell the router the servers' prefix caches were dropped (after a weight update). Never raises."""
    try:
        await client._post(ROUTER_RESET_INDEX)
        return True
    except Exception:  # noqa: BLE001  routing still works with a stale index, only less well
        return False
