"""Which block-scaled layouts torch._scaled_mm accepts on this GPU, for the shapes the trainer makes:
each variant's error or its max |difference| from the dequantized fp32 product. Prints one line per
(variant, shape). Harness-only (scripts/gpu_check.sh); the trainer uses rl.trainer.fp8.block_scaled_mm."""
import torch
import torch.nn.functional as F

from rl import fp8 as q8
from rl.trainer.fp8 import block_scaled_mm


def variants():
    def a(xq, xs, wq, ws):      # row-major scales, as first written
        return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16)

    def b(xq, xs, wq, ws):      # outer-major scale_a, unpadded scale_b
        return torch._scaled_mm(xq, wq.t(), scale_a=xs.t().contiguous().t(), scale_b=ws.t(),
                                out_dtype=torch.bfloat16)

    def d(xq, xs, wq, ws):      # the v2 API with L padded to 4 in the shape
        l = xs.shape[1]
        l4 = -(-l // 4) * 4
        sb = torch.nn.functional.pad(ws, (0, l4 - l)).t()
        return F.scaled_mm(xq, wq.t(), xs.t().contiguous().t(), F.ScalingType.BlockWise1x128, sb,
                           F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
    out = {"row_major": a, "outer_major_a": b, "block_scaled_mm": block_scaled_mm}
    if hasattr(F, "scaled_mm"):
        out["v2_padded"] = d
    return out


def main():
    g = torch.Generator(device="cuda").manual_seed(0)
    for m, k, n in [(96, 128, 336), (256, 512, 384), (100, 384, 256), (4096, 2048, 1536), (7, 128, 128)]:
        x = torch.randn(m, k, device="cuda", generator=g)
        w = torch.randn(n, k, device="cuda", generator=g)
        xq, xs = q8.quantize_act(x)
        wq, ws = q8.quantize_block(w)
        ref = q8.dequantize_act(xq, xs) @ q8.dequantize_block(wq, ws).t()
        for name, f in variants().items():
            try:
                y = f(xq, xs, wq, ws)
                torch.cuda.synchronize()
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                print(f"{name:16s} M={m} K={k} N={n}: ok, max rel err {err:.2e}", flush=True)
            except Exception as e:  # noqa: BLE001 - the probe reports every failure
                print(f"{name:16s} M={m} K={k} N={n}: {type(e).__name__}: {str(e).splitlines()[0][:160]}",
                      flush=True)


if __name__ == "__main__":
    main()
