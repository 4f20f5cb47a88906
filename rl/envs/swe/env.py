"""The SWE environment: sample tasks, run one episode per task in its own sandbox, reward at the end.

`SWEEnv(tasks, config).start(task)` puts the task's starting tree (its snapshot, base_commit of its git
repository, or the repository inside its image) into a fresh sandbox and returns an `Episode`. The
sandbox comes from the runtime of `config.runtime` (`env.swe.runtime`: rl/envs/swe/runtimes.py), or,
when the plan has sandbox nodes, from the sandbox service on one of them (`sandboxes=`, a
rl.envs.swe.runtime_remote.ServicePool): the episode then calls the tools and grading on the service,
which runs them there with the same code (docs/sandboxes.md). The orchestrator drives it turn by turn:
`initial_messages()` opens the conversation (system prompt with the tool list, then the issue), each
model turn goes to `step(text)`, which runs the one tool call in it and returns the observation to send
back (`tool_message(obs)` wraps it as a chat message), and `reward()` grades the tree on the hidden
tests once the episode is done. The hidden tests and the reference patch never enter the tree, and the
checkout that holds them is masked inside the sandbox.

Limits: `max_turns` model turns and `wall_s` seconds per episode (tool timeouts are clipped to the time
left). Grading has its own limit, `grade_timeout_s` (env.swe.grade_timeout_s): the hidden tests of a
real repository take longer than one tool call may, and a grade cut short scores the tests it did not
reach as failed; the grading sandbox's CPU-seconds limit is raised to match it. An episode ends at `submit`, or when a limit is reached; `step` then returns done=True. No torch or
vLLM here: the environment is plain Python plus the sandbox, so it is testable on its own.
"""
from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from dataclasses import dataclass, field

from typing import Any

from rl.envs.swe.datasets import needs_container, playable
from rl.envs.swe.sandbox import Limits
from rl.envs.swe.grader import grade, run_tests_install, run_tests_roots
from rl.contract.sandbox_runtimes import IMAGE_RUNTIMES
from rl.envs.swe.datasets import load_tasks
from rl.envs.swe.tasks import Task, check_task, open_sandbox
from rl.envs.swe.tools import TOOL_SPECS, Tools, parse_tool_call


@dataclass(frozen=True)
class EnvConfig:
    max_turns: int = 30
    wall_s: float = 1800.0
    tool_timeout_s: float = 60.0
    output_chars: int = 4000
    limits: Limits = field(default_factory=lambda: Limits(cpu_s=60, memory_bytes=2 << 30))
    partial_credit: bool = True        # fraction of graded tests passed; off: 1 only if all pass
    runtime: dict = field(default_factory=lambda: {"name": "inprocess"})  # open_runtime's settings
    grade_timeout_s: float = 300.0     # grading the hidden tests, apart from tool_timeout_s

    def __post_init__(self):
        if not self.grade_timeout_s > 0:
            raise ValueError(f"env.swe.grade_timeout_s={self.grade_timeout_s}: must be positive")

    def grade_limits(self) -> Limits:
        """The sandbox limits of grading: the episode's, with CPU seconds no lower than the grade's
        wall-clock limit (a test run may use all of it)."""
        return dataclasses.replace(self.limits, cpu_s=max(self.limits.cpu_s, math.ceil(self.grade_timeout_s)))


SYSTEM_PROMPT = """You are a software engineer fixing an issue in a Python repository.
Work with the tools below. Call exactly one tool per turn, as a JSON object inside tags:
<tool_call>{{"name": "read_file", "arguments": {{"path": "pkg/module.py"}}}}</tool_call>
Paths are relative to the repository root. Hidden tests will check your fix after you submit.

Tools:
{tools}

Explore the code, make the fix, run the tests, then call submit."""


def system_prompt() -> str:
    tools = "\n".join(f"- {s['name']}({', '.join(s['arguments'])}): {s['description']}"
                      + "".join(f"\n    {k}: {v}" for k, v in s["arguments"].items())
                      for s in TOOL_SPECS)
    return SYSTEM_PROMPT.format(tools=tools)


def initial_messages(task: Task) -> list[dict]:
    return [{"role": "system", "content": system_prompt()},
            {"role": "user", "content": f"Fix this issue:\n\n{task.problem_statement}"}]


