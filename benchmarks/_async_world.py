"""The simulated world of benchmarks/async_rollouts.py: a toy policy over digits served by a stand-in
server whose generation costs time per token and more under load, the agentic latency model (turns of generation and tool
calls with heavy-tailed times), and a trainer that takes real Adam steps on the toy policy with the
configured off-policy correction (`trainer.mismatch`, rl.trainer.corrections).

Trainer/inference mismatch (`mismatch_kl` > 0): the server samples from, and reports the logprobs of, a
perturbed copy of the policy it serves, as an FP8 engine or a different MoE routing would. The
perturbation is one fixed random direction of the logits per run (a systematic numerical difference,
not fresh noise each step, which would average out), scaled for every version so that the exact mean
KL(served || trainer) per answer token, over positions and target digits, equals `mismatch_kl`.

The server's cost depends on its load (`Decoder`): a decode step serves every running sequence and takes
tok_s while at most `knee` of them run, then grows in proportion (memory-bound decode: the weights are
read once per step whatever the batch, until the batch's compute and KV reads take over). So the
server's tokens per second saturate at knee / tok_s: a wasted or over-sampled token takes time from a
useful one, as on a real engine; knee 0 is the old flat rate (every request at tok_s whatever the load).
The running requests share the steps exactly (processor sharing, re-timed whenever one starts or ends),
so the event loop's lag costs once per finished request, not once per token.

Also `pilot` and `predict`: what one run measured (launch.calibrate's `Pilot`) and launch.calibrate's
prediction of another configuration from it, out of sample. Kept apart from the benchmark's measuring and
reporting so each reads on its own; the orchestrator, its pool and the run directory the world drives are
the product's own (rl.orchestrator), unchanged, except that the world writes the plan.json and
config.yaml a launcher would and answers the weight watcher's server-record checks for its one server.
"""
from __future__ import annotations

import asyncio
import math
import random
import re
import statistics
import time
from pathlib import Path

