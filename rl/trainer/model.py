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


def _flavor(m: Mapping[str, Any]):
    """A qwen3 flavor function (attn_backend, moe_comm_backend) -> Qwen3Model.Config for `m`."""
    from torchtitan.models import qwen3 as q3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    def build(attn_backend: str, moe_comm_backend: str = "standard"):
        dim, vocab = int(m["dim"]), int(m["vocab_size"])
        cfg = q3.Qwen3Model.Config(
            vocab_size=vocab, dim=dim, norm=q3._qwen3_norm(dim), enable_weight_tying=False,
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                            param_init=q3._EMBEDDING_INIT),
            lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=q3._LINEAR_INIT),
            layers=q3._build_qwen3_moe_layers(
                n_layers=int(m["n_layers"]), dim=dim, n_heads=int(m["n_heads"]),
                n_kv_heads=int(m["n_kv_heads"]), head_dim=int(m["head_dim"]),
                moe_hidden_dim=int(m["moe_hidden_dim"]), num_experts=int(m["num_experts"]),
                top_k=int(m["top_k"]), attn_backend=attn_backend, moe_comm_backend=moe_comm_backend,
                rope=CosSinRoPE.Config(dim=int(m["head_dim"]), max_seq_len=int(m["max_seq_len"]),
                                       theta=float(m["rope_theta"]))))
        for layer in cfg.layers:
            layer.moe.load_balance_coeff = None
        return cfg
    return build


def model_spec(m: Mapping[str, Any], attn_backend: str = "flex"):
    """Register the flavor of model config `m` with torchtitan's qwen3 family; return its ModelSpec."""
    from torchtitan.models.qwen3 import model_registry, qwen3_configs

    if m["family"] != "qwen3":
        raise NotImplementedError(f"model.family={m['family']!r}: the trainer builds qwen3 only so far "
                                  f"(the MLA families are not wired into the trainer yet)")
    name = f"hetrl:{m['name']}"
    qwen3_configs[name] = _flavor(m)  # re-registering the same name replaces it (tests use several sizes)
    return model_registry(name, attn_backend=attn_backend)


@dataclass
class Built:
    model: torch.nn.Module
    spec: Any                      # torchtitan ModelSpec (parallelize_fn, state_dict_adapter, ...)
    device: torch.device
    dtype: torch.dtype


def build_model(m: Mapping[str, Any], *, seed: int, device: str | torch.device = "cpu",
                dtype: str | torch.dtype = "float32", parallel: Mapping[str, int] | None = None,
                fp8: bool = False) -> Built:
    """Build and initialise the model of config `m` with torch's RNG seeded by `seed`.

    `parallel` ({"ep": ...}, given for multi-rank runs): fill torchtitan's sharding configs first, as its
    Trainer does through `update_from_config`, so that `parallelize_fn` can shard experts over ep.
    `fp8`: block-scaled FP8 GEMMs in attention and experts (rl.trainer.fp8; emulated on the CPU).
    """
    from torchtitan.tools.utils import set_default_dtype

    device = torch.device(device)
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    spec = model_spec(m)
    if parallel is not None:
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config
        set_qwen3_sharding_config(spec.model, enable_sp=False, enable_ep=int(parallel["ep"]) > 1)
    replay.apply(spec.model)  # routers that can replay recorded expert ids (a no-op until asked to)
    if device.type == "cpu":
        cpu.apply(spec.model)
    if fp8:
        from rl.trainer import fp8 as fp8_training
        fp8_training.apply(spec.model)
    with set_default_dtype(dtype), torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with set_default_dtype(dtype), torch.no_grad():
        model.init_weights(buffer_device=device)
    return Built(model, spec, device, dtype)


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
