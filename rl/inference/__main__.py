"""`python -m rl.inference --run-dir D --index I [--node-rank K]`: replica I of the plan on this node.

Started once per node of the replica (see rl.inference.server); the node rank defaults to the Slurm task
rank (SLURM_PROCID), 0 outside Slurm."""
import sys

from rl.inference.server import main

if __name__ == "__main__":
    sys.exit(main())
