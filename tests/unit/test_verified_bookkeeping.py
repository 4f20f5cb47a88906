"""Only verified steps count: a rollout batch's bookkeeping (which groups and rollouts it trains) is
believed by the orchestrator's resume only when the step verifies and its meta.json fits its schema,
the trainer refuses the same batches, batches carry real policy versions and logprobs, and a frozen
incarnation cannot publish after someone rewinds both resume.json and incarnations/.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rl import exchange
from rl.contract.batch import InvalidBatch, RolloutBatch, Sample
from rl.contract.config import Config
from rl.contract.records import RecordError
from rl.exchange import Fenced, fencing
from rl.orchestrator.grouplog import GroupLog, partial_rollouts, resume_order, trained_group_ids

G = 4


def _run_dir(path: Path) -> Path:
    cfg = OmegaConf.structured(Config)
    cfg.run_dir = str(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    return path


def _batch(entries: list[tuple[int, list[int], bool]], rewards: list[float] | None = None, **meta) -> RolloutBatch:
    """A real batch: per entry (group, rollout indices, complete), one sample per rollout, with the
    bookkeeping the pool writes (rl.orchestrator.groups.entries_meta)."""
    samples, k = [], 0
    for j, (g, idx, _) in enumerate(entries):
        for _ in idx:
            r = rewards[k] if rewards else float(k % 2)
            samples.append(Sample(prompt_ids=[1, 2], completion_ids=[3, 4], completion_logprobs=[-0.5, -1.0],
                                  completion_versions=[0, 0], reward=r, group=j))
            k += 1
    book = {"group_ids": [g for g, _, c in entries if c], "entries": [[g, idx] for g, idx, _ in entries],
            "partial_groups": {str(g): {"rollouts": idx, "rewards": [s.reward for s in samples if s.group == j]}
                               for j, (g, idx, c) in enumerate(entries) if not c},
            "num_samples": len(samples)}
    return RolloutBatch.from_samples(samples, {**book, **meta})


def _publish(run: Path, step: int, batch: RolloutBatch) -> Path:
    return exchange.publish(run, "rollouts", step, batch.save, producer="orchestrator").path


def _edit_meta(step: Path, rehash: bool, **changes) -> None:
    """A probe editing meta.json, with or without fixing its checksum in the manifest."""
    old = (step / "meta.json").read_bytes()
    meta = json.loads(old)
    meta.update(changes)
    data = json.dumps(meta, separators=(",", ":")).encode()
    data += b" " * max(len(old) - len(data), 0)   # same size where it fits: only the checksum can tell
    (step / "meta.json").write_bytes(data)
    if rehash:
        m = json.loads((step / exchange.MANIFEST).read_text())
        m["files"]["meta.json"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        (step / exchange.MANIFEST).write_text(json.dumps(m))


def _log(run: Path, groups) -> None:
    log = GroupLog(run, restart=0)
    for g in groups:
        log.started(g, 0)


def test_groups_of_a_batch_that_fails_verification_are_not_marked_trained(tmp_path, caplog):
    """The probe: a batch trained group 1; its meta.json is edited to list groups [1, 2, 3]. The step
    fails verify, yet resume_order marked 2 and 3 trained (never trained, silently lost)."""
    run = _run_dir(tmp_path / "run")
    _log(run, range(5))
    step = _publish(run, 0, _batch([(1, [0, 1, 2, 3], True)]))
    assert resume_order(run, G) == ([0, 2, 3, 4], 5)
    _edit_meta(step, rehash=False, group_ids=[1, 2, 3])
    with pytest.raises(exchange.CorruptStep, match="sha256"):
        exchange.verify(step)
    caplog.set_level(logging.WARNING, "hetrl.records")
    # not trusted at all: the trainer sets the step aside (below), so group 1 is not trained either
    assert resume_order(run, G) == ([0, 1, 2, 3, 4], 5)
    assert trained_group_ids(run) == {}
    assert any("meta.json does not match the sha256 in its manifest" in r.getMessage() for r in caplog.records)


def test_a_rehashed_meta_whose_parts_disagree_is_not_believed(tmp_path):
    """The checksum fixed too: group_ids that are not among the entries are still refused (schema)."""
    run = _run_dir(tmp_path / "run")
    _log(run, range(5))
    step = _publish(run, 0, _batch([(1, [0, 1, 2, 3], True)]))
    _edit_meta(step, rehash=True, group_ids=[1, 2, 3])
    exchange.verify(step)   # the step verifies...
    assert resume_order(run, G) == ([0, 1, 2, 3, 4], 5)   # ...but what it says does not hold together
    with pytest.raises(InvalidBatch, match=r"group_ids and partial_groups list group 2, which is not among the entries"):
        RolloutBatch.load(step)


def test_a_part_with_fewer_rewards_than_rollouts_is_refused_not_zip_truncated(tmp_path):
    """The probe: partial_groups {rollouts [0, 1, 2], rewards [1.0]} was read as rollout 0 trained
    (zip truncates), so rollouts 1 and 2 were played again and trained twice. Now the batch is refused
    whole: by the resume (its groups untrained) and by the trainer (set aside, republished)."""
    from rl.runtime import StopFlag
    from rl.trainer.loop import next_batch
    run = _run_dir(tmp_path / "run")
    _log(run, [0])
    step = _publish(run, 0, _batch([(0, [0, 1, 2], False)]))
    assert partial_rollouts(run, G) == {0: ({0: 0.0, 1: 1.0, 2: 0.0}, set(), None)}
    _edit_meta(step, rehash=True, partial_groups={"0": {"rollouts": [0, 1, 2], "rewards": [1.0]}})
    assert partial_rollouts(run, G) == {}                 # no part believed: group 0 plays whole again
    assert resume_order(run, G) == ([0], 1)
    with pytest.raises(InvalidBatch, match=r"partial_groups\[0\] has 1 rewards for 3 rollouts"):
        RolloutBatch.load(step)
    stop, aside = StopFlag(install=False), []
    stop.set("test")   # returns after the first look: the step is set aside, nothing republishes it
    assert next_batch(run, 0, stop, poll=0.01, set_aside=aside) is None
    assert exchange.list_steps(run, "rollouts") == [] and "has 1 rewards for 3 rollouts" in aside[0]


def test_meta_that_does_not_describe_the_arrays_is_invalid(tmp_path):
    run = _run_dir(tmp_path / "run")
    b = _batch([(0, [0, 1], True), (5, [2], False)])
    b.meta["entries"] = [[0, [0]], [5, [1, 2]]]       # rollout counts swapped between the entries
    b.meta["partial_groups"] = {"5": {"rollouts": [1, 2], "rewards": [0.0, 1.0]}}
    with pytest.raises(InvalidBatch, match=r"entry 0 \(group 0\) lists 1 rollouts, the batch has 2 samples of it"):
        RolloutBatch.load(_publish(run, 0, b))
    b = _batch([(0, [0, 1], True), (5, [2], False)], rewards=[0.0, 1.0, 1.0])
    b.meta["partial_groups"]["5"]["rewards"] = [0.0]  # a reward that is not its sample's
    with pytest.raises(InvalidBatch, match=r"partial_groups\[5\].rewards=\[0.0\] are not its samples' rewards \[1.0\]"):
        RolloutBatch.load(_publish(run, 1, b))
    for bad, says in (({"group_ids": [0, 0]}, re.escape("group_ids=[0, 0] is not a list of distinct group ids")),
                      ({"entries": [[0, [0, 0]]]}, "entries=.* is not a list of"),
                      ({"snapshots": {"0": {"1": float("nan")}}}, "snapshots=.* is not a map"),
                      ({"num_samples": 7}, "num_samples=7, the batch has 3 samples"),
                      ({"version_min": -3}, "version_min=-3 is not a policy version or null")):
        b = _batch([(0, [0, 1], True), (5, [2], False)])
        b.meta.update(bad)
        with pytest.raises(InvalidBatch, match=says):
            b.validate_meta()
    _batch([(0, [0, 1], True), (5, [2], False)]).validate_meta(group_size=G)   # the pool's own is fine


def test_batch_versions_below_minus_one_and_absurd_logprobs_are_invalid(tmp_path):
    """The probe: versions < -1 (not a version, not 'no policy') and logprobs > 0 or of -1e6 were
    trained on; vLLM's -9999 for -inf is a logprob."""
    run = _run_dir(tmp_path / "run")
    cases = (("versions", 3, -5, r"versions\[3\] = -5 is not a policy version"),
             ("logprobs", 2, 3.0, r"logprobs\[2\] = 3.0 is not a logprob"),
             ("logprobs", 3, -1e6, r"logprobs\[3\] = -1000000.0 is not a logprob"))
    for n, (field, i, value, says) in enumerate(cases):
        b = _batch([(0, [0, 1], True)])
        getattr(b, field)[i] = value
        with pytest.raises(InvalidBatch, match=says):
            RolloutBatch.load(_publish(run, n, b))
    b = _batch([(0, [0, 1], True)])
    b.logprobs[3] = -9999.0
    RolloutBatch.load(_publish(run, 9, b))


