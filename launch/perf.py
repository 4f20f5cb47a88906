"""How fast a plan will run, predicted from the config before anything is submitted: seconds per step by
term and role, the bottleneck, steps per hour, rollouts per hour and the weight-sync time.

Why an analytic model: a job of 28-100 nodes waits in a queue and is paid by the hour, so a plan that is
3x slower than hoped (CPU AdamW over host memory, an all-to-all on the network, a decode pool too small
for the rollouts) should be found on the login node. Every term is a count (FLOPs, bytes) over a rate
(peak FLOP/s times an assumed utilisation, a link's bandwidth), so each can be checked on its own and
the table says which one sets the step. The rates are `cluster.hardware` (presets H100 / H200 below;
docs/perf.md cites their sources and has every formula). The architecture comes from launch.memory's
public `Shape` / `count_params`, the sizes from the typed config; standard library only.

What a run's rollouts look like cannot be read from the config, so it is a stated `Workload` (tokens per
rollout, generated tokens, turns, tool seconds per turn): defaults from the config's limits, overridden
by `launch plan --assume key=value` or taken from a finished run's metrics.jsonl (`Workload.from_metrics`).
The asynchronous design overlaps the trainer, the rollouts and the publish, so a step costs the slowest
of the three; what does not overlap is said per term: the trainer's blocking copy-out, the all-to-alls
it waits for, the CPU optimizer step, the servers' pause while they load a version, and, with
max_off_policy k, the pipeline bound (train + sync + one episode) / (k + 1). launch.simulate refines the
rollout side with the episode distribution (stragglers, the staleness policy). A point from assumed
coefficients is not a number to size a job with: launch.calibrate varies them (`predict`'s `coeffs`) into
a low / mid / high range and calibrates the model on a finished pilot run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from launch import dataplane, rollout_side
from launch.simulate import SimConfig, SimResult, from_metrics, lognormal_source, read_jsonl, simulate
from rl.contract.config import Config, ConfigError, typed

# Per-GPU figures (GB/s, TFLOP/s dense) and per-node ones, sources in docs/perf.md. The filesystem rates
# and the last three are assumptions, not datasheet values: set the site's in cluster.hardware (their
# ranges are launch.calibrate's). checksum_gbps is sha256 as this repository measured it (1.2 GiB/s).
PRESETS = {
    "h100": dict(bf16_tflops=989.4, fp8_tflops=1978.9, hbm_gbps=3350.0, nvlink_gbps=450.0, nic_gbps=50.0,
                 pcie_gbps=50.0, host_mem_gbps=450.0, fs_read_gbps=17.7, fs_write_gbps=8.0, fs_total_gbps=100.0,
                 checksum_gbps=1.29, mfu=0.3, inference_mfu=0.4, hbm_efficiency=0.7),
    "h200": dict(bf16_tflops=989.4, fp8_tflops=1978.9, hbm_gbps=4800.0, nvlink_gbps=450.0, nic_gbps=50.0,
                 pcie_gbps=50.0, host_mem_gbps=450.0, fs_read_gbps=17.7, fs_write_gbps=8.0, fs_total_gbps=100.0,
                 checksum_gbps=1.29, mfu=0.3, inference_mfu=0.4, hbm_efficiency=0.7),
}
G = 1e9
ADAMW_BYTES = 28          # per fp32 parameter: read+write p, m, v (24) and read the gradient (4)
DELTA_FRACTION = 0.011    # a sparse delta version's bytes / a full one's (docs/weight-sync.md: 0.8-1.3%)
EP_LATENCY_S = 20e-6      # one dispatch or combine at decode batch sizes, besides its bytes (assumed)
FP8_BLOCK = 128


@dataclass(frozen=True)
class Hardware:
    gpu: str
    bf16_tflops: float
    fp8_tflops: float
    hbm_gbps: float
    nvlink_gbps: float
    nic_gbps: float
    pcie_gbps: float
    host_mem_gbps: float
    fs_read_gbps: float
    fs_write_gbps: float
    fs_total_gbps: float
    checksum_gbps: float
    mfu: float
    inference_mfu: float
    hbm_efficiency: float

    @classmethod
    def from_cfg(cls, cfg: Config) -> "Hardware":
        h = cfg.cluster.hardware
        if h.gpu not in PRESETS:
            raise ConfigError(f"cluster.hardware.gpu={h.gpu!r}: must be one of {', '.join(PRESETS)}")
        base = PRESETS[h.gpu]
        return cls(gpu=h.gpu, **{k: float(getattr(h, k) if getattr(h, k) is not None else v) for k, v in base.items()})


@dataclass(frozen=True)
class Workload:
    """What one rollout costs: its tokens (prompt, model turns, observations), the generated ones, its
    turns and the environment's seconds per turn (tools, tests, grading)."""
    rollout_tokens: float
    decode_tokens: float
    turns: float
    env_s: float
    source: str = "assumed"

    KEYS = ("rollout_tokens", "decode_tokens", "turns", "env_s")

    @classmethod
    def from_cfg(cls, cfg: Config, assume: dict | None = None) -> "Workload":
        """Defaults: multi-turn rollouts fill half of their token budget (max_rollout_tokens or
        max_model_len), a quarter of it generated, in min(max_turns, 50) turns with 5 s of tools each;
        single-turn ones generate half of max_tokens after a 64-token prompt, graded at once."""
        o, e = cfg.orchestrator, cfg.env
        budget = o.max_rollout_tokens or cfg.inference.max_model_len
        if e.max_turns > 1:
            w = dict(rollout_tokens=0.5 * budget, decode_tokens=0.125 * budget, turns=min(e.max_turns, 50), env_s=5.0)
        else:
            w = dict(rollout_tokens=64 + 0.5 * o.max_tokens, decode_tokens=0.5 * o.max_tokens, turns=1.0,
                     env_s=float(e.digits.latency_median_s))
        src = "assumed"
        for k, v in (assume or {}).items():
            if k not in cls.KEYS:
                raise ConfigError(f"--assume {k}: unknown (known: {', '.join(cls.KEYS)})")
            try:
                w[k] = float(v)
            except ValueError:
                raise ConfigError(f"--assume {k}={v!r}: must be a number") from None
            if w[k] < 0 or (k != "env_s" and w[k] <= 0):
                raise ConfigError(f"--assume {k}={v!r}: must be positive")
            src = "assumed (--assume)"
        if w["decode_tokens"] > w["rollout_tokens"]:
            raise ConfigError(f"--assume decode_tokens={w['decode_tokens']:g}: exceeds rollout_tokens="
                              f"{w['rollout_tokens']:g}")
        return cls(**w, source=src)

    @classmethod
    def from_metrics(cls, path: str | Path) -> "Workload":
        """A finished run's rollouts: the means over metrics.jsonl's lines (orchestrator/... keys)."""
        rows = read_jsonl(path)
        o = [r for r in rows if "orchestrator/completion_len_mean" in r]
        if not o:
            raise ConfigError(f"{path}: no line with orchestrator/completion_len_mean (not a run's metrics.jsonl?)")
        mean = lambda k, d=0.0: sum(r.get(f"orchestrator/{k}", d) for r in o) / len(o)  # noqa: E731
        turns = max(mean("turns_per_episode", 1.0), 1.0)
        dec = mean("completion_len_mean")
        total = mean("episode_tokens_mean", 0.0) or dec + 64
        env_s = mean("turn_env_s") / max(mean("turns_total", 0.0), 1.0) if "orchestrator/turn_env_s" in o[0] else 0.0
        return cls(rollout_tokens=total, decode_tokens=min(dec, total), turns=turns, env_s=env_s,
                   source=f"measured ({path})")


