"""Rewinding resume.json and incarnations/ together does not let a frozen incarnation publish again, even
before the newer incarnation published anything (issue 49).

Each role is a real process here: it starts as the launcher starts roles (HETRL_EPOCH set from
resume.json right after rl.prepare, then rl.runtime.record_role fences it) and then waits, frozen, for a
command on stdin. Between its start and its publish, rl.prepare starts incarnation 1, and someone rewinds
both records: resume.json back to restart 0 (rewritten in place, restored from a copy, or its original
inode linked back) and incarnations/restart_000001.json deleted. Incarnation 1 has published nothing, so
no step's manifest remembers it either; what remembers is resume.json's inode and change time, noted by
each process when it fenced (rl.exchange.fencing). The frozen process is refused in one line and nothing
is published; so is incarnation 1's own process, which can no longer tell it is the newest; a process
whose resume.json is left alone publishes as before.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rl import exchange
from rl.contract.config import Config
from rl.prepare import prepare

REPO = Path(__file__).resolve().parents[2]
ROLE = textwrap.dedent("""
    import sys
    from pathlib import Path
    from rl import exchange, runtime
    run = Path(sys.argv[1])
    runtime.record_role(run, "trainer")          # fences this process to HETRL_EPOCH, as every role does
    print("started", flush=True)
    for line in sys.stdin:                       # frozen until told to publish
        step = int(line)
        try:
            exchange.publish(run, "weights", step, lambda d: (d / "w").write_bytes(b"late"), producer="trainer")
            print("published", flush=True)
        except exchange.Fenced as e:
            print("Fenced: " + str(e), flush=True)
""")


class Role:
    """A role process of incarnation `epoch` (HETRL_EPOCH), started and fenced, then waiting."""

    def __init__(self, run: Path, epoch: int):
        env = {**os.environ, "HETRL_EPOCH": str(epoch), "PYTHONPATH": str(REPO)}
        env.pop("SLURM_JOB_ID", None)
        self.p = subprocess.Popen([sys.executable, "-c", ROLE, str(run)], cwd=REPO, env=env, text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert self.p.stdout.readline().strip() == "started", self.p.stderr.read()

    def publish(self, step: int) -> str:
        self.p.stdin.write(f"{step}\n")
        self.p.stdin.flush()
        return self.p.stdout.readline().strip()

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(30)


def _run_dir(path: Path) -> Path:
    cfg = OmegaConf.structured(Config)
    cfg.run_dir = str(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    return path


def _rewrite_in_place(run: Path, old: bytes, _copy: Path, _link: Path) -> None:
    (run / "resume.json").write_bytes(old)                   # same inode, new content


def _restore_copy(run: Path, _old: bytes, copy: Path, _link: Path) -> None:
    shutil.copy2(copy, run / "resume.json.restored")         # cp -p: the old bytes and mtime
    os.replace(run / "resume.json.restored", run / "resume.json")


def _link_original_back(run: Path, _old: bytes, _copy: Path, link: Path) -> None:
    os.replace(link, run / "resume.json")                    # the very inode incarnation 0 started from


REWINDS = [_rewrite_in_place, _restore_copy, _link_original_back]


@pytest.fixture
def roles():
    started: list[Role] = []
    yield started
    for r in started:
        r.close()


@pytest.mark.parametrize("rewind", REWINDS, ids=[f.__name__.strip("_") for f in REWINDS])
def test_a_frozen_incarnation_cannot_publish_after_both_records_are_rewound(tmp_path, monkeypatch, roles, rewind):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    run = _run_dir(tmp_path / "run")
    assert prepare(run).restart == 0
    old = (run / "resume.json").read_bytes()
    shutil.copy2(run / "resume.json", tmp_path / "resume.copy")
    os.link(run / "resume.json", tmp_path / "resume.link")   # keeps incarnation 0's inode alive
    frozen = Role(run, 0)                                    # incarnation 0's trainer, then stopped
    roles.append(frozen)
    assert prepare(run).restart == 1                         # the next job: incarnation 1
    current = Role(run, 1)
    roles.append(current)
    # the rewind, before incarnation 1 published anything
    rewind(run, old, tmp_path / "resume.copy", tmp_path / "resume.link")
    (run / "incarnations" / "restart_000001.json").unlink()
    assert json.loads((run / "resume.json").read_text())["restart"] == 0
    assert exchange.incarnation(run).restart == 0            # both records say incarnation 0 is current
    said = frozen.publish(1)
    assert said.startswith("Fenced: weights/step_000001: refused: ") and "resume.json" in said, said
    assert "since this process of incarnation 0 started from it" in said and "\n" not in said, said
    said = current.publish(1)                                 # the newest cannot tell it is either
    assert said.startswith("Fenced: ") and "resume.json" in said, said
    assert exchange.list_steps(run, "weights") == []


def test_deleting_both_records_refuses_the_frozen_incarnation(tmp_path, monkeypatch, roles):
    """resume.json and incarnations/ removed altogether: a process of incarnation 0 used to take a missing
    record for a run before its first prepare."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    run = _run_dir(tmp_path / "run")
    prepare(run)
    frozen = Role(run, 0)
    roles.append(frozen)
    prepare(run)
    (run / "resume.json").unlink()
    shutil.rmtree(run / "incarnations")
    said = frozen.publish(1)
    assert said.startswith("Fenced: ") and "resume.json is missing since this process" in said, said
    assert exchange.list_steps(run, "weights") == []


def test_the_epoch_handed_out_again_does_not_revive_the_old_holder(tmp_path, monkeypatch, roles):
    """After the rewind the next prepare numbers incarnation 1 again (nothing left says it was used); the
    process that held the first incarnation 1 is refused, the new one publishes."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    run = _run_dir(tmp_path / "run")
    prepare(run)
    old = (run / "resume.json").read_bytes()
    prepare(run)
    first = Role(run, 1)
    roles.append(first)
    (run / "resume.json").write_bytes(old)
    (run / "incarnations" / "restart_000001.json").unlink()
    assert prepare(run).restart == 1
    second = Role(run, 1)
    roles.append(second)
    assert first.publish(1).startswith("Fenced: ")
    assert second.publish(1) == "published"
    assert exchange.list_steps(run, "weights") == [1]


def test_a_process_whose_resume_json_is_left_alone_publishes(tmp_path, monkeypatch, roles):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    run = _run_dir(tmp_path / "run")
    prepare(run)
    role = Role(run, 0)
    roles.append(role)
    (run / "resume.json").read_bytes()                       # reading it changes nothing
    assert role.publish(0) == "published" and role.publish(1) == "published"
    assert exchange.list_steps(run, "weights") == [0, 1]
