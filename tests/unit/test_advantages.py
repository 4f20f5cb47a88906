import numpy as np
import pytest

from rl.orchestrator.advantages import group_advantages


def test_grpo_normalises_within_groups():
    r = np.array([1, 0, 0, 0, 0.5, 0.5, 0.5, 0.5], np.float32)
    g = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    a = group_advantages(r, g, "grpo")
    assert a[:4].mean() == pytest.approx(0, abs=1e-6)
    assert a[:4].std() == pytest.approx(1, rel=1e-4)
    assert a[0] > 0 and np.all(a[1:4] < 0)
    assert np.all(a[4:] == 0)  # unanimous group: no signal


def test_drgrpo_does_not_divide_by_std():
    r = np.array([1.0, 0.0, 0.2, 0.2])
    a = group_advantages(r, np.array([0, 0, 1, 1]), "drgrpo")
    assert np.allclose(a, [0.5, -0.5, 0, 0])


def test_groups_need_not_be_contiguous():
    a = group_advantages(np.array([1.0, 0.0, 0.0, 1.0]), np.array([0, 1, 0, 1]), "drgrpo")
    assert np.allclose(a, [0.5, -0.5, -0.5, 0.5])


def test_bad_input():
    with pytest.raises(ValueError, match="shape"):
        group_advantages(np.zeros(3), np.zeros(2))
    with pytest.raises(ValueError, match="unknown"):
        group_advantages(np.zeros(2), np.zeros(2), "ppo")


def test_routed_experts_get_one_row_per_token():
    from rl.contract.batch import routed_per_token
    r = np.arange(2 * 3 * 2).reshape(3, 2, 2)  # vLLM: n-1 rows for n tokens
    out = routed_per_token(r, 4)
    assert out.shape == (4, 2, 2) and out.dtype == np.uint8
    assert (out[:3] == r).all() and (out[3] == r[2]).all()
    assert routed_per_token(None, 4) is None
    with pytest.raises(ValueError, match="cover"):
        routed_per_token(r, 7)
