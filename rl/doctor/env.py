"""What this node's torch sees: its build, the CUDA devices and their FP8 support, the optional kernels.

FP8 GEMMs (`torch._scaled_mm` with e4m3 operands) need compute capability 8.9 or newer (Ada, Hopper,
Blackwell); the block-scaled form the trainer uses (1x128 activation and 128x128 weight scales) is
Hopper's. Below 8.9 `trainer.fp8` still runs, emulated (quantize-dequantize and a bf16/fp32 matmul): the
numbers are the same, the speed is not.

The optional kernels are imported for real (not only looked up), since an installed wheel built for
another torch or CUDA fails only at import; each row says what is lost without it.
"""
from __future__ import annotations

import importlib

from rl.doctor import row

FP8_CAPABILITY = (8, 9)

# module -> (what it is for, what is lost without it, what to do)
KERNELS = {
    "deep_ep": ("DeepEP: vLLM's wide-EP all-to-all (inference.all2all_backend=auto uses it)",
                "without: inference.all2all_backend=allgather_reducescatter, slower EP decode"),
    "deep_gemm": ("DeepGEMM: vLLM's block-FP8 GEMMs on Hopper",
                  "without: vLLM's Triton/CUTLASS FP8 kernels, slower; the trainer is unaffected"),
    "mamba_ssm": ("mamba_ssm: nemotron_h's fused Mamba-2 scan on CUDA",
                  "without: the plain-torch chunked scan, slower and more memory"),
    "causal_conv1d": ("causal_conv1d: nemotron_h's fused Mamba-2 conv (with mamba_ssm)",
                      "without: torch's conv1d; the fused path needs both"),
}


def torch_rows() -> list[dict]:
    import torch
    cuda = torch.version.cuda
    build = f"torch {torch.__version__}" + (f", CUDA {cuda}" if cuda else ", CPU only")
    rows = [row("torch build", "info", build,
                "a CUDA build is needed for GPU training" if not cuda else "",
                version=torch.__version__, cuda=cuda)]
    if not torch.cuda.is_available():
        why = ("this torch is a CPU build" if not cuda else
               "the CUDA build finds no device (driver, CUDA_VISIBLE_DEVICES, or no GPU on this node)")
        rows.append(row("CUDA devices", "skip", "0", f"{why}; GPU rows skip", count=0))
        rows.append(row("FP8 capability (>= 8.9)", "skip", "no CUDA device",
                        "trainer.fp8 runs emulated on the CPU (same values, fp32 matmuls)"))
        return rows
    n = torch.cuda.device_count()
    devs = []
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        devs.append({"name": p.name, "capability": f"{p.major}.{p.minor}",
                     "memory_gib": round(p.total_memory / 2**30, 1)})
    first = devs[0]
    rows.append(row("CUDA devices", "pass", f"{n} x {first['name']} ({first['memory_gib']} GiB)",
                    count=n, devices=devs))
    caps = [tuple(int(x) for x in d["capability"].split(".")) for d in devs]
    ok = all(c >= FP8_CAPABILITY for c in caps)
    rows.append(row("FP8 capability (>= 8.9)", "pass" if ok else "fail",
                    ", ".join(sorted({d["capability"] for d in devs})),
                    "" if ok else "these GPUs have no FP8 GEMMs: trainer.fp8 runs emulated (slow); use "
                                  "trainer.fp8=false or FP8 GPUs (Ada, Hopper, Blackwell)",
                    capabilities=[d["capability"] for d in devs]))
    return rows


def kernel_rows() -> list[dict]:
    rows = []
    for mod, (what, lost) in KERNELS.items():
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:  # the module is there, something it needs is not
                rows.append(row(f"kernel {mod}", "fail", f"import fails: {e}", f"{what}; {lost}"))
            else:
                rows.append(row(f"kernel {mod}", "skip", "not installed", f"{what}; {lost}", installed=False))
            continue
        except Exception as e:  # noqa: BLE001 - a wheel built for another torch/CUDA fails here
            first = (str(e).splitlines() or [type(e).__name__])[0][:200]
            rows.append(row(f"kernel {mod}", "fail", f"import fails: {first}",
                            f"reinstall it for this torch and CUDA; {lost}", installed=True))
            continue
        rows.append(row(f"kernel {mod}", "pass", f"importable {getattr(m, '__version__', '')}".strip(),
                        what, installed=True))
    return rows
