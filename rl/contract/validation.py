"""Validation of the typed config: every rule on the config alone, each written once.

`validate()` checks what the dataclasses of rl.contract.config cannot express (ranges, combinations,
names that must exist, Slurm's own formats) and raises `ConfigError` with one line naming the key. The
launcher runs it before planning (launch.plan), on `launch resume`, and on every composed point; the
roles trust the frozen config it passed. Kept apart from the schema so that the schema stays a short
read and the rules grow here.

A few rules look past the config, because what they guard would otherwise fail only after a Slurm
allocation is granted: a family's structural constraints from its row in rl.contract.families and the
checkpoint's config.json (context parallel must divide NemotronH's Mamba groups), and whether a
`verifiers:<id>` environment is installed for this interpreter (found on sys.path without importing it,
so planning stays torch-free and fast). The rules read the config as plain dicts typed by the schema
(rl.contract.typed_tree), not a DictConfig: planning validates twice and each DictConfig read is slow.
"""
from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rl.contract import backends, families, offpolicy, sandbox_runtimes
from rl.contract.config import FAMILIES, Config, ConfigError, structured
from rl.contract.typed_tree import build

_CHOICES = {
    "model.family": FAMILIES,
    "cluster.backend": backends.NAMES,
    "trainer.dtype": ("float32", "bfloat16"),
    "trainer.mismatch": ("mask", "truncate", "none", "is", "seq_truncate", "seq_mask", "geo_mask", "m2po"),
    "trainer.activation_checkpointing": ("none", "selective", "full"),
    "inference.dtype": ("float32", "bfloat16", "auto"),
    "inference.fp8_load": ("auto", "dequantize", "fp8"),
    "inference.kv_offload": (None, "cpu", "cpu+disk"),
    "inference.routing.policy": ("kv", "round_robin"),
    "inference.all2all_backend": ("auto", "naive", "allgather_reducescatter", "deepep_high_throughput",
                                  "deepep_low_latency", "pplx", "nixl_ep"),
    "orchestrator.advantage": ("grpo", "drgrpo"),
    "wandb.mode": ("offline", "online", "disabled"),
}
# Slurm's time formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS (sbatch --time).
_SLURM_TIME = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2})$")
# Account, partition, QOS and job names: no whitespace, quotes or shell metacharacters (they land in
# #SBATCH lines); constraints also take Slurm's operators.
_SLURM_NAME = re.compile(r"^[A-Za-z0-9_.+\-]+$")
_SLURM_CONSTRAINT = re.compile(r"^[A-Za-z0-9_.\-&|\[\]*:,()!]+$")
_GRES = re.compile(r"^[A-Za-z0-9_]+(:[A-Za-z0-9_]+)*(,[A-Za-z0-9_]+(:[A-Za-z0-9_]+)*)*$")


class _Tree(dict):
    """The config as plain dicts with attribute access (`cfg.model.n_heads`, `m[k]`): the rules below read
    a few hundred values, and a DictConfig's access costs ~20x a dict's (planning runs validate twice)."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    @classmethod
    def of(cls, value):
        if isinstance(value, dict):
            return cls({k: cls.of(v) for k, v in value.items()})
        if isinstance(value, list):
            return [cls.of(v) for v in value]
        return value


def _get(cfg, dotted: str):
    """The value at a dotted key, None where a part is missing (as OmegaConf.select)."""
    for part in dotted.split("."):
        if not isinstance(cfg, dict) or part not in cfg:
            return None
        cfg = cfg[part]
    return cfg


def _no_newline(key: str, value) -> None:
    if isinstance(value, str) and ("\n" in value or "\r" in value or "\0" in value):
        raise ConfigError(f"{key}: must not contain a newline or NUL (it would become a line of the batch script)")


def _not_a_number(tree, prefix: str = "") -> str | None:
    """The first key holding NaN: it compares false with everything, so no range rule below catches it
    (`eval.solved_reward=nan` would make every task unsolvable, silently)."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for k, v in items:
        key = f"{prefix}[{k}]" if isinstance(tree, list) else f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, float) and math.isnan(v):
            return key
        found = _not_a_number(v, key) if isinstance(v, (dict, list)) else None
        if found:
            return found
    return None


