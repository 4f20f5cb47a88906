"""Per model family, from its tiny twin: the trainer's logits against transformers on the same device,
and one trainer step in bf16 and with FP8, each under the device guard.

The twin is a random checkpoint written by transformers' own classes (rl.tiny_models.twins). Its widths are
raised to 128 where the family allows (`_SIZES`), so that the FP8 GEMMs of the projections and experts
meet `torch._scaled_mm`'s shape rules (the reduction dimension a multiple of 128) on an FP8 GPU and are
not all emulated. A step row passes when the loss and gradient norm are finite, the update was applied,
and no operation of the step or of the publisher's copy-out mixed the model's device with a tensor made
without it (rl.doctor.guard). The FP8 row says how its GEMMs ran: on the CPU every one is emulated
(quantize-dequantize, then an fp32 matmul: the values of real FP8, not its speed); on a GPU of
capability >= 8.9 it counts the `aten._scaled_mm` calls and fails when there were none.
"""
from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

from rl.doctor import guarded, row

# twin widths that give FP8 GEMMs a reduction dimension of 128 (the twins' own are 32-64 in places)
_SIZES = {"qwen3": dict(hidden_size=128, moe_intermediate_size=128, intermediate_size=128),
          "deepseek_v3": dict(moe_intermediate_size=128), "kimi_k2_7": dict(moe_intermediate_size=128),
          "glm_moe_dsa": dict(moe_intermediate_size=128),
          # Mamba in_proj out = 2*128 + 2*n_groups*ssm_state + heads = 336 (a multiple of 16, _scaled_mm's
          # rule for the output width); experts and shared experts read 128-wide latents and intermediates
          "nemotron_h": dict(hidden_size=128, mamba_num_heads=16, mamba_head_dim=8, moe_latent_size=128,
                             moe_intermediate_size=128, moe_shared_expert_intermediate_size=128,
                             intermediate_size=128)}
# max |ours - transformers| over fp32 logits. On an H200 (torch 2.11) qwen3's twin differed by 1.35e-3
# (|logits| < 1) and NemotronH, which has no flex attention, by 4e-7; the likely cause is the compiled
# flex-attention kernel, whose Triton dots take fp32 inputs in TF32 by default
LOGIT_TOL = {"cpu": 1e-4, "cuda": 5e-3}


