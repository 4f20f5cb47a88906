"""Start from an HF checkpoint: every rank reads only the slices of the tensors it holds.

The model is built on the meta device, parallelized (FSDP2 / EP shard the parameters), materialised
empty, and then filled here: for each parameter of this rank's state dict (a DTensor or a plain tensor)
the global offset and local shape of its shard say which rows/columns of which HF tensors it needs, and
safetensors' slice reads (memory-mapped) fetch exactly those bytes. No rank ever assembles the whole
model; a rank holding 1/32 of the experts reads 1/32 of the expert bytes.

Names: the family's torchtitan state-dict adapter (`spec.state_dict_adapter`) says which HF tensor(s)
feed each parameter. Stacked routed experts (`w1_EFD` [E, F, D], ...) map to one HF tensor per expert
(`...experts.{j}.gate_proj.weight` [F, D] = parameter[j]); everything else maps 1:1.

Block-FP8 checkpoints (`quantization_config.quant_method: fp8`, e4m3 with one fp32 `weight_scale_inv`
per 128x128 block, as DeepSeek, Kimi and GLM-5.1-FP8 publish) are dequantized slice by slice: the scale
blocks overlapping the slice are read and expanded. Other formats are refused by rl.contract.hf before
anything is submitted.
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from rl.contract import hf as hfc

INDEX = "model.safetensors.index.json"
BLOCK = 128
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
# buffers the checkpoint does not hold (recomputed or runtime-only)
_RUNTIME = ("rope.cache", "tokens_per_expert")


class Checkpoint:
    """Lazy, sliced access to an HF checkpoint's safetensors files."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        cfg = hfc.read_config(self.path)
        self.prefix = hfc.weight_prefix(cfg)
        self.quant = hfc.quantization(cfg)
        idx = self.path / INDEX
        if idx.is_file():
            self.where = json.loads(idx.read_text())["weight_map"]
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise hfc.CheckpointError(f"model.hf_path={self.path}: no *.safetensors and no {INDEX}")
            from safetensors import safe_open
            self.where = {}
            for f in files:
                with safe_open(str(f), framework="pt") as h:
                    self.where.update({k: f.name for k in h.keys()})
        self._open: dict[str, Any] = {}
        self.bytes_read = 0

    def _file(self, name: str):
        fname = self.where.get(name)
        if fname is None:
            raise hfc.CheckpointError(f"{self.path}: tensor {name} is missing from the checkpoint")
        if fname not in self._open:
            from safetensors import safe_open
            self._open[fname] = safe_open(str(self.path / fname), framework="pt")
        return self._open[fname]

    def has(self, name: str) -> bool:
        return self.prefix + name in self.where

    def read(self, name: str, index: tuple[slice, ...], dtype: torch.dtype) -> torch.Tensor:
        """HF tensor `name` (without the checkpoint's prefix) at `index`, dequantized, as `dtype`."""
        full = self.prefix + name
        sl = self._file(full).get_slice(full)
        part = sl[index] if index else sl[:]
        self.bytes_read += part.numel() * part.element_size()
        scale_name = full + "_scale_inv"
        if part.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            if scale_name not in self.where:
                raise hfc.CheckpointError(f"{self.path}: FP8 tensor {full} has no {scale_name}")
            part = self._dequantize(part, scale_name, index)
        return part.to(dtype)

    def _dequantize(self, q: torch.Tensor, scale_name: str, index: tuple[slice, ...]) -> torch.Tensor:
        if q.dim() != 2:
            raise hfc.CheckpointError(f"{scale_name}: block-FP8 tensors must be 2-D, got {tuple(q.shape)}")
        (r0, r1), (c0, c1) = [(s.start or 0, s.stop) for s in index] if index else [(0, q.shape[0]), (0, q.shape[1])]
        r1 = r0 + q.shape[0] if r1 is None else r1
        c1 = c0 + q.shape[1] if c1 is None else c1
        sl = self._file(scale_name).get_slice(scale_name)
        s = sl[r0 // BLOCK:(r1 - 1) // BLOCK + 1, c0 // BLOCK:(c1 - 1) // BLOCK + 1].float()
        self.bytes_read += s.numel() * 4
        s = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        s = s[r0 - (r0 // BLOCK) * BLOCK:][:q.shape[0], c0 - (c0 // BLOCK) * BLOCK:][:, :q.shape[1]]
        return q.float() * s


def _local_box(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local tensor, local shape, global offset) of a parameter or buffer (DTensor or not)."""
    from torch.distributed.tensor import DTensor
    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return t.to_local(), tuple(shape), tuple(offset)
    return t, tuple(t.shape), (0,) * t.dim()


def hf_sources(spec, state_dict: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """model key -> the HF names feeding it (experts: one per expert, in expert order)."""
    adapter = spec.state_dict_adapter(spec.model, None)
    out: dict[str, list[str]] = {}
    for key, t in state_dict.items():
        if key.endswith(_RUNTIME):
            continue
        names = list(adapter.to_hf({key: torch.empty(tuple(t.shape), device="meta")}).keys())
        if len(names) > 1:
            names.sort(key=lambda n: int(_EXPERT.search(n).group(1)) if _EXPERT.search(n) else -1)
        out[key] = names
    return out


@torch.no_grad()
def load(model, spec, hf_path: str | Path, *, log=None) -> dict:
    """Fill `model` (parallelized, materialised) from the checkpoint at `hf_path`; returns read stats."""
    ck = Checkpoint(hf_path)
    sd = model.state_dict()
    sources = hf_sources(spec, sd)
    missing = [n for names in sources.values() for n in names if not ck.has(n)]
    if missing:
        raise hfc.CheckpointError(f"{hf_path}: {len(missing)} tensor(s) the model needs are missing, "
                                  f"e.g. {ck.prefix}{missing[0]}")
    needed = defaultdict(int)
    for key, names in sources.items():
        if not names:
            continue
        t = sd[key]
        local, shape, off = _local_box(t)
        if 0 in shape:
            continue
        box = tuple(slice(o, o + n) for o, n in zip(off, shape))
        if len(names) == 1:
            part = ck.read(names[0], box, local.dtype)
        else:  # stacked experts: parameter[j] is expert j's HF tensor
            part = torch.stack([ck.read(names[j], box[1:], local.dtype) for j in range(box[0].start, box[0].stop)])
        if tuple(part.shape) != tuple(local.shape):
            raise hfc.CheckpointError(f"{hf_path}: {names[0]} gives {tuple(part.shape)} for {key}, which needs "
                                      f"{tuple(local.shape)} (config.json and weights disagree?)")
        local.copy_(part.to(local.device))
        needed[key] = part.numel() * part.element_size()
    stats = {"hf_bytes_read": ck.bytes_read, "tensors": len(needed), "fp8": ck.quant is not None}
    if log is not None:
        log(f"loaded {hf_path}: {ck.bytes_read / 2**20:.1f} MiB read by this rank "
            f"({'block-FP8 dequantized' if ck.quant else 'unquantized'})")
    return stats
