"""Rollout workers (rl/orchestrator/workers.py, worker.py, wire.py): what crosses the socket and what the
centre does when a worker dies.

Routes travel as part files in the run directory (the centre never reads them, no rows on the wire); a
multi-turn sample's Rollout travels as its EpisodeStats and the batch metrics read the same from either.
The fault path runs the centre's real RolloutWorkers against in-process stand-in workers on real
socketpairs (the real worker process needs servers: tests/integration/test_rollout_workers_run.py runs it,
kill -9 included): a worker that dies after reporting some rollouts of a group loses only the others,
which are counted and played again on the restarted worker, each rollout accepted once.
"""
from __future__ import annotations

import asyncio
import pickle
import socket
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from rl.contract.batch import Sample
from rl.orchestrator import accounting, multiturn, parts, spill, wire
from rl.orchestrator.accounting import IdleClock, RolloutAcct
from rl.orchestrator.groups import Group
from rl.orchestrator.rollout import EpisodeStats, Rollout
from rl.orchestrator.versions import VersionTracker
from rl.orchestrator.workers import RolloutWorkers, rollout_workers


@pytest.fixture
def parts_dir(tmp_path):
    (tmp_path / "rollouts").mkdir()
    return str(parts.reset(tmp_path))


def _rows(n, layers=3, k=2):
    return (np.arange(n * layers * k) % 7).reshape(n, layers, k).astype(np.uint8)


def test_routes_travel_as_a_part_file_the_centre_claims(tmp_path, parts_dir):
    r = Rollout([1, 2, 3], spill_dir=str(tmp_path / "spill"))
    r.add_model([4, 5], [-0.1, -0.2], [0, 0])
    rows = _rows(5)
    sp = spill.directory(str(tmp_path / "spill")).new(rows.shape[1:])
    sp.append(rows)
    sealed = sp.seal(len(rows))
    s = Sample(prompt_ids=np.array([1, 2, 3]), completion_ids=np.array([4, 5]), completion_logprobs=np.zeros(2),
               completion_versions=np.zeros(2, np.int32), reward=1.0, group=0, routed_experts=sealed,
               info={"finish_reason": "stop", "multiturn": r})
    w = wire.to_wire(s, parts_dir, worker=3)
    assert isinstance(w.routed_experts, parts.RoutePart) and isinstance(w.info["multiturn"], EpisodeStats)
    path = Path(w.routed_experts.path)
    assert path.parent == Path(parts_dir) and path.exists()
    body = wire.encode(w)
    assert len(body) < 2000, "rows or the Rollout's arrays went on the wire"
    back = wire.from_wire(pickle.loads(body[wire.HEADER.size:]), parts_dir)
    assert np.array_equal(np.asarray(back.routed_experts), rows)
    del back, w
    import gc
    gc.collect()
    assert not path.exists(), "a claimed part no batch took goes with its sample"


def test_single_turn_routes_become_a_part(parts_dir):
    rows = _rows(6)
    s = Sample(prompt_ids=[1, 2], completion_ids=[3, 4, 5, 6], completion_logprobs=[0.0] * 4,
               completion_versions=[0] * 4, reward=0.0, group=1, routed_experts=rows, info={})
    w = wire.to_wire(s, parts_dir)
    assert isinstance(w.routed_experts, parts.RoutePart) and len(w.routed_experts) == 6
    assert np.array_equal(np.asarray(wire.from_wire(w, parts_dir).routed_experts), rows)


def test_the_centre_refuses_a_part_outside_its_directory(tmp_path, parts_dir):
    other = tmp_path / "victim.safetensors"
    other.write_bytes(b"x")
    s = Sample(prompt_ids=[1], completion_ids=[2], completion_logprobs=[0.0], completion_versions=[0], reward=0.0,
               group=0, routed_experts=parts.RoutePart(str(other), "|u1", (2, 3, 2), 1, "0" * 64), info={})
    with pytest.raises(ValueError, match="not a part file in"):
        wire.from_wire(s, parts_dir)
    assert other.exists()