@dataclass
class Term:
    role: str           # trainer | inference | sync
    name: str
    seconds: float
    overlapped: bool    # hidden behind another term of its role (shown, not added)
    hint: str = ""      # what to change when this term sets the step


@dataclass
class Prediction:
    terms: list[Term]
    trainer_s: float
    inference_s: float
    publish_s: float
    pipeline_s: float
    step_s: float
    bottleneck: str
    dominant: Term
    sync_full_s: float
    sync_delta_s: float
    rollouts_per_hour: float
    episode_s: float
    decode_batch: float
    decode_tok_s_gpu: float
    workload: Workload
    hardware: Hardware
    token_s: float = 0.0          # one sequence's seconds per generated token (a decode step)
    prefill_turn_s: float = 0.0   # prefill latency of one turn's new tokens
    sync_s: float = 0.0           # mean version: publish + load (the version's latency to the servers)
    load_s: float = 0.0           # mean version: the servers' pause to read, verify and copy it in
    data: dataplane.DataPlane | None = None   # the rollout batch's bytes and seconds (launch.dataplane)
    rollout: rollout_side.RolloutCPU | None = None   # the rollout side's CPU per step (launch.rollout_side)
    notes: list[str] = field(default_factory=list)

    @property
    def steps_per_hour(self) -> float:
        return 3600.0 / self.step_s

    def term(self, prefix: str) -> float:
        return sum(t.seconds for t in self.terms if t.name.startswith(prefix))

    def warning(self, target: float | None) -> str | None:
        """One line when the step misses cluster.target_step_s, naming the dominant term and a fix."""
        if not target or self.step_s <= target:
            return None
        d = self.dominant
        return (f"predicted step {self.step_s:.1f} s exceeds cluster.target_step_s={target:g} "
                f"(bottleneck {self.bottleneck}; dominant term: {d.role}: {d.name} {d.seconds:.1f} s"
                + (f"; {d.hint})" if d.hint else ")"))


