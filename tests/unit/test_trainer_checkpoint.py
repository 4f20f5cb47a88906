"""Trainer checkpoints restore model, optimizer, RNG and data position bit-identically; packing."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from rl.contract.config import Config
from rl import exchange
from rl.contract.batch import RolloutBatch, Sample
from rl.trainer import checkpoint as ckpt
from rl.trainer.packing import pack
from rl.trainer.train import Trainer


def _cfg(tmp_path, seed=0):
    cfg = OmegaConf.structured(Config)
    cfg.run_dir, cfg.seed, cfg.wandb.mode = str(tmp_path), seed, "disabled"
    cfg.model.max_seq_len = 64
    cfg.trainer.micro_batch_tokens = 40
    return cfg


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(6):
        p, c = rng.integers(5, 500, 6).tolist(), rng.integers(5, 500, 5).tolist()
        samples.append(Sample(p, c, (-rng.uniform(1, 6, 5)).tolist(), [0] * 5, float(i % 2), i // 3,
                              advantage=float(i % 2) - 0.5))
    return RolloutBatch.from_samples(samples)


def _rng_draws():
    return torch.rand(4), np.random.rand(4), [random.random() for _ in range(4)]


def test_checkpoint_restores_the_trainer_state_bit_identically(tmp_path):
    tr = Trainer(_cfg(tmp_path))
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    tr.train_step(_batch(), 0)
    assert any(not torch.equal(before[k], v) for k, v in tr.model.state_dict().items())
    tr.progress = ckpt.TrainerProgress(next_step=1, consumed=[0])
    torch.manual_seed(123), np.random.seed(7), random.seed(9)
    tr.save(tmp_path, 1)
    expected_draws = _rng_draws()  # what the saved RNG states produce next
    model_sd = {k: v.clone() for k, v in tr.model.state_dict().items()}
    opt_sd = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in tr.optimizer.state_dict().items()}

    other = Trainer(_cfg(tmp_path, seed=5))  # different init, fresh optimizer, RNG moved on
    _rng_draws()
    other.load(tmp_path, 1)
    assert other.progress == ckpt.TrainerProgress(next_step=1, consumed=[0])
    for k, v in model_sd.items():
        assert torch.equal(v, other.model.state_dict()[k]), k
    got = other.optimizer.state_dict()
    assert got.keys() == opt_sd.keys()
    for k, v in opt_sd.items():
        assert torch.equal(v, got[k]) if torch.is_tensor(v) else v == got[k], k
    draws = _rng_draws()
    assert torch.equal(draws[0], expected_draws[0])
    assert np.array_equal(draws[1], expected_draws[1]) and draws[2] == expected_draws[2]


def test_a_damaged_checkpoint_is_refused(tmp_path):
    tr = Trainer(_cfg(tmp_path))
    tr.save(tmp_path, 0)
    state = exchange.step_dir(tmp_path, "checkpoints", 0) / ckpt.STATE_FILE
    state.write_text(state.read_text().replace('"next_step": 0', '"next_step": 9'))
    with pytest.raises(exchange.CorruptStep):
        Trainer(_cfg(tmp_path)).load(tmp_path, 0)


def test_pack_keeps_samples_whole_and_positions_per_sample():
    offsets = np.array([0, 5, 9, 20, 22])
    tokens = np.arange(22)
    mbs = pack(offsets, 10, 64, tokens, mask=np.ones(22))
    assert [mb.tokens.shape[1] for mb in mbs] == [9, 11, 2]
    assert mbs[0].positions[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert torch.equal(torch.cat([mb.tokens[0] for mb in mbs]), torch.arange(22))
    with pytest.raises(ValueError, match="max_seq_len"):
        pack(offsets, 10, 8, tokens)
