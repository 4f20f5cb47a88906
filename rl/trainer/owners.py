"""Which trainer rank publishes which tensor: every rank writes some, no rank holds the whole model.

The HF-named state dict of a parallelized model (`StateDictAdapter.to_hf` of the sharded state dict) is
different on every rank: routed experts come out one HF tensor per expert, only for the experts the rank
holds under expert parallelism (a plain tensor when no other mesh dimension shards them, else a DTensor
over the remaining dimensions), and every other tensor is a DTensor sharded by FSDP (or replicated).

A *unit* is one HF tensor with the set of ranks that hold (a shard of) it. Units held by one rank are
published by that rank, with no communication: under expert parallelism that is the bulk of an MoE model.
The others are assigned greedily, largest first, to the least-loaded rank among their holders, so the
bytes each rank quantizes and writes are balanced. The assignment is a pure function of every rank's
unit list (exchanged once per run with `all_gather_object` and cached: the layout does not change), so
every rank computes the same plan.

Assembling a sharded unit at its owner is an all-gather over the unit's mesh (`DTensor.full_tensor`),
tensor by tensor, so besides its own units a rank transiently holds one full tensor. An all-gather moves
more bytes than a gather to the owner would (every holder receives the tensor, not only the owner); for
the MoE models this concerns only the non-expert tensors (about 3% of Kimi-K2's bytes) and, where FSDP
also shards the experts, the experts over that FSDP group (docs/weight-sync.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch


@dataclass(frozen=True)
class Unit:
    name: str
    nbytes: int
    holders: tuple[int, ...]


def assign_owners(units: Iterable[Unit], world: int) -> dict[str, int]:
    """name -> owner rank: single-holder units to their holder, the rest largest first to the least
    loaded holder (ties: lowest rank). Units of the same name are one unit held by all their holders.
    Deterministic for a given set of units."""
    merged: dict[str, Unit] = {}
    for u in units:  # a tensor every rank holds whole (replicated, not a DTensor) is listed by each
        prev = merged.get(u.name)
        merged[u.name] = u if prev is None else Unit(u.name, u.nbytes, tuple(sorted(set(prev.holders) | set(u.holders))))
    units = list(merged.values())
    load = [0] * world
    owner: dict[str, int] = {}
    for u in sorted(units, key=lambda u: (len(u.holders) > 1, u.name)):
        if len(u.holders) == 1:
            owner[u.name] = u.holders[0]
            load[u.holders[0]] += u.nbytes
    for u in sorted((u for u in units if len(u.holders) > 1), key=lambda u: (-u.nbytes, u.name)):
        r = min(u.holders, key=lambda h: (load[h], h))
        owner[u.name] = r
        load[r] += u.nbytes
    return owner


def local_units(hf_state: Mapping[str, torch.Tensor], rank: int) -> list[Unit]:
    from torch.distributed.tensor import DTensor
    out = []
    for name, v in hf_state.items():
        if isinstance(v, DTensor):
            holders = tuple(int(r) for r in v.device_mesh.mesh.flatten().tolist())
            nbytes = v.numel() * v.element_size()
        else:
            holders, nbytes = (rank,), v.numel() * v.element_size()
        out.append(Unit(name, nbytes, holders))
    return out


class OwnershipPlan:
    """The owner of every HF tensor, computed on first use and reused for every publish."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.owner: dict[str, int] | None = None
        self.bytes_per_rank: list[int] = []

    def owned(self, hf_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's units as full local tensors, in a fixed order; every rank must call this together
        (sharded units are all-gathered over their mesh)."""
        from torch.distributed.tensor import DTensor
        if self.owner is None:
            self._plan(hf_state)
        out = {}
        for name in sorted(hf_state):  # the same order on every holder of a sharded unit
            v = hf_state[name]
            if name not in self.owner:
                raise RuntimeError(f"{name}: not in the publishing plan (the layout changed since it was made)")
            if isinstance(v, DTensor):
                v = v.full_tensor()
            if self.owner[name] == self.rank:
                out[name] = v.detach()
        return out

    def _plan(self, hf_state) -> None:
        units = local_units(hf_state, self.rank)
        if self.world > 1:
            import torch.distributed as dist
            gathered: list = [None] * self.world
            dist.all_gather_object(gathered, units)
            units = [u for part in gathered for u in part]
        self.owner = assign_owners(units, self.world)
        sizes = {u.name: u.nbytes for u in units}
        self.bytes_per_rank = [0] * self.world
        for name, r in self.owner.items():
            self.bytes_per_rank[r] += sizes[name]
