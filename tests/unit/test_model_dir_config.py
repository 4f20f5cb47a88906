"""The model directory a server loads (rl.inference.model_dir): the FP8 quantization config derived from
the checkpoint's own and the publisher's shard metadata, and materialize's config.json both ways
(dequantized, FP8). No vLLM is started: moved from tests/integration/test_inference_server.py."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from rl import exchange  # noqa: E402
from rl.exchange.weights import write_shards  # noqa: E402
from rl.inference.model_dir import materialize  # noqa: E402


def test_fp8_quant_config_derivation():
    from rl.inference.model_dir import FP8_QUANT_CONFIG, fp8_quant_config

    names = ["model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight",
             "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight_scale_inv",
             "model.layers.0.mlp.experts.0.up_proj.weight"]
    meta = {"block": 128, "quantized": ["model.layers.0.self_attn.q_proj.weight",
                                        "model.layers.0.mlp.experts.0.up_proj.weight"]}
    kept = ["lm_head", "model.embed_tokens", "model.layers.0.mlp.gate"]
    # no quantization_config in the checkpoint: ours, ignoring what the publisher kept high-precision
    q = fp8_quant_config({"model_type": "qwen3_moe"}, meta, names)
    assert q == {**FP8_QUANT_CONFIG, "ignored_layers": kept}
    # the checkpoint's own block-FP8 config: its keys and its ignore list, under the key it uses
    own = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
           "modules_to_not_convert": ["model.layers.0.mlp.gate", "model.layers.0.self_attn.indexer.weights_proj"]}
    q = fp8_quant_config({"quantization_config": own}, meta, names)
    assert "ignored_layers" not in q and q["modules_to_not_convert"] == [
        "model.layers.0.mlp.gate", "model.layers.0.self_attn.indexer.weights_proj", "lm_head", "model.embed_tokens"]
    assert own["modules_to_not_convert"] == ["model.layers.0.mlp.gate",
                                             "model.layers.0.self_attn.indexer.weights_proj"]  # not mutated
    q = fp8_quant_config({"quantization_config": {**own, "modules_to_not_convert": None,
                                                   "ignored_layers": ["re:.*kv_b_proj"], "extra": 1}}, meta, names)
    assert q["ignored_layers"] == ["re:.*kv_b_proj", *kept] and q["extra"] == 1
    # a multimodal checkpoint's text tower
    q = fp8_quant_config({"model_type": "kimi_k25", "text_config": {"quantization_config": {
        **own, "modules_to_not_convert": None, "ignored_layers": ["vision_tower"]}}}, meta, names)
    assert q["ignored_layers"] == ["vision_tower", *kept]
    # another format (the shards are ours whatever the checkpoint was): ours
    q = fp8_quant_config({"quantization_config": {"quant_method": "compressed-tensors"}}, meta, names)
    assert q == {**FP8_QUANT_CONFIG, "ignored_layers": kept}


def test_materialize_config_of_an_hf_checkpoint(tmp_path):
    """A checkpoint's config.json (dtype instead of torch_dtype, a quantization_config) materialized both
    ways: dequantized (quantization gone, the new dtype under both keys) and FP8 (derived config)."""
    from rl.inference.server import torch_dtype

    assets = tmp_path / "assets"
    assets.mkdir()
    cfg = {"model_type": "deepseek_v3", "dtype": "bfloat16",
           "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": [128, 128], "ignored_layers": ["model.layers.0.mlp"]}}
    (assets / "config.json").write_text(json.dumps(cfg))
    assert torch_dtype("auto", cfg) == torch.bfloat16
    assert torch_dtype("auto", {"torch_dtype": "float32"}) == torch.float32
    g = torch.Generator().manual_seed(0)
    sd = {"model.embed_tokens.weight": torch.randn(16, 8, generator=g),
          "model.layers.0.mlp.gate.weight": torch.randn(4, 8, generator=g),
          "model.layers.0.self_attn.o_proj.weight": torch.randn(8, 8, generator=g),
          "model.norm.weight": torch.ones(8)}
    w = exchange.publish(tmp_path / "run", "weights", 0, lambda d: write_shards(d, sd), producer="test").path
    deq = json.loads((materialize(assets, w, tmp_path / "deq", dtype=torch.float32, fp8=False)
                      / "config.json").read_text())
    assert "quantization_config" not in deq and deq["dtype"] == deq["torch_dtype"] == "float32"
    q = json.loads((materialize(assets, w, tmp_path / "fp8", dtype=torch.bfloat16, fp8=True)
                    / "config.json").read_text())["quantization_config"]
    assert q["ignored_layers"] == ["model.layers.0.mlp", "model.embed_tokens", "model.layers.0.mlp.gate"]
