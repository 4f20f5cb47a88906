#!/usr/bin/env bash
# The GPU check, run from the repository root on a machine with a CUDA torch (docs/gpu.md): the block-scaled
# FP8 GEMM probe, the unit tests marked gpu, then the doctor's torch side (`python -m rl.doctor --gpu
# --device cuda`: every family's logits and trainer steps, the mid-size model's memory, MFU and FP8
# publish) with one progress line per finished check. Each step has its own time limit, so a hang still
# leaves the others' results. Everything lands under $OUT (default ./gpu-out). DOCTOR_ARGS narrows the
# doctor (e.g. "--families qwen3,nemotron_h --share 0.1"). The launcher's own rows (packages,
# filesystem, Slurm) need no GPU: `python -m launch doctor --gpu --device cuda` runs both sides.
set -u
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
if [ -d .gpu/whl ]; then   # scripts/gpu_prepare.sh: what a bare GPU machine lacks
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD/.gpu/site:$PWD
fi
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# torch older than 2.13 lacks names torchtitan 0.3.0 uses: the harness-only shim (scripts/gpu_compat)
python3 -c 'import torch.distributed.fsdp as f; f.DataParallelMeshDims' 2>/dev/null || export HETRL_TORCH_SHIM=1
{ date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__)'
  echo "HETRL_TORCH_SHIM=${HETRL_TORCH_SHIM:-0}"; } >"$OUT/machine.txt" 2>&1
timeout "${PROBE_TIMEOUT:-40}" python3 scripts/gpu_compat/probe_scaled_mm.py >"$OUT/probe.txt" 2>&1
echo "probe rc=$?" >>"$OUT/machine.txt"
timeout "${PYTEST_TIMEOUT:-90}" python3 -m pytest -q -p no:cacheprovider -m gpu -rs \
  tests/unit/test_fp8_training.py tests/unit/test_weight_publish.py >"$OUT/pytest.log" 2>&1
echo "pytest rc=$?" >>"$OUT/machine.txt"
FS=${GPU_CHECK_FS:-/tmp/hetrl-fs}; mkdir -p "$FS"
# shellcheck disable=SC2086
MALLOC_MMAP_THRESHOLD_=65536 timeout "${DOCTOR_TIMEOUT:-600}" python3 -m rl.doctor --gpu --device cuda \
  --publish-dir "$FS" --out "$OUT/doctor-rows.json" ${DOCTOR_ARGS:-} 2>"$OUT/doctor.log"
echo "doctor rc=$?" >>"$OUT/machine.txt"
cat "$OUT/machine.txt" "$OUT/probe.txt"; tail -15 "$OUT/pytest.log"; grep '^\[doctor' "$OUT/doctor.log"
