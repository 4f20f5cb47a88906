"""Routing decisions of the KV-aware router (rl.inference.router): pure logic, no HTTP. In rl.contract
because two roles make them: the router, and the rollout workers that route their own requests
(rl/orchestrator/local_routing.py).

Where prefixes live is the router's bookkeeping: every prompt is cut into blocks (`block_tokens` token
ids, `text_block_chars` characters of a text prompt, one message of a chat) and hashed as a chain
(each hash covers the whole prefix up to its block, as vLLM's own block hashes do); each server has an
LRU set of the hashes it was sent (prompt at dispatch, prompt + completion when the answer comes back),
sized to its KV capacity. A request's reusable prefix on a server is the number of its leading hashes
that server holds. Sessions: a request may name its rollout with the header `X-Session-Id` (or a body
field `session_id`, removed before forwarding); the router remembers each session's server (per pool).
A server that comes back after being down, or whose counters went backwards, has its index cleared.

Decision for one pool (RouterConfig holds the knobs; `Policy.pick`):
  1. affinity: the server with the longest reusable prefix (the session's server wins ties) is taken if
     it is the session's server or has a real advantage (`min_affinity_tokens` more than the worst
     candidate), is not full (load < `max_queue` and KV usage < `kv_full`), and its load is at most
     least load x (1 + `queue_slack_ratio`) + `queue_slack`. The first request of a new session has
     no affinity (a prefix it shares with other rollouts, e.g. the system prompt, enters its cost);
  2. otherwise the least cost: load + uncached prompt tokens / `miss_tokens_per_load`, among servers
     that are not full (all, if all are); ties go to the server with fewer sessions, then in turn.
  load = max(router in-flight, running + waiting) + `waiting_weight` x waiting (metrics younger than
  `metrics_stale_s`; the in-flight count alone otherwise).
Prefill/decode pools (plan.json pools "prefill" and "decode", as kimi_swe / glm5_swe plan them,
vLLM's NixlConnector on every server): the decode server is picked first (its local prefix cache
decides how much must be transferred); if its uncached part is below `pd_min_prefill_tokens` it
prefills locally (no transfer); else a prefill server is picked the same way and the request runs
prefill-then-decode as vLLM's disaggregated-serving proxy does it: to the prefill server with
max_tokens 1 and `kv_transfer_params={"do_remote_decode": true, ...}`, then to the decode server with
the `kv_transfer_params` the prefill server returned (remote engine, blocks, host, port).
"""
from __future__ import annotations

import json
import math
import re
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from itertools import takewhile
from typing import Any, Iterable

import msgspec

from rl.contract.config import RoutingConfig as RouterConfig  # the schema's section inference.routing
from rl.contract.http import (BACKEND_HEADER, FANOUT_PATHS, PREFILL_HEADER, ROUTED_PATHS,  # noqa: F401
                              SESSION_HEADER)

POOLS = ("mixed", "prefill", "decode")
# What vLLM's NixlConnector expects on the prefill leg (vLLM's disaggregated proxy sends the same).
PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                     "remote_block_ids": None, "remote_host": None, "remote_port": None}


# -- request keys ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestKey:
    """A prompt as the router sees it: chained block hashes, tokens up to each block's end, size."""
    hashes: tuple[int, ...] = ()
    ends: tuple[int, ...] = ()          # prompt tokens covered by hashes[:i+1] (estimated for text/chat)
    n_tokens: int = 0
    session: str | None = None
    kind: str = "none"                  # tokens | text | chat | none

    def tokens_matched(self, blocks: int) -> int:
        return min(self.ends[blocks - 1], self.n_tokens) if blocks > 0 else 0


