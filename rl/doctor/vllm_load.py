"""`python -m rl.doctor.vllm_load MODEL_DIR`: load a model directory into vLLM and generate a few tokens.

A child of `python -m rl.doctor`, so that vLLM's engine (its processes, threads and device memory)
ends with it and a hang is cut by the parent's time limit. Prints one JSON line: load_s, generate_s,
generated (tokens).
"""
from __future__ import annotations

import argparse
import json
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rl.doctor.vllm_load", description=__doc__.splitlines()[0])
    from rl.doctor import args as t
    ap.add_argument("model_dir", type=t.existing_dir)
    ap.add_argument("--dtype", default="bfloat16", choices=("auto", "bfloat16", "float16", "float32"))
    ap.add_argument("--vocab", type=t.count(11, 1 << 24), default=512)
    ap.add_argument("--tokens", type=t.count(1, 4096), default=8)
    a = ap.parse_args(argv)
    from vllm import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(model=a.model_dir, dtype=a.dtype, max_model_len=256, enforce_eager=True, seed=0,
              gpu_memory_utilization=0.3, generation_config="vllm")
    load = time.perf_counter() - t0
    prompt = {"prompt_token_ids": [(17 * i) % max(2, a.vocab - 10) + 10 for i in range(16)]}
    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True))
    gen = time.perf_counter() - t0
    print(json.dumps({"load_s": round(load, 2), "generate_s": round(gen, 3),
                      "generated": len(out[0].outputs[0].token_ids)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
