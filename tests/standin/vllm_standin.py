"""A stand-in for vLLM's OpenAI server, for Slurm tests of multi-node replicas on a machine without GPUs.

vLLM cannot run data-parallel GPU ranks on a CPU, yet what a Slurm test must prove is that every node of
a replica ran exactly the command and environment the plan gave it. So the run's `cluster.python` is the
stand-in interpreter `write_interpreter` creates: a shell script that execs the real Python for every
role (prepare, trainer, orchestrator, rl.inference itself) and hands only `-m vllm.entrypoints....` (the
vLLM server the inference role starts) to this file. This file then

- records what it was started with into `$HETRL_RUN_DIR/standin/vllm-<node>-<pid>.json`: the full argv
  as the role executed it (the interpreter path included), the whole environment, the hostname, the
  `SLURM_*` ids of the task it runs in (SLURM_PROCID: its node rank in the replica's step) and whether
  the model directory (`--model DIR` or `serve DIR`) was materialised when it started;
- acts just enough like vLLM for the role: without `--headless` it serves HTTP on the `--host`/`--port`
  of its argv, answering `GET /health` with 200 and `POST /update_weight_version` (recording the label,
  as `label-<pid>.json`); any other request (the orchestrator's generation) is held open until the
  process is killed, since nothing here can generate. With `--headless` (a data-parallel rank with no
  API server) it only waits to be killed. SIGTERM ends it at once, like the real server's shutdown.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HERE = Path(__file__).resolve()

INTERPRETER = """#!/bin/sh
# Stand-in interpreter (tests/standin/vllm_standin.py): the real Python, except for vLLM's server.
case "$1 $2" in
  "-m vllm.entrypoints."*) exec {real} {standin} "$0" "$@" ;;
esac
exec {real} "$@"
"""


def write_interpreter(path: Path, real_python: str) -> Path:
    """An executable at `path` to use as cluster.python (see the module docstring)."""
    import shlex
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(INTERPRETER.format(real=shlex.quote(real_python), standin=shlex.quote(str(HERE))))
    path.chmod(0o755)
    return path


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


def _write(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, lambda s, f: os._exit(0))
    out = Path(os.environ["HETRL_RUN_DIR"]) / "standin"
    out.mkdir(parents=True, exist_ok=True)
    # the model dir: `--model DIR` (the OpenAI server module) or `serve DIR` (vllm's CLI, multi-node)
    model = _flag(argv, "--model") or (argv[argv.index("serve") + 1] if "serve" in argv[:5] else None)
    rec = {"argv": argv, "env": dict(os.environ), "hostname": socket.gethostname(), "pid": os.getpid(),
           "cwd": os.getcwd(), "slurm": {k: v for k, v in os.environ.items() if k.startswith("SLURM")},
           "node_rank": int(os.environ.get("SLURM_PROCID", "0")),
           "model_materialised": bool(model) and (Path(model) / "config.json").is_file(),
           "time": time.time()}
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    _write(out / f"vllm-{node}-{os.getpid()}.json", rec)
    print(f"vllm stand-in on {node}: {' '.join(argv)}", flush=True)
    if "--headless" in argv:
        while True:
            signal.pause()

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                return self._reply(200, {})
            threading.Event().wait()  # the stand-in cannot serve this: hold the request until killed

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path == "/update_weight_version":
                _write(out / f"label-{os.getpid()}.json", json.loads(body or b"{}"))
                return self._reply(200, {})
            threading.Event().wait()

        def log_message(self, fmt, *args):
            print(f"stand-in http: {fmt % args}", flush=True)

    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer((_flag(argv, "--host"), int(_flag(argv, "--port"))), Handler).serve_forever()
    return 0


if __name__ == "__main__":  # python vllm_standin.py ARGV0 -m vllm.entrypoints.... ARGS...
    sys.exit(main(sys.argv[1:]))