# -- FLOPs ------------------------------------------------------------------------------------------
def attention_flops(s, keys: float, train: bool) -> float:
    """Forward FLOPs of one token beyond its matmuls over the weights, summed over the layers (each row's
    calculators, rl.models.layers): attention over `keys` keys (GLM-5's DSA attends to its top-k keys and
    scores all of them with the indexer; decode with MLA runs absorbed), Mamba-2's chunked scan and conv."""
    return s.over_layers(lambda x: x.flops(keys, train))


def token_flops(s, p, keys: float, train: bool = True) -> float:
    """Forward FLOPs of one token: every active matmul (2 per weight; the embedding is a lookup, the LM
    head a matmul) plus attention at `keys` keys."""
    return 2 * (p.active - p.embed) + attention_flops(s, keys, train)


# -- trainer ----------------------------------------------------------------------------------------
def _trainer(cfg: Config, s, p, hw: Hardware, w: Workload, rollouts: int, a2a_overlap: float = 0.0) -> list[Term]:
    t = cfg.trainer
    gpn = max(t.gpus_per_node, 1)
    world, ep, cp, dp = t.nodes * gpn, t.parallel.ep, t.parallel.cp, t.parallel.dp_shard
    cb = 2 if t.dtype == "bfloat16" else 4
    tokens = rollouts * w.rollout_tokens
    recompute = {"full": 1.0, "selective": 0.5, "none": 0.0}[t.activation_checkpointing]
    fwd = token_flops(s, p, w.rollout_tokens / 2)          # causal: a position sees half its document
    head = 2 * p.embed
    flops = tokens * (3 * fwd + recompute * (fwd - head))
    compute = flops / (world * hw.bf16_tflops * 1e12 * hw.mfu)
    terms = [Term("trainer", f"compute: {flops / 1e15:.0f} PFLOP at mfu {hw.mfu:g}"
                  + (f" (+{recompute:g} forward recomputed)" if recompute else ""), compute, False,
                  "more trainer.nodes, or trainer.activation_checkpointing=selective where memory allows")]
    # micro-batches per data rank: rows of micro_batch_tokens over dp_shard x ep data ranks, cp ranks per row
    mb = max(1, math.ceil(tokens / (max(t.micro_batch_tokens, 1) * dp * ep)))
    inner = dp * cp                                        # the experts' FSDP group (cp innermost)
    bw = lambda n: (hw.nvlink_gbps if n <= gpn else hw.nic_gbps) * G   # noqa: E731
    dense, experts = p.dense, p.experts_total
    gather = 2 * cb * (dense * (world - 1) / world / bw(world) + experts / ep * (inner - 1) / inner / bw(inner))
    scatter = 4 * (dense * (world - 1) / world / bw(world) + experts / ep * (inner - 1) / inner / bw(inner))
    fsdp = mb * (gather + scatter) if world > 1 else 0.0
    shard = (dense + experts) / world
    offload = 0.0
    if t.cpu_offload:     # FSDP2 offload: the fp32 shard up for forward and backward, its gradient down
        per_rank = mb * 12 * shard
        offload = max(per_rank / (hw.pcie_gbps * G), per_rank * gpn / (hw.host_mem_gbps * G))
    hidden = fsdp + offload
    terms.append(Term("trainer", f"FSDP all-gather + reduce-scatter, {mb} micro-batch(es)", fsdp, True,
                      "fewer micro-batches (larger trainer.micro_batch_tokens) or a larger trainer.parallel.ep"))
    if t.cpu_offload:
        terms.append(Term("trainer", "CPU offload: shards host<->GPU (PCIe, host memory)", offload, True,
                          "trainer.cpu_offload=false with more trainer.nodes"))
    exposed = max(0.0, hidden - compute)
    terms.append(Term("trainer", "communication not hidden by compute", exposed, False,
                      "more trainer.nodes or trainer.cpu_offload=false"))
    passes = 4 + 2 * recompute
    local = tokens / (dp * ep * cp)                        # tokens one rank runs per step
    if ep > 1 and s.moe_layers:
        a2a = passes * s.moe_layers * local * s.top_k * s.dim * cb * (ep - 1) / ep / bw(ep * cp)
        a2a *= 1.0 - a2a_overlap            # the share hidden behind expert compute (0: none, the default)
        terms.append(Term("trainer", f"EP all-to-all, {s.moe_layers} MoE layers"
                          + (f" ({1 - a2a_overlap:.0%} exposed)" if a2a_overlap else ""), a2a, False,
                          "a smaller trainer.parallel.ep (all-to-all over the NICs)"))
    if cp > 1:                 # what each layer all-gathers (attention K/V, Mamba's projections)
        per_tok = s.over_layers(lambda x: x.cp_elems())
        cpx = (2 + recompute) * local * (cp - 1) * per_tok * cb / bw(cp)
        terms.append(Term("trainer", "CP exchange (K/V all-gather)", cpx, False, "a smaller trainer.parallel.cp"))
    if t.cpu_offload:
        adam = gpn * shard * ADAMW_BYTES / (hw.host_mem_gbps * G)
        terms.append(Term("trainer", "AdamW on the CPU (host memory bandwidth)", adam, False,
                          "more trainer.nodes (less state per node) or trainer.cpu_offload=false"))
    else:
        terms.append(Term("trainer", "AdamW on the GPU", shard * ADAMW_BYTES / (hw.hbm_gbps * G), False))
    fp8_rank = _fp8_bytes(p, s)[0] / world
    copy = fp8_rank / (hw.host_mem_gbps * G / gpn if t.cpu_offload else hw.pcie_gbps * G)
    terms.append(Term("trainer", "weight copy-out for the publish (blocking)", copy, False))
    return terms


