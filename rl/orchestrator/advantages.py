"""Group-relative advantages.

Each prompt is sampled `group_size` times; a sample's advantage is its reward minus the mean reward of
its group (the group is its own baseline, no value network). GRPO also divides by the group's standard
deviation; Dr. GRPO argues that this overweights near-unanimous groups and leaves it out. A group whose
rewards are all equal carries no signal: its advantages are zero.
"""
from __future__ import annotations

import numpy as np


def group_advantages(rewards: np.ndarray, groups: np.ndarray, kind: str = "grpo", eps: float = 1e-6) -> np.ndarray:
    rewards = np.asarray(rewards, np.float64)
    groups = np.asarray(groups)
    if rewards.shape != groups.shape:
        raise ValueError(f"rewards {rewards.shape} and groups {groups.shape} differ in shape")
    adv = np.zeros_like(rewards)
    for g in np.unique(groups):
        idx = groups == g
        r = rewards[idx]
        centred = r - r.mean()
        if kind == "grpo":
            std = r.std()
            centred = centred / (std + eps) if std > eps else np.zeros_like(centred)
        elif kind != "drgrpo":
            raise ValueError(f"orchestrator.advantage={kind!r}: unknown (grpo, drgrpo)")
        adv[idx] = centred
    return adv.astype(np.float32)
