"""GLM-5's network (transformers' `GlmMoeDsaForCausalLM`), built from torchtitan's DeepSeek-V3 pieces.

torchtitan 0.3.0 has no GLM-5. GLM-5 is a DeepSeek-V3 network (MLA attention, sigmoid-routed MoE with a
shared expert and the noaux_tc expert-bias correction, `first_k_dense_replace` dense layers) plus
DeepSeek Sparse Attention (DSA): in every layer a small *indexer* scores all keys per query and the MLA
attention of that query only sees the `index_topk` best-scoring keys inside its causal window.

What is reused, unchanged: torchtitan's `build_mla_moe_layers` (the DeepSeek-V3 layer builder: MLA
`Attention.Config`, `MoE` with `TokenChoiceTopKRouter.Config` routers: score_func sigmoid, expert bias
`moe.expert_bias_E` = HF `e_score_correction_bias`, route_scale = routed_scaling_factor, route_norm =
norm_topk_prob, group-limited routing from n_group/topk_group; Embedding/Linear/RMSNorm/ComplexRoPE
configs), `DeepSeekV3TransformerBlock`, the `DeepSeekV3Model` decoder, torchtitan's deepseek_v3
parallelize function and state-dict adapter (rl.models.glm_moe_dsa.parallelize, .state_dict_adapter).
So `rl.models.replay.apply` (router swap), `rl.models.cpu.apply` (dense eager attention, fp32 looped
experts), the meta build + `to_empty` + `init_weights` of rl.trainer.model, FSDP2 and EP all see the same config shapes as for DeepSeek-V3.

What is new: `GlmAttention`, a subclass of torchtitan's MLA `Attention` with an `Indexer` submodule, and
the adapter entries of the indexer's weights. The indexer (as HF's `GlmMoeDsaIndexer`): per-head queries
from the MLA query latent by its own projection, `indexer.wq_b(q_norm(wq_a(x)))`, one key shared by all
heads, `LayerNorm(wk(x))` (weight and bias, eps 1e-6), RoPE on the
*first* `qk_rope_head_dim` dims of both (interleaved pairs, the same ComplexRoPE as the MLA rope part; HF
writes the rotated pairs de-interleaved, which permutes q and k alike and leaves every dot product equal),
score = sum_h w_h(x) * relu(q_h . k * index_head_dim^-0.5), w = weights_proj(x) * index_n_heads^-0.5, in
fp32. Keys outside the allowed mask get -inf, the best min(index_topk, L_doc) keys of the query's document
are picked, and the selection is a boolean mask ANDed with the allowed mask (so a query never sees a key
the model's mask forbids, even when fewer than index_topk keys are allowed). The allowed mask is the one
the model is given: causal and same-document from `positions` (packed rows), a dense [B, 1, L, L] bool
on the CPU (`rl.models.cpu.document_mask`), or torchtitan's flex BlockMask on a GPU, whose mask_mod is evaluated
densely; in that case the attention runs as dense SDPA under the combined mask instead of the flex kernel
(flex has no per-query top-k key list). Softmax scale = qk_head_dim^-0.5 (times yarn mscale^2 when the
checkpoint uses yarn), as HF.

Training of the indexer: HF runs the indexer under `torch.no_grad()` and the selection is discrete, so
no gradient reaches the indexer's weights (wq_b, wk, k_norm, weights_proj) from the language-model loss;
the same here. They are loaded, kept and published unchanged (DeepSeek's separate indexer KL warm-up loss
is not part of HF's model and not implemented). Everything else trains.

Differences from HF / limits:
- (not a difference) ties in index score: with few indexer heads keys often score exactly 0 (every
  head's relu is 0). HF picks with `torch.topk` over the [L] row of the (unpacked) sequence, and which
  tied keys it keeps depends on the row's length (on the CPU std::nth_element sees the trailing -inf of
  the causal mask). So the top-k here is `torch.topk` over each query's own document, a row of the
  document's length with its keys in row-position order (`_topk`): HF's choice, ties included, for a
  document alone, packed with others, or split over context-parallel ranks. (An earlier stable sort
  keeping the earlier tied key differed from HF's CPU choice: ~0.5 logits with 2 indexer heads);
- (not a difference, easy to miss) `q_a_layernorm` / `kv_a_layernorm` use eps 1e-6, HF's RMSNorm default,
  not rms_norm_eps;
- only `indexer_types` all "full" (GLM-5's release): "shared" layers reuse the previous layer's top-k in
  HF, which torchtitan's decoder has no channel for; that config is a ValueError;
- the dense mask is O(L^2) per row: fine for the CPU and moderate GPU lengths, not for 128k contexts
  (that needs a sparse MLA kernel such as FlashMLA's, which torchtitan does not have);
- context parallelism (`trainer.parallel.cp`): the trainer's head-tail row split and dense mask rows
  [B, 1, L/cp, L] (rl.trainer.packing._cp_shard). torchtitan gathers K/V inside the inner attention, but
  the indexer needs every key of the row too, so `GlmAttention` does the gathering itself: MLA K/V and
  the indexer keys all-gathered over the cp mesh with torch's `flex_cp_allgather` (reduce-scatter in
  backward; the indexer keys travel with V), the local queries scored against all keys, the top-k taken
  with keys in row-position order over each query's document (`Indexer(..., key_index=, doc_end=)`; the
  documents' ends max-reduced over the cp ranks, a [B, L] all-reduce), ANDed with the trainer's mask;
  equal to one process (the two-gloo-rank test). Memory per rank: the [B, L/cp, L] masks and the
  indexer's fp32 [B, L/cp, index_n_heads, L] scores; a BlockMask (flex) is refused under CP;
- tensor parallelism is NotImplementedError in `parallelize_fn` (no TP plan for the indexer);
  VarlenAttention masks are NotImplementedError;
- the MTP layer GLM-5 checkpoints carry after the last layer is dropped by `from_hf`, as HF drops it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from torchtitan.models.common import Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import FlexAttention
from torchtitan.models.common.nn_modules import LayerNorm
from torchtitan.models.deepseek_v3.model import Attention, DeepSeekV3Model
from torchtitan.protocols.module import Module

from rl.models import common

NAME = "glm_moe_dsa"
# HF's GlmMoeDsaRMSNorm default (q_a_layernorm, kv_a_layernorm) and the indexer's LayerNorm eps
_LORA_NORM_EPS = 1e-6
_INDEXER_NORM_EPS = 1e-6


class Indexer(Module):
    """DSA lightning indexer: which keys each query may attend to (no gradient, as HF)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        n_heads: int
        head_dim: int
        rope_head_dim: int
        topk: int
        wq_b: Linear.Config
        wk: Linear.Config
        k_norm: LayerNorm.Config
        weights_proj: Linear.Config

    def __init__(self, config: Config):
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        self.rope_head_dim, self.topk = config.rope_head_dim, config.topk
        self.wq_b = config.wq_b.build()
        self.wk = config.wk.build()
        self.k_norm = config.k_norm.build()
        self.weights_proj = config.weights_proj.build()
        self.softmax_scale = self.head_dim ** -0.5

    @torch.no_grad()
    def keys(self, x: torch.Tensor, rope, positions: torch.Tensor | None) -> torch.Tensor:
        """[B, L, D]: the one key per token shared by all indexer heads, its first r dims roped."""
        r = self.rope_head_dim
        k = self.k_norm(self.wk(x)).unsqueeze(2)
        k_pe = rope(k[..., :r], k[..., :r], positions)[1]  # the indexer ropes its *first* r dims
        return torch.cat([k_pe, k[..., r:]], dim=-1).squeeze(2)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, rope, positions: torch.Tensor | None,
                allowed_BLL: torch.Tensor, *, keys: torch.Tensor | None = None,
                key_index: torch.Tensor | None = None, doc_end: torch.Tensor | None = None) -> torch.Tensor:
        """[B, Lq, Lk] bool: True where query i selected key j (always inside `allowed_BLL` [B, Lq, Lk]).

        One process: the queries and keys are the row's tokens `x` (Lq = Lk = L). Context parallel: `x`,
        `q_resid` and `positions` are this rank's query rows, `keys` the all-gathered `keys(...)` of
        the whole row in the gathered layout, `key_index` [Lk] the row position of each gathered key, and
        `doc_end` [B, Lk] (row-position order) one past the last token of each key's document, which the
        local rows alone cannot tell (`doc_ends` of every rank's rows, max-reduced; computed here when
        None). The top-k runs per query over its own document's keys in row-position order (`_topk`).
        """
        b, n, _ = x.shape
        r = self.rope_head_dim
        q = self.wq_b(q_resid).view(b, n, self.n_heads, self.head_dim)
        q_pe = rope(q[..., :r], q[..., :r], positions)[0]
        q = torch.cat([q_pe, q[..., r:]], dim=-1)                     # [B, Lq, H, D]
        k = self.keys(x, rope, positions) if keys is None else keys   # [B, Lk, D]
        if key_index is not None:
            order = torch.argsort(key_index)                          # layout -> row-position order
            k, allowed_BLL = k[:, order], allowed_BLL[..., order]
        # same op order as HF: fp32 scores [B, Lq, H, Lk], relu, head-weighted sum -> [B, Lq, Lk]
        scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1))
        scores = F.relu(scores * self.softmax_scale)
        w = F.linear(x.float(), self.weights_proj.weight.float()) * self.n_heads ** -0.5
        index_scores = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)
        index_scores = index_scores.masked_fill(~allowed_BLL, float("-inf"))
        if doc_end is None:
            doc_end = doc_ends(allowed_BLL)
        sel = _topk(index_scores, allowed_BLL, doc_end, self.topk)
        if key_index is not None:
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(order.numel(), device=order.device)
            sel = sel[..., inverse]                                   # back to the gathered layout
        return sel


