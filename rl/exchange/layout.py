"""The files of a `weights/step_N` directory and which tensors go FP8: the leaf every weights module reads.

rl.exchange.shards writes these files, rl.exchange.shard_reader reads them, rl.exchange.deltas writes
and reads sparse deltas of them, rl.exchange.weights is the one-call entry (write_shards, iter_tensors)
on top of those; each of them imports this module and none imports rl.exchange.weights.
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
