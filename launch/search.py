"""`launch plan --search`: the node split and trainer layout that meet the step time, for a fixed total of nodes.

What is searched. The config's total of nodes (trainer.nodes + inference.nodes, gpus_per_node fixed) is
split between the trainer and the inference pools (prefill and decode when the config disaggregates,
one mixed pool otherwise); the trainer's parallel layout (dp_shard x ep x cp = its GPUs, ep dividing
the experts, 2*cp dividing max_seq_len, powers of two) and the inference replicas' size (tp x dp GPUs,
wide EP as the config has it; every replica of both pools the same size, as launch.plan requires) are
searched with it, and each layout gets the rollout worker count it needs (`orchestrator.rollout_workers`:
the fewest whose busiest process stays under launch.rollout_side.ROLLOUT_SHARE of the step, in counts
that deal the groups in flight evenly; 0 when one process does). Everything else (the model, the
workload, max_concurrency, max_inflight, offloading) stays as configured: the search answers "how
should these nodes be laid out", not "what should the run do".

How a layout is judged: by the same models `launch plan` prints, nothing of its own. Memory per GPU and
per node is launch.memory's estimate (a layout whose role does not fit is ruled out by the same check
that makes `launch plan` refuse it, and the reason is that check's one line); the step time is
launch.perf's prediction (its bottleneck and dominant term are printed). The best few are then planned
for real (launch.plan.make_plan), so a layout printed here is one `launch plan` accepts.

Why it is fast. The full product (28 nodes: ~25 splits x ~30 trainer layouts x ~100 inference layouts)
is ~10^5 predictions; but the trainer's terms and memory depend on the trainer layout alone and the
inference's on the inference layout alone. So each trainer layout is judged once per trainer node count,
each inference layout once per inference node count, and only the best few of each side are combined
for the full prediction (the pipeline and weight-sync terms need both). Each judgement is a millisecond
on the typed config (no re-validation), so a 28-node search takes about a second.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

from rl.contract.config import ConfigError, PlanError, typed

TOP_EACH_SIDE = 3     # trainer layouts and inference layouts per node count that go on to the full prediction


@dataclass(frozen=True)
class Layout:
    trainer_nodes: int
    dp_shard: int
    ep: int
    cp: int
    prefill_nodes: int       # 0: one mixed pool
    decode_nodes: int
    replica_gpus: int        # tp x dp of every replica
    rollout_workers: int = 0  # orchestrator.rollout_workers

    @property
    def inference_nodes(self) -> int:
        return self.prefill_nodes + self.decode_nodes

    def overrides(self, tp: int, wide_ep: bool, gpn: int) -> list[str]:
        """The Hydra overrides that give a config this layout."""
        dp = self.replica_gpus // tp
        out = [f"trainer.nodes={self.trainer_nodes}", f"trainer.parallel.dp_shard={self.dp_shard}",
               f"trainer.parallel.ep={self.ep}", f"trainer.parallel.cp={self.cp}",
               f"inference.nodes={self.inference_nodes}", f"inference.dp={dp}",
               f"inference.ep={self.replica_gpus if wide_ep else 1}",
               f"inference.replicas={self.inference_nodes * gpn // self.replica_gpus}",
               f"orchestrator.rollout_workers={self.rollout_workers}"]
        if self.prefill_nodes:
            out += [f"inference.prefill_nodes={self.prefill_nodes}", f"inference.decode_nodes={self.decode_nodes}"]
        return out


@dataclass
class Found:
    layout: Layout
    step_s: float
    trainer_s: float
    inference_s: float
    bottleneck: str
    dominant: str
    rollout_s: float = 0.0   # CPU per step of the busiest rollout-side process


@dataclass
class Result:
    total_nodes: int
    gpus_per_node: int
    considered: int = 0
    fitting: list[Found] = field(default_factory=list)           # ranked, fastest first
    ruled_out: dict[str, list] = field(default_factory=dict)     # reason -> [count, one example]
    target: float | None = None

    def rule_out(self, reason: str, example: str) -> None:
        e = self.ruled_out.setdefault(reason, [0, example])
        e[0] += 1


def _pow2(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def _with_trainer(c, nodes: int, dp: int, ep: int, cp: int):
    t = c.trainer
    return dataclasses.replace(c, trainer=dataclasses.replace(
        t, nodes=nodes, parallel=dataclasses.replace(t.parallel, dp_shard=dp, ep=ep, cp=cp)))


def _with_inference(c, pre: int, dec: int, nodes: int, size: int):
    i = c.inference
    return dataclasses.replace(c, inference=dataclasses.replace(
        i, nodes=nodes, prefill_nodes=pre, decode_nodes=dec, dp=size // i.tp, ep=size if i.ep > 1 else 1,
        replicas=nodes * i.gpus_per_node // size))


def _memory_layout(c) -> dict:
    """The plan layout launch.memory reads (its dict form), for the typed config `c`."""
    t, i = c.trainer, c.inference
    size, gpn = i.tp * i.dp, i.gpus_per_node
    pools = [("prefill", i.prefill_nodes), ("decode", i.decode_nodes)] if i.prefill_nodes else [("mixed", i.nodes)]
    reps = [dict(pool=pool, tp=i.tp, dp=i.dp, ep=i.ep) for pool, n in pools for _ in range(n * gpn // size)]
    return {"trainer": dict(world_size=t.nodes * t.gpus_per_node, ep=t.parallel.ep, cp=t.parallel.cp,
                            gpus_per_node=t.gpus_per_node, nodes=t.nodes),
            "inference": {"gpus_per_node": gpn, "replicas": reps}}


def _with_workers(c, workers: int):
    return dataclasses.replace(c, orchestrator=dataclasses.replace(c.orchestrator, rollout_workers=workers))


def _misfit(c, roles: str) -> str | None:
    """launch.memory's refusal (one line) for the roles starting with `roles` of config `c`, or None."""
    from launch import memory
    rep = memory.estimate(c, _memory_layout(c))
    rep = dataclasses.replace(rep, roles=[r for r in rep.roles if r.role.startswith(roles)])
    try:
        memory.check(rep)
    except PlanError as e:
        return str(e)
    return None


