"""`launch plan --calibrate PILOT` checks the pilot before simulating and bounds its work (issue 49).

The pilot is the embedded default run's shape (single-turn digits on the 0.2M-parameter qwen3, six
steps: the numbers are those of a real `python -m launch run trainer.max_steps=6`), written as the
launcher writes config.yaml and as the trainer appends metrics.jsonl. Probes, each through the real
command line: times going backwards, NaN / Infinity / a string where a number belongs, a negative token
count, 1e12 turns, a step that waited longer than its interval, no span at all, a FIFO at metrics.jsonl;
each is refused with exit status 2 and one line naming the file, the line and the key (they used to run
without end, memory growing, or end in a traceback). The README's own line, a debug pilot for
kimi_swe, printed nothing for 17 minutes (every simulation ticked the pool every 0.2 simulated s
through 10^7 s steps); it now finishes in seconds, warning on stderr that pilot and target differ in
environment and model family. The bounds themselves (events per simulation, wall time, progress lines)
and a pipeline that cannot finish are checked on the simulator directly. A teammate's pilot (another
uid owns it) is read as foreign data: checked, not refused for its owner.
"""
from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from launch import calibrate
from launch.compose import compose_points
from launch.simulate import SimConfig, Simulation, SimulationBound, Turn, simulate
from rl.contract.config import ConfigError

REPO = Path(__file__).resolve().parents[2]
T0 = 1796655291.6286
# (step_time_s, publish_s, wait_s, dt since the step before, turn_gen_s, episode_s_mean, started_episode_s_mean)
STEPS = [(1.7057, 0.0029, 70.5452, 0.0, 2530.3091, 19.7681, 20.3283),
         (0.3555, 0.0177, 0.0027, 0.5117, 2711.7756, 21.1858, 21.048),
         (0.4116, 0.0063, 0.8095, 1.3995, 59.1298, 0.462, 14.211),
         (0.3415, 0.0032, 0.0111, 0.3792, 86.8995, 0.6789, 10.8327),
         (0.339, 0.1562, 2.2958, 2.8289, 158.0456, 1.2348, 8.9207),
         (0.5877, 0.0364, 0.006, 0.867, 260.629, 2.0362, 7.7779)]


def pilot_rows() -> list[dict]:
    rows, t = [], T0
    for i, (st, pub, wait, dt, gen, ep, started) in enumerate(STEPS):
        t += dt
        rows.append({"step": i, "step_time_s": st, "publish_s": pub, "wait_s": wait, "time": t,
                     "orchestrator/episodes": 128, "orchestrator/turns_total": 128,
                     "orchestrator/tokens_per_turn": 3.96, "orchestrator/turn_gen_s": gen,
                     "orchestrator/turn_env_s": 0.0015, "orchestrator/episode_s_mean": ep,
                     "orchestrator/started_episode_s_mean": started, "orchestrator/started_episode_s_p90": 22.0,
                     "orchestrator/started_episode_tokens_mean": 3.96, "orchestrator/started_episode_tokens_p90": 4.0,
                     "orchestrator/turns_per_episode": 1.0, "policy_version": i + 1})
    return rows


def write_pilot(d: Path, rows: list[dict] | None = None, raw_lines: dict[int, str] | None = None) -> Path:
    """A finished embedded default run's config.yaml (as launch.rundir freezes it) and metrics.jsonl
    (`raw_lines`: {row index: the line as written}, for values JSON cannot carry as such)."""
    d.mkdir(parents=True, exist_ok=True)
    (cfg,) = compose_points([f"run_dir={d}", "trainer.max_steps=6"], multirun=False)
    cfg = {k: v for k, v in cfg.items() if k != "_overrides"}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    lines = [json.dumps(r) for r in (rows if rows is not None else pilot_rows())]
    for i, text in (raw_lines or {}).items():
        lines[i] = text
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n" + json.dumps({"step": len(lines)}) + "\n")
    return d


def plan(tmp_path: Path, pilot: Path, *target: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch", "plan", *target, f"run_dir={tmp_path / 'plan'}",
                           "--calibrate", str(pilot)], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _with(i: int, **values) -> list[dict]:
    rows = pilot_rows()
    rows[i].update(values)
    return rows


