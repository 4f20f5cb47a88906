"""benchmarks/seed_rehearsal.py at a tiny size: the real orchestrator process on echo_tools episodes,
mock engines speaking vLLM's wire format, the real exchange and trainer data ranks in a gloo group.

Checked where the measurement is exact, not its speeds: the last line parses as `key=value`; every
episode of every published batch was matched to its engine requests, and each received its routed rows
exactly once (rows sent = tokens - 1, rows stored = tokens), so decoded routes per episode stay below the
episode's own rows while base64 on the wire is 4/3 of them; each data rank read its own shard and nothing
more (its read calls returned at least its shard and less than its shard plus any other one); the ranks'
shards are every shard of the step, once each, and hold every token of the batch; and no process the
benchmark started outlives it.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _parse(line: str) -> dict:
    kv = dict(item.split("=", 1) for item in line.split())
    assert kv, line
    return kv


def _procs_mentioning(text: str) -> list[str]:
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = (Path("/proc") / pid / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            out.append(f"{pid}: {cmd}")
    return out


def test_tiny_rehearsal_measures_what_is_exact(tmp_path):
    work = tmp_path / "w"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "seed_rehearsal.py"),
                        "--rollouts-per-step", "8", "--group-size", "4", "--tokens-per-episode", "1024",
                        "--turns", "4", "--data-ranks", "2", "--steps", "2", "--work-dir", str(work),
                        "--timeout-s", "300", "--no-probe"],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert not _procs_mentioning(str(work)), "processes left behind"
    kv = _parse(r.stdout.strip().splitlines()[-1])
    for key in ("routes_http_vs_rows", "routes_wire_vs_rows", "rank_read_vs_share", "seed_critical_path_s",
                "seed_orchestrator_rss_gib", "plan_vs_rehearsal", "critical_path_s", "batch_bytes"):
        float(kv[key])   # present and a number
    assert kv["path"] == "share", "the trainer's per-rank data plane is not what ran"
    assert int(kv["episodes"]) >= 16 and kv["episodes_matched"] == kv["episodes"]
    assert kv["routes_rows_eq_tokens"] == "1"
    assert float(kv["routes_http_vs_rows"]) < 1.0
    assert 1.30 < float(kv["routes_wire_vs_rows"]) < 1.40
    assert kv["only_own_shard"] == "1"
    assert kv["shards_partition_batch"] == "1"
