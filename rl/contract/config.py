"""The typed config: the schema of every key a run can set, its one set of defaults, and its validation.

Every process of a run reads the same tree. The launcher composes `conf/` with Hydra on top of these
dataclasses (registered as the schema of the base config, so an unknown key or a value of the wrong type
is refused by OmegaConf with the key's full name), `rl.contract.validation.validate()` checks what types cannot express
(ranges, combinations, names that must exist, Slurm's own formats) and raises `ConfigError` with one
line naming the key, and the result is frozen into `RUN_DIR/config.yaml`. Every role then calls
`load(run_dir)`, which merges that file onto the same dataclasses: roles get typed attribute access and
the defaults below, never an untyped dict with defaults of their own.

The defaults ARE the embedded default run (a tiny Qwen3-MoE on the CPU, the digits task, every role a
local process): `conf/` only overlays what differs (an environment, the Slurm backend, an experiment).
Torch-free: the launcher imports this on a login node.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from rl.contract import families


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""


class PlanError(ConfigError):
    """A config whose allocation cannot work (topology, ports, memory); the message names the key."""


# Model families the config accepts: the rows of rl.contract.families (their networks: rl/models).
FAMILIES = families.FAMILIES


@dataclass
class ModelConfig:
    name: str = "tiny-qwen3-moe"       # the served model name (vLLM --served-model-name)
    family: str = "qwen3"              # network architecture, one of FAMILIES
    hf_path: Optional[str] = None      # an HF checkpoint dir to start from; None = create the tiny model
    vocab_size: int = 512
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 2
    n_kv_heads: int = 1
    head_dim: int = 32
    moe_hidden_dim: int = 64
    num_experts: int = 4
    top_k: int = 2
    max_seq_len: int = 512
    rope_theta: float = 1000000.0
    # Multi-head latent attention (DeepSeek-V3 / Kimi / GLM-5); 0 = grouped-query attention.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    n_shared_experts: int = 0          # experts every token goes through
    n_dense_layers: int = 0            # leading layers with a dense FFN instead of experts
    dense_hidden_dim: int = 0          # their FFN width
    # DeepSeek sparse attention's indexer (GLM-5): top-k keys per query; 0 = dense attention.
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0


@dataclass
class ParallelConfig:
    dp_shard: int = 1
    ep: int = 1
    cp: int = 1


@dataclass
class WarmStartConfig:
    steps: int = 150                   # supervised steps on the environment's sft_examples before RL
    lr: float = 3e-3
    batch_size: int = 32


@dataclass
class TrainerConfig:
    max_steps: int = 40
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list = field(default_factory=lambda: [0.9, 0.99])
    grad_clip: float = 1.0
    micro_batch_tokens: int = 1024
    dtype: str = "float32"             # compute dtype of the trainer (fp32 on CPU)
    fp8: bool = False                  # block-scaled FP8 training (emulated on CPU)
    router_replay: bool = False        # R3: MoE routers use the batch's recorded expert ids (rl.models.replay)
    activation_checkpointing: str = "none"  # none | selective | full (torchtitan's AC modes)
    cpu_offload: bool = False          # FSDP2 CPU offload of parameters, gradients and optimizer states
    checkpoint_every: int = 5
    keep_checkpoints: int = 2
    keep_weights: int = 3
    publish_async: bool = True         # weights quantized, written and committed while the next step trains
    publish_timeout_s: float = 600.0   # rank 0 gives up on the other ranks' shards after this (no commit)
    weights_full_every: int = 10       # a full version every K; the others sparse deltas (0: always full)
    delta_max_fraction: float = 0.25   # a tensor whose changed bytes cost more than this goes whole
    # loss: importance-sampled policy gradient, token level (rl.trainer.loss)
    mismatch: str = "truncate"         # the off-policy correction (rl.trainer.corrections): truncate | mask |
    #                                    none | is | seq_truncate | seq_mask | geo_mask | m2po (docs/async.md)
    ratio_max: float = 2.0             # token (or sample) ratio above this: masked / truncated
    ratio_min: float = 0.5
    geo_ratio_min: float = 0.99        # geo_mask: a sample's geometric-mean ratio outside [min, max] is dropped
    geo_ratio_max: float = 1.01
    m2_threshold: float = 0.04         # m2po: largest (log r)^2 tokens masked until their mean is <= this
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    nodes: int = 1
    gpus_per_node: int = 0             # 0: CPU ranks (gloo); > 0: one rank per GPU, cuda:LOCAL_RANK, NCCL
    master_port: int = 0               # torch.distributed rendezvous port on the first trainer node (0 = auto)


@dataclass
class RoutingConfig:
    """The KV-aware router's policy (rl.contract.routing), when inference.router is on."""
    policy: str = "kv"                  # kv | round_robin (the baseline)
    block_tokens: int = 16              # token ids per hashed block
    text_block_chars: int = 64          # characters per hashed block of a text prompt
    chars_per_token: float = 4.0        # token estimate of text and chat prompts
    max_queue: int = 64                 # a server at this load is full: no affinity, last choice
    queue_slack: float = 4.0            # affinity while load(server) <= least load x (1 + ratio) + slack
    queue_slack_ratio: float = 0.25
    kv_full: float = 0.95               # vllm:kv_cache_usage_perc at which a server counts as full
    min_affinity_tokens: int = 16       # a prefix advantage smaller than this is no affinity
    miss_tokens_per_load: float = 2048.0  # uncached prompt tokens that cost as much as one queued request
    waiting_weight: float = 1.0         # extra load per request the server queues (not yet scheduled)
    pd_min_prefill_tokens: int = 512    # P/D: fewer uncached tokens than this prefill on the decode server
    index_blocks: int = 1 << 20         # per-server index size before the KV capacity is known
    max_sessions: int = 1 << 20
    poll_interval_s: float = 0.5
    metrics_stale_s: float = 5.0
    fail_after: int = 2                 # failed polls before a server counts as down
    request_timeout_s: float = 7200.0
    # rollout workers route their own requests (the same policy, the servers' /metrics), not through the
    # router process (rl/orchestrator/local_routing.py); mixed servers only
    in_workers: bool = True


