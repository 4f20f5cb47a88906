"""Per-test outcomes from pytest's own structured report, not its terminal text (issue 51).

`command(targets, roots, install)` is the argv and environment of one pytest run in a sandbox: `python -c
BOOT` bootstraps our plugin (rl/envs/swe/_pytest_plugin.py) from a private directory of the sandbox's
/tmp (outside the graded tree), installs the tree's metadata there, and runs pytest with `-p
_hetrl_report` last on the command line, after the repository's addopts. The plugin writes one JSON line
per report (`pytest_runtest_logreport`, subtests included; collection errors; deselected items) to a
results file in the tree's root under a random name; `collect(sb, rel)` reads it back through the runtime
(no link followed), removes it and folds it into a `Report`:

- a test's status from its phases: setup failed -> ERROR, skipped -> SKIPPED (XFAIL when xfailed); call
  passed -> PASSED (XPASS when it was an xfail), failed -> FAILED, skipped -> SKIPPED / XFAIL; a failed
  teardown -> ERROR; any failed subtest (pytest's `subtests`, unittest's `self.subTest`) -> FAILED;
- ids as pytest's summary names them (relative to where pytest started: the tree's root).
Colours (`--color=yes`), `-q`/`-v`, capture and `-p no:...` in addopts change nothing of it.
"""
from __future__ import annotations

import json
import os
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path

PLUGIN_SOURCE = Path(__file__).with_name("_pytest_plugin.py").read_text()
# `python -c BOOT`: write the plugin as a module of a fresh private directory, import it, run pytest
BOOT = ("import json,os,sys,tempfile\n"
        "s=json.loads(os.environ.pop('HETRL_PYTEST_SPEC'))\n"
        "d=tempfile.mkdtemp(prefix='hetrl-site-')\n"
        "f=open(os.path.join(d,'_hetrl_report.py'),'w');f.write(s.pop('plugin'));f.close()\n"
        "sys.path.insert(1,d)\n"
        "import _hetrl_report\n"
        "sys.exit(_hetrl_report.main(s,d,sys.argv[1:]))\n")
# Only what changes how results are printed (the log the agent reads): a summary line per test.
OUTPUT_ARGS = ["-rA", "-q", "--tb=short", "--no-header"]
PASSING = ("PASSED", "XFAIL")


@dataclass
class Report:
    """What pytest recorded. `started`: the session began (the plugin was configured); `finished`: it
    ended normally (not killed); `collect_errors`: {collector id (a file): message}."""
    outcomes: dict[str, str] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)
    collect_errors: dict[str, str] = field(default_factory=dict)
    deselected: set[str] = field(default_factory=set)
    collected: int | None = None
    started: bool = False
    finished: bool = False
    exit: int | None = None


def report_name() -> str:
    return f".hetrl-pytest-{secrets.token_hex(8)}.jsonl"


def command(targets: list[str], roots: list[str] | None, install: dict | None, report: str,
            python: str = sys.executable) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of one pytest run over `targets` writing its results to tree/`report`."""
    for t in targets:  # pytest has no `--` end of options: a target must not look like one
        if not isinstance(t, str) or not t or t.startswith("-"):
            raise ValueError(f"pytest target {str(t)[:80]!r}: empty or starts with '-' (it would read as an "
                             "option)")
    spec = {"plugin": PLUGIN_SOURCE, "report": report, **(install or {})}
    env = {"HETRL_PYTEST_SPEC": json.dumps(spec)}
    if roots is not None:
        env["PYTHONPATH"] = os.pathsep.join(r or "." for r in roots)
    return [python, "-c", BOOT, *OUTPUT_ARGS, *targets], env


def fold(lines: list[str]) -> Report:
    """The Report of a results file's lines (a torn last line, from a killed run, is skipped)."""
    rep = Report()
    sub_failed: dict[str, str] = {}
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        ev = rec.get("ev")
        if ev == "start":
            rep.started = True
        elif ev == "finish":
            rep.finished, rep.exit = True, rec.get("exit")
        elif ev == "collected":
            rep.collected = rec.get("n")
        elif ev == "deselected":
            rep.deselected.add(rec["id"])
        elif ev == "collect":
            rep.collect_errors[rec["id"]] = rec.get("msg", "")
        elif ev == "test":
            tid, when, outcome, xfail = rec["id"], rec.get("when"), rec.get("outcome"), rec.get("xfail")
            if rec.get("sub"):
                if outcome == "failed":
                    sub_failed[tid] = rec.get("msg", "")
                continue
            status = None
            if outcome == "failed":
                status = "FAILED" if when == "call" else "ERROR"
            elif outcome == "skipped" and when in ("setup", "call"):
                status = "XFAIL" if xfail else "SKIPPED"
            elif outcome == "passed" and when == "call":
                status = "XPASS" if xfail else "PASSED"
            if status is None or rep.outcomes.get(tid) in ("ERROR", "FAILED"):
                continue  # a passed setup or teardown says nothing; an earlier failure stands
            rep.outcomes[tid] = status
            if rec.get("msg"):
                rep.messages[tid] = rec["msg"]
    for tid, msg in sub_failed.items():  # a failed subtest fails its test, whatever its own report said
        if rep.outcomes.get(tid) in PASSING or tid not in rep.outcomes:
            rep.outcomes[tid] = "FAILED"
            rep.messages.setdefault(tid, f"subtest failed: {msg}")
    return rep


