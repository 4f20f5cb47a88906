"""Which inference servers the orchestrator loads weights into, and when it may start: its server view.

Since issue 43 the set of servers changes during a run: a failed server withdraws its record and comes
back with a new one (restarted in place), a server that never comes up is given up on by the batch
script's supervisor, and `launch scale` adds or drains servers. The orchestrator does not follow these
events; it asks a `ServerView` each time it needs to know: which servers serve now (`up`), how to reach
one (`connect`), how many workers a reload must hear from (`workers`), and what the batch metrics say
(`metrics`). `RunDirServers`, the default, reads it all from the run directory (server records, extra
replica rows and drain markers: rl.contract.elastic). A world without a launcher (the benchmarks' load
model, benchmarks/_async_world.py) passes its own view instead of patching the orchestrator. A server
record is obeyed only if this run's user wrote it (docs/run-directory-safety.md): one another user owns
or can write is refused by safefs, the server is not up (no secret, no pause, no weights sent to it),
and the log says so once.

`wait_for_start` is the orchestrator's start. Without the router every planned server must be up (the
orchestrator sends each request to a server itself, so a missing one would fail requests). With it the
orchestrator still waits for every planned server, except those the supervisor has given up on (it
names them in `inference/given_up`, one role name a line, cleared at each incarnation's start): once the
router is up, at least the supervisor's floor of planned servers (`cluster.min_inference_fraction`, the
same rounding as the batch script) has a record and every other one is given up, it starts, naming the
missing ones; at `inference.startup_timeout_s` it starts the same way if the floor is met (naming those
that never wrote a record) instead of failing. It does not start early on servers that are merely slow:
a server that writes its first record after the others started may have loaded a version that is
already outdated, and the weight watcher, which loads each version only once, would not reload it.
"""
from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import Any

from rl.contract import elastic, paths, safefs
from rl.contract.plan import Plan, PlanFormatError
from rl.contract.records import RecordError, ServerRecord
from rl.contract.secret import secret_or_none
from rl.orchestrator.client import InferenceClient, Refusals, wait_for_router
from rl.runtime import is_done, log

ROLE = "orchestrator"


def floor_count(planned: int, fraction: float) -> int:
    """Servers the job needs (cluster.min_inference_fraction of `planned`, rounded up, at least 1): the
    batch script's MIN_SERVERS, which subtracts 1e-6 before rounding so that 0.5 x 2 is 1, not 2."""
    return max(1, math.ceil(fraction * planned - 1e-6))


class RunDirServers:
    """The servers as the run directory shows them (the default view)."""

    def __init__(self, run_dir: Path, request_timeout_s: float = 600.0):
        self.run_dir = Path(run_dir)
        self.timeout = float(request_timeout_s)
        self._plan: Plan | None = None
        # a server record another user wrote or can write (planted, or edited: chmod 666) names an address
        # the run's secret and weights would go to: refused by safefs, the server counted as not up, and
        # said once in the log (module `log` looked up at call time: tests capture it)
        self.refusals = Refusals(lambda msg: log(ROLE, msg))

    @property
    def plan(self) -> Plan | None:
        """plan.json, or None outside a launched run (the unit tests' orchestrators)."""
        # lstat, not exists(): nothing is followed; a link or FIFO there is Plan.read's one-line refusal
        if self._plan is None and safefs.lstat(paths.plan_file(self.run_dir)) is not None:
            self._plan = Plan.read(self.run_dir)
        return self._plan

    def record(self, index: int) -> ServerRecord | None:
        """Server `index`'s record if it passes the trust rule (rl.contract.safefs, through records);
        refused or damaged: None (down until readable), said once."""
        try:
            return ServerRecord.read(self.run_dir, index)
        except (OSError, RecordError) as e:
            self.refusals.note(e)
            return None

    def up(self) -> dict[int, ServerRecord] | None:
        """{index: record} of the servers serving now: planned or added by `launch scale`, not draining.
        None outside a launched run: no records to follow, the orchestrator's own clients are the servers."""
        plan = self.plan
        if plan is None:
            return None
        return {i: rec for i in elastic.server_indexes(plan, self.run_dir) if (rec := self.record(i)) is not None}

    def connect(self, index: int, record: ServerRecord) -> InferenceClient:
        return InferenceClient(record.url, secret=secret_or_none(self.run_dir), timeout=self.timeout)

    def workers(self, index: int) -> int | None:
        """Engines x tensor-parallel workers of server `index`: each reports its reload (worker_ext)."""
        try:
            row = elastic.replica_row(self.plan, self.run_dir, index)
        except (PlanFormatError, OSError, AttributeError):
            return None
        return int(row.dp) * int(row.tp)

    def given_up(self) -> set[str]:
        """Names of the servers the batch script's supervisor gave up on in this incarnation."""
        return elastic.given_up(self.run_dir)

    def metrics(self) -> dict:
        """{servers_up, servers_planned} for a batch's metadata; {} without a plan."""
        plan = self.plan
        if plan is None:
            return {}
        return dict(zip(("servers_up", "servers_planned"), elastic.servers_up(plan, self.run_dir)))


async def wait_for_start(view: Any, run_dir: Path, plan: Plan, stop, timeout: float,
                         min_fraction: float) -> dict[int, Any]:
    """{index: record} of the planned servers to start with ({} if stopped or DONE first); see the module
    docstring for the rule. TimeoutError, naming the servers missing, after `timeout` seconds."""
    replicas = plan.inference.replicas
    routed = plan.inference.router is not None
    need = floor_count(len(replicas), min_fraction) if routed else len(replicas)
    deadline = time.monotonic() + timeout
    router_up = False
    while True:
        now = view.up() or {}
        have = {r.index: now[r.index] for r in replicas if r.index in now}
        missing = [r.name for r in replicas if r.index not in have]
        if not missing:
            return have
        late = time.monotonic() > deadline
        if routed and len(have) >= need:
            gone = view.given_up()
            if late or all(m in gone for m in missing):
                router_up = router_up or await _router_up(run_dir, stop)
                if router_up:
                    why = ", ".join(f"{m} ({'given up by the job' if m in gone else f'no record after {timeout:.0f} s'})"
                                    for m in missing)
                    log(ROLE, f"starting with {len(have)} of {len(replicas)} inference servers (at least {need}: "
                              f"cluster.min_inference_fraction={min_fraction}); missing: {why}")
                    return have
        if stop.is_set() or is_done(run_dir):
            return {}
        if late:
            raise TimeoutError(f"{run_dir}/inference: no server record of {', '.join(missing)} after "
                               f"{timeout:.0f} s (inference.startup_timeout_s; {len(have)} of {len(replicas)} up, "
                               f"{need} needed{'' if not routed or len(have) < need else ', and no router'}); "
                               f"see {run_dir}/logs/inference_*.log")
        await asyncio.sleep(0.5)


async def _router_up(run_dir: Path, stop) -> bool:
    """Is the router's record there (and not an earlier incarnation's)? One look."""
    try:
        return await wait_for_router(run_dir, stop, 0.0) is not None
    except TimeoutError:
        return False
