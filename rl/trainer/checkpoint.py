"""Trainer checkpoints: `checkpoints/step_N/`, the state after N optimizer steps (policy version N).

A checkpoint is published like any other step (`rl.exchange.publish`: written into a tmp dir, manifest
with checksums, atomic rename), so `rl.prepare` can verify it and a half-written one never exists under
its final name. Contents:

- `dcp/`: model and optimizer through torch.distributed.checkpoint, using torchtitan's `ModelWrapper`
  and `OptimizersContainer` state dicts (FQN-keyed; the generic `get_state_dict` helper trips on the
  fused QKV projection). Under torchrun every rank writes its own shards into the same tmp directory
  (rank 0 creates it and broadcasts its name, then publishes it once DCP's collective save returned;
  every rank opens and checks it itself and hands DCP its pinned fd path, rl.contract.privdirs.pinned_dir);
  DCP reshards on load, so a checkpoint resumes under any other (dp_shard, ep, cp) and world size,
  one process included (which runs without a process group).
- `rng.safetensors` + the `rng` entry of `trainer_state.json`: torch, numpy and Python RNG states (no
  pickle: tensors in safetensors, the rest in JSON);
- `trainer_state.json`: `next_step` (the data position: the rollout step this state consumes next; equal
  to N), and `consumed`, the rollout steps this lineage trained on, in order.

- `dcp_metadata.json`: DCP's metadata (which tensors and chunks exist, where their bytes are) in a JSON
  format of ours, written by the publishing rank from the Metadata `dcp.save` returns.

Nothing read from the run directory can run code. DCP's own `dcp/.metadata` is a pickle (torch has no
other encoding for it); it is still written, for torch's own tools, but `load` never unpickles it: it
rebuilds DCP's Metadata from `dcp_metadata.json` (`_metadata_from_json`), checking every field's type
and that every byte range it names lies in a file the manifest lists under `dcp/`. Those bytes are read
once and checked against the manifest's sha256 again as read (nothing can swap the file between the
whole-checkpoint verify and use), and DCP reads its data files through `rl.exchange.open_in_step` (no
symlink followed, no FIFO opened). DCP's non-tensor entries (the optimizer's hyperparameters) are read
with `torch.load(weights_only=True)` instead of DCP's default `weights_only=False`; tensor shards already are.

A checkpoint never holds a NaN or inf: `save` first checks every floating tensor of the model and the
optimizer state (`isfinite().all()` on each rank's local shard, one read-back per device, the count
summed over ranks so all stop together) and refuses with NonFiniteCheckpoint, one line naming the first
such tensor and the step, before writing anything: the previous checkpoint stays the newest.

Checkpoints saved before `dcp_metadata.json` existed (an older run directory) still load, so that
upgrading never strands a run: their `.metadata` is unpickled from the verified bytes by
`_MetadataUnpickler`, which resolves exactly the (module, name) pairs such a file holds (DCP's metadata
classes, torch.Size, torch's dtype and layout names, OrderedDict, PosixPath), refuses every other name,
dotted ones included (`torch.distributed.checkpoint.metadata` + `os.system` reached os through the old
module-wide rule), and refuses setting attributes on a class. A checkpoint that has the JSON never falls
back to the pickle, whatever the JSON holds: a malformed one is CorruptStep.
"""
from __future__ import annotations

import contextlib
import copy
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
from safetensors.torch import load as load_safetensors
from safetensors.torch import save_file

from rl import exchange
from rl.contract import privdirs, safefs
from rl.faults import crash_point

KIND = "checkpoints"
STATE_FILE = "trainer_state.json"
RNG_FILE = "rng.safetensors"
DCP_DIR = "dcp"
METADATA_FILE = "dcp_metadata.json"
_FORMAT = "hetrl-dcp-metadata"


_CHECKED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class NonFiniteCheckpoint(RuntimeError):
    """A checkpoint refused because the state to save holds a NaN or inf; the message names the tensor."""


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


def _local(v):
    return v.to_local() if hasattr(v, "to_local") else v  # this rank's shard of a DTensor