def doc_ends(allowed_BLL: torch.Tensor, key_index: torch.Tensor | None = None) -> torch.Tensor:
    """[B, Lk] int64, row-position order: one past the row position of the last of these queries that
    may see each key (0 if none). For a key that starts a document this is the document's end, as
    every query of a causal document sees its first key. `allowed_BLL` [B, Lq, Lk] has its keys in the
    layout `key_index` gives (row-position order when None) and needs each query's own key allowed
    (causal masks), which tells the query's row position. Under context parallel every rank has some
    of the queries: the max over the ranks' results is the whole row's."""
    if key_index is not None:
        allowed_BLL = allowed_BLL[..., torch.argsort(key_index)]
    lk = allowed_BLL.shape[-1]
    ar = torch.arange(1, lk + 1, device=allowed_BLL.device, dtype=torch.int32)
    q_end = torch.where(allowed_BLL, ar, 0).amax(dim=-1)            # [B, Lq]: query's row position + 1
    return torch.where(allowed_BLL, q_end[..., None], 0).amax(dim=1).long()


def _topk(index_scores: torch.Tensor, allowed_BLL: torch.Tensor, doc_end: torch.Tensor,
          topk: int) -> torch.Tensor:
    """[B, Lq, Lk] bool selection of the `topk` best keys of each query, as HF picks them for the
    query's document alone: `torch.topk` over a row of the document's length, its keys in row order.

    Exact ties in index score are common when index_n_heads is small (a key whose every head's relu is
    0 scores exactly 0; with one head about half the keys do). Which tied keys torch.topk keeps depends
    on the row's length and content (on the CPU std::nth_element, so also on the trailing -inf of the
    causal mask), and HF runs it over [L] rows of the unpacked sequence. Taking it over each
    document's own [L_doc] row (keys outside the causal window -inf, as HF) gives HF's choice, ties
    included, and the same choice whether a document is alone, packed with others at any offset, or
    split over context-parallel ranks. Rows of the same document length share one torch.topk call
    (the picks of a row do not depend on the other rows)."""
    b, lq, lk = index_scores.shape
    flat = index_scores.reshape(b * lq, lk)
    allowed = allowed_BLL.reshape(b * lq, lk)
    start = allowed.to(torch.int8).argmax(dim=-1)                    # first allowed key: document start
    has_key = allowed.any(dim=-1)
    end = doc_end.gather(1, start.view(b, lq)).reshape(-1)
    length = torch.where(has_key, end - start, 0)
    sel = torch.zeros_like(allowed)
    for ld in torch.unique(length).tolist():
        if ld <= 0:
            continue  # a query with no allowed key selects none
        rows = (length == ld).nonzero().squeeze(-1)
        cols = start[rows, None] + torch.arange(ld, device=flat.device)
        picked = flat[rows[:, None], cols].topk(min(topk, ld), dim=-1).indices
        sel[rows[:, None], picked + start[rows, None]] = True
    # picks beyond the allowed keys (rows with fewer than topk of them: -inf keys) are dropped
    return sel.view(b, lq, lk) & allowed_BLL


