"""Online evaluation: the current policy on held-out tasks, on the rollouts' servers, beside training.

Every `eval.every` policy versions (version 0, the starting policy, included) and for the final version,
the orchestrator plays a held-out task set through a view of its sampler (rl.orchestrator.sampling):
the same servers and version tracker, its own sampling settings (`eval.temperature` 0 = greedy,
`eval.samples` completions per task for pass@k) and its own request budget (`eval.max_concurrency`),
so it neither changes nor starves the rollouts. Nothing it samples enters a batch. It runs as a task of
its own: a batch never waits for it, and the trainer never does either, except once at the very end
for the final version's result (`eval.final_timeout_s`, rl/trainer/bookkeeping.py).

Sampled by default (4 completions per task at temperature 1, the rollouts' own). A greedy evaluation
measures the policy's mode, which is right long before the policy is: on the embedded default greedy
pass@1 reached 1.0 at version 14 of 40 and said nothing for the rest of the run. pass@1 over samples at
the sampling temperature estimates the probability the trained distribution solves a task, the quantity
RL raises, so it keeps moving until the policy itself is near-deterministic; pass@k (k = samples) is
reported beside it. `eval.temperature=0 eval.samples=1` is the greedy evaluation.

Held-out tasks. `eval.tasks_file` names rows in the environment's own task format (the first
`eval.tasks`); otherwise an environment with a fixed task list (SWE, verifiers) has `eval.tasks` of its
tasks, drawn by a seeded shuffle, removed from training before the first rollout starts, and a
procedural one (digits) draws them from an RNG stream of their own (seeded by (seed, "eval")), which
training never draws from (with few digits an eval prompt can still coincide with a training one).

An evaluation of version v starts once the servers serve v. The servers move to newer versions while
it runs (weights load in flight), so each row records the versions its tokens really came from
(`eval/version_min`, `eval/version_max`); a version that comes and goes during another evaluation is
skipped rather than queued, since the servers cannot serve it again.

Records. `eval/results.jsonl` gets one fsynced line per evaluated version: `{"version": v, "eval/...":
...}`. The trainer folds new lines into its metrics (metrics.jsonl and wandb, keys `eval/...` with
`eval/version`). A resumed orchestrator reads the file and evaluates no version twice; `rl.prepare`
drops the lines of versions the resume discards (their weights are trained again). Every reader checks
each line against its schema (rl.contract.record_schemas.eval_result: an integer `version`, scalar
`eval/...` values, finite numbers) and skips a malformed one with a warning naming file:line.
"""
from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

from rl import exchange
from rl.contract import paths, record_schemas, safefs
from rl.orchestrator import accounting
from rl.runtime import is_done, log

ROLE = "orchestrator"


def results_file(run_dir: str | Path) -> Path:
    return paths.eval_results_file(run_dir)


def read_results(run_dir: str | Path) -> list[dict]:
    """The well-formed rows (rl.contract.record_schemas.eval_result); a malformed line is skipped with
    one warning naming file:line, so it never keeps the orchestrator from resuming."""
    return exchange.read_jsonl(results_file(run_dir), check=record_schemas.eval_result)


def due(version: int, every: int, final: int) -> bool:
    """Is policy version `version` one to evaluate? Every `every`-th, and the final one."""
    return every > 0 and (version % every == 0 or version == final)


def hold_out(env: Any, ecfg: Any, seed: int) -> list:
    """The held-out tasks (module docstring); removes them from a task-list environment's training set."""
    n = int(ecfg.tasks)
    if ecfg.tasks_file:
        load = getattr(env, "load_tasks", None)
        if not callable(load):
            raise ValueError(f"eval.tasks_file={ecfg.tasks_file}: {type(env).__name__} reads no task file")
        rows = load(str(ecfg.tasks_file))
        if not rows:
            raise ValueError(f"eval.tasks_file={ecfg.tasks_file}: no tasks")
        return rows[:n]
    tasks = getattr(env, "tasks", None)
    if isinstance(tasks, list):
        if n >= len(tasks):
            raise ValueError(f"eval.tasks={n}: the environment has {len(tasks)} tasks; holding out that many "
                             f"leaves none to train on (set eval.tasks below {len(tasks)}, eval.tasks_file, "
                             f"or eval.every=0)")
        order = list(range(len(tasks)))
        random.Random(f"{seed}-eval-split").shuffle(order)
        held = set(order[:n])
        out = [tasks[i] for i in sorted(held)]
        env.tasks = [t for i, t in enumerate(tasks) if i not in held]
        if hasattr(env, "by_id"):
            env.by_id = {t.instance_id: t for t in env.tasks}
        return out
    return env.sample_tasks(n, random.Random(f"{seed}-eval"))


