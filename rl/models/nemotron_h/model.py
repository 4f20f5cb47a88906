"""NemotronH (Nemotron-3 Nano / Super / Ultra) for the trainer: the hybrid Mamba-2 / attention / LatentMoE stack.

The reference is transformers 5.19's `NemotronHForCausalLM` (its torch path), equal to it in fp32 to ~1e-6
(tests/unit/test_nemotron_h.py). torchtitan 0.3 has no Mamba and no non-gated (relu^2) latent MoE, so the
network is plain torch modules laid out like transformers' (same parameter names below the `model.` /
`backbone.` prefix), built from a config dataclass with torchtitan's `Config.build()` / `init_weights`
protocol so rl.trainer.model's meta build -> `to_empty` -> `init_weights` path applies unchanged.

Blocks (`layers_block_type`, or the legacy `hybrid_override_pattern` "M*E-"), each `x + mixer(RMSNorm(x))`:
- "linear_attention" (M): Mamba-2 mixer, rl.models.nemotron_h.mamba (chunked SSD scan, packed documents,
  head-parallel context parallelism);
- "full_attention" (*): GQA attention, q/k/v/o projections without bias, softmax scale head_dim^-0.5 and
  *no positional embedding* (transformers defines RoPE helpers for NemotronH but never applies them; the
  Mamba layers carry position); causal and same-document mask from positions;
- "moe" (E): LatentMoE. Router on the full hidden state, in fp32: sigmoid(x W^T), choice scores
  + e_score_correction_bias, group-limited (n_group groups scored by their top-2 sum, best topk_group kept),
  top-k, weights = the unbiased sigmoid scores of the chosen experts, renormalised (+1e-20) if
  norm_topk_prob, times routed_scaling_factor. Routed experts run at the latent width: fc1_latent_proj
  (hidden -> moe_latent_size), per-expert down(relu2(up(.))) (non-gated), weighted sum, fc2_latent_proj
  back; plus one shared expert MLP on the (un-projected) input (transformers builds one whatever
  n_shared_experts says). Without moe_latent_size the projections are identities;
- "mlp" (-): dense down(act(up(x))).
Final RMSNorm `norm_f`, untied `lm_head`. RMSNorm is computed in fp32, as transformers does.

The expert-bias correction `e_score_correction_bias` (a buffer in transformers, kept fp32) is loaded and
published, never updated here (no auxiliary-loss-free balancing hook): the trainer routes as inference does.

MTP (`num_nextn_predict_layers` > 0): the checkpoint's `mtp.layers.*` (vLLM's NemotronH-MTP layout: the
first layer of each step has enorm, hnorm and eh_proj fusing norm(embedding of token t+1) with
norm(final hidden state at t), the last has final_layernorm; layer kinds from mtp_layers_block_type) are
loaded into `model.mtp`, published back bit for bit, and FROZEN (requires_grad False, not run in the
training forward). Why: transformers drops them (`_keys_to_ignore_on_load_unexpected = mtp.*`), so there is
no reference for their training; the RL objective is on the main head's logprobs only, so they would get no
gradient anyway, and an MTP loss would change the policy objective. They are only a draft for vLLM's
speculative decoding, where a stale draft costs acceptance rate, never correctness (the target model
verifies every drafted token). `NemotronH.mtp_logits` runs them (for checks and a future MTP loss).

`logits`, `position_logprobs` and `token_logprobs` have rl.trainer.model's / rl.models.common's signatures and
semantics. Nothing here imports rl.trainer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from rl.models.nemotron_h.args import NemotronHArgs
from rl.models.nemotron_h.gemm import Linear
from rl.models.nemotron_h.mamba import Mamba2Mixer


def _act(name: str):
    if name == "relu2":
        return lambda x: torch.square(F.relu(x))
    return {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}[name]


class RMSNorm(nn.Module):
    """transformers' NemotronHRMSNorm: fp32 normalisation and weight multiply, result in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x).to(dtype)


