"""Activation memory of the trainer, per rank: what autograd keeps for backward, tensor by tensor.

Activations are those autograd keeps for backward,
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
and the shared expert's three.

Split from launch/memory.py (issue 23), which adds the parameters, gradients, optimizer states and
workspace around these figures. Standard library only; the shapes come from rl.plan_math.shape.
"""
from __future__ import annotations

from dataclasses import dataclass

from rl.plan_math.shape import Shape


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
