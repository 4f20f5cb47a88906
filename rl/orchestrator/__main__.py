"""`python -m rl.orchestrator --run-dir D`: build and publish rollout batches until max_steps."""
import asyncio
import sys

from rl.orchestrator import heap
from rl.orchestrator.loop import ROLE, Orchestrator
from rl.runtime import EXIT_PREEMPTED, StopFlag, load_config, log, parse_role_args, record_role


def main(argv=None) -> int:
    ns = parse_role_args(ROLE, argv)
    heap.bound()   # large arrays as their own mappings, returned when freed (rl/orchestrator/heap.py)
    cfg = load_config(ns.run_dir)
    stop = StopFlag()
    record_role(ns.run_dir, ROLE)
    rc = asyncio.run(Orchestrator(ns.run_dir, cfg, stop).run())
    if stop.is_set():
        log(ROLE, f"stopped on {stop.reason}")
        return EXIT_PREEMPTED
    return rc


if __name__ == "__main__":
    sys.exit(main())