@dataclass
class InferenceConfig:
    host: Optional[str] = None         # bind address; None: 127.0.0.1 locally, 0.0.0.0 on Slurm
    port: int = 0                      # first server's port, +1 per replica (0 = auto, derived from run_dir)
    dtype: str = "float32"
    max_model_len: int = 512
    kv_cache_gb: float = 1.0           # vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE) on CPU servers
    gpu_memory_utilization: float = 0.9  # vLLM's fraction of each GPU (weights + KV cache + workspace)
    enforce_eager: bool = True
    fp8_load: str = "auto"             # auto | dequantize | fp8: how shards enter the engine
    startup_timeout_s: float = 600.0
    extra_args: list = field(default_factory=list)   # more vLLM server arguments, appended to the plan's
    nodes: int = 1
    gpus_per_node: int = 0
    tp: int = 1
    dp: int = 1
    ep: int = 1
    replicas: int = 1
    prefill_nodes: int = 0
    decode_nodes: int = 0
    kv_offload: Optional[str] = None   # None | cpu | cpu+disk
    kv_offload_cpu_gb: float = 0.0     # CPU tier of the KV offload, per server (needs kv_offload)
    kv_offload_disk_gb: float = 0.0    # disk tier (kv_offload=cpu+disk), under cluster.node_local_dir
    router: bool = False
    router_port: int = 0               # the router's port on the first inference node (0 = auto)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    dp_rpc_port: int = 13345           # base of vLLM's data-parallel RPC ports (one per multi-node replica)
    all2all_backend: str = "auto"      # vLLM --all2all-backend with EP; auto: DeepEP (HT prefill, LL decode)


