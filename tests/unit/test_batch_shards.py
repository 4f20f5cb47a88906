"""The rollout batch cut into one shard per trainer data rank (rl.contract.batch, rl.trainer.dataplane).

Checked against the trainer's own packing: the shards the orchestrator writes hold exactly the
micro-batches `rl.trainer.packing.rows_for_rank` deals each data rank from the whole batch, so a rank
that reads only its shard trains the same rows; a rank reads and hashes only meta.json, the sample index
and its shard; the whole batch reads back exactly; any rank's refusal sets the step aside for all.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rl import exchange
from rl.contract.batch import (INDEX_FILE, META_FILE, InvalidBatch, RolloutBatch, Sample, ShardPlan,
                               load_share, shard_file, write_samples)
from rl.runtime import StopFlag
from rl.trainer import packing, parallel


def _samples(n=13, seed=0, routes=(3, 2), experts=40):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = rng.integers(0, 500, int(rng.integers(2, 30)), dtype=np.int32)
        c = rng.integers(0, 500, int(rng.integers(1, 60)), dtype=np.int32)
        m = (rng.uniform(size=len(c)) < 0.7).astype(np.uint8)
        r = rng.integers(0, experts, (len(p) + len(c), *routes)).astype(np.uint8) if routes else None
        out.append(Sample(p, c, -rng.uniform(0.1, 5, len(c)).astype(np.float32),
                          rng.integers(0, 4, len(c)).astype(np.int32), reward=float(rng.uniform()), group=i // 4,
                          advantage=float(rng.normal()), completion_mask=m, routed_experts=r))
    return out


def _publish(run, step, samples, plan):
    return exchange.publish(run, "rollouts", step, lambda d: write_samples(d, samples, {"step": step}, plan),
                            producer="orchestrator", hashed=True).path


class _Rank:
    """A data rank as rows_for_rank sees it (no process group: only dp_rank/dp_size are read)."""
    def __init__(self, rank, size):
        self.dp_rank, self.dp_size, self.cp, self.world = rank, size, 1, size
        self.distributed = True


def _rows_tokens(rows):
    return [r.tokens[0].tolist() for r in rows]


@pytest.mark.parametrize("ranks,mbt", [(1, 64), (3, 64), (4, 100), (5, 1000)])
def test_each_rank_reads_exactly_the_rows_the_layout_deals_it(tmp_path, ranks, mbt):
    samples = _samples()
    plan = ShardPlan(ranks, mbt)
    step = _publish(tmp_path, 0, samples, plan)
    whole = RolloutBatch.from_samples(samples)
    mbs = packing.pack(whole.offsets, mbt, 10_000, whole.tokens, whole.routed_experts)
    files = exchange.verify(step, checksums=True)["files"]
    assert sorted(files) == sorted([META_FILE, INDEX_FILE, *(shard_file(r) for r in range(ranks))])
    total = sum(f["size"] for f in files.values())
    dealt, loads = [], []
    for r in range(ranks):
        share, nbytes = load_share(step, r, files=files, plan=plan)
        got = packing.pack(share.offsets, mbt, 10_000, share.tokens, share.routed_experts,
                           sizes=share.share["micro_batches"])
        # each of the rank's rows is one of the trainer's own micro-batches of the whole batch, in batch order
        index = [next(m for m, mb in enumerate(mbs) if torch.equal(mb.tokens, g.tokens) and
                      torch.equal(mb.routed, g.routed) and m not in dealt) for g in got]
        assert index == sorted(index)
        dealt += index
        loads.append(len(share.tokens))
        # what the rank read: meta.json, the index and its own shard, nothing else
        mine = files[META_FILE]["size"] + files[INDEX_FILE]["size"] + files[shard_file(r)]["size"]
        assert nbytes <= mine and (ranks == 1 or nbytes < total)
        assert share.totals["loss_tokens"] == int(whole.loss_mask.sum())
        assert share.share["total_micro_batches"] == len(mbs)
        rows = packing.rows_for_rank(got, _Rank(r, ranks), share.share["rows_per_rank"])
        assert len(rows) == max(len(x["micro_batches"]) for x in share.meta["layout"]["ranks"])
    assert sorted(dealt) == list(range(len(mbs)))   # every micro-batch trained once, by one rank
    # dealt by tokens, largest first to the least-loaded rank: no rank holds more than an even share plus
    # one micro-batch
    biggest = max(int(mb.tokens.shape[1]) for mb in mbs)
    assert max(loads) <= len(whole.tokens) / ranks + biggest


def test_the_whole_batch_reads_back_exactly_in_sample_order(tmp_path):
    samples = _samples(routes=(2, 2), experts=300)   # ids beyond 255: uint16 routes
    for s in samples:
        s.routed_experts = s.routed_experts.astype(np.uint16) * 2
    step = _publish(tmp_path, 0, samples, ShardPlan(3, 50))
    back = RolloutBatch.load(step, files=exchange.read_manifest(step)["files"])
    want = RolloutBatch.from_samples(samples)
    for k in ("tokens", "offsets", "loss_mask", "logprobs", "versions", "rewards", "advantages", "groups",
              "routed_experts"):
        assert np.array_equal(getattr(back, k), getattr(want, k)), k
    assert back.routed_experts.dtype == np.uint16


def test_a_trainer_with_another_layout_reads_the_whole_batch(tmp_path):
    samples = _samples()
    step = _publish(tmp_path, 0, samples, ShardPlan(2, 64))
    got, _ = load_share(step, 0, plan=ShardPlan(4, 64))   # resumed with 4 data ranks
    assert got.share is None and got.num_samples == len(samples)
    got, _ = load_share(step, 0, plan=ShardPlan(2, 128))  # another micro-batch size
    assert got.share is None


def test_a_damaged_shard_is_refused_naming_it_and_the_others_still_read(tmp_path):
    step = _publish(tmp_path, 0, _samples(), ShardPlan(3, 64))
    files = exchange.read_manifest(step)["files"]
    f = step / shard_file(1)
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(InvalidBatch, match=r"shard_00001\.safetensors: sha256 does not match"):
        load_share(step, 1, files=files)
    load_share(step, 0, files=files)   # rank 0's bytes are intact: it alone would not notice


def test_a_share_whose_arrays_disagree_with_the_index_is_refused(tmp_path):
    samples = _samples()
    step = _publish(tmp_path, 0, samples, ShardPlan(2, 64))
    from safetensors.numpy import load_file
    from rl.contract.batch import write_arrays
    a = load_file(str(step / shard_file(0)))
    a["loss_mask"] = np.ones_like(a["loss_mask"])   # more trained tokens than the index counts
    (step / shard_file(0)).unlink()
    write_arrays(step / shard_file(0), a)
    with pytest.raises(InvalidBatch, match="loss tokens or their versions differ"):
        load_share(step, 0)


def test_building_holds_routes_as_memory_maps_and_writes_them_through(tmp_path):
    """Sample.routed_experts may be the orchestrator's spilled memmap; the shards hold its rows."""
    samples = _samples(n=5)
    for i, s in enumerate(samples):
        path = tmp_path / f"r{i}.bin"
        s.routed_experts.tofile(path)
        s.routed_experts = np.memmap(path, np.uint8, "r", shape=s.routed_experts.shape)
    run = tmp_path / "run"
    step = _publish(run, 0, samples, ShardPlan(2, 40))
    back = RolloutBatch.load(step)
    assert np.array_equal(back.routed_experts, np.concatenate([np.asarray(s.routed_experts) for s in samples]))


