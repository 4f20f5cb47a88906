"""Trainer checkpoints: `checkpoints/step_N/`, the state after N optimizer steps (policy version N).

A checkpoint is published like any other step (`rl.exchange.publish`: written into a tmp dir, manifest
with checksums, atomic rename), so `rl.prepare` can verify it and a half-written one never exists under
its final name. Contents:

- `dcp/`: model and optimizer through torch.distributed.checkpoint, using torchtitan's `ModelWrapper`
  and `OptimizersContainer` state dicts (FQN-keyed; the generic `get_state_dict` helper trips on the
  fused QKV projection). Under torchrun every rank writes its own shards into the same tmp directory
  (rank 0 creates it and broadcasts its name, then publishes it once DCP's collective save returned);
  DCP reshards on load, so a checkpoint resumes under any other (dp_shard, ep, cp) and world size,
  one process included (which runs without a process group).
- `rng.safetensors` + the `rng` entry of `trainer_state.json`: torch, numpy and Python RNG states (no
  pickle: tensors in safetensors, the rest in JSON);
- `trainer_state.json`: `next_step` (the data position: the rollout step this state consumes next; equal
  to N), and `consumed`, the rollout steps this lineage trained on, in order.

DCP's own `.metadata` file is a pickle written by torch (its format has no other encoding), the one
pickle on the shared filesystem. It is never unpickled as found: `load` verifies the whole checkpoint
against its manifest (sha256) in the loading process, then reads `.metadata` once into memory, checks
those bytes against the manifest again (nothing can swap the file between check and use), and
unpickles them with an allowlist of DCP's own metadata classes, torch.Size, dtypes and paths
(`_MetadataUnpickler`): a crafted pickle cannot call anything else. DCP's non-tensor entries (the
optimizer's hyperparameters) are read with `torch.load(weights_only=True)` instead of DCP's default
`weights_only=False`; tensor shards already are.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import pathlib
import pickle
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from rl import exchange
from rl.faults import crash_point

KIND = "checkpoints"
STATE_FILE = "trainer_state.json"
RNG_FILE = "rng.safetensors"
DCP_DIR = "dcp"


@dataclass
class TrainerProgress:
    """What besides weights and optimizer a resumed trainer needs."""
    next_step: int = 0
    consumed: list[int] = field(default_factory=list)


def _rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    np_state = np.random.get_state()
    py_state = random.getstate()
    tensors = {"torch": torch.get_rng_state(),
               "numpy_keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.uint32).view(np.int32).copy())}
    meta = {"numpy": {"kind": np_state[0], "pos": int(np_state[2]), "has_gauss": int(np_state[3]),
                      "cached_gaussian": float(np_state[4])},
            "python": [py_state[0], list(py_state[1]), py_state[2]]}
    return tensors, meta


def _set_rng_state(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    torch.set_rng_state(tensors["torch"])
    n = meta["numpy"]
    keys = tensors["numpy_keys"].numpy().view(np.uint32)
    np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    v, st, gauss = meta["python"]
    random.setstate((v, tuple(st), gauss))


@contextlib.contextmanager
def _quiet():
    """DCP warns on every call that it runs without a process group; on one process that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _stateful(model, optimizer) -> dict:
    from torchtitan.components.checkpointer.base import ModelWrapper
    return {"model": ModelWrapper(model), **({"optimizer": optimizer} if optimizer is not None else {})}


def _has_state(optimizer) -> bool:
    # A fresh optimizer has no state yet; torchtitan's state_dict() would materialise it with a zero-lr
    # step, which counts as an Adam step (bias correction) and so changes the training that follows.
    # Such an optimizer is not saved, and on load it stays fresh.
    return any(len(o.state) for o in optimizer.optimizers)


