"""Weight shards written by many ranks at once into one step, each tensor with its own digest.

Writing. Every trainer rank streams the tensors it owns into its own safetensors files
(`model-r00003-00001.safetensors`) inside the step's shared tmp directory. The safetensors header is
known before any data (names, dtypes, shapes), so a file is written front to back: header, then each
tensor quantized into two reused buffers (`rl.fp8.quantize_block(scratch=, out=)`), hashed and
written, so a rank never holds more than one tensor's wire form besides its parameter snapshot. Each rank
then records what it wrote in `parts/rank-00003.json` (its tensors with their file, byte range and
sha256; its files with size and the sha256 of their header) and rank 0 merges the parts into the HF index,
`fp8.json` and `checksums.json` and commits the step (`rl.exchange.commit`): manifest last, then the
rename. A rank that dies never writes its part, so the step is never committed; its tmp directory is what
`rl.exchange.clean_tmp` removes at the next start.

Reading: rl.exchange.shard_reader.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch

from rl import fp8
from rl.contract import safefs
from rl.exchange.steps import Published, commit
from rl.contract.atomic import atomic_write_json
from rl.faults import crash_point

from rl.exchange.layout import FP8_META, INDEX, SCALE_SUFFIX, default_quantize

CHECKSUMS = "checksums.json"
PARTS = "parts"
DELTA = "delta.json"          # a delta step (rl.exchange.deltas): {"base": the version it applies to}
IDX, VAL = "::idx", "::val"   # a sparse tensor's changed byte positions and their new values


class NeedsBase(RuntimeError):
    """A delta step read without the stored tensors of the version it applies to."""

_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "BF16": torch.bfloat16, "F16": torch.float16,
           "F32": torch.float32, "F64": torch.float64, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_CODES = {v: k for k, v in _DTYPES.items()}


def dtype_code(dtype: torch.dtype) -> str:
    try:
        return _CODES[dtype]
    except KeyError:
        raise ValueError(f"no safetensors dtype for {dtype}") from None


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


# -- writing -------------------------------------------------------------------------------------------
@dataclass
class _Out:
    """One tensor as it will be stored: name, safetensors dtype, shape, and how to make its bytes."""
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    source: str            # the input name it comes from
    kind: str              # "q" (e4m3 values), "s" (their scales) or "plain" (cast to `dtype`)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Prequantized:
    """A weight already in wire form (e4m3 values and their fp32 block scales), e.g. quantized on the
    GPU during the copy-out so the host only writes FP8 bytes."""
    q: torch.Tensor
    scale: torch.Tensor


def plan_outputs(tensors: Mapping[str, torch.Tensor], *, fp8_enabled: bool, wire_dtype: torch.dtype,
                 quantize: Callable[[str, torch.Tensor], bool], block: int = fp8.BLOCK) -> list[_Out]:
    outs = []
    for name, t in tensors.items():
        if isinstance(t, Prequantized):
            outs.append(_Out(name, torch.float8_e4m3fn, tuple(t.q.shape), name, "pq"))
            outs.append(_Out(name + SCALE_SUFFIX, torch.float32, tuple(t.scale.shape), name, "ps"))
        elif fp8_enabled and quantize(name, t):
            m, n = t.shape
            outs.append(_Out(name, torch.float8_e4m3fn, (m, n), name, "q"))
            outs.append(_Out(name + SCALE_SUFFIX, torch.float32, (-(-m // block), -(-n // block)), name, "s"))
        else:
            outs.append(_Out(name, wire_dtype, tuple(t.shape), name, "plain"))
    return outs


def _split_files(outs: list[_Out], max_shard_bytes: int) -> list[list[_Out]]:
    files: list[list[_Out]] = [[]]
    size = 0
    for o in outs:
        if files[-1] and size + o.nbytes > max_shard_bytes and o.kind not in ("s", "ps"):  # a scale follows its weight
            files.append([])
            size = 0
        files[-1].append(o)
        size += o.nbytes
    return [f for f in files if f]


def _header(outs: list[_Out]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    head: dict = {"__metadata__": {"format": "pt"}}
    ranges, off = {}, 0
    for o in outs:
        head[o.name] = {"dtype": dtype_code(o.dtype), "shape": list(o.shape), "data_offsets": [off, off + o.nbytes]}
        ranges[o.name] = (off, off + o.nbytes)
        off += o.nbytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw, ranges


class Buffers:
    """The scratch space a writer quantizes into, grown to the largest tensor and then reused."""

    def __init__(self):
        self.scratch = torch.empty(0, dtype=torch.float32)
        self.out = torch.empty(0, dtype=torch.uint8)

    def need(self, fp32_elems: int, out_bytes: int) -> None:
        if self.scratch.numel() < fp32_elems:
            self.scratch = torch.empty(fp32_elems, dtype=torch.float32)
        if self.out.numel() < out_bytes:
            self.out = torch.empty(out_bytes, dtype=torch.uint8)


def _wire_tensors(outs: list[_Out], tensors: Mapping[str, torch.Tensor], pool: list[Buffers], block: int,
                  handoff, spent: dict) -> None:
    """Producer: every output's wire form in order, into `handoff` as (out, tensor, buffers or None).

    Runs on its own thread: quantizing the next tensor overlaps writing and hashing the previous one
    (torch, file writes and hashlib all release the GIL). A quantized tensor lives in one of the `pool`
    buffers until the writer hands it back; its scale is small and freshly allocated."""
    free = handoff.free

    def take() -> Buffers:
        while True:
            if handoff.cancel.is_set():
                raise RuntimeError("the shard writer stopped")
            try:
                return free.get(timeout=0.1)
            except queue.Empty:
                continue
    try:
        pending: dict[str, torch.Tensor] = {}
        for o in outs:
            src = tensors[o.source]
            t0 = time.perf_counter()
            if o.kind == "q":
                m, n = o.shape
                buf = take()
                buf.need(-(-m // block) * block * (-(-n // block) * block), m * n)
                q, pending[o.name + SCALE_SUFFIX] = fp8.quantize_block(
                    src, block, scratch=buf.scratch, out=buf.out.view(torch.float8_e4m3fn))
                item = (o, q, buf)
            elif o.kind == "s":
                item = (o, pending.pop(o.name), None)
            elif o.kind == "pq":
                item = (o, src.q, None)
            elif o.kind == "ps":
                item = (o, src.scale, None)
            else:
                data, buf = src.detach(), None
                if data.dtype != o.dtype or not data.is_contiguous():
                    buf = take()
                    buf.need(0, o.nbytes)
                    data = buf.out[: o.nbytes].view(o.dtype).view(o.shape).copy_(data)
                item = (o, data, buf)
            spent["quantize"] += time.perf_counter() - t0
            handoff.put(item)
        handoff.put(None)
    except BaseException as e:  # re-raised by the writer
        handoff.put(e)


def write_part(out_dir: Path, rank: int, tensors: Mapping[str, torch.Tensor], *, fp8_enabled: bool = True,
               wire_dtype: torch.dtype = torch.bfloat16,
               quantize: Callable[[str, torch.Tensor], bool] | None = None, block: int = fp8.BLOCK,
               max_shard_bytes: int = 2 << 30, buffers: list[Buffers] | None = None,
               keep: dict | None = None) -> dict:
    """Write this rank's `tensors` (HF names) as shards into `out_dir` and record them in
    `parts/rank-<rank>.json` (written last, atomically: its presence means the rank's files are complete
    and fsynced). `buffers`: two or more reused quantization buffers (a pipeline of that depth);
    `keep`: filled with a copy of every stored tensor's bytes (the base of a next delta).
    Returns the part record."""
    quantize = quantize or default_quantize
    out_dir = Path(out_dir)
    pool = buffers or [Buffers(), Buffers()]
    outs = plan_outputs(tensors, fp8_enabled=fp8_enabled, wire_dtype=wire_dtype, quantize=quantize, block=block)
    groups = _split_files(outs, max_shard_bytes)
    part = {"rank": rank, "files": {}, "tensors": {}, "block": block, "bytes": 0,
            "quantized": [o.name for o in outs if o.kind in ("q", "pq")],
            "wire_dtype": str(wire_dtype).removeprefix("torch.")}
    spent = {"quantize": 0.0, "hash": 0.0, "write": 0.0}  # where a rank's publish time goes
    handoff: queue.Queue = queue.Queue()
    handoff.free = queue.Queue()
    handoff.cancel = threading.Event()
    for b in pool:
        handoff.free.put(b)
    producer = threading.Thread(target=_wire_tensors, args=(outs, tensors, pool, block, handoff, spent),
                                name=f"quantize-rank{rank}", daemon=True)
    producer.start()
    try:
        for i, group in enumerate(groups, 1):
            fname = f"model-r{rank:05d}-{i:05d}.safetensors"
            head, ranges = _header(group)
            # safefs: the file is new in begin()'s private tmp dir; a link or FIFO planted there is refused
            with os.fdopen(safefs.open_write(out_dir / fname, truncate=True), "wb") as f:
                f.write(head)
                for expect in group:
                    item = handoff.get()
                    if isinstance(item, BaseException):
                        raise item
                    o, data, buf = item
                    assert o is expect
                    mv = _bytes(data)
                    assert len(mv) == o.nbytes, (o.name, len(mv), o.nbytes)
                    t1 = time.perf_counter()
                    f.write(mv)
                    t2 = time.perf_counter()
                    lo, hi = ranges[o.name]
                    part["tensors"][o.name] = {"file": fname, "sha256": hashlib.sha256(mv).hexdigest(),
                                               "offsets": [lo, hi]}
                    spent["write"] += t2 - t1
                    spent["hash"] += time.perf_counter() - t2
                    if keep is not None:
                        keep[o.name] = data.reshape(-1).view(torch.uint8).clone()
                    del mv, data
                    if buf is not None:
                        handoff.free.put(buf)
                t0 = time.perf_counter()
                f.flush()
                os.fsync(f.fileno())
                size = f.tell()
                spent["write"] += time.perf_counter() - t0
            part["files"][fname] = {"size": size, "header_sha256": hashlib.sha256(head).hexdigest()}
            part["bytes"] += size
        last = handoff.get()
        if isinstance(last, BaseException):
            raise last
    except BaseException:
        handoff.cancel.set()  # the producer may be waiting for a buffer this writer will not return
        raise
    finally:
        producer.join()
    part["seconds"] = spent
    safefs.makedirs(out_dir / PARTS)
    atomic_write_json(out_dir / PARTS / f"rank-{rank:05d}.json", part)
    return part


def wait_parts(tmp: Path, world: int, *, timeout_s: float, poll: float = 0.005,
               should_stop: Callable[[], bool] | None = None) -> list[dict]:
    """Every rank's part record, waiting for the ranks still writing (ValueError after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    paths = [tmp / PARTS / f"rank-{r:05d}.json" for r in range(world)]
    while True:
        missing = [p for p in paths if not p.exists()]
        if not missing:
            return [json.loads(p.read_text()) for p in paths]
        if time.monotonic() > deadline or (should_stop is not None and should_stop()):
            raise TimeoutError(f"{tmp.name}: trainer rank(s) {[paths.index(p) for p in missing]} did not "
                               f"finish writing their shards within {timeout_s:.0f} s")
        time.sleep(poll)