import numpy as np


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

    def expected_reward(self, w: np.ndarray) -> float:
        """The exact expected reward of policy w (either latency model: the mean over positions and
        uniform target digits of the probability of the right digit), with no sampling noise: what a
        trainer step taught, apart from which rollouts the batch held."""
        p = np.exp(w - w.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        return float(np.mean(np.diagonal(p, axis1=1, axis2=2)))

    def targets(self, ids: list[int]) -> list[int]:
        key = tuple(ids[:32])
        if key not in self._targets:
            m = re.search(r"repeat ([\d ]+)", self.tok.decode(list(key)))
            self._targets[key] = [int(x) for x in m.group(1).split()][:self.n]
        return self._targets[key]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    z = x - x.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def mean_kl(q_logits: np.ndarray, p_logits: np.ndarray) -> float:
    """Exact KL(q || p) of the toy's rows (position, target digit), averaged over the rows."""
    lq, lp = _log_softmax(q_logits), _log_softmax(p_logits)
    return float(np.mean(np.sum(np.exp(lq) * (lq - lp), axis=-1)))


def perturbed(w: np.ndarray, direction: np.ndarray, kl: float) -> np.ndarray:
    """w + s * direction with s set (bisection: the KL grows with s) so that mean_kl(served, w) = kl."""
    if kl <= 0:
        return w
    lo, hi = 0.0, 1.0
    while mean_kl(w + hi * direction, w) < kl:
        hi *= 2
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_kl(w + mid * direction, w) < kl else (lo, mid)
    return w + hi * direction


class World:
    def __init__(self, toy: Toy, tok_s: float, mismatch_kl: float = 0.0, seed: int = 0):
        self.toy, self.tok_s, self.mismatch_kl = toy, tok_s, float(mismatch_kl)
        self.params = {0: toy.w0.copy()}
        self._served: dict[int, np.ndarray] = {}
        self._direction = np.random.default_rng(10_000 + seed).standard_normal(toy.w0.shape).astype(np.float32)
        self.history = [(0.0, 0)]  # (monotonic time, version) as the servers switched
        self.generated = 0
        self.by_group: dict = {}  # group id (the pool's; None in batch mode) -> tokens generated
        self.by_rollout: dict = {}  # (group id, rollout index) -> tokens generated
        self.gen_s, self.gen_tokens, self.tool_s, self.tool_planned = 0.0, 0, 0.0, 0.0  # for launch.simulate

    def count(self, n: int) -> None:
        from rl.orchestrator import accounting as pool
        g, r = pool.GROUP.get(), pool.ROLLOUT.get()
        gid = g.gid if g is not None else None
        self.generated += n
        self.by_group[gid] = self.by_group.get(gid, 0) + n
        # per rollout too: a drop under stale_policy=release may cover some of a group's rollouts only
        i = next((i for i, x in g.rollouts.items() if x is r), None) if g is not None else None
        self.by_rollout[(gid, i)] = self.by_rollout.get((gid, i), 0) + n

    def served(self, v: int) -> np.ndarray:
        """The logits the server samples version v from: the policy itself, or its perturbed copy."""
        if v not in self._served:
            self._served[v] = perturbed(self.params[v], self._direction, self.mismatch_kl)
        return self._served[v]

    def version_at(self, t: float) -> int:
        v = self.history[0][1]
        for tt, vv in self.history:
            if tt <= t:
                v = vv
        return v


class _Job:
    def __init__(self, n: int, fut):
        self.n, self.left, self.fut = n, float(n), fut


class Decoder:
    """The server's decode steps shared by its running requests: step time tok_s * max(1, b / knee) at
    b requests (knee 0: tok_s at any b); `run(n)` returns when n tokens of this request are out."""

    def __init__(self, tok_s: float, knee: int = 0):
        self.tok_s, self.knee = tok_s, knee
        self.jobs: set[_Job] = set()
        self.t = time.monotonic()
        self.changed = asyncio.Event()
        self.task = None
        self.busy_s, self.load_area = 0.0, 0.0   # seconds with a request running, and b over them

    def step_s(self, b: int) -> float:
        return self.tok_s * max(1.0, b / self.knee) if self.knee > 0 else self.tok_s

    def _advance(self) -> None:
        now, b = time.monotonic(), len(self.jobs)
        if b:
            d = (now - self.t) / self.step_s(b)
            for j in self.jobs:
                j.left -= d
            self.busy_s += now - self.t
            self.load_area += b * (now - self.t)
        self.t = now

    async def _manage(self) -> None:
        while self.jobs:
            self.changed.clear()
            nxt = max(min(j.left for j in self.jobs), 0.0) * self.step_s(len(self.jobs))
            try:
                async with asyncio.timeout(nxt):
                    await self.changed.wait()
            except TimeoutError:
                pass
            self._advance()
            for j in [j for j in self.jobs if j.left <= 1e-9]:
                self.jobs.discard(j)
                if not j.fut.done():
                    j.fut.set_result(None)
        self.task = None

    def _kick(self) -> None:
        self.changed.set()
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._manage())

    async def run(self, n: int, on_cancel) -> None:
        """n tokens of one request; cancelled, `on_cancel(tokens out before the abort)` is called first."""
        self._advance()
        job = _Job(n, asyncio.get_running_loop().create_future())
        self.jobs.add(job)
        self._kick()
        try:
            await job.fut
        except asyncio.CancelledError:
            self._advance()
            self.jobs.discard(job)
            self._kick()
            on_cancel(min(n, int(n - max(job.left, 0.0))))
            raise


