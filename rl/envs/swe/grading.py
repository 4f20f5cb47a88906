"""Test-log parsers and the reward of one graded run, as the public SWE datasets define them.

A graded run prints a test log; a parser turns it into {test id: status} with the statuses SWE-bench's
harness uses (PASSED, FAILED, ERROR, SKIPPED, XFAIL; pytest's XPASS is kept as XPASS, which the harness
does not count as a pass). Parsers, by the names rows use (SWE-rebench's `install_config.log_parser`
names the harness function; our own short names are aliases of the same code):

- `pytest` = `parse_log_pytest`: the short summary of `pytest -rA`, lines "PASSED tests/t.py::test_a" and
  "FAILED tests/t.py::test_b - AssertionError..." (the " - message" tail is not part of the id; a PASSED line has none: all of it is the id). Given
  the graded ids (`known=`, as the grader passes them), a line naming one of them is read as that id
  whatever it holds (spaces, " - ", "::" or unbalanced brackets inside a parametrization). pytest 9
  reports a failed unittest subTest (or `subtests` fixture subtest) as "SUBFAILED[msg] id - error" after
  the test's own "PASSED id": the test counts as FAILED.
- `pytest_v2` = `parse_log_pytest_v2`: the same after stripping ANSI colour codes (`--color=yes` logs).
- `pytest_verbose`: `pytest -v` progress lines, "tests/t.py::test_a PASSED   [ 50%]" (a skip or xfail
  reason in parentheses after the status).
- `name_status`: one "name: STATUS" per line (ok/pass/fail spellings accepted), for test runners that
  are not pytest, and for harnesses that print their own summary.
- `r2e`: R2E-Gym's view of the `-rA` summary: the id without its file ("TestX.test_a" for
  "tests/t.py::TestX::test_a"), which is how its `expected_output_json` keys tests.

Reward, SWE-bench style (`swebench_reward`): the graded tests are FAIL_TO_PASS (must now pass) and
PASS_TO_PASS (must still pass); a test passes if its status is PASSED or XFAIL, and a test missing from
the log (it did not run, or its file failed to import) fails. Without partial credit the reward is 1 only
when every graded test passes (SWE-bench's "resolved"), else 0; with it, the fraction that pass.
R2E-Gym style (`expected_output_reward`): the log must reproduce the expected status of every test in
`expected_output_json`; without partial credit 1 only on a full match (as R2E-Gym grades), with it the
fraction of expected tests whose status matches.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

STATUSES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
PASSING = ("PASSED", "XFAIL")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_SUMMARY = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (.+)$")
# pytest >= 9 reports unittest subTest and `subtests` failures on lines of their own after the test's
# own line (which then says PASSED): "SUBFAILED[msg] tests/t.py::TestX::test_a - error"
_SUB = re.compile(r"^SUB(FAILED|ERROR)(?:\[(.*)\])? (.+)$")
_VERBOSE = re.compile(r"^(\S+::.+?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)"
                      r"(?: \(.*\))?(?:\s+\[\s*\d+%\])?\s*$")
_NAME_STATUS = re.compile(r"^(.+?):\s+(\w+)\s*$")
_SPELLINGS = {"passed": "PASSED", "pass": "PASSED", "ok": "PASSED", "success": "PASSED",
              "failed": "FAILED", "fail": "FAILED", "failure": "FAILED", "error": "ERROR",
              "skipped": "SKIPPED", "skip": "SKIPPED", "xfail": "XFAIL", "xpass": "XPASS"}


def _test_id(rest: str) -> str | None:
    """The test id at the start of a summary line's remainder: up to the " - message" tail, which may
    itself contain " - ", and never inside a parametrization's brackets."""
    rest = rest.strip()
    if rest.startswith("["):  # "SKIPPED [1] tests/t.py:12: reason" names no test id
        return None
    end = rest.find("[")
    if end >= 0 and "::" in rest[:end] and " " not in rest[:end]:  # parametrized: ends at its "]"
        depth = 0
        for i in range(end, len(rest)):
            depth += {"[": 1, "]": -1}.get(rest[i], 0)
            if depth == 0:
                return rest[: i + 1]
        return rest
    return rest.split(" - ", 1)[0].strip() or None


def _known_id(rest: str, known: set[str]) -> str | None:
    """The graded id a summary line's remainder names: all of it, or what precedes one of its " - "
    (the message tail), whatever the id holds (spaces, unbalanced brackets, " - ", "::")."""
    rest = rest.strip()
    if rest in known:
        return rest
    i = rest.find(" - ")
    while i >= 0:
        if rest[:i] in known:
            return rest[:i]
        i = rest.find(" - ", i + 1)
    return None