def test_rewinding_resume_json_and_incarnations_does_not_let_a_frozen_incarnation_publish(tmp_path, monkeypatch):
    """The probe: incarnation 1 started and published; someone rewinds resume.json to restart 0 AND
    removes incarnations/restart_000001.json; a frozen process of incarnation 0, continued, published
    again. The steps incarnation 1 published carry its epoch, which neither rewind touches."""
    from rl.prepare import prepare
    run = _run_dir(tmp_path / "run")
    monkeypatch.setattr(fencing, "_FENCES", {})
    monkeypatch.setattr(fencing, "_SEEN", {})
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert prepare(run).restart == 0
    rewound = (run / "resume.json").read_text()
    assert prepare(run, from_scratch=True).restart == 1
    exchange.fence(run, 1)
    exchange.publish(run, "weights", 1, lambda d: (d / "f").write_bytes(b"1"), producer="trainer")
    (run / "resume.json").write_text(rewound)
    (run / "incarnations" / "restart_000001.json").unlink()
    monkeypatch.setattr(fencing, "_FENCES", {})   # the frozen process never saw incarnation 1
    monkeypatch.setattr(fencing, "_SEEN", {})
    exchange.fence(run, 0)
    with pytest.raises(Fenced, match=r"weights/step_000002: refused: .*resume.json says restart 0, but "
                                     r"weights/step_000001 was published by incarnation 1 \(its manifest\)"):
        exchange.publish(run, "weights", 2, lambda d: (d / "f").write_bytes(b"zombie"), producer="trainer")
    with pytest.raises(Fenced, match="the record went backwards"):
        exchange.check_fence(run, "groups.jsonl: group 3")
    assert exchange.list_steps(run, "weights") == [1]
    with pytest.raises(RecordError, match="weights/step_000001 was published by incarnation 1"):
        prepare(run)   # nor is epoch 1 handed out again
