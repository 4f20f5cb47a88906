"""`python -m launch export RUN_DIR [--step N] --out DIR [--dtype bfloat16|fp8]`: the command line of rl.export.

The torch side (reading the DCP checkpoint, the family's adapter, the shard writer) lives in rl.export
and runs as a child process, `python -m rl.export`, as `launch doctor` runs `python -m rl.doctor`: the
launcher imports no role and no torch (tests/unit/test_contract.py follows every import of launch to the
end), so a login node without torch still parses, checks and reports this command, and a change to
the trainer cannot slow or break `launch plan`. The flags are checked here first (argparse, one line);
the child inherits stdout and stderr, so its progress line and its one-line errors reach the user as
they are, and its exit status is this command's: 2 for what was asked (no such step, an output directory
in the way or reached through a symlink), 1 for a checkpoint that does not verify or holds a NaN or inf
(named with its step), never a traceback. Its last line on success is how to serve what it wrote (the
vLLM command per platform, with the family's flags); the export's README.md says why each flag is there
and what an FP8 export needs (rl/serving.py, docs/export.md).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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


def child_argv(ns) -> list[str]:
    """The child's command line: `python -m rl.export` with the flags as parsed here."""
    argv = [sys.executable, "-m", "rl.export", str(ns.run_dir), "--out", str(ns.out), "--dtype", ns.dtype]
    return argv + (["--step", str(ns.step)] if ns.step is not None else [])


def run(ns) -> int:
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    p = subprocess.Popen(child_argv(ns), env=env)
    try:
        return p.wait()
    except KeyboardInterrupt:
        # the child got the same SIGINT: let it remove its partial directory before returning
        p.wait()
        raise