@dataclass
class OrchestratorConfig:
    max_off_policy: int = 1
    prompts_per_step: int = 16
    group_size: int = 8
    max_tokens: int = 12               # per completion; per model turn in multi-turn environments
    temperature: float = 1.0
    top_p: float = 1.0
    max_concurrency: int = 64          # requests in flight to the inference servers
    request_timeout_s: float = 300.0   # one HTTP request to a server (a long generation included)
    advantage: str = "grpo"            # grpo (group mean baseline, std normalised) | drgrpo (no std)
    # Multi-turn rollouts (rl/orchestrator/multiturn.py); env.max_turns caps the turns.
    max_rollout_tokens: Optional[int] = None   # prompt + turns + observations; None = inference.max_model_len
    rollout_timeout_s: Optional[float] = None  # wall time of one rollout; None = no limit
    env_concurrency: int = 8                   # environment calls (tool runs, grading) at once, per process
    # Rollout worker processes per run; 0 runs episodes in the orchestrator process. One Python process
    # needs ~300 s of CPU per glm5_seed step (issue 50); `launch plan` shows the busiest process's CPU per
    # step and `--search` picks the count (docs/perf.md "Rollout side").
    rollout_workers: int = 0
    # Where in-flight episodes' routed-expert rows (router replay) are spilled as they arrive, one file per
    # episode in a private per-process directory made under it (rl/orchestrator/spill.py); "" = node-local
    # scratch ($SLURM_TMPDIR, else $TMPDIR). Needs ~layers x top_k bytes per in-flight token of disk.
    spill_dir: str = ""
    # How rollouts are scheduled (rl/orchestrator/pool.py): `continuous` keeps up to max_inflight groups
    # generating whatever the batch boundaries and forms batch n from finished groups as soon as
    # prompts_per_step of them are within max_off_policy of n; `batch` samples batch n's groups together
    # and waits for all of them (one straggler holds the step).
    schedule: str = "continuous"
    # ROLLOUTS in flight (each rollout holds its slot until it finishes, not until its group does), the same
    # budget for both schedules. Until issue 25 this counted groups: an old value v (groups) is now
    # v * group_size; a value below group_size is refused. None = prompts_per_step * group_size *
    # (max_off_policy + 1).
    max_inflight: Optional[int] = None
    # What happens to tokens older than max_off_policy (docs/async.md): `drop` cancels / drops the whole
    # group (biased against long episodes); `mask` keeps the episode and gives only its stale tokens loss
    # mask 0; `admit` is mask plus admission control (a group starts only when its predicted duration lets
    # it finish within the bound); `release` is mask without the group barrier: a group's finished
    # rollouts are trained before their straggling siblings, at the last batch within the bound, against
    # the siblings finished by then (rl/orchestrator/groups.py). The default: measured to waste the least
    # and learn as mask does (docs/async.md).
    stale_policy: str = "release"
    # Under release, while the trainer waits for batch n, the finished rollouts of any in-flight group may
    # fill it (not only of groups for which n is the last batch within the bound): fewer idle trainer
    # seconds where inference is the bottleneck, for more stale tokens (docs/async.md has both measured).
    release_on_wait: bool = False
    # Who gets a freed request or environment slot (rl/orchestrator/slots.py): `oldest` serves the waiter
    # whose group started at the oldest policy version first (it goes stale first); `fifo` first come.
    slot_order: str = "oldest"
    drain_timeout_s: float = 30.0              # at max_steps or a stop: in-flight work cancelled within this


@dataclass
class DigitsConfig:
    """The embedded default's task: repeat the prompt's digits (rl.envs.digits)."""
    n_digits: int = 3
    # The warm start's noisy teacher is right on each digit with this probability: 0.5 leaves the tiny
    # model at a reward of about 0.3 after 150 warm-start steps, the rest is RL's work.
    warm_start_accuracy: float = 0.5
    # Grading latency per prompt (a test suite's run time), for studying asynchrony: lognormal with this
    # median and sigma, and with probability outlier_prob a prompt takes outlier_factor times as long.
    # Drawn with the prompt, so a prompt is as slow every time it is played. 0 = grading is instant.
    latency_median_s: float = 0.0
    latency_sigma: float = 0.5
    latency_outlier_prob: float = 0.0
    latency_outlier_factor: float = 30.0


