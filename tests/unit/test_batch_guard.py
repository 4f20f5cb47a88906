"""Poisoned rollout batches and non-finite numbers never reach the weights (issue 20, item 6).

Each probe is a batch with a valid manifest and checksums but content the trainer cannot train on,
written through the real writer (or as raw safetensors bytes where the writer cannot produce it) and read
through the trainer's real path (rl.trainer.loop.next_batch): it is set aside with a one-line reason and
the good batch published after it is the one returned. The trainer itself skips an update whose loss or
gradient is not finite and refuses to publish non-finite weights (a real tiny model on the CPU). A NaN
reward from an environment's scoring code makes its group a failed one (the real orchestrator, with a
stand-in for the inference server), never NaN advantages.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import struct

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from rl import exchange
from safetensors.numpy import load_file

from rl.contract.batch import INDEX_FILE, RolloutBatch, Sample, batch_digest, shard_file, write_arrays
from rl.contract.config import Config
from rl.runtime import StopFlag

VOCAB = 512  # rl.contract.config.ModelConfig.vocab_size: the tiny model's


def good_batch(seed: int = 0) -> RolloutBatch:
    """Eight samples in two groups, ids well inside the tiny vocabulary, the orchestrator's layout."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(8):
        p = rng.integers(10, 500, int(rng.integers(3, 8))).tolist()
        c = rng.integers(10, 500, int(rng.integers(2, 8))).tolist()
        # near the untrained tiny model's own logprobs (about -log 512), so the ratios keep most tokens
        lps = (-np.log(VOCAB) + rng.uniform(-0.3, 0.3, len(c))).tolist()
        samples.append(Sample(p, c, lps, [0] * len(c),
                              reward=float(i % 3) / 2, group=i // 4, advantage=float(i % 3) / 2 - 0.5))
    return RolloutBatch.from_samples(samples, meta={"reward_mean": 0.5})


def _with(**arrays) -> RolloutBatch:
    b = good_batch()
    for k, v in arrays.items():
        setattr(b, k, v)
    return b


def _set(field: str, i: int, value):
    def f(b):
        a = getattr(b, field).copy()
        a[i] = value
        setattr(b, field, a)
    return f


def _replace(field: str, fn):
    return lambda b: setattr(b, field, fn(getattr(b, field)))


# (probe, how the good batch is damaged, what the one-line reason must say)
PROBES = [
    ("nan advantage", _set("advantages", 3, np.nan), "advantages[3] = nan is not finite"),
    ("inf advantage", _set("advantages", 0, np.inf), "advantages[0] = inf is not finite"),
    ("-inf logprob", _set("logprobs", 7, -np.inf), "logprobs[7] = -inf is not finite"),
    ("nan logprob", _set("logprobs", 9, np.nan), "logprobs[9] = nan is not finite"),
    ("nan reward", _set("rewards", 5, np.nan), "rewards[5] = nan is not finite"),
    ("token id = vocab", _set("tokens", 4, VOCAB), f"tokens[4] = {VOCAB} is outside the vocabulary [0, {VOCAB})"),
    ("huge token id", _set("tokens", 2, 2**31 - 1), "is outside the vocabulary"),
    ("negative token id", _set("tokens", 1, -5), "tokens[1] = -5 is a negative token id"),
    ("decreasing offsets", _set("offsets", 3, 2), "offsets decrease at offsets[3] = 2 after offsets[2]"),
    ("offsets past the tokens", lambda b: setattr(b, "offsets", np.append(b.offsets[:-1], b.offsets[-1] + 7)),
     "offsets end at"),
    ("offsets not from 0", _set("offsets", 0, 1), "offsets must start at 0, found [1]"),
    ("short loss mask", _replace("loss_mask", lambda a: a[:-1]), "loss_mask has"),
    ("long logprobs", _replace("logprobs", lambda a: np.append(a, np.float32(-1.0))), "logprobs has"),
    ("short versions", _replace("versions", lambda a: a[:-2]), "versions has"),
    ("advantages of fewer samples", _replace("advantages", lambda a: a[:-1]),
     "advantages has 7 entries for 8 samples"),
    ("loss mask of 2", _set("loss_mask", 10, 2), "loss_mask[10] = 2, must be 0 or 1"),
    ("float token ids", _replace("tokens", lambda a: a.astype(np.float32)), "tokens has dtype float32"),
    ("routed experts of other length",
     lambda b: setattr(b, "routed_experts", np.zeros((len(b.tokens) - 1, 2, 2), np.uint8)),
     "routed_experts has"),
]


def _as_they_are(b: RolloutBatch):
    """A writer of `b`'s arrays as they are, in the on-disk layout (one shard; the per-sample arrays in
    the sample index), through the real file writer: what a buggy or hostile orchestrator could publish
    (RolloutBatch.save itself derives the index from the arrays and could not write most probes)."""
    def write(d):
        good_batch().save(d)   # meta.json (layout: one shard, every sample) and the good index's totals
        index = load_file(str(d / INDEX_FILE))
        for f in (INDEX_FILE, shard_file(0)):
            (d / f).unlink()
        index.update(offsets=b.offsets, rewards=b.rewards, advantages=b.advantages, groups=b.groups)
        write_arrays(d / INDEX_FILE, index)
        write_arrays(d / shard_file(0), {"tokens": b.tokens, "offsets": b.offsets, "loss_mask": b.loss_mask,
                                         "logprobs": b.logprobs, "versions": b.versions,
                                         **({} if b.routed_experts is None else {"routed_experts": b.routed_experts})})
    return write


def _publish(run_dir, write, step: int = 0):
    return exchange.publish(run_dir, "rollouts", step, write, producer="orchestrator")


def _read_like_the_trainer(run_dir, step: int = 0) -> tuple[RolloutBatch, list[str]]:
    """rl.trainer.loop.next_batch on `rollouts/step_<step>`; on its first poll after the step went
    missing the orchestrator (played here) publishes a good batch. Returns (batch read, reasons)."""
    from rl.trainer.loop import next_batch
    flag = StopFlag(install=False)
    polls = []

    def stop():
        polls.append(1)
        if not exchange.step_dir(run_dir, "rollouts", step).exists():
            _publish(run_dir, good_batch().save, step)
        return len(polls) > 50
    flag.is_set = stop
    reasons: list[str] = []
    got = next_batch(run_dir, step, flag, poll=0.01, vocab_size=VOCAB, set_aside=reasons)
    assert got is not None, "the republished good batch was not taken"
    return got[0], reasons


def _assert_set_aside_once(run_dir, reasons, says: str, batch: RolloutBatch) -> None:
    assert len(reasons) == 1, reasons
    assert says in reasons[0] and "\n" not in reasons[0], reasons[0]
    assert "step_000000" in reasons[0]  # names the file
    (aside,) = (run_dir / "rollouts" / "corrupt").iterdir()
    assert aside.name.startswith("step_000000-")
    assert np.array_equal(batch.tokens, good_batch().tokens)  # what came back is the republished batch


@pytest.mark.parametrize("probe,damage,says", PROBES, ids=[p[0] for p in PROBES])
def test_a_checksum_valid_poisoned_batch_is_set_aside_with_its_reason(tmp_path, probe, damage, says):
    bad = good_batch()
    damage(bad)
    _publish(tmp_path, _as_they_are(bad))  # the real file writer: manifest and sha256 are right
    exchange.verify(exchange.step_dir(tmp_path, "rollouts", 0), checksums=True)
    batch, reasons = _read_like_the_trainer(tmp_path)
    _assert_set_aside_once(tmp_path, reasons, says, batch)


def _raw_safetensors(header: dict, data: bytes) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def _write_raw(batch_bytes: bytes):
    def write(d):
        good_batch().save(d)
        (d / shard_file(0)).unlink()
        (d / shard_file(0)).write_bytes(batch_bytes)
    return write


@pytest.mark.parametrize("probe,raw,says", [
    ("header not JSON", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json!!!!!!}", "not a readable safetensors file"),
    ("header length past the file", struct.pack("<Q", 1 << 40) + b"{}", "not a readable safetensors file"),
    ("three bytes", b"\x01\x02\x03", "not a readable safetensors file"),
    ("offsets past the data", _raw_safetensors({"tokens": {"dtype": "I32", "shape": [4], "data_offsets": [0, 16]}},
                                                b"\0" * 8), "not a readable safetensors file"),
    ("a dtype numpy lacks", _raw_safetensors({"tokens": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}},
                                             b"\0" * 4), "not a readable safetensors file"),
    ("an array missing", _raw_safetensors({"tokens": {"dtype": "I32", "shape": [1], "data_offsets": [0, 4]}},
                                          b"\0" * 4), "no array 'offsets'"),
], ids=["header not JSON", "header length past the file", "three bytes", "offsets past the data",
        "a dtype numpy lacks", "an array missing"])
def test_a_malformed_safetensors_header_is_set_aside_not_a_crash(tmp_path, probe, raw, says):
    _publish(tmp_path, _write_raw(raw))
    batch, reasons = _read_like_the_trainer(tmp_path)
    _assert_set_aside_once(tmp_path, reasons, says, batch)
    assert shard_file(0) in reasons[0]


@pytest.mark.parametrize("meta,says", [("{\"step\": ", "not valid JSON"), ("[1, 2]", "must be a JSON object")],
                         ids=["truncated JSON", "a list"])
def test_a_malformed_meta_json_is_set_aside(tmp_path, meta, says):
    def write(d):
        good_batch().save(d)
        (d / "meta.json").write_text(meta)
    _publish(tmp_path, write)
    batch, reasons = _read_like_the_trainer(tmp_path)
    _assert_set_aside_once(tmp_path, reasons, says, batch)
    assert "meta.json" in reasons[0]


def test_a_good_batch_passes_unchanged(tmp_path):
    b = good_batch()
    b.routed_experts = np.ones((len(b.tokens), 2, 2), np.uint16)
    _publish(tmp_path, b.save)
    back, reasons = _read_like_the_trainer(tmp_path)
    assert reasons == [] and not (tmp_path / "rollouts" / "corrupt").exists()
    for k in ("tokens", "offsets", "loss_mask", "logprobs", "versions", "rewards", "advantages", "groups",
              "routed_experts"):
        assert np.array_equal(getattr(back, k), getattr(b, k)), k


# -- the trainer --------------------------------------------------------------------------------------
def tiny_cfg(run_dir, **trainer):
    cfg = OmegaConf.structured(Config)
    cfg.run_dir = str(run_dir)
    cfg.wandb.mode = "disabled"
    cfg.model.max_seq_len = 128
    t = {"max_steps": 1, "checkpoint_every": 3, "micro_batch_tokens": 96, "lr": 1e-2,
         "warm_start": {"steps": 0}, **trainer}
    cfg.trainer = OmegaConf.merge(cfg.trainer, t)
    return cfg


def _weights(tr) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tr.model.state_dict().items()}


