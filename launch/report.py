"""`python -m launch report RUN_DIR [--out FILE]`: one self-contained HTML page about a run.

Everything comes from the run directory alone, so the page can be made for a run that is still going,
for a finished one copied off the cluster, and for a Slurm run as for a local one:

- `metrics.jsonl` (one line per trainer step, the orchestrator's numbers under `orchestrator/`, evaluation
  rows under `eval/`): reward, evaluation results per policy version, mismatch KL, lag, throughput of
  the trainer and of the inference servers (a chart each: one axis per scale), trainer and inference
  idle time, dropped, cancelled, failed and masked work, batches set aside and updates skipped, and
  step times on a robust axis (a start-up wait sits on the top edge instead of setting the scale);
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

Everything in a run directory may have been written by someone else (a shared filesystem, a copied
run), and the page is opened in a browser, so nothing read is trusted. Every value printed is escaped,
config.yaml's included (`trainer.max_steps: "<script>..."` must come out as text); long texts are cut
with a visible marker and the trajectory view stops at a page budget, so a million-token prompt makes a
page of bounded size. Each record is checked for the fields the page uses before it is used: a line of
a JSONL file that is not a JSON object or has a field of the wrong type is skipped, a JSON record that
does not parse, a FIFO or a symlink in a record's place is not read, and each such record is named in
one line (file, and line for JSONL) on stderr and in a "Records not read" list at the top of the page,
never a traceback. The page itself is written with rl.contract.safefs.write_atomic: a fresh temp name
beside it, no link followed on the way, and an existing `report.html` that is a link (planted to make
the report overwrite `~/.ssh/authorized_keys`) is refused, not written through.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from launch.report_svg import clip, esc, fmt, line_chart, page
from launch.report_svg import finite as _num  # a finite float, or None
from rl.contract import paths, safefs
from rl.contract.config import ConfigError
from rl.doctor.args import count  # the one integer-range argparse type (standard library only)

STEPS_SHOWN = 8          # steps of the trajectory view (first, last and evenly between)
EPISODES_PER_STEP = 4    # per step: the best, the worst and others of distinct groups
MAX_EPISODE_TOKENS = 6000  # beyond this an episode shows its head and tail
MAX_TEXT = 200           # characters of a config value or record field printed in a table cell
MAX_EVAL_KEYS = 200      # eval/... keys charted and tabled (a hostile row may carry thousands)
MAX_NOTES = 50           # records-not-read lines listed on the page
_RECORD_LIMIT = 16 << 20  # a JSON record or config.yaml larger than this is not read


def add_arguments(s) -> None:
    s.add_argument("run_dir")
    s.add_argument("--out", default=None, help="the HTML file to write (default: RUN_DIR/report.html)")
    s.add_argument("--steps", type=count(0, 1000), default=STEPS_SHOWN,
                   help="steps in the trajectory view (0: none)")
    s.add_argument("--episodes", type=count(1, 100), default=EPISODES_PER_STEP, help="episodes shown per step")


def run(ns) -> int:
    run_dir = safefs.resolve_run_dir(ns.run_dir)
    out = Path(os.path.abspath(ns.out)) if ns.out else run_dir / "report.html"
    try:  # before the work: a link on the way to --out is refused now, not after rendering
        safefs.check_path(out.parent, kind="dir")
        safefs.check_path(out, kind="file")
    except safefs.UnsafePath as e:
        print(f"error: --out: {e}", file=sys.stderr)
        return 1
    notes: list[str] = []
    html = render(run_dir, steps=ns.steps, episodes=ns.episodes, notes=notes)
    for n in notes[:MAX_NOTES]:
        print(f"report: {n}", file=sys.stderr)
    if len(notes) > MAX_NOTES:
        print(f"report: ... and {len(notes) - MAX_NOTES} more records not read", file=sys.stderr)
    try:
        safefs.write_atomic(out, html.encode())
    except safefs.UnsafePath as e:  # planted between the check above and now
        print(f"error: --out: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({len(html) / 1024:.0f} KiB)")
    return 0


# -- reading the run directory ---------------------------------------------------------------------------
def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _field(r: dict, key: str, ok, what: str, required: bool = False) -> str | None:
    if key not in r:
        return f"no {key!r}" if required else None
    return None if ok(r[key]) else f"{key}={clip(repr(r[key]), 60)} is not {what}"


def _step_ok(v) -> bool:
    return _int(v) and v >= 0


def _opt_str(v) -> bool:
    return v is None or isinstance(v, str)


# what the page uses of each record; None when the record is usable, else why not
def _metrics_check(r: dict) -> str | None:
    return (_field(r, "step", _step_ok, "a step number")
            or _field(r, "time", lambda v: _num(v) is not None, "a time"))


def _consumed_check(r: dict) -> str | None:
    return (_field(r, "step", _step_ok, "a step number", required=True)
            or _field(r, "restart", _step_ok, "a restart count")
            or _field(r, "time", lambda v: _num(v) is not None, "a time"))


def _history_check(r: dict) -> str | None:
    return (_field(r, "role", lambda v: isinstance(v, str), "a role name", required=True)
            or _field(r, "slurm_restart_count", lambda v: v is None or _step_ok(v), "a restart count")
            or _field(r, "host", _opt_str, "a host name")
            or _field(r, "slurm_nodename", _opt_str, "a node name"))


def _groups_check(r: dict) -> str | None:
    return _field(r, "event", lambda v: isinstance(v, str), "an event name")


def _incarnation_check(r: dict) -> str | None:
    return (_field(r, "restart", _step_ok, "a restart count", required=True)
            or _field(r, "time", lambda v: _num(v) is not None and v >= 0, "a time")
            or _field(r, "slurm_job_id", lambda v: v is None or isinstance(v, str) or _int(v), "a job id"))


class _Skipped(logging.Handler):
    """Collects the one-line 'file:line: record skipped (reason)' of rl.exchange.jsonl's readers."""

    def __init__(self, notes: list[str]):
        super().__init__(logging.WARNING)
        self.notes = notes

    def emit(self, record: logging.LogRecord) -> None:
        self.notes.append(record.getMessage())


