"""`torchrun --nproc_per_node 2 -m rl.trainer` on gloo: FSDP, EP and CP give the single-process losses;
a checkpoint written by 2 ranks resumes on 1 rank and continues with the same losses."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from helpers.trainer import publish_batches, tiny_cfg
from rl.contract.batch import ShardPlan
from rl import exchange
from rl.exchange import weights as wire
from rl.metrics import read_metrics
from rl.runtime import EXIT_PREEMPTED, is_done
from rl.trainer.loop import run

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.distributed

STEPS = 2
TOL = dict(rel=1e-5, abs=1e-6)  # fp32: only the summation order differs between layouts


def _cfg(run_dir, dp=1, ep=1, cp=1, max_steps=STEPS):
    # warm start on the real env (default examples) so the parallel warm start is covered too;
    # lr 1e-3: Adam's normalised first steps blow summation-order noise up to ~1e-4 relative at 1e-2
    return tiny_cfg(run_dir, max_steps=max_steps, lr=1e-3,
                    warm_start={"steps": 2, "batch_size": 8, "lr": 1e-3},
                    parallel={"dp_shard": dp, "ep": ep, "cp": cp})


def _torchrun(run_dir, nproc=2, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={nproc}", "-m", "rl.trainer", "--run-dir", str(run_dir)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-8000:]
    return p.stdout


def _losses(run_dir):
    return {m["step"]: m["loss"] for m in read_metrics(run_dir)}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The reference: one process, the same config and batches, STEPS + 2 steps."""
    d = tmp_path_factory.mktemp("single")
    cfg = _cfg(d, max_steps=STEPS + 2)
    publish_batches(d, range(STEPS + 2), plan=ShardPlan.from_config(cfg))
    assert run(d, cfg, poll=0.01) == 0
    return _losses(d)


