"""Names in the run directory and on node-local disk: one definition each, used by every process.

The run directory (on the shared filesystem) is the only channel between the launcher, the batch
script and the roles. Step-versioned kinds (`rollouts/`, `weights/`, `checkpoints/`, `assets/`) follow
the publishing protocol of rl.exchange; the files here are small records written atomically (tmp +
fsync + rename), read by `launch status`, the router, the orchestrator and the tests. Node-local paths
(model copies, KV offload files) are derived here too, so the plan, the batch script's cleanup and the
inference role agree on them. Torch-free.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

PathLike = str | os.PathLike

# Frozen at first submission (launch.rundir); a resume checks config.yaml against the new config.
CONFIG = "config.yaml"
PLAN = "plan.json"
JOB_SCRIPT = "job.sbatch"
SUBMISSIONS = "submissions.jsonl"
SLURM_JOBS = "slurm_jobs.jsonl"
SECRET = "secret"
# Written while the run runs.
RESUME = "resume.json"
DONE = "DONE"
METRICS = "metrics.jsonl"
EVAL, EVAL_RESULTS = "eval", "results.jsonl"   # eval/results.jsonl: online evaluation, a line per version
WANDB_ID = "wandb_id"
LOCAL_PIDS = "local.json"            # the local backend's launcher: host, pid, start time
# Step-versioned kinds (rl.exchange).
ROLLOUTS, WEIGHTS, CHECKPOINTS, ASSETS = "rollouts", "weights", "checkpoints", "assets"
KINDS = (ROLLOUTS, WEIGHTS, CHECKPOINTS, ASSETS)
CONSUMED = "consumed.jsonl"
CORRUPT = "corrupt"
SUBDIRS = ("logs", "roles", ROLLOUTS, WEIGHTS, CHECKPOINTS, "inference")
# Directories whose owner and mode every entry point checks (safefs.check_run_dir_private): those where a
# record that names a command, an address, a pid or a grade lives.
PRIVATE_DIRS = (*SUBDIRS, ASSETS, "incarnations", "sandboxes", "eval", "inference/extra", "inference/reloads")

# Every name hetrl itself makes at the top of a run directory. A non-empty directory holding anything else
# and no config.yaml is not a run directory, and the launcher refuses to write into it (launch.rundir):
# a directory holding only these is one whose first launch stopped before config.yaml was frozen.
RUN_ENTRIES = frozenset({CONFIG, PLAN, JOB_SCRIPT, SUBMISSIONS, SLURM_JOBS, SECRET, RESUME, DONE, METRICS,
                         EVAL, WANDB_ID, LOCAL_PIDS, *KINDS, *SUBDIRS, "incarnations", "sandboxes",
                         "launcher.lock", "report.html", "wandb"})

# Exit status of a role that stopped early because it was asked to (preemption, time limit, Ctrl-C):
# the batch script and the local backend tell it apart from a crash and requeue / report "stopped".
EXIT_PREEMPTED = 3
EXIT_STALLED = 4    # rl.runtime.Watchdog: waited past cluster.stall_timeout_s for another role's output


def p(run_dir: PathLike, *parts: str) -> Path:
    return Path(run_dir).joinpath(*parts)


def config_file(run_dir: PathLike) -> Path:
    return p(run_dir, CONFIG)


def plan_file(run_dir: PathLike) -> Path:
    return p(run_dir, PLAN)


def resume_file(run_dir: PathLike) -> Path:
    return p(run_dir, RESUME)


def done_file(run_dir: PathLike) -> Path:
    return p(run_dir, DONE)


def secret_file(run_dir: PathLike) -> Path:
    return p(run_dir, SECRET)


def metrics_file(run_dir: PathLike) -> Path:
    return p(run_dir, METRICS)


def eval_results_file(run_dir: PathLike) -> Path:
    return p(run_dir, EVAL, EVAL_RESULTS)


def logs_dir(run_dir: PathLike) -> Path:
    return p(run_dir, "logs")


def log_file(run_dir: PathLike, role: str) -> Path:
    """RUN_DIR/logs/<role>.log; role names as in plan.json (trainer, inference_0, router, orchestrator)."""
    return p(run_dir, "logs", f"{role}.log")


def vllm_log_file(run_dir: PathLike, index: int, node_rank: int = 0) -> Path:
    suffix = "" if node_rank == 0 else f".node{node_rank}"
    return p(run_dir, "logs", f"inference_{index}{suffix}.vllm.log")


def roles_dir(run_dir: PathLike) -> Path:
    return p(run_dir, "roles")


def role_record(run_dir: PathLike, role: str) -> Path:
    return p(run_dir, "roles", f"{role}.json")


def role_history(run_dir: PathLike) -> Path:
    return p(run_dir, "roles", "history.jsonl")


def trainer_exit(run_dir: PathLike) -> Path:
    """Rank 0's exit status, read by rl.trainer.torchrun (torchrun turns any failure into 1)."""
    return p(run_dir, "roles", "trainer.exit.json")


def server_record(run_dir: PathLike, index: int) -> Path:
    return p(run_dir, "inference", f"server_{index}.json")


def router_record(run_dir: PathLike) -> Path:
    return p(run_dir, "inference", "router.json")


