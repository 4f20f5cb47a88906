"""Packing a rollout batch into what each rank runs: greedy in-order micro-batches of whole samples
(`pack`), rows shifted to the predicting position (`to_row`), and this rank's share of them (`rows_for_rank`:
round robin over the data ranks, each row split head-tail over the context-parallel ranks, `_cp_shard`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rl.contract.batch import micro_batches
from rl.models.common import gathered_index, headtail_index
from rl.trainer import parallel


@dataclass
class MicroBatch:
    tokens: torch.Tensor      # [1, L] int64, several samples back to back
    positions: torch.Tensor   # [1, L] restarting at 0 at each sample
    per_token: dict[str, torch.Tensor]  # mask, lp_inf, adv, lag ... each [1, L]
    routed: torch.Tensor | None = None  # [1, L, moe layers, top_k] expert ids (replay); narrow until on device


@dataclass
class Row:
    """What one rank runs for one micro-batch: position j predicts `targets[j]` (= token j+1).

    `per_token` is shifted to the predicting position (entry j is about token j+1), so a row can be
    split along the sequence (context parallel) and every part scored on its own. `masks`: the
    attention mask rows of this rank under context parallel (None: built from `positions`).
    """
    tokens: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor
    per_token: dict[str, torch.Tensor]
    routed: torch.Tensor | None = None
    masks: torch.Tensor | None = None


def to_row(mb: MicroBatch) -> Row:
    tok, pos = mb.tokens, mb.positions
    targets = torch.nn.functional.pad(tok[:, 1:], (0, 1))
    # the last position of each sample predicts nothing inside it (the next token starts a new sample)
    ends = torch.nn.functional.pad(pos[:, 1:] == 0, (0, 1), value=True)
    per = {k: torch.nn.functional.pad(v[:, 1:], (0, 1)).masked_fill(ends, 0.0)
           for k, v in mb.per_token.items()}
    return Row(tok, pos, targets, per, mb.routed)


def _empty_row(keys, length: int, routed_like: torch.Tensor | None) -> Row:
    """A row with no loss token: keeps a rank with fewer micro-batches in its peers' collectives."""
    z = torch.zeros(1, length, dtype=torch.int64)
    routed = None
    if routed_like is not None:
        k = routed_like.shape[-1]
        routed = torch.arange(k).expand(1, length, routed_like.shape[2], k).clone()
    per = {key: torch.zeros(1, length) for key in keys}
    return Row(z, torch.arange(length)[None], z.clone(), per, routed)


def _cp_shard(row: Row, d: parallel.Dist) -> Row:
    """This cp rank's head-tail part of `row` and its attention mask rows (against gathered keys)."""
    from rl.models import cpu
    n, m = row.tokens.shape[1], 2 * d.cp
    pad = -n % m
    if pad:  # a separate document of padding tokens, outside the loss
        routed = row.routed
        if routed is not None:
            routed = torch.cat([routed, torch.arange(routed.shape[-1]).to(routed.dtype).expand(1, pad, *routed.shape[2:])], 1)
        row = Row(torch.nn.functional.pad(row.tokens, (0, pad)),
                  torch.cat([row.positions, torch.arange(pad)[None]], 1),
                  torch.nn.functional.pad(row.targets, (0, pad)),
                  {k: torch.nn.functional.pad(v, (0, pad)) for k, v in row.per_token.items()}, routed)
        n += pad
    mine = headtail_index(n, d.cp, d.cp_rank)
    masks = cpu.cp_document_mask(row.positions, mine, gathered_index(n, d.cp))
    return Row(row.tokens[:, mine], row.positions[:, mine], row.targets[:, mine],
               {k: v[:, mine] for k, v in row.per_token.items()},
               None if row.routed is None else row.routed[:, mine], masks)


def rows_for_rank(mbs: list[MicroBatch], d: parallel.Dist, per_rank: int | None = None,
                  routed_like: torch.Tensor | None = None) -> list[Row]:
    """This rank's rows: micro-batches round robin over the data ranks, each split over the cp ranks.
    With `per_rank`, `mbs` are already this data rank's own (a share the orchestrator cut and dealt by
    tokens, rl.contract.batch.ShardPlan) and `per_rank` is the most any data rank has.

    Every rank gets the same number of rows (empty ones fill up), so FSDP and EP collectives match.
    """
    rows = [to_row(mb) for mb in mbs]
    if not d.distributed:
        return rows
    if per_rank is None:
        per_rank = -(-len(rows) // d.dp_size)
        mine = rows[d.dp_rank::d.dp_size]
    else:
        mine = rows
    keys = list(rows[0].per_token) if rows else ["mask"]
    routed_like = rows[0].routed if rows else routed_like
    mine += [_empty_row(keys, 2 * d.cp, routed_like) for _ in range(per_rank - len(mine))]
    return [_cp_shard(r, d) for r in mine] if d.cp > 1 else mine


def _narrow(routed: np.ndarray) -> torch.Tensor:
    """Expert ids as a host tensor in their batch width (uint8; int32 for uint16 ids, which torch handles
    poorly): widened to int64 on the device (Trainer._on_device), not here, so packing copies 1 byte per
    id instead of 8."""
    r = np.ascontiguousarray(routed)
    return torch.from_numpy(r if r.dtype == np.uint8 else r.astype(np.int32))


def pack(offsets: np.ndarray, max_tokens: int, max_seq_len: int, tokens: np.ndarray,
         routed: np.ndarray | None = None, sizes: list[int] | None = None,
         **per_token: np.ndarray) -> list[MicroBatch]:
    """Greedy in-order packing of whole samples into rows of at most `max_tokens` tokens
    (rl.contract.batch.micro_batches, the rule the orchestrator cuts shards by), or into the micro-batches
    of `sizes` samples each when the share says where they end.

    A sample longer than `max_tokens` gets a row of its own; one longer than the model's context is an
    error (RoPE has no positions for it). `routed` ([T, layers, top_k] expert ids) is cut like tokens.
    """
    lengths = np.diff(offsets)
    if len(lengths) and lengths.max() > max_seq_len:
        raise ValueError(f"a sample has {int(lengths.max())} tokens, above model.max_seq_len={max_seq_len}")
    if routed is not None and len(routed) != len(tokens):
        raise ValueError(f"routed experts cover {len(routed)} tokens, the batch has {len(tokens)}")
    if sizes is None:
        ranges = micro_batches(lengths, max_tokens)
    else:
        ends = np.cumsum(sizes).tolist()
        if (ends[-1] if ends else 0) != len(lengths):
            raise ValueError(f"micro-batches of {sizes} samples for {len(lengths)} samples")
        ranges = list(zip([0] + ends[:-1], ends))
    out = []
    for first, last in ranges:
        a, b = int(offsets[first]), int(offsets[last])
        pos = np.concatenate([np.arange(n) for n in lengths[first:last]])
        out.append(MicroBatch(
            tokens=torch.from_numpy(tokens[a:b].astype(np.int64))[None],
            positions=torch.from_numpy(pos.astype(np.int64))[None],
            per_token={k: torch.from_numpy(np.ascontiguousarray(v[a:b], dtype=np.float32))[None]
                       for k, v in per_token.items()},
            routed=None if routed is None else _narrow(routed[a:b])[None]))
    return out