@pytest.mark.parametrize("dims", [(2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["dp_shard2", "ep2", "cp2"])
def test_two_ranks_give_the_single_process_losses(tmp_path, single, dims):
    cfg = _cfg(tmp_path, *dims)
    OmegaConf.save(cfg, tmp_path / "config.yaml")
    # cut as the orchestrator cuts them: each data rank reads only its shard (rl.trainer.dataplane)
    publish_batches(tmp_path, range(STEPS), plan=ShardPlan.from_config(cfg))
    out = _torchrun(tmp_path)
    assert out.count("step 0: loss") == 1, out  # rank 0 alone logs
    assert is_done(tmp_path)
    got = _losses(tmp_path)
    assert sorted(got) == list(range(STEPS))
    for n in range(STEPS):
        assert got[n] == pytest.approx(single[n], **TOL), (n, got, single)
    data_ranks = dims[0] * dims[1]
    for m in read_metrics(tmp_path):   # rank 0 read its share: meta.json, the index and one of the shards
        files = exchange.read_manifest(exchange.step_dir(tmp_path, "rollouts", m["step"]))["files"]
        assert len([f for f in files if f.startswith("shard_")]) == data_ranks
        assert m["batch_read_bytes"] < sum(f["size"] for f in files.values()) or data_ranks == 1
    assert exchange.list_steps(tmp_path, "weights") == [0, 1, 2]
    assert exchange.list_steps(tmp_path, "checkpoints") == [0, 2]
    # every rank wrote its DCP shard into the one checkpoint directory
    dcp_files = sorted(p.name for p in (exchange.step_dir(tmp_path, "checkpoints", 2) / "dcp").iterdir())
    assert sum(f.endswith(".distcp") for f in dcp_files) == 2, dcp_files


def test_checkpoint_of_two_ranks_resumes_on_one_rank(tmp_path, single):
    """ep=2 x FSDP shards (experts split by EP) saved by 2 ranks, loaded by 1 process via DCP."""
    cfg = _cfg(tmp_path, 1, 2, 1)
    OmegaConf.save(cfg, tmp_path / "config.yaml")
    publish_batches(tmp_path, range(STEPS))
    _torchrun(tmp_path)
    cfg.trainer.max_steps = STEPS + 2
    cfg.trainer.parallel.ep = 1
    OmegaConf.save(cfg, tmp_path / "config.yaml")
    publish_batches(tmp_path, range(STEPS, STEPS + 2))
    assert run(tmp_path, cfg, poll=0.01) == 0  # newest complete checkpoint: step STEPS
    got = _losses(tmp_path)
    assert sorted(got) == list(range(STEPS + 2))
    # the second resumed step also checks the restored Adam moments
    for n in range(STEPS + 2):
        assert got[n] == pytest.approx(single[n], **TOL), (n, got, single)


def _publish_routed_batches(run_dir, steps, layers, experts, top_k):
    """Synthetic batches carrying engine routing (random distinct experts per token and layer)."""
    import numpy as np
    from helpers.trainer import synthetic_batch
    for n in steps:
        b = synthetic_batch(n)
        rng = np.random.default_rng(100 + n)
        b.routed_experts = np.stack([np.stack([rng.permutation(experts)[:top_k] for _ in range(layers)])
                                     for _ in range(len(b.tokens))]).astype(np.uint8)
        exchange.publish(run_dir, "rollouts", n, b.save, producer="test")


@pytest.mark.parametrize("dims", [(1, 2, 1), (1, 1, 2)], ids=["ep2", "cp2"])
def test_router_replay_and_fp8_under_two_ranks(tmp_path, dims):
    """Replayed routing is cut with the tokens (data split, head-tail CP split); FP8 GEMMs per rank."""
    def cfg_of(d, dd):
        cfg = _cfg(d, *dd)
        cfg.trainer.router_replay = True
        cfg.trainer.fp8 = True
        cfg.trainer.warm_start.steps = 0
        return cfg
    _replayed_fp8_two_ranks_equal_one(tmp_path, dims, cfg_of)


def _replayed_fp8_two_ranks_equal_one(tmp_path, dims, cfg_of):
    """One process and two ranks (`dims`) on the same engine-routed batches give the same losses."""
    ref, par = tmp_path / "single", tmp_path / "par"
    for d, dd in ((ref, (1, 1, 1)), (par, dims)):
        d.mkdir()
        cfg = cfg_of(d, dd)
        OmegaConf.save(cfg, d / "config.yaml")
        m = cfg.model
        _publish_routed_batches(d, range(STEPS), m.n_layers - m.n_dense_layers, m.num_experts, m.top_k)
    assert run(ref, OmegaConf.load(ref / "config.yaml"), poll=0.01) == 0
    _torchrun(par)
    want, got = _losses(ref), _losses(par)
    assert sorted(got) == sorted(want) == list(range(STEPS))
    for n in range(STEPS):
        assert got[n] == pytest.approx(want[n], **TOL), (n, got, want)
    m = read_metrics(par)[0]
    assert m["router_replay"] == 1 and m["routing_recorded_by_engine"] == 1


def test_sigterm_to_the_torchrun_wrapper_preempts_and_resumes(tmp_path):
    """`python -m rl.trainer.torchrun` exits EXIT_PREEMPTED (torchrun alone would say 1) and resumes."""
    cfg = _cfg(tmp_path, 2, 1, 1)
    cfg.trainer.warm_start.steps = 0
    OmegaConf.save(cfg, tmp_path / "config.yaml")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "rl.trainer.torchrun", "--standalone", "--nproc_per_node=2",
           "-m", "rl.trainer", "--run-dir", str(tmp_path)]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180
    while not exchange.step_dir(tmp_path, "checkpoints", 0).exists():  # waiting for rollouts now
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()[0][-6000:]
        time.sleep(0.2)
    time.sleep(1.0)
    p.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=120)[0]
    assert p.returncode == EXIT_PREEMPTED, out[-6000:]
    publish_batches(tmp_path, range(STEPS))
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    assert "resumed from checkpoints/step_000000 on 2 ranks" in p.stdout
    assert is_done(tmp_path) and sorted(_losses(tmp_path)) == list(range(STEPS))


