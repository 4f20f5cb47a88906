"""The model as the launcher's estimates see it: its architecture numbers (`Shape`) and parameter counts
(`Params`, `count_params`), torch-free, from the typed `model` group and the family's row.

Parameters. Counted from the architecture keys of `model` (GQA, or multi-head latent attention when
`kv_lora_rank` > 0; routed and shared experts; `n_dense_layers` leading dense FFN layers; GLM-5's
sparse-attention indexer; untied embedding and LM head). Kimi-K2 comes out at 1.026T / 32.9B active,
DeepSeek-V3 at 671.0B / 37.6B, GLM-5 at 743.9B / 41.8B (tests/unit/test_memory.py).
Hybrid attention kind (NemotronH): the layer pattern, Mamba-2, LatentMoE and MTP sizes have no
ModelConfig fields; `Shape.hybrid` reads them from the checkpoint's config.json with the family's
torch-free `rl.models.<package>.args.from_hf`. Each block is one of Mamba-2 (in/out projections, conv1d,
per-head A/D/dt_bias, gated norm), GQA attention (no RoPE), LatentMoE (router, hidden->latent->hidden
projections, non-gated experts at the latent width, a shared expert) or a dense non-gated MLP; the MTP
layers are counted apart (`Params.frozen`). The Nemotron-3 Ultra card: 549.6B / 55.0B active (+10.8B MTP),
equal to rl.models.nemotron_h.args.param_counts.

Split from launch/memory.py (issue 23): the memory estimate (rl.plan_math.memory), the step-time prediction
(launch.perf) and `launch doctor` all read the model through here. Standard library and rl.contract
only (a hybrid family's torch-free config reader is imported by name inside `Hybrid.from_hf`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rl.contract import families
from rl.contract.config import ModelConfig, typed


@dataclass(frozen=True)
class Shape:
    """The architecture numbers the estimate reads: the `model` group's fields under their own names, and
    what the family's row (rl.contract.families) says about its layers."""
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    moe_hidden_dim: int
    num_experts: int
    top_k: int
    max_seq_len: int
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    n_shared_experts: int = 0
    n_dense_layers: int = 0
    dense_hidden_dim: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    qk_norm: bool = False              # per-head q/k RMSNorms (the family's row)
    hybrid: "Hybrid | None" = None     # attention kind "hybrid": the layer pattern and Mamba-2 sizes

    @classmethod
    def from_cfg(cls, m: "ModelConfig | dict", hf: "dict | None" = None) -> "Shape":
        """The shape of the `model` group (a dict is read on the schema: its defaults fill missing keys).
        A hybrid family's layer pattern, Mamba-2 and LatentMoE sizes have no ModelConfig fields: they are
        read from `hf` (a config.json) or the checkpoint's config.json (`model.hf_path`)."""
        if isinstance(m, dict):
            m = typed({"run_dir": "", "model": m}).model
        row = families.get(m.family)
        sizes = {f.name: getattr(m, f.name) for f in dataclasses.fields(cls) if f.name not in ("qk_norm", "hybrid")}
        hybrid = Hybrid.from_hf(row, hf, m.hf_path) if row.attention == "hybrid" else None
        return cls(**sizes, qk_norm=row.qk_norm, hybrid=hybrid)

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    def layers_of(self, kind: str) -> int:
        """Main-network layers of a kind: attention | mamba | moe | dense (a layer may be attention + moe)."""
        if self.hybrid:
            return self.hybrid.kinds.count(kind)
        return {"attention": self.n_layers, "mamba": 0, "moe": self.n_layers - self.n_dense_layers,
                "dense": self.n_dense_layers}[kind]

    @property
    def moe_layers(self) -> int:
        return self.layers_of("moe")

    @property
    def dense_layers(self) -> int:
        return self.layers_of("dense")


# config.json layer types of a hybrid (Mamba-2 / attention / MoE) network -> the kinds counted here
HYBRID_KINDS = {"linear_attention": "mamba", "full_attention": "attention", "moe": "moe", "mlp": "dense"}


