"""The sampler: what every scheduler of rollouts needs to play one group, and nothing else.

A group is `orchestrator.group_size` rollouts of one task: single-turn (one completion, then the
environment's grade) or multi-turn (rl/orchestrator/multiturn.py: model turns and tool observations).
Playing one needs the servers' clients (or the router's), the generation gate the weight watcher closes
while the servers reload, the shared request and environment semaphores
(`orchestrator.max_concurrency`, `orchestrator.env_concurrency`), the version tracker that labels every
token with the policy version that produced it, the tokenizer and the environment. The batch schedule
(rl.orchestrator.loop) and the continuous pool (rl.orchestrator.pool) both hold a `Sampler` and call
`sample_group_or_none`; they never reach into the orchestrator, and the orchestrator keeps what is
its own: loading weights, forming and publishing batches.

A group whose environment fails (a sandbox error, a crashed tool, a non-finite reward) comes back as
None, to be dropped and counted; an inference error propagates, since without servers nothing can go on.
"""
from __future__ import annotations

import asyncio
import copy
import itertools
import time
from types import SimpleNamespace
from typing import Any

from rl.contract.batch import Sample, routed_per_token
from rl.envs.base import is_multi_turn, prompt_ids
from rl.orchestrator import accounting, multiturn, slots
from rl.orchestrator.accounting import IdleClock
from rl.orchestrator.client import SESSION as ROUTER_SESSION
from rl.orchestrator.client import InferenceClient, InferenceError
from rl.orchestrator.versions import VersionTracker
from rl.runtime import log

ROLE = "orchestrator"


class UntrainableGroup(ValueError):
    """A sampled group whose numbers the trainer cannot use (a non-finite reward or logprob)."""


def check_trainable(samples: list[Sample]) -> None:
    """Raise UntrainableGroup unless every reward and every trained token's logprob is finite as the
    float32 the batch stores. One NaN reward (an environment's scoring code) would make the whole group's
    advantages NaN, and the trainer sets a batch with non-finite numbers aside whole: the group is dropped
    and counted as failed instead, like an environment that raised."""
    why = accounting.check_finite(samples)
    if why is not None:
        raise UntrainableGroup(why)


