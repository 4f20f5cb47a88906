"""`model.family: nemotron_h` through the project's own paths: the table row, the checkpoint reader, the tiny
twin (rl.tiny_models.twins, transformers' NemotronH classes + MTP tensors), the trainer's build / load / train /
checkpoint / FP8 publish (rl.trainer), and the launcher's CPU refusal.

The network's own parity with transformers (packing, SSD scan, CP, one optimizer step) is
tests/unit/test_nemotron_h.py; here the reference is transformers' NemotronHForCausalLM loaded from the
directories the project writes (the twin, and the served copy of the published FP8 shards).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rl.contract import families, hf
from rl.models import fields
from rl.models.nemotron_h.args import NemotronHArgs
from rl.trainer import hf_load

ROOT = Path(__file__).resolve().parents[2]
TOL = dict(rtol=1e-4, atol=1e-4)
FAMILY = "nemotron_h"


def _tokens(vocab=512, n=28, b=2, seed=0):
    tok = torch.randint(0, vocab, (b, n), generator=torch.Generator().manual_seed(seed))
    return tok, torch.arange(n)[None].expand(b, -1)


def _reference(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _from_checkpoint(path):
    from rl.trainer.model import build_model, materialize_empty
    b = build_model(dict(name="t", family=FAMILY, hf_path=str(path), max_seq_len=512), seed=0, materialize=False)
    materialize_empty(b.model, "cpu")
    return b, hf_load.load(b.model, b.spec, path)


def test_the_row_the_registry_and_the_twin_sizes_agree():
    from rl import models
    row = families.get(FAMILY)
    assert row.attention == "hybrid" and "hybrid" in families.ATTENTION_KINDS
    assert families.BY_MODEL_TYPE["nemotron_h"] == FAMILY
    assert models.family_module(FAMILY).__name__ == "rl.models.nemotron_h"
    assert "is_act_and_mul=False is supported only for CUDA" in row.cpu_unservable
    from test_nemotron_h import SIZES  # the parity config: the twin is that network
    assert {k: v for k, v in SIZES.items() if k not in ("vocab_size", "tie_word_embeddings")} == \
        {k: v for k, v in row.twin.items() if k != "max_position_embeddings"}


def test_model_fields_of_the_ultra_card_and_an_nvfp4_checkpoint_is_one_line():
    cfg = json.loads((ROOT / "conf/checkpoints/nemotron_h/config.json").read_text())
    assert hf.family_of(cfg) == FAMILY
    m = fields.model_fields(cfg, FAMILY)
    assert (m["dim"], m["n_layers"], m["num_experts"], m["top_k"], m["vocab_size"]) == (8192, 108, 512, 22, 131072)
    assert m["n_heads"] % m["n_kv_heads"] == 0 and m["kv_lora_rank"] == 0 and "rope_theta" not in m
    assert set(m) >= set(NemotronHArgs.HF_FIELDS)
    del cfg["n_routed_experts"]       # a size the `model` group needs is named, not taken from a default
    with pytest.raises(hf.CheckpointError, match=r"^config.json: n_routed_experts is missing \(needed for "
                                                 r"family nemotron_h\)$"):
        fields.model_fields(cfg, FAMILY)
    cfg["n_routed_experts"] = 512
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
    with pytest.raises(hf.CheckpointError, match=r"quant_method='modelopt' \(quant_algo='NVFP4'\) is not "
                                                 r"supported") as e:
        hf.quantization(cfg)
    assert "\n" not in str(e.value)


def test_a_config_json_key_the_args_refuse_is_a_one_line_config_error_at_composition(tmp_path):
    """The family's args are the one reader of config.json: what they refuse stops composition (launch
    plan / submit), one line naming the key, before any plan is made."""
    from launch.compose import compose_points
    from rl.contract.config import ConfigError
    cfg = json.loads((ROOT / "conf/checkpoints/nemotron_h/config.json").read_text())
    cfg["sliding_window"] = 4096
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"^config.json sliding_window=4096 is not supported for NemotronH "
                                          r"\(transformers' NemotronH attention is full causal\)$"):
        compose_points([f"model.hf_path={tmp_path}", f"run_dir={tmp_path / 'run'}"], multirun=False)


def test_resolve_model_takes_the_sizes_from_the_twin(twin):
    from dataclasses import asdict
    from rl.contract.config import ModelConfig
    out = fields.resolve_model(dict(family=FAMILY, hf_path=str(twin(FAMILY))), asdict(ModelConfig()))
    assert (out["family"], out["dim"], out["n_layers"], out["num_experts"], out["max_seq_len"]) == (FAMILY, 64, 6, 8, 512)


def test_twin_loads_in_transformers_and_the_trainer_gives_its_logits(twin):
    from rl.models.common import logits
    path = twin(FAMILY)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == FAMILY and cfg["architectures"] == ["NemotronHForCausalLM"]
    b, stats = _from_checkpoint(path)
    assert stats["tensors"] > 0 and not stats["fp8"]
    tok, pos = _tokens()
    with torch.no_grad():
        ours, theirs = logits(b.model, tok, pos), _reference(path)(input_ids=tok).logits
    assert theirs.abs().max() > 0.1
    torch.testing.assert_close(ours, theirs, **TOL)
    # the MTP layer's tensors are in the twin, loaded (not the init) and run
    with torch.no_grad():
        mtp = b.model.mtp_logits(tok, pos)
    assert len(mtp) == 1 and torch.isfinite(mtp[0]).all()


def test_published_names_are_the_checkpoint_names_mtp_included(twin):
    from safetensors.torch import load_file
    from rl.models.common import hf_state_dict
    path = twin(FAMILY)
    b, _ = _from_checkpoint(path)
    ref = load_file(str(path / "model.safetensors"))
    ours = hf_state_dict(b)
    assert set(ours) == set(ref) and any(k.startswith("mtp.layers.") for k in ref)
    for k in ref:
        assert torch.equal(ours[k], ref[k]), k
    assert all(ours[k].abs().sum() > 0 for k in ref if k.endswith("e_score_correction_bias"))


def test_fp8_publisher_keeps_the_adapters_keep_list(twin):
    """The publisher's predicate (layout.quantize_except of hf.ignored_modules: the family row's
    fp8_keep_modules) quantizes exactly the 2-D GEMM weights the adapter's FP8_KEEP_DTYPE does not keep."""
    from safetensors.torch import load_file
    from rl.exchange import layout
    from rl.models.nemotron_h.state_dict_adapter import keeps_dtype
    path = twin(FAMILY)
    quantize = layout.quantize_except(hf.ignored_modules(hf.read_config(path)))
    sd = load_file(str(path / "model.safetensors"))
    for name, t in sd.items():
        assert quantize(name, t) == (not keeps_dtype(name) and t.dim() == 2), name
    q = {n for n, t in sd.items() if quantize(n, t)}
    assert any(".mixer.in_proj." in n for n in q) and any(".mixer.experts.0.up_proj" in n for n in q)
    assert any(n.startswith("mtp.") for n in q)
    assert not any("conv1d" in n or ".mixer.gate." in n or "embeddings" in n or "lm_head" in n for n in q)


