"""Environments written for the `verifiers` library (PyPI, 0.4 API: `verifiers.v1`), as hetrl episodes.

`env.name: "verifiers:<id>"` loads a verifiers *taskset* the way verifiers does (`<id>` is a built-in
`verifiers.v1.tasksets.<id>` or an installed module exporting its `vf.Taskset` subclass in `__all__`;
`"verifiers:pkg.module:ClassName"` names the class directly) and plays its tasks with hetrl's own
multi-turn loop instead of a verifiers harness program:

- the conversation opens with the task's `system_prompt` (plus the tool list, when there are tools) and
  its `prompt` (a string or a list of messages);
- the model's turn is read for `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the
  Hermes/Qwen format our tokenizer has special tokens for); every call runs the matching `@vf.tool`
  method of the task's and the taskset's `vf.Toolset`s **in process** (not as MCP servers), and the
  results go back as one `<tool_response>` message; a turn without a tool call ends the episode, as in
  verifiers' own chat loop (the `null` harness);
- `@vf.stop` predicates that take the `Trace` are checked after every turn;
- at the end the conversation is recorded as a `vf.Trace` (messages, the model's turns marked sampled)
  and scored by the task's own `Task.score`: `@vf.reward` functions (weighted sum = our reward) and
  `@vf.metric` functions (averaged into the batch meta as `env/<name>`).

Refused when loading, with the reason (nothing is silently skipped): multi-agent `vf.Env` subclasses,
tasksets that ship their own harness program, tasks that need a container (`NEEDS_CONTAINER`) or a
runtime (overridden `setup`/`finalize`/`stage_verifier`, rewards that take `runtime`), judges (LLM
calls), `@vf.intercept` hooks and `Request`/`Response` stop predicates. Metrics that need a runtime are
skipped (verifiers' own behaviour without a runtime) and logged once. Tasksets load from local data
only (there is no hub here); an infinite taskset is cut at `env.args.max_tasks`.

`env.args`: `taskset` (fields of the taskset's config class, e.g. its dataset path), `max_tasks`
(default 100000).
"""
from __future__ import annotations

import importlib
import inspect
import itertools
import json
import logging
import random
import re
from typing import Any

from rl.envs.base import call, parse_tool_calls

log = logging.getLogger(__name__)

TOOL_PROMPT = """You can call tools. Call a tool as a JSON object inside tags, one block per call:
<tool_call>{{"name": "tool_name", "arguments": {{"arg": "value"}}}}</tool_call>
Answer without a tool call when you are done.

Tools:
{tools}"""
_BLOCK = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.S)


class UnsupportedEnvironment(ValueError):
    """A verifiers environment uses something this adapter cannot run; the message says what."""


def _vf():
    try:
        import verifiers.v1 as vf
    except ImportError as e:  # pragma: no cover - verifiers is a dependency of the venv
        raise UnsupportedEnvironment("env.name=verifiers:*: the `verifiers` package (>= 0.4) is not "
                                     "installed") from e
    return vf


def _taskset_class(spec: str):
    vf = _vf()
    from verifiers.v1.utils import loaders
    if ":" in spec:
        module, _, attr = spec.partition(":")
        cls = getattr(importlib.import_module(module), attr)
        if not (isinstance(cls, type) and issubclass(cls, vf.Taskset)):
            raise UnsupportedEnvironment(f"verifiers:{spec}: {cls!r} is not a verifiers Taskset subclass")
        return cls, _config_type(cls)
    env_cls = loaders.environment_class(spec)
    if env_cls is not vf.SingleAgentEnv:
        raise UnsupportedEnvironment(f"verifiers:{spec}: exports the multi-agent Env {env_cls.__name__}; "
                                     "only single-agent tasksets are supported")
    if loaders.default_harness_id(spec) != "bash":
        raise UnsupportedEnvironment(f"verifiers:{spec}: ships its own harness program; only tasksets "
                                     "played by a chat/tool loop are supported")
    return loaders.taskset_class(spec), loaders.taskset_config_type(spec)


def _config_type(cls):
    from verifiers.v1.configs.taskset import TasksetConfig
    from verifiers.v1.taskset import Taskset
    from verifiers.v1.utils.generic import concrete_type
    return concrete_type(cls, TasksetConfig, origin=Taskset) or TasksetConfig


def _needs_runtime(fn) -> bool:
    p = inspect.signature(fn).parameters.get("runtime")
    return p is not None and p.default is inspect.Parameter.empty


def _tool_schema(fn) -> dict:
    params = {n: p for n, p in inspect.signature(fn).parameters.items() if n != "self"}
    try:
        from pydantic import create_model
        fields = {n: (p.annotation if p.annotation is not inspect.Parameter.empty else Any,
                      ... if p.default is inspect.Parameter.empty else p.default) for n, p in params.items()}
        schema = create_model(f"{fn.__name__}_args", **fields).model_json_schema()
        schema.pop("title", None)
        for v in schema.get("properties", {}).values():
            v.pop("title", None)
        return schema
    except Exception:  # exotic annotations: names only
        return {"type": "object", "properties": {n: {} for n in params}}


