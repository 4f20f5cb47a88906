"""How long does handing weights to inference take, and how long is the trainer blocked by it?

Publishes the same MoE-shaped tensors (a few hundred MB in fp32 by default) in one run, four ways:
  fp8_protocol   FP8 block-scaled shards through the run-directory protocol (quantize, write, fsync,
                 manifest with sha256, atomic rename): what hetrl does
  bf16_whole     bf16 safetensors saved as one file, no protocol: what peers typically do
  raw_fp8        the FP8 bytes written with one write + fsync: the disk's floor for this payload
  fp8_async      the protocol again through WeightPublisher: the trainer only waits for quantization
and prints wall times and ratios against bf16_whole, plus the trainer-blocked time of sync vs async.
Machines here are noisy: compare ratios from one run, not absolute times across runs.

    python benchmarks/weight_sync.py [--layers 4 --experts 16 --dim 1024 --moe-dim 512 --repeats 2]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from rl import exchange  # noqa: E402
from rl.exchange.publisher import WeightPublisher, quantize_state_dict, write_quantized  # noqa: E402


def moe_tensors(layers: int, experts: int, dim: int, moe_dim: int, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    t = {"model.embed_tokens.weight": torch.randn(vocab, dim, generator=g),
         "lm_head.weight": torch.randn(vocab, dim, generator=g), "model.norm.weight": torch.ones(dim)}
    for i in range(layers):
        p = f"model.layers.{i}"
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[f"{p}.self_attn.{n}.weight"] = torch.randn(dim, dim, generator=g) * 0.02
        t[f"{p}.mlp.gate.weight"] = torch.randn(experts, dim, generator=g) * 0.02
        t[f"{p}.input_layernorm.weight"] = torch.ones(dim)
        t[f"{p}.post_attention_layernorm.weight"] = torch.ones(dim)
        for e in range(experts):
            t[f"{p}.mlp.experts.{e}.gate_proj.weight"] = torch.randn(moe_dim, dim, generator=g) * 0.02
            t[f"{p}.mlp.experts.{e}.up_proj.weight"] = torch.randn(moe_dim, dim, generator=g) * 0.02
            t[f"{p}.mlp.experts.{e}.down_proj.weight"] = torch.randn(dim, moe_dim, generator=g) * 0.02
    return t


def _fsync_dir_files(d: Path) -> None:
    for p in d.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--moe-dim", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir on this filesystem)")
    a = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    tensors = moe_tensors(a.layers, a.experts, a.dim, a.moe_dim, a.vocab)
    fp32_mb = sum(t.numel() * 4 for t in tensors.values()) / 2**20
    root = Path(tempfile.mkdtemp(prefix="hetrl-bench-", dir=a.dir))
    print(f"{len(tensors)} tensors, {fp32_mb:.0f} MB fp32 ({fp32_mb / 2:.0f} MB bf16); writing under {root}")
    times: dict[str, list[float]] = {k: [] for k in ("fp8_protocol", "bf16_whole", "raw_fp8", "fp8_async")}
    blocked: dict[str, list[float]] = {"sync": [], "async": []}
    wire, quantized = quantize_state_dict(tensors)
    fp8_bytes = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in wire.values())
    try:
        for r in range(a.repeats):
            t0 = time.perf_counter()
            pub = WeightPublisher(root / f"sync{r}", background=False)
            pub.publish(1, tensors)
            times["fp8_protocol"].append(time.perf_counter() - t0)
            blocked["sync"].append(pub.last_blocked_s)

            d = root / f"bf16_{r}"
            d.mkdir()
            t0 = time.perf_counter()
            save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
            _fsync_dir_files(d)
            times["bf16_whole"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            with open(root / f"raw_{r}.bin", "wb") as f:
                f.write(fp8_bytes)
                f.flush()
                os.fsync(f.fileno())
            times["raw_fp8"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            apub = WeightPublisher(root / f"async{r}", background=True)
            apub.publish(1, tensors)
            blocked["async"].append(apub.last_blocked_s)
            apub.wait()
            times["fp8_async"].append(time.perf_counter() - t0)
            exchange.verify(root / f"async{r}" / "weights" / "step_000001")
        fp8_mb = len(fp8_bytes) / 2**20
        base = statistics.median(times["bf16_whole"])
        print(f"\npayload on the wire: fp8 {fp8_mb:.0f} MB vs bf16 {fp32_mb / 2:.0f} MB")
        print(f"{'method':<14}{'median s':>10}{'MB/s (fp32 in)':>16}{'vs bf16_whole':>15}")
        for k, v in times.items():
            m = statistics.median(v)
            print(f"{k:<14}{m:>10.3f}{fp32_mb / m:>16.0f}{m / base:>14.2f}x")
        bs, ba = statistics.median(blocked["sync"]), statistics.median(blocked["async"])
        print(f"\ntrainer blocked per publish: sync {bs:.3f} s, async {ba:.3f} s "
              f"({ba / bs:.2f}x of sync; async waits for quantization only)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
