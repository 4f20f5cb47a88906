"""The rollout batch: what the orchestrator hands the trainer for one step.

Samples have different lengths, so the batch is stored packed: one flat token array and offsets, the
layout the trainer's sequence packing wants anyway. Per token it carries the loss mask (1 = a token the
policy generated and is trained on; 0 = prompt, tool output, observation), the logprob the inference
engine assigned when sampling it and the policy version that produced it (-1 for tokens the policy did
not generate). Per sample: reward, advantage, group id. Optionally routed expert ids recorded at
inference, [tokens, layers, top_k], as uint8 while every id fits (up to 256 experts) and as uint16
beyond (Kimi-K2 routes to 384 experts, GLM-5 to 256): the narrowest width that holds the family's ids,
since for a long SWE episode these ids outweigh every other per-token field.

On disk it is one safetensors file of numpy arrays (no pickle, no torch needed) plus `meta.json`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

BATCH_FILE = "batch.safetensors"
META_FILE = "meta.json"


def routed_per_token(routed: np.ndarray | None, n_tokens: int) -> np.ndarray | None:
    """vLLM returns routed experts for every token but the last one sampled ([n-1, layers, top_k]: the
    last token was never fed back through the model). The trainer wants one row per token; the last
    row only shapes the logits after the final token, which no loss term reads, so it repeats the row
    before it."""
    if routed is None:
        return None
    r = np.asarray(routed)
    if r.shape[0] == n_tokens - 1:
        r = np.concatenate([r, r[-1:]], axis=0)
    if r.shape[0] != n_tokens:
        raise ValueError(f"routed experts cover {r.shape[0]} tokens, the sample has {n_tokens}")
    return expert_ids(r)


def expert_ids(r: np.ndarray) -> np.ndarray:
    """Expert ids in the batch layout: uint8 when they all fit, else uint16 (up to 65536 experts)."""
    r = np.asarray(r)
    if r.size and (r.min() < 0 or r.max() > np.iinfo(np.uint16).max):
        raise ValueError(f"expert ids must lie in [0, 65535], got [{r.min()}, {r.max()}]")
    return r.astype(np.uint8 if r.max(initial=0) <= np.iinfo(np.uint8).max else np.uint16)


@dataclass
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    completion_versions: list[int]
    reward: float
    group: int
    advantage: float = 0.0
    # 1 where the completion token is the policy's own (multi-turn rollouts put observations in between)
    completion_mask: list[int] | None = None
    routed_experts: np.ndarray | None = None  # [prompt+completion tokens, layers, top_k]
    info: dict = field(default_factory=dict)


@dataclass
class RolloutBatch:
    tokens: np.ndarray          # int32 [T]
    offsets: np.ndarray         # int64 [B+1]
    loss_mask: np.ndarray       # uint8 [T]
    logprobs: np.ndarray        # float32 [T] inference logprob of each token (0 where mask is 0)
    versions: np.ndarray        # int32 [T] policy version that generated the token, -1 if not generated
    rewards: np.ndarray         # float32 [B]
    advantages: np.ndarray      # float32 [B]
    groups: np.ndarray          # int32 [B]
    routed_experts: np.ndarray | None = None  # uint8/uint16 [T, layers, top_k] (expert_ids)
    meta: dict = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return len(self.offsets) - 1

    def sample_slice(self, i: int) -> slice:
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))

    @classmethod
    def from_samples(cls, samples: list[Sample], meta: dict | None = None) -> "RolloutBatch":
        toks, mask, lps, vers, offs, rex = [], [], [], [], [0], []
        for s in samples:
            n_p, n_c = len(s.prompt_ids), len(s.completion_ids)
            if not (len(s.completion_logprobs) == len(s.completion_versions) == n_c):
                raise ValueError("completion ids, logprobs and versions differ in length")
            cm = s.completion_mask if s.completion_mask is not None else [1] * n_c
            toks += list(s.prompt_ids) + list(s.completion_ids)
            mask += [0] * n_p + list(cm)
            lps += [0.0] * n_p + [lp if m else 0.0 for lp, m in zip(s.completion_logprobs, cm)]
            vers += [-1] * n_p + [v if m else -1 for v, m in zip(s.completion_versions, cm)]
            offs.append(offs[-1] + n_p + n_c)
            if s.routed_experts is not None:
                rex.append(s.routed_experts)
        routed = None
        if rex:
            if len(rex) != len(samples):
                raise ValueError("routed experts recorded for some samples only")
            routed = expert_ids(np.concatenate(rex))
        return cls(
            tokens=np.asarray(toks, np.int32), offsets=np.asarray(offs, np.int64),
            loss_mask=np.asarray(mask, np.uint8), logprobs=np.asarray(lps, np.float32),
            versions=np.asarray(vers, np.int32),
            rewards=np.asarray([s.reward for s in samples], np.float32),
            advantages=np.asarray([s.advantage for s in samples], np.float32),
            groups=np.asarray([s.group for s in samples], np.int32),
            routed_experts=routed, meta=meta or {})

    def save(self, out_dir: Path) -> None:
        arrays = {k: getattr(self, k) for k in ("tokens", "offsets", "loss_mask", "logprobs", "versions",
                                                  "rewards", "advantages", "groups")}
        if self.routed_experts is not None:
            arrays["routed_experts"] = self.routed_experts
        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(Path(out_dir) / BATCH_FILE))
        (Path(out_dir) / META_FILE).write_text(json.dumps(self.meta, indent=1, sort_keys=True))

    @classmethod
    def load(cls, step_dir: Path) -> "RolloutBatch":
        a = load_file(str(Path(step_dir) / BATCH_FILE))
        meta = json.loads((Path(step_dir) / META_FILE).read_text())
        return cls(routed_experts=a.pop("routed_experts", None), meta=meta, **a)
