"""The user's tools refuse hostile input from the run directory: report, status, export, cancel, doctor.

Each test plants what an attacker with write access to a shared run directory (or a hostile dataset or
model output) would, and runs the real command on it: a symlink where the report writes its page, a
config value that is a script, records of the wrong shape and FIFOs in records' places, a million-token
prompt, a checkpoint holding NaN, `--out` through a link, a `launcher.lock` linked to /dev/null or to
another run's lock, and nonsense arguments. The answer is always one line and nothing written, read
through, signalled or hung on.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from builders import make_run_dir

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("hostile") / "run"
    make_run_dir(run, "wandb.mode=disabled")
    return run


@pytest.fixture
def run(base_run, tmp_path):
    """A fresh copy of a frozen run directory (config.yaml, plan.json, secret) to plant things in."""
    dst = tmp_path / "run"
    shutil.copytree(base_run, dst, symlinks=True)
    return dst


def _report_ns(run_dir, *args):
    from launch import report
    ap = argparse.ArgumentParser()
    report.add_arguments(ap)
    return ap.parse_args([str(run_dir), *args])


def _publish_batch(run_dir, step, prompt_len=6, completion=4, meta=None):
    from rl import exchange
    from rl.contract.batch import RolloutBatch, Sample
    s = Sample(list(range(10, 10 + prompt_len)), [20 + i for i in range(completion)], [-0.5] * completion,
               [step] * completion, reward=1.0, group=0)
    batch = RolloutBatch.from_samples([s], meta=meta or {"prompt_tokens": [prompt_len]})
    exchange.publish(run_dir, "rollouts", step, batch.save, producer="test")
    return exchange.step_dir(run_dir, "rollouts", step)


# -- report -----------------------------------------------------------------------------------------------
def test_report_never_writes_through_a_planted_link(run, tmp_path, capsys):
    from launch import report
    victim = tmp_path / "authorized_keys"
    victim.write_text("ssh-ed25519 AAAA the user's key\n")
    os.symlink(victim, run / "report.html.tmp")   # the fixed temp name of before
    assert report.run(_report_ns(run)) == 0
    assert victim.read_text() == "ssh-ed25519 AAAA the user's key\n"
    assert (run / "report.html").is_file() and not (run / "report.html").is_symlink()
    assert not [p for p in run.iterdir() if ".tmp" in p.name and p.name != "report.html.tmp"]

    (run / "report.html").unlink()
    os.symlink(victim, run / "report.html")       # the page itself a link: refused, not replaced or followed
    capsys.readouterr()
    assert report.run(_report_ns(run)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "symlink" in err[0] and "report.html" in err[0], err
    assert victim.read_text() == "ssh-ed25519 AAAA the user's key\n" and (run / "report.html").is_symlink()

    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "linked")          # --out into a symlinked directory: one line, nothing written
    assert report.run(_report_ns(run, "--out", str(tmp_path / "linked" / "r.html"))) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --out") and "symlink" in err[0], err
    assert list(real.iterdir()) == []


def test_report_escapes_every_config_value(run):
    import yaml

    from launch import report
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["trainer"]["max_steps"] = "<script>alert(1)</script>"
    cfg["orchestrator"]["schedule"] = "<img src=x onerror=alert(2)>"
    cfg["experiment"] = "</title><script>alert(3)</script>"
    cfg["model"]["name"] = "x" * 100_000
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    page = report.render(run)
    assert "<script" not in page and "<img" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "&lt;img src=x onerror=alert(2)&gt;" in page
    assert "x" * 1000 not in page and "more characters not shown" in page
    # a config.yaml that is not a mapping: the page is still made and says why
    (run / "config.yaml").write_text("- just\n- a list\n")
    notes: list[str] = []
    report.render(run, notes=notes)
    assert any("config.yaml" in n and "not a mapping" in n for n in notes), notes


@pytest.mark.timeout(30)
def test_axes_terminate_and_draw_any_finite_range():
    from launch.report_svg import line_chart, nice_ticks
    big = sys.float_info.max
    for lo, hi in [(1e16, 1e16 + 2), (1e16, 1e16), (2.0 ** 60, 2.0 ** 60 + 512), (-big, big), (big, big),
                   (0.0, 1e-320), (-5.0, -5.0), (0.0, 1.0), (3.0, 17.0)]:
        ticks = nice_ticks(lo, hi)
        assert 2 <= len(ticks) <= 7 and all(a < b for a, b in zip(ticks, ticks[1:])), (lo, hi, ticks)
        assert all(math.isfinite(t) for t in ticks) and ticks[0] <= lo and ticks[-1] >= hi * (1 - 1e-12) - 1e-300
    assert nice_ticks(3, 17) == [0.0, 5.0, 10.0, 15.0, 20.0]
    for bad in [(math.nan, 1.0), (0.0, math.inf), (10 ** 400, 1)]:
        with pytest.raises(ValueError, match="not finite"):
            nice_ticks(*bad)
    for pts in ([(1e16, 0.1), (1e16 + 2, 0.2)], [(0, -big), (1, big)], [(10 ** 400, 1.0), (2, 2.0)],
                [(i, float(i)) for i in range(10_000)]):
        svg = line_chart("t", [("s", pts)], markers=[(1e16, "restart")])
        assert "nan" not in svg and "inf" not in svg
    assert "one in 5 drawn" in line_chart("t", [("s", [(i, float(i)) for i in range(10_000)])])
    assert len(line_chart("t", [("s", [(i, float(i)) for i in range(10 ** 6)])])) < 2 << 20


@pytest.mark.timeout(60)
def test_report_names_each_record_it_could_not_read_and_draws_the_rest(run, capsys):
    from launch import report
    good = [{"step": 0, "reward_mean": 0.25, "time": 1.0}, {"step": 1, "reward_mean": 0.5, "time": 2.0}]
    lines = [json.dumps(good[0]), "[1, 2]", '"a string"', "NaN", json.dumps({"step": "x", "reward_mean": 1}),
             json.dumps({"step": [1]}), '{"step": 3, "reward_mean": 1, "time": "noon"}',
             '{"step": 4, "reward_mean": 1' + "0" * 400 + "}", json.dumps(good[1]),
             json.dumps({"step": 10 ** 16, "reward_mean": 0.1}), json.dumps({"step": 10 ** 16 + 2, "reward_mean": 0.2}),
             json.dumps({"eval/policy_version": 1, "eval/a/acc": "<b>high</b>", "eval/b/acc": 0.5}),
             json.dumps({"eval/policy_version": "v2", "eval/a/acc": 0.75})]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run / "rollouts").mkdir(exist_ok=True)
    (run / "rollouts" / "consumed.jsonl").write_text('{"step": 1, "time": "x", "restart": 1}\n'
                                                   '{"step": 1, "restart": "a"}\n{"step": 0, "restart": 0}\n')
    (run / "roles").mkdir(exist_ok=True)
    (run / "roles" / "history.jsonl").write_text('{"role": "trainer", "slurm_restart_count": "abc"}\n'
                                                '{"role": ["x"]}\n{"role": "trainer", "host": "n1"}\n')
    (run / "incarnations").mkdir(exist_ok=True)
    (run / "incarnations" / "restart_0.json").write_text('{"restart": 0, "time": 1e300}')
    (run / "incarnations" / "restart_1.json").write_text("garbage")
    (run / "incarnations" / "restart_2.json").write_text('{"restart": "two"}')
    os.mkfifo(run / "slurm_jobs.jsonl")   # would block a reader that opens it
    (run / "resume.json").write_text("[]")
    bad_step = _publish_batch(run, 1)
    meta = json.loads((bad_step / "meta.json").read_text())
    (bad_step / "meta.json").write_text(json.dumps({**meta, "prompt_tokens": [3]}))  # changed after publishing

    assert report.run(_report_ns(run)) == 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert err and all(ln.startswith("report: ") for ln in err) and "Traceback" not in "\n".join(err), err
    said = "\n".join(err)
    for expected in ["metrics.jsonl:2: record skipped (a JSON list, not an object)",
                     "metrics.jsonl:4: record skipped (a JSON float", "metrics.jsonl:5: record skipped (step='x'",
                     "metrics.jsonl:7: record skipped (time='noon'", "consumed.jsonl:2: record skipped (restart='a'",
                     "history.jsonl:1: record skipped (slurm_restart_count='abc'", "slurm_jobs.jsonl: a FIFO",
                     "restart_1.json: not read (not JSON", "restart_2.json: not read (restart='two'",
                     "resume.json: not a ResumeState record", "step 1: not shown"]:
        assert expected in said, (expected, said)
    page = (run / "report.html").read_text()
    assert "Records not read" in page and "<b>high</b>" not in page
    assert "record skipped (a JSON list, not an object)" in page
    assert 'reward mean @ step 1: 0.5</title>' in page   # the good lines are drawn


def test_report_clips_a_million_token_prompt(run):
    from launch import report
    _publish_batch(run, 0, prompt_len=1_000_000)
    page = report.render(run)
    assert len(page) < 1 << 20, len(page)
    assert "prompt, tokens 0..999 of 1000000" in page and "998000 tokens not shown" in page


def test_report_refuses_nonsense_arguments_in_one_line(run, capsys):
    for args in (["--steps", "-1"], ["--episodes", "0"], ["--steps", "x"], ["--steps", "10000000"]):
        with pytest.raises(SystemExit) as e:
            _report_ns(run, *args)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert f"error: argument {args[0]}" in err[-1], err
    assert _report_ns(run, "--steps", "0").steps == 0


# -- status ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_status_shows_what_it_can_of_malformed_records(run):
    import io

    from rich.console import Console

    from launch.status import render, status
    for last in ("[1, 2]", '"a string"', "NaN", '{"step": "x", "reward_mean": "y"}', '{"step": [1]}',
                 '{"step": 3, "reward_mean": "y", "[/x]": "[/bold]"}'):
        (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward_mean": 0.5}) + "\n" + last + "\n")
        st = status(run)
        render(st, Console(file=io.StringIO(), width=200))
        assert st["reward"] in (None, 0.5) and isinstance(st["step"], int), (last, st)
    (run / "roles").mkdir(exist_ok=True)
    (run / "roles" / "trainer.json").write_text('{"role": ["x"], "host": "h", "pid": "12", "time": 1}')
    (run / "roles" / "orchestrator.json").write_text('{"role": "orchestrator", "host": "[/x]", "pid": 12, "time": 1}')
    (run / "roles" / "junk.json").write_text("garbage")
    (run / "local.json").write_text(json.dumps({"host": socket.gethostname(), "pid": "x", "started": 1.0}))
    (run / "metrics.jsonl").unlink()
    os.mkfifo(run / "metrics.jsonl")
    (run / "logs").mkdir(exist_ok=True)
    os.mkfifo(run / "logs" / "inference_0.vllm.log")
    os.symlink("/etc/passwd", run / "logs" / "inference_1.vllm.log")
    st = status(run)
    buf = io.StringIO()
    render(st, Console(file=buf, width=300))
    out = buf.getvalue()
    # local.json's schema refuses the pid on read: the job state is unknown and the reason is on the page
    assert st["job"]["state"] == "UNKNOWN" and "local.json" in st["job"]["reason"]
    assert "pid='x' is not a process id" in out
    assert "metrics.jsonl: a FIFO" in out and "inference_0.vllm.log: a FIFO" in out and "symlink" in out
    assert "role orchestrator" in out and "[/x]" in out   # markup in a record is text


# -- export and checkpoints ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def nan_checkpoint(tmp_path_factory):
    """A run directory whose checkpoints/step_000000 holds a NaN, as a trainer without the check saved it."""
    import torch

    from rl import exchange
    from rl.contract import config
    from rl.trainer import checkpoint as ckpt
    from rl.trainer.startup import write_assets
    from rl.trainer.train import Trainer
    run = tmp_path_factory.mktemp("nan_ckpt") / "run"
    make_run_dir(run, "wandb.mode=disabled")
    cfg = config.load(run)
    exchange.publish(run, "assets", 0, lambda p: write_assets(p, cfg.model), producer="test")
    tr = Trainer(cfg)
    name, p = list(tr.model.named_parameters())[3]
    with torch.no_grad():
        p.view(-1)[5] = float("nan")
    ckpt._publish(run, 0, tr.model, tr.optimizer, tr.progress, producer="test", dist=None)
    return run, name


def test_export_refuses_a_non_finite_tensor_naming_it_and_the_step(nan_checkpoint, tmp_path, capfd):
    from launch import export as launch_export
    from rl import export
    run, name = nan_checkpoint
    out = tmp_path / "hf"
    with pytest.raises(export.NonFiniteWeights) as e:
        export.export(run, out, log=lambda m: None)
    msg = str(e.value)
    assert "checkpoints/step_000000" in msg and "NaN or inf" in msg and "\n" not in msg
    assert name.split(".")[-1] in msg, (name, msg)
    assert not out.exists() and list(tmp_path.iterdir()) == []   # no directory, no temp left behind
    ap = argparse.ArgumentParser()
    launch_export.add_arguments(ap)
    # launch export runs `python -m rl.export` as a child writing to this process's stderr (capfd: the fd)
    assert launch_export.run(ap.parse_args([str(run), "--out", str(out)])) == 1
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "NaN" in err[0], err


def test_export_refuses_out_through_a_link_or_into_a_foreign_directory(run, tmp_path):
    from rl import export
    from rl.contract.config import ConfigError
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "as_link")
    cases = {tmp_path / "as_link": "symlink", tmp_path / "as_link" / "new": "symlink"}
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    cases[tmp_path / "full"] = "not an empty directory"
    for out, why in cases.items():
        with pytest.raises(ConfigError) as e:
            export.export(run, out, log=lambda m: None)
        assert str(e.value).startswith("--out") and why in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert list(real.iterdir()) == [] and (tmp_path / "full" / "notes.txt").read_text() == "mine"
    ap = argparse.ArgumentParser()
    from launch import export as launch_export
    launch_export.add_arguments(ap)
    with pytest.raises(SystemExit):
        ap.parse_args([str(run), "--out", str(tmp_path / "x"), "--step", "-3"])


def test_the_trainer_never_saves_a_checkpoint_holding_nan(tmp_path):
    import torch
    from omegaconf import OmegaConf

    from rl import exchange
    from rl.contract.config import Config
    from rl.trainer import checkpoint as ckpt
    from rl.trainer.train import Trainer
    cfg = OmegaConf.structured(Config)
    cfg.run_dir, cfg.wandb.mode, cfg.model.max_seq_len = str(tmp_path), "disabled", 64
    tr = Trainer(cfg)
    tr.save(tmp_path, 0)
    name, p = list(tr.model.named_parameters())[2]
    keep = p.detach().clone()
    with torch.no_grad():
        p.view(-1)[0] = float("inf")
    with pytest.raises(ckpt.NonFiniteCheckpoint) as e:
        tr.save(tmp_path, 1)
    assert name in str(e.value) and "checkpoints/step_000001" in str(e.value) and "\n" not in str(e.value)
    assert exchange.list_steps(tmp_path, "checkpoints") == [0]   # the previous one stays the newest
    with torch.no_grad():
        p.copy_(keep)
    # an optimizer moment holding NaN is refused too, naming the parameter it belongs to
    p.grad = torch.ones_like(p)
    for o in tr.optimizer.optimizers:
        o.step()
    state = tr.optimizer.optimizers[0].state[p]
    key = next(k for k, v in state.items() if torch.is_tensor(v) and v.numel() > 1)
    state[key].view(-1)[0] = float("nan")
    with pytest.raises(ckpt.NonFiniteCheckpoint, match=f"optimizer {key} of {name}"):
        tr.save(tmp_path, 1)
    assert exchange.list_steps(tmp_path, "checkpoints") == [0]


# -- cancel ---------------------------------------------------------------------------------------------
def _holder(path, lock=False):
    """A process holding `path` open (flocked when `lock`, as a launcher holds its lock)."""
    code = ("import fcntl, sys, time; f = open(sys.argv[1], 'a+' if sys.argv[2] == '1' else 'r'); "
            "sys.argv[2] == '1' and fcntl.flock(f, fcntl.LOCK_EX); print('ready', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code, str(path), "1" if lock else "0"], stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def _cancel(run_dir):
    return subprocess.run([sys.executable, "-m", "launch", "cancel", str(run_dir)], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_cancel_signals_nothing_through_a_planted_lock(run, tmp_path):
    from launch.local import recorded_processes
    from launch.procs import Recorded, cancel_local
    from rl.contract.records import LocalLauncher
    other = tmp_path / "other"
    other.mkdir()
    daemon = _holder("/dev/null")                      # any process holding /dev/null open
    other_launcher = _holder(other / "launcher.lock", lock=True)
    try:
        for target, victim in (("/dev/null", daemon), (other / "launcher.lock", other_launcher)):
            if os.path.lexists(run / "launcher.lock"):
                os.unlink(run / "launcher.lock")
            os.symlink(target, run / "launcher.lock")
            LocalLauncher(host=socket.gethostname(), pid=victim.pid, started=time.time(), roles={}).write(run)
            done, skipped = cancel_local(recorded_processes(run), signal.SIGTERM)
            assert not done and len(skipped) == 1, skipped
            assert "symlink" in skipped[0][1] and "nothing signalled" in skipped[0][1], skipped
            r = _cancel(run)
            assert r.returncode == 0 and "sent SIGTERM to nothing" in r.stdout and not r.stderr, (r.stdout, r.stderr)
            time.sleep(0.3)
            assert victim.poll() is None, f"{target}: its holder was signalled"
        os.unlink(run / "launcher.lock")                  # a hard link to another run's lock: the same trick
        os.link(other / "launcher.lock", run / "launcher.lock")
        ok, why = Recorded("launcher", socket.gethostname(), other_launcher.pid, time.time(), run).alive()
        assert not ok and "2 hard links" in why, why
        assert other_launcher.poll() is None
    finally:
        daemon.kill()
        other_launcher.kill()


def test_a_recorded_start_time_must_match_the_process(run):
    from launch.procs import Recorded
    from rl.contract.procs import start_time as process_start_time
    launcher = _holder(run / "launcher.lock", lock=True)
    try:
        started = process_start_time(launcher.pid)
        here = socket.gethostname()
        assert Recorded("launcher", here, launcher.pid, time.time(), run, proc_started=started).alive() == (True, "")
        ok, why = Recorded("launcher", here, launcher.pid, time.time(), run, proc_started=started - 50).alive()
        assert not ok and "another process" in why
        assert not Recorded("launcher", here, launcher.pid, time.time(), run, proc_started="then").alive()[0]
    finally:
        launcher.kill()


# -- doctor ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,flag", [(["--fs-mib", "0"], "--fs-mib"), (["--fs-mib", "-5"], "--fs-mib"),
                                       (["--share", "0"], "--share"), (["--share", "nan"], "--share"),
                                       (["--share", "1.5"], "--share"), (["--timeout", "-1"], "--timeout"),
                                       (["--publish-repeats", "0"], "--publish-repeats"), (["--steps", "-1"], "--steps"),
                                       (["--peak-tflops", "inf"], "--peak-tflops"), (["--families", "gpt9"], "--families"),
                                       (["--json", "/"], "--json"), (["--fs", "/etc/hostname"], "--fs")])
def test_doctor_refuses_nonsense_arguments_at_parse_time(args, flag, capsys):
    from launch.doctor import add_parser
    p = argparse.ArgumentParser(prog="launch")
    add_parser(p.add_subparsers(dest="cmd"))
    with pytest.raises(SystemExit) as e:
        p.parse_args(["doctor", *args])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {flag}" in last and "Traceback" not in last, last


def test_rl_doctor_refuses_nonsense_arguments_before_running(tmp_path, capsys):
    from rl.doctor.__main__ import main
    for args in (["--share", "0"], ["--vllm-timeout", "-1"], ["--publish-dir", "/etc/hostname"]):
        with pytest.raises(SystemExit) as e:
            main(["--out", str(tmp_path / "rows.json"), *args])
        assert e.value.code == 2 and f"argument {args[0]}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path)])
    assert not (tmp_path / "rows.json").exists()
