"""What every GPU of a plan will hold, estimated from the config before anything is submitted.

`estimate(cfg, plan)` returns, per role, the bytes of each term one GPU (one CPU rank or server when
the plan runs on CPUs) holds at its peak; `check` refuses a plan whose total exceeds the usable memory
(or, with `cluster.host_memory_gib`, whose host memory per node does), naming the role and its largest
term; `table_rows` is what `launch plan` prints. It reads the typed config (rl.contract.config.Config)
and the plan, and imports only the standard library and rl.contract: `launch` never imports torch. On the CPU the trainer's terms agree with measured peak memory within a few percent
(tests/integration/test_memory_measured.py); docs/memory.md has the tolerance and the sizing.

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

Trainer, per rank. FSDP2 shards dense parameters over all dp_shard*ep*cp ranks and experts over ep,
then over the rest, so every rank holds 1/world of the model: fp32 master weights (4 B/param), fp32
gradients (4 B) and AdamW's fp32 moments m and v (8 B). With `trainer.cpu_offload` those 16 B/param
move to pinned host memory (reported per node). Activations are those autograd keeps for backward,
counted tensor by tensor from torchtitan's layer code for one packed row of the longest sequence,
L = max(micro_batch_tokens, max_seq_len), of which a rank holds L/cp tokens (context parallel):
every norm keeps its input, 1/rms and normalised output; attention keeps q, the (cp-gathered) k and
v, its output and the log-sum-exp; an MoE layer keeps the router scores, the top_k dispatched token
copies (k*dim), the four [k, moe_hidden] SwiGLU intermediates of the experts and their outputs;
shared experts and dense FFNs keep four [hidden] intermediates. Activation checkpointing changes what
is kept: `full` keeps each layer's input only and recomputes one layer at a time in backward;
`selective` (torchtitan's op-level policy) keeps the layer input, the attention output, the top-k
ids, the all-to-all outputs and every second matmul output. The loss computes fp32 log-softmax over
the vocabulary for every position: the log-probabilities and their exp (two [L/cp, vocab] fp32
tensors) stay referenced through the whole backward, because the entropy, a statistic outside the
loss, keeps its graph alive, and differentiating the loss needs three more. Backward's peak is the
larger of that and one layer's backward (under AC its tensors recomputed; on the CPU also the
gradients of rl.models.cpu.LoopedExperts' per-expert weight slices, each a zero-filled tensor of the
whole [experts, hidden, dim] weight, four at once as measured); the two never coexist.
Hybrid blocks (`hybrid_layer_acts`): a Mamba-2 layer keeps in_proj's z|xBC|dt (and its all-to-all copy
under head-parallel CP, after which a rank scans the whole row for H/cp heads: the same elements per local
token), the conv output and its silu, dt, the fp32 scan inputs (x, x*dt, B, C) and output, the chunked
scan's states (per chunk of chunk_size tokens, heads x head_dim x ssm_state in fp32, before and after the
inter-chunk recurrence) and the gated norm's tensors; LatentMoE keeps the fp32 router input and scores,
the latent projection, top_k dispatched latent copies, the experts' up / relu / relu^2 and down outputs,
and the shared expert's three. The frozen MTP layers hold 4 B/param of fp32 masters (sharded, offloaded
with the rest), no gradients or moments, and are not run. The FSDP unit is one block: without expert
parallel a LatentMoE block unshards all its experts.
Workspace (GPU, or several ranks): FSDP's unsharded copy of the largest unit (a layer with this
rank's experts, or the embedding / LM head) for the current and the prefetched unit in the compute
dtype, plus that unit's unsharded gradients in the compute dtype and in fp32 for the reduce-scatter
(+1 B/param of FP8 operands with `trainer.fp8`), and a fixed 4 GiB for the CUDA context, NCCL, cuBLAS
and the caching allocator's slack. On the CPU (gloo ranks) the dense attention mask of rl.models.cpu
is added: the boolean [L/cp, L] mask and, per layer, its fp32 copy inside SDPA.

Inference, per GPU of a vLLM replica of tp x dp GPUs. With ep > 1 the routed experts are split over
all tp*dp GPUs; attention, shared experts, dense layers, embeddings and the LM head are split over tp
only and replicated on every data-parallel rank. FP8 weights (inference.fp8_load auto|fp8 on GPUs)
take 1 B/param plus one fp32 scale per 128x128 block for every linear of attention and the MLPs;
embeddings, the LM head, norms and routers stay bf16. KV cache per token and layer: MLA stores
(kv_lora_rank + qk_rope_head_dim) values, GQA 2*n_kv_heads*head_dim (split over tp, at least one head
per rank), GLM-5's indexer adds index_head_dim FP8 keys and their fp32 scale; hybrid networks keep KV for
their attention layers only, and per running sequence a constant Mamba state: (conv_kernel-1) x conv_dim
conv inputs and heads x head_dim x ssm_state SSM state (mamba_ssm_cache_dtype) per Mamba layer, split
over tp. MTP weights are not counted (vLLM loads them only for speculative decoding). Concurrency: the
orchestrator's max_concurrency requests are spread over the decode (or mixed) replicas and their
data-parallel ranks, and each is counted at max_model_len tokens: vLLM pages the KV, so that is the
worst case, and prefix sharing within a group (the prompt) only helps. Prefill servers hand the KV to
the decode pool; they need room for one full-length sequence per data-parallel rank. KV offload tiers
(CPU, disk) hold evicted prefixes, not running sequences: they are host memory, not GPU memory.
Workspace: activations of one forward at vLLM's default batch for the OpenAI server (8192 tokens on
an H200, 16384 from 160 GiB: hidden states, MoE intermediates, attention), fp32 sampler logits for
vLLM's 1024 sequences, and a fixed 4 GiB (6 GiB with expert parallel, for the DeepEP buffers) for
CUDA graphs, NCCL and the context. vLLM may use inference.gpu_memory_utilization of the GPU.

Ignored, and why: buffers (RoPE tables, expert counters: kilobytes to megabytes), routing imbalance
under expert parallelism (balanced routing assumed: a rank receiving twice its share of tokens holds
twice that layer's expert activations), the vision tower of Kimi K2.x (not trained here), the Python
interpreter and libraries (the measured test subtracts them), and the optimizer's transient buffers.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from rl.contract import families
from rl.contract.config import Config, ModelConfig, typed

GiB = 1 << 30
MiB = 1 << 20
GPU_RUNTIME = 4 * GiB          # CUDA context, NCCL, cuBLAS workspaces, allocator slack (not measured)
VLLM_RUNTIME = 4 * GiB         # CUDA graphs, NCCL, context
VLLM_RUNTIME_EP = 6 * GiB      # ... and DeepEP's dispatch/combine buffers
VLLM_MAX_SEQS = 1024           # vLLM's default max_num_seqs for the OpenAI server on >= 70 GiB GPUs
FP8_BLOCK = 128


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


@dataclass(frozen=True)
class Term:
    """One line of a role's memory: what, and its bytes (unpacks as `name, nbytes = term`)."""
    name: str
    nbytes: int

    def __iter__(self):
        return iter((self.name, self.nbytes))


