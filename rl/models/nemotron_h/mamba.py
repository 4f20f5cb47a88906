"""NemotronH's Mamba-2 mixer in plain torch: packed documents, optional mamba_ssm kernels, context parallel.

The mixer is transformers 5.19's `NemotronHMamba2Mixer` (its torch path):

    zxbcdt = in_proj(x);  z, xBC, dt = split(zxbcdt, [H*P, H*P + 2*G*N, H])
    xBC = silu(causal depthwise conv1d(xBC))            (kernel conv_kernel, bias use_conv_bias)
    x, B, C = split(xBC, [H*P, G*N, G*N])
    dt = clamp(softplus(dt + dt_bias), min=time_step_min);  A = -exp(A_log)
    h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T;  y_t = C_t h_t + D x_t           (per head, B/C per group)
    y = RMSNormGated(y * silu(z)) (rms over n_groups groups of the channels, then weight);  out_proj(y)

The scan is the chunked state-space-dual (SSD) form (`ssd_scan`): within a chunk of `chunk_size` tokens an
attention-like product under the segment-sum decay matrix, across chunks a recurrence over the chunk end
states, in fp32 as transformers computes it. Note `time_step_min` is a *lower clamp* of dt in transformers'
mixer (its `time_step_limit = (time_step_min, inf)`); that is followed here.

Packed rows (the trainer's convention, rl.trainer.model.logits): `positions` restart at 0 where each
document starts. No state crosses a document boundary: the conv input at shift k is zeroed where
position < k, and in the scan every decay between two tokens of different documents is zeroed (the
segment-sum matrix inside a chunk, the chunk-to-chunk carry, and the carried state's read-out are masked
by equal document ids, ids = cumsum(positions == 0)). Two documents in one row therefore equal each
alone (tests/unit/test_nemotron_h.py).

Kernels: on CUDA, when `mamba_ssm` and `causal_conv1d` are importable (imported lazily, on first use),
`causal_conv1d_fn(..., seq_idx=doc ids)` and `mamba_chunk_scan_combined(..., seq_idx=doc ids,
dt_softplus=True, dt_limit=(time_step_min, inf))` replace the torch conv and scan: the same function
(the kernels reset conv and state at seq_idx changes). `USE_KERNELS = False` forces the torch path.
Neither package is installed on the CPU machine, so that path is not exercised by the tests here.

Context parallelism — head-parallel, with an all-to-all inside each Mamba layer (what Megatron-Core's
Mamba CP, NeMo Automodel and prime-rl do), chosen over passing conv and SSM state rank to rank along the
sequence, because:
- the trainer's CP layout is head-tail load balanced (rank r holds chunks r and 2cp-1-r of the row):
  state passing along the sequence would be a 2cp-step serial chain through the ranks (or a
  parallel-prefix over chunk states with a second correction pass), with document resets at arbitrary
  chunk offsets to carry along; after the all-to-all each rank has the whole row for H/cp heads, so the
  conv, the scan, the document masking and the mamba_ssm kernels run unchanged on full sequences;
- communication is two all-to-alls of the projected activations per layer, no dependency chain;
- cost: cp must divide n_groups (B and C are per group; each rank takes whole groups, so the gated
  RMSNorm's groups are local as well): cp <= n_groups (8 in released NemotronH configs).
Concretely: in_proj on the local tokens; the z/x/B/C/dt columns of each rank's heads are sent to that
rank (all_to_all_single, its own transpose in backward); positions are all-gathered; the row is put back
in sequence order (rl.models.common.gathered_index); conv + scan + gated norm on this rank's heads
with the matching slices of conv1d/dt_bias/A_log/D/norm weights; back to the gathered order and the
reverse all-to-all; out_proj on the local tokens. The sliced parameters' gradients are partial per rank
and summed by FSDP's reduce-scatter like any other gradient.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from rl.models.nemotron_h.gemm import Linear

USE_KERNELS = True
_KERNELS: tuple | None | bool = False   # False: not looked up yet; None: unavailable


def _kernels():
    global _KERNELS
    if _KERNELS is False:
        try:
            from causal_conv1d import causal_conv1d_fn
            from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
            _KERNELS = (causal_conv1d_fn, mamba_chunk_scan_combined)
        except Exception:  # not installed, or built for another torch
            _KERNELS = None
    return _KERNELS


def doc_ids(positions: torch.Tensor) -> torch.Tensor:
    """Document index of every token of packed rows [B, L] (positions restart at 0 per document)."""
    return torch.cumsum((positions == 0).to(torch.int32), dim=1)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                positions: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv1d of x [B, L, C] with weight [C, K] (HF's conv1d.weight[:, 0]), inputs of
    earlier documents zeroed (position < shift), then silu. Equals F.conv1d(padding=K-1)[..., :L]."""
    k = weight.shape[-1]
    out = x * weight[:, k - 1]
    for s in range(1, k):
        shifted = F.pad(x[:, :-s], (0, 0, s, 0)) if s < x.shape[1] else torch.zeros_like(x)
        out = out + (shifted * (positions >= s)[..., None].to(x.dtype)) * weight[:, k - 1 - s]
    if bias is not None:
        out = out + bias
    return F.silu(out)


