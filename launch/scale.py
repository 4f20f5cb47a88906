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
from rl.contract.plan import Plan, Replica
from rl.contract.records import ServerRecord

_DELTA = re.compile(r"[+-][1-9][0-9]{0,3}")


def add_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("run_dir")
    s.add_argument("--inference", required=True, metavar="+N|-N",
                   help="+N: submit a job of N more inference servers; -N: drain the N newest extra ones")


def parse_delta(text: str) -> int:
    if not _DELTA.fullmatch(str(text)):
        raise ConfigError(f"--inference={text!r}: must be +N or -N (N from 1 to 9999)")
    return int(text)


def template_row(plan: Plan) -> Replica:
    """The plan row extra servers copy: the first decode server of a P/D plan, else the first replica."""
    rows = plan.inference.replicas
    return next((r for r in rows if r.pool == "decode"), rows[0])


def _check_run(run_dir: Path, plan: Plan) -> None:
    if plan.inference.router is None:
        raise ConfigError(f"{paths.plan_file(run_dir)}: inference.router=false; servers added to a running job "
                          f"are reached only through the router (plan the run with inference.router=true)")
    if paths.done_file(run_dir).exists():
        raise ConfigError(f"{run_dir}: the run is DONE; there is nothing to add servers to")


def _role_env(plan: Plan, template: Replica, row: Replica) -> dict:
    role = next(r for r in plan.roles if r.name == template.name)
    return {**role.env, "HETRL_INFERENCE_INDEX": str(row.index)}


def scale_up(run_dir: Path, n: int) -> list[Replica]:
    plan = Plan.read(run_dir)
    _check_run(run_dir, plan)
    template = template_row(plan)
    first = max([len(plan.inference.replicas) - 1, *elastic.extra_indexes(run_dir)]) + 1
    # ports follow the plan's rule (base + index), so servers sharing a host never share one
    base = template.port - template.index
    rows = [elastic.extra_row(template, i, base + i) for i in range(first, first + n)]
    for r in rows:   # written first: a server started by the job finds its row
        elastic.write_row(run_dir, r)
    try:
        # a batch scheduler (Slurm) runs them as a job of their own; otherwise they are processes here
        job = (_submit_slurm(run_dir, plan, template, rows) if backends.row(plan.backend).scheduler
               else _start_local(run_dir, plan, template, rows))
    except BaseException:
        for r in rows:
            safefs.remove(elastic.row_file(run_dir, r.index))
        raise
    for r in rows:
        elastic.write_row(run_dir, r, job=job)
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


def scale_down(run_dir: Path, n: int) -> list[int]:
    """Drain the n newest extra servers not yet drained; [] when there are none."""
    serving = [i for i in elastic.extra_indexes(run_dir) if not elastic.draining(run_dir, i)]
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
    run_dir = Path(ns.run_dir)
    delta = parse_delta(ns.inference)
    if delta > 0:
        rows = scale_up(run_dir, delta)
        job = elastic.row_job(run_dir, rows[0].index)
        print(f"{len(rows)} inference server(s) {', '.join(r.name for r in rows)} "
              f"({rows[0].nodes} node(s) each, like {template_row(Plan.read(run_dir)).name}): job {job}")
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
