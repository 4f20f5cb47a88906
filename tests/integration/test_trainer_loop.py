"""The trainer role run in-process on synthetic rollout batches: resume, corruption, FP8 publishing."""
from __future__ import annotations

import json

import torch

from rl.contract.batch import batch_digest, shard_file
from helpers.trainer import examples, publish_batches, synthetic_batch, tiny_cfg
from rl import exchange, fp8
from rl.exchange import retention
from rl.exchange.deltas import stored_tensors
from rl.exchange import layout
from rl.exchange import weights as wire
from rl.metrics import read_metrics
from rl.runtime import EXIT_PREEMPTED, StopFlag, is_done
from rl.trainer.loop import run
from rl.trainer.train import Trainer
from rl.models.common import hf_state_dict


def _final_state(run_dir, cfg, step):
    tr = Trainer(cfg)
    tr.load(run_dir, step)
    return tr


def test_interrupted_and_resumed_run_ends_bit_identical(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        publish_batches(d, range(4))
    cfg_a, cfg_b = tiny_cfg(a), tiny_cfg(b)
    assert run(a, cfg_a, examples=examples, poll=0.01) == 0
    assert is_done(a)

    stop = StopFlag(install=False)
    rc = run(b, cfg_b, stop=stop, examples=examples, poll=0.01,
             after_step=lambda n, m: stop.set("test") if n == 1 else None)
    assert rc == EXIT_PREEMPTED and not is_done(b)
    assert exchange.list_steps(b, "checkpoints") == [0, 2]
    assert run(b, cfg_b, examples=examples, poll=0.01) == 0  # no resume.json: newest complete checkpoint
    assert is_done(b)

    ta, tb = _final_state(a, cfg_a, 4), _final_state(b, cfg_b, 4)
    for k, v in ta.model.state_dict().items():
        assert torch.equal(v, tb.model.state_dict()[k]), k
    oa, ob = ta.optimizer.state_dict(), tb.optimizer.state_dict()
    assert oa.keys() == ob.keys()
    for k in oa:
        assert torch.equal(oa[k], ob[k]) if torch.is_tensor(oa[k]) else oa[k] == ob[k], k
    assert ta.progress.consumed == tb.progress.consumed == [0, 1, 2, 3]
    # published weights agree byte for byte, and every step was logged once per lineage
    # (b's first version after the restart is a full one where a's is a delta: compare them rebuilt)
    for v in range(2, 5):
        wa, wb = exchange.step_dir(a, "weights", v), exchange.step_dir(b, "weights", v)
        (ta_, _), (tb_, _) = stored_tensors(wa), stored_tensors(wb)
        assert ta_.keys() == tb_.keys()
        assert all(torch.equal(ta_[k].view(torch.uint8), tb_[k].view(torch.uint8)) for k in ta_), v
    assert exchange.delta_base(exchange.step_dir(b, "weights", 3)) is None  # no base in the new incarnation
    m = read_metrics(a)
    assert [x["step"] for x in m] == [0, 1, 2, 3]
    for key in ("loss", "reward_mean", "mismatch_kl", "entropy", "lag", "lag_max", "tokens_per_s",
                "step_time_s", "publish_s", "wait_s"):
        assert key in m[0], key
    # keep_weights=3 keeps 2, 3, 4, and whatever a delta among them is rebuilt from
    kept = exchange.list_steps(a, "weights")
    assert kept[-3:] == [2, 3, 4]
    for v in kept:
        b_ = exchange.delta_base(exchange.step_dir(a, "weights", v))
        assert b_ is None or b_ in kept
    assert exchange.list_steps(a, "assets") == [0]


class _RepublishWhenMissing(StopFlag):
    """A stop flag that, polled while the step is missing, plays the orchestrator republishing it."""

    def __init__(self, run_dir):
        super().__init__(install=False)
        self.run_dir, self.republished = run_dir, 0

    def is_set(self):
        if not exchange.step_dir(self.run_dir, "rollouts", 0).exists():
            publish_batches(self.run_dir, [0])
            self.republished += 1
        return super().is_set()


def _corrupt_and_run(run_dir, damage):
    publish_batches(run_dir, [0])
    damage(exchange.step_dir(run_dir, "rollouts", 0) / shard_file(0))
    stop = _RepublishWhenMissing(run_dir)
    assert run(run_dir, tiny_cfg(run_dir, max_steps=1, warm_start={"steps": 0}), stop=stop, poll=0.01) == 0
    assert stop.republished == 1
    quarantined = list((run_dir / "rollouts" / "corrupt").iterdir())
    assert len(quarantined) == 1
    good = batch_digest(exchange.read_manifest(exchange.step_dir(run_dir, "rollouts", 0))["files"])
    consumed = [json.loads(x) for x in (run_dir / "rollouts" / "consumed.jsonl").read_text().splitlines()]
    assert [(c["step"], c["sha256"]) for c in consumed] == [(0, good)]


def test_truncated_rollout_batch_is_never_consumed(tmp_path):
    def truncate(f):
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2])
    _corrupt_and_run(tmp_path, truncate)


