"""`launch` must plan and submit without torch, vLLM or torchtitan (login nodes)."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_launch_imports_no_heavy_packages():
    code = (
        "import sys, launch.__main__, launch.compose, rl.contract.config, launch.local, launch.rundir\n"
        "import launch.plan, launch.slurm, launch.export, launch.doctor, launch.status, launch.backends\n"
        "import launch.memory, rl.plan_math.memory\n"
        "from launch.compose import compose_points\n"
        "compose_points(['trainer.max_steps=2'], False)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'torchtitan', 'transformers', 'numpy'))\n"
        "print(heavy)\n"
        "assert not heavy, heavy\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr + out.stdout


def _launch(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "launch", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_a_family_cpu_vllm_cannot_serve_is_refused_before_anything_starts(twin, tmp_path):
    """glm5_tiny on a CPU machine used to start every role and die a minute later in vLLM (no sparse
    attention kernel on CPU): it is refused in one line, with nothing written."""
    run = tmp_path / "run"
    r = _launch("run", "+experiment=glm5_tiny", f"model.hf_path={twin('glm_moe_dsa')}", f"run_dir={run}")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("\n") == 1 and "model.family=glm_moe_dsa" in r.stderr, r.stderr
    assert "inference.gpus_per_node" in r.stderr and not run.exists()


def test_a_missing_twin_names_the_command_that_makes_it(tmp_path):
    missing = tmp_path / "models" / "kimi_tiny"
    r = _launch("run", "+experiment=kimi_tiny", f"model.hf_path={missing}", f"run_dir={tmp_path / 'run'}")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"python -m rl.tiny_models.twins kimi_k2_7 {missing}" in r.stderr, r.stderr


def test_models_dir_is_ignored_by_git():
    r = subprocess.run(["git", "check-ignore", "-q", "models/kimi_tiny/config.json"], cwd=REPO)
    assert r.returncode == 0, "models/ (where tiny twins are written) must be ignored by git"


def test_a_malformed_resume_record_is_one_line_from_launch(tmp_path):
    from builders import make_run_dir
    run = tmp_path / "run"
    make_run_dir(run)
    (run / "resume.json").write_text('{"restart": "x"}')
    r = _launch("status", str(run))
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "resume.json: restart='x' is not a non-negative integer" in r.stderr
