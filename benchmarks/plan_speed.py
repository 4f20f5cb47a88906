"""How long does planning a real-cluster run take on a login node?

Times `python -m launch plan +experiment=kimi_swe cluster=slurm` (compose, validate, plan, render the
batch script) against bare `python -c 'import hydra'` in the same run, as whole processes (interpreter
start included), and prints medians and the ratio. The target is under 1 s for the plan.

    python benchmarks/plan_speed.py [--repeats 7] [--experiment kimi_swe]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _time(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--experiment", default="kimi_swe")
    a = ap.parse_args()
    py = sys.executable
    plan = [py, "-m", "launch", "plan", f"+experiment={a.experiment}", "cluster=slurm", "run_dir=/tmp/hetrl-plan-bench",
            # the checkpoint's config.json as an architecture card (the site path does not exist here)
            f"model.hf_path={Path(__file__).resolve().parents[1]}/conf/checkpoints/"
            f"{'kimi_k2_7' if a.experiment.startswith('kimi') else 'glm_moe_dsa'}"]
    base = [py, "-c", "import hydra"]
    _time(plan), _time(base)  # warm the page cache
    tp, tb = [], []
    for _ in range(a.repeats):  # interleaved, so load changes hit both alike
        tp.append(_time(plan))
        tb.append(_time(base))
    mp, mb = statistics.median(tp), statistics.median(tb)
    print(f"launch plan +experiment={a.experiment} cluster=slurm: median {mp:.3f} s (min {min(tp):.3f})")
    print(f"python -c 'import hydra':                  median {mb:.3f} s (min {min(tb):.3f})")
    print(f"ratio plan / import hydra: {mp / mb:.2f}x; target < 1 s: {'met' if mp < 1.0 else 'NOT met'}")
    print(f"plan_s={mp:.3f} import_hydra_s={mb:.3f} ratio={mp / mb:.2f} target_met={int(mp < 1.0)}")


if __name__ == "__main__":
    main()
