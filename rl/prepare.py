"""Before the roles start: decide where this incarnation of the run resumes from.

`python -m rl.prepare --run-dir D` runs once per job start (local backend and batch script alike), while
no role is running. It finds the newest complete checkpoint c (verified against its manifest), removes
`*.tmp-*` leftovers of producers that crashed mid-publish, and discards weights and rollout batches
newer than c: weights after c came from optimizer steps the checkpoint does not hold, and a rollout batch
after c may have been sampled from such weights. Rollout batches up to c stay: they were sampled from
versions <= c, which the restored lineage reproduces. The decision is written to `D/resume.json` so
every role acts on the same one. No torch.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from rl import exchange
from rl.exchange import atomic_write_json

KINDS = ("rollouts", "weights", "checkpoints", "assets")


def prepare(run_dir: str | Path) -> dict:
    run_dir = Path(run_dir)
    cleaned = exchange.clean_tmp(run_dir, KINDS)
    # Server records of the previous incarnation point at dead processes.
    for stale in [*(run_dir / "inference").glob("server_*.json"), run_dir / "inference" / "router.json"]:
        stale.unlink(missing_ok=True)
    ckpt = exchange.latest_complete(run_dir, "checkpoints", checksums=True)
    discarded = {}
    if ckpt is not None:
        discarded["weights"] = exchange.discard_after(run_dir, "weights", ckpt)
        discarded["rollouts"] = exchange.discard_after(run_dir, "rollouts", ckpt)
    else:
        # No checkpoint: the trainer starts from scratch, so nothing downstream of version 0 is valid.
        discarded["weights"] = exchange.discard_after(run_dir, "weights", -1)
        discarded["rollouts"] = exchange.discard_after(run_dir, "rollouts", -1)
    from rl.metrics import truncate_metrics
    truncate_metrics(run_dir, ckpt if ckpt is not None else 0)
    prev = {}
    if (run_dir / "resume.json").exists():
        prev = json.loads((run_dir / "resume.json").read_text())
    state = {
        "checkpoint_step": ckpt,
        "restart": prev.get("restart", -1) + 1,
        "discarded": discarded,
        "cleaned_tmp": cleaned,
    }
    atomic_write_json(run_dir / "resume.json", state)
    (run_dir / "DONE").unlink(missing_ok=True) if _more_steps_wanted(run_dir, ckpt) else None
    return state


def _more_steps_wanted(run_dir: Path, ckpt: int | None) -> bool:
    """A finished run resubmitted with a larger trainer.max_steps continues: its DONE marker goes."""
    from omegaconf import OmegaConf
    cfg = OmegaConf.load(run_dir / "config.yaml")
    return ckpt is None or ckpt < cfg.trainer.max_steps


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m rl.prepare")
    p.add_argument("--run-dir", required=True, type=Path)
    ns = p.parse_args(argv)
    state = prepare(ns.run_dir)
    where = "from scratch" if state["checkpoint_step"] is None else f"from checkpoint step {state['checkpoint_step']}"
    gone = {k: v for k, v in state["discarded"].items() if v}
    print(f"[prepare] restart {state['restart']}: resuming {where}"
          + (f"; discarded {gone}" if gone else ""), flush=True)


if __name__ == "__main__":
    main()
