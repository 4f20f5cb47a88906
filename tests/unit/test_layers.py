"""rl.models.layers and the families' torch-free args: the published parameter counts come out of the
`layers()` rows, the Mamba-2 state is vLLM's own state shape, and a family made of existing layer kinds is
one folder plus one row (a throwaway family registered here from a config.json is composed, planned,
estimated and predicted without a line elsewhere)."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from rl.models import layers as L

REPO = Path(__file__).resolve().parents[2]
CARDS = REPO / "conf" / "checkpoints"


def _counts(args) -> tuple[int, int]:
    """(total, active) of an args' main network: its rows, both embedding tables and the final norm."""
    rows = args.layers()
    d = rows[0].dim
    head = 2 * args.vocab_size * d + d
    return head + sum(x.params() for x in rows), head + sum(x.active() for x in rows)


def test_published_counts_are_sums_over_the_rows():
    from rl.models.deepseek_v3 import args as dsv3
    from rl.models.glm_moe_dsa import args as glm
    from rl.models.nemotron_h import args as nem
    kimi = dsv3.from_hf(json.loads((CARDS / "kimi_k2_7" / "config.json").read_text()))   # a kimi_k25 card
    assert _counts(kimi) == (1026408209408, 32861477888)          # Kimi K2: "1.03T total, 32B activated"
    ds = dataclasses.replace(kimi, vocab_size=129280, n_heads=128, num_experts=256, n_dense_layers=3)
    assert _counts(ds) == (671026404352, 37552282624)             # DeepSeek-V3: "671B total, 37B activated"
    g = glm.from_hf(json.loads((CARDS / "glm_moe_dsa" / "config.json").read_text()))
    assert _counts(g) == (743911199232, 41784709632)              # GLM-5: "744B parameters (40B active)"
    assert isinstance(g.layers()[0].parts[0], L.DSA) and not isinstance(kimi.layers()[0].parts[0], L.DSA)
    n = nem.from_hf(json.loads((CARDS / "nemotron_h" / "config.json").read_text()))
    assert _counts(n) == (549569260032, 55034604032)              # Nemotron-3 Ultra: "550B / 55B active"
    assert sum(x.params() for x in n.mtp_layers()) == 10777305600 and all(x.frozen for x in n.mtp_layers())


def test_calculators_by_hand():
    gqa = L.GQA(dim=64, n_heads=8, n_kv_heads=2, head_dim=16, qk_norm=True)
    assert gqa.params() == L.Count(linear=64 * 12 * 16 + 8 * 16 * 64, norms=32)
    assert gqa.kv_bytes(tp=8, kvb=2) == 2 * 1 * 16 * 2                 # at least one KV head per rank
    mla = L.MLA(dim=64, n_heads=4, q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=8)
    dsa = L.DSA(**dataclasses.asdict(mla), index_n_heads=2, index_head_dim=16, index_topk=10)
    assert mla.kv_bytes(1, 2) == (32 + 4) * 2 and dsa.kv_bytes(1, 2) == (32 + 4) * 2 + 16 + 4
    assert dsa.flops(100, True) == 2 * 4 * 20 * 10 + 2 * 2 * 16 * 100      # top-k keys + the indexer on all
    moe = L.MoE(dim=64, hidden=32, n_experts=8, top_k=2, n_shared=1)
    row = L.Layer(64, (gqa, moe))
    assert row.params() - row.active() == 6 * 3 * 64 * 32                 # the 6 experts a token skips
    assert row.params(ep=4) == row.params() - 6 * 3 * 64 * 32             # 2 of 8 experts on an ep rank
    assert row.norms == 2 * 64 + 32 and row.routed and not L.Layer(64, (gqa, L.MLP(64, 96))).routed


def test_mamba2_state_is_vllms_state_shape():
    """The constant per-sequence state the memory estimate charges is the shape vLLM allocates
    (MambaStateShapeCalculator / MambaStateDtypeCalculator), on each tp rank."""
    torch = pytest.importorskip("torch")
    mu = pytest.importorskip("vllm.model_executor.layers.mamba.mamba_utils")
    from rl.models.nemotron_h import args as nem
    n = nem.from_hf(json.loads((CARDS / "nemotron_h" / "config.json").read_text()))
    m = next(x.parts[0] for x in n.layers() if isinstance(x.parts[0], L.Mamba2))
    conv_dt, ssm_dt = mu.MambaStateDtypeCalculator.mamba2_state_dtype("bfloat16", "auto", "float32")
    for tp in (1, 2, 8):
        conv, ssm = mu.MambaStateShapeCalculator.mamba2_state_shape(
            tp_world_size=tp, intermediate_size=m.d_inner, n_groups=m.n_groups, num_heads=m.heads,
            head_dim=m.head_dim, state_size=m.ssm_state, conv_kernel=m.conv_kernel)
        vllm_bytes = torch.Size(conv).numel() * conv_dt.itemsize + torch.Size(ssm).numel() * ssm_dt.itemsize
        assert m.state_bytes(tp, 2) == vllm_bytes, tp


