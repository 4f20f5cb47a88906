"""Environments: where prompts come from and how rollouts are scored.

`make_env(cfg)` returns the environment named by `cfg.env.name`. Single-turn environments implement
`sample_tasks`, `prompt` and `score` (the orchestrator does the sampling); multi-turn ones (the SWE
environment, `verifiers:*` environments through rl/envs/verifiers_adapter.py) implement `start(task)`
returning an episode the orchestrator drives turn by turn; rl/envs/base.py spells out both APIs. Both
may implement `sft_examples` for the supervised warm start of a tiny model.
"""
from __future__ import annotations

from typing import Any


def make_env(cfg: Any):
    name = cfg.env.name
    if name == "digits":
        from rl.envs.digits import DigitsEnv
        return DigitsEnv(cfg.env)
    if name == "swe":
        return _swe_env(cfg.env)
    if name.startswith("verifiers:"):
        from rl.envs.verifiers_adapter import load_verifiers_env
        return load_verifiers_env(name.split(":", 1)[1], cfg.env)
    raise ValueError(f"env.name={name!r}: unknown environment (digits, swe, verifiers:<module>)")


def _swe_env(env_cfg: Any):
    """SWEEnv from the `env` group: `env.max_turns`, and under `env.args`: `tasks` (a SWE-bench-format
    JSONL path; default the built-in set), `wall_s`, `tool_timeout_s`, `output_chars` and `limits`
    (the sandbox's per-command `Limits` fields: cpu_s, memory_bytes, ...)."""
    from rl.envs.swe.env import EnvConfig, SWEEnv
    from rl.envs.swe.sandbox import Limits
    args = dict(env_cfg.get("args", {}) or {})
    tasks = args.pop("tasks", None)
    limits = dict(args.pop("limits", {}) or {})
    known = {"wall_s", "tool_timeout_s", "output_chars"}
    if unknown := sorted(set(args) - known):
        raise ValueError(f"env.args.{unknown[0]}: unknown for env.name=swe "
                         f"(tasks, {', '.join(sorted(known))}, limits)")
    config = EnvConfig(max_turns=int(env_cfg.get("max_turns", EnvConfig.max_turns)),
                       limits=Limits(**limits) if limits else EnvConfig().limits, **args)
    return SWEEnv(tasks=str(tasks) if tasks else None, config=config)
