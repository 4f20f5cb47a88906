"""metrics.jsonl is the record; a broken wandb (its service killed by Slurm's SIGTERM) never stops a role."""
from omegaconf import OmegaConf

from rl.metrics import MetricsLogger, read_metrics


class _DeadWandb:
    def log(self, *a, **k):
        raise ConnectionResetError("Connection lost")  # what wandb raised when its service was killed

    def finish(self):
        raise ConnectionResetError("Connection lost")


def test_metrics_survive_a_dead_wandb_service(tmp_path):
    m = MetricsLogger(tmp_path, OmegaConf.create({"wandb": {"mode": "disabled"}}))
    # Injected: killing wandb's service process mid-run is what Slurm preemption did, not reproducible here.
    m.wandb = _DeadWandb()
    m.log(0, {"reward_mean": 0.5})
    m.log(1, {"reward_mean": 0.6})
    m.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]
    assert m.wandb is None
