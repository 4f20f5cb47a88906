"""launch.memory, pure logic: parameter counts of published models, sharding arithmetic, KV cache,
activation checkpointing, refusals naming the role and the term, and the real-cluster experiments
fitting. (tests/integration/test_memory_measured.py compares the estimate with measured memory.)"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from launch import activations, memory
from launch.compose import compose_points
from launch.plan import make_plan
from rl.contract.config import PlanError, structured
from omegaconf import OmegaConf

GiB = 2**30

# Published architectures (config.json of each checkpoint; the trainer keys of conf/experiment/*.yaml).
KIMI_K2 = dict(vocab_size=163840, dim=7168, n_layers=61, n_heads=64, n_kv_heads=64, head_dim=192,
               moe_hidden_dim=2048, num_experts=384, top_k=8, max_seq_len=131072, family="kimi_k2_7",
               q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
               n_shared_experts=1, n_dense_layers=1, dense_hidden_dim=18432)
DEEPSEEK_V3 = {**KIMI_K2, "vocab_size": 129280, "n_heads": 128, "n_kv_heads": 128, "num_experts": 256,
               "n_dense_layers": 3, "family": "deepseek_v3"}
GLM5 = dict(vocab_size=154880, dim=6144, n_layers=78, n_heads=64, n_kv_heads=64, head_dim=256,
            moe_hidden_dim=2048, num_experts=256, top_k=8, max_seq_len=131072, family="glm_moe_dsa",
            q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
            n_shared_experts=1, n_dense_layers=3, dense_hidden_dim=12288, index_n_heads=32,
            index_head_dim=128, index_topk=2048)


def params(m: dict) -> memory.Params:
    return memory.count_params(memory.Shape.from_cfg(m))


@pytest.mark.parametrize("m, total, active", [
    (KIMI_K2, 1.03e12, 32e9),      # Kimi K2: "1T total (1.03T), 32B activated"
    (DEEPSEEK_V3, 671e9, 37e9),    # DeepSeek-V3: "671B total, 37B activated"
    (GLM5, 744e9, 40e9),           # GLM-5: "744B parameters (40B active)"
], ids=["kimi_k2", "deepseek_v3", "glm5"])
def test_parameter_counts_match_published_totals(m, total, active):
    p = params(m)
    assert abs(p.total - total) <= 0.005 * total, p.total
    # active counts here include both embedding tables; the published figures round differently
    assert abs(p.active - active) <= 0.05 * active, p.active
    assert p.total == p.dense + p.experts_total and p.active < p.total


def test_experiment_yamls_hold_the_published_architectures():
    for name, ref in (("kimi_swe", KIMI_K2), ("glm5_swe", GLM5)):
        (cfg,) = compose_points([f"+experiment={name}", "run_dir=/tmp/hetrl-memory-test", card(name)],
                                multirun=False)
        assert {k: cfg["model"][k] for k in ref} == ref, name


def card(experiment: str) -> str:
    """The experiment's checkpoint as an architecture card (config.json only; rl.contract.hf)."""
    fam = "kimi_k2_7" if experiment.startswith("kimi") else "glm_moe_dsa"
    return f"model.hf_path={Path(__file__).resolve().parents[2]}/conf/checkpoints/{fam}"


def cfg_of(over: dict) -> dict:
    over = {"run_dir": "/tmp/hetrl-memory-test", **over}
    return OmegaConf.to_container(structured(over), resolve=True)


GPU = {"cluster": {"backend": "slurm"},
       "model": {**KIMI_K2},
       "trainer": {"nodes": 16, "gpus_per_node": 8, "dtype": "bfloat16", "micro_batch_tokens": 131072,
                   "activation_checkpointing": "full", "parallel": {"dp_shard": 1, "ep": 16, "cp": 8}},
       "inference": {"nodes": 4, "gpus_per_node": 8, "tp": 1, "dp": 32, "ep": 32, "replicas": 1,
                     "max_model_len": 131072, "dtype": "auto", "fp8_load": "fp8"},
       "orchestrator": {"max_concurrency": 64}}


def merged(base: dict, **over) -> dict:
    out = json.loads(json.dumps(base))
    for dotted, v in over.items():
        d = out
        *path, last = dotted.split("__")
        for k in path:
            d = d.setdefault(k, {})
        d[last] = v
    return out


def report_of(over: dict) -> memory.MemoryReport:
    cfg = cfg_of(over)
    return memory.estimate(cfg, make_plan(cfg, check_memory=False))


