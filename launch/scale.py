"""`python -m launch scale RUN_DIR --inference +N|-N`: inference capacity on demand for a running run.

The run's plan is fixed when it is submitted, and its Slurm job cannot grow. What can grow is the number
of servers the run uses, because servers join a run only through its directory: a server writes its
record once it serves the newest weights, the router re-reads the records, and the orchestrator loads
each new version into every server that has one. So `+N` writes N extra replica rows (rl.contract.elastic:
copies of the plan's first replica of the pool that generates, under new indexes and ports) and submits
ONE separate Slurm job of N x that replica's nodes running them (sbatch/scale.sbatch.j2, the same srun
shape as the main job's inference roles, restarts in place included). The job is not recorded among the
run's jobs (slurm_jobs.jsonl): `launch status`, `cancel` and `resume` keep meaning the run's own job; the
rows name it. `-N` drains the N newest extra servers still serving: a marker each, which their roles
act on (withdraw the record, let the requests they hold finish, exit 0).

On the local backend the extra servers are processes started here, detached, with the same command and
environment. Either way the run must route through the router (`inference.router=true`): generation
reaches a server the orchestrator did not start with only through it.

How many: at most `--max-servers` extra servers serve at once (drained ones not counted), by default
MAX_SERVERS_PER_REPLICA x the plan's replicas; on the local backend also at most this machine's CPU count,
since every server is a process here and more of them than cores only slows them all. Every argument
is checked before anything is written or started, and a bad one is answered in one line (exit 2): the
delta, the cap, RUN_DIR (missing, not a run directory, someone else's), the run (no router, DONE).
The rows hold data only (rl.contract.elastic): the commands the servers run are the plan's.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

from launch import backends
from rl.contract import elastic, paths, safefs
from rl.contract.config import ConfigError, load as load_config
from rl.contract.plan import Plan, PlanFormatError, Replica
from rl.contract.records import ServerRecord

_DELTA = re.compile(r"[+-][1-9][0-9]{0,3}")
MAX_SERVERS_PER_REPLICA = 4   # the default --max-servers: 4 x the plan's replicas


def add_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("run_dir")
    s.add_argument("--inference", required=True, metavar="+N|-N",
                   help="+N: submit a job of N more inference servers; -N: drain the N newest extra ones")
    s.add_argument("--max-servers", type=_positive, default=None, metavar="M",
                   help=f"at most M extra servers serving at once (default: {MAX_SERVERS_PER_REPLICA} x the "
                        f"plan's replicas; local backend: also at most this machine's CPU count)")

    def error(message: str):   # argparse's usage line and error in one line, exit 2 as argparse does
        s.exit(2, f"error: python -m launch scale: {message}\n")
    s.error = error


def _positive(text: str) -> int:
    if not re.fullmatch(r"[1-9][0-9]{0,5}", text):
        raise argparse.ArgumentTypeError(f"{text!r}: must be an integer from 1 to 999999")
    return int(text)


def parse_delta(text: str) -> int:
    if not _DELTA.fullmatch(str(text)):
        raise ConfigError(f"--inference={text!r}: must be +N or -N (N from 1 to 9999)")
    return int(text)


def template_row(plan: Plan) -> Replica:
    """The plan row extra servers copy: the first decode server of a P/D plan, else the first replica."""
    rows = plan.inference.replicas
    return next((r for r in rows if r.pool == "decode"), rows[0])


def read_run(run_dir: Path) -> Plan:
    """The plan of the run in `run_dir`; ConfigError (one line) when `run_dir` is missing, not a directory
    or not a run directory, or its plan.json is missing or damaged."""
    try:
        if not safefs.is_dir(run_dir):
            raise ConfigError(f"{run_dir}: no such directory (RUN_DIR is a run directory `python -m launch run` "
                              f"made)")
        if safefs.lstat(paths.config_file(run_dir)) is None:
            raise ConfigError(f"{run_dir}: not a run directory (no {paths.CONFIG}); RUN_DIR is a directory "
                              f"`python -m launch run` made")
        return Plan.read(run_dir)
    except (PlanFormatError, safefs.UnsafePath) as e:
        raise ConfigError(str(e)) from None


def max_servers(plan: Plan, flag: int | None) -> tuple[int, str]:
    """(the most extra servers that may serve at once, why: the words for the refusal)."""
    n = len(plan.inference.replicas)
    if flag is not None:
        cap, why = flag, "--max-servers"
    else:
        cap, why = (MAX_SERVERS_PER_REPLICA * n,
                    f"--max-servers, by default {MAX_SERVERS_PER_REPLICA} x the plan's {n} replica(s)")
    if not backends.row(plan.backend).scheduler:
        cpus = os.cpu_count() or 1
        if cpus < cap:
            cap, why = cpus, f"the local backend starts every server here: at most this machine's {cpus} CPUs"
    return cap, why


def _check_run(run_dir: Path, plan: Plan) -> None:
    if plan.inference.router is None:
        raise ConfigError(f"{paths.plan_file(run_dir)}: inference.router=false; servers added to a running job "
                          f"are reached only through the router (plan the run with inference.router=true)")
    if paths.done_file(run_dir).exists():
        raise ConfigError(f"{run_dir}: the run is DONE; there is nothing to add servers to")


def _role_env(plan: Plan, template: Replica, row: Replica) -> dict:
    role = next(r for r in plan.roles if r.name == template.name)
    return {**role.env, "HETRL_INFERENCE_INDEX": str(row.index)}


def scale_up(run_dir: Path, n: int, max_extra: int | None = None) -> list[Replica]:
    """Add n servers (see the module docstring); ConfigError, before anything is written, when the run
    cannot take them or they would pass the cap (`max_servers`)."""
    plan = read_run(run_dir)
    _check_run(run_dir, plan)
    cap, why = max_servers(plan, max_extra)
    serving = _serving(plan, run_dir)
    if len(serving) + n > cap:
        raise ConfigError(f"--inference=+{n}: {len(serving)} extra server(s) serve now and at most {cap} may "
                          f"({why}); drain some first (--inference -N) or raise --max-servers")
    template = template_row(plan)
    first = max([len(plan.inference.replicas) - 1, *elastic.extra_indexes(run_dir)]) + 1
    # ports follow the plan's rule (base + index), so servers sharing a host never share one
    base = template.port - template.index
    if base + first + n - 1 > 65535 or first + n - 1 > elastic.MAX_INDEX:
        raise ConfigError(f"--inference=+{n}: servers {first}..{first + n - 1} would serve on ports up to "
                          f"{base + first + n - 1}, past 65535 (inference.port={base} + index)")
    extra = [elastic.ExtraRow(template=template.index, index=i, port=base + i)
             for i in range(first, first + n)]
    # the commands come from the plan (the same rebuild every reader of the rows does)
    rows = [elastic.extra_row(template, e.index, e.port) for e in extra]
    for e in extra:   # written first: a server started by the job finds its row
        elastic.write_row(run_dir, e)
    try:
        # a batch scheduler (Slurm) runs them as a job of their own; otherwise they are processes here
        job = (_submit_slurm(run_dir, plan, template, rows) if backends.row(plan.backend).scheduler
               else _start_local(run_dir, plan, template, rows))
    except BaseException:
        for e in extra:
            safefs.remove(elastic.row_file(run_dir, e.index))
        raise
    for e in extra:
        elastic.write_row(run_dir, dataclasses.replace(e, job=job))
    return rows


def scale_script(run_dir: Path, plan: Plan, template: Replica, rows: list[Replica]) -> str:
    """The batch script of the job that runs `rows` (sbatch/scale.sbatch.j2), with the run's cluster
    settings and the inference group's own #SBATCH options."""
    from launch import slurm
    group = next(g for g in plan.groups if g.het_group == 1)
    envs = {r.name: _role_env(plan, template, r) for r in rows}
    # each extra server on nodes of its own inside the job
    placed = [dataclasses.replace(r, node=k * r.nodes) for k, r in enumerate(rows)]
    return slurm.render_script(plan, load_config(run_dir), template="scale.sbatch.j2", rows=placed, envs=envs,
                               group=group, nodes=sum(r.nodes for r in rows))


