"""The inference role: one vLLM OpenAI server per `python -m rl.inference --run-dir D --index I`.

vLLM is run as a child process (`python -m vllm.entrypoints.openai.api_server`), not imported: its
engine spawns its own processes, owns signals and logs a lot, and a child we can terminate and whose
output goes to `D/logs/inference_<I>.vllm.log` is easier to supervise and to restart. This process
waits for the trainer's first publication, materialises an HF model directory on node-local disk
(vLLM loads far faster from there than from the shared filesystem, and on the CPU it cannot take the
FP8 shards, which are dequantized here), starts the server with our worker extension
(rl.inference.worker_ext) and the endpoints the orchestrator needs (VLLM_SERVER_DEV_MODE=1 for
pause / collective_rpc / reset_prefix_cache / weight version; `--enable-scale-out` for the
token-in/token-out endpoint that reports per-token weight versions), labels the engine with the policy
version it loaded, and advertises itself in `D/inference/server_<I>.json`. Later versions are loaded in
flight by the orchestrator, never by restarting. It stays up until `D/DONE` appears or it is signalled,
then stops the child (terminate, wait, kill).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from omegaconf import OmegaConf

import rl
from rl import exchange, runtime
from rl.inference.worker_ext import VERSION_ENV

ROLE = "inference"
ASSETS_KIND, WEIGHTS_KIND = "assets", "weights"
WORKER_EXTENSION = "rl.inference.worker_ext.WeightSyncExtension"
SERVED_MODEL_NAME = "policy"
# DeepSeek-V3 / Kimi checkpoint convention for block-scaled e4m3, as vLLM's Fp8Config reads it.
FP8_QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}


def log(msg: str) -> None:
    runtime.log(ROLE, msg)


def run_hash(run_dir: str | os.PathLike) -> str:
    return hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]


def fp8_supported() -> bool:
    """Can vLLM compute with block FP8 weights here? CUDA with compute capability >= 8.9 (Ada/Hopper)."""
    import torch
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def resolve_fp8_load(mode: str, supported: bool) -> bool:
    """fp8_load (auto|dequantize|fp8) -> load the shards as FP8?"""
    if mode == "dequantize":
        return False
    if mode == "fp8":
        if not supported:
            raise RuntimeError("inference.fp8_load=fp8 but this machine has no FP8-capable GPU; "
                               "use auto or dequantize")
        return True
    if mode == "auto":
        return supported
    raise ValueError(f"inference.fp8_load must be auto|dequantize|fp8, got {mode!r}")


def torch_dtype(name: str, assets_config: dict):
    import torch
    if name == "auto":
        name = assets_config.get("torch_dtype") or "bfloat16"
    return getattr(torch, name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def clean_stale(base: Path, keep: str) -> list[str]:
    """Remove model dirs under `base` left by runs whose inference process on this host is gone."""
    gone = []
    if not base.is_dir():
        return gone
    host = socket.gethostname()
    for d in base.iterdir():
        if d.name == keep or not d.is_dir():
            continue
        try:
            owner = json.loads((d / "owner.json").read_text())
        except (OSError, json.JSONDecodeError):
            owner = {}
        if owner.get("host") == host and _alive(int(owner.get("pid", 0) or 0)):
            continue
        shutil.rmtree(d, ignore_errors=True)
        gone.append(d.name)
    return gone


def materialize(assets_dir: Path, weights_dir: Path, out_dir: Path, *, dtype, fp8: bool) -> Path:
    """Write an HF model dir: the assets (tokenizer, config) plus the weights of `weights_dir`.

    Dequantized to `dtype` in HF names (one safetensors file per wire shard), or, with `fp8`, the
    shards as they are and a `quantization_config` in config.json. Written to a temp dir, then renamed.
    """
    from safetensors.torch import save_file

    from rl.exchange.weights import FP8_META, INDEX, iter_tensors

    exchange.verify(weights_dir, checksums=True)
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for p in assets_dir.iterdir():
        if p.is_file() and p.name != exchange.MANIFEST:
            shutil.copy2(p, tmp / p.name)
    config = json.loads((tmp / "config.json").read_text())
    if fp8:
        for p in weights_dir.iterdir():
            if p.suffix == ".safetensors" or p.name == INDEX:
                shutil.copy2(p, tmp / p.name)
        config["quantization_config"] = FP8_QUANT_CONFIG
    else:
        index = json.loads((weights_dir / INDEX).read_text())
        shard_of: dict[str, str] = {}
        shards: dict[str, dict] = {}
        for name, t in iter_tensors(weights_dir, dequantize=True, dtype=dtype):
            fname = index["weight_map"][name]
            shards.setdefault(fname, {})[name] = t.contiguous()
            shard_of[name] = fname
        total = 0
        for fname, tensors in shards.items():
            save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": shard_of},
                                            indent=1, sort_keys=True))
        config.pop("quantization_config", None)
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    (tmp / "hetrl_source.json").write_text(json.dumps(
        {"weights": str(weights_dir), "fp8": fp8,
         "fp8_meta": json.loads((weights_dir / FP8_META).read_text())}))
    shutil.rmtree(out_dir, ignore_errors=True)
    os.rename(tmp, out_dir)
    return out_dir


def vllm_command(model_dir: Path, icfg, *, host: str, port: int, python: str = sys.executable,
                 api_key: str | None = None, routed_experts: bool = False) -> list[str]:
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", SERVED_MODEL_NAME, "--host", host, "--port", str(port),
           "--dtype", str(icfg.dtype), "--max-model-len", str(icfg.max_model_len),
           "--worker-extension-cls", WORKER_EXTENSION, "--generation-config", "vllm",
           "--enable-scale-out",
           # Prefix caching explicitly (the router's affinity relies on it) and per-request
           # usage.prompt_tokens_details.cached_tokens, which rl.inference.router records.
           "--enable-prefix-caching", "--enable-prompt-tokens-details"]
    if icfg.enforce_eager:
        cmd.append("--enforce-eager")
    if routed_experts:  # router replay (R3): every response carries [tokens-1, layers, top_k] expert ids
        cmd.append("--enable-return-routed-experts")
    if api_key:
        cmd += ["--api-key", api_key]
    cmd += [str(a) for a in (icfg.get("extra_args") or [])]
    return cmd


def vllm_env(icfg, *, host: str, version: int, cache_root: str, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    repo = str(Path(rl.__file__).resolve().parent.parent)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([repo] + rest)
    env.update({
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_HOST_IP": host,
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, int(round(float(icfg.kv_cache_gb))))),
        "VLLM_CACHE_ROOT": cache_root,
        VERSION_ENV: str(version),
    })
    return env


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log_path: Path,
                 stop: runtime.StopFlag | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited with status {proc.returncode} before it was healthy; "
                               f"see {log_path}")
        if stop is not None and stop.is_set():
            raise InterruptedError(f"stopped ({stop.reason}) while vLLM was starting")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"vLLM server not healthy at {url} after {timeout:.0f} s "
                       f"(inference.startup_timeout_s); see {log_path}")


def _die_with_parent() -> None:
    """In the vLLM child before exec: SIGTERM it when this role dies, even by SIGKILL, so a killed
    role never leaves an orphan server holding the port and the node's memory (Linux prctl)."""
    import ctypes
    import signal
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def stop_child(proc: subprocess.Popen, grace: float = 30.0) -> int | None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def wait_first_publication(run_dir: Path, stop: runtime.StopFlag) -> tuple[Path, Path, int] | None:
    """Block until assets/step_000000 and a complete weights step exist; (assets, weights, version)."""
    announced = False
    while not stop.is_set() and not runtime.is_done(run_dir):
        assets = exchange.step_dir(run_dir, ASSETS_KIND, 0)
        version = exchange.latest_complete(run_dir, WEIGHTS_KIND) if assets.is_dir() else None
        if version is not None:
            return assets, exchange.step_dir(run_dir, WEIGHTS_KIND, version), version
        if not announced:
            log(f"waiting for {assets} and weights/step_* from the trainer")
            announced = True
        time.sleep(0.5)
    return None


