"""Every JSON-lines record is read through its schema (rl/contract/record_schemas.py): hostile lines are
written into a real run directory and read by the roles' own reading functions (the trainer's
evaluation fold, the orchestrator's resume and evaluator, rl.prepare's truncation), which must skip each
with one warning naming file:line and never raise. Also the writers in rl.metrics never follow a link.
"""
from __future__ import annotations

import ast
import json
import logging
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rl import exchange
from rl.contract import record_schemas, safefs
from rl.contract.config import Config
from rl.contract.records import RecordError, ResumeState


def _run_dir(path: Path) -> Path:
    cfg = OmegaConf.structured(Config)
    cfg.run_dir = str(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    return path


def _lines(path: Path, *lines) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))


def _skips(caplog, path: Path) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"{path}:")]


BAD_EVAL = ['{"version": "x", "eval/reward_mean": 1.0}',      # version not an integer
            '{"eval/reward_mean": 1.0}',                        # no version
            '{"version": 2, "eval/reward_mean": {"a": 1}}',     # not a scalar
            '{"version": 3, "eval/reward_mean": NaN}',          # not finite
            '{"version": 4, "eval/version": 5}',                # disagrees with its line
            '{"version": 1e400}',                               # inf
            '[1, 2]']


def test_malformed_eval_rows_never_crash_the_trainer_the_orchestrator_or_prepare(tmp_path, caplog):
    """The probe: a malformed eval/results.jsonl row crashed the trainer on every step and restart."""
    from rl.metrics import EvalFold, truncate_eval
    from rl.orchestrator.evaluation import read_results
    run = _run_dir(tmp_path / "run")
    f = run / "eval" / "results.jsonl"
    _lines(f, *BAD_EVAL, {"version": 1, "eval/version": 1, "eval/reward_mean": 0.5, "eval/error": None})
    caplog.set_level(logging.WARNING, "hetrl.records")
    fold = EvalFold(run)                      # the trainer, every step
    assert fold.new() == {"eval/version": 1, "eval/reward_mean": 0.5, "eval/error": None}
    assert fold.has(1) and not fold.has(2)
    assert [r["version"] for r in read_results(run)] == [1]   # the orchestrator's Evaluator on resume
    truncate_eval(run, 0)                     # rl.prepare on a resume
    assert read_results(run) == []
    skipped = _skips(caplog, f)
    assert len(skipped) == len(BAD_EVAL), skipped   # one line per bad line, once per process
    assert all("\n" not in s for s in skipped)
    assert f"{f}:1: record skipped (version='x' is not a policy version)" in skipped
    assert f"{f}:4: record skipped (eval/reward_mean=nan is not a finite number, a string or null)" in skipped
    assert f"{f}:5: record skipped (eval/version=5 is not its line's version 4)" in skipped


def test_malformed_metrics_lines_are_skipped_by_every_reader(tmp_path, caplog):
    """`eval/version` of the wrong type crashed the trainer's start (EvalFold), a string step crashed
    rl.prepare's truncation (TypeError). A non-finite loss is a record (a skipped update logs it)."""
    from rl.metrics import EvalFold, read_metrics, truncate_metrics
    run = _run_dir(tmp_path / "run")
    f = run / "metrics.jsonl"
    _lines(f, {"step": 0, "loss": 1.0}, {"step": "3", "loss": 1.0}, {"step": 1, "eval/version": "x"},
           {"loss": 2.0}, {"step": 2, "loss": float("nan"), "nested": {"a": 1}},
           {"step": 4, "eval/version": 4, "eval/reward_mean": 1.0}, '{"step": 3, "loss": NaN, "update_skipped": 1}')
    caplog.set_level(logging.WARNING, "hetrl.records")
    assert [m["step"] for m in read_metrics(run, final_eval=True)] == [0, 4, 3]
    assert EvalFold(run).seen == {4}
    truncate_metrics(run, 1)
    assert [m["step"] for m in read_metrics(run, final_eval=True)] == [0]
    assert len(_skips(caplog, f)) == 4


def test_malformed_group_log_lines_do_not_stop_the_orchestrator_from_resuming(tmp_path, caplog):
    """The probe: a groups.jsonl line without a group (KeyError) or with a list for one (TypeError)
    stopped every resume; a drop of rollout indices beyond the group is not believed either."""
    from rl.orchestrator.grouplog import GroupLog, resume_order, unresolved
    run = _run_dir(tmp_path / "run")
    log = GroupLog(run, restart=0)
    for g in range(4):
        log.started(g, 0)
    f = run / "rollouts" / "groups.jsonl"
    with open(f, "a") as out:
        for ln in ('{"event": "drop"}', '{"event": "start", "group": [1], "version": 0}',
                   '{"event": "start", "group": "7", "version": 0}', '{"event": "start", "group": 9}',
                   '{"event": "explode", "group": 1}', '{"event": "drop", "group": 1, "reason": "x", "step": 0, '
                   '"rollouts": [0, 9]}', '{"event": "drop", "group": 2, "reason": "stale", "step": "one"}'):
            out.write(ln + "\n")
    log.dropped(3, "stale", 1)
    caplog.set_level(logging.WARNING, "hetrl.records")
    assert resume_order(run) == ([0, 2], 4)   # the unlogged-looking drop of 1 (rollouts [0, 9]) counts
    assert resume_order(run, 4) == ([0, 1, 2], 4)   # with the group size it is refused: 1 is played again
    from rl.orchestrator.grouplog import resume_plan   # the pool's one read of both
    assert resume_plan(run, 4)[:2] == ([0, 1, 2], 4)
    assert unresolved(run, exclude={0}, group_size=4) == [1, 2]
    skipped = _skips(caplog, f)
    assert any("rollouts=[0, 9] is not a list of distinct rollout indices below group_size=4" in s for s in skipped)
    assert any(":5: record skipped (no 'group')" in s for s in skipped)
    assert any(":8: record skipped (no 'version')" in s for s in skipped)
    assert any(":11: record skipped (step='one' is not a step number (or -1))" in s for s in skipped)


