"""Router replay (R3): recorded expert ids replace the routers' top-k; the gate still gets gradients."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from rl.contract.config import Config
from rl.contract.batch import RolloutBatch, Sample
from rl.models import replay
from rl.models.common import logits, token_logprobs
from rl.trainer.model import build_model
from rl.trainer.train import Trainer

M = dict(name="tiny-replay", family="qwen3", vocab_size=128, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
         moe_hidden_dim=24, num_experts=4, top_k=2, max_seq_len=64, rope_theta=10000.0)


def _inputs(seed=0, lengths=(9, 14)):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, M["vocab_size"], (1, sum(lengths)), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return tokens, positions


def _random_routing(n_tokens, seed=1):
    """Distinct experts per token and layer, unrelated to what the router would pick."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.stack([torch.randperm(M["num_experts"], generator=g)[:M["top_k"]]
                                    for _ in range(M["n_layers"])]) for _ in range(n_tokens)])
    return ids[None]  # [1, T, layers, K]


def _capture(model):
    """Hooks recording each MoE layer's router input/output and the ids its experts were given."""
    seen = {"router": [], "experts": []}
    hooks = []
    for r in replay.routers(model):
        hooks.append(r.register_forward_hook(lambda m, a, out: seen["router"].append((m, a[0], out))))
    for mod in model.modules():
        if type(mod).__name__ == "RoutedExperts":
            hooks.append(mod.register_forward_pre_hook(lambda m, a: seen["experts"].append(a[2].clone())))
    return seen, hooks


def test_experts_used_are_the_recorded_ids_for_every_token():
    built = build_model(M, seed=0)
    tokens, pos = _inputs()
    ids = _random_routing(tokens.shape[1])
    live = replay.record_routing(built.model, tokens, pos)
    assert (live != ids.sort(-1).values).any() or (live.sort(-1).values != ids.sort(-1).values).any()

    seen, hooks = _capture(built.model)
    with replay.replaying(built.model, ids):
        logits(built.model, tokens, pos)
    for h in hooks:
        h.remove()
    assert len(seen["experts"]) == M["n_layers"]
    for layer, used in enumerate(seen["experts"]):  # what the token dispatcher received
        assert torch.equal(used.reshape(tokens.shape[1], -1), ids[0, :, layer])
    # the gate weights are the live softmax scores at the recorded ids, renormalised (Qwen3-MoE)
    for layer, (router, x, (top, got_ids, scores)) in enumerate(seen["router"]):
        assert torch.equal(got_ids, ids[:, :, layer])
        probs = torch.softmax(x.float() @ router.gate.weight.float().T, -1)
        want = probs.gather(-1, ids[:, :, layer])
        torch.testing.assert_close(top, want / want.sum(-1, keepdim=True), rtol=1e-5, atol=1e-6)
    assert all(r.replay_ids is None for r in replay.routers(built.model))  # switched off again


def test_gate_gets_gradients_under_replay():
    built = build_model(M, seed=0)
    tokens, pos = _inputs()
    ids = _random_routing(tokens.shape[1])
    with replay.replaying(built.model, ids):
        lp, _ = token_logprobs(built.model, tokens, pos)
    lp.sum().backward()
    replayed = [r.gate.weight.grad.clone() for r in replay.routers(built.model)]
    for g in replayed:
        assert g is not None and g.abs().sum() > 0
    # and they are the replayed routing's gradients, not the live routing's
    built.model.zero_grad()
    lp, _ = token_logprobs(built.model, tokens, pos)
    lp.sum().backward()
    live = [r.gate.weight.grad for r in replay.routers(built.model)]
    assert any(not torch.allclose(a, b) for a, b in zip(replayed, live))


def test_replaying_recorded_routing_reproduces_the_live_forward():
    built = build_model(M, seed=3)
    tokens, pos = _inputs(seed=5)
    rec = replay.record_routing(built.model, tokens, pos)
    assert rec.shape == (1, tokens.shape[1], M["n_layers"], M["top_k"])
    stored = replay.to_batch_ids(rec[0])
    assert stored.dtype == np.uint8
    with torch.no_grad():
        live = logits(built.model, tokens, pos)
        with replay.replaying(built.model, torch.from_numpy(stored)[None].long()):
            replayed = logits(built.model, tokens, pos)
    torch.testing.assert_close(replayed, live, rtol=0, atol=1e-6)


def test_replay_checks_the_shape():
    built = build_model(M, seed=0)
    tokens, pos = _inputs()
    with pytest.raises(ValueError, match="MoE layers"):
        with replay.replaying(built.model, torch.zeros(1, tokens.shape[1], 3, 2, dtype=torch.long)):
            pass
    with pytest.raises(ValueError, match="do not fit"):
        with replay.replaying(built.model, torch.zeros(1, 5, 2, 2, dtype=torch.long)):
            logits(built.model, tokens, pos)


def _cfg(tmp_path, **trainer):
    cfg = OmegaConf.structured(Config)
    cfg.run_dir, cfg.wandb.mode = str(tmp_path), "disabled"
    cfg.model.max_seq_len = 64
    cfg.trainer = OmegaConf.merge(cfg.trainer, {"micro_batch_tokens": 40, **trainer})
    return cfg


def _batch(cfg, routed: bool, seed=0):
    rng = np.random.default_rng(seed)
    m = cfg.model
    samples = []
    for i in range(4):
        p, c = rng.integers(5, 500, 6).tolist(), rng.integers(5, 500, 5).tolist()
        re = rng.integers(0, m.num_experts, (11, m.n_layers, m.top_k)).astype(np.uint8) if routed else None
        samples.append(Sample(p, c, (-rng.uniform(1, 6, 5)).tolist(), [0] * 5, float(i % 2), i // 2,
                              advantage=float(i % 2) - 0.5, routed_experts=re))
    return RolloutBatch.from_samples(samples)


def test_trainer_replays_the_batch_routing(tmp_path):
    cfg = _cfg(tmp_path, router_replay=True)
    tr = Trainer(cfg)
    batch = _batch(cfg, routed=True)
    seen, hooks = _capture(tr.model)
    m = tr.train_step(batch, 0)
    for h in hooks:
        h.remove()
    assert m["router_replay"] == 1 and m["routing_recorded_by_engine"] == 1
    # every token of every micro-batch went to its recorded experts, layer by layer
    per_layer = [torch.cat([e.reshape(-1, cfg.model.top_k) for e in seen["experts"][i::cfg.model.n_layers]])
                 for i in range(cfg.model.n_layers)]
    for layer, got in enumerate(per_layer):
        assert torch.equal(got, torch.from_numpy(batch.routed_experts[:, layer].astype(np.int64))), layer
    assert np.isfinite(m["loss"]) and m["grad_norm"] > 0


def test_trainer_without_engine_routing_replays_its_own(tmp_path, capsys):
    cfg = _cfg(tmp_path, router_replay=True)
    a, b = Trainer(cfg), Trainer(_cfg(tmp_path))
    batch = _batch(cfg, routed=False)
    ma, mb = a.train_step(batch, 0), b.train_step(batch, 0)
    assert ma["routing_recorded_by_engine"] == 0
    # the CPU fallback says so, and why: the servers returned no routing (CPU vLLM cannot record it)
    warned = [line for line in capsys.readouterr().out.splitlines() if "router_replay:" in line]
    assert len(warned) == 1 and "the servers returned none" in warned[0] and "own" in warned[0]
    assert "--enable-return-routed-experts" in warned[0] and "gpus_per_node > 0" in warned[0]
    assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-6)  # its own routing: the same step
