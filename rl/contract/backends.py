"""The cluster backends, one row each: the names `cluster.backend` takes and what each one is.

Like submitit's executor registry (one name per executor, the executor found by its name), a backend
is a row here and an executor in the launcher: the module `launch.<name>` offers the same four
functions (`submit_run`, `cancel_command`, `job_status`, `plan_text`; launch/backends.py says what each
does and finds the module), so `launch run`, `cancel`, `status` and `plan` call the executor of the
run's backend instead of comparing its name. Adding a backend is one row here and one module there
(tests/unit/test_backends.py checks that every row has its executor).

Here, in the contract, because config validation (which names are allowed), the plan and the status
reader all need the names and none of them may import the launcher. Standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Backend:
    name: str          # cluster.backend; the executor is the module launch.<name>
    # a batch scheduler holds the run: `launch run` submits and returns at once with a job id, `launch
    # plan` prints the batch script it would submit, the run's state is the scheduler's job state
    scheduler: bool
    what: str          # one line for people


ROWS = (
    Backend("local", scheduler=False,
            what="every role as a local process on this machine, the launcher in the foreground"),
    Backend("slurm", scheduler=True,
            what="one heterogeneous Slurm job per run, submitted with sbatch"),
)
BY_NAME = {b.name: b for b in ROWS}
NAMES = tuple(BY_NAME)
