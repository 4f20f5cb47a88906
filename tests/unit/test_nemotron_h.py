"""NemotronH (rl.models.nemotron_h) equals transformers 5.19's NemotronHForCausalLM, packs documents, runs CP/FSDP.

The outside reference is transformers' own torch path (random init, fp32), on a tiny config with every
block kind (Mamba-2, GQA attention, dense MLP, LatentMoE with group-limited routing) and one MTP step; the
expert-bias correction is made non-zero and the router weights scaled up so that both change the routing.
Rows are longer than the Mamba chunk (8) and not a multiple of it.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rl.models.nemotron_h import args as nargs
from rl.models.nemotron_h import mamba, model as nm
from rl.models.nemotron_h import model_spec
from rl.models.nemotron_h.state_dict_adapter import FP8_KEEP_DTYPE, NemotronHStateDictAdapter, keeps_dtype

ROOT = Path(__file__).resolve().parents[2]
TOL = dict(rtol=1e-4, atol=1e-4)
SIZES = dict(vocab_size=256, hidden_size=64,
             layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention", "mlp", "moe"],
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
             ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=8, n_groups=2, conv_kernel=4, chunk_size=8,
             n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
             moe_shared_expert_intermediate_size=48, moe_latent_size=32, n_group=2, topk_group=1,
             routed_scaling_factor=2.5, num_nextn_predict_layers=1,
             mtp_layers_block_type=["full_attention", "moe"], tie_word_embeddings=False)
N = 32


def _hf(seed=0, **over):
    from transformers import NemotronHConfig, NemotronHForCausalLM
    cfg = NemotronHConfig(**{**SIZES, **over})
    torch.manual_seed(seed)
    ref = NemotronHForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, b in ref.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
        for m in ref.modules():
            if type(m).__name__ == "NemotronHTopkRouter":
                m.weight.normal_(0.0, cfg.hidden_size ** -0.5)
    return cfg, ref


def _mtp_tensors(model, seed=3) -> dict:
    """Random MTP weights under checkpoint names (transformers has no MTP module to make them)."""
    g = torch.Generator().manual_seed(seed)
    sd = NemotronHStateDictAdapter().to_hf({k: v for k, v in model.state_dict().items() if k.startswith("mtp.")})
    return {k: (torch.randn(v.shape, generator=g) * 0.05 + (1.0 if k.endswith("norm.weight") else 0.0))
            for k, v in sd.items()}


def _ours(cfg, sd, with_mtp=True):
    spec = model_spec({}, cfg.to_dict())
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    model.init_weights()
    ad = spec.state_dict_adapter(spec.model, None)
    sd = dict(sd)
    if with_mtp:
        sd.update(_mtp_tensors(model))
    missing, unexpected = model.load_state_dict(ad.from_hf(sd), strict=False)
    assert not unexpected and (not missing if with_mtp else all(k.startswith("mtp.") for k in missing))
    return spec, model


def _tokens(b=2, n=N, seed=1):
    tok = torch.randint(0, SIZES["vocab_size"], (b, n), generator=torch.Generator().manual_seed(seed))
    return tok, torch.arange(n)[None].expand(b, -1)


def _nll(logits, tok):
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return -logp.gather(-1, tok[:, 1:, None]).mean()


# -- parity with transformers ------------------------------------------------------------------------------
def test_logits_equal_transformers():
    cfg, ref = _hf()
    _, model = _ours(cfg, ref.state_dict())
    tok, pos = _tokens(n=21)  # 3 chunks, the last partial
    with torch.no_grad():
        ours, theirs = model(tok, positions=pos), ref(input_ids=tok).logits
    assert theirs.abs().max() > 0.1
    assert (ours - theirs).abs().max() < 1e-4
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_group_limited_routing_and_bias_matter():
    """The parity above has teeth: without the bias or the group limit other experts are chosen."""
    cfg, ref = _hf()
    _, model = _ours(cfg, ref.state_dict())
    tok, pos = _tokens()
    routers = [m for m in model.modules() if isinstance(m, nm.Router)]

    def chosen():
        for r in routers:
            r.recorded = []
        with torch.no_grad():
            model(tok, positions=pos)
        out = [torch.sort(r.recorded[0], dim=-1)[0] for r in routers if r.recorded]
        for r in routers:
            r.recorded = None
        return torch.cat(out)
    base = chosen()
    for r in routers:
        r.n_group = 1
    assert not torch.equal(chosen(), base)
    for r in routers:
        r.n_group = 2
        r.e_score_correction_bias.zero_()
    assert not torch.equal(chosen(), base)


def test_one_optimizer_step_equals_transformers_and_loads_back(tmp_path):
    """One AdamW step on the same loss in both; then our trained weights, written by the adapter in the
    checkpoint layout, are read by transformers' from_pretrained and give our logits."""
    from safetensors.torch import save_file
    from transformers import NemotronHForCausalLM
    cfg, ref = _hf()
    _, model = _ours(cfg, ref.state_dict())
    ref.train()
    model.train()
    tok, pos = _tokens()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for m, o, out in ((ref, opt_ref, lambda: ref(input_ids=tok).logits), (model, opt, lambda: model(tok, positions=pos))):
        o.zero_grad()
        _nll(out(), tok).backward()
        o.step()
    assert all(p.grad is None for p in model.mtp.parameters())  # frozen MTP
    ref.eval()
    model.eval()
    with torch.no_grad():
        ours, theirs = model(tok, positions=pos), ref(input_ids=tok).logits
    torch.testing.assert_close(ours, theirs, **TOL)
    # weights moved (the step did something) and match transformers' through the adapter
    ad = NemotronHStateDictAdapter()
    got = ad.from_hf(ref.state_dict())
    for k, v in model.state_dict().items():
        if not k.startswith("mtp."):
            torch.testing.assert_close(v, got[k], rtol=1e-4, atol=1e-5, msg=k)
    # load back into transformers from the checkpoint layout
    hf = {k: v.contiguous() for k, v in ad.to_hf(model.state_dict()).items()}
    assert any(k.startswith("mtp.layers.") for k in hf) and all(k.startswith(("backbone.", "lm_head", "mtp.")) for k in hf)
    ref.config.save_pretrained(tmp_path)
    save_file(hf, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    back = NemotronHForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=tok).logits, ours, **TOL)


