"""The KV-aware router beats round robin on prefix-cache reuse with 2 real vLLM CPU servers.

A smaller run of benchmarks/router.py (same code): the same multi-turn workload through the router and
through per-request round robin, prefix caches reset before each; hit rates from the servers' own
vllm:prefix_cache_hits / vllm:prefix_cache_queries counters.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("aiohttp")

REPO = Path(__file__).resolve().parents[2]


def _bench_module():
    spec = importlib.util.spec_from_file_location("hetrl_bench_router", REPO / "benchmarks" / "router.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod      # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_router_hit_rate_beats_round_robin():
    bench = _bench_module()
    out = bench.main(["--sessions", "6", "--turns", "3", "--system-tokens", "128", "--user-tokens", "64",
                      "--followup-tokens", "32", "--max-tokens", "8:16", "--think-ms", "20",
                      "--max-model-len", "512"])
    rr, kv = (next(r for r in out["results"] if r["policy"] == p) for p in ("round_robin", "kv"))
    assert kv["requests"] == rr["requests"] == 18
    assert kv["prefix_queries"] > 0 and rr["prefix_queries"] > 0
    assert kv["hit_rate"] > rr["hit_rate"], out["summary"]
    # every later turn of a session went back to the server that held its prefix
    assert kv["same_server_turns"] == 1.0
    assert set(kv["requests_per_server"].values()) != {0} and min(kv["requests_per_server"].values()) > 0
