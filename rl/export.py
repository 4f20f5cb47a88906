"""Export a trained policy from a run directory as a Hugging Face checkpoint (`python -m launch export`).

`launch export` checks its flags and runs this module as a child process (`python -m rl.export RUN_DIR
--out DIR --dtype D [--step N]`, `main` below), so the launcher never imports torch or a role. The child
prints one line per refusal: `error: ...` with exit 2 for what was asked (ConfigError) and exit 1 for a
checkpoint that does not verify, cannot be read or holds a NaN or inf, or for the filesystem.

What comes out is a directory transformers and vLLM load like any release: `config.json`,
`generation_config.json`, the tokenizer with its chat template (all from the run's `assets/step_000000`,
which is the start checkpoint's own files for an `hf_path` run or the tiny model's otherwise), and the
weights as sharded safetensors with `model.safetensors.index.json`, named as the start checkpoint names
them (a multimodal Kimi keeps its `language_model.` prefix). Its `README.md` says how to serve it: the
vLLM command per platform with the flags the family needs there, from the family table (rl.serving),
and what an FP8 export needs; the same commands are printed as the last line. A start checkpoint's own
README.md (a release's model card) is kept as `README.start_checkpoint.md`.

Where the weights come from. The trainer's DCP checkpoint `checkpoints/step_N` holds the fp32 master
weights (and the optimizer state, which is not read). It is verified against its manifest first, its
metadata is rebuilt from `dcp_metadata.json` (never the pickle) and DCP's own reader fetches one model
entry at a time into a plain full tensor, reassembling it from every rank's chunks: a checkpoint saved
by any (dp_shard, ep, cp) layout exports the same. Each entry goes through the family's state-dict
adapter (`to_hf`, the same call the weight publisher makes; stacked experts come out one tensor per
expert), is cast to its wire form right away and joins the shard being filled; a full shard is written
by rl.exchange.shards (the writer of every trainer rank's weight shards) and dropped. So this process
holds at most one shard's wire bytes plus the largest single entry in fp32, never the model.

Dtypes. `bfloat16`: every tensor in bf16. `fp8`: the block-FP8 layout of the official FP8 releases
(DeepSeek-V3, Kimi, Qwen3-FP8): linear weights of attention and experts as e4m3 with one fp32
`weight_scale_inv` per 128x128 block (rl.fp8, the trainer's own quantizer), the rest in bf16, the
start checkpoint's ignore list and family keep-list honoured; config.json gets the matching
`quantization_config` (rl.inference.model_dir.fp8_quant_config: quant_method fp8, fmt e4m3, dynamic
activations, weight_block_size [128, 128], and every module kept high precision in its ignore list).

Tensors of the start checkpoint the trainer does not hold (a vision tower, MTP layers) are copied
through from `model.hf_path` when it is readable, dequantized if it stored them in FP8, so the export
replaces the start checkpoint one for one.

The directory is written under a fresh `.<out>.tmp-<pid>-<random>` beside it (created mode 0700, so
nobody else can plant a link inside while it fills) and renamed into place at the end: an interrupted
export leaves no directory that looks complete. `--out` must be a new path or an empty directory,
reached without a symlink anywhere on the way (rl.contract.safefs.check_path): a link there would send
the weights, and the rename, wherever it points. Every tensor written is checked to be finite first
(`isfinite().all()` per entry, as it is read): a checkpoint holding a NaN or inf, which an older trainer
could save, is refused with NonFiniteWeights naming the tensor and the step, and nothing is left behind.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

import torch

from rl import exchange, fp8, serving
from rl.contract import safefs
from rl.contract.config import ConfigError

DTYPES = ("bfloat16", "fp8")
MODEL_PREFIX = "model."          # the DCP entries of the model (the checkpoint's stateful key)
SHARD_BYTES = 5 << 30            # the shard size HF's own save_pretrained uses by default
_SKIP_ASSETS = (exchange.MANIFEST, "model.safetensors.index.json")
README, START_README = "README.md", "README.start_checkpoint.md"   # ours: how to serve it (rl.serving)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


class NonFiniteWeights(ValueError):
    """A tensor to export holds a NaN or inf; the message names it and the checkpoint step."""


def _finite(name: str, t: torch.Tensor, where: str) -> torch.Tensor:
    if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
        n = int((~torch.isfinite(t)).sum())
        raise NonFiniteWeights(f"{where}: tensor {name} holds {n} NaN or inf value(s) of {t.numel()}: "
                               f"refusing to export it")
    return t


def _check_out(out_dir: Path) -> None:
    """--out must be a new path or an empty directory, with no symlink on the way (ConfigError, one line)."""
    try:
        safefs.check_path(out_dir, kind="dir")
    except safefs.UnsafePath as e:
        raise ConfigError(f"--out: {e}") from None
    try:
        entries = os.listdir(out_dir)
    except FileNotFoundError:
        return
    except OSError as e:
        raise ConfigError(f"--out {out_dir}: {e.strerror or e}") from None
    if entries:
        raise ConfigError(f"--out {out_dir}: exists and is not an empty directory (choose a new one)")


def export(run_dir, out_dir, *, step: int | None = None, dtype: str = "bfloat16",
           shard_bytes: int = SHARD_BYTES, log: Callable[[str], None] = print) -> dict:
    """Write the policy of `checkpoints/step_<step>` (default: the newest complete one) of `run_dir` as an
    HF checkpoint in `out_dir`, which must not exist or be empty. Returns a summary (step, files,
    tensors, bytes, seconds). One-line ConfigError for what the caller asked wrong (`--out` a link, on a
    link's way, or a non-empty directory), CorruptStep for a checkpoint that does not verify,
    NonFiniteWeights for a tensor holding a NaN or inf."""
    from rl.contract import config as config_mod
    from rl.contract import hf
    from rl.exchange import layout
    from rl.trainer import checkpoint as ckpt

    t0 = time.monotonic()
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: not one of {', '.join(DTYPES)}")
    run_dir, out_dir = safefs.resolve_run_dir(run_dir), Path(os.path.abspath(out_dir))
    _check_out(out_dir)
    cfg = config_mod.load(run_dir)
    ckpt_step = _pick_step(run_dir, step)
    assets = exchange.step_dir(run_dir, "assets", 0)
    if not assets.is_dir():
        raise ConfigError(f"{assets}: missing (the trainer writes it at its first start)")
    exchange.verify(assets, checksums=True)
    start_cfg = json.loads((assets / "config.json").read_text())
    prefix, ignored = hf.weight_prefix(start_cfg), hf.ignored_modules(start_cfg)
    quantize = layout.quantize_except(ignored) if dtype == "fp8" else (lambda name, t: False)

    safefs.makedirs(out_dir.parent)
    _check_out(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(tmp, 0o700)  # new (never an existing path) and closed to others until the rename
    try:
        start_readme = None
        for p in sorted(assets.iterdir()):  # verified above: regular files of the step, no links
            if p.is_file() and p.name not in _SKIP_ASSETS and not p.name.endswith(_WEIGHT_SUFFIXES):
                # a release's model card describes the start checkpoint, not this policy: kept beside ours
                name = START_README if p.name == README else p.name
                start_readme = name if p.name == README else start_readme
                shutil.copy2(p, tmp / name)
        writer = _ShardWriter(tmp, shard_bytes, quantize)
        produced = set()
        where = f"{ckpt.KIND}/step_{ckpt_step:06d}"
        for name, t in _policy_tensors(run_dir, ckpt_step, cfg.model, start_cfg):
            produced.add(prefix + name)
            writer.add(prefix + name, _finite(prefix + name, t, where))
        passed = 0
        for name, t in _pass_through(cfg.model.hf_path, produced):
            writer.add(name, _finite(name, t, f"model.hf_path {cfg.model.hf_path}"))
            passed += 1
        index, quantized = writer.finish()
        _write_config(tmp, start_cfg, dtype, writer.two_dim, quantized)
        (tmp / README).write_text(serving.readme(cfg.model.family, dtype, str(out_dir), start_cfg,
                                                 source=str(run_dir), step=ckpt_step, start_readme=start_readme))
        os.chmod(tmp, 0o755)
        if os.path.lexists(out_dir):
            os.rmdir(out_dir)  # an empty directory, checked above; a link swapped in since is not removed
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    summary = {"step": ckpt_step, "dtype": dtype, "out": str(out_dir), "files": writer.files,
               "tensors": len(index["weight_map"]), "passed_through": passed,
               "bytes": index["metadata"]["total_size"], "seconds": time.monotonic() - t0}
    log(f"exported checkpoints/step_{ckpt_step:06d} ({dtype}) to {out_dir}: {summary['tensors']} tensors in "
        f"{summary['files']} files, {summary['bytes'] / 2**20:.1f} MiB, {summary['seconds']:.1f} s")
    log(serving.serve_line(cfg.model.family, dtype, str(out_dir), start_cfg))
    return summary


def _pick_step(run_dir: Path, step: int | None) -> int:
    from rl.trainer import checkpoint as ckpt
    have = exchange.list_steps(run_dir, ckpt.KIND)
    if step is None:
        newest = exchange.latest_complete(run_dir, ckpt.KIND, checksums=False)
        if newest is None:
            raise ConfigError(f"{run_dir / ckpt.KIND}: no complete checkpoint to export "
                              f"(found: {', '.join(map(str, have)) or 'none'})")
        return newest
    if step not in have:
        raise ConfigError(f"--step {step}: no {ckpt.KIND}/step_{step:06d} in {run_dir} "
                          f"(have: {', '.join(map(str, have)) or 'none'})")
    return step


def _policy_tensors(run_dir: Path, step: int, m, start_cfg: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name without the checkpoint prefix, fp32 tensor) of every model weight of the checkpoint, one
    DCP entry at a time."""
    import torch.distributed.checkpoint as dcp

    from rl.contract import hf
    from rl.trainer import checkpoint as ckpt
    from rl.trainer.model import build_model

    path = exchange.step_dir(run_dir, ckpt.KIND, step)
    manifest = exchange.verify(path, checksums=True)
    metadata = ckpt._read_metadata(path, manifest)
    # the network exactly as the trainer built it (its module swaps included), on the meta device: its
    # config is what the adapter reads (expert counts, weight tying), and costs no memory
    built = build_model(dict(m), seed=0, materialize=False, hf_config=hf.text_config(start_cfg))
    adapter = built.spec.state_dict_adapter(built.spec.model, None)
    reader = ckpt._reader(path.resolve(), manifest)
    entries = [k for k, v in metadata.state_dict_metadata.items()
               if k.startswith(MODEL_PREFIX) and hasattr(v, "chunks")]
    if not entries:
        raise exchange.CorruptStep(f"{path}: its DCP metadata has no model entries")
    for key in entries:
        meta = metadata.state_dict_metadata[key]
        t = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        with ckpt._quiet():
            dcp.load({key: t}, storage_reader=reader, planner=ckpt._planner())
        yield from adapter.to_hf({key[len(MODEL_PREFIX):]: t}).items()


def _pass_through(hf_path, produced: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Float tensors of the start checkpoint that the trainer does not hold, dequantized if stored FP8."""
    if not hf_path or not (Path(hf_path) / "config.json").is_file():
        return
    from safetensors import safe_open

    from rl.exchange.layout import SCALE_SUFFIX
    from rl.trainer.hf_load import Checkpoint
    where = Checkpoint(hf_path).where
    rest = sorted(n for n in where if n not in produced and not
                  (n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in where))
    for name in rest:
        with safe_open(str(Path(hf_path) / where[name]), framework="pt") as f:
            t = f.get_tensor(name)
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and name + SCALE_SUFFIX in where:
            with safe_open(str(Path(hf_path) / where[name + SCALE_SUFFIX]), framework="pt") as f:
                t = fp8.dequantize_block(t, f.get_tensor(name + SCALE_SUFFIX).float())
        if t.is_floating_point():  # integer buffers have no meaning in bf16; none of the families stores one
            yield name, t


class _ShardWriter:
    """Fills shards of about `limit` wire bytes and writes each with rl.exchange.shards as soon as it is
    full; the HF file names and index are made at `finish`."""

    def __init__(self, out: Path, limit: int, quantize):
        self.out, self.limit, self.quantize = out, limit, quantize
        self.group: dict[str, object] = {}
        self.size = 0
        self.parts: list[dict] = []
        self.matrices: list[str] = []   # 2-D weights: the modules an FP8 ignore list may have to name

    def add(self, name: str, t: torch.Tensor) -> None:
        from rl.exchange import shards
        if name in self.group or any(name in p["tensors"] for p in self.parts):
            raise RuntimeError(f"export: tensor {name} produced twice")
        if t.dim() == 2:
            self.matrices.append(name)
        if self.quantize(name, t):
            q, s = fp8.quantize_block(t)
            wire = shards.Prequantized(q, s)
            n = q.numel() + s.numel() * 4
        else:
            wire = t.detach().to(torch.bfloat16).contiguous()
            if wire.data_ptr() == t.data_ptr():
                wire = wire.clone()  # never a view into the fp32 entry: that would keep it alive
            n = wire.numel() * 2
        if self.group and self.size + n > self.limit:
            self._flush()
        self.group[name] = wire
        self.size += n

    def _flush(self) -> None:
        from rl.exchange import shards
        rank = len(self.parts)
        self.parts.append(shards.write_part(self.out, rank, self.group, fp8_enabled=False,
                                            wire_dtype=torch.bfloat16, max_shard_bytes=1 << 62))
        self.group, self.size = {}, 0

    def finish(self) -> tuple[dict, list[str]]:
        """Write the last shard, name the files `model-0000i-of-0000n.safetensors`, write the index;
        returns (index, names of the FP8 weights)."""
        from rl.exchange import shards
        from rl.exchange.layout import FP8_META, INDEX
        if self.group or not self.parts:
            self._flush()
        shards.merge_parts(self.out, self.parts)
        (self.out / FP8_META).unlink()              # the run directory's bookkeeping, not HF's
        (self.out / shards.CHECKSUMS).unlink()
        index = json.loads((self.out / INDEX).read_text())
        old = sorted(set(index["weight_map"].values()))
        n = len(old)
        rename = {f: (f"model-{i:05d}-of-{n:05d}.safetensors" if n > 1 else "model.safetensors")
                  for i, f in enumerate(old, 1)}
        for f, g in rename.items():
            os.rename(self.out / f, self.out / g)
        index["weight_map"] = {k: rename[v] for k, v in sorted(index["weight_map"].items())}
        (self.out / INDEX).write_text(json.dumps(index, indent=2))
        self.files = n
        return index, [q for p in self.parts for q in p["quantized"]]

    @property
    def two_dim(self) -> list[str]:
        return list(self.matrices)


def _write_config(out: Path, start_cfg: dict, dtype: str, matrices: list[str], quantized: list[str]) -> None:
    """config.json of the export: the start config, its dtype bf16, and the quantization_config of what
    was written (the block-FP8 one for fp8, none for bf16: the tensors no longer are what any earlier
    quantization_config described)."""
    from rl.inference.model_dir import fp8_quant_config
    config = json.loads(json.dumps(start_cfg))
    for c in (config, config.get("text_config")):
        if isinstance(c, dict):
            c.pop("quantization_config", None)
            if c is config or "dtype" in c or "torch_dtype" in c:
                c["torch_dtype"] = c["dtype"] = "bfloat16"  # transformers 5 reads dtype, older ones torch_dtype
    if dtype == "fp8":
        holder = exchange.quant_holder(start_cfg)
        q = fp8_quant_config(start_cfg, {"block": fp8.BLOCK, "quantized": quantized}, matrices)
        (config if holder is start_cfg else config["text_config"])["quantization_config"] = q
    (out / "config.json").write_text(json.dumps(config, indent=2))


def main(argv=None) -> int:
    """`python -m rl.export`: the child `launch export` runs (launch.export checks the flags first)."""
    import argparse
    import sys

    from rl.contract.hf import CheckpointError
    ap = argparse.ArgumentParser(prog="python -m rl.export", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--out", required=True)
    ap.add_argument("--step", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    a = ap.parse_args(argv)
    try:
        export(a.run_dir, a.out, step=a.step, dtype=a.dtype, log=lambda msg: print(msg, flush=True))
    except ConfigError as e:   # what was asked: as launch's own refusals, exit 2
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (exchange.CorruptStep, CheckpointError, NonFiniteWeights) as e:
        # a checkpoint that does not verify, cannot be read or holds a NaN or inf
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:   # the filesystem (a full disk, a read-only directory): one line, no traceback
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
