"""SWE tasks: the typed task record, loading rows, and grading a tree against a task's hidden tests.

A task is one row of a public SWE dataset, normalized by rl/envs/swe/datasets.py (SWE-bench and its
variants, SWE-smith, SWE-rebench, R2E-Gym; docs/swe.md describes them): instance_id, repo, base_commit,
problem_statement, patch = reference solution, test_patch = hidden tests, FAIL_TO_PASS, PASS_TO_PASS.
The agent's starting tree is `base_commit` of a local git repository (rl/envs/swe/repos.py), or, for the
original built-in rows, `files` (the snapshot inline). The built-in set is 23 tiny Python repositories,
shipped both ways: `data/builtin.jsonl` (snapshots, written by `data/make_builtin.py`) and
`data/builtin_swebench.jsonl` (SWE-bench rows over real git repositories, `data/make_swebench.py`).

Sandboxes come from the runtime named by `env.swe.runtime` (rl/envs/swe/runtimes.py): `open_sandbox`
passes `runtime` ({"name": ..., "image_cache": ...}, what `runtimes.from_config` returns) on to
`open_runtime`, with `image=task.image` for the image runtimes (podman, apptainer).

Grading lives in rl/envs/swe/grader.py (it builds on this module; this module never imports it):
what the task names is graded, with the repository's own conftest files and its own code.
`apply_patch` and `run_pytest` here serve the agent's tools and the dataset builders; `run_pytest` runs
the tests as the grader does (rl/envs/swe/testrun.py: the repository's configuration and installed
plugins, its source roots on PYTHONPATH), so what the agent sees is what it is rewarded on.
"""
from __future__ import annotations

import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from rl.contract.sandbox_runtimes import IMAGE_RUNTIMES
from rl.envs.swe import patches, pytest_report, repos, testrun
from rl.envs.swe.grading import _ANSI
from rl.envs.swe.runtimes import Runtime, open_runtime
from rl.envs.swe.sandbox import Limits

BUILTIN = Path(__file__).with_name("data") / "builtin.jsonl"
# Shipped task sets, by the names env.swe.tasks accepts besides a path.
SHIPPED = {"builtin": BUILTIN, "builtin_swebench": BUILTIN.with_name("builtin_swebench.jsonl")}
PATCH = ["patch", "-p1", "--batch", "--forward", "--fuzz=0", "--no-backup-if-mismatch", "--reject-file=-"]


@dataclass(frozen=True)
class Task:
    """One task, whatever public format its row came in (rl/envs/swe/datasets.py normalizes them).

    The tree the agent starts from is either `files` (the built-in snapshot rows) or `base_commit` of
    the git repository at `repo_dir` (resolved from `repo` when the task is made playable here).
    `image`, `test_cmd` and `log_parser` are the instance's own environment and test command, for
    runtimes that run its image; `expected_output` is R2E-Gym's {test: status}."""
    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    patch: str
    test_patch: str
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    files: dict[str, str] = field(default_factory=dict, repr=False)
    format: str = "swe_bench"
    version: str = ""
    environment_setup_commit: str = ""
    image: str = ""
    test_cmd: str = ""
    log_parser: str = "pytest"
    expected_output: dict[str, str] | None = field(default=None, repr=False)
    repo_dir: str = ""
    # R2E-Gym: its `commit_hash`, the commit that made the change (the fix); the starting tree
    # (base_commit) is that commit's parent, named by the row or found in the local repository
    fix_commit: str = ""

    @property
    def graded(self) -> list[str]:
        return self.fail_to_pass + self.pass_to_pass

    def base_file(self, rel: str) -> str | None:
        """The text of `rel` in the task's starting tree, None if it has no such file."""
        if self.files or not self.repo_dir:
            return self.files.get(rel)
        return repos.show(self.repo_dir, self.base_commit, rel)


# -- what a row may say --------------------------------------------------------------------------------
# A dataset row is untrusted input: its paths are written and read on the host (the orchestrator's or the
# sandbox service's user) before any sandbox runs, and some of its values reach command lines (podman,
# apptainer, git, pytest). So every path it names must stay inside the task's tree and every value that
# reaches an argv must have its format: checked when rows are loaded (datasets.normalize, SWEEnv) and
# again where they are used (open_sandbox, run_pytest, the runtimes' argv builders).

