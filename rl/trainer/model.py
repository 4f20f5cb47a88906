"""The trainer's network: torchtitan's Qwen3-MoE built from `cfg.model`, its HF names, its logprobs.

The model group of the config (dim, n_layers, heads, experts, ...) becomes a torchtitan qwen3 *flavor*
registered under `hetrl:<model.name>` and assembled with torchtitan's own qwen3 layer builders, so the
ModelSpec that comes back carries torchtitan's parallelize function and state-dict adapter: FSDP / EP /
CP (`trainer.parallel`, rl.trainer.parallel) go through `spec.parallelize_fn` without touching this module.

Differences from torchtitan's stock MoE flavors, all to be the exact network of the HF config written
by `rl.model.tiny.hf_config` (Qwen3MoeForCausalLM, which is what vLLM serves):
- no weight tying (tie_word_embeddings false);
- softmax router with top-k renormalisation (norm_topk_prob true), as torchtitan's qwen3 MoE already is;
- no auxiliary-loss-free expert bias (`load_balance_coeff=None`): HF Qwen3-MoE has no such bias, and a
  bias only the trainer sees would route tokens differently from inference.

The model is built on the meta device, moved with `to_empty` and initialised by torchtitan's
`init_weights` under `set_default_dtype` (casting afterwards with `.to(dtype)` breaks the RoPE cache).
On the CPU the flex attention and bf16 grouped experts are swapped for `rl.trainer.cpu`'s versions.
Every router is `rl.trainer.replay.ReplayRouter` (torchtitan's, able to replay recorded expert ids);
`fp8=True` routes attention and expert GEMMs through `rl.trainer.fp8`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from rl.trainer import cpu, replay

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def network_config(m: Mapping[str, Any]) -> dict:
    """The HF config.json (text tower) that defines the network of model config `m`.

    With `model.hf_path` it is the checkpoint's; otherwise the one `rl.model.tiny.write_hf_assets` writes
    for a model created here (the same architecture keys; token ids do not change the network).
    """
    from rl.contract import hf
    if m.get("hf_path"):
        return hf.text_config(hf.read_config(m["hf_path"]))
    from rl.model.tiny import hf_config
    return hf_config(m, int(m["vocab_size"]), 0, 0)


def _rms_eps(cfg, eps: float) -> None:
    """Every RMSNorm config under `cfg` gets the checkpoint's epsilon (torchtitan defaults to 1e-5)."""
    import dataclasses
    from torchtitan.models.common import RMSNorm
    seen = set()

    def walk(c):
        if id(c) in seen or not dataclasses.is_dataclass(c):
            return
        seen.add(id(c))
        if isinstance(c, RMSNorm.Config):
            c.eps = eps
        for f in dataclasses.fields(c):
            v = getattr(c, f.name, None)
            for x in (v if isinstance(v, (list, tuple)) else [v]):
                walk(x)
    walk(cfg)


def _qwen3(m: Mapping[str, Any], h: Mapping[str, Any]):
    """torchtitan qwen3 flavor function (attn_backend, moe_comm_backend) -> Qwen3Model.Config for HF `h`."""
    from rl.contract.hf import model_fields, rope_scaling, rope_theta
    from torchtitan.models import qwen3 as q3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    if rope_scaling(h):
        raise ValueError(f"config.json rope scaling {rope_scaling(h)} is not supported for family qwen3")
    f = model_fields(h, "qwen3")

    def build(attn_backend: str, moe_comm_backend: str = "standard"):
        dim, vocab = f["dim"], f["vocab_size"]
        cfg = q3.Qwen3Model.Config(
            vocab_size=vocab, dim=dim, norm=q3._qwen3_norm(dim), enable_weight_tying=bool(h.get("tie_word_embeddings")),
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                            param_init=q3._EMBEDDING_INIT),
            lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=q3._LINEAR_INIT),
            layers=q3._build_qwen3_moe_layers(
                n_layers=f["n_layers"], dim=dim, n_heads=f["n_heads"], n_kv_heads=f["n_kv_heads"],
                head_dim=f["head_dim"], moe_hidden_dim=f["moe_hidden_dim"], num_experts=f["num_experts"],
                top_k=f["top_k"], attn_backend=attn_backend, moe_comm_backend=moe_comm_backend,
                rope=CosSinRoPE.Config(dim=f["head_dim"], max_seq_len=int(m["max_seq_len"]),
                                       theta=rope_theta(h))))
        for layer in cfg.layers:
            # HF Qwen3-MoE has no expert bias: one only the trainer saw would route unlike inference
            layer.moe.load_balance_coeff = None
            layer.moe.router.route_norm = bool(h.get("norm_topk_prob", True))
        _rms_eps(cfg, float(h.get("rms_norm_eps", 1e-6)))
        return cfg
    return build


