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
run it predicts. How the servers' token rate changes with their load a pilot shows only through the
loads its own schedule met: `fit_server` finds the knee under which a replay of the pilot measures what
the pilot measured (its token-weighted seconds per token and its time-averaged load), and the range
brackets the curve between a flat rate (the measured seconds per token at any load) and a saturated one
(the servers' tokens per second fixed at what the pilot drew). Last, the range is widened by the
simulator's own error, measured out of sample (MODEL_ERROR): a trainer-bound pilot's step spread is
narrower than the simulator's few per cent. Single-turn pilots are read as one turn per episode. The trainer and the servers of the target are the pilot's when the
model, trainer and inference groups are equal; otherwise the measured times are scaled by launch.perf's
ratio of the two configurations' predictions (its coefficients calibrated by the pilot).

Why the pilot is checked and the work bounded: the pilot may be a teammate's run or a damaged one, and
its numbers become simulated durations and counts. Its files are read as foreign data (safefs, `foreign`:
not refused for another owner, never through a link, never blocking on a FIFO), and every value used is
checked first (launch.sim_inputs.checked_rows: finite numbers within stated bounds, times and steps
never going back, spans that add up; one line naming the file, line and key, exit status 2), because
times going backwards, 1e12 turns or negative token counts made simulations that never ended and a NaN
or a string a traceback. The simulations themselves are bounded (`Budget`): MAX_SIM_EVENTS events each,
MAX_WALL_S seconds of wall time for all of them, a progress line on stderr every PROGRESS_S seconds once
it runs that long, and a one-line stop naming the bound. A pilot of another environment or model family
than the target is warned about on stderr (`kind_warning`): its times are then an extrapolation.
"""
from __future__ import annotations

import dataclasses
import math
import stat
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from launch import perf
from launch.sim_inputs import MAX_TURNS, PilotError, checked_rows
from launch.simulate import SimConfig, Simulation, SimulationBound, lognormal_sigma
from launch.simulate import lognormal_source as _lognormal_source
from rl.contract import safefs
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


MAX_PILOT_BYTES = 256 << 20    # a pilot's metrics.jsonl: a few kB a step; beyond this it is not a pilot
MAX_CONFIG_BYTES = 16 << 20


def _read_foreign(path: Path, limit: int) -> bytes:
    """A pilot's file: maybe a teammate's run, so not owned by this user (safefs's owner check skipped:
    the bytes are validated instead), but never through a link and never blocking on a FIFO."""
    try:
        return safefs.read_bytes(path, limit, foreign=True)
    except safefs.UnsafePath as e:
        raise ConfigError(f"--calibrate: {e}") from None


def _exists(path: Path) -> bool:
    try:
        return safefs.lstat(path) is not None
    except safefs.UnsafePath as e:   # a link on the way to it
        raise ConfigError(f"--calibrate: {e}") from None


def _pilot_rows(run_dir, path: Path) -> list[tuple[int, dict]]:
    """The pilot's timed metrics.jsonl rows, checked (launch.sim_inputs.checked_rows)."""
    if not _exists(path):
        raise ConfigError(f"--calibrate {run_dir}: no metrics.jsonl (not a finished run's directory?)")
    try:
        return checked_rows(path, _read_foreign(path, MAX_PILOT_BYTES))
    except PilotError as e:
        raise ConfigError(f"--calibrate {run_dir}: {e}") from None


def pilot_config(run_dir):
    """The pilot's config.yaml on the schema (None without one), read as foreign data (`_read_foreign`);
    one line naming the file when it is not a config."""
    from omegaconf import OmegaConf

    from rl.contract.config import one_line, structured
    p = Path(run_dir) / "config.yaml"
    if not _exists(p):
        return None
    text = _read_foreign(p, MAX_CONFIG_BYTES)
    try:
        raw = OmegaConf.create(text.decode())
        if not isinstance(raw, type(OmegaConf.create({}))):
            raise ValueError(f"a YAML {type(OmegaConf.to_container(raw)).__name__}, not a mapping")
        cfg = structured(OmegaConf.to_container(raw))
        typed(cfg)
    except Exception as e:  # noqa: BLE001 - YAML, schema or type errors of someone else's file: one line
        raise ConfigError(f"--calibrate {run_dir}: {p}: not a run's config ({one_line(e)[:300]})") from None
    OmegaConf.set_readonly(cfg, True)
    return cfg


@dataclass
class Pilot:
    """What a finished run measured (see the module docstring); seconds per step and per token as
    (p10, median, p90) over its steps."""
    source: str
    train_s: tuple
    token_s: tuple
    load: float                 # requests decoding at once, time-averaged (over the wall, or the servers' busy time)
    tokens_per_turn: float
    turns_mean: float
    turns_sigma: float          # lognormal sigma of (turns - 1), from the episodes' token p90 / mean
    env_s: float                # per turn: tool seconds and the driver's time outside generation and tools
    env_sigma: float
    steps_per_hour: float
    steps: int
    load_busy: bool = True      # load averaged over the servers' busy time (False: over the wall time)

    @classmethod
    def from_run(cls, run_dir: str | Path, pilot_cfg=None) -> "Pilot":
        """From RUN_DIR/metrics.jsonl; `pilot_cfg` (its config) separates queueing from service: a turn's
        generation and tool seconds include the wait for a request or environment slot, and where the
        time-averaged number of them exceeds orchestrator.max_concurrency / env_concurrency, that share
        is queueing (launch.simulate models the slots itself)."""
        path = Path(run_dir) / "metrics.jsonl"
        rows = [r for _, r in _pilot_rows(run_dir, path)]
        if len(rows) < 3:
            raise ConfigError(f"--calibrate {run_dir}: {len(rows)} trainer step(s) in metrics.jsonl; need 3 or more")
        if rows[-1]["time"] <= rows[0]["time"]:
            raise ConfigError(f"--calibrate {run_dir}: {path}: its {len(rows)} steps all have time="
                              f"{rows[0]['time']!r}: no span to measure steps/h over")
        o = [r for r in rows if "orchestrator/turn_gen_s" in r]
        if not o:
            raise ConfigError(f"--calibrate {run_dir}: no orchestrator/turn_gen_s in metrics.jsonl (the per-turn "
                              f"generation seconds calibrate reads; a run older than single-turn rollouts' gen_s?)")
        if all("wait_s" in r for r in rows[1:]):   # busy = between two steps, less the wait for the batch
            busy = [max(b["time"] - a["time"] - b["wait_s"], 0.0) for a, b in zip(rows, rows[1:])]
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
        if gen_s <= 0 or tokens <= 0:
            raise ConfigError(f"--calibrate {run_dir}: {path}: no generation measured (orchestrator/turn_gen_s "
                              f"or tokens_per_turn x turns_total is 0 in every step): nothing to calibrate the "
                              f"servers on")
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
                   steps_per_hour=(len(rows) - 1) / max(span, 1e-9) * 3600, steps=len(rows), load_busy=False)

    def line(self) -> str:
        return (f"pilot {self.source}: {self.steps} steps, {self.steps_per_hour:.0f} steps/h; trainer "
                f"{self.train_s[1]:.2f} s/step (p10 {self.train_s[0]:.2f}, p90 {self.train_s[2]:.2f}); "
                f"{self.token_s[1] * 1e3:.2f} ms/token at {self.load:.1f} requests decoding; "
                f"{self.turns_mean:.1f} turns (sigma {self.turns_sigma:.2f}) of {self.tokens_per_turn:.0f} tokens, "
                f"{self.env_s:.3f} s outside generation per turn (sigma {self.env_sigma:.2f})")