# Size limits per row field, in characters (lists: items, and characters over all items). A 100 MB
# problem statement would otherwise be tokenized whole into every episode's prompt. Generous enough for
# the public sets (SWE-bench's longest statements and patches are well under these).
ROW_LIMITS = {
    "instance_id": 256,
    "repo": 1024,
    "problem_statement": 256 << 10,
    "hints_text": 256 << 10,
    "patch": 2 << 20,
    "test_patch": 2 << 20,
    "test_ids": 50_000,              # FAIL_TO_PASS + PASS_TO_PASS items
    "test_ids_chars": 4 << 20,       # ... all their characters together
    "test_id": 4096,                 # one test id
    "files": 20_000,                 # snapshot files
    "files_chars": 64 << 20,         # ... all their text together
    "file": 16 << 20,                # one snapshot file's text
    "image": 512,
    "test_cmd": 64 << 10,
    "expected_output": 50_000,       # R2E-Gym's {test: status} entries
    "version": 256,
}

# An OCI image reference (github.com/distribution/reference's grammar): [domain[:port]/]path[:tag][@digest].
# No leading '-', no whitespace: it is a positional argument of podman / apptainer and must never be read as
# an option (`--volume=/:/host:rw` before the image would mount the host).
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_DOMAIN = rf"(?:{_LABEL}(?:\.{_LABEL})*(?::[0-9]+)?/)"
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
OCI_REFERENCE = re.compile(
    rf"{_DOMAIN}?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?")
# Registry schemes apptainer builds from; a host path (a .sif, a docker-archive) is not a row's to name.
IMAGE_SCHEMES = ("docker://", "oras://", "library://")
COMMIT = re.compile(r"[0-9a-fA-F]{4,64}")                 # a git object id (sha1 or sha256, or a prefix)
_REPO_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(?:/[A-Za-z0-9_][A-Za-z0-9_.-]*)*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_image(image: str) -> str:
    """`image` if it is an OCI reference (optionally behind a registry scheme apptainer takes); a
    ValueError saying why otherwise."""
    ref = image
    for scheme in IMAGE_SCHEMES:
        if image.startswith(scheme):
            ref = image[len(scheme):]
            break
    if not isinstance(image, str) or len(image) > ROW_LIMITS["image"] or not OCI_REFERENCE.fullmatch(ref):
        raise ValueError(f"{image[:80]!r} is not an image reference ([registry/]name[:tag][@digest], "
                         f"optionally behind {', '.join(IMAGE_SCHEMES)}; no leading '-', no spaces, no "
                         "host paths)")
    return image


def check_rel(rel: str) -> str:
    """`rel` if it is a path inside a tree: relative, no '..' component, not option-shaped, no control
    characters; a ValueError saying why otherwise (a symlink on the way is refused where it is opened)."""
    if not isinstance(rel, str) or not rel or not rel.strip():
        raise ValueError("empty path")
    if _CONTROL.search(rel):
        raise ValueError(f"path {rel[:80]!r} holds a control character")
    if rel.startswith("/") or rel.startswith("\\"):
        raise ValueError(f"path {rel[:80]!r} is absolute: paths are relative to the task's tree")
    if ".." in rel.split("/"):
        raise ValueError(f"path {rel[:80]!r} has a '..' component: it would leave the task's tree")
    if rel.startswith("-"):
        raise ValueError(f"path {rel[:80]!r} starts with '-' (it would read as a command-line option)")
    if not [q for q in rel.split("/") if q not in ("", ".")]:
        raise ValueError(f"path {rel[:80]!r} names the tree itself, not a file in it")
    return rel


def check_repo(repo: str) -> str:
    """A row's `repo`: a name under env.swe.repos_dir (owner/name: no '..', no leading '-'), or a local
    path (/..., ~/..., ./...) without '..'."""
    if _CONTROL.search(repo):
        raise ValueError("holds a control character")
    if repo.startswith(("/", "~", "./", "../")):
        if ".." in repo.split("/"):
            raise ValueError(f"{repo[:80]!r}: a path with a '..' component")
        return repo
    if not _REPO_NAME.fullmatch(repo) or any(q in (".", "..") for q in repo.split("/")):
        raise ValueError(f"{repo[:80]!r} is neither a repository name (owner/name: letters, digits, '._-', "
                         "no '..', no leading '-') nor a local path (/..., ~/..., ./...)")
    return repo