def _submit_slurm(run_dir: Path, plan: Plan, template: Replica, rows: list[Replica]) -> str:
    from launch import slurm
    script = scale_script(run_dir, plan, template, rows)
    path = Path(run_dir) / "inference" / "extra" / f"job_{rows[0].index}.sbatch"
    safefs.write_atomic(path, script.encode())
    safefs.makedirs(Path(run_dir) / "logs")
    r = slurm._run("sbatch", "--parsable", f"--chdir={run_dir}", str(path))
    return slurm.job_id_arg(r.stdout.strip().split(";")[0], "sbatch --parsable printed job id")


def _start_local(run_dir: Path, plan: Plan, template: Replica, rows: list[Replica]) -> str:
    from rl.contract.records import ResumeState
    epoch = ResumeState.read(run_dir).restart
    pids = []
    for r in rows:
        fd = safefs.open_write(paths.log_file(run_dir, r.name), append=True)
        try:
            env = {**os.environ, **_role_env(plan, template, r), "HETRL_EPOCH": str(epoch)}
            proc = subprocess.Popen(r.command, env=env, stdout=fd, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=plan.workdir, start_new_session=True)
        finally:
            os.close(fd)
        pids.append(str(proc.pid))
    return "local:" + ",".join(pids)


def _serving(plan: Plan, run_dir: Path) -> list[int]:
    """Indexes of the extra servers not drained whose rows are valid (elastic.server_indexes)."""
    return [i for i in elastic.server_indexes(plan, run_dir) if i >= len(plan.inference.replicas)]