def serve(run_dir: Path, index: int = 0) -> int:
    run_dir = Path(run_dir).resolve()
    cfg = runtime.load_config(run_dir)
    icfg = cfg.inference
    stop = runtime.StopFlag()
    first = wait_first_publication(run_dir, stop)
    if first is None:
        log("stopped before the first weights were published")
        return runtime.EXIT_PREEMPTED if stop.is_set() else 0
    assets, weights, version = first

    base = Path(cfg.cluster.node_local_dir)
    rh = run_hash(run_dir)
    gone = clean_stale(base, keep=rh)
    if gone:
        log(f"removed stale model dirs of earlier runs: {', '.join(gone)}")
    work = base / rh
    work.mkdir(parents=True, exist_ok=True)
    exchange.atomic_write_json(work / "owner.json", {"run_dir": str(run_dir), "host": socket.gethostname(),
                                                     "pid": os.getpid()})
    fp8 = resolve_fp8_load(str(icfg.fp8_load), fp8_supported() if icfg.fp8_load != "dequantize" else False)
    assets_cfg = json.loads((assets / "config.json").read_text())
    dtype = torch_dtype(str(icfg.dtype), assets_cfg)
    t0 = time.monotonic()
    model_dir = materialize(assets, weights, work / f"model{index}", dtype=dtype, fp8=fp8)
    log(f"materialised version {version} ({'fp8' if fp8 else str(dtype)}) in {model_dir} "
        f"({time.monotonic() - t0:.1f} s)")

    host = str(icfg.host)
    port = int(icfg.port) + index
    url = f"http://{host}:{port}"
    secret_file = run_dir / "secret"
    secret = secret_file.read_text().strip() if secret_file.exists() else None
    log_path = run_dir / "logs" / f"inference_{index}.vllm.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cache_root = tempfile.mkdtemp(prefix="vllm-cache-", dir=work)
    # vLLM captures routing only with its GPU MoE kernels (0.32 refuses on the CPU); without it the
    # trainer records routing with its own forward (rl.trainer.replay) and says so in its metrics.
    capture = bool(OmegaConf.select(cfg, "trainer.router_replay", default=False)) and _cuda_available()
    cmd = vllm_command(model_dir, icfg, host=host, port=port, api_key=secret, routed_experts=capture)
    env = vllm_env(icfg, host=host, version=version, cache_root=cache_root)
    if port_in_use(host, port):
        raise RuntimeError(f"inference.port: {host}:{port} is already in use (another server, or a leftover "
                           f"of an earlier run?); pick another inference.port or stop that process")
    log(f"starting vLLM on {url} (log: {log_path})")
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, cwd=str(work),
                                start_new_session=True, preexec_fn=_die_with_parent)
    try:
        t0 = time.monotonic()
        wait_healthy(url, proc, float(icfg.startup_timeout_s), log_path, stop)
        headers = {"Authorization": f"Bearer {secret}"} if secret else {}
        httpx.post(f"{url}/update_weight_version", json={"new_version": str(version)}, headers=headers,
                   timeout=30.0).raise_for_status()
        log(f"vLLM healthy after {time.monotonic() - t0:.0f} s, policy version {version}")
        exchange.atomic_write_json(run_dir / "inference" / f"server_{index}.json",
                                   {"url": url, "version": version, "host": socket.gethostname(),
                                    "pid": proc.pid, "index": index, "fp8": fp8, "log": str(log_path)})
        runtime.record_role(run_dir, f"{ROLE}_{index}", url=url, vllm_pid=proc.pid)
        while not stop.is_set() and not runtime.is_done(run_dir):
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with status {proc.returncode}; see {log_path}")
            time.sleep(0.5)
        log("DONE" if not stop.is_set() else f"stopping ({stop.reason})")
    except InterruptedError as e:
        log(str(e))
    finally:
        rc = stop_child(proc)
        log(f"vLLM stopped (status {rc})")
        shutil.rmtree(cache_root, ignore_errors=True)
    return runtime.EXIT_PREEMPTED if stop.is_set() else 0


def main(argv=None) -> int:
    ns = runtime.parse_role_args(ROLE, argv, extra=[(("--index",), {"type": int, "default": 0})])
    return serve(ns.run_dir, ns.index)
