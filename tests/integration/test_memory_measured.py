"""launch.memory's estimate against the measured peak memory of real trainer steps on the CPU.

A subprocess (this file run as a script) builds `rl.trainer.train.Trainer` from the typed config, as
the trainer role does (torchtitan's qwen3 MoE, AdamW through torchtitan's optimizer container, the
configured activation checkpointing: none, selective, full), after a warm-up Trainer of the default
tiny model has loaded every library. Step 0 (two short micro-batches) makes AdamW allocate its state;
step 1 has a short micro-batch, which allocates the gradients, then a full-length one (one 1024-token
sample, the longest sequence), which runs while those gradients are alive, as under gradient
accumulation on a GPU. Memory is the process's resident set: glibc is told to mmap every allocation
above 64 KiB (MALLOC_MMAP_THRESHOLD_), so freed tensors leave the RSS at once, and the peak (VmHWM,
reset by writing 5 to /proc/self/clear_refs) is the live bytes at the worst moment plus the pages of
small allocations. The measured terms:

- parameters: RSS growth while the Trainer is built;
- gradients: the RSS the optimizer's zero_grad (set to None) gives back after step 0;
- optimizer states: what stays after that, above the parameters;
- activations: step 1's peak above parameters + optimizer states + gradients.

Tolerance (docs/memory.md): every term within 10 % of the estimate and step 1's peak (from the RSS
before the Trainer was built) within 5 %; measured here: terms within +-3.5 %, peaks within +1.5 %.
Dropping any one term of the estimate breaks a bound: the optimizer states are 35-42 % of the peak,
the activations 16-30 % (and each term has its own bound). The model (56M parameters, 8 experts) is
sized so that these terms dwarf interpreter noise; the three cases take ~45 s on 2 idle cores. With
no AC, the activations are also compared with what autograd saves, tensor by tensor (within 2 %).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOKENS = 1024                          # the longest row: one full-length sample
MODEL = dict(name="mem-probe", family="qwen3", vocab_size=2048, dim=512, n_layers=4, n_heads=8, n_kv_heads=4,
             head_dim=64, moe_hidden_dim=1024, num_experts=8, top_k=2, max_seq_len=TOKENS)
TERM_TOL = 0.10
TOTAL_TOL = 0.05


def overrides(ac: str) -> dict:
    return {"run_dir": "/tmp/hetrl-memory-probe", "model": MODEL,
            "trainer": {"micro_batch_tokens": TOKENS, "activation_checkpointing": ac,
                        "warm_start": {"steps": 0}},
            "wandb": {"mode": "disabled"}}


# -- the measuring subprocess --------------------------------------------------------------------------
def _status() -> dict:
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)
                if k in ("VmRSS", "VmHWM")}


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _batch(step: int, lengths: list[int], vocab: int = MODEL["vocab_size"]):
    """One sample per length; packing puts a short first sample and a full-length one in two rows."""
    from rl.doctor.throughput import batch  # the doctor's memory row measures with the same batches
    return batch(step, lengths, vocab)


def measure(ac: str) -> dict:
    import torch
    from rl.contract.config import structured
    from rl.trainer.train import Trainer

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    # Warm up with the schema's default tiny model: every lazy import, torch's and torchtitan's caches,
    # so that the baseline below already holds the interpreter and its libraries.
    warm = Trainer(structured({**overrides(ac), "model": {}, "trainer": {"warm_start": {"steps": 0}}}))
    warm.train_step(_batch(0, [8, 8], vocab=64), 0)
    del warm
    cfg = structured(overrides(ac))
    # step 0 allocates the gradients and AdamW's state; step 1's short first micro-batch allocates the
    # gradients again, so they are alive while its second, full-length micro-batch runs (as under gradient
    # accumulation on a GPU)
    batches = [_batch(0, [64, 64]), _batch(1, [64, TOKENS])]
    base = _status()["VmRSS"]
    tr = Trainer(cfg, device="cpu")
    built = _status()["VmRSS"]
    tr.train_step(batches[0], 0)
    stepped = _status()["VmRSS"]
    tr.optimizer.zero_grad()
    zeroed = _status()["VmRSS"]
    _reset_peak()
    m = tr.train_step(batches[1], 1)
    peak = _status()["VmHWM"]
    grads = stepped - zeroed
    out = {"params": built - base, "grads": grads, "optimizer": zeroed - built,
           "activations": peak - zeroed - grads, "peak": peak - base,
           "n_params": sum(p.numel() for p in tr.model.parameters()), "micro_batches": m["micro_batches"]}
    if ac == "none":  # what autograd keeps, tensor by tensor (a cross-check of the activation formula)
        from rl.models.common import position_logprobs
        from rl.trainer.packing import pack, to_row
        keep = {p.untyped_storage().data_ptr() for p in [*tr.model.parameters(), *tr.model.buffers()]}
        saved: dict[int, int] = {}

        def hook(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in keep:
                saved[ptr] = t.untyped_storage().nbytes()
            return t
        b = batches[1]
        row = to_row(pack(b.offsets, TOKENS, TOKENS, b.tokens, mask=b.loss_mask.astype("float32"))[-1])
        with torch.autograd.graph.saved_tensors_hooks(hook, lambda t: t):
            position_logprobs(tr.model, row.tokens, row.positions, row.targets)
        out["saved_by_autograd"] = sum(saved.values())
    return out


# -- the test ----------------------------------------------------------------------------------------------
def _measured(ac: str) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "2",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, __file__, ac], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _estimate(ac: str):
    from omegaconf import OmegaConf
    from launch import memory
    from launch.plan import make_plan
    from rl.contract.config import structured
    cfg = OmegaConf.to_container(structured(overrides(ac)), resolve=True)
    plan = make_plan(cfg)
    return memory.estimate(cfg, plan).role("trainer"), memory


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_estimate_matches_measured_peak(ac):
    got = _measured(ac)
    role, memory = _estimate(ac)
    shape = memory.Shape.from_cfg(MODEL)
    assert memory.count_params(shape).total == got["n_params"]   # the parameter count is exact
    assert got["micro_batches"] == 2
    est = {"params": role.term("parameters"), "grads": role.term("gradients"),
           "optimizer": role.term("optimizer"),
           "activations": role.term("activations") + role.term("loss") + role.term("backward")}
    assert sum(est.values()) == role.total           # CPU: no workspace terms; the four are everything
    report = []
    for k, e in est.items():
        report.append(f"{k}: measured {got[k] / 2**20:.1f} MiB, estimated {e / 2**20:.1f} MiB "
                      f"({got[k] / e - 1:+.1%})")
    report.append(f"peak: measured {got['peak'] / 2**20:.1f} MiB, estimated {role.total / 2**20:.1f} MiB "
                  f"({got['peak'] / role.total - 1:+.1%})")
    print("\n".join(report))
    for k, e in est.items():
        assert abs(got[k] - e) <= TERM_TOL * e, "\n".join(report)
    assert abs(got["peak"] - role.total) <= TOTAL_TOL * role.total, "\n".join(report)
    if ac == "none":  # the formula's tensor-by-tensor count of what autograd keeps
        kept = role.term("activations") + role.term("loss")  # + log-probs and their exp
        assert abs(got["saved_by_autograd"] - kept) <= 0.02 * kept, (got["saved_by_autograd"], kept)


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1])))