def document_mask(positions: torch.Tensor, q_index=None, kv_index=None) -> torch.Tensor:
    """[B, 1, Lq, Lk] bool: causal and same document (positions restart at 0 per document); the same
    mask as rl.models.cpu.document_mask / cp_document_mask, without torchtitan."""
    n = positions.shape[1]
    q = torch.arange(n, device=positions.device) if q_index is None else q_index
    k = torch.arange(n, device=positions.device) if kv_index is None else kv_index
    doc = torch.cumsum((positions == 0).long(), dim=1)
    return ((q[:, None] >= k[None, :])[None] & (doc[:, q][:, :, None] == doc[:, k][:, None, :])).unsqueeze(1)


class Attention(nn.Module):
    """transformers' NemotronHAttention (GQA, no RoPE, no bias). Under context parallel (`cp_group` set)
    K/V are all-gathered with torch's `flex_cp_allgather` (reduce-scatter in backward), the local queries
    masked against the gathered keys by the mask rows the trainer passes (rl.trainer.packing._cp_shard)."""

    def __init__(self, a: NemotronHArgs):
        super().__init__()
        d, hd = a.hidden_size, a.head_dim
        self.n_heads, self.n_kv, self.head_dim = a.num_attention_heads, a.num_key_value_heads, hd
        self.q_proj = Linear(d, self.n_heads * hd, bias=False)
        self.k_proj = Linear(d, self.n_kv * hd, bias=False)
        self.v_proj = Linear(d, self.n_kv * hd, bias=False)
        self.o_proj = Linear(self.n_heads * hd, d, bias=False)
        self.cp_group_name = None

    def enable_context_parallel(self, group) -> None:
        import torch.distributed as dist
        self.cp_group_name = dist._get_process_group_name(group)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, n, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(b, n, self.n_kv, self.head_dim)
        if self.cp_group_name is not None:
            from torch.distributed.tensor.experimental._context_parallel._cp_custom_ops import flex_cp_allgather
            k, v = flex_cp_allgather(k.contiguous(), v.contiguous(), 1, self.cp_group_name)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, scale=self.head_dim ** -0.5,
                                             enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class MLP(nn.Module):
    def __init__(self, a: NemotronHArgs, hidden: int):
        super().__init__()
        self.up_proj = Linear(a.hidden_size, hidden, bias=a.mlp_bias)
        self.down_proj = Linear(hidden, a.hidden_size, bias=a.mlp_bias)
        self.act = _act(a.mlp_hidden_act)

    def forward(self, x):
        return self.down_proj(self.act(self.up_proj(x)))