def _cp_groups(family: str, hf_path) -> tuple[int, str] | None:
    """(groups, where they come from) of the family's `cp_groups` row (rl.contract.families): from the
    checkpoint's config.json, or the tiny twin's sizes when no checkpoint is named; None when unknown here
    (no such key, or a site path this host does not see: the trainer's own check still holds)."""
    from rl.contract import hf
    row = families.BY_NAME.get(family)
    if row is None or not row.cp_groups:
        return None
    if hf_path:
        try:
            tc = hf.text_config(hf.read_config(hf_path))
        except (hf.CheckpointError, OSError, ValueError):
            return None
        where = f"{Path(str(hf_path)) / hf.CONFIG}"
    else:
        tc, where = row.twin, f"the {family} twin's sizes (rl.contract.families)"
    for key in row.cp_groups:
        if isinstance(tc.get(key), int) and tc[key] > 0:
            return tc[key], f"{key}={tc[key]} of {where}"
    return None


def _find_module(name: str) -> bool:
    """Whether module `name` can be imported, found without importing it or its parent packages (a
    verifiers environment's package may pull in torch or datasets; planning stays light)."""
    import importlib.machinery
    import importlib.util
    parts = name.split(".")
    if not all(p.isidentifier() for p in parts):
        return False
    for i in range(len(parts), 0, -1):   # the longest prefix already imported (or registered) here
        if ".".join(parts[:i]) in sys.modules:
            if i == len(parts):
                return True
            path = getattr(sys.modules[".".join(parts[:i])], "__path__", None)
            break
    else:
        i, spec = 1, importlib.util.find_spec(parts[0])   # a top-level name: nothing is imported
        if spec is None:
            return False
        path = spec.submodule_search_locations
    for j in range(i, len(parts)):
        if path is None:      # a module, not a package: it has no submodules
            return False
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:j + 1]), list(path))
        if spec is None:
            return False
        path = spec.submodule_search_locations
    return True


def verifiers_env_missing(name: str) -> str | None:
    """Why `env.name=verifiers:<id>` names no environment installed for this interpreter, or None.

    The id resolves as the adapter loads it (rl.envs.verifiers_adapter, verifiers' own plugin loader):
    `pkg.module:Class` names a module; `<id>` (also `owner/<id>@version`) is the built-in taskset
    `verifiers.v1.tasksets.<id>` or an installed module `<id>` (dashes as underscores, lower case)."""
    spec = name.split(":", 1)[1]
    if ":" in spec:
        module = spec.split(":", 1)[0]
        return None if _find_module(module) else f"no module {module!r} is installed"
    module = spec.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
    if _find_module(f"verifiers.v1.tasksets.{module}") or _find_module(module):
        return None
    return (f"no verifiers taskset {module!r} (neither a built-in verifiers.v1.tasksets.{module} nor an "
            f"installed module {module!r})")