@dataclass
class SandboxLimitsConfig:
    """Per-command limits of the SWE sandbox (rl.envs.swe.sandbox.Limits)."""
    cpu_s: int = 60
    memory_bytes: int = 2 << 30
    nproc: int = 64
    fsize_bytes: int = 64 << 20
    nofile: int = 256
    tmp_bytes: int = 64 << 20
    disk_bytes: int = 1 << 30           # the episode's tree (every runtime measures it while each command runs and after it)
    output_chars: int = 1 << 20


@dataclass
class SweConfig:
    """The SWE environment (rl.envs.swe)."""
    # Task rows: a JSONL or parquet file or a saved `datasets` directory, in any format of docs/swe.md,
    # or a shipped set: builtin (snapshots; also None) or builtin_swebench (SWE-bench rows, git repos).
    tasks: Optional[str] = None
    format: str = "auto"               # auto | swe_bench | swe_smith | swe_rebench | r2e_gym
    split: Optional[str] = None        # which split of a directory holding several (train, test, dev, ...)
    repos_dir: Optional[str] = None    # git repositories of rows' `repo` names; None = ~/.cache/hetrl/swe_repos
    partial_credit: bool = True        # reward = fraction of graded tests passed; False: 1 only if all pass
    wall_s: float = 1800.0             # one episode, tools and grading included
    tool_timeout_s: float = 60.0       # one tool run (pytest, patch); clipped to the time left
    grade_timeout_s: float = 300.0     # grading an episode's tree on the hidden tests
    output_chars: int = 4000           # tool output kept per observation
    limits: SandboxLimitsConfig = field(default_factory=SandboxLimitsConfig)
    # Where episode commands run (docs/sandboxes.md): inprocess | bubblewrap | podman | apptainer.
    runtime: str = "inprocess"
    image_cache: Optional[str] = None  # apptainer SIFs, built once per image: shared filesystem, never /tmp
    max_sandbox_starts_per_s: float = 8.0  # per process (token bucket): start storms break runtimes
    # Cores one sandbox's command holds while it runs (sizing sandbox nodes: docs/sandboxes.md); its memory
    # is limits.memory_bytes, the budget of all its processes together.
    sandbox_cores: float = 1.0


@dataclass
class EnvConfig:
    name: str = "digits"               # digits | swe | verifiers:<id>
    max_turns: int = 1
    # context summarization (rl.orchestrator.multiturn): context sizes in tokens, used in order, at which the
    # policy summarizes its progress and the episode goes on in a fresh context; [] = never
    summarize_at_tokens: list[int] = field(default_factory=list)
    summary_prompt: str = ("Your context is almost full. Summarize your progress so far for yourself: the task, "
                           "what you tried, what you found, which files you changed and what remains to do. "
                           "Be concise and specific; you will continue from this summary alone.")
    digits: DigitsConfig = field(default_factory=DigitsConfig)
    swe: SweConfig = field(default_factory=SweConfig)
    args: dict = field(default_factory=dict)   # verifiers:<id> only: taskset fields, max_tasks


@dataclass
class HardwareConfig:
    """Per-GPU and per-node figures the step-time prediction reads (launch.perf, docs/perf.md). `gpu` picks
    a preset (h100 | h200, sources in docs/perf.md); every other key left None takes the preset's value."""
    gpu: str = "h200"
    bf16_tflops: Optional[float] = None     # dense peak, per GPU
    fp8_tflops: Optional[float] = None
    hbm_gbps: Optional[float] = None        # GB/s per GPU
    nvlink_gbps: Optional[float] = None     # intra-node, GB/s per GPU and direction
    nic_gbps: Optional[float] = None        # inter-node (RDMA), GB/s per GPU and direction
    pcie_gbps: Optional[float] = None       # host <-> GPU, GB/s per GPU and direction
    host_mem_gbps: Optional[float] = None   # achievable host memory bandwidth per node, GB/s
    fs_read_gbps: Optional[float] = None    # shared filesystem, per client node, GB/s
    fs_write_gbps: Optional[float] = None
    fs_total_gbps: Optional[float] = None   # the filesystem's aggregate, GB/s
    checksum_gbps: Optional[float] = None   # sha256, GB/s per core
    mfu: Optional[float] = None             # trainer: model FLOP utilisation (of the GEMMs' precision peak)
    inference_mfu: Optional[float] = None   # vLLM prefill / decode compute
    hbm_efficiency: Optional[float] = None  # achieved fraction of hbm_gbps when decode streams weights


