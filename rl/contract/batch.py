"""The rollout batch: what the orchestrator hands the trainer for one step, and how it lies on disk.

Samples have different lengths, so a batch is packed: one flat token array and offsets, the layout the
trainer's sequence packing wants anyway. Per token it carries the loss mask (1 = a token the policy
generated and is trained on; 0 = prompt, tool output, observation), the logprob the inference engine
assigned when sampling it and the policy version that produced it (-1 for tokens the policy did not
generate). Per sample: reward, advantage, group id. Optionally routed expert ids recorded at inference,
[tokens, layers, top_k], as uint8 while every id fits (up to 256 experts) and as uint16 beyond (Kimi-K2
routes to 384 experts, GLM-5 to 256): the narrowest width that holds the family's ids, since for a long
SWE episode these ids outweigh every other per-token field (GLM-5: 600 B a token against 13).

On disk (a published `rollouts/step_N`, numpy arrays in safetensors files, no pickle, no torch):
- `meta.json`: the batch's bookkeeping, and `layout`, the shard table: which samples each trainer data
  rank trains and in which micro-batches (`ShardPlan`);
- `samples.safetensors`: the per-sample arrays of the whole batch (offsets, rewards, advantages, groups,
  and per sample its loss tokens, their version sum and minimum: the step's totals without the tokens);
- `shard_<r>.safetensors`, one per data rank: the per-token arrays of exactly the samples rank r trains.
Each file has its own sha256 in the manifest, so a trainer rank reads and verifies meta.json, the small
index and its own shard: its share of the bytes, not the batch (128 ranks reading a 10 GB batch whole
would read 1.3 TB a step). The orchestrator cuts the shards by the rule the trainer packs by (greedy in
order to `trainer.micro_batch_tokens`, micro-batches round robin over data ranks: `micro_batches`), read
from the config both share. `RolloutBatch.load` reads every shard back into the whole batch in sample
order (tools; a trainer whose layout differs from the batch's, e.g. resumed with another parallelism).

Building is array work (rl.contract.batch_files: the files, `ShardPlan`, the writers): `write_samples`
fills each rank's shard from the samples' numpy arrays (routes may be memory maps of the orchestrator's
spill files, their pages dropped once copied) and writes each file straight from memory while hashing,
so the orchestrator holds one shard at a time, never the batch nor a Python list per token.

What a reader checks before training is rl.contract.batch_checks (InvalidBatch with a one-line reason).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rl.contract import record_schemas, safefs
from rl.contract.batch_checks import (  # noqa: F401  (re-exported: the batch's API)
    ARRAYS, MAX_ADVANTAGE, PER_SAMPLE, PER_TOKEN, ChecksumMismatch, InvalidBatch, check_arrays, check_layout,
    check_meta, read_file, read_routes, read_safetensors, version_bound)
from rl.contract.batch_files import (  # noqa: F401  (re-exported: the batch's API)
    INDEX, INDEX_FILE, META_FILE, SHARD, ShardPlan, _index, _write, batch_digest, expert_ids, micro_batches,
    route_file, shard_file, write_arrays, write_samples)

_MAX_META = 256 << 20   # meta.json lists a few numbers per sample; a file beyond this is not one

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


@dataclass
class Sample:
    """One rollout; the id/logprob/version/mask fields are lists or numpy arrays."""
    prompt_ids: Any
    completion_ids: Any
    completion_logprobs: Any
    completion_versions: Any
    reward: float
    group: int
    advantage: float = 0.0
    # 1 where the completion token is the policy's own (multi-turn rollouts put observations in between)
    completion_mask: Any = None
    routed_experts: np.ndarray | None = None  # [prompt+completion tokens, layers, top_k]; may be a memmap
    info: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    def arrays(self) -> dict[str, np.ndarray]:
        """Its per-token arrays in the batch layout (prompt then completion)."""
        p = np.asarray(self.prompt_ids, np.int32)
        c = np.asarray(self.completion_ids, np.int32)
        lp = np.asarray(self.completion_logprobs, np.float32)
        v = np.asarray(self.completion_versions, np.int32)
        if not (len(lp) == len(v) == len(c)):
            raise ValueError("completion ids, logprobs and versions differ in length")
        cm = np.ones(len(c), np.uint8) if self.completion_mask is None else \
            np.asarray(self.completion_mask).astype(np.uint8)
        if len(cm) != len(c):
            raise ValueError(f"completion mask has {len(cm)} entries for {len(c)} completion tokens")
        z = np.zeros(len(p), np.uint8)
        return {"tokens": np.concatenate([p, c]), "loss_mask": np.concatenate([z, cm]),
                "logprobs": np.concatenate([z.astype(np.float32), np.where(cm > 0, lp, np.float32(0))]),
                "versions": np.concatenate([np.full(len(p), -1, np.int32), np.where(cm > 0, v, np.int32(-1))])}


def _concat(parts: list[dict[str, np.ndarray]], lengths: np.ndarray) -> dict[str, np.ndarray]:
    dtypes = {"tokens": np.int32, "loss_mask": np.uint8, "logprobs": np.float32, "versions": np.int32}
    out = {k: np.concatenate([p[k] for p in parts]) if parts else np.zeros(0, dt) for k, dt in dtypes.items()}
    out["offsets"] = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
    return out


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
    # A data rank's share (load_share): {"rank", "data_ranks", "micro_batch_tokens", "micro_batches" (this
    # rank's, sample counts), "total_micro_batches", "samples" (global indices), "rows_per_rank"}; None for
    # a whole batch.
    share: dict | None = None
    # The whole batch's totals (samples, tokens, loss_tokens, reward_mean, version_sum, version_min).
    totals: dict | None = None

    @property
    def num_samples(self) -> int:
        return len(self.offsets) - 1

    def sample_slice(self, i: int) -> slice:
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))

    @classmethod
    def from_samples(cls, samples: list[Sample], meta: dict | None = None) -> "RolloutBatch":
        per = [s.arrays() for s in samples]
        lengths = np.asarray([len(p["tokens"]) for p in per], np.int64)
        c = _concat(per, lengths)
        rex = [s.routed_experts for s in samples if s.routed_experts is not None]
        if rex and len(rex) != len(samples):
            raise ValueError("routed experts recorded for some samples only")
        return cls(**c, rewards=np.asarray([s.reward for s in samples], np.float32),
                   advantages=np.asarray([s.advantage for s in samples], np.float32),
                   groups=np.asarray([s.group for s in samples], np.int32),
                   routed_experts=expert_ids(np.concatenate([np.asarray(r) for r in rex])) if rex else None,
                   meta=meta or {})

    def save(self, out_dir: Path, plan: ShardPlan | None = None) -> dict[str, dict]:
        """Write this (whole) batch into `out_dir` in the on-disk layout, cut by `plan` (default: one
        shard); returns the manifest entries of the files."""
        lengths = np.diff(self.offsets).astype(np.int64)
        masks = [(self.loss_mask[self.sample_slice(i)], self.versions[self.sample_slice(i)])
                 for i in range(self.num_samples)]
        index = _index(lengths, self.rewards, self.advantages, self.groups, masks)

        def rank_arrays(idx: list[int]) -> dict[str, np.ndarray]:
            sl = [self.sample_slice(i) for i in idx]
            out = {k: np.concatenate([getattr(self, k)[s] for s in sl]) if sl else getattr(self, k)[:0]
                   for k in PER_TOKEN}
            out["offsets"] = np.concatenate([[0], np.cumsum(lengths[idx], dtype=np.int64)]).astype(np.int64)
            if self.routed_experts is not None:
                out["routed_experts"] = np.concatenate([self.routed_experts[s] for s in sl]) if sl else \
                    self.routed_experts[:0]
            return out
        return _write(Path(out_dir), self.meta, plan or ShardPlan(), lengths, index, rank_arrays)

    @classmethod
    def load(cls, step_dir: Path, vocab_size: int | None = None, files: dict | None = None) -> "RolloutBatch":
        """The whole batch of a step directory (every shard, in sample order), validated; InvalidBatch if
        it is malformed (ChecksumMismatch with `files`, the manifest's entries; I/O errors propagate)."""
        meta, index, _ = _read_head(Path(step_dir), files)
        return _assemble(Path(step_dir), meta, index, files, vocab_size)[0]

    def validate_meta(self, group_size: int | None = None, where: str = "rollout batch meta") -> None:
        """Raise InvalidBatch unless meta.json's bookkeeping describes these arrays (batch_checks.check_meta)."""
        check_meta(self.meta, self.groups, self.rewards, group_size, where)

    def validate(self, vocab_size: int | None = None, where: str = "rollout batch",
                 max_version: int | None = None) -> None:
        """Raise InvalidBatch unless the trainer can train on this batch (batch_checks.check_arrays;
        `max_version`: the newest version it may hold, where known)."""
        check_arrays(self, vocab_size, where, max_version=max_version)


def _totals(index: dict) -> dict:
    loss = index["loss_tokens"]
    return {"samples": len(index["rewards"]), "tokens": int(index["offsets"][-1]),
            "loss_tokens": int(loss.sum()), "version_sum": int(index["version_sum"].sum()),
            "version_min": int(index["version_min"][loss > 0].min()) if (loss > 0).any() else None,
            "reward_mean": float(index["rewards"].mean()) if len(loss) else math.nan}


def _assemble(step_dir: Path, meta: dict, index: dict, files: dict | None, vocab_size: int | None
              ) -> tuple[RolloutBatch, int]:
    """Every shard read back into the whole batch, in sample order; (batch, bytes read)."""
    layout = meta["layout"]
    n = len(index["rewards"])
    parts, order, n_read = [], [], 0
    newest = version_bound(step_dir)
    for r in range(len(layout["ranks"])):
        got, nread = _read_shard(step_dir, r, layout, index, files, vocab_size, newest, meta.get("route_files"))
        parts.append(got)
        n_read += nread
        order += layout["ranks"][r]["samples"]
    order = np.asarray(order, np.int64)
    lengths = np.diff(index["offsets"])
    starts = np.concatenate([[0], np.cumsum(lengths[order])]).astype(np.int64)
    pos = np.empty(n, np.int64)
    pos[order] = np.arange(n)   # where each sample sits in the shards' concatenation
    take = np.concatenate([np.arange(starts[pos[i]], starts[pos[i]] + lengths[i]) for i in range(n)]) \
        if n else np.zeros(0, np.int64)
    keys = [*PER_TOKEN, *(["routed_experts"] if parts and all("routed_experts" in p for p in parts) else [])]
    cat = {k: np.concatenate([p[k] for p in parts]) for k in keys}
    batch = RolloutBatch(**{k: cat[k][take] for k in PER_TOKEN}, offsets=index["offsets"].astype(np.int64),
                         rewards=index["rewards"], advantages=index["advantages"], groups=index["groups"],
                         routed_experts=cat["routed_experts"][take] if "routed_experts" in cat else None,
                         meta=meta, totals=_totals(index))
    check_arrays(batch, vocab_size, str(step_dir), max_version=newest)
    return batch, n_read


def _read(step_dir: Path, name: str, files: dict | None) -> memoryview:
    info = None if files is None else files.get(name)
    if files is not None and info is None:
        raise ChecksumMismatch(f"{step_dir / name}: not in the step's manifest")
    data, _ = read_file(step_dir / name, None if info is None else info.get("sha256"),
                        None if info is None else info.get("size"))
    return data


def _read_head(step_dir: Path, files: dict | None) -> tuple[dict, dict, int]:
    """meta.json and the sample index, checked against each other; (meta, index, bytes read)."""
    mf = step_dir / META_FILE
    try:
        raw = safefs.read_bytes(mf, limit=_MAX_META)
        want = None if files is None else (files.get(META_FILE) or {}).get("sha256")
        if files is not None and (want is None or hashlib.sha256(raw).hexdigest() != want):
            raise ChecksumMismatch(f"{mf}: sha256 does not match the manifest")
        meta = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidBatch(f"{mf}: not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise InvalidBatch(f"{mf}: must be a JSON object, found {type(meta).__name__}")
    data = _read(step_dir, INDEX_FILE, files)
    a = read_safetensors(step_dir / INDEX_FILE, data)
    f = step_dir / INDEX_FILE
    if missing := [k for k in INDEX if k not in a]:
        raise InvalidBatch(f"{f}: no array {missing[0]!r} (the sample index has {', '.join(INDEX)})")
    if extra := sorted(set(a) - set(INDEX)):
        raise InvalidBatch(f"{f}: unknown array {extra[0]!r} (the sample index has {', '.join(INDEX)})")
    n = len(a["offsets"]) - 1
    for k in INDEX:
        kinds = "f" if k in ("rewards", "advantages") else "iu"
        if a[k].ndim != 1 or a[k].dtype.kind not in kinds:
            raise InvalidBatch(f"{f}: {k} must be a 1-d array of {'floats' if kinds == 'f' else 'integers'}, "
                               f"found {a[k].dtype} {a[k].shape}")
        if k != "offsets" and len(a[k]) != n:
            raise InvalidBatch(f"{f}: {k} has {len(a[k])} entries for {n} samples (offsets)")
    off = a["offsets"].astype(np.int64)
    if n < 0 or off[0] != 0:
        raise InvalidBatch(f"{f}: offsets must start at 0, found {off[:1].tolist() or 'no offsets'}")
    if (back := np.diff(off) < 0).any():
        i = int(np.flatnonzero(back)[0]) + 1
        raise InvalidBatch(f"{f}: offsets decrease at offsets[{i}] = {off[i]} after offsets[{i - 1}] = {off[i - 1]}")
    for k in ("rewards", "advantages"):
        if (nf := ~np.isfinite(a[k])).any():
            i = int(np.flatnonzero(nf)[0])
            raise InvalidBatch(f"{f}: {k}[{i}] = {a[k][i]} is not finite ({int(nf.sum())} non-finite of {n})")
    check_meta(meta, a["groups"], a["rewards"], where=str(mf))
    check_layout(meta.get("layout"), n, where=str(mf))
    return meta, a, len(raw) + len(data)


def _read_routes(step_dir: Path, idx: np.ndarray, lengths: np.ndarray, files: dict | None,
                 row: list) -> tuple[np.ndarray, int]:
    """The route files (meta `route_files` = [layers, top_k]: rollout workers' parts) of samples `idx`,
    each verified against the manifest and its sample, read into one array in order; (rows, bytes read)."""
    names = [route_file(i) for i in idx.tolist()]
    if files is not None and (missing := [n for n in names if n not in files]):
        raise ChecksumMismatch(f"{step_dir / missing[0]}: not in the step's manifest")
    wants = [None if files is None else (files[n].get("sha256"), files[n].get("size")) for n in names]
    return read_routes([step_dir / n for n in names], wants, [int(lengths[i]) for i in idx.tolist()], row)


def _read_shard(step_dir: Path, rank: int, layout: dict, index: dict, files: dict | None,
                vocab_size: int | None, step: int | None = None, route_files: list | None = None
                ) -> tuple[dict[str, np.ndarray], int]:
    """Shard `rank`'s per-token arrays, checked against the index (its samples' lengths, loss tokens and
    versions) and as a batch (check_arrays; versions at most `step`, the batch's `version_bound`, group
    ids those of the whole batch); with `route_files` ([layers, top_k]), its samples' routes from their
    route files. Returns (arrays, bytes of arrays read)."""
    f = step_dir / shard_file(rank)
    a = dict(read_safetensors(f, _read(step_dir, shard_file(rank), files)))
    if missing := [k for k in SHARD if k not in a]:
        raise InvalidBatch(f"{f}: no array {missing[0]!r} (a shard has {', '.join(SHARD)})")
    if extra := sorted(set(a) - set(SHARD) - {"routed_experts"}):
        raise InvalidBatch(f"{f}: unknown array {extra[0]!r} (a shard has {', '.join(SHARD)}, routed_experts)")
    idx = np.asarray(layout["ranks"][rank]["samples"], np.int64)
    n_read = sum(v.nbytes for v in a.values())
    if route_files:
        if "routed_experts" in a:
            raise InvalidBatch(f"{f}: routed_experts in a shard of a batch whose routes are route files")
        a["routed_experts"], n_routes = _read_routes(step_dir, idx, np.diff(index["offsets"]), files, route_files)
        n_read += n_routes
    b = RolloutBatch(tokens=a["tokens"], offsets=a["offsets"], loss_mask=a["loss_mask"], logprobs=a["logprobs"],
                     versions=a["versions"], rewards=index["rewards"][idx], advantages=index["advantages"][idx],
                     groups=index["groups"][idx], routed_experts=a.get("routed_experts"))
    check_arrays(b, vocab_size, where=str(f), max_version=step, num_samples=len(index["rewards"]))
    want = np.diff(index["offsets"])[idx]
    if len(a["offsets"]) != len(idx) + 1 or not np.array_equal(np.diff(a["offsets"]), want):
        raise InvalidBatch(f"{f}: its samples' lengths are not those of samples {record_schemas.shown(idx.tolist())} "
                           f"in {INDEX_FILE}")
    starts = a["offsets"][:-1]
    on = a["loss_mask"].astype(np.int64)
    if len(idx) and len(a["tokens"]):
        loss = np.add.reduceat(on, starts) * (want > 0)
        vsum = np.add.reduceat(np.where(on > 0, a["versions"].astype(np.int64), 0), starts) * (want > 0)
        if not (np.array_equal(loss, index["loss_tokens"][idx]) and np.array_equal(vsum, index["version_sum"][idx])):
            raise InvalidBatch(f"{f}: its loss tokens or their versions differ from {INDEX_FILE}'s totals")
    return {**{k: a[k] for k in PER_TOKEN}, **({"routed_experts": a["routed_experts"]}
                                               if "routed_experts" in a else {})}, n_read


def load_share(step_dir: Path, data_rank: int, vocab_size: int | None = None, files: dict | None = None,
               plan: ShardPlan | None = None) -> tuple[RolloutBatch, int]:
    """Data rank `data_rank`'s share of a step: meta.json, the sample index and its own shard, each read
    once and (with `files`, the manifest's entries) hashed as read. Returns (the share as a RolloutBatch
    with `share` and `totals` set, bytes read). When the batch was cut for another layout than `plan`
    (the reader's data ranks and micro-batch size, None: any; a resumed run with another parallelism) or
    not cut at all (written unpacked, one shard), the whole batch is returned instead, `share` None. InvalidBatch / ChecksumMismatch if
    anything is wrong."""
    step_dir = Path(step_dir)
    meta, index, n_read = _read_head(step_dir, files)
    layout = meta["layout"]
    if plan is not None and (layout["micro_batch_tokens"] is None or layout["data_ranks"] != plan.data_ranks or
                             plan.micro_batch_tokens not in (None, layout["micro_batch_tokens"])):
        whole, n = _assemble(step_dir, meta, index, files, vocab_size)
        return whole, n_read + n
    if not 0 <= data_rank < len(layout["ranks"]):
        raise InvalidBatch(f"{step_dir / META_FILE}: layout has {len(layout['ranks'])} data ranks, no rank "
                           f"{data_rank}")
    a, n_shard = _read_shard(step_dir, data_rank, layout, index, files, vocab_size, version_bound(step_dir),
                             meta.get("route_files"))
    e = layout["ranks"][data_rank]
    idx = np.asarray(e["samples"], np.int64)
    lengths = np.diff(index["offsets"])[idx]
    share = RolloutBatch(**{k: a[k] for k in PER_TOKEN},
                         offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                         rewards=index["rewards"][idx], advantages=index["advantages"][idx],
                         groups=index["groups"][idx], routed_experts=a.get("routed_experts"), meta=meta,
                         share={"rank": data_rank, "data_ranks": layout["data_ranks"],
                                "micro_batch_tokens": layout["micro_batch_tokens"],
                                "micro_batches": list(e["micro_batches"]),
                                "total_micro_batches": layout["micro_batches"], "samples": e["samples"],
                                # the most micro-batches any rank trains: every rank runs that many rows
                                "rows_per_rank": max(len(x["micro_batches"]) for x in layout["ranks"])},
                         totals=_totals(index))
    return share, n_read + n_shard

