"""Every family the trainer builds equals transformers' own model on the same checkpoint directory.

The outside reference is transformers 5.19's implementation of each architecture (Qwen3MoeForCausalLM,
DeepseekV3ForCausalLM for deepseek_v3 and Kimi's text tower), loaded from a tiny random checkpoint that
transformers itself wrote (rl.tiny_models.twins). GLM-5 has its own tests (test_glm5.py).
"""
import json
import shutil
from pathlib import Path

import pytest
import torch

from rl.contract import hf
from rl.trainer import hf_load
from rl.models.common import hf_state_dict, load_hf_state_dict, logits
from rl.trainer.model import build_model, materialize_empty

FAMILIES = ["qwen3", "kimi_k2_7", "deepseek_v3"]
TOL = dict(rtol=1e-5, atol=1e-5)


def _tokens(vocab=512, n=28, b=2, seed=0):
    tok = torch.randint(0, vocab, (b, n), generator=torch.Generator().manual_seed(seed))
    return tok, torch.arange(n)[None].expand(b, -1)


def _from_checkpoint(family, path, **kw):
    b = build_model(dict(name="t", family=family, hf_path=str(path), max_seq_len=512), seed=0,
                    materialize=False, **kw)
    materialize_empty(b.model, "cpu")
    stats = hf_load.load(b.model, b.spec, path)
    return b, stats


