"""`python -m launch export RUN_DIR [--step N] --out DIR [--dtype bfloat16|fp8]`: the command line of rl.export.

The torch side (reading the DCP checkpoint, the family's adapter, the shard writer) lives in rl.export
and is imported only when this command runs, so `launch plan` and `launch status` stay light. Errors come
back as one line naming the file or flag at fault: a ConfigError for what was asked (no such step, an
output directory in the way, an unknown dtype) and `error: ...` for a checkpoint that does not verify.
"""
from __future__ import annotations

import sys


def add_arguments(s) -> None:
    s.add_argument("run_dir")
    s.add_argument("--out", required=True, help="the HF checkpoint directory to write (new or empty)")
    s.add_argument("--step", type=int, default=None,
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
    except (CorruptStep, CheckpointError) as e:  # a checkpoint that does not verify or cannot be read
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