@dataclass
class RoleMemory:
    """One role's peak per GPU (per rank or server on CPUs): terms in bytes; capacity 0 = not checked."""
    role: str
    unit: str                   # "GPU" | "CPU rank" | "CPU server"
    count: int                  # GPUs (ranks, servers) of the role
    terms: list[Term]
    capacity: int
    capacity_text: str          # how the capacity follows from the config (named in refusals)
    host_terms: list[Term] = field(default_factory=list)   # per node
    host_capacity: int = 0      # bytes per node (cluster.host_memory_gib); 0 = not checked
    hints: dict = field(default_factory=dict)   # term -> what to change when it overflows

    @property
    def total(self) -> int:
        return sum(b for _, b in self.terms)

    def term(self, prefix: str) -> int:
        return sum(b for n, b in self.terms if n.startswith(prefix))


@dataclass
class MemoryReport:
    roles: list[RoleMemory]
    params_total: int
    params_active: int
    notes: list[str] = field(default_factory=list)

    def role(self, name: str) -> RoleMemory:
        for r in self.roles:
            if r.role == name:
                return r
        have = ", ".join(r.role for r in self.roles)
        raise KeyError(f"no role {name!r} in the memory report (have {have})")


# -- trainer activations ---------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerActs:
    """Bytes per local token one layer keeps for backward, without AC and under selective AC."""
    saved: float
    selective: float


