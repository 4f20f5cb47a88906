"""Grade a dataset's reference patches and base trees before a run: which rows can be played, and why not.

    python -m rl.envs.swe.check DATASET [--runtime inprocess] [--repos-dir DIR] [--split S]
                                        [--format auto] [--timeout 300] [--only ID ...]

DATASET is what `env.swe.tasks` takes (`builtin`, `builtin_swebench`, a JSONL / parquet path or
directory). Every row is graded twice, as an episode would be (rl/envs/swe/grader.py): its starting tree
with the reference patch, and its starting tree as it is. One table follows: row, playable, reference
reward, base reward, why not. A row is playable when its reference patch scores 1.0 without a grading
error and its base tree scores below 1 (something is left to fix). Exit status 1 if any row is
unplayable (2 if the dataset itself cannot be loaded), 0 otherwise. Rows without a reference patch are
listed as "?" and do not fail the check.
"""
from __future__ import annotations

import argparse
import sys

from rl.envs.swe.grader import grade
from rl.envs.swe.sandbox import Limits


def verdict(task, runtime: dict, timeout_s: float, limits: Limits) -> dict:
    """{row, playable (True/False/None), ref, base, why} of one task."""
    out = {"row": task.instance_id, "playable": None, "ref": None, "base": None, "why": ""}
    why = []
    try:
        b = grade(task, limits=limits, timeout_s=timeout_s, runtime=runtime)
        out["base"] = b.reward
        if b.reward >= 1.0:
            why.append("the base tree already scores 1.0: nothing to fix")
    except Exception as e:  # a row whose test_patch does not apply, a repository missing a commit, ...
        why.append(f"base: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}")
    if not task.patch:
        out["why"] = "; ".join(why + ["no reference patch to check"])
        out["playable"] = False if why else None
        return out
    try:
        r = grade(task, extra_patch=task.patch, limits=limits, timeout_s=timeout_s, runtime=runtime)
        out["ref"] = r.reward
        if r.grading_error:
            why.insert(0, f"reference: grading error: {r.grading_error}")
        elif r.reward < 1.0:
            failed = ", ".join(r.failed[:3]) + (f" (+{len(r.failed) - 3})" if len(r.failed) > 3 else "")
            why.insert(0, f"reference scores {r.reward:.2f}: fails {failed}")
    except Exception as e:
        why.insert(0, f"reference: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}")
    out["playable"], out["why"] = not why, "; ".join(why)
    return out


def table(rows: list[dict]) -> str:
    def num(x):
        return "-" if x is None else f"{x:.2f}"

    cells = [("row", "playable", "reference", "base", "why not")]
    cells += [(r["row"], {True: "yes", False: "NO", None: "?"}[r["playable"]], num(r["ref"]), num(r["base"]),
               r["why"]) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(4)) + "  " + c[4] for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * 7)
    return "\n".join(x.rstrip() for x in lines)


def main(argv: list[str] | None = None) -> int:
    from rl.envs.swe.datasets import load_tasks
    from rl.envs.swe.env import playable_under
    ap = argparse.ArgumentParser(prog="python -m rl.envs.swe.check", description=__doc__.split("\n\n")[0])
    ap.add_argument("dataset")
    ap.add_argument("--runtime", default="inprocess")
    ap.add_argument("--repos-dir", default=None)
    ap.add_argument("--split", default=None)
    ap.add_argument("--format", default="auto")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--only", nargs="*", default=None, help="instance ids to check (default: every row)")
    a = ap.parse_args(argv)
    try:
        rows = playable_under(load_tasks(a.dataset, a.format, None, a.split), a.runtime, a.repos_dir, a.dataset)
    except (ValueError, OSError) as e:
        print(f"{a.dataset}: cannot be loaded: {e}", file=sys.stderr)
        return 2
    if a.only:
        rows = [t for t in rows if t.instance_id in set(a.only)]
    runtime = {"name": a.runtime}
    limits = Limits(cpu_s=max(60, int(a.timeout)))
    out = []
    for t in rows:
        out.append(verdict(t, runtime, a.timeout, limits))
        print(f"checked {t.instance_id}", file=sys.stderr, flush=True)
    print(table(out))
    bad = sum(r["playable"] is False for r in out)
    print(f"\n{len(out)} rows: {sum(r['playable'] is True for r in out)} playable, {bad} unplayable"
          + (f", {sum(r['playable'] is None for r in out)} unchecked" if any(r['playable'] is None for r in out) else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
