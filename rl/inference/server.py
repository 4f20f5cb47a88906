"""The inference role: `python -m rl.inference --run-dir D --index I` executes replica I of the plan.

The plan (`D/plan.json`, rl.contract.plan) says everything about a replica: the nodes it spans, the
node-local model directory, the complete vLLM command of each node (`Replica.vllm_argv(node_rank)`: the
head serves the OpenAI API, the other nodes of a multi-node replica run vLLM's headless data-parallel
ranks) and the environment of the vLLM processes. This module re-derives none of it. The batch script
starts this role once per node of the replica (one Slurm task per node, so the node rank is the step's
`SLURM_PROCID`; 0 outside Slurm), and on each node it:

1. waits for the trainer's first publication (`assets/step_000000` and a complete `weights/step_v`);
   the head picks the newest version, and in a multi-node replica writes it to a start record that the
   headless nodes wait for, so every data-parallel rank of one replica serves the same policy version;
2. materialises an HF model directory at the replica's planned `model_dir` (rl.inference.model_dir;
   node-local disk: vLLM loads far faster from there than from the shared filesystem, and on the CPU it
   cannot take the FP8 shards, which are dequantized here); on Slurm that path is inside this node's directory of this incarnation
   (`${HETRL_NODE_DIR}`, rl.contract.paths.node_dir), never one a previous incarnation may still write;
3. runs exactly `expand(replica.vllm_argv(node_rank), env)` as a child process (not imported: vLLM's
   engine spawns its own processes, owns signals and logs a lot; a child we can terminate and whose output
   goes to `paths.vllm_log_file` is easier to supervise), with `env` = this process's environment +
   `replica.env` + only what can be decided at run time, nowhere else:
   - the repository this role runs from, first on PYTHONPATH (vLLM's workers import the worker
     extension rl.inference.worker_ext from it);
   - the policy version the engine starts with (`HETRL_POLICY_VERSION`, read by the worker extension);
   - the run's secret as `VLLM_API_KEY`, which vLLM's API server honours like `--api-key` (its
     authentication middleware takes `args.api_key or [envs.VLLM_API_KEY]`) and which the plan's
     `--middleware rl.inference.auth.RunSecret` requires on every other path (/health excepted), without
     putting the secret on a command line every user of the node can read; when the run has no secret,
     unset, and `HETRL_UNAUTHENTICATED=1` tells the middleware that this is on purpose.
4. the head waits for `/health`, labels the engine with the policy version it loaded
   (`/update_weight_version`) and writes the replica's one server record (rl.contract.records.ServerRecord)
   with a URL the other het group can reach: this node's hostname when vLLM binds every interface
   (0.0.0.0 on Slurm), the bind address otherwise. Headless nodes have no API server: they neither poll
   `/health` nor write a server record, and log to their own `inference_<I>.node<k>.vllm.log`.

A server that fails is not the end of the run (issue 43): the head withdraws its server record first
(`withdraw_record`; the router takes a missing record for a server that is down and the orchestrator stops
loading weights into it), stops its child and exits non-zero, and the batch script restarts the role in
place; the restarted role loads the newest published version and writes a new record (a new pid) only
once it serves it. The replica may also be an extra row `launch scale` added (rl.contract.elastic, same
code path: the row names only which plan replica it copies, its index, port and job, and its commands are
rebuilt from plan.json; a row that is not this user's own, or is edited or of the earlier format, is
refused in one line and nothing runs); when its drain marker appears the head withdraws its record, lets
the requests it holds finish (`drain`) and exits 0.

Every node then stays up until `D/DONE` appears or it is signalled, and stops its child (terminate, wait,
kill) through rl.inference.guard, a small process that outlives a role killed by SIGKILL and takes the
whole server (API server, engine core, workers) down with it. Later
policy versions are loaded in flight by the orchestrator (pause / collective_rpc / resume), never by a
restart. Model directories of earlier runs left on the node are removed only if this code created them
(they hold owner records) and every process that owned them on this host is gone.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

import rl
from rl import exchange, runtime
from rl.contract import backends, elastic, paths, procs, safefs
from rl.contract.secret import secret_or_none
from rl.contract.plan import PlanFormatError, Replica, expand
from rl.contract.records import RecordError, ReplicaStart, ServerRecord
from rl.contract.vllm_log import describe as engine_death
from rl.inference import guard
from rl.inference.auth import SECRET_ENV, UNAUTHENTICATED_ENV, bearer
from rl.inference.model_dir import claim, clean_stale, materialize
from rl.inference.worker_ext import VERIFIED_ENV, VERSION_ENV

ROLE = "inference"
EXIT_REFUSED = 2   # the replica's row was refused (one line on stderr): nothing was started
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def log(msg: str) -> None:
    runtime.log(ROLE, msg)


def fp8_supported() -> bool:
    """Can vLLM compute with block FP8 weights here? CUDA with compute capability >= 8.9 (Ada/Hopper)."""
    import torch
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def resolve_fp8_load(mode: str, supported: bool) -> bool:
    """fp8_load (auto|dequantize|fp8) -> load the shards as FP8?"""
    if mode == "dequantize":
        return False
    if mode == "fp8":
        if not supported:
            raise RuntimeError("inference.fp8_load=fp8 but this machine has no FP8-capable GPU; "
                               "use auto or dequantize")
        return True
    if mode == "auto":
        return supported
    raise ValueError(f"inference.fp8_load must be auto|dequantize|fp8, got {mode!r}")


def checkpoint_dtype(config: dict) -> str | None:
    """The dtype an HF config.json declares: `dtype` (transformers >= 4.56 writes it) or the older
    `torch_dtype`; of a multimodal checkpoint, its text tower's."""
    for c in (config, config.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            if isinstance(c.get(key), str):
                return c[key]
    return None


def torch_dtype(name: str, assets_config: dict):
    import torch
    if name == "auto":
        name = checkpoint_dtype(assets_config) or "bfloat16"  # an HF config.json, not our config
    return getattr(torch, name)


# -- where this process runs ---------------------------------------------------------------------------
def node_rank_from_env(env) -> int:
    """This node's rank inside its replica: the Slurm task rank of the replica's step (one task per node
    of the replica, started by the batch script), 0 outside Slurm (a local run's replicas have one node)."""
    raw = env.get("SLURM_PROCID", "0")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"SLURM_PROCID={raw!r}: not a task rank") from None


