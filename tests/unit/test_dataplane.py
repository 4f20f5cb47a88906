"""launch.dataplane: the rollout batch's bytes by hand and against the project's own writer, the routes'
width by expert count, the ranks' shares adding up to the batch, the base64 routes of an episode against
numpy's `.npy` encoding, measured rates, and the rows `launch plan` prints for the seed."""
from __future__ import annotations

import base64
import io
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from launch import dataplane as dp
from launch import perf
from launch.compose import compose_points
from rl.contract.batch import INDEX_FILE, META_FILE, RolloutBatch, ShardPlan, expert_ids, shard_file

REPO = Path(__file__).resolve().parents[2]
GLM = ["+experiment=glm5_seed", "cluster=slurm", f"model.hf_path={REPO}/conf/checkpoints/glm_moe_dsa"]

# 4 episodes of 10 tokens, 3 MoE layers x top-2 of 8 experts, 2 data ranks (each: 2 samples, 20 tokens)
SMALL = dict(rollouts=4, mean_tokens=10, max_tokens=16, moe_layers=3, top_k=2, n_experts=8, data_ranks=2,
             trainer_ranks=4, inflight=8, turns=2)


def padded(header: str) -> int:
    return 8 + len(header) + (-len(header) % 8)


def test_small_batch_bytes_by_hand():
    v = dp.Volume(**SMALL)
    assert v.token_bytes == 13 + 3 * 2 * 1
    shard_header = ('{"tokens":{"dtype":"I32","shape":[20],"data_offsets":[0,80]},'
                    '"loss_mask":{"dtype":"U8","shape":[20],"data_offsets":[80,100]},'
                    '"logprobs":{"dtype":"F32","shape":[20],"data_offsets":[100,180]},'
                    '"versions":{"dtype":"I32","shape":[20],"data_offsets":[180,260]},'
                    '"offsets":{"dtype":"I64","shape":[3],"data_offsets":[260,284]},'
                    '"routed_experts":{"dtype":"U8","shape":[20,3,2],"data_offsets":[284,404]}}')
    assert v.shard_bytes() == 20 * 19 + 3 * 8 + padded(shard_header)
    index_header = ('{"offsets":{"dtype":"I64","shape":[5],"data_offsets":[0,40]},'
                    '"rewards":{"dtype":"F32","shape":[4],"data_offsets":[40,56]},'
                    '"advantages":{"dtype":"F32","shape":[4],"data_offsets":[56,72]},'
                    '"groups":{"dtype":"I32","shape":[4],"data_offsets":[72,88]},'
                    '"loss_tokens":{"dtype":"I64","shape":[4],"data_offsets":[88,120]},'
                    '"version_sum":{"dtype":"I64","shape":[4],"data_offsets":[120,152]},'
                    '"version_min":{"dtype":"I64","shape":[4],"data_offsets":[152,184]}}')
    assert v.index_bytes() == 184 + padded(index_header)
    assert v.batch_bytes() == 2 * v.shard_bytes() + v.index_bytes() + dp.META_BASE_BYTES + 4 * dp.META_SAMPLE_BYTES
    assert v.route_bytes() == 40 * 6
    # HTTP: 2 turns of 4.5 rows each -> 27 B of rows + 128 B npy header = 155 B -> 52 base64 quads
    assert v.http_route_bytes() == 4 * 2 * 4 * math.ceil((9 * 6 / 2 + 128) / 3)


def test_shard_and_index_bytes_are_what_the_batch_writer_writes(tmp_path):
    """The formula against rl.contract.batch's own files (cut by the trainer's rule, two data ranks)."""
    v = dp.Volume(**SMALL)
    rng = np.random.default_rng(0)
    n = 40
    batch = RolloutBatch(tokens=rng.integers(0, 1000, n, dtype=np.int32), offsets=np.arange(5, dtype=np.int64) * 10,
                         loss_mask=np.ones(n, np.uint8), logprobs=np.full(n, -0.5, np.float32),
                         versions=np.zeros(n, np.int32), rewards=np.zeros(4, np.float32),
                         advantages=np.zeros(4, np.float32), groups=np.arange(4, dtype=np.int32),
                         routed_experts=expert_ids(rng.integers(0, 8, (n, 3, 2))), meta={"num_samples": 4})
    files = batch.save(tmp_path, ShardPlan(data_ranks=2, micro_batch_tokens=20))
    assert files[shard_file(0)]["size"] == files[shard_file(1)]["size"] == v.shard_bytes()
    assert files[INDEX_FILE]["size"] == v.index_bytes()
    assert files[META_FILE]["size"] < v.meta_bytes()   # the estimate errs long for a small meta.json


