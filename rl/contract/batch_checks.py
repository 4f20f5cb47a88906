"""What a rollout batch must satisfy before anyone trains on it, and the reader of its files.

A checksum only proves a file is the one its producer wrote, not that the producer wrote something
trainable, so every reader of a batch (the trainer's ranks, `launch report`, the orchestrator's resume)
checks what it read: every array is there with its layout's dtype and length, offsets run from 0 to the
number of tokens without going back, float arrays are finite, token ids lie in [0, vocab_size), the
loss mask is 0/1, policy versions are -1 (not generated) or a version the batch can hold, logprobs are
logprobs (in [-1e4, 0], vLLM's -inf being -9999), advantages and group ids within bounds (below). The
bookkeeping in meta.json (which groups and rollouts the batch trains) is checked against its schema
(rl.contract.record_schemas.batch_meta) and against the per-sample arrays: entry j of `entries` is the
samples of dense group j, and a part's rewards are those samples' rewards. The shard table (`layout`)
must name every sample exactly once. Anything else is `InvalidBatch` with a one-line reason naming the
file, the field and the value.

Bounds that no writer of a real batch comes near, so that a value past them is damage or a hostile
producer, never a run (each a one-line InvalidBatch naming the file, array, index and value):
- a token's policy version is at most the newest version in the run's `weights/` plus VERSION_MARGIN
  (`version_bound`): no server can have generated with weights that were never published, and the one
  of margin covers the trainer reading batch N while its publish of version N is still being committed
  (batch N is sampled from versions <= N). Before any weights (or for a batch outside a run's
  `rollouts/`), at most MAX_STEP. A version of 2^30 would otherwise pass as the freshest of all and turn
  off every staleness bound downstream.
- advantages are finite and |advantage| <= MAX_ADVANTAGE (1e6): GRPO's are at most sqrt(group_size) in
  size (32 for groups of 1024), Dr. GRPO's are differences of rewards (0..1 for hetrl's tasks); 3e38 is
  finite in float32 and multiplied every token's loss of its sample into overflow.
- group ids are the batch's dense group numbers (rl.orchestrator.loop renumbers them 0..n-1 in sample
  order), so 0 <= group < the batch's number of samples: -5 named no group and was averaged nowhere.

`read_safetensors` parses the safetensors format itself (an 8-byte header length, a JSON header, raw
little-endian arrays) from bytes read through rl.contract.safefs, and returns numpy views of one buffer:
a rank's host memory for its share of the batch is the share's bytes once, not a copy per layer of
library, and a header that lies (offsets past the data, a dtype numpy lacks) is an InvalidBatch naming
the file rather than an exception from inside a library.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import numpy as np

from rl.contract import record_schemas, safefs
from rl.contract.record_schemas import LOGPROB_MAX, LOGPROB_MIN, MAX_STEP

PER_TOKEN = ("tokens", "loss_mask", "logprobs", "versions")  # one entry per token, like routed_experts
PER_SAMPLE = ("rewards", "advantages", "groups")
ARRAYS = ("tokens", "offsets", *PER_TOKEN[1:], *PER_SAMPLE)  # always there; routed_experts optionally
FLOAT = ("logprobs", "rewards", "advantages")
_DTYPES = {"I8": np.int8, "U8": np.uint8, "I16": np.int16, "U16": np.uint16, "I32": np.int32,
           "U32": np.uint32, "I64": np.int64, "U64": np.uint64, "F32": np.float32, "F64": np.float64,
           "BOOL": np.bool_}
_MAX_HEADER = 16 << 20
MAX_ADVANTAGE = 1e6   # |advantage| a sample may carry (module docstring)
VERSION_MARGIN = 1    # versions a batch may hold past the newest published weights (module docstring)
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


def version_bound(step_dir) -> int | None:
    """The newest policy version the batch in `step_dir` may hold: the newest version in its run's
    `weights/` plus VERSION_MARGIN; None when the batch is not a run's `rollouts/step_N` or the run has
    published no weights yet (then only MAX_STEP bounds it). Read without following a link; a listing
    that fails says nothing (None): what is wrong with `weights/` is its readers' to refuse."""
    d = Path(os.path.normpath(os.fspath(step_dir)))
    if d.parent.name != "rollouts":
        return None
    try:
        found = [int(m.group(1)) for name, mode in safefs.scandir(d.parent.parent / "weights")
                 if stat.S_ISDIR(mode) and (m := _STEP_DIR.match(name))]
    except OSError:
        return None
    return max(found) + VERSION_MARGIN if found else None


