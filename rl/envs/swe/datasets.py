"""Task rows in the public SWE formats, from local files, normalized to one typed record (tasks.Task).

Files: JSONL (or a .json list), parquet, a directory of parquet files (the Hugging Face hub layout,
data/<split>-*.parquet), or a directory written by `datasets.Dataset.save_to_disk`. Nothing is fetched:
users download the rows once, where their cluster can read them.

Splits are never merged. A downloaded SWE-bench holds dev, test and train files side by side, SWE-Gym
and R2E-Gym theirs; reading every parquet file under the directory would train on the test split. So a
directory's parquet files are grouped by split, as the hub names them (`<split>-00000-of-00001.parquet`,
`<split>/<n>.parquet`, `<split>.parquet`); a directory holding more than one split is refused unless
`split` (env.swe.split) names one, in one line listing the splits found; a saved DatasetDict likewise.

Formats, told apart by their columns (or named by `env.swe.format`):
- `swe_bench` (SWE-bench, Verified, Lite, SWE-Gym: the same columns): instance_id, repo, base_commit,
  patch (reference fix), test_patch (hidden tests), problem_statement, FAIL_TO_PASS, PASS_TO_PASS;
  optional version, environment_setup_commit, image_name. Our built-in snapshot rows are this format
  plus `files` (the starting tree inline, base_commit empty).
- `swe_smith`: the instance's image holds the bug, so there is no test_patch (and base_commit may be
  absent): instance_id, repo, patch, FAIL_TO_PASS, PASS_TO_PASS, image_name, problem_statement.
- `swe_rebench`: SWE-bench's columns plus `docker_image` (or image_name) and `install_config`, a dict or
  JSON string whose `test_cmd` runs the tests and `log_parser` names the harness parser of their log.
- `r2e_gym`: repo_name, commit_hash, problem_statement, docker_image and expected_output_json (JSON
  {test: status}); graded by reproducing that output, with the image's run_tests.sh (or `test_cmd`).
  `commit_hash` is the commit that made the change (R2E-Gym's execution_result_content and
  parsed_commit_content call it `new_commit_hash`; the image `..._final:<commit_hash>` holds its parent's
  code): the starting tree is its parent, `parsed_commit_content.old_commit_hash` when the row has it,
  else the parent in the local repository (datasets.playable). Rows have no instance_id: it is
  `<repo_name>__<commit_hash[:12]>`, and when several rows share a commit, each gets `-<8 hex>` of its
  problem statement and expected output appended, so ids are unique per row.
Detection: expected_output_json -> r2e_gym; install_config -> swe_rebench; image_name without
test_patch -> swe_smith; base_commit + test_patch + FAIL_TO_PASS (or `files`) -> swe_bench.

FAIL_TO_PASS / PASS_TO_PASS may be lists or JSON-encoded strings (SWE-bench's own files use strings).
A bad row is a ValueError of one line naming the file, the row (index and instance_id) and the field.
Rows are untrusted input: every path they name must stay inside the task's tree, every value that reaches
a command line must have its format, every field has a size limit (tasks.ROW_LIMITS), and a binary file
change in patch or test_patch must be one git apply takes (a full index line, readable `GIT binary patch`
data, a literal matching its blob id: patches.binary_problem); all checked here, at load, so a bad row is
refused before any episode rather than raising at every grading (tasks.task_problem; docs/swe.md).
pyarrow and `datasets` are imported only for the files that need them.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Iterable

from rl.envs.swe import patches
from rl.envs.swe.grading import PARSERS
from rl.envs.swe.tasks import BUILTIN, ROW_LIMITS, SHIPPED, Task, task_problem

FORMATS = ("swe_bench", "swe_smith", "swe_rebench", "r2e_gym")
R2E_TEST_CMD = "bash run_tests.sh"   # R2E-Gym images carry the instance's test script in the repo root
_REQUIRED = {
    "swe_bench": ("instance_id", "repo", "problem_statement", "patch", "test_patch", "FAIL_TO_PASS",
                  "PASS_TO_PASS"),
    "swe_smith": ("instance_id", "repo", "problem_statement", "patch", "FAIL_TO_PASS", "PASS_TO_PASS",
                  "image_name"),
    "swe_rebench": ("instance_id", "repo", "base_commit", "problem_statement", "patch", "test_patch",
                    "FAIL_TO_PASS", "PASS_TO_PASS", "install_config"),
    "r2e_gym": ("repo_name", "commit_hash", "problem_statement", "expected_output_json"),
}


class RowError(ValueError):
    pass


def read_rows(path: str | Path, split: str | None = None) -> list[dict]:
    """The rows of a JSONL / JSON / parquet file or a parquet / saved-dataset directory, as dicts. A
    directory holding several splits needs `split` (refused otherwise, naming the splits found)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file or directory")
    if p.is_dir():
        if (p / "dataset_dict.json").is_file():
            splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
            if split is None:
                raise ValueError(f"{p}: a saved DatasetDict with splits {', '.join(map(str, splits))}: name one "
                                 f"(env.swe.split), e.g. env.swe.split={splits[0] if splits else 'train'}")
            if split not in splits:
                raise ValueError(f"{p}: env.swe.split={split!r}: no such split (found: {', '.join(map(str, splits))})")
            p, split = p / split, None
        if (p / "state.json").is_file() or (p / "dataset_info.json").is_file():
            if split is not None:
                raise ValueError(f"{p}: env.swe.split={split!r}: a saved Dataset is one split; leave env.swe.split "
                                 "unset")
            from datasets import load_from_disk  # only for saved datasets
            return [dict(r) for r in load_from_disk(str(p))]
        by_split = parquet_splits(p)
        if not by_split:
            raise ValueError(f"{p}: a directory with neither a saved dataset (state.json) nor parquet files")
        names = ", ".join(sorted(by_split))
        if split is None and len(by_split) > 1:
            raise ValueError(f"{p}: holds the splits {names}: name one (env.swe.split); splits are never merged")
        if split is not None and split not in by_split:
            raise ValueError(f"{p}: env.swe.split={split!r}: no such split (found: {names})")
        files = by_split[split if split is not None else next(iter(by_split))]
        return [r for f in files for r in _parquet(f)]
    if split is not None:
        raise ValueError(f"{p}: env.swe.split={split!r} names a split of a directory; {p.name} is one file: "
                         "leave env.swe.split unset")
    if p.suffix == ".parquet":
        return _parquet(p)
    text = p.read_text()
    if p.suffix == ".json" and text.lstrip().startswith("["):
        rows = json.loads(text)
        if not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"{p}: a JSON list of rows must hold objects only")
        return rows
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}: line {n}: not JSON ({e.msg} at char {e.pos})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{p}: line {n}: a row must be a JSON object")
            rows.append(rec)
    return rows