def role_name(replica: Replica, node_rank: int) -> str:
    """The head is the replica's role (`inference_<I>`, as in plan.json); node k > 0 is `inference_<I>.node<k>`."""
    return replica.name if replica.is_head(node_rank) else f"{replica.name}.node{node_rank}"


def advertised_url(host: str, port: int, hostname: str | None = None) -> str:
    """The URL other processes (another het group included) reach the head at: a server bound to every
    interface is reached through this node's hostname, one bound to an address through that address."""
    if host in WILDCARD_HOSTS:
        host = hostname or socket.gethostname()
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def vllm_env(replica: Replica, *, version: int, secret: str | None, base) -> dict:
    """The vLLM processes' environment: `base` (this process's), the plan's `replica.env`, and the three
    things only known at run time (see the module docstring)."""
    env = dict(base)
    # a Slurm plan's node-local paths name ${HETRL_NODE_DIR} (set in `base` by serve)
    env.update(zip(replica.env, expand(list(replica.env.values()), env)))
    repo = str(Path(rl.__file__).resolve().parent.parent)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != repo]
    env["PYTHONPATH"] = os.pathsep.join([repo, *rest])
    env[VERSION_ENV] = str(version)
    model_dir = expand([replica.model_dir], env)[0]
    env[VERIFIED_ENV] = str(Path(model_dir).parent / "verified")  # node-local, shared by its engines
    if secret:
        env[SECRET_ENV] = secret
        env.pop(UNAUTHENTICATED_ENV, None)
    else:  # the clients send no key: the server must not ask for one, and the auth middleware is told so
        env.pop(SECRET_ENV, None)
        env[UNAUTHENTICATED_ENV] = "1"
    return env


# -- what to load ----------------------------------------------------------------------------------------
def wait_first_publication(run_dir: Path, stop: runtime.StopFlag) -> tuple[Path, Path, int] | None:
    """Block until assets/step_000000 and a complete weights step exist; (assets, weights, version)."""
    with runtime.waiting_for(f"{exchange.step_dir(run_dir, paths.ASSETS, 0)} and a complete weights/step_* "
                             f"from the trainer"):
        return _wait_first_publication(run_dir, stop)


def _wait_first_publication(run_dir: Path, stop: runtime.StopFlag) -> tuple[Path, Path, int] | None:
    announced = False
    # Nothing older than this incarnation's checkpoint: rl.prepare removed its published version, which the
    # trainer publishes again from the checkpoint; an older step left by retention may be damaged.
    floor = runtime.resume_state(run_dir).checkpoint_step or 0
    while not stop.is_set() and not runtime.is_done(run_dir):
        assets = exchange.step_dir(run_dir, paths.ASSETS, 0)
        version = exchange.latest_complete(run_dir, paths.WEIGHTS) if assets.is_dir() else None
        if version is not None and version >= floor:
            return assets, exchange.step_dir(run_dir, paths.WEIGHTS, version), version
        if not announced:
            log(f"waiting for {assets} and weights/step_* from the trainer")
            announced = True
        time.sleep(0.5)
    return None


