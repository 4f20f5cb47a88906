"""The allocation plan: a pure function from the composed config to who runs where, with which command.

One heterogeneous Slurm job per run. Het group 0 holds the trainer nodes: one `torchrun` per node (plain
`python -m rl.trainer` when the trainer is a single process), and FSDP (`dp_shard`) x EP x CP must equal
the trainer's world size. Het group 1 holds the inference nodes: vLLM replicas of `tp` x `dp` GPUs each
(expert parallel over the whole replica when `inference.ep` > 1, the "wide EP" of large MoE models),
optionally split into a prefill pool and a decode pool, the router and the orchestrator (CPU processes) on
the first inference node. With `cluster.sandbox_nodes` > 0 (or the count `cluster.sandbox_nodes_auto` derives:
launch.rollout_side), het group 2 holds CPU nodes of their own
(`cluster.sandbox_partition` / `sandbox_account`, default the cluster's) that run one SWE sandbox
service each (rl.envs.swe.service, role `sandbox_<i>`); the orchestrator's episodes open their
sandboxes there. The plan is computed once, written to `RUN_DIR/plan.json` and read by every role
and by the batch script template, so no role re-derives the topology.

Every role entry carries its node range inside its het group, its command line, its environment and its
log file; the template only loops over roles. Command arguments may name `${HETRL_TRAINER_ADDR}` or
`${HETRL_ROLE_ADDR}` (the hostname of the first node of the trainer group, of the role itself), which the
batch script sets at run time; `rl.inference` expands them (rl.contract.plan.expand) in each replica's
per-node vLLM argv, which it runs exactly as planned. A Slurm plan's node-local paths (model dir, KV
offload dir) start with `${HETRL_NODE_DIR}`, the directory of the node and incarnation, which
`rl.inference` sets itself (rl.contract.paths.node_dir). The plan is built as the typed `Plan` of
rl.contract.plan (what every role reads back from plan.json, `plan.to_dict()`; the round trip is checked
here) from the typed config (rl.contract.config.Config, every key present and typed, the schema's
defaults: no fallbacks of its own); a rule on the config alone is rl.contract.validation.validate's, run
first. Impossible plans raise `PlanError`, one line naming the key. No torch, no vLLM here.
"""
from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from pathlib import Path

from rl.contract import backends, families, paths
from rl.contract.config import Config, PlanError, resolve_ports, typed
from rl.contract.validation import validate
from rl.contract.plan import (PLAN_VERSION, SERVED_MODEL_NAME, Command, Group, InferencePlan, Plan, Replica, Role,
                               RouterPlan, SandboxPlan, SandboxService, TrainerPlan)

REPO = Path(__file__).resolve().parent.parent
AUTH_MIDDLEWARE = "rl.inference.auth.RunSecret"  # vLLM imports it (--middleware); reads VLLM_API_KEY
CPU_BATCHED_TOKENS = 2048  # vLLM's own default step budget on the CPU, kept when chunking is off


def _need(cond: bool, key: str, value, msg: str) -> None:
    if not cond:
        raise PlanError(f"{key}={value!r}: {msg}")


def _plain(cfg) -> dict:
    if isinstance(cfg, dict):
        return cfg
    from omegaconf import OmegaConf
    if isinstance(cfg, Config):
        return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    return OmegaConf.to_container(cfg, resolve=True)


run_id = paths.run_id


