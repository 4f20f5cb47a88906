"""Step metrics: one JSON line per trainer step in `RUN_DIR/metrics.jsonl`, mirrored to wandb.

The JSONL file is the source of truth (the launcher's progress line, `launch status` and the tests read
it); wandb is a view. The wandb run id is created once and kept in `RUN_DIR/wandb_id`, so a resumed or
requeued job continues the same run; offline, wandb starts a new folder per process with its own step
counter, so every log call passes `step=` explicitly to keep the axis continuous (the folders merge at
`wandb sync`). The trainer logs the orchestrator's numbers too (they travel in each rollout batch's
metadata), which makes one wandb run for both roles.

Every line read back passes its schema (rl.contract.record_schemas: `metrics_line` here, `eval_result`
for eval/results.jsonl); a line that does not is skipped with one warning naming file:line and reason,
so a hand-edited or hostile line never crashes the trainer (which folds evaluation rows in every step)
nor rl.prepare's truncation on a resume. Writes go through rl.contract.safefs (no link followed).
"""
from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from rl.contract import record_schemas, safefs
from rl.contract.paths import METRICS as METRICS_FILE  # noqa: E402
from rl.contract.paths import eval_results_file

_warned: set[str] = set()


def read_metrics(run_dir: str | os.PathLike, *, final_eval: bool = False) -> list[dict]:
    """The trainer's line per step, in order. The final version's evaluation comes after the last step as
    a line of its own (`step` = max_steps, `eval/...` keys, no loss): included with `final_eval=True`."""
    from rl.exchange.jsonl import read_jsonl  # torch-free, like this module
    # a killed trainer's torn last line is skipped, a malformed one skipped with a warning
    rows = read_jsonl(Path(run_dir) / METRICS_FILE, check=record_schemas.metrics_line)
    return rows if final_eval else [m for m in rows if not is_eval_only(m)]


def read_eval_results(run_dir: str | os.PathLike) -> list[dict]:
    """eval/results.jsonl's well-formed lines (record_schemas.eval_result), in order."""
    from rl.exchange.jsonl import read_jsonl
    return read_jsonl(eval_results_file(run_dir), check=record_schemas.eval_result)


def is_eval_only(m: dict) -> bool:
    """A metrics line that carries an evaluation and no training step (the final version's)."""
    return "eval/version" in m and "loss" not in m


def _keep_lines(path: Path, check, keep) -> None:
    """Rewrite a JSONL record with only the well-formed lines for which `keep(line)` holds (atomically,
    never through a link). A malformed line was warned about by the read and is not carried over: no
    reader could use it, and what it held cannot be told (its step or version is what is malformed)."""
    from rl.contract.atomic import atomic_write_bytes
    from rl.exchange.jsonl import read_jsonl
    if safefs.lstat(path) is None:
        return
    atomic_write_bytes(path, "".join(json.dumps(m) + "\n" for m in read_jsonl(path, check) if keep(m)).encode())


def truncate_metrics(run_dir: str | os.PathLike, first_dropped_step: int) -> None:
    """Keep only lines of steps before `first_dropped_step` (a resume replays the later ones)."""
    _keep_lines(Path(run_dir) / METRICS_FILE, record_schemas.metrics_line, lambda m: m["step"] < first_dropped_step)


class EvalFold:
    """Online evaluation's rows (`eval/results.jsonl`, written by the orchestrator) folded into the
    trainer's metrics, so that metrics.jsonl and wandb keep one writer. Each new row's `eval/...` keys go
    into the next step's line (the newest row wins when several arrived between two steps; the results
    file keeps them all); the rows already folded in by an earlier incarnation are known from
    metrics.jsonl (`eval/version`)."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.seen = {m["eval/version"] for m in read_metrics(run_dir, final_eval=True) if "eval/version" in m}

    def rows(self) -> list[dict]:
        """The well-formed rows. Evaluation is a view: a results file that cannot be read safely (a link
        or FIFO in its place) is reported once and read as empty, never a reason to stop training."""
        try:
            return read_eval_results(self.run_dir)
        except safefs.UnsafePath as e:
            if str(e) not in _warned:
                _warned.add(str(e))
                print(f"[metrics] evaluation rows not folded in: {e}", flush=True)
            return []

    def new(self) -> dict:
        out: dict = {}
        for r in sorted(self.rows(), key=lambda r: r["version"]):
            if r["version"] not in self.seen:
                self.seen.add(r["version"])
                out.update({k: v for k, v in r.items() if k.startswith("eval/")})
        return out

    def has(self, version: int) -> bool:
        return any(r["version"] == version for r in self.rows())


def truncate_eval(run_dir: str | os.PathLike, last_kept_version: int) -> None:
    """Drop the evaluations of versions after `last_kept_version` (a resume trains them again)."""
    _keep_lines(eval_results_file(run_dir), record_schemas.eval_result, lambda r: r["version"] <= last_kept_version)


_WANDB_ID = 64   # the id is 8 hex digits; a larger file in its place is not one hetrl wrote


def wandb_run_id(run_dir: str | os.PathLike) -> str:
    """The run's wandb id, created once (exclusively, never through a link) and read back after."""
    p = Path(run_dir) / "wandb_id"
    try:
        fd = safefs.open_write(p, exclusive=True)
    except FileExistsError:
        pass
    else:
        try:
            os.write(fd, secrets.token_hex(4).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
    rid = safefs.read_text(p, limit=_WANDB_ID).strip()
    if not rid or not all(c.isalnum() or c in "-_" for c in rid):
        raise ValueError(f"{p}: {record_schemas.shown(rid)} is not a wandb run id (letters, digits, - and _)")
    return rid


class MetricsLogger:
    def __init__(self, run_dir: str | os.PathLike, cfg: Any, role: str = "trainer"):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.wandb = None
        mode = cfg.wandb.mode
        if mode != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb
            from omegaconf import OmegaConf
            self.wandb = wandb.init(
                id=wandb_run_id(self.run_dir), resume="allow", mode=mode, project=cfg.wandb.project,
                entity=cfg.wandb.entity, dir=str(self.run_dir), name=self.run_dir.name,
                config=OmegaConf.to_container(cfg, resolve=True), job_type=role,
                settings=wandb.Settings(console="off", x_disable_stats=True),
            )

    def log(self, step: int, metrics: dict) -> None:
        from rl.exchange import append_jsonl, check_fence
        check_fence(self.run_dir, f"metrics.jsonl: step {step}")
        # one fsynced line, a crash's torn last line ended first, never through a link (rl.exchange.jsonl)
        append_jsonl(self.path, {"step": step, **metrics})
        if self.wandb is not None:
            try:
                self.wandb.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)
            except Exception as e:  # noqa: BLE001 - wandb is a view; metrics.jsonl is the record
                self._drop_wandb(e)

    def _drop_wandb(self, e: BaseException) -> None:
        # On preemption Slurm sends SIGTERM to every process of the step, wandb's service included:
        # the trainer must still checkpoint, so wandb goes quiet instead of taking the role down.
        print(f"[metrics] wandb stopped working ({type(e).__name__}: {e}); metrics continue in "
              f"{self.path} only", flush=True)
        self.wandb = None

    def close(self) -> None:
        if self.wandb is not None:
            try:
                self.wandb.finish()
            except Exception as e:  # noqa: BLE001
                self._drop_wandb(e)
            self.wandb = None
