"""Weight shards written by many ranks at once and read back in parts, each tensor verified on its own.

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

Reading. `ShardReader` reads only the tensors a worker selects (an expert-parallel rank: its experts)
with positioned reads of exactly their bytes, and checks each against its digest in `checksums.json`:
the bytes verified are the bytes read, no more. Digests of tensors already verified on the node can be
skipped (`verified=`). Shard files keep no file-level sha256 in the manifest (hashing a whole file would
mean reading it whole); the manifest still covers their sizes and hashes the small files, checksums.json
included, so a reader that trusts the manifest trusts the digests.

A weights directory written before checksums.json existed (a run directory from an older version) has
file-level sha256 in its manifest instead; `ShardReader` then verifies whole files.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import shutil
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import torch

from rl import exchange, fp8

from rl.exchange.weights import FP8_META, INDEX, SCALE_SUFFIX, default_quantize

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
            with open(out_dir / fname, "wb") as f:
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
    (out_dir / PARTS).mkdir(exist_ok=True)
    exchange.atomic_write_json(out_dir / PARTS / f"rank-{rank:05d}.json", part)
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
    entries of the shard files (for `exchange.commit(known=...)`)."""
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
    (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                        indent=1, sort_keys=True))
    (tmp / FP8_META).write_text(json.dumps(
        {"enabled": bool(quantized), "block": first["block"], "fmt": "e4m3", "scale_dtype": "float32",
         "wire_dtype": first["wire_dtype"], "quantized": sorted(quantized)}, indent=1))
    (tmp / CHECKSUMS).write_text(json.dumps({"algorithm": "sha256", "tensors": tensors, "headers": headers,
                                             "sparse": sparse}, indent=1, sort_keys=True))
    (base,) = bases
    if base is not None and sparse:  # a delta where nothing paid off is a full version: no chain kept
        (tmp / DELTA).write_text(json.dumps({"base": int(base)}))
    shutil.rmtree(tmp / PARTS)
    return known


def commit_parts(run_dir: Path, step: int, tmp: Path, world: int, *, producer: str,
                 timeout_s: float = 600.0, should_stop: Callable[[], bool] | None = None
                 ) -> exchange.Published:
    """Rank 0: wait for every rank's part, merge, and commit `weights/step_<step>`."""
    parts = wait_parts(tmp, world, timeout_s=timeout_s, should_stop=should_stop)
    known = merge_parts(tmp, parts)
    meta = {"ranks": world, "bytes_per_rank": [p["bytes"] for p in parts],
            "seconds_per_rank": [p.get("seconds", {}) for p in parts]}
    return exchange.commit(run_dir, "weights", step, tmp, producer=producer, policy_version=step,
                           meta=meta, known=known)


def write_shards(out_dir: Path, tensors: Mapping[str, torch.Tensor], **kw) -> dict:
    """One writer: the part of rank 0 of 1, merged in place (the single-process publish). Returns the index."""
    out_dir = Path(out_dir)
    part = write_part(out_dir, 0, tensors, **kw)
    merge_parts(out_dir, [part])
    return json.loads((out_dir / INDEX).read_text())


# -- reading -------------------------------------------------------------------------------------------
@dataclass
class ReadStats:
    bytes_read: int = 0        # tensor data and headers read from the shard files
    bytes_needed: int = 0      # data of the tensors selected
    bytes_hashed: int = 0
    tensors: int = 0
    files: set = field(default_factory=set)


