"""Sparse weight deltas: a version stored as the bytes that changed since the previous one.

Measured on the debug model's trainer (Adam, lr 1e-6) and in benchmarks/weight_sync.py: between two
consecutive versions every 128x128 FP8 block changes (its scale moves with its amax), but only 0.15-0.22%
of the e4m3 values do. So a delta is kept per *byte*, not per block: for each stored tensor whose changed
bytes, as int32 positions plus values, cost at most `max_fraction` of it, the step holds
`<name>::idx` (positions in the flat byte view) and `<name>::val` (the new bytes); every other tensor (the
fp32 scales, high-precision tensors that changed a lot) is stored whole. About 1% of the FP8 bytes.

A delta step is an ordinary published weights directory plus `delta.json` {"base": N-1}; checksums.json
lists its sparse tensors with dtype and shape, the digests of the idx/val entries (what is read is what is
verified) and the digest of every tensor *as rebuilt*, so a reconstruction against the wrong base is
caught. Each trainer rank diffs against its own copy of what it published last (`WeightPublisher`); a full
version comes every `trainer.weights_full_every` steps, after a restart and whenever the previous version
was not this incarnation's, so a chain is never longer than that. Retention keeps the chain of every kept
step (rl.exchange.retention.prune). Readers rebuild from their own copy of the base (an inference worker keeps the
wire form of what it serves) or, without one, from the chain (`stored_tensors`).
"""
from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from pathlib import Path
from typing import Callable, Mapping

import torch

from rl import fp8
from rl.exchange.files import CorruptStep
from rl.exchange.steps import delta_base, delta_chain
from rl.contract import safefs
from rl.contract.atomic import atomic_write_json
from rl.exchange import shards
from rl.exchange.shard_reader import ShardReader, VerifiedOnNode
from rl.exchange.layout import default_quantize

DELTA, IDX, VAL = shards.DELTA, shards.IDX, shards.VAL


