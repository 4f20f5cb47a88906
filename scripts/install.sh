#!/usr/bin/env bash
# Install hetrl on a fresh CPU machine (Debian 12, Python 3.11): a venv in .venv with the pinned stack.
#   scripts/install.sh            the product (vLLM CPU, torchtitan, torch 2.13.0 CPU build)
#   scripts/install.sh --test     also pytest, a local Slurm (slurmctld, slurmd, munge), bubblewrap and
#                                 shellcheck for the tests
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_TEST=0
for a in "$@"; do
  case "$a" in
    --test) WITH_TEST=1 ;;
    *) echo "install.sh: unknown option $a (known: --test)" >&2; exit 2 ;;
  esac
done
# GNU patch applies agent patches in the SWE environment's sandbox.
if ! command -v patch >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends patch
fi
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || { echo "install.sh: $PY not found (hetrl needs Python 3.11)" >&2; exit 1; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if ! .venv/bin/python -c "import vllm, torchtitan, hydra, submitit" 2>/dev/null; then
  .venv/bin/pip install -q -U pip
  # torch must be exactly 2.13.0: the CPU build. A range pulls a multi-GB CUDA build.
  .venv/bin/pip install -q -e ".[cpu,envs,test]"
  # PyPI's torchvision is a CUDA build that breaks transformers' model imports beside CPU torch.
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
.venv/bin/pip install -q -e . --no-deps
if [ "$WITH_TEST" = 1 ]; then
  # an older venv may predate a test dependency
  .venv/bin/python -c "import pytest, pytest_timeout" 2>/dev/null || .venv/bin/pip install -q "pytest>=8" "pytest-timeout>=2.3"
  bash .ci/install_slurm.sh
  # bubblewrap: the SWE sandbox runtime the escape tests run besides inprocess (docs/sandboxes.md)
  command -v bwrap >/dev/null || { SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo;
    $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends bubblewrap; }
  # shellcheck: every rendered batch script must pass `shellcheck -S warning` (tests/unit/test_batch_script.py)
  command -v shellcheck >/dev/null || { SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo;
    $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends shellcheck; }
fi
echo "hetrl installed in $(pwd)/.venv"