# -- trainer -----------------------------------------------------------------------------------------
def _trainer(cfg: Config, run_dir: str, python: str) -> TrainerPlan:
    t = cfg.trainer
    p = t.parallel
    nodes, gpn = t.nodes, t.gpus_per_node
    dims = p.dp_shard * p.ep * p.cp
    if gpn > 0:
        nproc = gpn
        world = nodes * gpn
        _need(dims == world, "trainer.parallel", f"{p.dp_shard}x{p.ep}x{p.cp}",
              f"dp_shard*ep*cp={dims} must equal the trainer GPUs trainer.nodes*trainer.gpus_per_node={world}")
    else:
        # CPU ranks (gloo): the parallel dims choose the world size; it must spread evenly over the nodes.
        _need(dims % nodes == 0, "trainer.nodes", nodes,
              f"must divide the CPU world size dp_shard*ep*cp={dims}")
        nproc, world = dims // nodes, dims
    port = t.master_port
    role_cmd = ["-m", "rl.trainer", "--run-dir", run_dir]
    # torchrun's agent handles only TERM, INT, HUP and QUIT by default: Slurm's time-limit USR1 (scancel
    # --signal=USR1 reaches every task) killed it with status 138, which the batch script takes for a crash
    # while stopping, so the job was not requeued. Handled, it stops the ranks, which checkpoint.
    signals = "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
    if world == 1:
        command = [python, *role_cmd]
    elif nodes == 1:
        command = [python, "-m", "rl.trainer.torchrun", "--nnodes=1", f"--nproc-per-node={nproc}",
                   "--master-addr=127.0.0.1", f"--master-port={port}", signals, *role_cmd]
    else:
        command = [python, "-m", "rl.trainer.torchrun", f"--nnodes={nodes}", f"--nproc-per-node={nproc}",
                   "--rdzv-backend=c10d", f"--rdzv-endpoint=${{HETRL_TRAINER_ADDR}}:{port}",
                   f"--rdzv-id={run_id(run_dir)}", signals, *role_cmd]
    return TrainerPlan(nodes=nodes, gpus_per_node=gpn, nproc_per_node=nproc, world_size=world,
                       dp_shard=p.dp_shard, ep=p.ep, cp=p.cp, master_port=port,
                       device="cuda" if gpn else "cpu", backend="nccl" if gpn else "gloo", command=command)


