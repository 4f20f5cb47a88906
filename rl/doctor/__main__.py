"""`python -m rl.doctor --out FILE [--gpu] [--device cpu|cuda|auto] ...`: the torch-side rows of
`launch doctor`, written as a JSON list to FILE (progress and library chatter go to stderr)."""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from rl.doctor import guarded


def main(argv=None) -> int:
    from rl.doctor import args as t  # bad values are refused here, in one line
    ap = argparse.ArgumentParser(prog="python -m rl.doctor", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=t.out_file, required=True, help="where the rows go (JSON)")
    ap.add_argument("--gpu", action="store_true", help="run the trainer, memory, publish and vLLM checks")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--families", type=t.families, default="", help="comma-separated families (default: all)")
    ap.add_argument("--share", type=t.number(0, 1), default=0.3, help="GPU memory share of the mid-size model")
    ap.add_argument("--steps", type=t.count(0, 1000), default=0,
                    help="timed mid-size steps (default 3 on cuda, 2 on cpu)")
    ap.add_argument("--peak-tflops", type=t.number(0, 1e6), default=None, help="dense bf16 peak for MFU")
    ap.add_argument("--publish-dir", type=t.directory, default=None,
                    help="where the publish is measured (default: a temp dir)")
    ap.add_argument("--publish-repeats", type=t.count(1, 100), default=3)
    ap.add_argument("--vllm", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--vllm-timeout", type=t.number(0, 86400), default=300.0)
    a = ap.parse_args(argv)
    from rl.contract import families
    from rl.doctor import env, fill, gpu_checks
    fams = [f for f in a.families.split(",") if f] or list(families.FAMILIES)
    rows = guarded("torch", env.torch_rows, "install torch (pyproject's cpu or gpu extra)")
    rows += guarded("kernels", env.kernel_rows)
    if a.gpu:
        import torch
        device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cuda" and not torch.cuda.is_available():
            from rl.doctor import row
            rows.append(row("GPU checks", "fail", "--device cuda but no CUDA device",
                            "see the CUDA devices row"))
        else:
            rows += _gpu_rows(a, device, fams)
        rows = fill(rows, gpu_checks(fams), "not reached: a check before it failed (see above)")
    else:
        rows = fill(rows, gpu_checks(fams), "--gpu runs it (--device cpu: at tiny size on the CPU)")
    Path(a.out).write_text(json.dumps(rows, indent=1, default=str))
    return 0


def _gpu_rows(a, device: str, fams: list[str]) -> list[dict]:
    from rl.doctor import row, steps, throughput
    work = Path(tempfile.mkdtemp(prefix="hetrl-doctor-"))
    pub_dir = Path(a.publish_dir) if a.publish_dir else work / "publish"
    pub_dir.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        rows = steps.family_rows(device, work, fams)
        print(f"[doctor] families: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        steps_n = a.steps or (3 if device == "cuda" else 2)
        rows += throughput.mid_rows(device, work, share=a.share, steps=steps_n, peak_tflops=a.peak_tflops,
                                    publish_dir=pub_dir, publish_repeats=a.publish_repeats, vllm=a.vllm,
                                    vllm_timeout=a.vllm_timeout)
        print(f"[doctor] mid-size, publish, vLLM: {time.perf_counter() - t0:.1f} s", file=sys.stderr,
              flush=True)
        return [row("GPU checks device", "info", device,
                    "" if device == "cuda" else "--device cpu: the GPU code at tiny size on the CPU",
                    device=device)] + rows
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not a.publish_dir:
            shutil.rmtree(pub_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
