"""The rows `python -m launch doctor` reports: tests/unit/test_doctor.py checks a plain report has each,
tests/integration/test_doctor_run.py the whole report on the CPU and on a GPU."""
from __future__ import annotations


def expected_checks() -> set[str]:
    from rl.contract import families
    from rl.doctor import gpu_checks
    return {"python", "package torch", "package vllm", "package torchtitan", "package transformers", "config",
            "torch build", "CUDA devices", "FP8 capability (>= 8.9)", "kernel deep_ep", "kernel deep_gemm",
            "kernel mamba_ssm", "kernel causal_conv1d", "filesystem write+fsync", "filesystem read",
            "weight sync on this filesystem", "slurm: sbatch --test-only of the plan",
            *gpu_checks(families.FAMILIES)}