def _unreadable(p: Path, e: OSError) -> str:
    said = str(e) if isinstance(e, safefs.UnsafePath) else f"{p}: {e.strerror or e}"  # the former names p
    return f"{said} (not read)"


def _jsonl(p: Path, check, notes: list[str]) -> list[dict]:
    from rl.exchange.jsonl import read_jsonl  # torch-free; skips a torn last line
    try:
        return read_jsonl(p, check)
    except OSError as e:  # UnsafePath (a link, a FIFO) or unreadable
        notes.append(_unreadable(p, e))
        return []


def _json(p: Path, check, notes: list[str]) -> dict | None:
    try:
        obj = json.loads(safefs.read_bytes(p, limit=_RECORD_LIMIT))
    except FileNotFoundError:
        return None
    except OSError as e:
        notes.append(_unreadable(p, e))
        return None
    except (ValueError, UnicodeDecodeError) as e:
        notes.append(f"{p}: not read (not JSON: {clip(e, 120)})")
        return None
    why = f"a JSON {type(obj).__name__}, not an object" if not isinstance(obj, dict) else check(obj)
    if why:
        notes.append(f"{p}: not read ({why})")
        return None
    return obj


def _config(run_dir: Path, notes: list[str]) -> dict:
    import yaml
    cfg_file = paths.config_file(run_dir)
    try:
        text = safefs.read_text(cfg_file, limit=_RECORD_LIMIT)
    except FileNotFoundError:
        raise ConfigError(f"{cfg_file}: not found (is {run_dir} a run directory?)") from None
    except OSError as e:
        notes.append(_unreadable(cfg_file, e))
        return {}
    except UnicodeDecodeError:
        notes.append(f"{cfg_file}: not read (not UTF-8)")
        return {}
    try:
        cfg = yaml.safe_load(text)
    except yaml.YAMLError as e:
        notes.append(f"{cfg_file}: not read (not YAML: {' '.join(str(e).split())[:200]})")
        return {}
    if not isinstance(cfg, dict):
        notes.append(f"{cfg_file}: not read (a YAML {type(cfg).__name__}, not a mapping)")
        return {}
    return cfg


