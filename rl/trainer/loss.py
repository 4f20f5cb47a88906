"""The RL loss: importance-weighted policy gradient over tokens (pure torch, no model in here).

Tokens were sampled by the inference engine, from a policy version that may be a few steps behind
(asynchronous RL) and whose numerics differ from the trainer's (other kernels, FP8 weights). Per token
the trainer has its own logprob `lp` (with grad) and the engine's `lp_inf`; the importance ratio
r = exp(lp - lp_inf) (detached) corrects for the difference. How far-off tokens and samples are treated
is `trainer.mismatch`, one entry of the correction menu in rl.trainer.corrections (token TIS, the
token two-sided mask IcePop uses, sequence TIS and MIS, the geometric-mean sequence mask, M2PO's
second-moment mask, or plain importance sampling), each with its published formula there.

loss = -sum(w * A * lp * mask) / N, with N the number of loss tokens of the whole batch (token-level
normalisation, as in DAPO / Dr.GRPO: long completions are not down-weighted per token). `normalizer`
lets a caller that splits the batch in micro-batches pass the batch-wide N so the accumulated gradient
equals the full-batch one. Sequence rules need each token's sample index (`sample`): rows pack several
samples back to back.

The metrics describe the mismatch itself: `mismatch_kl` is the k3 estimator of KL(inference || trainer),
mean(r - 1 - log r) over loss tokens (non-negative, zero iff the two agree), `masked_fraction` the share
of loss tokens the rule dropped (or, for the truncations, capped); with sample indices also per sample:
`seq_masked_fraction` (samples a sequence rule dropped whole), `seq_log_ratio_mean` and
`seq_log_ratio_abs_max` (log of the sample's ratio prod r), `seq_geo_dev_mean` and `seq_geo_dev_max`
(|log| of the geometric-mean ratio: 0.01 is a 1% per-token drift).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rl.trainer import corrections
from rl.trainer.corrections import MODES, SEQUENCE_MODES  # noqa: F401  (the menu's names, re-exported)


@dataclass(frozen=True)
class LossConfig:
    mismatch: str = "truncate"
    ratio_min: float = 0.5
    ratio_max: float = 2.0
    geo_ratio_min: float = 0.99
    geo_ratio_max: float = 1.01
    m2_threshold: float = 0.04

    @classmethod
    def from_trainer(cls, t) -> "LossConfig":
        return cls(mismatch=str(t.mismatch), ratio_min=float(t.ratio_min), ratio_max=float(t.ratio_max),
                   geo_ratio_min=float(t.geo_ratio_min), geo_ratio_max=float(t.geo_ratio_max),
                   m2_threshold=float(t.m2_threshold))

    def __post_init__(self):
        if self.mismatch not in MODES:
            raise ValueError(f"trainer.mismatch={self.mismatch!r}: must be one of {', '.join(MODES)}")

    @property
    def sequence_level(self) -> bool:
        return self.mismatch in SEQUENCE_MODES


def pg_loss(lp: torch.Tensor, lp_inf: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
            cfg: LossConfig, *, entropy: torch.Tensor | None = None,
            normalizer: float | torch.Tensor | None = None, sample: torch.Tensor | None = None,
            n_samples: int | None = None, reduce_samples: Callable[[torch.Tensor], torch.Tensor] | None = None,
            gather_row: Callable | None = None, count_samples: bool = True,
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and metric sums over these tokens. All inputs have the same shape (advantages per token).

    `sample`: each token's sample index (needed by the sequence rules, and for the per-sample metrics);
    `n_samples`, `reduce_samples`, `gather_row`, `count_samples`: see rl.trainer.corrections.weights
    (context parallel: `reduce` and `gather` there).
    Returns (loss, stats): `stats` holds *sums* and counts (tokens, kl_sum, masked, entropy_sum, ratio_sum,
    ratio_max, the per-sample sums) so micro-batches can be added up; `finalize_stats` turns them into means.
    """
    m = mask.to(lp.dtype)
    log_r = (lp.detach() - lp_inf).masked_fill(m == 0, 0.0)
    r = log_r.exp()
    w, dropped, seq = corrections.weights(log_r, m, cfg, sample=sample, n_samples=n_samples,
                                          reduce=reduce_samples, gather=gather_row, count_samples=count_samples)
    n = m.sum() if normalizer is None else normalizer
    loss = -(w.detach() * advantages * lp * m).sum() / torch.clamp(torch.as_tensor(n, dtype=lp.dtype, device=lp.device), min=1.0)
    stats = {
        "tokens": m.sum(),
        "kl_sum": ((r - 1 - log_r) * m).sum(),
        "masked": dropped.sum(),
        "ratio_sum": (r * m).sum(),
        "ratio_max": (r * m).max() if m.numel() else torch.zeros((), device=lp.device),
        "entropy_sum": (entropy.detach() * m).sum() if entropy is not None else torch.zeros((), device=lp.device),
        **seq,
    }
    return loss, {k: v.detach() for k, v in stats.items()}


def is_max_stat(key: str) -> bool:
    """Statistics combined by max over micro-batches and ranks (the others add up)."""
    return key.endswith("_max")


def add_stats(a: dict | None, b: dict) -> dict:
    if a is None:
        return dict(b)
    return {k: torch.maximum(a[k], b[k]) if is_max_stat(k) else a[k] + b[k] for k in a}


def finalize_stats(s: dict) -> dict[str, float]:
    n = max(float(s["tokens"]), 1.0)
    out = {
        "loss_tokens": int(s["tokens"]),
        "mismatch_kl": float(s["kl_sum"]) / n,
        "masked_fraction": float(s["masked"]) / n,
        "entropy": float(s["entropy_sum"]) / n,
        "ratio_mean": float(s["ratio_sum"]) / n,
        "ratio_max": float(s["ratio_max"]),
    }
    seqs = float(s.get("seqs", 0.0))
    if seqs > 0:
        out.update({"seq_masked_fraction": float(s["seqs_masked"]) / seqs,
                    "seq_log_ratio_mean": float(s["seq_log_ratio_sum"]) / seqs,
                    "seq_log_ratio_abs_max": float(s["seq_log_ratio_abs_max"]),
                    "seq_geo_dev_mean": float(s["seq_geo_dev_sum"]) / seqs,
                    "seq_geo_dev_max": float(s["seq_geo_dev_max"])})
    return out