def validate(cfg: DictConfig | dict) -> None:
    """Raise ConfigError naming the first key whose value cannot work."""
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    # Hydra's `+key=value` / `++key=value` add keys even to a struct config: every key must still be the
    # schema's, whatever form of override put it there. The rules read the schema-typed tree, defaults
    # filled in; OmegaConf's merge runs only where the fast path is unsure (rl.contract.typed_tree).
    data = {k: v for k, v in cfg.items() if k not in ("hydra", "_overrides")}
    fast = build(Config, data)
    if fast is not None:
        import dataclasses
        plain = dataclasses.asdict(fast)
    else:
        plain = OmegaConf.to_container(structured(data), resolve=True)
    cfg = _Tree.of(plain)
    nan = _not_a_number(plain)
    if nan:
        raise ConfigError(f"{nan}=nan: must be a number (NaN compares false with everything)")

    def need(cond: bool, key: str, msg: str):
        if not cond:
            raise ConfigError(f"{key}={_get(cfg, key)!r}: {msg}")

    for key, allowed in _CHOICES.items():
        need(_get(cfg, key) in allowed, key, f"must be one of {', '.join(map(str, allowed))}")
    need(bool(str(cfg.run_dir)), "run_dir", "must be a path")
    need(cfg.seed >= 0, "seed", "must be >= 0")
    m = cfg.model
    for k in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "moe_hidden_dim",
              "num_experts", "top_k", "max_seq_len"):
        need(m[k] > 0, f"model.{k}", "must be positive")
    for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
              "n_shared_experts", "n_dense_layers", "dense_hidden_dim", "index_n_heads", "index_head_dim",
              "index_topk"):
        need(m[k] >= 0, f"model.{k}", "must be >= 0")
    need(m.rope_theta > 0, "model.rope_theta", "must be positive")
    need(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads", f"must divide model.n_heads={m.n_heads}")
    need(m.top_k <= m.num_experts, "model.top_k", f"cannot exceed model.num_experts={m.num_experts}")
    need(m.n_dense_layers < m.n_layers, "model.n_dense_layers", f"must leave MoE layers of model.n_layers={m.n_layers}")
    need(m.n_dense_layers == 0 or m.dense_hidden_dim > 0, "model.dense_hidden_dim",
         "must be positive with model.n_dense_layers > 0")
    if m.kv_lora_rank > 0:
        for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            need(m[k] > 0, f"model.{k}", "must be positive with multi-head latent attention (model.kv_lora_rank > 0)")
        need(m.head_dim == m.qk_nope_head_dim + m.qk_rope_head_dim, "model.head_dim",
             f"must be qk_nope_head_dim + qk_rope_head_dim = {m.qk_nope_head_dim + m.qk_rope_head_dim} with MLA")
    need((m.index_topk > 0) == (m.index_n_heads > 0) == (m.index_head_dim > 0), "model.index_topk",
         "the sparse-attention indexer needs index_topk, index_n_heads and index_head_dim (all or none)")
    need(m.hf_path is None or bool(str(m.hf_path)), "model.hf_path", "must be a path or null")
    t = cfg.trainer
    need(t.max_steps > 0, "trainer.max_steps", "must be positive")
    need(t.lr > 0, "trainer.lr", "must be positive")
    need(t.weight_decay >= 0, "trainer.weight_decay", "must be >= 0")
    need(t.grad_clip > 0, "trainer.grad_clip", "must be positive (the max gradient norm)")
    need(t.micro_batch_tokens > 0, "trainer.micro_batch_tokens", "must be positive")
    need(t.checkpoint_every > 0, "trainer.checkpoint_every", "must be positive")
    need(t.keep_checkpoints >= 1, "trainer.keep_checkpoints", "must keep at least one checkpoint")
    need(t.publish_timeout_s > 0, "trainer.publish_timeout_s", "must be positive (seconds rank 0 waits "
         "for the other ranks' shards)")
    need(t.weights_full_every >= 0, "trainer.weights_full_every", "must be >= 0 (0: every version full)")
    need(0 < t.delta_max_fraction <= 1, "trainer.delta_max_fraction", "must be in (0, 1]")
    need(t.keep_weights >= cfg.orchestrator.max_off_policy + 1, "trainer.keep_weights",
         f"must be at least orchestrator.max_off_policy + 1 = {cfg.orchestrator.max_off_policy + 1}")
    need(0 < t.ratio_min <= 1 <= t.ratio_max, "trainer.ratio_max", "need 0 < ratio_min <= 1 <= ratio_max")
    need(0 < t.geo_ratio_min <= 1 <= t.geo_ratio_max, "trainer.geo_ratio_max",
         "need 0 < geo_ratio_min <= 1 <= geo_ratio_max")
    need(t.m2_threshold > 0, "trainer.m2_threshold", "must be positive (the kept tokens' mean (log r)^2)")
    need(len(t.betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in t.betas),
         "trainer.betas", "two values in [0, 1)")
    need(t.warm_start.steps >= 0, "trainer.warm_start.steps", "must be >= 0")
    need(t.warm_start.lr > 0, "trainer.warm_start.lr", "must be positive")
    need(t.warm_start.batch_size >= 1, "trainer.warm_start.batch_size", "must be positive")
    need(t.nodes >= 1, "trainer.nodes", "must be at least 1")
    need(t.gpus_per_node >= 0, "trainer.gpus_per_node", "must be >= 0 (0 = CPU ranks)")
    need(t.master_port == 0 or 1024 <= t.master_port <= 65535, "trainer.master_port",
         "must be 0 (auto) or a TCP port in [1024, 65535]")
    p = t.parallel
    for k in ("dp_shard", "ep", "cp"):
        need(p[k] >= 1, f"trainer.parallel.{k}", "must be at least 1")
    need(m.num_experts % p.ep == 0, "trainer.parallel.ep", f"must divide model.num_experts={m.num_experts}")
    need(p.ep == 1 or m.family not in families.FAMILIES or families.get(m.family).trainer_expert_parallel,
         "trainer.parallel.ep", f"must be 1 for model.family={m.family}: its trainer network has no expert "
         "parallelism yet (experts are FSDP-sharded with their block)")
    need(m.max_seq_len % (2 * p.cp) == 0 or p.cp == 1, "trainer.parallel.cp",
         f"2*cp must divide model.max_seq_len={m.max_seq_len} (load-balanced context parallel)")
    groups = _cp_groups(m.family, m.hf_path) if p.cp > 1 else None
    need(groups is None or groups[0] % p.cp == 0, "trainer.parallel.cp",
         f"must divide {groups and groups[1]}: model.family={m.family}'s context parallel gives each cp rank "
         "whole groups (found before any allocation; the trainer would stop there)")
    o = cfg.orchestrator
    need(o.max_off_policy >= 0, "orchestrator.max_off_policy", "must be >= 0")
    need(o.group_size >= 2, "orchestrator.group_size", "group-relative advantages need at least 2 samples")
    need(o.prompts_per_step >= 1, "orchestrator.prompts_per_step", "must be positive")
    need(o.max_tokens >= 1, "orchestrator.max_tokens", "must be positive")
    need(o.max_tokens < cfg.inference.max_model_len, "orchestrator.max_tokens",
         f"must be below inference.max_model_len={cfg.inference.max_model_len}")
    need(o.max_concurrency >= 1, "orchestrator.max_concurrency", "must be at least 1 (0 never sends a request)")
    need(o.request_timeout_s > 0, "orchestrator.request_timeout_s", "must be positive")
    need(0 < o.top_p <= 1, "orchestrator.top_p", "must be in (0, 1]")
    need(o.max_rollout_tokens is None or 0 < o.max_rollout_tokens <= cfg.inference.max_model_len,
         "orchestrator.max_rollout_tokens",
         f"must be in 1..inference.max_model_len={cfg.inference.max_model_len}")
    need(o.rollout_timeout_s is None or o.rollout_timeout_s > 0, "orchestrator.rollout_timeout_s",
         "must be positive (or null for no limit)")
    need(o.env_concurrency >= 1, "orchestrator.env_concurrency", "must be at least 1")
    need(o.schedule in ("continuous", "batch"), "orchestrator.schedule", "must be continuous or batch")
    need(o.max_inflight is None or o.max_inflight >= o.group_size, "orchestrator.max_inflight",
         f"counts rollouts (not groups, since issue 25): must be at least group_size={o.group_size} "
         "(or null for prompts_per_step * group_size * (max_off_policy + 1))")
    need(o.stale_policy in offpolicy.STALE_POLICIES, "orchestrator.stale_policy",
         f"must be one of {', '.join(offpolicy.STALE_POLICIES)}")
    need(not o.release_on_wait or offpolicy.stale_policy(o.stale_policy).trains_parts, "orchestrator.release_on_wait",
         f"applies only with orchestrator.stale_policy=release (it is {o.stale_policy}, which would ignore it): "
         "drop the override or set stale_policy=release")
    need(o.slot_order in ("oldest", "fifo"), "orchestrator.slot_order", "must be oldest or fifo")
    need(o.drain_timeout_s > 0, "orchestrator.drain_timeout_s", "must be positive")
    dg = cfg.env.digits
    need(dg.latency_median_s >= 0, "env.digits.latency_median_s", "must be >= 0")
    need(dg.latency_sigma >= 0, "env.digits.latency_sigma", "must be >= 0")
    need(0 <= dg.latency_outlier_prob <= 1, "env.digits.latency_outlier_prob", "must be in [0, 1]")
    need(dg.latency_outlier_factor >= 1, "env.digits.latency_outlier_factor", "must be >= 1")
    need(o.temperature > 0, "orchestrator.temperature", "must be positive (RL samples the policy)")
    ev = cfg.eval
    need(ev.every >= 0, "eval.every", "must be >= 0 (0 turns online evaluation off)")
    need(ev.tasks >= 1, "eval.tasks", "must be at least 1")
    need(ev.samples >= 1, "eval.samples", "must be at least 1 (pass@samples)")
    need(ev.temperature >= 0, "eval.temperature", "must be >= 0 (0 = greedy)")
    need(0 < ev.top_p <= 1, "eval.top_p", "must be in (0, 1]")
    need(ev.max_tokens is None or 1 <= ev.max_tokens < cfg.inference.max_model_len, "eval.max_tokens",
         f"must be in [1, inference.max_model_len={cfg.inference.max_model_len})")
    need(ev.max_concurrency >= 1, "eval.max_concurrency", "must be at least 1")
    need(ev.final_timeout_s >= 0, "eval.final_timeout_s", "must be >= 0")
    need(math.isfinite(ev.solved_reward), "eval.solved_reward",
         "must be a finite reward (a completion with at least this reward solves its task)")
    if ev.every and ev.tasks_file:
        need(Path(str(ev.tasks_file)).is_file() and os.access(str(ev.tasks_file), os.R_OK), "eval.tasks_file",
             "is not a readable file")
        need(cfg.env.name in ("digits", "swe"), "eval.tasks_file",
             f"env.name={cfg.env.name} reads no task file; leave it unset to hold out a split of its tasks")
    e = cfg.env
    need(e.name in ("digits", "swe", "echo_tools") or (e.name.startswith("verifiers:") and len(e.name) > len("verifiers:")),
         "env.name", "must be digits, swe, echo_tools or verifiers:<id>")
    if e.name.startswith("verifiers:") and len(e.name) > len("verifiers:") and not _other_python(cfg):
        missing = verifiers_env_missing(e.name)
        need(missing is None, "env.name", f"{missing} for {sys.executable}: install the environment's "
             "package, or name its class as verifiers:package.module:Class")
    need(e.max_turns >= 1, "env.max_turns", "must be at least 1")
    if e.summarize_at_tokens:
        th, budget = list(e.summarize_at_tokens), min(o.max_rollout_tokens or cfg.inference.max_model_len,
                                                      cfg.inference.max_model_len)
        need(all(t > 0 for t in th) and th == sorted(set(th)), "env.summarize_at_tokens",
             "must be positive token counts in increasing order")
        need(th[-1] < budget, "env.summarize_at_tokens",
             f"the last threshold must be below the context budget {budget} (orchestrator.max_rollout_tokens "
             "/ inference.max_model_len), or it never fires")
        need(e.max_turns >= 2, "env.summarize_at_tokens", "summarizes multi-turn episodes only (env.max_turns >= 2)")
        need(bool(str(e.summary_prompt).strip()), "env.summary_prompt", "must not be empty when env.summarize_at_tokens is set")
    need(not e.args or e.name.startswith("verifiers:"), "env.args",
         f"is for verifiers:<id> environments only (env.name={e.name}: use env.{e.name}.*)")
    need(e.digits.n_digits >= 1, "env.digits.n_digits", "must be at least 1")
    need(0 <= e.digits.warm_start_accuracy <= 1, "env.digits.warm_start_accuracy", "must be in [0, 1]")
    need(e.swe.wall_s > 0, "env.swe.wall_s", "must be positive")
    need(e.swe.tool_timeout_s > 0, "env.swe.tool_timeout_s", "must be positive")
    need(e.swe.output_chars > 0, "env.swe.output_chars", "must be positive")
    for k, v in e.swe.limits.items():
        need(v > 0, f"env.swe.limits.{k}", "must be positive")
    if e.name == "swe" and e.swe.tasks and e.swe.tasks not in ("builtin", "builtin_swebench"):
        # On Slurm the orchestrator reads it on its node: a site filesystem this host does not mount at
        # all (/datasets/... on a laptop) is left to it; a missing path on a mounted one is a typo here.
        t = Path(e.swe.tasks)
        visible = (backends.row(cfg.cluster.backend).roles_on_launch_host or not t.is_absolute()
                   or Path(*t.parts[:2]).exists())
        need(not visible or t.exists(), "env.swe.tasks",
             "file or directory not found (nor a shipped set: builtin, builtin_swebench)")
    need(e.swe.format in ("auto", "swe_bench", "swe_smith", "swe_rebench", "r2e_gym"), "env.swe.format",
         "must be auto, swe_bench, swe_smith, swe_rebench or r2e_gym")
    need(e.swe.runtime in sandbox_runtimes.NAMES, "env.swe.runtime", f"must be {sandbox_runtimes.names_text()}")
    need(e.swe.max_sandbox_starts_per_s > 0, "env.swe.max_sandbox_starts_per_s", "must be positive")
    need(not sandbox_runtimes.get(e.swe.runtime).needs_image_cache or bool(e.swe.image_cache), "env.swe.image_cache",
         f"must be set for env.swe.runtime={e.swe.runtime} (a directory on the shared filesystem for the SIFs)")
    if e.swe.image_cache:
        cache = os.path.realpath(str(e.swe.image_cache))
        need(os.path.isabs(str(e.swe.image_cache)), "env.swe.image_cache", "must be an absolute path")
        need(not any(cache == d or cache.startswith(d + "/") for d in ("/tmp", "/var/tmp", "/dev/shm")),
             "env.swe.image_cache", "node-local scratch (/tmp, /var/tmp, /dev/shm) "
             "is refused: SIFs are built once and shared, put them on the shared filesystem")
    i = cfg.inference
    need(i.port == 0 or 1024 <= i.port <= 65535 - 64, "inference.port", "must be 0 (auto) or a TCP port in [1024, 65471]")
    need(i.router_port == 0 or 1024 <= i.router_port <= 65535, "inference.router_port",
         "must be 0 (auto) or a TCP port in [1024, 65535]")
    need(1024 <= i.dp_rpc_port <= 65535 - 64, "inference.dp_rpc_port", "must be a TCP port in [1024, 65471]")
    need(i.kv_cache_gb > 0, "inference.kv_cache_gb", "must be positive")
    need(0 < i.gpu_memory_utilization <= 1, "inference.gpu_memory_utilization", "must be in (0, 1]")
    need(i.startup_timeout_s > 0, "inference.startup_timeout_s", "must be positive")
    need(i.max_model_len <= m.max_seq_len, "inference.max_model_len",
         f"cannot exceed model.max_seq_len={m.max_seq_len}")
    need(i.kv_offload_cpu_gb >= 0 and i.kv_offload_disk_gb >= 0, "inference.kv_offload_cpu_gb", "must be >= 0")
    need(i.kv_offload not in ("cpu", "cpu+disk") or i.kv_offload_cpu_gb > 0, "inference.kv_offload_cpu_gb",
         f"must be positive with inference.kv_offload={i.kv_offload}")
    need(i.kv_offload != "cpu+disk" or i.kv_offload_disk_gb > 0, "inference.kv_offload_disk_gb",
         "must be positive with inference.kv_offload=cpu+disk")
    need(i.nodes >= 1, "inference.nodes", "must be at least 1 (the orchestrator runs there)")
    need(i.gpus_per_node >= 0, "inference.gpus_per_node", "must be >= 0 (0 = CPU servers)")
    for k in ("tp", "dp", "ep", "replicas"):
        need(i[k] >= 1, f"inference.{k}", "must be at least 1")
    need(i.ep in (1, i.tp * i.dp), "inference.ep",
         f"vLLM's expert parallel spans the whole replica: ep must be 1 or tp*dp={i.tp * i.dp}")
    need(m.num_experts % i.ep == 0, "inference.ep", f"must divide model.num_experts={m.num_experts}")
    need(m.n_kv_heads % i.tp == 0 or i.tp % m.n_kv_heads == 0, "inference.tp",
         f"must divide or be a multiple of model.n_kv_heads={m.n_kv_heads}")
    need(all(isinstance(a, (str, int, float)) for a in i.extra_args), "inference.extra_args",
         "must be a list of strings")
    r = i.routing
    for k in ("block_tokens", "text_block_chars", "max_queue", "index_blocks", "max_sessions", "fail_after"):
        need(r[k] >= 1, f"inference.routing.{k}", "must be at least 1")
    for k in ("chars_per_token", "poll_interval_s", "metrics_stale_s", "request_timeout_s"):
        need(r[k] > 0, f"inference.routing.{k}", "must be positive")
    need(0 < r.kv_full <= 1, "inference.routing.kv_full", "must be in (0, 1]")
    c = cfg.cluster
    need(c.signal_grace_s >= 10, "cluster.signal_grace_s", "leave at least 10 s to checkpoint")
    need(c.max_restarts >= 0, "cluster.max_restarts", "must be >= 0 (0: never requeue)")
    need(c.max_role_restarts >= 0, "cluster.max_role_restarts",
         "must be >= 0 (0: a failed inference server is not restarted in place)")
    need(0 < c.min_inference_fraction <= 1, "cluster.min_inference_fraction", "must be in (0, 1]")
    need(c.stall_timeout_s >= 0, "cluster.stall_timeout_s", "must be >= 0 (0: no watchdog)")
    need(bool(_SLURM_TIME.match(str(c.time))), "cluster.time",
         "must be a Slurm time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS")
    for k in ("account", "partition", "qos", "job_name"):
        need(c[k] is None or bool(_SLURM_NAME.match(str(c[k]))), f"cluster.{k}",
             "must be a Slurm name: letters, digits, _ . + - (no spaces or quotes)")
    need(c.constraint is None or bool(_SLURM_CONSTRAINT.match(str(c.constraint))), "cluster.constraint",
         "is not a Slurm constraint expression (features joined by & | , with [] and *N counts)")
    need(c.gres is None or bool(_GRES.match(str(c.gres))), "cluster.gres",
         "must be a Slurm GRES spec like gpu:8 or gpu:h200:8")
    need(c.gpu_memory_gib > 0, "cluster.gpu_memory_gib", "must be positive")
    need(c.host_memory_gib >= 0, "cluster.host_memory_gib", "must be >= 0 (0 = not checked)")
    need(c.sandbox_nodes >= 0, "cluster.sandbox_nodes", "must be >= 0 (0: sandboxes on the orchestrator's "
         "node)")
    need(c.sandbox_nodes == 0 or e.name == "swe", "cluster.sandbox_nodes",
         f"sandbox nodes serve SWE sandboxes; env.name={e.name} has none (set cluster.sandbox_nodes=0)")
    for k in ("sandbox_partition", "sandbox_account"):
        need(c[k] is None or bool(_SLURM_NAME.match(str(c[k]))), f"cluster.{k}",
             "must be a Slurm name: letters, digits, _ . + - (no spaces or quotes)")
    need(str(c.node_local_dir).startswith("/"), "cluster.node_local_dir", "must be an absolute path")
    need(c.python is None or str(c.python).startswith("/") or "/" not in str(c.python), "cluster.python",
         "must be an absolute path or a command name on PATH")
    for key in ("run_dir", "experiment", "model.name", "model.hf_path", "cluster.node_local_dir",
                "cluster.python", "env.swe.tasks", "env.swe.repos_dir", "env.swe.image_cache", "inference.host"):
        _no_newline(key, _get(cfg, key))
    for key in ("cluster.setup", "cluster.extra_sbatch", "inference.extra_args"):
        for n, line in enumerate(_get(cfg, key) or []):
            _no_newline(f"{key}[{n}]", line)
    hw = c.hardware
    need(hw.gpu in ("h100", "h200"), "cluster.hardware.gpu", "must be one of h100, h200 (docs/perf.md)")
    for k in ("bf16_tflops", "fp8_tflops", "hbm_gbps", "nvlink_gbps", "nic_gbps", "pcie_gbps", "host_mem_gbps",
              "fs_read_gbps", "fs_write_gbps", "fs_total_gbps", "checksum_gbps"):
        need(hw[k] is None or hw[k] > 0, f"cluster.hardware.{k}", "must be positive (or null: the preset's)")
    for k in ("mfu", "inference_mfu", "hbm_efficiency"):
        need(hw[k] is None or 0 < hw[k] <= 1, f"cluster.hardware.{k}", "must be in (0, 1] (or null: the preset's)")
    need(c.target_step_s is None or c.target_step_s > 0, "cluster.target_step_s", "must be positive (or null)")
    cap = backends.row(c.backend).max_cpu_ranks
    if cap is not None:
        need(p.dp_shard * p.ep * p.cp <= cap or t.gpus_per_node > 0, "trainer.parallel",
             f"the {c.backend} backend runs at most {cap} CPU ranks")


def _other_python(cfg) -> bool:
    """Whether the roles run another interpreter (cluster.python) than this one, whose installed packages
    this process cannot see: then a verifiers environment is resolved by the orchestrator alone."""
    import shutil
    py = _get(cfg, "cluster.python")
    if not py:
        return False
    found = str(py) if "/" in str(py) else shutil.which(str(py))
    return found is None or os.path.realpath(found) != os.path.realpath(sys.executable)


def check_run_dir(run_dir: str | os.PathLike) -> None:
    """A run directory that can be created and written, before anything is submitted or started."""
    p = Path(run_dir)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"run_dir={str(p)!r}: exists and is not a directory")
    probe = p
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"run_dir={str(p)!r}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"run_dir={str(p)!r}: {probe} is not writable")


