"""The built-in SWE tasks, read from their data files.

Each task is one YAML file in `builtin/` (`NN-<id>.yaml`, NN its place in `builtin.jsonl`): the issue text,
the tiny repository (`files`, visible tests included), the fix as `{path, old, new}` replacements, and
the hidden tests as new files. Block scalars keep the code as it reads in an editor; `make_builtin.py`
turns the tasks into `builtin.jsonl` (diffs computed, test outcomes measured). A task is data, so it
lives in a data file: adding one is a new file, not a module edit.
"""
from __future__ import annotations

from pathlib import Path

import yaml

DIR = Path(__file__).resolve().parent / "builtin"
KEYS = {"id": str, "issue": str, "files": dict, "fix": list, "hidden": dict}


def _task(path: Path) -> dict:
    doc = yaml.safe_load(path.read_text())
    if not isinstance(doc, dict) or set(doc) != set(KEYS):
        raise ValueError(f"{path}: a task has exactly the keys {sorted(KEYS)}, got "
                         f"{sorted(doc) if isinstance(doc, dict) else type(doc).__name__}")
    for k, kind in KEYS.items():
        if not isinstance(doc[k], kind):
            raise ValueError(f"{path}: `{k}` must be a {kind.__name__}, got {type(doc[k]).__name__}")
    if not path.stem.endswith(f"-{doc['id']}"):
        raise ValueError(f"{path}: the file name must end with the task's id {doc['id']!r}")
    for where in ("files", "hidden"):
        for name, text in doc[where].items():
            if not isinstance(name, str) or not isinstance(text, str):
                raise ValueError(f"{path}: `{where}` maps paths to file texts, got {name!r}: {type(text).__name__}")
    fix = []
    for i, f in enumerate(doc["fix"]):
        if not isinstance(f, dict) or set(f) != {"path", "old", "new"}:
            raise ValueError(f"{path}: fix[{i}] must have exactly the keys new, old, path")
        if f["path"] not in doc["files"]:
            raise ValueError(f"{path}: fix[{i}] edits {f['path']!r}, which is not in `files`")
        fix.append((f["path"], f["old"], f["new"]))
    return {**doc, "fix": fix}


def load(directory: Path = DIR) -> list[dict]:
    """Every task of `directory`, in the order of the files' names."""
    tasks = [_task(p) for p in sorted(directory.glob("*.yaml"))]
    ids = [t["id"] for t in tasks]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{directory}: duplicate task ids")
    return tasks


TASKS = load()