@pytest.mark.parametrize("experts, width, dtype", [(8, 1, np.uint8), (256, 1, np.uint8), (257, 2, np.uint16),
                                                   (384, 2, np.uint16)])
def test_route_width_follows_the_expert_count_like_the_batch(experts, width, dtype):
    assert dp.route_width(experts) == width
    assert expert_ids(np.array([[[experts - 1]]])).dtype == dtype   # what the batch stores
    v = dp.Volume(**{**SMALL, "n_experts": experts, "moe_layers": 75, "top_k": 8})
    assert v.route_token_bytes == 600 * width
    assert dp.Volume(**{**SMALL, "n_experts": experts, "router_replay": False}).route_token_bytes == 0


def test_episode_routes_over_http_match_numpy_npy_base64():
    """One row per token, sent once per episode in `turns` responses: the base64 of each turn's `.npy`
    (as vLLM's numpy2base64 encodes it), summed, is the formula's; linear in tokens, not turns."""
    layers, top_k, turns, rows_per_turn = 5, 4, 6, 33
    tokens = turns * rows_per_turn + 1     # the last token sampled is never forwarded
    sent = 0
    for _ in range(turns):
        buf = io.BytesIO()
        np.save(buf, np.zeros((rows_per_turn, layers, top_k), np.uint8), allow_pickle=False)
        sent += len(base64.b64encode(buf.getvalue()))
    v = dp.Volume(**{**SMALL, "rollouts": 1, "mean_tokens": tokens, "moe_layers": layers, "top_k": top_k,
                     "n_experts": 128, "turns": turns})
    assert v.http_route_bytes() == sent
    more = dp.Volume(**{**SMALL, "rollouts": 1, "mean_tokens": tokens, "moe_layers": layers, "top_k": top_k,
                        "n_experts": 128, "turns": 3 * turns})
    extra = more.http_route_bytes() - sent   # three times the turns: only the added turns' npy headers
    assert 0 < extra <= 2 * turns * 4 * (math.ceil(dp.NPY_HEADER / 3) + 1)


@pytest.mark.parametrize("ranks", [1, 2, 16, 128])
def test_rank_shares_sum_to_the_batch(ranks):
    v = dp.Volume(**{**SMALL, "rollouts": 256, "mean_tokens": 65536, "moe_layers": 75, "top_k": 8,
                     "n_experts": 256, "data_ranks": ranks, "trainer_ranks": 128})
    d = dp.predict(v)
    shared = v.index_bytes() + v.meta_bytes()
    assert ranks * (d.rank_read_bytes - shared) + shared == pytest.approx(d.batch_bytes, rel=1e-12)
    assert d.fs_read_bytes == 128 * d.rank_read_bytes and d.fs_write_bytes == d.batch_bytes
    assert d.critical_path_s == pytest.approx(d.verify_s + d.load_s + d.pack_s + dp.STEP_FIXED_S)
    if ranks == 16:   # the seed: ~10.3 GB a step, 1/16 of it per rank
        assert 10.2e9 < d.batch_bytes < 10.4e9 and d.rank_read_bytes < d.batch_bytes / 15.9


