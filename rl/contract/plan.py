"""The plan as every role reads it: what runs where, with which argv and environment.

`launch.plan.make_plan` computes the plan once from the validated config and writes it to
`RUN_DIR/plan.json`; the batch script template, the local backend and every role execute it. No role
re-derives topology: the inference role runs its replica's `vllm_argv(node_rank)` on each of the
replica's nodes (the head serves; the other nodes of a multi-node replica run vLLM's headless
data-parallel ranks), the trainer takes its device and process-group backend from `trainer`, the
router its port from `inference.router`, a sandbox service (`sandboxes`, het group 2 when
`cluster.sandbox_nodes` > 0) its index, and the SWE environment the number of services to spread
sandboxes over.

Arguments may name `${HETRL_...}` variables (the first trainer node's address, the role's own head
node address) that only exist at run time; `expand` substitutes them from the process environment
and refuses a reference it cannot resolve. `Plan.read` is strict: a plan.json with a missing or
unknown field is an error naming the field. Torch-free.
"""
from __future__ import annotations

import dataclasses
import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from rl.contract import paths, safefs

PLAN_VERSION = 2
# The name vLLM serves the policy under; the orchestrator and the router send it as "model".
SERVED_MODEL_NAME = "policy"
_VAR = re.compile(r"\$\{(HETRL_[A-Z0-9_]+)\}")


class PlanFormatError(ValueError):
    """plan.json does not match this version of the contract; the message names the field."""


def expand(args: list[str], env: dict) -> list[str]:
    """`args` with every `${HETRL_...}` replaced from `env`; an unset one is an error naming it."""
    def sub(m):
        if m.group(1) not in env:
            raise PlanFormatError(f"${{{m.group(1)}}}: not set in the environment of this process "
                                  f"(the batch script sets it before starting the role)")
        return env[m.group(1)]
    return [_VAR.sub(sub, str(a)) for a in args]


def _build(cls, data, where: str):
    if not dataclasses.is_dataclass(cls):
        return data
    if not isinstance(data, dict):
        raise PlanFormatError(f"{where}: expected an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    if unknown := sorted(set(data) - names):
        raise PlanFormatError(f"{where}.{unknown[0]}: unknown field (plan.json from another hetrl version?)")
    kw = {}
    for f in dataclasses.fields(cls):
        key = f"{where}.{f.name}"
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise PlanFormatError(f"{key}: missing")
            continue
        kw[f.name] = _value(hints[f.name], data[f.name], key)
    return cls(**kw)


def _value(tp, v, key):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:  # Optional[X]
        if v is None:
            return None
        tp = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, v, key)
    if origin is list and args and dataclasses.is_dataclass(args[0]):
        return [_build(args[0], x, f"{key}[{i}]") for i, x in enumerate(v)]
    return v


@dataclass(frozen=True)
class Group:
    het_group: int
    name: str
    nodes: int
    gpus_per_node: int
    # #SBATCH options of this component that differ from the cluster.* ones (a value of None drops the
    # option): the sandbox component's own partition and account, no GPU gres or constraint.
    sbatch: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Role:
    """One srun line of the batch script (one process per node of the role's node range)."""
    name: str
    het_group: int
    node: int                 # first node inside the het group
    nodes: int
    gpus_per_node: int
    command: list[str]
    env: dict
    log: str


@dataclass(frozen=True)
class TrainerPlan:
    nodes: int
    gpus_per_node: int
    nproc_per_node: int
    world_size: int
    dp_shard: int
    ep: int
    cp: int
    master_port: int
    device: str               # "cuda" (one rank per GPU, cuda:LOCAL_RANK) or "cpu"
    backend: str              # torch.distributed backend: "nccl" or "gloo"
    command: list[str]