def _get(cfg, *keys):
    """cfg[k1][k2]... or None where a level is missing or not a mapping (a hand-edited config.yaml)."""
    for k in keys:
        if not isinstance(cfg, dict):
            return None
        cfg = cfg.get(k)
    return cfg


def read_run(run_dir, notes: list[str] | None = None) -> dict:
    """What the page shows, as plain data (also what the tests check). Every record that could not be
    read or was skipped is named in one line in `notes` (and in the result's "notes")."""
    from rl.contract.records import RecordError, ResumeState, read_optional
    run_dir = Path(run_dir).absolute()
    notes = [] if notes is None else notes
    skipped = _Skipped(notes)
    logger = logging.getLogger("hetrl.records")
    logger.addHandler(skipped)
    try:
        cfg = _config(run_dir, notes)
        metrics = _jsonl(paths.metrics_file(run_dir), _metrics_check, notes)
        consumed = _jsonl(paths.consumed_log(run_dir, paths.ROLLOUTS), _consumed_check, notes)
        history = _jsonl(paths.role_history(run_dir), _history_check, notes)
        groups = _jsonl(run_dir / paths.ROLLOUTS / "groups.jsonl", _groups_check, notes)
        slurm_jobs = _jsonl(run_dir / paths.SLURM_JOBS, lambda r: None, notes)
    finally:
        logger.removeHandler(skipped)
    # a trainer step's line may carry the evaluation results that finished meanwhile, and an evaluation
    # that finished after the last step has a line of its own: split by key, not by line
    train = [m for m in metrics if any(not k.startswith("eval/") and k not in ("step", "time") for k in m)]
    evals = [m for m in metrics if any(k.startswith("eval/") for k in m)]
    inc_dir = run_dir / "incarnations"
    names = sorted(e.name for e in os.scandir(inc_dir) if e.name.startswith("restart_")
                   and e.name.endswith(".json")) if inc_dir.is_dir() and not inc_dir.is_symlink() else []
    incarnations = sorted((r for r in (_json(inc_dir / n, _incarnation_check, notes) for n in names) if r),
                          key=lambda r: r["restart"])
    try:
        resume = read_optional(ResumeState, paths.resume_file(run_dir))
    except RecordError as e:  # its message names the file
        notes.append(f"{e} (not read)")
        resume = None
    except OSError as e:
        notes.append(_unreadable(paths.resume_file(run_dir), e))
        resume = None
    return {"run_dir": str(run_dir), "cfg": cfg, "metrics": train, "evals": evals, "consumed": consumed,
            "incarnations": incarnations, "history": history, "groups": groups, "slurm_jobs": slurm_jobs,
            "resume": None if resume is None else {"restart": resume.restart},
            "done": os.path.lexists(paths.done_file(run_dir)), "notes": notes}


def restart_markers(run: dict) -> list[tuple[float, str]]:
    """(first step trained by incarnation k, label) for every k > 0: where the run restarted."""
    seen, out = set(), []
    for c in sorted(run["consumed"], key=lambda c: _num(c.get("time")) or 0.0):
        k = c.get("restart")
        if isinstance(k, int) and k > 0 and k not in seen:
            seen.add(k)
            out.append((c["step"], f"restart {k}: resumed, first trained step {c['step']}"))
    return out


# -- the page -------------------------------------------------------------------------------------------
def render(run_dir, *, steps: int = STEPS_SHOWN, episodes: int = EPISODES_PER_STEP,
           notes: list[str] | None = None) -> str:
    """The page. Records that could not be read are appended to `notes` (one line each) and listed on it."""
    notes = [] if notes is None else notes
    run = read_run(run_dir, notes)
    cfg, ms = run["cfg"], run["metrics"]
    title = f"hetrl report: {Path(run['run_dir']).name}"
    sub = (f"{run['run_dir']} | experiment {_text(_get(cfg, 'experiment'))} | "
           f"{_text(_get(cfg, 'cluster', 'backend'))} | model {_text(_get(cfg, 'model', 'name'))} "
           f"({_text(_get(cfg, 'model', 'family'))}) | env {_text(_get(cfg, 'env', 'name'))} | "
           f"made {time.strftime('%Y-%m-%d %H:%M')}")
    body = [_summary(run), _charts(run), _evals(run), _incarnations(run), _trajectories(run, steps, episodes)]
    if not ms:
        body.insert(1, '<p class="warn">metrics.jsonl has no trainer steps yet.</p>')
    if notes:  # after the trajectories, which add the batches they could not read
        body.insert(0, _not_read(notes))
    return page(title, sub, "".join(body))


