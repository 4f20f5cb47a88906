"""How long does planning a real-cluster run take on a login node?

Times `python -m launch plan +experiment=kimi_swe cluster=slurm` (compose, validate, plan, render the
batch script) against bare `python -c 'import hydra'` in the same run, as whole processes (interpreter
start included), interleaved, and prints medians and the ratio. The target is under 1 s for the plan and
a ratio of at most 3.

Besides wall time it records each process's CPU time (user + system, from the kernel's child
accounting): on a shared machine whose other users come and go, CPU time moves far less than wall time,
so `cpu_ratio` is the steadier comparison; the target is judged on wall time, as a user feels it.

Python's bytecode cache: a login node writes `__pycache__` on the first run, so later plans do not
compile the launcher's modules again. Where PYTHONDONTWRITEBYTECODE is set (some shared sandboxes set it)
every plan compiles ~25 modules from source; `--no-bytecode-cache` keeps that setting and measures that
case, the default lets the untimed warm-up run write the cache, as on a login node.

    python benchmarks/plan_speed.py [--repeats 7] [--experiment kimi_swe] [--no-bytecode-cache]
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _time(cmd: list[str], env: dict) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of `cmd` to completion."""
    c0, t0 = _cpu(), time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return time.perf_counter() - t0, _cpu() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--experiment", default="kimi_swe")
    ap.add_argument("--no-bytecode-cache", action="store_true",
                    help="keep PYTHONDONTWRITEBYTECODE as the environment has it (see the module docstring)")
    a = ap.parse_args()
    if a.repeats < 1:
        ap.error(f"--repeats {a.repeats}: must be at least 1")
    env = dict(os.environ)
    if not a.no_bytecode_cache:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    py = sys.executable
    plan = [py, "-m", "launch", "plan", f"+experiment={a.experiment}", "cluster=slurm", "run_dir=/tmp/hetrl-plan-bench",
            # the checkpoint's config.json as an architecture card (the site path does not exist here)
            f"model.hf_path={REPO}/conf/checkpoints/"
            f"{'kimi_k2_7' if a.experiment.startswith('kimi') else 'glm_moe_dsa'}"]
    base = [py, "-c", "import hydra"]
    _time(plan, env), _time(base, env)  # warm the page cache (and the bytecode cache, unless told not to)
    tp, tb = [], []
    for _ in range(a.repeats):  # interleaved, so load changes hit both alike
        tp.append(_time(plan, env))
        tb.append(_time(base, env))
    mp, mb = statistics.median(w for w, _ in tp), statistics.median(w for w, _ in tb)
    cp, cb = statistics.median(c for _, c in tp), statistics.median(c for _, c in tb)
    met = int(mp < 1.0 and mp / mb <= 3.0)
    cache = "off (PYTHONDONTWRITEBYTECODE kept)" if a.no_bytecode_cache else "on"
    print(f"launch plan +experiment={a.experiment} cluster=slurm: median {mp:.3f} s wall, {cp:.3f} s CPU "
          f"(min {min(w for w, _ in tp):.3f} s wall)")
    print(f"python -c 'import hydra':                  median {mb:.3f} s wall, {cb:.3f} s CPU "
          f"(min {min(w for w, _ in tb):.3f} s wall)")
    print(f"ratio plan / import hydra: {mp / mb:.2f}x wall, {cp / max(cb, 1e-9):.2f}x CPU; bytecode cache {cache}; "
          f"target < 1 s and ratio <= 3: {'met' if met else 'NOT met'}")
    print(f"plan_s={mp:.3f} import_hydra_s={mb:.3f} ratio={mp / mb:.2f} plan_cpu_s={cp:.3f} "
          f"import_hydra_cpu_s={cb:.3f} cpu_ratio={cp / max(cb, 1e-9):.2f} bytecode_cache={int(not a.no_bytecode_cache)} "
          f"target_met={met}")


if __name__ == "__main__":
    main()
