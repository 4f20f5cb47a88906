"""Local git repositories behind SWE-bench-format tasks: where they are, how an episode's tree is taken
out of them, and the built-in ones made on demand.

A row's `repo` is either a path to a git repository or a name ("owner/name") looked up under
`env.swe.repos_dir` (default `$XDG_CACHE_HOME/hetrl/swe_repos`, i.e. ~/.cache/hetrl/swe_repos). An
episode's tree is `git archive <base_commit>` unpacked into the sandbox: files only, no `.git`, so the
agent cannot read later commits (a real repository's history holds the fix) and the hidden tests, which
live in the row's test_patch, never reach it. Git runs here on the host, on repositories the user put
there; the agent's code never runs git.

The built-in repositories ("builtin/<id>") are made from builtin.jsonl's snapshots with fixed author,
committer and dates, so the commit id is the same on every machine and equals the shipped row's
base_commit (checked: a mismatch means the shipped file is stale). They are created in a temporary
directory and renamed into place, so concurrent loaders on one filesystem never see half a repository.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

BUILTIN_PREFIX = "builtin/"
_BUILTIN_SNAPSHOTS = Path(__file__).with_name("data") / "builtin.jsonl"
# Everything that enters a commit id is pinned; user and system git config (hooks, templates, signing)
# are kept out so that nothing else can.
_DATE = "2024-01-01T00:00:00+0000"
GIT_ENV = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_TERMINAL_PROMPT": "0",
           "GIT_AUTHOR_NAME": "hetrl", "GIT_AUTHOR_EMAIL": "hetrl@localhost", "GIT_AUTHOR_DATE": _DATE,
           "GIT_COMMITTER_NAME": "hetrl", "GIT_COMMITTER_EMAIL": "hetrl@localhost",
           "GIT_COMMITTER_DATE": _DATE, "LC_ALL": "C"}


def git(*args: str, cwd: Path | str, input: bytes | None = None) -> bytes:
    r = subprocess.run(["git", *args], cwd=cwd, input=input, capture_output=True,
                       env={**os.environ, **GIT_ENV})
    if r.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} in {cwd}: {r.stderr.decode(errors='replace').strip()}")
    return r.stdout


def default_repos_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hetrl" / "swe_repos"


def make_repo(files: dict[str, str], dest: Path, message: str = "base") -> str:
    """A new git repository at dest holding `files` in one commit; returns the commit id, which
    depends only on the files and the message."""
    dest.mkdir(parents=True)
    for rel, text in files.items():
        p = dest / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        p.chmod(0o644)
    git("-c", "init.defaultBranch=main", "init", "-q", cwd=dest)
    git("add", "-A", cwd=dest)
    git("-c", "commit.gpgsign=false", "commit", "-q", "--no-verify", "-m", message, cwd=dest)
    return git("rev-parse", "HEAD", cwd=dest).decode().strip()


def resolve(repo: str, repos_dir: Path | str | None) -> Path:
    """The local repository of a row's `repo`: an existing path, else `repos_dir/repo`. Raises
    FileNotFoundError naming where it looked."""
    base = Path(repos_dir) if repos_dir else default_repos_dir()
    is_path = repo.startswith(("/", "~", "./", "../"))
    cand = Path(repo).expanduser() if is_path else base / repo
    if (cand / ".git").exists() or (cand / "HEAD").is_file():  # a work tree or a bare repository
        return cand
    where = "" if is_path else f" (clone it under env.swe.repos_dir={base}, or give the row a local path)"
    raise FileNotFoundError(f"repo {repo!r}: no git repository at {cand}{where}")


def has_commit(repo_dir: Path, commit: str) -> bool:
    r = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=repo_dir, capture_output=True,
                       env={**os.environ, **GIT_ENV})
    return r.returncode == 0


def parent(repo_dir: Path | str, commit: str) -> str | None:
    """The first parent of `commit` (full id), None if it has none or is not here."""
    r = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{commit}^1^{{commit}}"], cwd=repo_dir,
                       capture_output=True, env={**os.environ, **GIT_ENV})
    return r.stdout.decode().strip() or None if r.returncode == 0 else None


def checkout(repo_dir: Path | str, commit: str, dest: Path) -> None:
    """Unpack the tree of `commit` into dest (files only, no .git); tarfile's "data" filter refuses
    links and paths that would land outside dest."""
    data = git("archive", "--format=tar", commit, cwd=repo_dir)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")


def show(repo_dir: Path | str, commit: str, rel: str) -> str | None:
    """The text of `rel` at `commit`, or None if it has no such file."""
    r = subprocess.run(["git", "show", f"{commit}:{rel}"], cwd=repo_dir, capture_output=True,
                       env={**os.environ, **GIT_ENV})
    return r.stdout.decode() if r.returncode == 0 else None


def builtin_snapshots() -> dict[str, dict[str, str]]:
    """{repo name: files} of the built-in tasks (builtin.jsonl)."""
    out = {}
    for line in _BUILTIN_SNAPSHOTS.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            out[rec["repo"]] = rec["files"]
    return out


def ensure_builtin(repo: str, base_commit: str, repos_dir: Path | str | None) -> Path:
    """The built-in repository `repo` under repos_dir, made if missing; its commit must be base_commit."""
    base = Path(repos_dir) if repos_dir else default_repos_dir()
    dest = base / repo
    if not (dest / ".git").exists():
        snaps = builtin_snapshots()
        if repo not in snaps:
            raise FileNotFoundError(f"repo {repo!r}: not a built-in repository (known: {len(snaps)} in "
                                    f"{_BUILTIN_SNAPSHOTS.name})")
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=dest.parent))
        try:
            make_repo(snaps[repo], tmp / "r")
            try:
                os.rename(tmp / "r", dest)
            except OSError:
                if not (dest / ".git").exists():  # not a lost race: a real failure
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if base_commit and not has_commit(dest, base_commit):
        head = git("rev-parse", "HEAD", cwd=dest).decode().strip()
        raise ValueError(f"repo {repo!r} at {dest}: commit {base_commit} not found (HEAD is {head}); the "
                         "shipped rows are stale: run python -m rl.envs.swe.data.make_swebench")
    return dest