def test_trainer_trains_checkpoints_and_publishes_fp8_shards_transformers_reads(tmp_path, twin):
    """rl.trainer.loop.run on the twin (synthetic rollout batches, router replay on): two steps, a
    checkpoint, FP8 weights; the dequantized shards give the same logits in the trainer's network and in
    transformers' NemotronH loaded from the served directory; the checkpoint holds the trained weights."""
    from omegaconf import OmegaConf
    from builders import compose_cfg
    from helpers.trainer import publish_batches
    from rl import exchange
    from rl.exchange import layout
    from rl.exchange.weights import iter_tensors
    from rl.inference.model_dir import materialize
    from rl.metrics import read_metrics
    from rl.models.common import hf_state_dict, load_hf_state_dict, logits
    from rl.trainer import checkpoint
    from rl.trainer.loop import run
    from rl.trainer.model import build_model
    from rl.trainer.startup import write_assets

    ckpt, steps = twin(FAMILY), 2
    cfg = OmegaConf.create(compose_cfg(tmp_path, "+experiment=nemotron_tiny", f"model.hf_path={ckpt}",
                                       "wandb.mode=disabled", f"trainer.max_steps={steps}", "trainer.lr=1e-3",
                                       "trainer.warm_start.steps=0", "trainer.micro_batch_tokens=96",
                                       "trainer.router_replay=true"))
    assert cfg.model.family == FAMILY and cfg.model.n_layers == 6
    publish_batches(tmp_path, range(steps))
    assert run(tmp_path, cfg, poll=0.01) == 0
    ms = read_metrics(tmp_path)
    assert [m["step"] for m in ms] == list(range(steps)) and all(m["loss"] == m["loss"] for m in ms)
    assert all(m.get("router_replay") == 1 for m in ms)
    w = exchange.step_dir(tmp_path, "weights", steps)
    exchange.verify(w)
    quantized = set(json.loads((w / layout.FP8_META).read_text())["quantized"])
    assert any(".mixer.in_proj." in n for n in quantized) and any(".experts.3.down_proj" in n for n in quantized)
    assert not any("conv1d" in n or ".mixer.gate." in n or "embeddings" in n or "norm" in n for n in quantized)
    sd = dict(iter_tensors(w, dequantize=True, dtype=torch.float32))
    from safetensors import safe_open
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        assert set(sd) == set(f.keys())
        moved = [k for k in f.keys() if not torch.equal(f.get_tensor(k), sd[k])]
    assert len(moved) > 10 and not any(k.startswith("mtp.") and k not in quantized for k in moved)  # MTP frozen
    # dequantized shards: the trainer's network and transformers' agree
    (tmp_path / "assets_copy").mkdir()
    write_assets(tmp_path / "assets_copy", cfg.model)
    served = materialize(tmp_path / "assets_copy", w, tmp_path / "served", dtype=torch.float32, fp8=False)
    fresh = build_model(dict(cfg.model), seed=0)
    load_hf_state_dict(fresh, sd)
    tok, pos = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(logits(fresh.model, tok, pos), _reference(served)(input_ids=tok).logits, **TOL)
    # the checkpoint restores the trained weights: its kept-dtype tensors are the published ones exactly
    assert checkpoint.resume_step(tmp_path) == steps
    restored = build_model(dict(cfg.model), seed=1)
    from rl.trainer.train import build_optimizer
    progress = checkpoint.load(tmp_path, steps, restored.model, build_optimizer(restored.model, cfg.trainer))
    assert progress.next_step == steps
    got = hf_state_dict(restored)
    for k in sd:
        if k not in quantized:
            assert torch.equal(got[k], sd[k]), k