def _state(optimizer) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(v).clone() for k, v in optimizer.state_dict().items() if k.startswith("state.")}


def _finite(sd) -> bool:
    return all(torch.isfinite(v).all() for v in sd.values() if v.is_floating_point())


def test_the_trainer_role_never_trains_a_nan_batch_and_goes_on_with_the_republished_one(tmp_path):
    """run(): NaN advantages at step 0 are set aside (logged, counted in the metrics), the orchestrator's
    republished batch is trained, consumed.jsonl lists it alone and the published weights are finite."""
    from rl.metrics import read_metrics
    from rl.trainer.loop import run
    bad = good_batch()
    bad.advantages[:] = np.nan
    _publish(tmp_path, bad.save)

    class Republish(StopFlag):
        def is_set(self):
            if not exchange.step_dir(tmp_path, "rollouts", 0).exists():
                _publish(tmp_path, good_batch().save)
            return super().is_set()
    assert run(tmp_path, tiny_cfg(tmp_path), stop=Republish(install=False), poll=0.01) == 0
    assert len(list((tmp_path / "rollouts" / "corrupt").iterdir())) == 1
    good = batch_digest(exchange.read_manifest(exchange.step_dir(tmp_path, "rollouts", 0))["files"])
    consumed = [json.loads(x) for x in (tmp_path / "rollouts" / "consumed.jsonl").read_text().splitlines()]
    assert [(c["step"], c["sha256"], c.get("applied", True)) for c in consumed] == [(0, good, True)]
    (m,) = read_metrics(tmp_path)
    assert m["rollouts_set_aside"] == 1 and m["update_skipped"] == 0 and math.isfinite(m["loss"])
    from rl.exchange.deltas import stored_tensors
    tensors, _ = stored_tensors(exchange.step_dir(tmp_path, "weights", 1))
    assert all(torch.isfinite(v.float()).all() for v in tensors.values())