# The hub's shard names: data/<split>-00000-of-00003.parquet (push_to_hub), or <split>-<anything>.parquet
_SHARD = re.compile(r"^(?P<split>.+?)-\d+-of-\d+$")


def split_of(f: Path, root: Path) -> str:
    """The split a parquet file under a dataset directory belongs to, as the hub names it:
    `<split>-00000-of-00001.parquet`, `<split>/0000.parquet` (the hub's parquet conversion), or
    `<split>.parquet`; a split in a configuration's subdirectory is `<config>/<split>`."""
    rel = f.relative_to(root)
    m = _SHARD.match(f.stem)
    if m:
        name, where = m.group("split"), rel.parent
    elif f.stem.isdigit() and rel.parent != Path("."):
        name, where = rel.parent.name, rel.parent.parent
    else:
        name, where = f.stem, rel.parent
    # `data/` is the hub's folder of the default configuration, not part of a split's name
    prefix = "/".join(q for q in where.parts if q != "data")
    return f"{prefix}/{name}" if prefix else name


def parquet_splits(root: Path) -> dict[str, list[Path]]:
    """{split: its parquet files, sorted} of a dataset directory (split_of)."""
    out: dict[str, list[Path]] = {}
    for f in sorted(root.rglob("*.parquet")):
        out.setdefault(split_of(f, root), []).append(f)
    return out


def _parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq  # only for parquet files
    return pq.read_table(path).to_pylist()