def check_finite(model, optimizer, what: str, dist=None) -> None:
    """Raise NonFiniteCheckpoint on every rank if any rank's part of the model or optimizer state holds a
    NaN or inf, naming `what` and the first such tensor (its FQN, or the optimizer key and parameter)."""
    flags: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}

    def add(name: str, v) -> None:
        v = _local(v)
        if torch.is_tensor(v) and v.dtype in _CHECKED_DTYPES and v.numel():
            flags.setdefault(v.device, []).append((name, torch.isfinite(v).all()))

    parts = model if isinstance(model, (list, tuple)) else [model]
    for m in parts:
        for k, v in m.state_dict().items():
            add(k, v)
    if optimizer is not None:
        names = {id(p): n for m in parts for n, p in m.named_parameters()}
        for o in getattr(optimizer, "optimizers", [optimizer]):
            for p, state in o.state.items():
                for key, v in state.items():
                    add(f"optimizer {key} of {names.get(id(p), 'a parameter')}", v)
    bad = []
    for items in flags.values():  # one read-back per device: a sync per tensor costs thousands of them
        ok = torch.stack([f for _, f in items]).tolist()
        bad += [k for (k, _), good in zip(items, ok) if not good]
    n_bad = len(bad)
    if dist is not None and dist.distributed:
        n_bad = int(dist.sum(torch.tensor(float(n_bad), device=dist.device)))
    if n_bad:
        rank = f" (rank {dist.rank})" if dist is not None and dist.distributed else ""
        where = f"{bad[0]}{rank}" if bad else "on another rank"
        raise NonFiniteCheckpoint(f"{what}: refusing to save a checkpoint holding NaN or inf: {n_bad} tensor(s), "
                                  f"first {where}; the newest checkpoint stays the previous one")


def save(run_dir, step: int, model, optimizer, progress: TrainerProgress, *, producer: str = "trainer",
         dist=None) -> exchange.Published | None:
    """Publish `checkpoints/step_<step>`; `overwrite` so a re-run step replaces a stale one. Refused
    (NonFiniteCheckpoint, nothing written) when the state holds a NaN or inf.

    `dist` (rl.trainer.parallel.Dist): under torchrun every rank calls this; rank 0 publishes and
    returns the Published, the others write their DCP shards and return None.
    """
    with_opt = _has_state(optimizer)
    # every rank, before any writes: a collective, so all stop together
    check_finite(model, optimizer if with_opt else None, f"{KIND}/step_{step:06d}", dist)
    return _publish(run_dir, step, model, optimizer, progress, producer=producer, dist=dist)


def _publish(run_dir, step: int, model, optimizer, progress: TrainerProgress, *, producer: str,
             dist) -> exchange.Published | None:
    """`save` without the check (tests use it to make what an older hetrl could have saved).

    Every file goes into the step's private tmp dir through the path rl.contract.privdirs.pinned_dir
    hands out (`/proc/self/fd/<fd>` of the directory this process opened and checked: this user's,
    mode 0700), never through its name: DCP resolves its path again for every file it writes, and a
    name in the kind directory can be renamed and replaced by a link in between. Under torchrun rank 0
    makes the directory and broadcasts its name; every other rank opens and checks it itself."""
    import torch.distributed.checkpoint as dcp

    with_opt = _has_state(optimizer)
    distributed = dist is not None and dist.distributed
    if distributed and not dist.is_main:
        tmp = Path(dist.broadcast(None))
        with privdirs.pinned_dir(tmp) as pinned:
            _dcp_save(dcp, model, optimizer if with_opt else None, pinned)
        dist.barrier()  # rank 0 has published (renamed) the directory
        return None

    def write(pinned: Path, tmp: Path) -> None:
        if distributed:
            dist.broadcast(str(tmp))
        crash_point("checkpoint.save")
        md = _dcp_save(dcp, model, optimizer if with_opt else None, pinned)
        # the metadata as returned (every rank's plans merged), not read back: loads never unpickle
        (pinned / METADATA_FILE).write_text(json.dumps(_metadata_to_json(md), separators=(",", ":")))
        tensors, rng_meta = _rng_state()
        save_file(tensors, str(pinned / RNG_FILE))
        (pinned / STATE_FILE).write_text(json.dumps(
            {"step": step, "next_step": progress.next_step, "consumed": list(progress.consumed),
             "optimizer_state": with_opt, "rng": rng_meta}, indent=1))

    published = exchange.publish(run_dir, KIND, step, write, producer=producer, policy_version=step,
                                 overwrite=True, named=True)
    if distributed:
        dist.barrier()
    return published


def _dcp_save(dcp, model, optimizer, pinned: Path):
    """DCP's save of the model (and optimizer) into `pinned`/dcp: the pinned path of the step's tmp dir."""
    with _quiet():
        return dcp.save(_stateful(model, optimizer), checkpoint_id=str(pinned / DCP_DIR))


