"""No module of rl/ or launch/ is over 500 lines of code: a module that size does several jobs, and the
next change to one of them means reading all of them (issue 23).

The count: every line that is not blank and not a comment-only line (its first non-blank character is
`#`). Docstrings count: a module's prose is part of what a reader has to get through, and the rule stays
one a reader can apply with grep (`grep -cvE '^\\s*(#.*)?$' FILE`). Task data (modules under
rl/envs/*/data/, rows of tasks written as Python literals) is exempt: it is data, not code.
"""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("rl", "launch")
LIMIT = 500
_CODE = re.compile(r"^\s*(#.*)?$")    # what does NOT count: blank or comment-only

# Modules allowed over LIMIT for now, each with why and until when. Keep it empty; an entry is a debt.
TEMPORARY_ALLOWLIST: dict[str, str] = {}


def lines_of_code(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if not _CODE.match(line))


def exempt(rel: Path) -> bool:
    """rl/envs/<env>/data/...: task data."""
    parts = rel.parts
    return len(parts) >= 5 and parts[:2] == ("rl", "envs") and parts[3] == "data"


def modules() -> list[Path]:
    out = []
    for root in ROOTS:
        for p in sorted((REPO / root).rglob("*.py")):
            if "__pycache__" in p.parts:
                continue
            out.append(p.relative_to(REPO))
    return out


def test_no_module_over_500_lines_of_code():
    over = []
    for rel in modules():
        if exempt(rel) or rel.as_posix() in TEMPORARY_ALLOWLIST:
            continue
        n = lines_of_code(REPO / rel)
        if n > LIMIT:
            over.append(f"{rel}: {n} lines of code")
    assert not over, (f"modules over {LIMIT} lines of code (split them along their seams):\n"
                      + "\n".join(over))


def test_the_allowlist_holds_only_modules_still_over():
    # an entry for a module that shrank (or went away) is removed, so the list never hides a new one
    stale = [m for m in TEMPORARY_ALLOWLIST
             if not (REPO / m).exists() or lines_of_code(REPO / m) <= LIMIT]
    assert not stale, f"remove from TEMPORARY_ALLOWLIST (now under {LIMIT} or gone): {stale}"


def test_the_count_skips_blank_and_comment_lines_and_counts_docstrings(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('"""Doc\n\nmore doc."""\n\n# a comment\n    # indented comment\nx = 1  # trailing\n\n')
    assert lines_of_code(f) == 3      # the docstring's two non-blank lines and `x = 1`
    assert exempt(Path("rl/envs/swe/data/builtin_tasks.py"))
    assert not exempt(Path("rl/envs/swe/tasks.py"))
