"""A mid-size model on one device: tokens per second, model FLOP utilisation, and peak memory per term
against rl.plan_math.memory's estimate for the same config (the one `launch plan` prints).

The model is a qwen3 MoE made here (no checkpoint). On a GPU its depth is chosen so that rl.plan_math.memory's
estimate of the trainer fills `share` of the device (the widths are fixed: `GPU_MODEL`); on the CPU it is
the fixed small `CPU_MODEL`. One process, `Trainer` exactly as the trainer role builds it.

Memory is split into terms the way tests/integration/test_memory_measured.py does it: the growth while
the Trainer is built (parameters), what `zero_grad` gives back after a first step (gradients), what
stays above the parameters (AdamW's states), and the peak of a second step, whose short first
micro-batch allocates the gradients before a full-length one runs, above all of that (activations).
On a GPU the meter is torch.cuda's allocator (memory_allocated, max_memory_allocated); the estimate's
fixed CUDA-context budget is not allocator memory and is left out of the comparison. On the CPU the
meter is the process's resident set (VmRSS, VmHWM reset through /proc/self/clear_refs), which is
faithful only when glibc returns freed memory at once: `launch doctor` starts this process with
MALLOC_MMAP_THRESHOLD_=65536 for that.

Throughput: `steps` timed steps of one batch of two full-length samples after the memory steps.
Model FLOPs per token: 6 x the active matmul parameters (embedding lookup excluded, LM head included)
plus 6 x layers x heads x head_dim x tokens for causal attention (half of the usual 12, the mask
being causal), forward and backward. MFU divides the achieved FLOP/s by the device's dense bf16 peak
(`PEAK_TFLOPS` by device name, or --peak-tflops); the CPU has no such figure, so no MFU there.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from rl.doctor import guarded, row

CPU_MODEL = dict(name="doctor-mid", family="qwen3", vocab_size=2048, dim=256, n_layers=2, n_heads=4,
                 n_kv_heads=2, head_dim=64, moe_hidden_dim=512, num_experts=8, top_k=2, max_seq_len=256)
GPU_MODEL = dict(name="doctor-mid", family="qwen3", vocab_size=32768, dim=2048, n_layers=1, n_heads=16,
                 n_kv_heads=4, head_dim=128, moe_hidden_dim=768, num_experts=64, top_k=8, max_seq_len=4096)
# dense bf16 peak per GPU (TFLOP/s, SXM parts, no sparsity), matched against the device name
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "GH200": 989.0, "B200": 2250.0, "B100": 1750.0,
               "A100": 312.0, "A800": 312.0, "L40S": 362.0}
GiB = 1 << 30


class Meter:
    """Current and peak bytes of the device the model lives on."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def now(self) -> int:
        if self.cuda:
            import torch
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated()
        return _status("VmRSS")

    def reset_peak(self) -> None:
        if self.cuda:
            import torch
            torch.cuda.reset_peak_memory_stats()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")

    def peak(self) -> int:
        if self.cuda:
            import torch
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return _status("VmHWM")

    @property
    def what(self) -> str:
        return "torch.cuda allocator" if self.cuda else "resident set (RSS)"


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def batch(step: int, lengths: list[int], vocab: int):
    import numpy as np
    from rl.contract.batch import RolloutBatch, Sample
    rng = np.random.default_rng(step)
    samples = []
    for i, n in enumerate(lengths):
        p = min(16, n // 2)
        c = n - p
        samples.append(Sample(rng.integers(10, vocab, p).tolist(), rng.integers(10, vocab, c).tolist(),
                              (-rng.uniform(0.5, 5.0, c)).tolist(), [step] * c, reward=float(i % 2), group=0,
                              advantage=float(i % 2) - 0.5))
    return RolloutBatch.from_samples(samples)


def _plan(gpus: int) -> dict:
    """The trainer part of a one-process plan, as rl.plan_math.memory reads it (no inference replicas)."""
    return {"trainer": {"world_size": 1, "ep": 1, "cp": 1, "gpus_per_node": gpus, "nodes": 1},
            "inference": {"gpus_per_node": 0, "replicas": []}}


def estimate(cfg, gpus: int):
    from rl.plan_math import memory
    return memory.estimate(cfg, _plan(gpus)).role("trainer")


def model_for(device: str, share: float, workdir: Path):
    """(config, trainer estimate, stated size) of the mid-size model for `device`."""
    from rl.doctor.steps import trainer_cfg
    if not device.startswith("cuda"):
        cfg = trainer_cfg(workdir / "mid", CPU_MODEL, micro_batch_tokens=CPU_MODEL["max_seq_len"],
                          dtype="float32", weights_full_every=0)
        size = f"fixed CPU size ({CPU_MODEL['n_layers']} layers, dim {CPU_MODEL['dim']})"
        return cfg, estimate(cfg, 0), size
    import torch
    cap = torch.cuda.get_device_properties(torch.device(device)).total_memory
    best = None
    for layers in range(1, 200):
        m = dict(GPU_MODEL, n_layers=layers)
        cfg = trainer_cfg(workdir / "mid", m, micro_batch_tokens=m["max_seq_len"], dtype="bfloat16",
                          weights_full_every=0)
        cfg.cluster.gpu_memory_gib = cap / GiB
        est = estimate(cfg, 1)
        if est.total > share * cap:
            break
        best = (cfg, est)
    if best is None:
        raise RuntimeError(f"one layer of the mid-size model exceeds {share:.0%} of {cap / GiB:.0f} GiB")
    cfg, est = best
    return cfg, est, (f"{cfg.model.n_layers} layers filling {est.total / cap:.0%} of {cap / GiB:.0f} GiB "
                      f"by the estimate")


def _flops_per_token(cfg) -> float:
    from rl.plan_math import memory
    s = memory.Shape.from_cfg(cfg.model)
    p = memory.count_params(s)
    matmul = p.active - p.embed            # the LM head is a matmul, the embedding a lookup
    attn = 6 * s.n_layers * s.n_heads * s.head_dim * s.max_seq_len
    return 6.0 * matmul + attn


def _peak_tflops(device: str, override: float | None) -> float | None:
    if override:
        return override
    if not device.startswith("cuda"):
        return None
    import torch
    name = torch.cuda.get_device_name(torch.device(device))
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def mid_rows(device: str, workdir: Path, *, share: float, steps: int, peak_tflops: float | None,
             publish_dir: Path, publish_repeats: int, vllm: str, vllm_timeout: float) -> list[dict]:
    """The mid-size rows; the publish rows (rl.doctor.publish) reuse the same trainer."""
    rows: list[dict] = []
    state: dict = {}

    def build():
        from rl.trainer.train import Trainer
        cfg, est, size = model_for(device, share, workdir)
        meter = Meter(device)
        t = cfg.model.max_seq_len
        base = meter.now()
        tr = Trainer(cfg, device=device)
        built = meter.now()
        tr.train_step(batch(0, [64, 64], cfg.model.vocab_size), 0)
        stepped = meter.now()
        tr.optimizer.zero_grad()
        zeroed = meter.now()
        meter.reset_peak()
        tr.train_step(batch(1, [64, t], cfg.model.vocab_size), 1)
        peak = meter.peak()
        state.update(tr=tr, cfg=cfg)
        grads = stepped - zeroed
        got = {"parameters": built - base, "gradients": grads, "optimizer states": zeroed - built,
               "activations + loss": peak - zeroed - grads}
        want = {"parameters": est.term("parameters"), "gradients": est.term("gradients"),
                "optimizer states": est.term("optimizer"),
                "activations + loss": est.term("activations") + est.term("loss") + est.term("backward")}
        n = sum(p.numel() for p in tr.model.parameters())
        out = [row("mid-size model", "info", f"{n / 1e6:.1f}M parameters, {t} tokens per row, {size}",
                   f"qwen3 MoE made here, trainer.dtype={cfg.trainer.dtype}", params=n, tokens=t,
                   n_layers=int(cfg.model.n_layers), estimate_total=est.total)]
        for k in got:
            out.append(row(f"mid-size memory: {k}", "info",
                           f"measured {_mib(got[k])}, estimated {_mib(want[k])} ({_ratio(got[k], want[k])})",
                           f"meter: {meter.what}", measured=got[k], estimated=want[k]))
        total_m, total_e = peak - base, sum(want.values())
        off = abs(total_m / total_e - 1) if total_e else 1.0
        ok = off <= 0.25
        ctx = est.term("CUDA context")
        out.append(row("mid-size memory: peak vs estimate", "pass" if ok else "fail",
                       f"measured {_mib(total_m)}, estimated {_mib(total_e)} ({_ratio(total_m, total_e)})"
                       + (f" + {_mib(ctx)} CUDA context budget" if ctx else ""),
                       "" if ok else "the memory estimate (rl.plan_math.memory) is more than 25% off on this "
                                     "device: plans sized by it may not fit or may waste memory",
                       measured=total_m, estimated=total_e, meter=meter.what,
                       malloc_mmap_threshold=os.environ.get("MALLOC_MMAP_THRESHOLD_")))
        return out

    rows += guarded("mid-size model", build)
    tr = state.get("tr")
    if tr is None:
        return rows

    def speed():
        import torch
        cfg = state["cfg"]
        t = cfg.model.max_seq_len
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        b = batch(2, [t, t], cfg.model.vocab_size)
        tr.train_step(b, 2)  # warm (allocator, kernels)
        sync()
        t0 = time.perf_counter()
        for i in range(steps):
            tr.train_step(b, 3 + i)
        sync()
        secs = time.perf_counter() - t0
        tps = steps * len(b.tokens) / secs
        out = [row("mid-size tokens/s", "info", f"{tps:,.0f} tokens/s ({steps} steps, {secs:.2f} s)",
                   tokens_per_s=tps, seconds=secs)]
        peak = _peak_tflops(device, peak_tflops)
        fpt = _flops_per_token(cfg)
        if peak is None:
            why = ("no peak FLOP/s figure for a CPU" if not device.startswith("cuda")
                   else f"no peak figure for {torch.cuda.get_device_name()}: pass --peak-tflops")
            out.append(row("mid-size MFU", "skip", f"{fpt * tps / 1e9:.1f} GFLOP/s achieved", why,
                           flops_per_token=fpt))
        else:
            mfu = fpt * tps / (peak * 1e12)
            out.append(row("mid-size MFU", "info", f"{mfu:.1%} of {peak:g} TFLOP/s bf16",
                           "6 x active matmul params + causal attention, forward and backward",
                           mfu=mfu, flops_per_token=fpt, peak_tflops=peak))
        return out

    rows += guarded("mid-size tokens/s", speed)
    from rl.doctor import publish
    pub_rows, published = publish.publish_rows(tr, publish_dir, repeats=publish_repeats)
    rows += pub_rows
    rows += publish.vllm_rows(tr, published, device=device, mode=vllm, timeout=vllm_timeout)
    tr.close()
    return rows


def _mib(b: float) -> str:
    return f"{b / GiB:.2f} GiB" if abs(b) >= GiB else f"{b / 2**20:.1f} MiB"


def _ratio(m: float, e: float) -> str:
    return f"{m / e - 1:+.0%}" if e else "n/a"