def _mm_alternate(outputs: list[float]) -> float:
    """torchtitan's selective AC saves the 1st, 3rd, ... matmul output of a block, recomputes the rest."""
    return sum(outputs[0::2])


def layer_acts(s: Shape, moe: bool, cb: int, cp: int, ep: int, cpu: bool, l_kv: int) -> LayerActs:
    """Saved activations of one transformer block per local token (compute dtype `cb` bytes)."""
    d, h, f4 = s.dim, s.n_heads, 4
    saved = d * cb + f4 + 2 * d * cb           # block input; attention norm: 1/rms, normalised, output
    mms: list[float] = []
    if s.mla:
        qk, kvl = s.qk_nope_head_dim + s.qk_rope_head_dim, s.kv_lora_rank
        if s.q_lora_rank:
            saved += 3 * s.q_lora_rank * cb + f4    # q_a output = q norm input, normalised, output
            mms += [s.q_lora_rank, h * qk]
        else:
            mms += [h * qk]
        saved += h * qk * cb                   # q = cat(q_nope, rope(q_pe))
        saved += (kvl + s.qk_rope_head_dim) * cb + f4 + 2 * kvl * cb   # kv_a output (kv norm input), normed, out
        if cp > 1:                             # k and v all-gathered over the cp ranks for attention
            saved += h * (qk + s.v_head_dim) * cb * cp
        else:                                  # k = cat(k_nope, k_pe); v is a view of kv_b's output
            saved += h * qk * cb + h * (s.qk_nope_head_dim + s.v_head_dim) * cb
        mms += [kvl + s.qk_rope_head_dim, h * (s.qk_nope_head_dim + s.v_head_dim)]
        out = h * s.v_head_dim
        if s.index_n_heads:                        # indexer: q, k (gathered), head weights, top-k ids
            saved += s.index_n_heads * s.index_head_dim * cb + 2 * s.index_head_dim * cb * cp + 2 * f4 + s.index_n_heads * f4
            saved += s.index_topk * 4
            mms += [s.index_n_heads * s.index_head_dim, s.index_head_dim]
    else:
        hd, kv = s.head_dim, s.n_kv_heads
        if s.qk_norm:                # q/k norms keep their input and normalised output
            saved += 2 * h * hd * cb + h * f4 + 2 * kv * hd * cb + kv * f4
        saved += 2 * hd * cb                   # RoPE's cos/sin rows
        saved += h * hd * cb + 2 * kv * hd * cb * cp   # attention inputs q, k, v (k, v gathered over cp)
        mms += [(h + 2 * kv) * hd]
        out = h * s.head_dim
    saved += out * cb + h * f4                 # attention output (wo's input) and log-sum-exp
    if cpu:
        saved += l_kv * 4                      # rl.models.cpu: SDPA's fp32 copy of the dense mask
    mms += [d]                                 # wo
    sel = d * cb + out * cb + h * f4
    saved += d * cb + f4 + 2 * d * cb          # FFN norm: input (the residual), 1/rms, normalised, output
    k = s.top_k
    if moe:
        f = s.moe_hidden_dim
        saved += s.num_experts * f4 + k * 8 + f4 + k * f4 + 2 * k * 8   # router scores, ids, weights, indices
        saved += k * d * cb + 4 * k * f * cb + k * f4 + k * d * cb   # dispatched, SwiGLU x4, scores, out
        mms += [k * f, k * f, k * d]           # the experts' three GEMMs (the gate is always recomputed)
        sel += k * 8 + (2 * k * d * cb if ep > 1 else 0)   # top-k ids; all-to-all outputs
        if s.n_shared_experts:
            saved += 4 * s.n_shared_experts * f * cb
            mms += [s.n_shared_experts * f, s.n_shared_experts * f, d]
    else:
        saved += 4 * s.dense_hidden_dim * cb
        mms += [s.dense_hidden_dim, s.dense_hidden_dim, d]
    sel += _mm_alternate(mms) * cb
    return LayerActs(saved=saved, selective=sel)


