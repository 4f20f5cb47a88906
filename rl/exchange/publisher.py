"""Publishing weights from every trainer rank, overlapped with the next training step.

`WeightPublisher.publish(version, tensors, gathers)` is called by every rank with the tensors it owns
and its shards of the FSDP-sharded tensors (rl.trainer.owners). On the caller's thread it only copies
them out into buffers kept from one publish to the next (pinned host memory for GPU parameters), so the
next optimizer step may change the parameters at once. A background thread then gathers the sharded
tensors at their owners (gloo groups of their own), quantizes to FP8, writes and hashes this rank's shards
into the step's shared tmp directory (rl.exchange.shards.write_part) and, on rank 0, waits for every
rank's part and commits the step: the orchestrator sees `weights/step_N` only when all of it is there.
One publish is in flight at most: the next `publish` (and `wait`) joins the previous one and re-raises
its error on the trainer's thread.

All ranks write into `weights/step_N.tmp-<token>`; the token is agreed once per trainer incarnation
(rank 0 draws it, the others receive it), so no collective runs on the background threads and a
restarted trainer never writes into its predecessor's leftovers. A rank that dies mid-publish leaves an
uncommitted tmp directory, which the next start removes (rl.exchange.clean_tmp); a publish still running
when the trainer is asked to stop is joined (`wait`) before the role exits, within the signal's grace
period, or killed with the process and then discarded the same way.
"""
from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from rl import fp8
from rl.exchange.steps import Published, begin
from rl.exchange import shards
from rl.exchange.layout import SCALE_SUFFIX, default_quantize


_GATHERED = "\0gather:"  # snapshot keys of shards to gather (never an HF name)


class WeightPublisher:
    def __init__(self, run_dir: str | Path, *, rank: int = 0, world: int = 1, token: str | None = None,
                 producer: str = "trainer", fp8_enabled: bool = True, wire_dtype: torch.dtype = torch.bfloat16,
                 quantize: Callable[[str, torch.Tensor], bool] = default_quantize, background: bool = True,
                 commit_timeout_s: float = 600.0, max_shard_bytes: int = 2 << 30,
                 quantize_on_copy: bool = False, full_every: int = 0, delta_max_fraction: float = 0.25,
                 on_published: Callable[[int], None] | None = None):
        if world > 1 and token is None:
            raise ValueError("a multi-rank publisher needs the token every rank shares")
        self.run_dir = Path(run_dir)
        self.rank, self.world = rank, world
        self.token = token or uuid.uuid4().hex[:12]
        self.producer = producer
        self.write_kw = dict(fp8_enabled=fp8_enabled, wire_dtype=wire_dtype, quantize=quantize,
                             max_shard_bytes=max_shard_bytes)
        self.background = background
        self.quantize_on_copy = quantize_on_copy  # the GPU's split on the CPU too (tests, benchmark)
        # deltas (rl.exchange.deltas): every version not a multiple of full_every is stored as the bytes
        # that changed since the previous one, when this rank published that one (0: always full)
        self.full_every, self.delta_max_fraction = int(full_every), float(delta_max_fraction)
        self._prev: dict[str, torch.Tensor] | None = None
        self._prev_version: int | None = None
        self.commit_timeout_s = commit_timeout_s
        self.on_published = on_published
        self._snap: dict[str, torch.Tensor] = {}
        self._buffers = [shards.Buffers(), shards.Buffers()]  # quantize one while writing the other
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_blocked_s = 0.0      # the caller's time in the last publish (copy-out)
        self.last_write_s = 0.0        # the background part of the last finished publish
        self.last_published: Published | None = None

    def _host(self, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self._snap.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            # on the host on purpose (the background thread writes it): pinned for a GPU tensor
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
        buf.copy_(t, non_blocking=t.is_cuda)
        self._next[key] = buf
        return buf

    def _copy_out(self, tensors: Mapping[str, torch.Tensor]) -> dict:
        """Host copies of `tensors` in reused buffers. A weight on the GPU that goes out as FP8 is
        quantized there first (the device does it in milliseconds; the host then moves and writes a
        quarter of the fp32 bytes), as is any weight with `quantize_on_copy`."""
        snap, cuda, self._next = {}, False, {}
        for name, t in tensors.items():  # (keys of gathered shards are prefixed, see publish)
            t = t.detach()
            cuda |= t.is_cuda
            if (t.is_cuda or self.quantize_on_copy) and not name.startswith(_GATHERED) and self._fp8(name, t):
                q, sc = fp8.quantize_block(t)
                snap[name] = shards.Prequantized(self._host(name, q), self._host(name + SCALE_SUFFIX, sc))
            else:
                snap[name] = self._host(name, t)
        if cuda:
            torch.cuda.synchronize()
        self._snap = self._next
        return snap

    def _fp8(self, name: str, t: torch.Tensor) -> bool:
        return self.write_kw["fp8_enabled"] and self.write_kw["quantize"](name, t)

    def publish(self, version: int, tensors: Mapping[str, torch.Tensor], gathers: Sequence = ()) -> None:
        """Start publishing `weights/step_<version>` from this rank's `tensors` (HF names) and the
        sharded tensors `gathers` (rl.trainer.owners.Gather: this rank's shard of each, assembled at its
        owner on the background thread); returns as soon as the parameters may change again."""
        t0 = time.perf_counter()
        self.wait()
        snap = self._copy_out({**tensors, **{_GATHERED + g.name: g.local for g in gathers}})
        gathers = [dataclasses.replace(g, local=snap.pop(_GATHERED + g.name)) for g in gathers]
        tmp = begin(self.run_dir, "weights", version, token=self.token)

        def work():
            t1 = time.perf_counter()
            try:
                own = dict(snap)
                for g in gathers:  # the same order on every rank (the owners plan sorted them)
                    full = g.run(self.rank)
                    if full is not None:
                        own[g.name] = full
                own = dict(sorted(own.items()))
                keep = {} if self.full_every > 0 else None
                if self.delta_base(version) is not None:
                    from rl.exchange.deltas import write_delta_part
                    write_delta_part(tmp, self.rank, own, prev=self._prev, keep=keep, base=version - 1,
                                     buffers=self._buffers, max_fraction=self.delta_max_fraction,
                                     **self.write_kw)
                else:
                    shards.write_part(tmp, self.rank, own, buffers=self._buffers, keep=keep, **self.write_kw)
                self._prev, self._prev_version = keep, (version if keep is not None else None)
                if self.rank == 0:
                    self.last_published = shards.commit_parts(
                        self.run_dir, version, tmp, self.world, producer=self.producer,
                        timeout_s=self.commit_timeout_s)
                    if self.on_published is not None:
                        self.on_published(version)
            except BaseException as e:  # re-raised on the trainer's thread at the next wait()
                self._error = e
                self._prev = self._prev_version = None  # the next version is a full one
            self.last_write_s = time.perf_counter() - t1

        if self.background:
            self._thread = threading.Thread(target=work, name=f"publish-weights-{version}", daemon=True)
            self._thread.start()
        else:
            work()
            self._raise()
        self.last_blocked_s = time.perf_counter() - t0

    def delta_base(self, version: int) -> int | None:
        """The version `version` will be a delta against, or None for a full version."""
        if self.full_every <= 0 or version % self.full_every == 0 or self._prev is None \
                or self._prev_version != version - 1:
            return None
        return version - 1

    def _raise(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise RuntimeError(f"publishing weights failed on trainer rank {self.rank}: {e}") from e

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Join the publish in flight (if any); raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()