def test_consumed_records_have_a_schema(tmp_path, caplog):
    """rollouts/consumed.jsonl: what rl.exchange.ConsumedLog passes to read_jsonl."""
    f = tmp_path / "consumed.jsonl"
    _lines(f, {"step": 0, "consumer": "trainer", "restart": 0, "sha256": "a" * 64, "time": 1.0},
           {"step": 1, "consumer": "trainer", "applied": False},
           {"step": "2", "consumer": "trainer"}, {"step": 3}, {"step": 4, "consumer": "trainer", "restart": -1},
           {"step": 5, "consumer": "trainer", "sha256": 7}, {"step": 6, "consumer": "trainer", "applied": "no"})
    caplog.set_level(logging.WARNING, "hetrl.records")
    assert [r["step"] for r in exchange.read_jsonl(f, check=record_schemas.consumed)] == [0, 1]
    assert len(_skips(caplog, f)) == 5


def test_every_reader_of_a_record_in_rl_passes_a_check():
    """A list built from the code: every read_jsonl call in rl/ names the schema of what it reads, so a
    new reader without one fails here."""
    root = Path(__file__).resolve().parents[2] / "rl"
    calls, missing = 0, []
    for py in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(py.read_text())):
            f = node.func if isinstance(node, ast.Call) else None
            if getattr(f, "id", getattr(f, "attr", None)) == "read_jsonl":
                calls += 1
                if len(node.args) < 2 and not any(k.arg == "check" for k in node.keywords):
                    missing.append(f"{py.relative_to(root.parent)}:{node.lineno}")
    assert calls >= 6 and not missing, f"read_jsonl without a check: {missing}"


def test_resume_json_discarded_must_be_step_lists(tmp_path):
    (tmp_path / "resume.json").write_text(json.dumps({"restart": 0, "discarded": {"rollouts": ["x"]}}))
    with pytest.raises(RecordError, match=r"discarded=\{'rollouts': \['x'\]\} is not an object of step lists"):
        ResumeState.read(tmp_path)
    (tmp_path / "resume.json").write_text(json.dumps({"restart": 0, "discarded": {"rollouts": [3, 4]}}))
    assert ResumeState.read(tmp_path).discarded == {"rollouts": [3, 4]}


def test_a_fifo_in_place_of_eval_results_is_reported_not_a_crash_loop(tmp_path, capsys):
    """Evaluation is a view: the trainer folding rows in every step reports a FIFO (or link) once and
    trains on, never blocking on it or dying on every step."""
    from rl.metrics import EvalFold
    run = _run_dir(tmp_path / "run")
    (run / "eval").mkdir()
    os.mkfifo(run / "eval" / "results.jsonl")
    fold = EvalFold(run)
    assert fold.new() == {} and fold.new() == {} and not fold.has(0)
    out = capsys.readouterr().out
    assert out.count("evaluation rows not folded in") == 1 and "a FIFO" in out


def test_prepare_refuses_a_fifo_record_in_one_line(tmp_path, capsys):
    """rl.prepare reads metrics.jsonl to truncate it: a FIFO there is one line on exit, no traceback."""
    from rl.prepare import main
    run = _run_dir(tmp_path / "run")
    os.mkfifo(run / "metrics.jsonl")
    with pytest.raises(SystemExit) as e:
        main(["--run-dir", str(run)])
    assert str(e.value).startswith(f"[prepare] error: {run / 'metrics.jsonl'}: a FIFO")
    assert "\n" not in str(e.value)


def test_metrics_writers_never_follow_a_planted_link(tmp_path):
    """metrics.jsonl and wandb_id linked to a file of the user's: refused, the file untouched (the old
    writer appended through the link, and read a linked wandb_id as the run's id)."""
    from rl.metrics import MetricsLogger, truncate_metrics, wandb_run_id
    run = _run_dir(tmp_path / "run")
    victim = tmp_path / "authorized_keys"
    victim.write_text("ssh-ed25519 AAAA user\n")
    os.symlink(victim, run / "metrics.jsonl")
    os.symlink(victim, run / "wandb_id")
    logger = MetricsLogger(run, OmegaConf.create({"wandb": {"mode": "disabled"}}))
    with pytest.raises(safefs.UnsafePath, match="a symlink"):
        logger.log(0, {"loss": 1.0})
    with pytest.raises(safefs.UnsafePath, match="a symlink"):
        truncate_metrics(run, 0)
    with pytest.raises(safefs.UnsafePath, match="a symlink"):
        wandb_run_id(run)
    assert victim.read_text() == "ssh-ed25519 AAAA user\n"
    os.unlink(run / "wandb_id")
    rid = wandb_run_id(run)
    assert wandb_run_id(run) == rid and len(rid) == 8
