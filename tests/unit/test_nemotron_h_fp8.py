"""FP8 training for NemotronH (rl.trainer.fp8 through rl.models.nemotron_h.gemm), on the tiny twin, emulated on
the CPU: which GEMMs run in FP8, that one step trains through them, and that the published FP8 shards are the
weights the trainer multiplied by, with the precision-sensitive tensors kept in the checkpoint's dtype.

The references are outside the trainer's FP8 code: the publisher's own predicate (rl.exchange.layout with
the checkpoint's ignore list, rl.contract.hf.ignored_modules) and the files it writes.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from rl.trainer import fp8 as fp8_training

from helpers.trainer import fp8_hf_names, synthetic_batch

FAMILY = "nemotron_h"
# the twin's HF modules run as FP8 GEMMs (docs/models.md): Mamba in/out_proj, routed + shared experts, the
# dense MLP, MTP's fusion projection; everything else high precision
FP8_KINDS = (".mixer.in_proj.", ".mixer.out_proj.", ".mixer.experts.", ".mixer.shared_experts.",
             ".mixer.up_proj.", ".mixer.down_proj.", ".eh_proj.")
HIGH_KINDS = (".mixer.q_proj.", ".mixer.k_proj.", ".mixer.v_proj.", ".mixer.o_proj.", "_latent_proj.",
              ".mixer.conv1d.", ".mixer.A_log", ".mixer.D", ".mixer.dt_bias", ".mixer.gate.", "norm",
              "embeddings.", "lm_head.")


def _trainer(tmp_path, twin, fp8_on=True):
    from omegaconf import OmegaConf
    from builders import compose_cfg
    from rl.trainer.train import Trainer
    return Trainer(OmegaConf.create(compose_cfg(
        tmp_path, "+experiment=nemotron_tiny", f"model.hf_path={twin(FAMILY)}", "wandb.mode=disabled",
        f"trainer.fp8={str(fp8_on).lower()}", "trainer.lr=1e-2", "trainer.warm_start.steps=0",
        "trainer.micro_batch_tokens=96")))


def test_the_fp8_gemms_are_exactly_the_weights_the_publisher_quantizes(twin):
    from rl.contract import hf
    from rl.exchange import layout
    from rl.models.common import hf_state_dict
    from rl.trainer import hf_load
    from rl.trainer.model import build_model, materialize_empty
    path = twin(FAMILY)
    b = build_model(dict(name="t", family=FAMILY, hf_path=str(path), max_seq_len=128), seed=0,
                    materialize=False, fp8=True)
    materialize_empty(b.model, "cpu")
    hf_load.load(b.model, b.spec, path)
    sd = hf_state_dict(b)
    quantize = layout.quantize_except(hf.ignored_modules(hf.read_config(path)))
    published = {n for n, t in sd.items() if quantize(n, t)}
    covered = fp8_hf_names(b)
    assert covered == published
    for k in sd:
        assert (k in covered) == any(s in k for s in FP8_KINDS), k
        if k not in covered:
            assert any(s in k for s in HIGH_KINDS), k
    for s in FP8_KINDS:   # every kind is present in the twin
        assert any(s in k for k in covered), s
    assert any(k.startswith("mtp.") for k in covered)
    # without trainer.fp8 nothing is swapped
    plain = build_model(dict(name="t", family=FAMILY, hf_path=str(path), max_seq_len=128), seed=0,
                        materialize=False)
    assert not list(fp8_training.fp8_modules(plain.model))


def test_a_checkpoint_ignore_list_is_followed_by_the_trainer_too(tmp_path, twin):
    """A start checkpoint whose quantization_config keeps a Mamba in_proj unquantized: the publisher keeps
    it, and so does the trainer (for NemotronH the trainer reads the same list)."""
    import shutil
    from rl.trainer.model import build_model
    path = tmp_path / "ck"
    shutil.copytree(twin(FAMILY), path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128], "ignored_layers": ["backbone.layers.0.mixer.in_proj"]}
    (path / "config.json").write_text(json.dumps(cfg))
    b = build_model(dict(name="t", family=FAMILY, hf_path=str(path), max_seq_len=128), seed=0,
                    materialize=False, fp8=True)
    names = {n for n, _ in fp8_training.fp8_modules(b.model)}
    assert "layers.0.mixer.out_proj" in names and "layers.0.mixer.in_proj" not in names
    assert "layers.3.mixer.in_proj" in names


def test_one_fp8_step_trains_and_the_shards_are_its_fp8_weights(tmp_path, twin):
    """One step with FP8 on: finite loss, other than fp32's from the same start, every FP8 master of the
    main network gets a gradient (STE); the published shard dequantizes bit for bit to the trainer's FP8
    weights, and every tensor kept high precision is stored in the checkpoint's dtype, unquantized."""
    from safetensors import safe_open
    from rl import exchange
    from rl.exchange import layout
    from rl.exchange import weights as wire
    a, b = _trainer(tmp_path / "a", twin), _trainer(tmp_path / "b", twin, fp8_on=False)
    batch = synthetic_batch(0)
    ma, mb = a.train_step(batch, 0), b.train_step(batch, 0)
    assert math.isfinite(ma["loss"]) and ma["grad_norm"] > 0
    assert ma["loss"] != mb["loss"] and ma["loss"] == pytest.approx(mb["loss"], rel=0.2, abs=1e-2)
    mods = dict(fp8_training.fp8_modules(a.model))
    for name, m in mods.items():
        for pname, p in m.named_parameters():
            if name.startswith("mtp."):
                assert p.grad is None, name    # frozen MTP
            else:
                assert p.grad is not None and p.grad.abs().sum() > 0, f"{name}.{pname}"

    run = tmp_path / "a"
    a.publish_weights(run, 1)
    a.wait_published()
    w = exchange.step_dir(run, "weights", 1)
    quantized = set(json.loads((w / layout.FP8_META).read_text())["quantized"])
    got = dict(wire.iter_tensors(w, dequantize=True))
    ours = fp8_training.trainer_fp8_state_dict(a.built)
    master = a.full_hf_state_dict()
    assert got.keys() == ours.keys() == master.keys()
    assert {k for k in ours if not torch.equal(ours[k], master[k])} == quantized
    for name in ours:
        assert torch.equal(got[name], ours[name]), name
    # stored as they are: the Mamba scan's tensors, conv, norms, router, attention and latent projections
    with safe_open(str(twin(FAMILY) / "model.safetensors"), "pt") as f:
        ck_dtype = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    stored = {}
    for p in w.glob("*.safetensors"):
        with safe_open(str(p), "pt") as f:
            stored.update({k: f.get_slice(k).get_dtype() for k in f.keys()})
    for k, dt in ck_dtype.items():
        if k in quantized:
            assert stored[k] == "F8_E4M3", k
        else:
            assert stored[k] == dt and any(s in k for s in HIGH_KINDS), (k, stored[k], dt)
    for s in (".mixer.A_log", ".mixer.D", ".mixer.dt_bias", ".mixer.conv1d.weight", ".mixer.gate.weight",
              ".mixer.q_proj.weight", ".mixer.fc1_latent_proj.weight", ".mixer.norm.weight"):
        assert any(k.endswith(s) for k in ck_dtype if k not in quantized), s
