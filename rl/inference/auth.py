"""The run's secret in front of every HTTP path of the vLLM server: `--middleware rl.inference.auth.RunSecret`.

vLLM's own `--api-key` / `VLLM_API_KEY` check guards only its OpenAI-style prefixes (`/v1`, `/inference`,
...): the engine-control paths this project turns on with `VLLM_SERVER_DEV_MODE` (`/pause`, `/resume`,
`/collective_rpc`, `/update_weight_version`, `/reset_prefix_cache`, `/sleep`, `/wake_up`), `/metrics`,
`/weight_info`, `/is_paused`, `/version` and the rest answer anyone who can reach the port, and
`/collective_rpc` calls a method of every worker with the caller's arguments. So the plan adds this
middleware to every replica's vLLM argv (vLLM's `--middleware` option imports it and calls
`app.add_middleware(RunSecret)`; added last, it is the outermost layer and runs before vLLM's own).

Every request, on every path and method (websockets too), must carry `Authorization: Bearer <secret>`;
anything else gets 401 before vLLM sees it. The one exception is `GET`/`HEAD /health`: the inference role
polls it while the engine starts (rl.inference.server.wait_healthy), and so may a scheduler's or an
operator's readiness probe that holds no token; it changes nothing and tells only "up or not" (200 or
503, empty body), which an open port tells anyway. `OPTIONS` is not exempt (vLLM's own check lets CORS
preflights through; nothing in a run is a browser).

The secret comes from the environment (`VLLM_API_KEY`, which rl.inference.server sets from the run
directory's `secret` file), never from argv, and is never logged. Tokens are compared in constant time:
both sides are hashed to SHA-256 first (so even their lengths do not leak) and compared with
`hmac.compare_digest`. A vLLM started with this middleware but without a secret refuses to start (the
middleware is built before the first request, lifespan included) unless the inference role says the run
has none (`HETRL_UNAUTHENTICATED=1`, a run directory whose `secret` was removed, as some tests do): a
process that lost its environment must not serve its admin paths open; nor does one whose secret is
shorter than 32 characters (a damaged `secret` file: rl/contract/secret.py).

Pure ASGI with no imports beyond the standard library: it runs inside vLLM's API server process, and it
must not pull torch or vLLM into anything that imports it (the router and the tests do).
"""
from __future__ import annotations

import hashlib
import hmac
import os

SECRET_ENV = "VLLM_API_KEY"
UNAUTHENTICATED_ENV = "HETRL_UNAUTHENTICATED"  # "1": the run has no secret, serve without tokens
OPEN_PATHS = ("/health",)
OPEN_METHODS = ("GET", "HEAD")
MIDDLEWARE = f"{__name__}.RunSecret"  # what the plan passes to vLLM's --middleware
MIN_SECRET_CHARS = 32  # rl.contract.secret.MIN_CHARS (not imported: this module is stdlib-only)


def bearer(secret: str) -> dict[str, str]:
    """The header every client of the run's endpoints sends."""
    return {"Authorization": f"Bearer {secret}"}


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def token_ok(authorization: bytes | str | None, secret_digest: bytes) -> bool:
    """Does an `Authorization` header value carry the secret (whose SHA-256 is `secret_digest`)?"""
    if not authorization:
        return False
    if isinstance(authorization, str):
        authorization = authorization.encode("latin-1", "replace")
    scheme, _, token = authorization.partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    return hmac.compare_digest(_digest(token.strip()), secret_digest)


def is_open(method: str | None, path: str) -> bool:
    """The paths answered without a token (see the module docstring)."""
    return path in OPEN_PATHS and (method or "GET") in OPEN_METHODS


class RunSecret:
    """ASGI middleware: 401 for every request without the run's bearer token, except `is_open` ones."""

    def __init__(self, app, secret: str | None = None, env=None):
        env = os.environ if env is None else env
        secret = secret if secret is not None else env.get(SECRET_ENV)
        if not secret and env.get(UNAUTHENTICATED_ENV) != "1":
            raise RuntimeError(f"{MIDDLEWARE}: {SECRET_ENV} is unset, so the run's secret never reached this "
                               f"vLLM; refusing to serve its admin paths without one (set "
                               f"{UNAUTHENTICATED_ENV}=1 only for a run without a secret)")
        if secret and len(secret.strip()) < MIN_SECRET_CHARS:  # a damaged secret file, not a token
            raise RuntimeError(f"{MIDDLEWARE}: {SECRET_ENV} holds {len(secret.strip())} chars, fewer than "
                               f"{MIN_SECRET_CHARS}: refusing to serve behind a secret anyone could guess")
        self.app = app
        self._digest = _digest(secret.encode()) if secret else None

    async def __call__(self, scope, receive, send):
        if self._digest is None or scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)  # lifespan; or a run without a secret
        path = scope["path"]
        root = scope.get("root_path") or ""
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        if scope["type"] == "http" and is_open(scope.get("method"), path):
            return await self.app(scope, receive, send)
        auth = next((v for k, v in scope.get("headers") or () if k.lower() == b"authorization"), None)
        if token_ok(auth, self._digest):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # before accept: the server answers 403
            return None
        body = b'{"error": "unauthorized: this path needs the run\'s bearer token"}'
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
        return None