class VerifiedOnNode:
    """Which tensors some process on this node has verified already (an append-only file of keys in
    node-local storage). Engines on the node share it, so a tensor read by several engines is hashed by
    the first only; the others read it from the page cache the first one filled. A key names the file,
    the tensor and the digest it was checked against, so a different step that reuses the step number
    (a resume that discarded and republished it) never matches an old entry."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._seen: set[str] = set()
        self._offset = 0
        self._refresh()

    def _refresh(self) -> None:  # read only what was appended since the last look
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                tail = f.read()
        except FileNotFoundError:
            return
        complete = tail[: tail.rfind(b"\n") + 1]  # a line still being appended is read next time
        self._offset += len(complete)
        self._seen.update(complete.decode().split())

    def __contains__(self, key: str) -> bool:
        if key not in self._seen:
            self._refresh()
        return key in self._seen

    def add(self, keys: Iterable[str]) -> None:
        lines = "".join(k + "\n" for k in keys)
        if lines:  # one O_APPEND write: lines of concurrent writers never interleave
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                os.write(fd, lines.encode())
            finally:
                os.close(fd)
            self._seen.update(lines.split())


def _read_header(fd: int, path: Path) -> tuple[bytes, dict, int]:
    raw = os.pread(fd, 8, 0)
    if len(raw) != 8:
        raise exchange.CorruptStep(f"{path}: shorter than a safetensors header")
    (n,) = struct.unpack("<Q", raw)
    if n > 100 << 20:
        raise exchange.CorruptStep(f"{path}: header length {n} is not plausible")
    body = os.pread(fd, n, 8)
    try:
        head = json.loads(body)
    except json.JSONDecodeError as e:
        raise exchange.CorruptStep(f"{path}: header is not JSON ({e})") from None
    return raw + body, head, 8 + n


class ShardReader:
    """The tensors of one published weights directory, read selectively and verified as they are read."""

    def __init__(self, weights_dir: Path, *, verify: bool = True):
        self.dir = Path(weights_dir)
        self.verify = verify
        self.meta = json.loads((self.dir / FP8_META).read_text())
        self.index = json.loads((self.dir / INDEX).read_text())
        self.quantized = set(self.meta["quantized"])
        self.block = int(self.meta["block"])
        self.stats = ReadStats()
        ck = self.dir / CHECKSUMS
        self.digests = json.loads(ck.read_text()) if ck.exists() else None
        self.sparse: dict = (self.digests or {}).get("sparse", {})
        self.delta = json.loads((self.dir / DELTA).read_text()) if (self.dir / DELTA).exists() else None
        if verify:
            manifest = exchange.verify(self.dir, checksums=False)
            for rel in (CHECKSUMS, INDEX, FP8_META, DELTA):  # small: hashed whole against the manifest
                info = manifest["files"].get(rel)
                if info is None and rel in (CHECKSUMS, DELTA) and not (self.dir / rel).exists():
                    continue
                if info is None or exchange.sha256_file(self.dir / rel) != info.get("sha256"):
                    raise exchange.CorruptStep(f"{self.dir / rel}: does not match the manifest")
            if self.digests is None:  # an older directory: whole files, against the manifest
                for fname in dict.fromkeys(self.index["weight_map"].values()):
                    info = manifest["files"].get(fname, {})
                    if exchange.sha256_file(self.dir / fname) != info.get("sha256"):
                        raise exchange.CorruptStep(f"{self.dir / fname}: sha256 does not match the manifest")
                    self.stats.bytes_hashed += info.get("size", 0)

    def names(self) -> list[str]:
        """HF names of the stored weights (scales of FP8 weights not listed)."""
        return [n for n in self.index["weight_map"]
                if not (n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in self.quantized)]

    def needed_bytes(self, select: Callable[[str], bool] | None = None) -> int:
        """Bytes of the tensors `select` picks (with their scales), from the file headers."""
        total = 0
        for fname, names in self._by_file(select).items():
            with open(self.dir / fname, "rb") as f:
                _, head, _ = _read_header(f.fileno(), self.dir / fname)
            for n in names:
                for e in ((n + IDX, n + VAL) if n in self.sparse else (n,)):
                    total += head[e]["data_offsets"][1] - head[e]["data_offsets"][0]
        return total

    def _by_file(self, select) -> dict[str, list[str]]:
        files: dict[str, list[str]] = {}
        for name in self.names():
            if select is None or select(name):
                files.setdefault(self.index["weight_map"][name], []).append(name)
                if name in self.quantized:
                    s = name + SCALE_SUFFIX
                    files.setdefault(self.index["weight_map"][s], []).append(s)
        return files

    def _read(self, fd: int, path: Path, head: dict, start: int, name: str,
              verified: VerifiedOnNode | None, done: list[str]) -> torch.Tensor:
        info = head.get(name)
        if info is None:
            raise exchange.CorruptStep(f"{path}: {name} is in the index but not in the file")
        lo, hi = info["data_offsets"]
        buf = torch.empty(hi - lo, dtype=torch.uint8)
        got = os.preadv(fd, [_bytes(buf)], start + lo) if hi > lo else 0
        if got != hi - lo:
            raise exchange.CorruptStep(f"{path}: {name} truncated ({got} of {hi - lo} bytes)")
        self.stats.bytes_read += got
        self.stats.bytes_needed += got
        if self.verify and self.digests is not None:
            want = self.digests["tensors"].get(name)
            key = f"{path.name}:{name}:{want}"
            if verified is None or key not in verified:
                if want is None or hashlib.sha256(_bytes(buf)).hexdigest() != want:
                    raise exchange.CorruptStep(f"{path}: {name} does not match its sha256 in {CHECKSUMS}")
                self.stats.bytes_hashed += got
                done.append(key)
        dtype = _DTYPES[info["dtype"]]
        return buf.view(dtype).view(info["shape"]) if info["shape"] else buf.view(dtype).reshape(())

    def _stored(self, fd: int, path: Path, head: dict, start: int, name: str,
                verified: VerifiedOnNode | None, done: list[str], base, verify_rebuilt: bool) -> torch.Tensor:
        if name not in self.sparse:
            return self._read(fd, path, head, start, name, verified, done)
        idx = self._read(fd, path, head, start, name + IDX, verified, done)
        val = self._read(fd, path, head, start, name + VAL, verified, done)
        if base is None or name not in base:
            raise NeedsBase(f"{self.dir}: {name} is a delta against version {(self.delta or {}).get('base')}")
        info = self.sparse[name]
        dtype, shape = _DTYPES[info["dtype"]], info["shape"]
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        from rl.exchange.deltas import rebuild
        out = rebuild(base[name], idx, val, n)
        if self.verify and verify_rebuilt and hashlib.sha256(_bytes(out)).hexdigest() != \
                self.digests["tensors"].get(name):
            raise exchange.CorruptStep(f"{path}: {name} rebuilt from its base does not match its sha256")
        return out.view(dtype).view(shape) if shape else out.view(dtype).reshape(())

    def tensors(self, select: Callable[[str], bool] | None = None, *, dequantize: bool = True,
                dtype: torch.dtype | None = None, verified: VerifiedOnNode | None = None,
                base: Mapping[str, torch.Tensor] | None = None, verify_rebuilt: bool = True
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, tensor) for the selected weights, file by file in storage order.

        With `dequantize`, FP8 weights come back as `dtype` (float32 by default) and their scales are
        not yielded; otherwise both are yielded as stored. A tensor whose bytes do not match its digest
        raises CorruptStep before it is yielded. In a delta step a sparse tensor is rebuilt from `base`
        (the stored tensors of the version it applies to; NeedsBase without) and checked against its
        digest as rebuilt (`verify_rebuilt`; rl.exchange.deltas.stored_tensors resolves the chain)."""
        for fname, names in self._by_file(select).items():
            path = self.dir / fname
            fd = os.open(path, os.O_RDONLY)
            done: list[str] = []
            try:
                head_bytes, head, start = _read_header(fd, path)
                self.stats.bytes_read += len(head_bytes)
                self.stats.files.add(fname)
                if self.verify and self.digests is not None:
                    if hashlib.sha256(head_bytes).hexdigest() != self.digests["headers"].get(fname):
                        raise exchange.CorruptStep(f"{path}: header does not match {CHECKSUMS}")
                order = sorted(names, key=lambda n: head.get(n if n not in self.sparse else n + IDX,
                                                              {}).get("data_offsets", [0])[0])
                held: dict[str, torch.Tensor] = {}
                for name in order:
                    t = self._stored(fd, path, head, start, name, verified, done, base, verify_rebuilt)
                    self.stats.tensors += 1
                    weight = name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else None
                    if weight is not None and weight in self.quantized:
                        if not dequantize:
                            yield name, t
                        elif weight in held:
                            yield weight, fp8.dequantize_block(held.pop(weight), t, dtype or torch.float32,
                                                               self.block)
                        continue
                    if name in self.quantized and dequantize:
                        held[name] = t  # its scale follows in the same file
                        continue
                    if dtype is not None and dequantize:
                        t = t.to(dtype)
                    yield name, t
                if held:
                    raise exchange.CorruptStep(f"{path}: no scale for {sorted(held)[0]}")
            finally:
                os.close(fd)
            if verified is not None:
                verified.add(done)


def dequantize_stream(items: Iterable[tuple[str, torch.Tensor]], quantized: set[str], block: int,
                      dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Stored (name, tensor) pairs, scales included, as `tensors(dequantize=True)` would yield them:
    for a caller that held the wire form (verified) and converts one tensor at a time."""
    held: dict[str, torch.Tensor] = {}
    for name, t in items:
        base = name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else None
        if base is not None and base in quantized:
            yield base, fp8.dequantize_block(held.pop(base), t, dtype or torch.float32, block)
        elif name in quantized:
            held[name] = t
        else:
            yield name, t if dtype is None else t.to(dtype)
    if held:
        raise exchange.CorruptStep(f"no scale for {sorted(held)[0]}")


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.")


def expert_selector(served: Mapping[str, set[int] | range]) -> Callable[[str], bool]:
    """Select everything except the routed experts a worker does not serve: `served` maps an experts
    module prefix (`model.layers.3.mlp.experts`) to the expert ids the worker holds; experts of layers not
    in `served` are all selected."""
    def select(name: str) -> bool:
        m = _EXPERT.match(name)
        if m is None or m.group(1) not in served:
            return True
        return int(m.group(2)) in served[m.group(1)]
    return select