def dense_allowed_mask(attention_masks, batch: int, length: int, device,
                       kv_length: int | None = None) -> torch.Tensor:
    """The model's attention mask as a dense [B, 1, L, Lk] bool (True = may attend; Lk = L but under CP)."""
    kv_length = length if kv_length is None else kv_length
    if isinstance(attention_masks, torch.Tensor):
        if attention_masks.dtype != torch.bool:
            raise TypeError("GLM-5 attention needs a boolean mask (rl.models.cpu.document_mask)")
        return attention_masks.expand(batch, 1, length, kv_length)
    if isinstance(attention_masks, BlockMask) and kv_length == length:
        # torchtitan's causal + packed-document mask_mods index tensors, so they evaluate on a grid
        ar = partial(torch.arange, device=device)
        m = attention_masks.mask_mod(ar(batch)[:, None, None], ar(1)[:, None, None],
                                     ar(length)[None, :, None], ar(length)[None, None, :])
        return m.expand(batch, length, length).unsqueeze(1)
    if isinstance(attention_masks, BlockMask):
        raise NotImplementedError("GLM-5 with context parallelism needs the dense [B, 1, L/cp, L] bool mask "
                                  "of the trainer's CP sharding (rl.models.cpu.cp_document_mask), not a "
                                  "BlockMask")
    raise NotImplementedError(f"GLM-5 sparse attention with attention masks of type "
                              f"{type(attention_masks).__name__} (varlen) is not implemented")