# -- inference --------------------------------------------------------------------------------------
def _fp8_bytes(p, s) -> tuple[float, float, float]:
    """(whole version, its routed experts, everything but routed experts) as published: FP8 linears with
    an fp32 scale per 128x128 block, bf16 embeddings, LM head, routers, norms and Mamba parameters."""
    q = 1 + 4 / FP8_BLOCK ** 2
    experts = p.experts_total * q
    rest = p.linear * q + 2 * (2 * p.embed + p.other)
    return experts + rest, experts, rest


def kv_read_bytes(s, ctx: float, tp: int) -> float:
    """Cache bytes one decode step reads for one sequence at context `ctx` (bf16 KV), on one GPU: each
    layer's KV (its top-k keys under DSA, plus the indexer's keys), a Mamba layer's conv and SSM state,
    read and written."""
    return s.over_layers(lambda x: x.kv_read(ctx, tp))


def decode_step_s(cfg: Config, s, p, hw: Hardware, b: float, ctx: float) -> float:
    """Seconds of one decode step on a GPU holding `b` running sequences: the bytes it reads (its dense
    weights, its experts at the replica's coverage, the KV cache) over HBM, or its FLOPs if more, plus
    the expert-parallel dispatch and combine of every MoE layer (not overlapped)."""
    i = cfg.inference
    tp, dp, ep = i.tp, i.dp, i.ep
    gpn = max(i.gpus_per_node, 1)
    _, experts, rest = _fp8_bytes(p, s)
    n = max(s.num_experts, 1)
    batch = b * dp if ep > 1 else b                        # tokens the replica routes per step
    cover = 1 - (1 - s.top_k / n) ** max(batch, 0.0)       # share of this GPU's experts some token hits
    weights = rest / tp + experts / (ep if ep > 1 else tp) * cover
    mem = (weights + b * kv_read_bytes(s, ctx, tp)) / (hw.hbm_gbps * G * hw.hbm_efficiency)
    comp = b * token_flops(s, p, ctx, train=False) / tp / (hw.fp8_tflops * 1e12 * hw.inference_mfu)
    a2a = 0.0
    if ep > 1 and s.moe_layers:
        link = (hw.nvlink_gbps if tp * dp <= gpn else hw.nic_gbps) * G
        a2a = s.moe_layers * (2 * EP_LATENCY_S + b * s.top_k * s.dim * 3 / link)   # fp8 out, bf16 back
    return max(mem, comp) + a2a


