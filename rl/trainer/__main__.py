"""`python -m rl.trainer --run-dir D`: the trainer role (see rl.trainer.loop and docs/internals.md)."""
from __future__ import annotations

import sys

from rl.runtime import StopFlag, parse_role_args


def main(argv=None) -> int:
    ns = parse_role_args("trainer", argv)
    stop = StopFlag()  # SIGTERM / SIGUSR1: finish the step, checkpoint, exit with EXIT_PREEMPTED
    from rl.trainer.loop import run  # torch is imported after the signal handlers are in place
    return run(ns.run_dir, stop=stop)


if __name__ == "__main__":
    sys.exit(main())