class InvalidBatch(ValueError):
    """A rollout batch that must not be trained on; the message is one line naming file, field and value."""


class ChecksumMismatch(InvalidBatch):
    """A batch file whose bytes are not those its manifest recorded (damaged or replaced after publishing)."""


def _first(bad: np.ndarray) -> int:
    return int(np.flatnonzero(bad)[0])


def read_file(path, want_sha256: str | None = None, size: int | None = None) -> tuple[memoryview, int]:
    """A batch file's bytes (one buffer, read through safefs: no link followed, no FIFO blocked on) and
    their count; with `want_sha256` the bytes are hashed as read and ChecksumMismatch raised unless they
    are the manifest's."""
    fd = safefs.open_read(path)
    try:
        n = os.fstat(fd).st_size
        if size is not None and n != size:
            raise ChecksumMismatch(f"{path}: {n} bytes, the manifest says {size} (truncated?)")
        buf = bytearray(n)
        view, off = memoryview(buf), 0
        while off < n:
            got = os.preadv(fd, [view[off:]], off)
            if got == 0:
                raise ChecksumMismatch(f"{path}: ended after {off} of {n} bytes")
            off += got
    finally:
        os.close(fd)
    if want_sha256 is not None and hashlib.sha256(view).hexdigest() != want_sha256:
        raise ChecksumMismatch(f"{path}: sha256 does not match the manifest")
    return view, n


def _route_head(path, fd: int, size: int | None, row: list) -> tuple[bytes, np.dtype, int]:
    """A route file's safetensors head (the bytes before its rows), the rows' dtype and count."""
    def bad(why: str):
        raise InvalidBatch(f"{path}: {why}")

    n = os.fstat(fd).st_size
    if size is not None and n != size:
        raise ChecksumMismatch(f"{path}: {n} bytes, the manifest says {size} (truncated?)")
    first = os.pread(fd, 8, 0)
    hlen = int.from_bytes(first, "little") if len(first) == 8 else -1
    if not 0 <= hlen <= min(_MAX_HEADER, n - 8):
        bad(f"not a readable safetensors file of numpy arrays ({n} bytes, header of {hlen})")
    head = first + os.pread(fd, hlen, 8)
    try:
        header = json.loads(head[8:])
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        bad(f"not a readable safetensors file of numpy arrays (header is not JSON: {e})")
    info = header.get("routed_experts") if isinstance(header, dict) else None
    if not isinstance(header, dict) or set(header) != {"routed_experts"} or not isinstance(info, dict):
        bad(f"a route file holds routed_experts only, found {', '.join(sorted(map(str, header or {})))}")
    dt, shape = {"U8": np.uint8, "U16": np.uint16}.get(info.get("dtype")), info.get("shape")
    if dt is None or not isinstance(shape, list) or len(shape) != 3 or shape[1:] != list(row) or \
            not all(record_schemas.is_int(v, 0, 1 << 40) for v in shape):
        bad(f"routed_experts must be uint8/uint16 [tokens, {row[0]}, {row[1]}], found "
            f"{record_schemas.shown(info.get('dtype'))} {record_schemas.shown(shape)}")
    nbytes = int(np.prod(shape)) * np.dtype(dt).itemsize
    if info.get("data_offsets") != [0, nbytes] or n != len(head) + nbytes:
        bad(f"routed_experts of shape {shape} does not fill the file's {n - len(head)} bytes of data")
    return head, np.dtype(dt), int(shape[0])