def test_trainer_state_is_16_bytes_per_parameter_over_all_ranks():
    r = report_of(GPU).role("trainer")
    per_rank = params(KIMI_K2).total / 128
    assert r.term("parameters") == pytest.approx(4 * per_rank, rel=1e-6)
    assert r.term("gradients") == pytest.approx(4 * per_rank, rel=1e-6)
    assert r.term("optimizer") == pytest.approx(8 * per_rank, rel=1e-6)
    # twice the nodes: half the state per GPU; ep only moves experts between ranks, not the total
    r2 = report_of(merged(GPU, trainer__nodes=32,
                          trainer__parallel={"dp_shard": 2, "ep": 16, "cp": 8})).role("trainer")
    assert r2.term("optimizer") == pytest.approx(r.term("optimizer") / 2, rel=1e-6)
    r3 = report_of(merged(GPU, trainer__parallel={"dp_shard": 1, "ep": 32, "cp": 4})).role("trainer")
    assert r3.term("optimizer") == r.term("optimizer")
    assert r3.term("FSDP") < r.term("FSDP")        # fewer experts per rank: a smaller unsharded unit


def test_cpu_offload_moves_the_state_to_host_memory():
    on = report_of(merged(GPU, trainer__cpu_offload=True)).role("trainer")
    off = report_of(GPU).role("trainer")
    state = off.term("parameters") + off.term("gradients") + off.term("optimizer")
    assert on.term("parameters") == on.term("optimizer") == 0
    assert on.total == off.total - state
    assert sum(b for _, b in on.host_terms) == state * 8   # 8 ranks per node


def test_context_parallel_splits_the_row_and_ac_keeps_less():
    acts = {}
    for ac in ("none", "selective", "full"):
        for cp in (1, 4):
            acts[ac, cp] = activations.trainer_acts(memory.Shape.from_cfg(KIMI_K2), tokens=131072, cb=2, cp=cp,
                                               ep=16, ac=ac, cpu=False)
    assert acts["none", 4].tokens == 131072 // 4
    assert acts["full", 4].logprobs == acts["full", 1].logprobs / 4 == 2 * 4 * 163840 * 32768
    for cp in (1, 4):
        assert acts["full", cp].kept < acts["selective", cp].kept < acts["none", cp].kept
        assert acts["none", cp].layer_bwd < acts["full", cp].layer_bwd   # AC recomputes a layer in backward
    assert acts["full", 4].kept == pytest.approx(acts["full", 1].kept / 4, rel=1e-3)
    # the cp ranks all-gather k and v: per local token, attention keeps more than without cp
    s = memory.Shape.from_cfg(KIMI_K2)
    moe = s.layers[-1]                          # an MLA + MoE block
    with_cp, without = (activations.layer_acts(moe, 2, cp, 16, False, 131072).saved for cp in (4, 1))
    assert with_cp > without


def test_inference_splits_experts_over_the_replica_and_dense_over_tp():
    p = params(KIMI_K2)
    r = report_of(GPU).role("inference")
    fp8 = 1 + 4 / 128**2
    assert r.term("weights: experts") == int(p.experts_total / 32 * fp8)
    dense = p.linear * fp8 + (2 * p.embed + p.other) * 2        # routers and norms in bf16
    assert r.term("weights: dense") == int(dense)
    bf16 = report_of(merged(GPU, inference__fp8_load="dequantize")).role("inference")
    assert bf16.term("weights: experts") == int(p.experts_total / 32 * 2)


def test_kv_cache_mla_gqa_and_concurrency():
    s = memory.Shape.from_cfg(KIMI_K2)
    assert memory.kv_bytes_per_token(s, tp=1, kvb=2) == (512 + 64) * 2 * 61
    g = memory.Shape.from_cfg(GLM5)
    assert memory.kv_bytes_per_token(g, tp=1, kvb=2) == ((512 + 64) * 2 + 128 + 4) * 78   # + indexer keys
    q = memory.Shape.from_cfg(dict(vocab_size=1000, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=16,
                                   moe_hidden_dim=64, num_experts=4, top_k=2, max_seq_len=64))
    assert memory.kv_bytes_per_token(q, tp=2, kvb=2) == 2 * 2 * 16 * 2 * 2
    assert memory.kv_bytes_per_token(q, tp=8, kvb=2) == 2 * 1 * 16 * 2 * 2        # one head per rank at least
    r = report_of(GPU).role("inference")        # 64 requests on one replica of 32 data-parallel ranks
    assert r.term("KV") == 2 * 131072 * memory.kv_bytes_per_token(s, 1, 2)


