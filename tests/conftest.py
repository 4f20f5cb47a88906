"""Shared pytest fixtures. The Slurm part (a real localhost cluster) lives in tests/slurm_cluster.py."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from slurm_cluster import slurm, slurm_cluster  # noqa: E402,F401  (fixtures)