class SimServer:
    """An inference server: a toy policy's tokens at the `Decoder`'s load-dependent rate; reloads land in
    flight (every token carries the version current when it was produced)."""

    def __init__(self, world: World, turn_tokens: int, knee: int = 0):
        self.w, self.turn_tokens = world, turn_tokens
        self.decoder = Decoder(world.tok_s, knee)

    async def generate(self, prompt_ids, max_tokens, temperature=1.0, top_p=1.0, seed=None, request_id=None, **kw):
        from rl.orchestrator import accounting as pool
        from rl.orchestrator.client import Completion
        toy, w = self.w.toy, self.w
        multi = self.turn_tokens > 0
        n_tok = min(self.turn_tokens if multi else toy.n + 1, max_tokens)
        t0 = time.monotonic()

        def cancelled(part: int) -> None:
            w.count(part)
            pool.count_generated(part)  # the orchestrator never sees a cancelled request's tokens
        await self.decoder.run(n_tok, cancelled)
        t1 = time.monotonic()
        w.count(n_tok)
        w.gen_s, w.gen_tokens = w.gen_s + t1 - t0, w.gen_tokens + n_tok
        rng = np.random.default_rng(seed)
        tg = toy.targets(prompt_ids)
        ids, lps, vers = [], [], []
        for j in range(n_tok):   # token j came out at its share of the request's time (rates vary)
            v = w.version_at(t0 + (j + 1) * (t1 - t0) / n_tok)
            vers.append(v)
            if j < toy.n:
                logits = w.served(v)[j, tg[j]]
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
    """Reads batch n, trains with the real loss (the configured correction, each token's sample index
    for the sequence rules) on its loss mask, publishes version n + 1."""
    import torch

    from rl import exchange
    from rl.contract import offpolicy
    from rl.contract.batch import RolloutBatch
    from rl.metrics import MetricsLogger
    from rl.runtime import mark_done
    from rl.trainer.loss import LossConfig, finalize_stats, pg_loss
    loss_cfg = LossConfig.from_trainer(cfg.trainer)
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
        corr = {}
        if mask.sum() > 0:
            sample = torch.tensor(np.repeat(np.arange(b.num_samples), counts), dtype=torch.float32)
            loss, st = pg_loss(lp, lp_inf, adv, mask, loss_cfg, sample=sample, n_samples=b.num_samples)
            loss.backward()
            opt.step()
            corr = {k: v for k, v in finalize_stats(st).items() if k != "loss_tokens"}
        await asyncio.sleep(train_s)  # the trainer's compute
        world.params[n + 1] = W.detach().numpy().copy()
        policy_reward = toy.expected_reward(world.params[n + 1])
        exchange.publish(run_dir, "weights", n + 1, lambda d: (d / "w").write_text("toy"), producer="trainer")
        m = {"reward_mean": float(b.rewards.mean()), "wait_s": t0 - t_wait, "time": time.time(),
             "lag": float(lag[b.loss_mask > 0].mean()) if b.loss_mask.any() else 0.0,
             "lag_max": int(lag.max()) if len(lag) else 0, "loss_tokens": int(b.loss_mask.sum()),
             "policy_reward": policy_reward, **corr}
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


class WorldServers:
    """The orchestrator's server view (rl.orchestrator.servers) in this world: one server, always up,
    never scaled; it has no server record, so the view hands out the simulated server itself."""

    def __init__(self, server):
        self.server = server

    def up(self) -> dict:
        return {0: None}

    def connect(self, index: int, record) -> "SimServer":
        return self.server

    def workers(self, index: int) -> int:
        return 1

    def metrics(self) -> dict:
        return {"servers_up": 1, "servers_planned": 1}


async def sim_run(run_dir: Path, cfg, model: str, a, tok, mismatch_kl: float = 0.0) -> dict:
    from rl import exchange
    from rl.orchestrator.loop import Orchestrator
    from rl.orchestrator.versions import VersionTracker
    from rl.runtime import StopFlag
    n_digits = int(cfg.env.digits.n_digits)
    toy = Toy(tok, n_digits)
    world = World(toy, a.tok_ms / 1000, mismatch_kl, seed=int(cfg.seed))
    import torch  # before the clock starts: the first import of Adam takes seconds and would block the loop
    world.W = torch.tensor(toy.w0, requires_grad=True)
    world.opt = torch.optim.Adam([world.W], lr=a.lr, foreach=False)
    server = SimServer(world, a.turn_tokens if model == "agentic" else 0, getattr(a, "decode_knee", 0))
    orch = Orchestrator(run_dir, cfg, stop=StopFlag(install=False), servers=WorldServers(server))
    if model == "agentic":
        orch.sampler.env, orch.sampler.multi_turn = AgenticEnv(n_digits, a), True
        orch.sampler.env.world = world
    # The world's one server has no launcher: plan.json is written as `launch run` would, and the
    # orchestrator's server view (rl/orchestrator/servers.py) is the world's (above): its one server, always up.
    from launch.plan import make_plan
    from rl.contract import paths
    import yaml
    from omegaconf import OmegaConf

    from rl.contract.atomic import atomic_write_json, atomic_write_text
    plain = OmegaConf.to_container(cfg, resolve=True)
    atomic_write_json(paths.plan_file(run_dir), make_plan(plain, check_memory=False).to_dict())
    atomic_write_text(paths.config_file(run_dir), yaml.safe_dump(plain, sort_keys=False))   # launch.calibrate reads it
    orch.sampler.clients = [server]
    orch.sampler.tokenizer, orch.sampler.tracker = tok, VersionTracker(0)
    steps = int(cfg.trainer.max_steps)
    exchange.publish(run_dir, "weights", 0, lambda d: (d / "w").write_text("toy"), producer="trainer")
    t_start = time.time()  # the clock of time-to-reward (metrics.jsonl's `time` is wall time too)
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
    d = orch.sampler.clients[0].decoder
    world.decode_load = d.load_area / d.busy_s if d.busy_s else 0.0   # requests decoding, over the busy time
    return {"server_generated": world.generated, "by_group": world.by_group, "by_rollout": world.by_rollout, "env": orch.sampler.env,
            "max_lag_trainer": max_lag, "world": world, "t_start": t_start}