def read_routes(paths: list, wants: list, lengths: list, row: list) -> tuple[np.ndarray, int]:
    """Route files (one sample's routed-expert rows each) read straight into one [tokens, layers, top_k]
    array, in order: no copy after the read. `wants`: per file (sha256, size) from the manifest or None;
    each file is opened once (its head read, then its rows), hashed as read and checked against its
    sample's length. (rows, bytes read)."""
    opened = []
    try:
        for path, want, m in zip(paths, wants, lengths):
            fd = safefs.open_read(path)
            opened.append(fd)
            head, dt, rows = _route_head(path, fd, None if want is None else want[1], row)
            if rows != m:
                raise InvalidBatch(f"{path}: {rows} rows of routed experts, its sample has {int(m)} tokens")
            opened[-1] = (fd, head, dt)
        dtype = max((dt for _, _, dt in opened), key=lambda d: d.itemsize, default=np.dtype(np.uint8))
        # allocated as read_file allocates (a bytearray): the plan's read rate (launch.dataplane.measure_rates)
        # is read_file's, so both of a rank's reads run at the rate it predicts with
        rows_n = int(sum(lengths))
        out = np.frombuffer(bytearray(rows_n * row[0] * row[1] * dtype.itemsize), dtype).reshape(rows_n, *row)
        off, n_read = 0, 0
        for path, want, m, (fd, head, dt) in zip(paths, wants, lengths, opened):
            # straight into its place in the rank's array; a narrower file beside wider ones is widened after
            tmp = None if dt == dtype else np.empty(m * row[0] * row[1], dt)
            dst = memoryview((out[off:off + m].reshape(-1) if tmp is None else tmp).view(np.uint8))
            done = 0
            while done < len(dst):
                got = os.preadv(fd, [dst[done:]], len(head) + done)
                if got == 0:
                    raise ChecksumMismatch(f"{path}: ended after {len(head) + done} bytes")
                done += got
            if want is not None:
                h = hashlib.sha256(head)
                h.update(dst)
                if h.hexdigest() != want[0]:
                    raise ChecksumMismatch(f"{path}: sha256 does not match the manifest")
            if tmp is not None:
                out[off:off + m] = tmp.reshape(m, *row)
            off += m
            n_read += len(head) + len(dst)
        return out, n_read
    finally:
        for x in opened:
            os.close(x if isinstance(x, int) else x[0])


