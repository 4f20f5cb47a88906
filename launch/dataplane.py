"""The rollout data plane of a plan, predicted from the config: the bytes a step's rollout batch weighs, what
each trainer rank reads, verifies and packs before it can train, and what the orchestrator spends on it.

Why a model of its own: at the seed's volume (256 episodes of 64k tokens with GLM-5's 75 x top-8 routed
experts) the batch is ~10 GB a step, and every byte of it is decoded from base64, spilled, concatenated,
hashed and written by one orchestrator process, then read, hashed and packed by the trainer ranks while
the GPUs wait. launch.perf models weights, compute and rollouts; this module adds those terms from the
same kind of formula (a count of bytes over a rate), so a plan that would not fit its step because of the
data plane is found on the login node, and the same formulas are what benchmarks/seed_rehearsal.py checks
against a measurement (it builds its own `Volume` and calls `measure_rates` and `predict`).

Bytes are exact where the format is ours (rl.contract.batch): a step is one shard per trainer data rank
(dp_shard x ep; cp ranks of one data rank read the same shard) holding its samples' per-token arrays (13
B a token: int32 token, uint8 loss mask, float32 logprob, int32 version; plus moe_layers x top_k expert
ids of 1 B while ids fit in uint8, i.e. up to 256 experts, else 2 B) and int64 offsets; a sample index
(samples.safetensors, 44 B a sample); meta.json. Every file is a safetensors header (rebuilt byte for byte
by `safetensors_header_bytes`) and the arrays. Each rank reads its shard, the index and meta.json. Routes
arrive over HTTP as vLLM's base64 `.npy`: 4/3 of the rows plus a 128-byte npy header per turn, each row
once per episode (turns ask from routed_experts_prompt_start). meta.json is an estimate (a few numbers
per sample); the shares are even (a rank's whole-sample share may hold one more episode: shown apart).
Rates are bytes per second of exactly the operation named (`Rates`); the defaults were measured with
`measure_rates` (the numbers and the machine are in `Rates`'s docstring and docs/perf.md), and
`launch plan` bounds the file reads and writes by the cluster's shared filesystem (`SharedFS`, from
cluster.hardware). Standard library only: numpy is imported inside `measure_rates`, never by the plan.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import dataclass, fields
from pathlib import Path

G = 1e9
GIB = 2 ** 30
TOKEN_BYTES = 4 + 1 + 4 + 4      # tokens int32, loss_mask uint8, logprobs float32, versions int32
SHARD_SAMPLE_BYTES = 8           # a shard's int64 offsets (plus one)
INDEX_SAMPLE_BYTES = 8 + 4 + 4 + 4 + 8 + 8 + 8   # the index: offsets, rewards, advantages, groups, loss_tokens,
#                                                  version_sum, version_min
NPY_HEADER = 128                 # numpy's .npy v1 header of a 3-d array (padded to 64 B: 128 for any shape here)
META_BASE_BYTES = 2048           # meta.json's fixed keys (estimate)
META_SAMPLE_BYTES = 64           # per sample: entries, prompt_tokens, snapshots, the shards' indices (estimate)
# The orchestrator's memory, in the parts benchmarks/seed_rehearsal.py measures apart (its _rehearsal_memory.py;
# docs/perf.md, "Data plane at the seed's volume"):
RESIDENT_TOKEN_BYTES = 75        # per token in flight, an episode counted half-way, as the rehearsal measured
#                                  it (74-76 B at its default size): 13 B of growing arrays at up to 1.25x
#                                  capacity, the rest not attributed (docs/perf.md)
EPISODE_BYTES = 32 * 2 ** 10     # per episode in flight: a request's own objects (httpx, h11, its task: 24 kB in
#                                  tests/unit/test_client_memory.py) and the episode's; below the rehearsal's noise
ANSWERS_HELD = 8                 # generate answers' worth being read and parsed at once, per server
#                                  (rl.orchestrator.client.READ_BODIES bodies, each ~2x while parsed)
ANSWER_TOKEN_BYTES = 40          # an answer's JSON per generated token besides the routes (ids, logprobs)
ORCH_BASE_BYTES = 1 * GIB        # the orchestrator without episodes: interpreter, tokenizer, clients (assumed)
PACK_TOKEN_BYTES = 8 + 8 + 4 * 4 + 4 * 3  # packing.pack's output: tokens, positions int64; mask, lp_inf, adv,
#                                           lag float32; the trainer's mask/lag/adv inputs built first
CRITICAL_FRACTION = 0.02         # the trainer's data plane may cost this share of cluster.target_step_s
# A rank's per-step cost that does not grow with bytes: the manifest and tree check, meta.json and the
# sample index parsed and checked, the layout, the validation passes' fixed work. Measured as the intercept
# of benchmarks/seed_rehearsal.py's ranks replayed alone at two sizes (0.6 GB and 0.16 GB batches: 0.02 s
# above the byte terms at both, on the development VM).
STEP_FIXED_S = 0.02

# safetensors' dtype names and sizes of the files' arrays, in the order rl.contract.batch writes them
_SHARD = (("tokens", "I32", 4), ("loss_mask", "U8", 1), ("logprobs", "F32", 4), ("versions", "I32", 4))
_INDEX = (("rewards", "F32", 4), ("advantages", "F32", 4), ("groups", "I32", 4), ("loss_tokens", "I64", 8),
          ("version_sum", "I64", 8), ("version_min", "I64", 8))


def route_width(n_experts: int) -> int:
    """Bytes of one expert id, as vLLM returns them and the batch stores them: uint8 up to 256 experts."""
    return 1 if n_experts <= 256 else 2


def safetensors_header_bytes(tensors: list[tuple[str, str, int, tuple[int, ...]]]) -> int:
    """The bytes before the data of a safetensors file of `tensors` ((name, dtype, itemsize, shape), in
    file order): an 8-byte length and the compact JSON header padded with spaces to a multiple of 8."""
    parts, start = [], 0
    for name, dtype, size, shape in tensors:
        end = start + size * math.prod(shape)
        parts.append(f'"{name}":{{"dtype":"{dtype}","shape":[{",".join(map(str, shape))}],'
                     f'"data_offsets":[{start},{end}]}}')
        start = end
    n = len("{" + ",".join(parts) + "}")
    return 8 + n + (-n % 8)


@dataclass(frozen=True)
class Volume:
    """What one step moves: `rollouts` episodes of `mean_tokens` (at most `max_tokens`) in `turns` turns,
    routed experts of `moe_layers` x `top_k` ids among `n_experts` when `router_replay`, `data_ranks`
    shards (trainer.parallel.dp_shard x ep) read by `trainer_ranks` ranks, `inflight` episodes held by
    the orchestrator at once, finished samples waiting up to `off_policy` batches ahead
    (orchestrator.max_off_policy), `servers` the orchestrator reads answers from (one through the router).
    Keyword-constructible (benchmarks build their own)."""
    rollouts: int
    mean_tokens: float
    max_tokens: float
    moe_layers: int
    top_k: int
    n_experts: int
    data_ranks: int
    trainer_ranks: int
    inflight: int = 0
    turns: float = 1.0
    router_replay: bool = True
    off_policy: int = 0
    servers: int = 1

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            # a dense model, none in flight, no batch waiting
            zero = f.name in ("inflight", "moe_layers", "top_k", "n_experts", "off_policy")
            if f.name != "router_replay" and not (isinstance(v, (int, float)) and math.isfinite(v)
                                                  and (v >= 0 if zero else v > 0)):
                raise ValueError(f"Volume.{f.name}={v!r}: must be a finite number {'>= 0' if zero else '> 0'}")
        if self.router_replay and not (self.moe_layers and self.top_k and self.n_experts):
            raise ValueError(f"Volume.router_replay=True with moe_layers={self.moe_layers}, top_k={self.top_k}, "
                             f"n_experts={self.n_experts}: router replay needs MoE layers")

    @classmethod
    def from_cfg(cls, cfg, workload) -> "Volume":
        """The volume of the composed config `cfg`: rollouts per step, in flight and ranks from the config,
        the MoE shape from launch.shape, the mean rollout length and turns from `workload` (launch.perf's
        `Workload`: its defaults, `launch plan --assume` or a run's metrics; `launch.perf.data_volume(cfg,
        assume)` builds both, since launch.perf imports this module and not the other way round). Routes
        are carried when trainer.router_replay is on and the servers run on GPUs (the only place vLLM
        returns them)."""
        from launch import shape
        from rl.contract.config import typed
        c = typed(cfg)
        w = workload
        s = shape.Shape.from_cfg(c.model)
        o, t, p = c.orchestrator, c.trainer, c.trainer.parallel
        rollouts = o.prompts_per_step * o.group_size
        cap = (o.max_off_policy + 1) * rollouts       # launch.perf's in-flight rule
        inflight = min(o.max_inflight or cap, cap)
        world = t.nodes * t.gpus_per_node if t.gpus_per_node else p.dp_shard * p.ep * p.cp
        return cls(rollouts=rollouts, mean_tokens=w.rollout_tokens,
                   max_tokens=float(o.max_rollout_tokens or c.inference.max_model_len),
                   moe_layers=s.moe_layers, top_k=s.top_k, n_experts=s.num_experts,
                   data_ranks=p.dp_shard * p.ep, trainer_ranks=world, inflight=inflight, turns=w.turns,
                   router_replay=bool(t.router_replay and c.inference.gpus_per_node > 0 and s.moe_layers),
                   off_policy=int(o.max_off_policy), servers=1 if c.inference.router else int(c.inference.replicas))

    # -- bytes ------------------------------------------------------------------------------------
    @property
    def route_token_bytes(self) -> int:
        """Routed-expert bytes per token in the batch (0 without router replay)."""
        return self.moe_layers * self.top_k * route_width(self.n_experts) if self.router_replay else 0

    @property
    def token_bytes(self) -> int:
        return TOKEN_BYTES + self.route_token_bytes

    @property
    def tokens(self) -> float:
        return self.rollouts * self.mean_tokens

    def shard_bytes(self) -> float:
        """One data rank's shard: its even share of tokens and samples, one more offset, the header."""
        t, n = self.tokens / self.data_ranks, self.rollouts / self.data_ranks
        arrays = [(k, d, sz, (round(t),)) for k, d, sz in _SHARD] + [("offsets", "I64", 8, (round(n) + 1,))]
        if self.router_replay:
            w = route_width(self.n_experts)
            arrays.append(("routed_experts", "U8" if w == 1 else "U16", w, (round(t), self.moe_layers, self.top_k)))
        return t * self.token_bytes + (n + 1) * SHARD_SAMPLE_BYTES + safetensors_header_bytes(arrays)

    def index_bytes(self) -> float:
        """samples.safetensors: the per-sample arrays of the whole batch (every rank reads it)."""
        n = self.rollouts
        arrays = [("offsets", "I64", 8, (n + 1,))] + [(k, d, sz, (n,)) for k, d, sz in _INDEX]
        return n * INDEX_SAMPLE_BYTES + 8 + safetensors_header_bytes(arrays)

    def meta_bytes(self) -> float:
        return META_BASE_BYTES + META_SAMPLE_BYTES * self.rollouts

    def rank_read_bytes(self) -> float:
        """What one trainer rank reads: its shard, the sample index and meta.json."""
        return self.shard_bytes() + self.index_bytes() + self.meta_bytes()

    def batch_bytes(self) -> float:
        return self.data_ranks * self.shard_bytes() + self.index_bytes() + self.meta_bytes()

    def route_bytes(self) -> float:
        """Routed-expert rows of one step's batch (one per token), as spilled and as stored."""
        return self.tokens * self.route_token_bytes

    def http_route_bytes(self) -> float:
        """Base64 text of the routes the engines send for one step: each row once per episode, one `.npy`
        per turn (4/3 of rows + header, padded to 4 characters)."""
        if not self.router_replay:
            return 0.0
        per_turn = (self.mean_tokens - 1) * self.route_token_bytes / self.turns + NPY_HEADER
        return self.rollouts * self.turns * 4 * math.ceil(per_turn / 3)


@dataclass(frozen=True)
class Rates:
    """Bytes per second of one core doing each data-plane operation, as `measure_rates` measures it:
    sha256 (hashlib over an in-memory buffer), read (a file in the page cache into memory), write (a
    file written and fsynced), build (numpy concatenation of per-episode arrays into the batch's),
    decode (per bytes of base64 text: JSON string, base64 decode, `.npy` parse) and pack (per bytes of
    output of the trainer's packing: int64 tokens and positions, float32 per-token terms; routes are
    viewed in their batch width, not copied).

    The defaults were measured with `measure_rates(tmp_dir="/tmp", mib=128)` on the development machine (a
    2-core Intel Xeon cloud VM shared with other work, Python 3.11, numpy 2.3; three runs, the lowest median
    of each, rounded down): a cluster node's core is at least as fast, so the plan errs long. Pack is the
    exception: the micro-benchmark gave 2-10 GB/s from run to run there, rl.trainer.packing.pack on a
    loaded share 2.1-2.4 GB/s of output, and the default is the latter. Base64 decoding is CPython's
    binascii, ~0.2 GB/s of text: the largest orchestrator term at the seed's volume."""
    sha256: float = 1.4e9
    read: float = 1.7e9
    write: float = 1.2e9
    build: float = 5.0e9
    decode: float = 0.2e9
    pack: float = 2.0e9

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ValueError(f"Rates.{f.name}={v!r}: must be a positive number of bytes per second")


@dataclass(frozen=True)
class SharedFS:
    """The shared filesystem's bounds on the batch's files (cluster.hardware): per client node, in
    aggregate, and how many trainer ranks share a node's client."""
    read_bps: float
    write_bps: float
    total_bps: float
    ranks_per_node: int

    @classmethod
    def from_hardware(cls, hw, ranks_per_node: int) -> "SharedFS":
        return cls(hw.fs_read_gbps * G, hw.fs_write_gbps * G, hw.fs_total_gbps * G, max(ranks_per_node, 1))


@dataclass(frozen=True)
class DataPlane:
    """One step's data-plane bytes and seconds (see `predict`)."""
    volume: Volume
    rates: Rates
    batch_bytes: float
    rank_read_bytes: float         # one data rank's shard + the sample index + meta.json
    rank_read_max_bytes: float     # a rank whose whole-sample share holds one more max-length episode
    route_bytes: float             # routed-expert rows of the step (spilled, then stored)
    http_route_bytes: float        # base64 routes received over HTTP in the step
    verify_s: float                # a rank hashes what it read (sha256 against the manifest)
    load_s: float                  # it reads its files into memory (the only read)
    pack_s: float                  # packing.pack of its share into micro-batches
    critical_path_s: float         # verify + load + pack + STEP_FIXED_S: serial after the batch appears
    decode_s: float                # orchestrator: base64 + .npy of the routes received
    spill_s: float                 # orchestrator: routes written to node-local disk and read back
    build_s: float                 # orchestrator: concatenating the shards' arrays
    hash_s: float                  # orchestrator: sha256 of every shard (the manifest)
    write_s: float                 # orchestrator: writing the shards to the shared filesystem
    orchestrator_cpu_s: float
    orchestrator_rss_bytes: float
    fs_read_bytes: float           # shared filesystem, per step, all trainer ranks
    fs_write_bytes: float


def answer_bytes(v: Volume) -> float:
    """A mean generate answer: a turn's routes as base64 and its tokens' JSON."""
    per_turn = v.mean_tokens / v.turns
    return v.http_route_bytes() / (v.rollouts * v.turns) + per_turn * ANSWER_TOKEN_BYTES


def orchestrator_rss(v: Volume) -> float:
    """The orchestrator's peak resident bytes: the base, the episodes in flight (each half-way on average,
    and what each holds whatever its length), the answers being parsed (bounded per server), finished
    samples waiting up to `off_policy` batches ahead (13 B/token arrays; their routes are mapped files),
    the batch's 13 B/token arrays while it is cut, and one shard at a time: its arrays and the spilled rows
    it was read from (mapped pages count in RSS). The episodes in flight and the batches waiting are both
    taken at their maxima: an upper bound (the pool's room caps them together)."""
    return (ORCH_BASE_BYTES + v.inflight * (EPISODE_BYTES + v.mean_tokens / 2 * RESIDENT_TOKEN_BYTES)
            + ANSWERS_HELD * v.servers * answer_bytes(v) + (v.off_policy + 1) * v.tokens * TOKEN_BYTES
            + 2 * v.shard_bytes())


def predict(volume: Volume, rates: Rates | None = None, fs: SharedFS | None = None) -> DataPlane:
    """The data plane of one step of `volume` at `rates`. With `fs` (launch plan: the cluster's shared
    filesystem) the trainer ranks' read and the orchestrator's write are bounded by it. The trainer's
    terms are serial: a rank reads its files once, hashes the bytes it read (rl.contract.batch.load_share)
    and packs them, and none of it overlaps its training; validation (a few passes over the 13 B/token
    arrays, none over the routes) is not counted."""
    v, r = volume, rates or Rates()
    share = v.rank_read_bytes()
    batch = v.batch_bytes()
    read, write = r.read, r.write
    if fs is not None:
        read = min(r.read, fs.read_bps / fs.ranks_per_node, fs.total_bps / v.trainer_ranks)
        write = min(r.write, fs.write_bps, fs.total_bps)
    verify = share / r.sha256
    load = share / read
    # routes stay in the batch's width and are viewed, not copied (rl.trainer.packing._narrow): the copies
    # are the per-token terms
    pack = (v.tokens / v.data_ranks) * PACK_TOKEN_BYTES / r.pack
    routes, http = v.route_bytes(), v.http_route_bytes()
    decode = http / r.decode
    spill = routes / r.write + routes / r.read
    build = batch / r.build
    hash_ = batch / r.sha256
    write_s = batch / write
    rss = orchestrator_rss(v)
    return DataPlane(volume=v, rates=r, batch_bytes=batch, rank_read_bytes=share,
                     rank_read_max_bytes=share + v.max_tokens * v.token_bytes, route_bytes=routes,
                     http_route_bytes=http, verify_s=verify, load_s=load, pack_s=pack,
                     critical_path_s=verify + load + pack + STEP_FIXED_S, decode_s=decode, spill_s=spill, build_s=build,
                     hash_s=hash_, write_s=write_s, orchestrator_cpu_s=decode + spill + build + hash_ + write_s,
                     orchestrator_rss_bytes=rss, fs_read_bytes=v.trainer_ranks * share, fs_write_bytes=batch)


def table_rows(d: DataPlane) -> list[tuple[str, str, str]]:
    """launch plan's rows (role, term, seconds per step): the bytes in the term's words."""
    v = d.volume
    routes = (f"{v.moe_layers} x top-{v.top_k} routes ({v.route_token_bytes} B/token)" if v.router_replay
              else "no routes (router replay off)")
    return [
        ("data", f"batch: {d.batch_bytes / G:.2f} GB ({v.rollouts} x {v.mean_tokens:.0f} tokens, {routes}), "
                 f"{v.data_ranks} shards", ""),
        ("data", f"trainer rank reads {d.rank_read_bytes / G:.3f} GB (up to {d.rank_read_max_bytes / G:.3f}); "
                 f"all {v.trainer_ranks} ranks {d.fs_read_bytes / G:.0f} GB from the shared filesystem", ""),
        ("data", "trainer load (read its shard, index and meta.json)", f"{d.load_s:.2f}"),
        ("data", "trainer verify (sha256 of what it read)", f"{d.verify_s:.2f}"),
        ("data", "trainer pack (micro-batches; routes viewed in place)", f"{d.pack_s:.2f}"),
        ("data", "trainer critical path (verify + load + pack + fixed, serial, GPUs idle)", f"{d.critical_path_s:.2f}"),
        ("data", f"orchestrator CPU: decode {d.http_route_bytes / G:.1f} GB base64, spill, build, hash, write "
                 f"{d.fs_write_bytes / G:.1f} GB", f"{d.orchestrator_cpu_s:.1f}"),
        ("data", f"orchestrator RSS: {v.inflight} episodes in flight, samples up to {v.off_policy} batches "
                 "ahead (routes spilled)",
         f"{d.orchestrator_rss_bytes / GIB:.1f} GiB"),
    ]


def warnings(d: DataPlane, target_step_s: float | None, step_s: float) -> list[str]:
    """One line each: the trainer's data plane above CRITICAL_FRACTION of cluster.target_step_s, the
    orchestrator's CPU seconds above the predicted step (one process cannot keep up)."""
    out = []
    if target_step_s and d.critical_path_s > CRITICAL_FRACTION * target_step_s:
        out.append(f"the trainer's data-plane critical path {d.critical_path_s:.1f} s exceeds "
                   f"{CRITICAL_FRACTION:.0%} of cluster.target_step_s={target_step_s:g} (each rank verifies, "
                   f"loads and packs {d.rank_read_bytes / G:.2f} GB: more data ranks, trainer.parallel.dp_shard x ep)")
    if d.orchestrator_cpu_s > step_s:
        out.append(f"the orchestrator's data-plane CPU {d.orchestrator_cpu_s:.0f} s per step exceeds the predicted "
                   f"step {step_s:.0f} s (one process decodes, builds, hashes and writes "
                   f"{d.batch_bytes / G:.1f} GB)")
    return out


# -- measuring the rates ----------------------------------------------------------------------------
def _median_rate(nbytes: float, fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return nbytes / max(statistics.median(times), 1e-9)


def measure_rates(tmp_dir: str | Path, mib: int = 64, repeats: int = 5) -> Rates:
    """Each rate of `Rates` measured here on `mib` MiB (median of `repeats`): the operations themselves,
    on arrays shaped like a batch with GLM-5's 75 x 8 uint8 routes. The read and the hash are a trainer
    rank's own calls (rl.contract.batch_checks.read_file, then sha256 of the buffer it returned), on a file
    just written and fsynced, so in the page cache. Writes and removes one file in `tmp_dir` (node-local
    scratch, not a run directory). A few seconds at the default size. Wall-clock rates: on a shared
    machine they follow its load, so a comparison with another measurement should take both together
    (benchmarks/seed_rehearsal.py interleaves them)."""
    import base64
    import hashlib
    import io

    import numpy as np

    n = mib << 20
    layers, top_k = 75, 8
    rng = np.random.default_rng(0)
    buf = rng.integers(0, 256, n, dtype=np.uint8)
    raw = buf.tobytes()

    from rl.contract import safefs   # the batch's own way in and out (rl.contract.batch)
    from rl.contract.batch_checks import read_file   # what a rank calls (load_share -> _read -> read_file)
    path = Path(tmp_dir) / f"hetrl-rates-{os.getpid()}.bin"

    def write():   # as rl.contract.batch.write_arrays: write(2) from memory, then fsync
        fd = safefs.open_write(path, truncate=True)
        try:
            mv = memoryview(raw)
            while len(mv):
                mv = mv[os.write(fd, mv[: 1 << 30]):]
            os.fsync(fd)
        finally:
            os.close(fd)

    # A rank's read and hash are rl.contract.batch_checks.read_file itself: preadv into a fresh zeroed
    # buffer, then hashlib over that buffer. The file was just written and fsynced, so its pages are in
    # the page cache, as a rank's shard is on the machine whose orchestrator wrote it (the rehearsal
    # records how much of each shard was resident: benchmarks/_rehearsal_rank.py).
    held = []

    def read():
        held[:] = [read_file(path)[0]]

    def sha():     # read_file's check: one sha256 over the buffer it read
        hashlib.sha256(held[0]).hexdigest()

    try:
        w = _median_rate(n, write, repeats)
        r = _median_rate(n, read, repeats)
        sh = _median_rate(n, sha, repeats)
    finally:
        held.clear()
        path.unlink(missing_ok=True)

    # build: the orchestrator concatenates per-episode arrays (16 episodes) into the batch's arrays
    rows = n // (layers * top_k + TOKEN_BYTES)
    per = [buf[: (rows // 16) * layers * top_k].reshape(-1, layers, top_k)] * 16
    toks = [np.arange(rows // 16, dtype=np.int32)] * 16
    built = 16 * (rows // 16) * (layers * top_k + TOKEN_BYTES)

    def build():
        np.concatenate(per)
        np.concatenate(toks), np.concatenate(toks), np.concatenate(toks)
        np.concatenate([t.view(np.uint8)[: len(t)] for t in toks])

    b = _median_rate(built, build, repeats)

    # decode: one turn's response body as the client parses it (JSON string, base64, .npy)
    npy = io.BytesIO()
    # (what np.save writes, into memory: vLLM's numpy2base64)
    np.lib.format.write_array(npy, buf[: (n // (layers * top_k)) * layers * top_k].reshape(-1, layers, top_k),
                              allow_pickle=False)
    body = json.dumps({"routed_experts": base64.b64encode(npy.getvalue()).decode()})
    text_bytes = len(body)

    def decode():
        s = json.loads(body)["routed_experts"]
        np.load(io.BytesIO(base64.b64decode(s)), allow_pickle=False)

    d = _median_rate(text_bytes, decode, repeats)

    # pack: rl.trainer.packing.pack's numpy work on a share (micro-batches of 8 samples), and the
    # trainer's per-token inputs (mask, lag, advantages) built before it
    t = rows
    tokens = np.arange(t, dtype=np.int32)
    mask = np.ones(t, np.uint8)
    lps = np.zeros(t, np.float32)
    vers = np.zeros(t, np.int32)
    routed = buf[: t * layers * top_k].reshape(t, layers, top_k)
    bounds = np.linspace(0, t, 9).astype(int)

    def pack():
        m = mask.astype(np.float32)
        lag = np.where(mask > 0, 1 - vers, 0).astype(np.float32)
        adv = np.repeat(np.zeros(8, np.float32), np.diff(bounds))
        for a, z in zip(bounds[:-1], bounds[1:]):
            tokens[a:z].astype(np.int64), np.arange(z - a, dtype=np.int64)
            for x in (m, lps, adv, lag):
                np.ascontiguousarray(x[a:z], dtype=np.float32)
            np.ascontiguousarray(routed[a:z])   # a view: routes widen on the device, not here

    p = _median_rate(t * PACK_TOKEN_BYTES, pack, repeats)
    return Rates(sha256=sh, read=r, write=w, build=b, decode=d, pack=p)
