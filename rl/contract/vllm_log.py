"""What a vLLM server's log says about a dead engine core (standard library only: the inference role
and the launcher both read it, so it lives in the contract).

When vLLM's engine core raises, the API server stays up and answers every request with HTTP 500
"EngineCore encountered an issue" and /health with 503, so whoever calls it first (the orchestrator)
shows only the symptom. The cause is in the server's own log, after vLLM's "EngineCore encountered a
fatal error" line: the last exception line of the engine core's traceback.
"""
from __future__ import annotations

import re
from pathlib import Path

FATAL = "EngineCore encountered a fatal error"
_EXC = re.compile(r"\] ([A-Za-z_][\w.]*(?:Error|Exception|Exit)\b.*)")


def engine_death(log: str | Path) -> tuple[int, str] | None:
    """(1-based line, exception line) of the first engine-core death in `log`; None if there is none."""
    try:
        lines = Path(log).read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return None
    start = next((k for k, ln in enumerate(lines) if FATAL in ln), None)
    if start is None:
        return None
    tag = lines[start].split(" ERROR ")[0]  # "(EngineCore pid=N)": that process's traceback lines
    found = [(k, m.group(1)) for k in range(start, len(lines))
             if lines[k].startswith(tag) and (m := _EXC.search(lines[k]))]
    k, exc = found[-1] if found else (start, "(no exception line)")
    return k + 1, exc[:300]


def describe(log: str | Path) -> str | None:
    """"<exception line> (<log>:<line>)" for a dead engine core in `log`; None if there is none."""
    d = engine_death(log)
    return None if d is None else f"{d[1]} ({log}:{d[0]})"


def engine_deaths(logs_dir: str | Path) -> dict[str, str]:
    """Every vLLM server of a run (`<name>.vllm.log` in its logs directory) whose engine core died."""
    return {log.name.split(".")[0]: d for log in sorted(Path(logs_dir).glob("*.vllm.log"))
            if (d := describe(log)) is not None}
