"""The off-policy correction menu (rl.trainer.corrections): each rule on a hand-computed case.

Every case gives the log-ratios log r = lp - lp_inf directly and checks the gradient of the loss, which is
-w * A / N per loss token: the weights the rule must produce, worked out by hand in the comments.
"""
import math

import numpy as np
import pytest
import torch

from rl.trainer import corrections
from rl.trainer.loss import LossConfig, finalize_stats, pg_loss
from rl.trainer.packing import pack, to_row


def _grad(log_r, mask, cfg, sample=None, adv=None, **kw):
    """(d loss / d lp, finalized stats) with lp_inf = -1 - log_r, lp = -1, so lp - lp_inf = log_r."""
    log_r = torch.tensor(log_r, dtype=torch.float32)
    lp = torch.full_like(log_r, -1.0).requires_grad_()
    adv = torch.ones_like(log_r) if adv is None else torch.tensor(adv, dtype=torch.float32)
    s = None if sample is None else torch.tensor(sample, dtype=torch.float32)
    loss, st = pg_loss(lp, -1.0 - log_r, adv, torch.tensor(mask, dtype=torch.float32), cfg, sample=s, **kw)
    loss.backward()
    return lp.grad, finalize_stats(st)


def _weights(grad, n):
    """The weights back from the gradient (A = 1): w = -grad * N."""
    return (-grad * n).tolist()


def test_token_tis_caps_each_token():
    # r = e^0.9 = 2.46 -> 2 (capped); e^0.4 = 1.49; e^-1 = 0.37 (no lower cap)
    g, m = _grad([0.9, 0.4, -1.0], [1, 1, 1], LossConfig("truncate", 0.5, 2.0))
    assert _weights(g, 3) == pytest.approx([2.0, math.exp(0.4), math.exp(-1.0)], rel=1e-6)
    assert m["masked_fraction"] == pytest.approx(1 / 3)


def test_token_mask_icepop_drops_tokens_outside_the_band():
    # r = 0.4 (below 0.5: dropped), 1, 3 (above 2: dropped), 1.9 (kept with its own ratio)
    g, m = _grad([math.log(0.4), 0.0, math.log(3.0), math.log(1.9)], [1, 1, 1, 1], LossConfig("mask", 0.5, 2.0))
    assert _weights(g, 4) == pytest.approx([0.0, 1.0, 0.0, 1.9], rel=1e-6)
    assert m["masked_fraction"] == 0.5


def test_sequence_tis_gives_every_token_its_samples_truncated_ratio():
    # sample 0: log r 0.3 + 0.5 = 0.8, R = e^0.8 = 2.23 -> 2 for both tokens
    # sample 1: log r -0.2 + 0.1 = -0.1, R = e^-0.1 = 0.905 for both; its observation token (mask 0, log r 5)
    # is not a policy token and does not enter R
    g, m = _grad([0.3, 0.5, -0.2, 5.0, 0.1], [1, 1, 1, 0, 1], LossConfig("seq_truncate", 0.5, 2.0),
                 sample=[0, 0, 1, 1, 1])
    assert _weights(g, 4) == pytest.approx([2.0, 2.0, math.exp(-0.1), 0.0, math.exp(-0.1)], rel=1e-6)
    assert m["masked_fraction"] == 0.5          # sample 0's two tokens were capped
    assert m["seq_log_ratio_mean"] == pytest.approx((0.8 - 0.1) / 2)
    assert m["seq_log_ratio_abs_max"] == pytest.approx(0.8)


def test_sequence_mis_drops_whole_samples_outside_the_band():
    # R: sample 0 e^0.8 = 2.23 (> 2, dropped), sample 1 e^-0.1 = 0.905 (kept, weight R), sample 2 e^-0.8 = 0.45
    # (< 0.5, dropped)
    g, m = _grad([0.3, 0.5, -0.2, 0.1, -0.8], [1, 1, 1, 1, 1], LossConfig("seq_mask", 0.5, 2.0),
                 sample=[0, 0, 1, 1, 2])
    assert _weights(g, 5) == pytest.approx([0, 0, math.exp(-0.1), math.exp(-0.1), 0], rel=1e-6)
    assert m["masked_fraction"] == pytest.approx(3 / 5)
    assert m["seq_masked_fraction"] == pytest.approx(2 / 3)