def load(run_dir, step: int, model, optimizer) -> TrainerProgress:
    """Restore model, optimizer and RNG from `checkpoints/step_<step>` (verified); return the progress."""
    import torch.distributed.checkpoint as dcp

    path = exchange.step_dir(run_dir, KIND, step)
    manifest = exchange.verify(path, checksums=True)  # in this process, right before loading
    state = json.loads(_verified_bytes(path, STATE_FILE, manifest))
    with _quiet():
        dcp.load(_stateful(model, optimizer if state["optimizer_state"] else None),
                 storage_reader=_reader(path.resolve(), manifest), planner=_planner())
    _set_rng_state(load_safetensors(_verified_bytes(path, RNG_FILE, manifest)), state["rng"])
    return TrainerProgress(next_step=int(state["next_step"]), consumed=[int(s) for s in state["consumed"]])


def _verified_bytes(step_path: Path, rel: str, manifest: dict) -> bytes:
    """`rel`'s bytes, read once (rl.exchange.read_in_step) and matched against the manifest's sha256 as read."""
    data = exchange.read_in_step(step_path, rel)
    expected = manifest["files"].get(rel, {}).get("sha256")
    if expected is None or hashlib.sha256(data).hexdigest() != expected:
        raise exchange.CorruptStep(f"{step_path / rel}: not listed with a matching sha256 in {step_path}/"
                                   f"{exchange.MANIFEST}: refused")
    return data


# -- DCP metadata as JSON ------------------------------------------------------------------------------
_MEMORY_FORMATS = ("contiguous_format", "channels_last", "preserve_format")


def _torch_name(value, kind) -> str:
    name = str(value).removeprefix("torch.")
    if getattr(torch, name, None) is not value:
        raise TypeError(f"{value!r} is not a torch.{kind} named in the torch module")
    return name