@dataclass(frozen=True)
class Replica:
    """One vLLM server (a data-parallel group spanning `nodes` nodes when it is larger than a node)."""
    index: int
    name: str
    pool: str                 # mixed | prefill | decode
    node: int
    nodes: int
    gpus_per_node: int
    tp: int
    dp: int
    ep: int
    host: str                 # bind address
    port: int
    dp_rpc_port: Optional[int]
    model_dir: str            # node-local HF dir the head and every headless rank load
    vllm_command: list[str]   # shared by every node of the replica
    node_args: list[list[str]]  # appended per node: node 0 serves, the others run headless
    env: dict                 # extra environment of the vLLM processes (KV offload settings)
    command: list[str]        # the role process that runs vllm_command on each node

    def vllm_argv(self, node_rank: int) -> list[str]:
        if not 0 <= node_rank < len(self.node_args):
            raise PlanFormatError(f"inference.replicas[{self.index}]: node rank {node_rank} outside the "
                                  f"replica's {len(self.node_args)} node(s)")
        return [*self.vllm_command, *self.node_args[node_rank]]

    def is_head(self, node_rank: int) -> bool:
        return node_rank == 0


@dataclass(frozen=True)
class RouterPlan:
    host: str
    port: int
    node: int
    command: list[str]


@dataclass(frozen=True)
class InferencePlan:
    nodes: int
    gpus_per_node: int
    tp: int
    dp: int
    ep: int
    replica_gpus: int
    disaggregated: bool
    prefill_nodes: int
    decode_nodes: int
    kv_offload: Optional[str]
    replicas: list[Replica]
    router: Optional[RouterPlan]


@dataclass(frozen=True)
class SandboxService:
    """One sandbox service (rl.envs.swe.service): node `node` of het group 2."""
    index: int
    name: str                 # its role: sandbox_<index>
    node: int
    command: list[str]


@dataclass(frozen=True)
class SandboxPlan:
    """The optional third component: CPU nodes that run the SWE episodes' sandboxes."""
    nodes: int
    partition: Optional[str]
    account: Optional[str]
    services: list[SandboxService]


@dataclass(frozen=True)
class Command:
    command: list[str]


@dataclass(frozen=True)
class Plan:
    version: int
    experiment: str
    backend: str
    run_dir: str
    run_id: str
    python: str
    workdir: str
    node_local_dir: str
    signal_grace_s: int
    exit_preempted: int
    groups: list[Group]
    trainer: TrainerPlan
    inference: InferencePlan
    prepare: Command
    requeue_check: Command                     # after a clean stop: exit 0 = requeue (rl.requeue)
    roles: list[Role]
    memory: dict = field(default_factory=dict)   # launch.memory's report (per role, per GPU)
    sandboxes: Optional[SandboxPlan] = None      # None: sandboxes run on the orchestrator's node

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        if not isinstance(d, dict) or d.get("version") != PLAN_VERSION:
            raise PlanFormatError(f"plan.version={d.get('version') if isinstance(d, dict) else None!r}: "
                                  f"this hetrl reads version {PLAN_VERSION} (re-plan the run)")
        return _build(cls, d, "plan")

    @classmethod
    def read(cls, run_dir) -> "Plan":
        p = paths.plan_file(run_dir)
        try:   # no link followed, a FIFO refused without blocking, someone else's file refused (safefs)
            raw = safefs.read_bytes(p, limit=64 << 20)
        except FileNotFoundError:
            raise PlanFormatError(f"{p}: not found (the launcher writes it at submission)") from None
        except safefs.UnsafePath as e:
            raise PlanFormatError(str(e)) from None
        try:
            return cls.from_dict(json.loads(raw))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PlanFormatError(f"{p}: not JSON ({e})") from None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def role(self, name: str) -> Role:
        for r in self.roles:
            if r.name == name:
                return r
        raise PlanFormatError(f"plan.roles: no role {name!r} (have {', '.join(r.name for r in self.roles)})")

    def replica(self, index: int) -> Replica:
        if not 0 <= index < len(self.inference.replicas):
            raise PlanFormatError(f"plan.inference.replicas: no replica {index} "
                                  f"(the plan has {len(self.inference.replicas)})")
        return self.inference.replicas[index]
