"""A rollout worker: `python -m rl.orchestrator.worker --fd N --index I`, a child of the orchestrator.

It runs the episode loop of the groups the centre hands it (rl/orchestrator/workers.py says why the work
is split so): a `Sampler` of its own (its HTTP clients to the servers or the router, the multi-turn driver,
environment calls and grading, route capture and spill) plays each group exactly as the orchestrator
would play it in-process, and reports back over its inherited socket (rl/orchestrator/wire.py):

- `("ready", pid)` once its sampler is set up from the centre's `hello` (config, tokenizer directory,
  servers, router, secret, policy version);
- `("end", key, i, tokens, segments, segment_tokens, sample)` when rollout i of a group has its reward:
  the sample, routes as a part file in the run directory (rl/orchestrator/parts.py); the centre frees its slot and may train it (release);
- `("acct", key, {i: (tokens, segments, segment_tokens)})` as soon as a group is started (its
  acknowledgement: a replay the worker never acknowledged is not counted lost with it), then twice a
  second for groups whose counts moved (the pool's waste accounting and progress of long episodes);
- `("done", key, None | (kind, message))` when the group is over: None, or why it failed (`inference`:
  the role fails as it would in-process; `environment`: the group is dropped and counted).

The centre sends `play`, `cancel` (a stale or drained group: its task is cancelled, its episodes close
their sandboxes and spill files), `gate` (closed while the servers reload weights), `reload` (the new
version and the servers' in-flight token counts, for the version tracker) and `stop`. At the end of the
stream (the centre is gone) the worker cancels its episodes and exits. SIGTERM and SIGINT are ignored:
a launcher signals the whole process group and the centre decides, drains and then stops its workers.
"""
from __future__ import annotations

import argparse
import asyncio
import contextvars
import os
import signal
import socket
import sys
import time
from typing import Any

from rl.orchestrator import accounting, wire
from rl.orchestrator.accounting import RolloutAcct
from rl.runtime import log

TICK_S = 0.5


class WorkerGroup:
    """The pool's view of a group inside the worker (what rl.orchestrator.accounting reports to): the
    rollouts' counts, and each finished rollout's sample sent to the centre as soon as it has its reward."""

    def __init__(self, key: int, start_version: int, indices: list[int], send, gid: int = 0):
        self.key, self.start_version, self.started = key, start_version, time.monotonic()
        self.gid = int(gid)   # the pool's group id: with start_version, the slots' order (rl.orchestrator.slots)
        self.rollouts = {i: RolloutAcct() for i in indices}
        self.done: dict = {}
        self.sent: set[int] = set()
        self.last: dict = {}
        self._send = send
        self.parts_dir, self.worker = "", 0

    def on_rollout_done(self) -> None:
        for i, s in list(self.done.items()):
            if i not in self.sent:
                self.sent.add(i)
                self.send_end(i, s)

    def send_end(self, i: int, s: Any) -> None:
        r = self.rollouts.get(i) or RolloutAcct()
        self._send(("end", self.key, i, r.tokens, r.segments, r.segment_tokens, wire.to_wire(s, self.parts_dir, self.worker)))

    def counts(self) -> dict:
        return {i: (r.tokens, r.segments, r.segment_tokens) for i, r in self.rollouts.items()}