class Router(nn.Module):
    """transformers' NemotronHTopkRouter (sigmoid, bias-corrected group-limited top-k), fp32.

    `replay_ids` ([B, L, K] expert ids), when set, replace the top-k choice (router replay, as
    rl.trainer.replay); `recorded` (a list), when set, receives the ids used."""

    def __init__(self, a: NemotronHArgs):
        super().__init__()
        self.n_experts, self.top_k = a.n_routed_experts, a.num_experts_per_tok
        self.n_group, self.topk_group = a.n_group, a.topk_group
        self.norm, self.scale = a.norm_topk_prob, float(a.routed_scaling_factor)
        self.weight = nn.Parameter(torch.zeros(self.n_experts, a.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n_experts, dtype=torch.float32))
        self.replay_ids: torch.Tensor | None = None
        self.recorded: list | None = None

    def forward(self, x: torch.Tensor, lead: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (weights [T, K] fp32, expert ids [T, K]); `lead` (e.g. (B, L), T = B*L): the shape
        the recorded ids take ([B, L, K], rl.models.replay's layout)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        if self.replay_ids is not None:
            if self.replay_ids.numel() != x.shape[0] * self.top_k:
                raise ValueError(f"replayed expert ids {tuple(self.replay_ids.shape)} do not fit {x.shape[0]} "
                                 f"tokens x top_k {self.top_k}")
            idx = self.replay_ids.reshape(-1, self.top_k).to(x.device).long()
        else:
            with torch.no_grad():
                choice = scores + self.e_score_correction_bias.float()
                if self.n_group > 1:
                    per = self.n_experts // self.n_group
                    gs = choice.view(-1, self.n_group, per).topk(2, dim=-1)[0].sum(-1)
                    gidx = torch.topk(gs, k=self.topk_group, dim=-1, sorted=False)[1]
                    gmask = torch.zeros_like(gs).scatter_(1, gidx, 1).bool()
                    choice = choice.masked_fill(~gmask[..., None].expand(-1, -1, per).reshape(-1, self.n_experts),
                                                float("-inf"))
                idx = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        if self.recorded is not None:
            self.recorded.append(idx.detach().reshape(*lead, self.top_k) if lead else idx.detach())
        w = scores.gather(1, idx)
        if self.norm:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.scale, idx


class Experts(nn.Module):
    """The routed experts, stacked as transformers keeps them: up_proj [E, F, latent], down_proj
    [E, latent, F]; down(act(up(x))) per expert, no gate. `forward` takes tokens sorted by expert and the
    per-expert counts (the layout an expert-parallel all-to-all delivers)."""

    fp8_params = ("up_proj", "down_proj")   # rl.models.nemotron_h.gemm: quantized per expert

    def __init__(self, a: NemotronHArgs):
        super().__init__()
        e, f, lat = a.n_routed_experts, a.moe_intermediate_size, a.latent
        self.up_proj = nn.Parameter(torch.empty(e, f, lat))
        self.down_proj = nn.Parameter(torch.empty(e, lat, f))
        self.act = _act(a.mlp_hidden_act)
        self.gemm = None   # a replacement for F.linear (FP8 training), set by gemm.set_gemm

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        up, down = self.up_proj, self.down_proj
        lin = self.gemm or F.linear
        if hasattr(up, "to_local"):  # expert parallel: this rank's experts
            up, down = up.to_local(), down.to_local()
        # every expert runs, idle ones on 0 rows: each rank then has a gradient (zeros) for every expert
        # it holds, so FSDP's reduce-scatter sees the same parameters on every rank
        outs, start = [], 0
        for e, c in enumerate(counts):
            xe = x[start:start + c]
            outs.append(lin(self.act(lin(xe, up[e])), down[e]))
            start += c
        return torch.cat(outs)


class LatentMoE(nn.Module):
    """transformers' NemotronHMoE: router on x, experts at the latent width, shared expert on x."""

    def __init__(self, a: NemotronHArgs):
        super().__init__()
        self.gate = Router(a)
        self.experts = Experts(a)
        self.shared_experts = MLP(a, a.moe_shared_expert_intermediate_size)
        if a.moe_latent_size:
            self.fc1_latent_proj = Linear(a.hidden_size, a.moe_latent_size, bias=a.mlp_bias)
            self.fc2_latent_proj = Linear(a.moe_latent_size, a.hidden_size, bias=a.mlp_bias)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None
        self.n_experts, self.top_k = a.n_routed_experts, a.num_experts_per_tok
        self.ep_group = None   # set by parallelize (expert parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        w, idx = self.gate(flat, tuple(shape[:-1]))
        h = flat if self.fc1_latent_proj is None else self.fc1_latent_proj(flat)
        order = torch.argsort(idx.reshape(-1), stable=True)
        tok = order // self.top_k
        counts = torch.bincount(idx.reshape(-1), minlength=self.n_experts)
        xs = h[tok]
        if self.ep_group is None:
            ys = self.experts(xs, counts.tolist())
        else:
            from rl.models.nemotron_h.parallelize import ep_experts
            ys = ep_experts(self.experts, xs, counts, self.ep_group)
        ys = ys * w.reshape(-1)[order, None].to(ys.dtype)
        out = torch.zeros(flat.shape[0], ys.shape[-1], dtype=ys.dtype, device=ys.device).index_add(0, tok, ys)
        out = out.to(h.dtype)
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out)
        return out.reshape(shape) + self.shared_experts(x)


class Block(nn.Module):
    def __init__(self, a: NemotronHArgs, kind: str):
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(a.hidden_size, a.layer_norm_epsilon)
        if kind == "linear_attention":
            self.mixer = Mamba2Mixer(a)
        elif kind == "full_attention":
            self.mixer = Attention(a)
        elif kind == "moe":
            self.mixer = LatentMoE(a)
        else:
            self.mixer = MLP(a, a.intermediate_size)

    def forward(self, x, positions, mask):
        h = self.norm(x)
        if self.kind == "linear_attention":
            h = self.mixer(h, positions)
        elif self.kind == "full_attention":
            h = self.mixer(h, mask)
        else:
            h = self.mixer(h)
        return x + h


class MTPLayer(Block):
    """One physical MTP layer (vLLM's NemotronHMTP*DecoderLayer): a Block, with the fusion projection on
    the first layer of a step and the closing norm on its last."""

    def __init__(self, a: NemotronHArgs, kind: str, start: bool, end: bool):
        super().__init__(a, kind)
        d, eps = a.hidden_size, a.layer_norm_epsilon
        if start:
            self.enorm, self.hnorm = RMSNorm(d, eps), RMSNorm(d, eps)
            self.eh_proj = Linear(2 * d, d, bias=False)
        if end:
            self.final_layernorm = RMSNorm(d, eps)
        self.start, self.end = start, end

    def forward(self, x, positions, mask, emb=None):
        if self.start:
            x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(x)], dim=-1))
        x = super().forward(x, positions, mask)
        return self.final_layernorm(x) if self.end else x


