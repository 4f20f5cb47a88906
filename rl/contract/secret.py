"""The run's secret (`RUN_DIR/secret`): written once with its content, read by every server of the run.

vLLM, the router and the sandbox service use it as a bearer token. A server that finds no usable secret
must not start: a file that is missing, empty or short (a crash between creating it and writing it left
it so; an empty token would make every server open to anyone who can reach its port) is an error of one
line, never "serve without a token". `create_secret` therefore writes the content to a temporary file
(mode 0600), fsyncs it and links or renames it into place, so the file is never seen without its content;
a short one found there is replaced.

A run deliberately without a secret (tests that talk to servers without a token remove the file) must
say so: `secret_or_none` returns None for a missing file only when `HETRL_UNAUTHENTICATED=1` (the same
switch rl.inference.auth honours); an empty or short file is refused even then, as it is the signature of
the crash above, not of a choice.

The file is opened and written through rl.contract.safefs (no link followed, no FIFO opened), and it must
be the user's own with mode 0600: a secret others can read is no secret, so it is refused in one line
(chmod 600) rather than used.

Torch-free; imports nothing of rl but its sibling rl.contract.safefs (rl/contract's rule).
"""
from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from rl.contract import safefs

SECRET = "secret"                     # rl.contract.paths.SECRET: the same name, not imported (no rl imports)
MIN_CHARS = 32                        # token_hex(16): 128 bits; anything shorter is a damaged file
UNAUTHENTICATED_ENV = "HETRL_UNAUTHENTICATED"  # rl.inference.auth.UNAUTHENTICATED_ENV


class SecretError(RuntimeError):
    pass


def _file(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / SECRET


def _problem(text: str | None) -> str | None:
    """Why `text` (None: no file) is not a usable secret, None if it is."""
    if text is None:
        return "missing"
    if not text.strip():
        return "empty"
    if len(text.strip()) < MIN_CHARS:
        return f"short ({len(text.strip())} chars, at least {MIN_CHARS})"
    if any(c.isspace() for c in text.strip()):
        return "holds whitespace (not a token)"
    return None


def _read(path: Path) -> tuple[str, os.stat_result] | None:
    """(text, stat) of the secret file, None when missing. Opened through rl.contract.safefs: a symlink
    at it or on the way, a FIFO or a device is SecretError (one line), never followed or blocked on."""
    try:   # owner and mode are checked below with the secret's own, stricter rule (0600) and advice
        fd = safefs.open_read(path, foreign=True)
    except FileNotFoundError:
        return None
    except safefs.UnsafePath as e:
        raise SecretError(f"{e}; the run's secret must be a regular file") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        return f.read(4096).decode("utf-8", "replace"), st


def _access_problem(path: Path, st: os.stat_result) -> str | None:
    """Why a secret with this owner and mode may be known to someone else, None if it may not."""
    if st.st_uid != os.getuid():
        return (f"{path}: owned by uid {st.st_uid}, not by this user (uid {os.getuid()}); the run's secret "
                f"must be this user's own file (remove it and re-submit the run to write a new one)")
    if stat.S_IMODE(st.st_mode) & 0o077:
        return (f"{path}: mode {stat.S_IMODE(st.st_mode):04o}, readable or writable by others; the run's "
                f"secret must be mode 0600 (chmod 600 {path}, or remove it and re-submit the run for a new "
                f"one if others may have read it)")
    return None


def read_secret(run_dir: str | os.PathLike) -> str:
    """The run's secret; SecretError (one line) when the file is missing, empty, short, not a regular
    file, someone else's, or readable by others (mode other than 0600)."""
    path = _file(run_dir)
    try:
        got = _read(path)
    except SecretError:
        raise
    except OSError as e:
        raise SecretError(f"{path}: cannot be read ({e.strerror or e}); servers do not start without the "
                          "run's secret") from None
    why = _problem(None if got is None else got[0])
    if why:
        raise SecretError(f"{path}: {why}: servers do not start without the run's secret (re-submit the "
                          "run to write a new one)")
    if bad := _access_problem(path, got[1]):
        raise SecretError(bad)
    return got[0].strip()


def secret_or_none(run_dir: str | os.PathLike, env=None) -> str | None:
    """read_secret, except that a *missing* file gives None when the run says it has no secret on purpose
    (HETRL_UNAUTHENTICATED=1 in `env`, default os.environ)."""
    env = os.environ if env is None else env
    if env.get(UNAUTHENTICATED_ENV) == "1" and not os.path.lexists(_file(run_dir)):
        return None
    return read_secret(run_dir)


def create_secret(run_dir: str | os.PathLike) -> bool:
    """Make sure RUN_DIR/secret holds a usable secret: keep a good one, else write a new one atomically
    (temp file 0600, write, fsync, then link into place if absent or rename over a damaged one). Returns
    True if it wrote one. Refused (SecretError, one line) rather than replaced: a good secret that is
    someone else's or readable by others (the user decides: chmod 600, or remove it), and a symlink, FIFO
    or directory in its place (planted: never written through, and not silently removed either). Every
    operation is relative to the run directory opened by rl.contract.safefs (no link followed)."""
    path = _file(run_dir)
    got = _read(path)
    if got is not None and _problem(got[0]) is None:
        if bad := _access_problem(path, got[1]):
            raise SecretError(bad)
        return False
    dfd = safefs.open_dir(path.parent, create=True)
    tmp = f".{SECRET}.tmp-{secrets.token_hex(8)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        try:
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), 0o600)  # whatever the umask
                f.write(secrets.token_hex(32))
                f.flush()
                os.fsync(f.fileno())
            try:  # absent: link() creates it only if no other launcher did meanwhile (theirs is then kept)
                os.link(tmp, SECRET, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
            except FileExistsError:
                try:
                    now = _read(path)
                except SecretError:
                    raise
                if now is not None and _problem(now[0]) is None:
                    return False
                # damaged (empty or short): replaced whole, never seen half-written
                os.replace(tmp, SECRET, src_dir_fd=dfd, dst_dir_fd=dfd)
            rfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dfd)
            try:
                os.fsync(rfd)
            finally:
                os.close(rfd)
            return True
        finally:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except FileNotFoundError:
                pass
    finally:
        os.close(dfd)
