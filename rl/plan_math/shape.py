"""The model as the launcher's estimates see it: its rows (`Shape.layers`, one per block, from the family's
torch-free args) and parameter counts (`Params`, `count_params`), torch-free.

Each family's `rl/models/<package>/args.py` (the family's row in rl.contract.families names the package)
turns the typed `model` group, or the checkpoint's config.json where the group has no fields for its
sizes (NemotronH's layer pattern, Mamba-2 and LatentMoE sizes), into `layers()`: one row per block made of
rl.models.layers' calculators (MLA, DSA, GQA, Mamba-2, MoE, LatentMoE, dense MLP), and `mtp_layers()`, the
frozen multi-token-prediction layers. Everything here and in the estimates that read it (rl.plan_math's
memory and activations, launch.perf) is a sum over those rows, so this module names no family and no
layer kind. Kimi-K2 comes out at 1.026T / 32.9B active, DeepSeek-V3 at 671.0B / 37.6B, GLM-5 at 743.9B /
41.8B, the Nemotron-3 Ultra card at 549.6B / 55.0B active (+10.8B MTP) (tests/unit/test_memory.py,
tests/unit/test_layers.py).

Split from launch/memory.py (issue 23): the memory estimate (rl.plan_math.memory), the step-time prediction
(launch.perf) and `launch doctor` all read the model through here. Standard library, rl.contract and the
torch-free rl.models.layers / rl.models.<package>.args (imported by name: a family is a row, not an import).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from rl.contract.config import ModelConfig, typed
from rl.models.fields import family_args


@dataclass(frozen=True)
class Shape:
    """The architecture the estimates read: the `model` group's fields under their own names, and the
    network's rows (`layers`: the main network in order; `mtp`: the frozen MTP layers)."""
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
    layers: tuple = field(default=(), repr=False)
    mtp: tuple = field(default=(), repr=False)

    @classmethod
    def from_cfg(cls, m: "ModelConfig | dict", hf: "dict | None" = None) -> "Shape":
        """The shape of the `model` group (a dict is read on the schema: its defaults fill missing keys);
        its rows from the family's args (`hf`: a config.json for the sizes the group has no fields for;
        else the family's args read `model.hf_path`'s where they need it)."""
        if isinstance(m, dict):
            m = typed({"run_dir": "", "model": m}).model
        a = family_args(m.family).from_model(m, hf)
        sizes = {f.name: getattr(m, f.name) for f in dataclasses.fields(cls)
                 if f.name not in ("layers", "mtp")}
        return cls(**sizes, layers=tuple(a.layers()), mtp=tuple(a.mtp_layers()))

    @functools.cached_property
    def _row_counts(self) -> tuple:
        """(row, how many times it stands in `layers`), distinct rows in order: blocks repeat (Kimi's 60
        MoE blocks are one row), and `launch plan` sums per-row terms over them a thousand times."""
        counts: dict = {}
        for x in self.layers:
            counts[x] = counts.get(x, 0) + 1
        return tuple(counts.items())

    @property
    def moe_layers(self) -> int:
        """Layers with routed experts (the EP all-to-alls, the routes a rollout records)."""
        return sum(n for x, n in self._row_counts if x.routed)

    def over_layers(self, f) -> float:
        """f(row) summed over the main network's rows (each distinct row evaluated once)."""
        return sum(f(x) * n for x, n in self._row_counts)


@dataclass(frozen=True)
class Params:
    """Parameter counts, summed over the rows. The main network is `total` / `active`; `frozen` are the
    MTP layers (held by the trainer without gradients or optimizer state, not loaded by vLLM without
    speculative decoding)."""
    embed: int          # token embedding (= LM head: untied)
    linear: int         # linears of attention, Mamba in/out projections, shared experts and MLPs (FP8)
    other: int          # routers, Mamba's conv / A / D / dt_bias / gated norm, every norm (checkpoint dtype)
    experts_total: int  # routed experts, all of them
    experts_active: int  # routed experts a token goes through
    frozen: int = 0          # MTP layers, all their experts
    frozen_active: int = 0   # MTP layers, top_k experts
    shape: Shape = None

    @property
    def dense(self) -> int:
        """Everything but routed experts."""
        return self.linear + 2 * self.embed + self.other

    @property
    def total(self) -> int:
        return self.dense + self.experts_total

    @property
    def active(self) -> int:
        return self.dense + self.experts_active

    def unit(self, ep: int = 1) -> int:
        """The largest FSDP unit: the embedding (= LM head) or one block with this rank's experts."""
        return max([self.embed] + [x.params(ep) for x in self.shape.layers])


def count_params(s: Shape) -> Params:
    rows = s.layers
    return Params(embed=s.vocab_size * s.dim, linear=sum(x.linear for x in rows),
                  other=sum(x.other + x.norms + x.extra for x in rows) + s.dim,     # + the final norm
                  experts_total=sum(x.experts for x in rows),
                  experts_active=sum(x.experts_active for x in rows),
                  frozen=sum(x.params() for x in s.mtp), frozen_active=sum(x.active() for x in s.mtp),
                  shape=s)
