"""Shared by the trainer tests: a tiny config and synthetic rollout batches (no vLLM, no orchestrator)."""
from __future__ import annotations

import numpy as np
import torch
from omegaconf import OmegaConf

from rl.contract.config import Config
from rl import exchange
from rl.contract.batch import RolloutBatch, Sample, ShardPlan


def tiny_cfg(run_dir, **trainer):
    cfg = OmegaConf.structured(Config)
    cfg.run_dir = str(run_dir)
    cfg.wandb.mode = "disabled"
    cfg.model.max_seq_len = 128
    t = {"max_steps": 4, "checkpoint_every": 3, "micro_batch_tokens": 96, "lr": 1e-2,
         "warm_start": {"steps": 2, "batch_size": 4, "lr": 1e-2}, **trainer}
    cfg.trainer = OmegaConf.merge(cfg.trainer, t)
    return cfg


def examples(n, rng):
    """Warm-start pairs that depend on the rng, like an environment's would."""
    out = []
    for _ in range(n):
        p = [rng.randrange(10, 500) for _ in range(rng.randint(3, 8))]
        out.append((p, [rng.randrange(10, 500) for _ in range(rng.randint(2, 6))]))
    return out


def synthetic_batch(step: int, seed: int = 0, n_samples: int = 8, vocab: int = 512) -> RolloutBatch:
    rng = np.random.default_rng([seed, step])
    samples = []
    for i in range(n_samples):
        p = rng.integers(10, vocab, rng.integers(3, 10)).tolist()
        c = rng.integers(10, vocab, rng.integers(2, 12)).tolist()
        lps = (-rng.uniform(0.5, 7.0, len(c))).tolist()
        vers = [max(0, step - int(rng.integers(0, 2)))] * len(c)
        samples.append(Sample(p, c, lps, vers, reward=float(rng.uniform()), group=i // 4))
    rewards = np.array([s.reward for s in samples])
    for s in samples:
        s.advantage = float(s.reward - rewards.mean())
    return RolloutBatch.from_samples(samples, meta={"reward_mean": float(rewards.mean())})


def publish_batches(run_dir, steps, seed: int = 0, plan: ShardPlan | None = None):
    """Synthetic batches; with `plan` cut into data-rank shards as the orchestrator cuts them, without
    it written as one unpacked shard (each trainer rank then reads the whole batch and packs it)."""
    for n in steps:
        exchange.publish(run_dir, "rollouts", n, lambda d: synthetic_batch(n, seed).save(d, plan), producer="test")


@torch.no_grad()
def fp8_hf_names(built) -> set[str]:
    """HF names of the weights the trainer multiplies in FP8: the FP8 modules' parameters set to NaN,
    read through the adapter (which splits fused wqkv and the experts into their HF tensors)."""
    from rl.models.common import hf_state_dict
    from rl.trainer import fp8 as fp8_training
    params = [p for _, m in fp8_training.fp8_modules(built.model) for p in m.parameters()]
    saved = [p.clone() for p in params]
    for p in params:
        p.fill_(float("nan"))
    try:
        nan = {k: torch.isnan(v) for k, v in hf_state_dict(built).items()}
    finally:
        for p, v in zip(params, saved):
            p.copy_(v)
    assert all(m.all() or not m.any() for m in nan.values())  # no HF tensor is part FP8, part not
    return {k for k, m in nan.items() if m.all()}