@dataclass(frozen=True)
class Hybrid:
    """A hybrid network's layers, one kind each (HYBRID_KINDS), and the sizes of its Mamba-2 mixers,
    latent MoE and non-gated MLPs, read with the family's torch-free config reader
    (`rl.models.<package>.args.from_hf`: NemotronH's handles its aliases and legacy patterns)."""
    kinds: tuple[str, ...]             # main network, in order
    mtp_kinds: tuple[str, ...]         # the multi-token-prediction layers (frozen in the trainer)
    mtp_steps: int                     # num_nextn_predict_layers: steps of the MTP pattern
    mamba_heads: int
    mamba_head_dim: int
    n_groups: int
    ssm_state: int
    conv_kernel: int
    chunk_size: int
    conv_bias: bool
    mamba_bias: bool
    latent: int                        # routed experts' width (moe_latent_size; 0 = the hidden size)
    shared_hidden: int                 # the shared expert's hidden width (0 = none)
    mlp_hidden: int                    # the dense ("mlp") layers' hidden width
    mlp_bias: bool
    ssm_cache_bytes: int = 4           # vLLM's SSM state dtype (mamba_ssm_cache_dtype, float32)

    @property
    def d_inner(self) -> int:
        return self.mamba_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.ssm_state

    @classmethod
    def from_hf(cls, row, hf: "dict | None", hf_path: "str | None") -> "Hybrid":
        import importlib
        from rl.contract import hf as hfc
        if hf is None:
            if not hf_path:
                raise ValueError(f"model.family={row.name}: its layer pattern and Mamba-2 sizes are in a "
                                 f"config.json; set model.hf_path")
            hf = hfc.read_config(hf_path)
        # the family's args module is torch-free, and so is its package's __init__ (torch inside functions)
        a = importlib.import_module(f"rl.models.{row.package}.args").from_hf(hfc.text_config(hf))
        ssm_dtype = str(a.extra.get("mamba_ssm_cache_dtype") or "float32")
        return cls(kinds=tuple(HYBRID_KINDS[t] for t in a.layer_types),
                   mtp_kinds=tuple(HYBRID_KINDS[t] for t in a.mtp_types), mtp_steps=int(a.num_nextn_predict_layers),
                   mamba_heads=a.mamba_num_heads, mamba_head_dim=a.mamba_head_dim, n_groups=a.n_groups,
                   ssm_state=a.ssm_state_size, conv_kernel=a.conv_kernel, chunk_size=a.chunk_size,
                   conv_bias=a.use_conv_bias, mamba_bias=a.use_bias, latent=int(a.moe_latent_size or 0),
                   shared_hidden=a.moe_shared_expert_intermediate_size, mlp_hidden=a.intermediate_size,
                   mlp_bias=a.mlp_bias, ssm_cache_bytes=4 if "32" in ssm_dtype else 2)


