"""The importance-sampled token-level policy-gradient loss."""
import math

import pytest
import torch

from rl.trainer.loss import LossConfig, add_stats, finalize_stats, pg_loss


def _inputs():
    lp = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.5, -0.2], requires_grad=True)
    lp_inf = torch.tensor([-1.0, -1.0, -0.5, -1.0, -1.7, -0.2])  # r = 1, e^-1, 1, e^-2, e^0.2, 1
    adv = torch.tensor([1.0, 1.0, 1.0, -2.0, -2.0, -2.0])
    mask = torch.tensor([0, 1, 1, 1, 1, 1])
    return lp, lp_inf, adv, mask


def test_none_mode_trains_as_if_on_policy():
    lp, lp_inf, adv, mask = _inputs()
    loss, st = pg_loss(lp, lp_inf, adv, mask, LossConfig("none"))
    loss.backward()
    # no correction: d loss / d lp_i = -A_i m_i / N whatever the ratio (e^-2 on token 3, e^0.2 on 4)
    assert torch.allclose(lp.grad, -(adv * mask) / 5)
    assert finalize_stats(st)["masked_fraction"] == 0


def test_is_mode_is_plain_importance_weighted_pg():
    lp, lp_inf, adv, mask = _inputs()
    loss, st = pg_loss(lp, lp_inf, adv, mask, LossConfig("is"))
    r = (lp.detach() - lp_inf).exp() * mask
    expected = -(r * adv * lp.detach() * mask).sum() / 5
    assert torch.allclose(loss, expected)
    loss.backward()
    # d loss / d lp_i = -w_i A_i m_i / N: the weight is a constant, not differentiated
    assert torch.allclose(lp.grad, -(r * adv * mask) / 5)
    m = finalize_stats(st)
    assert m["loss_tokens"] == 5 and m["masked_fraction"] == 0
    assert math.isclose(m["ratio_max"], math.exp(0.2), rel_tol=1e-6)


def test_mask_mode_drops_tokens_outside_the_ratio_band_but_keeps_normaliser():
    lp, lp_inf, adv, mask = _inputs()
    loss, st = pg_loss(lp, lp_inf, adv, mask, LossConfig("mask", 0.5, 2.0))
    loss.backward()
    # r = e^-1 (0.37) and e^-2 are below 0.5: tokens 1 and 3 get no gradient
    assert lp.grad[1] == 0 and lp.grad[3] == 0 and lp.grad[0] == 0
    assert torch.allclose(lp.grad[2], torch.tensor(-1.0 / 5))
    assert torch.allclose(lp.grad[4], torch.tensor(2.0 * math.exp(0.2) / 5))
    assert math.isclose(finalize_stats(st)["masked_fraction"], 2 / 5)


def test_truncate_mode_caps_the_weight():
    lp = torch.tensor([-0.1, -0.1], requires_grad=True)
    lp_inf = torch.tensor([-3.0, -0.1])  # r = e^2.9 = 18, 1
    loss, st = pg_loss(lp, lp_inf, torch.ones(2), torch.ones(2), LossConfig("truncate", 0.5, 2.0))
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([-2.0 / 2, -1.0 / 2]))
    assert finalize_stats(st)["masked_fraction"] == 0.5


def test_k3_kl_is_zero_on_policy_and_positive_off_policy():
    lp = torch.tensor([-1.0, -2.0])
    _, st = pg_loss(lp, lp.clone(), torch.ones(2), torch.ones(2), LossConfig())
    assert finalize_stats(st)["mismatch_kl"] == 0.0
    _, st = pg_loss(lp, torch.tensor([-1.5, -1.0]), torch.ones(2), torch.ones(2), LossConfig("none"))
    lr = torch.tensor([0.5, -1.0])
    assert math.isclose(finalize_stats(st)["mismatch_kl"], float((lr.exp() - 1 - lr).mean()), rel_tol=1e-6)


def test_micro_batches_with_global_normaliser_match_the_full_batch():
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(40, generator=g) - 2
    lp_inf = lp + 0.3 * torch.randn(40, generator=g)
    adv = torch.randn(40, generator=g)
    mask = (torch.rand(40, generator=g) > 0.3).long()
    ent = torch.rand(40, generator=g)
    cfg = LossConfig("mask")
    full_lp = lp.clone().requires_grad_()
    full, st_full = pg_loss(full_lp, lp_inf, adv, mask, cfg, entropy=ent)
    full.backward()
    parts_lp = lp.clone().requires_grad_()
    total, st = 0.0, None
    n = mask.sum()
    for sl in (slice(0, 13), slice(13, 29), slice(29, 40)):
        l, s = pg_loss(parts_lp[sl], lp_inf[sl], adv[sl], mask[sl], cfg, entropy=ent[sl], normalizer=n)
        l.backward()
        total += float(l.detach())
        st = add_stats(st, s)
    assert math.isclose(total, float(full), rel_tol=1e-5)
    assert torch.allclose(parts_lp.grad, full_lp.grad)
    a, b = finalize_stats(st), finalize_stats(st_full)
    for k in a:
        assert math.isclose(a[k], b[k], rel_tol=1e-5), k


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="trainer.mismatch"):
        LossConfig("clip")
