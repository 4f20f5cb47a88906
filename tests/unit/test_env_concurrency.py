"""Environment calls run as wide as configured (issue 50 item 4): rl.envs.base.call used asyncio.to_thread,
the loop's default executor of min(32, cpus + 4) threads, so at most 32 blocking environment calls ran at
once whatever orchestrator.env_concurrency said. They now run in the environment's own executor, sized
per process from env_concurrency (make_env) up to rl.envs.base.ENV_THREADS_MAX."""
from __future__ import annotations

import asyncio
import contextvars
import threading
import time

import pytest

from rl.contract.config import structured
from rl.envs import base, make_env

N = 64   # more than the 32 threads asyncio's default executor ever has


@pytest.fixture(autouse=True)
def _restore_size():
    before = base.env_threads()
    yield
    base.set_env_threads(before)


def _run_side_by_side(n: int) -> int:
    """n blocking calls of 0.25 s through `call`; returns the most observed running at once. Each call
    waits at a barrier of n, so the count reaches n only if all n run together (under load too: no
    timing is asserted), and a narrower executor breaks the barrier instead of hanging."""
    lock = threading.Lock()
    state = {"running": 0, "peak": 0}
    barrier = threading.Barrier(n, timeout=20)

    def blocking() -> str:
        with lock:
            state["running"] += 1
            state["peak"] = max(state["peak"], state["running"])
        try:
            barrier.wait()
            time.sleep(0.25)
        finally:
            with lock:
                state["running"] -= 1
        return threading.current_thread().name

    async def main():
        return await asyncio.gather(*(base.call(blocking) for _ in range(n)))

    names = asyncio.run(main())
    assert len(names) == n and all(x.startswith("env") for x in names), names[:3]
    return state["peak"]


def test_n_blocking_calls_run_side_by_side():
    assert base.set_env_threads(N) == N
    assert _run_side_by_side(N) == N


def test_make_env_sizes_the_executor_from_env_concurrency():
    cfg = structured({"run_dir": "/tmp/hetrl-env-concurrency", "orchestrator": {"env_concurrency": N}})
    make_env(cfg)
    assert base.env_threads() == N
    assert _run_side_by_side(N) == N
    # capped per process: more calls at once than this is more processes (orchestrator.rollout_workers)
    make_env(structured({"run_dir": "/tmp/x", "orchestrator": {"env_concurrency": 10 ** 6}}))
    assert base.env_threads() == base.ENV_THREADS_MAX
    with pytest.raises(ValueError, match="at least 1"):
        base.set_env_threads(0)


def test_one_executor_per_loop_resized_when_the_size_changes_and_context_kept():
    var = contextvars.ContextVar("var", default="unset")
    base.set_env_threads(3)

    async def twice():
        var.set("caller's")
        a = base.env_executor()
        got = await base.call(var.get)
        assert base.env_executor() is a
        base.set_env_threads(5)
        b = base.env_executor()
        return a, b, got

    a, b, got = asyncio.run(twice())
    assert got == "caller's"                        # as asyncio.to_thread: the caller's context variables
    assert a is not b and a._max_workers == 3 and b._max_workers == 5
    c, _, _ = asyncio.run(twice())                  # another loop, its own executor
    assert c is not a and c is not b


def test_coroutine_functions_are_awaited_in_the_loop():
    async def coro(x):
        return threading.current_thread() is threading.main_thread(), x

    assert asyncio.run(base.call(coro, 7)) == (True, 7)
