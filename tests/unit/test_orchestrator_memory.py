"""Bounded orchestrator memory for in-flight multi-turn episodes (rl/orchestrator/spill.py, Rollout).

(a) The spill files: an episode's routed-expert rows land in its own file, exactly the rows in order (the
same as concatenating them in memory), the tail padded with the last row, uint8 rewritten once as uint16
when a later turn needs it; the file is gone once mapped, when the episode fails or is cancelled, when the
rollout is dropped; stale directories of dead orchestrators are removed, a live one's and another host's
are not; the process's directory is removed at exit.
(b) The memory: N in-flight rollouts of T tokens driven through add_routes / add_model / add_env hold,
measured with tracemalloc (numpy reports its buffers to it), at most 32 bytes per in-flight token, and the
same with 2 x 2 routes as with GLM-5's 75 x 8: routes cost disk, not memory.
"""
from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from rl.contract.batch import expert_ids
from rl.orchestrator import spill
from rl.orchestrator.client import Completion
from rl.orchestrator.multiturn import ChatBridge, Rollout, RolloutLimits, run_episode

REPO = Path(__file__).resolve().parents[2]
BOUND = 32  # bytes per in-flight token, routes not counted (spill.py's docstring, docs/internals.md)


def _spill_files(parent: Path) -> list[Path]:
    return sorted(p for d in parent.glob(f"{spill.PREFIX}*") for p in d.iterdir())


def _drive(r: Rollout, rng, turns: int, gen: int, obs: int, shape, high: int = 256, keep=None):
    """Turns of `gen` model tokens and `obs` observation tokens with routes of `shape`, as run_episode
    feeds them (each request asks from the rows held); `keep` collects the rows sent."""
    n = len(r)
    for t in range(turns):
        start = r.routed_rows
        rows = rng.integers(0, high, (n + gen - 1 - start, *shape))
        rows = rows.astype(np.uint16 if high > 256 else np.uint8)
        if keep is not None:
            keep.append(rows)
        r.add_routes(rows, start, n, gen, t)
        r.add_model(rng.integers(0, 1000, gen).tolist(), [-0.5] * gen, [t] * gen)
        n += gen
        if t < turns - 1:
            r.add_env(rng.integers(0, 1000, obs).tolist())
            n += obs


def test_spill_holds_exactly_the_rows_in_order_then_unlinks(tmp_path):
    rng = np.random.default_rng(0)
    r = Rollout(prompt_ids=list(range(37)), spill_dir=str(tmp_path))
    sent: list[np.ndarray] = []
    _drive(r, rng, turns=5, gen=11, obs=7, shape=(3, 2), keep=sent)
    r.add_env([5, 6, 7])  # an observation no turn read (a timed-out turn): its rows are the padded tail
    files = _spill_files(tmp_path)
    assert len(files) == 1 and files[0].stat().st_size == r.routed_rows * 3 * 2   # uint8, on disk
    held = np.concatenate(sent)
    assert r.routed_rows == len(held) == len(r) - 1 - 3
    s = r.sample(0)
    got = s.routed_experts
    want = np.concatenate([held, np.repeat(held[-1:], len(r) - len(held), axis=0)])
    assert isinstance(got, np.memmap) and not got.flags.writeable
    assert got.dtype == np.uint8 == expert_ids(want).dtype and np.array_equal(got, want)
    assert _spill_files(tmp_path) == []          # unlinked once mapped; the mapping still reads
    assert int(got[-1].sum()) == int(want[-1].sum())
    # the other fields: compact arrays, one per token after the prompt
    assert (s.prompt_ids.dtype, s.completion_ids.dtype, s.completion_mask.dtype, s.completion_logprobs.dtype,
            s.completion_versions.dtype) == (np.int32, np.int32, np.uint8, np.float32, np.int32)
    assert len(s.prompt_ids) + len(s.completion_ids) == len(got)
    assert s.completion_versions[-1] == -1 and s.completion_mask[-1] == 0 and s.completion_versions[-4] == 4
    assert r.sample(0).routed_experts is got     # sealed once


