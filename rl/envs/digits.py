"""The embedded default's task: repeat the digits of the prompt.

Chosen because a 0.2M-parameter model can learn it within minutes on two CPU cores and its reward is
graded (partial credit per position, in [0, 1]), which gives group-relative advantages something to
separate. The warm start is a deliberately noisy teacher: it shows the answer format and gets each
digit right only with probability `warm_start_accuracy`, so the policy starts with the copying circuit
half-formed and RL has to do the rest: the reward curve is the RL's own work, not the warm start's.
"""
from __future__ import annotations

import random
from typing import Any

PROMPT = "repeat {}"


class DigitsEnv:
    name = "digits"

    def __init__(self, digits_cfg: Any):
        """`digits_cfg`: the config's `env.digits` section (n_digits, warm_start_accuracy)."""
        self.n_digits = int(digits_cfg.n_digits)
        self.warm_start_accuracy = float(digits_cfg.warm_start_accuracy)
        if self.n_digits < 1:
            raise ValueError(f"env.digits.n_digits={self.n_digits}: must be at least 1")

    def sample_tasks(self, n: int, rng: random.Random) -> list[dict]:
        return [{"digits": [rng.randrange(10) for _ in range(self.n_digits)]} for _ in range(n)]

    def prompt(self, task: dict) -> list[dict]:
        return [{"role": "user", "content": PROMPT.format(" ".join(map(str, task["digits"])))}]

    def score(self, task: dict, completion: str) -> float:
        answer = completion.replace("<|im_end|>", " ").split()
        target = [str(d) for d in task["digits"]]
        hits = sum(a == t for a, t in zip(answer, target))
        return hits / max(len(target), len(answer))

    def sft_examples(self, n: int, rng: random.Random, tokenizer) -> list[tuple[list[int], list[int]]]:
        out = []
        for task in self.sample_tasks(n, rng):
            shown = [d if rng.random() < self.warm_start_accuracy else rng.randrange(10) for d in task["digits"]]
            prompt_ids = encode_prompt(tokenizer, self.prompt(task))
            completion_ids = tokenizer.encode(" ".join(map(str, shown)), add_special_tokens=False)
            out.append((prompt_ids, completion_ids + [tokenizer.eos_token_id]))
        return out


def encode_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Chat-template token ids of `messages` with the assistant turn opened."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
