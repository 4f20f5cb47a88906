"""Elastic inference capacity (issue 43): does a server added mid-run with `launch scale` add throughput,
and how long from an engine's death until its restarted server takes traffic again?

Real parts: the run directory (config, plan, secret, resume.json, published assets and weights), the
inference role (`python -m rl.inference`, which materializes the weights, supervises its engine through
rl.inference.guard, writes and withdraws its server record, drains), the router (`python -m
rl.inference.router`, run-directory mode, which follows the records) and `python -m launch scale`
(extra replica rows, the local backend's extra processes, drains). The engine is a stand-in
(benchmarks/_elastic_engine.py: vLLM's paths, a fixed capacity of `--slots` requests of `--service-ms`
each), since the question is about the parts around it. Clients send `/inference/v1/generate` through
the router in a closed loop (`--concurrency` of them, enough to fill two servers).

scale_up_ratio: rollouts per second with the second server (added by `launch scale +1`, once the
router counts it healthy) over rollouts per second with one, measured in windows of `--seconds`,
interleaved (one, scale up, two, drain it, ...) `--repeats` times; the median of the per-repeat ratios.

recovery_s: the engine (the role's vLLM stand-in, the guard's child) is SIGKILLed; its role sees it
exit, withdraws its record and exits 1; this script then restarts the role as the batch script's
supervisor does for a first failure (after its 5 s back-off: sbatch/job.sbatch.j2), and recovery_s
is the time from the kill to the first answer served by the restarted server (median over
`--repeats`). Its parts are printed: detect_s (kill to record withdrawn), the back-off, and the
restarted role's start until its record (role_start_s).

    python benchmarks/elastic.py [--seconds 6 --repeats 3 --slots 4 --service-ms 50 --concurrency 32]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BACKOFF_S = 5.0   # the batch script's back-off before a role's first in-place restart


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_run(root: Path, args) -> Path:
    """A local run directory whose inference replica runs the stand-in engine, with weights v0 published."""
    import torch
    from launch.compose import compose
    from launch.plan import make_plan
    from launch.rundir import freeze_run_dir
    from rl import exchange
    from rl.contract import paths
    from rl.contract.atomic import atomic_write_json
    from rl.exchange.weights import write_shards
    from rl.tiny_models.tiny import write_hf_assets

    run_dir = root / "run"
    port = _free_port()
    cfg = compose([f"run_dir={run_dir}", f"inference.port={port}", f"inference.router_port={_free_port()}",
                   "inference.router=true", "wandb.mode=disabled", "inference.startup_timeout_s=120",
                   f"cluster.node_local_dir={root / 'node_local'}", "orchestrator.request_timeout_s=60"])
    freeze_run_dir(cfg, run_dir, make_plan(cfg), backend="local")
    plan = json.loads(paths.plan_file(run_dir).read_text())
    r = plan["inference"]["replicas"][0]
    r["vllm_command"] = [sys.executable, str(REPO / "benchmarks" / "_elastic_engine.py"),
                         "--host", r["host"], "--port", str(r["port"]), "--model", r["model_dir"]]
    atomic_write_json(paths.plan_file(run_dir), plan)
    subprocess.run([sys.executable, "-m", "rl.prepare", "--run-dir", str(run_dir)], cwd=REPO, check=True,
                   capture_output=True)   # resume.json first: a run without a checkpoint keeps no weights
    exchange.publish(run_dir, "assets", 0, lambda d: write_hf_assets(d, cfg["model"]), producer="bench")
    sd = {"model.embed_tokens.weight": torch.zeros(cfg["model"]["vocab_size"] if "vocab_size" in cfg["model"]
                                                   else 512, 8)}
    exchange.publish(run_dir, "weights", 0, lambda d: write_shards(d, sd), producer="bench", policy_version=0)
    return run_dir


def start_role(run_dir: Path, name: str, env_extra: dict, args) -> subprocess.Popen:
    from rl.contract.plan import Plan
    from rl.contract import paths
    plan = Plan.read(run_dir)
    role = plan.role(name)
    env = {**os.environ, **role.env, **env_extra, "PYTHONPATH": str(REPO), "HETRL_EPOCH": "0"}
    log = open(paths.log_file(run_dir, name), "ab")
    return subprocess.Popen(role.command, cwd=plan.workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


async def wait_for(cond, timeout: float, what: str):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        v = await cond()
        if v:
            return v
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{what} after {timeout:.0f} s")


class Load:
    """Closed-loop clients through the router; every answer as (time, backend)."""

    def __init__(self, url: str, secret: str, concurrency: int):
        self.url, self.headers, self.n = url, {"Authorization": f"Bearer {secret}"}, concurrency
        self.done: list[tuple[float, str]] = []
        self.errors: list[str] = []
        self.stop = False

    async def worker(self, http, k: int):
        i = 0
        while not self.stop:
            body = {"token_ids": [k, i % 97, 3, 4], "sampling_params": {"max_tokens": 4}}
            i += 1
            try:
                async with http.post(f"{self.url}/inference/v1/generate", json=body, headers=self.headers) as r:
                    await r.read()
                    if r.status == 200:
                        self.done.append((time.monotonic(), r.headers.get("X-Hetrl-Backend", "?")))
                    else:
                        self.errors.append(f"{r.status}")
            except Exception as e:  # noqa: BLE001  counted, the load goes on
                self.errors.append(type(e).__name__)
                await asyncio.sleep(0.1)

    def rate(self, t0: float, t1: float) -> float:
        return sum(1 for t, _ in self.done if t0 <= t < t1) / (t1 - t0)


async def bench(args) -> dict:
    import aiohttp
    from rl.contract import elastic, paths
    from rl.contract.records import ServerRecord
    root = Path(tempfile.mkdtemp(prefix="hetrl-elastic-"))
    procs: list[subprocess.Popen] = []
    try:
        run_dir = make_run(root, args)
        engine_env = {"HETRL_MOCK_SLOTS": str(args.slots), "HETRL_MOCK_SERVICE_MS": str(args.service_ms)}
        os.environ.update(engine_env)   # `launch scale` (local backend) passes the environment on
        procs.append(start_role(run_dir, "inference_0", engine_env, args))
        procs.append(start_role(run_dir, "router", {}, args))
        secret = paths.secret_file(run_dir).read_text().strip()

        async def router_url():
            try:
                return json.loads(paths.router_record(run_dir).read_text())["url"]
            except (OSError, ValueError, KeyError):
                return None
        url = await wait_for(router_url, 120, "no router record")
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            async def healthy(n):
                async def check():
                    async with http.get(f"{url}/router/stats", headers={"Authorization": f"Bearer {secret}"}) as r:
                        st = await r.json()
                    return sum(b["healthy"] for b in st["backends"]) == n
                return check
            await wait_for(await healthy(1), 120, "inference_0 not healthy in the router")
            load = Load(url, secret, args.concurrency)
            workers = [asyncio.create_task(load.worker(http, k)) for k in range(args.concurrency)]
            await asyncio.sleep(1.0)   # warm
            ones, twos, ratios = [], [], []
            for _ in range(args.repeats):
                t0 = time.monotonic()
                await asyncio.sleep(args.seconds)
                one = load.rate(t0, time.monotonic())
                out = subprocess.run([sys.executable, "-m", "launch", "scale", str(run_dir), "--inference", "+1"],
                                     cwd=REPO, capture_output=True, text=True, timeout=120)
                assert out.returncode == 0, out.stderr + out.stdout
                index = elastic.extra_indexes(run_dir)[-1]
                pid = int(elastic.row_job(run_dir, index).split(":")[1].split(",")[0])
                await wait_for(await healthy(2), 120, f"inference_{index} not healthy in the router")
                t0 = time.monotonic()
                await asyncio.sleep(args.seconds)
                two = load.rate(t0, time.monotonic())
                used = {b for t, b in load.done if t >= t0}
                out = subprocess.run([sys.executable, "-m", "launch", "scale", str(run_dir), "--inference", "-1"],
                                     cwd=REPO, capture_output=True, text=True, timeout=120)
                assert out.returncode == 0, out.stderr + out.stdout

                async def gone():
                    try:
                        os.kill(pid, 0)
                        return False
                    except ProcessLookupError:
                        return True
                    finally:
                        try:
                            os.waitpid(pid, os.WNOHANG)
                        except ChildProcessError:
                            pass
                await wait_for(gone, 120, f"inference_{index} did not exit after draining")
                await wait_for(await healthy(1), 60, "the drained server still counted healthy")
                ones.append(one)
                twos.append(two)
                ratios.append(two / one)
                print(f"  repeat: 1 server {one:.1f}/s, 2 servers {two:.1f}/s ({two / one:.2f}x; answered by "
                      f"{sorted(used)})", flush=True)

            # recovery: kill inference_0's engine, restart its role like the batch script
            recoveries, detects, starts = [], [], []
            for _ in range(args.repeats):
                rec = ServerRecord.read(run_dir, 0)
                t_kill = time.monotonic()
                os.kill(rec.pid, signal.SIGKILL)
                role = procs[0]

                async def withdrawn():
                    return ServerRecord.read(run_dir, 0) is None
                await wait_for(withdrawn, 60, "the dead server's record was not withdrawn")
                detects.append(time.monotonic() - t_kill)
                rc = await asyncio.get_running_loop().run_in_executor(None, role.wait, 60)
                assert rc != 0, f"the role exited {rc} after its engine died"
                await asyncio.sleep(BACKOFF_S)
                t_start = time.monotonic()
                procs[0] = start_role(run_dir, "inference_0", engine_env, args)

                async def new_record():
                    r = ServerRecord.read(run_dir, 0)
                    return r is not None and r.pid != rec.pid
                await wait_for(new_record, 120, "the restarted server wrote no record")
                starts.append(time.monotonic() - t_start)

                async def served():
                    return next((t for t, b in load.done if t > t_kill and b == "inference_0"), None)
                t_first = await wait_for(served, 60, "the restarted server took no traffic")
                recoveries.append(t_first - t_kill)
                print(f"  recovery: {recoveries[-1]:.1f} s (detect {detects[-1]:.1f} s, back-off {BACKOFF_S:.0f} s, "
                      f"role start {starts[-1]:.1f} s)", flush=True)
            load.stop = True
            await asyncio.gather(*workers, return_exceptions=True)
        return {"scale_up_ratio": statistics.median(ratios), "rps_1": statistics.median(ones),
                "rps_2": statistics.median(twos), "recovery_s": statistics.median(recoveries),
                "detect_s": statistics.median(detects), "role_start_s": statistics.median(starts),
                "backoff_s": BACKOFF_S, "errors": len(load.errors), "repeats": args.repeats,
                "slots": args.slots, "service_ms": args.service_ms, "concurrency": args.concurrency}
    finally:
        try:
            (root / "run" / "DONE").write_text("{}")   # every role (the extra ones too) exits on DONE
        except OSError:
            pass
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        import shutil
        shutil.rmtree(root, ignore_errors=True)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=6.0, help="length of each throughput window")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--slots", type=int, default=4, help="requests a stand-in engine serves at once")
    p.add_argument("--service-ms", type=float, default=50.0, help="time of one request in the engine")
    p.add_argument("--concurrency", type=int, default=32, help="closed-loop clients (fill two engines)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    out = asyncio.run(bench(args))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print("elastic: " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in out.items()))
    return out


if __name__ == "__main__":
    main()
