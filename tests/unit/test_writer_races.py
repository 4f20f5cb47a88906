"""A polling attacker races the library writers (issue 49: no exemptions by file).

A library that writes by path (torch's distributed checkpoint, safetensors' save_file) resolves the path
again for every file. Someone who can rename entries in the directory above a step's private tmp dir
(`kind/step_N.tmp-<random>`) could move that directory aside and put a symlink to a victim directory at
its name while the library writes: the rest of the files land in the victim (a polling attacker won 2 of
2 against `dcp.save`). The writers now hand libraries `/proc/self/fd/<fd>` of the directory they opened
and checked (rl.contract.privdirs.pinned_dir), which no rename changes.

Here a child process running as uid 65534 (`nobody`) polls a kind directory made writable by everyone
(0o777: the entry points refuse such a run directory, so the writers are called directly, to show that
the writer itself holds) and swaps every `*.tmp-*` directory it sees for a symlink to a victim directory,
then puts it back, a thousand times, while the checkpoint writer and the node-local model copy write in a
loop. The victim must stay untouched. The same attacker against a path-based writer (what the checkpoint
did before: `dcp.save(checkpoint_id=str(tmp / "dcp"))`) wins, so this test is one that can fail.

The node-local model copy lives below a directory of this user's own (`<base>/hetrl-<uid>`): one another
user made first, with a copy whose config.json names remote code, is refused in one line and never used.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import tempfile
import time
from pathlib import Path

import pytest

NOBODY = 65534
TRIES = 1000
TMP_MARK = ".tmp-"

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="O_PATH, /proc/self/fd and setuid are Linux's"),
    pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user (uid 65534) needs root"),
]


# -- another user, for real: a forked child that drops to uid/gid 65534 -------------------------------
def _as_nobody(fn, *args) -> int:
    """Fork a child that drops to uid/gid 65534 and runs fn(*args); its pid. It reports fn's result (an
    int) or its error on the pipe `_reap` reads."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only os calls from here, then _exit (no pytest, no atexit)
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            out = fn(*args)
            os.write(w, f"ok {int(out or 0)}".encode())
            code = 0
        except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the test
            try:
                os.write(w, f"error {type(e).__name__}: {e}".encode())
            except OSError:
                pass
        finally:
            os._exit(code)
    os.close(w)
    _CHILDREN[pid] = r
    return pid


_CHILDREN: dict[int, int] = {}   # pid -> the read end of its report pipe
_REAPED: set[int] = set()


def _done(pid: int) -> bool:
    """Whether the child has exited (reaped here)."""
    if pid not in _REAPED and os.waitpid(pid, os.WNOHANG)[0] == pid:
        _REAPED.add(pid)
    return pid in _REAPED


def _reap(pid: int, timeout: float = 30.0) -> int:
    """Wait for the child; the int it reported (AssertionError with its error otherwise)."""
    deadline = time.monotonic() + timeout
    while not _done(pid):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            _REAPED.add(pid)
            break
        time.sleep(0.01)
    r = _CHILDREN.pop(pid)
    try:
        msg = os.read(r, 4096).decode()
    finally:
        os.close(r)
    assert msg.startswith("ok "), f"the uid {NOBODY} child failed: {msg or 'no report'}"
    return int(msg.split()[1])


def _attack(kind_dir: str, victim: str, stop: str, tries: int, hold_s: float) -> int:
    """The attacker (runs as uid 65534): poll `kind_dir`; every `*.tmp-*` directory seen is renamed
    aside, a symlink to `victim` put at its name for `hold_s`, then the directory put back (so the writer
    goes on writing and the race has many chances). Returns how many swaps it made."""
    done = n = 0
    while done < tries and not os.path.exists(stop):
        try:
            names = os.listdir(kind_dir)
        except OSError:
            continue
        for name in names:
            if TMP_MARK not in name:
                continue
            p = os.path.join(kind_dir, name)
            try:
                if not stat.S_ISDIR(os.lstat(p).st_mode):
                    continue
            except OSError:
                continue
            aside = os.path.join(kind_dir, f".moved-{n}")
            n += 1
            try:
                os.rename(p, aside)
            except OSError:
                continue
            try:
                os.symlink(victim, p)
                done += 1
                time.sleep(hold_s)
                os.unlink(p)
            except OSError:
                pass
            try:
                os.rename(aside, p)
            except OSError:
                pass
    return done