def _inference(cfg: Config, s, p, hw: Hardware, w: Workload, rollouts: int, pause: float) -> tuple[list[Term], dict]:
    i, o = cfg.inference, cfg.orchestrator
    gpn = max(i.gpus_per_node, 1)
    pd = i.prefill_nodes > 0 and i.decode_nodes > 0
    dec_gpus = (i.decode_nodes if pd else i.nodes) * gpn
    pre_gpus = i.prefill_nodes * gpn if pd else dec_gpus
    inflight = min(o.max_inflight or o.prompts_per_step * o.group_size * (o.max_off_policy + 1),
                   (o.max_off_policy + 1) * o.prompts_per_step * o.group_size)
    ctx = w.rollout_tokens / 2                             # mean context while the rollout generates
    prefill_tok = max(w.rollout_tokens - w.decode_tokens, 0.0)
    pre_flops = token_flops(s, p, ctx, train=True)         # prefill attends like training (not absorbed)
    pre_rate = pre_gpus * hw.fp8_tflops * 1e12 * hw.inference_mfu / pre_flops   # tokens/s of the pool
    pre_lat = prefill_tok / w.turns * pre_flops / (i.tp * hw.fp8_tflops * 1e12 * hw.inference_mfu)
    b, step = 1.0, decode_step_s(cfg, s, p, hw, 1.0, ctx)
    for _ in range(100):      # Little's law: sequences decoding = in flight x decoding share of the episode
        episode = w.turns * (w.env_s + pre_lat) + w.decode_tokens * step
        gen = min(inflight * w.decode_tokens * step / episode, o.max_concurrency)
        nb = max(gen * i.tp / dec_gpus, 1e-3)
        b = 0.5 * b + 0.5 * nb
        step = decode_step_s(cfg, s, p, hw, b, ctx)
    episode = w.turns * (w.env_s + pre_lat) + w.decode_tokens * step
    rate = min(inflight / episode, o.max_concurrency / max(w.decode_tokens * step, 1e-12))   # rollouts/s
    calls = rollout_side.env_calls_at_once(cfg)   # min(env_concurrency, threads) per process x processes
    env_rate = calls / (w.turns * w.env_s) if w.env_s > 0 else float("inf")   # env slots' bound
    gen_s = rollouts / rate
    env_bound = rollouts / env_rate
    pre_s = rollouts * prefill_tok / pre_rate
    terms = [Term("inference", f"rollouts: {rollouts} x {w.rollout_tokens:.0f} tokens ({w.decode_tokens:.0f} "
                               f"generated), {inflight} in flight, {episode:.0f} s each", gen_s, pd,
                  "more inference.decode_nodes, a higher orchestrator.max_concurrency or max_inflight"),
             Term("inference", f"prefill: {rollouts * prefill_tok / 1e6:.1f}M tokens on {pre_gpus} GPUs", pre_s, pd,
                  "more inference.prefill_nodes")]
    if w.env_s > 0:
        terms.append(Term("inference", f"environment: {rollouts * w.turns:.0f} calls of {w.env_s:g} s, {calls} at "
                                       f"once (orchestrator.env_concurrency={o.env_concurrency} per process, "
                                       f"{rollout_side.env_threads(cfg)} threads, x {rollout_side.processes(cfg)} "
                                       f"process(es))", env_bound, True,
                          f"a higher orchestrator.env_concurrency or more orchestrator.rollout_workers (>= "
                          f"{math.ceil(rate * w.turns * w.env_s)} calls at once keep up with the servers)"))
    total = max(gen_s, pre_s) if pd else gen_s + pre_s
    total = max(total, env_bound)
    terms.append(Term("inference", "reload pause (read, verify, copy in)", pause, False,
                      "trainer.weights_full_every > 1 (deltas) or a faster shared filesystem"))
    return terms, dict(total=total + pause, episode=episode, b=b, tok_s=b / step / i.tp,
                       per_hour=min(rate, env_rate) * 3600,
                       token_s=step, prefill_turn_s=pre_lat)