def test_uint8_rows_are_rewritten_once_as_uint16(tmp_path):
    rng = np.random.default_rng(1)
    r = Rollout(prompt_ids=[1, 2, 3, 4], spill_dir=str(tmp_path))
    sent: list[np.ndarray] = []
    _drive(r, rng, turns=2, gen=5, obs=3, shape=(2, 4), keep=sent)
    assert r._routes.dtype == np.uint8
    r.add_env([7, 8])
    n = len(r)
    rows = rng.integers(0, 384, (n + 5 - 1 - r.routed_rows, 2, 4)).astype(np.uint16)   # Kimi-K2's ids
    r.add_routes(rows, r.routed_rows, n, 5, 2)
    r.add_model([9] * 5, [-1.0] * 5, [2] * 5)
    sent.append(rows)
    size_after_widening = _spill_files(tmp_path)[0].stat().st_size
    r.add_env([7, 8])
    n = len(r)
    rows = np.full((n + 1 - 1 - r.routed_rows, 2, 4), 3, np.uint8)   # a uint8 turn after: stored as uint16
    r.add_routes(rows, r.routed_rows, n, 1, 3)
    r.add_model([9], [-1.0], [3])
    sent.append(rows)
    f = _spill_files(tmp_path)[0]
    assert r._routes.dtype == np.uint16 and f.stat().st_size == r.routed_rows * 2 * 4 * 2
    assert size_after_widening == (r.routed_rows - len(rows)) * 2 * 4 * 2
    got = r.routed()
    held = np.concatenate(sent)
    want = expert_ids(np.concatenate([held, held[-1:]]))
    assert got.dtype == want.dtype == np.uint16 and np.array_equal(got, want)


class OneEnv:
    """Answers every turn; fails at turn `fail_at` (environment code raising), never done."""

    def __init__(self, fail_at=None):
        self.fail_at = fail_at

    def start(self, task):
        env = self

        class Ep:
            turns = 0

            def initial_messages(self):
                return [{"role": "user", "content": "task"}]

            def step(self, text):
                self.turns += 1
                if self.turns == env.fail_at:
                    raise RuntimeError("tool crashed")
                return f"ok {self.turns}", False

            def reward(self):
                return 1.0
        return Ep()


class RoutingPolicy:
    """A generate() returning 3 tokens and the rows from routed_start on; blocks forever at turn `hang_at`."""

    def __init__(self, hang_at=None):
        self.hang_at, self.started = hang_at, asyncio.Event()

    async def __call__(self, ids, max_tokens, turn, routed_start=0):
        if turn == self.hang_at:
            self.started.set()
            await asyncio.Event().wait()
        new = [11, 12, 13]
        rows = np.full((len(ids) + len(new) - 1 - routed_start, 2, 2), turn, np.uint8)
        return Completion(ids=new, logprobs=[-0.1] * 3, finish_reason="stop", request_id="r",
                          routed_experts=rows), [0] * 3


@pytest.fixture(scope="module")
def bridge(tmp_path_factory):
    from rl.tiny_models.tiny import build_tokenizer
    return ChatBridge(build_tokenizer(tmp_path_factory.mktemp("tok")))


def _limits(tmp_path, **kw):
    return RolloutLimits(**{"max_turns": 6, "max_tokens_per_turn": 8, "max_total_tokens": 1024,
                            "spill_dir": str(tmp_path), **kw})


def test_failed_cancelled_and_dropped_episodes_leave_no_file(tmp_path, bridge):
    r = asyncio.run(run_episode(OneEnv(), {}, RoutingPolicy(), bridge, _limits(tmp_path)))
    assert r.end_reason == "max_turns" and r.routed_rows > 0 and len(_spill_files(tmp_path)) == 1
    del r
    gc.collect()
    assert _spill_files(tmp_path) == []          # a rollout dropped unsealed takes its file along

    with pytest.raises(RuntimeError, match="tool crashed"):
        asyncio.run(run_episode(OneEnv(fail_at=3), {}, RoutingPolicy(), bridge, _limits(tmp_path)))
    assert _spill_files(tmp_path) == []

    async def cancel_midway():
        policy = RoutingPolicy(hang_at=2)
        task = asyncio.create_task(run_episode(OneEnv(), {}, policy, bridge, _limits(tmp_path)))
        await policy.started.wait()
        assert len(_spill_files(tmp_path)) == 1   # two turns of rows spilled, the third in flight
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(cancel_midway())
    assert _spill_files(tmp_path) == []