def _segsum(x: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T]: out[i, j] = sum x[j+1..i] for i >= j, -inf above the diagonal (HF's
    stable cumsum-of-masked form)."""
    t = x.size(-1)
    x = x[..., None].expand(*x.size(), t)
    x = x.masked_fill(~torch.tril(torch.ones(t, t, device=x.device, dtype=torch.bool), diagonal=-1), 0)
    s = torch.cumsum(x, dim=-2)
    return s.masked_fill(~torch.tril(torch.ones(t, t, device=x.device, dtype=torch.bool), diagonal=0), -math.inf)


def ssd_scan(x, dt, A, B, C, D, chunk: int, seg: torch.Tensor) -> torch.Tensor:
    """Chunked SSD scan with document resets, fp32.

    x [b, l, h, p], dt [b, l, h] (after softplus and clamp), A [h] (negative), B, C [b, l, g, n], D [h],
    seg [b, l] document ids (non-decreasing along the row). Returns y [b, l, h, p] (D skip included).
    """
    b, l, h, p = x.shape
    g = B.shape[2]
    x, dt = x.float(), dt.float()
    B = B.float().repeat_interleave(h // g, dim=2)
    C = C.float().repeat_interleave(h // g, dim=2)
    y_skip = D.float()[:, None] * x
    pad = (-l) % chunk
    xdt = x * dt[..., None]
    dA = dt * A.float()
    if pad:
        xdt, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (xdt, B, C))
        dA = F.pad(dA, (0, 0, 0, pad))
        seg = torch.cat([seg, (seg[:, -1:] + 1).expand(b, pad)], dim=1)  # padding: a document of its own
    nc = (l + pad) // chunk
    xdt = xdt.reshape(b, nc, chunk, h, p)
    B = B.reshape(b, nc, chunk, h, -1)
    C = C.reshape(b, nc, chunk, h, -1)
    dA = dA.reshape(b, nc, chunk, h).permute(0, 3, 1, 2)          # [b, h, c, l]
    seg = seg.reshape(b, nc, chunk)                                 # [b, c, l]
    cs = torch.cumsum(dA, dim=-1)

    # 1. within each chunk: decay between tokens of one document only
    same = (seg[:, :, :, None] == seg[:, :, None, :])               # [b, c, l, s]
    Lm = torch.exp(_segsum(dA)) * same[:, None].to(dA.dtype)        # [b, h, c, l, s]
    G = torch.einsum("bclhn,bcshn->bclsh", C, B)
    Y_diag = torch.einsum("bclsh,bcshp->bclhp", G * Lm.permute(0, 2, 3, 4, 1), xdt)

    # 2. each chunk's end state, from the tokens of the chunk's last document
    last = seg[:, :, -1]                                            # [b, c]
    decay_states = torch.exp(cs[..., -1:] - cs) * (seg == last[..., None])[:, None].to(cs.dtype)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, decay_states, xdt)

    # 3. chunk-to-chunk recurrence: carried only while the document goes on
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)          # [b, c+1, h, p, n]
    ends = torch.cat([torch.full_like(last[:, :1], -1), last], dim=1)              # [b, c+1]
    carry = torch.exp(_segsum(F.pad(cs[..., -1], (1, 0))))                        # [b, h, c+1, c+1]
    carry = carry * (ends[:, :, None] == ends[:, None, :])[:, None].to(carry.dtype)
    start_states = torch.einsum("bhcz,bzhpn->bchpn", carry, states)[:, :-1]      # state entering chunk c

    # 4. the carried state read out by C, for the tokens of the document it belongs to
    out_decay = torch.exp(cs) * (seg == ends[:, :-1, None])[:, None].to(cs.dtype)  # [b, h, c, l]
    Y_off = torch.einsum("bclhn,bchpn->bclhp", C, start_states) * out_decay.permute(0, 2, 3, 1)[..., None]

    y = (Y_diag + Y_off).reshape(b, nc * chunk, h, p)[:, :l]
    return y + y_skip


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with equal splits along dim 0; the backward is the same exchange of the grads."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        import torch.distributed as dist
        # (the incoming grad can be a permuted view: empty_like would keep its strides, gloo writes row-major)
        g = g.contiguous()
        out = torch.empty_like(g, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, g, group=ctx.group)
        return out, None


def _assign(p: torch.Tensor, value: torch.Tensor) -> None:
    """p[...] = value (full size), also when p is a sharded DTensor (a checkpoint start initialises the
    model after FSDP has sharded it; the values are rank 0's, then overwritten by the checkpoint's)."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    if isinstance(p, DTensor):
        value = distribute_tensor(value.to(p.dtype), p.device_mesh, p.placements)
    p.copy_(value)


