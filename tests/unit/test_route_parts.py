"""Routes as rollout workers' part files (rl/orchestrator/parts.py; issue 50 item 2): the batch takes each
sample's part by a rename, the centre never reads it, and each trainer data rank reads and verifies the
route files of its own samples only, getting exactly what a batch with the routes copied into its shards
gives.
"""
from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from rl import exchange
from rl.contract.batch import (INDEX_FILE, META_FILE, InvalidBatch, RolloutBatch, Sample, ShardPlan, batch_digest,
                               load_share, route_file, shard_file, write_arrays, write_samples)
from rl.orchestrator import parts


def _samples(n=11, seed=1, row=(3, 2)):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = rng.integers(0, 500, int(rng.integers(2, 30)), dtype=np.int32)
        c = rng.integers(0, 500, int(rng.integers(1, 60)), dtype=np.int32)
        hi = 600 if i == 4 else 200   # one sample's ids need uint16
        r = rng.integers(0, hi, (len(p) + len(c), *row))
        out.append(Sample(p, c, -rng.uniform(0.1, 5, len(c)).astype(np.float32),
                          rng.integers(0, 4, len(c)).astype(np.int32), reward=float(rng.uniform()), group=i // 4,
                          advantage=float(rng.normal()), completion_mask=(rng.uniform(size=len(c)) < .7).astype(np.uint8),
                          routed_experts=r))
    return out


def _as_parts(run, samples):
    """The samples as the centre holds them after its workers sent them: routes as claimed parts."""
    (run / "rollouts").mkdir(parents=True, exist_ok=True)
    where = parts.reset(run)
    out = []
    for s in samples:
        part = parts.claim(parts.write(s.routed_experts, where, worker=1), where)
        out.append(Sample(s.prompt_ids, s.completion_ids, s.completion_logprobs, s.completion_versions,
                          reward=s.reward, group=s.group, advantage=s.advantage, completion_mask=s.completion_mask,
                          routed_experts=part))
    return out, where


def _publish(run, step, samples, plan):
    return exchange.publish(run, "rollouts", step, lambda d: write_samples(d, samples, {"step": step}, plan),
                            producer="orchestrator", hashed=True).path


@pytest.mark.parametrize("ranks,mbt", [(1, 64), (3, 64), (4, 100)])
def test_each_rank_reads_its_own_route_files_and_gets_what_the_shards_would_hold(tmp_path, ranks, mbt):
    samples = _samples()
    plan = ShardPlan(ranks, mbt)
    copied = _publish(tmp_path / "a", 0, samples, plan)
    held, where = _as_parts(tmp_path / "b", samples)
    step = _publish(tmp_path / "b", 0, held, plan)
    assert os.listdir(where) == [], "every part was taken by the batch"
    files = exchange.verify(step, checksums=True)["files"]
    assert sorted(files) == sorted([META_FILE, INDEX_FILE, *(shard_file(r) for r in range(ranks)),
                                    *(route_file(i) for i in range(len(samples)))])
    meta = exchange.read_manifest(step)
    for r in range(ranks):
        want, _ = load_share(copied, r, files=exchange.read_manifest(copied)["files"], plan=plan)
        got, nbytes = load_share(step, r, files=files, plan=plan)
        for k in ("tokens", "offsets", "loss_mask", "logprobs", "versions", "routed_experts"):
            assert np.array_equal(getattr(got, k), getattr(want, k)), k
        mine = got.share["samples"]
        own = sum(files[n]["size"] for n in (META_FILE, INDEX_FILE, shard_file(r), *map(route_file, mine)))
        assert nbytes <= own, "a rank reads meta.json, the index, its shard and its samples' route files only"
        assert "routed_experts" not in open(step / shard_file(r), "rb").read(4096).decode("latin-1")
    whole = RolloutBatch.load(step, files=meta["files"])
    ref = RolloutBatch.from_samples(samples)
    assert np.array_equal(whole.routed_experts, ref.routed_experts) and whole.routed_experts.dtype == np.uint16


def test_a_damaged_route_file_is_refused_by_its_rank_only(tmp_path):
    held, _ = _as_parts(tmp_path, _samples())
    plan = ShardPlan(3, 64)
    step = _publish(tmp_path, 0, held, plan)
    files = exchange.read_manifest(step)["files"]
    layout = __import__("json").loads((step / META_FILE).read_text())["layout"]
    owner = next(r for r, e in enumerate(layout["ranks"]) if 0 in e["samples"])
    f = step / route_file(0)
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(InvalidBatch, match=r"routes_000000\.safetensors: sha256 does not match"):
        load_share(step, owner, files=files, plan=plan)
    for r in set(range(3)) - {owner}:
        load_share(step, r, files=files, plan=plan)


def test_a_route_file_that_disagrees_with_its_sample_is_refused(tmp_path):
    samples = _samples(n=4)
    held, _ = _as_parts(tmp_path, samples)
    step = _publish(tmp_path, 0, held, ShardPlan(1, 1000))
    f = step / route_file(2)
    f.unlink()
    write_arrays(f, {"routed_experts": np.zeros((len(samples[2]) + 1, 3, 2), np.uint8)})
    with pytest.raises(InvalidBatch, match=r"routes_000002\.safetensors: \d+ rows of routed experts, its sample has"):
        load_share(step, 0)   # no manifest: the reader's own checks
    f.unlink()
    write_arrays(f, {"routed_experts": np.zeros((len(samples[2]), 3, 2), np.uint8), "extra": np.zeros(1, np.uint8)})
    with pytest.raises(InvalidBatch, match="holds routed_experts only"):
        load_share(step, 0)


def test_the_digest_covers_route_files(tmp_path):
    held, _ = _as_parts(tmp_path, _samples(n=3))
    files = exchange.read_manifest(_publish(tmp_path, 0, held, ShardPlan()))["files"]
    changed = {**files, route_file(1): {**files[route_file(1)], "sha256": "0" * 64}}
    assert batch_digest(changed) != batch_digest(files)


def test_a_part_no_batch_takes_is_removed_with_its_sample(tmp_path):
    held, where = _as_parts(tmp_path, _samples(n=3))
    assert len(os.listdir(where)) == 3
    del held
    gc.collect()
    assert os.listdir(where) == []
