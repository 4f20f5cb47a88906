"""The torch side of `python -m launch doctor`: checks that need torch, run in a child process.

`launch doctor` stays free of torch (a login node plans and submits without it) and runs
`python -m rl.doctor --out FILE [--gpu] [--device cpu|cuda]` for everything that needs torch: the
torch build and its CUDA devices, the optional kernels (`env`), and with `--gpu` the trainer step of
every family from its tiny twin in bf16 and FP8 against transformers (`steps`), a mid-size model's
throughput and memory against rl.plan_math.memory's estimate (`throughput`), and the FP8 weight publish
against a raw write and a bf16 save, with an optional vLLM load of the published shards (`publish`).
`guard` is the device check the steps run under.

Every check is a row: {"check", "status" (pass | fail | skip | info), "figure" (what was measured),
"note" (what it means, or what to do when it failed), "data" (numbers for the JSON)}. A check that
raises becomes a failed row with the exception's first line, so one broken path never hides the
others.
"""
from __future__ import annotations

import sys
import time
import traceback
from typing import Callable

_T0 = time.perf_counter()

STATUSES = ("pass", "fail", "skip", "info")
MID_CHECKS = ("mid-size model", "mid-size memory: parameters", "mid-size memory: gradients",
              "mid-size memory: optimizer states", "mid-size memory: activations + loss",
              "mid-size memory: peak vs estimate", "mid-size tokens/s", "mid-size MFU",
              "FP8 publish vs raw write", "FP8 publish vs bf16 save", "FP8 publish: trainer blocked",
              "vLLM load of the FP8 shards + generate")


def gpu_checks(families) -> list[str]:
    """The names of the --gpu rows, in order: every run of the doctor shows each of them (a skip when
    not asked, or when an earlier check it depends on failed)."""
    return ["GPU checks device"] + [f"{f}: {c}" for f in families
            for c in ("logits vs transformers", "trainer step bf16", "trainer step FP8")] + list(MID_CHECKS)


def fill(rows: list[dict], names: list[str], why: str) -> list[dict]:
    """`rows` with a skip row (reason `why`) for every name in `names` that has none, in `names`' order."""
    have = {r["check"] for r in rows}
    out = list(rows)
    for n in names:
        if n not in have:
            out.append(row(n, "skip", "not run", why))
    return out


def row(check: str, status: str, figure: str = "", note: str = "", **data) -> dict:
    if status not in STATUSES:
        raise ValueError(f"row {check!r}: status {status!r} is not one of {', '.join(STATUSES)}")
    # one progress line per row as it is made (stderr: the child's log), so a run cut short by a time
    # limit still says which checks finished and how long the rest took
    print(f"[doctor {time.perf_counter() - _T0:7.1f} s] {status:4s} {check}: {figure[:160]}", file=sys.stderr,
          flush=True)
    return {"check": check, "status": status, "figure": figure, "note": note, "data": data}


def guarded(check: str, fn: Callable[[], list[dict] | dict], fix: str = "") -> list[dict]:
    """Run one check; its exception becomes a failed row naming it (first line, plus where it came from)."""
    t0 = time.perf_counter()
    try:
        out = fn()
        return out if isinstance(out, list) else [out]
    except Exception as e:  # noqa: BLE001 - every failure is a row, never the end of the report
        tb = traceback.extract_tb(e.__traceback__)
        where = f" ({tb[-1].filename.rsplit('/', 2)[-1]}:{tb[-1].lineno})" if tb else ""
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        return [row(check, "fail", f"{type(e).__name__}: {msg}{where}", fix,
                    seconds=round(time.perf_counter() - t0, 2))]
