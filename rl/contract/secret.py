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

Torch-free and imports nothing else of rl (rl/contract's rule).
"""
from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

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


def _read(path: Path) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise SecretError(f"{path}: not a regular file; the run's secret must be one")
        return f.read(4096).decode("utf-8", "replace")


def read_secret(run_dir: str | os.PathLike) -> str:
    """The run's secret; SecretError (one line) when the file is missing, empty or short."""
    path = _file(run_dir)
    try:
        text = _read(path)
    except OSError as e:
        raise SecretError(f"{path}: cannot be read ({e.strerror or e}); servers do not start without the "
                          "run's secret") from None
    why = _problem(text)
    if why:
        raise SecretError(f"{path}: {why}: servers do not start without the run's secret (re-submit the "
                          "run to write a new one)")
    return text.strip()


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
    True if it wrote one."""
    path = _file(run_dir)
    try:
        if _problem(_read(path)) is None:
            return False
    except SecretError:
        pass  # not a regular file: replaced below (rename replaces the entry, never writes through it)
    tmp = path.with_name(f".{SECRET}.tmp-{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
            f.flush()
            os.fsync(f.fileno())
        try:  # absent: link() creates it only if no other launcher did meanwhile (theirs is then kept)
            os.link(tmp, path)
        except FileExistsError:
            try:
                good = _problem(_read(path)) is None
            except SecretError:
                good = False
            if good:
                return False
            os.replace(tmp, path)  # damaged (empty or short): replaced whole, never seen half-written
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return True
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
