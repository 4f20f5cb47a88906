"""Creating and reopening run directories.

A run directory is frozen at its first submission: `config.yaml` (the composed, resolved config),
`plan.json`, `job.sbatch` (Slurm only) and `submissions.jsonl` (one line per submission). Submitting
again into the same directory is a resume: the new config must equal the frozen one except for keys
that may change between incarnations (more steps, other cluster settings); anything else is an error
that names the first differing key, so a resume never silently trains a different run.

What may be a run directory is checked before anything is written, started or submitted
(`check_run_dir_choice`, docs/run-directory-safety.md): a new directory, or an existing run directory
(config.yaml, or only names hetrl makes there: a first launch that stopped before freezing). Refused, in
one line naming the value: `/`, system directories and anything under them, `$HOME` itself, a path with
`%` (Slurm expands it in --output and --chdir, so logs and the job's working directory would go
elsewhere), the current directory when it is not a run, and a non-empty directory that is not a run
(launching into `~/project` would scatter run files among the user's own and later prune them). The
value is resolved once here (`safefs.resolve_run_dir`): a run under a symlinked path (/scratch ->
/lustre/scratch) is named by its real path, and every write below it goes through rl.contract.safefs,
which refuses any link found there afterwards.
"""
from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import yaml

from rl.contract import paths, safefs
from rl.contract.config import ClusterConfig, ConfigError
from rl.contract.plan import Plan
from rl.contract.secret import create_secret
from rl.contract.atomic import atomic_write_json, atomic_write_text

# Keys a resume may change. Everything else must match the frozen config.
RESUMABLE_PREFIXES = ("trainer.max_steps", "cluster.", "wandb.", "inference.startup_timeout_s",
                      "inference.port", "hydra")


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_diff(old: dict, new: dict) -> list[str]:
    fo, fn = _flatten(old), _flatten(new)
    keys = sorted(set(fo) | set(fn))
    return [k for k in keys if fo.get(k, "<unset>") != fn.get(k, "<unset>")
            and not k.startswith(RESUMABLE_PREFIXES)]


# Refused with everything under them: the system's own trees.
SYSTEM_TREES = ("/etc", "/usr", "/bin", "/sbin", "/boot", "/dev", "/proc", "/sys", "/lib", "/lib32", "/lib64",
                "/libx32", "/snap", "/var")
# Refused themselves (the places runs go are below them), as is $HOME.
SYSTEM_DIRS = ("/", "/home", "/tmp", "/opt", "/srv", "/mnt", "/media", "/root", "/run", "/scratch", "/var/tmp")
# Writable scratch inside a refused tree.
SYSTEM_SCRATCH = ("/var/tmp",)


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def is_run_dir(path: Path) -> bool:
    """`path` is a directory hetrl made: config.yaml in it, or nothing but names hetrl makes there (a first
    launch that stopped before config.yaml), including their hidden temp files (`.config.yaml.tmp-...`)."""
    listing = safefs.scandir(path)
    for name, mode in listing:  # nothing hetrl makes is a link: one at the top is planted, refused early
        if stat.S_ISLNK(mode):
            raise safefs.UnsafePath(f"{path / name}: a symlink (to {os.readlink(path / name)}); hetrl never "
                                    f"follows links in a run directory: remove it")
    entries = [name for name, _ in listing]
    if paths.CONFIG in entries:
        return True
    return all(name in paths.RUN_ENTRIES or name.lstrip(".").split(".tmp-")[0].split(".pending-")[0]
               in paths.RUN_ENTRIES for name in entries)


