"""launch.calibrate: the plan's step as low / mid / high with the dominant coefficient (cheap enough for
`launch plan`), the pilot reader's one-line refusals, and, at CI size, `launch plan --calibrate RUN_DIR`
on a finished run of the benchmark world (the real orchestrator on a real run directory, multi-turn and
single-turn): its printed range holds the measured steps/h of a second run with another schedule,
max_off_policy, stale policy and concurrency; and the servers' load curve fitted on a pilot."""
from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch import calibrate, perf
from launch.compose import compose_points
from rl.contract.config import ConfigError, typed

REPO = Path(__file__).resolve().parents[2]
GLM = ["+experiment=glm5_seed", "cluster=slurm", "model.hf_path=conf/checkpoints/glm_moe_dsa"]


def cfg(*over):
    (c,) = compose_points([*over, "run_dir=/tmp/hetrl-calibrate-test"], multirun=False)
    return c


def test_ranges_bracket_the_point_and_name_the_coefficient_that_moves_it_most():
    c = typed(cfg(*GLM))
    r = calibrate.ranges(c)
    assert r.mid.step_s == pytest.approx(perf.predict(c).step_s, rel=1e-12)   # mid: the assumed values
    assert r.low.step_s < r.mid.step_s < r.high.step_s
    for k, (fav, unfav) in r.swings.items():
        assert fav <= r.mid.step_s + 1e-9 <= unfav + 2e-9 and r.low.step_s <= fav and unfav <= r.high.step_s, k
    width = {k: b - a for k, (a, b) in r.swings.items()}
    assert r.dominant == max(width, key=width.get) and width[r.dominant] > 0
    # a measured rollout length narrows its range, so another coefficient may lead
    w = perf.Workload(rollout_tokens=65536, decode_tokens=16384, turns=50, env_s=5.0, source="measured (x)")
    m = calibrate.ranges(c, w)
    assert m.ends["rollout_length"] == calibrate.MEASURED_LENGTH
    assert m.swings["rollout_length"][1] - m.swings["rollout_length"][0] < width["rollout_length"]


def test_a_lower_mfu_slows_only_the_trainer_terms():
    c = typed(cfg(*GLM))
    a, b = perf.predict(c), perf.predict(c, coeffs={"mfu": 0.15})
    assert b.trainer_s > a.trainer_s and b.inference_s == pytest.approx(a.inference_s)
    hidden = perf.predict(c, coeffs={"a2a_overlap": 1.0})
    assert sum(t.seconds for t in hidden.terms if t.name.startswith("EP all-to-all")) == 0.0


def test_plan_prints_low_mid_high_and_the_dominant_coefficient():
    p = subprocess.run([sys.executable, "-m", "launch", "plan", *GLM, "run_dir=/tmp/hetrl-calibrate-test"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    low, mid, high = map(float, re.search(r"step low / mid / high: (\d+) / (\d+) / (\d+) s", p.stdout).groups())
    assert low < mid < high
    assert re.search(r"dominant coefficient: (rollout length|trainer MFU|EP all-to-all hidden|filesystem rates)",
                     p.stdout), p.stdout[-3000:]


def test_a_pilot_without_what_calibrate_reads_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="no metrics.jsonl"):
        calibrate.Pilot.from_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {i}, "time": {i}.0, "wait_s": 0.1}}\n'
                                                    for i in range(4)))
    with pytest.raises(ConfigError, match="orchestrator/turn_gen_s") as e:
        calibrate.Pilot.from_run(tmp_path)
    assert "\n" not in str(e.value)