class Mamba2Mixer(nn.Module):
    """transformers' NemotronHMamba2Mixer (same parameter names and shapes), see the module docstring."""

    def __init__(self, a):
        super().__init__()
        self.a = a
        self.num_heads, self.head_dim = a.mamba_num_heads, a.mamba_head_dim
        self.n_groups, self.state = a.n_groups, a.ssm_state_size
        self.intermediate, self.conv_dim = a.mamba_intermediate, a.conv_dim
        self.chunk_size, self.dt_min = a.chunk_size, float(a.time_step_min)
        self.eps = a.layer_norm_epsilon
        self.in_proj = Linear(a.hidden_size, self.intermediate + self.conv_dim + self.num_heads, bias=a.use_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, a.conv_kernel, groups=self.conv_dim,
                                padding=a.conv_kernel - 1, bias=a.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.D = nn.Parameter(torch.empty(self.num_heads))
        self.norm = GatedRMSNorm(self.intermediate, self.intermediate // self.n_groups, self.eps)
        self.out_proj = Linear(self.intermediate, a.hidden_size, bias=a.use_bias)
        self.cp_group = None
        self.cp_size = 1
        self.cp_rank = 0

    @torch.no_grad()
    def init_weights(self, n_layers: int) -> None:
        a = self.a
        std = a.initializer_range
        nn.init.normal_(self.in_proj.weight, std=std)
        self.conv1d.reset_parameters()
        for lin in (self.in_proj, self.out_proj):
            if lin.bias is not None:
                lin.bias.zero_()
        _assign(self.A_log, torch.log(torch.arange(1, self.num_heads + 1, dtype=torch.float32)))
        self.D.fill_(1.0)
        dt = torch.exp(torch.rand(self.num_heads) * (math.log(a.time_step_max) - math.log(a.time_step_min))
                       + math.log(a.time_step_min)).clamp(min=a.time_step_floor)
        _assign(self.dt_bias, dt + torch.log(-torch.expm1(-dt)))     # inverse softplus
        nn.init.kaiming_uniform_(self.out_proj.weight, a=math.sqrt(5))
        self.out_proj.weight.div_(math.sqrt(n_layers))            # HF rescale_prenorm_residual
        self.norm.weight.fill_(1.0)

    # -- context parallel -------------------------------------------------------------------------------
    def enable_context_parallel(self, group, cp_size: int, cp_rank: int, gathered_index=None) -> None:
        """Head-parallel CP over `group` (see the module docstring). `gathered_index(L, cp)`: row positions
        in the order all-gathered local tokens lay out (default: the trainer's head-tail layout)."""
        if self.n_groups % cp_size:
            raise ValueError(f"NemotronH Mamba context parallel splits the n_groups={self.n_groups} B/C groups "
                             f"over the cp ranks: cp={cp_size} must divide it")
        if gathered_index is None:
            from rl.models.common import gathered_index
        self.cp_group, self.cp_size, self.cp_rank = group, cp_size, cp_rank
        self._gathered_index = gathered_index

    def _head_cols(self, r: int, cp: int) -> list[tuple[int, int]]:
        """(start, stop) columns of zxbcdt that cp rank r's heads use: z, x, B, C, dt pieces."""
        hp, gn = self.num_heads // cp * self.head_dim, self.n_groups // cp * self.state
        di, gs = self.intermediate, self.n_groups * self.state
        h = self.num_heads // cp
        return [(r * hp, (r + 1) * hp), (di + r * hp, di + (r + 1) * hp),
                (2 * di + r * gn, 2 * di + (r + 1) * gn), (2 * di + gs + r * gn, 2 * di + gs + (r + 1) * gn),
                (2 * di + 2 * gs + r * h, 2 * di + 2 * gs + (r + 1) * h)]

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        zxbcdt = self.in_proj(hidden)
        if self.cp_group is None:
            y = self._core(zxbcdt, positions, 0, 1)
            return self.out_proj(y.to(hidden.dtype))
        import torch.distributed as dist
        cp, b, n = self.cp_size, hidden.shape[0], hidden.shape[1]
        # send each rank the columns of its heads, for this rank's tokens
        send = torch.stack([torch.cat([zxbcdt[..., s:e] for s, e in self._head_cols(r, cp)], dim=-1)
                            for r in range(cp)])                                 # [cp, b, n, cols]
        got = _AllToAll.apply(send, self.cp_group)                              # [cp(src), b, n, cols]
        pos = [torch.empty_like(positions) for _ in range(cp)]
        dist.all_gather(pos, positions.contiguous(), group=self.cp_group)
        gidx = self._gathered_index(n * cp, cp).to(hidden.device)
        order = torch.argsort(gidx)                                              # gathered -> row order
        full = got.permute(1, 0, 2, 3).reshape(b, cp * n, -1)[:, order]
        full_pos = torch.cat(pos, dim=1)[:, order]
        y = self._core(full, full_pos, self.cp_rank, cp)                         # [b, L, H/cp * P]
        y = y[:, gidx].reshape(b, cp, n, -1).permute(1, 0, 2, 3)                # [cp(dst), b, n, hp]
        back = _AllToAll.apply(y.contiguous(), self.cp_group)                    # [cp(src heads), b, n, hp]
        y = back.permute(1, 2, 0, 3).reshape(b, n, -1)
        return self.out_proj(y.to(hidden.dtype))

    def _core(self, zxbcdt: torch.Tensor, positions: torch.Tensor, r: int, cp: int) -> torch.Tensor:
        """Conv, scan and gated norm of cp rank r's 1/cp of the heads (all heads when cp == 1)."""
        h, p, gn = self.num_heads // cp, self.head_dim, self.n_groups // cp * self.state
        hp = h * p
        z, xBC, dt = zxbcdt.split([hp, hp + 2 * gn, h], dim=-1)
        di, gs = self.intermediate, self.n_groups * self.state
        w = self.conv1d.weight[:, 0]
        bias = self.conv1d.bias
        if cp > 1:
            idx = torch.cat([torch.arange(r * hp, (r + 1) * hp), torch.arange(di + r * gn, di + (r + 1) * gn),
                             torch.arange(di + gs + r * gn, di + gs + (r + 1) * gn)]).to(w.device)
            w = w[idx]
            bias = None if bias is None else bias[idx]
        heads = slice(r * h, (r + 1) * h)
        A = -torch.exp(self.A_log[heads].float())
        dt_bias, D = self.dt_bias[heads], self.D[heads]
        b, n, _ = zxbcdt.shape
        seg = doc_ids(positions)
        kern = _kernels() if (USE_KERNELS and zxbcdt.is_cuda) else None
        if kern is not None:
            conv_fn, scan_fn = kern
            xBC = conv_fn(xBC.transpose(1, 2).contiguous(), w, bias, seq_idx=seg.to(torch.int32),
                          activation="silu").transpose(1, 2)
            x, B, C = xBC.split([hp, gn, gn], dim=-1)
            y = scan_fn(x.reshape(b, n, h, p), dt, A, B.reshape(b, n, -1, self.state),
                        C.reshape(b, n, -1, self.state), self.chunk_size, D=D, z=None, dt_bias=dt_bias,
                        dt_softplus=True, dt_limit=(self.dt_min, float("inf")), seq_idx=seg.to(torch.int32))
        else:
            xBC = causal_conv(xBC, w, bias, positions)
            x, B, C = xBC.split([hp, gn, gn], dim=-1)
            dt = torch.clamp(F.softplus(dt + dt_bias.to(dt.dtype)), min=self.dt_min)
            y = ssd_scan(x.reshape(b, n, h, p), dt, A, B.reshape(b, n, -1, self.state),
                         C.reshape(b, n, -1, self.state), D, self.chunk_size, seg)
        y = y.reshape(b, n, hp)
        weight = self.norm.weight[r * hp:(r + 1) * hp]
        return self.norm(y, z, weight=weight)


class GatedRMSNorm(nn.Module):
    """transformers' Zamba2RMSNormGated with norm_before_gate=False: rms over groups of y * silu(z)."""

    def __init__(self, dim: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size, self.eps = group_size, eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        dtype = y.dtype
        y = y.float() * F.silu(gate.float())
        *pre, last = y.shape
        yg = y.view(*pre, last // self.group_size, self.group_size)
        yg = yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight if weight is None else weight
        return w * yg.view(*pre, last).to(dtype)
