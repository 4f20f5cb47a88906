"""Policy weights on the wire: FP8 block-scaled safetensors shards in HF layout.

A `weights/step_N/` directory holds `model-0000i-of-0000k.safetensors` shards, the HF index
`model.safetensors.index.json` and `fp8.json` (block size, which tensors are quantized). Linear weights
of attention and experts are stored as e4m3 + `<name>_scale_inv` (see rl.fp8); embeddings, the LM head,
norms and the MoE router gate stay in `wire_dtype` (bf16 by default), as in DeepSeek-V3's own checkpoints,
because they are small and precision-sensitive.

Readers that cannot compute in FP8 (vLLM on most CPUs) dequantize with `iter_tensors(dequantize=True)`;
on a GPU the shards load as they are.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch

from rl import fp8
from rl.exchange.layout import SCALE_SUFFIX, default_quantize

def quantize_state_dict(tensors: Mapping[str, torch.Tensor], fp8_enabled: bool = True,
                        wire_dtype: torch.dtype = torch.bfloat16,
                        quantize: Callable[[str, torch.Tensor], bool] = default_quantize,
                        block: int = fp8.BLOCK) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The wire form of `tensors`: e4m3 + scales for quantized weights, `wire_dtype` copies otherwise."""
    out, quantized = {}, []
    for name, t in tensors.items():
        t = t.detach()
        if fp8_enabled and quantize(name, t):
            q, s = fp8.quantize_block(t, block)
            out[name], out[name + SCALE_SUFFIX] = q, s
            quantized.append(name)
        else:
            out[name] = t.to(wire_dtype).clone().contiguous()
    return out, quantized


def write_shards(out_dir: Path, tensors: Mapping[str, torch.Tensor], *, fp8_enabled: bool = True,
                 wire_dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int = 2 << 30,
                 quantize: Callable[[str, torch.Tensor], bool] = default_quantize,
                 block: int = fp8.BLOCK) -> dict:
    """Quantize and write `tensors` (HF names) as shards into `out_dir`, one writer. Returns the index.

    The same writer every trainer rank runs in a multi-rank publish (rl.exchange.shards)."""
    from rl.exchange import shards
    return shards.write_shards(out_dir, tensors, fp8_enabled=fp8_enabled, wire_dtype=wire_dtype,
                               max_shard_bytes=max_shard_bytes, quantize=quantize, block=block)


def iter_tensors(weights_dir: Path, *, dequantize: bool = True, dtype: torch.dtype | None = None,
                 select: Callable[[str], bool] | None = None, verify: bool = False
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) from a weights directory, shard by shard, in the writer's order.

    With `dequantize`, FP8 tensors come back as `dtype` (default float32) and their scales are not
    yielded; otherwise both are yielded as stored. `select(name)` limits what is read; with `verify`
    every tensor read is checked against its digest (rl.exchange.shard_reader.ShardReader)."""
    from rl.exchange.shard_reader import ShardReader, dequantize_stream
    reader = ShardReader(Path(weights_dir), verify=verify)
    if reader.delta is None:
        yield from reader.tensors(select, dequantize=dequantize, dtype=dtype)
        return
    from rl.exchange.deltas import stored_tensors  # a delta step: rebuilt from the chain before it
    stored, reader = stored_tensors(Path(weights_dir), select)
    if not dequantize:
        yield from stored.items()
        return
    yield from dequantize_stream(stored.items(), reader.quantized, reader.block, dtype)


def load_state_dict(weights_dir: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    return dict(iter_tensors(weights_dir, dequantize=True, dtype=dtype))
