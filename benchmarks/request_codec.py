"""CPU per request of the JSON and base64 work around one generate request, before and after issue 50 item 7.

Two processes do this work per request: the orchestrator's client (rl/orchestrator/client.py: the request
body with the whole context's token ids, the answer's JSON, the routes' base64 `.npy` into numpy) and the
router (rl/inference/router.py + routing.py: it parses the body, hashes the whole prompt into its prefix
index, forwards the body, parses the answer and hashes prompt + completion for the next turn). Both are
timed here on the same bodies, without HTTP (the sockets, httpx / aiohttp and asyncio are not in these
figures), each against a faithful copy of the code before the change (`old_*` below, the baseline).

Bodies and answers as the rehearsal's engine makes them (benchmarks/_rehearsal_engine.py): the context a
numpy int32 view (a multi-turn episode's), `routed_experts_prompt_start` set, the answer vLLM 0.32's own
`GenerateTokensResponse` serialized as its server does (`model_dump_json`), logprobs for every token, routes
`numpy2base64` of uint8 [rows, layers, top_k] with rows = the tokens since the previous turn (observation +
generated, a quarter generated as in SWE episodes). Old and new interleaved (order alternated), repeated,
medians of CPU time (process_time) per call.

Seed extrapolation: each side's CPU per request is fitted as a x context tokens + b x route rows + c (least
squares over the cases), then applied to the seed's step as docs/perf.md's rehearsal states it (256
rollouts x 65536 mean tokens, 50 turns, 75 x 8 routes: contexts summed over turns T x (n + 1) / 2 per
episode, every token's route row once, 12800 requests) through one router process (the plan has one router,
on inference node 0).

    python benchmarks/request_codec.py [--repeats 7] [--layers 75] [--top-k 8]

The last line is `key=value ...` (codec_new_vs_old, route_decode_new_vs_old, router_us_per_context_token_*,
seed_router_cpu_s_*, ...).
"""
from __future__ import annotations

import argparse
import base64
import gc
import io
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rl.contract import routing  # noqa: E402
from rl.orchestrator import client  # noqa: E402

SEED = {"rollouts": 256, "mean_tokens": 65536, "turns": 50, "routers": 1}
CASES = [(8192, 1024), (32768, 1024), (32768, 2048), (65536, 2048), (65536, 4096)]   # (context, generated)
OBS_PER_GEN = 3   # observation tokens per generated token since the previous turn (a quarter generated)