def merge_parts(tmp: Path, parts: list[dict]) -> dict[str, dict]:
    """Write index, fp8.json and checksums.json from the parts, remove `parts/`; returns the manifest
    entries of the shard files (for `rl.exchange.steps.commit(known=...)`)."""
    weight_map, tensors, headers, quantized, known, total = {}, {}, {}, [], {}, 0
    sparse, bases = {}, {p.get("delta_base") for p in parts}
    if len(bases) != 1:
        raise ValueError(f"{tmp.name}: the ranks disagree on the delta base: {sorted(map(str, bases))}")
    for part in parts:
        for name, info in part["tensors"].items():
            if name in tensors:
                raise ValueError(f"{tmp.name}: {name} written by two ranks")
            weight_map[name] = info["file"]
            tensors[name] = info["sha256"]
            total += info["offsets"][1] - info["offsets"][0]
        for name, info in part.get("entries", {}).items():
            tensors[name] = info["sha256"]
        sparse.update(part.get("sparse", {}))
        for fname, info in part["files"].items():
            headers[fname] = info["header_sha256"]
            known[fname] = {"size": info["size"], "verify": CHECKSUMS}
        quantized += part["quantized"]
    first = parts[0]
    safefs.write_atomic(tmp / INDEX, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=1, sort_keys=True).encode())
    safefs.write_atomic(tmp / FP8_META, json.dumps(
        {"enabled": bool(quantized), "block": first["block"], "fmt": "e4m3", "scale_dtype": "float32",
         "wire_dtype": first["wire_dtype"], "quantized": sorted(quantized)}, indent=1).encode())
    safefs.write_atomic(tmp / CHECKSUMS, json.dumps({"algorithm": "sha256", "tensors": tensors, "headers": headers,
                                                     "sparse": sparse}, indent=1, sort_keys=True).encode())
    (base,) = bases
    if base is not None and sparse:  # a delta where nothing paid off is a full version: no chain kept
        safefs.write_atomic(tmp / DELTA, json.dumps({"base": int(base)}).encode())
    safefs.remove(tmp / PARTS)
    return known


def commit_parts(run_dir: Path, step: int, tmp: Path, world: int, *, producer: str,
                 timeout_s: float = 600.0, should_stop: Callable[[], bool] | None = None
                 ) -> Published:
    """Rank 0: wait for every rank's part, merge, and commit `weights/step_<step>`."""
    parts = wait_parts(tmp, world, timeout_s=timeout_s, should_stop=should_stop)
    known = merge_parts(tmp, parts)
    meta = {"ranks": world, "bytes_per_rank": [p["bytes"] for p in parts],
            "seconds_per_rank": [p.get("seconds", {}) for p in parts]}
    crash_point("weights.publish")
    return commit(run_dir, "weights", step, tmp, producer=producer, policy_version=step,
                           meta=meta, known=known)


def write_shards(out_dir: Path, tensors: Mapping[str, torch.Tensor], **kw) -> dict:
    """One writer: the part of rank 0 of 1, merged in place (the single-process publish). Returns the index."""
    out_dir = Path(out_dir)
    part = write_part(out_dir, 0, tensors, **kw)
    merge_parts(out_dir, [part])
    return json.loads((out_dir / INDEX).read_text())