def diff_paths(diff: str) -> list[str]:
    """Every path a unified diff names in its headers: `---`/`+++` pairs (a/ b/ prefixes dropped;
    /dev/null skipped) and git's rename/copy lines. Hunk lines that merely look like headers are not."""
    out = []
    lines = diff.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            for h, prefix in ((line, "a/"), (lines[i + 1], "b/")):
                name = h[4:].split("\t")[0].strip()
                if name != "/dev/null":
                    out.append(name[2:] if name.startswith(prefix) else name)
        m = re.match(r"(?:rename|copy) (?:from|to) (.+)$", line)
        if m:
            out.append(m.group(1))
    return out


def id_file(test_id: str) -> str:
    """The file part of a test id (`path::name`); ids of other harnesses (Django's `test_x (mod.Class)`)
    have none and are checked whole, harmlessly: grading resets only the ones that are files."""
    return test_id.split("::")[0]


def task_problem(task: "Task", limits: dict | None = None) -> tuple[str, str] | None:
    """(field, why) of the first thing wrong with `task` as untrusted input, None if nothing is: sizes
    over ROW_LIMITS, paths that leave the tree, values that would read as options on a command line."""
    lim = {**ROW_LIMITS, **(limits or {})}

    def over(field: str, n: int, key: str, unit: str = "chars") -> tuple[str, str] | None:
        return (field, f"{n} {unit}, over the limit of {lim[key]} (ROW_LIMITS[{key!r}])") if n > lim[key] \
            else None

    for field, value, key in (("instance_id", task.instance_id, "instance_id"), ("repo", task.repo, "repo"),
                              ("problem_statement", task.problem_statement, "problem_statement"),
                              ("patch", task.patch, "patch"), ("test_patch", task.test_patch, "test_patch"),
                              ("image", task.image, "image"), ("test_cmd", task.test_cmd, "test_cmd"),
                              ("version", task.version, "version")):
        bad = over(field, len(value), key)
        if bad:
            return bad
    if not task.instance_id.strip() or _CONTROL.search(task.instance_id):
        return "instance_id", "empty or holds a control character"
    ids = task.fail_to_pass + task.pass_to_pass
    bad = (over("FAIL_TO_PASS/PASS_TO_PASS", len(ids), "test_ids", "test ids")
           or over("FAIL_TO_PASS/PASS_TO_PASS", sum(map(len, ids)), "test_ids_chars"))
    if bad:
        return bad
    for field, lst in (("FAIL_TO_PASS", task.fail_to_pass), ("PASS_TO_PASS", task.pass_to_pass)):
        for tid in lst:
            bad = over(field, len(tid), "test_id")
            if bad:
                return field, f"test id {tid[:60]!r}...: {bad[1]}"
            try:
                check_rel(id_file(tid))
            except ValueError as e:
                return field, f"test id {tid[:80]!r}: {e}"
    bad = (over("files", len(task.files), "files", "files")
           or over("files", sum(map(len, task.files.values())), "files_chars"))
    if bad:
        return bad
    dirs: set[str] = set()
    for rel, text in task.files.items():
        try:
            check_rel(rel)
        except ValueError as e:
            return "files", str(e)
        if rel.endswith("/"):
            return "files", f"path {rel[:80]!r} ends in '/': a snapshot holds files, not directories"
        bad = over("files", len(text), "file")
        if bad:
            return "files", f"{rel[:80]!r}: {bad[1]}"
        parts = [q for q in rel.split("/") if q not in ("", ".")]
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
    for rel in task.files:
        if "/".join(q for q in rel.split("/") if q not in ("", ".")) in dirs:
            return "files", f"path {rel[:80]!r} is both a file and a directory of other files"
    for field, diff in (("patch", task.patch), ("test_patch", task.test_patch)):
        # a diff that git cannot read, or that names a path outside the tree in any header (`diff --git`
        # lines included: a binary patch has no ---/+++), is the row's fault: refused here, at load,
        # rather than raising when the first episode is graded
        why = patches.check_diff(diff)
        if why:
            return field, why if why.startswith("not a unified diff") else f"not a unified diff: {why}"
        for rel in dict.fromkeys(diff_paths(diff) + patches.touched(diff)):
            try:
                check_rel(rel)
            except ValueError as e:
                return field, f"diff header: {e}"
    try:
        check_repo(task.repo)
    except ValueError as e:
        return "repo", str(e)
    for field, commit in (("base_commit", task.base_commit),
                          ("environment_setup_commit", task.environment_setup_commit),
                          ("commit_hash", task.fix_commit)):
        if commit and not COMMIT.fullmatch(commit):  # it reaches git's argv (archive, show, cat-file)
            return field, f"{commit[:80]!r} is not a git commit id (4 to 64 hex digits)"
    if task.image:
        try:
            check_image(task.image)
        except ValueError as e:
            return "image", str(e)
    if task.expected_output is not None:
        bad = over("expected_output_json", len(task.expected_output), "expected_output", "entries")
        if bad:
            return bad
    return None