start_record = paths.replica_start_record


def _incarnation(run_dir: Path) -> tuple[int, str | None]:
    """What tells this incarnation's start record from an earlier one's: prepare's restart count (it
    runs before the roles of every incarnation) and the Slurm job."""
    return runtime.resume_state(run_dir).restart, os.environ.get("SLURM_JOB_ID")


def write_start(run_dir: Path, index: int, version: int, fp8: bool) -> None:
    restart, job = _incarnation(run_dir)
    ReplicaStart(version=version, fp8=fp8, restart=restart, job=job).write(run_dir, index)


def wait_start(run_dir: Path, index: int, stop: runtime.StopFlag) -> tuple[int, bool] | None:
    """(version, fp8) from this incarnation's start record of replica `index`; None if stopped first."""
    with runtime.waiting_for(f"{start_record(run_dir, index)} from the replica's head"):
        return _wait_start(run_dir, index, stop)


def _wait_start(run_dir: Path, index: int, stop: runtime.StopFlag) -> tuple[int, bool] | None:
    want = _incarnation(run_dir)
    path, announced, said = start_record(run_dir, index), False, set()
    while not stop.is_set() and not runtime.is_done(run_dir):
        try:
            rec = ReplicaStart.read(run_dir, index)
        except FileNotFoundError:
            rec = None
        except (OSError, RecordError) as e:   # another layout, or refused by the trust rule: said once
            rec, line = None, " ".join(str(e).split())
            if line not in said:
                said.add(line)
                log(f"refused: {line}; still waiting for this incarnation's record")
        if rec is not None and (rec.restart, rec.job) == want:
            return rec.version, rec.fp8
        if not announced:
            log(f"waiting for {path} (the version the replica's head loads)")
            announced = True
        time.sleep(0.5)
    return None


# -- the vLLM child ------------------------------------------------------------------------------------
def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log_path: Path,
                 stop: runtime.StopFlag | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited with status {proc.returncode} before it was healthy; "
                               f"see {log_path}")
        if stop is not None and stop.is_set():
            raise InterruptedError(f"stopped ({stop.reason}) while vLLM was starting")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"vLLM server not healthy at {url} after {timeout:.0f} s "
                       f"(inference.startup_timeout_s); see {log_path}")


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1" if host in WILDCARD_HOSTS else host, port)) == 0