class NemotronH(nn.Module):
    """The NemotronH causal LM; call as torchtitan models are: `model(tokens, positions=, attention_masks=)`."""

    def __init__(self, a: NemotronHArgs):
        super().__init__()
        self.args = a
        self.embeddings = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleDict({str(i): Block(a, t) for i, t in enumerate(a.layer_types)})
        self.norm_f = RMSNorm(a.hidden_size, a.layer_norm_epsilon)
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        pat = a.mtp_layer_types
        self.mtp = nn.ModuleDict({str(i): MTPLayer(a, t, i % len(pat) == 0, i % len(pat) == len(pat) - 1)
                                  for i, t in enumerate(a.mtp_types)})
        for p in self.mtp.parameters():
            p.requires_grad_(False)   # frozen: see the module docstring
        self.cp_group = None

    def replay_routers(self) -> list:
        """The routers of the main network's MoE layers in layer order (rl.models.replay: the `layers` axis
        of routed_experts); the frozen MTP layers' routers are not in it (inference reports main layers)."""
        return [b.mixer.gate for b in self.layers.values() if b.kind == "moe"]

    @torch.no_grad()
    def init_weights(self, buffer_device=None) -> None:
        """HF-like random init (normal(initializer_range) for linears and embeddings, Mamba's A_log/D/dt_bias
        schedule, ones for norms, zero expert bias), drawn from torch's global RNG."""
        a = self.args
        std = a.initializer_range
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)
            elif isinstance(m, Router):
                nn.init.normal_(m.weight, std=std)
                m.e_score_correction_bias.zero_()
            elif isinstance(m, Experts):
                nn.init.normal_(m.up_proj, std=std)
                nn.init.normal_(m.down_proj, std=std)
        for m in self.modules():
            if isinstance(m, Mamba2Mixer):
                m.init_weights(a.n_layers)

    def get_attention_masks(self, positions: torch.Tensor) -> torch.Tensor:
        return document_mask(positions)

    def enable_context_parallel(self, group, gathered_index=None) -> None:
        """Context parallel over process group `group`: Mamba head-parallel (all-to-all), attention K/V
        all-gather. The trainer's head-tail row layout unless `gathered_index(L, cp)` says otherwise."""
        import torch.distributed as dist
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        self.cp_group = group
        for m in self.modules():
            if isinstance(m, Mamba2Mixer):
                m.enable_context_parallel(group, cp, rank, gathered_index)
            elif isinstance(m, Attention):
                m.enable_context_parallel(group)
        self._gathered_index = gathered_index

    def _masks(self, positions):
        if self.cp_group is None:
            return document_mask(positions)
        import torch.distributed as dist
        from rl.models.common import gathered_index
        cp, rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        gi = self._gathered_index or gathered_index
        parts = [torch.empty_like(positions) for _ in range(cp)]
        dist.all_gather(parts, positions.contiguous(), group=self.cp_group)
        n = positions.shape[1] * cp
        g = gi(n, cp).to(positions.device)
        full = torch.empty_like(torch.cat(parts, 1))
        full[:, g] = torch.cat(parts, 1)
        mine = g[rank * positions.shape[1]:(rank + 1) * positions.shape[1]]
        return document_mask(full, mine, g)

    def hidden(self, tokens, positions=None, attention_masks=None) -> torch.Tensor:
        """The final normed hidden states [B, L, D] (what the LM head and the MTP layers read)."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)[None].expand(tokens.shape[0], -1)
        mask = attention_masks if attention_masks is not None else self._masks(positions)
        h = self.embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, positions, mask)
        return self.norm_f(h)

    def forward(self, tokens, positions=None, attention_masks=None) -> torch.Tensor:
        return self.lm_head(self.hidden(tokens, positions, attention_masks))

    @torch.no_grad()
    def mtp_logits(self, tokens, positions=None) -> list[torch.Tensor]:
        """Logits of each MTP step k (1-based) at position t, predicting token t+1+k: step k reads the
        previous step's hidden state at t and the embedding of token t+k (vLLM's NemotronH-MTP); positions
        whose token t+k lies in another document (or past the row) are meaningless. One process only."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)[None].expand(tokens.shape[0], -1)
        mask = document_mask(positions)
        h = self.hidden(tokens, positions, mask)
        outs, pat = [], len(self.args.mtp_layer_types)
        layers = list(self.mtp.values())
        for k in range(self.args.num_nextn_predict_layers):
            nxt = torch.roll(tokens, -(k + 1), dims=1)
            emb = self.embeddings(nxt)
            for layer in layers[k * pat:(k + 1) * pat]:
                h = layer(h, positions, mask, emb=emb)
            outs.append(self.lm_head(h))
        return outs


