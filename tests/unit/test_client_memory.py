"""What the orchestrator's HTTP client (rl/orchestrator/client.py) holds per request, over real HTTP.

The server is a real aiohttp process (answers in vLLM's generate shape, routes as vLLM's `numpy2base64`:
base64 of a `.npy`), so nothing it holds is in this process's tracemalloc; the client is the real
InferenceClient over real sockets.
(a) A request waiting for its answer does not hold its body: N requests of long contexts sent and held by
    the server add well under a byte per context token (the body is ~7; a list of ints would be ~44).
(b) Answers are read and parsed at most `READ_BODIES` at a time per server: N large answers released at
    once peak at a few bodies' worth, not N, and each decodes to the rows the server sent.
(c) A request that failed before its body was read is sent again with the same body (made per attempt).
"""
from __future__ import annotations

import asyncio
import base64
import gc
import io
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from rl.orchestrator.client import InferenceClient, decode_routed_experts

REPO = Path(__file__).resolve().parents[2]

SERVER = r"""
import asyncio, base64, io, json, sys
import numpy as np
from aiohttp import web

rows, drop_first = int(sys.argv[1]), int(sys.argv[2])
state = {"arrived": 0, "bodies": [], "release": asyncio.Event(), "seen": 0}

def b64(n, seed):
    a = np.random.default_rng(seed).integers(0, 256, (n, 2, 8), dtype=np.uint8)
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()

async def generate(request):
    body = await request.read()
    state["seen"] += 1
    if state["seen"] <= drop_first:      # a connection closed before an answer: the client sends again
        request.transport.close()
        return web.Response(status=500)
    req = json.loads(body)
    if not req["request_id"].startswith("w"):   # warm-up requests are answered at once, not counted
        state["bodies"].append(len(body))
        state["arrived"] += 1
        await state["release"].wait()
    n = len(req["token_ids"])
    seed = int(req["request_id"][1:]) if req["request_id"][1:].isdigit() else 0
    ans = {"choices": [{"index": 0, "finish_reason": "stop", "token_ids": [7, 8],
                        "logprobs": {"content": [{"token_id": 7, "logprob": -0.5}, {"token_id": 8, "logprob": -0.25}]},
                        "weight_versions": [{"version": "3", "start": 0, "end": 2}],
                        "routed_experts": b64(rows, seed) if rows else None}],
           "echo_tokens": n, "echo_sum": int(sum(req["token_ids"]))}
    return web.Response(body=json.dumps(ans).encode(), content_type="application/json")

async def stats(request):
    return web.json_response({"arrived": state["arrived"], "bodies": state["bodies"], "seen": state["seen"]})

async def release(request):
    state["release"].set()
    return web.json_response({})

async def main():
    app = web.Application(client_max_size=1 << 30)
    app.add_routes([web.post("/inference/v1/generate", generate), web.get("/stats", stats),
                    web.post("/release", release)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(site._server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


class Server:
    def __init__(self, rows: int = 0, drop_first: int = 0):
        self.p = subprocess.Popen([sys.executable, "-c", SERVER, str(rows), str(drop_first)], stdout=subprocess.PIPE,
                                  env={**os.environ, "PYTHONPATH": str(REPO)}, text=True)
        line = self.p.stdout.readline()
        if not line.strip().isdigit():
            self.p.kill()
            raise RuntimeError(f"test server did not start: {line!r}")
        self.url = f"http://127.0.0.1:{int(line)}"

    def close(self):
        self.p.kill()
        self.p.wait()


@pytest.fixture
def server(request):
    s = Server(*getattr(request, "param", ()))
    yield s
    s.close()


def _rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 2, 8), dtype=np.uint8)


async def _wait_arrived(side, n: int) -> dict:
    for _ in range(6000):   # generous: a loaded machine
        st = (await side.get("/stats")).json()
        if st["arrived"] >= n:
            return st
        await asyncio.sleep(0.05)
    raise TimeoutError(f"only {st['arrived']} of {n} requests reached the server")


def test_requests_waiting_for_their_answer_do_not_hold_their_body(server):
    import httpx
    n_req, tokens = 12, 40_000
    rng = np.random.default_rng(0)
    contexts = [rng.integers(100_000, 150_000, tokens).astype(np.int32) for _ in range(n_req)]

    async def run():
        client = InferenceClient(server.url)
        side = httpx.AsyncClient(base_url=server.url, timeout=60)
        try:
            # connections opened and modules imported first: what is measured is the requests' own
            await asyncio.gather(*(client.generate([1], max_tokens=2, request_id=f"w{i}") for i in range(n_req)))
            gc.collect()
            tracemalloc.start()
            try:
                base = tracemalloc.get_traced_memory()[0]
                out = [asyncio.create_task(client.generate(c, max_tokens=2, request_id=f"q{i}"))
                       for i, c in enumerate(contexts)]
                st = await _wait_arrived(side, n_req)
                gc.collect()
                held = tracemalloc.get_traced_memory()[0] - base
            finally:
                tracemalloc.stop()
            await side.post("/release")
            comps = await asyncio.gather(*out)
        finally:
            await side.aclose()
            await client.aclose()
        return held, st, comps

    held, st, comps = asyncio.run(run())
    body = sum(st["bodies"])
    print(f"{n_req} requests out, {n_req * tokens} context tokens, bodies {body} B on the wire: the client holds "
          f"{held} B ({held / (n_req * tokens):.2f} B per context token)")
    assert body >= 7 * n_req * tokens                      # what holding the bodies would cost
    # each request's own objects (httpx's request and response, h11 events, the tasks) are a few kB
    assert held < 0.1 * body, f"the client holds {held} B with {body} B of request bodies out"
    assert [(c.ids, c.versions, c.raw["echo_tokens"]) for c in comps] == [([7, 8], [3, 3], tokens)] * n_req
    assert [c.raw["echo_sum"] for c in comps] == [int(c.sum()) for c in contexts]   # the bodies were whole


@pytest.mark.parametrize("server", [(60_000,)], indirect=True)
def test_answers_are_read_a_few_at_a_time_per_server_and_decode_to_the_rows_sent(server):
    import httpx
    n_req, rows = 48, 60_000
    one = len(base64.b64encode(b"x" * (rows * 16 + 128)))   # one answer's routes as base64

    async def run():
        client = InferenceClient(server.url)
        side = httpx.AsyncClient(base_url=server.url, timeout=60)
        got = {}

        async def one_turn(i):
            c = await client.generate([1, 2, 3], max_tokens=2, request_id=f"q{i}")
            # what the orchestrator does with a turn's rows, synchronously after the answer: spill them
            got[i] = (c.routed_experts.shape, bool(np.array_equal(c.routed_experts, _rows(rows, i))),
                      "routed_experts" in c.raw["choices"][0])
        try:
            out = [asyncio.create_task(one_turn(i)) for i in range(n_req)]
            await _wait_arrived(side, n_req)
            gc.collect()
            tracemalloc.start()
            try:
                base = tracemalloc.get_traced_memory()[0]
                await side.post("/release")
                await asyncio.gather(*out)
                peak = tracemalloc.get_traced_memory()[1] - base
            finally:
                tracemalloc.stop()
        finally:
            await side.aclose()
            await client.aclose()
        return got, peak

    got, peak = asyncio.run(run())
    print(f"{n_req} answers of {one} B of base64 routes released at once: client peak {peak} B "
          f"({peak / one:.1f} answers' worth; READ_BODIES={InferenceClient.READ_BODIES})")
    assert got == {i: ((rows, 2, 8), True, False) for i in range(n_req)}
    # a body being read or parsed costs a few times its size (the bytes, the JSON's string, the decoded
    # rows); all of them at once would be n_req times that
    assert peak < 3 * (InferenceClient.READ_BODIES + 1) * one < n_req * one


@pytest.mark.parametrize("server", [(0, 2)], indirect=True)
def test_a_request_lost_before_its_answer_is_sent_again_whole(server):
    import httpx
    ctx = np.arange(5000, dtype=np.int32)

    async def run():
        client = InferenceClient(server.url)
        side = httpx.AsyncClient(base_url=server.url, timeout=60)
        try:
            await side.post("/release")
            c = await client.generate(ctx, max_tokens=2, request_id="q5")
            st = (await side.get("/stats")).json()
        finally:
            await side.aclose()
            await client.aclose()
        return c, st

    c, st = asyncio.run(run())
    assert st["seen"] == 3 and st["arrived"] == 1         # two connections closed, the third answered
    assert c.raw["echo_tokens"] == 5000 and c.raw["echo_sum"] == int(ctx.sum()) and c.routed_experts is None


def test_routes_decode_like_np_load_and_bad_ones_are_named():
    from rl.orchestrator.client import InferenceError
    for a in (_rows(5, 1), _rows(3, 2).astype(np.uint16), np.asfortranarray(_rows(4, 3)), _rows(0, 4)):
        buf = io.BytesIO()
        np.save(buf, a, allow_pickle=False)
        b64 = base64.b64encode(buf.getvalue()).decode()
        got = decode_routed_experts(b64)
        want = np.load(io.BytesIO(base64.b64decode(b64)), allow_pickle=False)
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
    assert decode_routed_experts(None) is None
    buf = io.BytesIO()
    np.save(buf, _rows(5, 1), allow_pickle=False)
    with pytest.raises(InferenceError, match=r"routed_experts: .* data bytes for shape \(5, 2, 8\)"):
        decode_routed_experts(base64.b64encode(buf.getvalue()[:-3]).decode())
    with pytest.raises(InferenceError, match="routed_experts is not a .npy array"):
        decode_routed_experts(base64.b64encode(b"not an npy file at all").decode())
    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(InferenceError, match="object arrays are refused"):
        decode_routed_experts(base64.b64encode(buf.getvalue()).decode())