def detect_format(columns: Iterable[str]) -> str:
    cols = set(columns)
    if "expected_output_json" in cols:
        return "r2e_gym"
    if "install_config" in cols:
        return "swe_rebench"
    if "image_name" in cols and "test_patch" not in cols:
        return "swe_smith"
    if {"test_patch", "FAIL_TO_PASS"} <= cols and ("base_commit" in cols or "files" in cols):
        return "swe_bench"
    raise ValueError(f"cannot tell the row format from the columns {sorted(cols)}: set env.swe.format to "
                     f"one of {', '.join(FORMATS)}")


def load_dataset(path: str | Path, format: str = "auto", limits: dict | None = None,
                 split: str | None = None) -> list[Task]:
    """Every row of `path` (of its split `split`, for a directory holding several) as a Task. `format`
    is auto (from the first row's columns) or one of FORMATS. `limits` overrides entries of
    tasks.ROW_LIMITS (field sizes); every row is checked against them and for paths that leave the
    task's tree or values that would read as options (tasks.task_problem), so a bad row is refused
    here, before any episode."""
    rows = read_rows(path, split)
    if not rows:
        raise ValueError(f"{path}: no rows")
    if format == "auto":
        try:
            format = detect_format(rows[0])
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    elif format not in FORMATS:
        raise ValueError(f"env.swe.format={format!r}: must be auto or one of {', '.join(FORMATS)}")
    tasks = [normalize(r, format, f"{path}: row {i}", limits) for i, r in enumerate(rows)]
    if format == "r2e_gym":
        tasks = _unique_r2e_ids(tasks, rows)
    seen: dict[str, int] = {}
    for i, t in enumerate(tasks):
        if t.instance_id in seen:
            raise ValueError(f"{path}: row {i} ({t.instance_id}): instance_id: duplicate of row "
                             f"{seen[t.instance_id]}")
        seen[t.instance_id] = i
    return tasks


def _unique_r2e_ids(tasks: list[Task], rows: list[dict]) -> list[Task]:
    """R2E-Gym rows name no instance; `<repo>__<commit[:12]>` is shared by rows of one commit (several
    issues written for it): those get `-<8 hex>` of their problem statement and expected output, so
    the id is unique per row and the same on every load. Identical rows stay identical (refused as
    duplicates)."""
    import dataclasses
    count: dict[str, int] = {}
    for t, r in zip(tasks, rows):
        if not r.get("instance_id"):
            count[t.instance_id] = count.get(t.instance_id, 0) + 1
    out = []
    for t, r in zip(tasks, rows):
        if not r.get("instance_id") and count[t.instance_id] > 1:
            digest = hashlib.sha256(json.dumps([t.problem_statement, t.expected_output], sort_keys=True)
                                    .encode()).hexdigest()[:8]
            t = dataclasses.replace(t, instance_id=f"{t.instance_id}-{digest}")
        out.append(t)
    return out


# -- one row ----------------------------------------------------------------------------------------
# Raw columns measured before anything parses them (a 100 MB JSON string is refused unread): the limit
# key of each; JSON-encoded lists and objects get twice their decoded limit for quotes and commas, and
# are measured exactly once decoded (tasks.task_problem).
_RAW_LIMITS = {"instance_id": "instance_id", "problem_statement": "problem_statement",
               "hints_text": "hints_text", "patch": "patch", "test_patch": "test_patch",
               "FAIL_TO_PASS": "test_ids_chars", "PASS_TO_PASS": "test_ids_chars", "repo": "repo",
               "repo_name": "repo", "image_name": "image", "docker_image": "image", "version": "version"}


