"""Diffs as datasets ship them: which paths a diff touches, and applying one inside a sandbox.

Rows carry `patch` / `test_patch` as `git diff` prints them (SWE-bench, SWE-rebench, SWE-smith): besides
plain text hunks they may hold renames and copies (`rename from` / `rename to`), mode changes, deleted
and new files, and binary files (`GIT binary patch`, written by `git diff --binary`), in any encoding
(a Latin-1 data file's hunks are Latin-1 bytes). GNU patch refuses binary patches and mishandles some
of the rest, so a diff is applied with `git apply`, which needs no repository (outside one it works on
the files of the current directory, like patch) and is atomic: it applies every file or none. GNU
patch is the fallback, for diffs git refuses that patch takes (plain `--- / +++` diffs with shifted
hunks); it is tried dry first so that a failed fallback leaves the tree as it was.

Both run inside the sandbox, so a diff cannot write through a link the agent planted out of the tree
(git apply also refuses to write "beyond a symbolic link" on its own). git runs with no system or
global config, HOME in the sandbox's /tmp, and GIT_CEILING_DIRECTORIES at the tree's parent, so no
repository above the tree is found; a `.git` inside the grading copy is removed by the grader first.

A diff given as text is turned into bytes with UTF-8 and `surrogateescape`, so a row read from bytes
with surrogateescape (non-UTF-8 hunks) reaches git byte for byte.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# GNU patch: the fallback, and what tasks.PATCH runs for the agent's own apply_patch tool
GNU_PATCH = ["patch", "-p1", "--batch", "--forward", "--fuzz=0", "--no-backup-if-mismatch", "--reject-file=-"]
GIT_APPLY = ["git", "apply", "-p1", "--whitespace=nowarn", "--verbose"]


@dataclass(frozen=True)
class FileChange:
    """One file of a diff: old path (None: created), new path (None: deleted), binary or not."""
    old: str | None
    new: str | None
    binary: bool = False

    @property
    def paths(self) -> list[str]:
        return [p for p in dict.fromkeys((self.old, self.new)) if p]


def to_bytes(diff: str | bytes) -> bytes:
    return diff if isinstance(diff, bytes) else diff.encode("utf-8", "surrogateescape")


_ESC = {"a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, '"': 34, "\\": 92}


def _unquote(s: str) -> str:
    """A path as git prints it: plain, or C-quoted ("a/sp\\303\\251cial" with octal bytes)."""
    if not (len(s) >= 2 and s[0] == s[-1] == '"'):
        return s
    out, i, body = bytearray(), 0, s[1:-1]
    while i < len(body):
        c = body[i]
        if c == "\\" and i + 1 < len(body):
            n = body[i + 1]
            if n in "01234567":
                out.append(int(body[i + 1:i + 4], 8))
                i += 4
                continue
            out.append(_ESC.get(n, ord(n)))
            i += 2
            continue
        out += c.encode("utf-8", "surrogateescape")
        i += 1
    return out.decode("utf-8", "surrogateescape")


def _strip(p: str) -> str | None:
    p = _unquote(p.strip())
    if p == "/dev/null":
        return None
    return p[2:] if p[:2] in ("a/", "b/") else p


def _header_pair(rest: str) -> tuple[str, str] | None:
    """The two paths of a `diff --git a/X b/Y` line (quoted, or split where both halves agree)."""
    rest = rest.strip()
    if rest.startswith('"'):
        m = re.match(r'("(?:[^"\\]|\\.)*")\s+(.+)$', rest)
        return (m.group(1), m.group(2)) if m else None
    if rest.endswith('"'):
        m = re.match(r'(.+?)\s+("(?:[^"\\]|\\.)*")$', rest)
        return (m.group(1), m.group(2)) if m else None
    # unquoted, possibly with spaces: "a/x y b/x y" splits at the middle " b/"
    cands = [m.start() for m in re.finditer(r" b/", rest)]
    for i in cands:
        a, b = rest[:i], rest[i + 1:]
        if a[2:] == b[2:]:
            return a, b
    return (rest[:cands[0]], rest[cands[0] + 1:]) if cands else None


def changes(diff: str | bytes) -> list[FileChange]:
    """The files a diff touches, in order: git diffs by their `diff --git` blocks (renames, copies,
    deletions, binary files included), plain unified diffs by their `---` / `+++` pairs."""
    text = to_bytes(diff).decode("utf-8", "surrogateescape") if diff else ""
    lines = text.splitlines()
    out: list[FileChange] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("diff --git "):
            pair = _header_pair(line[len("diff --git "):])
            old, new = (_strip(pair[0]), _strip(pair[1])) if pair else (None, None)
            binary, created, deleted = False, False, False
            j = i + 1
            while j < len(lines) and not lines[j].startswith("diff --git "):
                h = lines[j]
                if h.startswith(("rename from ", "copy from ")):
                    old = _unquote(h.split(" from ", 1)[1])
                elif h.startswith(("rename to ", "copy to ")):
                    new = _unquote(h.split(" to ", 1)[1])
                elif h.startswith("new file mode"):
                    created = True
                elif h.startswith("deleted file mode"):
                    deleted = True
                elif h.startswith("--- ") and j + 1 < len(lines) and lines[j + 1].startswith("+++ "):
                    o, n = _strip(h[4:].split("\t")[0]), _strip(lines[j + 1][4:].split("\t")[0])
                    created, deleted = created or o is None, deleted or n is None
                    old, new = o or old, n or new
                    j += 1
                elif h == "GIT binary patch" or (h.startswith("Binary files ") and h.endswith(" differ")):
                    binary = True
                elif h.startswith("@@"):
                    break  # the hunks: headers are over (a hunk line may look like a header)
                j += 1
            out.append(FileChange(None if created else old, None if deleted else new, binary))
            while j < len(lines) and not lines[j].startswith("diff --git "):
                j += 1
            i = j
            continue
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            out.append(FileChange(_strip(line[4:].split("\t")[0]), _strip(lines[i + 1][4:].split("\t")[0])))
            i += 2
            continue
        i += 1
    return out


_HUNK = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_GIT_ONLY = ("new file mode", "deleted file mode", "old mode", "new mode", "rename from", "rename to",
             "copy from", "copy to", "similarity index", "GIT binary patch", "Binary files ")


def check_diff(diff: str | bytes) -> str | None:
    """None if `diff` is a unified diff git or patch can apply as far as its structure goes, else why
    not (one line, naming the line): at least one file, every file with a hunk or a git header that
    changes it without one (rename, copy, mode, binary, an empty new or deleted file), every hunk's
    line counts matching its `@@ -a,b +c,d @@` header. Text before the first file (a commit message)
    and git's index lines are allowed, as git apply allows them."""
    text = to_bytes(diff).decode("utf-8", "surrogateescape") if diff else ""
    if not text.strip():
        return None
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    files = 0
    cur: list | None = None   # [line number, path, from `diff --git`, its ---/+++ seen, changed]

    def unchanged() -> str | None:
        return f"line {cur[0]}: file {cur[1][:80]!r} has no hunk" if cur and not cur[4] else None

    binary = False
    i = 0
    while i < len(lines):
        line, n = lines[i], i + 1
        if line.startswith("diff --git "):
            if unchanged():
                return unchanged()
            files += 1
            cur, binary = [n, line[11:].strip(), True, False, False], False
        elif binary:
            pass                                  # base85 data, up to the next file
        elif line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            if cur and cur[2] and not cur[3]:     # the file headers of this `diff --git`
                cur[3] = True
            else:
                if unchanged():
                    return unchanged()
                files += 1
                cur = [n, lines[i + 1][4:].split("\t")[0].strip(), False, True, False]
            i += 2
            continue
        elif cur and cur[2] and line.startswith(_GIT_ONLY):
            cur[4] = True
            binary = line == "GIT binary patch"
        elif line.startswith("@@"):
            m = _HUNK.match(line)
            if not m:
                return f"line {n}: a hunk header that is not '@@ -a,b +c,d @@': {line[:60]!r}"
            if cur is None:
                return f"line {n}: a hunk before any file header (---/+++ or diff --git)"
            old = int(m.group(2)) if m.group(2) is not None else 1
            new = int(m.group(4)) if m.group(4) is not None else 1
            j = i + 1
            while (old > 0 or new > 0) and j < len(lines):
                c = lines[j][:1]
                if c in (" ", ""):                # "": a context line whose space was stripped
                    old, new = old - 1, new - 1
                elif c == "-":
                    old -= 1
                elif c == "+":
                    new -= 1
                elif c != "\\":                   # "\ No newline at end of file"
                    break
                j += 1
            if old != 0 or new != 0:
                return f"line {n}: the hunk {line[:40]!r} does not match the lines that follow it"
            cur[4] = True
            i = j
            continue
        i += 1
    if files == 0:
        return "not a unified diff: no file header (diff --git, or --- and +++ lines)"
    return unchanged()


