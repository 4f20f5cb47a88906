"""What every GPU of a plan will hold, estimated from the config before anything is submitted.

`estimate(cfg, plan)` returns, per role, the bytes of each term one GPU (one CPU rank or server when
the plan runs on CPUs) holds at its peak; `check` refuses a plan whose total exceeds the usable memory
(or, with `cluster.host_memory_gib`, whose host memory per node does), naming the role and its largest
term; `table_rows` is what `launch plan` prints. It reads the typed config (rl.contract.config.Config)
and the typed plan (rl.contract.plan.Plan), and imports only the standard library, rl.contract and its
rl.plan_math siblings: `launch` never imports torch. On the CPU the trainer's terms agree with measured peak
memory within a few percent (tests/integration/test_memory_measured.py); docs/memory.md has the
tolerance and the sizing.

The model's numbers and parameter counts are rl.plan_math.shape's (`Shape`, `count_params`), the
trainer's activations rl.plan_math.activations'; this module adds up what each role holds per GPU and judges it.

Trainer, per rank. FSDP2 shards dense parameters over all dp_shard*ep*cp ranks and experts over ep,
then over the rest, so every rank holds 1/world of the model: fp32 master weights (4 B/param), fp32
gradients (4 B) and AdamW's fp32 moments m and v (8 B). With `trainer.cpu_offload` those 16 B/param
move to pinned host memory (reported per node). The activations are rl.plan_math.activations' (its docstring
says what is kept). The frozen MTP layers hold 4 B/param of fp32 masters (sharded, offloaded
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

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

from rl.plan_math.activations import trainer_acts
from rl.plan_math.shape import Params, Shape, count_params, family_args  # noqa: F401 (re-exported)
from rl.contract.config import Config, typed
from rl.contract.plan import InferencePlan, Plan, TrainerPlan

GiB = 1 << 30
MiB = 1 << 20
GPU_RUNTIME = 4 * GiB          # CUDA context, NCCL, cuBLAS workspaces, allocator slack (not measured)
VLLM_RUNTIME = 4 * GiB         # CUDA graphs, NCCL, context
VLLM_RUNTIME_EP = 6 * GiB      # ... and DeepEP's dispatch/combine buffers
VLLM_MAX_SEQS = 1024           # vLLM's default max_num_seqs for the OpenAI server on >= 70 GiB GPUs
FP8_BLOCK = 128


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


def _trainer(cfg: Config, tp: TrainerPlan, p: Params, s: Shape) -> RoleMemory:
    t = cfg.trainer
    world, ep, cp = tp.world_size, tp.ep, tp.cp
    gpus = tp.gpus_per_node
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
    if world > 1:                            # one FSDP unit per block (the frozen MTP units are not run)
        unit = p.unit(ep)
        ws = unit * (2 * cb + cb + 4) + (unit if t.fp8 else 0)
        terms.append(("FSDP unsharded buffers", ws))
    if gpus:
        terms.append(("CUDA context, NCCL", GPU_RUNTIME))
    ranks = gpus or max(1, world // tp.nodes)
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
    return _role("trainer", gpus, tp.nodes * gpus if gpus else world, terms, cfg, host, hints,
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
    return s.over_layers(lambda x: x.kv_bytes(tp, kvb))


def state_bytes_per_seq(s: Shape, tp: int, wb: int) -> int:
    """The recurrent state of one sequence, all layers, on one GPU of a tensor-parallel group of `tp`,
    constant in its length (Mamba-2: the last conv_kernel-1 conv inputs and the SSM state); 0 for networks
    without recurrent layers."""
    return s.over_layers(lambda x: x.state_bytes(tp, wb))


def _inference(cfg: Config, inf: InferencePlan, p: Params, s: Shape) -> list[RoleMemory]:
    i, o = cfg.inference, cfg.orchestrator
    gpus = inf.gpus_per_node
    qb, wb = _weight_bytes(cfg, gpus)
    pools: dict[str, list] = {}
    for r in inf.replicas:
        pools.setdefault(r.pool, []).append(r)
    serving = len(pools.get("decode", [])) or len(pools.get("mixed", [])) or 1
    concurrency = o.max_concurrency
    max_len = i.max_model_len
    out = []
    for pool, reps in pools.items():
        r = reps[0]
        tp, dp, ep = r.tp, r.dp, r.ep
        split_e = ep if ep > 1 else tp
        experts = p.experts_total / split_e * qb
        dense = p.linear / tp * qb + (2 * p.embed / tp + p.other) * wb
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
        state = state_bytes_per_seq(s, tp, wb)
        if state:
            label, what = next(x.state_label for x in s.layers if x.state_label[0])
            terms.append((f"{label}: {seqs} sequences ({what})", seqs * state))
        batch = 16384 if cfg.cluster.gpu_memory_gib >= 160 else 8192
        # hidden states, the attention's width and the widest other mixer or the experts' intermediates
        hidden = 6 * s.dim + max(x.ws_attn(tp) for x in s.layers) + max(x.ws_mix(tp) for x in s.layers)
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
def _layout(plan: "Plan | dict") -> tuple:
    """(trainer, inference) of `plan` as the estimate reads them. The typed Plan of launch.plan.make_plan;
    or, for a layout no launcher plans (rl.doctor's one-process trainer), a dict holding at least
    trainer {world_size, ep, cp, gpus_per_node, nodes} and inference {gpus_per_node, replicas: [{pool,
    tp, dp, ep}]} (a plan.json as written is one), read with the same names."""
    if isinstance(plan, Plan):
        return plan.trainer, plan.inference
    t, i = plan["trainer"], plan["inference"]
    trainer = SimpleNamespace(**{k: int(t[k]) for k in ("world_size", "ep", "cp", "gpus_per_node", "nodes")})
    replicas = [SimpleNamespace(pool=r["pool"], tp=int(r["tp"]), dp=int(r["dp"]), ep=int(r["ep"]))
                for r in i["replicas"]]
    return trainer, SimpleNamespace(gpus_per_node=int(i["gpus_per_node"]), replicas=replicas)


def estimate(cfg: "Config | dict", plan: "Plan | dict") -> "MemoryReport":
    """Per-role, per-GPU memory of `plan` (launch.plan.make_plan(cfg); see `_layout` for a dict) for the
    composed config `cfg` (read as the typed Config: rl.contract.config.typed)."""
    cfg = typed(cfg)
    s = Shape.from_cfg(cfg.model)
    p = count_params(s)
    trainer, inference = _layout(plan)
    roles = [_trainer(cfg, trainer, p, s), *_inference(cfg, inference, p, s)]
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
