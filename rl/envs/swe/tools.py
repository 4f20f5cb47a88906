"""The agent's tools on its episode tree, and the tool-call format.

A call is one JSON object inside `<tool_call>...</tool_call>` (special tokens of our tokenizer, the
Hermes/Qwen convention): `{"name": "read_file", "arguments": {"path": "pkg/mod.py"}}`. Every tool returns
a text observation; mistakes (unknown tool, bad arguments, a path outside the tree) come back as an
observation starting with "error:" so the model can recover, rather than ending the episode.

File tools (list/read/write) run in this process, on the tree, because they are cheap and only touch
files: every path is checked first. Absolute paths and `..` are refused outright; anything else is
resolved (symlinks included) and refused unless it stays inside the tree, so a link the agent's own code
planted (tests run inside the sandbox can create one) cannot point a host-side write elsewhere. Commands
(patch, pytest) run inside the sandbox, where a link out of the tree leads to read-only or private paths.

`run_tests` runs the repository's tests exactly as the grader runs the hidden ones (tasks.run_pytest ->
rl/envs/swe/testrun.py: the repository's conftest, ini options, addopts, markers, filterwarnings and
installed plugins; the task's source roots on PYTHONPATH, given by the episode as the grader computes
them), so the feedback the policy sees agrees, test by test, with the reward it gets on the same tree.
"""
from __future__ import annotations

import json
import re
import stat
from pathlib import Path, PurePosixPath

from rl.envs.swe import trees
from rl.envs.swe.runtimes import Runtime
from rl.envs.swe.tasks import PATCH, patched_paths, run_pytest

TOOL_SPECS = [
    {"name": "list_files", "description": "List files under a directory of the repository (recursive).",
     "arguments": {"path": "directory relative to the repository root (default '.')"}},
    {"name": "read_file", "description": "Read a file with line numbers, optionally lines start..end.",
     "arguments": {"path": "file path", "start": "first line, 1-based (optional)",
                   "end": "last line, inclusive (optional)"}},
    {"name": "write_file", "description": "Create or overwrite a file with the given content.",
     "arguments": {"path": "file path", "content": "the whole new file text"}},
    {"name": "apply_patch", "description": "Apply a unified diff (paths a/... b/..., as `git diff` prints).",
     "arguments": {"diff": "the unified diff"}},
    {"name": "run_tests", "description": "Run the repository's visible tests with pytest, as its own "
     "configuration says (all of them, or only the given test files or ids).",
     "arguments": {"paths": "test files or ids, e.g. ['tests/test_m.py::test_f'] (optional)"}},
    {"name": "submit", "description": "Submit the current repository state as your solution; ends the task.",
     "arguments": {}},
]
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_SKIP_DIRS = {"__pycache__", ".git", ".pytest_cache"}


def parse_tool_call(text: str) -> tuple[str, dict] | str:
    """(name, arguments) of the first tool call in a model turn, or an error text for the model. A
    missing closing tag is accepted (generation may stop on it)."""
    start = text.find(_OPEN)
    if start < 0:
        return (f'error: no tool call found. Call one tool per turn as {_OPEN}{{"name": "...", '
                f'"arguments": {{...}}}}{_CLOSE}')
    body = text[start + len(_OPEN):]
    end = body.find(_CLOSE)
    body = (body if end < 0 else body[:end]).strip()
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return f"error: the tool call is not valid JSON ({e.msg} at char {e.pos})"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return 'error: a tool call is a JSON object with "name" (string) and "arguments" (object)'
    args = call.get("arguments", {})
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return 'error: "arguments" must be a JSON object'
    if not isinstance(args, dict):
        return 'error: "arguments" must be a JSON object'
    return call["name"], args


class PathError(ValueError):
    pass


