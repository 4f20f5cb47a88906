"""`echo_tools`: a multi-turn environment whose only tool echoes back as many words as it is asked for.

Built for measuring the data plane (benchmarks/seed_rehearsal.py), not for learning: what costs the
orchestrator and the trainer in a SWE episode is its shape (many turns, observations that are long token
blobs, one growing sequence per episode), not what the tools compute. A SWE episode's observation is a
file or a test log that the model asked for; here the model asks for it by size:

    <tool_call>{"name": "echo", "arguments": {"words": 300}}</tool_call>

and the observation is 300 words of one token each (" x" under the tiny tokenizer; any tokenizer gives
about one token a word). So whoever plays the model (a mock engine at benchmark time, a real policy
otherwise) decides the episode's length turn by turn, and the environment itself costs next to nothing:
no sandbox, no files, no settings but `env.max_turns`. A turn without a valid call ends the episode,
as in verifiers' chat loop; a malformed call or a word count outside [0, MAX_WORDS] is answered with an
`error:` observation (the SWE tools' convention, counted as a tool error). Reward: 1 for an episode whose
task id and turn count are both odd or both even, else 0, so every group has a spread and GRPO's
advantages are not all zero; a function of the task and the episode, never random.
"""
from __future__ import annotations

from typing import Any

from rl.envs.base import parse_tool_calls

MAX_WORDS = 1 << 20   # one observation; beyond this a call is an error, not a memory bomb
WORD = " x"


class EchoToolsEnv:
    def __init__(self, max_turns: int):
        self.max_turns = int(max_turns)

    def sample_tasks(self, n: int, rng) -> list[dict]:
        return [{"id": rng.getrandbits(31)} for _ in range(n)]

    def start(self, task: dict) -> "EchoEpisode":
        return EchoEpisode(task)


class EchoEpisode:
    def __init__(self, task: dict):
        self.task, self.turns, self.calls, self.errors, self.words = task, 0, 0, 0, 0

    def initial_messages(self) -> list[dict]:
        return [{"role": "user", "content": f"task {self.task['id']}: call echo until you are done"}]

    def step(self, text: str) -> tuple[Any, bool]:
        self.turns += 1
        self.calls = self.errors = 0   # turn_info is about the last step
        calls = parse_tool_calls(text)
        if not calls:
            return None, True
        out = []
        for c in calls:
            if isinstance(c, str):
                out.append(c)
                self.errors += 1
                continue
            name, args = c
            n = args.get("words")
            if name != "echo" or not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_WORDS:
                out.append(f"error: only echo(words: int in [0, {MAX_WORDS}]) exists, got {name}({args})")
                self.errors += 1
                continue
            self.calls += 1
            self.words += n
            out.append(WORD * n)
        return "\n".join(out), False

    def tool_message(self, obs: str) -> dict:
        return {"role": "user", "content": f"<tool_response>\n{obs}\n</tool_response>"}

    def turn_info(self) -> dict:
        return {"tool_calls": self.calls, "tool_errors": self.errors}

    def reward(self) -> float:
        return float(self.task["id"] % 2 == self.turns % 2)

    def metrics(self) -> dict:
        return {"echo_words": self.words}
