"""The trainer's torchtitan model: HF parity (what vLLM serves), packing isolation, gradients on CPU."""
import torch

from rl.models.common import hf_state_dict, load_hf_state_dict, logits, token_logprobs
from rl.trainer.model import build_model

M = dict(name="tiny-test", family="qwen3", vocab_size=128, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
         moe_hidden_dim=24, num_experts=4, top_k=2, max_seq_len=64, rope_theta=10000.0)


def test_hf_state_dict_gives_same_logits_in_transformers(tmp_path):
    """Shards written in HF names load into transformers' Qwen3MoeForCausalLM (fp32) with equal logits."""
    import json
    from transformers import Qwen3MoeForCausalLM
    from rl.exchange.weights import write_shards
    from rl.tiny_models.tiny import hf_config

    built = build_model(M, seed=1)
    sd = hf_state_dict(built)
    write_shards(tmp_path, sd, fp8_enabled=False, wire_dtype=torch.float32)
    cfg = hf_config(M, M["vocab_size"], 1, 0)
    cfg["torch_dtype"] = "float32"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf = Qwen3MoeForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    tokens = torch.randint(0, M["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(20)[None].expand(2, -1)
    with torch.no_grad():
        ours = logits(built.model, tokens, pos)
        theirs = hf(input_ids=tokens).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)

    # and back: the HF names load into a fresh model bit-exactly
    other = build_model(M, seed=2)
    load_hf_state_dict(other, sd)
    for k, v in built.model.state_dict().items():
        assert torch.equal(v, other.model.state_dict()[k]), k


def test_packed_samples_do_not_attend_across_boundaries():
    built = build_model(M, seed=0)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, 128, (1, 7), generator=g), torch.randint(0, 128, (1, 11), generator=g)
    packed = torch.cat([a, b], 1)
    pos = torch.cat([torch.arange(7), torch.arange(11)])[None]
    with torch.no_grad():
        lp, ent = token_logprobs(built.model, packed, pos)
        lpa, _ = token_logprobs(built.model, a, torch.arange(7)[None])
        lpb, entb = token_logprobs(built.model, b, torch.arange(11)[None])
    torch.testing.assert_close(lp[0, :7], lpa[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(lp[0, 7:], lpb[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(ent[0, 7:], entb[0], rtol=0, atol=1e-5)
    assert lp[0, 0] == 0 and lp[0, 7] == 0  # sample starts have no in-sample prediction
    # the logprob really is log p(token) from the previous position
    ref = torch.log_softmax(logits(built.model, b, torch.arange(11)[None])[0, :-1], -1)
    torch.testing.assert_close(lpb[0, 1:], ref.gather(-1, b[0, 1:, None]).squeeze(-1), rtol=0, atol=1e-6)


def test_backward_reaches_every_parameter():
    built = build_model(M, seed=0)
    tokens = torch.randint(0, 128, (1, 24))
    pos = torch.cat([torch.arange(12), torch.arange(12)])[None]
    lp, _ = token_logprobs(built.model, tokens, pos)
    lp.sum().backward()
    no_grad = [n for n, p in built.model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not no_grad, no_grad


def test_activation_checkpointing_wraps_blocks_and_keeps_the_step():
    """trainer.activation_checkpointing (what the memory estimate assumes) is applied, and a checkpointed
    step computes the same loss and update as the plain one."""
    from helpers.trainer import synthetic_batch, tiny_cfg
    from rl.trainer.train import Trainer
    out = {}
    for mode in ("none", "full", "selective"):
        tr = Trainer(tiny_cfg("/tmp/unused", activation_checkpointing=mode))
        kinds = {type(b).__name__ for b in tr.model.layers.values()}
        assert (kinds == {"CheckpointWrapper"}) == (mode != "none"), (mode, kinds)
        m = tr.train_step(synthetic_batch(0), 0)
        out[mode] = (m["loss"], next(iter(tr.model.parameters())).detach().clone())
    for mode in ("full", "selective"):
        assert abs(out[mode][0] - out["none"][0]) < 1e-6
        assert torch.allclose(out[mode][1], out["none"][1], atol=1e-6)


def test_bf16_compute_keeps_fp32_masters_so_a_tiny_lr_step_changes_them(tmp_path):
    """trainer.dtype=bfloat16 is the compute dtype; parameters and AdamW states stay fp32. At lr=1e-6 a
    bf16 master would keep almost none of the update (its spacing near 0.02 is ~1e-4)."""
    from omegaconf import OmegaConf
    from builders import compose_cfg
    from rl.trainer.train import Trainer
    from helpers.trainer import synthetic_batch

    cfg = OmegaConf.create(compose_cfg(tmp_path, "trainer.dtype=bfloat16", "trainer.lr=1e-6",
                                       "trainer.warm_start.steps=0"))
    tr = Trainer(cfg)
    assert all(p.dtype == torch.float32 for p in tr.model.parameters())
    before = {k: v.clone() for k, v in tr.model.named_parameters()}
    m = tr.train_step(synthetic_batch(0), 0)
    assert m["loss"] == m["loss"]
    total = changed = 0
    for k, v in tr.model.named_parameters():
        if v.grad is None or "tok_embeddings" in k:  # rows of tokens not in the batch get no gradient
            continue
        total += v.numel()
        changed += int((v.detach() != before[k]).sum())
    assert changed / total > 0.9, changed / total
    assert all(s.dtype == torch.float32 for st in tr.optimizer.optimizers[0].state.values()
               for s in st.values() if torch.is_tensor(s) and s.dim() > 0)
