"""Mismatch KL between trainer and inference, with and without router replay (R3), on the debug model.

What it does (CPU, no vLLM; the CPU engine cannot return routed experts, so an engine is emulated):
- the trainer: the debug experiment's MoE (conf defaults: 2 layers, 4 experts, top-2) built by
  rl.trainer.model with seed S, fp32 master weights;
- the "engine": a copy of it holding exactly what inference loads from `weights/step_N` (the trainer's
  weights through rl.exchange.weights' FP8 128x128 block quantizer and back: attention and expert
  projections in e4m3, router gate / embeddings / norms / LM head kept high), plus optional Gaussian
  noise of relative size `--noise` on every weight standing in for other kernels' rounding;
- the engine samples `--completion` tokens at temperature 1 after random `--prompt`-token prompts,
  and scores the sequences, recording its logprobs and its routed experts (rl.models.replay.recording);
- the trainer scores the same tokens (a) routing itself, (b) replaying the engine's routing.
Printed: k3 estimate of KL(engine || trainer) over the sampled tokens (the `mismatch_kl` metric of the
loss), mean |logprob difference|, and the share of (token, layer) routing decisions that differ.

    python benchmarks/router_replay.py [--seeds 3] [--prompts 64] [--noise 0]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from rl.contract.config import Config  # noqa: E402
from rl.exchange import layout  # noqa: E402
from rl import fp8  # noqa: E402
from rl.models import replay  # noqa: E402
from rl.models.common import hf_state_dict, load_hf_state_dict, logits  # noqa: E402
from rl.trainer.model import build_model  # noqa: E402


def engine_copy(trainer, m, seed: int, noise: float):
    """A model with the weights inference would load from the trainer's published shards."""
    eng = build_model(m, seed=seed + 1000)
    sd = hf_state_dict(trainer)
    served = {}
    for name, w in sd.items():
        served[name] = fp8.fake_quantize_block(w) if layout.default_quantize(name, w) else w.clone()
    if noise:
        g = torch.Generator().manual_seed(seed + 7)
        served = {k: v + noise * v.abs().mean() * torch.randn(v.shape, generator=g)
                  for k, v in served.items()}
    load_hf_state_dict(eng, served)
    return eng


def token_lp(logits_BLV, tokens):
    logp = torch.log_softmax(logits_BLV.float(), -1)[:, :-1]
    return logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)


@torch.no_grad()
def one_seed(m, seed: int, n_prompts: int, prompt_len: int, completion: int, noise: float) -> dict:
    torch.manual_seed(seed)
    tr = build_model(m, seed=seed)
    eng = engine_copy(tr, m, seed, noise)
    for b in (tr, eng):
        b.model.eval()
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(10, int(m["vocab_size"]), (n_prompts, prompt_len), generator=g)
    for _ in range(completion):  # the engine samples (full recompute, no KV cache: tiny model)
        pos = torch.arange(seq.shape[1])[None].expand(n_prompts, -1)
        probs = torch.softmax(logits(eng.model, seq, pos)[:, -1].float(), -1)
        seq = torch.cat([seq, torch.multinomial(probs, 1, generator=g)], 1)
    pos = torch.arange(seq.shape[1])[None].expand(n_prompts, -1)
    with replay.recording(eng.model) as rec:
        lp_eng = token_lp(logits(eng.model, seq, pos), seq)
    routed = rec[0]
    with replay.recording(tr.model) as own:
        lp_live = token_lp(logits(tr.model, seq, pos), seq)
    with replay.replaying(tr.model, routed):
        lp_replay = token_lp(logits(tr.model, seq, pos), seq)
    sel = slice(prompt_len - 1, None)  # the sampled tokens

    def kl(lp):
        log_r = (lp - lp_eng)[:, sel].double()
        return float((log_r.exp() - 1 - log_r).mean())

    flips = (own[0].sort(-1).values != routed.sort(-1).values).any(-1).float().mean()
    return {"kl_live": kl(lp_live), "kl_replay": kl(lp_replay),
            "dlp_live": float((lp_live - lp_eng)[:, sel].abs().mean()),
            "dlp_replay": float((lp_replay - lp_eng)[:, sel].abs().mean()),
            "routing_differs": float(flips)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--completion", type=int, default=24)
    ap.add_argument("--noise", type=float, default=0.0, help="extra relative weight noise of the engine")
    a = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    m = OmegaConf.to_container(OmegaConf.structured(Config).model)
    rows = [one_seed(m, s, a.prompts, a.prompt_len, a.completion, a.noise) for s in range(a.seeds)]
    print(f"debug MoE ({m['n_layers']} layers, {m['num_experts']} experts, top-{m['top_k']}); engine = FP8 "
          f"block-quantized copy{f' + {a.noise:g} relative noise' if a.noise else ''}; "
          f"{a.prompts} prompts x {a.completion} sampled tokens, {a.seeds} seeds")
    print(f"{'seed':>4} {'routing differs':>16} {'KL no replay':>13} {'KL replay':>11} "
          f"{'|dlp| no replay':>16} {'|dlp| replay':>13}")
    for s, r in enumerate(rows):
        print(f"{s:>4} {r['routing_differs']:>16.4f} {r['kl_live']:>13.3e} {r['kl_replay']:>11.3e} "
              f"{r['dlp_live']:>16.3e} {r['dlp_replay']:>13.3e}")
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
    print(f"mean {mean['routing_differs']:>16.4f} {mean['kl_live']:>13.3e} {mean['kl_replay']:>11.3e} "
          f"{mean['dlp_live']:>16.3e} {mean['dlp_replay']:>13.3e}")
    print(f"mismatch KL without replay {mean['kl_live']:.3e}, with replay {mean['kl_replay']:.3e} "
          f"(ratio {mean['kl_live'] / max(mean['kl_replay'], 1e-300):.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
