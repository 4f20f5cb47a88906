"""The cluster backends, one row each: the names `cluster.backend` takes and what each one is.

Like submitit's executor registry (one name per executor, the executor found by its name), a backend
is a row here and an executor in the launcher: the module `launch.<name>` offers the same four
functions (`submit_run`, `cancel_command`, `job_status`, `plan_text`; launch/backends.py says what each
does and finds the module), so `launch run`, `cancel`, `status` and `plan` call the executor of the
run's backend instead of comparing its name. Adding a backend is one row here and one module there
(tests/unit/test_backends.py checks that every row has its executor).

What differs between backends outside the executor is a column of the row, one per meaning, read through
`row(name)`: whether a scheduler holds the run, whether node-local directories are per incarnation,
whether servers are called from other nodes, whether the roles share the launching host's filesystems,
and how many CPU trainer ranks fit. The plan, config validation, the inference role and the SWE sandbox
service ask the row instead of comparing `cluster.backend` with a name, so the names are written here
only (tests/unit/test_backends.py looks for name comparisons in rl/ and launch/).

Here, in the contract, because config validation (which names are allowed), the plan, the roles and the
status reader all need the rows and none of them may import the launcher. Nothing else of rl but the
contract's ConfigError.
"""
from __future__ import annotations

from dataclasses import dataclass

from rl.contract.config import ConfigError


@dataclass(frozen=True)
class Backend:
    name: str          # cluster.backend; the executor is the module launch.<name>
    # a batch scheduler holds the run: `launch run` submits and returns at once with a job id, `launch
    # plan` prints the batch script it would submit, the run's state is the scheduler's job state
    scheduler: bool
    # node-local directories are per node and incarnation (rl.contract.paths.node_dir), which only the
    # node knows once it runs: the plan names them `${HETRL_NODE_DIR}` and the role sets it from its
    # environment; otherwise one incarnation at a time on one host keeps the run's node-local directory
    node_dirs_per_incarnation: bool
    # roles on other nodes call the servers (vLLM, the SWE sandbox service): they listen on every
    # interface and are addressed by host name; otherwise on loopback, vLLM's own address
    # (VLLM_HOST_IP) pinned to the listen host as well
    binds_all_interfaces: bool
    # the roles run on the host that launches them: a path this host lacks, they lack too (config
    # validation refuses it); otherwise a role's node may mount a site filesystem this host does not
    roles_on_launch_host: bool
    # the most CPU trainer ranks (dp_shard * ep * cp with gpus_per_node=0) it runs; None: no limit
    max_cpu_ranks: int | None
    what: str          # one line for people


ROWS = (
    Backend("local", scheduler=False, node_dirs_per_incarnation=False, binds_all_interfaces=False,
            roles_on_launch_host=True, max_cpu_ranks=2,
            what="every role as a local process on this machine, the launcher in the foreground"),
    Backend("slurm", scheduler=True, node_dirs_per_incarnation=True, binds_all_interfaces=True,
            roles_on_launch_host=False, max_cpu_ranks=None,
            what="one heterogeneous Slurm job per run, submitted with sbatch"),
)
BY_NAME = {b.name: b for b in ROWS}
NAMES = tuple(BY_NAME)


def row(name: str) -> Backend:
    """The row of backend `name` (a config's cluster.backend, a plan's backend); an unknown name is a
    one-line ConfigError naming the key."""
    b = BY_NAME.get(name) if isinstance(name, str) else None
    if b is None:
        raise ConfigError(f"cluster.backend={str(name)[:40]!r}: not one of {', '.join(NAMES)}")
    return b
