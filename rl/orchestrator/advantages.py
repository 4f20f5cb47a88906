"""Group-relative advantages.

Each prompt is sampled `group_size` times; a sample's advantage is its reward minus the mean reward of
its group (the group is its own baseline, no value network). GRPO also divides by the group's standard
deviation; Dr. GRPO argues that this overweights near-unanimous groups and leaves it out. A group whose
rewards are all equal carries no signal: its advantages are zero.

Under `stale_policy=release` (rl/orchestrator/groups.py) a group may be trained in parts, and its
baseline set is then a *snapshot*: the siblings finished at the first batch the group was eligible for
a part. `refs[g] = (snapshot {index: reward}, the entry's rollout indices, rewards of the group's rollouts
trained earlier {index: reward})` for such an entry g. Rollout i is taken against its siblings in the
snapshot, or against every sibling when the snapshot holds none but i itself (it then waited for the
whole group): `c * (r_i - mean(siblings))` with c = (G - 1) / G, under GRPO divided by the std of the
siblings' rewards and r_i. A whole group's `r_i - mean(R)` is exactly c times its leave-one-out
advantage `r_i - mean(R without i)`, so both have the same scale; an empty snapshot gives the usual
numbers. Why a snapshot: the baseline must be a function of the siblings alone. "The siblings finished
by the time i is trained" is not (whether i is trained early depends on its own length), and where
reward and length go together that biased the gradient (benchmarks/release_bias.py). The scale must
not depend on how many siblings there are for the same reason, hence the constant c.

Rewards must be finite: one NaN or inf would make every advantage of its group NaN (the mean is the
baseline). The orchestrator drops such a group as a failed one before it gets here
(rl.orchestrator.sampling.check_trainable); a non-finite reward reaching this function is refused.
"""
from __future__ import annotations

import numpy as np


def group_advantages(rewards: np.ndarray, groups: np.ndarray, kind: str = "grpo", eps: float = 1e-6,
                     refs: dict[int, tuple[dict[int, float], list[int], dict[int, float]]] | None = None,
                     group_size: int | None = None) -> np.ndarray:
    rewards = np.asarray(rewards, np.float64)
    groups = np.asarray(groups)
    if rewards.shape != groups.shape:
        raise ValueError(f"rewards {rewards.shape} and groups {groups.shape} differ in shape")
    if kind not in ("grpo", "drgrpo"):
        raise ValueError(f"orchestrator.advantage={kind!r}: unknown (grpo, drgrpo)")
    if (bad := ~np.isfinite(rewards)).any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"reward {rewards[i]} of sample {i} (group {groups[i]}) is not finite: its group "
                         f"must be dropped as failed, not given NaN advantages")
    adv = np.zeros_like(rewards)
    for g in np.unique(groups):
        idx = groups == g
        r = rewards[idx]
        if refs and int(g) in refs:
            adv[idx] = _against_snapshot(r, *refs[int(g)], kind, eps, group_size, g)
            continue
        centred = r - r.mean()
        if kind == "grpo":
            std = r.std()
            centred = centred / (std + eps) if std > eps else np.zeros_like(centred)
        adv[idx] = centred
    out = adv.astype(np.float32)
    if (bad := ~np.isfinite(out)).any():  # finite float64 rewards so large their float32 advantage overflows
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"advantage of sample {i} (group {groups[i]}, reward {rewards[i]}) overflows float32")
    return out


def _against_snapshot(r: np.ndarray, snapshot: dict[int, float], indices: list[int], earlier: dict[int, float],
                      kind: str, eps: float, group_size: int | None, g) -> np.ndarray:
    if group_size is None or group_size < 2:
        raise ValueError(f"group {g}: a group trained against a snapshot needs the group size (>= 2)")
    if len(indices) != len(r):
        raise ValueError(f"group {g}: {len(r)} rewards for rollout indices {indices}")
    if not all(np.isfinite(list(snapshot.values()) + list(earlier.values()))):
        raise ValueError(f"group {g}: a reward of its snapshot or of an earlier part is not finite")
    c = (group_size - 1) / group_size
    out = np.zeros_like(r)
    for j, (i, x) in enumerate(zip(indices, r)):
        sib = [v for k, v in snapshot.items() if k != i]
        if not sib:   # only i was finished at the snapshot: it waited for its group, every sibling counts
            sib = list(earlier.values()) + [v for m, v in enumerate(r) if m != j]
        if not sib:   # a group reduced to one rollout (its others dropped before a restart): no signal
            continue
        a = c * (x - np.mean(sib))
        if kind == "grpo":
            std = np.std(sib + [x])
            a = a / (std + eps) if std > eps else 0.0
        out[j] = a
    return out
