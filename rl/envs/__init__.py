"""Environments: where prompts come from and how rollouts are scored.

`make_env(cfg)` returns the environment named by `cfg.env.name`. Single-turn environments implement
`sample_tasks`, `prompt` and `score` (the orchestrator does the sampling); multi-turn ones (the SWE
environment) implement `start(task)` returning an episode the orchestrator drives turn by turn. Both
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
        from rl.envs.swe.env import SWEEnv
        return SWEEnv(**dict(cfg.env.get("args", {}) or {}))
    if name.startswith("verifiers:"):
        from rl.envs.verifiers_adapter import load_verifiers_env
        return load_verifiers_env(name.split(":", 1)[1], cfg.env)
    raise ValueError(f"env.name={name!r}: unknown environment (digits, swe, verifiers:<module>)")