def check_task(task: "Task", where: str = "row", limits: dict | None = None) -> "Task":
    """`task`, or a ValueError of one line naming `where`, the instance and the field at fault."""
    bad = task_problem(task, limits)
    if bad:
        raise ValueError(f"{where} ({str(task.instance_id)[:80]}): {bad[0]}: {bad[1]}")
    return task


def patched_paths(diff: str) -> list[str]:
    """Paths a unified diff writes (its `+++ b/...` lines), for path checks and test-file resets."""
    return [m.group(1) for m in re.finditer(r"^\+\+\+ (?:b/)?(\S+)", diff, re.M) if m.group(1) != "/dev/null"]


def runtime_args(task: Task, runtime: dict | None) -> dict:
    """open_runtime's keyword arguments for `task`: the runtime settings ({"name": ..., ...}, default
    inprocess) plus, for the image runtimes, the task's image."""
    kw = dict(runtime or {"name": "inprocess"})
    if kw["name"] in IMAGE_RUNTIMES:
        if not task.image:
            raise ValueError(f"{task.instance_id}: env.swe.runtime={kw['name']} runs each task in its "
                             "image, and this row names none (image_name / docker_image)")
        try:  # the image is a positional argument of podman / apptainer: never option-shaped
            kw["image"] = check_image(task.image)
        except ValueError as e:
            raise ValueError(f"{task.instance_id}: image: {e}") from None
    return kw


def apply_patch(sb: Runtime, diff: str, timeout_s: float = 30):
    """Apply a -p1 unified diff inside the sandbox (so a diff cannot write through a link out of the
    tree). Returns the Result; returncode 0 means every hunk applied."""
    return sb.run(PATCH, timeout_s=timeout_s, input=diff)


def run_pytest(sb: Runtime, targets: list[str], timeout_s: float, roots: list[str] | None | str = "tree",
               install: dict | None = None) -> tuple[dict[str, str], str]:
    """Run the repository's tests on targets in the sandbox, as the grader runs them (testrun.run);
    returns ({test id: outcome} as pytest recorded it, output with those outcomes summed up last). `roots`: the source roots to put on PYTHONPATH
    (grader.task_roots of the task), "tree" to read them from the sandbox's tree, None for none (image
    runtimes)."""
    if roots == "tree":
        roots = testrun.tree_roots(sb.tree)
    r, rep = testrun.run(sb, list(targets), roots, timeout_s, install)
    out = _ANSI.sub("", r.stdout + r.stderr) + (f"\n[timed out after {timeout_s:.0f}s]" if r.timed_out else "")
    # the outcomes the grader would use (pytest's structured report), last: what the agent reads
    return rep.outcomes, out.rstrip("\n") + "\n" + pytest_report.summary(rep)


def open_sandbox(task: Task, limits: Limits = Limits(), runtime: dict | None = None,
                 tree: Path | None = None) -> Runtime:
    """A sandbox of `runtime` (default inprocess) whose tree is `tree` if given (copied), else the task's
    starting tree: its snapshot, base_commit checked out, or (image runtimes, no local repository) the
    repository inside its image."""
    check_task(task, task.instance_id)  # again here: a Task need not have come through load_dataset
    kw = runtime_args(task, runtime)
    sb = open_runtime(tree=tree, limits=limits, **kw)
    if tree is not None or (kw["name"] in IMAGE_RUNTIMES and not task.files and not task.repo_dir):
        return sb
    try:  # a fresh tree nothing has run in yet, written as the orchestrator's (or service's) user
        if task.files or not task.repo_dir:
            for rel, text in task.files.items():
                # through the runtime: every component opened O_NOFOLLOW beneath the tree and the file
                # created O_EXCL, so no key (checked above) and no link can put the write elsewhere
                sb.write_file(check_rel(rel), text)
        else:
            try:  # tarfile's "data" filter refuses absolute paths and links that leave the tree
                repos.checkout(task.repo_dir, task.base_commit, sb.tree)
            except tarfile.FilterError as e:
                raise ValueError(f"{task.instance_id}: base_commit: the checkout of {task.repo} leaves the "
                                 f"task's tree ({e})") from None
    except BaseException:
        sb.close()
        raise
    return sb
