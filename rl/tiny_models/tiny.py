"""Tiny models made on this machine: a byte-level BPE tokenizer and a Qwen3-MoE HF config.

No model hub is reachable here, so the embedded default trains a model created locally. The tokenizer
is trained offline with `tokenizers` on text shaped like what the environments produce (digits, short
words, chat markup); the architecture is Qwen3-MoE because torchtitan has it (`qwen3` family, MoE layers)
and vLLM serves `Qwen3MoeForCausalLM` on the CPU, so trainer and inference run the same network.

`write_hf_assets(dir, model_cfg)` writes config.json, generation_config.json and the tokenizer files:
everything an HF model directory needs except the weights, which the trainer publishes as shards.
"""
from __future__ import annotations

import json
import random
import string
from pathlib import Path
from typing import Any, Mapping

from rl.contract import families

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>"]
PAD, BOS_EOS, IM_START, IM_END = "<|endoftext|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# ChatML, as Qwen uses; the generation prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _corpus(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["repeat", "the", "digits", "answer", "add", "sum", "of", "and", "reverse", "copy", "task",
             "file", "test", "tests", "def", "return", "import", "class", "self", "print", "if", "else",
             "for", "in", "range", "list", "read", "write", "run", "submit", "patch", "error", "passed",
             "failed", "issue", "fix", "bug", "python", "value", "name", "path", "tool", "result", "ok"]
    out = []
    for _ in range(n):
        k = rng.randint(3, 20)
        parts = []
        for _ in range(k):
            r = rng.random()
            if r < 0.35:
                parts.append(" ".join(rng.choice(string.digits) for _ in range(rng.randint(1, 6))))
            elif r < 0.8:
                parts.append(rng.choice(words))
            else:
                parts.append("".join(rng.choice(string.ascii_letters + string.punctuation)
                                     for _ in range(rng.randint(1, 5))))
        out.append(" ".join(parts) + rng.choice(["\n", ": ", ". ", "(", ")", " = "]))
    return out


def build_tokenizer(out_dir: str | Path, vocab_size: int = 512, seed: int = 0):
    """Train a ByteLevel BPE tokenizer and save it as an HF fast tokenizer. Returns the tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(4000, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=PAD,
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return fast


def hf_config_dict(family: str, sizes: dict, vocab_size: int, eos: int, pad: int, dtype: str = "float32") -> dict:
    """config.json of `family` as transformers' config class writes it, plus what vLLM needs (its row's
    `twin_extra` keys, without its `twin_drop` keys: rl.contract.families)."""
    import transformers
    row = families.get(family)
    c = getattr(transformers, row.hf_config_class)(vocab_size=vocab_size, eos_token_id=eos, pad_token_id=pad,
                                                   bos_token_id=None, tie_word_embeddings=False, **sizes)
    c.architectures = [row.hf_model_class]
    d = c.to_dict()
    d["dtype"] = d["torch_dtype"] = dtype
    d.update(row.twin_extra)
    for k in row.twin_drop:
        d.pop(k, None)
    return d


def hf_config(m: Mapping[str, Any], vocab_size: int, eos_token_id: int, pad_token_id: int) -> dict:
    """config.json of the family's HF architecture with the sizes of the `model` config group.

    Architectures in `_WRITTEN_HERE` get a config.json written key by key (the embedded default run's
    Qwen3-MoE, unchanged since it was first published); the others their transformers config class's,
    with the keys of the family's args' `twin_sizes(m)` (rl/models/<package>/args.py, the inverse of its
    `from_hf`). A family whose args have none is created from a checkpoint only."""
    from rl.models import fields
    row = families.get(m["family"])
    if row.hf_model_class in _WRITTEN_HERE:
        return _WRITTEN_HERE[row.hf_model_class](m, vocab_size, eos_token_id, pad_token_id)
    twin_sizes = getattr(fields.family_args(row.name), "twin_sizes", None)
    if twin_sizes is None:
        raise NotImplementedError(f"model.family={m['family']}: no config.json for a model created here "
                                  f"(its args have no twin_sizes); start from a checkpoint (model.hf_path)")
    return hf_config_dict(m["family"], twin_sizes(m), vocab_size, eos_token_id, pad_token_id, "bfloat16")


def _qwen3_moe_config(m: Mapping[str, Any], vocab_size: int, eos_token_id: int, pad_token_id: int) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": vocab_size,
        "hidden_size": m["dim"],
        "intermediate_size": m["moe_hidden_dim"],
        "moe_intermediate_size": m["moe_hidden_dim"],
        "num_hidden_layers": m["n_layers"],
        "num_attention_heads": m["n_heads"],
        "num_key_value_heads": m["n_kv_heads"],
        "head_dim": m["head_dim"],
        "num_experts": m["num_experts"],
        "num_experts_per_tok": m["top_k"],
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "max_position_embeddings": m["max_seq_len"],
        "rms_norm_eps": 1e-6,
        "rope_theta": m["rope_theta"],
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.0,
        "torch_dtype": "bfloat16",
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "use_cache": True,
    }


_WRITTEN_HERE = {"Qwen3MoeForCausalLM": _qwen3_moe_config}


def write_hf_assets(out_dir: str | Path, m: Mapping[str, Any], seed: int = 0) -> dict:
    """Tokenizer + config.json + generation_config.json into out_dir; returns the config dict."""
    out_dir = Path(out_dir)
    tok = build_tokenizer(out_dir, vocab_size=m["vocab_size"], seed=seed)
    if len(tok) > m["vocab_size"]:
        raise ValueError(f"model.vocab_size={m['vocab_size']} is smaller than the tokenizer ({len(tok)})")
    eos = tok.convert_tokens_to_ids(IM_END)
    pad = tok.convert_tokens_to_ids(PAD)
    cfg = hf_config(m, m["vocab_size"], eos, pad)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [eos], "pad_token_id": pad, "do_sample": True, "temperature": 1.0, "top_p": 1.0,
         "top_k": 0}, indent=1))
    return cfg
