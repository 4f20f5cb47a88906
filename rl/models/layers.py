"""One calculator per layer kind, written once: what a block of that kind holds and costs (torch-free).

Each family's torch-free `args.py` (rl/models/<package>/args.py) reads its config.json and answers
`layers()`: one `Layer` per block of the network, each made of the calculators of its parts (a mixer,
then for transformer blocks an FFN), as torchtitan's models answer `get_nparams_and_flops` from shared
helpers and vLLM's hybrid models answer their state shape from `MambaStateShapeCalculator`. The plan
arithmetic (rl.plan_math: parameter counts, the memory estimate, the trainer's activations; launch.perf:
FLOPs, bytes read per decode step, the context-parallel exchange) sums over those rows and names no
family and no kind: a new family made of these kinds is a folder and a row of rl.contract.families, a new
kind is one calculator here plus the args of the family that uses it.

Every calculator answers the same questions, zero where the kind has nothing of it:
- `params()`: its parameters as `Count` (linears stored in FP8, other weights kept in the checkpoint
  dtype, internal norms, routed experts);
- `kv_bytes(tp, kvb)` per token and `state_bytes(tp, wb)` per sequence that vLLM keeps, on one GPU of a
  tensor-parallel group (KV for attention, the conv and SSM state for Mamba-2);
- `acts(cb, cp, ep, cpu, l_kv)`: what autograd keeps for backward per local token (`Acts`: saved bytes,
  the extra bytes torchtitan's selective AC keeps, the matmul output widths it alternates over);
- `flops(keys, train)`: forward FLOPs per token beyond the weights' matmuls (attention over `keys` keys,
  the Mamba-2 scan; decode when not `train`), and `kv_read(ctx, tp)`: cache bytes one decode step reads;
- `cp_elems()`: elements per token all-gathered over context-parallel ranks;
- `ws_attn(tp)` / `ws_mix(tp)`: widths of vLLM's forward workspace (the attention's, and the widest of
  the other mixers and the experts).
The arithmetic is rl.plan_math's before this split, term for term (docs/memory.md, docs/perf.md): the
rendered plans, memory and perf tables did not change. Standard library only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

F4 = 4            # fp32 bytes: 1/rms, log-sum-exp, router scores
FP8_BLOCK = 128   # block-FP8 scale granularity (the DSA indexer's keys)


@dataclass(frozen=True)
class Count:
    """Parameters of one part: `linear` (the weights served in FP8), `other` (kept in the checkpoint
    dtype: routers, Mamba's conv / A / D / dt_bias / gated norm), `norms` (its internal norms), and its
    routed experts: `n_experts` of `expert` parameters each, `top_k` of them active per token."""
    linear: int = 0
    other: int = 0
    norms: int = 0
    expert: int = 0
    n_experts: int = 0
    top_k: int = 0

    @property
    def dense(self) -> int:
        return self.linear + self.other + self.norms


@dataclass(frozen=True)
class Acts:
    saved: float = 0          # bytes kept for backward per local token, without AC
    sel: float = 0            # kept under selective AC besides the alternate matmul outputs
    mms: tuple = ()           # matmul output widths, in order (selective AC keeps every second one)


class Part:
    """Defaults: a part with nothing of the asked kind."""
    state_name = ""           # how the memory table names the state_bytes term, and what it is made of
    state_what = ""

    def params(self) -> Count:
        return Count()

    def kv_bytes(self, tp: int, kvb: int) -> int:
        return 0

    def state_bytes(self, tp: int, wb: int) -> int:
        return 0

    def acts(self, cb: int, cp: int, ep: int, cpu: bool, l_kv: int) -> Acts:
        return Acts()

    def flops(self, keys: float, train: bool) -> float:
        return 0

    def kv_read(self, ctx: float, tp: int) -> float:
        return 0

    def cp_elems(self) -> int:
        return 0

    def ws_attn(self, tp: int) -> float:
        return 0

    def ws_mix(self, tp: int) -> float:
        return 0


# -- attention -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GQA(Part):
    """Grouped-query attention: q/k/v/o projections; optional per-head q/k RMSNorms (qwen3); RoPE, or no
    positional embedding (NemotronH)."""
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    qk_norm: bool = False
    rope: bool = True

    def params(self) -> Count:
        d, h, kv, hd = self.dim, self.n_heads, self.n_kv_heads, self.head_dim
        return Count(linear=d * (h + 2 * kv) * hd + h * hd * d, norms=2 * hd if self.qk_norm else 0)

    def kv_bytes(self, tp, kvb):
        return 2 * math.ceil(self.n_kv_heads / tp) * self.head_dim * kvb     # at least one head per rank

    def acts(self, cb, cp, ep, cpu, l_kv):
        h, hd, kv = self.n_heads, self.head_dim, self.n_kv_heads
        saved = 0
        if self.qk_norm:                 # q/k norms keep their input and normalised output
            saved += 2 * h * hd * cb + h * F4 + 2 * kv * hd * cb + kv * F4
        if self.rope:
            saved += 2 * hd * cb         # RoPE's cos/sin rows
        saved += h * hd * cb + 2 * kv * hd * cb * cp   # q, k, v (k, v gathered over cp)
        out = h * hd
        saved += out * cb + h * F4       # attention output (wo's input) and log-sum-exp
        if cpu:
            saved += l_kv * 4            # rl.models.cpu: SDPA's fp32 copy of the dense mask
        return Acts(saved, out * cb + h * F4, ((h + 2 * kv) * hd, self.dim))

    def flops(self, keys, train):
        return 4 * self.n_heads * self.head_dim * keys

    def kv_read(self, ctx, tp):
        return ctx * 2 * math.ceil(self.n_kv_heads / tp) * self.head_dim * 2

    def cp_elems(self):
        return 2 * self.n_kv_heads * self.head_dim

    def ws_attn(self, tp):
        return (self.n_heads / tp) * (3 * self.head_dim)


@dataclass(frozen=True)
class MLA(Part):
    """Multi-head latent attention (DeepSeek-V3, Kimi): low-rank q (q_lora_rank > 0) and a compressed KV
    latent of kv_lora_rank + the shared RoPE key; vLLM caches the latent, decode runs absorbed."""
    dim: int
    n_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def params(self) -> Count:
        d, h, ql, kvl = self.dim, self.n_heads, self.q_lora_rank, self.kv_lora_rank
        q = (d * ql + ql * h * self.qk) if ql else d * h * self.qk
        attn = (q + d * (kvl + self.qk_rope_head_dim) + kvl * h * (self.qk_nope_head_dim + self.v_head_dim)
                + h * self.v_head_dim * d)
        return Count(linear=attn, norms=ql + kvl)

    def _keys(self, keys: float) -> float:
        return keys                      # dense attention: every key

    def kv_bytes(self, tp, kvb):
        return (self.kv_lora_rank + self.qk_rope_head_dim) * kvb

    def _indexer_acts(self, cb: int, cp: int) -> tuple[float, list]:
        return 0, []

    def acts(self, cb, cp, ep, cpu, l_kv):
        h, qk, kvl, ql = self.n_heads, self.qk, self.kv_lora_rank, self.q_lora_rank
        saved, mms = 0, []
        if ql:
            saved += 3 * ql * cb + F4                    # q_a output = q norm input, normalised, output
            mms += [ql, h * qk]
        else:
            mms += [h * qk]
        saved += h * qk * cb                             # q = cat(q_nope, rope(q_pe))
        # kv_a output (the kv norm's input), 1/rms, normalised, output
        saved += (kvl + self.qk_rope_head_dim) * cb + F4 + 2 * kvl * cb
        if cp > 1:                                       # k and v all-gathered over the cp ranks
            saved += h * (qk + self.v_head_dim) * cb * cp
        else:                                            # k = cat(k_nope, k_pe); v is a view of kv_b's output
            saved += h * qk * cb + h * (self.qk_nope_head_dim + self.v_head_dim) * cb
        mms += [kvl + self.qk_rope_head_dim, h * (self.qk_nope_head_dim + self.v_head_dim)]
        isaved, imms = self._indexer_acts(cb, cp)
        saved += isaved
        mms += imms
        out = h * self.v_head_dim
        saved += out * cb + h * F4                       # attention output (wo's input) and log-sum-exp
        if cpu:
            saved += l_kv * 4                            # rl.models.cpu: SDPA's fp32 copy of the dense mask
        return Acts(saved, out * cb + h * F4, tuple(mms) + (self.dim,))

    def flops(self, keys, train):
        sel, h = self._keys(keys), self.n_heads
        return (2 * h * (self.qk + self.v_head_dim) * sel if train
                else 2 * h * (2 * self.kv_lora_rank + self.qk_rope_head_dim) * sel)

    def kv_read(self, ctx, tp):
        return self._keys(ctx) * (self.kv_lora_rank + self.qk_rope_head_dim) * 2

    def cp_elems(self):
        return self.n_heads * (self.qk + self.v_head_dim)

    def ws_attn(self, tp):
        return (self.n_heads / tp) * (2 * self.qk + self.v_head_dim)


@dataclass(frozen=True)
class DSA(MLA):
    """DeepSeek sparse attention (GLM-5): MLA attending to its indexer's top-k keys; the indexer (its own
    q heads from the q latent, one shared key with a LayerNorm, per-head weights) scores every key and
    caches its keys in FP8 with an fp32 scale per block."""
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0

    def params(self) -> Count:
        c, d, ih, ihd = super().params(), self.dim, self.index_n_heads, self.index_head_dim
        idx = (self.q_lora_rank or d) * ih * ihd + d * ihd + d * ih
        return Count(linear=c.linear + idx, norms=c.norms + 2 * ihd)      # + the key LayerNorm

    def _keys(self, keys):
        return min(keys, self.index_topk)

    def _index_key_bytes(self) -> int:
        return self.index_head_dim + 4 * math.ceil(self.index_head_dim / FP8_BLOCK)

    def kv_bytes(self, tp, kvb):
        return super().kv_bytes(tp, kvb) + self._index_key_bytes()

    def _indexer_acts(self, cb, cp):                     # q, k (gathered), head weights, top-k ids
        ih, ihd = self.index_n_heads, self.index_head_dim
        saved = ih * ihd * cb + 2 * ihd * cb * cp + 2 * F4 + ih * F4 + self.index_topk * 4
        return saved, [ih * ihd, ihd]

    def flops(self, keys, train):
        return super().flops(keys, train) + 2 * self.index_n_heads * self.index_head_dim * keys

    def kv_read(self, ctx, tp):
        return super().kv_read(ctx, tp) + ctx * self._index_key_bytes()

    def cp_elems(self):
        return super().cp_elems() + self.index_head_dim


# -- Mamba-2 ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mamba2(Part):
    """Mamba-2 mixer (NemotronH): in_proj to z, xBC, dt; depthwise conv over xBC; A_log, D, dt_bias per
    head; gated RMSNorm; out_proj. vLLM keeps per sequence the last conv_kernel-1 xBC inputs (compute
    dtype) and the SSM state, heads x head_dim x ssm_state (mamba_ssm_cache_dtype)."""
    dim: int
    heads: int
    head_dim: int
    n_groups: int
    ssm_state: int
    conv_kernel: int
    chunk_size: int
    conv_bias: bool = True
    bias: bool = False
    ssm_cache_bytes: int = 4
    state_name, state_what = "Mamba state", "conv + SSM"

    @property
    def d_inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.ssm_state

    @property
    def proj(self) -> int:
        return self.d_inner + self.conv_dim + self.heads

    def params(self) -> Count:
        d, di, proj = self.dim, self.d_inner, self.proj
        linear = d * proj + di * d + ((proj + d) if self.bias else 0)
        other = (self.conv_dim * self.conv_kernel + (self.conv_dim if self.conv_bias else 0)
                 + 3 * self.heads + di)
        return Count(linear=linear, other=other)

    def state_bytes(self, tp, wb):
        conv = (self.conv_kernel - 1) * math.ceil(self.conv_dim / tp) * wb
        ssm = math.ceil(self.heads / tp) * self.head_dim * self.ssm_state * self.ssm_cache_bytes
        return conv + ssm

    def acts(self, cb, cp, ep, cpu, l_kv):
        # Head-parallel CP: after the all-to-all a rank scans the whole row for H/cp heads (and G/cp
        # groups), the same elements per local token as without CP.
        di, conv, h = self.d_inner, self.conv_dim, self.heads
        saved = self.proj * cb * (2 if cp > 1 else 1)    # in_proj output z|xBC|dt (+ its all-to-all copy)
        saved += 2 * conv * cb                           # conv1d output and its silu
        saved += 2 * h * F4                              # dt after softplus and clamp, dt * A
        saved += 2 * di * 4 + 2 * self.n_groups * self.ssm_state * 4 + di * 4   # fp32 x, x*dt, B, C; y
        # the chunked scan's states: per chunk heads x head_dim x ssm_state (fp32), before and after the
        # inter-chunk recurrence, i.e. per token 2 * H*P*N / chunk_size; + the decay cumsum
        saved += 2 * h * self.head_dim * self.ssm_state * 4 / self.chunk_size + h * F4
        saved += 3 * di * cb + di * 4 + self.n_groups * F4   # gated norm: y*silu(z), silu(z), normed, 1/rms
        return Acts(saved, 0, (self.proj, self.dim))

    def flops(self, keys, train):
        q = self.chunk_size if train else 1             # decode updates the state once per token
        n, di = self.ssm_state, self.d_inner
        scan = 2 * q * self.n_groups * n + 2 * q * di + 4 * di * n
        return scan + 2 * self.conv_dim * self.conv_kernel

    def kv_read(self, ctx, tp):                         # the state, read and written
        return 2 * ((self.conv_kernel - 1) * self.conv_dim * 2
                    + self.heads * self.head_dim * self.ssm_state * self.ssm_cache_bytes) / tp

    def cp_elems(self):
        return 2 * self.proj

    def ws_mix(self, tp):
        return 2 * (self.d_inner + self.conv_dim) / tp


# -- FFNs ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MoE(Part):
    """Routed SwiGLU experts (3 * dim * hidden each), top_k per token, a router over dim, and
    `n_shared` shared SwiGLU experts every token goes through."""
    dim: int
    hidden: int
    n_experts: int
    top_k: int
    n_shared: int = 0

    def params(self) -> Count:
        d, f = self.dim, self.hidden
        return Count(linear=self.n_shared * 3 * d * f, other=self.n_experts * d, expert=3 * d * f,
                     n_experts=self.n_experts, top_k=self.top_k)

    def acts(self, cb, cp, ep, cpu, l_kv):
        d, f, k, ns = self.dim, self.hidden, self.top_k, self.n_shared
        saved = self.n_experts * F4 + k * 8 + F4 + k * F4 + 2 * k * 8   # router scores, ids, weights, indices
        saved += k * d * cb + 4 * k * f * cb + k * F4 + k * d * cb   # dispatched, SwiGLU x4, scores, out
        mms = [k * f, k * f, k * d]              # the experts' three GEMMs (the gate is always recomputed)
        sel = k * 8 + (2 * k * d * cb if ep > 1 else 0)              # top-k ids; all-to-all outputs
        if ns:
            saved += 4 * ns * f * cb
            mms += [ns * f, ns * f, d]
        return Acts(saved, sel, tuple(mms))

    def ws_mix(self, tp):
        return self.top_k * (3 * self.hidden + self.dim)


@dataclass(frozen=True)
class LatentMoE(Part):
    """NemotronH's LatentMoE: router (+ its bias correction) on the hidden state, hidden -> latent
    projection (when `latent`), non-gated (relu2) routed experts at the latent width, latent -> hidden,
    and one shared non-gated expert on the hidden state."""
    dim: int
    hidden: int
    n_experts: int
    top_k: int
    latent: int = 0          # 0: the experts run at the hidden size, no projections
    shared_hidden: int = 0
    bias: bool = False

    @property
    def width(self) -> int:
        return self.latent or self.dim

    def params(self) -> Count:
        d, lat = self.dim, self.width
        proj = (2 * d * lat + ((lat + d) if self.bias else 0)) if self.latent else 0
        return Count(linear=2 * d * self.shared_hidden + proj, other=self.n_experts * (d + 1),
                     expert=2 * lat * self.hidden, n_experts=self.n_experts, top_k=self.top_k)

    def acts(self, cb, cp, ep, cpu, l_kv):
        d, k, f, lat = self.dim, self.top_k, self.hidden, self.width
        saved = d * 4 + self.n_experts * F4 + k * 8 + 2 * k * F4   # fp32 router input, scores, ids, weights
        saved += (lat * cb if self.latent else 0) + k * lat * cb     # latent projection; dispatched copies
        saved += 3 * k * f * cb + k * lat * cb + lat * cb            # up, relu, relu^2; down; combined
        saved += 3 * self.shared_hidden * cb                          # shared expert: up, relu, relu^2
        return Acts(saved, k * 8, (lat, k * f, k * lat, d, self.shared_hidden, d))

    def ws_mix(self, tp):
        return self.top_k * (2 * self.hidden + self.width)


@dataclass(frozen=True)
class MLP(Part):
    """A dense FFN: SwiGLU (`gated`: gate, up, down) or a non-gated one (up, down; NemotronH's relu2)."""
    dim: int
    hidden: int
    gated: bool = True
    bias: bool = False

    def params(self) -> Count:
        d, f = self.dim, self.hidden
        if self.gated:
            return Count(linear=3 * d * f)
        return Count(linear=2 * d * f + ((f + d) if self.bias else 0))

    def acts(self, cb, cp, ep, cpu, l_kv):
        f = self.hidden
        if self.gated:                   # four [hidden] intermediates
            return Acts(4 * f * cb, 0, (f, f, self.dim))
        return Acts(3 * f * cb, 0, (f, self.dim))       # up, relu, relu^2


# -- a block -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layer:
    """One block: its parts in order (a mixer, then an FFN for transformer blocks), each behind a
    pre-norm of `dim`. `frozen`: an MTP layer (held by the trainer without gradients or optimizer state,
    not run, not served); `extra`: parameters outside the parts (the MTP fusion projection and norms)."""
    dim: int
    parts: tuple
    frozen: bool = False
    extra: int = 0
    _counts: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_counts", tuple(p.params() for p in self.parts))

    @property
    def counts(self) -> tuple[Count, ...]:
        return self._counts

    @property
    def norms(self) -> int:
        return len(self.parts) * self.dim + sum(c.norms for c in self.counts)

    @property
    def linear(self) -> int:
        return sum(c.linear for c in self.counts)

    @property
    def other(self) -> int:
        return sum(c.other for c in self.counts)

    @property
    def experts(self) -> int:
        return sum(c.n_experts * c.expert for c in self.counts)

    @property
    def experts_active(self) -> int:
        return sum(c.top_k * c.expert for c in self.counts)

    @property
    def routed(self) -> bool:
        return any(c.n_experts for c in self.counts)

    def params(self, ep: int = 0) -> int:
        """All parameters; with `ep`, this rank's experts only (an FSDP unit's)."""
        experts = sum((c.n_experts // ep if ep else c.n_experts) * c.expert for c in self.counts)
        return self.linear + self.other + self.norms + experts + self.extra

    def active(self) -> int:
        return self.linear + self.other + self.norms + self.extra + self.experts_active

    def kv_bytes(self, tp: int, kvb: int) -> int:
        return sum(p.kv_bytes(tp, kvb) for p in self.parts)

    def state_bytes(self, tp: int, wb: int) -> int:
        return sum(p.state_bytes(tp, wb) for p in self.parts)

    def acts(self, cb: int, cp: int, ep: int, cpu: bool, l_kv: int) -> tuple[float, float]:
        """(saved, selective): bytes per local token kept for backward without AC and under selective
        AC (the layer input, what each part keeps, every second matmul output of the block)."""
        d, saved, sel, mms = self.dim, self.dim * cb, self.dim * cb, []
        for i, p in enumerate(self.parts):
            # each pre-norm keeps 1/rms, its normalised output and output; from the second on also its
            # input (the residual; the first one's is the layer input)
            saved += (d * cb if i else 0) + F4 + 2 * d * cb
            a = p.acts(cb, cp, ep, cpu, l_kv)
            saved += a.saved
            sel += a.sel
            mms += a.mms
        return saved, sel + sum(mms[0::2]) * cb

    def flops(self, keys: float, train: bool) -> float:
        return sum(p.flops(keys, train) for p in self.parts)

    def kv_read(self, ctx: float, tp: int) -> float:
        return sum(p.kv_read(ctx, tp) for p in self.parts)

    def cp_elems(self) -> int:
        return sum(p.cp_elems() for p in self.parts)

    def ws_attn(self, tp: int) -> float:
        return max(p.ws_attn(tp) for p in self.parts)

    def ws_mix(self, tp: int) -> float:
        return max(p.ws_mix(tp) for p in self.parts)

    @property
    def state_label(self) -> tuple[str, str]:
        """(name, what it is made of) of the state this layer keeps per sequence; ("", "") for none."""
        return next(((p.state_name, p.state_what) for p in self.parts if p.state_name), ("", ""))
