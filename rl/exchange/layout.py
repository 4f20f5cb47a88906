"""The files of a `weights/step_N` directory and which tensors go FP8: the leaf every weights module reads.

rl.exchange.shards writes these files, rl.exchange.shard_reader reads them, rl.exchange.deltas writes
and reads sparse deltas of them, rl.exchange.weights is the one-call entry (write_shards, iter_tensors)
on top of those; each of them imports this module and none imports rl.exchange.weights. `quant_holder`
says where a config.json keeps its `quantization_config` (torch-free, exported as rl.exchange.quant_holder).
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

INDEX = "model.safetensors.index.json"
FP8_META = "fp8.json"
SCALE_SUFFIX = "_scale_inv"

# DeepSeek-V3's choice: every projection inside attention and the MLP/experts is FP8, the rest is not.
# GLM-5's sparse-attention indexer `weights_proj` stays high precision too: vLLM fuses it with the
# indexer's `wk` into one unquantized weight and can only upcast an FP8 `wk`, and GLM-5's own FP8
# release keeps it in bf16.
_KEEP_HIGH = re.compile(r"(embed_tokens|lm_head|norm|mlp\.gate\.weight$|\.bias$|indexer\.weights_proj\.)")


def default_quantize(name: str, t: "torch.Tensor") -> bool:
    return t.dim() == 2 and name.endswith(".weight") and not _KEEP_HIGH.search(name)


def quantize_except(ignored: list[str]) -> Callable[[str, "torch.Tensor"], bool]:
    """`default_quantize`, minus the modules a checkpoint's quantization_config keeps high-precision."""
    if not ignored:
        return default_quantize
    from rl.contract.hf import is_ignored
    return lambda name, t: default_quantize(name, t) and not is_ignored(name, ignored)


def quant_holder(config: dict) -> dict:
    """The dict of a config.json whose `quantization_config` vLLM reads: the top level, unless only a
    multimodal checkpoint's text tower has one. Here, beside the FP8 layout, because both the replica's
    model directory (rl.inference.model_dir) and the export (rl.export) write that key."""
    tc = config.get("text_config")
    if "quantization_config" not in config and isinstance(tc, dict) and "quantization_config" in tc:
        return tc
    return config
