"""How a built-in SWE task is written in source: `T(id, issue, files, fix, hidden)` dedents the texts
and the fix blocks, so the task modules read like the repositories they describe."""
from __future__ import annotations

from textwrap import dedent


def _block(s):
    """A fix string: one-line literals are taken as written; a triple-quoted block (starting with a
    newline) is written at file indentation + 8 columns in this source, which is removed here."""
    if not s.startswith("\n"):
        return s
    lines = s[1:].split("\n")
    if any(line.strip() and not line.startswith(" " * 8) for line in lines):
        raise ValueError(f"fix block not indented by 8: {s!r}")
    return "\n".join(line[8:] for line in lines).rstrip()


def T(iid, issue, files, fix, hidden):
    return {"id": iid, "issue": dedent(issue).strip() + "\n",
            "files": {k: dedent(v).lstrip("\n") for k, v in files.items()},
            "fix": [(p, _block(o), _block(n)) for p, o, n in fix],
            "hidden": {k: dedent(v).lstrip("\n") for k, v in hidden.items()}}