def scale_down(run_dir: Path, n: int) -> list[int]:
    """Drain the n newest extra servers not yet drained; [] when there are none."""
    serving = _serving(read_run(run_dir), run_dir)
    chosen = serving[-n:] if n <= len(serving) else serving
    for i in chosen:
        elastic.request_drain(run_dir, i)
    return chosen


def summary(run_dir: Path) -> list[dict]:
    """Every extra server: index, job, up (has a record), drained; for `launch status`."""
    out = []
    for i in elastic.extra_indexes(run_dir):
        try:
            up = ServerRecord.read(run_dir, i) is not None
        except Exception:  # noqa: BLE001  a damaged record: not up
            up = False
        out.append({"index": i, "job": elastic.row_job(run_dir, i), "up": up,
                    "drained": elastic.draining(run_dir, i)})
    return out


def run(ns) -> int:
    try:
        return _run(ns)
    except PlanFormatError as e:   # a plan this version cannot copy a replica of: one line, exit 2
        raise ConfigError(str(e)) from None


def _run(ns) -> int:
    run_dir = Path(ns.run_dir)
    delta = parse_delta(ns.inference)
    plan = read_run(run_dir)   # a missing or non-run RUN_DIR: one line before anything else
    if delta > 0:
        rows = scale_up(run_dir, delta, getattr(ns, "max_servers", None))
        job = elastic.row_job(run_dir, rows[0].index)
        print(f"{len(rows)} inference server(s) {', '.join(r.name for r in rows)} "
              f"({rows[0].nodes} node(s) each, like {template_row(plan).name}): job {job}")
        return 0
    drained = scale_down(run_dir, -delta)
    if not drained:
        print(f"no extra inference servers to drain in {run_dir} (only those `launch scale` added can be)",
              file=sys.stderr)
        return 1
    print(f"draining {', '.join(f'inference_{i}' for i in drained)}: each finishes its requests and exits")
    return 0


def servers_status(run_dir: Path) -> dict:
    """{planned, up, extra: summary()} for `launch status`: servers with a record now, of those planned
    plus those `launch scale` added and not drained."""
    up, planned = elastic.servers_up(Plan.read(run_dir), run_dir)
    return {"planned": planned, "up": up, "extra": summary(run_dir)}
