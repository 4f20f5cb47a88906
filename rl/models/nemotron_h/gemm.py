"""NemotronH's replaceable GEMMs: which projections and routed experts run `x W^T` through a function the
trainer supplies (block-scaled FP8 training, rl.trainer.fp8), chosen by the HF tensor names the FP8
publisher quantizes, so that trainer and published shards cannot disagree on the set.

NemotronH is plain torch (no torchtitan Linear configs for rl.trainer.fp8 to rewrite), and rl/models
imports nothing of rl/trainer, so the GEMM is injected: `NemotronHConfig.gemm` (set by rl.trainer.fp8.apply,
None otherwise) with `gemm_select(hf_name, tensor) -> bool` (the publisher's predicate,
rl.exchange.layout.quantize_except of `NemotronHConfig.fp8_ignored`: the start checkpoint's
quantization_config ignore list plus the family row's `fp8_keep_modules`). At build, `set_gemm` gives every
`Linear` and `Experts` whose HF tensors that predicate quantizes the function; the others keep F.linear.
The LM head is a plain nn.Linear (never replaceable: it stays high precision as in every FP8 recipe),
and the router weight, conv1d, A_log / D / dt_bias and norms are not GEMM weights at all.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    """nn.Linear whose product `gemm(x, weight)` may be replaced; a bias is added after, in high precision
    (as the FP8 publisher keeps every bias)."""
    fp8_params = ("weight",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gemm: Callable | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemm is None:
            return F.linear(x, self.weight, self.bias)
        y = self.gemm(x, self.weight)
        return y if self.bias is None else y + self.bias


def set_gemm(model: nn.Module, gemm: Callable, select: Callable[[str, torch.Tensor], bool]) -> list[str]:
    """Give `gemm` to every replaceable module of `model` whose HF tensors `select` takes; returns their
    module names. A module whose HF tensors are part selected, part not (e.g. an ignore list naming one
    expert) is a ValueError naming it: its GEMM cannot be half FP8."""
    from rl.models.nemotron_h.state_dict_adapter import NemotronHStateDictAdapter
    adapter, out = NemotronHStateDictAdapter(), []
    for name, m in model.named_modules():
        if not hasattr(m, "fp8_params"):   # Linear, model.Experts
            continue
        hf = adapter.to_hf({f"{name}.{p}": getattr(m, p) for p in m.fp8_params})
        chosen = {k: bool(select(k, t)) for k, t in hf.items()}
        if len(set(chosen.values())) > 1:
            raise ValueError(f"FP8 selection splits module {name}: {sorted(k for k, v in chosen.items() if v)} "
                             f"quantized, the rest not")
        if all(chosen.values()):
            m.gemm = gemm
            out.append(name)
    return out
