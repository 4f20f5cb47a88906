"""rl.inference.auth: the run's secret in front of every path of the vLLM server.

Pure ASGI checks against a recording app, then the outside reference: vLLM's own middleware registration
(`init_entrypoints_middleware`, which imports `--middleware` by name) on a FastAPI app parsed from the
plan's argv, driven by Starlette's test client. The real server behind the secret is checked in
tests/integration/test_inference_server.py.
"""
from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from rl.inference.auth import MIDDLEWARE, UNAUTHENTICATED_ENV, RunSecret, token_ok

REPO = Path(__file__).resolve().parents[2]
SECRET = "0123456789abcdef0123456789abcdef"


class Recorder:
    def __init__(self):
        self.seen = []

    async def __call__(self, scope, receive, send):
        self.seen.append((scope["type"], scope.get("path")))
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})


def call(mw, path, method="GET", auth=None, kind="http", root_path=""):
    sent = []

    async def send(msg):
        sent.append(msg)

    async def receive():
        return {"type": "http.request", "body": b""}

    headers = [(b"host", b"x")] + ([(b"authorization", auth.encode())] if auth is not None else [])
    scope = {"type": kind, "path": path, "method": method, "headers": headers, "root_path": root_path}
    asyncio.run(mw(scope, receive, send))
    return sent[0].get("status", sent[0].get("code")) if sent else None


def test_every_path_needs_the_token_but_health():
    app = Recorder()
    mw = RunSecret(app, env={"VLLM_API_KEY": SECRET})
    for path in ("/collective_rpc", "/pause", "/update_weight_version", "/metrics", "/v1/completions",
                 "/sleep", "/weight_info", "/", "/health/", "/healthz"):
        for auth in (None, "", f"Bearer {SECRET[:-1]}0", f"Bearer {SECRET}0", SECRET, f"Basic {SECRET}",
                     f"Bearer{SECRET}"):
            assert call(mw, path, "POST", auth) == 401, (path, auth)
        assert call(mw, path, "POST", f"Bearer {SECRET}") == 200
        assert call(mw, path, "POST", f"bearer  {SECRET}") == 200  # scheme is case-insensitive (RFC 7235)
    assert len(app.seen) == 20
    assert call(mw, "/health") == call(mw, "/health", "HEAD") == 200
    assert call(mw, "/health", "POST") == call(mw, "/health", "OPTIONS") == 401
    assert call(mw, "/api/health", root_path="/api") == 200 and call(mw, "/api/pause", root_path="/api") == 401
    assert call(mw, "/v1/realtime", kind="websocket") == 1008  # closed before accept
    asyncio.run(mw({"type": "lifespan"}, None, None))
    assert app.seen[-1] == ("lifespan", None)


def test_no_secret_refuses_to_start_unless_the_run_has_none():
    with pytest.raises(RuntimeError, match=r"rl.inference.auth.RunSecret: VLLM_API_KEY is unset"):
        RunSecret(Recorder(), env={})
    with pytest.raises(RuntimeError, match="VLLM_API_KEY is unset"):
        RunSecret(Recorder(), env={"VLLM_API_KEY": "", UNAUTHENTICATED_ENV: "0"})
    open_mw = RunSecret(Recorder(), env={UNAUTHENTICATED_ENV: "1"})
    assert call(open_mw, "/collective_rpc", "POST") == 200


def test_token_ok_hashes_before_comparing():
    import hashlib
    d = hashlib.sha256(SECRET.encode()).digest()
    assert token_ok(f"Bearer {SECRET}", d) and token_ok(f"Bearer {SECRET}".encode(), d)
    assert not token_ok(f"Bearer {SECRET}\u00e9", d) and not token_ok(None, d) and not token_ok("Bearer", d)


def test_module_is_light():
    code = ("import sys, rl.inference.auth; bad = [m for m in ('torch', 'vllm', 'starlette', 'numpy') "
            "if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_vllm_loads_the_planned_middleware_by_name(tmp_path, monkeypatch):
    """vLLM's own registration, with the --middleware of a planned argv, guards a FastAPI app."""
    pytest.importorskip("vllm")
    from fastapi import FastAPI
    from starlette.testclient import TestClient
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from builders import make_run_dir
    from rl.contract.plan import Plan
    make_run_dir(tmp_path / "run", "wandb.mode=disabled", f"cluster.node_local_dir={tmp_path / 'nl'}")
    argv = Plan.read(tmp_path / "run").replica(0).vllm_argv(0)
    assert argv[argv.index("--middleware") + 1] == MIDDLEWARE
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
    assert args.middleware == [MIDDLEWARE] and not args.api_key
    monkeypatch.setenv("VLLM_API_KEY", SECRET)
    app = FastAPI()
    app.get("/health")(lambda: {})
    app.post("/collective_rpc")(lambda: {"results": []})
    app.get("/metrics")(lambda: "m")
    init_entrypoints_middleware(args, app, ("generate",))
    with TestClient(app) as c:
        assert c.get("/health").status_code == 200
        assert c.post("/collective_rpc").status_code == 401 and c.get("/metrics").status_code == 401
        assert c.post("/collective_rpc", headers={"Authorization": f"Bearer {'f' * 32}"}).status_code == 401
        assert c.post("/collective_rpc", headers={"Authorization": f"Bearer {SECRET}"}).json() == {"results": []}