def mla_rope(m: Mapping[str, Any], h: Mapping[str, Any], rope_dim: int):
    """torchtitan's ComplexRoPE config (interleaved pairs, as HF's rope_interleave) and the softmax mscale."""
    from rl.contract.hf import rope_scaling, rope_theta
    from torchtitan.models.common import ComplexRoPE
    if h.get("rope_interleave") is False:
        raise ValueError("config.json rope_interleave=false is not supported for the MLA families")
    rs = rope_scaling(h)
    kind = rs.get("rope_type")
    if kind is None:
        return ComplexRoPE.Config(dim=rope_dim, max_seq_len=int(m["max_seq_len"]), theta=rope_theta(h)), 1.0
    if kind != "yarn":
        raise ValueError(f"config.json rope scaling rope_type={kind!r} is not supported (known: default, yarn)")
    if rs.get("attention_factor") is not None or rs.get("mscale") is None or rs.get("mscale") != rs.get("mscale_all_dim"):
        # HF then scales cos/sin by an attention factor that torchtitan's ComplexRoPE does not apply
        raise ValueError(f"config.json yarn rope scaling needs mscale == mscale_all_dim and no attention_factor "
                         f"(as DeepSeek-V3 and Kimi write it), got {rs}")
    rope = ComplexRoPE.Config(
        dim=rope_dim, max_seq_len=int(m["max_seq_len"]), theta=rope_theta(h), scaling="yarn",
        rope_factor=float(rs["factor"]), beta_fast=float(rs.get("beta_fast", 32.0)),
        beta_slow=float(rs.get("beta_slow", 1.0)),
        original_seq_len=int(rs.get("original_max_position_embeddings", 4096)),
        truncate=bool(rs.get("truncate", True)))
    # HF scales the softmax by yarn_get_mscale(factor, mscale_all_dim)^2, torchtitan by its `mscale` the same way
    return rope, float(rs.get("mscale_all_dim") or 0.0)


# q_a_layernorm / kv_a_layernorm of DeepSeek-V3-style attention: DeepSeek's reference code and
# transformers build them with RMSNorm's default eps 1e-6, not config.rms_norm_eps (vLLM 0.32 uses
# rms_norm_eps; the two agree only for checkpoints with rms_norm_eps 1e-6). transformers is the reference.
LATENT_NORM_EPS = 1e-6


def _deepseek(m: Mapping[str, Any], h: Mapping[str, Any]):
    """DeepSeek-V3 / Kimi text tower (torchtitan's DeepSeekV3Model) for HF config `h`."""
    from rl.contract.hf import model_fields
    from torchtitan.models import deepseek_v3 as ds
    from torchtitan.models.common import Embedding, Linear, RMSNorm

    f = model_fields(h, "deepseek_v3")
    if h.get("scoring_func", "sigmoid") not in ("sigmoid", "softmax"):
        raise ValueError(f"config.json scoring_func={h.get('scoring_func')!r} is not supported")
    if h.get("topk_method", "noaux_tc") not in ("noaux_tc", "greedy", "group_limited_greedy"):
        raise ValueError(f"config.json topk_method={h.get('topk_method')!r} is not supported")
    rope, mscale = mla_rope(m, h, f["qk_rope_head_dim"])
    n_group, topk_group = int(h.get("n_group") or 1), int(h.get("topk_group") or 1)

    def build(attn_backend: str, moe_comm_backend: str = "standard"):
        dim, vocab = f["dim"], f["vocab_size"]
        layers = ds._build_dsv3_layers(
            n_layers=f["n_layers"], n_dense_layers=f["n_dense_layers"], dim=dim, n_heads=f["n_heads"],
            q_lora_rank=f["q_lora_rank"], kv_lora_rank=f["kv_lora_rank"],
            qk_nope_head_dim=f["qk_nope_head_dim"], qk_rope_head_dim=f["qk_rope_head_dim"],
            v_head_dim=f["v_head_dim"], mscale=mscale,
            dense_hidden_dim=f["dense_hidden_dim"], moe_hidden_dim=f["moe_hidden_dim"],
            num_experts=f["num_experts"], num_shared_experts=max(f["n_shared_experts"], 1),
            router_top_k=f["top_k"], router_score_func=h.get("scoring_func", "sigmoid"),
            router_num_expert_groups=n_group if n_group > 1 else None,
            router_num_limited_groups=topk_group if n_group > 1 else None,
            router_route_scale=float(h.get("routed_scaling_factor", 1.0)),
            router_route_norm=bool(h.get("norm_topk_prob", True)),
            attn_backend=attn_backend, moe_comm_backend=moe_comm_backend, non_blocking_capacity_factor=None,
            rope=rope)
        for layer in layers:
            if layer.moe is not None:
                if f["n_shared_experts"] == 0:
                    layer.moe.shared_experts = None
                # noaux_tc: the checkpoint's e_score_correction_bias is the expert bias; it is loaded and
                # published, never updated by the trainer (no load-balancing hook is registered)
                if h.get("topk_method", "noaux_tc") != "noaux_tc":
                    layer.moe.load_balance_coeff = None
        cfg = ds.DeepSeekV3Model.Config(
            vocab_size=vocab, dim=dim,
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=ds._EMBEDDING_INIT),
            norm=RMSNorm.Config(normalized_shape=dim, param_init=ds._NORM_INIT),
            lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=ds._output_linear_init(dim)),
            layers=layers, mtp_layers=[])
        _rms_eps(cfg, float(h.get("rms_norm_eps", 1e-6)))
        for layer in layers:  # the MLA latent norms keep 1e-6 whatever rms_norm_eps says (see LATENT_NORM_EPS)
            layer.attention.q_norm.eps = layer.attention.kv_norm.eps = LATENT_NORM_EPS
        return cfg
    return build


