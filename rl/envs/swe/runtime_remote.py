"""The client side of the sandbox service: the runtime interface over HTTP, for runs with sandbox nodes.

When the plan has sandbox nodes (`cluster.sandbox_nodes` > 0: het group 2, one rl.envs.swe.service per
node), the orchestrator's SWE environment opens every episode's sandbox through a `ServicePool` instead
of a local runtime. The pool knows the services from the plan (how many) and their records
(`RUN_DIR/sandboxes/service_<i>.json`: where each listens; it waits for them up to `wait_s`, and reads a
record again when a connection fails, since a restarted service listens elsewhere), and places each new
sandbox on the service with the fewest sandboxes this pool has open there (ties: the lowest index). There
is one orchestrator per run, so its own counts are the services' loads.

`RemoteRuntime` is the runtime interface of rl/envs/swe/runtimes.py (`run`, `read_file`, `write_file`,
`copy_out`, `close`) plus `tools()` and `grade()`: the episode's tool calls and its grading run on the
service, next to the tree, with the same code as a local episode (rl/envs/swe/service.py says why). It
has no `.tree` on this host. Errors keep their kinds: a bad path is a ValueError or OSError here as it is
locally, a failed sandbox a SandboxError; an unreachable or refusing service is a SandboxError of one
line naming the service and its URL.

Synchronous (httpx.Client, thread-safe): the orchestrator calls the environment from worker threads.
"""
from __future__ import annotations

import base64
import io
import tarfile
import threading
import time
from pathlib import Path

import httpx

from rl.contract import paths
from rl.contract.plan import Plan
from rl.contract.records import RecordError, SandboxServiceRecord
from rl.contract.secret import read_secret
from rl.envs.swe import trees
from rl.envs.swe.grading import Grade
from rl.envs.swe.sandbox import Result, SandboxError
from rl.runtime import log

_MARGIN_S = 120.0  # HTTP wait beyond a command's own time limit (queueing, start rate limit, transfer)


class ServicePool:
    """The run's sandbox services; `open(instance_id)` starts a sandbox on the least loaded one."""

    def __init__(self, run_dir: str, services: int, secret: str, wait_s: float = 600.0):
        if services < 1:
            raise ValueError(f"sandbox services: {services}; the plan has no sandbox nodes")
        self.run_dir, self.n, self.wait_s = run_dir, services, wait_s
        self.http = httpx.Client(headers={"Authorization": f"Bearer {secret}"},
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
                                 timeout=httpx.Timeout(60.0, read=wait_s + _MARGIN_S))
        self.counts = [0] * services
        self._urls: dict[int, str] = {}
        self._lock = threading.Lock()
        self._refused: set[str] = set()   # service records refused so far, each said once

    @classmethod
    def from_run_dir(cls, run_dir: str, wait_s: float = 600.0) -> "ServicePool":
        plan = Plan.read(run_dir)
        if plan.sandboxes is None:
            raise ValueError(f"{paths.plan_file(run_dir)}: the plan has no sandbox nodes, but "
                             "cluster.sandbox_nodes > 0 (re-plan the run)")
        # missing, empty or short: a one-line error (the services refuse to serve without it anyway)
        return cls(run_dir, len(plan.sandboxes.services), read_secret(run_dir), wait_s)

    def url(self, i: int, fresh: bool = False) -> str:
        """Service i's URL from its record, waiting up to wait_s for it to appear.

        The record decides where the run's secret is sent and whose grade an episode's reward is, so it
        is taken only if it passes the trust rule (rl.contract.records through safefs: owned by this
        user, writable by nobody else, a regular file; a FIFO refused without blocking). A refused one
        is absent (the service is not up), said once, and named in the error that ends the wait."""
        if not fresh and i in self._urls:
            return self._urls[i]
        deadline = time.monotonic() + self.wait_s
        while True:
            refused = None
            try:
                rec = SandboxServiceRecord.read(self.run_dir, i)
            except (OSError, RecordError) as e:
                rec, refused = None, self._refuse(e)
            if rec is not None:
                self._urls[i] = rec.url
                return rec.url
            if time.monotonic() > deadline:
                what = (f"usable record ({refused})" if refused else
                        f"record at {paths.sandbox_service_record(self.run_dir, i)}")
                raise SandboxError(f"sandbox service {i}: no {what} after {self.wait_s:.0f} s "
                                   f"(see {paths.log_file(self.run_dir, f'sandbox_{i}')})")
            time.sleep(0.5)

    def _refuse(self, error: Exception) -> str:
        """One line naming the refused record and why, printed the first time it is seen."""
        line = " ".join(str(error).split())
        with self._lock:
            first = line not in self._refused
            self._refused.add(line)
        if first:
            log("orchestrator", f"sandbox pool: refused: {line}; treated as absent (no secret sent, no grade "
                                f"taken)")
        return line

    def request(self, i: int, method: str, path: str, timeout_s: float | None = None, **kw) -> httpx.Response:
        """One call to service i; a failed connection re-reads its record once (it may have restarted)."""
        for attempt in (0, 1):
            url = self.url(i, fresh=attempt > 0)
            try:
                # never unbounded: a call without its own limit (create, files, close) gets the
                # episode's (env.swe.wall_s, this pool's wait_s): a hung service ends the episode
                r = self.http.request(method, url + path, timeout=httpx.Timeout(
                    60.0, read=(self.wait_s if timeout_s is None else timeout_s) + _MARGIN_S), **kw)
                break
            except httpx.ConnectError as e:
                if attempt:
                    raise SandboxError(f"sandbox service {i} at {url}: cannot connect ({e})") from None
            except httpx.TimeoutException as e:
                raise SandboxError(f"sandbox service {i} at {url}{path}: no answer in time "
                                   f"({type(e).__name__})") from None
        if r.status_code == 200:
            return r
        try:
            body = r.json()
        except ValueError:
            body = {"error": r.text[:500], "kind": "SandboxError"}
        msg, kind = str(body.get("error")), body.get("kind")
        if kind == "ValueError":
            raise ValueError(msg)
        if kind == "OSError":
            raise OSError(msg)
        if r.status_code == 401:
            raise SandboxError(f"sandbox service {i} at {url}: refused the run's secret (another run's "
                               "service?)")
        raise SandboxError(f"sandbox service {i} at {url}{path}: HTTP {r.status_code}: {msg}")

    def open(self, instance_id: str) -> "RemoteRuntime":
        with self._lock:
            i = min(range(self.n), key=lambda k: (self.counts[k], k))
            self.counts[i] += 1
        try:
            r = self.request(i, "POST", "/sandboxes", timeout_s=self.wait_s, json={"instance_id": instance_id})
        except BaseException:
            with self._lock:
                self.counts[i] -= 1
            raise
        body = r.json()
        return RemoteRuntime(self, i, body["id"], body.get("node", ""))

    def _released(self, i: int) -> None:
        with self._lock:
            self.counts[i] -= 1

    def describe(self) -> str:
        return f"{self.n} sandbox service(s) on sandbox nodes"

    def close(self) -> None:
        self.http.close()


