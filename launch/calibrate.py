"""What a plan's step time is worth: ranges from stated coefficient ranges, and a calibrated prediction
from a finished pilot run (`launch plan --calibrate RUN_DIR`).

Why ranges: launch.perf multiplies counts by rates, and four of its inputs are assumptions that move the
step by more than any formula error: the trainer's MFU (0.3 assumed; 0.2-0.4 is what large MoE runs
report), how much of the EP all-to-all hides behind expert compute (none assumed; up to half with a
pipelined dispatch), the shared filesystem's rates (a datasheet's, shared with every other job: a
quarter of them to twice them) and the rollout length (a guess until a run has measured it: half to
twice the default; 0.8-1.25x when it comes from a run's metrics). `ranges` predicts the step with every
coefficient at its favourable end (low), as assumed (mid) and at its unfavourable end (high), and each
coefficient alone at both ends, the others as assumed: the one whose two ends differ most is the one to
measure first. Eleven evaluations of the analytic model on a typed config take milliseconds, so
`launch plan` stays under a second.

Why a pilot: no coefficient range replaces a measurement. A short run of the same kind measures what the
model assumes: the trainer's busy seconds per step, the servers' seconds per generated token at the
load it ran, the tool seconds per turn and the episodes' turns with their tail. `Pilot.from_run` reads
them from the run's metrics.jsonl (the per-step spread too: p10 and p90 over its steps), and
`predict_target` replays another configuration (other max_off_policy, concurrency, stale policy,
schedule) in launch.simulate, which simulates every stale policy as itself, so nothing is fitted on the
run it predicts. One thing a pilot cannot measure is how the servers' token rate changes with their load
(it ran at one load): the range brackets it between a flat rate (the measured seconds per token at any
load) and a saturated one (the servers' tokens per second fixed at what the pilot drew), with the
pilot's own load as the mid knee. The trainer and the servers of the target are the pilot's when the
model, trainer and inference groups are equal; otherwise the measured times are scaled by launch.perf's
ratio of the two configurations' predictions (its coefficients calibrated by the pilot).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from launch import perf
from launch.simulate import SimConfig, lognormal_sigma, read_jsonl, simulate
from launch.simulate import lognormal_source as _lognormal_source
from rl.contract.config import ConfigError, typed

# (favourable, unfavourable) ends of each coefficient; the assumed value is launch.perf's. mfu is a factor
# on the configured MFU (0.3 -> 0.4 / 0.2); fs_scale multiplies every shared filesystem rate.
RANGES = {"mfu": (4 / 3, 2 / 3), "a2a_overlap": (0.5, 0.0), "fs_scale": (2.0, 0.25), "rollout_length": (0.5, 2.0)}
MEASURED_LENGTH = (0.8, 1.25)   # rollout length from a run's metrics: its mean is known, its drift is not
LABELS = {"mfu": "trainer MFU", "a2a_overlap": "EP all-to-all hidden", "fs_scale": "filesystem rates",
          "rollout_length": "rollout length"}


@dataclass
class Range:
    low: perf.Prediction
    mid: perf.Prediction
    high: perf.Prediction
    swings: dict            # coefficient -> (step s at its favourable end, at its unfavourable end)
    ends: dict              # coefficient -> (favourable value, unfavourable value), as printed
    dominant: str


def _scaled(w: perf.Workload, x: float) -> perf.Workload:
    """A workload whose rollouts are x times as long: x times the tokens, and x times the turns where
    there are several (the same turns, more of them)."""
    return dataclasses.replace(w, rollout_tokens=w.rollout_tokens * x, decode_tokens=w.decode_tokens * x,
                               turns=w.turns * x if w.turns > 1 else w.turns)


def ranges(cfg, workload: perf.Workload | None = None, assume: dict | None = None) -> Range:
    """The step at low / mid / high and each coefficient's swing (see the module docstring)."""
    c = typed(cfg)
    w = workload or perf.Workload.from_cfg(c, assume)
    mfu = perf.Hardware.from_cfg(c).mfu
    length = MEASURED_LENGTH if w.source.startswith("measured") or "rollout_tokens" in (assume or {}) \
        else RANGES["rollout_length"]
    ends = {"mfu": (mfu * RANGES["mfu"][0], mfu * RANGES["mfu"][1]), "a2a_overlap": RANGES["a2a_overlap"],
            "fs_scale": RANGES["fs_scale"], "rollout_length": length}

    def run(side: dict) -> perf.Prediction:
        co = {k: v for k, v in side.items() if k != "rollout_length"}
        return perf.predict(c, _scaled(w, side.get("rollout_length", 1.0)), coeffs=co)
    mid = run({})
    low = run({k: e[0] for k, e in ends.items()})
    high = run({k: e[1] for k, e in ends.items()})
    swings = {k: (run({k: e[0]}).step_s, run({k: e[1]}).step_s) for k, e in ends.items()}
    dominant = max(swings, key=lambda k: abs(swings[k][1] - swings[k][0]))
    return Range(low, mid, high, swings, ends, dominant)


