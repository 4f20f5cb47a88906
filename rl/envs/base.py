"""The environment API, single-turn and multi-turn, and the helpers the orchestrator drives them with.

Single-turn (`digits`): `sample_tasks(n, rng)`, `prompt(task) -> messages`, `score(task, text) -> float`
(or `ascore`, awaited, for grading that takes time); the orchestrator samples one completion per
rollout. The prompt's token ids are `prompt_ids(env, tokenizer, task)`: the chat template of
`env.prompt(task)` with the assistant turn opened, unless the environment encodes its prompts itself
(`env.prompt_ids(tokenizer, task)`, e.g. a raw completion prompt without a chat template).

Multi-turn (`swe`, `verifiers:*`): `sample_tasks(n, rng)` and `start(task) -> episode`. An episode is a
conversation the orchestrator drives turn by turn (rl/orchestrator/multiturn.py):

    episode.initial_messages() -> list[dict]        chat messages that open the conversation
    episode.step(assistant_text) -> (obs, done)     run what the model turn asked for (tool calls);
                                                    obs: None, a text (wrapped by
                                                    `episode.tool_message(text)` when it has one, else
                                                    sent as a user message), one message dict or a list
    episode.reward() -> float                       graded once, after the last turn
    episode.metrics() -> dict                       optional: numbers to average into the batch meta
    episode.turn_info() -> dict                     optional: {"tool_calls": n, "tool_errors": m} of the
                                                    last step; without it they are read off the text
    episode.close()                                 release the sandbox / tools

Every method may be a plain function (run in a worker thread, so a slow tool does not stall the other
rollouts' generation) or a coroutine function (awaited). The worker threads are the environment's own
executor (`env_executor()`), not the event loop's default one: asyncio's default is min(32, cpus + 4)
threads, so at most 32 blocking environment calls ran at once whatever `orchestrator.env_concurrency`
said (issue 50). `set_env_threads(n)` sizes it (`make_env` does, from `orchestrator.env_concurrency`),
capped at `ENV_THREADS_MAX` per process. The orchestrator owns the rollout limits
(turns, tokens, wall time) and stops calling `step` when one is hit; an environment may end earlier by
returning done=True. Environments never see token ids: the orchestrator tokenizes observations and keeps
the model's own tokens as generated (see multiturn.py).
"""
from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import json
import os
import re
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Chat-template token ids of `messages` with the assistant turn opened."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def prompt_ids(env: Any, tokenizer, task: Any) -> list[int]:
    """A single-turn environment's prompt as token ids (its own encoding if it has one)."""
    own = getattr(env, "prompt_ids", None)
    if callable(own):
        return [int(t) for t in own(tokenizer, task)]
    return chat_prompt_ids(tokenizer, env.prompt(task))


def is_multi_turn(env: Any) -> bool:
    return callable(getattr(env, "start", None))


# Environment calls block on subprocesses, sandboxes and HTTP to sandbox services, almost never on the
# CPU, so a thread per call in flight is cheap: its stack is virtual (8 MiB reserved, tens of KiB
# touched) and a blocked thread does not contend for the GIL. The cap bounds what one process holds at
# once: every thread counts against RLIMIT_NPROC (per user: a non-root launcher's sandboxes and other
# roles share it; clusters often set 4096), and many threads released at once (a batch of tool runs
# ending together) queue on the GIL. More calls at once than this means more processes
# (`orchestrator.rollout_workers`), each with its own executor. launch/rollout_side.py plans with it.
ENV_THREADS_MAX = 1024
_DEFAULT_THREADS = min(32, (os.cpu_count() or 1) + 4)   # asyncio's default executor, until sized
_threads = _DEFAULT_THREADS
_executors: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[int, ThreadPoolExecutor]]" = \
    weakref.WeakKeyDictionary()
_lock = threading.Lock()


def set_env_threads(n: int) -> int:
    """Size the environment executor of this process: `n` calls at once (orchestrator.env_concurrency),
    at most ENV_THREADS_MAX; returns the size taken. Threads start only as calls need them; a loop whose
    executor has another size gets a new one at its next call (the old one finishes what it runs)."""
    global _threads
    if int(n) < 1:
        raise ValueError(f"environment threads: {n}; at least 1")
    with _lock:
        _threads = min(int(n), ENV_THREADS_MAX)
        return _threads


def env_threads() -> int:
    """The environment executor's size in this process."""
    return _threads


def env_executor() -> ThreadPoolExecutor:
    """The running event loop's environment executor, made at its first call (one per process and
    loop; it goes with its loop)."""
    loop = asyncio.get_running_loop()
    with _lock:
        size, ex = _executors.get(loop, (0, None))
        if ex is None or size != _threads:
            if ex is not None:
                ex.shutdown(wait=False)   # its running and queued calls still finish
            ex = ThreadPoolExecutor(_threads, thread_name_prefix="env")
            _executors[loop] = (_threads, ex)
        return ex


async def call(fn, *args, **kwargs):
    """Await a coroutine function; run a plain one in a thread of the environment executor (with the
    caller's context variables, as asyncio.to_thread does)."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    ctx = contextvars.copy_context()
    out = await asyncio.get_running_loop().run_in_executor(
        env_executor(), functools.partial(ctx.run, fn, *args, **kwargs))
    return await out if inspect.isawaitable(out) else out


def observation_messages(episode: Any, obs: Any) -> list[dict]:
    """The chat messages that carry an episode's observation back to the model."""
    if obs is None:
        return []
    if isinstance(obs, dict):
        return [obs]
    if isinstance(obs, (list, tuple)):
        return [m if isinstance(m, dict) else {"role": "user", "content": str(m)} for m in obs]
    wrap = getattr(episode, "tool_message", None)
    return [wrap(str(obs))] if callable(wrap) else [{"role": "user", "content": str(obs)}]


def parse_tool_calls(text: str) -> list[tuple[str, dict] | str]:
    """Every `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in a model turn (Hermes/Qwen
    convention; a missing closing tag at the end is accepted): (name, arguments) or an error text."""
    out: list[tuple[str, dict] | str] = []
    for m in TOOL_CALL.finditer(text):
        body = m.group(1).strip()
        try:
            call_ = json.loads(body)
        except json.JSONDecodeError as e:
            out.append(f"error: the tool call is not valid JSON ({e.msg} at char {e.pos})")
            continue
        if not isinstance(call_, dict) or not isinstance(call_.get("name"), str):
            out.append('error: a tool call is a JSON object with "name" (string) and "arguments" (object)')
            continue
        args = call_.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(args, dict):
            out.append('error: "arguments" must be a JSON object')
            continue
        out.append((call_["name"], args))
    return out


def default_turn_info(assistant_text: str, observations: list[dict]) -> dict:
    """Tool calls and tool errors of one turn when the episode does not report them: a call is a
    `<tool_call>` block that parses; an error is an observation that starts with "error:" (inside a
    `<tool_response>` wrap or not), which is the convention of the SWE tools."""
    calls = sum(1 for c in parse_tool_calls(assistant_text) if not isinstance(c, str))
    errors = 0
    for m in observations:
        text = str(m.get("content", ""))
        text = text.removeprefix("<tool_response>").lstrip()
        errors += text.startswith("error:")
    return {"tool_calls": calls, "tool_errors": errors}