class GlmAttention(Attention):
    """torchtitan's DeepSeek-V3 MLA attention with GLM-5's DSA indexer selecting the keys per query."""

    @dataclass(kw_only=True, slots=True)
    class Config(Attention.Config):
        indexer: Indexer.Config
        # the projections rl.trainer.fp8 runs in FP8 (besides `wo`): DeepSeek-V3's MLA ones and the
        # indexer's wq_b / wk; the indexer's weights_proj stays high precision (rl.trainer.fp8)
        fp8_linears: ClassVar[tuple[str, ...]] = ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b", "indexer.wq_b",
                                                  "indexer.wk")

    def __init__(self, config: Config):
        super().__init__(config)
        if self.q_lora_rank == 0:
            raise ValueError("GLM-5 attention needs q_lora_rank > 0 (the indexer reads the query latent)")
        self.indexer = config.indexer.build()
        self.cp_group_name: str | None = None   # set by `enable_context_parallel`
        self.cp_size = 1

    def enable_context_parallel(self, cp_mesh) -> None:
        """Context parallel (the trainer's head-tail row split): every forward all-gathers the MLA K/V
        and the indexer keys over `cp_mesh` (torch's `flex_cp_allgather`, reduce-scatter in backward)."""
        import torch.distributed as dist
        self.cp_group_name = dist._get_process_group_name(cp_mesh.get_group())
        self.cp_size = cp_mesh.size()

    def _cp_gather(self, k, v, ik):
        """The whole row's K/V [B, L, H, *] and indexer keys [B, L, Di], ranks' chunks in rank order."""
        from torch.distributed.tensor.experimental._context_parallel._cp_custom_ops import flex_cp_allgather
        pg = self.cp_group_name
        if ik.dtype != v.dtype:  # e.g. autocast (LayerNorm in fp32); FSDP mixed precision casts alike
            return (*flex_cp_allgather(k.contiguous(), v.contiguous(), 1, pg),
                    flex_cp_allgather(ik, ik, 1, pg)[0])
        # one collective pair: the indexer key rides along the values (it has no gradient to send back)
        b, n, h, dv = v.shape
        gk, gvi = flex_cp_allgather(k.contiguous(), torch.cat([v.reshape(b, n, h * dv), ik], dim=-1), 1, pg)
        gv, gik = gvi.split([h * dv, ik.shape[-1]], dim=-1)
        return gk, gv.view(b, -1, h, dv), gik

    def _cp_doc_ends(self, allowed_BLL, key_index):
        """Each key's document end over the whole row: this rank's queries see only part of each
        document, so the per-rank `doc_ends` are max-reduced over the cp ranks (a [B, L] all-reduce)."""
        import torch.distributed._functional_collectives as funcol
        return funcol.all_reduce(doc_ends(allowed_BLL, key_index), "max", self.cp_group_name)

    def forward(self, x: torch.Tensor, attention_masks, positions: torch.Tensor | None = None):
        bsz, seqlen, _ = x.size()
        if self.cp_group_name is not None and positions is None:
            raise ValueError("GLM-5 with context parallelism needs the positions of the local rows (RoPE)")
        q_resid = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_resid).view(bsz, seqlen, -1, self.qk_head_dim)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv = self.wkv_a(x)
        kv, k_pe = torch.split(kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        q_pe, k_pe = self.rope(q_pe, k_pe.unsqueeze(2), positions)
        q = torch.cat([q_nope, q_pe], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv)).view(bsz, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.size(2), -1)], dim=-1)

        if self.cp_group_name is None:
            allowed = dense_allowed_mask(attention_masks, bsz, seqlen, x.device)
            mask = self.indexer(x, q_resid, self.rope, positions, allowed[:, 0]).unsqueeze(1)
        else:
            # this rank's query rows against the whole row's keys, in the layout the gather gives
            # (rl.models.common.gathered_index); the trainer's mask rows use the same key order
            k, v, ik = self._cp_gather(k, v, self.indexer.keys(x, self.rope, positions))
            total = seqlen * self.cp_size
            allowed = dense_allowed_mask(attention_masks, bsz, seqlen, x.device, kv_length=total)
            key_index = _gathered_index(total, self.cp_size, x.device)
            mask = self.indexer(x, q_resid, self.rope, positions, allowed[:, 0], keys=ik,
                                key_index=key_index,
                                doc_end=self._cp_doc_ends(allowed[:, 0], key_index)).unsqueeze(1)
        if isinstance(self.inner_attention, FlexAttention):
            # flex takes no per-query key list: dense SDPA under the combined mask (GPU path)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=mask, scale=self.softmax_scale).transpose(1, 2)
        else:  # rl.models.cpu.DenseAttention (or any inner attention taking a dense bool mask)
            out = self.inner_attention(q, k, v, attention_masks=mask, scale=self.softmax_scale)
        return self.wo(out.contiguous().view(bsz, seqlen, -1))


