"""The embedded default's task: repeat the digits of the prompt.

Chosen because a 0.2M-parameter model can learn it within minutes on two CPU cores and its reward is
graded (partial credit per position, in [0, 1]), which gives group-relative advantages something to
separate. The warm start is a deliberately noisy teacher: it shows the answer format and gets each
digit right only with probability `warm_start_accuracy`, so the policy starts with the copying circuit
half-formed and RL has to do the rest: the reward curve is the RL's own work, not the warm start's.
"""
from __future__ import annotations

import asyncio
import math
import random
from typing import Any

from rl.envs.base import chat_prompt_ids

PROMPT = "repeat {}"


class DigitsEnv:
    name = "digits"

    def __init__(self, digits_cfg: Any):
        """`digits_cfg`: the config's `env.digits` section (n_digits, warm_start_accuracy)."""
        self.n_digits = int(digits_cfg.n_digits)
        self.warm_start_accuracy = float(digits_cfg.warm_start_accuracy)
        if self.n_digits < 1:
            raise ValueError(f"env.digits.n_digits={self.n_digits}: must be at least 1")
        self.latency_median_s = float(digits_cfg.latency_median_s)
        self.latency_sigma = float(digits_cfg.latency_sigma)
        self.latency_outlier_prob = float(digits_cfg.latency_outlier_prob)
        self.latency_outlier_factor = float(digits_cfg.latency_outlier_factor)

    def sample_tasks(self, n: int, rng: random.Random) -> list[dict]:
        out = []
        for _ in range(n):
            task = {"digits": [rng.randrange(10) for _ in range(self.n_digits)]}
            if self.latency_median_s > 0:
                s = self.latency_median_s * math.exp(rng.gauss(0.0, self.latency_sigma))
                task["latency_s"] = s * (self.latency_outlier_factor if rng.random() < self.latency_outlier_prob
                                         else 1.0)
            out.append(task)
        return out

    def load_tasks(self, path: str) -> list[dict]:
        """Held-out tasks from a JSONL file, one `{"digits": [d, ...]}` per line (digits 0-9)."""
        import json
        out = []
        for n, line in enumerate(open(path).read().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                digits = [int(d) for d in row["digits"]]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a digits task ({type(e).__name__}: {e}); "
                                 f'expected {{"digits": [0-9, ...]}}') from None
            if not digits or any(not 0 <= d <= 9 for d in digits):
                raise ValueError(f"{path}:{n}: digits must be a non-empty list of 0-9")
            out.append({"digits": digits})
        return out

    def prompt(self, task: dict) -> list[dict]:
        return [{"role": "user", "content": PROMPT.format(" ".join(map(str, task["digits"])))}]

    def score(self, task: dict, completion: str) -> float:
        answer = completion.replace("<|im_end|>", " ").split()
        target = [str(d) for d in task["digits"]]
        hits = sum(a == t for a, t in zip(answer, target))
        return hits / max(len(target), len(answer))

    async def ascore(self, task: dict, completion: str) -> float:
        """`score` after the prompt's grading latency (env.digits.latency_*): what the orchestrator awaits."""
        if task.get("latency_s"):
            await asyncio.sleep(task["latency_s"])
        return self.score(task, completion)

    def sft_examples(self, n: int, rng: random.Random, tokenizer) -> list[tuple[list[int], list[int]]]:
        out = []
        for task in self.sample_tasks(n, rng):
            shown = [d if rng.random() < self.warm_start_accuracy else rng.randrange(10) for d in task["digits"]]
            prompt_ids = chat_prompt_ids(tokenizer, self.prompt(task))
            completion_ids = tokenizer.encode(" ".join(map(str, shown)), add_special_tokens=False)
            out.append((prompt_ids, completion_ids + [tokenizer.eos_token_id]))
        return out
