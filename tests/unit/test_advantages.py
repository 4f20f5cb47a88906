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


def test_routed_expert_ids_of_384_experts_survive_the_batch_file(tmp_path):
    """Kimi-K2 routes to 384 experts: ids above 255 widen the stored layout instead of wrapping."""
    from rl.contract.batch import RolloutBatch, Sample
    rng = np.random.default_rng(0)
    small = rng.integers(0, 256, (5, 2, 8))
    big = rng.integers(0, 384, (5, 2, 8))
    big[0, 0, 0] = 383
    samples = [Sample(prompt_ids=[1, 2], completion_ids=[3, 4, 5], completion_logprobs=[-1.0] * 3,
                      completion_versions=[0] * 3, reward=1.0, group=0, routed_experts=r) for r in (small, big)]
    batch = RolloutBatch.from_samples(samples)
    assert batch.routed_experts.dtype == np.uint16
    batch.save(tmp_path)
    back = RolloutBatch.load(tmp_path).routed_experts
    assert back.dtype == np.uint16 and (back == np.concatenate([small, big])).all()
    assert RolloutBatch.from_samples(samples[:1]).routed_experts.dtype == np.uint8
    with pytest.raises(ValueError, match="expert ids"):
        RolloutBatch.from_samples([Sample(prompt_ids=[1], completion_ids=[2], completion_logprobs=[-1.0],
                                          completion_versions=[0], reward=0.0, group=0,
                                          routed_experts=np.full((2, 1, 1), 70000))])