def _gathered_index(length: int, cp: int, device) -> torch.Tensor:
    """Row position of each all-gathered key: the trainer's head-tail split (rl.trainer.packing._cp_shard)."""
    return common.gathered_index(length, cp).to(device)


class GlmMoeDsaModel(DeepSeekV3Model):
    """torchtitan's DeepSeek-V3 decoder whose layers carry GlmAttention (a distinct name for GLM-5)."""

    @dataclass(kw_only=True, slots=True)
    class Config(DeepSeekV3Model.Config):
        pass


# -- config.json -> torchtitan config ---------------------------------------------------------------------
def _check(h: Mapping[str, Any]) -> None:
    """One-line ValueError naming the first config.json key this implementation does not follow."""
    def bad(key, why):
        raise ValueError(f"config.json {key}={h.get(key)!r} is not supported for GLM-5 ({why})")
    if h.get("model_type", NAME) != NAME:
        bad("model_type", f"expected {NAME!r}")
    if h.get("hidden_act", "silu") != "silu":
        bad("hidden_act", "silu only")
    for key in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
        if h.get(key):
            bad(key, "false only")
    if not h.get("q_lora_rank"):
        bad("q_lora_rank", "the indexer reads the query latent: > 0 needed")
    if h.get("scoring_func", "sigmoid") != "sigmoid":
        bad("scoring_func", "sigmoid only")
    if h.get("topk_method", "noaux_tc") != "noaux_tc":
        bad("topk_method", "noaux_tc only")
    if any(t != "full" for t in (h.get("indexer_types") or [])):
        bad("indexer_types", "every layer runs its own indexer ('full'); 'shared' top-k reuse is not built")
    pattern, freq = h.get("index_topk_pattern"), int(h.get("index_topk_freq") or 1)
    if h.get("indexer_types") is None and (pattern or freq > 1):
        bad("index_topk_pattern" if pattern else "index_topk_freq", "'full' layers only")
    n, k = int(h["num_hidden_layers"]), int(h.get("first_k_dense_replace") or 0)
    k = min(k, n)
    types = h.get("mlp_layer_types")
    if types is not None and list(types) != ["dense"] * k + ["sparse"] * (n - k):
        bad("mlp_layer_types", "first_k_dense_replace dense layers, then sparse")
    if int(h.get("index_head_dim", 0)) < int(h["qk_rope_head_dim"]):
        bad("index_head_dim", "must hold the qk_rope_head_dim rope part")


