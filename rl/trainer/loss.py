"""The RL loss: importance-sampled, token-level policy gradient (pure torch, no model in here).

Tokens were sampled by the inference engine, from a policy version that may be a few steps behind
(asynchronous RL) and whose numerics differ from the trainer's (other kernels, FP8 weights). Per token
the trainer has its own logprob `lp` (with grad) and the engine's `lp_inf`; the importance ratio
r = exp(lp - lp_inf) (detached) corrects for the difference. How far-off tokens are treated is
`trainer.mismatch`:

- "mask":     tokens with r outside [ratio_min, ratio_max] are dropped from the loss (their gradient is
              zero; they still count in the normaliser so one bad token does not upweight the rest);
- "truncate": w = min(r, ratio_max) (truncated importance sampling);
- "none":     w = r.

loss = -sum(w * A * lp * mask) / N, with N the number of loss tokens of the whole batch (token-level
normalisation, as in DAPO / Dr.GRPO: long completions are not down-weighted per token). `normalizer`
lets a caller that splits the batch in micro-batches pass the batch-wide N so the accumulated gradient
equals the full-batch one.

The metrics describe the mismatch itself: `mismatch_kl` is the k3 estimator of KL(inference || trainer),
mean(r - 1 - log r) over loss tokens (non-negative, zero iff the two agree), `masked_fraction` the share
of loss tokens the "mask" rule dropped (or that "truncate" clipped).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MODES = ("mask", "truncate", "none")


@dataclass(frozen=True)
class LossConfig:
    mismatch: str = "mask"
    ratio_min: float = 0.5
    ratio_max: float = 2.0

    @classmethod
    def from_trainer(cls, t) -> "LossConfig":
        return cls(mismatch=str(t.mismatch), ratio_min=float(t.ratio_min), ratio_max=float(t.ratio_max))

    def __post_init__(self):
        if self.mismatch not in MODES:
            raise ValueError(f"trainer.mismatch={self.mismatch!r}: must be one of {', '.join(MODES)}")


def pg_loss(lp: torch.Tensor, lp_inf: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
            cfg: LossConfig, *, entropy: torch.Tensor | None = None,
            normalizer: float | torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and metric sums over these tokens. All inputs have the same shape (advantages per token).

    Returns (loss, stats): `stats` holds *sums* and counts (tokens, kl_sum, masked, entropy_sum, ratio_sum,
    ratio_max) so micro-batches can be added up; `finalize_stats` turns them into means.
    """
    m = mask.to(lp.dtype)
    log_r = (lp.detach() - lp_inf).masked_fill(m == 0, 0.0)
    r = log_r.exp()
    if cfg.mismatch == "mask":
        keep = ((r >= cfg.ratio_min) & (r <= cfg.ratio_max)).to(lp.dtype)
        w = r * keep
        dropped = (1 - keep) * m
    elif cfg.mismatch == "truncate":
        w = r.clamp(max=cfg.ratio_max)
        dropped = (r > cfg.ratio_max).to(lp.dtype) * m
    else:
        w = r
        dropped = torch.zeros_like(m)
    n = m.sum() if normalizer is None else normalizer
    loss = -(w.detach() * advantages * lp * m).sum() / torch.clamp(torch.as_tensor(n, dtype=lp.dtype, device=lp.device), min=1.0)
    stats = {
        "tokens": m.sum(),
        "kl_sum": ((r - 1 - log_r) * m).sum(),
        "masked": dropped.sum(),
        "ratio_sum": (r * m).sum(),
        "ratio_max": (r * m).max() if m.numel() else torch.zeros((), device=lp.device),
        "entropy_sum": (entropy.detach() * m).sum() if entropy is not None else torch.zeros((), device=lp.device),
    }
    return loss, {k: v.detach() for k, v in stats.items()}


def add_stats(a: dict | None, b: dict) -> dict:
    if a is None:
        return dict(b)
    return {k: torch.maximum(a[k], b[k]) if k == "ratio_max" else a[k] + b[k] for k in a}


def finalize_stats(s: dict) -> dict[str, float]:
    n = max(float(s["tokens"]), 1.0)
    return {
        "loss_tokens": int(s["tokens"]),
        "mismatch_kl": float(s["kl_sum"]) / n,
        "masked_fraction": float(s["masked"]) / n,
        "entropy": float(s["entropy_sum"]) / n,
        "ratio_mean": float(s["ratio_sum"]) / n,
        "ratio_max": float(s["ratio_max"]),
    }