class RemoteRuntime:
    """One sandbox on a sandbox service, with the runtime interface (no local `.tree`)."""

    name = "remote"
    tree = None

    def __init__(self, pool: ServicePool, service: int, sid: str, node: str):
        self.pool, self.service, self.id, self.node = pool, service, sid, node
        self._closed = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method: str, what: str, timeout_s: float | None = None, **kw) -> httpx.Response:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} on service {self.service} is closed")
        return self.pool.request(self.service, method, f"/sandboxes/{self.id}{what}", timeout_s, **kw)

    def run(self, argv: list[str], timeout_s: float, input: str | bytes | None = None,
            env: dict[str, str] | None = None) -> Result:
        if not argv:
            raise ValueError("empty argv")
        body = {"argv": list(map(str, argv)), "timeout_s": float(timeout_s), "env": env or {}}
        if isinstance(input, bytes):
            body["input_b64"] = base64.b64encode(input).decode()
        else:
            body["input"] = input
        return Result(**self._call("POST", "/run", timeout_s, json=body).json())

    def read_file(self, rel: str) -> str | None:
        return self._call("POST", "/read", 0, json={"path": rel}).json()["text"]

    def write_file(self, rel: str, text: str) -> None:
        self._call("POST", "/write", 0, json={"path": rel, "text": text})

    def copy_out(self, dest: Path) -> Path:
        """The tree, copied to dest; links are copied as links (tarfile's "tar" filter refuses members
        that would land outside dest, through a link or otherwise)."""
        data = self._call("GET", "/tree", 0).content
        Path(dest).mkdir(parents=True, exist_ok=False)
        try:
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                tar.extractall(dest, filter="tar")
        except BaseException:  # no partial copy
            trees.remove_tree(dest)
            raise
        return Path(dest)

    def tools(self) -> "RemoteTools":
        return RemoteTools(self)

    def grade(self) -> Grade:
        """The hidden-test grade of this sandbox's tree, graded on its service (grader.grade there)."""
        return Grade(**self._call("POST", "/grade", None, json={}).json())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.pool.request(self.service, "DELETE", f"/sandboxes/{self.id}", 0)
        finally:
            self.pool._released(self.service)


class RemoteTools:
    """The episode's tools (rl/envs/swe/tools.py's `call` and `submitted`), run on the service."""

    def __init__(self, rt: RemoteRuntime):
        self.rt = rt
        self.submitted = False

    def call(self, name: str, args: dict, timeout_s: float | None = None) -> str:
        body = {"name": name, "args": args if isinstance(args, dict) else {}, "timeout_s": timeout_s}
        # a tool may run a dry run and then the patch: twice its time limit, plus the margin
        wait = 2 * (timeout_s if timeout_s is not None else 600.0)
        r = self.rt._call("POST", "/tool", wait, json=body).json()
        self.submitted = bool(r["submitted"])
        return r["observation"]