def synthetic_batch(step: int, vocab: int, n_samples: int = 8, seed: int = 0, max_len: int = 24):
    """A rollout batch of random prompts and completions, engine logprobs and group advantages."""
    import numpy as np
    from rl.contract.batch import RolloutBatch, Sample
    rng = np.random.default_rng([seed, step])
    samples = []
    for i in range(n_samples):
        p = rng.integers(10, vocab, rng.integers(3, max_len // 2)).tolist()
        c = rng.integers(10, vocab, rng.integers(2, max_len // 2)).tolist()
        samples.append(Sample(p, c, (-rng.uniform(0.5, 7.0, len(c))).tolist(), [step] * len(c),
                              reward=float(rng.uniform()), group=i // 4))
    mean = sum(s.reward for s in samples) / len(samples)
    for s in samples:
        s.advantage = s.reward - mean
    return RolloutBatch.from_samples(samples)


def trainer_cfg(run_dir: Path, model: dict, **trainer):
    """The typed config of a one-process trainer on `model` (a `model` group; `hf_path` resolved)."""
    from rl.contract.config import ModelConfig, structured
    from rl.models import fields
    m = fields.resolve_model(dict(model), dataclasses.asdict(ModelConfig()))
    t = {"warm_start": {"steps": 0}, "lr": 1e-3, "publish_async": True, **trainer}
    return structured({"run_dir": str(run_dir), "seed": 0, "model": m, "trainer": t,
                       "wandb": {"mode": "disabled"}})


def guarded_step(tr, batch, step: int):
    """One train_step under the device guard; returns (metrics, guard, seconds)."""
    import torch
    from rl.doctor.guard import DeviceGuard
    g = DeviceGuard(tr.built.device, known=[tr.model, tr.optimizer])
    sync = torch.cuda.synchronize if tr.built.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with g:
        m = tr.train_step(batch, step)
    sync()
    return m, g, time.perf_counter() - t0


def step_row(family: str, path: Path, device: str, workdir: Path, fp8: bool) -> dict:
    import torch
    from rl.trainer.train import Trainer
    what = f"{family}: trainer step " + ("FP8" if fp8 else "bf16")
    run = workdir / f"run_{family}_{'fp8' if fp8 else 'bf16'}"
    cfg = trainer_cfg(run, {"name": f"doctor-{family}", "family": family, "hf_path": str(path),
                            "max_seq_len": 128}, dtype="bfloat16", fp8=fp8, micro_batch_tokens=96)
    tr = Trainer(cfg, device=device)
    try:
        vocab = tr.vocab_size
        tr.train_step(synthetic_batch(0, vocab), 0)       # AdamW makes its state here
        m, g, secs = guarded_step(tr, synthetic_batch(1, vocab), 1)
        # the publisher's copy-out (on a GPU: on-device FP8 quantization) under the guard too
        from rl.doctor.guard import DeviceGuard
        pg = DeviceGuard(tr.built.device, known=[tr.model, tr.optimizer])
        with pg:
            tr.publish_weights(run, 1)
        tr.wait_published()
    finally:
        tr.close()
    mixes = g.distinct() + pg.distinct()
    ok = math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and not m["update_skipped"]
    # torch._scaled_mm or its explicit-recipe successor aten._scaled_mm_v2 (F.scaled_mm, what
    # rl.trainer.fp8.block_scaled_mm calls where torch has it)
    scaled = sum(n for op, n in g.counts.items() if op in ("_scaled_mm", "_scaled_mm_v2"))
    if not fp8:
        how = ""
    elif device == "cpu":
        how = ", GEMMs emulated (quantize-dequantize + fp32 matmul)"
    else:
        how = f", {scaled} real FP8 GEMMs (aten._scaled_mm / _scaled_mm_v2)"
    fig = f"{secs * 1e3:.0f} ms, loss {m['loss']:.4f}, grad norm {m['grad_norm']:.3g}{how}"
    note = ""
    status = "pass"
    if not ok:
        status = "fail"
        note = f"non-finite loss or gradient, or update skipped: {m.get('update_skip_reason', '')}"
    elif mixes:
        status = "fail"
        note = (f"{len(mixes)} operation(s) mix the model's device with tensors made without it: "
                + "; ".join(map(str, mixes[:3])))
    elif fp8 and device == "cuda" and not scaled:
        cap = torch.cuda.get_device_capability()
        status = "fail" if cap >= (8, 9) else "skip"
        note = ("no real FP8 GEMM ran (rl.trainer.fp8.gemm fell back to emulation)" if cap >= (8, 9)
                else f"capability {cap[0]}.{cap[1]} < 8.9: emulated")
    return row(what, status, fig, note, seconds=round(secs, 4), loss=m["loss"], grad_norm=m["grad_norm"],
               scaled_mm=scaled, guard_ops=g.ops + pg.ops, device_mixes=[str(x) for x in mixes])


def logits_row(family: str, path: Path, device: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from rl.models.common import logits
    from rl.trainer import hf_load
    from rl.trainer.model import build_model, materialize_empty
    b = build_model(dict(name="t", family=family, hf_path=str(path), max_seq_len=512), seed=0, device=device,
                    materialize=False)
    materialize_empty(b.model, device)
    hf_load.load(b.model, b.spec, path)
    from rl.contract import hf
    vocab = int(hf.text_config(hf.read_config(path))["vocab_size"])
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, vocab, (2, 28), generator=g).to(device)
    pos = torch.arange(28, device=device)[None].expand(2, -1)
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        ours = logits(b.model, tok, pos).float()
        theirs = ref(input_ids=tok).logits.float()
    diff = float((ours - theirs).abs().max())
    scale = float(theirs.abs().max())
    tol = LOGIT_TOL.get(torch.device(device).type, 1e-3)
    ok = diff <= tol and scale > 0.1
    return row(f"{family}: logits vs transformers", "pass" if ok else "fail",
               f"max |diff| {diff:.2e} (tol {tol:g}, |logits| up to {scale:.2f})",
               "" if ok else "the trainer's network disagrees with transformers' on this device",
               max_abs_diff=diff, tol=tol)


def family_rows(device: str, workdir: Path, families=None) -> list[dict]:
    from rl.contract import families as fams
    from rl.tiny_models.twins import write_twin
    rows = []
    for fam in families or fams.FAMILIES:
        twin = workdir / f"twin_{fam}"
        made: list[Path] = []

        def make(fam=fam, twin=twin):
            made.append(write_twin(twin, fam, sizes=_SIZES.get(fam)))
            return []
        rows += guarded(f"{fam}: tiny twin", make, "python -m rl.tiny_models.twins FAMILY DIR shows the error")
        if not made:
            continue
        path = made[0]
        rows += guarded(f"{fam}: logits vs transformers", lambda: logits_row(fam, path, device))
        rows += guarded(f"{fam}: trainer step bf16", lambda: step_row(fam, path, device, workdir, fp8=False))
        rows += guarded(f"{fam}: trainer step FP8", lambda: _fp8_or_refused(fam, path, device, workdir))
    return rows


def _fp8_or_refused(family: str, path: Path, device: str, workdir: Path) -> dict:
    """The FP8 step, or a skip row when the family's network has no FP8 path (the reason as raised)."""
    try:
        return step_row(family, path, device, workdir, fp8=True)
    except NotImplementedError as e:
        return row(f"{family}: trainer step FP8", "skip", "no FP8 path",
                   f"trainer.fp8 is not available for this family: {e}")