def hybrid_layer_acts(s: Shape, kind: str, cb: int, cp: int, cpu: bool, l_kv: int) -> LayerActs:
    """Saved activations per local token of one hybrid block of `kind` (rl.models.nemotron_h.model and
    .mamba: RMSNorm pre-norm, then the mixer)."""
    y, d, f4 = s.hybrid, s.dim, 4
    saved = d * cb + f4 + 2 * d * cb           # block input; pre-norm: 1/rms, normalised, output
    sel = d * cb
    if kind == "mamba":
        # Head-parallel CP: after the all-to-all a rank scans the whole row for H/cp heads (and G/cp groups),
        # the same elements per local token as without CP.
        di, conv, h = y.d_inner, y.conv_dim, y.mamba_heads
        proj = di + conv + h
        saved += proj * cb * (2 if cp > 1 else 1)   # in_proj output z|xBC|dt (+ its all-to-all copy)
        saved += 2 * conv * cb                 # conv1d output and its silu (the conv state: K-1 positions)
        saved += 2 * h * f4                    # dt after softplus and clamp, dt * A
        saved += 2 * di * 4 + 2 * y.n_groups * y.ssm_state * 4 + di * 4   # fp32 x, x*dt, B, C; y
        # the chunked scan's states: per chunk, heads x head_dim x ssm_state (fp32), before and after
        # the inter-chunk recurrence, i.e. per token 2 * H*P*N / chunk_size
        saved += 2 * h * y.mamba_head_dim * y.ssm_state * 4 / y.chunk_size + h * f4   # + the decay cumsum
        saved += 3 * di * cb + di * 4 + y.n_groups * f4   # gated norm: y*silu(z), silu(z), normalised, 1/rms
        mms = [proj, d]
    elif kind == "attention":                  # GQA, no positional embedding
        h, hd, kv = s.n_heads, s.head_dim, s.n_kv_heads
        saved += h * hd * cb + 2 * kv * hd * cb * cp + h * hd * cb + h * f4   # q, k, v (cp-gathered), out, lse
        if cpu:
            saved += l_kv * 4                  # SDPA's fp32 copy of the dense mask
        sel += h * hd * cb + h * f4
        mms = [(h + 2 * kv) * hd, d]
    elif kind == "moe":                        # LatentMoE, non-gated (relu2) experts at the latent width
        k, f, lat = s.top_k, s.moe_hidden_dim, y.latent or d
        saved += d * 4 + s.num_experts * f4 + k * 8 + 2 * k * f4   # fp32 router input, scores, ids, weights
        saved += (lat * cb if y.latent else 0) + k * lat * cb       # latent projection; dispatched copies
        saved += 3 * k * f * cb + k * lat * cb + lat * cb           # up, relu, relu^2; down; combined
        saved += 3 * y.shared_hidden * cb                            # shared expert: up, relu, relu^2
        sel += k * 8
        mms = [lat, k * f, k * lat, d, y.shared_hidden, d]
    else:                                      # dense non-gated MLP
        saved += 3 * y.mlp_hidden * cb
        mms = [y.mlp_hidden, d]
    sel += _mm_alternate(mms) * cb
    return LayerActs(saved=saved, selective=sel)


@dataclass(frozen=True)
class TrainerActs:
    kept: int           # kept for backward by the layers (per the AC mode), the final norm, the token ids
    logprobs: int       # fp32 log-softmax and its exp, [tokens, vocab]: alive through the whole backward
    head_bwd: int       # differentiating the loss head: 3 more fp32 [tokens, vocab]
    layer_bwd: int      # one layer in backward: recomputed (AC) + its gradients and temporaries
    tokens: int         # tokens of this rank's row
    row: int            # tokens of the whole row (before the cp split)

    @property
    def peak(self) -> int:
        return self.kept + self.logprobs + max(self.head_bwd, self.layer_bwd)