def _text(v) -> str:
    """A value read from the run directory, as text for a page: cut to MAX_TEXT characters (the caller
    escapes it)."""
    return clip("-" if v is None else v, MAX_TEXT)


def _not_read(notes: list[str]) -> str:
    items = "".join(f"<li>{esc(clip(n, 400))}</li>" for n in notes[:MAX_NOTES])
    more = f"<li>... and {len(notes) - MAX_NOTES} more</li>" if len(notes) > MAX_NOTES else ""
    return (f'<h2>Records not read</h2><p class="warn">{len(notes)} record(s) of this run directory were '
            f"skipped or could not be read; the page shows the rest.</p><ul class=\"warn\">{items}{more}</ul>")


def _kv(rows) -> str:
    """A two-column table; every cell is text, escaped here (values come from files anyone could edit)."""
    return '<table class="kv">' + "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in rows) + "</table>"


def _series(rows: list[dict], key: str, x: str = "step") -> list[tuple[float, float]]:
    return [(_num(r[x]), _num(r[key])) for r in rows if key in r and _num(r.get(x)) is not None
            and _num(r[key]) is not None]


def _summary(run: dict) -> str:
    cfg, ms = run["cfg"], run["metrics"]
    steps = len({m["step"] for m in ms if "step" in m})
    last = ms[-1] if ms else {}
    times = [_num(m.get("time")) for m in ms if _num(m.get("time")) is not None]
    restarts = (run["resume"] or {}).get("restart")
    dropped = sum(1 for g in run["groups"] if g.get("event") == "drop")
    first4, last4 = ([_num(m.get("reward_mean")) for m in part if _num(m.get("reward_mean")) is not None]
                     for part in (ms[:4], ms[-4:]))
    rows = [("status", "finished (DONE)" if run["done"] else "not finished (no DONE)"),
            ("steps trained", f"{steps} of {_text(_get(cfg, 'trainer', 'max_steps'))}"),
            ("reward, last step", fmt(_num(last.get("reward_mean")))),
            ("reward, mean of first / last 4 steps",
             " / ".join(fmt(sum(v) / len(v)) if v else "-" for v in (first4, last4))),
            ("wall time of the logged steps",
             f"{(max(times) / 2 - min(times) / 2) / 30:.1f} min" if len(times) > 1 else "-"),
            ("restarts", "-" if restarts is None else restarts),
            ("groups dropped (groups.jsonl)",
             f"{dropped} of {sum(1 for g in run['groups'] if g.get('event') == 'start')} started"),
            ("async", f"max_off_policy {_text(_get(cfg, 'orchestrator', 'max_off_policy'))}, schedule "
                      f"{_text(_get(cfg, 'orchestrator', 'schedule'))}, stale_policy "
                      f"{_text(_get(cfg, 'orchestrator', 'stale_policy'))}"),
            ("evaluation rows", len(run["evals"]))]
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
        # two charts, not one: the trainer's thousands of tokens/s would flatten the servers' tens
        ("Trainer throughput", [("trainer tokens/s", _series(ms, "tokens_per_s"))], "tokens/s",
         "tokens trained per second of the trainer's step"),
        ("Inference throughput", [("inference gen tokens/s", _series(ms, o + "gen_tokens_per_s"))], "tokens/s",
         "completion tokens the servers generated per second (own axis: a different scale from the trainer's)"),
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
                       [(c["step"], c["restart"]) for c in run["consumed"] if "restart" in c])],
         "restart count", "dashed lines in every chart: the first step a restarted incarnation trained"),
        ("Step time", [("train step s", _series(ms, "step_time_s")), ("wait for batch s", _series(ms, "wait_s")),
                       ("publish s", _series(ms, "publish_s"))], "seconds",
         "robust y axis: a start-up wait far above the other steps (step 0: model load and the servers' first "
         "start; a restart's first step) sits on the top edge instead of setting the scale"),
    ]
    robust = {"Step time"}
    if any(o + "turns_per_episode" in m for m in ms):
        charts.append(("Episodes (multi-turn)", [("turns/episode", _series(ms, o + "turns_per_episode")),
                                                 ("tool calls", _series(ms, o + "tool_calls")),
                                                 ("tool error rate", _series(ms, o + "tool_error_rate"))], "", ""))
    return "<h2>Over steps</h2><div class=\"charts\">" + "".join(
        line_chart(t, s, y_label=y, markers=mk, note=n, robust=t in robust) for t, s, y, n in charts) + "</div>"


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
    more = len(keys) - MAX_EVAL_KEYS
    keys = keys[:MAX_EVAL_KEYS]
    xkey = _eval_x(rows[0])[0] or "step"
    groups: dict[str, list[str]] = {}
    for k in keys:  # one chart per metric name (eval/<set>/<metric> of several sets share one)
        if k.rsplit("/", 1)[-1] not in _EVAL_BOOKKEEPING:
            groups.setdefault(k.rsplit("/", 1)[-1], []).append(k)
    charts = [line_chart(f"eval: {name}", [(k, [(_eval_x(r)[1], _num(r[k])) for r in rows if k in r
                                                and _eval_x(r)[1] is not None]) for k in ks],
                         x_label=xkey.replace("eval/", ""))
              for name, ks in groups.items()]
    table = ('<table class="kv"><tr><th>' + esc(xkey) + "</th>"
             + "".join(f"<th>{esc(clip(k, 60))}</th>" for k in keys) + "</tr>")
    for r in rows:
        table += f"<tr><td>{esc(fmt(_num(_eval_x(r)[1])))}</td>" + "".join(
            f"<td>{esc(fmt(_num(r.get(k))))}</td>" for k in keys) + "</tr>"
    extra = f'<p class="warn">{more} more eval/... keys not shown</p>' if more > 0 else ""
    return "<h2>Evaluation</h2><div class=\"charts\">" + "".join(charts) + "</div>" + table + "</table>" + extra