# (probe, metrics.jsonl rows, raw lines, the line and key the refusal names, what it says)
PROBES = [
    ("times going backwards", _with(3, time=T0 - 100.0), None, "metrics.jsonl:4: time=", "the pilot's times go back"),
    ("NaN generation seconds", None, {2: json.dumps(pilot_rows()[2]).replace('"orchestrator/turn_gen_s": 59.1298',
                                                                              '"orchestrator/turn_gen_s": NaN')},
     "metrics.jsonl:3: orchestrator/turn_gen_s=nan", "not a finite number"),
    ("Infinity wait", None, {4: json.dumps(pilot_rows()[4]).replace('"wait_s": 2.2958', '"wait_s": Infinity')},
     "metrics.jsonl:5: wait_s=inf", "not a finite number"),
    ("a string step time", _with(1, step_time_s="0.35"), None, 'metrics.jsonl:2: step_time_s="0.35"', "not a number"),
    ("negative tokens", _with(2, **{"orchestrator/tokens_per_turn": -4.0}), None,
     "metrics.jsonl:3: orchestrator/tokens_per_turn=-4.0", "not a finite number in [0,"),
    ("1e12 turns", _with(5, **{"orchestrator/turns_total": 1e12}), None,
     "metrics.jsonl:6: orchestrator/turns_total=1000000000000.0", "not a finite number in [0, 1e+09]"),
    ("1e6 turns an episode", _with(5, **{"orchestrator/turns_total": 128e6}), None,
     "metrics.jsonl:6: orchestrator/turns_total=128000000.0 for 128 episodes", "more than 10000 turns an episode"),
    ("a wait longer than the step", _with(2, wait_s=50.0), None, "metrics.jsonl:3: wait_s=50.0",
     "the step's spans do not add up"),
    ("steps going backwards", _with(4, step=1), None, "metrics.jsonl:5: step=1", "the steps go backwards"),
    ("no span", [dict(r, time=T0, wait_s=0.0) for r in pilot_rows()], None, "metrics.jsonl: its 6 steps all have",
     "no span to measure"),
]


@pytest.mark.parametrize("probe,rows,raw,where,says", PROBES, ids=[p[0] for p in PROBES])
def test_a_hostile_pilot_is_refused_in_one_line(tmp_path, probe, rows, raw, where, says):
    pilot = write_pilot(tmp_path / "pilot", rows, raw)
    p = plan(tmp_path, pilot, timeout=90)   # the unbounded ones used to run past this
    err = p.stderr.strip()
    assert p.returncode == 2, (p.returncode, err[-2000:])
    assert "Traceback" not in p.stderr and len(err.splitlines()) == 1, err[-2000:]
    assert err.startswith(f"error: --calibrate {pilot}: {pilot}/") and where in err and says in err, err