def test_adapter_round_trip_is_exact(tmp_path):
    """save_pretrained's checkpoint (backbone.*, experts split) + MTP tensors -> ours -> the same bytes."""
    from safetensors.torch import load_file
    cfg, ref = _hf()
    ref.save_pretrained(str(tmp_path))
    ckpt = load_file(str(tmp_path / "model.safetensors"))
    assert any(".mixer.experts.0.up_proj.weight" in k for k in ckpt) and any(k.startswith("backbone.") for k in ckpt)
    _, model = _ours(cfg, ckpt, with_mtp=False)
    ckpt.update(_mtp_tensors(model))
    ad = NemotronHStateDictAdapter()
    model.load_state_dict(ad.from_hf(ckpt))
    back = ad.to_hf(model.state_dict())
    assert set(back) == set(ckpt)
    assert all(torch.equal(back[k], ckpt[k]) for k in ckpt)
    # and transformers' in-memory names (model.*, fused experts) load to the same tensors
    mem = ad.from_hf(ref.state_dict())
    for k, v in ad.from_hf({k: v for k, v in ckpt.items() if not k.startswith("mtp.")}).items():
        assert torch.equal(mem[k], v), k


# -- packed documents ---------------------------------------------------------------------------------------
def test_two_documents_in_one_row_equal_each_alone():
    cfg, ref = _hf()
    _, model = _ours(cfg, ref.state_dict())
    a, b = 13, 19  # the boundary falls inside a Mamba chunk (8)
    tok, _ = _tokens(b=1, n=a + b)
    pos = torch.cat([torch.arange(a), torch.arange(b)])[None]
    with torch.no_grad():
        packed = model(tok, positions=pos)
        first = model(tok[:, :a], positions=torch.arange(a)[None])
        second = model(tok[:, a:], positions=torch.arange(b)[None])
        torch.testing.assert_close(packed[:, :a], first, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed[:, a:], second, rtol=1e-5, atol=1e-5)
        # and without the reset the second document would differ (the test's teeth)
        leaky = model(tok, positions=torch.arange(a + b)[None])
        assert (leaky[:, a:] - second).abs().max() > 1e-3
        lp, ent = nm.token_logprobs(model, tok, pos)
        assert lp[0, 0] == 0 and lp[0, a] == 0 and ent[0, a] == 0 and (lp[0, 1:a] < 0).all()
        lp2, _ = nm.token_logprobs(model, tok[:, a:], torch.arange(b)[None])
        torch.testing.assert_close(lp[:, a:], lp2, rtol=1e-5, atol=1e-5)