@dataclass(kw_only=True)
class NemotronHConfig:
    """The model config of a ModelSpec: `build()` makes the module (on the current default device, e.g.
    meta), `layers` lists the block kinds (rl.models.cpu.apply / replay.apply find no torchtitan
    attention or MoE configs in it and leave it alone)."""
    args: NemotronHArgs
    # FP8 training (rl.models.nemotron_h.gemm): the modules the publisher keeps high precision (HF module
    # names / `re:` patterns), and, set by rl.trainer.fp8.apply, the GEMM and the publisher's predicate
    fp8_ignored: tuple[str, ...] = ()
    gemm: Any = None
    gemm_select: Any = None

    @property
    def layers(self) -> tuple[str, ...]:
        return self.args.layer_types

    def build(self, **kwargs) -> NemotronH:
        model = NemotronH(self.args)
        if self.gemm is not None:
            from rl.models.nemotron_h.gemm import set_gemm
            set_gemm(model, self.gemm, self.gemm_select)
        return model


def model_config(hf: Mapping[str, Any]) -> NemotronHConfig:
    """The config of checkpoint config.json `hf`; its FP8 ignore list is the checkpoint's own plus the
    family row's `fp8_keep_modules` (rl.contract.hf.ignored_modules, whatever `model_type` says)."""
    from rl.contract import families, hf as hfc
    ignored = hfc.ignored_modules(hf)
    ignored += [m for m in families.get("nemotron_h").fp8_keep_modules if m not in ignored]
    return NemotronHConfig(args=NemotronHArgs.from_hf(hf), fp8_ignored=tuple(ignored))


# -- the trainer's functions (rl.trainer.model's signatures) ---------------------------------------------
def logits(model, tokens: torch.Tensor, positions: torch.Tensor, masks=None) -> torch.Tensor:
    return model(tokens, positions=positions, attention_masks=masks)


def position_logprobs(model, tokens, positions, targets, masks=None):
    logp = torch.log_softmax(logits(model, tokens, positions, masks).float(), dim=-1)
    lp = logp.gather(-1, targets[..., None].long()).squeeze(-1)
    return lp, -(logp.exp() * logp).sum(-1)


def token_logprobs(model, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Entry i: log p(tokens[i]) predicted at i-1 and that distribution's entropy; 0 at document starts."""
    logp = torch.log_softmax(logits(model, tokens, positions).float(), dim=-1)[:, :-1]
    lp = logp.gather(-1, tokens[:, 1:, None].long()).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    starts = positions[:, 1:] == 0
    return (F.pad(lp.masked_fill(starts, 0.0), (1, 0)), F.pad(ent.masked_fill(starts, 0.0), (1, 0)))
