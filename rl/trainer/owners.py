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

Assembling a sharded unit at its owner. The common layout, FSDP's Shard(0) over a 1-D mesh, is a
*gather to the owner* that runs on the publisher's background thread (`Gather`): on the trainer's thread
each holder only copies out its local shard; later the owner alone receives the others' shards, over a
gloo group of its own per mesh (created once, on every rank, when the plan is made), so the gathers
never interleave with the training step's collectives on the default group, and they move each byte
once. Any other layout (a multi-dimensional mesh, strided shards) is all-gathered on the trainer's thread
(`DTensor.full_tensor`), tensor by tensor, so besides its own units a rank transiently holds one full
tensor (docs/weight-sync.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch


@dataclass(frozen=True)
class Unit:
    name: str
    nbytes: int
    holders: tuple[int, ...]   # global ranks in mesh-coordinate order
    shard0: bool = False       # Shard(0) over a 1-D mesh: gathered to the owner in the background


@dataclass(frozen=True)
class Gather:
    """One Shard(0) tensor to assemble at its owner: this rank's `local` shard of `rows` rows."""
    name: str
    local: torch.Tensor
    rows: int
    owner: int
    holders: tuple[int, ...]
    group: object

    def run(self, rank: int) -> torch.Tensor | None:
        """Collective over `group` (every holder calls it, in the same order): the full tensor on the
        owner, None elsewhere."""
        import torch.distributed as dist
        n = len(self.holders)
        chunk = -(-self.rows // n)  # torch.chunk's split, as Shard(0) places rows
        padded = torch.zeros((chunk, *self.local.shape[1:]), dtype=self.local.dtype)
        padded[: self.local.shape[0]] = self.local
        bufs = [torch.empty_like(padded) for _ in range(n)] if rank == self.owner else None
        dist.gather(padded, bufs, dst=self.owner, group=self.group)
        if bufs is None:
            return None
        parts = [bufs[dist.get_group_rank(self.group, h)][: max(0, min(chunk, self.rows - c * chunk))]
                 for c, h in enumerate(self.holders)]
        return torch.cat(parts)


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


def _is_shard0(v) -> bool:
    from torch.distributed.tensor import Shard
    return v.device_mesh.ndim == 1 and len(v.placements) == 1 and type(v.placements[0]) is Shard \
        and v.placements[0].dim == 0 and v.dim() >= 1


def local_units(hf_state: Mapping[str, torch.Tensor], rank: int) -> list[Unit]:
    from torch.distributed.tensor import DTensor
    out = []
    for name, v in hf_state.items():
        if isinstance(v, DTensor):
            holders = tuple(int(r) for r in v.device_mesh.mesh.flatten().tolist())
            out.append(Unit(name, v.numel() * v.element_size(), holders, _is_shard0(v)))
        else:
            out.append(Unit(name, v.numel() * v.element_size(), (rank,)))
    return out


class OwnershipPlan:
    """The owner of every HF tensor, computed on first use and reused for every publish."""

    def __init__(self, rank: int, world: int, background_gathers: bool = True):
        self.rank, self.world = rank, world
        self.background_gathers = background_gathers and world > 1
        self.owner: dict[str, int] | None = None
        self.bytes_per_rank: list[int] = []
        self._groups: dict[tuple[int, ...], object] = {}
        self._shard0: set[str] = set()

    def owned(self, hf_state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[Gather]]:
        """(this rank's units as full local tensors, the Shard(0) units to gather in the background),
        in a fixed order; every rank must call this together (other sharded units are all-gathered over
        their mesh here). The tensors may be live parameters: the publisher copies them out."""
        from torch.distributed.tensor import DTensor
        if self.owner is None:
            self._plan(hf_state)
        out, gathers = {}, []
        for name in sorted(hf_state):  # the same order on every holder of a sharded unit
            v = hf_state[name]
            if name not in self.owner:
                raise RuntimeError(f"{name}: not in the publishing plan (the layout changed since it was made)")
            if isinstance(v, DTensor) and name in self._shard0:
                holders = tuple(int(r) for r in v.device_mesh.mesh.flatten().tolist())
                gathers.append(Gather(name, v.to_local().detach(), int(v.shape[0]), self.owner[name], holders,
                                      self._groups[holders]))
                continue
            if isinstance(v, DTensor):
                v = v.full_tensor()
            if self.owner[name] == self.rank:
                out[name] = v.detach()
        return out, gathers

    def _plan(self, hf_state) -> None:
        units = local_units(hf_state, self.rank)
        if self.world > 1:
            import torch.distributed as dist
            gathered: list = [None] * self.world
            dist.all_gather_object(gathered, units)
            units = [u for part in gathered for u in part]
            if self.background_gathers:
                self._shard0 = {u.name for u in units if u.shard0}
                # every rank creates every group, in the same order (new_group is collective)
                for holders in sorted({u.holders for u in units if u.shard0}):
                    self._groups[holders] = dist.new_group(sorted(holders), backend="gloo")
        self.owner = assign_owners(units, self.world)
        sizes = {u.name: u.nbytes for u in units}
        self.bytes_per_rank = [0] * self.world
        for name, r in self.owner.items():
            self.bytes_per_rank[r] += sizes[name]
