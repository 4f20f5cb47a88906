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

import json
import re
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rl import fp8

INDEX = "model.safetensors.index.json"
FP8_META = "fp8.json"
SCALE_SUFFIX = "_scale_inv"

# DeepSeek-V3's choice: every projection inside attention and the MLP/experts is FP8, the rest is not.
# GLM-5's sparse-attention indexer `weights_proj` stays high precision too: vLLM fuses it with the
# indexer's `wk` into one unquantized weight and can only upcast an FP8 `wk`, and GLM-5's own FP8
# release keeps it in bf16.
_KEEP_HIGH = re.compile(r"(embed_tokens|lm_head|norm|mlp\.gate\.weight$|\.bias$|indexer\.weights_proj\.)")


def default_quantize(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith(".weight") and not _KEEP_HIGH.search(name)


def quantize_except(ignored: list[str]) -> Callable[[str, torch.Tensor], bool]:
    """`default_quantize`, minus the modules a checkpoint's quantization_config keeps high-precision."""
    if not ignored:
        return default_quantize
    from rl.contract.hf import is_ignored
    return lambda name, t: default_quantize(name, t) and not is_ignored(name, ignored)


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


def write_quantized(out_dir: Path, wire: Mapping[str, torch.Tensor], quantized: list[str], *,
                    max_shard_bytes: int = 2 << 30, wire_dtype: torch.dtype = torch.bfloat16,
                    block: int = fp8.BLOCK) -> dict:
    """Shards + index + fp8.json for an already-quantized dict. A weight and its scale share a shard."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in wire.items():
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > max_shard_bytes and not name.endswith(SCALE_SUFFIX):
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map, total, k = {}, 0, len(shards)
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{k:05d}.safetensors"
        save_file(shard, str(Path(out_dir) / fname), metadata={"format": "pt"})
        for n, v in shard.items():
            weight_map[n] = fname
            total += v.numel() * v.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (Path(out_dir) / INDEX).write_text(json.dumps(index, indent=1, sort_keys=True))
    (Path(out_dir) / FP8_META).write_text(json.dumps(
        {"enabled": bool(quantized), "block": block, "fmt": "e4m3", "scale_dtype": "float32",
         "wire_dtype": str(wire_dtype).removeprefix("torch."), "quantized": sorted(quantized)}, indent=1))
    return index


def write_shards(out_dir: Path, tensors: Mapping[str, torch.Tensor], *, fp8_enabled: bool = True,
                 wire_dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int = 2 << 30,
                 quantize: Callable[[str, torch.Tensor], bool] = default_quantize,
                 block: int = fp8.BLOCK) -> dict:
    """Quantize and write `tensors` (HF names) as shards into `out_dir`. Returns the index dict."""
    wire, quantized = quantize_state_dict(tensors, fp8_enabled, wire_dtype, quantize, block)
    return write_quantized(out_dir, wire, quantized, max_shard_bytes=max_shard_bytes,
                           wire_dtype=wire_dtype, block=block)


def iter_tensors(weights_dir: Path, *, dequantize: bool = True, dtype: torch.dtype | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) from a weights directory, shard by shard, in the writer's order.

    With `dequantize`, FP8 tensors come back as `dtype` (default float32) and their scales are not
    yielded; otherwise both are yielded as stored.
    """
    weights_dir = Path(weights_dir)
    meta = json.loads((weights_dir / FP8_META).read_text())
    block = meta["block"]
    quantized = set(meta["quantized"])
    index = json.loads((weights_dir / INDEX).read_text())
    files = list(dict.fromkeys(index["weight_map"].values()))
    for fname in files:
        with safe_open(str(weights_dir / fname), framework="pt") as f:
            for name in f.keys():
                if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in quantized:
                    if not dequantize:
                        yield name, f.get_tensor(name)
                    continue
                t = f.get_tensor(name)
                if name in quantized and dequantize:
                    t = fp8.dequantize_block(t, f.get_tensor(name + SCALE_SUFFIX), dtype or torch.float32, block)
                elif dtype is not None and dequantize:
                    t = t.to(dtype)
                yield name, t


def load_state_dict(weights_dir: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    return dict(iter_tensors(weights_dir, dequantize=True, dtype=dtype))