def normalize(row: dict, format: str, where: str = "row", limits: dict | None = None) -> Task:
    """The Task of one row in `format`; RowError naming `where`, the instance and the field otherwise
    (sizes over ROW_LIMITS, paths out of the tree and option-shaped values included)."""
    iid = row.get("instance_id") or (f"{row.get('repo_name')}__{str(row.get('commit_hash'))[:12]}"
                                     if format == "r2e_gym" else "?")
    iid = str(iid)[:80]
    lim = {**ROW_LIMITS, **(limits or {})}

    def bad(field: str, why: str):
        raise RowError(f"{where} ({iid}): {field}: {why}")

    for k, key in _RAW_LIMITS.items():
        v = row.get(k)
        if isinstance(v, str) and len(v) > lim[key] * (2 if k in ("FAIL_TO_PASS", "PASS_TO_PASS") else 1):
            bad(k, f"{len(v)} chars, over the limit of {lim[key]} (ROW_LIMITS[{key!r}])")
    for k in ("expected_output_json", "install_config"):
        v = row.get(k)
        if isinstance(v, str) and len(v) > lim["test_ids_chars"] * 2:
            bad(k, f"{len(v)} chars, over the limit of {lim['test_ids_chars'] * 2} "
                "(2 * ROW_LIMITS['test_ids_chars'])")
    v = row.get("parsed_commit_content")  # R2E-Gym: the commit's diffs, read for old_commit_hash only
    if isinstance(v, str) and len(v) > lim["patch"] * 4:
        bad("parsed_commit_content", f"{len(v)} chars, over the limit of {lim['patch'] * 4} "
            "(4 * ROW_LIMITS['patch'])")
    task = _normalize(row, format, bad)
    problem = task_problem(task, limits)
    if problem:
        bad(*problem)
    for field in ("patch", "test_patch"):   # a binary change git apply would refuse at every grading
        if why := patches.binary_problem(getattr(task, field), lim["file"]):
            bad(field, why)
    return task


def _normalize(row: dict, format: str, bad) -> Task:
    iid = row.get("instance_id") or (f"{row.get('repo_name')}__{str(row.get('commit_hash'))[:12]}"
                                     if format == "r2e_gym" else "?")

    for k in _REQUIRED[format]:
        if k not in row or row[k] is None:
            bad(k, f"missing (a {format} row needs {', '.join(_REQUIRED[format])})")

    def text(k: str, default: str | None = None, nonempty: bool = False) -> str:
        v = row.get(k, default)
        if v is None:
            v = default
        if not isinstance(v, str):
            bad(k, f"must be a string, not {type(v).__name__}")
        if nonempty and not v.strip():
            bad(k, "empty")
        return v

    def ids(k: str) -> list[str]:
        v = row.get(k)
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError as e:
                bad(k, f"not a JSON list ({e.msg} at char {e.pos})")
        if hasattr(v, "tolist"):  # numpy arrays from pandas-made parquet
            v = v.tolist()
        if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) and x for x in v):
            bad(k, "must be a list of test ids (a list or a JSON-encoded list of strings)")
        return list(v)

    def mapping(k: str) -> dict:
        v = row.get(k)
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError as e:
                bad(k, f"not a JSON object ({e.msg} at char {e.pos})")
        if not isinstance(v, dict):
            bad(k, f"must be an object (or a JSON-encoded one), not {type(v).__name__}")
        return v

    if format == "r2e_gym":
        expected = mapping("expected_output_json")
        if not expected:
            bad("expected_output_json", "empty: nothing to grade against")
        for name, status in expected.items():
            if status not in ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS"):
                bad("expected_output_json", f"test {name!r} has status {status!r} (PASSED, FAILED, "
                    "ERROR, ...)")
        fix = text("commit_hash", nonempty=True)
        base = ""  # the fix commit's parent: named by parsed_commit_content, else found by playable()
        if row.get("parsed_commit_content") is not None:
            old = mapping("parsed_commit_content").get("old_commit_hash")
            if old is not None and not isinstance(old, str):
                bad("parsed_commit_content.old_commit_hash", "must be a string")
            base = old or ""
        return Task(iid, text("repo_name", nonempty=True), base,
                    text("problem_statement", nonempty=True), text("patch", ""), "", [], [],
                    format=format, image=text("docker_image", ""),
                    test_cmd=text("test_cmd", R2E_TEST_CMD, nonempty=True), log_parser="r2e",
                    expected_output={str(k): str(v) for k, v in expected.items()}, fix_commit=fix)

    text("instance_id", nonempty=True)
    f2p, p2p = ids("FAIL_TO_PASS"), ids("PASS_TO_PASS")
    if format != "swe_smith" and not f2p:
        bad("FAIL_TO_PASS", "empty: the reference patch fixes nothing")
    files = row.get("files") or {}
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                              for k, v in files.items()):
        bad("files", "must be an object {path: text}")
    test_cmd, log_parser = "", "pytest"
    image = text("image_name", "")
    if format == "swe_rebench":
        cfg = mapping("install_config")
        image = text("docker_image", "") or image
        if not image:
            bad("docker_image", "missing (SWE-rebench rows run in their instance image)")
        cmd = cfg.get("test_cmd")
        if isinstance(cmd, list) and all(isinstance(c, str) for c in cmd):
            cmd = " && ".join(cmd)
        if not isinstance(cmd, str) or not cmd.strip():
            bad("install_config.test_cmd", "missing or not a command string")
        log_parser = cfg.get("log_parser", "parse_log_pytest")
        if log_parser not in PARSERS:
            bad("install_config.log_parser",
                f"unknown parser {log_parser!r} (known: {', '.join(sorted(PARSERS))})")
        test_cmd = cmd
    elif format == "swe_smith" and not image:
        bad("image_name", "empty (SWE-smith rows run in their instance image)")
    base = text("base_commit", "")
    if format == "swe_bench" and not base.strip() and not files:
        bad("base_commit", "empty (and no `files` snapshot to start from)")
    patch = text("patch", nonempty=True)
    test_patch = text("test_patch", "", nonempty=format in ("swe_bench", "swe_rebench"))
    # whether patch and test_patch are diffs (hunks that match their headers, paths inside the tree) is
    # checked with every other field by tasks.task_problem
    return Task(text("instance_id"), text("repo", nonempty=True), base,
                text("problem_statement", nonempty=True), patch, test_patch, f2p, p2p, files=dict(files),
                format=format, version=str(row.get("version") or ""),
                environment_setup_commit=text("environment_setup_commit", ""), image=image,
                test_cmd=test_cmd, log_parser=log_parser)