def model_spec(m: Mapping[str, Any], attn_backend: str = "flex", hf_config: Mapping[str, Any] | None = None):
    """The torchtitan ModelSpec (model config, parallelize function, HF adapter) of `m`'s family.

    The network comes from `hf_config` (default: `network_config(m)`): a checkpoint's config.json, or the
    one written for a model created here.
    """
    from rl.contract.config import FAMILIES
    from torchtitan.protocols.model_spec import ModelSpec

    fam = m["family"]
    if fam not in FAMILIES:
        raise ValueError(f"model.family={fam!r} is not known (known: {', '.join(FAMILIES)})")
    h = dict(hf_config) if hf_config is not None else network_config(m)
    if fam == "qwen3":
        from torchtitan.models.qwen3 import model_registry, qwen3_configs
        name = f"hetrl:{m['name']}"
        qwen3_configs[name] = _qwen3(m, h)  # re-registering the same name replaces it (tests use several sizes)
        return model_registry(name, attn_backend=attn_backend)
    if fam == "glm_moe_dsa":
        from rl.trainer import glm5
        return glm5.model_spec(h, attn_backend=attn_backend, max_seq_len=int(m["max_seq_len"]))
    from torchtitan.models.deepseek_v3 import DeepSeekV3StateDictAdapter, parallelize_deepseekv3
    return ModelSpec(name=fam, flavor=f"hetrl:{m['name']}", model=_deepseek(m, h)(attn_backend),
                     parallelize_fn=parallelize_deepseekv3, pipelining_fn=None, post_optimizer_build_fn=None,
                     state_dict_adapter=DeepSeekV3StateDictAdapter)


def set_sharding(spec, ep: int) -> None:
    """torchtitan's sharding configs for the family (its Trainer does this in update_from_config)."""
    if spec.name == "qwen3":
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config
        set_qwen3_sharding_config(spec.model, enable_sp=False, enable_ep=ep > 1)
    else:
        from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config
        set_deepseek_v3_sharding_config(spec.model, enable_sp=False, enable_ep=ep > 1)


@dataclass
class Built:
    model: torch.nn.Module
    spec: Any                      # torchtitan ModelSpec (parallelize_fn, state_dict_adapter, ...)
    device: torch.device
    dtype: torch.dtype             # compute dtype; the parameters (masters) are always fp32