# -- weight sync ------------------------------------------------------------------------------------
def sync_times(cfg: Config, s, p, hw: Hardware, version_bytes: float | None = None, delta: bool = False) -> dict:
    """Publish (trainer ranks write and hash their share) and load (each inference node reads, hashes and
    copies in what its GPUs serve) of one version of `version_bytes` (default: a full one). A delta
    version (`delta`) writes and loads its own bytes, but its publish rebuilds every FP8 tensor, compares
    it with the kept previous one and hashes it whole (rl/exchange/deltas.py): benchmarks/weight_sync.py
    measured a delta publish at 1.81x a full one, so it is charged the full hash plus that comparison."""
    t, i = cfg.trainer, cfg.inference
    full, experts, rest = _fp8_bytes(p, s)
    frac = (version_bytes if version_bytes is not None else full) / full
    tn, tg = t.nodes, max(t.gpus_per_node, 1)
    inn, ig = i.nodes, max(i.gpus_per_node, 1)
    out = full * frac
    write = max(out / tn / (hw.fs_write_gbps * G), out / (hw.fs_total_gbps * G))
    hash_w = out / (tn * tg) / (hw.checksum_gbps * G)
    if delta:   # every rebuilt tensor hashed, and compared with the previous one (two reads over host memory)
        hash_w = full / (tn * tg) / (hw.checksum_gbps * G) + 2 * full / tn / (hw.host_mem_gbps * G)
    node = (experts * min(1.0, ig / i.ep) if i.ep > 1 else experts) + rest    # the union its GPUs serve
    node *= frac
    read = max(node / (hw.fs_read_gbps * G), node * inn / (hw.fs_total_gbps * G))
    hash_r = node / ig / (hw.checksum_gbps * G)
    gpu = (experts / (i.ep if i.ep > 1 else i.tp) + rest / i.tp) * frac
    h2d = gpu / (hw.pcie_gbps * G)
    return dict(write=write, hash_w=hash_w, read=read, hash_r=hash_r, h2d=h2d, publish=write + hash_w,
                load=read + hash_r + h2d, total=write + hash_w + read + hash_r + h2d, bytes=out, node_bytes=node)


# The coefficients launch.calibrate varies, at their assumed values (`predict`'s `coeffs` overrides them).
COEFFS = dict(mfu=None, a2a_overlap=0.0, fs_scale=1.0)


