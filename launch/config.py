"""Structured configs: the schema of every key a run can set, and its validation.

Hydra composes `conf/` into one tree; the dataclasses below are registered in Hydra's ConfigStore as the
schema of the base config, so an unknown key or a value of the wrong type is refused by OmegaConf with
the key's full name. `validate()` then checks what types cannot express (ranges, combinations) and
raises `ConfigError` with a one-line message naming the key. Everything here is light: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""


@dataclass
class ModelConfig:
    name: str = "tiny-qwen3-moe"
    family: str = "qwen3"             # torchtitan model family
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
    total_params: str = "0.2M"        # informational, for plans and logs


@dataclass
class ParallelConfig:
    dp_shard: int = 1
    ep: int = 1
    cp: int = 1


@dataclass
class WarmStartConfig:
    steps: int = 0                     # supervised steps on env.sft_examples before RL (tiny model only)
    lr: float = 3e-3
    batch_size: int = 32


@dataclass
class TrainerConfig:
    max_steps: int = 30
    lr: float = 2e-3
    weight_decay: float = 0.0
    betas: list = field(default_factory=lambda: [0.9, 0.99])
    grad_clip: float = 1.0
    micro_batch_tokens: int = 4096
    dtype: str = "float32"             # compute dtype of the trainer (fp32 on CPU)
    fp8: bool = False                  # block-scaled FP8 training (emulated on CPU)
    router_replay: bool = False        # R3: MoE routers use the batch's recorded expert ids (rl.trainer.replay)
    checkpoint_every: int = 5
    keep_checkpoints: int = 2
    keep_weights: int = 3
    # loss
    loss: str = "is_pg"                # importance-sampled policy gradient (token level)
    mismatch: str = "mask"             # mask | truncate | none: handling of trainer/inference mismatch
    ratio_max: float = 2.0             # tokens with importance ratio above this are masked / truncated
    ratio_min: float = 0.5
    kl_coef: float = 0.0
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    nodes: int = 1
    gpus_per_node: int = 0
    master_port: int = 0               # torch.distributed rendezvous port on the first trainer node (0 = auto)


@dataclass
class InferenceConfig:
    engine: str = "vllm"
    host: str = "127.0.0.1"
    port: int = 0                      # first server's port, +1 per replica (0 = auto, derived from run_dir)
    dtype: str = "float32"
    max_model_len: int = 512
    kv_cache_gb: float = 1.0
    enforce_eager: bool = True
    fp8_load: str = "auto"             # auto | dequantize | fp8: how shards enter the engine
    startup_timeout_s: float = 600.0
    extra_args: list = field(default_factory=list)
    nodes: int = 1
    gpus_per_node: int = 0
    tp: int = 1
    dp: int = 1
    ep: int = 1
    replicas: int = 1
    prefill_nodes: int = 0
    decode_nodes: int = 0
    kv_offload: Optional[str] = None   # None | cpu | cpu+disk
    router: bool = False
    # Added for the Slurm plan (launch/plan.py):
    router_port: int = 0               # the router's port on the first inference node (0 = auto)
    dp_rpc_port: int = 13345           # base of vLLM's data-parallel RPC ports (one per multi-node replica)
    all2all_backend: str = "auto"      # vLLM --all2all-backend with EP; auto: DeepEP (HT prefill, LL decode)
    kv_offload_cpu_gb: float = 0.0     # CPU tier of the KV offload, per server (needs kv_offload)
    kv_offload_disk_gb: float = 0.0    # disk tier (kv_offload=cpu+disk), under cluster.node_local_dir


@dataclass
class OrchestratorConfig:
    max_off_policy: int = 1
    prompts_per_step: int = 16
    group_size: int = 8
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    max_concurrency: int = 64
    request_timeout_s: float = 300.0
    advantage: str = "grpo"            # grpo (group mean baseline, std normalised) | drgrpo (no std)
    drop_zero_advantage_groups: bool = False
    # Multi-turn rollouts (envs with episodes, rl/orchestrator/multiturn.py). max_tokens above is per
    # model turn there; env.max_turns caps the turns.
    max_rollout_tokens: Optional[int] = None   # prompt + turns + observations; None = inference.max_model_len
    rollout_timeout_s: Optional[float] = None  # wall time of one rollout; None = no limit
    env_concurrency: int = 8                   # environment calls (tool runs, grading) at once


@dataclass
class EnvConfig:
    name: str = "digits"
    n_digits: int = 3
    max_turns: int = 1
    args: dict = field(default_factory=dict)


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
    extra_sbatch: list = field(default_factory=list)
    python: Optional[str] = None       # interpreter the roles run with (default: the launcher's)
    node_local_dir: str = "/tmp/hetrl"
    # Added for the Slurm plan (launch/plan.py):
    exclusive: bool = True             # whole nodes per het component (#SBATCH --exclusive)
    job_name: Optional[str] = None     # default: hetrl-<experiment>
    setup: list = field(default_factory=list)  # shell lines the batch script runs first (module load ...)


@dataclass
class WandbConfig:
    mode: str = "offline"              # offline | online | disabled
    project: str = "hetrl"
    entity: Optional[str] = None


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


def register() -> None:
    from hydra.core.config_store import ConfigStore
    cs = ConfigStore.instance()
    cs.store(name="schema", node=Config)


_CHOICES = {
    "cluster.backend": ("local", "slurm"),
    "trainer.dtype": ("float32", "bfloat16"),
    "trainer.loss": ("is_pg",),
    "trainer.mismatch": ("mask", "truncate", "none"),
    "inference.dtype": ("float32", "bfloat16", "auto"),
    "inference.fp8_load": ("auto", "dequantize", "fp8"),
    "inference.kv_offload": (None, "cpu", "cpu+disk"),
    "orchestrator.advantage": ("grpo", "drgrpo"),
    "wandb.mode": ("offline", "online", "disabled"),
}


def _get(cfg, dotted: str):
    return OmegaConf.select(cfg, dotted)


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError naming the first key whose value cannot work."""
    def need(cond: bool, key: str, msg: str):
        if not cond:
            raise ConfigError(f"{key}={_get(cfg, key)!r}: {msg}")

    for key, allowed in _CHOICES.items():
        need(_get(cfg, key) in allowed, key, f"must be one of {', '.join(map(str, allowed))}")
    need(bool(str(cfg.run_dir)), "run_dir", "must be a path")
    m = cfg.model
    for k in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "moe_hidden_dim",
              "num_experts", "top_k", "max_seq_len"):
        need(m[k] > 0, f"model.{k}", "must be positive")
    need(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads", f"must divide model.n_heads={m.n_heads}")
    need(m.top_k <= m.num_experts, "model.top_k", f"cannot exceed model.num_experts={m.num_experts}")
    t = cfg.trainer
    need(t.max_steps > 0, "trainer.max_steps", "must be positive")
    need(t.lr > 0, "trainer.lr", "must be positive")
    need(t.checkpoint_every > 0, "trainer.checkpoint_every", "must be positive")
    need(t.keep_checkpoints >= 1, "trainer.keep_checkpoints", "must keep at least one checkpoint")
    need(t.keep_weights >= cfg.orchestrator.max_off_policy + 1, "trainer.keep_weights",
         f"must be at least orchestrator.max_off_policy + 1 = {cfg.orchestrator.max_off_policy + 1}")
    need(0 < t.ratio_min <= 1 <= t.ratio_max, "trainer.ratio_max", "need ratio_min <= 1 <= ratio_max")
    need(len(t.betas) == 2 and all(0 <= b < 1 for b in t.betas), "trainer.betas", "two values in [0, 1)")
    p = t.parallel
    for k in ("dp_shard", "ep", "cp"):
        need(p[k] >= 1, f"trainer.parallel.{k}", "must be at least 1")
    need(m.num_experts % p.ep == 0, "trainer.parallel.ep", f"must divide model.num_experts={m.num_experts}")
    need(m.max_seq_len % (2 * p.cp) == 0 or p.cp == 1, "trainer.parallel.cp",
         f"2*cp must divide model.max_seq_len={m.max_seq_len} (load-balanced context parallel)")
    o = cfg.orchestrator
    need(o.max_off_policy >= 0, "orchestrator.max_off_policy", "must be >= 0")
    need(o.group_size >= 2, "orchestrator.group_size", "group-relative advantages need at least 2 samples")
    need(o.prompts_per_step >= 1, "orchestrator.prompts_per_step", "must be positive")
    need(o.max_tokens >= 1, "orchestrator.max_tokens", "must be positive")
    need(o.max_tokens < cfg.inference.max_model_len, "orchestrator.max_tokens",
         f"must be below inference.max_model_len={cfg.inference.max_model_len}")
    need(0 < o.top_p <= 1, "orchestrator.top_p", "must be in (0, 1]")
    need(o.max_rollout_tokens is None or 0 < o.max_rollout_tokens <= cfg.inference.max_model_len,
         "orchestrator.max_rollout_tokens",
         f"must be in 1..inference.max_model_len={cfg.inference.max_model_len}")
    need(o.rollout_timeout_s is None or o.rollout_timeout_s > 0, "orchestrator.rollout_timeout_s",
         "must be positive (or null for no limit)")
    need(o.env_concurrency >= 1, "orchestrator.env_concurrency", "must be at least 1")
    need(cfg.env.max_turns >= 1, "env.max_turns", "must be at least 1")
    need(o.temperature > 0, "orchestrator.temperature", "must be positive (RL samples the policy)")
    i = cfg.inference
    need(i.port == 0 or 1024 <= i.port <= 65535 - 64, "inference.port", "must be 0 (auto) or a TCP port in [1024, 65471]")
    need(i.kv_cache_gb > 0, "inference.kv_cache_gb", "must be positive")
    need(i.max_model_len <= m.max_seq_len, "inference.max_model_len",
         f"cannot exceed model.max_seq_len={m.max_seq_len}")
    need(cfg.cluster.signal_grace_s >= 10, "cluster.signal_grace_s", "leave at least 10 s to checkpoint")
    if cfg.cluster.backend == "local":
        need(p.dp_shard * p.ep * p.cp <= 2 or t.gpus_per_node > 0, "trainer.parallel",
             "the local backend runs at most 2 CPU ranks")


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