def test_checksum_failing_rollout_batch_is_never_consumed(tmp_path):
    def flip(f):
        data = bytearray(f.read_bytes())
        data[-3] ^= 0xFF
        f.write_bytes(bytes(data))
    _corrupt_and_run(tmp_path, flip)


def test_published_fp8_shards_dequantize_to_fake_quantized_trainer_weights(tmp_path):
    cfg = tiny_cfg(tmp_path)
    tr = Trainer(cfg)
    tr.train_step(synthetic_batch(0), 0)
    tr.publish_weights(tmp_path, 1)
    tr.wait_published()
    ours = hf_state_dict(tr.built)
    got = dict(wire.iter_tensors(exchange.step_dir(tmp_path, "weights", 1), dequantize=True))
    assert got.keys() == ours.keys()
    quantized = json.loads((exchange.step_dir(tmp_path, "weights", 1) / layout.FP8_META).read_text())["quantized"]
    assert any(".mlp.experts." in q for q in quantized) and any("q_proj" in q for q in quantized)
    for name, w in ours.items():
        expected = fp8.fake_quantize_block(w) if name in quantized else w
        assert torch.equal(got[name], expected), name


def test_damage_found_at_the_end_is_set_aside(tmp_path):
    publish_batches(tmp_path, range(4))
    cfg = tiny_cfg(tmp_path)
    hits = []

    def damage(n, m):
        if n == 3:  # after the last step trained, before DONE: flip bits in what is already published
            hits.append(exchange.step_dir(tmp_path, "rollouts", 1))
            f = exchange.step_dir(tmp_path, "rollouts", 1) / shard_file(0)
            data = bytearray(f.read_bytes())
            data[-1] ^= 0x01
            f.write_bytes(bytes(data))
    assert run(tmp_path, cfg, examples=examples, poll=0.01, after_step=damage) == 0
    assert hits and is_done(tmp_path)
    for kind in ("rollouts", "weights", "checkpoints"):
        assert retention.corrupt_steps(tmp_path, kind, stored_tensors if kind == "weights" else None) == {}, kind
    assert 1 not in exchange.list_steps(tmp_path, "rollouts")
    assert [p.name.split("-")[0] for p in (tmp_path / "rollouts" / "corrupt").iterdir()] == ["step_000001"]


def test_the_final_weights_and_checkpoint_are_written_again_when_damaged(tmp_path, monkeypatch):
    from rl.trainer import bookkeeping
    publish_batches(tmp_path, range(2))
    cfg = tiny_cfg(tmp_path, max_steps=2)
    real = bookkeeping._final_sweep

    def damage_then_sweep(run_dir, tr, d, final):
        for kind in ("weights", "checkpoints"):
            step = exchange.step_dir(run_dir, kind, final)
            f = max((p for p in step.rglob("*") if p.is_file() and p.name != "manifest.json"),
                    key=lambda p: p.stat().st_size)
            with open(f, "r+b") as fh:
                fh.seek(f.stat().st_size // 2)
                b = fh.read(1)
                fh.seek(f.stat().st_size // 2)
                fh.write(bytes([b[0] ^ 0x10]))
        assert set(retention.corrupt_steps(run_dir, "weights", stored_tensors)) >= {final}
        real(run_dir, tr, d, final)
    monkeypatch.setattr(bookkeeping, "_final_sweep", damage_then_sweep)
    assert run(tmp_path, cfg, examples=examples, poll=0.01) == 0
    for kind in ("weights", "checkpoints"):
        assert retention.corrupt_steps(tmp_path, kind, stored_tensors if kind == "weights" else None) == {}, kind
        assert exchange.latest_complete(tmp_path, kind, checksums=True) == 2, kind
        assert len(list((tmp_path / kind / "corrupt").iterdir())) == 1
    assert Trainer(cfg).load(tmp_path, 2) is None  # the rewritten checkpoint loads
