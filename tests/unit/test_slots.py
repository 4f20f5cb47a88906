"""rl.orchestrator.slots: freed slots go to the oldest group first, none leak on cancellation."""
import asyncio
import random
from types import SimpleNamespace

import pytest

from rl.orchestrator import slots
from rl.orchestrator.accounting import GROUP


def _in_group(version, gid, coro):
    """Run `coro` as a task of pool group (version, gid), as the pool does (GROUP in its context)."""
    async def body():
        GROUP.set(SimpleNamespace(start_version=version, gid=gid))
        return await coro
    return asyncio.ensure_future(body())


def _served(order, groups):
    """The order in which tasks of pool groups `groups` [(version, gid)] get one held slot of `order`."""
    async def main():
        sem = slots.make(1, order)
        served = []

        async def use(tag):
            async with sem:
                served.append(tag)
                await asyncio.sleep(0)

        await sem.acquire()  # held: everyone below waits
        tasks = [_in_group(v, g, use((v, g))) for v, g in groups]
        await asyncio.sleep(0.01)
        sem.release()
        await asyncio.gather(*tasks)
        return served
    return asyncio.run(main())


def test_freed_slots_go_to_the_oldest_group_first():
    groups = [(3, 30), (1, 12), (2, 20), (1, 11), (3, 31)]
    assert _served("oldest", groups) == [(1, 11), (1, 12), (2, 20), (3, 30), (3, 31)]


def test_fifo_order_is_first_come():
    groups = [(3, 3), (1, 1), (2, 2)]
    assert _served("fifo", groups) == groups


def test_outside_a_pool_group_the_order_is_first_come():
    async def main():
        sem = slots.SlotSemaphore(1, key=slots.group_key)
        order = []

        async def use(i):
            async with sem:
                order.append(i)
        await sem.acquire()
        tasks = [asyncio.ensure_future(use(i)) for i in range(5)]
        await asyncio.sleep(0.01)
        sem.release()
        await asyncio.gather(*tasks)
        return order
    assert asyncio.run(main()) == list(range(5))


def test_cancelled_waiters_never_leak_or_hold_a_slot():
    """Random cancels (the pool cancels stale groups mid-wait, and as a slot is handed over): afterwards
    every slot is free again and never more than `n` holders at once."""
    async def main(seed):
        rng = random.Random(seed)
        n = 3
        sem = slots.SlotSemaphore(n, key=slots.group_key)
        holders, peak = 0, 0

        async def use():
            nonlocal holders, peak
            async with sem:
                holders += 1
                peak = max(peak, holders)
                try:
                    await asyncio.sleep(rng.random() * 0.002)
                finally:
                    holders -= 1
        tasks = [_in_group(rng.randrange(5), i, use()) for i in range(60)]
        for _ in range(25):
            await asyncio.sleep(rng.random() * 0.002)
            rng.choice(tasks).cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert holders == 0 and peak <= n
        # every slot can be taken again at once
        for _ in range(n):
            await asyncio.wait_for(sem.acquire(), 1)
        assert sem.locked()
    for seed in range(5):
        asyncio.run(main(seed))


def test_a_slot_handed_to_a_waiter_cancelled_before_it_ran_passes_on():
    async def main():
        sem = slots.SlotSemaphore(1)
        await sem.acquire()
        first = asyncio.ensure_future(sem.acquire())
        second = asyncio.ensure_future(sem.acquire())
        await asyncio.sleep(0)
        sem.release()          # handed to `first` ...
        first.cancel()         # ... which is cancelled before it resumes
        await asyncio.wait_for(second, 1)   # the slot went on to `second`
        assert first.cancelled() and sem.locked()
    asyncio.run(main())


def test_unknown_order_and_bad_size_are_refused():
    with pytest.raises(ValueError, match="orchestrator.slot_order='lifo'"):
        slots.make(2, "lifo")
    with pytest.raises(ValueError, match="at least 1"):
        slots.SlotSemaphore(0)


class _Recorder:
    """A server that records the priority each request carried (None: the field was not sent)."""

    def __init__(self):
        self.priorities = []

    async def generate(self, prompt_ids, max_tokens, temperature=1.0, top_p=1.0, seed=None, request_id=None,
                       priority=None, **kw):
        from rl.orchestrator.client import Completion
        self.priorities.append(priority)
        await asyncio.sleep(0)
        return Completion(ids=[5, 6], logprobs=[-0.1, -0.2], finish_reason="stop", request_id=request_id,
                          versions=None)


@pytest.mark.parametrize("order", ["oldest", "fifo"])
def test_the_sampler_sends_its_group_start_version_as_the_server_priority(tmp_path, order):
    """Inside a pool group (slot_order=oldest) every request carries the group's start version, which
    vLLM serves lowest first; outside a group (evaluation, schedule=batch) and under fifo, none."""
    from omegaconf import OmegaConf

    from launch.plan import make_plan
    from rl.contract.config import Config
    from rl.envs import make_env
    from rl.orchestrator.sampling import Sampler
    from rl.orchestrator.versions import VersionTracker
    cfg = OmegaConf.structured(Config(run_dir=str(tmp_path)))
    cfg.orchestrator.slot_order = order
    sp = Sampler(cfg, make_env(cfg))
    server = _Recorder()
    sp.clients, sp.tracker = [server], VersionTracker(0)

    async def main():
        await _in_group(7, 70, sp.sample_one(server, [1, 2, 3], seed=1))
        await sp.sample_one(server, [1, 2, 3], seed=1)
    asyncio.run(main())
    assert server.priorities == ([7, None] if order == "oldest" else [None, None])
    # the servers run the scheduling policy the priorities need, and only then
    argv = make_plan(cfg).replica(0).vllm_argv(0)
    assert ("--scheduling-policy" in argv) == (order == "oldest")
    if order == "oldest":
        assert argv[argv.index("--scheduling-policy") + 1] == "priority"
