"""`python -m launch report RUN_DIR [--out FILE]`: one self-contained HTML page about a run.

Everything comes from the run directory alone, so the page can be made for a run that is still going,
for a finished one copied off the cluster, and for a Slurm run as for a local one:

- `metrics.jsonl` (one line per trainer step, the orchestrator's numbers under `orchestrator/`, evaluation
  rows under `eval/`): reward, evaluation results per policy version, mismatch KL, lag, throughput of
  the trainer and of the inference servers, trainer and inference idle time, dropped, cancelled,
  failed and masked work, batches set aside and updates skipped;
- `rollouts/consumed.jsonl`, `incarnations/restart_*.json`, `roles/history.jsonl`, `slurm_jobs.jsonl`:
  restarts over steps (each consumed step carries the incarnation that trained it) and where each role
  ran in each incarnation;
- `rollouts/step_N` (kept for the whole run) with the tokenizer of `assets/step_000000`: the trajectory
  view, a sample of episodes for some steps with the prompt, the model's turns, the observations and
  tool outputs between them, tool calls marked, the reward and advantage, and every policy token
  coloured by the policy version that produced it (hover for the version and the lag).

The page has no script and fetches nothing (launch.report_svg). It needs no torch: the batches are read
with numpy and safetensors (rl.contract.batch) and decoded with `tokenizers`; without them the metric
charts are still made and the trajectory view says why it is missing.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from launch.report_svg import esc, fmt, line_chart, page
from rl.contract import paths
from rl.contract.config import ConfigError

STEPS_SHOWN = 8          # steps of the trajectory view (first, last and evenly between)
EPISODES_PER_STEP = 4    # per step: the best, the worst and others of distinct groups
MAX_EPISODE_TOKENS = 6000  # beyond this an episode shows its head and tail


def add_arguments(s) -> None:
    s.add_argument("run_dir")
    s.add_argument("--out", default=None, help="the HTML file to write (default: RUN_DIR/report.html)")
    s.add_argument("--steps", type=int, default=STEPS_SHOWN, help="steps in the trajectory view")
    s.add_argument("--episodes", type=int, default=EPISODES_PER_STEP, help="episodes shown per step")


def run(ns) -> int:
    out = Path(ns.out) if ns.out else Path(ns.run_dir) / "report.html"
    html = render(ns.run_dir, steps=ns.steps, episodes=ns.episodes)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(html)
    tmp.replace(out)
    print(f"wrote {out} ({len(html) / 1024:.0f} KiB)")
    return 0


# -- reading the run directory ---------------------------------------------------------------------------
def _jsonl(p: Path) -> list[dict]:
    from rl.exchange.jsonl import read_jsonl  # torch-free; skips a torn last line
    return [r for r in read_jsonl(p) if isinstance(r, dict)] if p.is_file() else []


def _json(p: Path) -> dict | None:
    try:
        obj = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def _num(v):
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _series(rows: list[dict], key: str, x: str = "step") -> list[tuple[float, float]]:
    return [(r[x], _num(r[key])) for r in rows if key in r and _num(r.get(x)) is not None
            and _num(r[key]) is not None]


def read_run(run_dir) -> dict:
    """What the page shows, as plain data (also what the tests check)."""
    import yaml
    run_dir = Path(run_dir).absolute()
    cfg_file = paths.config_file(run_dir)
    if not cfg_file.is_file():
        raise ConfigError(f"{cfg_file}: not found (is {run_dir} a run directory?)")
    cfg = yaml.safe_load(cfg_file.read_text()) or {}
    metrics = _jsonl(paths.metrics_file(run_dir))
    # a trainer step's line may carry the evaluation results that finished meanwhile, and an evaluation
    # that finished after the last step has a line of its own: split by key, not by line
    train = [m for m in metrics if any(not k.startswith("eval/") and k not in ("step", "time") for k in m)]
    evals = [m for m in metrics if any(k.startswith("eval/") for k in m)]
    consumed = _jsonl(paths.consumed_log(run_dir, paths.ROLLOUTS))
    incarnations = sorted((_json(p) or {} for p in (run_dir / "incarnations").glob("restart_*.json")),
                          key=lambda r: r.get("restart", 0))
    return {"run_dir": str(run_dir), "cfg": cfg, "metrics": train, "evals": evals, "consumed": consumed,
            "incarnations": incarnations, "history": _jsonl(paths.role_history(run_dir)),
            "groups": _jsonl(run_dir / paths.ROLLOUTS / "groups.jsonl"),
            "slurm_jobs": _jsonl(run_dir / paths.SLURM_JOBS),
            "resume": _json(paths.resume_file(run_dir)), "done": paths.done_file(run_dir).exists()}


def restart_markers(run: dict) -> list[tuple[float, str]]:
    """(first step trained by incarnation k, label) for every k > 0: where the run restarted."""
    seen, out = set(), []
    for c in sorted(run["consumed"], key=lambda c: c.get("time", 0)):
        k = c.get("restart")
        if isinstance(k, int) and k > 0 and k not in seen and isinstance(c.get("step"), int):
            seen.add(k)
            out.append((c["step"], f"restart {k}: resumed, first trained step {c['step']}"))
    return out


# -- the page -------------------------------------------------------------------------------------------
def render(run_dir, *, steps: int = STEPS_SHOWN, episodes: int = EPISODES_PER_STEP) -> str:
    run = read_run(run_dir)
    cfg, ms = run["cfg"], run["metrics"]
    model = cfg.get("model", {})
    backend = cfg.get("cluster", {}).get("backend", "?")
    title = f"hetrl report: {Path(run['run_dir']).name}"
    sub = (f"{run['run_dir']} | experiment {cfg.get('experiment')} | {backend} | model {model.get('name')} "
           f"({model.get('family')}) | env {cfg.get('env', {}).get('name')} | made {time.strftime('%Y-%m-%d %H:%M')}")
    body = [_summary(run), _charts(run), _evals(run), _incarnations(run), _trajectories(run, steps, episodes)]
    if not ms:
        body.insert(1, '<p class="warn">metrics.jsonl has no trainer steps yet.</p>')
    return page(title, sub, "".join(body))


def _kv(rows) -> str:
    return '<table class="kv">' + "".join(f"<tr><th>{esc(k)}</th><td>{v}</td></tr>" for k, v in rows) + "</table>"


def _summary(run: dict) -> str:
    cfg, ms = run["cfg"], run["metrics"]
    t = cfg.get("trainer", {})
    o = cfg.get("orchestrator", {})
    steps = len({m.get("step") for m in ms})
    last = ms[-1] if ms else {}
    times = [m["time"] for m in ms if _num(m.get("time")) is not None]
    restarts = (run["resume"] or {}).get("restart")
    dropped = sum(1 for g in run["groups"] if g.get("event") == "drop")
    rows = [("status", "finished (DONE)" if run["done"] else "not finished (no DONE)"),
            ("steps trained", f"{steps} of {t.get('max_steps')}"),
            ("reward, last step", esc(fmt(_num(last.get("reward_mean"))))),
            ("reward, mean of first / last 4 steps", " / ".join(
                esc(fmt(sum(v) / len(v))) if v else "-" for v in (
                    [m["reward_mean"] for m in ms[:4] if _num(m.get("reward_mean")) is not None],
                    [m["reward_mean"] for m in ms[-4:] if _num(m.get("reward_mean")) is not None]))),
            ("wall time of the logged steps", f"{(max(times) - min(times)) / 60:.1f} min" if len(times) > 1 else "-"),
            ("restarts", esc(restarts if restarts is not None else "-")),
            ("groups dropped (groups.jsonl)", f"{dropped} of {sum(1 for g in run['groups'] if g.get('event') == 'start')} started"),
            ("async", esc(f"max_off_policy {o.get('max_off_policy')}, schedule {o.get('schedule')}, "
                          f"stale_policy {o.get('stale_policy')}")),
            ("evaluation rows", str(len(run["evals"])))]
    return "<h2>Summary</h2>" + _kv(rows)


def _charts(run: dict) -> str:
    ms, mk = run["metrics"], restart_markers(run)
    o = "orchestrator/"
    charts = [
        ("Reward", [("reward mean", _series(ms, "reward_mean")),
                    ("reward std", _series(ms, o + "reward_std"))], "reward", ""),
        ("Mismatch KL (inference vs trainer logprobs)", [("mismatch KL", _series(ms, "mismatch_kl"))], "nats/token",
         "KL between the sampling engine's and the trainer's token distributions on the trained tokens"),
        ("Lag (trainer step - policy version of the tokens)", [("lag mean", _series(ms, "lag")),
                                                              ("lag max", _series(ms, "lag_max"))], "versions", ""),
        ("Throughput", [("trainer tokens/s", _series(ms, "tokens_per_s")),
                        ("inference gen tokens/s", _series(ms, o + "gen_tokens_per_s"))], "tokens/s", ""),
        ("Idle fraction", [("trainer (waiting for rollouts)", _series(ms, "idle_fraction")),
                           ("inference", _series(ms, o + "inference_idle_fraction"))], "fraction of wall time", ""),
        ("Dropped and wasted work per step", [
            ("dropped groups", _series(ms, o + "dropped_groups")),
            ("cancelled groups", _series(ms, o + "cancelled_groups")),
            ("failed groups", _series(ms, o + "failed_groups")),
            ("batches set aside", _series(ms, "rollouts_set_aside")),
            ("updates skipped", _series(ms, "update_skipped"))], "count", ""),
        ("Wasted and masked tokens", [("wasted token fraction", _series(ms, o + "wasted_token_fraction")),
                                      ("masked fraction", _series(ms, "masked_fraction"))], "fraction", ""),
        ("Restarts", [("incarnation that trained the step",
                       [(c["step"], c.get("restart", 0)) for c in run["consumed"]
                        if isinstance(c.get("step"), int) and isinstance(c.get("restart"), int)])],
         "restart count", "dashed lines in every chart: the first step a restarted incarnation trained"),
        ("Step time", [("train step s", _series(ms, "step_time_s")), ("wait for batch s", _series(ms, "wait_s")),
                       ("publish s", _series(ms, "publish_s"))], "seconds", ""),
    ]
    if any(o + "turns_per_episode" in m for m in ms):
        charts.append(("Episodes (multi-turn)", [("turns/episode", _series(ms, o + "turns_per_episode")),
                                                 ("tool calls", _series(ms, o + "tool_calls")),
                                                 ("tool error rate", _series(ms, o + "tool_error_rate"))], "", ""))
    return "<h2>Over steps</h2><div class=\"charts\">" + "".join(
        line_chart(t, s, y_label=y, markers=mk, note=n) for t, s, y, n in charts) + "</div>"


_EVAL_X = ("eval/version", "eval/policy_version", "eval/version_min", "eval/version_max", "eval/step")
# evaluation numbers that go in the table only: how much was played, not how well
_EVAL_BOOKKEEPING = ("tasks", "samples", "failed_tasks", "seconds", "completion_tokens_mean")


def _eval_x(r: dict):
    # the version the evaluation played, before the trainer's own `policy_version` of a merged line
    for k in ("eval/version", "eval/policy_version", "policy_version", "step"):
        if _num(r.get(k)) is not None:
            return k, r[k]
    return None, None


def _evals(run: dict) -> str:
    rows = run["evals"]
    if not rows:
        return ("<h2>Evaluation</h2><p>No <code>eval/...</code> rows in metrics.jsonl (evaluation was off or has "
                "not run yet).</p>")
    keys = sorted({k for r in rows for k in r if k.startswith("eval/") and _num(r[k]) is not None
                   and k not in _EVAL_X})
    xkey = _eval_x(rows[0])[0] or "step"
    groups: dict[str, list[str]] = {}
    for k in keys:  # one chart per metric name (eval/<set>/<metric> of several sets share one)
        if k.rsplit("/", 1)[-1] not in _EVAL_BOOKKEEPING:
            groups.setdefault(k.rsplit("/", 1)[-1], []).append(k)
    charts = [line_chart(f"eval: {name}", [(k, [(_eval_x(r)[1], r[k]) for r in rows if k in r and _eval_x(r)[1]
                                                is not None]) for k in ks], x_label=xkey.replace("eval/", ""))
              for name, ks in groups.items()]
    table = '<table class="kv"><tr><th>' + esc(xkey) + "</th>" + "".join(f"<th>{esc(k)}</th>" for k in keys) + "</tr>"
    for r in rows:
        table += f"<tr><td>{esc(_eval_x(r)[1])}</td>" + "".join(
            f"<td>{esc(fmt(_num(r.get(k))))}</td>" for k in keys) + "</tr>"
    return "<h2>Evaluation</h2><div class=\"charts\">" + "".join(charts) + "</div>" + table + "</table>"


def _incarnations(run: dict) -> str:
    if not run["incarnations"] and not run["history"]:
        return ""
    by_restart: dict[int, list[dict]] = {}
    for h in run["history"]:
        by_restart.setdefault(int(h.get("slurm_restart_count") or 0), []).append(h)
    first_step = {}
    for c in run["consumed"]:
        k = c.get("restart")
        if isinstance(k, int) and isinstance(c.get("step"), int):
            first_step.setdefault(k, c["step"])
    rows = []
    incs = run["incarnations"] or [{"restart": k} for k in sorted(by_restart)]
    for inc in incs:
        k = inc.get("restart", 0)
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(inc["time"])) if _num(inc.get("time")) else "-"
        where = ", ".join(sorted({f"{h.get('role')}@{h.get('slurm_nodename') or h.get('host')}"
                                  for h in by_restart.get(k, [])}))
        rows.append(f"<tr><td>{esc(k)}</td><td>{esc(when)}</td><td>{esc(inc.get('slurm_job_id') or '-')}</td>"
                    f"<td>{esc(first_step.get(k, '-'))}</td><td>{esc(where or '-')}</td></tr>")
    return ("<h2>Incarnations (starts and restarts)</h2><table class=\"kv\"><tr><th>restart</th><th>started</th>"
            "<th>Slurm job</th><th>first trained step</th><th>roles (where)</th></tr>" + "".join(rows) + "</table>")


def _trajectories(run: dict, n_steps: int, per_step: int) -> str:
    from launch import report_episodes
    try:
        return report_episodes.section(Path(run["run_dir"]), run, n_steps, per_step)
    except ImportError as e:  # numpy / safetensors / tokenizers missing on this machine
        return f'<h2>Trajectories</h2><p class="warn">not shown: {esc(e)} (install the cpu extras)</p>'


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    sys.exit(run(ap.parse_args()))