@pytest.mark.parametrize("advantage,why", [(np.nan, "loss nan"), (3e38, "is not finite")])
def test_a_non_finite_update_is_skipped_and_the_weights_stay_as_they_were(tmp_path, advantage, why):
    """train_step on a batch that reached it anyway (NaN advantages, or advantages near float32's maximum
    whose loss overflows): no optimizer step, weights and Adam state untouched, counted. The read path
    refuses both (3e38 is past MAX_ADVANTAGE); the trainer's guard is the line behind it."""
    from rl.contract.batch import InvalidBatch
    from rl.trainer.train import Trainer
    tr = Trainer(tiny_cfg(tmp_path))
    b = good_batch()
    b.advantages[:] = advantage
    if math.isfinite(advantage):
        with pytest.raises(InvalidBatch, match=r"advantages\[0\] = 3\.0+\d*e\+38 is beyond"):
            b.validate(VOCAB)
    before, adam = _weights(tr), _state(tr.optimizer)
    m = tr.train_step(b, 0)
    assert m["update_skipped"] == 1 and why in m["update_skip_reason"]
    after = _weights(tr)
    assert all(torch.equal(before[k], after[k]) for k in before)
    now = _state(tr.optimizer)  # Adam's step counts and moments were never touched
    assert now.keys() == adam.keys() and all(torch.equal(adam[k], now[k]) for k in adam)
    m = tr.train_step(good_batch(), 1)  # and the next batch trains normally
    assert m["update_skipped"] == 0 and _finite(_weights(tr))
    assert any(not torch.equal(before[k], v) for k, v in _weights(tr).items())


