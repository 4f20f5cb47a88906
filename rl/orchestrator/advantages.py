"""Group-relative advantages.

Each prompt is sampled `group_size` times; a sample's advantage is its reward minus the mean reward of
its group (the group is its own baseline, no value network). GRPO also divides by the group's standard
deviation; Dr. GRPO argues that this overweights near-unanimous groups and leaves it out. A group whose
rewards are all equal carries no signal: its advantages are zero.

A batch entry may be part of a group (`stale_policy=release`, rl/orchestrator/groups.py): some of its
siblings were trained in an earlier batch. Their rewards (`baselines[g]`) join the reference set R the
entry's advantages are taken against: `r_i - mean(R)`, divided by `std(R)` under GRPO. R always holds
r_i, so this is the leave-one-out baseline scaled by (|R| - 1) / |R|; for a whole group it is the usual
formula, unchanged.

Rewards must be finite: one NaN or inf would make every advantage of its group NaN (the mean is the
baseline). The orchestrator drops such a group as a failed one before it gets here
(rl.orchestrator.sampling.check_trainable); a non-finite reward reaching this function is refused.
"""
from __future__ import annotations

import numpy as np


def group_advantages(rewards: np.ndarray, groups: np.ndarray, kind: str = "grpo", eps: float = 1e-6,
                     baselines: dict[int, list[float]] | None = None) -> np.ndarray:
    rewards = np.asarray(rewards, np.float64)
    groups = np.asarray(groups)
    if rewards.shape != groups.shape:
        raise ValueError(f"rewards {rewards.shape} and groups {groups.shape} differ in shape")
    if (bad := ~np.isfinite(rewards)).any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"reward {rewards[i]} of sample {i} (group {groups[i]}) is not finite: its group "
                         f"must be dropped as failed, not given NaN advantages")
    adv = np.zeros_like(rewards)
    for g in np.unique(groups):
        idx = groups == g
        r = rewards[idx]
        ref = np.concatenate([r, np.asarray((baselines or {}).get(int(g), []), np.float64)])
        if not np.isfinite(ref).all():
            raise ValueError(f"group {g}: a baseline reward of an earlier part is not finite")
        centred = r - ref.mean()
        if kind == "grpo":
            std = ref.std()
            centred = centred / (std + eps) if std > eps else np.zeros_like(centred)
        elif kind != "drgrpo":
            raise ValueError(f"orchestrator.advantage={kind!r}: unknown (grpo, drgrpo)")
        adv[idx] = centred
    out = adv.astype(np.float32)
    if (bad := ~np.isfinite(out)).any():  # finite float64 rewards so large their float32 advantage overflows
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"advantage of sample {i} (group {groups[i]}, reward {rewards[i]}) overflows float32")
    return out
