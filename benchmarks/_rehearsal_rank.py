"""One trainer rank of benchmarks/seed_rehearsal.py: the trainer's batch path without a model.

Each rank is a real process in a real gloo process group (rl.trainer.parallel.init, as under torchrun,
data ranks = trainer.parallel.dp_shard) and, every step, runs what the trainer runs between a batch
becoming visible and its rows being ready for the forward pass: wait for `rollouts/step_n`, verify,
load, pack (rl.trainer.packing, the trainer's own greedy micro-batches and rows). Where the per-rank
data plane is there (`rl.trainer.dataplane.next_share`: each rank verifies and loads only its shard),
that is what runs; on a tree without it, the trainer's current path (`rl.trainer.loop`: rank 0 verifies
the whole batch, every rank loads all of it and keeps its rows), so the rehearsal measures whichever the
repository has. After the step, rank 0 publishes `weights/step_{n+1}` (a small real step through
rl.exchange.publish) so the orchestrator's off-policy bound moves and the mock engines reload.

What a rank read is measured without touching the code under test: the bytes its read calls returned
between seeing the batch and holding its share (`rchar` of /proc/self/io: every read syscall, page-cache
hits included, so a file verified by hashing and then loaded would count twice). The files it opened in
the step directory are recorded too (a Python audit hook on `open`, by name), for information only:
opening a file to stat it is not reading it. Timestamps are wall-clock (time.time) so the driver can
line the ranks up against the moment the batch appeared.

Run by the driver with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set:
`python benchmarks/_rehearsal_rank.py --run-dir D --steps N --out FILE`. With `--replay-ranks R` (after the
run, nothing else running) one process replays every data rank's share of every step in turn through the
same calls, without a process group: each rank's cost on a core of its own, as on a GPU node, where the
live measurement has 4 ranks, the orchestrator and the engine sharing this machine's 2 cores.

With `--repeats K --rates-dir DIR` the replay is what plan_vs_rehearsal divides by, measured so that
machine load cancels: this one process alternates launch.dataplane.measure_rates and a full replay,
rates / replay / rates / ... / replay / rates, writing a `{"rates": ...}` record before each replay and
after the last. Each replay is then paired with the two rates measured just before and after it, in the
same process under the same load (the machine is shared: on 2 cores at a load of 8 a wall-clock rate
swings by 2x within minutes, which a rate measured once, minutes away from the replay, carried into the
ratio). Each replayed rank also records how much of its shard was in the page cache before it read it
(`resident`, mincore(2)): measure_rates reads a file it just wrote, a page-cache hit, so the comparison
is like for like only when the shard's pages are resident too.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import sys
import time
from pathlib import Path

import numpy as np

OPENED: set[str] = set()


def _audit(event: str, args) -> None:
    # every open of a file, whichever API (builtins.open, os.open with a dir_fd): keep the file's name
    if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        name = os.path.basename(os.fsdecode(args[0]))
        if name.endswith((".safetensors", ".json", ".npy", ".bin")):
            OPENED.add(name)


def rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def resident(path: Path) -> float:
    """The fraction of `path`'s pages in the page cache (mincore(2) on a mapping that touches none of
    them); NaN where the call is unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                                  ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            if not size:
                return 1.0
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return float("nan")
            try:
                pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(addr, size, vec):
                    return float("nan")
                return sum(b & 1 for b in bytes(vec)) / pages
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        return float("nan")


def _load(run_dir: Path, step: int, stop, d, cfg, vocab: int | None):
    """(rank's share, manifest, timings, path name): the trainer's own data-plane call with its arguments
    (rl.trainer.loop)."""
    from rl.contract.batch import ShardPlan
    from rl.trainer.dataplane import next_share
    got = next_share(run_dir, step, stop, 0.02, d, vocab, plan=ShardPlan.from_config(cfg))
    if got is None:
        return None
    share, manifest, timings = got
    return share, manifest, dict(timings or {}), "share" if share.share is not None else "whole"


def _pack(cfg, batch, d, step: int):
    """The trainer's rows for this rank (rl.trainer.train.Trainer.train_step up to the forward pass)."""
    import torch
    from rl.trainer import packing
    counts = np.diff(batch.offsets)
    mask = batch.loss_mask.astype(np.float32)
    lag = np.where(batch.loss_mask > 0, step - batch.versions, 0).astype(np.float32)
    routed = batch.routed_experts if cfg.trainer.router_replay else None
    share = getattr(batch, "share", None)
    sized = {"sizes": share["micro_batches"]} if share else {}
    mbs = packing.pack(batch.offsets, int(cfg.trainer.micro_batch_tokens), int(cfg.model.max_seq_len),
                       batch.tokens, routed, mask=mask, lp_inf=batch.logprobs,
                       adv=np.repeat(batch.advantages, counts), lag=lag, **sized)
    if not share:
        return packing.rows_for_rank(mbs, d)
    per_rank = share["rows_per_rank"]
    routed_like = None if routed is None else torch.zeros(1, 0, *routed.shape[1:], dtype=torch.int64)
    return packing.rows_for_rank(mbs, d, per_rank, routed_like)


