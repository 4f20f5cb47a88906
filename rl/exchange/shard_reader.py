"""Reading published weight shards in parts, each tensor verified on its own (the writer: rl.exchange.shards).

`ShardReader` reads only the tensors a worker selects (an expert-parallel rank: its experts) with
positioned reads of exactly their bytes, and checks each against its digest in `checksums.json`: the
bytes verified are the bytes read, no more. Digests of tensors already verified on the node can be
skipped (`VerifiedOnNode`). Shard files keep no file-level sha256 in the manifest (hashing a whole file
would mean reading it whole); the manifest still covers their sizes and hashes the small files,
checksums.json included, so a reader that trusts the manifest trusts the digests. A delta step
(rl.exchange.deltas) is read against the stored tensors of its base.

A weights directory written before checksums.json existed (a run directory from an older version) has
file-level sha256 in its manifest instead; `ShardReader` then verifies whole files.

Every file is opened through rl.exchange.open_in_step (no symlink followed, a FIFO or device refused
without blocking), verified or not, and a shard the index names must be a file the manifest lists: an
index pointing a tensor at a FIFO, a directory or a file smuggled in beside the manifest is CorruptStep.
The small JSON files are read once, checked against the manifest as read, then parsed.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import torch

from rl import fp8
from rl.contract import safefs
from rl.exchange.files import CorruptStep, MANIFEST, open_in_step, read_in_step, rel_ok, sha256_fd
from rl.exchange import steps
from rl.exchange.steps import parse_delta
from rl.exchange.shards import (CHECKSUMS, DELTA, FP8_META, IDX, INDEX, SCALE_SUFFIX, VAL, NeedsBase,
                                _DTYPES, _bytes)


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
        self.path = Path(path)  # node-local, but /tmp is shared with the node's other users: safefs
        safefs.makedirs(self.path.parent)
        self._seen: set[str] = set()
        self._offset = 0
        self._refresh()

    def _refresh(self) -> None:  # read only what was appended since the last look
        try:
            fd = safefs.open_read(self.path)
        except FileNotFoundError:
            return
        try:
            parts, off = [], self._offset
            while b := os.pread(fd, 1 << 20, off):
                parts.append(b)
                off += len(b)
            tail = b"".join(parts)
        finally:
            os.close(fd)
        complete = tail[: tail.rfind(b"\n") + 1]  # a line still being appended is read next time
        self._offset += len(complete)
        self._seen.update(complete.decode(errors="replace").split())

    def __contains__(self, key: str) -> bool:
        if key not in self._seen:
            self._refresh()
        return key in self._seen

    def add(self, keys: Iterable[str]) -> None:
        lines = "".join(k + "\n" for k in keys)
        if lines:  # one O_APPEND write: lines of concurrent writers never interleave
            fd = safefs.open_write(self.path, append=True, mode=0o600)
            try:
                os.write(fd, lines.encode())
            finally:
                os.close(fd)
            self._seen.update(lines.split())


def _read_header(fd: int, path: Path) -> tuple[bytes, dict, int]:
    raw = os.pread(fd, 8, 0)
    if len(raw) != 8:
        raise CorruptStep(f"{path}: shorter than a safetensors header")
    (n,) = struct.unpack("<Q", raw)
    if n > 100 << 20:
        raise CorruptStep(f"{path}: header length {n} is not plausible")
    body = os.pread(fd, n, 8)
    try:
        head = json.loads(body)
    except json.JSONDecodeError as e:
        raise CorruptStep(f"{path}: header is not JSON ({e})") from None
    return raw + body, head, 8 + n


class ShardReader:
    """The tensors of one published weights directory, read selectively and verified as they are read."""

    def __init__(self, weights_dir: Path, *, verify: bool = True):
        self.dir = Path(weights_dir)
        self.verify = verify
        self.stats = ReadStats()
        manifest = steps.verify(self.dir, checksums=False) if verify else None

        def small(rel: str, optional: bool = False):
            # read once, compared with the manifest as read, parsed from those bytes: what is checked is used
            data = read_in_step(self.dir, rel, missing_ok=optional)
            if data is None:
                return None
            if manifest is not None:
                info = manifest["files"].get(rel)
                if info is None or hashlib.sha256(data).hexdigest() != info.get("sha256"):
                    raise CorruptStep(f"{self.dir / rel}: does not match the manifest")
            if rel == DELTA:
                return {"base": parse_delta(self.dir, data)}
            try:
                obj = json.loads(data)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CorruptStep(f"{self.dir / rel}: not valid JSON ({e})") from None
            if not isinstance(obj, dict):
                raise CorruptStep(f"{self.dir / rel}: not a JSON object")
            return obj

        self.meta = small(FP8_META)
        self.index = small(INDEX)
        self.digests = small(CHECKSUMS, optional=True)
        self.delta = small(DELTA, optional=True)
        try:
            self.quantized = set(self.meta["quantized"])
            self.block = int(self.meta["block"])
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptStep(f"{self.dir / FP8_META}: no usable `quantized`/`block` ({e!r})") from None
        self.sparse: dict = (self.digests or {}).get("sparse", {})
        wmap = self.index.get("weight_map")
        if not isinstance(wmap, dict):
            raise CorruptStep(f"{self.dir / INDEX}: `weight_map` is not an object")
        for name, fname in wmap.items():
            if not rel_ok(fname) or fname == MANIFEST:
                raise CorruptStep(f"{self.dir / INDEX}: {name} -> {fname!r} is not a file of the step")
            if manifest is not None and fname not in manifest["files"]:
                raise CorruptStep(f"{self.dir / INDEX}: {name} -> {fname!r}, a file the manifest "
                                           f"does not list")
        if manifest is not None and self.digests is None:  # an older directory: whole files, against the manifest
            for fname in dict.fromkeys(wmap.values()):
                info = manifest["files"][fname]
                fd = open_in_step(self.dir, fname)
                try:
                    if sha256_fd(fd) != info.get("sha256"):
                        raise CorruptStep(f"{self.dir / fname}: sha256 does not match the manifest")
                finally:
                    os.close(fd)
                self.stats.bytes_hashed += info.get("size", 0)

    def names(self) -> list[str]:
        """HF names of the stored weights (scales of FP8 weights not listed)."""
        return [n for n in self.index["weight_map"]
                if not (n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in self.quantized)]

    def needed_bytes(self, select: Callable[[str], bool] | None = None) -> int:
        """Bytes of the tensors `select` picks (with their scales), from the file headers."""
        total = 0
        for fname, names in self._by_file(select).items():
            fd = open_in_step(self.dir, fname)
            try:
                _, head, _ = _read_header(fd, self.dir / fname)
            finally:
                os.close(fd)
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
            raise CorruptStep(f"{path}: {name} is in the index but not in the file")
        lo, hi = info["data_offsets"]
        buf = torch.empty(hi - lo, dtype=torch.uint8)
        got = os.preadv(fd, [_bytes(buf)], start + lo) if hi > lo else 0
        if got != hi - lo:
            raise CorruptStep(f"{path}: {name} truncated ({got} of {hi - lo} bytes)")
        self.stats.bytes_read += got
        self.stats.bytes_needed += got
        if self.verify and self.digests is not None:
            want = self.digests["tensors"].get(name)
            key = f"{path.name}:{name}:{want}"
            if verified is None or key not in verified:
                if want is None or hashlib.sha256(_bytes(buf)).hexdigest() != want:
                    raise CorruptStep(f"{path}: {name} does not match its sha256 in {CHECKSUMS}")
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
        out = rebuild(base[name], idx, val, n)
        if self.verify and verify_rebuilt and hashlib.sha256(_bytes(out)).hexdigest() != \
                self.digests["tensors"].get(name):
            raise CorruptStep(f"{path}: {name} rebuilt from its base does not match its sha256")
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
            fd = open_in_step(self.dir, fname)  # a FIFO or link the index names: CorruptStep, unopened
            done: list[str] = []
            try:
                head_bytes, head, start = _read_header(fd, path)
                self.stats.bytes_read += len(head_bytes)
                self.stats.files.add(fname)
                if self.verify and self.digests is not None:
                    if hashlib.sha256(head_bytes).hexdigest() != self.digests["headers"].get(fname):
                        raise CorruptStep(f"{path}: header does not match {CHECKSUMS}")
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
                    raise CorruptStep(f"{path}: no scale for {sorted(held)[0]}")
            finally:
                os.close(fd)
            if verified is not None:
                verified.add(done)


def rebuild(base: torch.Tensor, idx: torch.Tensor, val: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The new flat bytes: `base`'s, with the bytes at `idx` replaced by `val`."""
    out = base.reshape(-1).view(torch.uint8).clone()
    if out.numel() != nbytes:
        raise CorruptStep(f"delta base has {out.numel()} bytes, the tensor {nbytes}")
    out[idx.long()] = val
    return out


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
        raise CorruptStep(f"no scale for {sorted(held)[0]}")


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
