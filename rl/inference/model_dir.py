"""The replica's model directory on node-local disk: an HF checkpoint vLLM loads, made from a published step.

`materialize` writes the run's assets (tokenizer, config.json) and the weights of `weights/step_v` into
the replica's planned `model_dir`: dequantized to the serving dtype (vLLM's CPU build cannot compute
with FP8 block weights), or the FP8 shards as they are with a `quantization_config` vLLM's Fp8Config
reads (`fp8_quant_config`). Node-local because vLLM loads far faster from there than from the shared
filesystem; every byte is verified against the published checksums before it is written. A directory
made from the same step (same manifest, dtype, fp8: `SOURCE_FILE`) is reused, so a restart on the node
or several processes sharing one disk never rewrite one a vLLM may be loading.

Directories left by earlier runs are removed only if this code made them (`claim` leaves an owner
record per role process) and every owner on this host is gone (`clean_stale`).

The node-local base (cluster.node_local_dir, often /tmp) is shared with the node's other users, and a
model directory is code as much as data: vLLM imports what its config.json's `auto_map` names under
trust_remote_code. So the copy lives below a directory of this user's own (rl.contract.paths puts every
run under `<base>/hetrl-<uid>/`), checked on every use (rl.contract.privdirs.make_trusted_dirs: each
directory on the way owned by root or this user and not writable by others unless sticky, the last one
this user's own; a per-user directory someone else made first is refused in one line, never used), a
copy or file this user does not own is never reused, and the copy is written into a fresh 0700
directory through its pinned fd path (rl.contract.privdirs.pinned_dir), then renamed into place and
checked to be the directory that was written.

Split from rl/inference/server.py (issue 23): the role (server) decides what to load and runs vLLM;
this module only turns a published step into a directory. No vLLM import; torch and safetensors only
inside `materialize`.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import stat
import time
import uuid
from pathlib import Path

from rl.contract import privdirs, procs, safefs
from rl.contract.atomic import atomic_write_json
from rl.exchange import MANIFEST, open_in_step, quant_holder, read_in_step

# DeepSeek-V3 / Kimi checkpoint convention for block-scaled e4m3, as vLLM's Fp8Config reads it.
FP8_QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}
# What a materialised model dir was made from; a dir with the same source is reused, not rewritten.
SOURCE_FILE = "hetrl_source.json"


def fp8_quant_config(checkpoint_config: dict, fp8_meta: dict, weight_names) -> dict:
    """The `quantization_config` for serving the published FP8 shards as they are (pure function).

    From the checkpoint's own block-FP8 quantization_config when it has one (its keys kept, its ignore
    list kept under the key it uses: `ignored_layers`, `modules_to_not_convert`), else
    FP8_QUANT_CONFIG. Added to the ignore list: every module whose 2-D weight the publisher kept in high
    precision (in `weight_names`, the index's tensors, but not in fp8.json's `quantized`), named as a
    module path (the tensor name without `.weight`), the form vLLM's `is_layer_skipped` compares
    (exact match; it expands fused layers such as qkv_proj / gate_up_proj into these unfused names, and
    `Fp8Config.apply_vllm_mapper` maps checkpoint prefixes such as `language_model.`). Without that a
    layer vLLM builds with the quant config (Qwen3-MoE's router gate, for one) would expect FP8 values
    and a `weight_scale_inv` the shards do not have.
    vLLM's Fp8Config reads `ignored_layers` and falls back to `modules_to_not_convert` only when the
    former is empty, so a checkpoint that uses neither gets `ignored_layers`.
    """
    from rl.exchange.layout import SCALE_SUFFIX
    own = quant_holder(checkpoint_config).get("quantization_config") or {}
    if own and own.get("quant_method") != "fp8":
        own = {}  # another format: the shards are ours (block FP8), not the checkpoint's
    q = {k: (list(v) if isinstance(v, list) else v) for k, v in own.items()} if own else dict(FP8_QUANT_CONFIG)
    for k, v in FP8_QUANT_CONFIG.items():
        q.setdefault(k, v)
    q["weight_block_size"] = [int(fp8_meta.get("block", 128))] * 2
    if q.get("ignored_layers"):
        key = "ignored_layers"
    elif "modules_to_not_convert" in q:
        key = "modules_to_not_convert"
    else:
        key = "ignored_layers"
    ignored = list(q.get(key) or [])
    quantized = set(fp8_meta.get("quantized") or [])
    kept = sorted({n.removesuffix(".weight") for n in weight_names
                   if n.endswith(".weight") and n not in quantized and not n.endswith(SCALE_SUFFIX)})
    q[key] = ignored + [m for m in kept if m not in ignored]
    return q


def claim(local_dir: Path, run_dir: Path, role: str) -> Path:
    """Record that this process uses `local_dir` (one owner record per role process: several replicas,
    or several nodes of one replica sharing a host's disk, own the same run directory). `local_dir` is
    made (0700) or checked to be this user's own below directories nobody else can rename in
    (rl.contract.privdirs.make_trusted_dirs): UnsafePath, one line, otherwise."""
    privdirs.make_trusted_dirs(local_dir)
    p = local_dir / f"owner.{role}.json"
    atomic_write_json(p, {"run_dir": str(run_dir), "host": socket.gethostname(), "pid": os.getpid(),
                       "role": role, "time": time.time()})
    return p


_MAX_OWNER = 1 << 16


def _owner_records(d: Path) -> list:
    """The owner records (`owner*.json`) in `d` and in its subdirectories, read through safefs: one that
    is a link, a FIFO, or a file another user owns or can write counts as foreign ({})."""
    out = []
    for where in [d, *(d / n for n, m in safefs.scandir(d) if stat.S_ISDIR(m))]:
        for name, _ in safefs.scandir(where):
            if name.startswith("owner") and name.endswith(".json"):
                try:
                    out.append(json.loads(safefs.read_bytes(where / name, limit=_MAX_OWNER)))
                except (OSError, ValueError):
                    out.append({})  # unreadable, or not this user's: treat as foreign
    return out


def clean_stale(base: Path, keep: str) -> list[str]:
    """Remove run directories under `base` (this user's directory in cluster.node_local_dir) that this
    code created and nobody uses.

    A directory is ours if it holds owner records (`owner*.json`, written by `claim`); it is stale if every
    one of them names this host and a process that is gone. Anything else is left alone: directories
    other tools made, and those of processes on other hosts (a node-local dir that is in fact shared).
    A Slurm run keeps its records one level down, in its per-node, per-incarnation directories
    (rl.contract.paths.node_dir); they count as the run's. A `base` this user does not own is not
    looked into (it is not this user's to clean); nothing is followed through a link."""
    gone: list[str] = []
    try:
        st = safefs.lstat(base)
    except safefs.UnsafePath:
        return gone
    if st is None or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return gone
    host = socket.gethostname()
    for name, mode in safefs.scandir(base):
        if name == keep or not stat.S_ISDIR(mode):
            continue
        d = Path(base) / name
        owners = _owner_records(d)
        if not owners:
            continue
        if all(isinstance(o, dict) and "run_dir" in o and o.get("host") == host
               and procs.is_pid(o.get("pid")) and not procs.alive(o["pid"]) for o in owners):
            safefs.remove(d)
            gone.append(name)
    return gone


def _source(weights_dir: Path, *, dtype, fp8: bool) -> dict:
    manifest = hashlib.sha256(read_in_step(weights_dir, MANIFEST)).hexdigest()
    return {"weights": str(weights_dir), "manifest_sha256": manifest, "fp8": fp8,
            "dtype": None if fp8 else str(dtype).removeprefix("torch.")}


def _made_from(model_dir: Path, source: dict) -> bool:
    """Whether `model_dir` is this user's copy of `source`: the directory, its SOURCE_FILE and its
    config.json this user's own and writable by nobody else (safefs), and SOURCE_FILE naming `source`.
    A directory in its place that this user does not own is refused (UnsafePath), never reused."""
    st = safefs.lstat(model_dir)
    if st is None:
        return False
    if not stat.S_ISDIR(st.st_mode):
        raise safefs.UnsafePath(f"{model_dir}: {safefs.what(st.st_mode)}, not a model directory")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise safefs.UnsafePath(f"{model_dir}: owned by uid {st.st_uid}, mode "
                                f"{stat.S_IMODE(st.st_mode):04o}; a model copy is reused only if it is this "
                                f"user's own and nobody else can write it")
    try:
        got = json.loads(safefs.read_bytes(model_dir / SOURCE_FILE, limit=1 << 20))
        safefs.read_bytes(model_dir / "config.json", limit=1 << 26)  # this user's own file, or rewritten
    except (OSError, ValueError):
        return False
    return isinstance(got, dict) and all(got.get(k) == v for k, v in source.items())


def _two_dim_weights(weights_dir: Path, index: dict) -> list[str]:
    """Names of the 2-D tensors of a published step (the linear weights and embeddings), from the
    safetensors headers only."""
    from safetensors import safe_open
    out = []
    for fname in dict.fromkeys(index["weight_map"].values()):
        with safe_open(str(weights_dir / fname), framework="pt") as f:
            out += [n for n in f.keys() if len(f.get_slice(n).get_shape()) == 2]
    return out


def _put(path: Path, data: bytes) -> None:
    """A new file (O_EXCL, safefs) in the pinned tmp dir."""
    safefs.write_atomic(path, data)


def _copy_in(step: Path, name: str, dst: Path) -> None:
    """Copy the regular file `name` of `step` (opened without following a link, rl.exchange.open_in_step)
    to the new file `dst` (safefs.open_write, O_EXCL)."""
    src = open_in_step(step, name)
    try:
        out = safefs.open_write(dst, exclusive=True)
        try:
            off = 0
            while n := os.sendfile(out, src, off, 1 << 30):  # file to file, across filesystems
                off += n
            os.fsync(out)
        finally:
            os.close(out)
    finally:
        os.close(src)


def materialize(assets_dir: Path, weights_dir: Path, out_dir: Path, *, dtype, fp8: bool) -> Path:
    """Write an HF model dir: the assets (tokenizer, config) plus the weights of `weights_dir`.

    Dequantized to `dtype` in HF names (one safetensors file per wire shard; any `quantization_config`
    the checkpoint's config.json declared is dropped and `dtype` / `torch_dtype` name the new dtype), or,
    with `fp8`, the shards as they are and a `quantization_config` derived from the checkpoint's
    (`fp8_quant_config`). The assets' config.json is the checkpoint's own for an `hf_path` run (with
    `dtype` or `torch_dtype`, possibly a quantization_config, possibly a multimodal `text_config`).
    The weights are verified first. Written to a
    temporary dir and renamed into place; a dir already made from the same published step (same
    manifest, dtype, fp8) is kept as it is. That also makes concurrent calls safe when several processes
    share one disk (the nodes of the localhost test cluster): the check and the rename into place happen
    under a lock file next to `out_dir`, so the first copy wins, the others see it and drop theirs, and
    nobody replaces a copy of the same step another process's vLLM may be loading.

    `out_dir`'s directory must be this user's own below directories nobody else can rename in
    (rl.contract.privdirs.make_trusted_dirs; made 0700 when missing): UnsafePath, one line, otherwise.
    """
    from rl.exchange.shard_reader import ShardReader

    reader = ShardReader(weights_dir)  # manifest, index and digests; tensors are verified as read
    out_dir = Path(out_dir)
    privdirs.make_trusted_dirs(out_dir.parent)
    source = _source(weights_dir, dtype=dtype, fp8=fp8)
    if _made_from(out_dir, source):
        return out_dir
    return _build(assets_dir, weights_dir, out_dir, source, reader, dtype=dtype, fp8=fp8)


def _build(assets_dir: Path, weights_dir: Path, out_dir: Path, source: dict, reader, *, dtype,
           fp8: bool) -> Path:
    """`materialize` past its checks of `out_dir`'s directory: the copy written into a fresh private
    tmp dir beside `out_dir` through its pinned fd path, renamed into place under the lock."""
    mine = f"{out_dir.name}.tmp-{socket.gethostname()}-{os.getpid()}-"
    for name, _ in safefs.scandir(out_dir.parent):  # this pid's leftovers (a pid reused on this host)
        left = safefs.lstat(out_dir.parent / name) if name.startswith(mine) else None
        if left is not None and left.st_uid == os.geteuid():
            safefs.remove(out_dir.parent / name)
    tmp = out_dir.with_name(mine + uuid.uuid4().hex[:8])  # a fresh name, made here: nothing there before
    safefs.mkdir(tmp, mode=0o700)
    ident = None
    try:
        with privdirs.pinned_dir(tmp) as pinned:
            st = os.stat(pinned)
            ident = (st.st_dev, st.st_ino)
            _fill(assets_dir, weights_dir, pinned, source, reader, dtype=dtype, fp8=fp8)
            return _swap(tmp, out_dir, pinned, source)
    except BaseException:  # a corrupt shard (or a full disk) leaves no half-made copy behind
        now = safefs.lstat(tmp)
        if now is not None and (now.st_dev, now.st_ino) == ident:
            safefs.remove(tmp)
        raise


def _swap(tmp: Path, out_dir: Path, pinned: Path, source: dict) -> Path:
    """Rename the filled tmp dir to `out_dir` under the lock beside it; checked to have moved `pinned`."""
    old = out_dir.with_name(f"{out_dir.name}.old-{socket.gethostname()}-{os.getpid()}")
    lock = safefs.open_write(out_dir.with_name(f".{out_dir.name}.lock"), mode=0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the swap below is one step for every process on this disk
        if _made_from(out_dir, source):  # another process sharing this disk finished first
            if privdirs.same_dir(tmp, pinned):
                safefs.remove(tmp)
            return out_dir
        if not privdirs.same_dir(tmp, pinned):
            raise _replaced(tmp)
        if safefs.lstat(out_dir) is not None:
            safefs.remove(old)   # this process's own leftover of an earlier swap whose cleanup did not finish
            safefs.rename(out_dir, old)  # a copy of another version (an earlier start on this node)
        else:
            old = None
        safefs.rename(tmp, out_dir)
        if not privdirs.same_dir(out_dir, pinned):
            safefs.remove(out_dir)  # what was renamed in was put at the tmp name by someone else
            if old is not None:
                safefs.rename(old, out_dir)  # the copy that was in place stays
            raise _replaced(tmp)
    finally:
        os.close(lock)
    if old is not None:
        safefs.remove(old)
    return out_dir


def _replaced(tmp: Path) -> safefs.UnsafePath:
    return safefs.UnsafePath(f"{tmp}: renamed and replaced while being written (someone else can write "
                             f"{tmp.parent}); the model copy is not used")


def _fill(assets_dir: Path, weights_dir: Path, tmp: Path, source: dict, reader, *, dtype, fp8: bool) -> None:
    """Write the copy into `tmp`, the pinned path of the private tmp dir."""
    from safetensors.torch import save_file

    from rl.exchange.layout import FP8_META, INDEX
    from rl.exchange.shard_reader import dequantize_stream

    for name, mode in safefs.scandir(assets_dir):
        if stat.S_ISREG(mode) and name != MANIFEST:
            _copy_in(assets_dir, name, tmp / name)
    config = json.loads(safefs.read_bytes(tmp / "config.json"))
    stored = None
    if reader.delta is not None:  # a delta step: rebuilt on the chain before it (rl.exchange.deltas)
        from rl.exchange.deltas import stored_tensors
        stored, reader = stored_tensors(weights_dir)
    index = json.loads(read_in_step(weights_dir, INDEX))
    if fp8 and stored is not None:
        for fname in sorted(set(index["weight_map"].values())):
            save_file({n: stored[n].contiguous() for n, f in index["weight_map"].items() if f == fname},
                      str(tmp / fname), metadata={"format": "pt"})
        _copy_in(weights_dir, INDEX, tmp / INDEX)
    elif fp8:
        for _ in reader.tensors(dequantize=False):  # every byte verified before it is copied
            pass
        for name, mode in safefs.scandir(weights_dir):
            if stat.S_ISREG(mode) and (name.endswith(".safetensors") or name == INDEX):
                _copy_in(weights_dir, name, tmp / name)
    if fp8:
        shapes_2d = _two_dim_weights(tmp, index)  # the files as written here (a delta step rebuilt)
        holder = quant_holder(config)
        holder["quantization_config"] = fp8_quant_config(
            config, json.loads(read_in_step(weights_dir, FP8_META)), shapes_2d)
    else:
        shard_of: dict[str, str] = {}
        shards: dict[str, dict] = {}
        items = reader.tensors(dequantize=True, dtype=dtype) if stored is None else \
            dequantize_stream(stored.items(), reader.quantized, reader.block, dtype)
        for name, t in items:
            fname = index["weight_map"][name]
            shards.setdefault(fname, {})[name] = t.contiguous()
            shard_of[name] = fname
        total = 0
        for fname, tensors in shards.items():
            save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        _put(tmp / INDEX, json.dumps({"metadata": {"total_size": total}, "weight_map": shard_of},
                                     indent=1, sort_keys=True).encode())
        # dequantized: whatever quantization the checkpoint declared no longer describes these tensors
        name = str(dtype).removeprefix("torch.")
        for c in (config, config.get("text_config")):
            if isinstance(c, dict):
                c.pop("quantization_config", None)
                if c is config or "dtype" in c or "torch_dtype" in c:
                    c["torch_dtype"] = c["dtype"] = name  # transformers 5 reads dtype, older ones torch_dtype
    _put(tmp / "config.json", json.dumps(config, indent=1).encode())
    fp8_meta = json.loads(read_in_step(weights_dir, FP8_META))
    _put(tmp / SOURCE_FILE, json.dumps({**source, "fp8_meta": fp8_meta}).encode())
