"""Does the KV-aware router reuse more prefix cache than round robin on a multi-turn workload?

Starts 2 real vLLM CPU servers on the same tiny Qwen3-MoE (made here: rl.tiny_models.tiny tokenizer and
config, random weights in HF names; prefix caching on, `--block-size` small so a turn's growth shows),
then runs the same multi-turn workload through the router (rl.inference.router, policy "kv") and
through the same proxy doing per-request round robin, with the servers' prefix caches reset before each
run. The workload: S sessions x T turns, all sessions sharing a system prompt; a session's first prompt
is system + its own user message; each later turn's prompt is the previous prompt + the completion +
a new user message (token ids through /inference/v1/generate, as the orchestrator sends them), with
seeded completion lengths and "tool" pauses, so arrivals interleave as real rollouts do and both runs
send identical requests. Prints, per policy: the prefix-cache hit rate from the servers' own counters
(deltas of vllm:prefix_cache_hits / vllm:prefix_cache_queries over the run), the cached tokens the
servers reported per request, the router's decisions, wall time; then the ratios router / round robin.
Machines here are noisy: compare the ratios of one run.

    python benchmarks/router.py [--sessions 16 --turns 4 --system-tokens 256 --user-tokens 128
                                 --followup-tokens 64 --max-tokens 16:48 --repeats 1 --json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rl.inference.proxy import Router  # noqa: E402
from rl.contract.routing import BACKEND_HEADER, SESSION_HEADER, RouterConfig, parse_metrics  # noqa: E402

MODEL_NAME = "policy"


# -- the model and the servers -----------------------------------------------------------------------
def make_model(out_dir: Path, max_len: int, seed: int = 0) -> Path:
    """Tokenizer + config (rl.tiny_models.tiny) and random weights in HF checkpoint names (per expert)."""
    import torch
    from omegaconf import OmegaConf
    from safetensors.torch import save_file
    from transformers import AutoConfig, Qwen3MoeForCausalLM

    from rl.tiny_models.tiny import write_hf_assets

    out_dir = Path(out_dir)
    from rl.contract.config import ModelConfig
    m = OmegaConf.to_container(OmegaConf.structured(ModelConfig))  # the embedded default's model
    m["max_seq_len"] = max_len
    write_hf_assets(out_dir, m, seed=seed)
    cfg = AutoConfig.from_pretrained(out_dir)
    shapes = {k: v.shape for k, v in Qwen3MoeForCausalLM(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, shape in shapes.items():
        if name.endswith("experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            e, two_i, h = shape
            for j in range(e):
                sd[f"{prefix}{j}.gate_proj.weight"] = torch.randn(two_i // 2, h, generator=g) * 0.15
                sd[f"{prefix}{j}.up_proj.weight"] = torch.randn(two_i // 2, h, generator=g) * 0.15
        elif name.endswith("experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            e, h, i = shape
            for j in range(e):
                sd[f"{prefix}{j}.down_proj.weight"] = torch.randn(h, i, generator=g) * 0.15
        elif "norm" in name:
            sd[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            sd[name] = torch.randn(shape, generator=g) * 0.15
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    return out_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, port: int, work: Path, *, max_len: int, block_size: int,
                 kv_gb: int = 1, core: int | None = None) -> subprocess.Popen:
    cache = work / f"vllm-cache-{port}"
    cache.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_HOST_IP="127.0.0.1",
               VLLM_CPU_KVCACHE_SPACE=str(kv_gb), VLLM_CACHE_ROOT=str(cache),
               PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(
                   os.pathsep) if p]))
    if core is not None:   # vLLM's "auto" binding puts every server on the same core
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", str(max_len), "--enforce-eager",
           "--enable-prefix-caching", "--block-size", str(block_size), "--enable-prompt-tokens-details",
           "--enable-scale-out", "--generation-config", "vllm", "--seed", "0"]
    log = open(work / f"server-{port}.log", "ab")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_server(proc: subprocess.Popen, grace: float = 30.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


async def wait_healthy(http, urls: list[str], procs: list[subprocess.Popen], timeout: float, work: Path):
    deadline = time.monotonic() + timeout
    pending = set(urls)
    while pending:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"a vLLM server exited ({p.returncode}); see {work}/server-*.log")
        if time.monotonic() > deadline:
            raise TimeoutError(f"vLLM servers {sorted(pending)} not healthy after {timeout:.0f} s")
        for u in list(pending):
            try:
                async with http.get(f"{u}/health") as r:
                    if r.status == 200:
                        pending.discard(u)
            except Exception:  # noqa: BLE001  not up yet
                pass
        await asyncio.sleep(1.0)


# -- the workload ------------------------------------------------------------------------------------
@dataclass
class Workload:
    sessions: int = 16
    turns: int = 4
    system_tokens: int = 256        # shared by every session
    user_tokens: int = 128          # each session's own first message
    followup_tokens: int = 64       # the new user/tool message after each turn
    min_new: int = 16               # completion length range (seeded per session and turn)
    max_new: int = 48
    think_ms: int = 50              # up to this "tool" pause between turns (seeded)
    seed: int = 0

    def plan(self):
        rng = random.Random(self.seed)
        tok = lambda n: [rng.randrange(10, 500) for _ in range(n)]  # noqa: E731
        system = tok(self.system_tokens)
        out = []
        for s in range(self.sessions):
            first = system + tok(self.user_tokens)
            turns = [{"max_tokens": rng.randint(self.min_new, self.max_new),
                      "followup": tok(self.followup_tokens),
                      "pause": rng.uniform(0, self.think_ms / 1000), "seed": rng.randrange(1 << 30)}
                     for _ in range(self.turns)]
            out.append((first, turns, rng.uniform(0, self.think_ms / 1000)))
        return out


async def run_session(http, url: str, s: int, first: list[int], turns: list[dict], start_pause: float,
                      tag: str) -> list[dict]:
    await asyncio.sleep(start_pause)
    prompt, rows = list(first), []
    for t, turn in enumerate(turns):
        body = {"request_id": f"{tag}-s{s}-t{t}", "token_ids": prompt, "model": MODEL_NAME,
                "sampling_params": {"max_tokens": turn["max_tokens"], "temperature": 1.0,
                                    "seed": turn["seed"], "ignore_eos": True}}
        t0 = time.monotonic()
        async with http.post(f"{url}/inference/v1/generate", json=body,
                             headers={SESSION_HEADER: f"session-{s}"}) as r:
            if r.status != 200:
                raise RuntimeError(f"session {s} turn {t}: {r.status} {(await r.text())[:500]}")
            data = await r.json()
            backend = r.headers.get(BACKEND_HEADER)
        ids = data["choices"][0]["token_ids"]
        cached = ((data.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
        rows.append({"session": s, "turn": t, "prompt": len(prompt), "completion": len(ids),
                     "cached": cached, "backend": backend, "latency_s": time.monotonic() - t0})
        prompt = prompt + list(ids) + turn["followup"]
        await asyncio.sleep(turn["pause"])
    return rows


async def server_counters(http, urls: list[str]) -> dict[str, dict]:
    out = {}
    for u in urls:
        async with http.get(f"{u}/metrics") as r:
            out[u] = parse_metrics(await r.text())
    return out


async def reset_caches(http, urls: list[str]) -> None:
    for u in urls:
        for _ in range(50):
            async with http.post(f"{u}/reset_prefix_cache") as r:
                if r.status == 200 and (await r.json()).get("success"):
                    break
            await asyncio.sleep(0.2)
        else:
            raise RuntimeError(f"{u}: reset_prefix_cache kept failing")


async def run_policy(http, urls: list[str], policy: str, work: Workload, tag: str) -> dict:
    await reset_caches(http, urls)
    await asyncio.sleep(0.5)
    before = await server_counters(http, urls)
    router = Router([(f"inference_{i}", u, "mixed") for i, u in enumerate(urls)], RouterConfig(policy=policy),
                    log=lambda m: None)
    rurl = await router.start("127.0.0.1", 0)
    t0 = time.monotonic()
    try:
        rows = await asyncio.gather(*(run_session(http, rurl, s, first, turns, pause, tag)
                                      for s, (first, turns, pause) in enumerate(work.plan())))
        wall = time.monotonic() - t0
        stats = router.stats()
    finally:
        await router.stop()
    await asyncio.sleep(1.0)   # the engines' last stats reach /metrics
    after = await server_counters(http, urls)
    hits = sum(after[u].get("prefix_hits", 0) - before[u].get("prefix_hits", 0) for u in urls)
    queries = sum(after[u].get("prefix_queries", 0) - before[u].get("prefix_queries", 0) for u in urls)
    flat = [r for rs in rows for r in rs]
    prompt = sum(r["prompt"] for r in flat)
    cached = sum(r["cached"] or 0 for r in flat)
    per_turn = {}
    for t in range(work.turns):
        rs = [r for r in flat if r["turn"] == t]
        per_turn[t] = sum(r["cached"] or 0 for r in rs) / max(1, sum(r["prompt"] for r in rs))
    sticky = sum(1 for rs in rows for a, b in zip(rs, rs[1:]) if a["backend"] == b["backend"])
    return {"policy": policy, "wall_s": wall, "hit_rate": hits / queries if queries else 0.0,
            "prefix_hits": hits, "prefix_queries": queries, "reported_cached_tokens": cached,
            "prompt_tokens": prompt, "reported_hit_rate": cached / max(1, prompt),
            "completion_tokens": sum(r["completion"] for r in flat), "requests": len(flat),
            "same_server_turns": sticky / max(1, sum(len(rs) - 1 for rs in rows)),
            "per_turn_reported_hit_rate": per_turn, "decisions": stats["decisions"],
            "requests_per_server": {b["name"]: b["requests"] for b in stats["backends"]},
            "latency_mean_s": sum(r["latency_s"] for r in flat) / max(1, len(flat))}


async def bench(args) -> dict:
    import aiohttp

    work = Workload(sessions=args.sessions, turns=args.turns, system_tokens=args.system_tokens,
                    user_tokens=args.user_tokens, followup_tokens=args.followup_tokens,
                    min_new=args.min_new, max_new=args.max_new, think_ms=args.think_ms, seed=args.seed)
    longest = work.system_tokens + work.user_tokens + work.turns * (work.max_new + work.followup_tokens)
    max_len = max(args.max_model_len, 1 << (longest - 1).bit_length())
    tmp = Path(tempfile.mkdtemp(prefix="hetrl-router-bench-"))
    procs = []
    try:
        t0 = time.monotonic()
        model = make_model(tmp / "model", max_len)
        ports = [free_port() for _ in range(args.servers)]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        ncpu = len(os.sched_getaffinity(0))
        procs = [start_server(model, p, tmp, max_len=max_len, block_size=args.block_size, core=i % ncpu)
                 for i, p in enumerate(ports)]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.timeout)) as http:
            await wait_healthy(http, urls, procs, args.startup_timeout, tmp)
            print(f"{args.servers} vLLM servers up in {time.monotonic() - t0:.0f} s (model, max_model_len "
                  f"{max_len}, block size {args.block_size}); workload: {work.sessions} sessions x "
                  f"{work.turns} turns, system {work.system_tokens} + user {work.user_tokens} tokens, "
                  f"+{work.followup_tokens} per turn, completions {work.min_new}-{work.max_new}", flush=True)
            # warm both engines up (first requests pay one-time costs), outside the measured runs
            warm = Workload(sessions=4 * args.servers, turns=2, system_tokens=64, user_tokens=64, seed=99)
            await run_policy(http, urls, "round_robin", warm, "warm")
            results = []
            for rep in range(args.repeats):   # alternate the order: neither policy always goes first
                for policy in (("round_robin", "kv") if rep % 2 == 0 else ("kv", "round_robin")):
                    r = await run_policy(http, urls, policy, work, f"{policy}-{rep}")
                    r["repeat"] = rep
                    results.append(r)
                    print(f"  {policy:11s} rep {rep}: hit rate {r['hit_rate']:.3f} "
                          f"({r['prefix_hits']:.0f}/{r['prefix_queries']:.0f} tokens), {r['wall_s']:.2f} s, "
                          f"decisions {r['decisions']}", flush=True)
    finally:
        for p in procs:
            stop_server(p)
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return {"workload": asdict(work), "block_size": args.block_size, "max_model_len": max_len,
            "servers": args.servers, "results": results, "summary": summarize(results)}


def summarize(results: list[dict]) -> dict:
    def mean(policy, k):
        xs = [r[k] for r in results if r["policy"] == policy]
        return sum(xs) / len(xs)
    keys = ("hit_rate", "reported_hit_rate", "wall_s", "latency_mean_s", "same_server_turns")
    s = {p: {k: mean(p, k) for k in keys} for p in ("round_robin", "kv")}
    s["hit_rate_ratio"] = s["kv"]["hit_rate"] / max(s["round_robin"]["hit_rate"], 1e-9)
    s["time_ratio"] = s["kv"]["wall_s"] / s["round_robin"]["wall_s"]
    return s


def print_table(out: dict) -> None:
    print()
    print(f"{'policy':12s} {'hit rate':>9s} {'reported':>9s} {'same srv':>9s} {'wall s':>8s} "
          f"{'mean lat s':>10s}  per-turn reported hit rate")
    for r in out["results"]:
        pt = " ".join(f"{v:.2f}" for v in r["per_turn_reported_hit_rate"].values())
        print(f"{r['policy']:12s} {r['hit_rate']:9.3f} {r['reported_hit_rate']:9.3f} "
              f"{r['same_server_turns']:9.2f} {r['wall_s']:8.2f} {r['latency_mean_s']:10.3f}  {pt}")
    s = out["summary"]
    print(f"\nrouter / round robin: prefix-cache hit rate {s['kv']['hit_rate']:.3f} / "
          f"{s['round_robin']['hit_rate']:.3f} = x{s['hit_rate_ratio']:.2f}; total time "
          f"{s['kv']['wall_s']:.2f} s / {s['round_robin']['wall_s']:.2f} s = x{s['time_ratio']:.2f}")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--user-tokens", type=int, default=128)
    p.add_argument("--followup-tokens", type=int, default=64)
    p.add_argument("--max-tokens", default="16:48", help="completion length range MIN:MAX")
    p.add_argument("--think-ms", type=int, default=50)
    p.add_argument("--block-size", type=int, default=32, help="vLLM KV block size (CPU: multiple of 32)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (model, server logs)")
    a = p.parse_args(argv)
    lo, _, hi = a.max_tokens.partition(":")
    a.min_new, a.max_new = int(lo), int(hi or lo)
    return a


def main(argv=None) -> dict:
    args = parse(argv)
    out = asyncio.run(bench(args))
    print_table(out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