def test_geometric_mask_is_length_invariant_and_stacks_on_token_tis():
    # sample 0: mean log r (0.02 - 0.02 + 0) / 3 = 0 -> G = 1, kept; weights r_t (all below the cap 2)
    # sample 1: mean (0.03 + 0) / 2 = 0.015 -> G = 1.0151 > 1.01, dropped
    # sample 2: eight tokens of 0.008: product e^0.064 = 1.066, but G = e^0.008 = 1.008: kept (a product
    #           rule on [0.99, 1.01] would drop it for its length alone)
    log_r = [0.02, -0.02, 0.0, 0.03, 0.0] + [0.008] * 8
    sample = [0, 0, 0, 1, 1] + [2] * 8
    g, m = _grad(log_r, [1] * 13, LossConfig("geo_mask", 0.5, 2.0), sample=sample)
    want = [math.exp(0.02), math.exp(-0.02), 1.0, 0.0, 0.0] + [math.exp(0.008)] * 8
    assert _weights(g, 13) == pytest.approx(want, rel=1e-6)
    assert m["masked_fraction"] == pytest.approx(2 / 13)
    assert m["seq_geo_dev_max"] == pytest.approx(0.015, rel=1e-5)
    assert m["seq_geo_dev_mean"] == pytest.approx((0 + 0.015 + 0.008) / 3, rel=1e-5)
    # the geometric bounds are their own: a token-TIS cap still applies inside a kept sample
    g, _ = _grad([0.9, -0.9], [1, 1], LossConfig("geo_mask", 0.5, 2.0), sample=[0, 0])
    assert _weights(g, 2) == pytest.approx([2.0, math.exp(-0.9)], rel=1e-6)


def test_m2po_masks_the_largest_second_moments_until_the_mean_is_under_the_threshold():
    # (log r)^2 = 0.01, 0.09, 0.0025, 0.25, 0, and a masked token; the mean over all is 0.3525 / 5 = 0.0705.
    # Ascending: 0, 0.0025, 0.01, 0.09, 0.25; prefix means 0, 0.00125, 0.00417, 0.0256, 0.0705.
    log_r = [0.1, -0.3, 0.05, 0.5, 0.0, 3.0]
    mask = [1, 1, 1, 1, 1, 0]
    g, m = _grad(log_r, mask, LossConfig("m2po", m2_threshold=0.04))   # 0.0256 <= 0.04: only 0.5 dropped
    want = [math.exp(0.1), math.exp(-0.3), math.exp(0.05), 0.0, 1.0, 0.0]
    assert _weights(g, 5) == pytest.approx(want, rel=1e-6)
    assert m["masked_fraction"] == pytest.approx(1 / 5)
    g, _ = _grad(log_r, mask, LossConfig("m2po", m2_threshold=0.02))   # 0.0256 > 0.02: -0.3 dropped too
    assert _weights(g, 5) == pytest.approx([math.exp(0.1), 0.0, math.exp(0.05), 0.0, 1.0, 0.0], rel=1e-6)


