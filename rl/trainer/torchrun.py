"""`python -m rl.trainer.torchrun [torchrun options] -m rl.trainer --run-dir D`: torchrun, with the
trainer role's own exit status.

torchrun exits 1 whenever a worker exits non-zero (and sends SIGTERM to the others), so the role's
EXIT_PREEMPTED ("stopped because asked to, checkpointed") would read as a crash to the batch script and
the local backend. Rank 0 records its status in `D/roles/trainer.exit.json` just before returning
(rl.trainer.loop.run); this wrapper runs torchrun's own `main` in-process (the same agent, the same
options) and exits with that recorded status when this launch wrote it, else with torchrun's.
SIGTERM/SIGUSR1 to this process reach the agent, which forwards SIGTERM to the ranks: they finish the
step, checkpoint, record EXIT_PREEMPTED and exit.
"""
from __future__ import annotations

import sys

from rl.contract import paths
from rl.contract.records import ExitRecord

exit_file = paths.trainer_exit


def _run_dir(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a == "--run-dir" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--run-dir="):
            return a.split("=", 1)[1]
    return None


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    run_dir = _run_dir(argv)
    marker = exit_file(run_dir) if run_dir else None
    if marker is not None:
        marker.unlink(missing_ok=True)
    from torch.distributed.run import main as torchrun_main
    rc = 0
    try:
        torchrun_main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:  # ChildFailedError, SignalException (the agent was signalled), ...
        print(f"[rl.trainer.torchrun] torchrun: {type(e).__name__}: {str(e)[:2000]}",
              file=sys.stderr, flush=True)
        rc = 1
    if marker is not None and marker.exists():
        rc = int(ExitRecord.read(run_dir).rc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