def build_model(m: Mapping[str, Any], *, seed: int, device: str | torch.device = "cpu",
                dtype: str | torch.dtype = "float32", parallel: Mapping[str, int] | None = None,
                fp8: bool = False, hf_config: Mapping[str, Any] | None = None,
                materialize: bool = True) -> Built:
    """Build the model of config `m`; with `materialize`, initialise it with torch's RNG seeded by `seed`.

    Parameters are fp32 master weights whatever `dtype` is: `dtype` is the compute dtype (FSDP2's
    mixed-precision param dtype on several ranks, autocast on one; rl.trainer.train). bf16 masters would
    lose most small updates to rounding: at lr 1e-6 one Adam step changes ~1e-6 relative, far below
    bf16's 2^-8 spacing.

    `parallel` ({"ep": ..., "cp": ...}, given for multi-rank runs): fill torchtitan's sharding configs first, as its
    Trainer does through `update_from_config`, so that `parallelize_fn` can shard experts over ep.
    `fp8`: block-scaled FP8 GEMMs in attention and experts (rl.trainer.fp8; emulated on the CPU).
    `materialize=False` leaves the model on the meta device, to be parallelized first and then filled by
    `materialize_empty` + rl.trainer.hf_load (a checkpoint start: no rank holds the whole model).
    """
    device = torch.device(device)
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    spec = model_spec(m, hf_config=hf_config)
    if parallel is not None:
        set_sharding(spec, int(parallel["ep"]))
    replay.apply(spec.model)  # routers that can replay recorded expert ids (a no-op until asked to)
    if device.type == "cpu":
        cpu.apply(spec.model)
    elif parallel is not None and int(parallel.get("cp", 1)) > 1:
        # context parallel on a GPU takes the CPU's tested path: K/V all-gathered, dense document mask
        # for the local query rows (torchtitan's Flex CP needs a BlockMask sharded its own way)
        cpu.dense_attention(spec.model)
    if fp8:
        from rl.trainer import fp8 as fp8_training
        fp8_training.apply(spec.model)
    from torchtitan.tools.utils import set_default_dtype
    with set_default_dtype(torch.float32), torch.device("meta"):
        model = spec.model.build()
    built = Built(model, spec, device, dtype)
    if materialize:
        torch.manual_seed(seed)
        materialize_empty(model, device)
    return built


def materialize_empty(model, device: str | torch.device, buffer_device: str | torch.device | None = None) -> None:
    """Meta -> `device` storage, initialised by torchtitan's `init_weights` (buffers such as the RoPE cache
    are computed there; under set_default_dtype, since casting afterwards breaks the RoPE cache)."""
    from torchtitan.tools.utils import set_default_dtype
    model.to_empty(device=device)
    with set_default_dtype(torch.float32), torch.no_grad():
        model.init_weights(buffer_device=buffer_device or device)


def attention_masks(model, positions: torch.Tensor):
    """What the model's inner attention takes: a dense mask on the CPU, torchtitan's own otherwise."""
    if cpu.uses_dense_attention(model):
        return cpu.document_mask(positions)
    return model.get_attention_masks(positions)


def logits(model, tokens: torch.Tensor, positions: torch.Tensor, masks=None) -> torch.Tensor:
    """[B, L, V] logits for packed rows; positions restart at 0 where each sample starts.

    `masks` overrides the attention masks built from `positions` (context parallel passes the rows of
    the mask this rank holds).
    """
    if masks is None:
        masks = attention_masks(model, positions)
    return model(tokens, positions=positions, attention_masks=masks)


def position_logprobs(model, tokens: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor,
                      masks=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position j: log p(targets[j]) under the distribution predicted at j, and its entropy.

    The training path's form (targets = the next tokens, shifted before any sequence split), so each
    rank of a context-parallel group scores the positions it holds without its neighbours' logits.
    """
    logp = torch.log_softmax(logits(model, tokens, positions, masks).float(), dim=-1)
    lp = logp.gather(-1, targets[..., None].long()).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def token_logprobs(model, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprob and entropy, aligned with the tokens as inference logprobs are.

    Entry i is about token i given the tokens before it in its own sample: log p(tokens[i]) under the
    distribution predicted at i-1, and that distribution's entropy. The first token of every sample
    has no prediction inside the sample: its entries are 0 (it is a prompt token, never in the loss).
    """
    logp = torch.log_softmax(logits(model, tokens, positions).float(), dim=-1)[:, :-1]
    lp = logp.gather(-1, tokens[:, 1:, None].long()).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    starts = positions[:, 1:] == 0
    lp = torch.nn.functional.pad(lp.masked_fill(starts, 0.0), (1, 0))
    ent = torch.nn.functional.pad(ent.masked_fill(starts, 0.0), (1, 0))
    return lp, ent


def hf_state_dict(built: Built) -> dict[str, torch.Tensor]:
    """The model's weights under HF Qwen3-MoE names (experts split per expert), via torchtitan's adapter."""
    adapter = built.spec.state_dict_adapter(built.spec.model, None)
    return {k: v.detach() for k, v in adapter.to_hf(built.model.state_dict()).items()}


def load_hf_state_dict(built: Built, hf: Mapping[str, torch.Tensor]) -> None:
    """Load HF-named weights (e.g. an `hf_path` checkpoint, or published shards) into the model."""
    adapter = built.spec.state_dict_adapter(built.spec.model, None)
    sd = adapter.from_hf(dict(hf))
    missing, unexpected = built.model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith(("rope.cache", "expert_bias_E", "tokens_per_expert_E"))]
    if missing or unexpected:
        raise KeyError(f"HF state dict does not fit the model: missing {missing}, unexpected {unexpected}")