def one(run_dir: Path, n: int, stop, d, cfg, t_seen: float) -> dict | None:
    """Step n's data plane on this rank, from the batch seen at `t_seen` to its rows packed."""
    from rl import exchange
    from rl.contract import paths
    OPENED.clear()
    r0 = rchar()
    got = _load(run_dir, n, stop, d, cfg, None)
    if got is None:
        return None
    batch, manifest, timings, path = got
    t_loaded, r1 = time.time(), rchar()
    rows = _pack(cfg, batch, d, n)
    t_packed, r2 = time.time(), rchar()
    sizes = {k: int(v["size"]) for k, v in manifest["files"].items()}
    step_dir = exchange.step_dir(run_dir, paths.ROLLOUTS, n)
    arrays = [batch.tokens, batch.offsets, batch.loss_mask, batch.logprobs, batch.versions, batch.rewards,
              batch.advantages, batch.groups] + ([batch.routed_experts] if batch.routed_experts is not None else [])
    return {"rank": d.rank, "dp_rank": d.dp_rank, "step": n, "path": path, "t_seen": t_seen,
            "t_loaded": t_loaded, "t_packed": t_packed, "rchar_load": r1 - r0, "rchar_pack": r2 - r1,
            "opened": sorted(k for k in OPENED if k in sizes), "files": sizes,
            "unlisted": {"manifest.json": os.stat(step_dir / "manifest.json").st_size},
            "samples": int(batch.num_samples), "tokens": int(len(batch.tokens)),
            "array_bytes": int(sum(x.nbytes for x in arrays)), "rows": len(rows),
            "row_tokens": int(sum(r.tokens.shape[1] for r in rows)),
            "routed_rows": None if batch.routed_experts is None else int(len(batch.routed_experts)),
            "timings": {k: v for k, v in timings.items() if isinstance(v, (int, float))}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--replay-ranks", type=int, default=0,
                   help="no process group: replay every data rank's share of every published step in turn, "
                        "one at a time (each rank's cost on a core of its own, nothing else running)")
    p.add_argument("--repeats", type=int, default=1, help="with --replay-ranks: replay everything this many times")
    p.add_argument("--rates-dir", default=None,
                   help="with --replay-ranks: measure launch.dataplane.measure_rates here before each replay and "
                        "after the last (node-local scratch), in this process")
    p.add_argument("--rates-mib", type=int, default=64)
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error(f"--repeats={a.repeats}: must be at least 1")
    import torch
    from rl import exchange
    from rl.contract import paths, safefs
    from rl.runtime import StopFlag, load_config, mark_done
    from rl.trainer import parallel
    run_dir = Path(a.run_dir)
    cfg = load_config(run_dir)
    stop = StopFlag(install=False)
    sys.addaudithook(_audit)
    out = open(a.out, "w")
    if a.replay_ranks:
        from rl.contract.batch import shard_file
        pp = cfg.trainer.parallel

        def rates(rep: int) -> None:
            if a.rates_dir:
                from dataclasses import asdict
                from launch.dataplane import measure_rates
                t = time.time()
                got = asdict(measure_rates(a.rates_dir, mib=a.rates_mib, repeats=3))
                out.write(json.dumps({"rates": got, "rep": rep, "t0": t, "t1": time.time()}) + "\n")
                out.flush()
        for rep in range(a.repeats):
            rates(rep)
            for n in range(a.steps):
                for r in range(a.replay_ranks):
                    d = parallel.Dist(world=1, dp_shard=int(pp.dp_shard), ep=int(pp.ep), dp_rank=r)
                    shard = exchange.step_dir(run_dir, paths.ROLLOUTS, n) / shard_file(r)
                    res = resident(shard) if shard.exists() else float("nan")
                    rec = one(run_dir, n, stop, d, cfg, time.time())
                    out.write(json.dumps({**rec, "rank": r, "replay": True, "rep": rep, "resident": res}) + "\n")
        rates(a.repeats)
        out.close()
        return 0
    d = parallel.init(cfg.trainer.parallel, torch.device("cpu"))
    for n in range(a.steps):
        exchange.wait_for(run_dir, paths.ROLLOUTS, n, poll=0.02)
        rec = one(run_dir, n, stop, d, cfg, time.time())
        if rec is None:
            break
        out.write(json.dumps(rec) + "\n")
        out.flush()
        d.broadcast(n)   # the ranks train together: nobody publishes before every rank has its rows
        if d.is_main:
            exchange.publish(run_dir, paths.WEIGHTS, n + 1,
                             lambda t, n=n: safefs.write_atomic(t / "weights.txt", f"rehearsal version {n + 1}\n".encode()),
                             producer="trainer", policy_version=n + 1)
    if d.is_main:
        mark_done(run_dir, step=a.steps)
    out.close()
    d.close()   # a barrier before the group goes: a rank leaving while rank 0 still publishes aborts gloo
    return 0


if __name__ == "__main__":
    sys.exit(main())
