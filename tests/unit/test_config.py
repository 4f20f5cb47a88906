"""Config validation: every bad value is a one-line error naming the key, before anything runs."""
import subprocess
import sys
from pathlib import Path

import pytest

from launch.compose import compose_points
from rl.contract.config import ConfigError

REPO = Path(__file__).resolve().parents[2]

BAD = [
    (["trainer.foo=1"], "trainer.foo"),
    (["+trainer.foo=1"], "trainer.foo"),                             # Hydra's + adds keys past the struct
    (["++zzz=1"], "zzz"),
    (["cluster.max_restarts=-1"], "cluster.max_restarts"),
    (["cluster.stall_timeout_s=-5"], "cluster.stall_timeout_s"),
    (["trainer.max_steps=abc"], "trainer.max_steps"),
    (["trainer.max_steps=0"], "trainer.max_steps"),
    (["trainer.lr=-1"], "trainer.lr"),
    (["orchestrator.max_off_policy=-1"], "orchestrator.max_off_policy"),
    (["orchestrator.group_size=1"], "orchestrator.group_size"),
    (["orchestrator.temperature=0"], "orchestrator.temperature"),
    (["orchestrator.max_tokens=4096"], "orchestrator.max_tokens"),
    (["model.top_k=9"], "model.top_k"),
    (["model.n_kv_heads=3"], "model.n_kv_heads"),
    (["trainer.parallel.ep=3"], "trainer.parallel.ep"),
    (["trainer.mismatch=clip"], "trainer.mismatch"),
    (["cluster=nope"], "cluster/nope"),
    (["+experiment=nope"], "experiment/nope"),
    (["inference.max_model_len=100000"], "inference.max_model_len"),
    (["trainer.keep_weights=1"], "trainer.keep_weights"),
    (["wandb.mode=sometimes"], "wandb.mode"),
    (["seed=1,2"], "-m"),
    (["trainer.grad_clip=-1"], "trainer.grad_clip"),                 # would turn descent into ascent
    (["orchestrator.max_concurrency=0"], "orchestrator.max_concurrency"),   # would deadlock
    (["orchestrator.request_timeout_s=0"], "orchestrator.request_timeout_s"),
    (["model.family=llama"], "model.family"),
    (["env.name=chess"], "env.name"),
    (["env.args.x=1"], "env.args"),                                  # env.args is for verifiers:<id>
    (["env=swe", "env.swe.tasks=/no/such/tasks.jsonl"], "env.swe.tasks"),
    (["env.digits.warm_start_accuracy=2"], "env.digits.warm_start_accuracy"),
    (["trainer.activation_checkpointing=some"], "trainer.activation_checkpointing"),
    (["trainer.publish_timeout_s=0"], "trainer.publish_timeout_s"),
    (["trainer.delta_max_fraction=0"], "trainer.delta_max_fraction"),
    (["cluster.time=1h"], "cluster.time"),
    (["cluster.partition=gpu h100"], "cluster.partition"),
    (["cluster.gres=gpu 8"], "cluster.gres"),
    (["cluster.node_local_dir=tmp/x"], "cluster.node_local_dir"),
    (["inference.routing.policy=random"], "inference.routing.policy"),
    (["inference.routing.kv_full=2"], "inference.routing.kv_full"),
    (["inference.gpu_memory_utilization=1.5"], "inference.gpu_memory_utilization"),
    (["model.kv_lora_rank=512"], "model.qk_nope_head_dim"),          # MLA needs its head sizes
    # config-only rules once checked in launch/plan.py, now in validate() alone
    (["inference.nodes=0"], "inference.nodes"),
    (["inference.replicas=0"], "inference.replicas"),
    (["inference.tp=2", "inference.ep=3"], "inference.ep"),           # 1 or tp*dp
    (["inference.tp=2", "inference.ep=2", "model.num_experts=3", "model.top_k=1"], "inference.ep"),
    (["model.n_kv_heads=2", "inference.tp=3"], "inference.tp"),      # must divide or be a multiple
    (["inference.kv_offload=cpu"], "inference.kv_offload_cpu_gb"),
    (["inference.kv_offload=cpu+disk", "inference.kv_offload_cpu_gb=8"], "inference.kv_offload_disk_gb"),
]


@pytest.mark.parametrize("overrides,key", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_config_is_one_line_error_naming_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        compose_points(overrides, False)
    msg = str(e.value)
    assert key in msg
    assert "\n" not in msg


def test_a_newline_in_a_value_never_reaches_the_batch_script():
    from rl.contract.config import structured
    from rl.contract.validation import validate
    cfg = structured({"run_dir": "/tmp/r", "cluster": {"setup": ["module load x\nrm -rf /"]}})
    with pytest.raises(ConfigError, match=r"^cluster.setup\[0\]: must not contain a newline"):
        validate(cfg)
    cfg = structured({"run_dir": "/tmp/r", "model": {"name": "a\nb"}})
    with pytest.raises(ConfigError, match=r"^model.name: must not contain a newline"):
        validate(cfg)


def test_unusable_run_dir_is_refused_before_anything_runs(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        compose_points([f"run_dir={f}"], False)
    with pytest.raises(ConfigError, match="is not a directory"):
        compose_points([f"run_dir={f}/sub"], False)


def test_schema_defaults_are_the_embedded_default():
    """The schema is the one source of defaults: the base config adds nothing but the env/cluster choice."""
    from omegaconf import OmegaConf
    from rl.contract.config import Config
    (c,) = compose_points(["run_dir=/tmp/hetrl-defaults"], False)
    c.pop("_overrides")
    schema = OmegaConf.to_container(OmegaConf.structured(Config))
    schema["run_dir"] = c["run_dir"]
    for k in ("inference", "trainer"):  # auto ports are resolved per run
        for port in ("port", "router_port", "master_port"):
            if port in c[k]:
                schema[k][port] = c[k][port]
    assert c == schema


def test_default_config_is_the_debug_experiment(tmp_path):
    (c,) = compose_points([f"run_dir={tmp_path}"], False)
    (d,) = compose_points([f"run_dir={tmp_path}", "+experiment=debug"], False)
    c.pop("_overrides"), d.pop("_overrides")
    assert c == d
    assert c["cluster"]["backend"] == "local" and c["orchestrator"]["max_off_policy"] == 1
    assert c["run_dir"] == str(tmp_path)


def test_sweep_points_get_their_own_run_dirs():
    pts = compose_points(["seed=1,2,3"], True)
    assert [p["seed"] for p in pts] == [1, 2, 3]
    assert len({p["run_dir"] for p in pts}) == 3


def test_cli_prints_one_line_and_exits_2():
    out = subprocess.run([sys.executable, "-m", "launch", "run", "model.top_k=9"], cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "model.top_k" in out.stderr


def test_sweep_points_get_their_own_ports(tmp_path):
    # runs of one sweep may share a host: the same port would make their servers share a socket
    pts = compose_points([f"run_dir={tmp_path}", "seed=range(0,40)"], True)
    ports = [(p["inference"]["port"], p["inference"]["router_port"], p["trainer"]["master_port"]) for p in pts]
    assert len(set(ports)) == 40 and all(all(p) for p in ports)