def test_sequence_rules_on_a_packed_row_use_each_samples_own_policy_tokens():
    """Two samples packed back to back as the trainer packs them (rl.trainer.packing: per-token values
    shifted to the predicting position, the last position of each sample predicting nothing)."""
    # sample 0: prompt 2 tokens, completion 2 (log r 0.3, 0.5); sample 1: prompt 1, completion 3 where the
    # middle token is an observation (mask 0) with a huge log r, completion log r -0.2, 0.1
    mask = np.array([0, 0, 1, 1, 0, 1, 0, 1], np.float32)
    log_r = np.array([0, 0, 0.3, 0.5, 0, -0.2, 7.0, 0.1], np.float32)
    offsets = np.array([0, 4, 8])
    (mb,) = pack(offsets, 64, 64, np.arange(8), mask=mask, lp_inf=-1.0 - log_r, adv=np.ones(8, np.float32),
                 sample=np.repeat(np.arange(2), np.diff(offsets)))
    row = to_row(mb)
    pt = row.per_token
    lp = torch.full_like(pt["mask"], -1.0).requires_grad_()
    loss, st = pg_loss(lp, pt["lp_inf"], pt["adv"], pt["mask"], LossConfig("seq_mask", 0.5, 2.0),
                       sample=pt["sample"], n_samples=2)
    loss.backward()
    # sample 0: R = e^0.8 > 2, dropped; sample 1: R = e^-0.1, kept; N = 4 loss tokens
    w = (-lp.grad * 4)[0].tolist()
    want = [0, 0, 0, 0, math.exp(-0.1), 0, math.exp(-0.1), 0]   # shifted: entry j is about token j + 1
    assert w == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert finalize_stats(st)["seq_masked_fraction"] == 0.5


def test_context_parallel_parts_decide_like_the_whole_row():
    """A row split over two ranks: with `reduce` summing the per-sample vectors of both parts, each part
    weights its tokens as the whole row would, and the sample statistics are counted once."""
    log_r = torch.tensor([0.3, 0.5, -0.2, 0.1, -0.8, 0.2])
    m = torch.ones(6)
    sample = torch.tensor([0, 0, 1, 1, 2, 2], dtype=torch.float32)
    cfg = LossConfig("seq_mask", 0.5, 2.0)
    whole, _, st_whole = corrections.weights(log_r, m, cfg, sample=sample, n_samples=3)
    parts = [[0, 2, 4], [1, 3, 5]]   # each sample has a token on each rank
    vec = [corrections.per_sample(log_r[p], m[p], sample[p], 3, None)[:2] for p in parts]
    got = torch.zeros(6)
    stats = []
    for i, p in enumerate(parts):
        other = torch.stack(vec[1 - i])
        w, _, st = corrections.weights(log_r[p], m[p], cfg, sample=sample[p], n_samples=3,
                                       reduce=lambda t, o=other: t + o, count_samples=i == 0)
        got[p] = w
        stats.append(st)
    assert torch.allclose(got, whole)
    assert float(stats[0]["seqs"] + stats[1]["seqs"]) == float(st_whole["seqs"]) == 3
    assert float(stats[0]["seqs_masked"] + stats[1]["seqs_masked"]) == float(st_whole["seqs_masked"]) == 1   # R = e^0.8 only


def test_a_sequence_rule_without_sample_ids_is_an_error():
    with pytest.raises(ValueError, match="trainer.mismatch=geo_mask"):
        _grad([0.1], [1], LossConfig("geo_mask"))


def test_the_config_accepts_exactly_the_menu_and_refuses_others_in_one_line(tmp_path):
    from launch.compose import compose_points
    from rl.contract import validation
    from rl.contract.config import ConfigError
    assert validation._CHOICES["trainer.mismatch"] == corrections.MODES
    for mode in corrections.MODES:
        (cfg,) = compose_points([f"trainer.mismatch={mode}", f"run_dir={tmp_path / mode}"], multirun=False)
        assert cfg["trainer"]["mismatch"] == mode
    with pytest.raises(ConfigError) as e:
        compose_points(["trainer.mismatch=icepop2", f"run_dir={tmp_path / 'x'}"], multirun=False)
    msg = str(e.value)
    assert "\n" not in msg and "trainer.mismatch" in msg and all(x in msg for x in corrections.MODES)
    for bad, key in (("trainer.geo_ratio_min=1.5", "trainer.geo_ratio_max"), ("trainer.m2_threshold=0", "trainer.m2_threshold")):
        with pytest.raises(ConfigError, match=key):
            compose_points([bad, f"run_dir={tmp_path / 'y'}"], multirun=False)
