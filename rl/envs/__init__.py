"""Environments: where prompts come from and how rollouts are scored.

`make_env(cfg)` returns the environment named by `cfg.env.name`. Single-turn environments implement
`sample_tasks`, `prompt` and `score` (the orchestrator does the sampling); multi-turn ones (the SWE
environment, `verifiers:*` environments through rl/envs/verifiers_adapter.py) implement `start(task)`
returning an episode the orchestrator drives turn by turn; rl/envs/base.py spells out both APIs. Both
may implement `sft_examples` for the supervised warm start of a tiny model.

`make_env` also sizes this process's environment executor (rl.envs.base.set_env_threads) to
`orchestrator.env_concurrency`: the blocking calls of every environment it makes run there, as many at
once as the orchestrator's slots allow (up to rl.envs.base.ENV_THREADS_MAX per process).
"""
from __future__ import annotations

from typing import Any


def make_env(cfg: Any):
    size_env_threads(cfg)
    name = cfg.env.name
    if name == "digits":
        from rl.envs.digits import DigitsEnv
        return DigitsEnv(cfg.env.digits)
    if name == "swe":
        return _swe_env(cfg.env, cfg)
    if name == "echo_tools":   # the data-plane rehearsal's environment (benchmarks/seed_rehearsal.py)
        from rl.envs.echo_tools import EchoToolsEnv
        return EchoToolsEnv(cfg.env.max_turns)
    if name.startswith("verifiers:"):
        from rl.envs.verifiers_adapter import load_verifiers_env
        return load_verifiers_env(name.split(":", 1)[1], cfg.env)
    raise ValueError(f"env.name={name!r}: unknown environment (digits, swe, echo_tools, verifiers:<module>)")


def size_env_threads(cfg: Any) -> int:
    """This process's environment executor sized to `orchestrator.env_concurrency` (capped: rl.envs.base);
    returns the size. A config without the key leaves the size as it is."""
    from rl.envs.base import env_threads, set_env_threads
    n = getattr(getattr(cfg, "orchestrator", None), "env_concurrency", None)
    return set_env_threads(int(n)) if n else env_threads()


def _swe_env(env_cfg: Any, cfg: Any = None, remote: bool | None = None):
    """SWEEnv from the typed `env` section: `env.max_turns` and `env.swe` (tasks: a dataset path in any
    format of docs/swe.md, default the built-in set; format, split, repos_dir, partial_credit; wall_s,
    tool_timeout_s, grade_timeout_s, output_chars; limits: the sandbox's
    per-command `Limits`; runtime, image_cache, max_sandbox_starts_per_s). With sandbox nodes in the
    run's plan (`cluster.sandbox_nodes`, or the count `cluster.sandbox_nodes_auto` derives), episodes
    open their sandboxes on the sandbox services (`remote=False`: the service itself, which runs them
    here)."""
    from rl.envs.swe.env import EnvConfig, SWEEnv
    from rl.envs.swe.runtimes import from_config
    from rl.envs.swe.sandbox import Limits
    s = env_cfg.swe
    config = EnvConfig(max_turns=int(env_cfg.max_turns), wall_s=float(s.wall_s),
                       tool_timeout_s=float(s.tool_timeout_s), output_chars=int(s.output_chars),
                       limits=Limits(**{k: int(v) for k, v in s.limits.items()}),
                       partial_credit=bool(s.partial_credit), runtime=from_config(s),
                       grade_timeout_s=float(s.grade_timeout_s))
    pool = None
    cl = getattr(cfg, "cluster", None)
    planned = cl is not None and (int(cl.sandbox_nodes) > 0 or bool(getattr(cl, "sandbox_nodes_auto", False)))
    if remote is not False and planned:
        from rl.envs.swe.runtime_remote import ServicePool
        pool = ServicePool.from_run_dir(str(cfg.run_dir), wait_s=max(float(s.wall_s), float(s.grade_timeout_s)))
    return SWEEnv(tasks=str(s.tasks) if s.tasks else None, config=config, format=str(s.format),
                  split=str(s.split) if s.split else None,
                  repos_dir=str(s.repos_dir) if s.repos_dir else None, sandboxes=pool)