def test_every_rank_sets_aside_a_step_any_rank_refuses(tmp_path):
    """rl.trainer.dataplane.next_share on rank 0 of two, its all_gather answering what rank 1 finds in
    its own shard (truncated): rank 0, whose shard is intact, still sets the step aside, once, and takes
    the republished one. (Two real ranks over gloo: tests/integration/test_distributed_trainer.py.)"""
    from rl.trainer import dataplane
    samples = _samples()
    plan = ShardPlan(2, 64)
    _publish(tmp_path, 0, samples, plan)
    f = exchange.step_dir(tmp_path, "rollouts", 0) / shard_file(1)
    f.write_bytes(f.read_bytes()[:-5])   # rank 1's shard truncated

    class Rank0(parallel.Dist):
        def broadcast(self, obj):
            return obj

        def all_gather(self, obj):   # what rank 1 would say of its shard
            try:
                load_share(exchange.step_dir(tmp_path, "rollouts", 0), 1,
                           files=exchange.read_manifest(exchange.step_dir(tmp_path, "rollouts", 0))["files"])
                theirs = None
            except InvalidBatch as e:
                theirs = ("CORRUPT", str(e))
            return [obj, theirs]

        def barrier(self):
            pass
    d = Rank0(world=2, rank=0, dp_shard=2)

    class Republish(StopFlag):   # the orchestrator publishes the missing step again
        def is_set(self):
            if not exchange.step_dir(tmp_path, "rollouts", 0).exists():
                _publish(tmp_path, 0, samples, plan)
            return super().is_set()
    reasons: list[str] = []
    share, manifest, read = dataplane.next_share(tmp_path, 0, Republish(install=False), 0.01, d,
                                                 set_aside=reasons, plan=plan)
    assert len(reasons) == 1 and "shard_00001" in reasons[0] and "\n" not in reasons[0]
    assert len(list((tmp_path / "rollouts" / "corrupt").iterdir())) == 1
    assert share.share["rank"] == 0 and read["bytes_read"] > 0