# -- the baseline: the code before issue 50 item 7, copied faithfully -----------------------------------
def old_json_body(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def old_decode_routed_experts(b64):
    if b64 is None:
        return None
    raw = base64.b64decode(b64)
    f = io.BytesIO(raw)
    version = np.lib.format.read_magic(f)
    header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = header(f)
    count = math.prod(shape)
    if len(raw) - f.tell() != count * dtype.itemsize:
        raise ValueError("size")
    return np.frombuffer(raw, dtype, count, f.tell()).reshape(shape, order="F" if fortran else "C")


def old_client_answer(content: bytes, key: str):
    data = json.loads(content)   # httpx Response.json()
    ch = data["choices"][0]
    ids = ch["token_ids"] or []
    lps = [c["logprob"] for c in (ch.get("logprobs") or {}).get("content") or []]
    spans = ch.get("weight_versions")
    versions = client.versions_from_spans(spans, len(ids)) if spans is not None else None
    if len(lps) != len(ids):
        raise ValueError(key)
    routed = old_decode_routed_experts(ch.pop("routed_experts", None))
    return client.Completion(ids=ids, logprobs=[float(x) for x in lps], finish_reason=ch.get("finish_reason"),
                             request_id=key, versions=versions, prompt_ids=ch.get("prompt_token_ids"),
                             routed_experts=routed, raw=data)


def old_token_block_hashes(tokens, block, seed=0):
    h, hashes, ends = seed, [], []
    for i in range(0, len(tokens) - block + 1, block):
        h = hash((h, *tokens[i:i + block]))
        hashes.append(h)
        ends.append(i + block)
    return hashes, ends


def old_request_key(prompt, session, cfg):
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        hashes, ends = old_token_block_hashes(prompt, cfg.block_tokens)
        return routing.RequestKey(tuple(hashes), tuple(ends), len(prompt), session, "tokens")
    return routing.RequestKey(session=session)


def old_router(body_bytes: bytes, answer: bytes, cfg):
    """The router's work on one generate request (rl/inference/router.py `_routed` / `_execute`), old."""
    body = json.loads(body_bytes.decode())             # aiohttp request.json(): text, then json.loads
    session = body.pop("session_id", None)
    key = old_request_key(body.get("token_ids"), session, cfg)
    sent = json.dumps(body).encode()                   # aiohttp ClientSession.post(json=body)
    data = json.loads(answer)
    ch = data["choices"][0]
    ids, prompt = ch.get("token_ids"), body.get("token_ids")
    done = old_request_key(list(prompt) + list(ids), None, cfg)
    return key, done, routing.reported_cached_tokens(data), len(sent)


# -- the new code: the modules' own functions -----------------------------------------------------------
def new_client_answer(content: bytes, key: str):
    return client.completion(client.decode_answer(content), client.parse_generate, key)


def new_router(body_bytes: bytes, answer: bytes, cfg):
    from rl.inference.proxy import _DECODE
    body = _DECODE.decode(body_bytes)
    wire = body_bytes if "session_id" not in body else None
    session = body.pop("session_id", None)
    key = routing.request_key("/inference/v1/generate", body, session, cfg)
    sent = wire if wire is not None else routing.msgspec.json.encode(body)
    data = routing.decode_answer(answer)
    done = routing.completion_key("/inference/v1/generate", body, data, cfg, key)
    return key, done, routing.reported_cached_tokens(data), len(sent)


# -- bodies and answers ----------------------------------------------------------------------------------
def make_case(ctx_len: int, gen: int, layers: int, top_k: int, seed: int = 0):
    from vllm.entrypoints.scale_out.token_in_token_out import protocol as P
    from vllm.utils.serial_utils import numpy2base64
    rng = np.random.default_rng(seed)
    context = rng.integers(0, 151_000, ctx_len + 64).astype(np.int32)[:ctx_len]   # a view, as an episode's
    start = max(0, ctx_len - OBS_PER_GEN * gen)
    sp = {"max_tokens": 4 * gen, "temperature": 1.0, "top_p": 1.0, "logprobs": 0, "ignore_eos": False,
          "seed": 1234, "routed_experts_prompt_start": start}
    body = {"request_id": "hetrl-17", "token_ids": None, "sampling_params": sp, "model": "policy", "priority": 3}
    ids = rng.integers(0, 151_000, gen).tolist()
    rows = rng.integers(0, 256, (ctx_len + gen - 1 - start, layers, top_k), dtype=np.uint8)
    lps = P.GenerateLogProbs(content=[P.GenerateLogProbsContent(token_id=t, logprob=float(lp))
                                      for t, lp in zip(ids, -rng.exponential(1.0, gen))])
    choice = P.GenerateTokensChoice(index=0, finish_reason="stop", token_ids=ids, logprobs=lps,
                                    routed_experts=numpy2base64(rows),
                                    weight_versions=[P.WeightVersionSpan(version="7", start=0, end=gen)])
    resp = P.GenerateTokensResponse(request_id="hetrl-17", model="policy", created=1, choices=[choice],
                                    usage={"prompt_tokens": ctx_len, "completion_tokens": gen,
                                           "total_tokens": ctx_len + gen,
                                           "prompt_tokens_details": {"cached_tokens": start}})
    return context, body, resp.model_dump_json().encode(), rows


def body_old(context, body):
    return old_json_body({**body, "token_ids": client.token_list(context)})


def body_new(context, body):
    return client.json_body({**body, "token_ids": client.token_list(context)})


def cpu_per_call(fn, n: int) -> float:
    gc.collect()
    t0 = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - t0) / n


def measure(pairs: dict, repeats: int, n: int) -> dict:
    """{name: (old_fn, new_fn)} -> {name: (median old s, median new s)}, old and new interleaved."""
    got = {k: ([], []) for k in pairs}
    for rep in range(repeats):
        for k, (old, new) in pairs.items():
            order = ((0, old), (1, new)) if rep % 2 == 0 else ((1, new), (0, old))
            for side, fn in order:
                got[k][side].append(cpu_per_call(fn, n))
    return {k: (statistics.median(o), statistics.median(w)) for k, (o, w) in got.items()}


