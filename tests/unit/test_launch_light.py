"""`launch` must plan and submit without torch, vLLM or torchtitan (login nodes)."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_launch_imports_no_heavy_packages():
    code = (
        "import sys, launch.__main__, launch.compose, rl.contract.config, launch.local, launch.rundir\n"
        "import launch.plan, launch.slurm\n"
        "from launch.compose import compose_points\n"
        "compose_points(['trainer.max_steps=2'], False)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'torchtitan', 'transformers', 'numpy'))\n"
        "print(heavy)\n"
        "assert not heavy, heavy\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr + out.stdout
