"""A stand-in for vLLM's API server in benchmarks/elastic.py: the inference role runs it in vLLM's place.

The benchmark measures what the run directory, the role, the batch script's restart rule and the router
do when servers die, restart and join, not what vLLM does, so the engine only has to take the plan's
vLLM argv (it reads `--host` and `--port` and ignores the rest) and answer the paths the role and the
router use: `/health`, `/metrics` (vLLM's running / waiting gauges), `/update_weight_version` and
`/inference/v1/generate`. Its capacity is fixed, as a real engine's is: `HETRL_MOCK_SLOTS` requests at
once, each taking `HETRL_MOCK_SERVICE_MS`, the rest queued, so two servers have twice the throughput
of one when the load is high enough to fill both.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys


def main(argv=None) -> int:
    from aiohttp import web
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    ns, _ = p.parse_known_args(argv)
    slots = int(os.environ.get("HETRL_MOCK_SLOTS", "4"))
    service_s = float(os.environ.get("HETRL_MOCK_SERVICE_MS", "50")) / 1000
    state = {"running": 0, "waiting": 0, "version": os.environ.get("HETRL_POLICY_VERSION", "0")}
    sem = asyncio.Semaphore(slots)

    async def health(request):
        return web.Response(text="")

    async def metrics(request):
        return web.Response(text=f"vllm:num_requests_running {state['running']}\n"
                                 f"vllm:num_requests_waiting {state['waiting']}\n")

    async def update_version(request):
        state["version"] = str((await request.json())["new_version"])
        return web.json_response({})

    async def generate(request):
        body = await request.json()
        state["waiting"] += 1
        async with sem:
            state["waiting"] -= 1
            state["running"] += 1
            try:
                await asyncio.sleep(service_s)
            finally:
                state["running"] -= 1
        n = int((body.get("sampling_params") or {}).get("max_tokens", 4))
        return web.json_response({"choices": [{"token_ids": [7] * n, "logprobs": {"content": [{"logprob": -1.0}] * n},
                                               "finish_reason": "length",
                                               "weight_versions": [[state["version"], n]]}]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/update_weight_version", update_version)
    app.router.add_post("/inference/v1/generate", generate)
    web.run_app(app, host=ns.host, port=ns.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