def test_non_finite_weights_are_never_published(tmp_path):
    from rl.trainer.train import Trainer
    tr = Trainer(tiny_cfg(tmp_path))
    name, p = next(iter(tr.model.named_parameters()))
    with torch.no_grad():
        p.view(-1)[3] = float("inf")
    with pytest.raises(RuntimeError, match=r"weights/step_000001: refusing to publish non-finite weights: 1 "
                                           r"tensor\(s\) hold NaN or inf, first " + name):
        tr.publish_weights(tmp_path, 1)
    tr.wait_published()
    assert exchange.list_steps(tmp_path, "weights") == []


# -- the orchestrator ---------------------------------------------------------------------------------
def test_drgrpo_refuses_a_nan_reward_instead_of_making_its_group_nan():
    from rl.orchestrator.advantages import group_advantages
    with pytest.raises(ValueError, match=r"reward nan of sample 2 \(group 1\) is not finite"):
        group_advantages(np.array([1.0, 0.0, np.nan, 1.0]), np.array([0, 0, 1, 1]), "drgrpo")
    with pytest.raises(ValueError, match="overflows float32"):
        group_advantages(np.array([1e300, -1e300]), np.array([0, 0]), "drgrpo")


def test_a_nan_reward_makes_its_group_a_failed_group(tmp_path):
    """The real orchestrator builds a drgrpo batch; the environment's scoring code returns NaN for the
    first task it hands out. That group is dropped and counted as failed, a fresh one takes its place,
    and every advantage of the batch is finite (the batch passes the trainer's validation)."""
    from rl.envs.digits import DigitsEnv
    from rl.tiny_models.tiny import build_tokenizer
    from rl.orchestrator.client import Completion
    from rl.orchestrator.loop import Orchestrator
    from rl.orchestrator.versions import VersionTracker

    class NaNScoring(DigitsEnv):
        """Digits whose grader divides 0 by 0 on the first task (a scoring bug in user code)."""
        handed = 0

        def sample_tasks(self, n, rng):
            tasks = super().sample_tasks(n, rng)
            for t in tasks:
                t["broken"] = NaNScoring.handed == 0
                NaNScoring.handed += 1
            return tasks

        def score(self, task, completion):
            return float("nan") if task["broken"] else super().score(task, completion)

    class Generator:
        """Stands in for the inference server: digits text from the request's seed, version 0."""

        def __init__(self, tok):
            self.tok = tok

        async def generate(self, prompt_ids, max_tokens, temperature=1.0, top_p=1.0, seed=None,
                           request_id=None, **kw):
            rng = random.Random(seed)
            ids = self.tok.encode(" ".join(str(rng.randrange(10)) for _ in range(3)),
                                  add_special_tokens=False)[:max_tokens - 1] + [self.tok.eos_token_id]
            return Completion(ids=ids, logprobs=[-0.7] * len(ids), finish_reason="stop",
                              request_id=request_id, versions=[0] * len(ids))

    cfg = OmegaConf.structured(Config(run_dir=str(tmp_path)))
    cfg.orchestrator.advantage = "drgrpo"
    cfg.orchestrator.prompts_per_step = 3
    cfg.orchestrator.group_size = 4
    cfg.orchestrator.max_tokens = 16
    o = Orchestrator(tmp_path, cfg)
    o.sampler.env = NaNScoring(cfg.env.digits)
    tok = build_tokenizer(tmp_path / "tok")
    o.sampler.clients, o.sampler.tokenizer, o.sampler.tracker = [Generator(tok)], tok, VersionTracker(0)
    batch = asyncio.run(o.build_batch(0)).batch()
    assert batch.meta["failed_groups"] == 1 and batch.meta["num_groups"] == 3 and batch.num_samples == 12
    assert np.isfinite(batch.advantages).all() and np.isfinite(batch.rewards).all()
    assert batch.advantages.any()  # real drgrpo signal, not zeros papering over the NaN
    batch.validate(VOCAB)
