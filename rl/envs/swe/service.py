"""The sandbox service: SWE sandboxes on a node of their own, for an orchestrator on another node.

`python -m rl.envs.swe.service --run-dir D --index I` runs on node I of the optional third het group
(`cluster.sandbox_nodes`, role `sandbox_<I>` in the plan). It reads the run's frozen config, loads the
same task rows the orchestrator loads (env.swe.tasks, made playable under env.swe.runtime), and serves
them over HTTP:

    POST   /sandboxes                 {"instance_id"}                    -> {"id", "open"}
    POST   /sandboxes/<id>/run        {"argv", "timeout_s", "input", "input_b64", "env"} -> Result
    POST   /sandboxes/<id>/read       {"path"}                           -> {"text"} (null: no file)
    POST   /sandboxes/<id>/write      {"path", "text"}                   -> {}
    POST   /sandboxes/<id>/tool       {"name", "args", "timeout_s"}      -> {"observation", "submitted"}
    POST   /sandboxes/<id>/grade      {}                                 -> Grade
    GET    /sandboxes/<id>/tree       a tar of the tree (links as links)
    DELETE /sandboxes/<id>
    GET    /health                    (no token)

Why the tools and grading run here rather than in the client: the file tools of rl/envs/swe/tools.py
check paths against the tree on the host that holds it, and grading copies that tree into a fresh
sandbox; running the same code next to the tree keeps one implementation of both, and one HTTP call per
tool call. Sandboxes come from `open_runtime` of env.swe.runtime, as in the orchestrator's own process,
with the same start rate limit (env.swe.max_sandbox_starts_per_s, per service).

Every request but `GET /health` needs `Authorization: Bearer <RUN_DIR/secret>`, compared in constant time
(SHA-256 of both sides, `hmac.compare_digest`, the pattern of rl/inference/auth.py, not imported from
there: no role package here). A service that finds no secret refuses to start: it runs commands for
whoever holds the token. Read/write paths go through the runtime's `read_file` / `write_file`, which never
follow links.

Records: `RUN_DIR/sandboxes/service_<I>.json` (SandboxServiceRecord: URL, node) once it listens, removed
when it stops; `roles/sandbox_<I>.json` like every role; one line per closed sandbox in
`RUN_DIR/sandboxes/sandboxes_<I>.jsonl` (task, node, number of commands and tool calls, graded or not),
so what ran where can be checked after the run. Every one of them is written through rl.contract.safefs
(docs/run-directory-safety.md): a link or FIFO planted in their place is refused, never followed. It
exits when `RUN_DIR/DONE` appears (0) or on SIGTERM/SIGUSR1 (EXIT_PREEMPTED), closing its sandboxes.
"""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import errno
import hashlib
import hmac
import io
import json
import os
import signal
import socket
import stat
import tarfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from rl import runtime
from rl.contract import backends, paths, safefs
from rl.contract.records import SandboxServiceRecord
from rl.contract.secret import SecretError, read_secret
from rl.envs.swe import trees
from rl.envs.swe.sandbox import SandboxError
from rl.envs.swe.grader import grade, run_tests_install, run_tests_roots
from rl.envs.swe.tools import Tools

# Blocking sandbox work runs in threads: one per command in flight, so many episodes' commands overlap.
MAX_THREADS = 512


class Served:
    """One open sandbox: its runtime, its task, its tools, and counts for the per-sandbox record."""

    def __init__(self, sid: str, task, rt, config):
        self.id, self.task, self.rt, self.config = sid, task, rt, config
        self.commands = self.tool_calls = 0
        self.graded = False
        self.reward: float | None = None
        self.opened = time.time()
        run = rt.run

        def counted(*a, **kw):  # every command, whether from a tool, a direct run or a patch
            self.commands += 1
            return run(*a, **kw)
        rt.run = counted
        self.tools = Tools(rt, output_chars=config.output_chars, timeout_s=config.tool_timeout_s,
                           roots=run_tests_roots(task, config.runtime),
                           install=run_tests_install(task, config.runtime))