def _metadata_to_json(md) -> dict:
    """DCP's Metadata as plain JSON data (`_metadata_from_json` is the inverse)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
    entries = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            p = m.properties
            entries[fqn] = {"type": "tensor", "dtype": _torch_name(p.dtype, "dtype"),
                            "layout": _torch_name(p.layout, "layout"),
                            "memory_format": _torch_name(p.memory_format, "memory_format"),
                            "requires_grad": bool(p.requires_grad), "pin_memory": bool(p.pin_memory),
                            "size": list(m.size),
                            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in m.chunks]}
        elif isinstance(m, BytesStorageMetadata):
            entries[fqn] = {"type": "bytes"}
        else:
            raise TypeError(f"DCP metadata entry {fqn}: {type(m).__name__}, which this format does not hold")
    storage = [{"fqn": k.fqn, "offset": None if k.offset is None else list(k.offset), "index": k.index,
                "file": v.relative_path, "at": v.offset, "length": v.length,
                "transforms": list(v.transform_descriptors or [])}
               for k, v in md.storage_data.items()]
    planner = None if md.planner_data is None else {k: list(v) for k, v in md.planner_data.items()}
    sm = md.storage_meta
    return {"format": _FORMAT, "version": 1, "dcp_version": md.version, "state_dict": entries,
            "storage": storage, "planner_data": planner,
            "storage_meta": None if sm is None else {
                "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
                "save_id": sm.save_id, "modules": list(sm.modules)}}


def _metadata_from_json(data: bytes, where: Path, manifest: dict):
    """DCP's Metadata rebuilt from `dcp_metadata.json`, every value type-checked; a byte range must lie
    in a file the manifest lists under dcp/. CorruptStep naming the file, key and value otherwise."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta, TensorProperties,
                                                       TensorStorageMetadata)

    def bad(key, value, expected):
        return exchange.CorruptStep(f"{where}: {key}={value!r:.80} is not {expected}")

    def count(key, v):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise bad(key, v, "a non-negative integer")
        return v

    def dims(key, v):
        if not isinstance(v, list):
            raise bad(key, v, "a list of sizes")
        return torch.Size([count(key, x) for x in v])

    def text(key, v, optional=False):
        if not (isinstance(v, str) or (optional and v is None)):
            raise bad(key, v, "a string" + (" or null" if optional else ""))
        return v

    def flag(key, v):
        if not isinstance(v, bool):
            raise bad(key, v, "true or false")
        return v

    def named(key, v, kind, allowed=None):
        obj = getattr(torch, v, None) if isinstance(v, str) and v.isidentifier() else None
        if not isinstance(obj, kind) or (allowed is not None and v not in allowed):
            raise bad(key, v, f"a {kind.__name__} name")
        return obj

    try:
        obj = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise exchange.CorruptStep(f"{where}: not valid JSON ({e})") from None
    if not isinstance(obj, dict) or obj.get("format") != _FORMAT or obj.get("version") != 1:
        raise exchange.CorruptStep(f"{where}: not a {_FORMAT} version 1 object")
    state_dict, storage = obj.get("state_dict"), obj.get("storage")
    if not isinstance(state_dict, dict):
        raise bad("state_dict", state_dict, "an object")
    if not isinstance(storage, list):
        raise bad("storage", storage, "a list")
    entries = {}
    for fqn, e in state_dict.items():
        k = f"state_dict[{fqn!r}]"
        if not isinstance(e, dict) or e.get("type") not in ("tensor", "bytes"):
            raise bad(k, e, "a tensor or bytes entry")
        if e["type"] == "bytes":
            entries[fqn] = BytesStorageMetadata()
            continue
        props = TensorProperties(dtype=named(f"{k}.dtype", e.get("dtype"), torch.dtype),
                                 layout=named(f"{k}.layout", e.get("layout"), torch.layout),
                                 requires_grad=flag(f"{k}.requires_grad", e.get("requires_grad")),
                                 memory_format=named(f"{k}.memory_format", e.get("memory_format"),
                                                     torch.memory_format, _MEMORY_FORMATS),
                                 pin_memory=flag(f"{k}.pin_memory", e.get("pin_memory")))
        chunks = e.get("chunks")
        if not isinstance(chunks, list) or not all(isinstance(c, dict) for c in chunks):
            raise bad(f"{k}.chunks", chunks, "a list of chunks")
        entries[fqn] = TensorStorageMetadata(
            properties=props, size=dims(f"{k}.size", e.get("size")),
            chunks=[ChunkStorageMetadata(offsets=dims(f"{k}.chunks[{i}].offsets", c.get("offsets")),
                                         sizes=dims(f"{k}.chunks[{i}].sizes", c.get("sizes")))
                    for i, c in enumerate(chunks)])
    storage_data = {}
    for i, e in enumerate(storage):
        k = f"storage[{i}]"
        if not isinstance(e, dict):
            raise bad(k, e, "an object")
        rel = text(f"{k}.file", e.get("file"))
        info = manifest["files"].get(f"{DCP_DIR}/{rel}") if exchange.rel_ok(rel) else None
        if info is None:
            raise bad(f"{k}.file", rel, f"a file the manifest lists under {DCP_DIR}/")
        at, length = count(f"{k}.at", e.get("at")), count(f"{k}.length", e.get("length"))
        if at + length > info["size"]:
            raise bad(f"{k}.length", length, f"a range inside {DCP_DIR}/{rel} ({info['size']} bytes, from {at})")
        if e.get("transforms") not in ([], None):
            raise bad(f"{k}.transforms", e.get("transforms"), "empty (hetrl saves no stream transforms)")
        index = e.get("index")
        if index is not None:
            count(f"{k}.index", index)
        fqn = text(f"{k}.fqn", e.get("fqn"))
        if fqn not in entries:
            raise bad(f"{k}.fqn", fqn, "an entry of state_dict")
        offset = None if e.get("offset") is None else dims(f"{k}.offset", e.get("offset"))
        storage_data[MetadataIndex(fqn, offset, index)] = _StorageInfo(relative_path=rel, offset=at, length=length)
    planner = obj.get("planner_data")
    if planner is not None:
        if not isinstance(planner, dict):
            raise bad("planner_data", planner, "an object or null")
        for fqn, keys in planner.items():
            if not isinstance(keys, list) or not all(isinstance(x, (str, int)) and not isinstance(x, bool)
                                                     for x in keys):
                raise bad(f"planner_data[{fqn!r}]", keys, "a list of keys")
        planner = {fqn: tuple(keys) for fqn, keys in planner.items()}
    sm = obj.get("storage_meta")
    if sm is not None:
        if not isinstance(sm, dict):
            raise bad("storage_meta", sm, "an object or null")
        modules = sm.get("modules", [])
        if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
            raise bad("storage_meta.modules", modules, "a list of strings")
        sm = StorageMeta(checkpoint_id=text("storage_meta.checkpoint_id", sm.get("checkpoint_id"), True),
                         save_id=text("storage_meta.save_id", sm.get("save_id"), True), modules=modules)
    return Metadata(state_dict_metadata=entries, planner_data=planner, storage_data=storage_data,
                    storage_meta=sm, version=text("dcp_version", obj.get("dcp_version"), True))


