"""Run-directory integrity: crafted but checksum-valid files cannot run code, block a reader, loop it, or
let a stale incarnation publish (issue 20, items 7 and 8). Real files, real torch DCP, real shards; each
probe's manifest is rewritten so that only the new checks can see it."""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import threading
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from rl import exchange
from rl.exchange import fencing, retention
from rl.contract.config import Config
from rl.contract.records import RecordError
from rl.exchange import CorruptStep, Fenced


# -- helpers -------------------------------------------------------------------------------------------
def _rehash(step: Path, rel: str | None = None, drop: str | None = None) -> None:
    """Rewrite the step's manifest so `rel` matches again (or `drop` is no longer listed): what a probe
    that edits files and fixes their checksums does."""
    m = json.loads((step / exchange.MANIFEST).read_text())
    if rel is not None:
        data = (step / rel).read_bytes()
        m["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if drop is not None:
        m["files"].pop(drop)
    (step / exchange.MANIFEST).write_text(json.dumps(m))


def _run_dir(path: Path) -> Path:
    cfg = OmegaConf.structured(Config)
    cfg.run_dir = str(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    return path


def _files(files: dict[str, bytes]):
    def write(d: Path) -> None:
        for name, data in files.items():
            (d / name).write_bytes(data)
    return write


def _os_system_pickle(marker: Path, dotted: bool) -> bytes:
    """A pickle calling os.system("touch marker"), reaching it either through a dotted name from an
    allowed module (protocol 4's STACK_GLOBAL: `torch.distributed.checkpoint.metadata` + `os.system`)
    or plainly (posix.system)."""
    cmd = f"touch {marker}".encode()
    if dotted:
        mod, name = b"torch.distributed.checkpoint.metadata", b"os.system"
        return (b"\x80\x04" + b"\x8c" + bytes([len(mod)]) + mod + b"\x8c" + bytes([len(name)]) + name
                + b"\x93" + b"\x8c" + bytes([len(cmd)]) + cmd + b"\x85R.")
    return b"cposix\nsystem\n(V" + cmd + b"\ntR."


def _trainer_checkpoint(tmp_path: Path):
    from rl.trainer.train import Trainer
    cfg = OmegaConf.structured(Config)
    cfg.run_dir, cfg.wandb.mode = str(tmp_path), "disabled"
    cfg.model.max_seq_len = 64
    tr = Trainer(cfg)
    tr.save(tmp_path, 0)
    return cfg, tr, exchange.step_dir(tmp_path, "checkpoints", 0)


# -- item 7: nothing from the run directory runs code -------------------------------------------------
def test_checkpoint_metadata_pickle_is_never_unpickled(tmp_path):
    """A checkpoint loads from dcp_metadata.json: its `.metadata` pickle, replaced by one that runs a shell
    command (checksum rewritten), is never unpickled, and the command never runs."""
    from rl.trainer.train import Trainer
    marker = tmp_path / "PWNED"
    cfg, tr, step = _trainer_checkpoint(tmp_path)
    expected = {k: v.clone() for k, v in tr.model.state_dict().items()}
    (step / "dcp" / ".metadata").write_bytes(_os_system_pickle(marker, dotted=True))
    _rehash(step, "dcp/.metadata")
    other = Trainer(cfg)
    try:
        other.load(tmp_path, 0)
    finally:
        assert not marker.exists(), "the crafted .metadata was unpickled and ran its command"
    assert (step / "dcp_metadata.json").is_file()
    for k, v in expected.items():
        assert torch.equal(v, other.model.state_dict()[k]), k


def test_an_old_checkpoint_pickle_naming_os_system_through_an_allowed_module_is_refused(tmp_path):
    """A checkpoint from before dcp_metadata.json falls back to the exact allowlist: a pickle reaching
    os.system through `torch.distributed.checkpoint.metadata` (a dotted name), or naming it plainly, or
    setting attributes on an allowed class, is refused, and nothing runs."""
    from rl.trainer.checkpoint import _MetadataUnpickler
    from rl.trainer.train import Trainer
    import io
    import pathlib
    marker = tmp_path / "PWNED"
    cfg, _, step = _trainer_checkpoint(tmp_path)
    if (step / "dcp_metadata.json").exists():  # as an older hetrl wrote it
        (step / "dcp_metadata.json").unlink()
        _rehash(step, drop="dcp_metadata.json")
    (step / "dcp" / ".metadata").write_bytes(_os_system_pickle(marker, dotted=True))
    _rehash(step, "dcp/.metadata")
    with pytest.raises(Exception) as e:
        Trainer(cfg).load(tmp_path, 0)
    assert not marker.exists(), "the crafted .metadata ran its command"
    assert isinstance(e.value, pickle.UnpicklingError), e.value
    assert "names torch.distributed.checkpoint.metadata.os.system" in str(e.value)
    with pytest.raises(pickle.UnpicklingError, match=r"names posix\.system"):
        _MetadataUnpickler(io.BytesIO(_os_system_pickle(marker, dotted=False))).load()
    assert not marker.exists()
    # GLOBAL pathlib.PurePosixPath, then BUILD with slot state: pickle would setattr on the class itself
    build_on_class = b"cpathlib\nPurePosixPath\n(N}Vhetrl_probe\nK\x01stb."
    with pytest.raises(pickle.UnpicklingError, match="sets attributes on the class PurePosixPath"):
        _MetadataUnpickler(io.BytesIO(build_on_class)).load()
    assert not hasattr(pathlib.PurePosixPath, "hetrl_probe")


def test_a_malformed_dcp_metadata_json_is_refused_naming_the_key(tmp_path):
    """The JSON is checked, not trusted: a byte range outside the files the manifest lists under dcp/
    is refused in one line naming the key (and never falls back to the pickle)."""
    from rl.trainer.train import Trainer
    cfg, _, step = _trainer_checkpoint(tmp_path)
    md = json.loads((step / "dcp_metadata.json").read_text())
    md["storage"][0]["file"] = "../trainer_state.json"
    (step / "dcp_metadata.json").write_text(json.dumps(md))
    _rehash(step, "dcp_metadata.json")
    with pytest.raises(CorruptStep, match=r"storage\[0\]\.file='\.\./trainer_state\.json' is not a file the "
                                        r"manifest lists under dcp/"):
        Trainer(cfg).load(tmp_path, 0)


# -- item 8: steps and indexed files are what they claim -----------------------------------------------
def test_a_step_directory_linked_from_another_run_is_refused(tmp_path):
    """`rollouts/step_000000` as a symlink to another run's step verifies against that run's manifest
    today; it is refused, skipped, and setting it aside moves the link, never the other run's step."""
    other = exchange.publish(tmp_path / "other", "rollouts", 0, _files({"f": b"theirs"}), producer="t").path
    mine = tmp_path / "run" / "rollouts"
    mine.mkdir(parents=True)
    (mine / "step_000000").symlink_to(other)
    with pytest.raises(CorruptStep, match=r"step_000000: a symlink \(to .*other.*\), not a step directory"):
        exchange.verify(mine / "step_000000")
    assert exchange.list_steps(tmp_path / "run", "rollouts") == [0]  # it occupies the name
    assert exchange.latest_complete(tmp_path / "run", "rollouts") is None
    exchange.set_aside(tmp_path / "run", "rollouts", 0)
    exchange.verify(other)  # untouched


def test_a_symlink_anywhere_in_a_step_is_refused(tmp_path):
    """A link inside a step, even one the manifest does not list, is not something a producer writes."""
    step = exchange.publish(tmp_path, "rollouts", 0, _files({"f": b"abc"}), producer="t").path
    (step / "extra").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CorruptStep, match=r"extra: a symlink inside the step"):
        exchange.verify(step)


def _weights_step(run_dir: Path, step: int, *, delta_base: int | None = None) -> Path:
    from rl.exchange.weights import write_shards
    tensors = {"model.embed_tokens.weight": torch.arange(32, dtype=torch.float32).reshape(4, 8),
               "model.norm.weight": torch.ones(8)}

    def write(d: Path) -> None:
        write_shards(d, tensors, fp8_enabled=False)
        if delta_base is not None:
            (d / "delta.json").write_text(json.dumps({"base": delta_base}))
    return exchange.publish(run_dir, "weights", step, write, producer="t").path


def _finishes(fn, timeout=20.0):
    """(finished?, what fn returned or raised): a call that blocks (a FIFO opened for reading) is
    reported as unfinished instead of hanging the test."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive(), out


def test_a_weights_index_naming_a_fifo_is_refused_without_blocking(tmp_path):
    """The index names a FIFO beside the manifest (index checksum rewritten): readers refuse it at once,
    verified or not, instead of blocking in open(2)."""
    from rl.exchange import layout, weights
    from rl.exchange.shard_reader import ShardReader
    step = _weights_step(tmp_path, 0)
    fifo = step / "model-evil.safetensors"
    os.mkfifo(fifo)
    index = json.loads((step / layout.INDEX).read_text())
    index["weight_map"]["model.norm.weight"] = fifo.name
    (step / layout.INDEX).write_text(json.dumps(index))
    _rehash(step, layout.INDEX)
    try:
        for read in (lambda: dict(ShardReader(step).tensors()),           # verified: the trainer, a server
                     lambda: weights.load_state_dict(step),               # unverified: iter_tensors
                     lambda: dict(ShardReader(step, verify=False).tensors())):
            done, out = _finishes(read)
            assert done, "the reader blocked opening the FIFO"
            assert isinstance(out.get("error"), CorruptStep), out
            assert "model-evil.safetensors" in str(out["error"])
    finally:  # release a reader an old version left blocked in open(2)
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass


def test_a_delta_chain_that_loops_is_corrupt_not_a_recursion_error(tmp_path):
    """delta.json naming its own step, or two steps naming each other, is refused as CorruptStep by the
    chain walk, by every reader and by retention's audit."""
    from rl.exchange.deltas import stored_tensors
    from rl.exchange import weights
    _weights_step(tmp_path, 0)
    itself = _weights_step(tmp_path, 1, delta_base=1)
    a = _weights_step(tmp_path, 2, delta_base=3)
    _weights_step(tmp_path, 3, delta_base=2)
    for path, says in ((itself, r"base=1 is not an earlier step than step_000001"),
                       (a, r"base=3 is not an earlier step than step_000002")):
        for read in (lambda: stored_tensors(path), lambda: weights.load_state_dict(path)):
            done, out = _finishes(read)
            assert done and isinstance(out.get("error"), CorruptStep), out
            assert __import__("re").search(says, str(out["error"]))
    bad = retention.corrupt_steps(tmp_path, "weights")
    assert set(bad) == {1, 2, 3}  # 3's base (2) loops
    assert retention.prune(tmp_path, "weights", keep_last=1) == []  # a chain it cannot read frees nothing


def test_a_malformed_resume_json_is_refused_in_one_line(tmp_path, monkeypatch):
    """A restart count of the wrong type or sign, or a resume.json that is not an object, is refused in
    one line naming the file, key and value: by a fenced publisher, by prepare, by own_epoch."""
    from rl import runtime
    from rl.prepare import prepare
    run = _run_dir(tmp_path / "run")
    monkeypatch.setattr(fencing, "_FENCES", {})
    monkeypatch.setattr(fencing, "_SEEN", {})
    monkeypatch.delenv("HETRL_EPOCH", raising=False)
    exchange.fence(run, 0)
    for body, says in (({"restart": None}, "restart=None is not a non-negative integer"),
                       ({"restart": "x"}, "restart='x' is not a non-negative integer"),
                       ({"restart": -1}, "restart=-1 is not a non-negative integer"),
                       ({"restart": 1.5}, "restart=1.5 is not a non-negative integer"),
                       ({"restart": True}, "restart=True is not a non-negative integer"),
                       ({"restart": 0, "time": "now"}, "time='now' is not a non-negative time"),
                       ([1, 2], "not a ResumeState record")):
        (run / "resume.json").write_text(json.dumps(body))
        with pytest.raises(Fenced, match=f"weights/step_000001: refused: .*resume.json: .*{says}") as e:
            exchange.publish(run, "weights", 1, _files({"f": b"0"}), producer="t")
        assert "\n" not in str(e.value)
        with pytest.raises(RecordError, match=says):
            prepare(run)
        with pytest.raises(RecordError, match=says):
            runtime.own_epoch(run)
    assert exchange.list_steps(run, "weights") == []
    monkeypatch.setenv("HETRL_EPOCH", "1e3")
    with pytest.raises(ValueError, match=r"HETRL_EPOCH='1e3': not a non-negative integer"):
        runtime.own_epoch(run)


def test_a_rewound_restart_count_does_not_let_a_stale_incarnation_publish(tmp_path, monkeypatch):
    """Incarnation 1 started; resume.json is rewound to restart 0: the process of incarnation 0 is still
    refused (rl.prepare's incarnations/ floor), as is the current one (the record went backwards), and
    the next prepare refuses rather than hand out an epoch again."""
    from rl.prepare import prepare
    run = _run_dir(tmp_path / "run")
    monkeypatch.setattr(fencing, "_FENCES", {})
    monkeypatch.setattr(fencing, "_SEEN", {})
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert prepare(run).restart == 0
    rewound = (run / "resume.json").read_text()
    assert prepare(run, from_scratch=True).restart == 1
    (run / "resume.json").write_text(rewound)  # the rewind: restart 0 again, checksum-free record
    exchange.fence(run, 0)  # the stale incarnation's process, continued after the rewind
    with pytest.raises(Fenced, match=r"weights/step_000001: refused: .*resume.json says restart 0, but "
                                     r"incarnation 1 was started \(incarnations/restart_000001.json\)"):
        exchange.publish(run, "weights", 1, _files({"f": b"zombie"}), producer="t")
    exchange.fence(run, 1)  # the current incarnation: it cannot tell either
    with pytest.raises(Fenced, match="the record went backwards"):
        exchange.check_fence(run, "training on rollouts/step_000001")
    assert exchange.list_steps(run, "weights") == []
    with pytest.raises(RecordError, match="says restart 0, but incarnation 1 was started"):
        prepare(run)
    (run / "resume.json").unlink()  # deleting it is a rewind too
    with pytest.raises(Fenced, match="resume.json is missing, but incarnation 1 was started"):
        exchange.check_fence(run, "x")
