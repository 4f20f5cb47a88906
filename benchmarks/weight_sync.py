"""How long does handing weights to inference take when every trainer rank writes, and what does it cost?

The trainer publishes policy weights as FP8 block-scaled safetensors shards through the run-directory
protocol. Under expert parallelism no rank holds the whole model: each holds its routed experts as plain
tensors and an FSDP shard of everything else. `OwnershipPlan.owned` hands each rank the tensors it
publishes and its shards of the sharded ones, `WeightPublisher.publish` copies them out and returns, a
background thread gathers the sharded tensors at their owners, quantizes, hashes and writes the rank's
part, and rank 0 commits `weights/step_N` once every part is there. The writer's own account of its time
(quantize, sha256) is printed too: on this CPU quantization is CPU work, on a GPU trainer it is not. This benchmark lays MoE-shaped tensors (a few hundred MB in fp32 by default) out
that way on 1, 2 and 4 gloo ranks (spawned processes kept alive across repeats, one CPU thread each,
warmed up by one publish so buffers are allocated and the plan is cached, as in a trainer's steady
state) and times, interleaved within every repeat:

  publish_Nrank  barrier -> owned() -> publish() -> wait() -> rank 0 sees the committed step
  raw            the same FP8 payload (quantized beforehand) written with f.write + fsync into one file
  raw_4threads   the same bytes by 4 threads into 4 files; the faster raw write is the floor
  bf16           safetensors.torch.save_file of the bf16 tensors + fsync: what peers do

It reports medians and the trainer-blocked share of a publish (owned() plus the copy-out in publish(),
max over ranks). From the committed 4-rank step it then reads what 4 expert-parallel inference workers
need (ShardReader with expert_selector): read amplification from ReadStats, cross-checked with
/proc/self/io rchar, the share of the step each worker reads, and the hashing a second reader on the same
node skips (VerifiedOnNode). Last, it perturbs the weights like Adam's first step (w += lr * sign(noise),
lr = --delta-lr times each tensor's rms) and counts the 128x128 FP8 blocks whose bytes or scale change:
what a block-level delta would store, and what the byte-level deltas of rl.exchange.deltas store. Machines here are noisy: compare ratios from one run,
not absolute times across runs.

    python benchmarks/weight_sync.py [--quick] [--layers 2 --experts 64 --dim 1024 --moe-dim 192
                                      --vocab 2048 --repeats 5 --delta-lr 1e-5 --dir /tmp]

The last line is `publish_vs_raw=.. publish_vs_bf16=.. blocked_fraction=.. read_amplification=..
ranks_speedup=..` followed by further key=value pairs, the timing ratios' medians over the repeats and,
as `<ratio>_min` / `<ratio>_max`, their range over the repeats (each paired within its repeat).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
import uuid
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from rl import exchange, fp8  # noqa: E402
from rl.exchange.publisher import WeightPublisher  # noqa: E402
from rl.exchange.shard_reader import ShardReader, VerifiedOnNode, expert_selector  # noqa: E402
from rl.exchange.layout import SCALE_SUFFIX, default_quantize  # noqa: E402
from rl.exchange.weights import quantize_state_dict  # noqa: E402
from rl.trainer.owners import OwnershipPlan  # noqa: E402

# experts ~85% of the bytes, as in the MoE models this is for (Kimi-K2: ~97%)
PROFILES = {"default": dict(layers=2, experts=64, dim=1024, moe_dim=192, vocab=2048, repeats=5),
            "quick": dict(layers=2, experts=8, dim=512, moe_dim=256, vocab=2048, repeats=3)}
RANKS = (1, 2, 4)
DELTA_POOL = "delta_4rank"  # 4 ranks again, each version a sparse delta of the one before
READERS = 4
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def log(msg: str) -> None:
    print(f"[weight_sync {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- the model -----------------------------------------------------------------------------------------
def model_shapes(c: dict) -> dict[str, tuple[tuple[int, ...], float]]:
    """HF name -> (shape, init std; 0 means ones) of a small DeepSeek-style MoE."""
    d, f = c["dim"], c["moe_dim"]
    s = {"model.embed_tokens.weight": ((c["vocab"], d), 1.0), "model.norm.weight": ((d,), 0.0),
         "lm_head.weight": ((c["vocab"], d), 0.02)}
    for i in range(c["layers"]):
        p = f"model.layers.{i}"
        s[f"{p}.input_layernorm.weight"] = s[f"{p}.post_attention_layernorm.weight"] = ((d,), 0.0)
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            s[f"{p}.self_attn.{n}.weight"] = ((d, d), 0.02)
        s[f"{p}.mlp.gate.weight"] = ((c["experts"], d), 0.02)
        for m in ["shared_experts"] + [f"experts.{e}" for e in range(c["experts"])]:
            s[f"{p}.mlp.{m}.gate_proj.weight"] = s[f"{p}.mlp.{m}.up_proj.weight"] = ((f, d), 0.02)
            s[f"{p}.mlp.{m}.down_proj.weight"] = ((d, f), 0.02)
    return s


def expert_range(experts: int, rank: int, world: int) -> range:
    return range(experts * rank // world, experts * (rank + 1) // world)


def make(name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
    """The same tensor in every process: seeded by its name."""
    if std == 0.0:
        return torch.ones(shape)
    return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))) * std


def full_model(c: dict) -> dict[str, torch.Tensor]:
    return {n: make(n, sh, std) for n, (sh, std) in model_shapes(c).items()}


def trainer_state(c: dict, rank: int, world: int, mesh) -> dict[str, torch.Tensor]:
    """What rank `rank` of an expert-parallel trainer holds: its experts whole, a Shard(0) of the rest."""
    from torch.distributed.tensor import Shard, distribute_tensor
    mine = expert_range(c["experts"], rank, world)
    state = {}
    for name, (shape, std) in model_shapes(c).items():
        m = _EXPERT.search(name)
        if m is None:  # every rank made the same full tensor: each keeps its chunk, no communication
            state[name] = distribute_tensor(make(name, shape, std), mesh, [Shard(0)], src_data_rank=None)
        elif int(m.group(1)) in mine:
            state[name] = make(name, shape, std)
    return state


# -- the trainer ranks ---------------------------------------------------------------------------------
def publish_once(rank: int, state, plan: OwnershipPlan, pub: WeightPublisher, version: int) -> dict:
    import torch.distributed as dist
    dist.barrier()
    t0 = time.perf_counter()
    own, gathers = plan.owned(state)
    t1 = time.perf_counter()
    pub.publish(version, own, gathers)
    pub.wait()
    if rank == 0 and not exchange.step_dir(pub.run_dir, "weights", version).is_dir():
        raise RuntimeError(f"step {version} not committed after wait()")
    t2 = time.perf_counter()
    dist.barrier()  # no rank runs ahead into the next command
    return {"owned": t1 - t0, "copy": pub.last_blocked_s, "write": pub.last_write_s, "done": t2 - t0}


def adam_like_step(state: dict, lr: float, seed: int) -> None:
    """Every weight moves by lr x its tensor's rms, in a random direction (Adam's first steps), in place."""
    g = torch.Generator().manual_seed(seed)
    for t in state.values():
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.numel():
            local.add_(lr * local.pow(2).mean().sqrt() * torch.randn(local.shape, generator=g).sign_())


def worker(rank: int, world: int, port: int, c: dict, run_dir: str, token: str, cmds, results,
           delta_lr: float = 0.0) -> None:
    """One trainer rank: build its state, then publish each version it is sent until it gets None.
    With `delta_lr` the weights take an optimizer-like step before each version and every version after
    the first is published as a sparse delta (rl.exchange.deltas)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        state = trainer_state(c, rank, world, init_device_mesh("cpu", (world,)))
        plan = OwnershipPlan(rank, world)
        pub = WeightPublisher(run_dir, rank=rank, world=world, token=token,
                              full_every=10**9 if delta_lr else 0)
        results.put((rank, "ok", None))
        while (version := cmds.get()) is not None:
            if delta_lr and version > 1:
                adam_like_step(state, delta_lr, seed=1000 * version + rank)
            results.put((rank, "ok", publish_once(rank, state, plan, pub, version)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def free_ports(n: int) -> list[int]:
    socks = [socket.create_server(("127.0.0.1", 0)) for _ in range(n)]  # all open at once: n distinct
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Pool:
    """`world` trainer processes in one gloo group, alive across repeats, publishing into `run_dir`."""

    def __init__(self, ctx, world: int, port: int, c: dict, run_dir: Path, delta_lr: float = 0.0):
        self.world, self.run_dir = world, run_dir
        self.results, self.cmds = ctx.Queue(), [ctx.Queue() for _ in range(world)]
        self.delta, self.version = bool(delta_lr), 0  # a delta pool numbers its versions consecutively
        token = uuid.uuid4().hex[:12]  # one trainer incarnation
        self.procs = [ctx.Process(target=worker, daemon=True,
                                  args=(r, world, port, c, str(run_dir), token, self.cmds[r], self.results,
                                        delta_lr))
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def collect(self, timeout: float = 600.0) -> list:
        out = [None] * self.world
        for _ in range(self.world):
            rank, status, value = self.results.get(timeout=timeout)
            if status == "error":
                raise RuntimeError(f"{self.world}-rank pool, rank {rank} failed:\n{value}")
            out[rank] = value
        return out

    def publish(self, version: int) -> dict:
        if self.delta:
            self.version = version = self.version + 1
        for q in self.cmds:
            q.put(version)
        rs = self.collect()  # the publish ends with rank 0's commit: the latest "done"
        step = exchange.step_dir(self.run_dir, "weights", version)
        spent = exchange.read_manifest(step)["meta"]["seconds_per_rank"]  # what each rank's writer spent
        return {"s": max(r["done"] for r in rs), "owned": max(r["owned"] for r in rs),
                "bytes": sum(f.stat().st_size for f in step.glob("*.safetensors")),
                "is_delta": exchange.delta_base(step) is not None,
                "copy": max(r["copy"] for r in rs), "blocked": max(r["owned"] + r["copy"] for r in rs),
                "quantize": max(x["quantize"] for x in spent), "hash": max(x["hash"] for x in spent),
                "step": step}

    def close(self) -> None:
        for q in self.cmds:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()


# -- the baselines -------------------------------------------------------------------------------------
def as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def write_fsync(path: Path, bufs: list) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for b in bufs:
            f.write(b)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def split_balanced(bufs: list, n: int) -> list[list]:
    groups, load = [[] for _ in range(n)], [0] * n
    for b in sorted(bufs, key=len, reverse=True):
        i = load.index(min(load))
        groups[i].append(b)
        load[i] += len(b)
    return groups


def raw_threads(d: Path, groups: list[list]) -> float:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(groups)) as ex:
        list(ex.map(write_fsync, [d / f"raw{i}.bin" for i in range(len(groups))], groups))
    return time.perf_counter() - t0


def bf16_save(path: Path, tensors: dict) -> float:
    t0 = time.perf_counter()
    save_file(tensors, str(path))
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return time.perf_counter() - t0


# -- reading and deltas --------------------------------------------------------------------------------
def rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def read_worker(step: Path, select, verified: VerifiedOnNode | None = None) -> dict:
    before, t0 = rchar(), time.perf_counter()
    reader = ShardReader(step)
    got = sum(t.nbytes for _, t in reader.tensors(select, dequantize=False, verified=verified))
    st = reader.stats
    return {"s": time.perf_counter() - t0, "rchar": rchar() - before, "got": got, "read": st.bytes_read,
            "needed": st.bytes_needed, "hashed": st.bytes_hashed, "files": len(st.files)}


def worker_select(c: dict, w: int):
    r = expert_range(c["experts"], w, READERS)
    return expert_selector({f"model.layers.{i}.mlp.experts": r for i in range(c["layers"])})


def same_as_one_process(step: Path, wire: dict) -> bool:
    """What the ranks wrote is, bit for bit, what one process's quantize_state_dict makes."""
    got = dict(ShardReader(step).tensors(dequantize=False))
    return got.keys() == wire.keys() and all(torch.equal(t.view(torch.uint8), wire[n].view(torch.uint8))
                                             for n, t in got.items())


def read_tests(c: dict, step: Path, root: Path, wire: dict) -> dict:
    files = exchange.read_manifest(step)["files"]
    total = sum(i["size"] for f, i in files.items() if f.endswith(".safetensors"))
    experts = sum(t.nbytes for n, t in wire.items() if _EXPERT.search(n))
    per = [read_worker(step, worker_select(c, w)) for w in range(READERS)]
    first = read_worker(step, worker_select(c, 0), VerifiedOnNode(root / "verified.txt"))
    second = read_worker(step, worker_select(c, 0), VerifiedOnNode(root / "verified.txt"))  # same node
    return {"total": total, "per": per, "first": first, "second": second,
            "expected": (experts / READERS + sum(t.nbytes for t in wire.values()) - experts) / total,
            "content_ok": same_as_one_process(step, wire),
            "amplification": max(p["read"] / p["needed"] for p in per),
            "rchar_amplification": max(p["rchar"] / p["got"] for p in per)}


def block_bytes(m: int, n: int, b: int) -> torch.Tensor:
    """e4m3 bytes of each block of an m x n weight (edge blocks are ragged), plus its 4-byte scale."""
    rows, cols = torch.arange(0, m, b), torch.arange(0, n, b)
    return (m - rows).clamp(max=b)[:, None] * (n - cols).clamp(max=b)[None, :] + 4


def delta_blocks(full: dict, wire: dict, lr: float, b: int = fp8.BLOCK) -> dict:
    """One Adam-like step on the quantized weights: which FP8 blocks (values or scale) change."""
    g, n_ = torch.Generator().manual_seed(1), Counter()
    for name, w in full.items():
        if not default_quantize(name, w):
            continue
        step = lr * w.pow(2).mean().sqrt() * torch.randn(w.shape, generator=g).sign_()
        q, s = fp8.quantize_block(w + step, b)
        (m, n), rescaled = w.shape, wire[name + SCALE_SUFFIX] != s
        diff = wire[name].view(torch.uint8) != q.view(torch.uint8)
        pad = torch.nn.functional.pad(diff, (0, -n % b, 0, -m % b))
        hit = pad.view(-(-m // b), b, -(-n // b), b).any(3).any(1) | rescaled
        size = block_bytes(m, n, b)
        n_.update(blocks=hit.numel(), hit=int(hit.sum()), rescaled=int(rescaled.sum()), bytes=int(size.sum()),
                  hit_bytes=int(size[hit].sum()), values=diff.numel(), changed_values=int(diff.sum()))
    return {"block_fraction": n_["hit"] / n_["blocks"], "delta_fraction": n_["hit_bytes"] / n_["bytes"],
            "scale_fraction": n_["rescaled"] / n_["blocks"],
            "value_fraction": n_["changed_values"] / n_["values"],
            # what rl.exchange.deltas stores instead: int32 position + new byte per changed value, and
            # the scales whole (they all move)
            "sparse_fraction": (5 * n_["changed_values"] + 4 * n_["blocks"]) / n_["bytes"]}


# -- the run -------------------------------------------------------------------------------------------
def timed_methods(pools: dict[int, Pool], d: Path, bufs: list, bf16: dict) -> dict:
    """name -> callable(version) -> seconds, or a publish summary (a dict with "s")."""
    groups = split_balanced(bufs, 4)
    m = {(f"publish_{n}rank" if isinstance(n, int) else f"publish_{n}"): (lambda v, p=p: p.publish(v))
         for n, p in pools.items()}
    m["raw"] = lambda v: write_fsync(d / "raw.bin", bufs)
    m["raw_4threads"] = lambda v: raw_threads(d, groups)
    m["bf16"] = lambda v: bf16_save(d / "model.safetensors", bf16)
    return m


def run_repeats(methods: dict, repeats: int, scratch: Path) -> tuple[dict, Path]:
    """Every method once per repeat, in a rotated order; returns the results and the newest 4-rank step
    (kept for the read test; every other output is removed once timed)."""
    times: dict[str, list] = {k: [] for k in methods}
    names, version, last4 = list(methods), 2, None
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            scratch.mkdir()
            os.sync()  # the previous method's writeback and deletions do not bleed into this one
            r = methods[name](version)
            times[name].append(r)
            log(f"repeat {rep + 1}/{repeats} {name}: {r['s'] if isinstance(r, dict) else r:.3f} s")
            shutil.rmtree(scratch)
            if isinstance(r, dict):
                old = r["step"]
                if name == f"publish_{max(RANKS)}rank":
                    old, last4 = last4, old
                if old is not None:
                    shutil.rmtree(old)
            version += 1
    return times, last4


def med(xs: list, key: str | None = None) -> float:
    return statistics.median(x[key] for x in xs) if key else statistics.median(xs)


def floor_of(times: dict) -> tuple[float, str]:
    raw1, raw4 = med(times["raw"]), med(times["raw_4threads"])
    return (raw1, "raw") if raw1 <= raw4 else (raw4, "raw_4threads")


def print_writes(times: dict, payload: int, fp32: int, c: dict) -> None:
    mb, (floor, floor_name) = payload / 2**20, floor_of(times)
    print(f"\n{fp32 / 2**20:.0f} MB fp32 -> {mb:.0f} MB FP8 payload ({fp32 / 2**21:.0f} MB as bf16); "
          f"{c['layers']} layers x {c['experts']} experts, dim {c['dim']}, moe_dim {c['moe_dim']}, "
          f"vocab {c['vocab']}; {len(times['raw'])} repeats, medians")
    print(f"{'method':<20}{'median s':>9}{'min s':>8}{'MB/s':>7}{'vs floor':>9}"
          f"{'owned s':>9}{'copy s':>8}{'blocked s':>10}{'blocked %':>10}")
    for name, xs in times.items():
        pub = isinstance(xs[0], dict)
        s, lo = med(xs, "s" if pub else None), min(x["s"] if pub else x for x in xs)
        row = f"{name:<20}{s:>9.3f}{lo:>8.3f}{mb / s:>7.0f}{s / floor:>8.2f}x"
        if pub:
            b = med(xs, "blocked")
            row += f"{med(xs, 'owned'):>9.3f}{med(xs, 'copy'):>8.3f}{b:>10.3f}{100 * b / s:>9.1f}%"
        print(row)
    print(f"floor = {floor_name} (the faster raw write); MB/s of the FP8 payload; blocked = owned() + "
          f"copy-out in publish(), max over ranks; blocked_fraction in the last line: {max(RANKS)} ranks")
    print("where a rank's writer spends it (max over ranks): quantize on this CPU (on a GPU trainer the "
          "device's job), sha256")
    for name, xs in times.items():
        if isinstance(xs[0], dict):
            q, h, s = med(xs, "quantize"), med(xs, "hash"), med(xs, "s")
            print(f"  {name:<20} quantize {q:.3f} s, sha256 {h:.3f} s; the rest {s - q:.3f} s "
                  f"= {(s - q) / floor:.2f}x the floor")


def print_reads(reads: dict, delta: dict) -> None:
    print(f"\nread by {READERS} expert-parallel workers from the committed {max(RANKS)}-rank step "
          f"({reads['total'] / 2**20:.1f} MB of shards):")
    print(f"{'worker':<8}{'read MB':>9}{'needed MB':>10}{'rchar MB':>9}{'amplif.':>9}{'of step':>9}"
          f"{'files':>6}{'s':>7}")
    for w, p in enumerate(reads["per"]):
        print(f"{w:<8}{p['read'] / 2**20:>9.2f}{p['needed'] / 2**20:>10.2f}{p['rchar'] / 2**20:>9.2f}"
              f"{p['read'] / p['needed']:>9.4f}{p['read'] / reads['total']:>9.3f}{p['files']:>6}"
              f"{p['s']:>7.3f}")
    print(f"expected share of the step per worker: experts/{READERS} + the rest = {reads['expected']:.3f}; "
          f"step bit-identical to one process's quantize_state_dict: {reads['content_ok']}")
    f, s = reads["first"], reads["second"]
    print(f"verification on one node (worker 0 twice, one VerifiedOnNode file): first reader hashed "
          f"{f['hashed'] / 2**20:.2f} MB in {f['s']:.3f} s, second {s['hashed']} bytes in {s['s']:.3f} s")
    print(f"one optimizer step (lr {delta['lr']:g} x rms): {100 * delta['block_fraction']:.1f}% of 128x128 "
          f"blocks change ({100 * delta['delta_fraction']:.1f}% of FP8 bytes); "
          f"{100 * delta['scale_fraction']:.1f}% of scales and {100 * delta['value_fraction']:.2f}% of e4m3 "
          f"values change; a sparse delta (rl.exchange.deltas) is {100 * delta['sparse_fraction']:.2f}% of the "
          f"FP8 bytes")


def final_line(times: dict, reads: dict, delta: dict) -> str:
    pub = {n: med(times[f"publish_{n}rank"], "s") for n in RANKS}
    blocked = {n: med(times[f"publish_{n}rank"], "blocked") / pub[n] for n in RANKS}
    keys = {"publish_vs_raw": pub[4] / floor_of(times)[0], "publish_vs_bf16": pub[4] / med(times["bf16"]),
            "blocked_fraction": blocked[4], "read_amplification": reads["amplification"],
            "ranks_speedup": pub[1] / pub[4], **{f"publish_{n}rank_s": pub[n] for n in RANKS},
            "quantize_4rank_s": med(times["publish_4rank"], "quantize"),
            "publish_minus_quantize_vs_raw": (pub[4] - med(times["publish_4rank"], "quantize"))
            / floor_of(times)[0],
            **{f"blocked_fraction_{n}rank": blocked[n] for n in RANKS},
            **{f"{k}_s": med(times[k]) for k in ("raw", "raw_4threads", "bf16")},
            "rchar_amplification": reads["rchar_amplification"],
            "delta_fraction": delta["delta_fraction"], "delta_block_fraction": delta["block_fraction"],
            "sparse_delta_fraction": delta["sparse_fraction"],
            "delta_publish_vs_full": med(times[f"publish_{DELTA_POOL}"], "s") / pub[4],
            "delta_bytes_vs_full": med(times[f"publish_{DELTA_POOL}"], "bytes")
            / med(times["publish_4rank"], "bytes")}
    for k, (lo, hi) in spreads(times).items():   # the timing ratios per repeat: their min and max
        keys[f"{k}_min"], keys[f"{k}_max"] = lo, hi
    return " ".join(f"{k}={v:.4f}" for k, v in keys.items())


def spreads(times: dict) -> dict[str, tuple[float, float]]:
    """(min, max) over the repeats of each timing ratio of the last line, paired within a repeat (every
    method ran once per repeat, interleaved): a busy machine moves them between repeats and runs, and the
    spread says by how much."""
    n = len(times["raw"])
    s = lambda name, i: times[name][i]["s"] if isinstance(times[name][i], dict) else times[name][i]  # noqa: E731
    per = {"publish_vs_raw": [s("publish_4rank", i) / min(s("raw", i), s("raw_4threads", i)) for i in range(n)],
           "publish_vs_bf16": [s("publish_4rank", i) / s("bf16", i) for i in range(n)],
           "ranks_speedup": [s("publish_1rank", i) / s("publish_4rank", i) for i in range(n)],
           "delta_publish_vs_full": [s(f"publish_{DELTA_POOL}", i) / s("publish_4rank", i) for i in range(n)]}
    return {k: (min(v), max(v)) for k, v in per.items() if v}


def parse() -> tuple[argparse.Namespace, dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small tensors: a ~60 s smoke run")
    for k in PROFILES["default"]:
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=None)
    ap.add_argument("--delta-lr", type=float, default=1e-5, help="Adam's step, as a fraction of the rms")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under /tmp)")
    a = ap.parse_args()
    profile = PROFILES["quick" if a.quick else "default"]
    return a, {k: v if getattr(a, k) is None else getattr(a, k) for k, v in profile.items()}


def main() -> None:
    a, c = parse()
    t_start = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="hetrl-weight-sync-", dir=a.dir))
    os.environ["OMP_NUM_THREADS"] = "1"  # read by the spawned ranks at start: one thread each
    ctx, pools = mp.get_context("spawn"), {}
    try:
        ports = free_ports(len(RANKS) + 1)
        for n, port in zip(RANKS, ports):
            pools[n] = Pool(ctx, n, port, c, root / f"run{n}")
        pools[DELTA_POOL] = Pool(ctx, max(RANKS), ports[-1], c, root / "run_delta", delta_lr=a.delta_lr)
        log(f"started {sum(RANKS)} trainer processes; preparing the baselines under {root}")
        full = full_model(c)
        wire, _ = quantize_state_dict(full)
        bufs = [as_bytes(t) for t in wire.values()]
        bf16 = {k: v.to(torch.bfloat16).contiguous() for k, v in full.items()}
        for n, p in pools.items():
            p.collect()
            shutil.rmtree(p.publish(1)["step"])  # warm-up: buffers allocated, ownership plan cached
            log(f"{n}-rank pool ready and warmed up")
        methods = timed_methods(pools, root / "baseline", bufs, bf16)
        times, last4 = run_repeats(methods, c["repeats"], root / "baseline")
        log("reading as expert-parallel inference workers")
        reads = read_tests(c, last4, root, wire)
        log("measuring one optimizer step's FP8 delta")
        delta = {"lr": a.delta_lr, **delta_blocks(full, wire, a.delta_lr)}
        log(f"done in {time.perf_counter() - t_start:.0f} s")
        print_writes(times, sum(len(b) for b in bufs), sum(t.nbytes for t in full.values()), c)
        print_reads(reads, delta)
        print(final_line(times, reads, delta), flush=True)
    finally:
        for p in pools.values():
            p.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