def _reference(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_logits_equal_transformers_on_the_checkpoint(twin, family):
    path = twin(family)
    b, stats = _from_checkpoint(family, path)
    assert stats["tensors"] > 0 and not stats["fp8"]
    tok, pos = _tokens()
    with torch.no_grad():
        ours = logits(b.model, tok, pos)
        theirs = _reference(path)(input_ids=tok).logits
    assert theirs.abs().max() > 0.1  # not a degenerate comparison
    torch.testing.assert_close(ours, theirs, **TOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_published_names_are_the_checkpoint_names(twin, family):
    from safetensors.torch import load_file
    path = twin(family)
    b, _ = _from_checkpoint(family, path)
    ref = load_file(str(path / "model.safetensors"))
    ours = hf_state_dict(b)
    assert set(ours) == set(ref)
    for k in ref:
        assert torch.equal(ours[k], ref[k]), k
    if family != "qwen3":  # the expert-bias correction is loaded, not dropped or zeroed
        bias = [k for k in ref if k.endswith("e_score_correction_bias")]
        assert bias and all(ours[k].abs().sum() > 0 for k in bias)


def test_deepseek_with_yarn_rope_group_routing_and_no_q_lora_matches_transformers(tmp_path):
    """The config.json knobs Kimi/DeepSeek checkpoints use beyond the twin: yarn rope with mscale (softmax
    scale), group-limited routing, q_lora_rank 0 (direct q projection), an rms_norm_eps that the MLA
    latent norm does not take (it keeps 1e-6; 1e-2 here so that taking it would show)."""
    from rl.tiny_models.twins import write_twin
    path = write_twin(tmp_path / "ds", "deepseek_v3", seed=3, sizes=dict(
        q_lora_rank=None, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
        rms_norm_eps=1e-2, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 128}))
    b, _ = _from_checkpoint("deepseek_v3", path)
    tok, pos = _tokens(n=40, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(logits(b.model, tok, pos), _reference(path)(input_ids=tok).logits, **TOL)


def test_block_fp8_checkpoint_loads_dequantized_slice_by_slice(tmp_path, twin):
    """A checkpoint in the block-FP8 format (e4m3 + weight_scale_inv per 128x128 block) loads to exactly
    the dequantized values; a rank reading a slice reads that slice's bytes only."""
    from rl.exchange.weights import iter_tensors, write_shards
    from safetensors.torch import load_file
    src = twin("kimi_k2_7")
    ck = tmp_path / "fp8"
    shutil.copytree(src, ck, ignore=shutil.ignore_patterns("*.safetensors"))
    write_shards(ck, load_file(str(src / "model.safetensors")), wire_dtype=torch.float32)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (ck / "config.json").write_text(json.dumps(cfg))
    b, stats = _from_checkpoint("kimi_k2_7", ck)
    assert stats["fp8"]
    expect = dict(iter_tensors(ck, dequantize=True, dtype=torch.float32))
    ours = hf_state_dict(b)
    assert set(ours) == set(expect)
    for k in expect:
        assert torch.equal(ours[k], expect[k]), k
    # a slice that straddles scale blocks dequantizes like the whole tensor, cut
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    reader = hf_load.Checkpoint(ck)
    part = reader.read(name, (slice(100, 300), slice(5, 70)), torch.float32)
    assert torch.equal(part, expect[name][100:300, 5:70])
    assert reader.bytes_read < 200 * 65 + 4 * 3 * 1 * 4 + 1  # e4m3 bytes of the slice + its scale blocks


def test_unknown_quantization_and_family_are_one_line_errors(tmp_path, twin):
    from rl.trainer.model import model_spec
    ck = tmp_path / "awq"
    shutil.copytree(twin("qwen3"), ck)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(hf.CheckpointError, match="quant_method='awq' is not supported"):
        hf_load.Checkpoint(ck)
    with pytest.raises(ValueError, match=r"model.family='llama' is not known \(known: qwen3, deepseek_v3"):
        model_spec(dict(name="t", family="llama", hf_path=None))


def test_after_one_step_published_shards_dequantized_equal_transformers(tmp_path, twin):
    """Step 0 -> one optimizer step -> FP8 shards: the dequantized shards give the same logits in the
    trainer's network and in transformers' own model loaded from the materialised directory."""
    from omegaconf import OmegaConf
    from rl.exchange import step_dir
    from rl.exchange.weights import iter_tensors
    from rl.inference.model_dir import materialize
    from rl.trainer.startup import write_assets
    from rl.trainer.train import Trainer
    from builders import compose_cfg
    from helpers.trainer import synthetic_batch

    path = twin("kimi_k2_7")
    cfg = OmegaConf.create(compose_cfg(tmp_path, f"model.hf_path={path}", "model.family=kimi_k2_7",
                                       "trainer.lr=1e-2", "trainer.warm_start.steps=0"))
    tr = Trainer(cfg)
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    tr.train_step(synthetic_batch(0, vocab=512), 0)
    changed = [k for k, v in tr.model.state_dict().items() if not torch.equal(v, before[k])]
    assert len(changed) > 10
    tr.publish_weights(tmp_path, 1)
    tr.wait_published()
    (tmp_path / "assets").mkdir()
    a = tmp_path / "assets" / "a"
    a.mkdir()
    write_assets(a, cfg.model)
    served = materialize(a, step_dir(tmp_path, "weights", 1), tmp_path / "served", dtype=torch.float32, fp8=False)
    sd = dict(iter_tensors(step_dir(tmp_path, "weights", 1), dequantize=True, dtype=torch.float32))
    fresh = build_model(dict(cfg.model), seed=0)
    load_hf_state_dict(fresh, sd)
    tok, pos = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(logits(fresh.model, tok, pos), _reference(served)(input_ids=tok).logits, **TOL)


def test_a_model_created_here_reads_back_through_its_family_args():
    """rl.tiny_models.tiny writes the config.json of a model created here from the `model` group's sizes (the
    family args' `twin_sizes`, or Qwen3-MoE's key-by-key config); the family's args read the same sizes back
    (rl.models.fields). A family with neither is one line naming what to do instead."""
    from dataclasses import asdict

    from rl.contract import families
    from rl.contract.config import ModelConfig
    from rl.tiny_models import tiny
    from rl.models import fields

    sizes = dict(vocab_size=512, dim=128, n_layers=3, n_heads=4, n_kv_heads=4, head_dim=96, moe_hidden_dim=32,
                 num_experts=8, top_k=2, rope_theta=50000.0, q_lora_rank=64, kv_lora_rank=512,
                 qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, n_shared_experts=1, n_dense_layers=1,
                 dense_hidden_dim=128, index_n_heads=2, index_head_dim=32, index_topk=8, max_seq_len=512)
    written = []
    for row in families.ROWS:
        m = dict(asdict(ModelConfig()), family=row.name, **sizes)
        try:
            cfg = tiny.hf_config(m, 512, 1, 0)
        except NotImplementedError as e:
            assert str(e).startswith(f"model.family={row.name}: no config.json for a model created here"), e
            assert not hasattr(fields.family_args(row.name), "twin_sizes"), row.name
            continue
        got = fields.model_fields(cfg, row.name)
        own = fields.family_args(row.name).from_hf(cfg).HF_FIELDS
        assert {k: got[k] for k in own} == {k: m[k] for k in own}, row.name
        written.append(row.name)
    assert {"qwen3", "deepseek_v3", "kimi_k2_7", "glm_moe_dsa"} <= set(written), written


def test_every_family_row_has_a_builder_a_twin_and_a_memory_shape():
    """One row per family in rl.contract.families; each has a builder module in the rl/models registry
    (model_spec, set_sharding), a tiny twin (sizes and transformers classes that exist), and a memory
    shape (launch.memory counts its parameters from the twin's config.json)."""
    import importlib

    import transformers

    from launch import memory
    from rl import models
    from rl.contract import families
    from rl.contract.config import FAMILIES as CONFIG_FAMILIES
    from rl.tiny_models.twins import TWINS
    from rl.models import fields

    assert CONFIG_FAMILIES == families.FAMILIES
    assert set(models.REGISTRY) == set(families.FAMILIES), "registry and table disagree"
    for row in families.ROWS:
        mod = models.family_module(row.name)
        assert mod.__name__ == f"rl.models.{row.package}", row.name
        assert callable(mod.model_spec) and callable(mod.set_sharding), row.name
        assert importlib.util.find_spec(f"rl.models.{row.package}") is not None
        assert row.name in TWINS and row.twin, row.name
        assert hasattr(transformers, row.hf_config_class) and hasattr(transformers, row.hf_model_class), row.name
        cfg = transformers.__dict__[row.hf_config_class](vocab_size=512, **row.twin).to_dict()
        cfg.update(row.twin_extra)
        read = fields.family_args(row.name).from_hf(cfg)    # the one reader of the family's config.json
        assert set(read.HF_FIELDS) <= set(families.DERIVED) and set(read.model_fields()) == set(read.HF_FIELDS)
        values = fields.model_fields(cfg, row.name)
        assert set(values) | {"rope_theta"} == set(families.DERIVED), row.name
        assert all(values[k] == 0 for k in values if k not in read.HF_FIELDS), row.name
        m = dict(values, family=row.name, max_seq_len=512)
        shape = memory.Shape.from_cfg(m, hf=cfg)     # hybrid: the layer pattern and Mamba sizes from cfg
        assert memory.count_params(shape).total > 0, row.name
        # the family's torch-free args: config.json read once, the same rows as the composed model group's
        args = memory.family_args(row.name)
        assert tuple(args.from_hf(cfg).layers()) == shape.layers and len(shape.layers) == m["n_layers"], row.name
        assert (shape.kv_lora_rank > 0) == (row.attention in ("mla", "dsa")), row.name
        assert (shape.index_n_heads > 0) == (row.attention == "dsa"), row.name
