"""The trainer role's start-up: its device (`planned_device`), its record, `assets/step_000000`
(`write_assets`), and the Trainer it runs, warm-started and published as version 0 on a first start or
loaded from its checkpoint on a resume (`start`).

- first start: `assets/step_000000` (tokenizer + config.json, `rl.tiny_models.tiny.write_hf_assets`), the
  supervised warm start, `weights/step_000000` (version 0) and `checkpoints/step_000000`, so a restart
  before the first periodic checkpoint does not redo the warm start;
- resume: `checkpoints/step_c` (c from resume.json, else the newest complete one), and
  `weights/step_c` is republished if missing.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from rl import exchange
from rl.exchange import layout
from rl.runtime import log, own_epoch, record_role
from rl.trainer import checkpoint as ckpt
from rl.trainer import parallel
from rl.trainer.train import ROLE, Examples, Trainer

_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def write_assets(out_dir: Path, m) -> None:
    """`assets/step_000000`: tokenizer, chat template and config.json the orchestrator, the environments
    and vLLM use. From `model.hf_path`: the checkpoint's own files (everything but the weights);
    otherwise the tiny model's, created here (rl.tiny_models.tiny)."""
    if not m.hf_path:
        from rl.tiny_models.tiny import write_hf_assets
        write_hf_assets(out_dir, m)
        return
    import shutil
    src = Path(m.hf_path)
    for p in sorted(src.iterdir()):
        if p.is_file() and not p.name.endswith(_WEIGHT_FILES) and p.name != layout.INDEX:
            shutil.copy2(p, Path(out_dir) / p.name)


def _default_examples(run_dir, cfg) -> Examples:
    from transformers import AutoTokenizer
    from rl.envs import make_env
    env = make_env(cfg)
    tok = AutoTokenizer.from_pretrained(str(exchange.step_dir(run_dir, "assets", 0)))
    return lambda n, rng: env.sft_examples(n, rng, tok)


def planned_device(run_dir) -> str:
    """This rank's device as the plan says: `cuda:LOCAL_RANK` when the trainer group has GPUs (one rank
    per GPU, NCCL), else the CPU (gloo). Without a plan.json (in-process tests) the CPU."""
    from rl.contract import paths
    from rl.runtime import load_plan
    if not paths.plan_file(run_dir).exists():
        return "cpu"
    tp = load_plan(run_dir).trainer
    if tp.device == "cpu":
        return "cpu"
    import os
    import socket
    if not torch.cuda.is_available():
        raise RuntimeError(f"plan.trainer.device=cuda (trainer.gpus_per_node={tp.gpus_per_node}) but torch "
                           f"sees no GPU on {socket.gethostname()} (CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}, torch {torch.__version__})")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if local >= torch.cuda.device_count():
        raise RuntimeError(f"LOCAL_RANK={local} but only {torch.cuda.device_count()} GPU(s) are visible on "
                           f"{socket.gethostname()} (trainer.gpus_per_node={tp.gpus_per_node})")
    torch.cuda.set_device(local)
    return f"cuda:{local}"


def start(run_dir: Path, cfg, d: parallel.Dist, device: str, examples: Examples | None) -> tuple[Trainer, int]:
    """Record the role, write the assets, build the Trainer and warm-start or resume it.

    Returns the Trainer and the step of its newest checkpoint (the one it starts from)."""
    main = d.is_main
    if main:
        record_role(run_dir, ROLE, world_size=d.world, torch_threads=torch.get_num_threads())
        if not exchange.step_dir(run_dir, "assets", 0).is_dir():
            exchange.publish(run_dir, "assets", 0, lambda p: write_assets(p, cfg.model), producer=ROLE)
    else:  # every rank writes its shards of a publish: every rank is fenced, not only the one recorded
        exchange.fence(run_dir, own_epoch(run_dir))
    d.barrier()

    tr = Trainer(cfg, device=device, dist=d)
    start_step = d.broadcast(ckpt.resume_step(run_dir) if main else None)
    if start_step is None:
        if int(cfg.trainer.warm_start.steps) > 0:
            t0 = time.monotonic()
            tr.warm_start(examples or _default_examples(run_dir, cfg))
            if main:
                log(ROLE, f"warm start: {cfg.trainer.warm_start.steps} steps in "
                          f"{time.monotonic() - t0:.1f} s")
        tr.publish_weights(run_dir, 0)
        tr.save(run_dir, 0)
        return tr, 0
    tr.load(run_dir, start_step)
    tr.publish_weights(run_dir, start_step)  # no-op when weights/step_<start> is still there
    if main:
        where = f" on {d.world} ranks" if d.distributed else ""
        log(ROLE, f"resumed from checkpoints/step_{start_step:06d}{where}")
    return tr, start_step
