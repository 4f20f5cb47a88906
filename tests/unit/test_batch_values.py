"""Values a rollout batch may not carry, though each is a well-typed, finite-or-not number (issue 49):
a policy version no published weights ever had (2^30 beside versions 0..2), an advantage of 3e38 (finite
in float32, and every token's loss of its sample overflows with it) or inf / NaN, a group id of -5 or
past the batch's samples. Each probe is written with a valid manifest and checksums (the real writer,
raw arrays where RolloutBatch.save would not write them) and read through the trainer's real path
(rl.trainer.loop.next_batch): it is set aside with one line naming the file, the array, the index and the
value, and the good batch published after it is the one trained on. A batch at the bounds passes.
"""
from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file

from rl import exchange
from rl.contract.batch import (INDEX_FILE, MAX_ADVANTAGE, InvalidBatch, RolloutBatch, Sample, shard_file,
                               version_bound, write_arrays)
from rl.runtime import StopFlag

VOCAB = 512
STEP = 3   # the batch under test; weights 0..2 are published before it (the trainer is at step 2 or 3)


def good_batch(versions: int = 2) -> RolloutBatch:
    """Eight samples in two dense groups, tokens of policy version `versions`."""
    rng = np.random.default_rng(0)
    samples = []
    for i in range(8):
        p = rng.integers(10, 500, 4).tolist()
        c = rng.integers(10, 500, 5).tolist()
        samples.append(Sample(p, c, (-np.log(VOCAB) + rng.uniform(-0.3, 0.3, 5)).tolist(), [versions] * 5,
                              reward=float(i % 3) / 2, group=i // 4, advantage=float(i % 3) / 2 - 0.5))
    return RolloutBatch.from_samples(samples, meta={"step": STEP})


def _as_they_are(b: RolloutBatch):
    """Write `b`'s arrays as they are (one shard, the per-sample arrays in the sample index) with the
    real file writer: what a buggy or hostile orchestrator could publish."""
    def write(d):
        good_batch().save(d)
        index = load_file(str(d / INDEX_FILE))
        for f in (INDEX_FILE, shard_file(0)):
            (d / f).unlink()
        index.update(offsets=b.offsets, rewards=b.rewards, advantages=b.advantages, groups=b.groups)
        write_arrays(d / INDEX_FILE, index)
        write_arrays(d / shard_file(0), {"tokens": b.tokens, "offsets": b.offsets, "loss_mask": b.loss_mask,
                                         "logprobs": b.logprobs, "versions": b.versions})
    return write


def _run(tmp_path, weights: int = STEP):
    """A run directory whose trainer has published weights 0..weights-1."""
    for v in range(weights):
        exchange.publish(tmp_path, "weights", v, lambda d: (d / "w").write_bytes(b"w"), producer="trainer")
    return tmp_path


def _read_like_the_trainer(run_dir) -> tuple[RolloutBatch, list[str]]:
    """rl.trainer.loop.next_batch on rollouts/step_STEP; once the step went missing (set aside), the
    orchestrator (played here) publishes a good batch. Returns (the batch trained on, reasons)."""
    from rl.trainer.loop import next_batch
    flag, polls = StopFlag(install=False), []

    def stop():
        polls.append(1)
        if not exchange.step_dir(run_dir, "rollouts", STEP).exists():
            exchange.publish(run_dir, "rollouts", STEP, good_batch().save, producer="orchestrator")
        return len(polls) > 50
    flag.is_set = stop
    reasons: list[str] = []
    got = next_batch(run_dir, STEP, flag, poll=0.01, vocab_size=VOCAB, set_aside=reasons)
    assert got is not None, "the republished good batch was not taken"
    return got[0], reasons


def _set(field: str, i: int, value):
    def f(b):
        a = getattr(b, field).copy()
        a[i] = value
        setattr(b, field, a)
    return f


PROBES = [
    ("version 2^30", _set("versions", 20, 2**30),
     "versions[20] = 1073741824 is newer than any published policy version (at most 3"),
    ("version two past the newest weights", _set("versions", 20, 4), "versions[20] = 4 is newer than any"),
    ("advantage 3e38", _set("advantages", 3, 3e38), "advantages[3] = 3.0000000054977558e+38 is beyond +-1e+06"),
    ("advantage -1e7", _set("advantages", 0, -1e7), "advantages[0] = -10000000.0 is beyond +-1e+06"),
    ("advantage inf", _set("advantages", 5, np.inf), "advantages[5] = inf is not finite"),
    ("advantage nan", _set("advantages", 6, np.nan), "advantages[6] = nan is not finite"),
    ("group -5", _set("groups", 2, -5), "groups[2] = -5 is not a group of this batch (dense group numbers 0..7)"),
    ("group past the samples", _set("groups", 7, 8), "groups[7] = 8 is not a group of this batch"),
]


@pytest.mark.parametrize("probe,damage,says", PROBES, ids=[p[0] for p in PROBES])
def test_a_batch_value_out_of_bounds_is_set_aside_with_its_reason(tmp_path, probe, damage, says):
    run = _run(tmp_path)
    bad = good_batch()
    damage(bad)
    exchange.publish(run, "rollouts", STEP, _as_they_are(bad), producer="orchestrator")
    exchange.verify(exchange.step_dir(run, "rollouts", STEP), checksums=True)   # checksums are right
    batch, reasons = _read_like_the_trainer(run)
    assert len(reasons) == 1 and says in reasons[0] and "\n" not in reasons[0], reasons
    assert "rollouts/step_000003" in reasons[0]   # names the file
    assert np.array_equal(batch.versions, good_batch().versions) and np.isfinite(batch.advantages).all()


def test_values_at_the_bounds_pass(tmp_path):
    """Version = the newest weights + 1 (the trainer reads batch N while its publish of version N may still
    be committing), advantages of +-MAX_ADVANTAGE, the last dense group id: trained as they are."""
    run = _run(tmp_path)
    assert version_bound(exchange.step_dir(run, "rollouts", STEP)) == STEP
    b = good_batch(versions=STEP)
    b.advantages[0], b.advantages[1] = MAX_ADVANTAGE, -MAX_ADVANTAGE
    b.groups[:] = np.arange(8) // 4
    b.groups[7] = 7
    exchange.publish(run, "rollouts", STEP, b.save, producer="orchestrator")   # the real writer, whole
    batch, reasons = _read_like_the_trainer(run)
    assert reasons == [] and int(batch.versions.max()) == STEP and batch.advantages[0] == MAX_ADVANTAGE


def test_before_any_weights_a_version_is_bounded_by_max_step_only(tmp_path):
    """A run that has published no weights yet (or a batch outside a run's rollouts/): no newest version
    to bound by, so only MAX_STEP (2^31 - 1) applies; the in-memory check takes the bound it is given."""
    b = good_batch()
    b.versions = np.where(b.versions >= 0, 2**30, -1).astype(np.int32)
    assert version_bound(tmp_path / "rollouts" / "step_000003") is None
    b.validate(VOCAB)
    with pytest.raises(InvalidBatch, match=r"versions\[\d+\] = 1073741824 is newer than any published policy "
                                           r"version \(at most 5"):
        b.validate(VOCAB, max_version=5)
