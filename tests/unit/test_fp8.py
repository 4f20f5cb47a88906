"""Block-scaled e4m3: round trip error bound, ragged edges, scale layout, shard round trip."""
import pytest
import torch

from rl import fp8
from rl.exchange import layout
from rl.exchange import weights as W


@pytest.mark.parametrize("shape", [(256, 256), (64, 64), (300, 130), (1, 200), (129, 127)])
def test_round_trip_error_bound(shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.logspace(-3, 1, shape[1])  # columns of very different magnitude
    q, s = fp8.quantize_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.shape == (-(-shape[0] // 128), -(-shape[1] // 128)) and s.dtype == torch.float32
    back = fp8.dequantize_block(q, s)
    # e4m3 has 3 mantissa bits: relative rounding error <= 2^-4 of the value for normal numbers,
    # and every element is within half a quantum of its block's scale grid.
    full_scale = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]
    err = (back - w).abs()
    assert torch.all(err <= w.abs() * 2 ** -4 + full_scale * 2 ** -9 + 1e-12)


def test_block_max_maps_to_e4m3_max():
    w = torch.zeros(128, 256)
    w[3, 5] = 7.0
    w[0, 200] = -0.5
    q, s = fp8.quantize_block(w)
    assert s[0, 0] == pytest.approx(7.0 / 448) and s[0, 1] == pytest.approx(0.5 / 448)
    assert q.float()[3, 5] == 448 and q.float()[0, 200] == -448


def test_zero_block_is_safe():
    q, s = fp8.quantize_block(torch.zeros(10, 10))
    assert torch.all(fp8.dequantize_block(q, s) == 0)


def test_fake_quantize_is_idempotent():
    torch.manual_seed(1)
    w = torch.randn(200, 300)
    once = fp8.fake_quantize_block(w)
    assert torch.equal(fp8.fake_quantize_block(once), once)


def test_activation_tiles():
    torch.manual_seed(2)
    x = torch.randn(4, 5, 300)
    q, s = fp8.quantize_act(x)
    assert s.shape == (4, 5, 3)
    assert torch.allclose(fp8.dequantize_act(q, s), x, rtol=2 ** -4, atol=1e-6)


def test_scale_shape_mismatch_is_an_error():
    q, s = fp8.quantize_block(torch.randn(256, 256))
    with pytest.raises(ValueError, match="scale shape"):
        fp8.dequantize_block(q, s[:1])


def test_shards_round_trip(tmp_path):
    torch.manual_seed(3)
    sd = {
        "model.embed_tokens.weight": torch.randn(512, 64),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64),
        "model.layers.0.mlp.experts.0.gate_proj.weight": torch.randn(64, 64),
        "model.layers.0.mlp.gate.weight": torch.randn(4, 64),
        "model.layers.0.input_layernorm.weight": torch.randn(64),
        "lm_head.weight": torch.randn(512, 64),
    }
    index = W.write_shards(tmp_path, sd, max_shard_bytes=40_000)
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    raw = dict(W.iter_tensors(tmp_path, dequantize=False))
    assert raw["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert "model.layers.0.self_attn.q_proj.weight_scale_inv" in raw
    assert raw["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16  # router stays high precision
    back = W.load_state_dict(tmp_path)
    assert set(back) == set(sd)
    for name, t in sd.items():
        if layout.default_quantize(name, t):
            assert torch.equal(back[name], fp8.fake_quantize_block(t))
        else:
            assert torch.equal(back[name], t.to(torch.bfloat16).float())
