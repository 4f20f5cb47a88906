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

Split from rl/inference/server.py (issue 23): the role (server) decides what to load and runs vLLM;
this module only turns a published step into a directory. No vLLM import; torch and safetensors only
inside `materialize`.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import time
from pathlib import Path

from rl.contract import procs
from rl.contract.atomic import atomic_write_json
from rl.exchange import MANIFEST, quant_holder

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
    or several nodes of one replica sharing a host's disk, own the same run directory)."""
    local_dir.mkdir(parents=True, exist_ok=True)
    p = local_dir / f"owner.{role}.json"
    atomic_write_json(p, {"run_dir": str(run_dir), "host": socket.gethostname(), "pid": os.getpid(),
                       "role": role, "time": time.time()})
    return p


def clean_stale(base: Path, keep: str) -> list[str]:
    """Remove run directories under `base` (cluster.node_local_dir) that this code created and nobody uses.

    A directory is ours if it holds owner records (`owner*.json`, written by `claim`); it is stale if every
    one of them names this host and a process that is gone. Anything else is left alone: directories
    other tools made, and those of processes on other hosts (a node-local dir that is in fact shared).
    A Slurm run keeps its records one level down, in its per-node, per-incarnation directories
    (rl.contract.paths.node_dir); they count as the run's."""
    gone = []
    if not base.is_dir():
        return gone
    host = socket.gethostname()
    for d in base.iterdir():
        if d.name == keep or not d.is_dir():
            continue
        owners = []
        for f in [*d.glob("owner*.json"), *d.glob("*/owner*.json")]:
            try:
                owners.append(json.loads(f.read_text()))
            except (OSError, json.JSONDecodeError):
                owners.append({})  # unreadable: treat as foreign
        if not owners:
            continue
        if all(isinstance(o, dict) and "run_dir" in o and o.get("host") == host
               and procs.is_pid(o.get("pid")) and not procs.alive(o["pid"]) for o in owners):
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d.name)
    return gone


def _source(weights_dir: Path, *, dtype, fp8: bool) -> dict:
    manifest = hashlib.sha256((weights_dir / MANIFEST).read_bytes()).hexdigest()
    return {"weights": str(weights_dir), "manifest_sha256": manifest, "fp8": fp8,
            "dtype": None if fp8 else str(dtype).removeprefix("torch.")}


def _made_from(model_dir: Path, source: dict) -> bool:
    try:
        got = json.loads((model_dir / SOURCE_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return all(got.get(k) == v for k, v in source.items())


def _two_dim_weights(weights_dir: Path, index: dict) -> list[str]:
    """Names of the 2-D tensors of a published step (the linear weights and embeddings), from the
    safetensors headers only."""
    from safetensors import safe_open
    out = []
    for fname in dict.fromkeys(index["weight_map"].values()):
        with safe_open(str(weights_dir / fname), framework="pt") as f:
            out += [n for n in f.keys() if len(f.get_slice(n).get_shape()) == 2]
    return out


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
    """
    from safetensors.torch import save_file

    from rl.exchange.layout import FP8_META, INDEX

    from rl.exchange.shard_reader import ShardReader, dequantize_stream

    reader = ShardReader(weights_dir)  # manifest, index and digests; tensors are verified as read
    out_dir = Path(out_dir)
    source = _source(weights_dir, dtype=dtype, fp8=fp8)
    if _made_from(out_dir, source):
        return out_dir
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for p in assets_dir.iterdir():
            if p.is_file() and p.name != MANIFEST:
                shutil.copy2(p, tmp / p.name)
        config = json.loads((tmp / "config.json").read_text())
        stored = None
        if reader.delta is not None:  # a delta step: rebuilt on the chain before it (rl.exchange.deltas)
            from rl.exchange.deltas import stored_tensors
            stored, reader = stored_tensors(weights_dir)
        if fp8 and stored is not None:
            index = json.loads((weights_dir / INDEX).read_text())
            for fname in sorted(set(index["weight_map"].values())):
                save_file({n: stored[n].contiguous() for n, f in index["weight_map"].items() if f == fname},
                          str(tmp / fname), metadata={"format": "pt"})
            shutil.copy2(weights_dir / INDEX, tmp / INDEX)
        elif fp8:
            for _ in reader.tensors(dequantize=False):  # every byte verified before it is copied
                pass
            for p in weights_dir.iterdir():
                if p.suffix == ".safetensors" or p.name == INDEX:
                    shutil.copy2(p, tmp / p.name)
        if fp8:
            index = json.loads((weights_dir / INDEX).read_text())
            shapes_2d = _two_dim_weights(tmp, index)  # the files as written here (a delta step rebuilt)
            holder = quant_holder(config)
            holder["quantization_config"] = fp8_quant_config(
                config, json.loads((weights_dir / FP8_META).read_text()), shapes_2d)
        else:
            index = json.loads((weights_dir / INDEX).read_text())
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
            (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": shard_of},
                                                indent=1, sort_keys=True))
            # dequantized: whatever quantization the checkpoint declared no longer describes these tensors
            name = str(dtype).removeprefix("torch.")
            for c in (config, config.get("text_config")):
                if isinstance(c, dict):
                    c.pop("quantization_config", None)
                    if c is config or "dtype" in c or "torch_dtype" in c:
                        c["torch_dtype"] = c["dtype"] = name  # transformers 5 reads dtype, older ones torch_dtype
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        (tmp / SOURCE_FILE).write_text(json.dumps(
            {**source, "fp8_meta": json.loads((weights_dir / FP8_META).read_text())}))
    except BaseException:  # a corrupt shard (or a full disk) leaves no half-made copy behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = out_dir.with_name(f"{out_dir.name}.old-{socket.gethostname()}-{os.getpid()}")
    with open(out_dir.with_name(f".{out_dir.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the swap below is one step for every process on this disk
        if _made_from(out_dir, source):  # another process sharing this disk finished first
            shutil.rmtree(tmp, ignore_errors=True)
            return out_dir
        try:
            os.rename(out_dir, old)  # a copy of another version (an earlier start on this node)
        except FileNotFoundError:
            old = None
        os.rename(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out_dir