def test_the_servers_load_curve_is_fitted_on_the_pilot():
    """A pilot's seconds per token are an average over the loads its requests met, so the knee is not
    its mean load: a pilot simulated with a known knee (4, 16 or none) is given back as the knee and the
    seconds per token below it, from the pilot's two numbers alone (its token-weighted seconds per token
    and its time-averaged load), and the replay then steps as the pilot did (not fitted on that)."""
    from launch.simulate import SimConfig, lognormal_source, simulate
    src = lognormal_source(4, turns_median=3, turns_sigma=0.6, tokens_per_turn=16, env_median_s=0.05,
                           env_sigma=1.0, seed=0)
    over = ["orchestrator.schedule=batch", "orchestrator.max_off_policy=0", "orchestrator.stale_policy=drop",
            "orchestrator.prompts_per_step=8", "orchestrator.group_size=4", "orchestrator.max_concurrency=32",
            "orchestrator.env_concurrency=32", "trainer.max_steps=6"]
    c = cfg(*over)
    for knee in (4, 16, 0):
        sc = SimConfig.from_config(c, train_s=0.5, token_s=0.002, decode_knee=knee)
        r = simulate(sc, src)
        assert r.gen_token_s >= 0.002 - 1e-12 and (knee or r.gen_token_s == pytest.approx(0.002, rel=1e-9))
        p = calibrate.Pilot(source="sim", train_s=(0.5,) * 3, token_s=(r.gen_token_s,) * 3, load=r.decode_load,
                            tokens_per_turn=16, turns_mean=3, turns_sigma=0.6, env_s=0.05, env_sigma=1.0,
                            steps_per_hour=r.steps_per_hour, steps=6)
        tok, fitted, replay = calibrate.fit_server(p, c, src)
        assert fitted == pytest.approx(knee, rel=0.2) and tok == pytest.approx(0.002, rel=0.05), (knee, fitted, tok)
        assert replay.steps_per_hour == pytest.approx(r.steps_per_hour, rel=0.02)
        if knee:   # the former rule, a knee at the mean load, is another curve
            assert abs(r.decode_load - knee) > 1.0


def _world_run(run_dir: Path, overrides: list[str], tok, model: str = "agentic") -> float:
    """A run of benchmarks/async_rollouts.py's world (sim backend): its measured steps/h."""
    from _async_world import sim_config, sim_run
    import async_rollouts
    a = async_rollouts.parser().parse_args(["--train-s", "0.3"])
    run_dir.mkdir(parents=True)
    c = sim_config(run_dir, overrides)
    t0 = time.monotonic()
    out = asyncio.run(sim_run(run_dir, c, model, a, tok))
    return async_rollouts.measure(run_dir, c, out, model, a, time.monotonic() - t0)["steps_per_hour"]


@pytest.mark.parametrize("model", ["agentic", "grading"])
def test_plan_calibrated_on_a_pilot_predicts_another_configuration(tmp_path, model):
    """The pilot: batch mode, max_off_policy 0, 8 requests; the target: the continuous pool with release,
    max_off_policy 2, 16 requests and 24 environment slots. Nothing of the target run goes in. Both
    latency models: multi-turn episodes, and single-turn rollouts graded after one generation (their
    metrics.jsonl carries the same per-turn generation seconds)."""
    import async_rollouts
    from rl.tiny_models.tiny import build_tokenizer
    tok = build_tokenizer(tmp_path / "tok")
    a = async_rollouts.parser().parse_args([])
    base = lambda steps, conc, env: [*async_rollouts.common_overrides(a, model, 0, steps),  # noqa: E731
                                     "orchestrator.prompts_per_step=4", "orchestrator.group_size=4",
                                     f"orchestrator.max_concurrency={conc}", f"orchestrator.env_concurrency={env}"]
    pilot = base(6, 8, 16) + async_rollouts.mode_overrides("sync", 0, 16)
    target = base(8, 16, 24) + async_rollouts.mode_overrides("release", 2, 48)
    _world_run(tmp_path / "pilot", pilot, tok, model)
    p = subprocess.run([sys.executable, "-m", "launch", "plan", *target, f"run_dir={tmp_path / 'plan'}",
                        "--calibrate", str(tmp_path / "pilot")], cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("calibrate: calibrated"))
    low, mid, high = map(float, re.search(r"(\d+) / (\d+) / (\d+) steps/h low / mid / high", line).groups())
    assert "the pilot replayed" in line   # the pilot's config.yaml was read
    assert "servers' load curve from the pilot" in p.stdout and "out-of-sample error" in p.stdout, p.stdout[-2000:]
    measured = _world_run(tmp_path / "target", target, tok, model)
    assert low <= measured <= high, f"measured {measured:.0f} steps/h outside {line}"
    assert low <= mid <= high
