"""How a rollout batch lies on disk and how it is cut: the files, the shard plan, the writers.

A published `rollouts/step_N` is `meta.json` (bookkeeping and `layout`, the shard table), the sample index
`samples.safetensors` (per-sample arrays of the whole batch) and one `shard_<r>.safetensors` per trainer
data rank (per-token arrays of exactly the samples rank r trains). `ShardPlan` cuts a batch into the
micro-batches the trainer packs (`micro_batches`: greedy in order to trainer.micro_batch_tokens) and deals
them to the data ranks by tokens, so each rank reads an even share and trains the micro-batches the
layout gives it.

The writers work from numpy arrays: `write_samples` fills one shard at a time, sample by sample (a sample
is anything with `arrays()`, `len()`, reward, advantage, group and routed_experts: rl.contract.batch.Sample),
handing each sample's mapped routes back to the kernel once copied; `write_arrays` writes a file straight
from memory while hashing it (no serialized copy) and returns the manifest entry rl.exchange.commit takes
without reading the file again. rl.contract.batch holds the batch type and its readers.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from rl.contract import safefs
from rl.contract.batch_checks import PER_SAMPLE, PER_TOKEN
from rl.contract.record_schemas import MAX_STEP

META_FILE = "meta.json"
INDEX_FILE = "samples.safetensors"
INDEX = ("offsets", *PER_SAMPLE, "loss_tokens", "version_sum", "version_min")
SHARD = ("tokens", "offsets", *PER_TOKEN[1:])   # and routed_experts when recorded
_NP_CODE = {np.dtype(np.int32): "I32", np.dtype(np.int64): "I64", np.dtype(np.uint8): "U8",
            np.dtype(np.uint16): "U16", np.dtype(np.float32): "F32"}


def shard_file(rank: int) -> str:
    return f"shard_{rank:05d}.safetensors"


def route_file(sample: int) -> str:
    """A batch whose routes came as rollout workers' part files (meta `route_files`): sample i's rows."""
    return f"routes_{sample:06d}.safetensors"


def expert_ids(r: np.ndarray) -> np.ndarray:
    """Expert ids in the batch layout: uint8 when they all fit, else uint16 (up to 65536 experts)."""
    r = np.asarray(r)
    if r.dtype in (np.uint8, np.uint16) and r.dtype == np.min_scalar_type(int(r.max(initial=0))):
        return r
    if r.size and (r.min() < 0 or r.max() > np.iinfo(np.uint16).max):
        raise ValueError(f"expert ids must lie in [0, 65535], got [{r.min()}, {r.max()}]")
    return r.astype(np.uint8 if r.max(initial=0) <= np.iinfo(np.uint8).max else np.uint16)


def micro_batches(lengths: np.ndarray, max_tokens: int) -> list[tuple[int, int]]:
    """The trainer's packing rule: greedy, in order, whole samples into micro-batches of at most
    `max_tokens` tokens (a longer sample gets one of its own). [start, end) sample ranges."""
    out, start, size = [], 0, 0
    for i, n in enumerate(np.asarray(lengths, np.int64).tolist()):
        if i > start and size + n > max_tokens:
            out.append((start, i))
            start, size = i, 0
        size += n
    if len(lengths):
        out.append((start, len(lengths)))
    return out


@dataclass(frozen=True)
class ShardPlan:
    """How a batch is cut for the trainer: its data ranks (dp_shard x ep; cp ranks of one data rank read
    the same shard) and the micro-batch size it packs to. None: not packed here (one shard, the trainer
    packs it whole)."""
    data_ranks: int = 1
    micro_batch_tokens: int | None = None

    @classmethod
    def from_config(cls, cfg) -> "ShardPlan":
        p = cfg.trainer.parallel
        return cls(int(p.dp_shard) * int(p.ep), int(cfg.trainer.micro_batch_tokens))

    def layout(self, lengths: np.ndarray) -> dict:
        """meta.json's `layout`: per data rank its samples (in the order it trains them) and micro-batches
        (sample counts). Micro-batches are dealt by tokens, largest first to the rank holding the fewest
        (ties to the lowest rank), each rank keeping them in batch order: the ranks' shares of the bytes
        and of the work come out even (the step waits for the slowest rank), where dealing micro-batch m
        to rank m mod D could give one rank a long episode more than another."""
        if self.micro_batch_tokens is None:
            if self.data_ranks != 1:
                raise ValueError("a batch for several data ranks is cut by micro_batch_tokens")
            n = len(lengths)
            return {"data_ranks": 1, "micro_batch_tokens": None, "micro_batches": int(n > 0),
                    "ranks": [{"samples": list(range(n)), "micro_batches": [n] if n else []}]}
        mbs = micro_batches(lengths, self.micro_batch_tokens)
        lengths = np.asarray(lengths, np.int64)
        size = [int(lengths[a:b].sum()) for a, b in mbs]
        load, mine = [0] * self.data_ranks, [[] for _ in range(self.data_ranks)]
        for m in sorted(range(len(mbs)), key=lambda m: (-size[m], m)):
            r = min(range(self.data_ranks), key=lambda r: (load[r], r))
            load[r] += size[m]
            mine[r].append(m)
        ranks = [{"samples": [i for m in sorted(ms) for i in range(*mbs[m])],
                  "micro_batches": [mbs[m][1] - mbs[m][0] for m in sorted(ms)]} for ms in mine]
        return {"data_ranks": self.data_ranks, "micro_batch_tokens": self.micro_batch_tokens,
                "micro_batches": len(mbs), "ranks": ranks}


def write_arrays(path: Path, arrays: dict[str, np.ndarray]) -> dict:
    """Write `arrays` as a safetensors file straight from their memory, hashing as it goes (no serialized
    copy); returns the manifest entry {size, sha256} (the file is fsynced: rl.exchange.commit(known=))."""
    arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    header, off = {}, 0
    for k, v in arrays.items():
        header[k] = {"dtype": _NP_CODE[v.dtype], "shape": list(v.shape), "data_offsets": [off, off + v.nbytes]}
        off += v.nbytes
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)   # safetensors aligns the data to 8 bytes
    head = len(h).to_bytes(8, "little") + h
    sha = hashlib.sha256(head)
    fd = safefs.open_write(path, exclusive=True)
    try:
        _write_all(fd, memoryview(head))
        for v in arrays.values():
            mv = memoryview(v.reshape(-1).view(np.uint8)) if v.size else memoryview(b"")
            sha.update(mv)
            _write_all(fd, mv)
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"size": len(head) + off, "sha256": sha.hexdigest()}


def _write_all(fd: int, mv: memoryview) -> None:
    while len(mv):
        mv = mv[os.write(fd, mv[: 1 << 30]):]


def _write_json(path: Path, obj: dict) -> dict:
    data = json.dumps(obj, indent=1, sort_keys=True).encode()
    fd = safefs.open_write(path, exclusive=True)
    try:
        _write_all(fd, memoryview(data))
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _index(lengths, rewards, advantages, groups, per_sample_mask_versions) -> dict[str, np.ndarray]:
    loss, vsum, vmin = [], [], []
    for mask, vers in per_sample_mask_versions:
        on = vers[mask > 0].astype(np.int64)
        loss.append(len(on))
        vsum.append(int(on.sum()))
        vmin.append(int(on.min()) if len(on) else MAX_STEP)
    return {"offsets": np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64),
            "rewards": np.asarray(rewards, np.float32), "advantages": np.asarray(advantages, np.float32),
            "groups": np.asarray(groups, np.int32), "loss_tokens": np.asarray(loss, np.int64),
            "version_sum": np.asarray(vsum, np.int64), "version_min": np.asarray(vmin, np.int64)}


def _write(out_dir: Path, meta: dict, plan: ShardPlan, lengths: np.ndarray, index: dict,
           rank_arrays: Callable[[list[int]], dict[str, np.ndarray]]) -> dict[str, dict]:
    layout = plan.layout(lengths)
    known = {}
    for r, e in enumerate(layout["ranks"]):
        arrays = rank_arrays(e["samples"])
        known[shard_file(r)] = write_arrays(Path(out_dir) / shard_file(r), arrays)
        del arrays   # one shard in memory at a time
    known[INDEX_FILE] = write_arrays(Path(out_dir) / INDEX_FILE, index)
    known[META_FILE] = _write_json(Path(out_dir) / META_FILE, {**meta, "layout": layout})
    return known


def write_samples(out_dir: Path, samples: list, meta: dict, plan: ShardPlan | None = None
                  ) -> dict[str, dict]:
    """Write a batch of `samples` into the step directory `out_dir`, cut by `plan`; returns the manifest
    entries (size, sha256) of the files written, for rl.exchange.commit(known=).

    Memory: one shard's arrays at a time, filled sample by sample; a sample's routes (a memory map of the
    orchestrator's spill file) are copied in and their pages handed back to the kernel at once
    (`_drop_pages`), so the mapped file never accumulates in the process's resident set. Samples whose
    routes are part files (anything with `move_to`: rl.orchestrator.parts.RoutePart) are not copied:
    each part is renamed into `out_dir` as `route_file(i)`, its entry the writer's, and meta.json's
    `route_files` gives the rows' [layers, top_k]."""
    plan = plan or ShardPlan()
    lengths = np.asarray([len(s) for s in samples], np.int64)
    routed = [s.routed_experts is not None for s in samples]
    if any(routed) and not all(routed):
        raise ValueError("routed experts recorded for some samples only")
    stats = []
    for s in samples:   # the index's per-sample totals, one sample's 13 B/token arrays at a time
        a = s.arrays()
        stats.append((a["loss_mask"], a["versions"]))
    index = _index(lengths, [s.reward for s in samples], [s.advantage for s in samples],
                   [s.group for s in samples], stats)
    del stats
    files = all(routed) and bool(routed) and all(hasattr(s.routed_experts, "move_to") for s in samples)
    if routed and all(routed):
        shapes = {tuple(np.shape(s.routed_experts)[1:]) for s in samples}
        if len(shapes) != 1:
            raise ValueError(f"routed experts of several shapes in one batch: {sorted(shapes)}")
        (row_shape,) = shapes
        wide = any(np.dtype(s.routed_experts.dtype) not in (np.uint8,) for s in samples)
    known = {}
    if files:   # rollout workers' part files (rl.orchestrator.parts): renamed in, never read here
        for i, s in enumerate(samples):
            if len(s.routed_experts) != lengths[i]:
                raise ValueError(f"sample {i}: routed experts cover {len(s.routed_experts)} tokens, the sample "
                                 f"has {lengths[i]}")
        for i, s in enumerate(samples):
            known[route_file(i)] = s.routed_experts.move_to(Path(out_dir) / route_file(i))
        meta = {**meta, "route_files": [int(x) for x in row_shape]}

    def rank_arrays(idx: list[int]) -> dict[str, np.ndarray]:
        n = int(lengths[idx].sum()) if idx else 0
        out = {"tokens": np.empty(n, np.int32), "loss_mask": np.empty(n, np.uint8),
               "logprobs": np.empty(n, np.float32), "versions": np.empty(n, np.int32),
               "offsets": np.concatenate([[0], np.cumsum(lengths[idx], dtype=np.int64)]).astype(np.int64)}
        if routed and all(routed) and not files:
            out["routed_experts"] = np.empty((n, *row_shape), np.uint16 if wide else np.uint8)
        off = 0
        for i in idx:
            a, m = samples[i].arrays(), int(lengths[i])
            for k in PER_TOKEN:
                out[k][off:off + m] = a[k]
            if "routed_experts" in out:
                r = samples[i].routed_experts
                if len(r) != m:
                    raise ValueError(f"sample {i}: routed experts cover {len(r)} tokens, the sample has {m}")
                if r.dtype.kind != "u" or r.dtype.itemsize > 2:   # a wider type could wrap when stored
                    if r.size and (np.asarray(r).min() < 0 or np.asarray(r).max() > np.iinfo(np.uint16).max):
                        raise ValueError(f"sample {i}: expert ids must lie in [0, 65535]")
                out["routed_experts"][off:off + m] = r
                _drop_pages(r)
            off += m
        if "routed_experts" in out and wide:
            out["routed_experts"] = expert_ids(out["routed_experts"])   # uint8 when every id fits after all
        return out
    return {**known, **_write(out_dir, meta, plan, lengths, index, rank_arrays)}


def _drop_pages(r) -> None:
    """Hand a memory map's pages back to the kernel (MADV_DONTNEED: re-read from the file if touched
    again); a plain array is left alone."""
    mm = getattr(r, "_mmap", None)
    if mm is not None and hasattr(mm, "madvise"):
        import mmap
        try:
            mm.madvise(mmap.MADV_DONTNEED)
        except (ValueError, OSError):   # closed, or a mapping the kernel will not advise: only memory
            pass


def batch_digest(files: dict) -> str:
    """One sha256 naming a published batch: over its files' names and sha256s (what consumed.jsonl
    records for the batch a step trained)."""
    h = hashlib.sha256()
    for name in sorted(files):
        if name in (META_FILE, INDEX_FILE) or name.startswith(("shard_", "routes_")):
            h.update(f"{name}\0{files[name].get('sha256', '')}\n".encode())
    return h.hexdigest()