def _end(k: str, v: float) -> str:
    return {"mfu": f"{v:.2g}", "a2a_overlap": f"{v:.0%}", "fs_scale": f"x{v:g}", "rollout_length": f"x{v:g}"}[k]


def range_lines(r: Range) -> list[str]:
    """`launch plan`'s lines: the step and steps/h at low / mid / high, then each coefficient's swing,
    the largest first."""
    d = r.swings[r.dominant]
    out = [f"step low / mid / high: {r.low.step_s:.0f} / {r.mid.step_s:.0f} / {r.high.step_s:.0f} s "
           f"({r.low.steps_per_hour:.1f} / {r.mid.steps_per_hour:.1f} / {r.high.steps_per_hour:.1f} steps/h; "
           f"bottleneck {r.low.bottleneck} / {r.mid.bottleneck} / {r.high.bottleneck})",
           f"dominant coefficient: {LABELS[r.dominant]} ({_end(r.dominant, r.ends[r.dominant][0])} .. "
           f"{_end(r.dominant, r.ends[r.dominant][1])}) moves the step {d[0]:.0f} .. {d[1]:.0f} s"]
    for k in sorted(r.swings, key=lambda k: -abs(r.swings[k][1] - r.swings[k][0])):
        a, b = r.swings[k]
        out.append(f"  {LABELS[k]:21s} {_end(k, r.ends[k][0]):>6s} .. {_end(k, r.ends[k][1]):<6s} "
                   f"step {a:.0f} .. {b:.0f} s")
    return out


# -- calibration from a pilot run -----------------------------------------------------------------------
def _pct(xs: list, q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))] if s else 0.0