def trainer_acts(s: Shape, *, tokens: int, cb: int, cp: int, ep: int, ac: str, cpu: bool) -> TrainerActs:
    """Activation bytes of one rank for a packed row of `tokens` tokens split over `cp` ranks."""
    row = tokens if cp == 1 else -(-tokens // (2 * cp)) * 2 * cp   # head-tail CP pads to 2*cp chunks
    n = row // cp
    if s.hybrid:
        layers = [hybrid_layer_acts(s, k, cb, cp, cpu, row) for k in s.hybrid.kinds]
    else:
        layers = [layer_acts(s, i >= s.n_dense_layers, cb, cp, ep, cpu, row) for i in range(s.n_layers)]
    keep = {"full": lambda a: s.dim * cb, "selective": lambda a: a.selective, "none": lambda a: a.saved}[ac]
    kept = sum(keep(a) for a in layers)
    kept += 8 + 3 * s.dim * cb + 4           # token ids; final norm's input, normalised, output
    if cpu:
        kept += row                          # the boolean document mask, [n, row], shared by all layers
    worst = max(layers, key=lambda a: a.saved - keep(a))
    layer_bwd = (worst.saved - keep(worst)) * n    # AC: the layer's tensors again, during its backward
    if cpu and s.moe_layers:
        # rl.models.cpu.LoopedExperts indexes each expert's weights: every slice's gradient is a
        # zero-filled [experts, hidden, dim] tensor summed into the weight's (measured: 4 at once).
        layer_bwd += 4 * (s.num_experts // ep) * s.moe_hidden_dim * s.dim * cb
    # The entropy (a statistic, not in the loss) keeps log-softmax and its exp referenced until the
    # micro-batch ends; the loss's own backward then needs three more [tokens, vocab] fp32 buffers.
    return TrainerActs(kept=int(kept * n), logprobs=2 * s.vocab_size * 4 * n, head_bwd=3 * s.vocab_size * 4 * n,
                       layer_bwd=int(layer_bwd), tokens=n, row=row)


def _trainer(cfg: Config, plan: dict, p: Params, s: Shape) -> RoleMemory:
    t, tp = cfg.trainer, plan["trainer"]
    world, ep, cp = int(tp["world_size"]), int(tp["ep"]), int(tp["cp"])
    gpus = int(tp["gpus_per_node"])
    cb = 2 if t.dtype == "bfloat16" else 4
    ac = t.activation_checkpointing
    offload = t.cpu_offload
    per_rank = -(-p.dense // world) + -(-p.experts_total // world)
    state = [("parameters (fp32 masters)", per_rank * 4), ("gradients (fp32)", per_rank * 4),
             ("optimizer states (Adam m, v)", per_rank * 8)]
    if p.frozen:                             # MTP layers: frozen, sharded like the rest, no grads / moments
        state.insert(1, ("parameters: frozen MTP (fp32)", -(-p.frozen // world) * 4))
    tokens = max(t.micro_batch_tokens, s.max_seq_len)
    acts = trainer_acts(s, tokens=tokens, cb=cb, cp=cp, ep=ep, ac=ac, cpu=gpus == 0)
    kept_name = {"none": "activations (no AC)", "full": "activations (full AC)",
                 "selective": "activations (selective AC)"}[ac]
    terms = [] if offload else list(state)
    terms.append((f"{kept_name}, {acts.tokens} tokens", acts.kept))
    terms.append(("loss: fp32 log-probs + exp", acts.logprobs))
    if acts.head_bwd >= acts.layer_bwd:
        terms.append(("backward: loss head", acts.head_bwd))
    else:
        terms.append(("backward: one layer" + (" recomputed" if ac != "none" else ""), acts.layer_bwd))
    if world > 1 and s.hybrid:               # one FSDP unit per block (the frozen MTP units are not run)
        unit = max([p.embed] + [p.unit(k, ep) for k in set(s.hybrid.kinds)])
    if world > 1 and not s.hybrid:
        moe_unit = (p.attn_linear + p.shared + p.router + 2 * s.dim
                    + (s.num_experts // ep) * p.expert) if s.moe_layers else 0
        unit = max(p.embed, moe_unit, p.attn_linear + p.dense_ffn if s.n_dense_layers else 0)
    if world > 1:
        ws = unit * (2 * cb + cb + 4) + (unit if t.fp8 else 0)
        terms.append(("FSDP unsharded buffers", ws))
    if gpus:
        terms.append(("CUDA context, NCCL", GPU_RUNTIME))
    ranks = gpus or max(1, world // int(tp["nodes"]))
    host = [(f"fp32 state of {ranks} rank(s) (cpu_offload)",
             sum(b for _, b in state) * ranks)] if offload else []
    next_cp = (f"trainer.parallel.cp={2 * cp}" if s.max_seq_len % (4 * cp) == 0
               else "a larger trainer.parallel.cp")
    hints = {"parameters": "try trainer.cpu_offload=true or more trainer.nodes",
             "gradients": "try trainer.cpu_offload=true or more trainer.nodes",
             "optimizer": "try trainer.cpu_offload=true or more trainer.nodes",
             "activations": (f"try trainer.activation_checkpointing=full or {next_cp}" if ac != "full"
                             else f"try {next_cp}"),
             "loss": f"try {next_cp} (the loss holds [tokens/cp, vocab] in fp32)",
             "backward: loss": f"try {next_cp} (the loss holds [tokens/cp, vocab] in fp32)",
             "backward: one layer": f"try {next_cp}",
             "FSDP": "try a larger trainer.parallel.ep (fewer experts per rank)"}
    return _role("trainer", gpus, int(tp["nodes"]) * gpus if gpus else world, terms, cfg, host, hints,
                 util=1.0)


# -- inference -------------------------------------------------------------------------------------
def _weight_bytes(cfg: Config, gpus: int) -> tuple[float, float]:
    """(bytes per FP8-able linear param, bytes per other param) as the servers load them."""
    dt = cfg.inference.dtype
    wb = 4 if dt == "float32" or (dt == "auto" and not gpus and not cfg.model.hf_path) else 2
    fp8 = gpus > 0 and cfg.inference.fp8_load in ("auto", "fp8")
    return (1 + 4 / FP8_BLOCK ** 2 if fp8 else wb), wb


def kv_bytes_per_token(s: Shape, tp: int, kvb: int) -> int:
    """KV cache bytes of one token, all layers, on one GPU of a tensor-parallel group of `tp`."""
    if s.mla:
        per = (s.kv_lora_rank + s.qk_rope_head_dim) * kvb
        if s.index_n_heads:
            per += s.index_head_dim + 4 * math.ceil(s.index_head_dim / FP8_BLOCK)
    else:
        per = 2 * math.ceil(s.n_kv_heads / tp) * s.head_dim * kvb
    return per * s.layers_of("attention")       # hybrid: the attention layers only


def state_bytes_per_seq(s: Shape, tp: int, wb: int) -> int:
    """Hybrid: the recurrent state of one sequence, all Mamba layers, on one GPU of a tensor-parallel group
    of `tp` (heads and groups split over tp), constant in its length: the conv state, the last
    conv_kernel-1 inputs of xBC (compute dtype), and the SSM state, heads x head_dim x ssm_state
    (mamba_ssm_cache_dtype). 0 for networks without Mamba layers."""
    y = s.hybrid
    if not y:
        return 0
    conv = (y.conv_kernel - 1) * math.ceil(y.conv_dim / tp) * wb
    ssm = math.ceil(y.mamba_heads / tp) * y.mamba_head_dim * y.ssm_state * y.ssm_cache_bytes
    return (conv + ssm) * s.layers_of("mamba")


def _inference(cfg: Config, plan: dict, p: Params, s: Shape) -> list[RoleMemory]:
    inf, i, o = plan["inference"], cfg.inference, cfg.orchestrator
    gpus = int(inf["gpus_per_node"])
    qb, wb = _weight_bytes(cfg, gpus)
    pools: dict[str, list[dict]] = {}
    for r in inf["replicas"]:
        pools.setdefault(r["pool"], []).append(r)
    serving = len(pools.get("decode", [])) or len(pools.get("mixed", [])) or 1
    concurrency = o.max_concurrency
    max_len = i.max_model_len
    out = []
    for pool, reps in pools.items():
        r = reps[0]
        tp, dp, ep = int(r["tp"]), int(r["dp"]), int(r["ep"])
        split_e = ep if ep > 1 else tp
        experts = p.experts_total / split_e * qb
        dense = p.linear / tp * qb + (2 * p.embed / tp + s.moe_layers * p.router + p.norms
                                      + s.layers_of("mamba") * p.mamba_other) * wb
        fp8 = " fp8" if qb < 2 else ""
        terms = [(f"weights: experts 1/{split_e}{fp8}", int(experts)),
                 (f"weights: dense 1/{tp}{fp8}", int(dense))]
        name = "inference" if pool == "mixed" else f"inference {pool}"
        hints = {"weights": "try a wider replica (inference.dp, inference.ep) or inference.fp8_load=fp8",
                 "KV": ("try a lower orchestrator.max_concurrency, more decode replicas or a shorter "
                        "inference.max_model_len"),
                 "Mamba": "try a lower orchestrator.max_concurrency or more decode replicas",
                 "workspace": "try inference.tp > 1 (splits attention heads and the sampler's logits)"}
        host = []
        if i.kv_offload:
            per_node = max(1, gpus // (tp * dp)) if gpus else 1
            host.append((f"KV offload CPU tier, {per_node} server(s)",
                         int(i.kv_offload_cpu_gb * GiB * per_node)))
        if not gpus:
            terms.append(("KV cache (kv_cache_gb)", int(max(1, round(i.kv_cache_gb)) * GiB)))
            out.append(_role(name, 0, len(reps), terms, cfg, host, hints, util=1.0))
            continue
        seqs = 1 if pool == "prefill" else math.ceil(math.ceil(concurrency / serving) / dp)
        kv = seqs * max_len * kv_bytes_per_token(s, tp, wb)
        terms.append((f"KV cache: {seqs} x {max_len} tokens", int(kv)))
        if s.hybrid:
            terms.append((f"Mamba state: {seqs} sequences (conv + SSM)", seqs * state_bytes_per_seq(s, tp, wb)))
        batch = 16384 if cfg.cluster.gpu_memory_gib >= 160 else 8192
        attn = (s.n_heads / tp) * ((2 * (s.qk_nope_head_dim + s.qk_rope_head_dim) + s.v_head_dim) if s.mla else 3 * s.head_dim)
        if s.hybrid:                   # the widest mixer: Mamba's projections or the latent experts
            y = s.hybrid
            hidden = 6 * s.dim + attn + max(2 * (y.d_inner + y.conv_dim) / tp,
                                            s.top_k * (2 * s.moe_hidden_dim + (y.latent or s.dim)))
        else:
            hidden = 6 * s.dim + attn + s.top_k * (3 * s.moe_hidden_dim + s.dim)
        ws = batch * hidden * wb + 2 * VLLM_MAX_SEQS * s.vocab_size / tp * 4
        terms.append((f"workspace: {batch}-token forward", int(ws)))
        terms.append(("CUDA graphs, NCCL" + (", DeepEP" if ep > 1 else ""),
                      VLLM_RUNTIME_EP if ep > 1 else VLLM_RUNTIME))
        util = i.gpu_memory_utilization
        out.append(_role(name, gpus, len(reps) * tp * dp, terms, cfg, host, hints, util=util))
    return out


def _role(name: str, gpus: int, count: int, terms, cfg: Config, host, hints, util: float) -> RoleMemory:
    cl = cfg.cluster
    cap_gib = cl.gpu_memory_gib
    host_cap = int(cl.host_memory_gib * GiB)
    terms = [Term(n, int(b)) for n, b in terms]
    host = [Term(n, int(b)) for n, b in host]
    if not gpus:
        return RoleMemory(name, "CPU rank" if name == "trainer" else "CPU server", count, terms, 0,
                          "CPU: not checked", host, 0, hints)
    text = f"cluster.gpu_memory_gib={cap_gib:g}"
    if util != 1.0:
        text = f"inference.gpu_memory_utilization={util:g} x {text} = {util * cap_gib:.1f} GiB"
    return RoleMemory(name, "GPU", count, terms, int(util * cap_gib * GiB), text, host, host_cap, hints)


# -- the interface -----------------------------------------------------------------------------------
def estimate(cfg: "Config | dict", plan: dict) -> "MemoryReport":
    """Per-role, per-GPU memory of `plan` (launch.plan.make_plan(cfg)) for the composed config `cfg`
    (read as the typed Config: rl.contract.config.typed)."""
    cfg = typed(cfg)
    s = Shape.from_cfg(cfg.model)
    p = count_params(s)
    roles = [_trainer(cfg, plan, p, s), *_inference(cfg, plan, p, s)]
    o = cfg.orchestrator
    count = lambda n: f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"  # noqa: E731
    notes = [f"model: {count(p.total)} parameters, {count(p.active)} active"
             + (f" (+ {count(p.frozen)} frozen MTP)" if p.frozen else ""),
             f"KV cache counts orchestrator.max_concurrency={o.max_concurrency} requests at "
             f"inference.max_model_len={cfg.inference.max_model_len} tokens (the worst case)"]
    return MemoryReport(roles=roles, params_total=p.total, params_active=p.active, notes=notes)


def _fmt(b: float) -> str:
    return f"{b / GiB:.1f} GiB" if b >= GiB else f"{b / MiB:.1f} MiB"


def check(report: MemoryReport) -> None:
    """Raise PlanError (one line: the role, its total, the capacity, the largest term, what to try) when a
    role does not fit its GPU, or (with cluster.host_memory_gib) its nodes' host memory."""
    from rl.contract.config import PlanError
    for r in report.roles:
        if r.capacity and r.total > r.capacity:
            term, size = max(r.terms, key=lambda t: t.nbytes)
            hint = next((h for k, h in r.hints.items() if term.startswith(k)), "")
            raise PlanError(f"{r.role}: {_fmt(r.total)} per GPU exceeds {r.capacity_text} "
                            f"(largest term: {term} {_fmt(size)}" + (f"; {hint})" if hint else ")"))
        host = sum(b for _, b in r.host_terms)
        if r.host_capacity and host > r.host_capacity:
            term, size = max(r.host_terms, key=lambda t: t.nbytes)
            fix = ("try more trainer.nodes or trainer.cpu_offload=false" if r.role == "trainer"
                   else "try a smaller inference.kv_offload_cpu_gb")
            raise PlanError(f"{r.role}: {_fmt(host)} of host memory per node exceeds cluster.host_memory_gib="
                            f"{r.host_capacity / GiB:g} (largest term: {term} {_fmt(size)}; {fix})")


def table_rows(report: MemoryReport) -> list[tuple[str, str, str]]:
    """Header, then per role its terms, its total and its capacity (and host memory per node)."""
    rows = [("role", "term", "per GPU")]
    for r in report.roles:
        label = f"{r.role} ({r.count} {r.unit}{'s' if r.count != 1 else ''})"
        for i, (n, b) in enumerate(r.terms):
            rows.append((label if i == 0 else "", n, _fmt(b)))
        rows.append(("", f"total per {r.unit}", _fmt(r.total)))
        if r.capacity:
            verdict = "fits" if r.total <= r.capacity else "DOES NOT FIT"
            rows.append(("", f"capacity ({verdict})", _fmt(r.capacity)))
        for n, b in r.host_terms:
            rows.append(("", f"host per node: {n}", _fmt(b)))
    return rows
