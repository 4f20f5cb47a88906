"""The simulator's check in benchmarks/async_rollouts.py: its model error estimated out of sample and the
coverage of launch.calibrate's ranges.

Why a split by workload: a range that is widened by an error measured on the runs it is then checked on
covers them by construction. So the error is fitted on one latency model's pilot / second-run pairs
(every non-pilot mode and seed of it) and the ranges of the other model's runs are checked, widened by
it; both directions are printed, the in-sample figure beside each for contrast. The printed ranges'
own coverage (launch.calibrate.MODEL_ERROR in) is reported too.
"""
from __future__ import annotations

import numpy as np

from launch.calibrate import MODEL_ERROR  # noqa: F401  (async_rollouts takes it from here)


def coverage(results: dict) -> list[str]:
    """The simulator's model error out of sample: fitted on one workload's pilot / second-run pairs (the
    largest |ln(mid / measured)| over its non-pilot modes and seeds), then the other workload's measured
    steps/h checked against its ranges widened by it (before launch.calibrate's own MODEL_ERROR); and
    the printed ranges' coverage (MODEL_ERROR in). Prints both; returns the last line's fields."""
    pairs: dict[str, list] = {}
    for (model, _), rs in results.items():
        pairs.setdefault(model, []).extend(x for x in rs if "sim_raw" in x and not x["sim_pilot"])
    out = []
    for fit in pairs:
        if not pairs[fit]:
            continue
        err = max(abs(np.log(x["predicted_steps_per_hour"] / x["steps_per_hour"])) for x in pairs[fit])
        e = float(np.exp(err) - 1)
        pre = "" if fit == "agentic" else f"{fit}_"
        out.append(f"{pre}sim_model_error={e:.4f}")
        print(f"simulator's model error fitted on {fit} ({len(pairs[fit])} pairs, non-pilot modes): x{1 + e:.3f}; "
              f"launch.calibrate states x{1 + MODEL_ERROR:.3f}")
        for check in pairs:
            xs = pairs[check]
            k = sum(lo / (1 + e) <= x["steps_per_hour"] <= hi * (1 + e) for x in xs for lo, hi in [x["sim_raw"]])
            n = sum(x["sim_in_range"] for x in xs)
            cpre = "" if check == "agentic" else f"{check}_"
            tag = "out of sample" if check != fit else "in sample"
            print(f"  {check}: measured steps/h inside the range widened by it {k}/{len(xs)} ({tag}); inside the "
                  f"printed range (x{1 + MODEL_ERROR:.3f}) {int(n)}/{len(xs)}")
            out.append(f"{cpre}sim_coverage_from_{fit}={k}/{len(xs)}")
            if check == fit:
                out.append(f"{cpre}sim_coverage_printed={int(n)}/{len(xs)}")
    return out
