"""A rehearsal of the seed's data plane at scale (issue 37, item 4): real orchestrator, real exchange, real
trainer batch path, real HTTP with vLLM's wire format; only the engines' model and the trainer's model
are left out.

What runs for real, each as its own process started the way the launcher starts it:
- the run directory: `launch.compose.compose_points` + `launch.plan.make_plan` + `launch.rundir.
  freeze_run_dir` (config.yaml, plan.json, the run secret), then `python -m rl.prepare`;
- the orchestrator, `python -m rl.orchestrator --run-dir D` exactly as plan.json says, unmodified: the
  continuous pool, multi-turn episodes on `rl/envs/echo_tools.py` (a tool that returns as many one-token
  words as it is asked for, so episodes are sized token blobs like SWE observations), router replay with
  `routed_experts_prompt_start`, the weight watcher, advantages, the batch and its publication;
- the trainer's data ranks (benchmarks/_rehearsal_rank.py): a gloo process group of `--data-ranks`
  processes, each running the trainer's wait / verify / load / pack (`rl.trainer.dataplane.next_share`,
  then rl.trainer.packing as train_step does), after which rank 0 publishes a
  small `weights/step_{n+1}` through rl.exchange so the off-policy bound moves.

What is mocked, and why: the inference engines (benchmarks/_rehearsal_engine.py). vLLM returns routed
experts only from its GPU MoE kernels and this machine has no GPU, so a mock HTTP server per planned
replica speaks vLLM 0.32's API with vLLM's own request/response types and `numpy2base64` routes
(honouring `routed_experts_prompt_start`), answers the pause / load_policy / update_weight_version /
reset_prefix_cache / resume sequence the weight watcher sends, and generates instantly, so the
orchestrator's CPU, not a model, paces the run. No trainer model either: the rehearsal stops where the
forward pass would start (rows packed), which is where the data plane ends.

Measured per step: batch bytes (the manifest's data files), build seconds (re-run after the run on the
step's own samples with `RolloutBatch.from_samples`, since the orchestrator is not instrumented), publish
seconds (from its tmp directory appearing to the step's rename, polled), verify / load seconds (the
ranks' timings), bytes each rank opened and read, the trainer's critical path (from the first rank
seeing the batch to the slowest rank's rows packed; and "alone": each rank's share replayed after the
run through the same calls on the idle machine, since live the 4 ranks share 2 cores with the orchestrator
and the engine), orchestrator CPU (/proc/<pid>/stat utime + stime; per batch = all of it after start-up
over the batches, as the pool works ahead and batches come in bursts) and peak RSS (VmHWM; and RssAnon
sampled every 0.1 s, which leaves out spilled routes mapped in through a memmap), HTTP bytes per
generated token and routed bytes per episode (the engine's per-request records matched to the batch's
episodes by hashes of their token prefixes).

Extrapolation to the seed (256 rollouts x 64k mean tokens, 131k max, 75 x top-8 GLM-5 routes, 128
trainer ranks of which 16 data ranks: glm5_seed's dp_shard 1 x ep 16, its 8 cp ranks per data rank read
the same shard; 2048 episodes in flight), each stated where printed: batch bytes from the measured bytes
per token at the seed's route width; the critical path linear in the bytes the slowest rank reads (every
rank at the per-rank rate measured here, the filesystem delivering it to all); orchestrator CPU linear in
tokens per step at the rehearsal's turns per episode; orchestrator memory as a sum of parts, each
measured here and scaled by what it grows with (benchmarks/_rehearsal_memory.py says how): the fixed part
(a process doing only the orchestrator's start-up, measured apart), a part per episode in flight, per token
in flight and per byte of the largest answer (RssAnon between builds in the main run and in three one-step
probe runs: a quarter of the episodes in flight; episodes a quarter as long in a quarter of the turns;
episodes as long in a quarter of the turns, so answers four times as large), the rest as measured, the
shard being built (RssAnon's peak while a step is written, less the level between builds; scaled by a
data rank's share of the batch), the finished samples waiting for their batch (max_off_policy batches of
13 B/token arrays, added at the seed: the rehearsal runs max_off_policy 1), and file-backed pages as
measured (one sample's mapped routes at the seed's longest episode while it is copied). The cruder
scalings of all growth by tokens in flight or by tokens per batch are printed beside it.
The plan's formulas (launch.dataplane.predict) are evaluated at the rehearsal's own volume with rates
measured in the same run (`measure_rates`): plan_vs_rehearsal = predicted critical path / the slowest
rank's share replayed alone (a rank with a core of its own, as the plan assumes). Both sides are wall
clock on a shared machine, so they are measured together: after the main run one process alternates the
rates and a replay of every rank's share (rates, replay, rates, ..., replay, rates; `--replays`, 3),
each replay is divided into the plan at the rates measured just before and after it, and the median of
those ratios is reported with their spread (plan_vs_rehearsal_spread=min,max). The rates' read and hash
are the rank's own calls on a page-cache-resident file, and the replay records how much of each shard
was resident before it was read. The live ratio, four ranks sharing two cores with the orchestrator and
the engines, is printed as plan_vs_rehearsal_live (at the median rates).

Rollout workers (`--workers N`, issue 50: orchestrator.rollout_workers = N): each process's CPU from /proc
(the centre as above; each worker's CPU at the last batch less its own start-up, over the batches),
extrapolated linearly in tokens per step like the orchestrator's: `seed_central_cpu_s`, and
`seed_busiest_rollout_cpu_s` = the workers' sum at the seed / `--seed-workers` (16) x the imbalance
measured here; `cpu_sum_vs_one_process` = CPU per batch token of all processes over a `--workers 0` run of
the same size (run first, or `--baseline-cpu-per-token`). With `--router` (on by default with
`--workers`) the router role runs in front of the engines as the plan starts it (inference.router=true) and
its CPU per context token gives `seed_router_cpu_s`. benchmarks/_rehearsal_workers.py says how.

The last line is one `key=value ...` line. The default size (64 rollouts x 16k mean tokens x 20 turns,
75 x 8 routes, 4 data ranks, 3 steps, 128 in flight: 6% of the seed's tokens per step, ~0.6 GB batches)
takes 4-6 minutes with the three probe runs and the interleaved replays (`--no-probe` skips the
probes, and then the seed's RSS is the crude figure: all growth charged to tokens in flight), under 10 GB
on the 2-core development machine; `--fraction F` sizes rollouts and
tokens per episode to F of the seed's tokens per step instead (each by the square root of F). More than
2 data ranks: the config says `trainer.gpus_per_node` = data ranks, since the local backend refuses more
CPU trainer ranks than it has cores; nothing here reads the trainer's device.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _rehearsal_report import SEED, analyse, report  # noqa: E402  (the measuring half)
import _rehearsal_workers as W  # noqa: E402  (rollout workers: --workers N)

# the orchestrator's module run under tracemalloc, the peak of traced memory and its largest holders
# written at exit (sampled every 2 s: tracemalloc's peak is a number, its snapshot only the moment's)
TRACED = """
import atexit, runpy, sys, threading, time, tracemalloc
best = [0, None]
def sample():
    while True:
        time.sleep(2)
        cur, _ = tracemalloc.get_traced_memory()
        if cur > best[0]:
            best[0], best[1] = cur, tracemalloc.take_snapshot()