def test_batch_metrics_read_the_same_from_episode_stats():
    def sample():
        r = Rollout([1, 2, 3])
        r.add_model([4, 5], [-0.1, -0.2], [0, 0])
        r.turns.append(multiturn.Turn(2, 0, 0.1, 0.2, 1, 0, "stop"))
        r.end_reason, r.seconds = "done", 0.3
        return r.sample(0, rollout=0)
    a, b = sample(), sample()
    b.info["multiturn"] = b.info["multiturn"].stats()
    assert multiturn.batch_metrics([a]) == multiturn.batch_metrics([b])


def test_rollout_workers_key():
    assert rollout_workers(SimpleNamespace(orchestrator=SimpleNamespace())) == 0
    assert rollout_workers(SimpleNamespace(orchestrator=SimpleNamespace(rollout_workers=3))) == 3
    with pytest.raises(ValueError, match="rollout_workers"):
        rollout_workers(SimpleNamespace(orchestrator=SimpleNamespace(rollout_workers=-1)))


class StandIns(RolloutWorkers):
    """The centre's real RolloutWorkers with in-process stand-in workers on real socketpairs. A stand-in
    reports each rollout (its reward = its index); the first incarnation of worker 0 dies after reporting
    `die_after` rollouts of its first group (the socket closed, as a SIGKILL would)."""

    die_after = 2

    def _spawn(self, c):
        mine, theirs = socket.socketpair()
        c.proc, c.ready = None, asyncio.Event()
        c.reader_task = asyncio.create_task(self._serve(c, mine))
        dies = c.index == 0 and not c.restarts
        # held: the loop keeps only a weak reference to a task, and a collected stand-in closes its socket
        self.__dict__.setdefault("stand_ins", []).append(asyncio.create_task(self._stand_in(theirs, dies)))

    async def _stand_in(self, sock, dies):
        reader, writer = await asyncio.open_connection(sock=sock)
        await wire.read(reader)
        writer.write(wire.encode(("ready", 0)))
        sent = 0
        while True:
            try:
                msg = await wire.read(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            if msg[0] != "play":
                continue
            _, key, task, group, step, attempt, rollouts, _v = msg
            for i in rollouts or range(int(self.o.group_size)):
                await asyncio.sleep(0.01)
                if dies and sent == self.die_after:
                    writer.transport.abort()
                    return
                s = Sample(prompt_ids=[1], completion_ids=[2, 3], completion_logprobs=[0.0, 0.0],
                           completion_versions=[0, 0], reward=float(i), group=group, info={"rollout": i})
                writer.write(wire.encode(("end", key, i, 2, 0, 0, s)))
                sent += 1
            writer.write(wire.encode(("done", key, None)))


def test_a_dead_worker_loses_only_its_episodes_in_flight(parts_dir):
    local = SimpleNamespace(cfg=None, o=SimpleNamespace(group_size=4), env=None, multi_turn=False,
                            tracker=VersionTracker(0), idle=IdleClock())

    async def main():
        ws = StandIns(local, 2)
        await ws.start(servers=[], router=None, tokenizer="", timeout=1.0, parts_dir=parts_dir)
        groups = [Group(gid=g, task={}, start_version=0, started=0.0,
                        rollouts={i: RolloutAcct() for i in range(4)}) for g in range(3)]

        async def play(g):
            accounting.GROUP.set(g)
            return await ws.sample_group_or_none({}, g.gid, g.gid, 0)
        out = await asyncio.gather(*(play(g) for g in groups))
        await ws.aclose()
        return ws, groups, out

    ws, groups, out = asyncio.run(main())
    for g, samples in zip(groups, out):
        assert [s.reward for s in samples] == [0.0, 1.0, 2.0, 3.0], "every rollout once, in order"
        assert sorted(g.done) == [0, 1, 2, 3] and all(r.seconds is not None for r in g.rollouts.values())
    assert ws.totals["worker_restarts"] == 1
    # worker 0 held groups 0 and 2 (least loaded first): 2 rollouts of group 0 reported, 2 + 4 lost
    assert ws.totals["lost_episodes"] == 6 and ws.totals["replayed_groups"] == 2
    assert ws.meta()["lost_episodes_total"] == 6