def test_refusal_names_the_role_and_the_largest_term():
    rep = report_of(merged(GPU, trainer__activation_checkpointing="none"))
    with pytest.raises(PlanError) as e:
        memory.check(rep)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("trainer: ") and "exceeds cluster.gpu_memory_gib=140" in msg
    assert "largest term: activations (no AC)" in msg and "trainer.activation_checkpointing=full" in msg
    rep = report_of(GPU)                        # full AC, no offload: the 16 B/param state does not fit
    with pytest.raises(PlanError, match=r"^trainer: .*largest term: optimizer states .*cpu_offload=true"):
        memory.check(rep)
    rep = report_of(merged(GPU, trainer__cpu_offload=True, orchestrator__max_concurrency=2048))
    with pytest.raises(PlanError, match=r"^inference: .* exceeds inference.gpu_memory_utilization=0.9 x "
                                        r"cluster.gpu_memory_gib=140 = 126.0 GiB \(largest term: KV cache"):
        memory.check(rep)
    memory.check(report_of(merged(GPU, trainer__cpu_offload=True)))          # fits: no error


def test_host_memory_is_checked_when_the_cluster_says_how_much():
    over = merged(GPU, trainer__cpu_offload=True)
    cfg = cfg_of(over)
    rep = memory.estimate(cfg, make_plan(cfg, check_memory=False))
    memory.check(rep)                            # no host capacity given: not checked
    tr = rep.role("trainer")
    tr.host_capacity = 512 * GiB
    with pytest.raises(PlanError, match=r"^trainer: .* of host memory per node exceeds "
                                        r"cluster.host_memory_gib=512"):
        memory.check(rep)


def test_cpu_runs_are_estimated_but_never_refused():
    rep = report_of({"trainer": {"micro_batch_tokens": 1 << 20}, "model": {"max_seq_len": 1 << 20}})
    tr = rep.role("trainer")
    assert tr.unit == "CPU rank" and tr.capacity == 0 and tr.total > 140 * GiB
    memory.check(rep)


def test_table_rows_and_report_json():
    rep = report_of(merged(GPU, trainer__cpu_offload=True))
    rows = memory.table_rows(rep)
    assert rows[0] == ("role", "term", "per GPU") and all(len(r) == 3 for r in rows)
    for r in rep.roles:
        assert any(row[0].startswith(r.role + " (") for row in rows)
    assert sum(1 for row in rows if row[1].startswith("total per")) == len(rep.roles)
    assert sum(1 for row in rows if row[1].startswith("capacity (fits)")) == len(rep.roles)
    json.dumps(dataclasses.asdict(rep))          # plan.json carries it


@pytest.mark.parametrize("name", ["kimi_swe", "glm5_swe", "glm5_seed"])
def test_real_cluster_experiments_fit(name):
    (cfg,) = compose_points([f"+experiment={name}", "run_dir=/tmp/hetrl-memory-test", card(name)], multirun=False)
    plan = make_plan(cfg)                        # refuses what does not fit
    rep = memory.estimate(cfg, plan)
    for r in rep.roles:
        assert r.unit == "GPU" and 0 < r.total <= r.capacity, (name, r.role, r.total / GiB)
    if name == "glm5_seed":                      # the seed's numbers, as its header states them
        assert cfg["trainer"]["nodes"] + cfg["inference"]["nodes"] == 28
        assert cfg["model"]["max_seq_len"] == cfg["inference"]["max_model_len"] == 131072
        assert cfg["orchestrator"]["prompts_per_step"] * cfg["orchestrator"]["group_size"] == 256
        assert "glm" in cfg["model"]["family"]


# -- hybrid (NemotronH: Mamba-2 / GQA / LatentMoE + MTP), from the Ultra card ----------------------------
NEMOTRON_CARD = Path(__file__).resolve().parents[2] / "conf" / "checkpoints" / "nemotron_h"


def nemotron_shape() -> memory.Shape:
    from rl.contract import hf
    from rl.models import fields
    m = dict(fields.model_fields(hf.read_config(NEMOTRON_CARD), "nemotron_h"), family="nemotron_h",
             max_seq_len=131072, hf_path=str(NEMOTRON_CARD))
    return memory.Shape.from_cfg(m)


def test_nemotron_ultra_counts_are_the_model_card_and_param_counts():
    """The estimate's counts and the family's `param_counts` are one sum over the same rows
    (rl.models.nemotron_h.args.layers), pinned to the Ultra card's 549.6B / 55.0B active (+10.8B MTP)."""
    from rl.models.layers import GQA, LatentMoE, Mamba2
    from rl.models.nemotron_h.args import param_counts
    ref = param_counts(json.loads((NEMOTRON_CARD / "config.json").read_text()))
    p = memory.count_params(nemotron_shape())
    assert (p.total, p.active, p.frozen, p.frozen_active) == (549569260032, 55034604032, 10777305600, 886612480)
    assert (ref["total"], ref["active"], ref["mtp_total"], ref["mtp_active"]) == (
        p.total, p.active, p.frozen, p.frozen_active)
    assert abs(p.total - 550e9) <= 0.02 * 550e9 and abs(p.active - 55e9) <= 0.02 * 55e9   # the model card
    s = p.shape
    kinds = [type(x.parts[0]) for x in s.layers]
    assert (kinds.count(Mamba2), kinds.count(GQA), kinds.count(LatentMoE), s.moe_layers) == (50, 8, 50, 50)
    moe = next(x.parts[0] for x in s.layers if isinstance(x.parts[0], LatentMoE))
    assert moe.params().expert == 2 * 2048 * s.moe_hidden_dim    # non-gated experts at the latent width (2048)