# -- binary files: what git apply will accept ---------------------------------------------------------
# git apply takes a binary file's change only with a full index line (`index <40 hex>..<40 hex>`; 64 with
# SHA-256), and, unless it deletes the file, with its data: `GIT binary patch`, then a `literal N` or
# `delta N` block (base85 lines, each led by its byte count A-Z = 1..26, a-z = 27..52, ending at an empty
# line; the bytes inflate with zlib to exactly N) and optionally the reverse block. A literal is the new
# file whole, and git checks that its blob hash is the index line's new id. `Binary files a/x and b/x
# differ` (git diff without --binary) has no data. A row carrying any of these wrong was accepted and
# then every grading of it raised ("cannot apply binary patch ... without full index line", "corrupt
# binary patch"); `binary_problem` finds it at load (rl.envs.swe.datasets.normalize).
_B85 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz!#$%&()*+-;<=>?@^_`{|}~"
_B85_SET = frozenset(_B85)
_INDEX = re.compile(r"^index ([0-9a-f]+)\.\.([0-9a-f]+)(?: [0-7]+)?$")
_BLOCK = re.compile(r"^(literal|delta) (\d+)$")


def _blob_id(data: bytes, hexlen: int) -> str:
    import hashlib
    h = hashlib.sha1 if hexlen == 40 else hashlib.sha256
    return h(b"blob %d\0" % len(data) + data).hexdigest()


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    """git's delta header size: 7 bits a byte, least significant first, high bit = more."""
    value, shift = 0, 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated delta header")
        b = buf[pos]
        value |= (b & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not b & 0x80:
            return value, pos


def _binary_block(lines: list[str], i: int, max_bytes: int) -> tuple[str, bytes, int]:
    """The block at lines[i] (`literal N` / `delta N` and its data lines): (kind, inflated bytes, index of
    the line after its closing empty line). ValueError naming the line when git would not read it."""
    import base64
    import zlib
    m = _BLOCK.match(lines[i]) if i < len(lines) else None
    if not m:
        raise ValueError(f"line {i + 1}: 'literal N' or 'delta N' expected after 'GIT binary patch', found "
                         f"{(lines[i] if i < len(lines) else 'the end of the diff')[:40]!r}")
    kind, size = m.group(1), int(m.group(2))
    if size > max_bytes:
        raise ValueError(f"line {i + 1}: a binary block of {size} bytes, over the limit of {max_bytes} "
                         f"(ROW_LIMITS['file'])")
    raw, j = bytearray(), i + 1
    while j < len(lines) and lines[j] != "":
        line = lines[j]
        c = line[:1]
        n = ord(c) - ord("A") + 1 if "A" <= c <= "Z" else ord(c) - ord("a") + 27 if "a" <= c <= "z" else 0
        body = line[1:]
        if not n or len(body) != (n + 3) // 4 * 5 or not set(body) <= _B85_SET:
            raise ValueError(f"line {j + 1}: not a line of git's base85 binary data")
        raw += base64.b85decode(body)[:n]
        j += 1
    if j >= len(lines):
        raise ValueError(f"line {i + 1}: the {kind} block does not end with an empty line")
    d = zlib.decompressobj()
    try:
        out = d.decompress(bytes(raw), size + 1)
    except zlib.error as e:
        raise ValueError(f"line {i + 1}: the {kind} block's data does not inflate ({e})") from None
    if len(out) != size or not d.eof:
        raise ValueError(f"line {i + 1}: the {kind} block says {size} bytes, its data inflates to "
                         f"{len(out) if d.eof else f'more than {len(out)}'}")
    if kind == "delta":
        try:
            _, pos = _varint(out, 0)
            target, _ = _varint(out, pos)
        except ValueError as e:
            raise ValueError(f"line {i + 1}: {e}") from None
        if target > max_bytes:
            raise ValueError(f"line {i + 1}: the delta makes a file of {target} bytes, over the limit of "
                             f"{max_bytes} (ROW_LIMITS['file'])")
    return kind, out, j + 1


def binary_problem(diff: str | bytes, max_bytes: int = 16 << 20) -> str | None:
    """Why git apply would refuse a binary file's change in `diff` (one line naming the line and the
    file), or None: a binary change without a full index line, a `Binary files ... differ` that is not a
    deletion (no data), `GIT binary patch` data git cannot read (bad base85, not zlib, a size that is
    not the block's), a literal whose blob id is not the index line's, a block over `max_bytes`."""
    text = to_bytes(diff).decode("utf-8", "surrogateescape") if diff else ""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        if not lines[i].startswith("diff --git "):
            i += 1
            continue
        start, pair = i, _header_pair(lines[i][len("diff --git "):])
        path = (_strip(pair[1]) or _strip(pair[0]) or "?") if pair else "?"
        ids, j, problem = None, i + 1, None
        where = f"file {path[:80]!r} (diff --git at line {start + 1})"
        while j < len(lines) and not lines[j].startswith("diff --git "):
            h = lines[j]
            if (m := _INDEX.match(h)) and ids is None:
                ids = (m.group(1), m.group(2))
            elif h.startswith("@@"):
                break    # a text file's hunks: not binary
            elif h.startswith("Binary files ") and h.endswith(" differ") or h == "GIT binary patch":
                full = ids is not None and len(ids[0]) == len(ids[1]) and len(ids[0]) in (40, 64)
                if not full:
                    problem = (f"{where}: a binary change without a full index line (index <{40} hex>..<{40} "
                               f"hex>: git diff --binary writes it); git apply refuses it")
                elif h != "GIT binary patch":
                    if set(ids[1]) != {"0"}:
                        problem = (f"{where}: 'Binary files ... differ' carries no data (git diff without "
                                   f"--binary); git apply cannot make the new file")
                else:
                    try:
                        kind, data, j = _binary_block(lines, j + 1, max_bytes)
                        if kind == "literal":
                            new = ids[1]
                            got = _blob_id(data, len(new))
                            if (set(new) == {"0"} and data) or (set(new) != {"0"} and got != new):
                                problem = (f"{where}: the literal's bytes are blob {got}, the index line says "
                                           f"{new}; git apply refuses the result")
                        if problem is None and j < len(lines) and _BLOCK.match(lines[j]):
                            kind, data, j = _binary_block(lines, j, max_bytes)   # the reverse block
                    except ValueError as e:
                        problem = f"{where}: {e}"
                    j -= 1
                break
            j += 1
        if problem:
            return problem
        i = max(j, start + 1)
    return None


def touched(diff: str | bytes) -> list[str]:
    """Every path a diff reads or writes (both sides of a rename), in order, once each."""
    return list(dict.fromkeys(p for c in changes(diff) for p in c.paths))


def git_env(tree: str) -> dict[str, str]:
    import os
    return {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", "HOME": "/tmp",
            "GIT_CEILING_DIRECTORIES": os.path.dirname(tree.rstrip("/")) or "/", "LC_ALL": "C"}


@dataclass(frozen=True)
class Applied:
    ok: bool
    tool: str    # "git apply", "patch", or "" when neither applied
    output: str  # what the tools said (every attempt's, when none applied)


def apply(rt, diff: str | bytes, timeout_s: float = 60) -> Applied:
    """Apply `diff` (-p1) in the sandbox `rt`'s tree: git apply, else GNU patch (dry run, then for
    real). Nothing is applied when it returns ok=False."""
    data = to_bytes(diff)
    if not data.strip():
        return Applied(True, "", "")
    if not data.endswith(b"\n"):
        data += b"\n"
    env = git_env(str(rt.tree))
    r = rt.run(GIT_APPLY + ["-"], timeout_s=timeout_s, input=data, env=env)
    said = [f"git apply: {(r.stdout + r.stderr).strip()}"]
    if r.returncode == 0:
        return Applied(True, "git apply", said[0])
    if not any(c.binary for c in changes(data)):  # GNU patch cannot do binary files
        dry = rt.run(GNU_PATCH + ["--dry-run"], timeout_s=timeout_s, input=data)
        said.append(f"patch --dry-run: {(dry.stdout + dry.stderr).strip()}")
        if dry.returncode == 0:
            r = rt.run(GNU_PATCH, timeout_s=timeout_s, input=data)
            said.append(f"patch: {(r.stdout + r.stderr).strip()}")
            if r.returncode == 0:
                return Applied(True, "patch", "\n".join(said))
    return Applied(False, "", "\n".join(said))