@dataclass
class ClusterConfig:
    backend: str = "local"             # local | slurm
    account: Optional[str] = None
    partition: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    gres: Optional[str] = None
    time: str = "04:00:00"
    signal_grace_s: int = 120
    requeue: bool = True
    max_restarts: int = 20             # requeues of one job at most (rl.requeue); each also needs a new checkpoint
    max_role_restarts: int = 3         # in-place restarts of one inference role per incarnation (sbatch supervisor)
    min_inference_fraction: float = 1.0  # servers given up on below this fraction of the planned: requeue
    stall_timeout_s: float = 7200.0    # a role waiting this long for another role's output ends the job; 0 = never
    exclusive: bool = True             # whole nodes per het component (#SBATCH --exclusive)
    job_name: Optional[str] = None     # default: hetrl-<experiment>
    extra_sbatch: list = field(default_factory=list)
    setup: list = field(default_factory=list)  # shell lines the batch script runs first (module load ...)
    python: Optional[str] = None       # interpreter the roles run with (default: the launcher's)
    node_local_dir: str = "/tmp"   # a per-user hetrl-<uid> directory (0700) is made under it
    gpu_memory_gib: float = 140.0      # usable memory of one GPU (H200: about 140 GiB)
    host_memory_gib: float = 0.0       # usable host memory of one node (offloaded state, KV tier); 0 = unchecked
    # SWE sandboxes on CPU nodes of their own: het group 2, one sandbox service per node (docs/sandboxes.md).
    # 0 = sandboxes run on the orchestrator's node.
    sandbox_nodes: int = 0
    # true: when sandbox_nodes is 0, launch plan derives the count from the episodes in flight and what a
    # node holds (docs/sandboxes.md "Sizing sandbox nodes"); an explicit sandbox_nodes > 0 is taken as is.
    sandbox_nodes_auto: bool = False
    sandbox_node_cores: int = 128            # cores of one sandbox node its sandboxes may use (2 x 64-core CPUs)
    sandbox_node_memory_gib: float = 512.0   # memory of one sandbox node its sandboxes may use
    sandbox_partition: Optional[str] = None  # default: cluster.partition
    sandbox_account: Optional[str] = None    # default: cluster.account
    hardware: HardwareConfig = field(default_factory=HardwareConfig)   # step-time prediction (docs/perf.md)
    target_step_s: Optional[float] = None    # launch plan warns when the predicted step time exceeds it


@dataclass
class WandbConfig:
    mode: str = "offline"              # offline | online | disabled
    project: str = "hetrl"
    entity: Optional[str] = None


@dataclass
class EvalConfig:
    """Online evaluation (rl/orchestrator/evaluation.py, docs/eval.md): a held-out task set played by the
    current policy on the same servers, never trained on and never awaited by a training step."""
    every: int = 2                     # evaluate every `every` policy versions (and the final one); 0 = off
    tasks: int = 8                     # held-out tasks (a split of the environment's tasks, or the file's first N)
    tasks_file: Optional[str] = None   # held-out rows in the environment's task format (digits: JSONL; swe: docs/swe.md)
    # Sampled, not greedy: the embedded default's greedy pass@1 reached 1.0 by version 14 of 40 (the
    # mode is right long before the policy is), while pass@1 over 4 samples at the rollouts' temperature
    # measures the distribution RL trains and keeps moving (docs/eval.md)
    samples: int = 4                   # completions per task: pass@samples and mean reward over them
    temperature: float = 1.0           # 0 = greedy
    top_p: float = 1.0
    max_tokens: Optional[int] = None   # default: orchestrator.max_tokens
    max_concurrency: int = 4           # eval requests at once: its share beside the rollouts
    solved_reward: float = 1.0         # a completion with at least this reward solves its task (pass@k)
    final_timeout_s: float = 600.0     # the trainer waits at most this for the final version's evaluation


