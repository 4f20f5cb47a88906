"""Multi-turn rollouts: the orchestrator drives an episode turn by turn, token ids kept exact.

One rollout is one token sequence that grows by two kinds of segments:

    [prompt] [model turn 1] [observation 1] [model turn 2] [observation 2] ... [model turn k]

- the prompt is the chat template of `episode.initial_messages()` with the assistant turn opened;
- a model turn is exactly the token ids the server returned for a token-in/token-out request whose
  prompt was the whole sequence so far (`InferenceClient.generate`, `/inference/v1/generate`): they are
  appended as they came, never decoded and re-encoded, so the trained ids are the generated ids and the
  context the trainer scores them in is, token for token, the context the server sampled them in;
- an observation is the environment's reply (tool results), rendered with the tokenizer's own chat
  template and appended as ids: the text that closes the assistant turn (`<|im_end|>` unless the model
  already generated it, then `\\n`), the new messages, and the next generation prompt. `ChatBridge`
  takes that text from the template itself (the difference of two renderings), so it is the template's
  markup, not a hand-written copy of ChatML.

Model tokens carry their sampling logprob and the policy version that produced them (from the server's
version spans); observation tokens get loss mask 0, logprob 0 and version -1. The reward comes from the
episode at the end.

The token store (`Rollout`: compact arrays, routed-expert rows spilled to a file, segments) and the
per-turn record (`Turn`) are rl.orchestrator.rollout; this module is the driver that fills them.

Limits, per turn and per context: a turn gets at most `orchestrator.max_tokens` new tokens and never more
than what is left of the context's token budget (`orchestrator.max_rollout_tokens`, default and at most
`inference.max_model_len`, prompt and observations included); a rollout ends after `env.max_turns` model
turns (summary turns not counted), when an observation would not fit in the budget, when
`orchestrator.rollout_timeout_s` is spent (an unfinished turn is abandoned, not half-kept), or when the
environment says done (e.g. submit).

Context summarization (`env.summarize_at_tokens`, thresholds in tokens, used in order, and
`env.summary_prompt`). A 300-turn agent episode does not fit in one 131k context, so when the context
with the next observation would reach the next threshold, the observation is appended together with a
user message asking for a summary (`env.summary_prompt`), and the policy's reply is the summary turn: a
policy turn like any other (loss mask 1, its versions and logprobs kept), but not an environment step
(its text is not given to the environment, and it does not count against `env.max_turns`). The episode
then goes on in a fresh context: the episode's initial messages (system, task) and one user message
holding the summary, rendered by the chat template as a new prompt. Each context is a *segment*: it
becomes its own training sample, scored by the trainer in exactly the context the server sampled it in.
Each threshold is used once (so `[35000, 80000]` gives an episode at most three segments; past the last
one the episode ends at the context budget as without summarization), and the budget applies to each
context, not to the episode's sum.

A segmented episode stays one rollout in one token store until its batch is formed (rl.orchestrator.rollout
says how it is held, rl.orchestrator.segments why it is cut only then). The pool counts the segments an
episode closed (`accounting.segment_closed`), so a cancelled episode's finished contexts are counted as
lost with the cancel's reason, not dropped silently (rl.orchestrator.pool).
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import numpy as np

from rl.envs.base import call, chat_prompt_ids, default_turn_info, observation_messages
from rl.contract.batch import Sample
from rl.orchestrator import accounting
from rl.orchestrator.rollout import EpisodeStats, Rollout, Turn
from rl.runtime import log

_SENTINEL = "\u2063HETRL\u2063ASSISTANT\u2063"


@dataclass(frozen=True)
class RolloutLimits:
    max_turns: int
    max_tokens_per_turn: int
    max_total_tokens: int
    wall_s: float | None = None
    spill_dir: str = ""   # orchestrator.spill_dir: where routed-expert rows go ("" = node-local temp)
    summarize_at: tuple[int, ...] = ()   # env.summarize_at_tokens: context sizes that trigger a summary
    summary_prompt: str = ""

    @classmethod
    def from_config(cls, cfg: Any) -> "RolloutLimits":
        o = cfg.orchestrator
        total = o.max_rollout_tokens or cfg.inference.max_model_len
        wall = o.rollout_timeout_s
        return cls(max_turns=int(cfg.env.max_turns), max_tokens_per_turn=int(o.max_tokens),
                   max_total_tokens=int(min(total, cfg.inference.max_model_len)),
                   wall_s=float(wall) if wall else None, spill_dir=str(o.spill_dir or ""),
                   summarize_at=tuple(int(t) for t in cfg.env.summarize_at_tokens or ()),
                   summary_prompt=str(cfg.env.summary_prompt or ""))


class ChatBridge:
    """Chat messages -> token ids under the tokenizer's chat template, for a growing sequence."""

    _BASE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL}]

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.eos_text = tokenizer.eos_token or ""
        self._head = self._render(self._BASE, add_generation_prompt=False)
        i = self._head.rfind(_SENTINEL)
        if i < 0:
            raise ValueError("the chat template drops assistant content; cannot bridge turns")
        # What the template writes after an assistant message's content (ChatML: "<|im_end|>\n").
        self.closer = self._head[i + len(_SENTINEL):]
        self._cache: dict[tuple, list[int]] = {}

    def _render(self, messages, add_generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False,
                                            add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return chat_prompt_ids(self.tok, messages)

    def observation_text(self, messages: list[dict], ended_with_eos: bool) -> str:
        full = self._render(self._BASE + list(messages), add_generation_prompt=True)
        if not full.startswith(self._head):
            raise ValueError("the chat template re-renders earlier turns when messages are added; "
                             "multi-turn rollouts need a prefix-stable template")
        closer = self.closer
        if ended_with_eos and self.eos_text and closer.startswith(self.eos_text):
            closer = closer[len(self.eos_text):]  # the model generated the end-of-turn token itself
        return closer + full[len(self._head):]

    def observation_ids(self, messages: list[dict], ended_with_eos: bool) -> list[int]:
        return self.encode(self.observation_text(messages, ended_with_eos))

    def decode(self, ids: list[int]) -> str:
        """A model turn as the environment sees it: special tokens kept (tool-call tags are special
        tokens), a trailing end-of-turn token dropped."""
        if ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        return self.tok.decode(ids, skip_special_tokens=False)




# generate(prompt_ids, max_tokens, turn[, routed_start=k]) -> (Completion, per-token versions); routed_start
# (vLLM's routed_experts_prompt_start) is passed once the episode holds k > 0 rows of routed experts
Generate = Callable[[list, int, int], Awaitable[tuple[Any, list[int]]]]


SUMMARY_HEADER = "Summary of your progress so far (your earlier context was summarized):\n\n"


async def run_episode(env: Any, task: Any, generate: Generate, bridge: ChatBridge, limits: RolloutLimits,
                      env_sem: asyncio.Semaphore | None = None) -> Rollout:
    """Drive one episode of `task` to its end; returns the rollout (tokens, mask, logprobs, versions,
    reward, per-turn stats, its segments). The episode is closed whatever happens."""
    sem = env_sem or asyncio.Semaphore(1 << 30)
    t0 = time.monotonic()
    async with sem:
        episode = await call(env.start, task)
    r = None
    try:
        messages = await call(episode.initial_messages)
        r = Rollout(prompt_ids=bridge.prompt_ids(messages), spill_dir=limits.spill_dir)
        n = len(r.prompt_ids)   # tokens of the current context (segment)
        if n >= limits.max_total_tokens:
            raise ValueError(f"the episode's first prompt has {n} tokens, the rollout budget is "
                             f"{limits.max_total_tokens} (orchestrator.max_rollout_tokens / "
                             "inference.max_model_len)")

        async def model_turn(room: int):
            """One request on the current context; (new ids, finish reason, seconds) or None on timeout
            (the unfinished turn is abandoned: nothing of it is kept)."""
            timeout = None
            if limits.wall_s is not None:
                timeout = limits.wall_s - (time.monotonic() - t0)
                if timeout <= 0:
                    return None
            tg = time.monotonic()
            # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancellation that arrives as the
            # turn completes, and a group the pool cancelled (counted dropped) would play on and be trained
            try:
                held = r.routed_rows
                async with asyncio.timeout(timeout):
                    c, versions = await generate(r.context(), min(limits.max_tokens_per_turn, room),
                                                 len(r.turns), **({"routed_start": held} if held else {}))
            except TimeoutError:
                return None
            new = list(c.ids)
            r.add_routes(getattr(c, "routed_experts", None), held, n, len(new), len(r.turns))
            r.add_model(new, c.logprobs, versions)
            return new, c.finish_reason, time.monotonic() - tg

        end, env_turns, next_summary = None, 0, 0
        while end is None:
            if env_turns >= limits.max_turns:
                end = "max_turns"
                break
            room = limits.max_total_tokens - n
            if room < 1:
                end = "max_total_tokens"
                break
            got = await model_turn(room)
            if got is None:
                end = "wall_time"
                break
            new, finish_reason, gen_s = got
            n += len(new)
            text = bridge.decode(new)
            te = time.monotonic()
            async with sem:
                obs, done = await call(episode.step, text)
            env_s = time.monotonic() - te
            obs_msgs = observation_messages(episode, obs)
            info_fn = getattr(episode, "turn_info", None)
            info = info_fn() if callable(info_fn) else default_turn_info(text, obs_msgs)
            turn = Turn(gen_tokens=len(new), obs_tokens=0, gen_s=gen_s, env_s=env_s,
                        tool_calls=int(info.get("tool_calls", 0)),
                        tool_errors=int(info.get("tool_errors", 0)),
                        finish_reason=finish_reason)
            r.turns.append(turn)
            env_turns += 1
            if done:
                end = getattr(episode, "end_reason", None) or "env_done"
                break
            if env_turns >= limits.max_turns:
                end = "max_turns"  # no next turn: the observation would never be read
                break
            eos = bool(new) and new[-1] == bridge.eos_id
            obs_ids = bridge.observation_ids(obs_msgs, ended_with_eos=eos)
            if next_summary < len(limits.summarize_at) and n + len(obs_ids) >= limits.summarize_at[next_summary]:
                # the context passes the next threshold: the observation and the summary request go in
                # together, the policy summarizes (a trained turn), and the episode goes on afresh
                next_summary += 1
                ask = obs_msgs + [{"role": "user", "content": limits.summary_prompt}]
                ask_ids = bridge.observation_ids(ask, ended_with_eos=eos)
                if n + len(ask_ids) < limits.max_total_tokens:
                    r.add_env(ask_ids)
                    turn.obs_tokens = len(ask_ids)
                    n += len(ask_ids)
                    got = await model_turn(limits.max_total_tokens - n)
                    if got is None:
                        end = "wall_time"
                        break
                    new, finish_reason, gen_s = got
                    r.turns.append(Turn(gen_tokens=len(new), obs_tokens=0, gen_s=gen_s, env_s=0.0,
                                        tool_calls=0, tool_errors=0, finish_reason=finish_reason,
                                        summary=True))
                    fresh = bridge.prompt_ids(list(messages) + [
                        {"role": "user", "content": SUMMARY_HEADER + bridge.decode(new)}])
                    if len(fresh) >= limits.max_total_tokens:
                        end = "max_total_tokens"  # the summary alone fills a context
                        break
                    r.new_segment(fresh)
                    accounting.segment_closed(*r.closed())
                    r.turns[-1].obs_tokens = len(fresh)
                    n = len(fresh)
                    continue
            if n + len(obs_ids) >= limits.max_total_tokens:
                end = "max_total_tokens"  # no room for the observation and a reply to it
                break
            r.add_env(obs_ids)
            turn.obs_tokens = len(obs_ids)
            n += len(obs_ids)
        r.end_reason = end
        te = time.monotonic()
        async with sem:
            r.reward = float(await call(episode.reward))
        if r.turns:
            r.turns[-1].env_s += time.monotonic() - te
        metrics_fn = getattr(episode, "metrics", None)
        if callable(metrics_fn):
            m = await call(metrics_fn)
            r.env_metrics = {k: float(v) for k, v in (m or {}).items()
                             if isinstance(v, (int, float)) and not isinstance(v, bool)}
            if isinstance(why := (m or {}).get("grading_error"), str) and why:   # a grade not to be trusted
                name = (getattr(task, "instance_id", None) or (task.get("id") if isinstance(task, dict) else None)
                        or "?")
                log("orchestrator", f"task {name}: grading error (reward {r.reward:g} kept): {why}")
        r.seconds = time.monotonic() - t0
        return r
    except BaseException:
        if r is not None:
            r.discard_routes()  # a failed or cancelled episode leaves no spill file behind
        raise
    finally:
        close = getattr(episode, "close", None)
        if callable(close):
            await call(close)


async def sample_group(sampler: Any, task: Any, group: int, step: int, attempt: int,
                       rollouts: list[int] | None = None) -> list[Sample]:
    """`orchestrator.group_size` episodes of one task (or the episodes `rollouts`), played by `sampler`
    (rl.orchestrator.sampling): its clients, request and environment semaphores and `sample_one`. All
    turns of an episode go to the same server, so its prefix cache holds the conversation."""
    client = sampler.client_for(group)
    limits = RolloutLimits.from_config(sampler.cfg)

    async def one(i: int) -> Rollout:
        accounting.rollout_begin(i)  # the pool accounts rollouts one by one: this one's slot frees at its end

        async def generate(ids, max_tokens, turn, routed_start=0):
            async with sampler.request_sem:
                seed = hash((sampler.cfg.seed, step, attempt, group, i, turn)) & 0x7FFFFFFF
                return await sampler.sample_one(client, ids, seed, max_tokens=max_tokens,
                                                routed_start=routed_start)
        r = await run_episode(sampler.env, task, generate, sampler.bridge, limits, sampler.env_sem)
        s = r.sample(group, rollout=i)
        accounting.rollout_end(i, s)
        return s

    return list(await asyncio.gather(*(one(i) for i in (rollouts or range(sampler.o.group_size)))))


def batch_metrics(samples: list[Sample]) -> dict:
    """Per-turn numbers of a batch's rollouts, flat and numeric (they reach metrics.jsonl as
    `orchestrator/<key>` through the batch meta)."""
    # a Rollout (played here) or its EpisodeStats (played by a rollout worker, rl/orchestrator/wire.py)
    rs: list[EpisodeStats] = [r.stats() if isinstance(r, Rollout) else r for s in samples
                              if isinstance(r := s.info.get("multiturn"), (Rollout, EpisodeStats))]
    for s in samples:
        s.info.pop("multiturn", None)  # the batch meta is JSON; keep the rollout object out of it
    if not rs:
        return {}
    turns = [t for r in rs for t in r.turns]
    gen_tokens = sum(t.gen_tokens for t in turns)
    obs_tokens = sum(t.obs_tokens for t in turns)
    gen_s = sum(t.gen_s for t in turns)
    env_s = sum(t.env_s for t in turns)
    calls = sum(t.tool_calls for t in turns)
    errors = sum(t.tool_errors for t in turns)
    n_turns = [sum(not t.summary for t in r.turns) for r in rs]
    lengths = [r.tokens for r in rs]
    out = {
        "episodes": len(rs),
        "turns_per_episode": float(np.mean(n_turns)), "turns_per_episode_max": int(max(n_turns)),
        "turns_total": len(turns),
        "summaries": sum(t.summary for t in turns),
        "segments_per_episode": float(np.mean([r.segments for r in rs])),
        "tokens_per_turn": gen_tokens / max(len(turns), 1),
        "obs_tokens_per_turn": obs_tokens / max(len(turns), 1),
        "obs_tokens": obs_tokens,
        "prompt_tokens_mean": float(np.mean([r.prompt_tokens for r in rs])),
        "episode_tokens_mean": float(np.mean(lengths)), "episode_tokens_max": int(max(lengths)),
        "tool_calls": calls, "tool_errors": errors,
        "tool_calls_per_turn": calls / max(len(turns), 1),
        "tool_error_rate": errors / max(calls + errors, 1) if calls + errors else 0.0,
        "turn_gen_s": gen_s, "turn_env_s": env_s,
        "env_time_fraction": env_s / max(gen_s + env_s, 1e-9),
        "episode_s_mean": float(np.mean([r.seconds for r in rs])),
        "turn_truncated_fraction": float(np.mean([t.finish_reason == "length" for t in turns]))
        if turns else 0.0,
    }
    for reason, k in Counter(r.end_reason for r in rs).items():
        out[f"end/{reason}"] = k
    keys = sorted({k for r in rs for k in r.env_metrics})
    for k in keys:   # an environment's own namespace ("swe/grading_errors") is kept, others go under env/
        vals = [r.env_metrics[k] for r in rs if k in r.env_metrics]
        out[k if "/" in k else f"env/{k}"] = float(np.mean(vals))
    return out
