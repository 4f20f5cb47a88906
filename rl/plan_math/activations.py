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

Each block is a row of `Shape.layers` and each of its parts a calculator of rl.models.layers, which
holds the per-kind terms above and these: a Mamba-2 layer keeps in_proj's z|xBC|dt (and its all-to-all copy
under head-parallel CP, after which a rank scans the whole row for H/cp heads: the same elements per local
token), the conv output and its silu, dt, the fp32 scan inputs (x, x*dt, B, C) and output, the chunked
scan's states (per chunk of chunk_size tokens, heads x head_dim x ssm_state in fp32, before and after the
inter-chunk recurrence) and the gated norm's tensors; LatentMoE keeps the fp32 router input and scores,
the latent projection, top_k dispatched latent copies, the experts' up / relu / relu^2 and down outputs,
and the shared expert's three.

Split from launch/memory.py (issue 23), which adds the parameters, gradients, optimizer states and
workspace around these figures. Standard library only; the rows come from rl.plan_math.shape, and this
module names no layer kind: it sums the rows' answers.
"""
from __future__ import annotations

from dataclasses import dataclass

from rl.plan_math.shape import Shape


@dataclass(frozen=True)
class LayerActs:
    """Bytes per local token one layer keeps for backward, without AC and under selective AC."""
    saved: float
    selective: float


def layer_acts(row, cb: int, cp: int, ep: int, cpu: bool, l_kv: int) -> LayerActs:
    """Saved activations of one block (a row of `Shape.layers`) per local token, compute dtype `cb`
    bytes: its input, each pre-norm's tensors and what its parts keep (rl.models.layers)."""
    saved, sel = row.acts(cb, cp, ep, cpu, l_kv)
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
    layers = [layer_acts(x, cb, cp, ep, cpu, row) for x in s.layers]
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