def test_a_fifo_at_the_pilots_metrics_is_refused_without_blocking(tmp_path):
    pilot = write_pilot(tmp_path / "pilot")
    (pilot / "metrics.jsonl").unlink()
    os.mkfifo(pilot / "metrics.jsonl")
    p = plan(tmp_path, pilot, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "metrics.jsonl" in p.stderr and "FIFO" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_the_readme_line_a_debug_pilot_for_kimi_finishes_with_a_warning(tmp_path):
    """`python -m launch plan +experiment=kimi_swe cluster=slurm ... --calibrate DEBUG_PILOT`: the trainer
    is carried over x1.4e7 and a token x8e4, so every simulated step lasts 10^6-10^7 s; it finishes in
    seconds and says, on stderr, that pilot and target differ (it printed nothing for 17 minutes)."""
    pilot = write_pilot(tmp_path / "pilot")
    t0 = time.monotonic()
    p = plan(tmp_path, pilot, "+experiment=kimi_swe", "cluster=slurm", "model.hf_path=conf/checkpoints/kimi_k2_7",
             timeout=calibrate.MAX_WALL_S + 120)
    took = time.monotonic() - t0
    assert p.returncode == 0, p.stderr[-3000:]
    warn = [x for x in p.stderr.splitlines() if x.startswith("calibrate: warning:")]
    assert len(warn) == 1 and "environment digits (pilot) vs swe (target)" in warn[0], p.stderr[-3000:]
    assert "model family qwen3 (pilot) vs kimi" in warn[0]
    line = next(x for x in p.stdout.splitlines() if x.startswith("calibrate: calibrated"))
    assert re.search(r"trainer x1\.\d+e\+07", line) and "steps/h low / mid / high" in line, line
    assert took < 120, f"{took:.0f} s"


def test_a_pilot_like_its_target_warns_nothing(tmp_path):
    pilot = write_pilot(tmp_path / "pilot")
    p = plan(tmp_path, pilot, "orchestrator.max_off_policy=2", "orchestrator.max_concurrency=32")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "warning" not in p.stderr and "calibrate: calibrated" in p.stdout, p.stderr[-3000:]


def _admit(train_s: float, steps: int = 20) -> SimConfig:
    """stale_policy=admit counts its holds per look of the pool, so its idle looks are all simulated: the
    slowest kind of simulation there is, used here to reach the bounds."""
    return SimConfig(steps=steps, prompts_per_step=2, group_size=2, max_off_policy=1, stale_policy="admit",
                     train_s=train_s, token_s=0.001)


def one_turn(key):
    return [[Turn(8, 0.01)] for _ in range(2)]


def test_the_wall_time_bound_stops_with_progress_on_stderr(tmp_path):
    err = io.StringIO()
    budget = calibrate.Budget(max_events=10**9, wall_s=1.5, err=err, progress_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        budget.run(_admit(1e5), one_turn, "a slow target")
    assert time.monotonic() - t0 < 10
    msg = str(e.value)
    assert "\n" not in msg and "stopped at the wall-time bound of 1.5 s (MAX_WALL_S)" in msg and "a slow target" in msg
    progress = [x for x in err.getvalue().splitlines() if "simulated s" in x]
    assert len(progress) >= 2 and all(x.startswith("calibrate: simulation 1: a slow target: ") for x in progress), \
        err.getvalue()


def test_the_event_bound_stops_in_one_line():
    budget = calibrate.Budget(max_events=5000, err=io.StringIO())
    with pytest.raises(ConfigError, match=r"stopped at the bound of 5000 events a simulation \(MAX_SIM_EVENTS\)"):
        budget.run(_admit(1e5), one_turn, "x")
    assert calibrate.MAX_SIM_EVENTS >= 10**6 and calibrate.MAX_WALL_S <= 600   # as documented


def test_idle_looks_are_not_simulated_one_by_one():
    """The pool's tick with nothing new since its last look is moved to the next event: a target whose
    steps last 10^7 s takes the events of its rollouts, not 5 x 10^8 looks."""
    c = SimConfig(steps=20, prompts_per_step=2, group_size=2, max_off_policy=1, stale_policy="release",
                  train_s=1e7, token_s=0.001)
    sim = Simulation(c, one_turn)
    r = sim.run(max_events=50_000)
    assert r.steps_per_hour == pytest.approx(3600 / 1e7, rel=1e-3)
    batch = simulate(SimConfig(**{**c.__dict__, "schedule": "batch", "max_off_policy": 0}), one_turn)
    assert batch.steps_per_hour > 0


def test_a_pipeline_that_cannot_finish_is_refused_at_once():
    """No environment slot (or no request slot): every rollout waits forever, so no batch is ever built;
    refused when nothing is left to happen, not after 50 million idle looks. A source that gives a group
    no rollouts (which the pool would start forever, within one event) is refused too."""
    for slots in ({"env_concurrency": 0}, {"max_concurrency": 0}):
        t0 = time.monotonic()
        with pytest.raises(SimulationBound, match=r"no end: nothing left to happen at t=[\d.]+ s with 0 of 3 steps"):
            simulate(SimConfig(steps=3, prompts_per_step=2, group_size=2, max_off_policy=1, **slots), one_turn)
        assert time.monotonic() - t0 < 5
    with pytest.raises(SimulationBound, match="the episode source gave group-0 no rollouts"):
        simulate(SimConfig(steps=3, prompts_per_step=2, group_size=2, max_off_policy=1), lambda key: [])


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file another uid owns needs root")
def test_a_teammates_pilot_is_read_as_checked_foreign_data(tmp_path):
    """Another uid owns the pilot (a teammate's run): calibrate reads it (its values are checked instead
    of its owner), and a bad value in it is refused in one line like any other."""
    pilot = write_pilot(tmp_path / "pilot")
    for f in (pilot, pilot / "config.yaml", pilot / "metrics.jsonl"):
        os.chown(f, 4242, 4242)
    (cfg,) = compose_points([f"run_dir={tmp_path / 'plan'}"], multirun=False)
    lines = calibrate.calibrate_lines(cfg, str(pilot), calibrate.Budget(err=io.StringIO()))
    assert lines[1].startswith("calibrated (") and "the pilot replayed" in lines[1], lines
    bad = write_pilot(tmp_path / "bad", _with(3, time=T0 - 1.0))
    for f in (bad, bad / "config.yaml", bad / "metrics.jsonl"):
        os.chown(f, 4242, 4242)
    with pytest.raises(ConfigError, match=r"metrics.jsonl:4: time=.* the pilot's times go backwards"):
        calibrate.calibrate_lines(cfg, str(bad), calibrate.Budget(err=io.StringIO()))