def check_run_dir_choice(run_dir: str | os.PathLike) -> Path:
    """The run directory by its real path, after refusing (ConfigError, one line naming the value) one that
    is not a new directory or an existing run directory (module docstring). Writes nothing."""
    given = os.fspath(run_dir)
    if not given:
        raise ConfigError("run_dir: empty")
    if "%" in given:
        raise ConfigError(f"run_dir={given!r}: contains '%', which Slurm expands in --output and --chdir "
                          f"(%j, %u, ...): choose a path without it")
    real = safefs.resolve_run_dir(given)
    shown = given if str(real) == given else f"{given} (= {real})"
    if "%" in str(real):
        raise ConfigError(f"run_dir={shown!r}: contains '%', which Slurm expands in --output and --chdir: "
                          f"choose a path without it")
    r = str(real)
    home = os.path.realpath(os.path.expanduser("~"))
    if (any(_under(r, t) for t in SYSTEM_TREES) and not any(_under(r, t) for t in SYSTEM_SCRATCH)) \
            or r in SYSTEM_DIRS:
        raise ConfigError(f"run_dir={shown!r}: a system directory; a run needs a directory of its own "
                          f"(e.g. runs/NAME or /scratch/$USER/NAME)")
    if r == home:
        raise ConfigError(f"run_dir={shown!r}: your home directory itself; a run needs a directory of its own "
                          f"(e.g. ~/runs/NAME)")
    probe = real
    while not os.path.lexists(probe) and probe != probe.parent:
        probe = probe.parent  # the nearest existing ancestor: a file there makes the path impossible
    if probe != real and not os.path.islink(probe) and not os.path.isdir(probe):
        raise ConfigError(f"run_dir={shown!r}: {probe} is not a directory")
    try:
        st = safefs.lstat(real)
        if st is not None and not stat.S_ISDIR(st.st_mode) and not stat.S_ISLNK(st.st_mode):
            raise ConfigError(f"run_dir={shown!r}: exists and is not a directory")
        run = st is not None and is_run_dir(real)
        if run:   # the trust boundary: a run directory someone else owns or can write is not resumed
            safefs.check_run_dir_private(real, paths.PRIVATE_DIRS)
    except safefs.UnsafePath as e:
        raise ConfigError(f"run_dir={shown!r}: {e}") from None
    except PermissionError as e:
        raise ConfigError(f"run_dir={shown!r}: cannot be read ({e.strerror})") from None
    if st is not None and not run:
        if r == os.path.realpath(os.getcwd()):
            raise ConfigError(f"run_dir={shown!r}: the current directory, which is not a run directory (no "
                              f"{paths.CONFIG}); name a new directory for the run")
        raise ConfigError(f"run_dir={shown!r}: a non-empty directory that is not a run directory (no "
                          f"{paths.CONFIG}); name a new directory, or an existing run to resume it")
    return real


def load_frozen(run_dir: Path) -> dict | None:
    try:
        return yaml.safe_load(safefs.read_text(paths.config_file(run_dir), limit=16 << 20))
    except FileNotFoundError:
        return None


def check_resume(cfg: dict, run_dir: str | os.PathLike) -> bool:
    """Refuse a config that differs from the run's frozen one in a key a resume may not change (one line
    naming the key). Returns True if `run_dir` holds a frozen run (this is a resume). Writes nothing."""
    run_dir = Path(run_dir).absolute()
    cfg = {k: v for k, v in cfg.items() if k != "_overrides"}
    try:
        old = load_frozen(run_dir)
    except safefs.UnsafePath as e:
        raise ConfigError(f"{e}") from None
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{paths.config_file(run_dir)}: cannot be read ({' '.join(str(e).split())})") from None
    if old is None:
        return False
    diff = config_diff(old, cfg)
    if diff:
        k = diff[0]
        raise ConfigError(f"{k}: differs from the frozen config of {run_dir} "
                          f"({_flatten(old).get(k, '<unset>')!r} -> {_flatten(cfg).get(k, '<unset>')!r}); "
                          f"a resume cannot change it (use a new run_dir)")
    return True


def freeze_run_dir(cfg: dict, run_dir: str | os.PathLike, plan: Plan, script: str | None = None,
                   backend: str | None = None) -> bool:
    """Write (or check) the frozen files. Returns True if this is a resume of an existing run. Every write
    goes through rl.contract.safefs: a link planted anywhere below the run directory is refused.
    `backend` (recorded in submissions.jsonl) defaults to the config's cluster.backend."""
    run_dir = check_run_dir_choice(Path(run_dir).absolute())
    cfg = {k: v for k, v in cfg.items() if k != "_overrides"}  # the command line, not config
    if backend is None:   # the schema's default where the config omits it
        backend = (cfg.get("cluster") or {}).get("backend", ClusterConfig.backend)
    resuming = check_resume(cfg, run_dir)
    for sub in paths.SUBDIRS:
        safefs.makedirs(run_dir / sub)
    # The resumable keys may change, so the frozen files always hold the newest submission's values.
    atomic_write_text(paths.config_file(run_dir), yaml.safe_dump(cfg, sort_keys=False))
    atomic_write_json(paths.plan_file(run_dir), plan.to_dict())
    if script is not None:
        atomic_write_text(paths.p(run_dir, paths.JOB_SCRIPT), script)
    # written whole or not at all (temp 0600 + fsync + link/rename); an empty or short one a crash left
    # behind is replaced, since servers would otherwise refuse to start (rl/contract/secret.py)
    create_secret(run_dir)
    safefs.append_bytes(paths.p(run_dir, paths.SUBMISSIONS),
                        (json.dumps({"time": time.time(), "backend": backend, "resume": resuming}) + "\n").encode())
    return resuming