class VerifiersEnv:
    """A verifiers taskset as a hetrl multi-turn environment (see the module doc)."""

    def __init__(self, spec: str, env_cfg: Any = None):
        vf = _vf()
        args = dict((env_cfg.args if env_cfg is not None else {}) or {})
        ts_args = dict(args.pop("taskset", {}) or {})
        max_tasks = int(args.pop("max_tasks", 100_000))
        if args:
            raise UnsupportedEnvironment(f"env.args.{sorted(args)[0]}: unknown for verifiers environments "
                                         "(taskset, max_tasks)")
        self.spec = spec
        cls, cfg_type = _taskset_class(spec)
        self.taskset = cls(cfg_type.model_validate({"id": spec if ":" not in spec else "", **ts_args}))
        self.tasks = list(itertools.islice(iter(self.taskset), max_tasks))
        if not self.tasks:
            raise UnsupportedEnvironment(f"verifiers:{spec}: the taskset yields no tasks")
        self.task_cls = type(self.tasks[0])
        self._check(vf)
        self.shared_toolsets = list(cls.toolsets(self.taskset.config) or [])
        self._shared_ready = False
        self.skipped_metrics = [fn.__name__ for fn in self.tasks[0].hooks("metric") if _needs_runtime(fn)]
        if self.skipped_metrics:
            log.warning("verifiers:%s: metrics %s need a runtime and are skipped", spec, self.skipped_metrics)

    def _check(self, vf) -> None:
        t, T, name = self.tasks[0], self.task_cls, f"verifiers:{self.spec}"
        if T.NEEDS_CONTAINER:
            raise UnsupportedEnvironment(f"{name}: task {T.__name__} needs a container (NEEDS_CONTAINER)")
        for hook in ("setup", "finalize", "stage_verifier"):
            if getattr(T, hook) is not getattr(vf.Task, hook):
                raise UnsupportedEnvironment(f"{name}: task {T.__name__} overrides {hook}(trace, runtime); "
                                             "runtimes are not supported")
        if t.config.judges:
            raise UnsupportedEnvironment(f"{name}: judges (LLM calls at scoring) are not supported")
        if needs := [fn.__name__ for fn in t.hooks("reward") if _needs_runtime(fn)]:
            raise UnsupportedEnvironment(f"{name}: rewards {needs} need a runtime; not supported")
        from verifiers.v1.utils.decorators import discover_decorated
        if hooks := [fn.__name__ for fn in discover_decorated(t, "intercept")]:
            raise UnsupportedEnvironment(f"{name}: @vf.intercept hooks {hooks} are not supported")
        from verifiers.v1.session import hook_boundary
        for fn in t.hooks("stop"):
            if hook_boundary(fn, allow_trace=True) is not vf.Trace:
                raise UnsupportedEnvironment(f"{name}: stop {fn.__name__} takes a Request/Response; only "
                                             "Trace stop predicates are supported")

    async def _shared(self):
        if not self._shared_ready:
            for ts in self.shared_toolsets:
                await ts.setup()
            self._shared_ready = True
        return self.shared_toolsets

    def sample_tasks(self, n: int, rng: random.Random) -> list:
        out = []
        while len(out) < n:
            out += rng.sample(self.tasks, min(len(self.tasks), n - len(out)))
        return out

    def start(self, task) -> "VerifiersEpisode":
        return VerifiersEpisode(self, task)

    def describe(self) -> str:
        return json.dumps({"taskset": self.spec, "tasks": len(self.tasks),
                           "shared_toolsets": len(self.shared_toolsets)})