class Tools:
    """The tools of one episode. `call(name, args)` dispatches and always returns text; `submitted`
    turns true after `submit`."""

    def __init__(self, sandbox: Runtime, *, output_chars: int = 4000, timeout_s: float = 60,
                 max_file_chars: int = 200_000, roots: list[str] | None | str = "tree",
                 install: dict | None = None):
        self.sb = sandbox
        self.install = install  # the tree's install spec (grader.run_tests_install), as grading uses
        # PYTHONPATH of run_tests: the task's source roots (grader.task_roots), "tree" to read them
        # from the tree when no task says, None under image runtimes (the image installed the package)
        self.roots = roots
        self.output_chars = output_chars
        self.timeout_s = timeout_s
        self.max_file_chars = max_file_chars
        self.submitted = False

    def call(self, name: str, args: dict, timeout_s: float | None = None) -> str:
        fn = {s["name"]: getattr(self, s["name"]) for s in TOOL_SPECS}.get(name)
        if fn is None:
            return f"error: unknown tool {name!r}; tools: {', '.join(s['name'] for s in TOOL_SPECS)}"
        if name in ("apply_patch", "run_tests") and timeout_s is not None:
            args = {**args, "_timeout_s": timeout_s}
        try:
            return fn(**args)
        except TypeError as e:  # wrong/missing arguments
            return f"error: bad arguments for {name}: {e}"
        except (ValueError, OSError) as e:  # the model's mistakes; SandboxError (infrastructure) propagates
            return f"error: {e}"

    def _resolve(self, path: str) -> Path:
        if not isinstance(path, str) or not path.strip():
            raise PathError("a path must be a non-empty string relative to the repository root")
        p = PurePosixPath(path)
        if p.is_absolute() or ".." in p.parts:
            raise PathError(f"path {path!r} refused: use a path relative to the repository root, "
                            "without '..'")
        root = self.sb.tree.resolve()
        try:
            full = (root / p).resolve()
        except RuntimeError:  # Python 3.11's word for a symlink loop (3.13 raises OSError ELOOP)
            raise PathError(f"path {path!r} refused: it goes through a symlink loop") from None
        if full != root and root not in full.parents:
            raise PathError(f"path {path!r} refused: it leads outside the repository (symlink)")
        return full

    def _rel(self, p: Path) -> str:
        return p.relative_to(self.sb.tree.resolve()).as_posix()

    def list_files(self, path: str = ".") -> str:
        d = self._resolve(path)
        if not d.is_dir():
            raise NotADirectoryError(f"{path!r} is not a directory")
        out = []
        base = self._rel(d)
        base = "" if base == "." else base
        # iterative and never through a link: a loop, a FIFO or a tree thousands deep lists like any other
        for rel, entries in trees.walk(d, max_depth=trees.MAX_DEPTH):
            if any(part in _SKIP_DIRS for part in Path(rel).parts):
                continue
            out.extend("/".join(x for x in (base, rel, name) if x)
                       for name, st in sorted(entries) if not stat.S_ISDIR(st.st_mode))
        return self._truncate("\n".join(out) or "(no files)")

    def read_file(self, path: str, start: int | None = None, end: int | None = None) -> str:
        f = self._resolve(path)
        if not f.is_file():
            raise FileNotFoundError(f"{path!r} is not a file")
        if f.stat().st_size > self.max_file_chars * 4:
            return f"error: {path!r} is too large to read ({f.stat().st_size} bytes)"
        lines = f.read_text().splitlines()
        s = max(1, int(start or 1))
        e = min(len(lines), int(end) if end is not None else len(lines))
        body = "\n".join(f"{i:5d}  {lines[i - 1]}" for i in range(s, e + 1))
        return self._truncate(body or f"(no lines in {s}..{e}; the file has {len(lines)} lines)")

    def write_file(self, path: str, content: str) -> str:
        if not isinstance(content, str):
            return "error: content must be a string"
        if len(content) > self.max_file_chars:
            return f"error: content too long ({len(content)} > {self.max_file_chars} chars)"
        f = self._resolve(path)
        if f.is_dir():
            raise IsADirectoryError(f"{path!r} is a directory")
        # through the runtime: it opens every component without following links and replaces the file
        # (never writes through a link or a hard link), so a link planted after the check changes nothing
        self.sb.write_file(self._rel(f), content)
        return f"wrote {len(content)} chars to {self._rel(f)}"

    def apply_patch(self, diff: str, _timeout_s: float | None = None) -> str:
        if not isinstance(diff, str) or not diff.strip():
            return "error: diff must be a non-empty unified diff"
        diff = diff if diff.endswith("\n") else diff + "\n"
        paths = patched_paths(diff) + [m.group(1) for m in re.finditer(r"^--- (?:a/)?(\S+)", diff, re.M)
                                       if m.group(1) != "/dev/null"]
        if not paths:
            return "error: no file headers (---/+++ lines) found in the diff"
        for p in paths:
            self._resolve(p)
        timeout = _timeout_s or self.timeout_s
        dry = self.sb.run(PATCH + ["--dry-run"], timeout_s=timeout, input=diff)
        if dry.returncode != 0 or dry.timed_out:  # all or nothing: no half-applied diffs
            return self._truncate("error: the patch does not apply; nothing was changed.\n"
                                  + (dry.stdout + dry.stderr).strip())
        r = self.sb.run(PATCH, timeout_s=timeout, input=diff)
        if r.returncode != 0:
            return self._truncate("error: " + (r.stdout + r.stderr).strip())
        return self._truncate((r.stdout + r.stderr).strip() or "patch applied")

    def run_tests(self, paths: list[str] | str | None = None, _timeout_s: float | None = None) -> str:
        timeout = _timeout_s or self.timeout_s
        paths = [paths] if isinstance(paths, str) else list(paths or [])
        for p in paths:
            if not isinstance(p, str) or not p.strip():
                return "error: paths must be test files or ids relative to the repository root"
            self._resolve(p.split("::", 1)[0])  # inside the tree, never an option
            if p.startswith("-"):
                return f"error: path {p[:80]!r} starts with '-'"
        _, out = run_pytest(self.sb, paths, timeout, self.roots, self.install)
        return self._truncate(out.strip(), keep="tail")

    def submit(self) -> str:
        self.submitted = True
        return "submitted"

    def _truncate(self, text: str, keep: str = "head") -> str:
        n = self.output_chars
        if len(text) <= n:
            return text
        cut = f"[... {len(text) - n} chars cut ...]"
        return cut + "\n" + text[-n:] if keep == "tail" else text[:n] + "\n" + cut