def write_delta_part(out_dir: Path, rank: int, tensors: Mapping[str, torch.Tensor], *,
                     prev: Mapping[str, torch.Tensor], keep: dict, base: int, fp8_enabled: bool = True,
                     wire_dtype: torch.dtype = torch.bfloat16,
                     quantize: Callable[[str, torch.Tensor], bool] | None = None, block: int = fp8.BLOCK,
                     max_fraction: float = 0.25, buffers: list | None = None, **_) -> dict:
    """This rank's part of a delta step against version `base`, whose stored bytes this rank kept in
    `prev` (name -> flat uint8). Fills `keep` with this version's stored bytes. Returns the part record
    (as `shards.write_part`, plus "delta_base", "sparse", "entries")."""
    quantize = quantize or default_quantize
    outs = shards.plan_outputs(tensors, fp8_enabled=fp8_enabled, wire_dtype=wire_dtype, quantize=quantize,
                               block=block)
    pool = buffers or [shards.Buffers(), shards.Buffers()]
    spent = {"quantize": 0.0, "hash": 0.0, "write": 0.0, "diff": 0.0}
    handoff: queue.Queue = queue.Queue()
    handoff.free, handoff.cancel = queue.Queue(), threading.Event()
    for b in pool:
        handoff.free.put(b)
    producer = threading.Thread(target=shards._wire_tensors, args=(outs, tensors, pool, block, handoff, spent),
                                name=f"quantize-rank{rank}", daemon=True)
    producer.start()
    part = {"rank": rank, "files": {}, "tensors": {}, "entries": {}, "sparse": {}, "block": block,
            "bytes": 0, "delta_base": int(base), "quantized": [o.name for o in outs if o.kind in ("q", "pq")],
            "wire_dtype": str(wire_dtype).removeprefix("torch.")}
    stored: list[tuple[shards._Out, torch.Tensor]] = []
    try:
        for expect in outs:
            item = handoff.get()
            if isinstance(item, BaseException):
                raise item
            o, data, buf = item
            assert o is expect
            t0 = time.perf_counter()
            u8 = data.reshape(-1).view(torch.uint8)
            digest = hashlib.sha256(shards._bytes(u8)).hexdigest()
            keep[o.name] = u8 = u8.clone()  # next version's base (the buffers are reused)
            if buf is not None:
                handoff.free.put(buf)
            t1 = time.perf_counter()
            part["tensors"][o.name] = {"sha256": digest}
            p = prev.get(o.name)
            changed = (u8 != p).nonzero().flatten() if p is not None and p.numel() == u8.numel() else None
            wide = u8.numel() >= 2**31
            if changed is not None and changed.numel() * (9 if wide else 5) <= max_fraction * u8.numel():
                idx = changed.to(torch.int64 if wide else torch.int32)
                stored.append((shards._Out(o.name + IDX, idx.dtype, tuple(idx.shape), o.name, "plain"), idx))
                val = u8[changed]
                stored.append((shards._Out(o.name + VAL, torch.uint8, tuple(val.shape), o.name, "plain"), val))
                part["sparse"][o.name] = {"dtype": shards.dtype_code(o.dtype), "shape": list(o.shape)}
            else:
                stored.append((o, u8.view(o.dtype).view(o.shape)))
            spent["hash"] += t1 - t0
            spent["diff"] += time.perf_counter() - t1
        last = handoff.get()
        if isinstance(last, BaseException):
            raise last
    except BaseException:
        handoff.cancel.set()
        raise
    finally:
        producer.join()
    fname = f"model-r{rank:05d}-00001.safetensors"
    head, ranges = shards._header([o for o, _ in stored])
    t0 = time.perf_counter()
    with os.fdopen(safefs.open_write(Path(out_dir) / fname, truncate=True), "wb") as f:
        f.write(head)
        for o, t in stored:
            mv = shards._bytes(t)
            f.write(mv)
            if o.name.endswith((IDX, VAL)):
                part["entries"][o.name] = {"sha256": hashlib.sha256(mv).hexdigest()}
            else:
                part["tensors"][o.name]["offsets"] = list(ranges[o.name])
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    spent["write"] += time.perf_counter() - t0
    for name, info in part["tensors"].items():
        info["file"] = fname
        info.setdefault("offsets", [0, 0])
    part["files"][fname] = {"size": size, "header_sha256": hashlib.sha256(head).hexdigest()}
    part["bytes"] = size
    part["seconds"] = spent
    safefs.makedirs(Path(out_dir) / shards.PARTS)
    atomic_write_json(Path(out_dir) / shards.PARTS / f"rank-{rank:05d}.json", part)
    return part


def stored_tensors(weights_dir: Path, select: Callable[[str], bool] | None = None, *,
                   verified: "VerifiedOnNode | None" = None,
                   cache: tuple[int, Mapping[str, torch.Tensor]] | None = None,
                   verify_rebuilt: bool = True) -> tuple[dict[str, torch.Tensor], "ShardReader"]:
    """Every selected tensor of a published version in stored (wire) form, scales included, rebuilding a
    delta step from `cache` = (version, its stored tensors) when that is its base, else from the chain of
    steps before it in the same weights directory. Returns (tensors, the reader of this step).

    The chain is walked iteratively (rl.exchange.delta_chain: a visited set, a length bound, every base
    an earlier step): a delta.json naming its own step, or a longer loop, is CorruptStep, not a
    RecursionError. Each step's reader checks that its delta.json says what the chain walk read."""
    weights_dir = Path(weights_dir)
    chain = delta_chain(weights_dir)  # newest first, down to a full step
    base: Mapping[str, torch.Tensor] | None = None
    start = len(chain) - 1
    if cache is not None:
        for i, d in enumerate(chain[:-1]):  # the first step whose base the cache holds
            if delta_base(d) == cache[0]:
                base, start = cache[1], i
                break
    got: dict[str, torch.Tensor] = {}
    for i in range(start, -1, -1):  # oldest needed first: each step's tensors are the next one's base
        reader = ShardReader(chain[i])
        want = None if i == len(chain) - 1 else int(chain[i + 1].name.removeprefix("step_"))
        if (reader.delta or {}).get("base") != want:
            raise CorruptStep(f"{chain[i] / DELTA}: changed while its chain was read")
        got = dict(reader.tensors(select, dequantize=False, verified=verified, base=base,
                                  verify_rebuilt=verify_rebuilt))
        base = got
    return got, reader
