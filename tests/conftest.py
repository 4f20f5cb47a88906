"""Shared pytest fixtures. The Slurm part (a real localhost cluster) lives in tests/slurm_cluster.py."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from slurm_cluster import slurm, slurm_cluster  # noqa: E402,F401  (fixtures)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def twin(tmp_path_factory):
    """twin(family) -> the path of that family's tiny random HF checkpoint (rl.model.twins), made once."""
    made = {}

    def get(family: str) -> Path:
        if family not in made:
            from rl.model.twins import write_twin
            made[family] = write_twin(tmp_path_factory.mktemp(f"twin_{family}"), family)
        return made[family]
    return get