@dataclass(frozen=True)
class Params:
    """Parameter counts by kind. `attn_linear` etc. are per layer of their kind; `norms` covers the whole
    model. The main network is `total` / `active`; `frozen` are the MTP layers (hybrid: held by the
    trainer without gradients or optimizer state, not loaded by vLLM without speculative decoding)."""
    embed: int          # token embedding (= LM head: untied)
    attn_linear: int    # projections of one attention layer (indexer included)
    expert: int         # one routed expert (SwiGLU: 3 * dim * moe_hidden; LatentMoE: 2 * latent * moe_hidden)
    shared: int         # shared experts of one MoE layer
    router: int         # gate of one MoE layer
    dense_ffn: int      # FFN of one dense layer
    norms: int          # every norm weight of the model
    shape: Shape
    mamba_linear: int = 0   # in_proj + out_proj of one Mamba-2 layer
    mamba_other: int = 0    # its conv1d, A_log, D, dt_bias and gated-norm weight (kept in bf16)
    latent_proj: int = 0    # LatentMoE's hidden -> latent -> hidden projections of one MoE layer
    frozen: int = 0         # MTP layers, all their experts
    frozen_active: int = 0  # MTP layers, top_k experts

    @property
    def experts_total(self) -> int:
        return self.shape.moe_layers * self.shape.num_experts * self.expert

    @property
    def linear(self) -> int:
        """Linears of attention, Mamba in/out projections and MLPs: the weights stored in FP8."""
        s = self.shape
        return (s.layers_of("attention") * self.attn_linear + s.layers_of("mamba") * self.mamba_linear
                + s.moe_layers * (self.shared + self.latent_proj) + s.dense_layers * self.dense_ffn)

    @property
    def dense(self) -> int:
        """Everything but routed experts."""
        return (self.linear + 2 * self.embed + self.shape.moe_layers * self.router + self.norms
                + self.shape.layers_of("mamba") * self.mamba_other)

    @property
    def total(self) -> int:
        return self.dense + self.experts_total

    @property
    def active(self) -> int:
        return self.dense + self.shape.moe_layers * self.shape.top_k * self.expert

    def unit(self, kind: str, ep: int = 1) -> int:
        """Parameters of one layer of `kind` with this rank's experts (an FSDP unit), its norm included."""
        s, d = self.shape, self.shape.dim
        per = {"attention": self.attn_linear, "mamba": self.mamba_linear + self.mamba_other,
               "moe": self.shared + self.latent_proj + self.router + (s.num_experts // ep) * self.expert,
               "dense": self.dense_ffn}[kind]
        return per + d


def count_params(s: Shape) -> Params:
    if s.hybrid:
        return _count_hybrid(s)
    d, h = s.dim, s.n_heads
    if s.mla:
        qk = s.qk_nope_head_dim + s.qk_rope_head_dim
        q = (d * s.q_lora_rank + s.q_lora_rank * h * qk) if s.q_lora_rank else d * h * qk
        attn = q + d * (s.kv_lora_rank + s.qk_rope_head_dim) + s.kv_lora_rank * h * (s.qk_nope_head_dim + s.v_head_dim) + h * s.v_head_dim * d
        norms = s.q_lora_rank + s.kv_lora_rank
    else:
        attn = d * (h + 2 * s.n_kv_heads) * s.head_dim + h * s.head_dim * d
        norms = 2 * s.head_dim if s.qk_norm else 0   # qwen3's q/k norms
    if s.index_n_heads:
        attn += (s.q_lora_rank or d) * s.index_n_heads * s.index_head_dim + d * s.index_head_dim + d * s.index_n_heads
        norms += 2 * s.index_head_dim                                   # the indexer's key LayerNorm
    return Params(embed=s.vocab_size * d, attn_linear=attn, expert=3 * d * s.moe_hidden_dim,
                  shared=s.n_shared_experts * 3 * d * s.moe_hidden_dim, router=s.num_experts * d,
                  dense_ffn=3 * d * s.dense_hidden_dim, norms=s.n_layers * (2 * d + norms) + d, shape=s)


def _count_hybrid(s: Shape) -> Params:
    """Hybrid blocks (one pre-norm each): GQA attention without positional embedding; Mamba-2 (in_proj to
    z, xBC, dt; depthwise conv over xBC; A_log, D, dt_bias per head; gated RMSNorm; out_proj); LatentMoE
    (router + its bias correction on the hidden state, hidden -> latent projection, non-gated routed
    experts at the latent width, latent -> hidden, one shared non-gated expert on the hidden state);
    dense non-gated MLP. MTP layers: the same blocks, plus per step the fusion projection and its two
    norms (first layer) and a final norm (last layer)."""
    y, d, hd = s.hybrid, s.dim, s.head_dim
    attn = d * (s.n_heads + s.n_kv_heads) * hd * 2
    proj = y.d_inner + y.conv_dim + y.mamba_heads
    mamba_linear = d * proj + y.d_inner * d + ((proj + d) if y.mamba_bias else 0)
    mamba_other = y.conv_dim * y.conv_kernel + (y.conv_dim if y.conv_bias else 0) + 3 * y.mamba_heads + y.d_inner
    lat = y.latent or d
    latent_proj = (2 * d * lat + ((lat + d) if y.mlp_bias else 0)) if y.latent else 0
    dense_ffn = 2 * d * y.mlp_hidden + ((y.mlp_hidden + d) if y.mlp_bias else 0)
    p = Params(embed=s.vocab_size * d, attn_linear=attn, expert=2 * lat * s.moe_hidden_dim,
               shared=2 * d * y.shared_hidden, router=s.num_experts * (d + 1), dense_ffn=dense_ffn,
               norms=len(y.kinds) * d + d, shape=s, mamba_linear=mamba_linear, mamba_other=mamba_other,
               latent_proj=latent_proj)
    frozen = active = y.mtp_steps * (2 * d + 2 * d * d + d)     # per step: enorm, hnorm, eh_proj; final norm
    for kind in y.mtp_kinds:
        frozen += p.unit(kind)
        active += p.unit(kind) - ((s.num_experts - s.top_k) * p.expert if kind == "moe" else 0)
    return dataclasses.replace(p, frozen=frozen, frozen_active=active)
