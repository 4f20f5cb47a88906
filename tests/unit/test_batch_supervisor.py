"""The batch script's supervisor (sbatch/job.sbatch.j2), run for real by bash with Slurm's commands faked.

The rendered script of a real run directory runs as it would in a job (rl.prepare included), but `srun`
is a script that starts a scripted stand-in for each role instead of the role: each start of a role takes
the next line of that role's script (`exit N`; `serve`: run until the run is DONE; `finish S`: write
DONE after S seconds and exit 0; `checkpoint N`: publish checkpoint step N, run until stopped, exit as a
stopped role does), and every start is logged. `scontrol` answers `show hostnames` and
records `requeue`; `scancel` records what it was asked. So the restart rules are checked without Slurm:
an inference role restarted in place after its back-off, a crash loop given up on, the job going on with
the servers left or stopping to requeue below cluster.min_inference_fraction, and the old rule (a crash
ends the job) without the router.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch import slurm as ls
from launch.compose import compose_points

SRUN = r'''#!/bin/bash
while [[ $# -gt 0 && $1 != env && $1 != bash ]]; do shift; done
[[ $1 == bash ]] && exit 0          # the node-local cleanup
shift
role="" idx=""
for a in "$@"; do
  case $a in HETRL_ROLE=*) role=${a#HETRL_ROLE=} ;; HETRL_INFERENCE_INDEX=*) idx=${a#HETRL_INFERENCE_INDEX=} ;; esac
done
name=$role$idx
n=$(( $(grep -c "^$name\$" "$CTL/starts" 2>/dev/null) + 1 ))
echo "$name" >>"$CTL/starts"
action=$(sed -n "${n}p" "$CTL/$name")
case $action in
  exit*) exit "${action#exit }" ;;
  serve) while [[ ! -e $RUN_DIR/DONE && ! -e $CTL/stop ]]; do sleep 0.1; done; exit 0 ;;
  finish*) sleep "${action#finish }"; echo '{}' >"$RUN_DIR/DONE"; exit 0 ;;
  checkpoint*)  # a trainer that trained to step N, checkpointed it, then runs until stopped
    "$PY" -c 'import sys; from rl import exchange; exchange.publish(sys.argv[1], "checkpoints", int(sys.argv[2]), lambda d: (d / "state").write_text("x"), producer="trainer")' "$RUN_DIR" "${action#checkpoint }" || exit 98
    while [[ ! -e $RUN_DIR/DONE && ! -e $CTL/stop ]]; do sleep 0.1; done; exit 3 ;;
esac
echo "no action $n for $name" >&2; exit 99
'''
SCONTROL = r'''#!/bin/bash
if [[ $1 == show && $2 == hostnames ]]; then echo "$3" | tr ',' '\n'; exit 0; fi
echo "scontrol $*" >>"$CTL/calls"; [[ $1 == requeue ]] && touch "$CTL/stop"; exit 0
'''
SCANCEL = r'''#!/bin/bash
echo "scancel $*" >>"$CTL/calls"; touch "$CTL/stop"; exit 0
'''


def _run(tmp_path: Path, actions: dict[str, list[str]], *overrides: str, timeout: float = 120,
         no_inference_dir: bool = False, plant=None):
    run_dir = tmp_path / "run"
    (cfg,) = compose_points(["cluster=slurm", f"run_dir={run_dir}", "inference.host=127.0.0.1",
                             *overrides], multirun=False)
    from launch.rundir import freeze_run_dir
    plan, script = ls.prepare_run(cfg, run_dir)
    freeze_run_dir(dict(cfg, run_dir=str(run_dir)), run_dir, plan, backend="slurm")
    bin_dir, ctl = tmp_path / "bin", tmp_path / "ctl"
    bin_dir.mkdir()
    ctl.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("scancel", SCANCEL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    for role, lines in actions.items():
        (ctl / role).write_text("\n".join(lines) + "\n")
    (tmp_path / "job.sh").write_text(script)
    if no_inference_dir:   # as before any role ran: nothing has written into inference/ yet
        import shutil
        shutil.rmtree(run_dir / "inference", ignore_errors=True)
    if plant is not None:
        plant()
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CTL": str(ctl), "RUN_DIR": str(run_dir),
           "PY": sys.executable,
           "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST_HET_GROUP_0": "n1", "SLURM_JOB_NODELIST_HET_GROUP_1": "n2,n3",
           "SLURM_JOB_NODELIST_HET_GROUP_2": "n4", "SLURMD_NODENAME": "n0"}
    try:
        r = subprocess.run(["bash", str(tmp_path / "job.sh")], env=env, capture_output=True, text=True,
                           timeout=timeout)
    finally:
        # a job that ended with roles still "serving" (the script exits without waiting for them) would
        # leave its stand-ins looping: they stop on this file
        (ctl / "stop").touch()
    starts = (ctl / "starts").read_text().split() if (ctl / "starts").exists() else []
    calls = (ctl / "calls").read_text() if (ctl / "calls").exists() else ""
    return r, starts, calls


ROUTER = ["inference.router=true"]


def test_a_failed_inference_role_restarts_in_place_and_the_run_finishes(tmp_path):
    r, starts, calls = _run(tmp_path, {"trainer": ["finish 9"], "orchestrator": ["serve"], "router": ["serve"],
                                       "inference0": ["exit 1", "serve"]}, *ROUTER)
    assert r.returncode == 0, r.stdout + r.stderr
    assert starts.count("inference0") == 2 and starts.count("trainer") == 1
    assert "inference_0 failed (status 1" in r.stdout and "restarting inference_0 in place (1 of 3" in r.stdout
    assert "run complete" in r.stdout and not calls


def test_a_crash_loop_is_given_up_and_the_job_goes_on_above_the_floor(tmp_path):
    r, starts, calls = _run(tmp_path, {"trainer": ["finish 12"], "orchestrator": ["serve"], "router": ["serve"],
                                       "inference0": ["serve"], "inference1": ["exit 1", "exit 143"]},
                            *ROUTER, "inference.replicas=2", "cluster.max_role_restarts=1",
                            "cluster.min_inference_fraction=0.5")
    assert r.returncode == 0, r.stdout + r.stderr
    assert starts.count("inference1") == 2
    assert "given up; going on with 1 of 2 inference servers" in r.stdout
    # named for the orchestrator (rl/orchestrator/servers.py: it does not wait for a server given up)
    assert (tmp_path / "run" / "inference" / "given_up").read_text() == "inference_1\n"
    assert "run complete" in r.stdout and not calls


def test_a_server_lost_before_any_role_wrote_into_inference_is_still_named(tmp_path):
    """The fault trials' case: a server step cancelled a second into the job, before any role made
    inference/; the supervisor makes the directory itself, so the router and the orchestrator learn the
    server is given up instead of waiting for its record."""
    r, starts, calls = _run(tmp_path, {"trainer": ["finish 12"], "orchestrator": ["serve"], "router": ["serve"],
                                       "inference0": ["serve"], "inference1": ["exit 143"]},
                            *ROUTER, "inference.replicas=2", "cluster.max_role_restarts=0",
                            "cluster.min_inference_fraction=0.5", no_inference_dir=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "run" / "inference" / "given_up").read_text() == "inference_1\n"
    assert "given up; going on with 1 of 2 inference servers" in r.stdout


def test_a_planted_inference_link_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    run_dir = tmp_path / "run"
    r, starts, calls = _run(tmp_path, {"trainer": ["finish 1"], "orchestrator": ["serve"], "router": ["serve"],
                                       "inference0": ["serve"]}, *ROUTER, no_inference_dir=True,
                            plant=lambda: (run_dir / "inference").symlink_to(outside))
    assert r.returncode == 1 and "refusing" in r.stdout and "a symlink or not a directory" in r.stdout
    assert not starts and not list(outside.iterdir())


def test_below_the_floor_without_a_trained_step_the_job_ends_failed_instead_of_looping(tmp_path):
    """A deterministic server crash would be lost again in every incarnation: with nothing trained since
    the start (the trainer's step-0 checkpoint of a run from scratch is not progress, though rl.requeue
    alone would requeue for it) the job ends FAILED, saying why in the batch log and requeues.log."""
    r, starts, calls = _run(tmp_path, {"trainer": ["checkpoint 0"], "orchestrator": ["serve"], "router": ["serve"],
                                       "inference0": ["serve"], "inference1": ["exit 1"]},
                            *ROUTER, "inference.replicas=2", "cluster.max_role_restarts=0")
    assert "1 of 2 inference servers left, below cluster.min_inference_fraction (2): stopping to requeue" in r.stdout
    assert "scancel --signal=TERM 7" in calls    # every role asked to checkpoint and stop, as on preemption
    assert "scontrol requeue" not in calls and r.returncode == 1, r.stdout + r.stderr
    why = ("not requeueing, job FAILED: no step trained and checkpointed since this incarnation started "
           "(restart 0, from scratch): a requeue would lose the server again (see ")
    assert why in r.stdout and "inference_1.log; fix it, then: python -m launch resume" in r.stdout
    (line,) = (tmp_path / "run" / "logs" / "requeues.log").read_text().splitlines()
    assert "restart 0: 1 of 2 inference servers left (inference_1 lost): " + why in line
    assert ls.requeue_reasons(tmp_path / "run", []) == [line]    # what `launch status` shows


def test_below_the_floor_after_a_trained_step_the_job_requeues(tmp_path):
    r, starts, calls = _run(tmp_path, {"trainer": ["checkpoint 2"], "orchestrator": ["serve"], "router": ["serve"],
                                       "inference0": ["serve"], "inference1": ["exit 1"]},
                            *ROUTER, "inference.replicas=2", "cluster.max_role_restarts=0")
    assert "scontrol requeue 7" in calls and r.returncode == 0, r.stdout + r.stderr
    (line,) = (tmp_path / "run" / "logs" / "requeues.log").read_text().splitlines()
    assert "(inference_1 lost): requeueing: checkpoint step 2 written since the start" in line
    assert "FAILED" not in r.stdout


def test_without_the_router_an_inference_crash_is_not_restarted_in_place(tmp_path):
    r, starts, calls = _run(tmp_path, {"trainer": ["serve"], "orchestrator": ["serve"], "inference0": ["exit 1"]},
                            "cluster.requeue=false")
    assert r.returncode == 1
    assert "inference_0 failed (see" in r.stdout and "ending the job" in r.stdout
    assert starts.count("inference0") == 1


def test_a_trainer_crash_stops_the_roles_and_asks_to_requeue_with_its_reason(tmp_path):
    r, starts, calls = _run(tmp_path, {"trainer": ["exit 1"], "orchestrator": ["serve"], "router": ["serve"],
                                       "inference0": ["serve"]}, *ROUTER)
    assert "trainer crashed (status 1" in r.stdout and "stopping the other roles to requeue" in r.stdout, r.stdout
    assert "scancel --signal=TERM 7" in calls
    # rl.requeue decides (here: no checkpoint newer than this incarnation's start, so not requeued)
    lines = (tmp_path / "run" / "logs" / "requeues.log").read_text().splitlines()
    assert len(lines) == 1 and "restart 0: trainer crashed (status 1" in lines[0] and "not requeueing" in lines[0]
    assert r.returncode == 3   # EXIT_PREEMPTED: stopped, nothing to requeue from


def test_the_elastic_script_passes_shellcheck(tmp_path):
    import shutil
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (scripts/install.sh --test installs it; Debian: shellcheck)")
    (cfg,) = compose_points(["cluster=slurm", f"run_dir={tmp_path / 'run'}", *ROUTER, "inference.replicas=2"],
                            multirun=False)
    p = tmp_path / "job.sbatch"
    p.write_text(ls.prepare_run(cfg, tmp_path / "run")[1])
    r = subprocess.run(["shellcheck", "-S", "warning", str(p)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