def parse_pytest(log: str, known=None) -> dict[str, str]:
    """`pytest -rA` short summary lines -> {id: status}; a later line for the same id wins. With
    `known` (the graded ids), a line naming one of them is matched against it first."""
    out, sub = {}, {}
    ids = set(known or ())
    for line in log.splitlines():
        line = line.rstrip("\r\n")
        m = _SUMMARY.match(line)
        if m and (tid := (ids and _known_id(m.group(2), ids)) or
                  (m.group(2).strip() if m.group(1) == "PASSED" else _test_id(m.group(2)))):
            out[tid] = m.group(1)
        elif (m := _SUB.match(line)) and (tid := _sub_id(line, ids)):
            sub[tid] = m.group(1)
    for tid, status in sub.items():  # a failed subtest fails its test, whatever its own line said
        out[tid] = status
    return out


def _sub_id(line: str, known: set[str]) -> str | None:
    """The test of a SUBFAILED line: a graded id it names (the subtest message in brackets may hold
    anything), else the first "file::name" word after the message."""
    for k in known:
        i = line.find(" " + k)
        while i >= 0:
            end = i + 1 + len(k)
            if line[end:] == "" or line.startswith(" - ", end):
                return k
            i = line.find(" " + k, i + 1)
    m = re.search(r"\] (\S+::\S+)", line) or re.match(r"^SUB\w+ (\S+::\S+)", line)
    return _test_id(m.group(1)) if m else None


def parse_pytest_v2(log: str, known=None) -> dict[str, str]:
    return parse_pytest(_ANSI.sub("", log), known)


def parse_pytest_verbose(log: str, known=None) -> dict[str, str]:
    out = {}
    for line in _ANSI.sub("", log).splitlines():
        m = _VERBOSE.match(line.strip())
        if m:
            out[m.group(1)] = m.group(2)
    return out


def parse_name_status(log: str, known=None) -> dict[str, str]:
    out = {}
    for line in log.splitlines():
        m = _NAME_STATUS.match(line.strip())
        if m and m.group(2).lower() in _SPELLINGS:
            out[m.group(1).strip()] = _SPELLINGS[m.group(2).lower()]
    return out


def parse_r2e(log: str, known=None) -> dict[str, str]:
    """R2E-Gym keys: the part of the pytest id after the file, joined with dots."""
    out = {}
    for tid, status in parse_pytest_v2(log).items():
        if "::" in tid and status in ("PASSED", "FAILED", "ERROR"):
            out[".".join(tid.split("::")[1:])] = status
    return out


PARSERS = {"pytest": parse_pytest, "parse_log_pytest": parse_pytest,
           "pytest_v2": parse_pytest_v2, "parse_log_pytest_v2": parse_pytest_v2,
           "pytest_verbose": parse_pytest_verbose, "name_status": parse_name_status, "r2e": parse_r2e}


def parser(name: str):
    """The parser called `name`; a ValueError naming the known ones otherwise."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown log parser {name!r} (known: {', '.join(sorted(PARSERS))})") from None


@dataclass(frozen=True)
class Grade:
    """`grading_error`: why the grade cannot be trusted ("" when it can): pytest never started, none of
    the graded tests ran, graded ids found nowhere (pytest_report.grading_error); the reward stands as
    computed (0 for what did not run). `install_s`: seconds spent installing the tree's metadata."""
    reward: float
    passed: list[str]
    failed: list[str]
    output: str
    grading_error: str = ""
    install_s: float = 0.0


def swebench_reward(status: dict[str, str], fail_to_pass: list[str], pass_to_pass: list[str], *,
                    partial_credit: bool, output: str = "") -> Grade:
    graded = list(dict.fromkeys(fail_to_pass + pass_to_pass))  # a name in both lists is one test
    passed = [t for t in graded if status.get(t) in PASSING]
    failed = [t for t in graded if status.get(t) not in PASSING]
    if partial_credit:
        reward = len(passed) / len(graded) if graded else 0.0
    else:
        reward = 1.0 if graded and not failed else 0.0
    return Grade(reward, passed, failed, output)


def expected_output_reward(status: dict[str, str], expected: dict[str, str], *, partial_credit: bool,
                           output: str = "") -> Grade:
    """R2E-Gym: every expected test must show its expected status. Keys are compared without the
    " - message" tail R2E-Gym's own parser sometimes leaves in them."""
    def norm(d):
        return {_ANSI.sub("", k).split(" - ")[0]: v for k, v in d.items()}
    got, want = norm(status), norm(expected)
    passed = [t for t in want if got.get(t) == want[t]]
    failed = [t for t in want if got.get(t) != want[t]]
    if partial_credit:
        reward = len(passed) / len(want) if want else 0.0
    else:
        reward = 1.0 if want and not failed else 0.0
    return Grade(reward, passed, failed, output)