# -- playable here -------------------------------------------------------------------------------------
def needs_container(task: Task) -> str | None:
    """Why `task` cannot run in the in-process sandbox (None if it can)."""
    if task.format in ("swe_smith", "swe_rebench") or (task.format == "r2e_gym" and task.image):
        return (f"its {task.format} row runs in its instance image {task.image!r}: it needs a container "
                "runtime (apptainer or podman), not the in-process sandbox")
    return None


def playable(tasks: list[Task], repos_dir: str | Path | None, where: Any = "tasks") -> list[Task]:
    """The tasks with their repository resolved to a local git repository (built-in ones made on
    demand), refusing rows that need a container image or whose repo or commit is not here."""
    import dataclasses

    from rl.envs.swe import repos
    out = []
    for i, t in enumerate(tasks):
        why = needs_container(t)
        if why:
            raise ValueError(f"{where}: row {i} ({t.instance_id}): {why}")
        if t.files:
            out.append(t)
            continue
        try:
            if t.repo.startswith(repos.BUILTIN_PREFIX):
                path = repos.ensure_builtin(t.repo, t.base_commit, repos_dir)
            else:
                path = repos.resolve(t.repo, repos_dir)
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"{where}: row {i} ({t.instance_id}): repo: {e}") from None
        if t.format == "r2e_gym" and not t.base_commit:  # R2E-Gym's commit_hash is the fix: start at its parent
            if not repos.has_commit(path, t.fix_commit):
                raise ValueError(f"{where}: row {i} ({t.instance_id}): commit_hash: {t.fix_commit} is not in {path}")
            par = repos.parent(path, t.fix_commit)
            if par is None:
                raise ValueError(f"{where}: row {i} ({t.instance_id}): commit_hash: {t.fix_commit} (the commit that "
                                 f"fixed the issue) has no parent in {path} to start from")
            t = dataclasses.replace(t, base_commit=par)
        if not repos.has_commit(path, t.base_commit):
            raise ValueError(f"{where}: row {i} ({t.instance_id}): base_commit: {t.base_commit} is not in "
                             f"{path}")
        out.append(dataclasses.replace(t, repo_dir=str(path)))
    return out


def load_tasks(path: str | Path = BUILTIN, format: str = "auto", limits: dict | None = None,
               split: str | None = None) -> list[Task]:
    """Tasks of one dataset file or directory (its split `split`, for a directory holding several), in
    any of the public formats (datasets.load_dataset), or of a shipped set named in SHIPPED; `limits`
    overrides entries of ROW_LIMITS."""
    return load_dataset(SHIPPED.get(str(path), path), format, limits, split)