def test_launch_run_nemotron_tiny_on_cpu_is_refused_in_one_line(twin, tmp_path):
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "launch", "run", "+experiment=nemotron_tiny",
                        f"model.hf_path={twin(FAMILY)}", f"run_dir={run}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("\n") == 1 and "model.family=nemotron_h" in r.stderr, r.stderr
    assert "is_act_and_mul=False is supported only for CUDA, XPU and ROCm" in r.stderr, r.stderr
    assert not run.exists()


@pytest.mark.distributed
def test_expert_parallel_trainer_with_fp8_and_replay_equals_one_process(tmp_path, twin):
    """`torchrun --nproc_per_node 2 -m rl.trainer` with trainer.parallel.ep=2 (each rank 4 of the twin's 8
    experts, tokens exchanged at the latent width) from the twin's checkpoint, FP8 GEMMs and router replay of
    engine routing on: the same losses as one process on the same batches, and both ranks publish shards of
    version 0 that are the single process's bytes."""
    import os
    import numpy as np
    from omegaconf import OmegaConf
    from builders import compose_cfg
    from helpers.trainer import synthetic_batch
    from rl import exchange
    from rl.exchange.shard_reader import ShardReader, _bytes
    from rl.metrics import read_metrics
    from rl.trainer.loop import run

    steps, ckpt = 2, twin(FAMILY)
    dirs = {ep: tmp_path / f"ep{ep}" for ep in (1, 2)}
    for ep, d in dirs.items():
        d.mkdir()
        cfg = OmegaConf.create(compose_cfg(
            d, "+experiment=nemotron_tiny", f"model.hf_path={ckpt}", "wandb.mode=disabled",
            f"trainer.max_steps={steps}", "trainer.lr=1e-3", "trainer.warm_start.steps=0",
            "trainer.micro_batch_tokens=96", "trainer.router_replay=true", "trainer.fp8=true",
            "trainer.checkpoint_every=2", f"trainer.parallel.ep={ep}"))
        OmegaConf.save(cfg, d / "config.yaml")
        for n in range(steps):   # engine routing: random distinct experts per token and MoE layer
            b = synthetic_batch(n)
            rng = np.random.default_rng(100 + n)
            b.routed_experts = np.stack([np.stack([rng.permutation(8)[:3] for _ in range(2)])
                                         for _ in range(len(b.tokens))]).astype(np.uint8)
            exchange.publish(d, "rollouts", n, b.save, producer="test")
    assert run(dirs[1], OmegaConf.load(dirs[1] / "config.yaml"), poll=0.01) == 0
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "-m", "rl.trainer", "--run-dir", str(dirs[2])], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-8000:]
    want, got = ({m["step"]: m for m in read_metrics(dirs[ep])} for ep in (1, 2))
    assert sorted(got) == sorted(want) == list(range(steps))
    for n in range(steps):
        assert got[n]["loss"] == pytest.approx(want[n]["loss"], rel=1e-5, abs=1e-6), (n, got, want)
        assert got[n]["router_replay"] == 1
    stored = [{n: bytes(_bytes(t)) for n, t in ShardReader(exchange.step_dir(d, "weights", 0)).tensors(dequantize=False)}
              for d in (dirs[1], dirs[2])]
    assert stored[0] == stored[1]
    meta = exchange.read_manifest(exchange.step_dir(dirs[2], "weights", 0))["meta"]
    assert meta["ranks"] == 2