def token_block_hashes(tokens: list[int], block: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """Chained hashes of the full `block`-token blocks of `tokens` (and the token count at each end): block
    i's hash is hash((block i-1's, hash(block i's tokens))), `seed` before the first. The blocks are cut and
    hashed in C (zip over one iterator); only the chain is a Python loop, one step per block."""
    h, hashes = seed, []
    append = hashes.append
    for b in map(hash, zip(*[iter(tokens)] * block)):
        h = hash((h, b))
        append(h)
    return hashes, list(range(block, len(hashes) * block + 1, block))


def text_block_hashes(text: str, block_chars: int, chars_per_token: float, seed: int = 1):
    h, hashes, ends = seed, [], []
    for i in range(0, len(text) - block_chars + 1, block_chars):
        h = hash((h, text[i:i + block_chars]))
        hashes.append(h)
        ends.append(int((i + block_chars) / chars_per_token))
    return hashes, ends


def _content_text(content) -> str:
    return content if isinstance(content, str) else json.dumps(content, sort_keys=True)


def chat_block_hashes(messages: list[dict], chars_per_token: float, seed: int = 2):
    """One block per message (role, content, tool calls): a conversation's turns share a prefix."""
    h, hashes, ends, chars = seed, [], [], 0
    for m in messages:
        text = _content_text(m.get("content"))
        extra = json.dumps({k: v for k, v in m.items() if k not in ("role", "content")}, sort_keys=True)
        h = hash((h, m.get("role"), text, extra))
        chars += len(text) + len(extra) + 8
        hashes.append(h)
        ends.append(int(chars / chars_per_token))
    return hashes, ends


def _token_ids(x: Any) -> bool:
    """`x` is a list of token ids, judged by its ends: checking every entry was a fifth of the router's
    CPU per request (2 ms of 10 for a 64k-token context). The router only keys on the ids (an entry that
    is no int gives a key that matches nothing, or TypeError when unhashable); the server validates them."""
    return isinstance(x, list) and (not x or (type(x[0]) is int and type(x[-1]) is int))


def request_key(path: str, body: dict, session: str | None, cfg: RouterConfig) -> RequestKey:
    """The key of a routed request (its prompt), whatever the endpoint."""
    prompt: Any = None
    if path.endswith("/generate"):
        prompt = body.get("token_ids")
    elif path.endswith("/chat/completions"):
        msgs = body.get("messages") or []
        hashes, ends = chat_block_hashes(msgs, cfg.chars_per_token)
        return RequestKey(tuple(hashes), tuple(ends), ends[-1] if ends else 0, session, "chat")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]       # a batch of one
    if _token_ids(prompt):
        try:
            hashes, ends = token_block_hashes(prompt, cfg.block_tokens)
        except TypeError:   # something unhashable inside: not token ids after all
            return RequestKey(session=session)
        return RequestKey(tuple(hashes), tuple(ends), len(prompt), session, "tokens")
    if isinstance(prompt, str):
        hashes, ends = text_block_hashes(prompt, cfg.text_block_chars, cfg.chars_per_token)
        return RequestKey(tuple(hashes), tuple(ends), int(len(prompt) / cfg.chars_per_token), session, "text")
    return RequestKey(session=session)


def extend_key(key: RequestKey, prompt: list, ids: list, cfg: RouterConfig) -> RequestKey | None:
    """The tokens key of prompt + ids from `key` (the prompt's): its full blocks are kept and the chain goes
    on from the last of them over the prompt's partial block and `ids`, so the prompt is not hashed again.
    The same key as `request_key` of prompt + ids; None when `key` is not the prompt's tokens key."""
    block = cfg.block_tokens
    full = len(key.hashes)
    if key.kind != "tokens" or key.n_tokens != len(prompt) or full != len(prompt) // block:
        return None
    if not _token_ids(ids):
        return None
    try:
        hashes, ends = token_block_hashes(prompt[full * block:] + list(ids), block, key.hashes[-1] if full else 0)
    except TypeError:
        return None
    return RequestKey(key.hashes + tuple(hashes), key.ends + tuple(e + full * block for e in ends),
                      len(prompt) + len(ids), None, "tokens")


def completion_key(path: str, body: dict, response: dict, cfg: RouterConfig,
                   key: RequestKey | None = None) -> RequestKey | None:
    """Prompt + completion as the next turn will send it (what the server now holds), when knowable.
    `key`: the request's own key (request_key of `body`), extended instead of hashing the prompt again."""
    try:
        ch = response["choices"][0]
        if path.endswith("/chat/completions"):
            msg = ch.get("message") or {}
            turn = {"role": msg.get("role", "assistant"), "content": msg.get("content")}
            if msg.get("tool_calls"):
                turn["tool_calls"] = msg["tool_calls"]
            return request_key(path, {"messages": list(body.get("messages") or []) + [turn]}, None, cfg)
        ids = ch.get("token_ids")
        prompt = body.get("token_ids") if path.endswith("/generate") else body.get("prompt")
        if ids and isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            done = extend_key(key, prompt, ids, cfg) if key is not None else None
            if done is not None:
                return done
            return request_key("/inference/v1/generate", {"token_ids": list(prompt) + list(ids)}, None, cfg)
        text = ch.get("text")
        if isinstance(prompt, str) and isinstance(text, str):
            return request_key("/v1/completions", {"prompt": prompt + text}, None, cfg)
    except (KeyError, IndexError, TypeError, AttributeError):
        pass
    return None