def test_more_data_ranks_shorten_the_critical_path_and_the_filesystem_bounds_it():
    seed = {**SMALL, "rollouts": 256, "mean_tokens": 65536, "moe_layers": 75, "top_k": 8, "n_experts": 256,
            "trainer_ranks": 128}
    seed.pop("data_ranks")
    few, many = dp.predict(dp.Volume(**seed, data_ranks=4)), dp.predict(dp.Volume(**seed, data_ranks=16))
    assert many.critical_path_s < 0.26 * few.critical_path_s
    assert many.orchestrator_cpu_s == pytest.approx(few.orchestrator_cpu_s, rel=1e-3)   # the batch is the batch
    slow = dp.SharedFS(read_bps=1e9, write_bps=1e9, total_bps=8e9, ranks_per_node=8)
    bounded = dp.predict(dp.Volume(**seed, data_ranks=16), fs=slow)
    assert bounded.load_s == pytest.approx(many.rank_read_bytes / (8e9 / 128))
    assert bounded.verify_s == many.verify_s and bounded.write_s > many.write_s


def test_bad_volume_and_rates_are_one_line_errors():
    with pytest.raises(ValueError, match=r"^Volume.data_ranks=0: must be a finite number > 0$"):
        dp.Volume(**{**SMALL, "data_ranks": 0})
    with pytest.raises(ValueError, match="router replay needs MoE layers"):
        dp.Volume(**{**SMALL, "moe_layers": 0})
    with pytest.raises(ValueError, match=r"^Rates.sha256=0: must be a positive"):
        dp.Rates(sha256=0)


def test_measured_rates_are_positive_and_finite(tmp_path):
    r = dp.measure_rates(tmp_path, mib=4, repeats=2)
    for k, v in vars(r).items():
        assert math.isfinite(v) and v > 1e6, (k, v)   # above a MB/s: a real operation, not a zero time
    assert list(tmp_path.iterdir()) == []
    d = dp.predict(dp.Volume(**SMALL), r)
    assert d.critical_path_s > 0 and d.orchestrator_cpu_s > 0


def test_volume_from_the_seed_config():
    (c,) = compose_points([*GLM, "run_dir=/tmp/hetrl-dataplane-test"], multirun=False)
    v = perf.data_volume(c)
    assert (v.rollouts, v.data_ranks, v.trainer_ranks, v.moe_layers, v.top_k, v.n_experts) == (256, 32, 128, 75, 8, 256)
    assert v.router_replay and v.mean_tokens == 65536 and v.max_tokens == 131072 and v.inflight == 2048
    inf = c["inference"]
    assert v.off_policy == 8 and v.servers == (1 if inf["router"] else inf["replicas"])   # the RSS term's drivers
    assert perf.data_volume(c, {"rollout_tokens": "32768"}).mean_tokens == 32768
    (off,) = compose_points([*GLM, "trainer.router_replay=false", "run_dir=/tmp/hetrl-dataplane-test"], multirun=False)
    assert perf.data_volume(off).route_token_bytes == 0


def test_launch_plan_prints_the_data_plane_for_the_seed_and_warns():
    out = subprocess.run([sys.executable, "-m", "launch", "plan", *GLM, "cluster.target_step_s=20",
                          "run_dir=/tmp/hetrl-dataplane-test"], cwd=REPO, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "COLUMNS": "250"})   # rich wraps at 80 otherwise
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    for words in ("batch: 10.", "75 x top-8 routes (600 B/token)", "32 shards", "trainer rank reads 0.32",
                  "trainer load", "trainer verify", "trainer pack", "trainer critical path",
                  "orchestrator CPU", "orchestrator RSS", "perf: warning: the trainer's data-plane critical path"):
        assert words in text, words
    assert text.index("predicted seconds per step") < text.index("trainer critical path") < text.index("#!/bin/bash")


