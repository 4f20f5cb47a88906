"""The router as a role: `python -m rl.inference.router --run-dir D` (the HTTP side: rl.inference.proxy).

Finds the servers of the run (`discover`: planned replicas and the extra rows of `launch scale`, each
through its record), waits for them, serves the Router on the plan's host and port, writes
`D/inference/router.json` and stops when `D/DONE` appears or it is signalled. Kept apart from the HTTP
side so that rl.inference.proxy holds only what a request touches.

A server record names the address the run's secret is sent to and whose completions are trained on, so
it is obeyed only if this run's user wrote it (docs/run-directory-safety.md); plan.json is read once, at
the start, and `--run-dir` is checked as every role's is (rl.runtime.parse_role_args).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time
from collections import Counter
from pathlib import Path

from rl.contract.elastic import given_up
from rl.inference.discovery import Refusals, discover
from rl.inference.proxy import Router
from rl.contract.routing import RouterConfig


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m rl.inference.router", description="KV-aware router in front of the vLLM servers of a run")
    p.add_argument("--run-dir", type=Path, help="run directory (servers from D/inference/server_*.json)")
    p.add_argument("--backend", action="append", default=[],
                   help="URL[@pool] of a server (repeatable; instead of --run-dir)")
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    for f in RouterConfig.__dataclass_fields__.values():
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=None)
    ns = p.parse_args(argv)
    if not ns.run_dir and not ns.backend:
        p.error("give --run-dir or --backend")
    if ns.run_dir:
        # the entry point's part of the trust boundary (docs/run-directory-safety.md), as every role's
        # rl.runtime.parse_role_args does: the run directory by its real path, what this process creates
        # writable by its user alone, and a run directory someone else owns or can write refused in one line
        from rl.contract import paths, safefs
        ns.run_dir = safefs.resolve_run_dir(ns.run_dir)
        safefs.private_umask()
        try:
            safefs.check_run_dir_private(ns.run_dir, paths.PRIVATE_DIRS)
        except safefs.UnsafePath as e:
            p.error(str(e))
    return ns


async def _serve(ns) -> int:
    from rl import runtime
    from omegaconf import OmegaConf
    from rl.contract import paths, safefs
    stop = runtime.StopFlag()
    log = lambda msg: runtime.log("router", msg)  # noqa: E731
    run_dir = ns.run_dir   # resolved and checked by _parse
    base: dict = {}
    secret, host, port, plan = None, ns.host or "127.0.0.1", ns.port or 8100, None
    refused = Refusals(log)
    if run_dir is not None:
        from rl.contract.config import ConfigError
        from rl.contract.plan import PlanFormatError
        try:   # the plan is read once: the servers are followed on it for the router's whole life (discover)
            rcfg = runtime.load_config(run_dir)
            plan = runtime.load_plan(run_dir)
        except (ConfigError, PlanFormatError) as e:   # a FIFO, a link, someone else's file: one line
            raise SystemExit(f"router: {e}") from None
        rplan = plan.inference.router
        if rplan is None:
            raise SystemExit(f"{paths.plan_file(run_dir)}: the plan has no router (inference.router=false)")
        base = OmegaConf.to_container(rcfg.inference.routing)
        host, port = ns.host or rplan.host, ns.port or rplan.port
        # never a router open to anyone: a missing, empty or short secret stops it here (one line), unless
        # the run has none on purpose (HETRL_UNAUTHENTICATED=1 and no file: rl/contract/secret.py)
        from rl.contract.secret import SecretError, secret_or_none
        try:
            secret = secret_or_none(run_dir)
        except SecretError as e:
            raise SystemExit(f"router: {e}") from None
        timeout = float(rcfg.inference.startup_timeout_s)
        deadline, said = time.monotonic() + timeout, False
        while True:
            found, planned = discover(plan, run_dir, refused), len(plan.inference.replicas)
            # a server the job's supervisor gave up on (lost before its first record) will not come
            if len(found) >= planned or (found and len(found) + len(gone := given_up(run_dir)) >= planned):
                if len(found) < planned:
                    log(f"starting with {len(found)} of {planned} servers: {', '.join(sorted(gone))} given up by the job")
                break
            if stop.is_set() or runtime.is_done(run_dir):
                return runtime.EXIT_PREEMPTED if stop.is_set() else 0
            if time.monotonic() > deadline:
                log(f"only {len(found)} of {planned} servers up after {timeout:.0f} s; routing to those")
                break
            if not said:
                log(f"waiting for {planned} server(s) in {run_dir}/inference")
                said = True
            await asyncio.sleep(0.5)
        backends = [(name, url, pool) for name, (url, pool, _) in found.items()]
    else:
        backends = []
        for i, spec in enumerate(ns.backend):
            url, _, pool = spec.partition("@")
            backends.append((f"inference_{i}", url, pool or "mixed"))
    cfg = RouterConfig(**{**base, **{k: getattr(ns, k) for k in RouterConfig.__dataclass_fields__
                                     if getattr(ns, k) is not None}})
    router = Router(backends, cfg, secret=secret, run_dir=run_dir, log=log, plan=plan, refused=refused)
    if run_dir is not None:
        router.down_wait_s = float(rcfg.inference.startup_timeout_s)
    url = await router.start(host, port)
    pools = Counter(b.pool for b in router.backends.values())
    log(f"routing ({cfg.policy}) on {url} to {len(backends)} server(s): {dict(pools)}")
    if run_dir is not None:
        from rl.contract.records import RouterRecord
        RouterRecord(url=url, host=socket.gethostname(), port=port, pid=os.getpid(), policy=cfg.policy,
                     backends=[[b.name, b.url, b.pool] for b in router.backends.values()]).write(run_dir)
        runtime.record_role(run_dir, "router", url=url)
    try:
        while not stop.is_set() and not (run_dir is not None and runtime.is_done(run_dir)):
            await asyncio.sleep(0.5)
    finally:
        log(f"stopping; decisions {json.dumps(router.policy.decisions)}")
        await router.stop()
        if run_dir is not None:
            safefs.remove(paths.router_record(run_dir))   # never through a link planted on the way
    return runtime.EXIT_PREEMPTED if stop.is_set() else 0


def main(argv=None) -> int:
    return asyncio.run(_serve(parse(argv)))


_parse = parse   # the name tests and callers used before the split


if __name__ == "__main__":
    sys.exit(main())
