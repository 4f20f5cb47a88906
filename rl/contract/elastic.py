"""Inference capacity that comes and goes during a run (issue 43): the records `launch scale` writes.

The plan is computed once and never changes, so servers added to a running job cannot be plan rows.
They are *extra replica rows*: a copy of one of the plan's replicas (the same vLLM command, node count,
environment) under a new index, with only what must differ changed: the index and role name, the
port (`launch scale` jobs may share a host with the planned servers: the localhost test cluster) and
the node-local model directory. `launch scale RUN_DIR --inference +N` writes one row per new server as
`inference/extra/replica_<I>.json` before it submits the Slurm job that runs them; every reader finds a
server by index the same way whether it is planned or extra (`replica_row`, `server_indexes`), so the
inference role serves an extra row exactly as a planned one, the router routes to it and the
orchestrator loads weights into it once its server record appears.

Draining (`--inference -N`) is a marker file `inference/extra/drain_<I>`: the server's role withdraws
its server record (the router sends it nothing new and the orchestrator stops loading weights into it),
waits until the requests it holds are answered, and exits 0. A drained row stays on disk (its index is
never reused, so a late record of it cannot be mistaken for a new server) with the marker beside it.

Only rl.contract is imported: the launcher, the router, the inference role and the orchestrator all
read these records.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

from rl.contract import safefs
from rl.contract.atomic import atomic_write_json
from rl.contract.plan import Plan, PlanFormatError, Replica

PathLike = str | os.PathLike
_ROW = re.compile(r"replica_(\d+)\.json")


GIVEN_UP = "given_up"   # inference/given_up: written by the batch script's supervisor (sbatch/job.sbatch.j2)


def given_up(run_dir: PathLike) -> set[str]:
    """Role names of the inference servers the batch script's supervisor gave up on in this incarnation
    (one a line, cleared when the incarnation's roles start): the router and the orchestrator start
    without them instead of waiting for a record that will not come. A planted link or FIFO reads as none
    given up (wait as before)."""
    try:
        text = safefs.read_text(Path(run_dir) / "inference" / GIVEN_UP, limit=1 << 20)
    except OSError:
        return set()
    return {ln.strip() for ln in text.splitlines() if ln.strip()}


def extra_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / "inference" / "extra"


def row_file(run_dir: PathLike, index: int) -> Path:
    return extra_dir(run_dir) / f"replica_{index}.json"


def drain_file(run_dir: PathLike, index: int) -> Path:
    return extra_dir(run_dir) / f"drain_{index}"


def _swap(argv: list[str], old: str, new: str) -> list[str]:
    return [a.replace(old, new) if old in a else a for a in argv]


def extra_row(template: Replica, index: int, port: int) -> Replica:
    """Replica `index` made from the plan's `template` (see the module docstring for what changes)."""
    if "--port" not in template.vllm_command:
        raise PlanFormatError(f"plan.inference.replicas[{template.index}]: no --port in its vLLM command")
    cmd = list(template.vllm_command)
    cmd[cmd.index("--port") + 1] = str(port)
    model_dir = str(Path(template.model_dir).with_name(f"model{index}"))
    cmd = _swap(cmd, template.model_dir, model_dir)
    command = list(template.command)
    if "--index" not in command:
        raise PlanFormatError(f"plan.inference.replicas[{template.index}]: no --index in its role command")
    command[command.index("--index") + 1] = str(index)
    return dataclasses.replace(template, index=index, name=f"inference_{index}", node=0, port=port,
                               model_dir=model_dir, vllm_command=cmd, command=command,
                               env=dict(template.env))


def write_row(run_dir: PathLike, row: Replica, job: str | None = None) -> None:
    atomic_write_json(row_file(run_dir, row.index), {**dataclasses.asdict(row), "job": job})


def read_row(run_dir: PathLike, index: int) -> Replica | None:
    """Extra replica `index`, or None when there is no such row; a malformed row is a one-line error."""
    path = row_file(run_dir, index)
    try:
        raw = safefs.read_bytes(path, limit=1 << 20)
    except FileNotFoundError:
        return None
    try:
        d = json.loads(raw)
        d.pop("job", None)
        return Replica(**d)
    except (ValueError, TypeError) as e:
        raise PlanFormatError(f"{path}: not an extra replica row ({e})") from None


def row_job(run_dir: PathLike, index: int) -> str | None:
    try:
        return json.loads(safefs.read_bytes(row_file(run_dir, index), limit=1 << 20)).get("job")
    except (OSError, ValueError):
        return None


def extra_indexes(run_dir: PathLike) -> list[int]:
    """Indexes of every extra row written so far (drained ones included), ascending."""
    try:
        names = [n for n, _ in safefs.scandir(extra_dir(run_dir))]
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _ROW.fullmatch(n)))


def replica_row(plan: Plan, run_dir: PathLike, index: int) -> Replica:
    """Replica `index`: the plan's, or an extra row `launch scale` wrote."""
    if 0 <= index < len(plan.inference.replicas):
        return plan.replica(index)
    row = read_row(run_dir, index)
    if row is None:
        raise PlanFormatError(f"replica {index}: not in the plan ({len(plan.inference.replicas)} replicas) and no "
                              f"{row_file(run_dir, index)}")
    return row


def server_indexes(plan: Plan, run_dir: PathLike) -> list[int]:
    """Every server index a reader should look for: the plan's and the extra rows not drained."""
    return [r.index for r in plan.inference.replicas] + [
        i for i in extra_indexes(run_dir) if not drain_file(run_dir, i).exists()]


def draining(run_dir: PathLike, index: int) -> bool:
    return drain_file(run_dir, index).exists()


def request_drain(run_dir: PathLike, index: int) -> None:
    atomic_write_json(drain_file(run_dir, index), {"index": index})


def servers_up(plan: Plan, run_dir: PathLike) -> tuple[int, int]:
    """(servers with a record now, servers planned): what the metrics and `launch status` report."""
    from rl.contract.records import RecordError, ServerRecord
    up = 0
    for i in server_indexes(plan, run_dir):
        try:
            up += ServerRecord.read(run_dir, i) is not None
        except (OSError, RecordError):
            pass
    return up, len(plan.inference.replicas)


def server_records(run_dir: PathLike) -> tuple[dict[str, tuple[str, str, int]], int]:
    """({name: (url, pool, pid)} of the servers whose record is there now, planned or extra; how many are
    planned). An unreadable record (being replaced, damaged) counts as absent: the server is down until
    it is readable. The router's view of who serves (rl.inference.router)."""
    from rl.contract.records import RecordError, ServerRecord
    plan = Plan.read(run_dir)
    found = {}
    for i in server_indexes(plan, run_dir):   # the plan's and those `launch scale` added
        try:
            r = replica_row(plan, run_dir, i)
            rec = ServerRecord.read(run_dir, i)
        except (OSError, RecordError, PlanFormatError):
            rec = None
        if rec is not None:
            found[r.name] = (rec.url, r.pool, rec.pid)
    return found, len(plan.inference.replicas)