class Service:
    def __init__(self, env, run_dir: str, index: int, secret: str, node: str):
        if not isinstance(secret, str) or len(secret.strip()) < 32:  # never a service anyone may call
            raise ValueError("sandbox service: the run's secret is empty or short; refusing to serve")
        self.env, self.run_dir, self.index, self.node = env, run_dir, index, node
        self._digest = hashlib.sha256(secret.encode()).digest()
        self.open: dict[str, Served] = {}
        self._lock = threading.Lock()
        self.host = socket.gethostname()

    def log(self, msg: str) -> None:
        runtime.log(f"sandbox_{self.index}", msg)

    # -- auth -------------------------------------------------------------------------------------
    @web.middleware
    async def auth(self, request: web.Request, handler):
        if request.path == "/health" and request.method in ("GET", "HEAD"):
            return await handler(request)
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(
            hashlib.sha256(token.strip().encode()).digest(), self._digest)
        if not ok:
            return web.json_response({"error": "unauthorized: this service needs the run's bearer token",
                                      "kind": "Unauthorized"}, status=401)
        return await handler(request)

    @web.middleware
    async def errors(self, request: web.Request, handler):
        """Bad input comes back as 400 with the exception's kind, so the client raises the same kind."""
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except (ValueError, TypeError, OSError, KeyError) as e:
            kind = "OSError" if isinstance(e, OSError) else "ValueError"
            return web.json_response({"error": f"{type(e).__name__}: {e}", "kind": kind}, status=400)
        except SandboxError as e:
            return web.json_response({"error": str(e), "kind": "SandboxError"}, status=500)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.errors, self.auth], client_max_size=64 << 20)
        app.add_routes([web.get("/health", self.health), web.post("/sandboxes", self.create),
                        web.post("/sandboxes/{id}/run", self.run), web.post("/sandboxes/{id}/read", self.read),
                        web.post("/sandboxes/{id}/write", self.write), web.post("/sandboxes/{id}/tool", self.tool),
                        web.post("/sandboxes/{id}/grade", self.grade), web.get("/sandboxes/{id}/tree", self.tree),
                        web.delete("/sandboxes/{id}", self.close)])
        return app

    # -- handlers ---------------------------------------------------------------------------------
    async def health(self, request):
        return web.json_response({"ok": True, "open": len(self.open)})

    def _get(self, request) -> Served:
        s = self.open.get(request.match_info["id"])
        if s is None:
            raise web.HTTPNotFound(text=json.dumps({"error": f"no open sandbox {request.match_info['id']!r}",
                                                    "kind": "ValueError"}), content_type="application/json")
        return s

    @staticmethod
    async def _thread(fn, *a, **kw):
        return await asyncio.get_running_loop().run_in_executor(None, lambda: fn(*a, **kw))

    async def create(self, request):
        body = await request.json()
        iid = body.get("instance_id")
        task = self.env.by_id.get(iid)
        if task is None:
            raise web.HTTPNotFound(text=json.dumps({"error": f"instance_id={iid!r}: not among this run's "
                                                    f"{len(self.env.by_id)} tasks", "kind": "ValueError"}),
                                   content_type="application/json")
        from rl.envs.swe.tasks import open_sandbox
        cfg = self.env.config
        rt = await self._thread(open_sandbox, task, cfg.limits, cfg.runtime)
        sid = uuid.uuid4().hex[:16]
        with self._lock:
            self.open[sid] = Served(sid, task, rt, cfg)
            n = len(self.open)
        self.log(f"sandbox {sid} ({iid}) opened on {self.node}: {n} open")
        return web.json_response({"id": sid, "open": n, "node": self.node})

    async def run(self, request):
        s, body = self._get(request), await request.json()
        data = base64.b64decode(body["input_b64"]) if body.get("input_b64") else body.get("input")
        r = await self._thread(s.rt.run, list(body["argv"]), float(body["timeout_s"]), input=data,
                               env=body.get("env") or None)
        return web.json_response(dataclasses.asdict(r))

    async def read(self, request):
        s, body = self._get(request), await request.json()
        return web.json_response({"text": await self._thread(s.rt.read_file, str(body["path"]))})

    async def write(self, request):
        s, body = self._get(request), await request.json()
        await self._thread(s.rt.write_file, str(body["path"]), str(body["text"]))
        return web.json_response({})

    async def tool(self, request):
        s, body = self._get(request), await request.json()
        s.tool_calls += 1
        t = body.get("timeout_s")
        obs = await self._thread(s.tools.call, str(body["name"]), dict(body.get("args") or {}),
                                 timeout_s=float(t) if t is not None else None)
        return web.json_response({"observation": obs, "submitted": s.tools.submitted})

    async def grade(self, request):
        s, cfg = self._get(request), self.env.config
        g = await self._thread(grade, s.task, s.rt.tree, limits=cfg.grade_limits(), timeout_s=cfg.grade_timeout_s,
                               partial_credit=cfg.partial_credit, runtime=cfg.runtime)
        s.graded, s.reward = True, g.reward
        return web.json_response(dataclasses.asdict(g))

    async def tree(self, request):
        s = self._get(request)

        def pack() -> bytes:
            """The tree as a tar: directories, regular files and links (stored as links), walked
            iteratively; a FIFO, socket or device, or nesting past trees.MAX_DEPTH, is a TreeError (400,
            an OSError for the client) as it is for a local copy_out."""
            buf = io.BytesIO()
            root = str(s.rt.tree)
            with tarfile.open(fileobj=buf, mode="w") as tar:
                tar.add(root, arcname=".", recursive=False)
                for rel, entries in trees.walk(root, trees.MAX_DEPTH):
                    for name, st in entries:
                        r = os.path.join(rel, name) if rel else name
                        m = st.st_mode
                        if not (stat.S_ISDIR(m) or stat.S_ISREG(m) or stat.S_ISLNK(m)):
                            raise trees.TreeError(errno.EINVAL, f"{r}: {trees.kind(m)}, not a regular file")
                        tar.add(os.path.join(root, r), arcname="./" + r, recursive=False)
            return buf.getvalue()
        return web.Response(body=await self._thread(pack), content_type="application/x-tar")

    async def close(self, request):
        with self._lock:
            s = self.open.pop(request.match_info["id"], None)
        if s is not None:
            await self._thread(self._close, s)
        return web.json_response({"closed": s is not None})

    def _close(self, s: Served) -> None:
        s.rt.close()
        rec = {"id": s.id, "instance_id": s.task.instance_id, "service": self.index, "node": self.node,
               "host": self.host, "pid": os.getpid(), "runtime": self.env.config.runtime["name"],
               "commands": s.commands, "tool_calls": s.tool_calls, "graded": s.graded, "reward": s.reward,
               "opened": s.opened, "closed": time.time()}
        log_closed(self.run_dir, self.index, rec)
        self.log(f"sandbox {s.id} ({s.task.instance_id}) closed: {s.commands} commands, "
                 f"{s.tool_calls} tool calls, graded={s.graded}")

    def close_all(self) -> None:
        with self._lock:
            left, self.open = list(self.open.values()), {}
        for s in left:
            self._close(s)


