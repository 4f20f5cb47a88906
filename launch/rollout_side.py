"""The rollout side of a plan: CPU per step of the processes that drive the episodes, the environment
calls that really run at once, and the sandbox nodes (docs/perf.md "Rollout side", docs/sandboxes.md
"Sizing sandbox nodes"). Standard library only: launch.perf and launch.plan read it.

Why: the GPUs' terms say nothing about the Python processes between them. One orchestrator process
needed ~300 s of CPU per glm5_seed step (issue 50, benchmarks/seed_rehearsal.py), the whole step, and
its environment calls ran 32 at a time whatever `orchestrator.env_concurrency` said. Here each part of
that CPU is scaled by what it grows with (requests, generated tokens, context tokens sent, route bytes,
the batch) from coefficients measured once (below), split between the per-episode work that rollout
workers (`orchestrator.rollout_workers`) share and the centre's (the pool, the batch); the busiest
process is compared with the step, and the worker count that keeps it under `ROLLOUT_SHARE` of the step
is what `launch plan --search` picks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from rl.contract.config import ConfigError

# -- coefficients: CPU seconds on one core, in one place --------------------------------------------
# Source: issue 50's measurement on main 6fbb449 (benchmarks/seed_rehearsal.py at its default size: 64
# rollouts x 16k tokens in 20 turns, 128 in flight, 2 shared cores at load 6-16, a sampling profiler
# attached to the orchestrator): 17.9 s of CPU per batch = 14 ms per request = 74 us per generated
# token, split by the profile's shares of it:
REQUEST_S = 0.50 * 14e-3          # HTTP client stack and asyncio 32%, tokenizer and chat template 11%,
#                                   multi-turn driver and route spill 7%: per request (one model turn)
GEN_TOKEN_S = 0.09 * 74e-6        # answer JSON 9%: per generated token
CONTEXT_TOKEN_S = 0.08 * 14e-3 / 8192   # whole-context request JSON 8%: per context token sent (a request
#                                   carries the episode's context, 8192 tokens on average there)
POOL_ROLLOUT_S = 0.003 * 17.9 / 64      # pool and group log 0.3%: per rollout, at the centre
# Route base64 decode (16%) is launch.dataplane's `decode` term (bytes over its measured rate), per
# episode; batch build + sha256 + shard writes (16.5%) are its `build`, `hash` and `write` terms, at the
# centre. Checked: these terms give 17.5 s for the rehearsal's batch (measured 17.9 s). With rollout
# workers the routes' share of those bytes is written and hashed by the workers (rl/orchestrator/parts.py:
# each sample's rows once, as a part file the batch takes by a rename) and the centre builds, hashes and
# writes the rest (13 B a token).
ROLLOUT_SHARE = 0.10   # a rollout process above this share of the step: warned, and the search's bound
ENV_THREADS_MAX = 1024  # rl.envs.base.ENV_THREADS_MAX: environment threads per process (its comment: why)
SERVICE_THREADS = 512   # rl.envs.swe.service.MAX_THREADS: commands one sandbox service runs at once


def check(cfg) -> None:
    o, cl = cfg.orchestrator, cfg.cluster
    for key, v, ok in (("orchestrator.rollout_workers", o.rollout_workers, o.rollout_workers >= 0),
                       ("cluster.sandbox_node_cores", cl.sandbox_node_cores, cl.sandbox_node_cores >= 1),
                       ("cluster.sandbox_node_memory_gib", cl.sandbox_node_memory_gib,
                        cl.sandbox_node_memory_gib > 0),
                       ("env.swe.sandbox_cores", cfg.env.swe.sandbox_cores, cfg.env.swe.sandbox_cores > 0)):
        if not ok:
            raise ConfigError(f"{key}={v!r}: must be {'>= 0' if key.endswith('workers') else 'positive'}")


def inflight(cfg) -> int:
    """Rollouts in flight: launch.perf's rule (max_inflight, at most (max_off_policy + 1) batches)."""
    o = cfg.orchestrator
    cap = (o.max_off_policy + 1) * o.prompts_per_step * o.group_size
    return min(o.max_inflight or cap, cap)