def pilot_source_of(p: Pilot, group_size: int, seed: int = 0):
    """Episodes drawn like the pilot's: 1 + (turns - 1) x lognormal turns, lognormal tool seconds; an
    episode is cut at MAX_TURNS turns (the pilot's mean is at most that; a far draw of the tail would
    otherwise be millions of simulated turns, where a real run stops at env.max_turns)."""
    med_turns = 1 + (p.turns_mean - 1) * math.exp(-p.turns_sigma ** 2 / 2)   # mean of 1 + m e^(s Z) is the pilot's
    med_env = p.env_s * math.exp(-p.env_sigma ** 2 / 2)
    return _lognormal_source(group_size, turns_median=med_turns, turns_sigma=p.turns_sigma,
                             tokens_per_turn=max(1, round(p.tokens_per_turn)), env_median_s=med_env,
                             env_sigma=p.env_sigma, max_turns=MAX_TURNS, seed=seed)


# The simulator's own error out of sample, a relative factor on steps/h: what neither the pilot's
# step-to-step spread nor the load curve's bracket covers (the pool's wake-ups against the simulated
# ones, the event loop's lag on a loaded host, episodes drawn rather than replayed). Estimated by
# benchmarks/async_rollouts.py on one workload's pilot / second-run pairs and checked on the other's
# (docs/perf.md, "Calibration from a pilot run"): the largest |mid / measured - 1| of the agentic
# workload's non-pilot modes, seeds 0-1 (x1.129, over-sampling's; the grading runs' ranges widened by it
# held 12 of 12), rounded up.
MODEL_ERROR = 0.13
KNEES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)   # candidate decode knees (sequences); 0: flat