class VerifiersEpisode:
    def __init__(self, env: VerifiersEnv, task):
        self.env, self.task = env, task
        self.tools: dict[str, Any] = {}
        self.turns = 0
        self.done = False
        self.end_reason: str | None = None
        self.trace = None
        self._last = {"tool_calls": 0, "tool_errors": 0}
        self.reward_error: str | None = None

    # --- trace --------------------------------------------------------------------------------
    def _add(self, message, sampled: bool = False) -> None:
        from verifiers.v1.graph import MessageNode
        parent = len(self.trace.nodes) - 1 if self.trace.nodes else None
        self.trace.nodes.append(MessageNode(parent=parent, message=message, sampled=sampled))

    async def initial_messages(self) -> list[dict]:
        vf = _vf()
        from verifiers.v1.trace import AgentInfo, TraceTask
        from verifiers.v1.types import content_text
        t = self.task
        self.trace = vf.Trace(task=TraceTask(type=type(t).__name__, data=t.data, key=t.key, hash=t.hash),
                              agent=AgentInfo(config=vf.AgentConfig()))
        toolsets = list(await self.env._shared())
        for ts in type(t).toolsets(t.config) or []:
            await ts.setup()
            await ts.setup_task(t)
            toolsets.append(ts)
        from verifiers.v1.utils.decorators import discover_decorated
        specs = []
        for ts in toolsets:
            for fn in discover_decorated(ts, "tool"):
                tool = getattr(fn, "tool_name", None) or fn.__name__
                full = f"{ts.server_name}_{tool}" if ts.server_name else tool
                if full in self.tools:
                    raise UnsupportedEnvironment(f"verifiers:{self.env.spec}: duplicate tool name {full!r}")
                self.tools[full] = fn
                specs.append({"name": full, "description": (fn.__doc__ or "").strip(),
                              "parameters": _tool_schema(fn)})
        system = t.data.system_prompt
        if specs:
            tools = TOOL_PROMPT.format(tools="\n".join(json.dumps(s) for s in specs))
            system = f"{system}\n\n{tools}" if system else tools
        out = []
        if system:
            out.append({"role": "system", "content": system})
            self._add(vf.SystemMessage(content=system))
        prompt = t.data.prompt
        if prompt is None:
            raise UnsupportedEnvironment(f"verifiers:{self.env.spec}: task without a prompt (the user opens "
                                         "the conversation) is not supported")
        if isinstance(prompt, str):
            prompt = [vf.UserMessage(content=prompt)]
        for m in prompt:
            text = content_text(m.content) if getattr(m, "content", None) is not None else ""
            if m.role == "system" and out and out[0]["role"] == "system":
                out[0]["content"] = f"{text}\n\n{out[0]['content']}"
            else:
                out.append({"role": m.role if m.role != "tool" else "user", "content": text})
            self._add(m)
        return out

    # --- turns --------------------------------------------------------------------------------
    async def step(self, text: str):
        vf = _vf()
        if self.done:
            raise RuntimeError(f"episode of task {self.task.key[:12]} is over ({self.end_reason})")
        self.turns += 1
        calls = parse_tool_calls(text)
        has_blocks = bool(_BLOCK.search(text))
        content = _BLOCK.sub("", text).strip() or None
        tool_calls = [vf.ToolCall(id=f"call_{self.turns}_{j}", name=c[0], arguments=json.dumps(c[1]))
                      for j, c in enumerate(calls) if not isinstance(c, str)]
        self._add(vf.AssistantMessage(content=content, tool_calls=tool_calls or None), sampled=True)
        if not has_blocks:
            self._last = {"tool_calls": 0, "tool_errors": 0}
            return self._end("no_tool_call")
        results, errors = [], 0
        for j, c in enumerate(calls):
            call_id = f"call_{self.turns}_{j}"
            if isinstance(c, str):
                out, errors = c, errors + 1
            elif c[0] not in self.tools:
                out = f"error: unknown tool {c[0]!r}; tools: {', '.join(self.tools) or 'none'}"
                errors += 1
            else:
                try:
                    res = await call(self.tools[c[0]], **c[1])
                    out = res if isinstance(res, str) else json.dumps(res, default=str)
                except Exception as e:  # the model's mistake (bad arguments) or the tool's: the model sees it
                    out, errors = f"error: {type(e).__name__}: {e}", errors + 1
            results.append(out)
            self._add(vf.ToolMessage(tool_call_id=call_id, content=out,
                                     name=None if isinstance(c, str) else c[0]))
        self._last = {"tool_calls": sum(not isinstance(c, str) for c in calls), "tool_errors": errors}
        obs = {"role": "user",
               "content": "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)}
        if await self._stopped():
            self._end(self.trace.stop_condition or "stop")
            return obs, True
        return obs, False

    async def _stopped(self) -> bool:
        from verifiers.v1.session import call_hook
        for fn in self.task.hooks("stop"):
            available = {"task": self.task.data, "trace": self.trace, type(self.trace): self.trace}
            if await call_hook(fn, available):
                self.trace.stop(fn.__name__)
                return True
        return False

    def _end(self, reason: str):
        self.done = True
        self.end_reason = reason
        return None, True

    def turn_info(self) -> dict:
        return dict(self._last)

    # --- end ----------------------------------------------------------------------------------
    async def reward(self) -> float:
        vf = _vf()
        self.trace.is_completed = True
        try:
            await self.task.score(self.trace, None)
        except vf.TaskError as e:
            self.reward_error = str(e)
            log.warning("verifiers:%s: scoring failed, reward 0: %s", self.env.spec, e)
            return 0.0
        return float(self.trace.reward)

    def metrics(self) -> dict:
        m = {k: v for k, v in (self.trace.metrics if self.trace else {}).items() if v is not None}
        m.update(turns=self.turns, reward_error=float(self.reward_error is not None))
        return m

    def close(self) -> None:
        self.tools.clear()


def load_verifiers_env(spec: str, env_cfg: Any = None) -> VerifiersEnv:
    return VerifiersEnv(spec, env_cfg)