def predict(cfg, workload: Workload | None = None, assume: dict | None = None,
            coeffs: dict | None = None) -> Prediction:
    """The step-time prediction of the composed config `cfg` (dict, DictConfig or Config). `coeffs`:
    mfu (the trainer's), a2a_overlap (the share of the EP all-to-all hidden), fs_scale (every shared
    filesystem rate times this); the assumed values where left out."""
    import dataclasses

    from launch import memory
    cfg = typed(cfg)
    hw = Hardware.from_cfg(cfg)
    co = {**COEFFS, **(coeffs or {})}
    if co["mfu"] is not None or co["fs_scale"] != 1.0:
        f = co["fs_scale"]
        hw = dataclasses.replace(hw, mfu=co["mfu"] or hw.mfu, fs_read_gbps=hw.fs_read_gbps * f,
                                 fs_write_gbps=hw.fs_write_gbps * f, fs_total_gbps=hw.fs_total_gbps * f)
    w = workload or Workload.from_cfg(cfg, assume)
    s = memory.Shape.from_cfg(cfg.model)
    p = memory.count_params(s)
    o = cfg.orchestrator
    rollouts = o.prompts_per_step * o.group_size
    full = sync_times(cfg, s, p, hw)
    k_full = cfg.trainer.weights_full_every
    delta = sync_times(cfg, s, p, hw, _fp8_bytes(p, s)[0] * DELTA_FRACTION, delta=True)
    share = 0.0 if k_full <= 1 else 1 - 1 / k_full          # of the versions, deltas
    mean = {k: (1 - share) * full[k] + share * delta[k] for k in full}
    terms = _trainer(cfg, s, p, hw, w, rollouts, co["a2a_overlap"])
    inf_terms, inf = _inference(cfg, s, p, hw, w, rollouts, mean["load"])
    terms += inf_terms
    terms += [Term("sync", f"publish: write {mean['bytes'] / G:.0f} GB (mean version) + sha256 per rank",
                   mean["publish"], True, "trainer.weights_full_every > 1 or a faster shared filesystem"),
              Term("sync", f"load per inference node: read {mean['node_bytes'] / G:.1f} GB + sha256 + copy in",
                   mean["load"], True, "a faster shared filesystem")]
    train_s = sum(t.seconds for t in terms if t.role == "trainer" and not t.overlapped)
    k = o.max_off_policy
    pipeline = (train_s + mean["total"] + inf["episode"]) / (k + 1)
    parts = {"trainer": train_s, "inference": inf["total"], "sync": mean["publish"], "pipeline": pipeline}
    data = dataplane.predict(dataplane.Volume.from_cfg(cfg, w),   # its warnings print as perf notes
                             fs=dataplane.SharedFS.from_hardware(hw, cfg.trainer.gpus_per_node))
    roll = rollout_side.cpu(cfg, w, data, max(parts.values()))
    terms += [Term("rollout", name, sec, True, hint) for name, sec, hint in rollout_side.terms(roll)]
    if cfg.inference.gpus_per_node > 0:   # a process cannot do more than a core's worth per step (CPU
        parts["rollout"] = roll.bound_s   # servers' steps are not modelled: shown, not compared)
    bottleneck = max(parts, key=parts.get)
    step = parts[bottleneck]
    role = {"pipeline": "trainer"}.get(bottleneck, bottleneck)
    dominant = max((t for t in terms if t.role == role and not (t.overlapped and role == "trainer")),
                   key=lambda t: t.seconds)
    if bottleneck == "pipeline":
        dominant = Term("pipeline", f"train + sync + one episode over max_off_policy+1={k + 1}", pipeline, False,
                        "a larger orchestrator.max_off_policy")
    notes = [f"workload ({w.source}): {w.rollout_tokens:.0f} tokens per rollout, {w.decode_tokens:.0f} generated, "
             f"{w.turns:g} turns, {w.env_s:g} s of environment per turn",
             f"hardware: {hw.gpu} presets (docs/perf.md), mfu {hw.mfu:g}, inference mfu {hw.inference_mfu:g}, "
             f"HBM efficiency {hw.hbm_efficiency:g}"]
    notes += [f"warning: {x}" for x in dataplane.warnings(data, cfg.cluster.target_step_s, step)]
    notes += rollout_side.lines(cfg, roll, w.env_s, inf["episode"])
    return Prediction(terms=terms, trainer_s=train_s, inference_s=inf["total"], publish_s=mean["publish"],
                      pipeline_s=pipeline, step_s=step, bottleneck=bottleneck, dominant=dominant,
                      sync_full_s=full["total"], sync_delta_s=delta["total"], rollouts_per_hour=inf["per_hour"],
                      episode_s=inf["episode"], decode_batch=inf["b"], decode_tok_s_gpu=inf["tok_s"], workload=w,
                      hardware=hw, token_s=inf["token_s"], prefill_turn_s=inf["prefill_turn_s"],
                      sync_s=mean["total"], load_s=mean["load"], notes=notes, data=data, rollout=roll)