def test_ssd_scan_equals_the_sequential_recurrence_with_resets():
    g = torch.Generator().manual_seed(0)
    b, l, h, p, gr, n = 2, 23, 4, 3, 2, 5
    x, B, C = torch.randn(b, l, h, p, generator=g), torch.randn(b, l, gr, n, generator=g), torch.randn(b, l, gr, n, generator=g)
    dt = torch.rand(b, l, h, generator=g) * 0.5 + 0.01
    A, D = -torch.rand(h, generator=g) - 0.1, torch.randn(h, generator=g)
    pos = torch.stack([torch.cat([torch.arange(7), torch.arange(9), torch.arange(7)]), torch.arange(l)])
    y = mamba.ssd_scan(x, dt, A, B, C, D, 4, mamba.doc_ids(pos))
    Bh, Ch = B.repeat_interleave(h // gr, 2), C.repeat_interleave(h // gr, 2)
    want = torch.empty_like(y)
    for i in range(b):
        s = torch.zeros(h, p, n)
        for t in range(l):
            if pos[i, t] == 0:
                s = torch.zeros(h, p, n)
            s = torch.exp(dt[i, t] * A)[:, None, None] * s + dt[i, t][:, None, None] * x[i, t][..., None] * Bh[i, t][:, None]
            want[i, t] = (s * Ch[i, t][:, None]).sum(-1) + D[:, None] * x[i, t]
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


# -- MTP, config, counts, FP8 --------------------------------------------------------------------------------
def test_mtp_layers_are_loaded_frozen_and_run():
    cfg, ref = _hf()
    _, model = _ours(cfg, ref.state_dict())
    assert len(model.mtp) == 2 and model.mtp["0"].start and model.mtp["1"].end
    assert not any(p.requires_grad for p in model.mtp.parameters())
    tok, pos = _tokens()
    (lg,) = model.mtp_logits(tok, pos)
    assert lg.shape == (2, N, SIZES["vocab_size"]) and torch.isfinite(lg).all()


def test_config_aliases_and_refusals():
    a = nargs.NemotronHArgs.from_hf(dict(hybrid_override_pattern="M*E-", mamba_n_groups=4, mamba_d_conv=3,
                                         mtp_hybrid_override_pattern="*E", num_nextn_predict_layers=1,
                                         model_type="nemotron_h"))
    assert a.layer_types == ("linear_attention", "full_attention", "moe", "mlp") and a.n_groups == 4
    assert a.conv_kernel == 3 and a.mtp_types == ("full_attention", "moe")
    for over, key in [(dict(mamba_hidden_act="gelu"), "mamba_hidden_act"), (dict(tie_word_embeddings=True), "tie_word_embeddings"),
                      (dict(scoring_func="softmax"), "scoring_func"), (dict(model_type="llama"), "model_type")]:
        with pytest.raises(ValueError, match=key):
            nargs.NemotronHArgs.from_hf({**SIZES, **over})


def test_param_counts_match_the_built_model_and_the_ultra_card():
    cfg, _ = _hf()
    model = model_spec({}, cfg.to_dict()).model.build()
    c = nargs.param_counts(cfg.to_dict())
    main = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("mtp."))
    main += sum(b.numel() for n, b in model.named_buffers() if not n.startswith("mtp."))
    mtp = sum(p.numel() for p in model.mtp.parameters()) + sum(b.numel() for b in model.mtp.buffers())
    assert (c["total"], c["mtp_total"]) == (main, mtp)
    card = json.loads((ROOT / "conf/checkpoints/nemotron_h/config.json").read_text())
    u = nargs.param_counts(card)
    assert abs(u["total"] / 550e9 - 1) < 0.02 and abs(u["active"] / 55e9 - 1) < 0.02, u
    a = nargs.NemotronHArgs.from_hf(card)
    assert (a.n_layers, a.hidden_size, a.n_routed_experts, a.num_experts_per_tok) == (108, 8192, 512, 22)


