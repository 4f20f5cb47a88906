"""The rendered batch script itself, without Slurm: every experiment's script passes `shellcheck -S
warning`, and values that cannot be put into an #SBATCH line or reach scancel as options are refused
with one line naming the key (or the file) before anything is written or run."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from launch import slurm as ls
from launch.compose import compose_points
from rl.contract.config import ConfigError

REPO = Path(__file__).resolve().parents[2]
# Experiments that name a site checkpoint (model.hf_path) are planned from the config card of their
# family kept in conf/checkpoints (what tests/unit/test_plan.py does too).
CARDS = {"glm5": REPO / "conf" / "checkpoints" / "glm_moe_dsa", "kimi": REPO / "conf" / "checkpoints" / "kimi_k2_7",
         "nemotron": REPO / "conf" / "checkpoints" / "nemotron_h"}
EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))
# Template branches the experiments alone do not reach: no requeue, a GRES spec, the sandbox component.
VARIANTS = {"no_requeue": ["cluster.requeue=false", "cluster.exclusive=false"],
            "gres_and_extra": ["cluster.gres=gpu:8", "cluster.extra_sbatch=['--begin=now+60']",
                               "cluster.setup=['module load foo']"],
            "sandbox_nodes": ["cluster.sandbox_nodes=1"]}


def _overrides(name: str) -> list[str]:
    # a new family's experiment fails in compose ("model.hf_path=...: no config.json there"): add its card
    card = next((c for prefix, c in CARDS.items() if name.startswith(prefix)), None)
    return [f"model.hf_path={card}"] if card else []


def _script(tmp_path: Path, *overrides: str) -> str:
    run_dir = tmp_path / "run"
    (cfg,) = compose_points(["cluster=slurm", f"run_dir={run_dir}", *overrides], multirun=False)
    return ls.prepare_run(cfg, run_dir)[1]


def _shellcheck(script: str, tmp_path: Path) -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (scripts/install.sh --test installs it; Debian: shellcheck)")
    p = tmp_path / "job.sbatch"
    p.write_text(script)
    r = subprocess.run(["shellcheck", "-S", "warning", str(p)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiments_batch_script_passes_shellcheck(name, tmp_path):
    _shellcheck(_script(tmp_path, f"+experiment={name}", *_overrides(name)), tmp_path)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_template_branches_pass_shellcheck(variant, tmp_path):
    base = ["+experiment=swe_debug"] if variant == "sandbox_nodes" else []
    script = _script(tmp_path, *base, *VARIANTS[variant])
    if variant == "sandbox_nodes":
        assert "--het-group=2" in script
    _shellcheck(script, tmp_path)


@pytest.mark.parametrize("run_dir", ["r --partition=high", "r\t--qos=x", "it's", 'a"b', "back\\slash"])
def test_run_dir_that_would_change_sbatch_options_is_refused(run_dir, tmp_path):
    # `#SBATCH --output=RUN_DIR/logs/...`: sbatch splits at whitespace and reads quotes, so a space
    # would add an option of the run_dir's choosing.
    (cfg,) = compose_points(["cluster=slurm", "run_dir=/tmp/placeholder"], multirun=False)
    target = tmp_path / run_dir
    with pytest.raises(ConfigError) as e:
        ls.prepare_run(cfg, target)
    msg = str(e.value)
    assert msg.startswith("run_dir=") and "#SBATCH" in msg and "\n" not in msg, msg
    assert not target.exists()


def test_other_sbatch_values_are_refused_by_key(tmp_path):
    run_dir = tmp_path / "run"
    (cfg,) = compose_points(["cluster=slurm", f"run_dir={run_dir}"], multirun=False)
    from launch.plan import make_plan
    plan = make_plan(dict(cfg, run_dir=str(run_dir)))
    for key, value in (("time", "1:00 --qos=high"), ("constraint", "a b"), ("job_name", "x y")):
        bad = dict(cfg, cluster=dict(cfg["cluster"], **{key: value}))
        with pytest.raises(ConfigError, match=rf"^cluster\.{key}="):
            ls.render_script(plan, bad)
    bad = dict(cfg, cluster=dict(cfg["cluster"], extra_sbatch=["--begin=now\nrm -rf /"]))
    with pytest.raises(ConfigError, match=r"^cluster\.extra_sbatch\[0\]="):
        ls.render_script(plan, bad)


@pytest.mark.parametrize("job_id", ["--user=root", "-u", "123 456", "12;ls", "", "abc"])
def test_job_ids_read_back_must_be_numeric(job_id, tmp_path):
    # slurm_jobs.jsonl is a file in the run directory; what it says reaches scancel's argv
    (tmp_path / ls.JOBS_FILE).write_text(json.dumps({"job_id": "17"}) + "\n" + json.dumps({"job_id": job_id}) + "\n")
    with pytest.raises(ConfigError, match=r"slurm_jobs\.jsonl: job_id=.*not a Slurm job id"):
        ls.current_job(tmp_path)
    with pytest.raises(ConfigError, match="not a Slurm job id"):
        ls.cancel_run(tmp_path, signal="USR1")
    with pytest.raises(ls.SlurmError, match="not a Slurm job id"):
        ls.cancel(job_id)


def test_numeric_job_ids_pass(tmp_path):
    (tmp_path / ls.JOBS_FILE).write_text(json.dumps({"job_id": "4242"}) + "\n")
    assert ls.current_job(tmp_path) == "4242" and ls.job_id_arg(17) == "17"