def fit(xs: list[tuple[float, float]], ys: list[float]) -> np.ndarray:
    """cpu = a x context + b x rows + c, least squares (coefficients clipped at 0)."""
    a = np.array([[c, r, 1.0] for c, r in xs])
    coef, *_ = np.linalg.lstsq(a, np.array(ys), rcond=None)
    return np.clip(coef, 0.0, None)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--calls", type=int, default=3, help="calls per timed block")
    p.add_argument("--layers", type=int, default=75)
    p.add_argument("--top-k", type=int, default=8)
    a = p.parse_args(argv)
    cfg = routing.RouterConfig()
    rows_out, xs, client_old, client_new, router_old, router_new = [], [], [], [], [], []
    route_old = route_new = 0.0
    print(f"{'context':>8} {'gen':>5} {'rows':>6} | client us/request old new (x) | us/gen token old new | "
          f"routes ms old new | router us/ctx token old new (x)")
    for ctx_len, gen in CASES:
        context, body, answer, rows = make_case(ctx_len, gen, a.layers, a.top_k)
        b_old, b_new = body_old(context, body), body_new(context, body)
        # the same request and the same parsed answer both ways, before anything is timed
        assert json.loads(b_old) == json.loads(b_new)
        co, cn = old_client_answer(answer, "k"), new_client_answer(answer, "k")
        assert co.ids == cn.ids and co.logprobs == cn.logprobs and co.versions == cn.versions
        assert co.finish_reason == cn.finish_reason and np.array_equal(cn.routed_experts, rows)
        ro, rn = old_router(b_old, answer, cfg), new_router(b_new, answer, cfg)
        assert (ro[0].n_tokens, len(ro[0].hashes), ro[1].n_tokens, len(ro[1].hashes), ro[2]) == \
               (rn[0].n_tokens, len(rn[0].hashes), rn[1].n_tokens, len(rn[1].hashes), rn[2])
        b64 = json.loads(answer)["choices"][0]["routed_experts"]
        m = measure({"body": (lambda: body_old(context, body), lambda: body_new(context, body)),
                     "answer": (lambda: old_client_answer(answer, "k"), lambda: new_client_answer(answer, "k")),
                     "routes": (lambda: old_decode_routed_experts(b64), lambda: client.decode_routed_experts(b64)),
                     "router": (lambda: old_router(b_old, answer, cfg), lambda: new_router(b_new, answer, cfg))},
                    a.repeats, a.calls)
        c_old, c_new = m["body"][0] + m["answer"][0], m["body"][1] + m["answer"][1]
        client_old.append(c_old)
        client_new.append(c_new)
        router_old.append(m["router"][0])
        router_new.append(m["router"][1])
        route_old += m["routes"][0]
        route_new += m["routes"][1]
        xs.append((ctx_len, len(rows)))
        rows_out.append({"context": ctx_len, "gen": gen, "rows": len(rows), "client_old_s": c_old,
                         "client_new_s": c_new, **{f"{k}_{s}_s": v[i] for k, v in m.items()
                                                  for i, s in enumerate(("old", "new"))}})
        print(f"{ctx_len:8d} {gen:5d} {len(rows):6d} | {c_old * 1e6:9.0f} {c_new * 1e6:8.0f} "
              f"(x{c_new / c_old:.2f}) | {c_old / gen * 1e6:6.2f} {c_new / gen * 1e6:6.2f} | "
              f"{m['routes'][0] * 1e3:6.2f} {m['routes'][1] * 1e3:6.2f} | "
              f"{m['router'][0] / ctx_len * 1e6:.3f} {m['router'][1] / ctx_len * 1e6:.3f} "
              f"(x{m['router'][1] / m['router'][0]:.2f})", flush=True)
        print(f"{'':22s} body ms old {m['body'][0] * 1e3:.2f} new {m['body'][1] * 1e3:.2f}; answer ms old "
              f"{m['answer'][0] * 1e3:.2f} new {m['answer'][1] * 1e3:.2f}", flush=True)

    ctx_total = sum(c for c, _ in CASES)
    gen_total = sum(g for _, g in CASES)
    s = SEED
    seed_ctx = s["rollouts"] * s["mean_tokens"] * (s["turns"] + 1) / 2     # contexts summed over turns
    seed_rows = s["rollouts"] * s["mean_tokens"]                          # each token's route row once
    seed_requests = s["rollouts"] * s["turns"]

    def seed_s(ys):
        coef = fit(xs, ys)
        return float(coef @ np.array([seed_ctx, seed_rows, seed_requests])), coef

    r_old, ro_coef = seed_s(router_old)
    r_new, rn_coef = seed_s(router_new)
    c_old_s, _ = seed_s(client_old)
    c_new_s, _ = seed_s(client_new)
    out = {"codec_new_vs_old": sum(client_new) / sum(client_old),
           "route_decode_new_vs_old": route_new / route_old,
           "client_us_per_request_old": 1e6 * sum(client_old) / len(CASES),
           "client_us_per_request_new": 1e6 * sum(client_new) / len(CASES),
           "client_us_per_gen_token_old": 1e6 * sum(client_old) / gen_total,
           "client_us_per_gen_token_new": 1e6 * sum(client_new) / gen_total,
           "router_us_per_context_token_old": 1e6 * sum(router_old) / ctx_total,
           "router_us_per_context_token_new": 1e6 * sum(router_new) / ctx_total,
           "router_new_vs_old": sum(router_new) / sum(router_old),
           "seed_codec_cpu_s_old": c_old_s, "seed_codec_cpu_s_new": c_new_s,
           "seed_router_cpu_s_old": r_old / s["routers"], "seed_router_cpu_s_new": r_new / s["routers"]}
    print(f"\nseed step: {s['rollouts']} rollouts x {s['mean_tokens']} mean tokens in {s['turns']} turns: "
          f"{seed_ctx / 1e6:.0f} M context tokens over {seed_requests} requests, {seed_rows / 1e6:.1f} M route "
          f"rows; {s['routers']} router process (the plan's)")
    print(f"router fit, us per context token / per route row / per request: old {ro_coef[0] * 1e6:.3f} / "
          f"{ro_coef[1] * 1e6:.3f} / {ro_coef[2] * 1e6:.0f}, new {rn_coef[0] * 1e6:.3f} / {rn_coef[1] * 1e6:.3f} / "
          f"{rn_coef[2] * 1e6:.0f}")
    print(f"seed: router CPU per step per process {r_old:.0f} s -> {r_new:.0f} s; client codec CPU per step "
          f"(all rollout processes together) {c_old_s:.0f} s -> {c_new_s:.0f} s")
    print(" ".join(f"{k}={v:.4g}" for k, v in out.items()))
    return {"cases": rows_out, **out}


if __name__ == "__main__":
    main()