# -- inference ---------------------------------------------------------------------------------------
def _kv_transfer(cfg: Config, pd: bool, disk_dir: str) -> tuple[dict | None, dict]:
    """vLLM --kv-transfer-config for P/D (NIXL) and/or KV offload, plus the env LMCache reads."""
    i = cfg.inference
    off = i.kv_offload
    connectors, env = [], {}
    if pd:
        connectors.append({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
    if off == "cpu":
        connectors.append({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"cpu_bytes_to_use": int(i.kv_offload_cpu_gb * 2**30)}})
    elif off == "cpu+disk":
        connectors.append({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})
        env = {"LMCACHE_LOCAL_CPU": "True", "LMCACHE_MAX_LOCAL_CPU_SIZE": str(i.kv_offload_cpu_gb),
               "LMCACHE_LOCAL_DISK": f"file://{disk_dir}/", "LMCACHE_MAX_LOCAL_DISK_SIZE": str(i.kv_offload_disk_gb)}
    if not connectors:
        return None, env
    if len(connectors) == 1:
        return connectors[0], env
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": connectors}}, env


def _inference(cfg: Config, run_dir: str, python: str, local_dir: str, host: str) -> InferencePlan:
    i = cfg.inference
    nodes, gpn = i.nodes, i.gpus_per_node
    tp, dp, ep, replicas = i.tp, i.dp, i.ep, i.replicas
    size = tp * dp
    a2a = i.all2all_backend
    pn, dn = i.prefill_nodes, i.decode_nodes
    pd = pn > 0 or dn > 0
    if pd:
        _need(pn > 0 and dn > 0, "inference.prefill_nodes" if pn <= 0 else "inference.decode_nodes",
              pn if pn <= 0 else dn, "prefill/decode disaggregation needs both pools (or neither)")
        _need(pn + dn <= nodes, "inference.prefill_nodes", pn,
              f"prefill_nodes+decode_nodes={pn + dn} exceeds inference.nodes={nodes}")
        _need(pn + dn == nodes, "inference.decode_nodes", dn,
              f"prefill_nodes+decode_nodes={pn + dn} must use all inference.nodes={nodes}")
        _need(gpn > 0, "inference.gpus_per_node", gpn, "prefill/decode disaggregation needs GPU servers")
    if gpn > 0:
        _need(size <= gpn or size % gpn == 0, "inference.dp", dp,
              f"a replica of tp*dp={size} GPUs must fill whole nodes of inference.gpus_per_node={gpn} or fit in one")
        _need(size >= gpn or gpn % size == 0, "inference.dp", dp,
              f"tp*dp={size} must divide inference.gpus_per_node={gpn} to pack replicas on a node")
        _need(tp <= gpn, "inference.tp", tp, f"tensor parallel cannot span nodes (gpus_per_node={gpn})")
        pools = [("prefill", pn), ("decode", dn)] if pd else [("mixed", nodes)]
        layout = []
        for pool, pool_nodes in pools:
            gpus = pool_nodes * gpn
            key = f"inference.{pool}_nodes" if pd else "inference.replicas"
            _need(gpus % size == 0, key, pool_nodes if pd else replicas,
                  f"the {pool} pool's {gpus} GPUs do not split into replicas of tp*dp={size}")
            layout.append((pool, gpus // size, pool_nodes))
        want = sum(n for _, n, _ in layout)
        if not pd:
            _need(replicas * size <= nodes * gpn, "inference.replicas", replicas,
                  f"{replicas} replicas x tp*dp={size} GPUs exceed inference.nodes*gpus_per_node={nodes * gpn}")
        _need(replicas == want, "inference.replicas", replicas,
              f"inference.nodes={nodes} x {gpn} GPUs hold exactly {want} replicas of tp*dp={size}")
    else:
        _need(size == 1, "inference.tp", tp, "CPU servers (gpus_per_node=0) run tp=dp=1")
        layout = [("mixed", replicas, nodes)]

    out, first_node, port = [], 0, i.port
    # On Slurm the node-local paths are per node and incarnation (rl.contract.paths.node_dir), which only
    # the node knows: `${HETRL_NODE_DIR}`, which rl.inference sets before it expands the plan's argv and
    # env. The local backend runs one incarnation at a time on one host and keeps the run's directory.
    where = backends.row(cfg.cluster.backend)
    node_dir = f"${{{paths.NODE_DIR_VAR}}}" if where.node_dirs_per_incarnation else local_dir
    # Routed expert ids come back only from vLLM's GPU MoE kernels (0.32 refuses the flag on the CPU).
    capture = cfg.trainer.router_replay and gpn > 0
    env_common = {"VLLM_SERVER_DEV_MODE": "1"}  # /pause, /collective_rpc, weight versions
    if not gpn:
        env_common["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(round(i.kv_cache_gb))))
    if not where.binds_all_interfaces:
        env_common["VLLM_HOST_IP"] = host
    for pool, count, pool_nodes in layout:
        node_span = max(1, size // gpn) if gpn else 1
        per_node = max(1, gpn // size) if gpn else -(-count // pool_nodes)
        for k in range(count):
            idx = len(out)
            node = first_node + (k // per_node) * node_span if gpn else first_node + k % pool_nodes
            kv, kv_env = _kv_transfer(cfg, pd, paths.node_kv_dir(node_dir))
            model_dir = paths.node_model_dir(node_dir, idx)
            args = ["--host", host, "--port", str(port + idx), "--served-model-name", SERVED_MODEL_NAME,
                    "--dtype", i.dtype, "--max-model-len", str(i.max_model_len),
                    "--tensor-parallel-size", str(tp), "--data-parallel-size", str(dp),
                    "--seed", str(cfg.seed),
                    "--worker-extension-cls", "rl.inference.worker_ext.WeightSyncExtension",
                    "--generation-config", "vllm",
                    # the token-in/token-out endpoint with per-token weight versions
                    "--enable-scale-out",
                    # the router's affinity relies on prefix caching; cached-token counts per request
                    "--enable-prefix-caching", "--enable-prompt-tokens-details",
                    # every path but /health needs the run's secret (vLLM's --api-key guards only /v1-style
                    # ones); the launcher gives every run a secret, and launch imports no role: its name here
                    "--middleware", AUTH_MIDDLEWARE]
            if cfg.orchestrator.slot_order == "oldest":
                # requests carry their group's start version as priority: the oldest is served first
                args += ["--scheduling-policy", "priority"]
            if gpn:
                args += ["--gpu-memory-utilization", str(i.gpu_memory_utilization)]
            else:
                # No chunked prefill on the CPU: vLLM rewinds a seeded request's generator after a partial
                # prefill chunk (set_offset), which a CPU generator refuses, and the engine core dies
                # (docs/cpu.md). Every prompt then fits one step, so the step's budget covers max_model_len.
                args += ["--no-enable-chunked-prefill",
                         "--max-num-batched-tokens", str(max(i.max_model_len, CPU_BATCHED_TOKENS))]
            if capture:  # router replay (R3): every response carries [tokens-1, layers, top_k] expert ids
                args.append("--enable-return-routed-experts")
            if ep > 1:
                backend = a2a if a2a != "auto" else (
                    "deepep_low_latency" if pool == "decode" else "deepep_high_throughput") if gpn else "naive"
                args += ["--enable-expert-parallel", "--all2all-backend", backend]
            row = families.get(cfg.model.family)
            if not gpn:  # the family's vLLM-cpu arguments (rl.contract.families, docs/cpu.md)
                args += list(row.vllm_cpu_args)
            if i.enforce_eager:
                args.append("--enforce-eager")
                if not gpn:
                    args += list(row.vllm_cpu_eager_args)
            if kv is not None:
                args += ["--kv-transfer-config", json.dumps(kv, separators=(",", ":"))]
            args += [str(a) for a in i.extra_args]
            node_args = [[]]
            # One node: the OpenAI server module (`vllm serve` refuses vllm-cpu's package name).
            entry = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
            if gpn and size > gpn:
                # One replica over several nodes: vLLM's multi-node data parallel. Only `vllm serve`
                # knows --headless (the server module ignores it and would start a second API server).
                # The head gets no start rank: with one, vLLM switches to hybrid load balancing and its
                # API server would use only its own node's ranks; one API server, so the weight
                # version and pause state live in one place.
                local = gpn // tp
                rpc = i.dp_rpc_port + idx
                entry = [python, "-m", "vllm.entrypoints.cli.main", "serve", model_dir]
                args += ["--data-parallel-size-local", str(local), "--data-parallel-address",
                         "${HETRL_ROLE_ADDR}", "--data-parallel-rpc-port", str(rpc)]
                node_args = [["--api-server-count", "1"]] + [
                    ["--data-parallel-start-rank", str(n * local), "--headless"] for n in range(1, node_span)]
            out.append(Replica(
                index=idx, name=f"inference_{idx}", pool=pool, node=node, nodes=node_span,
                gpus_per_node=min(size, gpn) if gpn else 0, tp=tp, dp=dp, ep=ep,
                host=host, port=port + idx,
                dp_rpc_port=i.dp_rpc_port + idx if len(node_args) > 1 else None,
                model_dir=model_dir,
                vllm_command=[*entry, *args],
                node_args=node_args,
                env={**env_common, "VLLM_CACHE_ROOT": paths.node_vllm_cache(local_dir), **kv_env},
                command=[python, "-m", "rl.inference", "--run-dir", run_dir, "--index", str(idx)],
            ))
        first_node += pool_nodes
    router = None
    if i.router:
        router = RouterPlan(host=host, port=i.router_port, node=0,
                            command=[python, "-m", "rl.inference.router", "--run-dir", run_dir])
    return InferencePlan(nodes=nodes, gpus_per_node=gpn, tp=tp, dp=dp, ep=ep, replica_gpus=size,
                         disaggregated=pd, prefill_nodes=pn, decode_nodes=dn, kv_offload=i.kv_offload,
                         replicas=out, router=router)


def _check_ports(inf: InferencePlan, cfg: Config) -> None:
    """Ports of processes that share a node must differ; a taken port names the key that set it."""
    used: dict[int, str] = {}
    for r in inf.replicas:
        used[r.port] = "inference.port"
    extra = []
    if inf.router:
        extra.append((inf.router.port, "inference.router_port"))
    extra += [(r.dp_rpc_port, "inference.dp_rpc_port") for r in inf.replicas if r.dp_rpc_port]
    for port, key in extra:
        _need(port not in used, key, getattr(cfg.inference, key.split(".")[1]),
              f"port {port} collides with {used.get(port)} (ports {min(used)}..{max(used)} are taken)")
        used[port] = key
    _need(all(1 <= p <= 65535 for p in used), "inference.port", cfg.inference.port,
          "the plan's ports run past 65535")


# -- sandbox nodes -----------------------------------------------------------------------------------
def _sandboxes(cfg: Config, run_dir: str, python: str) -> SandboxPlan | None:
    """Het group 2: one sandbox service per CPU node, or None (sandboxes on the orchestrator's node). The
    count is cluster.sandbox_nodes, or with cluster.sandbox_nodes_auto (and sandbox_nodes 0) what
    launch.rollout_side derives from the episodes in flight (docs/sandboxes.md "Sizing sandbox nodes")."""
    from launch import rollout_side
    cl = cfg.cluster
    rollout_side.check(cfg)
    n = rollout_side.planned_sandbox_nodes(cfg)
    if n == 0:
        return None
    services = [SandboxService(index=i, name=f"sandbox_{i}", node=i,
                               command=[python, "-m", "rl.envs.swe.service", "--run-dir", run_dir, "--index", str(i)])
                for i in range(n)]
    return SandboxPlan(nodes=n, partition=cl.sandbox_partition or cl.partition,
                       account=cl.sandbox_account or cl.account, services=services)


# -- the plan ----------------------------------------------------------------------------------------
def _log(role: str) -> str:
    return f"logs/{role}.log"   # relative to the run dir (the batch script and the local backend open it there)


def _env(role: str, group: int, run_dir: str, **extra) -> dict:
    return {"HETRL_ROLE": role, "HETRL_HET_GROUP": str(group), "HETRL_RUN_DIR": run_dir,
            "PYTHONUNBUFFERED": "1", **{k: str(v) for k, v in extra.items()}}


def make_plan(cfg, check_memory: bool = True) -> Plan:
    """The allocation plan of `cfg` (a composed config: dict, DictConfig or rl.contract.config.Config): the
    typed Plan of rl.contract.plan, built from the typed Config; `plan.to_dict()` is its plan.json.

    The config is validated first (rl.contract.validation.validate: every rule on the config alone lives there);
    what is refused here is what only the plan can see (GPUs that do not split into replicas, ports that
    collide). With `check_memory`, a plan whose estimated per-GPU memory exceeds the GPU is refused
    (PlanError naming the role and the term); `launch plan` prints the table either way."""
    c = _plain(cfg)
    run_dir = str(Path(c["run_dir"] or ".").absolute())
    resolve_ports({**c, "run_dir": run_dir})  # ports left at 0 (auto), as the launcher resolves them
    c = {**c, "run_dir": run_dir}
    validate(c)
    cfg = typed(c)
    cl = cfg.cluster
    python = cl.python or sys.executable
    rid = run_id(run_dir)
    local_dir = paths.node_local_dir(cl.node_local_dir, run_dir)
    grace = cl.signal_grace_s
    # Servers on Slurm must be reachable from the other het group; locally nothing else needs them.
    host = cfg.inference.host or ("0.0.0.0" if backends.row(cl.backend).binds_all_interfaces else "127.0.0.1")
    trainer = _trainer(cfg, run_dir, python)
    inf = _inference(cfg, run_dir, python, local_dir, host)
    _check_ports(inf, cfg)

    roles = [Role(name="trainer", het_group=0, node=0, nodes=trainer.nodes, gpus_per_node=trainer.gpus_per_node,
                  command=trainer.command, env=_env("trainer", 0, run_dir, HETRL_WORLD_SIZE=trainer.world_size),
                  log=_log("trainer"))]
    for r in inf.replicas:
        roles.append(Role(name=r.name, het_group=1, node=r.node, nodes=r.nodes, gpus_per_node=r.gpus_per_node,
                          command=r.command, log=_log(r.name),
                          env=_env("inference", 1, run_dir, HETRL_INFERENCE_INDEX=r.index, **r.env)))
    if inf.router:
        roles.append(Role(name="router", het_group=1, node=0, nodes=1, gpus_per_node=0, command=inf.router.command,
                          env=_env("router", 1, run_dir), log=_log("router")))
    roles.append(Role(name="orchestrator", het_group=1, node=0, nodes=1, gpus_per_node=0,
                      command=[python, "-m", "rl.orchestrator", "--run-dir", run_dir],
                      env=_env("orchestrator", 1, run_dir), log=_log("orchestrator")))
    sbx = _sandboxes(cfg, run_dir, python)
    for sv in sbx.services if sbx else []:
        roles.append(Role(name=sv.name, het_group=2, node=sv.node, nodes=1, gpus_per_node=0, command=sv.command,
                          env=_env("sandbox", 2, run_dir, HETRL_SANDBOX_INDEX=sv.index), log=_log(sv.name)))

    groups = [Group(het_group=0, name="trainer", nodes=trainer.nodes, gpus_per_node=trainer.gpus_per_node, sbatch={}),
              Group(het_group=1, name="inference", nodes=inf.nodes, gpus_per_node=inf.gpus_per_node, sbatch={})]
    if sbx:  # CPU nodes: their own partition/account, none of the GPU components' gres or constraint
        groups.append(Group(het_group=2, name="sandboxes", nodes=sbx.nodes, gpus_per_node=0,
                            sbatch={"partition": sbx.partition, "account": sbx.account, "gres": None,
                                    "constraint": None}))
    plan = Plan(
        version=PLAN_VERSION, experiment=cfg.experiment or "run", backend=cl.backend,
        run_dir=run_dir, run_id=rid,
        python=python, workdir=str(REPO), node_local_dir=local_dir,
        signal_grace_s=grace, exit_preempted=paths.EXIT_PREEMPTED,
        groups=groups, trainer=trainer, inference=inf,
        prepare=Command([python, "-m", "rl.prepare", "--run-dir", run_dir]),
        requeue_check=Command([python, "-m", "rl.requeue", "--run-dir", run_dir]),
        roles=roles, sandboxes=sbx,
    )
    from launch import memory   # memory reads the plan (plan.py imports it here only: no circle at import)
    report = memory.estimate(cfg, plan)
    plan = dataclasses.replace(plan, memory=dataclasses.asdict(report))
    # what the roles will read (plan.json through Plan.read) is what was computed here
    if Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) != plan:
        raise AssertionError("the plan does not survive its JSON round trip (rl.contract.plan)")
    if check_memory:
        memory.check(report)
    return plan


def summary_rows(plan: Plan) -> list[tuple[str, str, str, str]]:
    """(role, het group, nodes, what) rows for `launch plan`'s table."""
    rows = []
    t = plan.trainer
    for r in plan.roles:
        span = f"{r.node}" if r.nodes == 1 else f"{r.node}-{r.node + r.nodes - 1}"
        if r.name == "trainer":
            what = f"{t.world_size} ranks ({t.nproc_per_node}/node): fsdp {t.dp_shard} x ep {t.ep} x cp {t.cp}"
        elif r.name.startswith("inference_"):
            rep = plan.replica(int(r.name.split("_")[1]))
            what = f"vLLM {rep.pool} tp {rep.tp} dp {rep.dp} ep {rep.ep} :{rep.port}"
        elif r.name == "router":
            what = f"router :{plan.inference.router.port}"
        elif r.name.startswith("sandbox_"):
            what = "SWE sandbox service (episodes' tools and grading)"
        else:
            what = "rollouts, advantages, weight updates"
        rows.append((r.name, str(r.het_group), span, what))
    return rows


RETURN_ROUTES = "--enable-return-routed-experts"


def server_lines(plan: Plan, router_replay: bool) -> list[str]:
    """`launch plan`'s lines under the table: whether router replay (R3) is on and which servers return
    routed experts, then each vLLM server's argv on its head node, as plan.json has it."""
    have = [f"{r.name} ({r.pool})" for r in plan.inference.replicas if RETURN_ROUTES in r.vllm_command]
    if not router_replay:
        r3 = "router replay (R3): off (trainer.router_replay=false)"
    elif have:
        r3 = (f"router replay (R3): on; {RETURN_ROUTES} in {', '.join(have)}; each turn asks only for the "
              "routes of tokens its episode does not hold (routed_experts_prompt_start)")
    else:
        r3 = ("router replay (R3): on, but no server returns routed experts (vLLM returns them from GPU MoE "
              "kernels only): the trainer replays its own routing")
    return [r3] + [f"{r.name} ({r.pool}) argv: {shlex.join(r.vllm_argv(0))}" for r in plan.inference.replicas]