threading.Thread(target=sample, daemon=True).start()
def dump():
    cur, peak = tracemalloc.get_traced_memory()
    with open({out!r}, "w") as f:
        f.write(f"traced peak {{peak}} current {{cur}} sampled max {{best[0]}}\\n")
        if best[1] is not None:
            for st in best[1].statistics("lineno")[:25]:
                f.write(f"{{st}}\\n")
atexit.register(dump)
sys.argv[0] = {module!r}
runpy.run_module({module!r}, run_name="__main__", alter_sys=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc(pid: int) -> dict:
    """CPU seconds (utime + stime) and VmRSS / VmHWM / RssAnon bytes of a live process. RssAnon leaves out
    file pages mapped in (spilled routes read through a memmap), which the kernel can drop and re-read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        f = stat[stat.rindex(")") + 2:].split()
        cpu = (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
        st = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
              if ln.startswith(("VmRSS", "VmHWM", "RssAnon"))}
        return {"cpu": cpu, "rss": st.get("VmRSS", 0), "hwm": st.get("VmHWM", 0), "anon": st.get("RssAnon", 0)}
    except (OSError, ValueError, IndexError):
        return {}


def args_(argv=None):
    p = argparse.ArgumentParser(description="Rehearse the seed's data plane at scale (issue 37).")
    p.add_argument("--rollouts-per-step", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--tokens-per-episode", type=int, default=16384, help="mean; episodes vary around it")
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--layers", type=int, default=75)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--data-ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--fraction", type=float, default=None,
                   help="size rollouts and tokens per episode to this fraction of the seed's tokens per step "
                        "(each scaled by its square root); overrides --rollouts-per-step/--tokens-per-episode")
    p.add_argument("--inflight", type=int, default=None, help="orchestrator.max_inflight (default 2 x rollouts)")
    p.add_argument("--work-dir", default=None, help="where the run directory goes (default: a temp dir, removed)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--replays", type=int, default=3,
                   help="replays of the ranks' shares after the main run, each between two measurements of the "
                        "plan's rates (plan_vs_rehearsal: the median of the per-replay ratios, and their spread)")
    p.add_argument("--profile", metavar="FILE", default=None,
                   help="run the orchestrator under cProfile and write its profile here (pstats format)")
    p.add_argument("--tracemalloc", metavar="FILE", default=None,
                   help="run the orchestrator under tracemalloc; at its exit write the peak of what Python and "
                        "numpy allocated and the largest holders at that moment's end (to compare with RSS)")
    p.add_argument("--no-probe", action="store_true",
                   help="skip the three one-step probe runs (a quarter of the episodes in flight; episodes a "
                        "quarter as long in a quarter of the turns; as long in a quarter of the turns) that "
                        "separate the orchestrator's memory per episode, per token in flight and per answer byte")
    p.add_argument("--workers", "--rollout-workers", dest="workers", type=int, default=0,
                   help="orchestrator.rollout_workers: episodes played in N rollout worker processes (issue 50); "
                        "the last line adds each process's CPU and its extrapolation (_rehearsal_workers.py)")
    p.add_argument("--kill-worker", action="store_true",
                   help="SIGKILL one rollout worker when the first batch appears (a fault: the centre counts its "
                        "episodes in flight as lost, replays them and restarts the worker)")
    p.add_argument("--router", action=argparse.BooleanOptionalAction, default=None,
                   help="run the router role (inference.router=true) in front of the engines and measure its CPU "
                        "(seed_router_cpu_s); default: on with --workers, off without")
    p.add_argument("--seed-workers", type=int, default=16,
                   help="rollout workers at the seed, for seed_busiest_rollout_cpu_s (default 16: one per 128 "
                        "episodes in flight)")
    p.add_argument("--baseline-cpu-per-token", type=float, default=None,
                   help="one process's CPU seconds per batch token (cpu_per_token_us / 1e6 of a --workers 0 run "
                        "of the same size); without it a --workers N > 0 run first runs that baseline itself")
    a = p.parse_args(argv)
    if a.workers < 0:
        p.error(f"--workers={a.workers}: must be >= 0")
    if a.fraction is not None:
        if not 0 < a.fraction <= 1:
            p.error(f"--fraction={a.fraction}: must be in (0, 1]")
        r = math.sqrt(a.fraction)
        a.rollouts_per_step = max(a.group_size, round(SEED["rollouts"] * r / a.group_size) * a.group_size)
        a.tokens_per_episode = max(256, round(SEED["mean_tokens"] * r))
    for k in ("rollouts_per_step", "group_size", "tokens_per_episode", "turns", "layers", "top_k", "data_ranks", "steps",
              "replays"):
        if getattr(a, k) < 1:
            p.error(f"--{k.replace('_', '-')}={getattr(a, k)}: must be at least 1")
    if a.rollouts_per_step % a.group_size:
        p.error(f"--rollouts-per-step={a.rollouts_per_step}: must be a multiple of --group-size={a.group_size}")
    if a.tokens_per_episode < 8 * a.turns:
        p.error(f"--tokens-per-episode={a.tokens_per_episode}: at least 8 tokens a turn ({8 * a.turns})")
    a.inflight = a.inflight or 2 * a.rollouts_per_step
    if a.router is None:
        a.router = a.workers > 0
    return a


def make_run(a, run_dir: Path):
    """The run directory as `launch` makes it: composed, validated, planned, frozen, prepared."""
    from omegaconf import OmegaConf
    from launch.compose import compose_points
    from launch.plan import make_plan
    from launch.rundir import freeze_run_dir
    budget = int(math.ceil(a.tokens_per_episode * SEED["max_tokens"] / SEED["mean_tokens"]))
    over = [f"run_dir={run_dir}", "wandb.mode=disabled", "env.name=echo_tools", f"env.max_turns={a.turns}",
            f"orchestrator.prompts_per_step={a.rollouts_per_step // a.group_size}",
            f"orchestrator.group_size={a.group_size}", f"orchestrator.max_inflight={a.inflight}",
            f"orchestrator.max_concurrency={a.inflight}", f"orchestrator.env_concurrency={a.inflight}",
            f"orchestrator.max_tokens={max(64, 4 * a.tokens_per_episode // a.turns)}",
            f"orchestrator.max_off_policy=1", f"inference.max_model_len={budget}", f"model.max_seq_len={budget}",
            "trainer.router_replay=true", f"trainer.micro_batch_tokens={budget}",
            f"trainer.parallel.dp_shard={a.data_ranks}", f"trainer.max_steps={a.steps}", "eval.every=0",
            *W.overrides(getattr(a, "workers", 0)), *(["inference.router=true"] if getattr(a, "router", False) else [])]
    if a.data_ranks > 2:
        # the local backend refuses more than 2 CPU trainer ranks (this machine's cores): the config says
        # GPUs so the plan takes them; nothing here reads the trainer's device, the ranks run on the CPU
        over.append(f"trainer.gpus_per_node={a.data_ranks}")
    (cfg,) = compose_points(over, multirun=False)
    plan = make_plan(cfg, check_memory=False)
    freeze_run_dir(cfg, run_dir, plan)
    return OmegaConf.create({k: v for k, v in cfg.items() if k != "_overrides"}), plan


def publish_start(run_dir: Path) -> None:
    """What the trainer's first start publishes before any role can work: the tokenizer and version 0."""
    from rl import exchange
    from rl.contract import safefs
    from rl.tiny_models.tiny import build_tokenizer
    exchange.publish(run_dir, "assets", 0, lambda d: build_tokenizer(d).save_pretrained(str(d)), producer="trainer")
    exchange.publish(run_dir, "weights", 0, lambda d: safefs.write_atomic(d / "weights.txt", b"rehearsal version 0\n"),
                     producer="trainer", policy_version=0)


class Procs:
    """The processes this benchmark started, each in its own process group; all stopped on exit."""

    def __init__(self, logs: Path):
        self.logs, self.procs = logs, {}

    def start(self, name: str, cmd: list[str], env: dict) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "wb")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        log.close()
        self.procs[name] = p
        return p

    def failed(self) -> str | None:
        for name, p in self.procs.items():
            if p.poll() not in (None, 0):
                tail = (self.logs / f"{name}.log").read_text(errors="replace").strip().splitlines()[-15:]
                return f"{name} exited with status {p.returncode}:\n" + "\n".join(tail)
        return None

    def stop(self, name: str | None = None) -> None:
        for n, p in list(self.procs.items()):
            if name is not None and n != name or p.poll() is not None:
                continue
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            except ProcessLookupError:
                pass