@dataclass
class Config:
    run_dir: str = MISSING
    seed: int = 0
    experiment: str = "debug"
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


def register() -> None:
    from hydra.core.config_store import ConfigStore
    ConfigStore.instance().store(name="schema", node=Config)


def structured(overrides: dict | None = None) -> DictConfig:
    """The schema with `overrides` merged on top: typed, unknown keys refused (for tests and tools)."""
    base = OmegaConf.structured(Config)
    if overrides:
        try:
            base = OmegaConf.merge(base, overrides)
        except Exception as e:  # noqa: BLE001 - OmegaConf's errors span lines; the key fits in one
            raise ConfigError(one_line(e)) from None
    return base


def typed(cfg) -> Config:
    """A composed config (dict or DictConfig; a Config is returned as is) as the schema's dataclasses:
    every key present and typed, the schema's defaults filling what a partial dict leaves out."""
    if isinstance(cfg, Config):
        return cfg
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    data = {k: v for k, v in cfg.items() if k not in ("hydra", "_overrides")}
    # OmegaConf's structured merge and to_object cost ~45 ms CPU per call (planning made 5); a dict that
    # already fits the schema is built directly, in ~0.3 ms
    # (rl.contract.typed_tree returns None for anything OmegaConf must convert or refuse)
    from rl.contract.typed_tree import build
    fast = build(Config, data)
    return fast if fast is not None else OmegaConf.to_object(structured(data))


def load(run_dir: str | os.PathLike) -> DictConfig:
    """The frozen config of a run as every role reads it: `RUN_DIR/config.yaml` on the schema."""
    from rl.contract import paths, safefs
    p = paths.config_file(run_dir)
    try:   # no link followed, a FIFO refused without blocking, someone else's file refused (safefs)
        text = safefs.read_text(p, limit=16 << 20)
    except FileNotFoundError:
        raise ConfigError(f"{p}: not found (is {run_dir} a run directory made by `python -m launch`?)") from None
    except safefs.UnsafePath as e:
        raise ConfigError(str(e)) from None
    cfg = structured(OmegaConf.to_container(OmegaConf.create(text)))
    OmegaConf.set_readonly(cfg, True)
    return cfg


def one_line(e: BaseException) -> str:
    """OmegaConf errors span several lines; the key and the reason fit in one."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    full = re.search(r"full_key: (\S+)", text)
    if full and full.group(1) not in first:
        first = f"{full.group(1)}: {first}"
    return first


def resolve_ports(c: dict, offset: int = 0) -> dict:
    """Fill ports left at 0 (auto) from a hash of run_dir, in place.

    Fixed ports collide as soon as two runs share a host: two local runs, a sweep on a non-exclusive
    partition, the localhost test cluster (vLLM binds with SO_REUSEPORT, so a second server on the same
    port silently shares it and requests land on the wrong run). Derived ports differ between runs,
    stay the same for one run (resume, requeue), and live below Linux's ephemeral range. A sweep passes
    the sweep dir as run_dir and each point's index as `offset`, so its points never collide.
    """
    import hashlib
    h = int(hashlib.sha1(str(c["run_dir"]).encode()).hexdigest(), 16)
    slot = (h + offset) % 700
    if not c["inference"].get("port"):
        c["inference"]["port"] = 15000 + slot * 20              # 15000..28980, room for 20 replicas
    if not c["inference"].get("router_port"):
        c["inference"]["router_port"] = 29000 + ((h >> 16) + offset) % 1500
    if not c["trainer"].get("master_port"):
        c["trainer"]["master_port"] = 30500 + ((h >> 32) + offset) % 1500
    return c


def to_container(cfg: DictConfig) -> dict:
    c = OmegaConf.to_container(cfg, resolve=True)
    c.pop("hydra", None)
    c.pop("_overrides", None)
    return c