@dataclass
class Pilot:
    """What a finished run measured (see the module docstring); seconds per step and per token as
    (p10, median, p90) over its steps."""
    source: str
    train_s: tuple
    token_s: tuple
    load: float                 # requests decoding at once, time-averaged (generation seconds / wall)
    tokens_per_turn: float
    turns_mean: float
    turns_sigma: float          # lognormal sigma of (turns - 1), from the episodes' token p90 / mean
    env_s: float                # per turn: tool seconds and the driver's time outside generation and tools
    env_sigma: float
    steps_per_hour: float
    steps: int

    @classmethod
    def from_run(cls, run_dir: str | Path, pilot_cfg=None) -> "Pilot":
        """From RUN_DIR/metrics.jsonl; `pilot_cfg` (its config) separates queueing from service: a turn's
        generation and tool seconds include the wait for a request or environment slot, and where the
        time-averaged number of them exceeds orchestrator.max_concurrency / env_concurrency, that share
        is queueing (launch.simulate models the slots itself)."""
        path = Path(run_dir) / "metrics.jsonl"
        if not path.is_file():
            raise ConfigError(f"--calibrate {run_dir}: no metrics.jsonl (not a finished run's directory?)")
        rows = [r for r in read_jsonl(path) if "time" in r]
        if len(rows) < 3:
            raise ConfigError(f"--calibrate {run_dir}: {len(rows)} trainer step(s) in metrics.jsonl; need 3 or more")
        o = [r for r in rows if "orchestrator/turn_gen_s" in r]
        if not o:
            raise ConfigError(f"--calibrate {run_dir}: no orchestrator/turn_gen_s in metrics.jsonl (a multi-turn "
                              f"run's per-turn generation seconds are what calibrate reads)")
        if all("wait_s" in r for r in rows[1:]):   # busy = between two steps, less the wait for the batch
            busy = [b["time"] - a["time"] - b["wait_s"] for a, b in zip(rows, rows[1:])]
        else:
            busy = [r["step_time_s"] + r.get("publish_s", 0.0) for r in rows if "step_time_s" in r]
        if not busy:
            raise ConfigError(f"--calibrate {run_dir}: neither wait_s nor step_time_s in metrics.jsonl")
        span = rows[-1]["time"] - rows[0]["time"]
        g = lambda r, k: float(r.get(f"orchestrator/{k}", 0.0))  # noqa: E731
        per_step = [g(r, "turn_gen_s") / max(g(r, "tokens_per_turn") * g(r, "turns_total"), 1.0) for r in o
                    if g(r, "turns_total") > 0]
        gen_s = sum(g(r, "turn_gen_s") for r in o)
        turns = sum(g(r, "turns_total") for r in o)
        tokens = sum(g(r, "tokens_per_turn") * g(r, "turns_total") for r in o)
        episodes = sum(g(r, "episodes") for r in o)
        env = sum(g(r, "turn_env_s") for r in o)
        outside = sum(g(r, "episode_s_mean") * g(r, "episodes") for r in o) - gen_s - env
        tm, tp = (statistics.fmean(g(r, f"started_episode_tokens_{q}") for r in o if f"orchestrator/started_episode_tokens_{q}" in r)
                  if any(f"orchestrator/started_episode_tokens_{q}" in r for r in o) else 0.0 for q in ("mean", "p90"))
        sm, sp = (statistics.fmean(g(r, f"started_episode_s_{q}") for r in o if f"orchestrator/started_episode_s_{q}" in r)
                  if any(f"orchestrator/started_episode_s_{q}" in r for r in o) else 0.0 for q in ("mean", "p90"))
        turns_mean = turns / max(episodes, 1.0)
        q_gen = q_env = 1.0
        if pilot_cfg is not None:
            po = typed(pilot_cfg).orchestrator
            q_gen = min(1.0, po.max_concurrency / max(gen_s / max(span, 1e-9), 1e-9))
            q_env = min(1.0, po.env_concurrency / max(env / max(span, 1e-9), 1e-9))
        per_step = [x * q_gen for x in per_step]
        s_sigma = lognormal_sigma(sm, sp) if sm > 0 else 1.0
        return cls(source=str(run_dir), train_s=(_pct(busy, 0.1), statistics.median(busy), _pct(busy, 0.9)),
                   token_s=(_pct(per_step, 0.1), q_gen * gen_s / max(tokens, 1.0), _pct(per_step, 0.9)),
                   load=q_gen * gen_s / max(span, 1e-9),
                   tokens_per_turn=tokens / max(turns, 1.0), turns_mean=turns_mean,
                   turns_sigma=lognormal_sigma(tm, tp) if tm > 0 else 0.0,
                   env_s=(q_env * env + max(outside, 0.0)) / max(turns, 1.0),
                   env_sigma=min(1.5, s_sigma * math.sqrt(max(turns_mean, 1.0))),
                   steps_per_hour=(len(rows) - 1) / max(span, 1e-9) * 3600, steps=len(rows))

    def line(self) -> str:
        return (f"pilot {self.source}: {self.steps} steps, {self.steps_per_hour:.0f} steps/h; trainer "
                f"{self.train_s[1]:.2f} s/step (p10 {self.train_s[0]:.2f}, p90 {self.train_s[2]:.2f}); "
                f"{self.token_s[1] * 1e3:.2f} ms/token at {self.load:.1f} requests decoding; "
                f"{self.turns_mean:.1f} turns (sigma {self.turns_sigma:.2f}) of {self.tokens_per_turn:.0f} tokens, "
                f"{self.env_s:.3f} s outside generation per turn (sigma {self.env_sigma:.2f})")


def pilot_source_of(p: Pilot, group_size: int, seed: int = 0):
    """Episodes drawn like the pilot's: 1 + (turns - 1) x lognormal turns, lognormal tool seconds."""
    med_turns = 1 + (p.turns_mean - 1) * math.exp(-p.turns_sigma ** 2 / 2)   # mean of 1 + m e^(s Z) is the pilot's
    med_env = p.env_s * math.exp(-p.env_sigma ** 2 / 2)
    return _lognormal_source(group_size, turns_median=med_turns, turns_sigma=p.turns_sigma,
                             tokens_per_turn=max(1, round(p.tokens_per_turn)), env_median_s=med_env,
                             env_sigma=p.env_sigma, seed=seed)


@dataclass
class Calibrated:
    low: float                  # steps per hour: the slow end, the mid, the fast end
    mid: float
    high: float
    train_s: float
    token_s: float
    scaled: str                 # how the pilot's times were carried over to the target
    pilot_error: float          # the pilot's measured steps/h over the simulator's replay of it (1: none)
    results: dict               # label -> SimResult


def _same(a, b, keys=("model", "trainer", "inference")) -> bool:
    return all(dataclasses.asdict(getattr(a, k)) == dataclasses.asdict(getattr(b, k)) for k in keys)