class _Choice(msgspec.Struct, gc=False):
    token_ids: list | None = None
    text: Any = None
    message: Any = None


class _Answer(msgspec.Struct, gc=False):
    choices: list[_Choice] = []
    usage: Any = None


_ANSWER = msgspec.json.Decoder(_Answer)


def decode_answer(raw: bytes) -> dict:
    """What the router reads of a server's answer, as the dict `completion_key` and
    `reported_cached_tokens` take ({"choices": [{token_ids, text, message}], "usage"}): decoded by msgspec
    into just those fields, so the routes' base64 and the logprobs are skipped, never built as Python
    objects. ValueError (msgspec.DecodeError) when it is not a JSON object of that shape."""
    a = _ANSWER.decode(raw)
    return {"choices": [{"token_ids": c.token_ids, "text": c.text, "message": c.message} for c in a.choices],
            "usage": a.usage}


def reported_cached_tokens(response: dict) -> int | None:
    """usage.prompt_tokens_details.cached_tokens (servers started with --enable-prompt-tokens-details)."""
    try:
        details = (response.get("usage") or {}).get("prompt_tokens_details") or {}
        v = details.get("cached_tokens")
        return int(v) if v is not None else None
    except (AttributeError, TypeError, ValueError):
        return None


# -- server metrics ----------------------------------------------------------------------------------
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+([-+0-9.eEinfNa]+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
GAUGES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
          "vllm:kv_cache_usage_perc": "kv_usage"}
COUNTERS = {"vllm:prefix_cache_queries": "prefix_queries", "vllm:prefix_cache_hits": "prefix_hits",
            "vllm:prompt_tokens": "prompt_tokens", "vllm:generation_tokens": "generation_tokens"}


def parse_metrics(text: str) -> dict[str, float]:
    """The numbers the router uses from a vLLM /metrics page, summed over engines (data parallel).

    Keys: running, waiting, kv_usage (max over engines), prefix_queries, prefix_hits, prompt_tokens,
    generation_tokens, kv_capacity_tokens (num_gpu_blocks x block_size of vllm:cache_config_info)."""
    out: dict[str, float] = {}
    kv: list[float] = []
    capacity = 0.0
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(3) or "", m.group(4)
        try:
            v = float(value)
        except ValueError:
            continue
        if name in GAUGES:
            if GAUGES[name] == "kv_usage":
                kv.append(v)
            else:
                out[GAUGES[name]] = out.get(GAUGES[name], 0.0) + v
        elif name.endswith("_total") and name[:-6] in COUNTERS:
            key = COUNTERS[name[:-6]]
            out[key] = out.get(key, 0.0) + v
        elif name == "vllm:cache_config_info":
            lab = dict(_LABEL.findall(labels))
            try:
                capacity += float(lab.get("num_gpu_blocks") or 0) * float(lab.get("block_size") or 0)
            except ValueError:
                pass
    if kv:
        out["kv_usage"] = max(kv)
    if capacity:
        out["kv_capacity_tokens"] = capacity
    return out


