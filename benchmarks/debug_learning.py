"""Does the embedded default learn, and how fast? Runs `python -m launch run` (the debug experiment,
default config) in a fresh run dir and prints the reward of the first and last 5 steps, their
difference (the target is >= 0.3, reward in [0, 1]) and the wall time (the target is 15 minutes on 2
cores).

    python benchmarks/debug_learning.py [extra overrides...]
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rl.metrics import read_metrics  # noqa: E402


def main() -> int:
    run_dir = Path(tempfile.mkdtemp(prefix="hetrl-debug-")) / "run"
    t0 = time.monotonic()
    rc = subprocess.run([sys.executable, "-m", "launch", "run", f"run_dir={run_dir}", *sys.argv[1:]], cwd=REPO).returncode
    wall = time.monotonic() - t0
    ms = read_metrics(run_dir)
    if rc != 0 or len(ms) < 10:
        print(f"run failed (exit {rc}, {len(ms)} steps); see {run_dir}/logs", file=sys.stderr)
        return 1
    first = sum(m["reward_mean"] for m in ms[:5]) / 5
    last = sum(m["reward_mean"] for m in ms[-5:]) / 5
    print(f"\nsteps {len(ms)}; reward first 5 {first:.3f}, last 5 {last:.3f}, gain {last - first:+.3f} "
          f"(target >= +0.300: {'met' if last - first >= 0.3 else 'NOT met'})")
    print(f"wall time {wall / 60:.1f} min (target <= 15: {'met' if wall <= 900 else 'NOT met'}); run dir {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