def save(run_dir, step: int, model, optimizer, progress: TrainerProgress, *, producer: str = "trainer",
         dist=None) -> exchange.Published | None:
    """Publish `checkpoints/step_<step>`; `overwrite` so a re-run step replaces a stale one.

    `dist` (rl.trainer.parallel.Dist): under torchrun every rank calls this; rank 0 publishes and
    returns the Published, the others write their DCP shards and return None.
    """
    import torch.distributed.checkpoint as dcp

    with_opt = _has_state(optimizer)
    distributed = dist is not None and dist.distributed
    if distributed and not dist.is_main:
        tmp = Path(dist.broadcast(None))
        dcp.save(_stateful(model, optimizer if with_opt else None), checkpoint_id=str(tmp / DCP_DIR))
        dist.barrier()  # rank 0 has published (renamed) the directory
        return None

    def write(tmp: Path) -> None:
        if distributed:
            dist.broadcast(str(tmp))
        crash_point("checkpoint.save")
        with _quiet():
            dcp.save(_stateful(model, optimizer if with_opt else None), checkpoint_id=str(tmp / DCP_DIR))
        tensors, rng_meta = _rng_state()
        save_file(tensors, str(tmp / RNG_FILE))
        (tmp / STATE_FILE).write_text(json.dumps(
            {"step": step, "next_step": progress.next_step, "consumed": list(progress.consumed),
             "optimizer_state": with_opt, "rng": rng_meta}, indent=1))

    published = exchange.publish(run_dir, KIND, step, write, producer=producer, policy_version=step,
                                 overwrite=True)
    if distributed:
        dist.barrier()
    return published


def load(run_dir, step: int, model, optimizer) -> TrainerProgress:
    """Restore model, optimizer and RNG from `checkpoints/step_<step>` (verified); return the progress."""
    import torch.distributed.checkpoint as dcp

    path = exchange.step_dir(run_dir, KIND, step)
    manifest = exchange.verify(path, checksums=True)  # in this process, right before loading
    state = json.loads((path / STATE_FILE).read_text())
    with _quiet():
        dcp.load(_stateful(model, optimizer if state["optimizer_state"] else None),
                 storage_reader=_reader(path.resolve(), manifest), planner=_planner())
    _set_rng_state(load_file(str(path / RNG_FILE)), state["rng"])
    return TrainerProgress(next_step=int(state["next_step"]), consumed=[int(s) for s in state["consumed"]])


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata` and nothing else: only the classes such a file names are found."""
    _MODULES = ("torch.distributed.checkpoint.metadata",)
    _NAMES = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
              ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
              ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in self._MODULES or (module, name) in self._NAMES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"DCP metadata names {module}.{name}, which a checkpoint's metadata "
                                     f"never holds: refused")


def _reader(step_path: pathlib.Path, manifest: dict):
    """DCP's FileSystemReader, reading `.metadata` from verified bytes through `_MetadataUnpickler`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class VerifiedReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            path = pathlib.Path(self._get_metadata_path(kwargs.get("rank")))
            rel = path.relative_to(step_path).as_posix()
            expected = manifest["files"].get(rel, {}).get("sha256")
            data = path.read_bytes()
            if expected is None or hashlib.sha256(data).hexdigest() != expected:
                raise exchange.CorruptStep(f"{path}: not listed with a matching sha256 in {step_path}/"
                                           f"{exchange.MANIFEST}: refusing to unpickle it")
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
            return metadata

    return VerifiedReader(str(step_path / DCP_DIR))


def _planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class PlainDataPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            # DCP reads non-tensor entries with weights_only=False; read them as plain data here, then
            # hand DCP a copy this process serialised itself, so its own placement logic still applies
            plain = torch.load(value, weights_only=True)
            buf = io.BytesIO()
            torch.save(plain, buf)
            buf.seek(0)
            super().load_bytes(read_item, buf)

    return PlainDataPlanner()


def resume_step(run_dir) -> int | None:
    """The checkpoint this incarnation resumes from: resume.json's decision, else the newest complete one."""
    from rl.runtime import resume_state
    from rl.contract import paths
    if paths.resume_file(run_dir).exists():
        return resume_state(run_dir).checkpoint_step
    return exchange.latest_complete(run_dir, KIND, checksums=True)