# -- prefix index ------------------------------------------------------------------------------------
class PrefixIndex:
    """The block hashes one server was sent, least recently sent evicted first; `match` = the leading
    blocks of a key it holds.

    Each block maps to a stamp: an insert gives its blocks fresh stamps, the first block the newest (one
    dict.update in C: moving each of a 64k-token context's 4096 blocks to the end of an OrderedDict was a
    fifth of the router's CPU in benchmarks/seed_rehearsal.py). The first block newest: a context's later
    blocks go before its earlier ones, as vLLM frees a request's blocks tail first, so what is held of a
    chain of block hashes stays a prefix of it. Past capacity the oldest go, a sixteenth of capacity at a
    time (one sort), so eviction is amortized."""

    def __init__(self, capacity: int):
        self.capacity = max(1, int(capacity))
        self._blocks: dict[int, int] = {}
        self._stamp = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Iterable[int]) -> int:
        return len(list(takewhile(self._blocks.__contains__, hashes)))

    def insert(self, hashes: Iterable[int]) -> None:
        hashes = list(hashes)
        top = self._stamp + len(hashes)
        self._blocks.update(zip(hashes, range(top, self._stamp, -1)))
        self._stamp = top
        if len(self._blocks) > self.capacity:
            self._evict(len(self._blocks) - self.capacity + self.capacity // 16)

    def _evict(self, n: int) -> None:
        b = self._blocks
        for h in sorted(b, key=b.__getitem__)[:n]:
            del b[h]

    def resize(self, capacity: int) -> None:
        self.capacity = max(1, int(capacity))
        if len(self._blocks) > self.capacity:
            self._evict(len(self._blocks) - self.capacity)

    def clear(self) -> None:
        self._blocks.clear()


@dataclass
class Backend:
    name: str
    url: str
    pool: str = "mixed"
    index: PrefixIndex | None = None
    in_flight: int = 0
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    prefix_hits: float = 0.0
    prefix_queries: float = 0.0
    kv_capacity_tokens: float = 0.0
    metrics_time: float = -math.inf
    healthy: bool = True
    failures: int = 0
    held: bool = False                  # its server record is gone (the role is restarting): down until a new one
    pid: int | None = None              # the server's pid in its record: another pid is a restarted server
    requests: int = 0
    sessions: int = 0
    predicted_cached: int = 0           # the router's estimate, summed over requests that reported
    reported_cached: int = 0            # what the server said it reused (usage.prompt_tokens_details)
    baseline: dict = field(default_factory=dict)  # first metrics seen: hit rates are deltas from here

    def __post_init__(self):
        if self.pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {self.pool!r}")
        if self.index is None:
            self.index = PrefixIndex(RouterConfig.index_blocks)

    def fresh(self, cfg: RouterConfig, now: float) -> bool:
        return now - self.metrics_time <= cfg.metrics_stale_s

    def load(self, cfg: RouterConfig, now: float) -> float:
        if not self.fresh(cfg, now):
            return float(self.in_flight)
        return max(float(self.in_flight), self.running + self.waiting) + cfg.waiting_weight * self.waiting

    def full(self, cfg: RouterConfig, now: float) -> bool:
        return self.load(cfg, now) >= cfg.max_queue or (self.fresh(cfg, now) and self.kv_usage >= cfg.kv_full)

    def update_metrics(self, m: dict, now: float, cfg: RouterConfig) -> None:
        # Back after being down, or counters went backwards: the server restarted with an empty cache.
        if self.metrics_time != -math.inf and (
                not self.healthy or m.get("prefix_queries", math.inf) < self.prefix_queries):
            self.index.clear()
            self.baseline = {}
            self.prefix_hits = self.prefix_queries = 0.0
        if not self.baseline:
            self.baseline = {k: m.get(k, 0.0) for k in ("prefix_hits", "prefix_queries")}
        self.running = m.get("running", 0.0)
        self.waiting = m.get("waiting", 0.0)
        self.kv_usage = m.get("kv_usage", 0.0)
        self.prefix_hits = m.get("prefix_hits", self.prefix_hits)
        self.prefix_queries = m.get("prefix_queries", self.prefix_queries)
        cap = m.get("kv_capacity_tokens")
        if cap and cap != self.kv_capacity_tokens:
            self.kv_capacity_tokens = cap
            self.index.resize(max(1, int(cap // cfg.block_tokens)))
        self.metrics_time = now
        self.failures = 0
        self.healthy = not self.held

    def hit_rate(self) -> float | None:
        q = self.prefix_queries - self.baseline.get("prefix_queries", 0.0)
        return (self.prefix_hits - self.baseline.get("prefix_hits", 0.0)) / q if q > 0 else None

    def stats(self, cfg: RouterConfig, now: float) -> dict:
        return {"name": self.name, "url": self.url, "pool": self.pool, "healthy": self.healthy, "held": self.held,
                "in_flight": self.in_flight, "running": self.running, "waiting": self.waiting,
                "kv_usage": self.kv_usage, "load": self.load(cfg, now), "full": self.full(cfg, now),
                "requests": self.requests, "sessions": self.sessions, "index_blocks": len(self.index),
                "index_capacity": self.index.capacity, "kv_capacity_tokens": self.kv_capacity_tokens,
                "prefix_hit_rate": self.hit_rate(), "predicted_cached_tokens": self.predicted_cached,
                "reported_cached_tokens": self.reported_cached,
                "metrics_age_s": (None if self.metrics_time == -math.inf
                                  else round(now - self.metrics_time, 3))}


# -- the decision ------------------------------------------------------------------------------------
class NoBackend(RuntimeError):
    """No healthy server to send a request to."""


@dataclass
class Pick:
    backend: Backend
    reason: str                 # session | prefix | least_cost | round_robin (+ _busy_home, _all_full)
    matched_tokens: int = 0
    load: float = 0.0
    scores: dict = field(default_factory=dict)


@dataclass
class Decision:
    backend: Backend                    # where the request (or its decode leg) runs
    reason: str
    prefill: Backend | None = None      # P/D: where the prefill leg runs first
    matched_tokens: int = 0
    prefill_matched_tokens: int = 0

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None


class Policy:
    """The routing decision and its bookkeeping (sessions, indexes, in-flight counts). No I/O."""

    def __init__(self, cfg: RouterConfig | None = None):
        self.cfg = cfg or RouterConfig()
        if self.cfg.policy not in ("kv", "round_robin"):
            raise ValueError(f"policy must be kv or round_robin, got {self.cfg.policy!r}")
        self.sessions: OrderedDict[str, dict[str, Backend]] = OrderedDict()  # session -> {pool: server}
        self.decisions: Counter = Counter()
        self._turn: Counter = Counter()                                       # round robin per pool

    def home(self, session: str | None, cands: list[Backend]) -> Backend | None:
        """The session's server among `cands` (the one of its pool), if any."""
        if session is None or session not in self.sessions:
            return None
        homes = {b.name for b in self.sessions[session].values()}
        return next((b for b in cands if b.name in homes), None)

    # one pool
    def pick(self, pool: list[Backend], key: RequestKey, now: float, exclude: Iterable[str] = (),
             pool_name: str = "mixed") -> Pick:
        cfg = self.cfg
        exclude = set(exclude)
        cands = [b for b in pool if b.healthy and b.name not in exclude]
        if not cands:
            raise NoBackend(f"no healthy {pool_name} server")
        if cfg.policy == "round_robin":
            b = cands[self._turn[pool_name] % len(cands)]
            self._turn[pool_name] += 1
            return Pick(b, "round_robin", key.tokens_matched(b.index.match(key.hashes)), b.load(cfg, now))
        loads = {b.name: b.load(cfg, now) for b in cands}
        matched = {b.name: key.tokens_matched(b.index.match(key.hashes)) for b in cands}
        home = self.home(key.session, cands)
        home_name = home.name if home is not None else None
        least = min(loads.values())
        best = max(cands, key=lambda b: (matched[b.name], b.name == home_name, -loads[b.name]))
        min_adv = max(1, cfg.min_affinity_tokens)
        advantage = matched[best.name] - min(matched.values())
        if key.session is not None and home is None:
            affinity = False    # a new rollout: a prefix it shares with others (system prompt) is no tie
        else:
            affinity = best.name == home_name or advantage >= min_adv
        busy = best.full(cfg, now) or loads[best.name] > least * (1 + cfg.queue_slack_ratio) + cfg.queue_slack
        if affinity and not busy:
            reason = "prefix" if advantage >= min_adv else "session"
            return Pick(best, reason, matched[best.name], loads[best.name])
        costs = {b.name: loads[b.name] + (key.n_tokens - matched[b.name]) / cfg.miss_tokens_per_load
                 for b in cands}
        all_full = all(b.full(cfg, now) for b in cands)
        open_ = cands if all_full else [b for b in cands if not b.full(cfg, now)]
        turn, n = self._turn[pool_name], len(cands)
        self._turn[pool_name] += 1
        order = {b.name: (i - turn) % n for i, b in enumerate(cands)}
        b = min(open_, key=lambda b: (round(costs[b.name], 9), b.sessions, order[b.name]))
        reason = "least_cost" + ("_busy_home" if affinity else "") + ("_all_full" if all_full else "")
        return Pick(b, reason, matched[b.name], loads[b.name], costs)

    def route(self, backends: list[Backend], key: RequestKey, now: float,
              exclude: Iterable[str] = ()) -> Decision:
        """Mixed servers: one pick. Prefill/decode pools: the decode server, then (when the decode
        server lacks at least pd_min_prefill_tokens of the prompt) a prefill server."""
        exclude = set(exclude)
        up = [b for b in backends if b.healthy and b.name not in exclude]
        prefill = [b for b in up if b.pool == "prefill"]
        decode = [b for b in up if b.pool == "decode"]
        mixed = [b for b in up if b.pool == "mixed"]
        if mixed or not (prefill and decode):
            # Only mixed servers, or one P/D pool is down: any server can run both phases.
            p = self.pick(mixed or up, key, now, pool_name="mixed" if mixed else "fallback")
            d = Decision(p.backend, p.reason if mixed else p.reason + "_pd_fallback",
                         matched_tokens=p.matched_tokens)
        else:
            dp = self.pick(decode, key, now, pool_name="decode")
            uncached = key.n_tokens - dp.matched_tokens
            if uncached < self.cfg.pd_min_prefill_tokens:
                d = Decision(dp.backend, dp.reason + "_local_prefill", matched_tokens=dp.matched_tokens)
            else:
                pp = self.pick(prefill, key, now, pool_name="prefill")
                d = Decision(dp.backend, f"{dp.reason}+prefill_{pp.reason}", prefill=pp.backend,
                             matched_tokens=dp.matched_tokens,
                             prefill_matched_tokens=pp.matched_tokens)
        self.decisions[d.reason] += 1
        return d

    # bookkeeping
    def _remember_session(self, session: str | None, b: Backend) -> None:
        if session is None:
            return
        homes = self.sessions.pop(session, {})
        old = homes.get(b.pool)
        if old is not None:
            old.sessions -= 1
        homes[b.pool] = b
        b.sessions += 1
        self.sessions[session] = homes
        while len(self.sessions) > self.cfg.max_sessions:
            self.forget_session(next(iter(self.sessions)))

    def dispatched(self, d: Decision, key: RequestKey) -> None:
        """The request was sent: count it in flight, remember its session and the prefix it leaves."""
        for b in (d.prefill, d.backend):
            if b is None:
                continue
            b.in_flight += 1
            b.requests += 1
            b.index.insert(key.hashes)
            self._remember_session(key.session, b)

    def finished(self, d: Decision, key: RequestKey, done: RequestKey | None = None,
                 reported_cached: int | None = None) -> None:
        """The answer came back (or failed): in flight -1; the server now also holds the completion."""
        for b in (d.prefill, d.backend):
            if b is not None:
                b.in_flight = max(0, b.in_flight - 1)
        if done is not None:
            d.backend.index.insert(done.hashes)
        if reported_cached is not None:
            d.backend.predicted_cached += d.matched_tokens
            d.backend.reported_cached += reported_cached

    def forget_session(self, session: str) -> None:
        for b in self.sessions.pop(session, {}).values():
            b.sessions -= 1


# -- P/D request bodies ------------------------------------------------------------------------------
def prefill_body(path: str, body: dict) -> dict:
    """The prefill leg: one token, no streaming, KV kept for a remote decode."""
    b = msgspec.json.decode(msgspec.json.encode(body))   # a deep copy
    if path.endswith("/generate"):
        sp = b.setdefault("sampling_params", {})
        sp["max_tokens"] = 1
        sp.pop("min_tokens", None)
    else:
        b["max_tokens"] = 1
        if "max_completion_tokens" in b:
            b["max_completion_tokens"] = 1
        b.pop("min_tokens", None)
    b["stream"] = False
    b.pop("stream_options", None)
    b["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return b


def decode_body(body: dict, kv_transfer_params: dict) -> dict:
    """The decode leg: the original request plus where its KV is (from the prefill answer)."""
    b = dict(body)
    b["kv_transfer_params"] = kv_transfer_params
    return b


# -- discovery ---------------------------------------------------------------------------------------


class Unreachable(Exception):
    """A server the router could not get an answer from (connection lost, or a 5xx while its /health is
    down): the request goes to another server (rl.inference.router)."""
    def __init__(self, backend: Backend, msg: str):
        super().__init__(msg)
        self.backend = backend
