"""The off-policy correction menu: per-token weights of the policy-gradient loss (`trainer.mismatch`).

Every loss token was sampled by the inference engine from a policy version up to `max_off_policy` steps
old, with numerics (FP8 weights, other kernels, MoE routing) that differ from the trainer's. Per token the
trainer has r_t = pi_train(y_t) / pi_infer(y_t) = exp(lp - lp_inf). A correction turns the r_t of a batch
into detached weights w_t (loss = -sum w_t A_t lp_t / N, rl.trainer.loss). The menu is what the peer
frameworks publish; each entry names its source and the published rule (formulas restated, not copied):

- "none": w_t = 1, no correction: the tokens are trained as if the trainer's policy had sampled them
  (what a framework without rollout correction does, the baseline the peers' guides measure against;
  biased by staleness and by the trainer/inference mismatch).
- "is": w_t = r_t, plain importance sampling (unbiased, unbounded variance).
- "truncate", token TIS (verl's rollout-correction `rollout_is=token`, SkyRL's `tis_ratio_type=token`,
  recommended there as the first thing to try with a cap of 2): w_t = min(r_t, ratio_max). The default:
  the best median time-to-reward under mismatch in benchmarks/async_rollouts.py (docs/async.md, where
  the token rules measured within noise of each other and the sequence rules slower).
- "mask", the token two-sided mask in IcePop's form (Ant Group's Ring-1T: a token whose ratio leaves
  the band [alpha, beta] gets no gradient; SkyRL's `token_mask_is_threshold_low/high`, 0.5 / 2.0 there;
  verl's token rejection `rollout_rs=token`): w_t = r_t if ratio_min <= r_t <= ratio_max else 0.
- "seq_truncate", sequence-level TIS (verl `rollout_is=sequence`, SkyRL `tis_ratio_type=sequence`): one
  weight for every token of a sample, the ratio of the whole sample R = prod_t r_t, truncated:
  w_t = min(R, ratio_max) (SkyRL suggests a looser cap for sequences, 2 to 10; ratio_max is shared).
- "seq_mask", sequence-level MIS (verl `rollout_rs=sequence` with sequence IS weights, SkyRL
  `sequence_mask_metric=product`): w_t = R if ratio_min <= R <= ratio_max else 0 for the whole sample.
- "geo_mask", the geometric-mean sequence mask (verl's `rollout_rs=geometric`, SkyRL's
  `sequence_mask_metric=geometric` with geo_mask_low/high 0.99 / 1.01, recommended there for long-context
  MoE, stacked on token TIS): G = exp(mean_t log r_t), a length-invariant per-token average; the sample
  is dropped whole unless geo_ratio_min <= G <= geo_ratio_max, and its kept tokens get token TIS
  weights w_t = min(r_t, ratio_max), the stack SkyRL's guide recommends.
- "m2po", M2PO's second-moment token mask (Zheng et al. 2025, AReaL's `m2_threshold`; stable at 256
  updates of staleness): with M2 = mean over tokens of (log r_t)^2, tokens are masked largest (log r)^2
  first until the mean over the tokens left is <= m2_threshold (tau_M2; 0.04 by default here); kept
  tokens get w_t = r_t.

Where the rules apply. Sequence rules work per sample over its *loss* tokens only: a multi-turn sample's
observation tokens and the turns the orchestrator masked as too stale carry no ratio, so R and G are
over the policy tokens the trainer trains. Rows pack several samples back to back, so they need the
per-token sample index (`sample`, from rl.trainer.train). A sample is whole in one row, except under
context parallel, where a row is split over the cp ranks: `reduce` then sums the per-sample
(log-ratio, count) vectors over those ranks before any rule reads them (every cp rank decides alike).
M2PO's mean is over one micro-batch row, not the whole batch: the trainer sees one row at a time. Each
row's kept mean is <= the threshold, so the batch's is too; it may mask a few more tokens than a
batch-wide sort would. Under context parallel `gather` brings the whole row's log-ratios to every cp
rank, so each masks its part exactly as one process masks the row (the layout does not change the loss).

Dropped tokens keep counting in the normaliser N (as "mask" always did): a bad token or sample does not
upweight the others.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

MODES = ("mask", "truncate", "none", "is", "seq_truncate", "seq_mask", "geo_mask", "m2po")
SEQUENCE_MODES = ("seq_truncate", "seq_mask", "geo_mask")
# per-sample statistics, summed over micro-batches and ranks ("_max" ones: max)
SEQ_STATS = ("seqs", "seqs_masked", "seq_log_ratio_sum", "seq_log_ratio_abs_max", "seq_geo_dev_sum",
             "seq_geo_dev_max")


def per_sample(log_r: torch.Tensor, m: torch.Tensor, sample: torch.Tensor, n_samples: int | None,
               reduce: Callable[[torch.Tensor], torch.Tensor] | None):
    """(sum of log r over each sample's loss tokens, their count, each token's sample index)."""
    mf = m.reshape(-1)
    # off the loss mask the index may be anything (to_row fills a sample's last position with 0)
    idx = (sample.detach().reshape(-1).round().long() * (mf > 0)).clamp(min=0)
    n = n_samples if n_samples is not None else int(idx.max()) + 1 if idx.numel() else 1
    both = torch.zeros(2, n, dtype=log_r.dtype, device=log_r.device)
    both[0].index_add_(0, idx, (log_r * m).reshape(-1))
    both[1].index_add_(0, idx, mf.to(log_r.dtype))
    if reduce is not None:   # context parallel: the other parts of these samples live on other ranks
        both = reduce(both)
    return both[0], both[1], idx.reshape(sample.shape)


def m2po_keep(log_r: torch.Tensor, m: torch.Tensor, threshold: float) -> torch.Tensor:
    """1 for the loss tokens M2PO keeps: the smallest (log r)^2 first, as many as keep their mean <=
    threshold. Prefix means of ascending values only grow, so this is the greedy drop-the-largest rule."""
    mf = m.reshape(-1)
    # tokens off the mask sort last (+inf), so the prefixes are of loss tokens; no host sync anywhere
    x = torch.where(mf > 0, log_r.reshape(-1) ** 2, torch.full_like(mf, float("inf")))
    xs, order = torch.sort(x, stable=True)
    means = torch.cumsum(xs, 0) / torch.arange(1, len(xs) + 1, dtype=xs.dtype, device=xs.device)
    keep = torch.zeros_like(mf)
    keep[order] = (means <= threshold).to(mf.dtype)
    return (keep * mf).reshape(m.shape)


def weights(log_r: torch.Tensor, m: torch.Tensor, cfg, *, sample: torch.Tensor | None = None,
            n_samples: int | None = None, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
            gather: Callable[..., tuple[torch.Tensor, ...]] | None = None,
            count_samples: bool = True) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(w, dropped, seq_stats) for detached log-ratios `log_r` (0 off the loss mask `m`).

    `dropped`: loss tokens a rule zeroed (or, for the truncations, capped). `seq_stats`: sums over the
    samples seen here (zeros without `sample`); `count_samples=False` on all but one of the ranks that
    share samples (context parallel), so summing over ranks counts each sample once. `gather(log_r, m)`:
    (the whole row's log_r, its mask, the positions of these tokens in it), for M2PO under context parallel.
    """
    mode = cfg.mismatch
    r = log_r.exp()
    zero = torch.zeros((), dtype=log_r.dtype, device=log_r.device)
    stats = {k: zero for k in SEQ_STATS}
    if mode in SEQUENCE_MODES and sample is None:
        raise ValueError(f"trainer.mismatch={mode}: a sequence rule needs each token's sample index")
    seq_keep = None
    if sample is not None:
        s, c, idx = per_sample(log_r, m, sample, n_samples, reduce)
        has = c > 0
        geo = torch.where(has, s / c.clamp(min=1), torch.zeros_like(s))
        if mode == "seq_truncate":
            w = s.clamp(max=math.log(cfg.ratio_max)).exp()[idx]
            dropped = (s > math.log(cfg.ratio_max))[idx].to(m.dtype) * m
        elif mode == "seq_mask":
            seq_keep = (s >= math.log(cfg.ratio_min)) & (s <= math.log(cfg.ratio_max))
            w = (s.clamp(math.log(cfg.ratio_min), math.log(cfg.ratio_max)).exp() * seq_keep)[idx]
        elif mode == "geo_mask":
            seq_keep = (geo >= math.log(cfg.geo_ratio_min)) & (geo <= math.log(cfg.geo_ratio_max))
            w = r.clamp(max=cfg.ratio_max) * seq_keep[idx]
        if seq_keep is not None:
            dropped = (~seq_keep)[idx].to(m.dtype) * m
        if count_samples:
            stats = {"seqs": has.sum().to(log_r.dtype),
                     "seqs_masked": ((~seq_keep) & has).sum().to(log_r.dtype) if seq_keep is not None else zero,
                     "seq_log_ratio_sum": (s * has).sum(), "seq_geo_dev_sum": (geo.abs() * has).sum(),
                     "seq_log_ratio_abs_max": (s.abs() * has).max(), "seq_geo_dev_max": (geo.abs() * has).max()}
    if mode == "mask":
        keep = ((r >= cfg.ratio_min) & (r <= cfg.ratio_max)).to(log_r.dtype)
        w, dropped = r * keep, (1 - keep) * m
    elif mode == "truncate":
        w, dropped = r.clamp(max=cfg.ratio_max), (r > cfg.ratio_max).to(log_r.dtype) * m
    elif mode == "m2po":
        if gather is None:
            keep = m2po_keep(log_r, m, cfg.m2_threshold)
        else:
            full_lr, full_m, mine = gather(log_r, m)
            keep = m2po_keep(full_lr, full_m, cfg.m2_threshold).reshape(-1)[mine].reshape(m.shape)
        w, dropped = r * keep, (1 - keep) * m
    elif mode == "is":
        w, dropped = r, torch.zeros_like(m)
    elif mode == "none":
        w, dropped = torch.ones_like(r), torch.zeros_like(m)
    return w * m, dropped, stats