def collect(sb, rel: str) -> Report:
    """Read tree/`rel` through the runtime (never through a link), remove it, fold it."""
    try:
        text = sb.read_file(rel)
    except OSError:
        text = None
    try:
        os.unlink(os.path.join(sb.tree, rel))
    except OSError:
        pass
    return fold((text or "").splitlines())


def summary(rep: Report, limit: int = 200) -> str:
    """The outcomes the grader uses, for the agent's run_tests: counts, then every test that did not
    pass (as `STATUS id - message` lines)."""
    if not rep.started:
        return "[outcomes: pytest did not start]"
    counts: dict[str, int] = {}
    for s in rep.outcomes.values():
        counts[s] = counts.get(s, 0) + 1
    head = ", ".join(f"{n} {s.lower()}" for s, n in sorted(counts.items())) or "no tests ran"
    lines = [f"[outcomes, as graded: {head}]"]
    bad = [(t, s) for t, s in rep.outcomes.items() if s not in PASSING and s != "SKIPPED"]
    for t, s in bad[:limit]:
        msg = rep.messages.get(t, "")
        lines.append(f"{s} {t}" + (f" - {msg}" if msg else ""))
    if len(bad) > limit:
        lines.append(f"... {len(bad) - limit} more")
    for f, msg in list(rep.collect_errors.items())[:20]:
        lines.append(f"ERROR collecting {f} - {msg}")
    return "\n".join(lines)


def is_doctest(test_id: str) -> bool:
    """A doctest id (`pkg/mod.py::pkg.mod.f`, `README.rst::README.rst`): one name after the file, dotted,
    where a test function's or class's name never holds a dot (a parametrization's brackets may)."""
    if "::" not in test_id:
        return False
    name = test_id.split("::", 1)[1].split("[", 1)[0]
    return "::" not in name and "." in name


def grading_error(rep: Report, graded: list[str], output: str, timed_out: bool) -> str:
    """Why a grading cannot be trusted, "" when it can: pytest never started (a conftest or plugin that
    cannot be imported, a usage error), none of the graded tests ran (collection errors: the package or
    the test modules cannot be imported; ids that name nothing), or some graded ids were found nowhere
    (never collected, or deselected by the repository's configuration) in a run that ended normally."""
    graded = list(dict.fromkeys(graded))
    tail = next((x.strip() for x in reversed(output.splitlines()) if x.strip()), "")[:300]
    if not rep.started:
        return f"pytest did not start: {tail or 'no output'}" + (" (timed out)" if timed_out else "")
    files = {t.split("::", 1)[0] for t in graded}
    errs = {f: m for f, m in rep.collect_errors.items() if f.split("::", 1)[0] in files or f in ("", ".")}
    ran = [t for t in graded if t in rep.outcomes]
    if not ran:
        why = "; ".join(f"{f or '.'}: {m}" for f, m in list(errs.items())[:3]) or \
            ("timed out" if timed_out else f"{rep.collected or 0} tests collected, none of them graded")
        return f"none of the {len(graded)} graded tests ran: {why}"
    if timed_out or not rep.finished:
        return ""
    desel = [t for t in graded if t in rep.deselected]
    if desel:
        return f"{len(desel)} graded tests deselected by the repository's configuration: {', '.join(desel[:3])}"
    nowhere = [t for t in graded if t not in rep.outcomes and t.split("::", 1)[0] not in errs]
    if nowhere:
        return f"{len(nowhere)} graded test ids found nowhere: {', '.join(nowhere[:3])}"
    return ""


def with_collect_errors(rep: Report, graded: list[str]) -> dict[str, str]:
    """The outcomes, with every graded test of a file that failed to collect as ERROR (what pytest
    recorded for it: an error, not an absence)."""
    out = dict(rep.outcomes)
    for t in graded:
        f = t.split("::", 1)[0]
        if t not in out and f in rep.collect_errors:
            out[t] = "ERROR"
    return out