def test_orchestrator_rss_counts_each_part_by_its_driver():
    """The RSS term's parts (benchmarks/seed_rehearsal.py measures them apart): finished samples waiting
    max_off_policy batches cost their 13 B/token arrays, episodes in flight cost per episode and per token
    half-way, answers being parsed cost per server, whatever the episodes in flight."""
    seed = {**SMALL, "rollouts": 256, "mean_tokens": 65536, "moe_layers": 75, "top_k": 8, "n_experts": 256,
            "data_ranks": 16, "trainer_ranks": 128, "inflight": 2048, "turns": 50}
    base = dp.orchestrator_rss(dp.Volume(**seed))
    assert dp.orchestrator_rss(dp.Volume(**seed, off_policy=8)) - base == pytest.approx(8 * 256 * 65536 * 13)
    assert (dp.orchestrator_rss(dp.Volume(**{**seed, "inflight": 1024})) - base ==
            pytest.approx(-1024 * (dp.EPISODE_BYTES + 65536 / 2 * dp.RESIDENT_TOKEN_BYTES)))
    v = dp.Volume(**seed)
    answers = dp.orchestrator_rss(dp.Volume(**seed, servers=3)) - base
    assert answers == pytest.approx(2 * dp.ANSWERS_HELD * dp.answer_bytes(v))
    assert 1.0e6 < dp.answer_bytes(v) < 1.2e6    # a turn of 1311 tokens: 75 x 8 routes as base64, ids and logprobs
    assert dp.predict(v).orchestrator_rss_bytes == base
    with pytest.raises(ValueError, match=r"^Volume.servers=0: must be a finite number > 0$"):
        dp.Volume(**seed, servers=0)



def test_rehearsal_page_cache_probe_tells_a_cached_shard_from_a_dropped_one(tmp_path):
    """plan_vs_rehearsal compares measure_rates' read (a file it just wrote: page-cache hits) with the
    ranks' replayed reads; the replay records how much of each shard was resident, by mincore(2)."""
    import _rehearsal_rank as rank
    if not hasattr(os, "posix_fadvise"):
        pytest.skip("no posix_fadvise to drop a file's pages")
    f = tmp_path / "shard_00000.safetensors"
    with open(f, "wb") as out:
        out.write(os.urandom(4 << 20))
        out.flush()
        os.fsync(out.fileno())
    assert rank.resident(f) > 0.9
    fd = os.open(f, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)   # clean pages after the fsync: dropped
    finally:
        os.close(fd)
    if rank.resident(f) > 0.5 and _fs_type(f) == "tmpfs":
        pytest.skip(f"{tmp_path} is on tmpfs: its pages are the file, never dropped")
    assert rank.resident(f) < 0.5


def _fs_type(path: Path) -> str:
    """The type of the filesystem `path` is on (/proc/mounts' longest matching mount point)."""
    best, kind = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        mnt, typ = line.split()[1:3]
        if str(path).startswith(mnt) and len(mnt) > len(best):
            best, kind = mnt, typ
    return kind


def test_rehearsal_ratio_pairs_each_replay_with_the_rates_measured_around_it():
    """Each replay is divided into the plan at the rates measured just before and just after it (mean of
    the two predictions), not at rates measured once elsewhere: a slow phase of the machine moves both."""
    from types import SimpleNamespace

    import _rehearsal_report as rep
    a = SimpleNamespace(rollouts_per_step=16, layers=75, top_k=8, experts=256, data_ranks=2, inflight=32, steps=2)
    m = {"tokens_mean": 4096.0, "budget": 8192, "turns_mean": 4.0}
    slow, fast = dp.Rates(sha256=0.3e9, read=0.3e9), dp.Rates(sha256=1.2e9, read=1.2e9)
    rates = [{"rep": k, "rates": vars(r)} for k, r in enumerate((slow, slow, fast))]
    alone = {0: 0.5, 1: 0.2}   # replay 0 in the slow phase, replay 1 as it ended
    replay = [{"rep": k, "step": n, "rank": r, "t_seen": 0.0, "t_packed": alone[k] * (0.5 if r else 1.0)}
              for k in (0, 1) for n in range(2) for r in range(2)]
    (p, _, median_rates, ratios), why = rep.plan_prediction(a, m, {"replay": replay, "replay_rates": rates}, None)
    assert why is None
    vol = dp.Volume(rollouts=16, mean_tokens=4096.0, max_tokens=8192.0, moe_layers=75, top_k=8, n_experts=256,
                    data_ranks=2, trainer_ranks=2, inflight=32, turns=4.0, off_policy=1)
    slow_s, fast_s = dp.predict(vol, slow).critical_path_s, dp.predict(vol, fast).critical_path_s
    assert ratios == pytest.approx([slow_s / 0.5, (slow_s + fast_s) / 2 / 0.2])
    assert median_rates.sha256 == slow.sha256 and p.critical_path_s == pytest.approx(slow_s)
