"""GLM-5 (rl/models/glm_moe_dsa) equals transformers 5.19's GlmMoeDsaForCausalLM, and its sparse attention works.

The outside reference is transformers' own implementation (random init, fp32, seed fixed), with the
expert-bias correction made non-zero and the router weights scaled up so that the bias and the routing
both matter. Sequences are longer than index_topk, so the DSA indexer really drops keys.
"""
from __future__ import annotations

import os
import socket
import time
from types import SimpleNamespace

import pytest
import torch

from rl.models import common, cpu, glm_moe_dsa, replay
from rl.models.glm_moe_dsa import model as glm_model
from rl.models.glm_moe_dsa.parallelize import parallelize_glm5
from rl.trainer.model import materialize_empty

TOL = dict(rtol=1e-5, atol=1e-5)
SIZES = dict(vocab_size=512, hidden_size=128, num_hidden_layers=3, first_k_dense_replace=1,
             num_attention_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
             q_lora_rank=64, kv_lora_rank=64,
             qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, index_topk=8, index_head_dim=32,
             # GLM-5's own 32 indexer heads leave no exact ties in index score; 1-8 heads, which do
             # (every head's relu 0), are test_logits_equal_transformers_for_any_indexer_heads
             index_n_heads=8, moe_intermediate_size=32, intermediate_size=128, max_position_embeddings=512,
             routed_scaling_factor=2.5, rms_norm_eps=1e-5, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
N = 32  # tokens per row: > index_topk


def _hf(seed=0, **over):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
    cfg = GlmMoeDsaConfig(**{**SIZES, **over})
    torch.manual_seed(seed)
    ref = GlmMoeDsaForCausalLM(cfg).eval()
    with torch.no_grad():
        for m in ref.modules():
            if type(m).__name__ == "GlmMoeDsaTopkRouter":
                m.weight.normal_(0.0, cfg.hidden_size ** -0.5)  # logits O(1): scores far from sigmoid(0)
                m.e_score_correction_bias.normal_(0.0, 0.1)       # large enough to change the choice
    return cfg, ref


def _ours(cfg, sd, flex=False):
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.tools.utils import set_default_dtype
    spec = glm_moe_dsa.model_spec({"max_seq_len": 512}, cfg.to_dict())
    replay.apply(spec.model)
    cpu.apply(spec.model)
    if flex:  # the GPU's inner attention; the experts stay fp32 (torchtitan's grouped ones cast to bf16)
        for layer in spec.model.layers:
            layer.attention.inner_attention = FlexAttention.Config()
    with set_default_dtype(torch.float32), torch.device("meta"):
        model = spec.model.build()
    materialize_empty(model, "cpu")
    adapter = spec.state_dict_adapter(spec.model, None)
    missing, unexpected = model.load_state_dict(adapter.from_hf(sd), strict=False)
    assert not unexpected and all(k.endswith("tokens_per_expert_E") for k in missing), (missing, unexpected)
    return spec, model


def _tokens(b=2, n=N, seed=1):
    tok = torch.randint(0, SIZES["vocab_size"], (b, n), generator=torch.Generator().manual_seed(seed))
    return tok, torch.arange(n)[None].expand(b, -1)


def _logits(model, tok, pos):
    masks = cpu.document_mask(pos) if cpu.uses_dense_attention(model) else model.get_attention_masks(pos)
    return model(tok, positions=pos, attention_masks=masks)


def test_logits_equal_transformers():
    cfg, ref = _hf()
    _, model = _ours(cfg, ref.state_dict())
    tok, pos = _tokens()
    with torch.no_grad():
        ours, theirs = _logits(model, tok, pos), ref(input_ids=tok).logits
    assert theirs.abs().max() > 0.1
    torch.testing.assert_close(ours, theirs, **TOL)
    # the expert-bias correction is loaded (not zeroed) and changes the routing
    biases = [m.expert_bias_E for m in model.modules() if getattr(m, "expert_bias_E", None) is not None]
    assert biases and all(b.abs().sum() > 0 for b in biases)


def _earliest_tied_key(index_scores, allowed_BLL, doc_end, topk):
    """The tie-break this family used before (a stable sort keeping the earlier of tied keys), which
    differed from HF's torch.topk on the CPU: the parity test below must catch it."""
    idx = torch.sort(index_scores, dim=-1, descending=True, stable=True).indices[..., :topk]
    return torch.zeros_like(allowed_BLL).scatter_(-1, idx, True) & allowed_BLL


@pytest.mark.parametrize("index_topk", [8, 20])
@pytest.mark.parametrize("index_n_heads", [1, 2, 4, 8])
def test_logits_equal_transformers_for_any_indexer_heads(index_n_heads, index_topk, monkeypatch):
    """Any index_n_heads, top-k below the length (the selection drops keys). With 1-2 heads many keys
    score exactly 0 at the top-k boundary; HF keeps the tied keys torch.topk keeps, and so must we (the
    earlier-key tie-break then fails: the test's teeth)."""
    cfg, ref = _hf(index_n_heads=index_n_heads, index_topk=index_topk)
    _, model = _ours(cfg, ref.state_dict())
    tok, pos = _tokens()
    with torch.no_grad():
        theirs = ref(input_ids=tok).logits
        torch.testing.assert_close(_logits(model, tok, pos), theirs, **TOL)
        if index_n_heads <= 2:
            monkeypatch.setattr(glm_model, "_topk", _earliest_tied_key)
            assert (_logits(model, tok, pos) - theirs).abs().max() > 1e-3


def test_trainer_start_from_a_checkpoint_directory_equals_transformers(tmp_path):
    """The trainer's own path: config.json -> build_model (family glm_moe_dsa) -> rl.trainer.hf_load
    through this adapter's names; published names are the checkpoint's, bit for bit."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from rl.tiny_models.twins import write_twin
    from rl.trainer import hf_load
    from rl.models.common import hf_state_dict, logits
    from rl.trainer.model import build_model
    path = write_twin(tmp_path / "glm5", "glm_moe_dsa", seed=2)  # the twin's own 2 indexer heads: ties
    b = build_model(dict(name="t", family="glm_moe_dsa", hf_path=str(path), max_seq_len=512), seed=0,
                    materialize=False)
    materialize_empty(b.model, "cpu")
    assert hf_load.load(b.model, b.spec, path)["tensors"] > 0
    tok, pos = _tokens()
    with torch.no_grad():
        ours = logits(b.model, tok, pos)
        ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        theirs = ref(input_ids=tok).logits
    torch.testing.assert_close(ours, theirs, **TOL)
    ref = load_file(str(path / "model.safetensors"))
    pub = hf_state_dict(b)
    assert set(pub) == set(ref) and all(torch.equal(pub[k], ref[k]) for k in ref)


def test_flex_config_uses_the_combined_mask_through_sdpa():
    """The GPU configuration (flex inner attention, BlockMask from positions) runs the same network: the
    BlockMask is evaluated densely and attention is SDPA under allowed AND selected (here on the CPU)."""
    cfg, ref = _hf()
    _, model = _ours(cfg, ref.state_dict(), flex=True)
    assert not cpu.uses_dense_attention(model)
    tok, pos = _tokens(b=1)
    with torch.no_grad():
        torch.testing.assert_close(_logits(model, tok, pos), ref(input_ids=tok).logits, **TOL)


def test_round_trip_of_checkpoint_names(tmp_path):
    from safetensors.torch import load_file
    cfg, ref = _hf()
    ref.save_pretrained(tmp_path)  # transformers' checkpoint layout: experts split per expert
    sd = load_file(str(tmp_path / "model.safetensors"))
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in sd)
    assert any(".self_attn.indexer.k_norm.bias" in k for k in sd)
    spec = glm_moe_dsa.model_spec({"max_seq_len": 512}, cfg.to_dict())
    adapter = spec.state_dict_adapter(spec.model, None)
    tt = adapter.from_hf(sd)
    assert "layers.1.moe.expert_bias_E" in tt and "layers.2.attention.indexer.weights_proj.weight" in tt
    back = adapter.to_hf(tt)
    assert set(back) == set(sd)
    for k in sd:
        assert back[k].dtype == sd[k].dtype and torch.equal(back[k], sd[k]), k
    # the in-memory fused experts give the same torchtitan tensors as the split checkpoint layout
    fused = adapter.from_hf(ref.state_dict())
    assert set(fused) == set(tt) and all(torch.equal(fused[k], tt[k]) for k in tt)


def test_packed_documents_equal_each_document_alone():
    """With 2 indexer heads many keys score exactly 0. Which tied keys torch.topk keeps depends on the row
    length, so the top-k runs over each document's own keys: a packed document selects what it selects
    alone, which is what transformers selects for it (alone)."""
    cfg, ref = _hf(index_n_heads=2)
    _, model = _ours(cfg, ref.state_dict())
    a, _ = _tokens(b=1, n=20, seed=2)
    b, _ = _tokens(b=1, n=N - 20, seed=3)
    packed = torch.cat([a, b], dim=1)
    pos = torch.cat([torch.arange(20), torch.arange(N - 20)])[None]
    with torch.no_grad():
        both = _logits(model, packed, pos)
        alone_a = _logits(model, a, torch.arange(20)[None])
        alone_b = _logits(model, b, torch.arange(N - 20)[None])
    torch.testing.assert_close(both[:, :20], alone_a, **TOL)
    torch.testing.assert_close(both[:, 20:], alone_b, **TOL)
    with torch.no_grad():
        torch.testing.assert_close(both[:, :20], ref(input_ids=a).logits, **TOL)
        torch.testing.assert_close(both[:, 20:], ref(input_ids=b).logits, **TOL)


def test_backward_reaches_every_parameter_but_the_indexer():
    """HF runs the indexer under no_grad and its selection is discrete: the LM loss gives the indexer's
    weights no gradient (as HF); every other parameter gets one."""
    cfg, ref = _hf()
    _, model = _ours(cfg, ref.state_dict())
    model.train()
    tok, pos = _tokens()
    logp = torch.log_softmax(_logits(model, tok, pos)[:, :-1], dim=-1)
    (-logp.gather(-1, tok[:, 1:, None]).mean()).backward()
    no_grad = {n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0}
    assert no_grad == {n for n, _ in model.named_parameters() if ".attention.indexer." in n}
    assert len(no_grad) == 5 * SIZES["num_hidden_layers"]
    # HF agrees on the split
    ref.train()
    logp = torch.log_softmax(ref(input_ids=tok).logits[:, :-1], dim=-1)
    (-logp.gather(-1, tok[:, 1:, None]).mean()).backward()
    hf_no_grad = {n for n, p in ref.named_parameters() if p.grad is None}
    assert hf_no_grad == {n for n, _ in ref.named_parameters() if ".indexer." in n}


def test_index_selection_is_not_a_no_op_and_full_topk_is_dense_mla():
    from torchtitan.models.deepseek_v3.model import Attention
    cfg, ref = _hf()
    sd = ref.state_dict()
    tok, pos = _tokens()
    _, sparse = _ours(cfg, sd)
    cfg_full, _ = _hf(index_topk=N)
    _, full = _ours(cfg_full, sd)
    with torch.no_grad():
        ls, lf = _logits(sparse, tok, pos), _logits(full, tok, pos)
        assert (ls - lf).abs().max() > 1e-3  # dropping keys changes the network
        # with topk >= length the selection keeps every allowed key: torchtitan's plain MLA forward
        for layer in full.layers.values():
            layer.attention.forward = Attention.forward.__get__(layer.attention)
        torch.testing.assert_close(_logits(full, tok, pos), lf, **TOL)


def test_unsupported_config_values_name_the_key():
    from transformers import GlmMoeDsaConfig
    base = GlmMoeDsaConfig(**SIZES).to_dict()
    linear = {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}
    for over, key in [(dict(rope_parameters=linear), "rope_type"),
                      (dict(indexer_types=["full", "shared", "full"]), "indexer_types"),
                      (dict(q_lora_rank=None), "q_lora_rank"),
                      (dict(hidden_act="gelu"), "hidden_act")]:
        with pytest.raises(ValueError, match=key):
            glm_moe_dsa.model_spec({}, {**base, **over})


# -- two gloo ranks ---------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loss(model, tok, pos, total):
    logp = torch.log_softmax(_logits(model, tok, pos)[:, :-1], dim=-1)
    return -logp.gather(-1, tok[:, 1:, None]).sum() / total


def _packed_positions(b=2, n=N, firsts=(13, 7)):
    """Two documents per row, boundaries inside the head-tail chunks of cp 2 (chunk n/4)."""
    return torch.stack([torch.cat([torch.arange(f), torch.arange(n - f)]) for f in firsts[:b]])


def _worker(rank, world, port, dims, path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from torch.distributed.tensor import DTensor
    from rl.trainer import parallel
    from rl.models.common import load_hf_state_dict
    from rl.trainer.model import build_model
    data = torch.load(path)
    dp, ep, cp = dims
    d = parallel.init(SimpleNamespace(dp_shard=dp, ep=ep, cp=cp), torch.device("cpu"))
    try:
        built = build_model(dict(name="glm5", family="glm_moe_dsa", max_seq_len=512), seed=0,
                            parallel={"ep": ep, "cp": cp}, hf_config=data["config"])
        load_hf_state_dict(built, data["hf"])
        model = parallel.parallelize(built.model, built.spec, d, torch.float32)
        w1 = model.layers["1"].moe.routed_experts.inner_experts.w1_EFD
        local_experts = w1.to_local().shape[0] if ep > 1 else w1.shape[0]
        tok, pos = data["tokens"], data["positions"]
        total = tok[:, 1:].numel()
        mine = None
        if cp == 1:
            with torch.no_grad():
                lg = _logits(model, tok, pos)
            # each rank its own row, loss normalised by the batch-wide count: summed grads = one process's
            loss = _loss(model, tok[rank:rank + 1], pos[rank:rank + 1], total)
        else:
            # both rows on every rank, each split head-tail by the trainer's own CP sharding (mask rows
            # of the local queries against the gathered keys); position j scores token j+1
            from rl.trainer.packing import Row, _cp_shard
            targets = torch.nn.functional.pad(tok[:, 1:], (0, 1))
            weight = torch.nn.functional.pad(torch.ones(tok.shape[0], tok.shape[1] - 1), (0, 1))
            row = _cp_shard(Row(tok, pos, targets, {"w": weight}), d)
            mine = common.headtail_index(tok.shape[1], cp, d.cp_rank)
            assert row.masks.shape == (tok.shape[0], 1, len(mine), tok.shape[1])
            out = model(row.tokens, positions=row.positions, attention_masks=row.masks)
            lg = out.detach()
            logp = torch.log_softmax(out, dim=-1).gather(-1, row.targets[..., None]).squeeze(-1)
            loss = -(logp * row.per_token["w"]).sum() / total
        loss.backward()
        grads = {}
        for n, p in model.named_parameters():
            if p.grad is not None:
                g = p.grad
                grads[n] = (g.full_tensor() if isinstance(g, DTensor) else g).clone()
        loss_sum = float(d.sum(loss.detach()))  # a collective: every rank
        if rank == 0:
            torch.save(dict(logits=lg, loss=loss_sum, grads=grads, local_experts=local_experts, mine=mine),
                       path + ".out")
        elif cp > 1:
            torch.save(dict(logits=lg, mine=mine), path + f".out{rank}")
    finally:
        d.close()


@pytest.mark.distributed
@pytest.mark.parametrize("dims", [(2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["dp_shard2", "ep2", "cp2"])
def test_two_gloo_ranks_give_the_single_process_logits_loss_and_grads(tmp_path, dims):
    """cp2: packed documents, index_topk 8 < the documents' lengths (the indexer drops keys), 2 indexer
    heads, and in the last layer only exact ties (its indexer's query projection zeroed), which must be
    broken by key position whatever the CP layout."""
    import torch.multiprocessing as mp
    from rl.models.common import load_hf_state_dict
    from rl.trainer.model import build_model
    cp = dims[2]
    cfg, ref = _hf(**(dict(index_n_heads=2) if cp > 1 else {}))
    if cp > 1:  # layer 2's indexer scores every key 0: its selection is the tie-break alone
        with torch.no_grad():
            ref.model.layers[2].self_attn.indexer.wq_b.weight.zero_()
    h = cfg.to_dict()
    tok, pos = _tokens()
    if cp > 1:
        pos = _packed_positions()
    path = str(tmp_path / "in.pt")
    torch.save(dict(config=h, hf=ref.state_dict(), tokens=tok, positions=pos), path)
    built = build_model(dict(name="glm5", family="glm_moe_dsa", max_seq_len=512), seed=0, hf_config=h)
    load_hf_state_dict(built, ref.state_dict())
    single = built.model
    loss = _loss(single, tok, pos, tok[:, 1:].numel())
    loss.backward()
    with torch.no_grad():
        lg = _logits(single, tok, pos)
    ctx = mp.start_processes(_worker, args=(2, _free_port(), dims, path), nprocs=2, start_method="spawn",
                             join=False)
    deadline = time.monotonic() + 180
    while not ctx.join(timeout=2):  # raises if a rank failed
        if time.monotonic() > deadline:  # a rank stuck in a collective: end both, fail
            for proc in ctx.processes:
                proc.kill()
            pytest.fail("two-rank GLM-5 run did not finish in 180 s")
    out = torch.load(path + ".out")
    if dims[1] == 2:  # the routed experts are split over the ep ranks
        assert out["local_experts"] == SIZES["n_routed_experts"] // 2
    if cp > 1:  # every rank's logits are those of the positions it holds
        parts = [out] + [torch.load(path + f".out{r}") for r in range(1, cp)]
        assert sorted(torch.cat([p["mine"] for p in parts]).tolist()) == list(range(N))
        got = torch.empty_like(lg)
        for p in parts:
            got[:, p["mine"]] = p["logits"]
        out["logits"] = got
    torch.testing.assert_close(out["logits"], lg, **TOL)
    assert out["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    want = {n: p.grad for n, p in single.named_parameters() if p.grad is not None}
    assert set(out["grads"]) >= set(want)
    for n, g in want.items():
        torch.testing.assert_close(out["grads"][n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_indexer_under_a_cp_layout_selects_the_single_process_keys():
    """Each cp rank's queries (head-tail rows) against the gathered keys (rank 0's chunks, rank 1's) pick
    the keys one process picks. Second pass: the indexer's query projection zeroed, so every key scores
    exactly 0 and the choice is the tie-break alone (torch.topk's over each document's keys); scoring
    the keys in the gathered layout instead of row-position order would then choose other keys (the
    test's teeth). The documents' ends come from the whole row (GlmAttention max-reduces each rank's)."""
    cfg, ref = _hf(index_n_heads=2)
    _, model = _ours(cfg, ref.state_dict())
    att = model.layers["1"].attention
    x = torch.randn(2, N, SIZES["hidden_size"], generator=torch.Generator().manual_seed(5))
    pos = _packed_positions()
    allowed_full = cpu.document_mask(pos)[:, 0]
    g = common.gathered_index(N, 2)
    q_resid = att.q_norm(att.wq_a(x))
    for all_ties in (False, True):
        if all_ties:
            with torch.no_grad():
                att.indexer.wq_b.weight.zero_()
        single = att.indexer(x, q_resid, att.rope, pos, allowed_full)
        assert (single.sum(-1) < allowed_full.sum(-1)).any()  # keys are dropped
        keys = att.indexer.keys(x[:, g], att.rope, pos[:, g])
        ends = glm_model.doc_ends(allowed_full)
        # each rank's queries see part of every document: the max over the ranks is the whole row's
        per_rank = [glm_model.doc_ends(cpu.cp_document_mask(pos, common.headtail_index(N, 2, r), g)[:, 0], g)
                    for r in range(2)]
        assert torch.equal(torch.maximum(*per_rank), ends) and not torch.equal(per_rank[0], ends)
        differs = False
        for r in range(2):
            mine = common.headtail_index(N, 2, r)
            args = (x[:, mine], q_resid[:, mine], att.rope, pos[:, mine], cpu.cp_document_mask(pos, mine, g)[:, 0])
            sel = att.indexer(*args, keys=keys, key_index=g, doc_end=ends)
            assert torch.equal(sel, single[:, mine][:, :, g]), (all_ties, r)
            if all_ties:  # without key_index the gathered layout is taken for row order
                differs |= not torch.equal(att.indexer(*args, keys=keys), sel)
        assert differs == all_ties


def test_indexer_selects_only_allowed_keys_topk_of_them():
    cfg, ref = _hf(index_n_heads=2)
    _, model = _ours(cfg, ref.state_dict())
    att = model.layers["1"].attention
    x = torch.randn(1, N, SIZES["hidden_size"], generator=torch.Generator().manual_seed(4))
    pos = torch.cat([torch.arange(12), torch.arange(N - 12)])[None]
    allowed = cpu.document_mask(pos)[:, 0]
    sel = att.indexer(x, att.q_norm(att.wq_a(x)), att.rope, pos, allowed)
    assert not (sel & ~allowed).any()
    assert torch.equal(sel.sum(-1), allowed.sum(-1).clamp(max=SIZES["index_topk"]))


def test_tensor_parallel_is_refused_by_name():
    for cp in (False, True):
        with pytest.raises(NotImplementedError, match="tensor parallelism"):
            parallelize_glm5(None, parallel_dims=SimpleNamespace(cp_enabled=cp, tp_enabled=True))


def test_context_parallel_refuses_a_block_mask():
    """Under CP a BlockMask of the local rows cannot say which gathered keys a query may see."""
    from torch.nn.attention.flex_attention import create_block_mask
    bm = create_block_mask(lambda b, h, q, k: q >= k, 1, 1, N, N, device="cpu")
    assert glm_model.dense_allowed_mask(bm, 1, N, "cpu").shape == (1, 1, N, N)
    with pytest.raises(NotImplementedError, match="context parallelism"):
        glm_model.dense_allowed_mask(bm, 1, N // 2, "cpu", kv_length=N)