FIXED = """
import os, sys
from pathlib import Path
from rl.runtime import load_config
from rl.orchestrator.loop import Orchestrator, _load_tokenizer
from rl.orchestrator.client import InferenceClient
run = Path(sys.argv[1])
o = Orchestrator(run, load_config(run))
c0 = sum(os.times()[:2])
o.sampler.tokenizer = _load_tokenizer(run)
o.sampler.bridge.observation_ids([{"role": "user", "content": "x"}], False)
o.sampler.clients = [InferenceClient("http://127.0.0.1:1")]
st = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in open("/proc/self/status") if ln.startswith(("VmHWM", "RssAnon"))}
print(sum(os.times()[:2]) - c0, st["VmHWM"], st["RssAnon"])
"""


def fixed_part(run_dir: Path, env: dict) -> tuple[float, int, int]:
    """The orchestrator's RSS without episodes: a process that does only its start-up (config, environment,
    tokenizer, chat bridge, a client), measured apart so nothing in flight is in it; and the CPU seconds of
    the part of it the orchestrator does after the servers are up (tokenizer, bridge)."""
    out = subprocess.run([sys.executable, "-c", FIXED, str(run_dir)], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    if out.returncode:
        raise RuntimeError(f"measuring the orchestrator's fixed RSS failed: {out.stderr[-1500:]}")
    cpu, rss, anon = out.stdout.split()[-3:]
    return float(cpu), int(rss), int(anon)


def run(a, work: Path, replay_rates: bool = True) -> dict:
    from rl.contract import paths
    from rl.contract.records import ResumeState
    from rl.runtime import is_done
    from launch.local import role_processes
    run_dir, out = work / "run", work / "out"
    out.mkdir(parents=True, exist_ok=True)
    cfg, plan = make_run(a, run_dir)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONUNBUFFERED="1", WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    rc = subprocess.run(plan.prepare.command, env=env, cwd=REPO, capture_output=True, text=True)
    if rc.returncode:
        raise RuntimeError(f"rl.prepare failed: {rc.stdout[-2000:]}{rc.stderr[-2000:]}")
    env["HETRL_EPOCH"] = str(ResumeState.read(run_dir).restart)
    publish_start(run_dir)
    procs = Procs(out)
    t = {"steps": {}, "tmp_seen": {}}
    try:
        cmd, role_env = role_processes(plan)["orchestrator"]
        if getattr(a, "profile", None) and cmd[1:2] == ["-m"]:   # the same command under cProfile
            cmd = [cmd[0], "-m", "cProfile", "-o", str(Path(a.profile).absolute()), *cmd[1:]]
        if getattr(a, "tracemalloc", None) and cmd[1:2] == ["-m"]:   # under tracemalloc: what Python holds
            cmd = [cmd[0], "-X", "tracemalloc=1", "-c", TRACED.format(out=str(Path(a.tracemalloc).absolute()),
                                                                        module=cmd[2]), *cmd[3:]]
        orch = procs.start("orchestrator", cmd, {**env, **role_env})
        # its base: imported and waiting for the servers (no episode yet); RSS steady over 1.5 s
        last, steady, t0 = -1, 0, time.monotonic()
        while steady < 3 and time.monotonic() - t0 < 120:
            time.sleep(0.5)
            if (why := procs.failed()):
                raise RuntimeError(why)
            rss = _proc(orch.pid).get("rss", 0)
            steady = steady + 1 if abs(rss - last) < (1 << 20) else 0
            last = rss
        t["base"] = _proc(orch.pid)
        engine = [sys.executable, str(REPO / "benchmarks" / "_rehearsal_engine.py"), "--run-dir", str(run_dir),
                  "--layers", str(a.layers), "--top-k", str(a.top_k), "--experts", str(a.experts),
                  "--tokens-per-episode", str(a.tokens_per_episode), "--turns", str(a.turns)]
        for r in plan.inference.replicas:
            procs.start(f"engine_{r.index}", engine + ["--index", str(r.index)], env)
        if getattr(a, "router", False):   # the router role as the plan starts it, in front of the engines
            rcmd, renv = role_processes(plan)["router"]
            t["router_pid"] = procs.start("router", rcmd, {**env, **renv}).pid
            t["router_base"] = W.router_ready(run_dir, t["router_pid"], procs.failed)
        port = _free_port()
        for r in range(a.data_ranks):
            procs.start(f"rank_{r}", [sys.executable, str(REPO / "benchmarks" / "_rehearsal_rank.py"), "--run-dir",
                                      str(run_dir), "--steps", str(a.steps), "--out", str(out / f"rank_{r}.jsonl")],
                        {**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(a.data_ranks),
                         "LOCAL_WORLD_SIZE": str(a.data_ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        rollouts = run_dir / "rollouts"
        deadline = time.monotonic() + a.timeout_s
        t["start"] = time.time()
        t["anon_peak"], polls = 0, 0
        while not is_done(run_dir):
            polls += 1
            if polls % 5 == 0:   # RssAnon has no high-water mark of its own: sampled every 0.1 s
                anon = _proc(orch.pid).get("anon", 0)
                t["anon_peak"] = max(t["anon_peak"], anon)
                # while a step is being written (a .tmp- directory exists) the shard being built is in it
                building = any(".tmp-" in n for n in os.listdir(rollouts))
                key = "anon_building" if building else "anon_idle"
                t[key] = max(t.get(key, 0), anon)
            if (why := procs.failed()):
                raise RuntimeError(why)
            if time.monotonic() > deadline:
                raise TimeoutError(f"not done after {a.timeout_s:.0f} s (--timeout-s); logs in {out}")
            now = time.time()
            for name in os.listdir(rollouts):
                if not name.startswith("step_"):
                    continue
                n = int(name[5:11])
                if ".tmp-" in name:
                    t["tmp_seen"].setdefault(n, now)
                elif name[5:].isdigit() and n not in t["steps"]:
                    t["steps"][n] = {"seen": now, **_proc(orch.pid), "workers": W.sample(orch.pid),
                                     "router": W.cpu(t["router_pid"]) if "router_pid" in t else None}
                    if getattr(a, "kill_worker", False) and "killed" not in t and W.children(orch.pid):
                        t["killed"] = W.children(orch.pid)[0]
                        os.kill(t["killed"], signal.SIGKILL)
                        print(f"killed rollout worker pid {t['killed']} (SIGKILL) at rollouts/step_{n:06d}", flush=True)
            time.sleep(0.02)
        t["end"] = {**_proc(orch.pid)}
        if "router_pid" in t:
            t["router_end"] = W.cpu(t["router_pid"])
        t["workers_n"], t["worker_startup"] = getattr(a, "workers", 0), W.startup(out / "orchestrator.log")
        t["engine_stats"] = []
        import httpx
        from rl.contract.secret import secret_or_none
        sec = secret_or_none(run_dir)
        for r in plan.inference.replicas:
            url = f"http://127.0.0.1:{r.port}/rehearsal/stats"
            t["engine_stats"] += httpx.get(url, headers={"Authorization": f"Bearer {sec}"} if sec else {},
                                           timeout=60).json()["requests"]
        for r in range(a.data_ranks):
            procs.procs[f"rank_{r}"].wait(timeout=120)
    finally:
        procs.stop()
    # each rank's share again, one at a time with nothing of the run left (see _rehearsal_rank.py
    # --replay-ranks); for the main run, repeated and interleaved with the plan's rates (measure_rates in the
    # same process: rates, replay, rates, ..., replay, rates), so each replay has rates measured next to it
    reps = ["--repeats", str(a.replays), "--rates-dir", str(out)] if replay_rates else []
    rp = subprocess.run([sys.executable, str(REPO / "benchmarks" / "_rehearsal_rank.py"), "--run-dir", str(run_dir),
                         "--steps", str(a.steps), "--out", str(out / "replay.jsonl"), "--replay-ranks",
                         str(a.data_ranks), *reps], env=env, cwd=REPO, capture_output=True, text=True, timeout=1200)
    if rp.returncode:
        raise RuntimeError(f"the replay of the ranks' shares failed: {rp.stdout[-1500:]}{rp.stderr[-1500:]}")
    recs = [json.loads(ln) for ln in (out / "replay.jsonl").read_text().splitlines()]
    t["replay"] = [r for r in recs if "rates" not in r]
    t["replay_rates"] = [r for r in recs if "rates" in r]
    t["ranks"] = [json.loads(ln) for r in range(a.data_ranks) for ln in (out / f"rank_{r}.jsonl").read_text().splitlines()]
    t["cfg"], t["run_dir"], t["servers"] = cfg, run_dir, len(plan.inference.replicas)
    t["startup_cpu"], t["fixed_rss"], t["fixed_anon"] = fixed_part(run_dir, env)
    return t


def run_shape(t: dict) -> dict:
    """A run's mean episode tokens (its first batch), turns per episode and largest generate answer (the
    engine's records: requests over first turns; the largest response body)."""
    from rl import exchange
    from rl.contract.batch import RolloutBatch
    b = RolloutBatch.load(exchange.step_dir(t["run_dir"], "rollouts", 0))
    recs = t["engine_stats"]
    firsts = sum(r["start"] == 0 for r in recs)
    return {"mean_tokens": len(b.tokens) / max(b.num_samples, 1), "turns": len(recs) / max(firsts, 1),
            "largest_answer": max((r["resp_bytes"] for r in recs), default=0)}


def main(argv=None) -> int:
    a = args_(argv)
    work = Path(a.work_dir).absolute() if a.work_dir else Path(tempfile.mkdtemp(prefix="hetrl-rehearsal-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        if a.workers and a.baseline_cpu_per_token is None:   # one process, same size: cpu_sum_vs_one_process
            import copy
            ba = copy.copy(a)
            ba.workers, ba.profile, ba.tracemalloc = 0, None, None
            bt = run(ba, work / "baseline", replay_rates=False)
            a.baseline_cpu_per_token = W.one_process_per_token(bt)
            print(f"baseline (rollout_workers=0): {a.baseline_cpu_per_token * 1e6:.1f} us CPU per batch token",
                  flush=True)
            if not a.keep and not a.work_dir:
                shutil.rmtree(work / "baseline", ignore_errors=True)
        t = run(a, work)
        if not a.no_probe:
            # Three one-step runs that each change one driver of the orchestrator's memory (the parts are
            # benchmarks/_rehearsal_memory.py's): a quarter of the episodes in flight; episodes a quarter as
            # long in a quarter of the turns (fewer tokens in flight, turns as large); episodes as long in a
            # quarter of the turns (answers four times as large, as many tokens).
            import copy
            t["probes"] = {}
            quarter = max(a.turns // 4, 1)
            for name, inflight, tokens, turns in (
                    ("inflight", max(a.inflight // 4, a.group_size), a.tokens_per_episode, a.turns),
                    ("length", a.inflight, max(a.tokens_per_episode // 4, 8 * quarter), quarter),
                    ("turn", a.inflight, a.tokens_per_episode, quarter)):
                pa = copy.copy(a)
                pa.inflight, pa.tokens_per_episode, pa.turns, pa.steps, pa.profile = inflight, tokens, turns, 1, None
                pa.tracemalloc = None
                pt = run(pa, work / f"probe_{name}", replay_rates=False)
                t["probes"][name] = {"inflight": inflight, "tokens": tokens, "anon_peak": pt["anon_peak"],
                                     "anon_idle": pt.get("anon_idle", 0), "hwm": pt["end"].get("hwm", 0),
                                     **run_shape(pt)}
                print(f"probe run ({name}): {inflight} in flight, {tokens} tokens per episode in {turns} turns: "
                      f"RssAnon between builds {pt.get('anon_idle', 0) / 2**30:.3f} GiB, HWM "
                      f"{pt['end'].get('hwm', 0) / 2**30:.2f} GiB, largest answer "
                      f"{t['probes'][name]['largest_answer'] / 1e6:.2f} MB", flush=True)
                if not a.keep and not a.work_dir:
                    shutil.rmtree(work / f"probe_{name}", ignore_errors=True)
        t["wall_s"] = time.monotonic() - t0
        m = analyse(a, t)
        m["budget"] = int(t["cfg"].inference.max_model_len)
        line = report(a, t, m, work)
    finally:
        if not a.keep and not a.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