def groups_inflight(cfg) -> int:
    return math.ceil(inflight(cfg) / max(cfg.orchestrator.group_size, 1))


def eval_episodes(cfg) -> tuple[int, float]:
    """(evaluation episodes at once, per step): every task's samples start together each `eval.every`
    versions (rl/orchestrator/evaluation.py)."""
    e = cfg.eval
    if e.every <= 0 or e.tasks <= 0:
        return 0, 0.0
    return e.tasks * e.samples, e.tasks * e.samples / e.every


def processes(cfg) -> int:
    """Processes that run episodes: the rollout workers, or the orchestrator itself."""
    return max(cfg.orchestrator.rollout_workers, 1)


def env_threads(cfg) -> int:
    """Environment threads per process (rl.envs.base.set_env_threads from orchestrator.env_concurrency)."""
    return min(cfg.orchestrator.env_concurrency, ENV_THREADS_MAX)


def env_calls_at_once(cfg) -> int:
    """Environment calls that can run at once: min(env_concurrency, threads) per process times the
    processes, at most one per episode in flight."""
    return min(processes(cfg) * min(cfg.orchestrator.env_concurrency, env_threads(cfg)), inflight(cfg))


# -- sandbox nodes ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sandboxes:
    open: int            # sandboxes open at once: episodes in flight + evaluation episodes
    commands: int        # commands at once at most: min(open, environment calls at once)
    per_node: int        # commands one node runs at once
    bound: str           # what sets per_node: cores | memory | service threads
    needed: int          # nodes the derivation gives
    nodes: int           # nodes planned (explicit, derived or none)
    how: str             # where `nodes` comes from


