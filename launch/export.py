"""`python -m launch export RUN_DIR [--step N] --out DIR [--dtype bfloat16|fp8]`: the command line of rl.export.

The torch side (reading the DCP checkpoint, the family's adapter, the shard writer) lives in rl.export
and is imported only when this command runs, so `launch plan` and `launch status` stay light. Errors come
back as one line naming the file or flag at fault: a ConfigError for what was asked (no such step, an
output directory in the way or reached through a symlink, an unknown dtype) and `error: ...` for a
checkpoint that does not verify or holds a NaN or inf (named with its step), never a traceback.
"""
from __future__ import annotations

import sys


def _step(text: str) -> int:
    """argparse type: a checkpoint step, a non-negative integer (refused in one line otherwise)."""
    import argparse
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v} is not a step (steps count from 0)")
    return v


def add_arguments(s) -> None:
    s.add_argument("run_dir")
    s.add_argument("--out", required=True, help="the HF checkpoint directory to write (new or empty)")
    s.add_argument("--step", type=_step, default=None,
                   help="the checkpoint to export (checkpoints/step_N); default: the newest complete one")
    s.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "fp8"),
                   help="bfloat16, or block-FP8 (e4m3, 128x128 blocks, as the official FP8 releases)")


def run(ns) -> int:
    from rl import export
    from rl.contract.hf import CheckpointError
    from rl.exchange import CorruptStep
    try:
        export.export(ns.run_dir, ns.out, step=ns.step, dtype=ns.dtype,
                      log=lambda msg: print(msg, flush=True))
    except (CorruptStep, CheckpointError, export.NonFiniteWeights) as e:
        # a checkpoint that does not verify, cannot be read or holds a NaN or inf
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
