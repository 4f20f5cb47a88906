"""Our pytest plugin and the bootstrap that installs the tree before pytest starts; runs INSIDE the sandbox.

Standalone on purpose (no import of hetrl: the checkout is not in the sandbox). The host
(rl/envs/swe/pytest_report.py) passes this file's text and a spec in HETRL_PYTEST_SPEC; `python -c BOOT`
writes it as `_hetrl_report.py` into a fresh directory of the sandbox's private /tmp (outside the graded
tree, on sys.path and PYTHONPATH so that `-p _hetrl_report` imports it in any process, xdist workers
included) and calls `main`, which:

1. installs the tree's metadata there (`<name>-<version>.dist-info` with METADATA and entry_points.txt:
   pytest's plugin autoload registers a plugin repository's own plugin, importlib.metadata finds its
   version), never into the node's environment; and writes the version files a build backend generates
   (setuptools-scm / hatch-vcs `_version.py`, a pretend version) into the tree when it lacks them;
2. runs pytest with `-p _hetrl_report` last on the command line (after the repository's addopts, so an
   addopts `-p no:...` cannot block it), which writes one JSON line per report to the results file:
   test phases (subtests included, marked "sub"), collection errors, deselected items, the start and end
   of the session. Terminal output, colours, verbosity and capture change nothing in it.

PYTEST_DONT_REWRITE: it is imported before pytest starts, so pytest must not try to rewrite it (its
warning would be an error under a repository's `filterwarnings = error`).
"""
import json
import os
import sys

_OUT = None
_CONFIG = None
REPORT_PATH = None


def _emit(rec):
    if _OUT is not None:
        _OUT.write(json.dumps(rec) + "\n")
        _OUT.flush()


def _id(nodeid):
    try:  # as pytest's own summary names it: relative to where pytest was started
        return _CONFIG.cwd_relative_nodeid(nodeid)
    except Exception:
        return nodeid


def _msg(report):
    text = str(getattr(report, "longrepr", "") or "")
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    pick = [x for x in lines if x.startswith("E ")] or lines
    return (pick[-1] if pick else "")[:500]


def pytest_configure(config):
    global _OUT, _CONFIG
    if hasattr(config, "workerinput") or _OUT is not None or not REPORT_PATH:
        return  # an xdist worker (its controller records) or an inner run (pytester)
    _CONFIG = config
    _OUT = open(REPORT_PATH, "a")
    root = getattr(config, "rootpath", None) or getattr(config, "rootdir", "")
    _emit({"ev": "start", "rootdir": str(root)})


def pytest_collectreport(report):
    if _OUT is not None and report.failed:
        _emit({"ev": "collect", "id": _id(report.nodeid), "msg": _msg(report)})


def pytest_deselected(items):
    for item in items:
        _emit({"ev": "deselected", "id": _id(item.nodeid)})


def pytest_collection_finish(session):
    _emit({"ev": "collected", "n": len(session.items)})


def pytest_runtest_logreport(report):
    if _OUT is None:
        return
    sub = getattr(report, "context", None) is not None or "subtest" in type(report).__name__.lower()
    rec = {"ev": "test", "id": _id(report.nodeid), "when": report.when, "outcome": report.outcome,
           "xfail": hasattr(report, "wasxfail"), "sub": sub}
    if report.failed:
        rec["msg"] = _msg(report)
    _emit(rec)


def pytest_sessionfinish(session, exitstatus):
    _emit({"ev": "finish", "exit": int(exitstatus)})


# -- installing the tree's metadata, then running pytest --------------------------------------------------
def _install(spec, site):
    for d in spec.get("dists", ()):
        name = d["name"].replace("-", "_").replace(".", "_")
        di = os.path.join(site, "%s-%s.dist-info" % (name, d["version"]))
        os.mkdir(di)
        with open(os.path.join(di, "METADATA"), "w") as f:
            f.write("Metadata-Version: 2.1\nName: %s\nVersion: %s\n" % (d["name"], d["version"]))
        if d.get("entry_points"):
            with open(os.path.join(di, "entry_points.txt"), "w") as f:
                f.write(d["entry_points"])
        with open(os.path.join(di, "INSTALLER"), "w") as f:
            f.write("hetrl\n")
        open(os.path.join(di, "RECORD"), "w").close()
    for vf in spec.get("version_files", ()):
        rel = vf["path"]
        if os.path.lexists(rel):
            continue  # the tree has its own: the tree's code wins
        parent = os.path.dirname(rel)
        if parent:
            os.makedirs(parent, exist_ok=True)
        with open(rel, "x") as f:
            f.write(vf["text"])


def main(spec, site, args):
    global REPORT_PATH
    if sys.path and sys.path[0] in ("", "."):
        sys.path[0] = os.getcwd()  # as `python -m pytest` has it: the root by its absolute path
    REPORT_PATH = os.path.abspath(spec["report"])
    _install(spec, site)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), site) if p)
    if site not in sys.path:
        sys.path.insert(1, site)
    import pytest
    return pytest.main(list(args) + ["-p", "_hetrl_report"])