def sandboxes(cfg) -> Sandboxes:
    """Sandbox nodes (cluster.sandbox_nodes, or derived with cluster.sandbox_nodes_auto): a command holds
    env.swe.sandbox_cores cores and up to env.swe.limits.memory_bytes while it runs (every command is a
    fresh sandbox over its tree: docs/sandboxes.md), so a node runs min(cores / sandbox_cores, memory /
    memory_bytes, the service's threads) commands at once, and the run needs enough nodes for every
    command that can run at once."""
    check(cfg)
    cl, s = cfg.cluster, cfg.env.swe
    at_eval, _ = eval_episodes(cfg)
    open_ = inflight(cfg) + at_eval
    commands = min(open_, env_calls_at_once(cfg) + at_eval)
    bounds = {"cores": int(cl.sandbox_node_cores / s.sandbox_cores),
              "memory": int(cl.sandbox_node_memory_gib * 2**30 // max(s.limits.memory_bytes, 1)),
              "service threads": SERVICE_THREADS}
    bound = min(bounds, key=bounds.get)
    per_node = max(bounds[bound], 1)
    needed = max(1, math.ceil(commands / per_node))
    swe = cfg.env.name == "swe"
    if cl.sandbox_nodes > 0:
        nodes, how = cl.sandbox_nodes, f"cluster.sandbox_nodes={cl.sandbox_nodes}"
    elif cl.sandbox_nodes_auto and swe:
        nodes, how = needed, "cluster.sandbox_nodes_auto"
    else:
        nodes, how = 0, "none: sandboxes on the orchestrator's node (cluster.sandbox_nodes=0)"
    return Sandboxes(open=open_, commands=commands, per_node=per_node, bound=bound, needed=needed, nodes=nodes,
                     how=how)


def planned_sandbox_nodes(cfg) -> int:
    """The sandbox nodes launch.plan gives het group 2 (0: none)."""
    if cfg.cluster.sandbox_nodes > 0 or not cfg.cluster.sandbox_nodes_auto or cfg.env.name != "swe":
        return cfg.cluster.sandbox_nodes
    return sandboxes(cfg).nodes


# -- CPU per step -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class RolloutCPU:
    workers: int           # orchestrator.rollout_workers (0: episodes in the orchestrator process)
    episodes: float        # episodes per step: the batch's rollouts and the evaluation's share
    requests: float
    parts: dict            # per-episode CPU seconds per step, all processes: name -> seconds
    per_episode_s: float   # their sum
    eval_s: float          # of per_episode_s, the evaluation's episodes (played in the centre)
    centre_s: float        # the pool, the group log, the batch (build, sha256, shard writes), evaluation
    busiest_s: float       # the busiest process (W = 0: the orchestrator, per-episode work and centre)
    busiest_groups: int    # its groups in flight
    reference_s: float     # the step it is compared with: min(the step without it, cluster.target_step_s)
    needed: int            # the fewest workers that keep the busiest under ROLLOUT_SHARE of the reference
    compared: bool = True  # GPU servers: compared with the step (CPU servers' steps are not modelled)

    @property
    def bound_s(self) -> float:
        """The step can be no shorter than its busiest rollout-side process's CPU."""
        return max(self.busiest_s, self.centre_s)


def busiest_s(train_s: float, centre_s: float, groups: int, workers: int) -> tuple[float, int]:
    """(CPU per step of the busiest process, its groups in flight): the training episodes' work `train_s`
    dealt by groups to `workers` processes, the busiest holding ceil(groups / workers); with none, one
    process does it and the centre's `centre_s` too."""
    if workers <= 0:
        return train_s + centre_s, groups
    most = math.ceil(groups / workers)
    return train_s * most / max(groups, 1), most


def workers_needed(train_s: float, centre_s: float, groups: int, reference_s: float,
                   single_s: float | None = None) -> int:
    """The fewest rollout workers whose busiest stays under ROLLOUT_SHARE of the step: 0 when one process
    does everything so (`single_s`, default train + centre: its CPU without workers), else the smallest
    divisor of the groups in flight that does (every worker holds the same number of groups), at most one
    worker per group. The centre's own CPU is not theirs to cut."""
    limit = ROLLOUT_SHARE * reference_s
    if (train_s + centre_s if single_s is None else single_s) <= limit:
        return 0
    for w in range(1, max(groups, 1) + 1):
        if groups % w == 0 and busiest_s(train_s, centre_s, groups, w)[0] <= limit:
            return w
    return max(groups, 1)


def cpu(cfg, workload, data, step_s: float, workers: int | None = None) -> RolloutCPU:
    """The rollout side's CPU per step of config `cfg` under `workload` (launch.perf.Workload) with the
    data plane `data` (launch.dataplane.DataPlane: route decode and the batch's terms), against `step_s`
    (the step without the rollout side) or cluster.target_step_s if shorter. The training episodes'
    work is dealt to the workers; evaluation is played in the centre (rl/orchestrator/workers.py), so its
    episodes' work is the centre's when there are workers."""
    check(cfg)
    o, w = cfg.orchestrator, workload
    n_workers = o.rollout_workers if workers is None else workers
    _, eval_per_step = eval_episodes(cfg)
    rollouts = o.prompts_per_step * o.group_size
    episodes = rollouts + eval_per_step
    requests = episodes * w.turns
    # one episode's work but its routes (evaluation asks for none: route decode is the batch's)
    unit = w.turns * REQUEST_S + w.decode_tokens * GEN_TOKEN_S + w.turns * w.rollout_tokens / 2 * CONTEXT_TOKEN_S
    decode = data.decode_s if data is not None else 0.0
    parts = {"requests": requests * REQUEST_S,
             "generated tokens": episodes * w.decode_tokens * GEN_TOKEN_S,
             "context sent": requests * w.rollout_tokens / 2 * CONTEXT_TOKEN_S,
             "route decode": decode}
    train, evaluation = rollouts * unit + decode, eval_per_step * unit
    batch = data.build_s + data.hash_s + data.write_s if data is not None else 0.0
    centre = rollouts * POOL_ROLLOUT_S + evaluation + batch
    # with workers: the routes' share of the batch's bytes is theirs (part files), the rest the centre's
    routes = data.route_bytes / data.batch_bytes if data is not None and data.batch_bytes else 0.0
    train_w = train + (data.hash_s + data.write_s) * routes if data is not None else train
    centre_w = rollouts * POOL_ROLLOUT_S + evaluation + batch * (1 - routes)
    single = train + centre   # W = 0: one process does all of it
    if n_workers:
        parts["route part files"] = train_w - train
        train, centre = train_w, centre_w
    groups = groups_inflight(cfg)
    busy, most = busiest_s(train, centre, groups, n_workers)
    target = cfg.cluster.target_step_s
    ref = min(step_s, target) if target else step_s
    compared = cfg.inference.gpus_per_node > 0
    return RolloutCPU(workers=n_workers, episodes=episodes, requests=requests, parts=parts,
                      per_episode_s=train + evaluation, eval_s=evaluation, centre_s=centre if n_workers else busy,
                      busiest_s=busy, busiest_groups=most, reference_s=ref, compared=compared,
                      needed=workers_needed(train_w, centre_w, groups, ref, single_s=single) if compared else n_workers)


def _workers_hint(r: RolloutCPU) -> str:
    return f"orchestrator.rollout_workers={r.needed}" if r.needed else "orchestrator.rollout_workers=0"


def terms(r: RolloutCPU) -> list[tuple[str, float, str]]:
    """(name, seconds, hint) of launch.perf's `rollout` rows."""
    hint = (f"more rollout worker processes ({_workers_hint(r)} keeps the busiest under "
            f"{ROLLOUT_SHARE:.0%} of the step)")
    if not r.workers:
        return [(f"orchestrator process CPU, episodes in it (rollout_workers=0): {r.requests:.0f} requests, "
                 f"pool and batch", r.busiest_s, hint)]
    return [(f"busiest rollout worker CPU: 1 of {r.workers}, {r.busiest_groups} groups in flight", r.busiest_s, hint),
            ("centre CPU: pool, group log, batch build, sha256, shard writes (no routes), evaluation episodes",
             r.centre_s, "evaluation on the workers")]


# Where the rollout workers run: children of the orchestrator on its node (rl/orchestrator/workers.py,
# "Placement"; placing them through the plan is a later step there).
WORKERS_ON_ORCHESTRATOR_NODE = True


def lines(cfg, r: RolloutCPU, env_s: float, episode_s: float) -> list[str]:
    """launch plan's rollout-side lines (printed as `perf:` notes): the CPU term and its derivation, the
    environment threads and calls at once, the sandbox nodes, and warnings."""
    o = cfg.orchestrator
    p = r.parts
    ref = max(r.reference_s, 1e-9)
    where = (f"{r.workers} rollout workers (orchestrator.rollout_workers), {groups_inflight(cfg)} groups in "
             f"flight, the busiest holds {r.busiest_groups}" if r.workers else
             "episodes in the orchestrator process (orchestrator.rollout_workers=0)")
    if not r.compared:
        share = "not compared with the step: CPU servers' steps are not modelled"
    elif r.workers:
        share = (f"busiest worker {r.busiest_s:.1f} s ({r.busiest_s / ref:.1%} of the {ref:.0f} s step), centre "
                 f"{r.centre_s:.1f} s ({r.centre_s / ref:.1%}; evaluation's {r.eval_s:.0f} s played there)")
    else:
        share = (f"one process {r.busiest_s:.0f} s with the centre's pool and batch ({r.busiest_s / ref:.1%} of the "
                 f"{ref:.0f} s step)")
    if r.compared:
        share += f"; the busiest worker under {ROLLOUT_SHARE:.0%} needs {_workers_hint(r)}"
    out = [f"rollout side: {where}; per-episode CPU per step {r.per_episode_s:.0f} s = {p['requests']:.0f} s for "
           f"{r.requests:.0f} requests at {REQUEST_S * 1e3:.1f} ms + {p['generated tokens']:.0f} s for "
           f"{p['generated tokens'] / GEN_TOKEN_S / 1e6:.2f}M generated tokens at {GEN_TOKEN_S * 1e6:.1f} us + "
           f"{p['context sent']:.0f} s for {p['context sent'] / CONTEXT_TOKEN_S / 1e6:.0f}M context tokens sent at "
           f"{CONTEXT_TOKEN_S * 1e9:.0f} ns + {p['route decode']:.0f} s of route decode"
           + (f" + {p['route part files']:.0f} s writing and hashing the routes' part files"
              if "route part files" in p else "")
           + f" ({r.episodes:.0f} episodes per step, evaluation included); {share} (coefficients: docs/perf.md "
           f"\"Rollout side\")"]
    threads = env_threads(cfg)
    per_proc = min(o.env_concurrency, threads, math.ceil(r.busiest_groups * o.group_size))
    calls = env_calls_at_once(cfg)
    placed = ""
    if r.workers and WORKERS_ON_ORCHESTRATOR_NODE:
        placed = (f"; the {r.workers} workers run beside the orchestrator on inference node 0 "
                  f"(rl/orchestrator/workers.py): {calls} calls at once there")
    out.append(f"environment: {threads} threads per process (min(orchestrator.env_concurrency={o.env_concurrency}, "
               f"{ENV_THREADS_MAX} cap), started as calls need them), up to {per_proc} calls at once in the busiest; "
               f"{calls} at once in all = min({processes(cfg)} process(es) x {min(o.env_concurrency, threads)}, "
               f"{inflight(cfg)} in flight){placed}" + (f"; {env_s:g} s per call (workload)" if env_s else ""))
    if cfg.env.name == "swe":
        s = sandboxes(cfg)
        sw = cfg.env.swe
        w_turns = r.requests / max(r.episodes, 1e-9)
        mean = inflight(cfg) * w_turns * env_s / episode_s if env_s and episode_s > 0 else 0.0
        node = (f"{s.per_node} per node = min({cfg.cluster.sandbox_node_cores} cores (cluster.sandbox_node_cores) / "
                f"{sw.sandbox_cores:g} (env.swe.sandbox_cores), {cfg.cluster.sandbox_node_memory_gib:g} GiB "
                f"(cluster.sandbox_node_memory_gib) / {sw.limits.memory_bytes / 2**30:g} GiB "
                f"(env.swe.limits.memory_bytes), {SERVICE_THREADS} service threads), bound by {s.bound}")
        text = (f"sandboxes: {s.open} open at once ({inflight(cfg)} in flight + {s.open - inflight(cfg)} "
                f"evaluation), up to {s.commands} commands at once"
                + (f" (the workload's mean: {mean:.0f} = {inflight(cfg)} x {w_turns:g} turns x {env_s:g} s / "
                   f"{episode_s:.0f} s per episode)" if mean else "")
                + f"; {node}; needs {s.needed} node(s) = ceil({s.commands} / {s.per_node}); planned: {s.nodes} "
                f"({s.how})")
        if s.nodes:
            text += (f", {math.ceil(s.open / s.nodes)} sandboxes and up to "
                     f"{math.ceil(s.open / s.nodes) * sw.limits.disk_bytes / 2**30:.0f} GiB of trees per node")
        out.append(text)
        if 0 < s.nodes < s.needed:
            out.append(f"warning: {s.nodes} sandbox nodes ({s.how}) run {s.nodes * s.per_node} commands at once, "
                       f"{s.commands} can be asked for: {s.needed} needed (or cluster.sandbox_nodes_auto=true "
                       f"with cluster.sandbox_nodes=0)")
        elif not s.nodes and s.open > s.per_node:
            out.append(f"warning: {s.open} sandboxes on the orchestrator's node ({s.how}): one node runs "
                       f"{s.per_node}; {s.needed} sandbox nodes needed (cluster.sandbox_nodes_auto=true)")
    limit = ROLLOUT_SHARE * ref
    if r.compared and r.busiest_s > limit:
        who = "the orchestrator process" if not r.workers else "the busiest rollout worker"
        out.append(f"warning: rollout side: {who} needs {r.busiest_s:.0f} s of CPU per step, "
                   f"{r.busiest_s / ref:.0%} of the {ref:.0f} s step (over {ROLLOUT_SHARE:.0%}: its event loop "
                   f"delays every turn, and at 100% it sets the step); {_workers_hint(r)} keeps each worker under "
                   f"{ROLLOUT_SHARE:.0%}")
    if r.compared and r.workers and r.centre_s > limit:
        out.append(f"warning: rollout side: the centre needs {r.centre_s:.0f} s of CPU per step, "
                   f"{r.centre_s / ref:.0%} of the {ref:.0f} s step (over {ROLLOUT_SHARE:.0%}): its pool, batch "
                   f"and evaluation are not the workers' to share")
    return out