def pilot(run_dir: Path, cfg, out: dict, a):
    """What a run measured, as launch.calibrate's `Pilot`: the trainer's busy seconds per step (p10, median,
    p90 from metrics.jsonl), the server's seconds per generated token as its requests saw them (the
    decoder's load included, its queue not) and the time-averaged number decoding; and, for the episodes
    `predict` replays, the tool calls' actual / planned seconds (the event loop's lag on a loaded
    machine) and the multi-turn driver's seconds per turn outside generation and tools."""
    from launch.calibrate import Pilot, _pct
    from rl.metrics import read_metrics
    ms = read_metrics(run_dir)
    busy = [m1["time"] - m0["time"] - m1["wait_s"] for m0, m1 in zip(ms, ms[1:])] or [a.train_s]
    w = out["world"]
    tok = w.gen_s / w.gen_tokens if w.gen_tokens else a.tok_ms / 1000
    turns = sum(m.get("orchestrator/turns_total", 0) for m in ms)
    outside = sum(m.get("orchestrator/episode_s_mean", 0) * m.get("orchestrator/episodes", 0)
                  - m.get("orchestrator/turn_gen_s", 0) - m.get("orchestrator/turn_env_s", 0) for m in ms)
    p = Pilot(source=str(run_dir), train_s=(_pct(busy, 0.1), statistics.median(busy), _pct(busy, 0.9)),
              token_s=(tok, tok, tok), load=max(w.decode_load, 1.0), tokens_per_turn=0, turns_mean=0, turns_sigma=0,
              env_s=max(outside / turns, 0.0) if turns else 0.0, env_sigma=0,
              steps_per_hour=(len(ms) - 1) / max(ms[-1]["time"] - ms[0]["time"], 1e-9) * 3600, steps=len(ms))
    p.stretch = w.tool_s / w.tool_planned if w.tool_planned else 1.0
    return p


def predict(cfg, p, env, model: str, a, pilot_cfg=None) -> dict:
    """launch.calibrate's prediction of this mode's steps/h from another run's measurements (`p`, the
    pilot: `pilot` of the same seed's sync run, `pilot_cfg` its config), out of sample: nothing of the
    run it predicts goes in.
    Episodes are the latency model's own, group by group, their tool seconds stretched as the pilot's were."""
    from launch.calibrate import predict_target
    from launch.simulate import Turn
    G, P = int(cfg.orchestrator.group_size), int(cfg.orchestrator.prompts_per_step)
    n_digits = int(cfg.env.digits.n_digits)

    def source(key: str):   # (the same for the pilot: tasks depend on the seed and the key alone)
        part = key.split("-")
        if part[0] == "group":   # the pool's task of group g; batch mode's task j of (step, attempt)
            task = env.sample_tasks(1, random.Random(f"{cfg.seed}-group-{part[1]}"))[0]
        else:
            task = env.sample_tasks(P, random.Random(f"{cfg.seed}-{part[1]}-{part[2]}"))[int(part[3])]
        if model == "agentic":
            return [[Turn(min(a.turn_tokens, int(cfg.orchestrator.max_tokens)), x * p.stretch + p.env_s)
                     for x in env.plan(task, i)] for i in range(G)]
        return [[Turn(n_digits + 1, task.get("latency_s", 0.0) * p.stretch + p.env_s)] for _ in range(G)]
    r = predict_target(cfg, p, pilot_cfg=pilot_cfg, source=source, steps=int(cfg.trainer.max_steps),
                       pilot_source=source)
    m = r.results["mid"]
    return {"steps_per_hour": r.mid, "low": r.low, "high": r.high, "trainer_idle": m.trainer_idle,
            "train_s": r.train_s, "token_s": r.token_s, "wasted_fraction": m.wasted_fraction, "pilot_error": r.pilot_error,
            "waiting_fraction": m.waiting_fraction, "sibling_wait_s": m.sibling_wait_s}