def data_volume(cfg, assume: dict | None = None) -> dataplane.Volume:
    """The data-plane volume of `cfg` under the workload `predict` assumes (`--assume` overrides)."""
    return dataplane.Volume.from_cfg(cfg, Workload.from_cfg(typed(cfg), assume))


def table_rows(pred: Prediction) -> list[tuple[str, str, str]]:
    """Header, the terms (overlapped ones in parentheses: shown, not added), the summary rows, then the
    rollout data plane's (launch.dataplane)."""
    rows = [("role", "term", "s per step")]
    for t in pred.terms:
        rows.append((t.role, t.name, f"({t.seconds:.2f})" if t.overlapped else f"{t.seconds:.2f}"))
    rows += [("trainer", "total (not overlapped terms)", f"{pred.trainer_s:.1f}"),
             ("inference", "total", f"{pred.inference_s:.1f}"),
             ("pipeline", "(train + sync + episode) / (max_off_policy + 1)", f"{pred.pipeline_s:.1f}"),
             ("step", f"bottleneck: {pred.bottleneck} ({pred.dominant.name})", f"{pred.step_s:.1f}"),
             ("", "steps per hour", f"{pred.steps_per_hour:.1f}"),
             ("", "rollouts per hour (inference capacity)", f"{pred.rollouts_per_hour:.0f}"),
             ("", f"decode: {pred.decode_batch:.1f} sequences per GPU, tokens/s per GPU", f"{pred.decode_tok_s_gpu:.0f}"),
             ("sync", "weight sync, full version (publish + load)", f"{pred.sync_full_s:.1f}"),
             ("sync", f"weight sync, delta version ({DELTA_FRACTION:.1%} of the bytes; publish hashes all)", f"{pred.sync_delta_s:.1f}")]
    return rows + (dataplane.table_rows(pred.data) if pred.data else [])


@dataclass
class PlanSimulation:
    result: SimResult
    steps: int
    source: str


def simulate_plan(cfg, pred, metrics: str | None = None, steps: int = 20, seed: int = 0) -> PlanSimulation:
    """`launch plan --simulate`: the pipeline of config `cfg` with launch.perf's component times (`pred`:
    trainer seconds per step, seconds per generated token at the predicted decode batch, a version's
    publish + load and the servers' pause). Episodes: a finished run's (`metrics`) or the workload's
    turns, each its share of the generated tokens and a lognormal tool call (sigma 1) around env_s."""
    c = typed(cfg)
    o = c.orchestrator
    sim = SimConfig.from_config(c, train_s=pred.trainer_s, token_s=pred.token_s,
                                sync_s=max(pred.sync_s - pred.load_s, 0.0) + pred.load_s,
                                reload_pause_s=pred.load_s)
    sim.steps = max(2, min(c.trainer.max_steps, steps))
    w = pred.workload
    if metrics:
        source, train_s = from_metrics(metrics, o.group_size, pred.token_s, seed)
        sim.train_s = train_s or pred.trainer_s
        what = f"episodes and trainer step from {metrics}"
    else:
        turns = max(1, round(w.turns))
        source = lognormal_source(o.group_size, turns_median=turns, turns_sigma=0.0,
                                  tokens_per_turn=max(1, int(w.decode_tokens / turns)),
                                  env_median_s=w.env_s + pred.prefill_turn_s, env_sigma=1.0 if w.env_s else 0.0,
                                  seed=seed)
        what = f"{turns} turns of {w.decode_tokens / turns:.0f} tokens, tools lognormal median {w.env_s:g} s sigma 1"
    return PlanSimulation(simulate(sim, source), sim.steps, what)