def _reason(msg: str) -> str:
    """A refusal's category: its role and largest term, without the numbers."""
    role = msg.split(":", 1)[0]
    term = msg.split("largest term: ", 1)[1].split(" ", 1)[0] if "largest term: " in msg else "total"
    return f"{role} memory ({term} ...)" if "exceeds" in msg else role


def search(cfg, workload=None, top: int = 5, assume: dict | None = None) -> Result:
    """Rank the layouts of `cfg`'s total nodes (the module docstring) under `workload` (default: the
    config's, with `assume` as `launch plan --assume` gives it)."""
    from launch import memory, perf
    base = typed(cfg)
    t0, i0 = base.trainer, base.inference
    gpn_t, gpn = t0.gpus_per_node, i0.gpus_per_node
    if gpn_t <= 0 or gpn <= 0 or gpn_t != gpn:
        raise ConfigError("launch plan --search: trainer and inference need GPU nodes of the same size "
                          f"(trainer.gpus_per_node={gpn_t}, inference.gpus_per_node={gpn})")
    total = t0.nodes + i0.nodes
    pd = i0.prefill_nodes > 0
    res = Result(total_nodes=total, gpus_per_node=gpn, target=base.cluster.target_step_s)
    w = workload or perf.Workload.from_cfg(base, assume)
    experts = memory.Shape.from_cfg(base.model).num_experts or 1
    seq = base.model.max_seq_len
    min_inf = 2 if pd else 1

    trainer_best: dict[int, list] = {}
    for tn in range(1, total - min_inf + 1):
        world, fits = tn * gpn, []
        for ep in _pow2(min(world, experts)):
            if experts % ep:
                continue
            for cp in _pow2(world // ep):
                if cp > 1 and seq % (2 * cp):
                    continue
                if world % (ep * cp):
                    continue
                res.considered += 1
                c = _with_trainer(base, tn, world // (ep * cp), ep, cp)
                if why := _misfit(c, "trainer"):
                    res.rule_out(_reason(why), f"trainer {tn} nodes {world // (ep * cp)}x{ep}x{cp}: {why}")
                    continue
                fits.append((perf.predict(c, w).trainer_s, tn, world // (ep * cp), ep, cp))
        trainer_best[tn] = sorted(fits)[:TOP_EACH_SIDE]

    inference_best: dict[int, list] = {}
    for inn in range(min_inf, total):
        fits = []
        for size in _pow2(inn * gpn):
            if size % i0.tp or (size > gpn and size % gpn) or (size < gpn and gpn % size) or \
                    (i0.ep > 1 and experts % size):
                continue
            for pre in (range(1, inn) if pd else [0]):
                dec = inn - pre if pd else 0
                if any(n * gpn % size for n in ((pre, dec) if pd else (inn,))):
                    res.rule_out("replica size does not split a pool", f"{pre} prefill + {dec} decode nodes, "
                                 f"replicas of {size} GPUs")
                    continue
                res.considered += 1
                c = _with_inference(base, pre, dec, inn, size)
                if why := _misfit(c, "inference"):
                    res.rule_out(_reason(why), f"inference {pre}+{dec} nodes, replicas of {size}: {why}")
                    continue
                fits.append((perf.predict(c, w).inference_s, pre, dec, size))
        inference_best[inn] = sorted(fits)[:TOP_EACH_SIDE]
    for side, best in (("trainer", trainer_best), ("inference", inference_best)):
        if none := [n for n, fits in best.items() if not fits]:   # the node counts a whole side rules out
            res.ruled_out[f"no {side} layout fits memory"] = [len(none), f"{side} nodes {_ranges(none)}"]

    found = []
    for tn, tl in trainer_best.items():
        for _, _, dp, ep, cp in tl:
            for _, pre, dec, size in inference_best.get(total - tn, []):
                c = _with_inference(_with_trainer(base, tn, dp, ep, cp), pre, dec, total - tn, size)
                p = perf.predict(c, w)
                if p.rollout.needed != c.orchestrator.rollout_workers:   # the count this layout needs
                    c = _with_workers(c, p.rollout.needed)
                    p = perf.predict(c, w)
                d = p.dominant
                found.append(Found(Layout(tn, dp, ep, cp, pre, dec, size, c.orchestrator.rollout_workers), p.step_s,
                                   p.trainer_s, p.inference_s, p.bottleneck, f"{d.role}: {d.name}",
                                   p.rollout.bound_s))
    found.sort(key=lambda f: (f.step_s, f.layout.trainer_nodes))
    # the best are planned for real: what is printed is what `launch plan` accepts
    from launch.plan import make_plan
    for f in found:
        if len(res.fitting) >= top:
            break
        c = copy.deepcopy(cfg if isinstance(cfg, dict) else dataclasses.asdict(base))
        _apply(c, f.layout, i0.tp, i0.ep > 1, gpn)
        try:
            make_plan(c)
        except (ConfigError, PlanError) as e:
            res.rule_out("launch plan refuses it", f"{f.layout}: {e}")
            continue
        res.fitting.append(f)
    slower = len(found) - len(res.fitting) - sum(1 for _ in res.ruled_out.get("launch plan refuses it", [[]])[1:])
    if slower > 0:
        res.ruled_out["fits, but slower than those shown"] = [slower, f"{len(found)} combined layouts predicted"]
    return res


def _ranges(xs: list[int]) -> str:
    """[1, 2, 3, 5] -> '1-3, 5'."""
    out, start = [], None
    for k, x in enumerate(xs):
        if start is None:
            start = x
        if k + 1 == len(xs) or xs[k + 1] != x + 1:
            out.append(f"{start}-{x}" if x != start else str(x))
            start = None
    return ", ".join(out)


def _apply(c: dict, lay: Layout, tp: int, wide_ep: bool, gpn: int) -> None:
    for o in lay.overrides(tp, wide_ep, gpn):
        key, value = o.split("=", 1)
        *path, last = key.split(".")
        d = c
        for k in path:
            d = d[k]
        d[last] = int(value)
    if not lay.prefill_nodes:
        c["inference"]["prefill_nodes"] = c["inference"]["decode_nodes"] = 0


def render(res: Result, tp: int = 1, wide_ep: bool = True) -> list[str]:
    """The ranked layouts, then why the others were not."""
    lines = [f"search: {res.total_nodes} nodes of {res.gpus_per_node} GPUs split between trainer and inference; "
             f"{res.considered} layouts judged (launch.memory, launch.perf)"]
    if not res.fitting:
        lines.append("search: no layout fits memory")
    for k, f in enumerate(res.fitting, 1):
        lay = f.layout
        inf = (f"{lay.prefill_nodes} prefill + {lay.decode_nodes} decode" if lay.prefill_nodes
               else f"{lay.inference_nodes} inference") + f" nodes (replicas of {lay.replica_gpus} GPUs)"
        miss = "" if not res.target or f.step_s <= res.target else f", misses target {res.target:g} s"
        lines.append(f"  {k}. {f.step_s:6.1f} s/step  trainer {lay.trainer_nodes} nodes "
                     f"dp_shard {lay.dp_shard} x ep {lay.ep} x cp {lay.cp}, {inf}; trainer {f.trainer_s:.0f} s, "
                     f"inference {f.inference_s:.0f} s, {lay.rollout_workers} rollout workers (busiest process "
                     f"{f.rollout_s:.0f} s of CPU); bottleneck {f.bottleneck} ({f.dominant}){miss}")
        lines.append(f"     overrides: {' '.join(lay.overrides(tp, wide_ep, res.gpus_per_node))}")
    lines.append("ruled out:")
    for reason, (n, example) in sorted(res.ruled_out.items(), key=lambda kv: -kv[1][0]):
        if n:
            lines.append(f"  {n:5d} x {reason}; e.g. {example}")
    return lines