# The work of one `--calibrate` (a few dozen simulations: the pilot's fit, then the target's range) is
# bounded: each simulation by its events, all of them together by the wall clock, with a progress line
# on stderr every PROGRESS_S seconds once it runs that long. A pilot far from its target (a debug run
# carried to Kimi: trainer times x1.4e7) used to simulate for 17 minutes without a word, then end in a
# traceback; launch.simulate now skips the pool's idle looks, and what still runs past a bound stops with
# one line naming it.
MAX_SIM_EVENTS = 5_000_000   # events of one simulation (the CI pilots' largest takes ~10^4)
MAX_WALL_S = 300.0           # wall seconds of all of --calibrate's simulations together
PROGRESS_S = 2.0             # wall seconds between two progress lines on stderr


class Budget:
    """Runs the simulations of one calibration within MAX_SIM_EVENTS each and MAX_WALL_S in all (or the
    given bounds), printing progress to `err` every PROGRESS_S seconds; ConfigError, one line naming the
    bound and what was being simulated, when one is hit."""

    def __init__(self, max_events: int = MAX_SIM_EVENTS, wall_s: float = MAX_WALL_S, err=None,
                 progress_s: float = PROGRESS_S):
        self.max_events, self.wall_s, self.progress_s = max_events, wall_s, progress_s
        self.err = err if err is not None else sys.stderr
        self.start = self.said = time.monotonic()
        self.runs = 0

    def _say(self, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.said >= self.progress_s:
            print(f"calibrate: {text} ({now - self.start:.0f} s)", file=self.err, flush=True)
            self.said = now

    def run(self, cfg: SimConfig, source, what: str):
        self.runs += 1
        self._say(f"simulation {self.runs}: {what}")

        def progress(n: int, t: float, steps: int) -> None:
            self._say(f"simulation {self.runs}: {what}: {n} events, {t:.4g} simulated s, {steps} of "
                      f"{cfg.steps} steps trained")
        try:
            return Simulation(cfg, source).run(self.max_events, self.start + self.wall_s, progress,
                                               min(self.progress_s, 0.5))
        except SimulationBound as e:
            bound = (f"the wall-time bound of {self.wall_s:g} s (MAX_WALL_S)" if "wall-time" in str(e) else
                     f"the bound of {self.max_events} events a simulation (MAX_SIM_EVENTS)"
                     if "events" in str(e) else "a pipeline that cannot finish")
            raise ConfigError(f"--calibrate: stopped at {bound} in simulation {self.runs} ({what}; trainer "
                              f"{cfg.train_s:.4g} s a step, {cfg.token_s:.4g} s a token, {cfg.steps} steps): "
                              f"{e}") from None


@dataclass
class Calibrated:
    low: float                  # steps per hour: the slow end, the mid, the fast end, widened by model_error
    mid: float
    high: float
    train_s: float
    token_s: float
    scaled: str                 # how the pilot's times were carried over to the target
    pilot_error: float          # the pilot's measured steps/h over the simulator's replay of it (1: none)
    results: dict               # label -> SimResult
    knee: float = 0             # the servers' load curve fitted on the pilot: token_s up to knee sequences
    knee_token_s: float = 0.0
    model_error: float = 0.0
    raw: tuple = (0.0, 0.0)     # (low, high) before the model error


def _same(a, b, keys=("model", "trainer", "inference")) -> bool:
    """The same model, trainer and servers: every setting but the ports (derived from the run directory,
    so two runs of one configuration never share them) and the step count (the run's length, not its
    speed)."""
    def plain(c, k):
        d = dataclasses.asdict(getattr(c, k))
        return {x: v for x, v in d.items() if not x.endswith("port") and x != "max_steps"}
    return all(plain(a, k) == plain(b, k) for k in keys)


def _at_knee(base: SimConfig, source, tok: float, knee: float, budget: "Budget | None" = None):
    """(seconds per token below the knee, the replay) whose token-weighted seconds per token are `tok`:
    a secant on the logarithms (the replay's per-token seconds grow about as a power of it)."""
    t1 = tok
    what = f"the pilot at a knee of {knee:g}"
    sim = (budget or Budget()).run
    r1 = sim(dataclasses.replace(base, token_s=t1, decode_knee=knee), source, what)
    if not knee or r1.gen_token_s <= 0:
        return t1, r1
    t2 = t1 * tok / r1.gen_token_s
    r2 = sim(dataclasses.replace(base, token_s=t2, decode_knee=knee), source, what)
    for _ in range(2):
        if r2.gen_token_s <= 0 or abs(math.log(r2.gen_token_s / tok)) < 0.01 or r2.gen_token_s == r1.gen_token_s:
            break
        slope = (math.log(t2) - math.log(t1)) / (math.log(r2.gen_token_s) - math.log(r1.gen_token_s))
        t1, r1 = t2, r2
        t2 = math.exp(math.log(t2) + slope * (math.log(tok) - math.log(r2.gen_token_s)))
        r2 = sim(dataclasses.replace(base, token_s=t2, decode_knee=knee), source, what)
    return t2, r2


def fit_server(pilot: Pilot, pilot_cfg, source, steps: int | None = None,
               budget: "Budget | None" = None) -> tuple:
    """The servers' load curve from the pilot: (seconds per token below the knee, knee, the replay).

    A pilot measures two things of its servers: its seconds per generated token, averaged over the loads
    its requests met and weighted by their tokens, and the number of requests decoding at once,
    averaged over time. A pilot whose batches start together meets many loads (all its requests at
    first, its stragglers alone at the end), so the two differ, and how they differ is the knee: the
    crowd's tokens are slow ones where the servers saturate early. A knee put at the time-averaged load
    charged the stragglers the crowd's rate and capped the servers' tokens/s at what this schedule
    happened to draw (agentic over-sampling predicted at 0.57 of measured). So the pilot is replayed
    under candidate knees, the seconds per token below each set so that the replay's token-weighted
    seconds are the pilot's (`_at_knee`), and the knee whose replay decodes as many requests at once
    as the pilot did is kept: powers of two, then two bisections in log between the two that bracket
    it. The load falls as the knee rises (a later knee: faster crowds, fewer decoding at once). The
    replay's steps/h only chooses between this curve and the former one (below). The load is over the
    servers' busy time where the pilot measured it so (`load_busy`), else over the wall time."""
    pc = typed(pilot_cfg)
    budget = budget or Budget()
    base = dataclasses.replace(SimConfig.from_config(pc), steps=steps or max(pilot.steps, 3),
                               train_s=pilot.train_s[1])
    tok, want = pilot.token_s[1], max(pilot.load, 1e-9)

    def load(r) -> float:
        return r.decode_load if pilot.load_busy else r.decode_load * (1 - r.inference_idle)
    fits = {}

    def at(knee: float):
        if knee not in fits:
            t, r = _at_knee(base, source, tok, knee, budget)
            fits[knee] = (t, r, math.log(max(load(r), 1e-9) / want))
        return fits[knee]
    grid = [k for k in KNEES if k < pc.orchestrator.max_concurrency]
    prev = None
    for k in grid:
        if at(k)[2] <= 0:   # the replay decodes no more at once than the pilot: the knee is at most k
            if prev is not None:
                lo, hi = prev, k
                for _ in range(2):
                    m = math.sqrt(lo * hi)
                    lo, hi = (m, hi) if at(m)[2] > 0 else (lo, m)
            break
        prev = k
    else:
        at(0)   # above every knee below max_concurrency: flat is a candidate too
    knee = min(fits, key=lambda k: abs(fits[k][2]))
    # The loads can mislead where the pilot's requests do not start as the simulator starts them (its
    # event loop staggers them on a loaded host), so the former curve, flat at the pilot's seconds per
    # token up to its load, is the other candidate, and the one whose replay steps as the pilot did is
    # kept; and where no knee replays the pilot's load within 25% (a single-turn batch's requests start
    # and end together, at one load whatever the knee), the load says nothing of the knee: the former.
    old = budget.run(dataclasses.replace(base, token_s=tok, decode_knee=max(pilot.load, 1.0)), source,
                     "the pilot under a flat curve")
    miss = lambda r: abs(math.log(max(r.steps_per_hour, 1e-9) / max(pilot.steps_per_hour, 1e-9)))  # noqa: E731
    if abs(fits[knee][2]) > math.log(1.25) or miss(old) < miss(fits[knee][1]):
        return tok, max(pilot.load, 1.0), old
    return fits[knee][0], knee, fits[knee][1]


def predict_target(cfg, pilot: Pilot, pilot_cfg=None, source=None, steps: int | None = None,
                   seed: int = 0, pilot_source=None, model_error: float = MODEL_ERROR,
                   budget: "Budget | None" = None) -> Calibrated:
    """Steps/h of config `cfg` from the pilot's measurements (see the module docstring): mid at the
    pilot's median trainer seconds and the servers' load curve fitted on the pilot (`fit_server`; without
    the pilot's config, a knee at the pilot's load); low and high the slowest and fastest of the
    trainer's p90 / p10 under a flat token rate, the fitted curve or a saturated one. With the pilot's
    config, the replay's error (measured / replayed) widens the range on its side: what the simulator
    leaves out of this machine or cluster, it left out of the pilot too. Then both ends move out by
    `model_error`, the simulator's own error measured out of sample (MODEL_ERROR)."""
    c = typed(cfg)
    budget = budget or Budget()
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
    err, replay = 1.0, None
    t0, knee = pilot.token_s[1], round(b)
    if pilot_cfg is not None:   # the pilot replayed from its own inputs (its trainer and servers: unscaled)
        pc = typed(pilot_cfg)
        key = (pilot.source, pilot.steps_per_hour, pilot.token_s, seed)   # one fit per pilot, many targets
        if getattr(pilot, "_fit", (None,))[0] != key:
            src0 = pilot_source or pilot_source_of(pilot, pc.orchestrator.group_size, seed)
            pilot._fit = (key, fit_server(pilot, pc, src0, budget=budget))
        t0, knee, replay = pilot._fit[1]
        err = pilot.steps_per_hour / max(replay.steps_per_hour, 1e-9)

    def run(train_s: float, curve: str):
        tok = {"flat": pilot.token_s[1], "fitted": t0, "saturated": pilot.token_s[1] / b}[curve] * scale_k
        s = dataclasses.replace(sim, train_s=train_s * scale_t, token_s=tok,
                                decode_knee={"flat": 0, "fitted": knee, "saturated": 1}[curve])
        return budget.run(s, src, f"the target, trainer at {train_s * scale_t:.3g} s, {curve} curve")
    res = {"mid": run(pilot.train_s[1], "fitted")}
    for name, ts in (("slow", pilot.train_s[2]), ("fast", pilot.train_s[0])):
        for curve in ("flat", "fitted", "saturated"):
            res[f"{name}_{curve}"] = run(ts, curve)
    if replay is not None:
        res["pilot_replay"] = replay
    mid = res["mid"].steps_per_hour
    low = min([r.steps_per_hour for k, r in res.items() if k.startswith("slow")] + [mid]) * min(1.0, err)
    high = max([r.steps_per_hour for k, r in res.items() if k.startswith("fast")] + [mid]) * max(1.0, err)
    return Calibrated(low=low / (1 + model_error), mid=mid, high=high * (1 + model_error),
                      train_s=pilot.train_s[1] * scale_t, token_s=t0 * scale_k, scaled=how, pilot_error=err,
                      results=res, knee=knee, knee_token_s=t0, model_error=model_error, raw=(low, high))


def _rate(x: float) -> str:
    """Steps/h as printed: whole numbers, and two figures below 10 (a pilot far from its target can
    predict 0.0004 steps/h, which '0' would hide)."""
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def kind_warning(cfg, pilot_cfg) -> str | None:
    """One line when the pilot ran another environment or model family than the target (None if not):
    its times then say little of the target's, however launch.perf scales them (a debug pilot of the
    digits task on a 0.2M-parameter qwen3 carried to Kimi on SWE scales the trainer x1.4e7)."""
    if pilot_cfg is None:
        return None
    c, pc = typed(cfg), typed(pilot_cfg)
    pairs = (("environment", pc.env.name, c.env.name), ("model family", pc.model.family, c.model.family))
    diff = [f"{what} {a} (pilot) vs {b} (target)" for what, a, b in pairs if a != b]
    if not diff:
        return None
    return (f"calibrate: warning: the pilot differs from the target in {' and '.join(diff)}: its measured "
            f"times are carried over by launch.perf's ratio of the two configurations, an extrapolation; "
            f"a pilot of the target's environment and model family measures what this predicts")


def calibrate_lines(cfg, run_dir: str, budget: Budget | None = None) -> list[str]:
    """`launch plan --calibrate RUN_DIR`'s lines. The pilot may be a teammate's run: its files are read as
    foreign data (not required to be this user's) and checked instead (`Pilot.from_run`,
    `pilot_config`); a pilot of another environment or model family is warned about on stderr; the
    simulations are bounded (`Budget`)."""
    run_dir = str(safefs.resolve_run_dir(run_dir))   # the user's own argument: a link to it is theirs
    try:
        st = safefs.lstat(run_dir)
    except safefs.UnsafePath as e:
        raise ConfigError(f"--calibrate: {e}") from None
    if st is None or not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"--calibrate {run_dir}: {'missing' if st is None else safefs.what(st.st_mode)}, not "
                          f"a directory (a finished pilot run's directory)")
    pilot_cfg = pilot_config(run_dir)
    p = Pilot.from_run(run_dir, pilot_cfg)
    budget = budget or Budget()
    if (warn := kind_warning(cfg, pilot_cfg)) is not None:
        print(warn, file=budget.err, flush=True)
    r = predict_target(cfg, p, pilot_cfg, budget=budget)
    m = r.results["mid"]
    replay = (f"; the pilot replayed: {_rate(r.results['pilot_replay'].steps_per_hour)} steps/h against "
              f"{_rate(p.steps_per_hour)} measured" if "pilot_replay" in r.results else "; no config.yaml: no replay")
    return [p.line(),
            f"calibrated ({r.scaled}): {_rate(r.low)} / {_rate(r.mid)} / {_rate(r.high)} steps/h low / mid / high "
            f"(step {3600 / max(r.high, 1e-9):.2f} .. {3600 / max(r.low, 1e-9):.2f} s); mid: trainer idle "
            f"{m.trainer_idle:.1%}, wasted {m.wasted_fraction:.1%}, inference idle {m.inference_idle:.1%}{replay}",
            f"servers' load curve from the pilot: {r.knee_token_s * 1e3:.2f} ms/token up to "
            + (f"{r.knee:.3g} sequences decoding, slower in proportion beyond" if r.knee else "any load (flat)")
            + f"; range widened by the simulator's out-of-sample error x{1 + r.model_error:.2f} (from "
            f"{_rate(r.raw[0])} / {_rate(r.raw[1])})"]