def sandboxes_dir(run_dir: PathLike) -> Path:
    return p(run_dir, "sandboxes")


def sandbox_service_record(run_dir: PathLike, index: int) -> Path:
    """Sandbox service i is up (rl.envs.swe.service): its URL."""
    return p(run_dir, "sandboxes", f"service_{index}.json")


def sandbox_log(run_dir: PathLike, index: int) -> Path:
    """One line per sandbox service i closed: which task, how many commands, on which node."""
    return p(run_dir, "sandboxes", f"sandboxes_{index}.jsonl")


def consumed_log(run_dir: PathLike, kind: str) -> Path:
    return p(run_dir, kind, CONSUMED)


def corrupt_dir(run_dir: PathLike, kind: str) -> Path:
    return p(run_dir, kind, CORRUPT)


# -- node-local disk ---------------------------------------------------------------------------------
def run_id(run_dir: PathLike) -> str:
    """Short, stable name of a run for node-local paths and rendezvous ids."""
    a = Path(run_dir).absolute()
    return f"{a.name[:40]}-{hashlib.sha1(str(a).encode()).hexdigest()[:8]}"


def user_local_dir(base: str, uid: int | None = None) -> str:
    """This user's directory under cluster.node_local_dir: `<base>/hetrl-<uid>`. The base (often /tmp)
    is shared with the node's other users, and what hetrl keeps there is code as much as data (a model
    copy's config.json and `auto_map`, vLLM's compile cache), so every run of a user lives below a
    directory of that user's own, made 0700 and checked on every use (rl.inference.model_dir); one
    someone else made first is refused, never used."""
    return f"{base.rstrip('/')}/hetrl-{os.geteuid() if uid is None else uid}"


def node_local_dir(base: str, run_dir: PathLike) -> str:
    """This run's directory under cluster.node_local_dir on every node (plan, cleanup, server), inside the
    launching user's own directory (`user_local_dir`). On Slurm it holds one directory per node and
    incarnation (`node_dir`), which is what the server uses."""
    return f"{user_local_dir(base)}/{run_id(run_dir)}"


def node_vllm_cache(local_dir: str) -> str:
    """VLLM_CACHE_ROOT: one per node and user, beside the user's runs' directories and shared by them. It
    holds what vLLM derives from code and config alone (its model-class inspection, which otherwise
    costs a Python subprocess of several seconds per start; torch.compile artifacts on a GPU), so every
    start after a node's first is warm, a restart of the same run included. vLLM writes it atomically;
    it holds no weights, and the stale-directory cleanup leaves it alone (it has no owner records). Per
    user, because what it holds is code vLLM runs: another user's cache is never read."""
    return f"{local_dir.rstrip('/').rsplit('/', 1)[0]}/vllm-cache"


# Node-local state is kept per node and per incarnation: `<node_local_dir>/<node>.<incarnation>`, with the
# incarnation `j<SLURM_JOB_ID>.r<SLURM_RESTART_COUNT>` (the leader's job id). Per node, because the nodes
# of the localhost test cluster (and nodes whose "local" disk is in fact shared) have one disk: with one
# directory per run, two nodes removing and recreating it at once failed the job ("rm: cannot remove
# ...: Is a directory"). Per incarnation, because a process of the previous incarnation may still be
# dying and writing there when the next one starts. The incarnation is the job id and restart count, not
# the epoch (HETRL_EPOCH): both are known before rl.prepare runs, when the batch script cleans up, and
# the job id keeps a resubmitted run (`launch resume`, restart count 0 again) apart from the earlier job.
NODE_DIR_VAR = "HETRL_NODE_DIR"        # where a Slurm plan's node-local paths point: `${HETRL_NODE_DIR}/...`
INCARNATION_VAR = "HETRL_INCARNATION"  # exported by the batch script: j<job id>.r<restart count>


def incarnation(job_id, restart) -> str:
    """The incarnation part of a node directory's name (the batch script builds the same in bash)."""
    return f"j{job_id}.r{restart}"


def node_dir(local_dir: str, node: str, incarnation_: str) -> str:
    """This node's directory for this incarnation, inside the run's node-local directory."""
    return f"{local_dir}/{node}.{incarnation_}"


def node_dir_from_env(local_dir: str, env) -> str:
    """node_dir for the process's own node (SLURMD_NODENAME) and incarnation (HETRL_INCARNATION)."""
    for var in ("SLURMD_NODENAME", INCARNATION_VAR):
        if not env.get(var):
            raise ValueError(f"{var}: not set in the environment of this process (the node-local directory "
                             f"of a Slurm run is per node and incarnation; the batch script sets it)")
    return node_dir(local_dir, env["SLURMD_NODENAME"], env[INCARNATION_VAR])


def node_model_dir(local_dir: str, index: int) -> str:
    """Where replica `index` materialises its HF model dir (several replicas may share a node)."""
    return f"{local_dir}/model{index}"


def node_kv_dir(local_dir: str) -> str:
    return f"{local_dir}/kv"


def replica_start_record(run_dir: PathLike, index: int) -> Path:
    """A multi-node replica's start record: the version and load mode its head chose, for its other
    nodes (they must load the same weights; written by the head, tagged with the incarnation)."""
    return p(run_dir, "inference", f"replica_{index}.start.json")