# -- the role ------------------------------------------------------------------------------------------
def serve(run_dir: Path, index: int = 0, node_rank: int | None = None) -> int:
    run_dir = Path(run_dir).resolve()
    cfg = runtime.load_config(run_dir)
    try:   # a plan row, or one `launch scale` added: its commands are the plan's (rl.contract.elastic)
        plan = runtime.load_plan(run_dir)
        replica = elastic.replica_row(plan, run_dir, index)
    except PlanFormatError as e:   # a planted, edited or earlier-format row: nothing is run
        print(f"rl.{ROLE}: refused: {e}", file=sys.stderr, flush=True)
        return EXIT_REFUSED
    rank = node_rank_from_env(os.environ) if node_rank is None else node_rank
    planned = replica.vllm_argv(rank)  # refuses a node rank outside the replica
    head = replica.is_head(rank)
    name = role_name(replica, rank)
    stop = runtime.StopFlag()

    if head:
        first = wait_first_publication(run_dir, stop)
        if first is None:
            log("stopped before the first weights were published")
            return runtime.EXIT_PREEMPTED if stop.is_set() else 0
        assets, weights, version = first
        mode = str(cfg.inference.fp8_load)
        fp8 = resolve_fp8_load(mode, fp8_supported() if mode != "dequantize" else False)
        if replica.nodes > 1:
            write_start(run_dir, index, version, fp8)
    else:
        started = wait_start(run_dir, index, stop)
        if started is None:
            log(f"{name}: stopped before the head chose a version")
            return runtime.EXIT_PREEMPTED if stop.is_set() else 0
        version, fp8 = started
        assets = exchange.step_dir(run_dir, paths.ASSETS, 0)
        weights = exchange.step_dir(run_dir, paths.WEIGHTS, version)

    if head and withdraw_dead_record(run_dir, index):
        log(f"{name}: removed the server record of a predecessor on this host that is gone")
    local = Path(plan.node_local_dir)
    gone = clean_stale(local.parent, keep=local.name)
    if gone:
        log(f"removed stale node-local dirs of earlier runs: {', '.join(gone)}")
    # On Slurm: this node's directory of this incarnation (the batch script made it and removed the
    # node's earlier ones); the plan's node-local paths name it as ${HETRL_NODE_DIR}.
    node_dir = (Path(paths.node_dir_from_env(plan.node_local_dir, os.environ))
                if backends.row(plan.backend).node_dirs_per_incarnation else local)
    base_env = {**os.environ, paths.NODE_DIR_VAR: str(node_dir)}
    claim(node_dir, run_dir, name)
    dtype = torch_dtype(str(cfg.inference.dtype), json.loads(exchange.read_in_step(assets, "config.json")))
    t0 = time.monotonic()
    planned_dir = Path(expand([replica.model_dir], base_env)[0])
    model_dir = materialize(assets, weights, planned_dir, dtype=dtype, fp8=fp8)
    log(f"{name}: version {version} ({'fp8' if fp8 else str(dtype)}) in {model_dir} "
        f"({time.monotonic() - t0:.1f} s)")

    secret = secret_or_none(run_dir)  # never serve on an empty or short secret
    env = vllm_env(replica, version=version, secret=secret, base=base_env)
    argv = expand(planned, env)
    log_path = paths.vllm_log_file(run_dir, index, rank)
    url = advertised_url(replica.host, replica.port)
    if head and port_in_use(replica.host, replica.port):
        raise RuntimeError(f"inference.port: {replica.host}:{replica.port} is already in use (another server, "
                           f"or a leftover of an earlier run?); pick another inference.port or stop that process")
    log(f"{name}: starting vLLM {'on ' + url if head else '(headless data-parallel ranks)'} (log: {log_path})")
    # the log is appended through rl.contract.safefs: a link planted at it (or at logs/) is refused, never
    # written through by vLLM
    logf = safefs.open_write(log_path, append=True)
    try:   # through rl.inference.guard: a dead role leaves no server behind
        proc = subprocess.Popen([sys.executable, "-m", "rl.inference.guard", "--", *argv],
                                env={**env, guard.PARENT_ENV: str(os.getpid())}, stdout=logf,
                                stderr=subprocess.STDOUT, cwd=str(node_dir), start_new_session=True,
                                preexec_fn=guard.die_with_parent)
    finally:
        os.close(logf)
    vllm_pid = guard.server_pid(proc.pid) or proc.pid
    try:
        if head:
            t0 = time.monotonic()
            wait_healthy(url, proc, float(cfg.inference.startup_timeout_s), log_path, stop)
            httpx.post(f"{url}/update_weight_version", json={"new_version": str(version)},
                       headers=bearer(secret) if secret else {},
                       timeout=30.0).raise_for_status()
            log(f"vLLM healthy after {time.monotonic() - t0:.0f} s, policy version {version}")
            ServerRecord(url=url, version=version, host=socket.gethostname(), pid=vllm_pid, index=index,
                         fp8=fp8, log=str(log_path), nodes=replica.nodes).write(run_dir)
        runtime.record_role(run_dir, name, url=url if head else None, vllm_pid=vllm_pid, node_rank=rank)
        next_health, refused = time.monotonic() + HEALTH_EVERY_S, [0]
        while not stop.is_set() and not runtime.is_done(run_dir):
            if proc.poll() is not None:
                if death := engine_death(log_path):   # vLLM may shut its API server down after it
                    raise RuntimeError(f"vLLM ({name}): engine core died: {death}; "
                                       f"the server exited with status {proc.returncode}")
                raise RuntimeError(f"vLLM ({name}) exited with status {proc.returncode}; see {log_path}")
            if head and time.monotonic() >= next_health:
                check_engine_alive(url, name, log_path, refused)
                next_health = time.monotonic() + HEALTH_EVERY_S
            if elastic.draining(run_dir, index):
                drain(run_dir, index, vllm_pid, url, secret, float(cfg.orchestrator.request_timeout_s))
                break
            time.sleep(0.5)
        else:
            log(f"{name}: " + ("DONE" if not stop.is_set() else f"stopping ({stop.reason})"))
    except InterruptedError as e:
        log(str(e))
    except BaseException:
        if head:   # first, so the router routes around this server before the slow stop below
            withdraw_record(run_dir, index, vllm_pid)
        raise
    finally:
        rc = guard.stop_child(proc, grace=3 * guard.GRACE_S)   # the guard escalates within 2 x GRACE_S
        log(f"{name}: vLLM stopped (status {rc})")
    return runtime.EXIT_PREEMPTED if stop.is_set() else 0


