"""Torch pieces every family shares: config helpers for the builders, the forward helpers, HF names.

- Builders: `rms_eps` (the checkpoint's RMSNorm epsilon on every norm of a torchtitan config),
  `mla_rope` (DeepSeek-style MLA RoPE: default or yarn, and the softmax mscale), `LATENT_NORM_EPS`.
- Forward: `logits`, `position_logprobs`, `token_logprobs` over packed rows (positions restart at 0
  where each sample starts), with the attention masks the model's inner attention takes.
- HF names: `hf_state_dict` / `load_hf_state_dict` through the family's torchtitan state-dict adapter
  (`built` is anything with `.model` and `.spec`, e.g. rl.trainer.model.Built).
- Context-parallel row layout: `headtail_index` / `gathered_index` (torchtitan's head-tail balancing).

A leaf of rl/models: it imports rl.models.cpu and nothing of rl/trainer.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from rl.models import cpu


def rms_eps(cfg, eps: float) -> None:
    """Every RMSNorm config under `cfg` gets the checkpoint's epsilon (torchtitan defaults to 1e-5)."""
    import dataclasses
    from torchtitan.models.common import RMSNorm
    seen = set()

    def walk(c):
        if id(c) in seen or not dataclasses.is_dataclass(c):
            return
        seen.add(id(c))
        if isinstance(c, RMSNorm.Config):
            c.eps = eps
        for f in dataclasses.fields(c):
            v = getattr(c, f.name, None)
            for x in (v if isinstance(v, (list, tuple)) else [v]):
                walk(x)
    walk(cfg)


# q_a_layernorm / kv_a_layernorm of DeepSeek-V3-style attention: DeepSeek's reference code and
# transformers build them with RMSNorm's default eps 1e-6, not config.rms_norm_eps (vLLM 0.32 uses
# rms_norm_eps; the two agree only for checkpoints with rms_norm_eps 1e-6). transformers is the reference.
LATENT_NORM_EPS = 1e-6


def mla_rope(m: Mapping[str, Any], h: Mapping[str, Any], rope_dim: int):
    """torchtitan's ComplexRoPE config (interleaved pairs, as HF's rope_interleave) and the softmax mscale."""
    from rl.contract.hf import rope_scaling, rope_theta
    from torchtitan.models.common import ComplexRoPE
    if h.get("rope_interleave") is False:
        raise ValueError("config.json rope_interleave=false is not supported for the MLA families")
    rs = rope_scaling(h)
    kind = rs.get("rope_type")
    if kind is None:
        return ComplexRoPE.Config(dim=rope_dim, max_seq_len=int(m["max_seq_len"]), theta=rope_theta(h)), 1.0
    if kind != "yarn":
        raise ValueError(f"config.json rope scaling rope_type={kind!r} is not supported (known: default, yarn)")
    if rs.get("attention_factor") is not None or rs.get("mscale") is None or rs.get("mscale") != rs.get("mscale_all_dim"):
        # HF then scales cos/sin by an attention factor that torchtitan's ComplexRoPE does not apply
        raise ValueError(f"config.json yarn rope scaling needs mscale == mscale_all_dim and no attention_factor "
                         f"(as DeepSeek-V3 and Kimi write it), got {rs}")
    rope = ComplexRoPE.Config(
        dim=rope_dim, max_seq_len=int(m["max_seq_len"]), theta=rope_theta(h), scaling="yarn",
        rope_factor=float(rs["factor"]), beta_fast=float(rs.get("beta_fast", 32.0)),
        beta_slow=float(rs.get("beta_slow", 1.0)),
        original_seq_len=int(rs.get("original_max_position_embeddings", 4096)),
        truncate=bool(rs.get("truncate", True)))
    # HF scales the softmax by yarn_get_mscale(factor, mscale_all_dim)^2, torchtitan by its `mscale` the same way
    return rope, float(rs.get("mscale_all_dim") or 0.0)


# -- forward --------------------------------------------------------------------------------------------
def attention_masks(model, positions: torch.Tensor):
    """What the model's inner attention takes: a dense mask on the CPU, torchtitan's own otherwise."""
    if cpu.uses_dense_attention(model):
        return cpu.document_mask(positions)
    return model.get_attention_masks(positions)


def logits(model, tokens: torch.Tensor, positions: torch.Tensor, masks=None) -> torch.Tensor:
    """[B, L, V] logits for packed rows; positions restart at 0 where each sample starts.

    `masks` overrides the attention masks built from `positions` (context parallel passes the rows of
    the mask this rank holds).
    """
    if masks is None:
        masks = attention_masks(model, positions)
    return model(tokens, positions=positions, attention_masks=masks)


def position_logprobs(model, tokens: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor,
                      masks=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position j: log p(targets[j]) under the distribution predicted at j, and its entropy.

    The training path's form (targets = the next tokens, shifted before any sequence split), so each
    rank of a context-parallel group scores the positions it holds without its neighbours' logits.
    """
    logp = torch.log_softmax(logits(model, tokens, positions, masks).float(), dim=-1)
    lp = logp.gather(-1, targets[..., None].long()).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def token_logprobs(model, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprob and entropy, aligned with the tokens as inference logprobs are.

    Entry i is about token i given the tokens before it in its own sample: log p(tokens[i]) under the
    distribution predicted at i-1, and that distribution's entropy. The first token of every sample
    has no prediction inside the sample: its entries are 0 (it is a prompt token, never in the loss).
    """
    logp = torch.log_softmax(logits(model, tokens, positions).float(), dim=-1)[:, :-1]
    lp = logp.gather(-1, tokens[:, 1:, None].long()).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    starts = positions[:, 1:] == 0
    lp = torch.nn.functional.pad(lp.masked_fill(starts, 0.0), (1, 0))
    ent = torch.nn.functional.pad(ent.masked_fill(starts, 0.0), (1, 0))
    return lp, ent


# -- HF names -------------------------------------------------------------------------------------------
def hf_state_dict(built) -> dict[str, torch.Tensor]:
    """The model's weights under the family's HF names (experts split per expert), via torchtitan's adapter."""
    adapter = built.spec.state_dict_adapter(built.spec.model, None)
    return {k: v.detach() for k, v in adapter.to_hf(built.model.state_dict()).items()}


def load_hf_state_dict(built, hf: Mapping[str, torch.Tensor]) -> None:
    """Load HF-named weights (e.g. an `hf_path` checkpoint, or published shards) into the model."""
    adapter = built.spec.state_dict_adapter(built.spec.model, None)
    sd = adapter.from_hf(dict(hf))
    missing, unexpected = built.model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith(("rope.cache", "expert_bias_E", "tokens_per_expert_E"))]
    if missing or unexpected:
        raise KeyError(f"HF state dict does not fit the model: missing {missing}, unexpected {unexpected}")


# -- context-parallel row layout --------------------------------------------------------------------------
def headtail_index(length: int, cp: int, rank: int) -> torch.Tensor:
    """Positions of a row of `length` (a multiple of 2*cp) that cp rank `rank` holds."""
    c = length // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


def gathered_index(length: int, cp: int) -> torch.Tensor:
    """Row positions in the order the all-gathered K/V lay them out (rank 0's chunk, rank 1's, ...)."""
    return torch.cat([headtail_index(length, cp, r) for r in range(cp)])
