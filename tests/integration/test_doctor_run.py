"""`python -m launch doctor` end to end: the whole report on the CPU (every row, the GPU checks at tiny
size with `--device cpu --gpu`), `--slurm` against the localhost Slurm cluster, and on a GPU the same
command on CUDA (skipped without one)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.doctor import expected_checks

REPO = Path(__file__).resolve().parents[2]


def doctor(tmp_path: Path, *args: str, timeout: float = 600):
    out = tmp_path / "doctor.json"
    r = subprocess.run([sys.executable, "-m", "launch", "doctor", "--fs", str(tmp_path), "--fs-mib", "16",
                        "--json", str(out), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    report = json.loads(out.read_text()) if out.is_file() else None
    return r, report


def last_line(stdout: str) -> dict:
    line = stdout.strip().splitlines()[-1]
    return dict(kv.split("=", 1) for kv in line.split())


@pytest.mark.slow
def test_doctor_on_the_cpu_runs_every_gpu_path_at_tiny_size(tmp_path):
    r, report = doctor(tmp_path, "--gpu", "--device", "cpu")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    rows = {x["check"]: x for x in report["rows"]}
    assert set(rows) == expected_checks(), set(rows) ^ expected_checks()
    assert not [x for x in report["rows"] if x["status"] == "fail"]
    assert rows["GPU checks device"]["figure"] == "cpu"
    from rl.contract import families
    for fam in families.FAMILIES:   # every family stepped in bf16 and FP8, and matched transformers
        for what in ("logits vs transformers", "trainer step bf16", "trainer step FP8"):
            assert rows[f"{fam}: {what}"]["status"] == "pass", rows[f"{fam}: {what}"]
        assert rows[f"{fam}: trainer step FP8"]["data"]["device_mixes"] == []
        assert "emulated" in rows[f"{fam}: trainer step FP8"]["figure"]
    assert rows["mid-size memory: peak vs estimate"]["status"] == "pass"
    assert rows["mid-size tokens/s"]["data"]["tokens_per_s"] > 0
    assert rows["mid-size MFU"]["status"] == "skip" and "CPU" in rows["mid-size MFU"]["note"]
    pub = rows["FP8 publish vs raw write"]["data"]
    assert pub["fp8_bytes"] > 0 and pub["publish_vs_raw"] > 0
    assert rows["FP8 publish vs bf16 save"]["status"] == "info"      # judged on a GPU only
    assert rows["vLLM load of the FP8 shards + generate"]["status"] == "skip"
    kv = last_line(r.stdout)
    assert kv["gpu_checks"] == "1" and kv["device"] == "cpu" and kv["doctor_fail"] == "0"
    assert float(kv["publish_vs_raw"]) > 0 and float(kv["tokens_per_s"]) > 0
    assert not list(tmp_path.glob("doctor-publish-*")) and not list(tmp_path.glob(".hetrl-doctor-*"))


@pytest.mark.slurm
def test_doctor_slurm_test_only_accepts_the_plan_and_names_a_refusal(slurm, tmp_path):
    """sbatch --test-only of the embedded default's heterogeneous plan on the 4-node cluster; then a
    partition the cluster does not have, refused in sbatch's own words."""
    r, report = doctor(tmp_path, "--slurm", timeout=300)
    rows = {x["check"]: x for x in report["rows"]}
    row = rows["slurm: sbatch --test-only of the plan"]
    assert row["status"] == "pass", row
    assert "to start at" in row["figure"], row
    assert not slurm.job_ids(), "--test-only must not leave a job"
    r, report = doctor(tmp_path, "--slurm", "cluster.partition=nosuchpartition", timeout=300)
    row = {x["check"]: x for x in report["rows"]}["slurm: sbatch --test-only of the plan"]
    assert row["status"] == "fail" and "partition" in row["figure"].lower(), row
    assert r.returncode == 1


@pytest.mark.gpu
@pytest.mark.slow
def test_doctor_gpu_on_cuda(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    r, report = doctor(tmp_path, "--gpu", "--device", "cuda", "--vllm", "auto", timeout=1500)
    print(r.stdout)
    failed = [x for x in report["rows"] if x["status"] == "fail"]
    assert not failed, json.dumps(failed, indent=1)
    assert last_line(r.stdout)["device"] == "cuda"