# -- a throwaway family: one folder (its args.py) and one row ----------------------------------------------
TOY_ARGS = '''
"""A toy family: GQA with RoPE (no q/k norms), one leading dense SwiGLU layer, then MoE layers with a
shared expert; sizes from its config.json (the checkpoint's, `model.hf_path`)."""
from rl.contract import hf as hfc
from rl.models import layers as L


class ToyArgs:
    def __init__(self, h):
        self.vocab_size, self.dim = int(h["vocab_size"]), int(h["hidden_size"])
        self.h = h

    def layers(self):
        h, d = self.h, self.dim
        attn = L.GQA(d, h["num_attention_heads"], h["num_key_value_heads"], h["head_dim"])
        dense = L.MLP(d, h["intermediate_size"])
        moe = L.MoE(d, h["moe_intermediate_size"], h["num_experts"], h["num_experts_per_tok"], n_shared=1)
        return tuple(L.Layer(d, (attn, dense if i < h["first_k_dense_replace"] else moe))
                     for i in range(h["num_hidden_layers"]))

    def mtp_layers(self):
        return ()

    def model_fields(self):
        h = self.h
        return dict(vocab_size=self.vocab_size, dim=self.dim, n_layers=h["num_hidden_layers"],
                    n_heads=h["num_attention_heads"], n_kv_heads=h["num_key_value_heads"], head_dim=h["head_dim"],
                    moe_hidden_dim=h["moe_intermediate_size"], num_experts=h["num_experts"],
                    top_k=h["num_experts_per_tok"], rope_theta=hfc.rope_theta(h))


def from_hf(hf):
    return ToyArgs(hfc.text_config(hf))


def from_model(m, hf=None):
    return from_hf(hf if hf is not None else hfc.read_config(m.hf_path))
'''
TOY_CONFIG = dict(model_type="toy_moe", vocab_size=32000, hidden_size=2048, num_hidden_layers=12,
                  num_attention_heads=16, num_key_value_heads=4, head_dim=128, intermediate_size=8192,
                  moe_intermediate_size=768, num_experts=64, num_experts_per_tok=4, first_k_dense_replace=1,
                  rope_theta=10000.0, max_position_embeddings=32768)


@pytest.fixture
def toy_family(tmp_path, monkeypatch):
    """Registers family `toy` (model_type toy_moe): its folder is tmp_path/toy (rl.models' path extended)
    and its row is added to rl.contract.families' tables as if written into ROWS."""
    import rl.models
    from rl.contract import config, families, validation
    pkg = tmp_path / "pkgs" / "toy_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "args.py").write_text(TOY_ARGS)
    monkeypatch.setattr(rl.models, "__path__", [*rl.models.__path__, str(pkg.parent)])
    row = families.Family("toy", "toy_pkg", "gqa", ("toy_moe",))                 # the one row
    rows = families.ROWS + (row,)
    monkeypatch.setattr(families, "ROWS", rows)
    monkeypatch.setitem(families.BY_NAME, "toy", row)
    monkeypatch.setitem(families.BY_MODEL_TYPE, "toy_moe", "toy")
    monkeypatch.setattr(families, "FAMILIES", tuple(f.name for f in rows))
    monkeypatch.setattr(config, "FAMILIES", families.FAMILIES)
    monkeypatch.setitem(validation._CHOICES, "model.family", families.FAMILIES)
    card = tmp_path / "toy_ckpt"
    card.mkdir()
    (card / "config.json").write_text(json.dumps(TOY_CONFIG))
    yield card
    for k in [k for k in sys.modules if k.startswith("rl.models.toy_pkg")]:
        del sys.modules[k]


def test_a_family_of_existing_kinds_is_one_folder_and_one_row(toy_family):
    from launch import memory, perf
    from launch.compose import compose_points
    from launch.plan import make_plan
    gpu = ["cluster=slurm", "trainer.nodes=2", "trainer.gpus_per_node=8", "trainer.parallel.dp_shard=4",
           "trainer.parallel.ep=4", "inference.nodes=2", "inference.gpus_per_node=8", "inference.tp=2",
           "inference.dp=4", "inference.ep=8", "inference.replicas=2", "inference.max_model_len=32768"]
    (cfg,) = compose_points([*gpu, f"model.hf_path={toy_family}", "model.name=toy",
                             "run_dir=/tmp/hetrl-toy-family"], multirun=False)
    assert cfg["model"]["family"] == "toy" and cfg["model"]["n_layers"] == 12
    plan = make_plan(cfg)                                 # refuses what does not fit
    rep = memory.estimate(cfg, plan)
    d, f, e, k = 2048, 768, 64, 4
    attn = d * (16 + 8) * 128 + 16 * 128 * d
    dense_block = attn + 3 * d * 8192 + 2 * d
    moe_block = attn + 3 * d * f + e * d + 2 * d                 # + shared expert, router, the two norms
    head = 2 * 32000 * d + d
    assert rep.params_total == head + dense_block + 11 * (moe_block + e * 3 * d * f)
    assert rep.params_active == head + dense_block + 11 * (moe_block + k * 3 * d * f)
    decode = rep.role("inference")
    assert decode.term("KV") > 0 and decode.term("Mamba") == 0
    s = memory.Shape.from_cfg(cfg["model"])
    assert memory.kv_bytes_per_token(s, tp=2, kvb=2) == 12 * 2 * 2 * 128 * 2   # 4 KV heads over tp 2
    pred = perf.predict(cfg)
    assert pred.step_s > 0 and any(t.name.startswith("EP all-to-all, 11 MoE layers") for t in pred.terms)