HEALTH_EVERY_S = 5.0


def drain(run_dir: Path, index: int, pid: int, url: str, secret: str | None, timeout: float) -> None:
    """`launch scale --inference -N` asked this server to leave: withdraw its record (the router sends it
    nothing new, the orchestrator loads no more weights into it), then wait until the requests it holds
    are answered (vLLM's running + waiting gauges read 0 twice, a router poll apart), at most `timeout`
    (orchestrator.request_timeout_s, what a request may take anyway)."""
    from rl.contract.routing import parse_metrics
    withdraw_record(run_dir, index, pid, why="draining")
    deadline, idle = time.monotonic() + timeout, 0
    time.sleep(1.0)   # a request the router dispatched just before it saw the record go
    while time.monotonic() < deadline and idle < 2:
        try:
            r = httpx.get(f"{url}/metrics", headers=bearer(secret) if secret else {}, timeout=10.0)
            m = parse_metrics(r.text) if r.status_code == 200 else {}
            busy = m.get("running", 1.0) + m.get("waiting", 0.0)
        except httpx.HTTPError:
            busy = 1.0
        idle = idle + 1 if busy == 0 else 0
        time.sleep(0.5)
    log(f"inference_{index}: drained" + ("" if idle >= 2 else f" (still busy after {timeout:.0f} s)"))


def withdraw_dead_record(run_dir: Path, index: int) -> bool:
    """A restarted role's first act: a record left by a predecessor killed before it could withdraw it
    (SIGKILL, the OOM killer) names a dead server on this host; without this the router would take it
    for a server that is merely slow to answer its polls."""
    try:
        rec = ServerRecord.read(run_dir, index)
    except (OSError, RecordError):
        return False
    if rec is None or rec.host != socket.gethostname() or procs.alive(rec.pid):
        return False
    return withdraw_record(run_dir, index, rec.pid)


def withdraw_record(run_dir: Path, index: int, pid: int, why: str = "the server failed") -> bool:
    """Remove replica `index`'s server record if it still names this role's server (`pid`): the server
    failed, and the router and the orchestrator take a missing record for a server that is down (the
    batch script restarts the role in place, and the restarted role writes a new one). A record another
    process wrote since is left alone."""
    try:
        rec = ServerRecord.read(run_dir, index)
    except (OSError, RecordError):
        return False
    if rec is None or rec.pid != pid:
        return False
    paths.server_record(run_dir, index).unlink(missing_ok=True)
    log(f"inference_{index}: server record withdrawn ({why})")
    return True


REFUSED_LIMIT = 3   # consecutive refused /health looks (HEALTH_EVERY_S apart) that mean a dead server


def check_engine_alive(url: str, name: str, log_path: Path, refused: list[int] | None = None) -> None:
    """Raise, naming the cause from the log, when the server's engine core is dead.

    A dead engine core does not end vLLM's API server: it answers /health with 503 and every request
    with HTTP 500 until it is stopped, which leaves a server that looks alive to the process table.
    A 503 counts at once. So does a port that refuses connections REFUSED_LIMIT looks in a row (counted
    in `refused`): an API server whose engine core died during a weight load was seen to close its port
    and hang in its shutdown (a fault trial: alive, deaf, for 5 minutes, until the orchestrator's stall
    watchdog ended the job). A slow /health (a loaded host) is left to the next look."""
    try:
        status = httpx.get(f"{url}/health", timeout=10.0).status_code
    except httpx.ConnectError:
        if refused is not None:
            refused[0] += 1
            if refused[0] >= REFUSED_LIMIT:
                cause = engine_death(log_path) or f"its port refused /health {refused[0]} times in a row"
                raise RuntimeError(f"vLLM ({name}): server dead: {cause}; see {log_path}") from None
        return
    except httpx.HTTPError:
        return
    if refused is not None:
        refused[0] = 0
    if status == 503:
        cause = engine_death(log_path) or f"/health answered 503; see {log_path}"
        raise RuntimeError(f"vLLM ({name}): engine core died: {cause}")


def main(argv=None) -> int:
    ns = runtime.parse_role_args(ROLE, argv, extra=[
        (("--index",), {"type": int, "default": 0, "help": "replica index in plan.json"}),
        (("--node-rank",), {"type": int, "default": None,
                            "help": "node rank inside the replica (default: SLURM_PROCID, 0 outside Slurm)"})])
    return serve(ns.run_dir, ns.index, ns.node_rank)