def test_fp8_keep_list_covers_every_non_gemm_tensor():
    cfg, ref = _hf()
    _, model = _ours(cfg, ref.state_dict())
    hf = NemotronHStateDictAdapter().to_hf(model.state_dict())
    # FP8: the GEMMs of the Mamba mixer, the experts (routed, shared) and MLPs, and MTP's fusion; the
    # attention and latent projections are GEMMs kept high precision (NVIDIA's Nemotron 3 FP8 layout)
    fp8 = (".mixer.in_proj.weight", ".mixer.out_proj.weight", "up_proj.weight", "down_proj.weight", ".eh_proj.weight")
    high_gemms = (".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".o_proj.weight", "_latent_proj.weight")
    for k, v in hf.items():
        gemm = v.ndim == 2 and not k.endswith(("embeddings.weight", "lm_head.weight", "gate.weight"))
        assert gemm == k.endswith(fp8 + high_gemms), k
        assert keeps_dtype(k) != (gemm and k.endswith(fp8)), k
    assert sum(k.endswith(high_gemms) for k in hf) == 4 + 4 + 2 * 2 + 2   # attention, MTP attention, 2+1 MoE
    assert ".mixer.A_log" in FP8_KEEP_DTYPE and keeps_dtype("backbone.layers.0.mixer.conv1d.weight")


# -- two gloo ranks --------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _packed_positions(b=2, n=N, firsts=(13, 7)):
    """Two documents per row, boundaries inside the cp-2 head-tail chunks and inside Mamba chunks."""
    return torch.stack([torch.cat([torch.arange(f), torch.arange(n - f)]) for f in firsts[:b]])


def _sum_loss(logits, targets, weight, total):
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    return -(logp * weight).sum() / total


def _worker(rank, world, port, dims, path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from torch.distributed.tensor import DTensor
    from rl.trainer import parallel
    from rl.trainer.packing import Row, _cp_shard  # the trainer's own CP row split
    data = torch.load(path)
    dp, ep, cp = dims
    d = parallel.init(SimpleNamespace(dp_shard=dp, ep=ep, cp=cp), torch.device("cpu"))
    try:
        spec = model_spec({}, data["config"])
        model = spec.model.build()
        model.load_state_dict(spec.state_dict_adapter(spec.model, None).from_hf(data["hf"]))
        model = parallel.parallelize(model, spec, d, torch.float32)
        tok, pos = data["tokens"], data["positions"]
        targets = torch.nn.functional.pad(tok[:, 1:], (0, 1))
        weight = torch.nn.functional.pad(torch.ones(tok.shape[0], tok.shape[1] - 1), (0, 1)) * (pos != 0).roll(-1, 1)
        total = float(weight.sum())
        mine = None
        if cp == 1:  # each rank its own row
            r = slice(rank, rank + 1)
            out = model(tok[r], positions=pos[r])
            loss = _sum_loss(out, targets[r], weight[r], total)
        else:  # both rows on every rank, split head-tail as the trainer does
            row = _cp_shard(Row(tok, pos, targets, {"w": weight}), d)
            from rl.models.common import headtail_index
            mine = headtail_index(tok.shape[1], cp, d.cp_rank)
            out = model(row.tokens, positions=row.positions, attention_masks=row.masks)
            loss = _sum_loss(out, row.targets, row.per_token["w"], total)
        loss.backward()
        grads = {}
        for n, p in model.named_parameters():
            if p.grad is not None:
                g = p.grad
                grads[n] = (g.full_tensor() if isinstance(g, DTensor) else g).clone()
        loss_sum = float(d.sum(loss.detach()))
        up = model.layers["1"].mixer.experts.up_proj   # where the routed experts live (EP: an "ep" mesh dim)
        experts_mesh = tuple(up.device_mesh.mesh_dim_names) if isinstance(up, DTensor) else ()
        torch.save(dict(logits=out.detach(), loss=loss_sum, grads=grads, mine=mine, experts_mesh=experts_mesh),
                   path + f".out{rank}")
    finally:
        d.close()


@pytest.mark.distributed
@pytest.mark.parametrize("dims", [(2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["fsdp2", "ep2", "cp2"])
def test_two_gloo_ranks_give_the_single_process_logits_loss_and_grads(tmp_path, dims):
    import torch.multiprocessing as mp
    cfg, ref = _hf()
    h = cfg.to_dict()
    tok, _ = _tokens()
    pos = _packed_positions()
    _, single = _ours(cfg, ref.state_dict())
    path = str(tmp_path / "in.pt")
    torch.save(dict(config=h, hf=NemotronHStateDictAdapter().to_hf(single.state_dict()), tokens=tok, positions=pos),
               path)
    targets = torch.nn.functional.pad(tok[:, 1:], (0, 1))
    weight = torch.nn.functional.pad(torch.ones(2, N - 1), (0, 1)) * (pos != 0).roll(-1, 1)
    lg = single(tok, positions=pos)
    loss = _sum_loss(lg, targets, weight, float(weight.sum()))
    loss.backward()
    ctx = mp.start_processes(_worker, args=(2, _free_port(), dims, path), nprocs=2, start_method="spawn", join=False)
    deadline = time.monotonic() + 240
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail("two-rank NemotronH run did not finish in 240 s")
    outs = [torch.load(path + f".out{r}") for r in range(2)]
    assert ("ep" in outs[0]["experts_mesh"]) == (dims[1] > 1), outs[0]["experts_mesh"]
    got = torch.empty_like(lg)
    if dims[2] == 1:
        for r in range(2):
            got[r:r + 1] = outs[r]["logits"]
    else:
        for o in outs:
            got[:, o["mine"]] = o["logits"]
    torch.testing.assert_close(got, lg.detach(), rtol=1e-5, atol=1e-5)
    assert outs[0]["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    want = {n: p.grad for n, p in single.named_parameters() if p.grad is not None}
    assert set(outs[0]["grads"]) == set(want)
    for n, g in want.items():
        torch.testing.assert_close(outs[0]["grads"][n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_tensor_parallel_is_refused_by_name():
    from rl.models.nemotron_h.parallelize import parallelize_nemotron_h
    with pytest.raises(NotImplementedError, match="tensor parallelism"):
        parallelize_nemotron_h(None, parallel_dims=SimpleNamespace(tp_enabled=True))


def test_context_parallel_needs_cp_to_divide_the_groups():
    cfg, _ = _hf()
    mixer = model_spec({}, cfg.to_dict()).model.build().layers["0"].mixer
    with pytest.raises(ValueError, match="n_groups=2"):
        mixer.enable_context_parallel(None, 4, 0)