def _incarnations(run: dict) -> str:
    if not run["incarnations"] and not run["history"]:
        return ""
    by_restart: dict[int, list[dict]] = {}
    for h in run["history"]:
        by_restart.setdefault(h.get("slurm_restart_count") or 0, []).append(h)
    first_step = {}
    for c in run["consumed"]:
        if "restart" in c:
            first_step.setdefault(c["restart"], c["step"])
    rows = []
    incs = run["incarnations"] or [{"restart": k} for k in sorted(by_restart)]
    for inc in incs:
        k = inc["restart"]
        rows.append(f"<tr><td>{esc(k)}</td><td>{esc(_when(inc.get('time')))}</td>"
                    f"<td>{esc(_text(inc.get('slurm_job_id') or '-'))}</td><td>{esc(first_step.get(k, '-'))}</td>"
                    f"<td>{esc(_where(by_restart.get(k, [])))}</td></tr>")
    return ("<h2>Incarnations (starts and restarts)</h2><table class=\"kv\"><tr><th>restart</th><th>started</th>"
            "<th>Slurm job</th><th>first trained step</th><th>roles (where)</th></tr>" + "".join(rows) + "</table>")


def _when(t) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if _num(t) is not None else "-"
    except (OverflowError, OSError, ValueError):  # a time past what the C library represents
        return clip(repr(t), 40)


def _where(history: list[dict]) -> str:
    places = sorted({f"{h['role']}@{h.get('slurm_nodename') or h.get('host')}" for h in history})
    return clip(", ".join(places), 2000) if places else "-"


def _trajectories(run: dict, n_steps: int, per_step: int) -> str:
    from launch import report_episodes
    if n_steps == 0:
        return "<h2>Trajectories</h2><p>not shown (--steps 0)</p>"
    try:
        return report_episodes.section(Path(run["run_dir"]), run, n_steps, per_step, MAX_EPISODE_TOKENS,
                                       notes=run["notes"])
    except ImportError as e:  # numpy / safetensors / tokenizers missing on this machine
        return f'<h2>Trajectories</h2><p class="warn">not shown: {esc(e)} (install the cpu extras)</p>'


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    sys.exit(run(ap.parse_args()))