def log_closed(run_dir, index: int, rec: dict) -> None:
    """Append `rec` (a closed sandbox) to `sandboxes/sandboxes_<index>.jsonl` through rl.contract.safefs,
    like every writer of the run directory: a link or FIFO planted at the log or at `sandboxes/` is
    refused in one line (UnsafePath), never written through; one write(2), O_APPEND."""
    safefs.append_bytes(paths.sandbox_log(run_dir, index), (json.dumps(rec) + "\n").encode())


async def serve(run_dir: str, index: int) -> int:
    cfg = runtime.load_config(run_dir)
    plan = runtime.load_plan(run_dir)
    if plan.sandboxes is None or not 0 <= index < len(plan.sandboxes.services):
        raise SystemExit(f"{paths.plan_file(run_dir)}: no sandbox service {index} in the plan "
                         "(cluster.sandbox_nodes)")
    try:  # it runs commands for whoever holds the token: never without one (missing, empty or short)
        secret = read_secret(run_dir)
    except SecretError as e:
        raise SystemExit(f"sandbox service {index}: {e}") from None
    from rl.envs import _swe_env
    env = _swe_env(cfg.env, cfg, remote=False)  # the same rows as the orchestrator, sandboxes here
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    svc = Service(env, run_dir, index, secret, node)
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="sandbox"))
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    remote = backends.row(cfg.cluster.backend).binds_all_interfaces  # orchestrators on other nodes call it
    runner = web.AppRunner(svc.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "0.0.0.0" if remote else "127.0.0.1", 0)  # port: any free one, recorded
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    url = f"http://{socket.gethostname() if remote else '127.0.0.1'}:{port}"
    safefs.makedirs(paths.sandboxes_dir(run_dir))
    SandboxServiceRecord(url=url, host=socket.gethostname(), node=node, pid=os.getpid(), index=index,
                         runtime=env.config.runtime["name"], time=time.time(),
                         slurm_job_id=os.environ.get("SLURM_JOB_ID"),
                         slurm_restart_count=int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)).write(run_dir)
    runtime.record_role(run_dir, f"sandbox_{index}", url=url, node=node)
    svc.log(f"serving {len(env.tasks)} tasks on {url} (node {node}, runtime {env.config.runtime['name']})")
    try:
        while not stop.is_set() and not runtime.is_done(run_dir):
            try:
                async with asyncio.timeout(0.5):  # not wait_for: it can swallow a cancellation on 3.11
                    await stop.wait()
            except TimeoutError:
                pass
    finally:
        safefs.remove(paths.sandbox_service_record(run_dir, index))  # the record, never a link's target
        await runner.cleanup()
        svc.close_all()
        svc.log("stopped")
    return runtime.EXIT_PREEMPTED if stop.is_set() else 0


def main(argv=None) -> int:
    ns = runtime.parse_role_args("sandbox", argv, extra=[(("--index",), {"type": int, "required": True})])
    return asyncio.run(serve(str(ns.run_dir), ns.index))


if __name__ == "__main__":
    raise SystemExit(main())
