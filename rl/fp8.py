"""Block-scaled FP8 (e4m3) quantization, the DeepSeek-V3 recipe.

Weights are cut into 128x128 blocks; each block gets one fp32 scale, amax/448, so that the block's
largest magnitude maps onto e4m3's largest finite value. Edge blocks of a matrix whose sides are not
multiples of 128 are ragged: they are padded for the amax computation only and the padding never reaches
the stored tensor. Stored as in the HF checkpoints of DeepSeek-V3 and Kimi: `<name>` holds the e4m3
values with the original shape, `<name>_scale_inv` the [ceil(m/128), ceil(n/128)] fp32 scales (the name
is historical: it is the multiplier that dequantizes).

Activations use 1x128 tiles (one scale per row per 128 columns); `quantize_act` does that.

The trainer's emulated FP8 training and the weight publisher call the same `quantize_block`, so what
inference loads dequantizes to exactly what the trainer computed with.
"""
from __future__ import annotations

import torch

E4M3_MAX = 448.0
BLOCK = 128
# Scales never go below this: an all-zero block would otherwise divide by zero.
_MIN_AMAX = 1e-12


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    m, n = x.shape
    if m == rows and n == cols:
        return x
    return torch.nn.functional.pad(x, (0, cols - n, 0, rows - m))


def _div_e4m3_max(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448, correctly rounded on every device. CUDA turns a division by a Python scalar into a
    multiplication by its reciprocal (1/448 is not exact in fp32), which moved some scales by one ulp
    against the CPU's (measured on an H200, torch 2.11); dividing by a tensor is a true division on both,
    so the GPU and the CPU publish the same bytes."""
    return amax / torch.full((), E4M3_MAX, dtype=amax.dtype, device=amax.device)


def quantize_block(w: torch.Tensor, block: int = BLOCK, *, scratch: torch.Tensor | None = None,
                   out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D tensor to (e4m3 values of the same shape, fp32 scales per block).

    `scratch` (flat fp32, at least the padded size) and `out` (flat e4m3, at least m*n) are reused
    buffers: on this CPU a freshly allocated tensor costs about as much in page faults as the arithmetic
    itself, so the publisher quantizes tensor after tensor into the same two buffers; the results then
    alias them. The amax is max(amax, -amin) rather than abs().amax (no temporary, 3x faster here),
    which is the same number.
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_block expects a 2-D weight, got shape {tuple(w.shape)}")
    m, n = w.shape
    bm, bn = -(-m // block), -(-n // block)
    ragged = bool(m % block or n % block)
    x = w.detach().float()
    if ragged:
        x = torch.nn.functional.pad(x, (0, bn * block - n, 0, bm * block - m))
    xv = x.view(bm, block, bn, block)
    amax = torch.maximum(xv.amax(dim=(1, 3)), xv.amin(dim=(1, 3)).neg_()).clamp_min_(_MIN_AMAX)
    # Multiplying by the reciprocal is about 1.5x faster than dividing on CPU; trainer and publisher
    # share this function, so the rounding is the same on both sides.
    size = bm * block * bn * block
    buf = torch.empty(size, dtype=torch.float32, device=w.device) if scratch is None else scratch[:size]
    torch.mul(xv, (E4M3_MAX / amax)[:, None, :, None], out=buf.view(bm, block, bn, block))
    q = buf.view(bm * block, bn * block)
    if ragged:
        q = q[:m, :n]
    # No clamp: |x| <= amax, so |x * 448/amax| exceeds 448 by at most a rounding error, which the
    # conversion rounds back to 448 (values only turn NaN from 480 on).
    dst = torch.empty(m * n, dtype=torch.float8_e4m3fn, device=w.device) if out is None else out[: m * n]
    dst = dst.view(m, n)
    dst.copy_(q)
    return dst, _div_e4m3_max(amax).float().contiguous()


def dequantize_block(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                     block: int = BLOCK) -> torch.Tensor:
    """Inverse of quantize_block: e4m3 values times their block's scale, in `dtype`."""
    m, n = q.shape
    bm, bn = scale.shape
    if bm != -(-m // block) or bn != -(-n // block):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match weight {tuple(q.shape)} "
                         f"with {block}x{block} blocks")
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:m, :n]
    return (q.float() * full).to(dtype)


def fake_quantize_block(w: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Quantize-dequantize in fp32: the values an FP8 block-scaled GEMM would multiply by."""
    q, s = quantize_block(w, block)
    return dequantize_block(q, s, torch.float32, block)


def quantize_act(x: torch.Tensor, tile: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """1 x `tile` activation quantization over the last dim: (e4m3 values, fp32 scales [..., ceil(k/tile)])."""
    *lead, k = x.shape
    t = -(-k // tile)
    xp = torch.nn.functional.pad(x.detach().float(), (0, t * tile - k)).view(*lead, t, tile)
    scale = _div_e4m3_max(xp.abs().amax(-1).clamp_min(_MIN_AMAX)).float()
    q = (xp / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).view(*lead, t * tile)[..., :k]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def dequantize_act(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                   tile: int = BLOCK) -> torch.Tensor:
    k = q.shape[-1]
    full = scale.repeat_interleave(tile, -1)[..., :k]
    return (q.float() * full).to(dtype)


def fake_quantize_act(x: torch.Tensor, tile: int = BLOCK) -> torch.Tensor:
    q, s = quantize_act(x, tile)
    return dequantize_act(q, s, torch.float32, tile)