def _family_cfg(run_dir, twin, dp=1, ep=1, cp=1, family="kimi_k2_7", *extra):
    from builders import compose_cfg
    return OmegaConf.create(compose_cfg(
        run_dir, f"model.family={family}", f"model.hf_path={twin(family)}", "model.max_seq_len=128",
        "inference.max_model_len=128",
        "wandb.mode=disabled", f"trainer.max_steps={STEPS}", "trainer.checkpoint_every=2", "trainer.lr=1e-3",
        "trainer.micro_batch_tokens=96", "trainer.warm_start.steps=0",
        f"trainer.parallel.dp_shard={dp}", f"trainer.parallel.ep={ep}", f"trainer.parallel.cp={cp}", *extra))


@pytest.fixture(scope="module")
def single_kimi(tmp_path_factory, twin):
    d = tmp_path_factory.mktemp("single_kimi")
    publish_batches(d, range(STEPS))
    assert run(d, _family_cfg(d, twin), poll=0.01) == 0
    return _losses(d), d


@pytest.mark.parametrize("dims", [(2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["dp_shard2", "ep2", "cp2"])
def test_kimi_from_its_checkpoint_on_two_ranks_gives_the_single_process_losses(tmp_path, twin, single_kimi, dims):
    """The MLA family (torchtitan's DeepSeek-V3 with shared expert, sigmoid routing, expert bias), started
    from its HF checkpoint, under FSDP2 / EP / CP (dense-mask K/V all-gather) on gloo ranks.

    Both ranks publish their own shards of every version; version 0 (the checkpoint's weights, no step
    taken) reassembles to exactly the single process's bytes."""
    losses, single_dir = single_kimi
    OmegaConf.save(_family_cfg(tmp_path, twin, *dims), tmp_path / "config.yaml")
    publish_batches(tmp_path, range(STEPS))
    _torchrun(tmp_path)
    got = _losses(tmp_path)
    assert sorted(got) == list(range(STEPS))
    for n in range(STEPS):
        assert got[n] == pytest.approx(losses[n], **TOL), (n, got, losses)
    w0, ref = (exchange.step_dir(d, "weights", 0) for d in (tmp_path, single_dir))
    assert _stored(w0) == _stored(ref)
    meta = exchange.read_manifest(w0)["meta"]
    assert meta["ranks"] == 2 and min(meta["bytes_per_rank"]) > 0.25 * max(meta["bytes_per_rank"]), meta
    writers = {p.name.split("-")[1] for p in w0.glob("*.safetensors")}
    assert writers == {"r00000", "r00001"}
    for v in range(STEPS + 1):  # later versions: two writers too, and every tensor verifies
        assert len(dict(wire.iter_tensors(exchange.step_dir(tmp_path, "weights", v), verify=True))) > 0


def _stored(weights_dir):
    from rl.exchange.shard_reader import ShardReader, _bytes
    return {n: bytes(_bytes(t)) for n, t in ShardReader(weights_dir).tensors(dequantize=False)}


@pytest.mark.parametrize("family,dims", [("kimi_k2_7", (1, 2, 1)), ("glm_moe_dsa", (1, 1, 2))],
                         ids=["kimi-ep2", "glm5-cp2"])
def test_router_replay_and_fp8_of_the_real_families_under_two_ranks(tmp_path, twin, family, dims):
    """Router replay of engine routing and FP8 training on the MLA families, started from their
    checkpoints, under EP (Kimi) and CP (GLM-5: MLA K/V and indexer keys gathered) equal one process."""
    _replayed_fp8_two_ranks_equal_one(tmp_path, dims, lambda d, dd: _family_cfg(
        d, twin, *dd, family, "trainer.router_replay=true", "trainer.fp8=true"))
