"""Request and environment slots handed out oldest group first.

The orchestrator bounds generation requests (`orchestrator.max_concurrency`) and environment calls
(`orchestrator.env_concurrency`) with counting semaphores. With an asyncio.Semaphore a slot goes to
whoever asked first, so a long episode's next turn queues behind the first turns of groups started a
moment ago. Under the continuous pool that is the wrong order: the staleness bound runs from a group's
start version, so every second an old group waits brings its tokens closer to being masked (or, under
`stale_policy=drop`, the whole group closer to being cancelled), while a young group has the whole bound
ahead of it. `SlotSemaphore` hands a freed slot to the waiter whose group started at the oldest policy
version (then the lowest group id, then first come), which is the group that goes stale first
(`orchestrator.slot_order=oldest`, the default; `fifo` is the plain semaphore's order).

Nothing is reordered while slots are free, and no waiter starves: the youngest groups wait at most
until the older ones ahead of them have taken their turn, and every group ages. The key comes from
the group the pool set in the task's context (rl.orchestrator.accounting.GROUP); outside the pool
(schedule=batch, online evaluation) every waiter has the same key, so the order is first come, as
before.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
from typing import Any, Callable

from rl.orchestrator.accounting import GROUP

SLOT_ORDERS = ("oldest", "fifo")


def group_key() -> tuple[int, int]:
    """(start version, group id) of the pool group this task plays; (0, 0) outside the pool."""
    g = GROUP.get()
    return (int(g.start_version), int(g.gid)) if g is not None else (0, 0)


class SlotSemaphore:
    """A counting semaphore whose waiters are served by `key()` ascending, ties first come first served.

    Used as `async with sem:`. A waiter cancelled after it was handed a slot passes the slot on, so a
    cancelled group (the pool cancels stale ones) never leaks one."""

    def __init__(self, value: int, key: Callable[[], Any] | None = None):
        if value < 1:
            raise ValueError(f"SlotSemaphore: {value} slots; at least 1")
        self._free = int(value)
        self._key = key or (lambda: 0)
        self._waiters: list[tuple[Any, int, asyncio.Future]] = []
        self._seq = itertools.count()

    def locked(self) -> bool:
        return self._free == 0

    async def acquire(self) -> None:
        if self._free > 0:   # release hands a slot to a live waiter before freeing one: none waits now
            self._free -= 1
            return
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (self._key(), next(self._seq), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()   # it was handed a slot as it was cancelled: hand the slot on
            raise

    def release(self) -> None:
        while self._waiters:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():
                fut.set_result(None)   # the slot passes straight to this waiter
                return
        self._free += 1

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc) -> None:
        self.release()


def make(value: int, order: str) -> SlotSemaphore | asyncio.Semaphore:
    """The semaphore for `orchestrator.slot_order`: oldest group first, or first come first served."""
    if order == "oldest":
        return SlotSemaphore(value, key=group_key)
    if order == "fifo":
        return asyncio.Semaphore(value)
    raise ValueError(f"orchestrator.slot_order={order!r}: must be one of {', '.join(SLOT_ORDERS)}")
