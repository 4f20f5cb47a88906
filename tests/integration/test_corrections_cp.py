"""Corrections that look past one token, under context parallel: `torchrun --nproc_per_node 2 -m
rl.trainer` with cp=2 splits every row over two ranks, so a sample's ratio is summed over both
(Trainer._cp_sum) before a sequence rule decides, and M2PO ranks the whole row's tokens
(Trainer._cp_gather); the losses and the metrics must be the single process's."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from helpers.trainer import publish_batches, tiny_cfg
from rl.contract.batch import ShardPlan
from rl.metrics import read_metrics
from rl.trainer.loop import run
from test_distributed_trainer import _torchrun

pytestmark = pytest.mark.distributed

STEPS = 2
TOL = dict(rel=1e-5, abs=1e-6)


# The synthetic batches' engine logprobs are far from the tiny model's (|log r| of a few nats per token),
# so bounds of e^+-28 on a sample's ratio keep some samples and drop others, and M2PO at 2 nats^2 keeps
# some tokens of each row and drops others.
RULES = {"seq_mask": {"ratio_min": 1e-12, "ratio_max": 1e12}, "m2po": {"m2_threshold": 2.0}}


def _cfg(run_dir, cp, mode):
    return tiny_cfg(run_dir, max_steps=STEPS, lr=1e-3, warm_start={"steps": 0, "batch_size": 4, "lr": 1e-3},
                    parallel={"dp_shard": 1, "ep": 1, "cp": cp}, mismatch=mode, **RULES[mode])


@pytest.mark.parametrize("mode", sorted(RULES))
def test_under_context_parallel_the_rule_gives_the_single_process_losses(tmp_path, mode):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    cfg1 = _cfg(one, 1, mode)
    publish_batches(one, range(STEPS), plan=ShardPlan.from_config(cfg1))
    assert run(one, cfg1, poll=0.01) == 0
    cfg2 = _cfg(two, 2, mode)
    OmegaConf.save(cfg2, two / "config.yaml")
    publish_batches(two, range(STEPS), plan=ShardPlan.from_config(cfg2))
    _torchrun(two)
    ref = {m["step"]: m for m in read_metrics(one)}
    got = {m["step"]: m for m in read_metrics(two)}
    assert sorted(got) == list(range(STEPS))
    for n in range(STEPS):
        # some kept, some dropped: the rule decided on something
        assert 0 < ref[n]["seq_masked_fraction" if mode == "seq_mask" else "masked_fraction"] < 1, ref[n]
        for key in ("loss", "masked_fraction", "seq_masked_fraction", "seq_log_ratio_mean",
                    "seq_log_ratio_abs_max", "seq_geo_dev_mean", "seq_geo_dev_max"):
            assert got[n][key] == pytest.approx(ref[n][key], **TOL), (n, key, got[n], ref[n])
