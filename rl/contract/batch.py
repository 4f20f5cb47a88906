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

`RolloutBatch.load` checks what it read before anyone trains on it (`validate`): a checksum only proves
the file is the one its producer wrote, not that the producer wrote something trainable. Every array is
there with its layout's dtype and length, offsets run from 0 to the number of tokens without going
back, float arrays are finite, token ids lie in [0, vocab_size), the loss mask is 0/1, policy versions
are -1 (not generated) or a version, and logprobs are logprobs (in [-1e4, 0], vLLM's -inf being -9999).
The bookkeeping in meta.json (which groups and rollouts the batch trains) is checked against its schema
(rl.contract.record_schemas.batch_meta) and against the arrays: entry j of `entries` is the samples of
dense group j, and a part's rewards are those samples' rewards. The orchestrator's resume believes that
bookkeeping, so a batch whose meta does not describe its arrays is not trained on either. Anything else
is `InvalidBatch` with a one-line reason naming the file, the field and the value; the trainer sets
such a batch aside like a corrupt one (rl.trainer.loop.next_batch).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from rl.contract import record_schemas, safefs
from rl.contract.record_schemas import LOGPROB_MAX, LOGPROB_MIN, MAX_STEP

BATCH_FILE = "batch.safetensors"
META_FILE = "meta.json"

PER_TOKEN = ("tokens", "loss_mask", "logprobs", "versions")  # one entry per token, like routed_experts
PER_SAMPLE = ("rewards", "advantages", "groups")
ARRAYS = ("tokens", "offsets", *PER_TOKEN[1:], *PER_SAMPLE)  # always stored; routed_experts optionally
_FLOAT = ("logprobs", "rewards", "advantages")
_MAX_META = 256 << 20   # meta.json lists a few numbers per sample; a file beyond this is not one


class InvalidBatch(ValueError):
    """A rollout batch that must not be trained on; the message is one line naming file, field and value."""


def _first(bad: np.ndarray) -> int:
    return int(np.flatnonzero(bad)[0])


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
    def load(cls, step_dir: Path, vocab_size: int | None = None) -> "RolloutBatch":
        """Read a batch and `validate` it; InvalidBatch if it is malformed (I/O errors propagate)."""
        f, mf = Path(step_dir) / BATCH_FILE, Path(step_dir) / META_FILE
        try:
            a = load_file(str(f))
        except (SafetensorError, TypeError, AttributeError) as e:
            # a header safetensors cannot parse is SafetensorError; one naming a dtype numpy lacks (BF16,
            # F8_*) fails inside its numpy loader as TypeError / AttributeError
            raise InvalidBatch(f"{f}: not a readable safetensors file of numpy arrays ({e})") from None
        try:  # never through a link, never blocking on a FIFO (rl.contract.safefs)
            meta = json.loads(safefs.read_bytes(mf, limit=_MAX_META))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InvalidBatch(f"{mf}: not valid JSON ({e})") from None
        if not isinstance(meta, dict):
            raise InvalidBatch(f"{mf}: must be a JSON object, found {type(meta).__name__}")
        if missing := [k for k in ARRAYS if k not in a]:
            raise InvalidBatch(f"{f}: no array {missing[0]!r} (a rollout batch has {', '.join(ARRAYS)})")
        if extra := sorted(set(a) - set(ARRAYS) - {"routed_experts"}):
            raise InvalidBatch(f"{f}: unknown array {extra[0]!r} (a rollout batch has {', '.join(ARRAYS)}, "
                               f"routed_experts)")
        batch = cls(routed_experts=a.pop("routed_experts", None), meta=meta, **a)
        batch.validate(vocab_size, where=str(f))
        batch.validate_meta(where=str(mf))
        return batch

    def validate_meta(self, group_size: int | None = None, where: str = "rollout batch meta") -> None:
        """Raise InvalidBatch unless meta.json's bookkeeping is well-formed (record_schemas.batch_meta)
        and describes these arrays: entry j's rollouts are the samples of dense group j, a part's
        rewards are theirs. Call after `validate` (the arrays are known to be consistent)."""
        if (why := record_schemas.batch_meta(self.meta, num_samples=self.num_samples,
                                             group_size=group_size)) is not None:
            raise InvalidBatch(f"{where}: {why}")
        entries = self.meta.get("entries")
        if entries is None:
            return
        counts = np.bincount(self.groups.astype(np.int64), minlength=len(entries)) if len(self.groups) else \
            np.zeros(len(entries), np.int64)
        if len(self.groups) and (self.groups.min() < 0 or len(counts) != len(entries)):
            raise InvalidBatch(f"{where}: the batch's dense groups run {int(self.groups.min())}.."
                               f"{int(self.groups.max())}, meta.json has {len(entries)} entries")
        parts = self.meta.get("partial_groups") or {}
        for j, (g, idx) in enumerate(entries):
            if counts[j] != len(idx):
                raise InvalidBatch(f"{where}: entry {j} (group {g}) lists {len(idx)} rollouts, the batch has "
                                   f"{int(counts[j])} samples of it")
            if str(g) in parts:
                have = self.rewards[self.groups == j].astype(np.float64)
                if not np.allclose(have, parts[str(g)]["rewards"], rtol=1e-5, atol=1e-5):
                    raise InvalidBatch(f"{where}: partial_groups[{g}].rewards="
                                       f"{record_schemas.shown(parts[str(g)]['rewards'])} are not its samples' "
                                       f"rewards {record_schemas.shown(have.tolist())}")

    def validate(self, vocab_size: int | None = None, where: str = "rollout batch") -> None:
        """Raise InvalidBatch (one line: `where`, the field, the value) unless the trainer can train on
        this batch: layout dtypes and lengths, offsets from 0 to len(tokens) never going back, finite
        floats, token ids in [0, vocab_size) (vocab_size None: only >= 0), a 0/1 loss mask."""
        def bad(msg: str):
            raise InvalidBatch(f"{where}: {msg}")

        for k in ARRAYS:
            v = getattr(self, k)
            if not isinstance(v, np.ndarray) or v.ndim != 1:
                bad(f"{k} must be a 1-d array, found shape {getattr(v, 'shape', type(v).__name__)}")
            kinds = "f" if k in _FLOAT else ("iub" if k == "loss_mask" else "iu")
            if v.dtype.kind not in kinds:
                bad(f"{k} has dtype {v.dtype}, expected {'a float' if k in _FLOAT else 'an integer'} type")
        n_tok = len(self.tokens)
        off = self.offsets.astype(np.int64)
        if len(off) == 0 or off[0] != 0:
            bad(f"offsets must start at 0, found {off[:1].tolist() or 'no offsets'}")
        if (back := np.diff(off) < 0).any():
            i = _first(back) + 1
            bad(f"offsets decrease at offsets[{i}] = {off[i]} after offsets[{i - 1}] = {off[i - 1]}")
        if off[-1] != n_tok:
            bad(f"offsets end at {off[-1]} but there are {n_tok} tokens")
        for k in PER_TOKEN[1:]:
            if len(getattr(self, k)) != n_tok:
                bad(f"{k} has {len(getattr(self, k))} entries, tokens has {n_tok}")
        for k in PER_SAMPLE:
            if len(getattr(self, k)) != self.num_samples:
                bad(f"{k} has {len(getattr(self, k))} entries for {self.num_samples} samples (offsets)")
        r = self.routed_experts
        if r is not None:
            if not isinstance(r, np.ndarray) or r.ndim != 3 or r.dtype not in (np.uint8, np.uint16):
                bad(f"routed_experts must be uint8/uint16 [tokens, layers, top_k], found "
                    f"{getattr(r, 'dtype', type(r).__name__)} {getattr(r, 'shape', '')}")
            if len(r) != n_tok:
                bad(f"routed_experts has {len(r)} rows, tokens has {n_tok}")
        for k in _FLOAT:
            v = getattr(self, k)
            if (nf := ~np.isfinite(v)).any():
                i = _first(nf)
                bad(f"{k}[{i}] = {v[i]} is not finite ({int(nf.sum())} non-finite of {len(v)})")
        if n_tok:
            lo, hi = int(self.tokens.min()), int(self.tokens.max())
            if lo < 0:
                bad(f"tokens[{_first(self.tokens < 0)}] = {lo} is a negative token id")
            if vocab_size is not None and hi >= vocab_size:
                bad(f"tokens[{_first(self.tokens >= vocab_size)}] = {hi} is outside the vocabulary "
                    f"[0, {vocab_size})")
        if ((self.loss_mask != 0) & (self.loss_mask != 1)).any():
            i = _first((self.loss_mask != 0) & (self.loss_mask != 1))
            bad(f"loss_mask[{i}] = {self.loss_mask[i]}, must be 0 or 1")
        v = self.versions.astype(np.int64)
        if (off := (v < -1) | (v > MAX_STEP)).any():
            i = _first(off)
            bad(f"versions[{i}] = {v[i]} is not a policy version (>= 0) nor -1 (a token no policy generated)")
        if (off := (self.logprobs < LOGPROB_MIN) | (self.logprobs > LOGPROB_MAX)).any():
            i = _first(off)
            bad(f"logprobs[{i}] = {self.logprobs[i]} is not a logprob (in [{LOGPROB_MIN:g}, 0]; "
                f"{int(off.sum())} such of {n_tok})")