class Episode:
    """One task attempt in its own sandbox. Use as a context manager or call close()."""

    def __init__(self, task: Task, config: EnvConfig, sandboxes: Any = None):
        self.task = task
        self.config = config
        if sandboxes is not None:  # on a sandbox node: the service runs the tools and grading there
            self.sandbox = sandboxes.open(task.instance_id)
            self.tools = self.sandbox.tools()
        else:
            self.sandbox = open_sandbox(task, config.limits, config.runtime)
            self.tools = Tools(self.sandbox, output_chars=config.output_chars,
                               timeout_s=config.tool_timeout_s, roots=run_tests_roots(task, config.runtime),
                               install=run_tests_install(task, config.runtime))
        self._remote = sandboxes is not None
        self.turns = 0
        self.done = False
        self.end_reason: str | None = None
        self.t0 = time.monotonic()
        self._reward: float | None = None
        self.grading_error = ""  # why the grade cannot be trusted, "" when it can (Grade.grading_error)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def system_prompt(self) -> str:
        return system_prompt()

    def initial_messages(self) -> list[dict]:
        return initial_messages(self.task)

    @staticmethod
    def tool_message(observation: str) -> dict:
        """The chat message that carries an observation back (Qwen's convention for tool results)."""
        return {"role": "user", "content": f"<tool_response>\n{observation}\n</tool_response>"}

    def time_left(self) -> float:
        return self.config.wall_s - (time.monotonic() - self.t0)

    def step(self, assistant_text: str) -> tuple[str | None, bool]:
        """Run the tool call in one model turn. Returns (observation, done): observation is None after
        submit; when a turn or time limit ends the episode the last observation is still returned."""
        if self.done:
            raise RuntimeError(f"episode of {self.task.instance_id} is over ({self.end_reason})")
        self.turns += 1
        call = parse_tool_call(assistant_text)
        if isinstance(call, str):
            obs = call
        else:
            name, args = call
            obs = self.tools.call(name, args, timeout_s=max(1.0, min(self.config.tool_timeout_s,
                                                                     self.time_left())))
            if self.tools.submitted:
                self._end("submitted")
                return None, True
        if self.turns >= self.config.max_turns:
            self._end("max_turns")
        elif self.time_left() <= 0:
            self._end("wall_time")
        return obs, self.done

    def _end(self, reason: str):
        self.done = True
        self.end_reason = reason

    def reward(self) -> float:
        """The hidden-test reward of the tree (grader.grade; partial credit per the config); graded once."""
        if self._reward is None:
            if self._remote:
                g = self.sandbox.grade()
            else:
                g = grade(self.task, self.sandbox.tree, limits=self.config.grade_limits(),
                          timeout_s=self.config.grade_timeout_s, partial_credit=self.config.partial_credit,
                          runtime=self.config.runtime)
            self._reward, self.grading_error = g.reward, g.grading_error
        return self._reward

    def metrics(self) -> dict:
        # swe/grading_errors: 1 when the grade could not be trusted; its reason goes to the log (the driver)
        return {"turns": self.turns, "end_reason": self.end_reason or "open",
                "seconds": time.monotonic() - self.t0, "reward": self._reward,
                "swe/grading_errors": int(bool(self.grading_error)), "grading_error": self.grading_error}

    def close(self):
        self.sandbox.close()


def playable_under(rows: list[Task], runtime: str, repos_dir: str | None, where: str,
                   limits: dict | None = None) -> list[Task]:
    """The rows made playable under `runtime`: image runtimes need every row's image (the repository is
    in it); inprocess and bubblewrap refuse image rows (they have no images) and resolve repositories.
    Every row is checked as untrusted input first (tasks.check_task), rows made in memory included."""
    for i, t in enumerate(rows):
        check_task(t, f"{where}: row {i}", limits)
    if runtime in IMAGE_RUNTIMES:
        for i, t in enumerate(rows):
            if not t.image:
                raise ValueError(f"{where}: row {i} ({t.instance_id}): env.swe.runtime={runtime} runs each "
                                 "task in its image, and this row names none (image_name / docker_image)")
        return [t for t in rows]
    for i, t in enumerate(rows):
        if needs_container(t):
            raise ValueError(f"{where}: row {i} ({t.instance_id}): its {t.format} row runs in its instance "
                             f"image {t.image!r}: env.swe.runtime={runtime} has no images: it needs a "
                             "container runtime (env.swe.runtime=apptainer or podman)")
    return playable(rows, repos_dir, where)


class SWEEnv:
    """Tasks of a dataset in any public SWE format (default: the built-in set) and episodes over them.
    Rows are made playable here at construction: repositories resolved (under `repos_dir`), rows the
    runtime cannot play refused with a one-line error (playable_under). `sandboxes`: a service pool
    (sandbox nodes), or None for sandboxes of `config.runtime` in this process. `row_limits` overrides
    entries of tasks.ROW_LIMITS (field sizes)."""

    def __init__(self, tasks: list[Task] | str | None = None, config: EnvConfig = EnvConfig(), *,
                 format: str = "auto", repos_dir: str | None = None, sandboxes: Any = None,
                 row_limits: dict | None = None, split: str | None = None):
        where = str(tasks) if isinstance(tasks, str) else "tasks"
        rows = (load_tasks(limits=row_limits) if tasks is None else
                load_tasks(tasks, format, row_limits, split) if isinstance(tasks, str) else tasks)
        self.tasks = playable_under(rows, config.runtime["name"], repos_dir, where, row_limits)
        if not self.tasks:
            raise ValueError("SWEEnv needs at least one task")
        self.config = config
        self.sandboxes = sandboxes
        self.by_id = {t.instance_id: t for t in self.tasks}
        self._format, self._repos_dir, self._row_limits = format, repos_dir, row_limits

    def load_tasks(self, path: str, split: str | None = None) -> list[Task]:
        """Rows of another dataset file made playable like this environment's own (held-out evaluation);
        `split` picks one split of a directory holding several (never the training split's setting)."""
        return playable_under(load_tasks(path, self._format, self._row_limits, split), self.config.runtime["name"],
                              self._repos_dir, str(path), self._row_limits)

    def sample_tasks(self, n: int, rng: random.Random) -> list[Task]:
        """n tasks: without replacement while n <= number of tasks, then cycling through reshuffles."""
        out = []
        while len(out) < n:
            out += rng.sample(self.tasks, min(len(self.tasks), n - len(out)))
        return out

    def start(self, task: Task) -> Episode:
        return Episode(task, self.config, self.sandboxes)

    def describe(self) -> str:
        where = self.sandboxes.describe() if self.sandboxes is not None else "this process"
        return json.dumps({"tasks": len(self.tasks), "runtime": self.config.runtime["name"],
                           "sandboxes": where})