def test_nemotron_kv_only_for_attention_layers_and_constant_mamba_state():
    from rl.models.layers import Mamba2
    s = nemotron_shape()
    assert memory.kv_bytes_per_token(s, tp=1, kvb=2) == 2 * 2 * 128 * 2 * 8     # 8 attention layers of 108
    row = next(x for x in s.layers if isinstance(x.parts[0], Mamba2))
    y = row.parts[0]
    ssm = y.heads * y.head_dim * y.ssm_state * 4
    conv = (y.conv_kernel - 1) * y.conv_dim * 2
    assert memory.state_bytes_per_seq(s, tp=1, wb=2) == 50 * (ssm + conv)
    assert memory.state_bytes_per_seq(memory.Shape.from_cfg(KIMI_K2), tp=1, wb=2) == 0
    # training: a Mamba layer keeps the chunked scan's states, heads x head_dim x state per chunk
    a = activations.layer_acts(row, 2, 1, 1, False, 8192)
    assert a.saved > 2 * y.heads * y.head_dim * y.ssm_state * 4 / y.chunk_size
    acts = activations.trainer_acts(s, tokens=65536, cb=2, cp=8, ep=1, ac="full", cpu=False)
    assert acts.kept == pytest.approx((108 * s.dim * 2 + 8 + 3 * s.dim * 2 + 4) * 8192, rel=1e-6)


NEMOTRON_PLAN = ["+experiment=nemotron3_swe", "run_dir=/tmp/hetrl-memory-test", "cluster=slurm",
                 f"model.hf_path={NEMOTRON_CARD}"]


def test_nemotron3_swe_fits_and_freezes_mtp():
    (cfg,) = compose_points(NEMOTRON_PLAN, multirun=False)
    plan = make_plan(cfg)                        # refuses what does not fit
    rep = memory.estimate(cfg, plan)
    assert abs(rep.params_total - 550e9) <= 0.02 * 550e9 and abs(rep.params_active - 55e9) <= 0.02 * 55e9
    for r in rep.roles:
        assert r.unit == "GPU" and 0 < r.total <= r.capacity, (r.role, r.total / GiB)
    assert plan.trainer.ep == 8 and plan.trainer.cp <= 8   # NemotronH: EP, cp | n_groups
    assert cfg["model"]["max_seq_len"] == 131072    # EP shrinks the FSDP unit enough for 131072-token rows
    decode = rep.role("inference decode")
    assert decode.term("Mamba state") > 0 and decode.term("KV") > 0
    # MTP: parameters only (frozen), no gradients or optimizer state
    (off,) = compose_points(NEMOTRON_PLAN + ["trainer.cpu_offload=false"], multirun=False)
    t = memory.estimate(off, make_plan(off, check_memory=False)).role("trainer")
    p = memory.count_params(nemotron_shape())
    world = 128
    assert t.term("parameters: frozen MTP") == -(-p.frozen // world) * 4
    assert t.term("gradients") == (-(-p.dense // world) + -(-p.experts_total // world)) * 4


def test_a_family_without_trainer_expert_parallelism_refuses_ep_in_validation(monkeypatch):
    """A family row without trainer expert parallelism (every family has it now; nemotron_h's row is made
    to lack it here) refuses ep > 1 in validation: an ep>1 plan used to pass `launch plan` and fail only
    when the trainer started."""
    import dataclasses
    import pytest
    from launch.compose import compose_points
    from rl.contract import families
    from rl.contract.config import ConfigError
    card = Path(__file__).resolve().parents[2] / "conf" / "checkpoints" / "nemotron_h"
    argv = ["+experiment=nemotron3_swe", "cluster=slurm", f"model.hf_path={card}", "trainer.parallel.ep=8"]
    assert compose_points(argv, False)   # nemotron_h: EP is built (rl.models.nemotron_h.parallelize)
    row = dataclasses.replace(families.get("nemotron_h"), trainer_expert_parallel=False)
    monkeypatch.setitem(families.BY_NAME, "nemotron_h", row)
    with pytest.raises(ConfigError, match=r"trainer.parallel.ep.*must be 1 for model.family=nemotron_h"):
        compose_points(argv, False)