def test_stale_dirs_of_dead_orchestrators_are_cleaned_at_start(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host = spill._host()
        names = {"dead": f"{spill.PREFIX}{host}-{dead.pid}-abc",
                 "live": f"{spill.PREFIX}{host}-{live.pid}-def",
                 "other": f"{spill.PREFIX}otherhost-{dead.pid}-ghi", "unrelated": "hetrl-something-1"}
        for n in names.values():
            (tmp_path / n).mkdir()
            (tmp_path / n / "0.routes").write_bytes(b"x" * 10)
        d = spill.SpillDir(tmp_path)
        mine = d.path
        left = {p.name for p in tmp_path.iterdir()}
        assert names["dead"] not in left
        assert {names["live"], names["other"], names["unrelated"], mine.name} == left
        assert mine.stat().st_mode & 0o777 == 0o700
        d.remove()
        assert not mine.exists()
    finally:
        live.kill()
        live.wait()


def test_spill_dir_is_removed_at_exit_and_a_bad_one_is_named(tmp_path):
    code = ("import numpy as np; from rl.orchestrator.multiturn import Rollout\n"
            "r = Rollout([1, 2, 3]); r.add_routes(np.zeros((4, 2, 2), np.uint8), 0, 3, 2, 0)\n"
            "import sys; print(r._routes.file.parent, file=sys.stderr)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}
    env.pop("SLURM_TMPDIR", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    made = Path(out.stderr.strip().splitlines()[-1])
    assert made.parent == tmp_path and made.name.startswith(spill.PREFIX) and not made.exists()
    (tmp_path / "file").write_text("not a directory")
    r = Rollout([1, 2, 3], spill_dir=str(tmp_path / "file"))
    with pytest.raises(ValueError, match=r"orchestrator.spill_dir='.*file': cannot be used"):
        r.add_routes(np.zeros((4, 2, 2), np.uint8), 0, 3, 2, 0)


def _held_per_token(tmp_path, shape, n_rollouts=24, turns=12, gen=96, obs=64, prompt=300):
    rng = np.random.default_rng(2)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        rollouts = []
        for i in range(n_rollouts):
            r = Rollout(prompt_ids=rng.integers(300, 1000, prompt).tolist(), spill_dir=str(tmp_path))
            rollouts.append(r)
        # interleaved like in-flight episodes: every rollout gets its turn t before any gets t + 1
        for t in range(turns):
            for r in rollouts:
                n = len(r)
                rows = rng.integers(0, 256, (n + gen - 1 - r.routed_rows, *shape), dtype=np.uint8)
                r.add_routes(rows, r.routed_rows, n, gen, t)
                del rows
                r.add_model(rng.integers(300, 1000, gen).tolist(), [-0.5] * gen, [t] * gen)
                if t < turns - 1:
                    r.add_env(rng.integers(300, 1000, obs).tolist())
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    tokens = sum(len(r) for r in rollouts)
    assert all(r.routed_rows == len(r) - 1 for r in rollouts)
    for r in rollouts:
        r.discard_routes()
    return held / tokens, tokens


def test_held_bytes_per_inflight_token_are_bounded_and_do_not_grow_with_routes(tmp_path):
    small, tokens = _held_per_token(tmp_path / "small", (2, 2))
    glm5, _ = _held_per_token(tmp_path / "glm5", (75, 8))      # 600 B of routes per token, all on disk
    print(f"held bytes per in-flight token: {small:.1f} (2x2 routes), {glm5:.1f} (75x8 routes), "
          f"{tokens} tokens")
    assert small <= BOUND and glm5 <= BOUND
    assert glm5 <= small + 1.0   # not a byte more per token for 150 times the routes


def test_requests_in_flight_hold_their_context_as_json_bytes(tmp_path):
    """N episodes each with a request out through the real InferenceClient (httpx, a transport that holds
    every request until all N are in): the rollouts plus the requests hold <= BOUND + 8 bytes per token
    (the context travels as compact JSON bytes, ~7 a token for ids < 10^6, never as a list of ints)."""
    import httpx
    from rl.orchestrator.client import InferenceClient

    n_eps, rng = 12, np.random.default_rng(3)

    async def run():
        arrived, release = [0], asyncio.Event()

        async def handler(request: httpx.Request) -> httpx.Response:
            arrived[0] += 1
            await release.wait()
            return httpx.Response(200, json={"choices": [{"token_ids": [5], "finish_reason": "stop",
                                                          "logprobs": {"content": [{"logprob": -0.1}]}}]})
        client = InferenceClient("http://fake:8000")
        await client._http.aclose()
        client._http = httpx.AsyncClient(base_url=client.url, transport=httpx.MockTransport(handler))
        rollouts = []
        gc.collect()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            for _ in range(n_eps):
                r = Rollout(prompt_ids=rng.integers(100_000, 150_000, 2000).tolist(), spill_dir=str(tmp_path))
                for t in range(20):
                    r.add_model(rng.integers(100_000, 150_000, 200).tolist(), [-0.5] * 200, [t] * 200)
                    r.add_env(rng.integers(100_000, 150_000, 100).tolist())
                rollouts.append(r)
            gc.collect()
            state = tracemalloc.get_traced_memory()[0] - base
            out = [asyncio.create_task(client.generate(r.context(), max_tokens=4, request_id=f"q{i}"))
                   for i, r in enumerate(rollouts)]
            while arrived[0] < n_eps:
                await asyncio.sleep(0.01)
            gc.collect()
            inflight = tracemalloc.get_traced_memory()[0] - base
            release.set()
            comps = await asyncio.gather(*out)
        finally:
            tracemalloc.stop()
            await client.aclose()
        assert [c.ids for c in comps] == [[5]] * n_eps
        return state, inflight, sum(len(r) for r in rollouts)

    state, inflight, tokens = asyncio.run(run())
    print(f"per in-flight token: {state / tokens:.1f} B rollout state, {inflight / tokens:.1f} B with a "
          f"request out ({tokens} tokens)")
    assert state / tokens <= BOUND
    assert (inflight - state) / tokens <= 10   # a list of ints would be ~44