def _make_as_nobody(root: str, files: dict) -> int:
    """(runs as uid 65534) make the directories and files {relative path: bytes} under `root`."""
    for rel, data in files.items():
        p = os.path.join(root, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(data)
    return len(files)


# -- fixtures -------------------------------------------------------------------------------------------
@pytest.fixture
def shared():
    """A directory uid 65534 can reach (pytest's tmp_path is 0700, root's alone)."""
    d = Path(tempfile.mkdtemp(prefix="hetrl-races-", dir="/tmp"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        for pid in list(_CHILDREN):  # a test that failed before reaping its attacker
            if not _done(pid):
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                _REAPED.add(pid)
            os.close(_CHILDREN.pop(pid))
        shutil.rmtree(d, ignore_errors=True)


def _open_kind(run: Path, kind: str) -> Path:
    """RUN/kind writable by everyone (no sticky bit): the directory an attacker renames entries in."""
    run.mkdir(mode=0o755, exist_ok=True)
    os.chmod(run, 0o755)
    d = run / kind
    d.mkdir(exist_ok=True)
    os.chmod(d, 0o777)
    return d


def _victim(base: Path) -> Path:
    v = base / "victim"
    v.mkdir(mode=0o755)
    (v / "keep.txt").write_bytes(b"the user's own file\n")
    return v


def _snapshot(p: Path) -> dict:
    return {str(x.relative_to(p)): (x.read_bytes() if x.is_file() else None) for x in sorted(p.rglob("*"))}


def _trainer(run: Path):
    from omegaconf import OmegaConf
    from rl.contract.config import Config
    from rl.trainer.train import Trainer
    cfg = OmegaConf.structured(Config)
    cfg.run_dir, cfg.wandb.mode, cfg.model.max_seq_len = str(run), "disabled", 64
    return Trainer(cfg)


# How a pinned writer may fail under the attack: it refuses the link it finds at its tmp dir's name
# (UnsafePath), or finds the name gone or not a directory at commit; never anything else.
HELD = ("UnsafePath: ", "FileNotFoundError: ", "ValueError: ", "FileExistsError: ")


def _check_held(writes: int, refused: list[str]) -> None:
    odd = [m for m in refused if not m.startswith(HELD) or "\n" in m]
    assert not odd, f"a pinned writer failed otherwise than by refusing: {odd[0]}"
    assert writes - len(refused) >= 1, f"no write of {writes} completed under the attack: {refused[:1]}"


def _race(kind_dir: Path, victim: Path, stop: Path, write, *, seconds: float, until_win: bool = False,
          hold_s: float = 0.0005) -> tuple[int, int, list[str]]:
    """Run `write(i)` in a loop while the attacker swaps; (attacker's swaps, writes, refusals seen). With
    `until_win`, stop as soon as the victim changed."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
    before = _snapshot(victim)
    pid = _as_nobody(_attack, str(kind_dir), str(victim), str(stop), TRIES, hold_s)
    writes, refused = 0, []
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline and not _done(pid):
            try:
                write(writes)
            except (Exception, CheckpointException) as e:  # refused, or (a path-based writer) a file lost
                refused.append(f"{type(e).__name__}: {e}")
            writes += 1
            if until_win and _snapshot(victim) != before:
                break
    finally:
        stop.touch()
    return _reap(pid), writes, refused


# -- the checkpoint writer ------------------------------------------------------------------------------
def test_the_checkpoint_writer_holds_against_a_polling_attacker(shared):
    from rl.trainer import checkpoint as ckpt
    run = shared / "run"
    kind = _open_kind(run, ckpt.KIND)
    victim = _victim(shared)
    before = _snapshot(victim)
    tr = _trainer(run)

    def write(i):
        ckpt.save(run, i % 4, tr.model, tr.optimizer, tr.progress)

    swaps, writes, refused = _race(kind, victim, shared / "stop", write, seconds=40)
    assert _snapshot(victim) == before, "the checkpoint writer wrote into the victim through a swapped link"
    assert swaps >= TRIES, f"the attacker swapped only {swaps} times in {writes} saves"
    assert writes >= 5, f"only {writes} saves ran"
    _check_held(writes, refused)
    assert not list(victim.rglob("*.distcp")) and not (victim / ckpt.DCP_DIR).exists()


def test_a_path_based_writer_loses_to_the_same_attacker(shared):
    """What the checkpoint did before (DCP handed the tmp dir's name): the attacker gets files written into
    the victim. Proves the race above is one the attacker can win."""
    import torch.distributed.checkpoint as dcp
    from rl import exchange
    from rl.trainer import checkpoint as ckpt
    run = shared / "run"
    kind = _open_kind(run, ckpt.KIND)
    victim = _victim(shared)
    before = _snapshot(victim)
    tr = _trainer(run)

    def write(i):
        tmp = exchange.begin(run, ckpt.KIND, i)
        with ckpt._quiet():
            dcp.save(ckpt._stateful(tr.model, None), checkpoint_id=str(tmp / ckpt.DCP_DIR))

    swaps, writes, _ = _race(kind, victim, shared / "stop", write, seconds=30, until_win=True, hold_s=0.002)
    assert _snapshot(victim) != before, (f"the attacker never won against a path-based writer ({swaps} swaps, "
                                         f"{writes} saves): the race test above proves nothing")


# -- the node-local model copy ------------------------------------------------------------------------------
def _weights(base: Path):
    """A published weights step and an assets directory, private to root (like a run's own)."""
    import torch
    from rl import exchange
    from rl.exchange.weights import write_shards
    src = base / "src"
    src.mkdir(mode=0o700)
    assets = src / "assets"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    (assets / "tokenizer.json").write_text("{}")
    g = torch.Generator().manual_seed(0)
    sd = {f"model.layers.{i}.self_attn.q_proj.weight": torch.randn(64, 64, generator=g) for i in range(4)}
    w = exchange.publish(src, "weights", 0, lambda d: write_shards(d, sd, max_shard_bytes=8192),
                         producer="t").path
    return assets, w


def test_the_model_copy_holds_against_a_polling_attacker(shared):
    import torch
    from rl.exchange.shard_reader import ShardReader
    from rl.inference import model_dir
    assets, w = _weights(shared)
    node = _open_kind(shared / "node", "n1")   # the copy's directory, writable by everyone
    victim = _victim(shared)
    before = _snapshot(victim)
    out = node / "model0"

    def write(i):
        dtype = (torch.float32, torch.bfloat16)[i % 2]  # another dtype each time: really swapped in
        source = model_dir._source(w, dtype=dtype, fp8=False)
        model_dir._build(assets, w, out, source, ShardReader(w), dtype=dtype, fp8=False)

    swaps, writes, refused = _race(node, victim, shared / "stop", write, seconds=40)
    assert _snapshot(victim) == before, "the model copy was written into the victim through a swapped link"
    assert swaps >= TRIES, f"the attacker swapped only {swaps} times in {writes} copies"
    assert writes >= 5, f"only {writes} copies ran"
    _check_held(writes, refused)


def test_a_node_local_copy_another_user_made_first_is_refused_and_never_used(shared):
    """uid 65534 pre-makes this user's node-local directory under a shared base (/tmp-like, 1777) with a
    copy of exactly the step this replica loads and a config.json naming remote code: the old code reused
    it (vLLM would import what auto_map names). Now claim and materialize refuse it in one line."""
    import torch
    from rl.contract import paths, privdirs, safefs
    from rl.inference import model_dir
    assets, w = _weights(shared)
    base = shared / "nl"
    base.mkdir()
    os.chmod(base, 0o1777)
    run_dir = shared / "run"
    local = Path(paths.node_local_dir(str(base), run_dir))
    assert local.parent.name == f"hetrl-{os.geteuid()}"
    out = Path(paths.node_model_dir(str(local), 0))
    planted = json.dumps({"auto_map": {"AutoModelForCausalLM": "evil.Model"}, "torch_dtype": "float32"}).encode()
    source = json.dumps(model_dir._source(w, dtype=torch.float32, fp8=False)).encode()
    rel = os.path.relpath(out, base)
    pid = _as_nobody(_make_as_nobody, str(base), {f"{rel}/config.json": planted, f"{rel}/evil.py": b"boom()\n",
                                                  f"{rel}/{model_dir.SOURCE_FILE}": source})
    assert _reap(pid) == 3
    for call in (lambda: model_dir.claim(local, run_dir, "inference_0"),
                 lambda: model_dir.materialize(assets, w, out, dtype=torch.float32, fp8=False)):
        with pytest.raises(safefs.UnsafePath) as e:
            call()
        msg = str(e.value)
        assert "\n" not in msg and f"owned by uid {NOBODY}" in msg and str(local.parent) in msg, msg
    assert (out / "config.json").read_bytes() == planted  # left alone, never rewritten or used
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", "evil.py", model_dir.SOURCE_FILE])
    assert not list(local.glob("owner*.json"))


def test_the_node_local_base_and_this_users_directory(shared):
    """A base everyone can write without the sticky bit is refused (anyone could rename the user's
    directory away and put theirs in its place); under a sticky base the user's directory is made 0700
    and the copy is made and reused."""
    import torch
    from rl.contract import paths, privdirs, safefs
    from rl.inference import model_dir
    assets, w = _weights(shared)
    open_base = shared / "open"
    open_base.mkdir()
    os.chmod(open_base, 0o777)
    local = Path(paths.node_local_dir(str(open_base), shared / "run"))
    with pytest.raises(safefs.UnsafePath, match="without the sticky bit") as e:
        model_dir.claim(local, shared / "run", "inference_0")
    assert "\n" not in str(e.value) and str(open_base) in str(e.value)
    base = shared / "sticky"
    base.mkdir()
    os.chmod(base, 0o1777)
    local = Path(paths.node_local_dir(str(base), shared / "run"))
    model_dir.claim(local, shared / "run", "inference_0")
    assert stat.S_IMODE(local.parent.stat().st_mode) == 0o700 and local.parent.stat().st_uid == os.geteuid()
    out = Path(paths.node_model_dir(str(local), 0))
    got = model_dir.materialize(assets, w, out, dtype=torch.float32, fp8=False)
    ino = (got / model_dir.SOURCE_FILE).stat().st_ino
    assert model_dir.materialize(assets, w, out, dtype=torch.float32, fp8=False) == out
    assert (out / model_dir.SOURCE_FILE).stat().st_ino == ino  # reused: this user's own copy
    assert not [p for p in local.iterdir() if TMP_MARK in p.name]


# -- the pieces: pinned_dir, begin's private tmp dir ---------------------------------------------------------
def test_pinned_dir_takes_only_a_private_directory_of_this_user(shared):
    """pinned_dir refuses, in one line naming it, a link, a directory others can use, and one another user
    owns; below what it hands out, safefs works (and still follows no link)."""
    from rl.contract import privdirs, safefs
    d = shared / "mine"
    d.mkdir(mode=0o700)
    os.chmod(d, 0o700)
    (shared / "link").symlink_to(d)
    theirs = shared / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    open_ = shared / "open"
    open_.mkdir()
    os.chmod(open_, 0o755)
    for bad, words in ((shared / "link", "symlink"), (open_, "mode 0755"), (theirs, f"owned by uid {NOBODY}")):
        with pytest.raises(safefs.UnsafePath, match=words) as e:
            with privdirs.pinned_dir(bad):
                pass
        assert "\n" not in str(e.value) and str(bad) in str(e.value)
    with privdirs.pinned_dir(d) as p:
        assert str(p).startswith("/proc/self/fd/")
        safefs.write_atomic(p / "sub" / "a.json", b"{}")
        safefs.append_bytes(p / "log.jsonl", b"x\n")
        (p / "sub" / "evil").symlink_to(shared)
        with pytest.raises(safefs.UnsafePath, match="symlink") as e:
            safefs.append_bytes(p / "sub" / "evil" / "f", b"x")
        assert str(d / "sub" / "evil") in str(e.value)  # named by the directory's own path
    assert (d / "sub" / "a.json").read_bytes() == b"{}" and (d / "log.jsonl").read_bytes() == b"x\n"
    assert not (shared / "f").exists()


def test_a_step_is_written_private_and_published_readable(shared):
    """begin() makes the tmp dir 0700 (the shared token's too, tightened if this user made it wider);
    the writer is handed the pinned path; the published step reads as before (0755 under umask 022)."""
    from rl import exchange
    from rl.contract import privdirs, safefs
    run = shared / "run"
    seen = []

    def write(d):
        seen.append((str(d), stat.S_IMODE(os.stat(d).st_mode)))
        (d / "f").write_bytes(b"x")

    old = os.umask(0o022)
    try:
        pub = exchange.publish(run, "rollouts", 1, write, producer="t")
        (run / "weights" / "step_000002.tmp-tok").mkdir(parents=True, mode=0o755)
        tmp = exchange.begin(run, "weights", 2, token="tok")
    finally:
        os.umask(old)
    assert seen[0][0].startswith("/proc/self/fd/") and seen[0][1] == 0o700
    assert stat.S_IMODE(pub.path.stat().st_mode) == 0o755 and exchange.verify(pub.path)
    assert stat.S_IMODE(tmp.stat().st_mode) == 0o700
    os.chown(tmp, NOBODY, NOBODY)
    with pytest.raises(safefs.UnsafePath, match=f"owned by uid {NOBODY}"):
        exchange.begin(run, "weights", 2, token="tok")