def summarize(groups: list[list | None], solved_reward: float) -> dict:
    """The row of one evaluation: reward, pass@k and pass@1, lengths, failures, versions."""
    played = [g for g in groups if g is not None]
    samples = [s for g in played for s in g]
    rewards = [s.reward for s in samples]
    versions = accounting.trained_versions(samples).tolist()  # Sample fields may be numpy arrays
    k = max((len(g) for g in played), default=0)
    return {
        "eval/tasks": len(groups), "eval/failed_tasks": len(groups) - len(played), "eval/samples": len(samples),
        "eval/reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
        f"eval/pass@{k}": (sum(any(s.reward >= solved_reward for s in g) for g in played) / len(played)
                           if played else 0.0),
        "eval/pass@1": sum(r >= solved_reward for r in rewards) / len(rewards) if rewards else 0.0,
        "eval/completion_tokens_mean": (sum(len(s.completion_ids) for s in samples) / len(samples)
                                        if samples else 0.0),
        "eval/version_min": min(versions) if versions else None,
        "eval/version_max": max(versions) if versions else None,
    }


class Evaluator:
    def __init__(self, sampler: Any, run_dir: str | Path, cfg: Any, tasks: list):
        self.ecfg, self.run_dir, self.cfg = cfg.eval, Path(run_dir), cfg
        self.tasks = tasks
        self.final = int(cfg.trainer.max_steps)
        self.sampler = sampler.view(int(self.ecfg.max_concurrency), group_size=int(self.ecfg.samples),
                                    temperature=float(self.ecfg.temperature), top_p=float(self.ecfg.top_p),
                                    max_tokens=self.ecfg.max_tokens)
        self.done = {r["version"] for r in read_results(self.run_dir)}
        safefs.makedirs(results_file(self.run_dir).parent)

    async def evaluate(self, version: int) -> dict:
        t0 = time.monotonic()
        groups = await asyncio.gather(*(self.sampler.sample_group_or_none(t, i, version, -1)
                                        for i, t in enumerate(self.tasks)))
        row = {"version": version, "eval/version": version, **summarize(groups, float(self.ecfg.solved_reward)),
               "eval/seconds": time.monotonic() - t0, "time": time.time()}
        exchange.check_fence(self.run_dir, f"eval/{paths.EVAL_RESULTS}: version {version}")
        exchange.append_jsonl(results_file(self.run_dir), row)
        self.done.add(version)
        k = int(self.ecfg.samples)
        log(ROLE, f"eval of policy version {version}: reward {row['eval/reward_mean']:.3f}, pass@{k} "
                  f"{row[f'eval/pass@{k}']:.3f} on {len(self.tasks)} held-out tasks ({row['eval/seconds']:.1f} s)")
        return row

    async def run(self, stop: Any) -> None:
        """Evaluate each due version once the servers serve it, until the final one is evaluated."""
        tracker = self.sampler.tracker
        while self.final not in self.done and not stop.is_set():
            v = tracker.version
            if v not in self.done and due(v, int(self.ecfg.every), self.final):
                try:
                    await self.evaluate(v)
                except Exception as e:  # noqa: BLE001 - evaluation is a view: it never takes training down
                    log(ROLE, f"eval of policy version {v} failed ({type(e).__name__}: {e}); recorded, not retried")
                    exchange.append_jsonl(results_file(self.run_dir), {"version": v, "eval/version": v,
                                                                       "eval/error": f"{type(e).__name__}: {e}"[:1000]})
                    self.done.add(v)
                continue
            if is_done(self.run_dir) and v >= self.final:
                return   # the final version was evaluated by an earlier incarnation, or cannot be now
            await asyncio.sleep(0.1)