def predict_target(cfg, pilot: Pilot, pilot_cfg=None, source=None, steps: int | None = None,
                   seed: int = 0, pilot_source=None) -> Calibrated:
    """Steps/h of config `cfg` from the pilot's measurements (see the module docstring): mid at the
    pilot's median trainer and token seconds with the servers' knee at the pilot's load; low and high
    the slowest and fastest of the trainer's p90 / p10 under a flat, knee'd or saturated token rate.
    With the pilot's config, the simulator also replays the pilot itself from the same inputs, and its
    error there (measured / replayed) widens the range on its side: what the simulator leaves out of
    this machine or cluster, it left out of the pilot too."""
    c = typed(cfg)
    scale_t = scale_k = 1.0
    how = "the pilot's trainer and servers"
    if pilot_cfg is not None and not _same(c, typed(pilot_cfg)):
        a, b = perf.predict(typed(pilot_cfg)), perf.predict(c)
        scale_t, scale_k = b.trainer_s / max(a.trainer_s, 1e-12), b.token_s / max(a.token_s, 1e-12)
        how = f"scaled by launch.perf: trainer x{scale_t:.3g}, token x{scale_k:.3g}"
    sim = SimConfig.from_config(c)
    sim.steps = steps or max(8, min(c.trainer.max_steps, 40))
    src = source or pilot_source_of(pilot, c.orchestrator.group_size, seed)
    b = max(pilot.load, 1.0)

    def run(train_s: float, knee: float):
        # token seconds at b decoding: measured x max(b, knee) / max(load, knee) (knee inf: flat)
        tok = pilot.token_s[1] * scale_k
        s = dataclasses.replace(sim, train_s=train_s * scale_t,
                                token_s=tok if math.isinf(knee) else tok * knee / max(b, knee),
                                decode_knee=0 if math.isinf(knee) else knee)
        return simulate(s, src)
    res = {"mid": run(pilot.train_s[1], b)}
    for name, ts in (("slow", pilot.train_s[2]), ("fast", pilot.train_s[0])):
        for kn, knee in (("flat", math.inf), ("knee", b), ("saturated", 1.0)):
            res[f"{name}_{kn}"] = run(ts, knee)
    slow = min(r.steps_per_hour for k, r in res.items() if k.startswith("slow"))
    fast = max(r.steps_per_hour for k, r in res.items() if k.startswith("fast"))
    err = 1.0
    if pilot_cfg is not None:   # the pilot replayed from its own inputs (its trainer and servers: unscaled)
        pc = typed(pilot_cfg)
        ps = dataclasses.replace(SimConfig.from_config(pc), steps=max(pilot.steps, 3), train_s=pilot.train_s[1],
                                 token_s=pilot.token_s[1], decode_knee=b)
        replay = simulate(ps, pilot_source or pilot_source_of(pilot, pc.orchestrator.group_size, seed))
        err = pilot.steps_per_hour / max(replay.steps_per_hour, 1e-9)
        res["pilot_replay"] = replay
    return Calibrated(low=min(slow, res["mid"].steps_per_hour) * min(1.0, err), mid=res["mid"].steps_per_hour,
                      high=max(fast, res["mid"].steps_per_hour) * max(1.0, err), train_s=pilot.train_s[1] * scale_t,
                      token_s=pilot.token_s[1] * scale_k, scaled=how, pilot_error=err, results=res)


def calibrate_lines(cfg, run_dir: str) -> list[str]:
    """`launch plan --calibrate RUN_DIR`'s lines."""
    from rl.contract.config import load
    pilot_cfg = load(run_dir) if (Path(run_dir) / "config.yaml").is_file() else None
    p = Pilot.from_run(run_dir, pilot_cfg)
    r = predict_target(cfg, p, pilot_cfg)
    m = r.results["mid"]
    replay = (f"; the pilot replayed: {r.results['pilot_replay'].steps_per_hour:.0f} steps/h against "
              f"{p.steps_per_hour:.0f} measured" if "pilot_replay" in r.results else "; no config.yaml: no replay")
    return [p.line(),
            f"calibrated ({r.scaled}): {r.low:.0f} / {r.mid:.0f} / {r.high:.0f} steps/h low / mid / high "
            f"(step {3600 / max(r.high, 1e-9):.2f} .. {3600 / max(r.low, 1e-9):.2f} s); mid: trainer idle "
            f"{m.trainer_idle:.1%}, wasted {m.wasted_fraction:.1%}, inference idle {m.inference_idle:.1%}{replay}"]