def read_safetensors(path, data: memoryview) -> dict[str, np.ndarray]:
    """The arrays of a safetensors file's bytes, as read-only numpy views of `data`."""
    def bad(why: str):
        raise InvalidBatch(f"{path}: not a readable safetensors file of numpy arrays ({why})")

    if len(data) < 8:
        bad(f"{len(data)} bytes")
    hlen = int.from_bytes(data[:8], "little")
    if hlen > min(_MAX_HEADER, len(data) - 8):
        bad(f"header of {hlen} bytes in a file of {len(data)}")
    try:
        header = json.loads(bytes(data[8:8 + hlen]))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        bad(f"header is not JSON: {e}")
    if not isinstance(header, dict):
        bad("header is not a JSON object")
    body, out = data[8 + hlen:], {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or not isinstance(info.get("shape"), list) or \
                not isinstance(info.get("data_offsets"), list) or len(info["data_offsets"]) != 2:
            bad(f"tensor {name!r} has no dtype, shape and data_offsets")
        dt = _DTYPES.get(info.get("dtype"))
        if dt is None:
            bad(f"tensor {name!r} has dtype {record_schemas.shown(info.get('dtype'))}, not one numpy reads")
        shape, (a, b) = info["shape"], info["data_offsets"]
        if not all(record_schemas.is_int(v, 0, 1 << 62) for v in (*shape, a, b)) or not a <= b <= len(body):
            bad(f"tensor {name!r} has data_offsets {record_schemas.shown(info['data_offsets'])} outside the "
                f"{len(body)} bytes of data")
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if count * np.dtype(dt).itemsize != b - a:
            bad(f"tensor {name!r} of shape {shape} does not take {b - a} bytes")
        arr = np.frombuffer(body[a:b], dtype=np.dtype(dt).newbyteorder("<"), count=count).reshape(shape)
        out[name] = arr
    return out


def check_arrays(b: Any, vocab_size: int | None = None, where: str = "rollout batch", *,
                 max_version: int | None = None, num_samples: int | None = None) -> None:
    """Raise InvalidBatch (one line: `where`, the field, the value) unless the trainer can train on the
    batch `b` (a RolloutBatch): layout dtypes and lengths, offsets from 0 to len(tokens) never going back,
    finite floats, token ids in [0, vocab_size) (vocab_size None: only >= 0), a 0/1 loss mask, versions
    -1 or in [0, max_version] (None: MAX_STEP; a published batch's is `version_bound`), |advantages| within
    MAX_ADVANTAGE and group ids in [0, num_samples) (None: the samples of `b`; a rank's share passes the
    whole batch's)."""
    def bad(msg: str):
        raise InvalidBatch(f"{where}: {msg}")

    for k in ARRAYS:
        v = getattr(b, k)
        if not isinstance(v, np.ndarray) or v.ndim != 1:
            bad(f"{k} must be a 1-d array, found shape {getattr(v, 'shape', type(v).__name__)}")
        kinds = "f" if k in FLOAT else ("iub" if k == "loss_mask" else "iu")
        if v.dtype.kind not in kinds:
            bad(f"{k} has dtype {v.dtype}, expected {'a float' if k in FLOAT else 'an integer'} type")
    n_tok = len(b.tokens)
    off = b.offsets.astype(np.int64)
    if len(off) == 0 or off[0] != 0:
        bad(f"offsets must start at 0, found {off[:1].tolist() or 'no offsets'}")
    if (back := np.diff(off) < 0).any():
        i = _first(back) + 1
        bad(f"offsets decrease at offsets[{i}] = {off[i]} after offsets[{i - 1}] = {off[i - 1]}")
    if off[-1] != n_tok:
        bad(f"offsets end at {off[-1]} but there are {n_tok} tokens")
    for k in PER_TOKEN[1:]:
        if len(getattr(b, k)) != n_tok:
            bad(f"{k} has {len(getattr(b, k))} entries, tokens has {n_tok}")
    for k in PER_SAMPLE:
        if len(getattr(b, k)) != len(off) - 1:
            bad(f"{k} has {len(getattr(b, k))} entries for {len(off) - 1} samples (offsets)")
    r = b.routed_experts
    if r is not None:
        if not isinstance(r, np.ndarray) or r.ndim != 3 or r.dtype not in (np.uint8, np.uint16):
            bad(f"routed_experts must be uint8/uint16 [tokens, layers, top_k], found "
                f"{getattr(r, 'dtype', type(r).__name__)} {getattr(r, 'shape', '')}")
        if len(r) != n_tok:
            bad(f"routed_experts has {len(r)} rows, tokens has {n_tok}")
    for k in FLOAT:
        v = getattr(b, k)
        if (nf := ~np.isfinite(v)).any():
            i = _first(nf)
            bad(f"{k}[{i}] = {v[i]} is not finite ({int(nf.sum())} non-finite of {len(v)})")
    if n_tok:
        lo, hi = int(b.tokens.min()), int(b.tokens.max())
        if lo < 0:
            bad(f"tokens[{_first(b.tokens < 0)}] = {lo} is a negative token id")
        if vocab_size is not None and hi >= vocab_size:
            bad(f"tokens[{_first(b.tokens >= vocab_size)}] = {hi} is outside the vocabulary "
                f"[0, {vocab_size})")
    if ((b.loss_mask != 0) & (b.loss_mask != 1)).any():
        i = _first((b.loss_mask != 0) & (b.loss_mask != 1))
        bad(f"loss_mask[{i}] = {b.loss_mask[i]}, must be 0 or 1")
    v = b.versions.astype(np.int64)
    if (off := (v < -1) | (v > MAX_STEP)).any():
        i = _first(off)
        bad(f"versions[{i}] = {v[i]} is not a policy version (>= 0) nor -1 (a token no policy generated)")
    if max_version is not None and (off := v > max_version).any():
        i = _first(off)
        bad(f"versions[{i}] = {v[i]} is newer than any published policy version (at most {max_version}: the "
            f"newest weights + {VERSION_MARGIN}; {int(off.sum())} such of {n_tok})")
    a = b.advantages
    if (off := np.abs(a) > MAX_ADVANTAGE).any():
        i = _first(off)
        bad(f"advantages[{i}] = {a[i]} is beyond +-{MAX_ADVANTAGE:g} (MAX_ADVANTAGE: no group-relative "
            f"advantage comes near it)")
    g = b.groups.astype(np.int64)
    top = len(b.offsets) - 1 if num_samples is None else num_samples
    if (off := (g < 0) | (g >= max(top, 0))).any():
        i = _first(off)
        bad(f"groups[{i}] = {g[i]} is not a group of this batch (dense group numbers 0..{top - 1})")
    if (off := (b.logprobs < LOGPROB_MIN) | (b.logprobs > LOGPROB_MAX)).any():
        i = _first(off)
        bad(f"logprobs[{i}] = {b.logprobs[i]} is not a logprob (in [{LOGPROB_MIN:g}, 0]; "
            f"{int(off.sum())} such of {n_tok})")


def check_meta(meta: dict, groups: np.ndarray, rewards: np.ndarray, group_size: int | None = None,
               where: str = "rollout batch meta") -> None:
    """Raise InvalidBatch unless meta.json's bookkeeping is well-formed (record_schemas.batch_meta) and
    describes the per-sample arrays of the whole batch: entry j's rollouts are the samples of dense group
    j, a part's rewards are theirs (per rollout: a summarized episode's later segments, meta `segment`,
    are not counted again). `groups` and `rewards` are known to be one per sample."""
    if (why := record_schemas.batch_meta(meta, num_samples=len(groups), group_size=group_size)) is not None:
        raise InvalidBatch(f"{where}: {why}")
    entries = meta.get("entries")
    if entries is None:
        return
    if "segment" in meta:   # an episode's later contexts (rl.orchestrator.segments): count its first only
        first = np.asarray(meta["segment"], np.int64) == 0
        if len(groups) and (bad := np.flatnonzero(~first & (np.r_[-1, groups[:-1]] != groups))).size:
            raise InvalidBatch(f"{where}: sample {int(bad[0])} continues an episode of another group "
                               f"(segment {meta['segment'][int(bad[0])]})")
        if len(rewards) and (bad := np.flatnonzero(~first & (np.r_[np.nan, rewards[:-1]] != rewards))).size:
            raise InvalidBatch(f"{where}: sample {int(bad[0])} (segment {meta['segment'][int(bad[0])]}) has "
                               f"reward {float(rewards[bad[0]])}, its episode's is {float(rewards[bad[0] - 1])}")
        groups, rewards = groups[first], rewards[first]
    counts = np.bincount(groups.astype(np.int64), minlength=len(entries)) if len(groups) else \
        np.zeros(len(entries), np.int64)
    if len(groups) and (groups.min() < 0 or len(counts) != len(entries)):
        raise InvalidBatch(f"{where}: the batch's dense groups run {int(groups.min())}..{int(groups.max())}, "
                           f"meta.json has {len(entries)} entries")
    parts = meta.get("partial_groups") or {}
    for j, (g, idx) in enumerate(entries):
        if counts[j] != len(idx):
            raise InvalidBatch(f"{where}: entry {j} (group {g}) lists {len(idx)} rollouts, the batch has "
                               f"{int(counts[j])} samples of it")
        if str(g) in parts:
            have = rewards[groups == j].astype(np.float64)
            if not np.allclose(have, parts[str(g)]["rewards"], rtol=1e-5, atol=1e-5):
                raise InvalidBatch(f"{where}: partial_groups[{g}].rewards="
                                   f"{record_schemas.shown(parts[str(g)]['rewards'])} are not its samples' "
                                   f"rewards {record_schemas.shown(have.tolist())}")


def check_layout(layout: Any, num_samples: int, where: str) -> None:
    """Raise InvalidBatch unless meta.json's `layout` (the shard table) gives every sample to exactly one
    data rank and each rank's micro-batches cover its samples."""
    def bad(msg: str):
        raise InvalidBatch(f"{where}: layout {msg}")

    if not isinstance(layout, dict):
        bad(f"must be an object, found {type(layout).__name__}")
    ranks, mbt = layout.get("ranks"), layout.get("micro_batch_tokens")
    if not isinstance(ranks, list) or not ranks or layout.get("data_ranks") != len(ranks):
        bad(f"data_ranks={record_schemas.shown(layout.get('data_ranks'))} must be the number of entries of "
            f"`ranks` (a non-empty list)")
    if mbt is not None and not record_schemas.is_int(mbt, 1):
        bad(f"micro_batch_tokens={record_schemas.shown(mbt)} is not a token count or null")
    seen = np.zeros(num_samples, np.int64)
    total = 0
    for r, e in enumerate(ranks):
        idx, mbs = (e.get("samples"), e.get("micro_batches")) if isinstance(e, dict) else (None, None)
        if not isinstance(idx, list) or not all(record_schemas.is_int(i, 0, num_samples - 1) for i in idx):
            bad(f"ranks[{r}].samples must list sample indices below {num_samples}")
        if not isinstance(mbs, list) or not all(record_schemas.is_int(m, 1) for m in mbs) or sum(mbs) != len(idx):
            bad(f"ranks[{r}].micro_batches must be positive sample counts summing to its {len(idx)} samples")
        np.add.at(seen, np.asarray(idx, np.int64), 1)
        total += len(mbs)
    if (seen != 1).any():
        i = _first(seen != 1)
        bad(f"gives sample {i} to {int(seen[i])} data ranks (each sample belongs to exactly one)")
    if layout.get("micro_batches") != total:
        bad(f"micro_batches={record_schemas.shown(layout.get('micro_batches'))}, the ranks list {total}")