class Sampler:
    """Plays groups on the servers. `clients`, `router_client`, `tokenizer` and `tracker` are set once
    the servers are up (the orchestrator's start-up; tests set them directly)."""

    def __init__(self, cfg: Any, env: Any):
        self.cfg, self.o, self.env = cfg, cfg.orchestrator, env
        self.multi_turn = is_multi_turn(env)   # episodes driven turn by turn (multiturn.py)
        self.clients: list[InferenceClient] = []
        self.router_client: InferenceClient | None = None   # generation through rl.inference.router
        self.tokenizer: Any = None
        self.tracker: VersionTracker | None = None
        self.gate = asyncio.Event()   # cleared while the servers reload weights
        self.gate.set()
        self.idle = IdleClock()
        # oldest group first (rl/orchestrator/slots.py): the group nearest its staleness bound
        order = str(getattr(self.o, "slot_order", "oldest"))
        self.prioritize = order == "oldest"   # and the servers schedule by the same key (launch.plan)
        self.request_sem = slots.make(int(self.o.max_concurrency), order)
        self.env_sem = slots.make(int(self.o.env_concurrency), order)
        self._bridge: multiturn.ChatBridge | None = None
        self._ids = itertools.count(1)   # request ids, unique across views (one tracker)
        self.rid_prefix = "hetrl"        # a rollout worker's own (rl/orchestrator/worker.py): unique per server

    def view(self, max_concurrency: int, **sampling) -> "Sampler":
        """The same servers, tracker, gate and environment with other sampling settings (`sampling`
        overrides orchestrator keys: group_size, temperature, top_p, max_tokens) and a request budget of
        its own: online evaluation plays its tasks through one without touching the rollouts' settings."""
        v = copy.copy(self)
        o = {k: getattr(self.o, k) for k in ("group_size", "temperature", "top_p", "max_tokens")}
        v.o = SimpleNamespace(**{**o, **{k: x for k, x in sampling.items() if x is not None}})
        v.request_sem = asyncio.Semaphore(int(max_concurrency))
        return v

    @property
    def bridge(self) -> multiturn.ChatBridge:
        if self._bridge is None:
            self._bridge = multiturn.ChatBridge(self.tokenizer)
        return self._bridge

    def client_for(self, group: int) -> InferenceClient:
        """Every rollout of a group on one server, so its prefix cache holds the shared prompt."""
        return self.clients[group % len(self.clients)]

    async def sample_one(self, client: InferenceClient, ids: list[int], seed: int,
                         max_tokens: int | None = None, routed_start: int = 0):
        """One completion of `ids` and the policy version of each of its tokens. `routed_start`: the
        routed-expert rows the caller already holds (a multi-turn episode); the engine returns only the
        rows from that position on (vLLM's `routed_experts_prompt_start`)."""
        await self.gate.wait()
        if self.router_client is not None:  # generation goes through the router (inference.router)
            client = self.router_client
        rid = f"{self.rid_prefix}-{next(self._ids)}"
        self.tracker.start(rid)
        self.idle.enter()
        try:
            # the servers queue by the group's start version as well: the oldest group goes stale first
            g = accounting.GROUP.get() if self.prioritize else None
            prio = {"priority": int(g.start_version)} if g is not None else {}
            c = await client.generate(ids, max_tokens=max_tokens or self.o.max_tokens,
                                      temperature=self.o.temperature, top_p=self.o.top_p, seed=seed,
                                      request_id=rid, **prio,
                                      **({"extra": {"routed_experts_prompt_start": int(routed_start)}}
                                         if routed_start else {}))
        except BaseException:
            self.tracker.forget(rid)
            raise
        finally:
            self.idle.leave()
        tracked = self.tracker.finish(rid, len(c.ids))
        accounting.count_generated(len(c.ids))  # waste accounting of the pool's rollout (if any)
        # The engine's own per-token version spans are exact; the tracker is the fallback.
        versions = list(c.versions) if c.versions is not None else tracked
        return c, versions

    async def sample_group(self, task: Any, group: int, step: int, attempt: int,
                           rollouts: list[int] | None = None) -> list[Sample]:
        """The group's rollouts `rollouts` (default: all group_size of them), in that order. Rollout i's
        seed depends on i, not on which others are played: a group resumed after a restart plays only
        the rollouts an earlier incarnation did not train (stale_policy=release)."""
        if self.router_client is not None:  # one router session per group: its rollouts share a prompt
            ROUTER_SESSION.set(f"{step}-{attempt}-{group}")
        if self.multi_turn:  # tool-using episodes: model turns and observations, rl/orchestrator/multiturn.py
            return await multiturn.sample_group(self, task, group, step, attempt, rollouts)
        ids = prompt_ids(self.env, self.tokenizer, task)
        client = self.client_for(group)
        ascore = getattr(self.env, "ascore", None)  # grading that takes time (a test run) is awaited

        async def one(i):
            # one rollout: generation (within max_concurrency), then grading (within env_concurrency, a
            # cost like a tool run, not a free sleep); its slot in the pool frees when it is graded
            accounting.rollout_begin(i)
            t0 = time.monotonic()   # the seconds of both, slot waits included (launch.calibrate reads them)
            async with self.request_sem:
                seed = hash((self.cfg.seed, step, attempt, group, i)) & 0x7FFFFFFF
                c, versions = await self.sample_one(client, ids, seed)
            text = self.tokenizer.decode(c.ids, skip_special_tokens=False)
            t1 = time.monotonic()
            if ascore is not None:
                async with self.env_sem:
                    reward = await ascore(task, text)
            else:
                reward = self.env.score(task, text)
            s = Sample(prompt_ids=ids, completion_ids=list(c.ids), completion_logprobs=list(c.logprobs),
                       completion_versions=versions, reward=float(reward), group=group,
                       routed_experts=routed_per_token(c.routed_experts, len(ids) + len(c.ids)),
                       info={"finish_reason": c.finish_reason, "gen_s": t1 - t0, "env_s": time.monotonic() - t1})
            accounting.rollout_end(i, s)
            return s

        return list(await asyncio.gather(*(one(i) for i in (rollouts or range(self.o.group_size)))))

    async def sample_group_or_none(self, task: Any, group: int, step: int, attempt: int, **kw):
        """A group, or None when the environment failed (see the module docstring). `kw`: rollouts."""
        try:
            samples = await self.sample_group(task, group, step, attempt, **kw)
            check_trainable(samples)
            return samples
        except (InferenceError, asyncio.CancelledError):
            raise
        except Exception as e:  # noqa: BLE001 - environment code is user code; report, drop, go on
            log(ROLE, f"step {step} group {group}: environment failed, group dropped: {type(e).__name__}: {e}")
            return None
