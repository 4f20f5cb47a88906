#!/usr/bin/env bash
# Fills .gpu/ (ignored by git) with what a lent GPU machine lacks, so that one `run` call with
# carry=[".gpu"] can execute scripts/gpu_check.sh there: the pure-Python packages the project and
# torchtitan import (copied from this venv without bytecode; omegaconf's antlr4 runtime has no wheel) and
# a transformers wheel of the tested version (the installed tree is ~120 MB, the wheel ~13 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
SP=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf .gpu && mkdir -p .gpu/site .gpu/whl
for p in torchtitan torchtitan_recipes tyro typeguard docstring_parser torchdata torch_checkpointing spmd_types \
         omegaconf antlr4 hydra submitit; do
  cp -r "$SP/$p" .gpu/site/
  # importlib.metadata reads the dist-info (the doctor's version rows, pytest plugins checking versions)
  d=$(ls -d "$SP/${p}"-*.dist-info 2>/dev/null || true)
  [ -n "$d" ] && cp -r $d .gpu/site/
done
for d in antlr4_python3_runtime hydra_core; do cp -r "$SP/$d"-*.dist-info .gpu/site/; done
cp scripts/gpu_compat/sitecustomize.py .gpu/site/
find .gpu/site -name __pycache__ -prune -exec rm -rf {} +
TV=$(.venv/bin/python -c 'import transformers; print(transformers.__version__)')
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 -d .gpu/whl "transformers==$TV"
du -sh .gpu