def _indexer_config(h: Mapping[str, Any]) -> Indexer.Config:
    dim, n_heads, head_dim = int(h["hidden_size"]), int(h["index_n_heads"]), int(h["index_head_dim"])
    lin = ds_model_inits()["linear"]
    return Indexer.Config(
        n_heads=n_heads, head_dim=head_dim, rope_head_dim=int(h["qk_rope_head_dim"]),
        topk=int(h["index_topk"]),
        wq_b=Linear.Config(in_features=int(h["q_lora_rank"]), out_features=n_heads * head_dim,
                           param_init=lin),
        wk=Linear.Config(in_features=dim, out_features=head_dim, param_init=lin),
        k_norm=LayerNorm.Config(normalized_shape=head_dim, eps=_INDEXER_NORM_EPS,
                                param_init={"weight": nn.init.ones_, "bias": nn.init.zeros_}),
        weights_proj=Linear.Config(in_features=dim, out_features=n_heads, param_init=lin))


def ds_model_inits() -> dict:
    from torchtitan.models import deepseek_v3 as ds
    return dict(linear=ds._LINEAR_INIT, norm=ds._NORM_INIT, embedding=ds._EMBEDDING_INIT,
                output=ds._output_linear_init)


def model_config(hf: Mapping[str, Any], attn_backend: str = "flex",
                 max_seq_len: int | None = None) -> GlmMoeDsaModel.Config:
    """The torchtitan model config of GLM-5 config.json `hf` (layers from torchtitan's MLA/MoE builder)."""
    from torchtitan.models import deepseek_v3 as ds
    h = dict(hf)
    _check(h)
    seq = int(max_seq_len or h.get("max_position_embeddings") or 4096)
    # default / yarn ComplexRoPE and the yarn softmax mscale
    rope, mscale = common.mla_rope({"max_seq_len": seq}, h, int(h["qk_rope_head_dim"]))
    dim, vocab = int(h["hidden_size"]), int(h["vocab_size"])
    n_group, topk_group = int(h.get("n_group") or 1), int(h.get("topk_group") or 1)
    n_shared = int(h.get("n_shared_experts") or 0)
    inits = ds_model_inits()
    layers = ds._build_dsv3_layers(
        n_layers=int(h["num_hidden_layers"]), n_dense_layers=int(h.get("first_k_dense_replace") or 0),
        dim=dim, n_heads=int(h["num_attention_heads"]), q_lora_rank=int(h["q_lora_rank"]),
        kv_lora_rank=int(h["kv_lora_rank"]), qk_nope_head_dim=int(h["qk_nope_head_dim"]),
        qk_rope_head_dim=int(h["qk_rope_head_dim"]), v_head_dim=int(h["v_head_dim"]), mscale=mscale,
        dense_hidden_dim=int(h["intermediate_size"]), moe_hidden_dim=int(h["moe_intermediate_size"]),
        num_experts=int(h["n_routed_experts"]), num_shared_experts=max(n_shared, 1),
        router_top_k=int(h["num_experts_per_tok"]), router_score_func="sigmoid",
        # HF always runs its group-limited path; with one group it selects every expert (a no-op)
        router_num_expert_groups=n_group if n_group > 1 else None,
        router_num_limited_groups=topk_group if n_group > 1 else None,
        router_route_scale=float(h.get("routed_scaling_factor", 1.0)),
        router_route_norm=bool(h.get("norm_topk_prob", True)),
        attn_backend=attn_backend, moe_comm_backend="standard", non_blocking_capacity_factor=None, rope=rope)
    eps = float(h.get("rms_norm_eps", 1e-5))
    for layer in layers:
        att = layer.attention
        fields = {f.name: getattr(att, f.name) for f in dataclasses.fields(att) if f.init}
        layer.attention = att = GlmAttention.Config(**fields, indexer=_indexer_config(h))
        att.q_norm.eps = att.kv_norm.eps = _LORA_NORM_EPS
        layer.attention_norm.eps = layer.ffn_norm.eps = eps
        if layer.moe is not None and n_shared == 0:
            layer.moe.shared_experts = None
        # noaux_tc: moe.expert_bias_E (load_balance_coeff set) holds the checkpoint's e_score_correction_bias;
        # it is loaded and published, never updated (the spec registers no load-balancing hook)
    return GlmMoeDsaModel.Config(
        vocab_size=vocab, dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=inits["embedding"]),
        norm=RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=inits["norm"]),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=inits["output"](dim)),
        layers=layers, mtp_layers=[])
