"""launch.status on a local run directory: a server whose engine core died is named with its cause."""
from __future__ import annotations

import io

from builders import make_run_dir
from launch.status import render, status


def test_status_names_a_dead_engine_and_its_cause(tmp_path):
    run = tmp_path / "run"
    make_run_dir(run)
    st = status(run)
    assert st["job"]["state"] == "NEVER STARTED" and st["engine_deaths"] == {}
    logs = run / "logs"
    logs.mkdir(exist_ok=True)
    e = "(EngineCore pid=5) ERROR 12-04 18:39:58 [core.py:1512]"
    (logs / "inference_1.vllm.log").write_text(
        f"INFO up\n{e} EngineCore encountered a fatal error.\n{e} Traceback (most recent call last):\n"
        f"{e} RuntimeError: Worker failed with error 'CPU Generator does not use offset'\n")
    (logs / "inference_0.vllm.log").write_text("INFO up\n")
    st = status(run)
    assert list(st["engine_deaths"]) == ["inference_1"]
    assert st["engine_deaths"]["inference_1"].startswith(
        "RuntimeError: Worker failed with error 'CPU Generator does not use offset' (") and \
        st["engine_deaths"]["inference_1"].endswith("inference_1.vllm.log:4)")
    from rich.console import Console
    buf = io.StringIO()
    render(st, Console(file=buf, width=300))
    assert "inference_1 engine" in buf.getvalue() and "CPU Generator does not use offset" in buf.getvalue()
