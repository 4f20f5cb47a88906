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

A row holds data only (issue 49): the index of the plan replica it copies (`template`), its own index,
its port and the Slurm job that runs it. The commands a server runs (its vLLM command, its role command,
its environment) are never read from a row: `replica_row` rebuilds them from plan.json with `extra_row`,
so a row that was planted or edited can at most name another of the plan's own replicas, a port and a
job, each checked (`ExtraRow.from_dict`: one line naming the file and the key). A row of the earlier
format, which carried the whole replica and its commands, is refused: `launch scale` writes a new one.

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


MAX_INDEX = 65535   # ports are base + index, and a port is at most 65535: no server index can be larger
_JOB = re.compile(r"[0-9]{1,20}|local:[0-9]{1,10}(,[0-9]{1,10}){0,999}")
_OLD_KEYS = ("vllm_command", "command", "env", "node_args", "model_dir")


@dataclasses.dataclass(frozen=True)
class ExtraRow:
    """What `inference/extra/replica_<I>.json` holds: data, never a command. `template` is the index of
    the plan replica this server copies, `index` its own (the file's), `port` where it serves, `job` the
    Slurm job that runs it (digits) or the local processes (`local:<pid>,...`), None until submitted."""
    template: int
    index: int
    port: int
    job: str | None = None

    def check(self, where: str) -> None:
        """PlanFormatError, one line naming `where` and the key, for a value no launcher writes."""
        for key, lo, hi in (("template", 0, MAX_INDEX), ("index", 1, MAX_INDEX), ("port", 1024, 65535)):
            v = getattr(self, key)
            if type(v) is not int or not lo <= v <= hi:
                raise PlanFormatError(f"{where}: {key}={v!r}: not an integer from {lo} to {hi}")
        if self.job is not None and not (isinstance(self.job, str) and _JOB.fullmatch(self.job)):
            raise PlanFormatError(f"{where}: job={str(self.job)[:40]!r}: not a Slurm job id (digits) or "
                                  f"local:<pid>,...")

    @classmethod
    def from_dict(cls, d, where: str) -> "ExtraRow":
        if not isinstance(d, dict):
            raise PlanFormatError(f"{where}: not an extra replica row (a JSON object expected)")
        if any(k in d for k in _OLD_KEYS):
            raise PlanFormatError(f"{where}: an extra replica row of an earlier hetrl that names its own "
                                  f"commands; hetrl now takes them from plan.json only: remove it and re-run "
                                  f"`launch scale`")
        names = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(d) - names):
            raise PlanFormatError(f"{where}: {unknown[0]}: not a key of an extra replica row "
                                  f"({', '.join(sorted(names))})")
        if missing := sorted(names - {"job"} - set(d)):
            raise PlanFormatError(f"{where}: {missing[0]}: missing (an extra replica row has "
                                  f"{', '.join(sorted(names))})")
        row = cls(**d)
        row.check(where)
        return row


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


def write_row(run_dir: PathLike, row: ExtraRow) -> None:
    """Write `row` (the launcher's: `launch scale`), through safefs like every record."""
    row.check(str(row_file(run_dir, row.index)))
    atomic_write_json(row_file(run_dir, row.index), dataclasses.asdict(row))


def read_row(run_dir: PathLike, index: int) -> ExtraRow | None:
    """Extra row `index`, or None when there is none. PlanFormatError (one line naming the file and the
    key) for a row that is not this user's own (safefs: owned by another uid, writable by others, a link,
    a FIFO: refused without blocking), is not JSON, has the earlier format or a value out of range."""
    path = row_file(run_dir, index)
    if type(index) is not int or not 0 < index <= MAX_INDEX:
        raise PlanFormatError(f"replica {index!r}: not a server index (1 to {MAX_INDEX})")
    try:
        raw = safefs.read_bytes(path, limit=1 << 16)
    except FileNotFoundError:
        return None
    except safefs.UnsafePath as e:
        raise PlanFormatError(str(e)) from None
    try:
        d = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise PlanFormatError(f"{path}: not an extra replica row ({e})") from None
    row = ExtraRow.from_dict(d, str(path))
    if row.index != index:
        raise PlanFormatError(f"{path}: index={row.index!r}: not {index}, the file's own")
    return row


def row_job(run_dir: PathLike, index: int) -> str | None:
    """The job a row names, as written (a reader that acts on it checks it: `launch cancel` refuses one
    that is not a Slurm job id, naming the row); None when the row is missing, unreadable or not this
    user's own."""
    try:
        job = json.loads(safefs.read_bytes(row_file(run_dir, index), limit=1 << 16)).get("job")
    except (OSError, ValueError, AttributeError):
        return None
    return None if job is None else str(job)


def extra_indexes(run_dir: PathLike) -> list[int]:
    """Indexes of every extra row file written so far (drained ones included), ascending; whether each
    is a valid row is for `replica_row` to say."""
    try:
        names = [n for n, _ in safefs.scandir(extra_dir(run_dir))]
    except FileNotFoundError:
        return []
    return sorted(i for n in names if (m := _ROW.fullmatch(n)) and 0 < (i := int(m.group(1))) <= MAX_INDEX)


def replica_row(plan: Plan, run_dir: PathLike, index: int) -> Replica:
    """Replica `index`: the plan's, or the copy of a plan replica an extra row names, rebuilt from the
    plan (`extra_row`): whatever the row holds, the commands and environment are the plan's."""
    if 0 <= index < len(plan.inference.replicas):
        return plan.replica(index)
    row = read_row(run_dir, index)
    if row is None:
        raise PlanFormatError(f"replica {index}: not in the plan ({len(plan.inference.replicas)} replicas) and no "
                              f"{row_file(run_dir, index)}")
    n = len(plan.inference.replicas)
    if not 0 <= row.template < n:
        raise PlanFormatError(f"{row_file(run_dir, index)}: template={row.template}: not a replica of the "
                              f"plan (0 to {n - 1})")
    return extra_row(plan.replica(row.template), index, row.port)


def _valid_row(plan: Plan, run_dir: PathLike, index: int) -> bool:
    try:
        replica_row(plan, run_dir, index)
    except (OSError, PlanFormatError):
        return False
    return True


def server_indexes(plan: Plan, run_dir: PathLike) -> list[int]:
    """Every server index a reader should look for: the plan's, and the extra rows not drained that
    `replica_row` accepts (a planted, edited or earlier-format row names no server)."""
    return [r.index for r in plan.inference.replicas] + [
        i for i in extra_indexes(run_dir) if not draining(run_dir, i) and _valid_row(plan, run_dir, i)]


def draining(run_dir: PathLike, index: int) -> bool:
    """Whether `launch scale -N` asked server `index` to leave: its marker is there and this user's own
    (safefs; a link, a FIFO or someone else's file asks nothing, and is not waited on)."""
    try:
        safefs.read_bytes(drain_file(run_dir, index), limit=1 << 12)
    except OSError:
        return False
    return True


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