class Worker:
    def __init__(self, index: int, sock: socket.socket):
        self.index, self.sock = index, sock
        self.groups: dict[int, WorkerGroup] = {}
        self.tasks: dict[int, asyncio.Task] = {}
        self.sampler: Any = None
        self.writer: asyncio.StreamWriter | None = None

    def send(self, msg: Any) -> None:
        if self.writer is not None and not self.writer.is_closing():
            self.writer.write(wire.encode(msg))

    def setup(self, hello: dict) -> None:
        from transformers import AutoTokenizer
        from rl.envs import make_env
        from rl.orchestrator.client import InferenceClient, router_client_class
        from rl.orchestrator.sampling import Sampler
        from rl.orchestrator.versions import VersionTracker
        cfg = hello["cfg"]
        sp = Sampler(cfg, make_env(cfg))
        sp.rid_prefix = f"hetrl-w{self.index}-{os.getpid()}"   # request ids unique on a shared server
        timeout = float(hello["timeout"])
        sp.clients = [InferenceClient(url, secret=sec, timeout=timeout) for url, sec in hello["servers"]]
        if hello.get("router") and hello.get("local_routing"):   # its own routing: rl.orchestrator.local_routing
            from rl.orchestrator.local_routing import LocalRouter
            sp.router_client = LocalRouter(hello["servers"], cfg.inference.routing, timeout)
        elif hello.get("router"):
            url, sec = hello["router"]
            sp.router_client = router_client_class()(url, secret=sec, timeout=timeout)
        sp.tokenizer = AutoTokenizer.from_pretrained(hello["tokenizer"])
        sp.tracker = VersionTracker(int(hello["version"]))
        self.parts_dir = str(hello["parts"])
        self.sampler = sp

    async def play(self, key: int, task, group: int, step: int, attempt: int, rollouts, start_version: int):
        from rl.orchestrator.client import InferenceError
        from rl.orchestrator.sampling import check_trainable
        sp = self.sampler
        g = self.groups[key]
        try:
            samples = await sp.sample_group(task, group, step, attempt, rollouts=rollouts)
            check_trainable(samples)
            for i, s in zip(rollouts or range(int(sp.o.group_size)), samples):
                if i not in g.sent:   # a sampler that did not report the rollout at its end
                    g.sent.add(i)
                    g.send_end(i, s)
            self.send(("acct", key, g.counts()))
            self.send(("done", key, None))
        except asyncio.CancelledError:
            self.send(("done", key, ("cancelled", "")))
            raise
        except InferenceError as e:
            self.send(("done", key, ("inference", f"{type(e).__name__}: {e}")))
        except Exception as e:  # noqa: BLE001 - environment code is user code: reported, the centre drops the group
            self.send(("done", key, ("environment", f"{type(e).__name__}: {e}")))
        finally:
            self.groups.pop(key, None)
            self.tasks.pop(key, None)

    def start_group(self, key, task, group, step, attempt, rollouts, start_version) -> None:
        idx = list(rollouts or range(int(self.sampler.o.group_size)))
        g = WorkerGroup(key, start_version, idx, self.send, gid=group)
        g.parts_dir, g.worker = self.parts_dir, self.index
        self.groups[key] = g
        ctx = contextvars.copy_context()
        ctx.run(accounting.GROUP.set, g)
        self.tasks[key] = asyncio.create_task(self.play(key, task, group, step, attempt, rollouts, start_version),
                                              context=ctx)
        g.last = g.counts()
        self.send(("acct", key, g.last))   # the acknowledgement: the centre counts it lost if this worker dies

    async def ticker(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            for key, g in list(self.groups.items()):
                c = g.counts()
                if c != g.last:
                    g.last = c
                    self.send(("acct", key, c))
            if self.writer is not None:
                await self.writer.drain()

    async def run(self) -> int:
        reader, self.writer = await asyncio.open_connection(sock=self.sock)
        self.setup(await wire.read(reader))
        log(f"rollout-worker-{self.index}", f"ready (pid {os.getpid()}, start-up {sum(os.times()[:2]):.2f} CPU s)")
        self.send(("ready", os.getpid()))
        tick = asyncio.create_task(self.ticker())
        try:
            while True:
                try:
                    msg = await wire.read(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return 0   # the centre is gone: its episodes are cancelled below
                kind = msg[0]
                if kind == "play":
                    self.start_group(*msg[1:])
                elif kind == "cancel":
                    t = self.tasks.get(msg[1])
                    if t is not None:
                        t.cancel()
                elif kind == "gate":
                    (self.sampler.gate.set if msg[1] else self.sampler.gate.clear)()
                elif kind == "reload":
                    self.sampler.tracker.on_reload(int(msg[1]), msg[2])
                    if hasattr(self.sampler.router_client, "reset_index"):   # local routing: caches dropped
                        self.sampler.router_client.reset_index()
                elif kind == "stop":
                    return 0
                else:
                    raise ValueError(f"rollout worker {self.index}: unknown message {kind!r} from the centre")
        finally:
            tick.cancel()
            for t in list(self.tasks.values()):
                t.cancel()
            await asyncio.gather(tick, *self.tasks.values(), return_exceptions=True)
            sp = self.sampler
            for c in (sp.clients + ([sp.router_client] if sp.router_client else [])) if sp else []:
                await c.aclose()
            try:
                await self.writer.drain()
            except ConnectionError:
                pass
            self.writer.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="A rollout worker (started by the orchestrator).")
    p.add_argument("--fd", type=int, required=True, help="the inherited socket to the orchestrator")
    p.add_argument("--index", type=int, required=True)
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # the centre drains, then stops its workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=a.fd)
    try:
        return asyncio.run(Worker(a.index, sock).run())
    except Exception as e:
        log(f"rollout-worker-{a.index}", f"failed: {type(e).__name__}: {e}")
        raise


if __name__ == "__main__":
    sys.exit(main())