# -- checkpoints saved before dcp_metadata.json: the pickle, through an exact allowlist -----------------
_DTYPE_NAMES = frozenset(n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype))


class _MetadataUnpickler(pickle._Unpickler):
    """Unpickles the `.metadata` of a checkpoint saved before `dcp_metadata.json` existed, and nothing
    else: `find_class` resolves exactly the (module, name) pairs such a file holds, never a dotted name
    (pickle would walk `a.b` as attributes from the module: `torch.distributed.checkpoint.metadata` +
    `os.system` reached os.system that way), and BUILD on a class (which pickle would turn into setattr on
    it) is refused. The pure-Python unpickler, because the C one cannot refuse BUILD; these files are small."""
    _NAMES = frozenset({
        *(("torch.distributed.checkpoint.metadata", n) for n in (
            "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
            "TensorProperties", "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING")),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
        ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")})
    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str):
        if "." not in name and ((module, name) in self._NAMES or (module == "torch" and name in _DTYPE_NAMES)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"DCP metadata names {module}.{name}, which a checkpoint's metadata "
                                     f"never holds: refused")

    def load_build(self):
        if isinstance(self.stack[-2], type):
            raise pickle.UnpicklingError(f"DCP metadata sets attributes on the class {self.stack[-2].__name__}: "
                                         f"refused")
        super().load_build()
    dispatch[pickle.BUILD[0]] = load_build


def _read_metadata(step_path: pathlib.Path, manifest: dict):
    """DCP's Metadata of the checkpoint at `step_path`: from `dcp_metadata.json` (checked against the
    manifest as read), or, for a checkpoint saved before it existed, from `dcp/.metadata` through
    `_MetadataUnpickler` (module docstring)."""
    data = exchange.read_in_step(step_path, METADATA_FILE, missing_ok=True)
    if data is not None:
        expected = manifest["files"].get(METADATA_FILE, {}).get("sha256")
        if expected is None or hashlib.sha256(data).hexdigest() != expected:
            raise exchange.CorruptStep(f"{step_path / METADATA_FILE}: not listed with a matching sha256 in "
                                       f"{step_path}/{exchange.MANIFEST}: refused")
        return _metadata_from_json(data, step_path / METADATA_FILE, manifest)
    rel = f"{DCP_DIR}/.metadata"
    data = exchange.read_in_step(step_path, rel)
    expected = manifest["files"].get(rel, {}).get("sha256")
    if expected is None or hashlib.sha256(data).hexdigest() != expected:
        raise exchange.CorruptStep(f"{step_path / rel}: not listed with a matching sha256 in "
                                   f"{step_path}/{exchange.MANIFEST}: refusing to unpickle it")
    print(f"[checkpoint] {step_path.name} predates {METADATA_FILE}: reading its {rel} through the exact "
          f"allowlist", flush=True)
    return _MetadataUnpickler(io.BytesIO(data)).load()


def _reader(step_path: pathlib.Path, manifest: dict):
    """DCP's FileSystemReader: the metadata rebuilt from verified `dcp_metadata.json` (or, for an older
    checkpoint without it, unpickled from verified bytes by `_MetadataUnpickler`); data files opened
    without following links (rl.exchange.open_in_step)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystem
    from torch.distributed.checkpoint.metadata import StorageMeta

    class InStepFS(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path, mode):
            if mode != "rb":
                raise ValueError(f"{path}: a checkpoint being loaded is opened for reading only")
            fd = exchange.open_in_step(step_path, pathlib.Path(path).relative_to(step_path).as_posix())
            with open(fd, "rb") as f:
                yield f

    # Read and checked here, before dcp.load: inside it a failure is retried as a rank-local metadata
    # file and comes back wrapped in a multi-line CheckpointException; here it is one CorruptStep line.
    metadata = _read_metadata(step_path, manifest)

    class VerifiedReader(FileSystemReader):
        def __init__(self, path):
            super().__init__(path)
            self.fs = InStepFS()

        def read_metadata(self, *args, **kwargs):
            md = copy.copy(metadata)
            md.storage_meta = copy.copy(metadata.storage_meta) if metadata.storage_meta else StorageMeta()
            md.storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
            return md

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
