"""`python -m launch {run,plan,status,resume,cancel,logs,export,report,doctor}`: the user's entry point.

  run [-m] [OVERRIDES...]   compose, validate, plan, then run locally (cluster=local, the default) or
                            submit one heterogeneous Slurm job per point (cluster=slurm) and return
  plan [OVERRIDES...]       print the allocation plan and the batch script, submit nothing
  status RUN_DIR            job state and progress read from the run directory
  resume RUN_DIR            start or resubmit a run from its frozen config; it resumes from the newest
                            complete checkpoint
  cancel RUN_DIR            stop the run (Slurm: scancel, its scale jobs too; local: SIGTERM to the roles)
  logs RUN_DIR ROLE         print a role's log (-f to follow)
  doctor [OVERRIDES...]     check packages, devices, kernels, filesystem and Slurm; --gpu runs the
                            trainer and publisher paths (docs/doctor.md)
  export RUN_DIR --out DIR  the trained policy as a Hugging Face checkpoint (docs/export.md)
  report RUN_DIR            one self-contained HTML page about the run (docs/report.md)

Only light dependencies here (hydra, omegaconf, jinja2, rich): no torch, vLLM or torchtitan, so planning
and submitting stay fast on a login node.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rl.contract.config import ConfigError


def _plan(cfg: dict):
    from launch.plan import make_plan
    return make_plan(cfg)


def check_servable(cfg: dict) -> None:
    """Refuse, before anything is written or started, a run whose policy servers would be CPU vLLM
    processes that cannot load the model: otherwise every role starts and the run dies a minute later
    with the inference role's traceback."""
    from rl.contract import families
    from rl.contract.config import typed
    c = typed(cfg)   # the schema's defaults, not ones of its own
    family = c.model.family
    # families whose attention vLLM's CPU build has no kernel for are served on GPUs only (docs/cpu.md)
    why = families.get(family).cpu_unservable
    if why and not c.inference.gpus_per_node:
        raise ConfigError(
            f"model.family={family}: vLLM's CPU build cannot serve {why}; serve it on GPUs "
            f"(cluster=slurm inference.gpus_per_node=N) or, on this machine, use +experiment=kimi_tiny "
            f"(the trainer alone runs here: pytest tests/unit/test_families.py)")


def _launch(cfg: dict) -> tuple[int, str | None]:
    """Run or submit one composed config. Returns (exit status, slurm job id or None)."""
    from launch.backends import executor
    check_servable(cfg)
    plan = _plan(cfg)
    return executor(cfg).submit_run(cfg, plan)   # runs here (local) or submits and returns (slurm)


def cmd_run(ns) -> int:
    from launch.compose import compose_points
    points = compose_points(ns.overrides, ns.multirun)
    if len(points) == 1:
        return _launch(points[0])[0]
    rows = []
    for c in points:
        rc, job = _launch(c)
        rows.append((" ".join(c["_overrides"]), job or ("ok" if rc == 0 else f"exit {rc}"), c["run_dir"]))
    from rich.console import Console
    from rich.table import Table
    from launch.backends import row
    t = Table(title=f"sweep: {len(points)} points")
    for col in ("overrides", "job" if row(points[0]).scheduler else "result", "run dir"):
        t.add_column(col)
    for r in rows:
        t.add_row(*r)
    Console().print(t)
    return 0 if all(not r[1].startswith("exit") for r in rows) else 1


def cmd_plan(ns) -> int:
    from launch.compose import compose_points
    from rich.console import Console
    from rich.table import Table
    from launch.plan import server_lines, summary_rows
    console = Console()
    from launch import memory
    from launch.plan import make_plan
    for c in compose_points(ns.overrides, ns.multirun):
        plan = make_plan(c, check_memory=False)  # the table first, then the refusal (if any)
        t = Table(title=f"plan: {c['experiment']} ({c['cluster']['backend']}) -> {c['run_dir']}")
        for col in ("role", "het group", "nodes", "what"):
            t.add_column(col)
        for row in summary_rows(plan):
            t.add_row(*map(str, row))
        console.print(t)
        print("\n".join(server_lines(plan, bool(c["trainer"]["router_replay"]))))
        print(_model_line(c))
        print(_episode_line(c))
        report = _print_memory(console, c, plan)
        _print_perf(console, c, ns)
        if getattr(ns, "search", False):   # node splits and trainer layouts of the same total (launch/search.py)
            from launch import search
            assume = dict(a.split("=", 1) if "=" in a else (a, "") for a in getattr(ns, "assume", None) or [])
            print("\n".join(search.render(search.search(c, _workload(ns), assume=assume), int(c["inference"]["tp"]),
                                           int(c["inference"]["ep"]) > 1)))
        from launch.backends import executor
        text = executor(c).plan_text(plan, c)   # the batch script a scheduler backend submits
        if text is not None:
            print(text)
        memory.check(report)
    return 0


def _episode_line(cfg: dict) -> str:
    """How long an episode may run: turns, wall time, context summarization (rl.orchestrator.multiturn)."""
    e, o = cfg["env"], cfg["orchestrator"]
    th = list(e.get("summarize_at_tokens") or [])
    return (f"episodes: up to env.max_turns={e['max_turns']} turns, orchestrator.rollout_timeout_s="
            f"{o.get('rollout_timeout_s')}; summarization "
            + (f"on at {', '.join(map(str, th))} context tokens (env.summarize_at_tokens): one training sample "
               f"per context, up to {len(th) + 1} per episode" if th else "off (env.summarize_at_tokens=[])"))


def _workload(ns):
    """The workload of --metrics, else None (the config's defaults, with --assume)."""
    from launch import perf
    return perf.Workload.from_metrics(ns.metrics) if getattr(ns, "metrics", None) else None


def _print_perf(console, cfg: dict, ns) -> None:
    """The step-time prediction (launch.perf, docs/perf.md) under the memory table; with --simulate the
    discrete-event simulation of the pipeline (launch.simulate) fed its component times."""
    from rich.table import Table
    from launch import perf
    assume = dict(a.split("=", 1) if "=" in a else (a, "") for a in getattr(ns, "assume", None) or [])
    metrics = getattr(ns, "metrics", None)
    from launch import calibrate   # the step as low / mid / high over stated coefficient ranges; mid: the table's
    rng = calibrate.ranges(cfg, perf.Workload.from_metrics(metrics) if metrics else None, assume)
    pred = rng.mid
    t = Table(title="predicted seconds per step (estimate; docs/perf.md; overlapped terms in parentheses)")
    rows = perf.table_rows(pred)
    for col in rows[0]:
        t.add_column(col)
    for row in rows[1:]:
        t.add_row(*row)
    console.print(t)
    for n in pred.notes:
        print(f"perf: {n}")
    warn = pred.warning(cfg["cluster"].get("target_step_s"))
    if warn:
        print(f"warning: {warn}")
    print("\n".join(f"perf: {x}" for x in calibrate.range_lines(rng)))
    if getattr(ns, "calibrate", None):
        print("\n".join(f"calibrate: {x}" for x in calibrate.calibrate_lines(cfg, ns.calibrate)))
    if getattr(ns, "simulate", False):
        r = perf.simulate_plan(cfg, pred, metrics)
        print(f"simulated ({r.steps} steps): {r.result.steps_per_hour:.1f} steps/h, trainer idle "
              f"{r.result.trainer_idle:.1%}, inference idle {r.result.inference_idle:.1%}, wasted "
              f"{r.result.wasted_fraction:.1%}, lag " + " ".join(f"{k}:{v / max(sum(r.result.lags.values()), 1):.0%}"
                                                             for k, v in r.result.lags.items())
              + f" ({r.source})")


def _model_line(cfg: dict) -> str:
    """What the trainer builds: family, where its architecture comes from, its size."""
    from launch import memory
    m = cfg["model"]
    p = memory.count_params(memory.Shape.from_cfg(m))
    src = f"{m['hf_path']}/config.json" if m["hf_path"] else "the model group (created here, random init)"
    return (f"model: {m['name']} family {m['family']} from {src}: {p.total / 1e9:.1f}B parameters, "
            f"{p.active / 1e9:.1f}B active, {m['num_experts']} experts top-{m['top_k']}, {m['n_layers']} layers")


def _print_memory(console, cfg: dict, plan: dict):
    """Print the per-GPU memory table of the plan (launch.memory); returns the report."""
    from rich.table import Table
    from launch import memory
    report = memory.estimate(cfg, plan)
    rows = memory.table_rows(report)
    t = Table(title="memory per GPU (estimate; docs/memory.md)")
    for col in rows[0]:
        t.add_column(col)
    for row in rows[1:]:
        t.add_row(*map(str, row))
    console.print(t)
    return report


def _frozen(run_dir: str) -> dict:
    import yaml
    from rl.contract import paths, safefs
    p = paths.config_file(run_dir)
    try:
        cfg = yaml.safe_load(safefs.read_text(p, limit=16 << 20))
    except FileNotFoundError:
        raise ConfigError(f"{p}: not found (is {run_dir} a run directory?)") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: not a YAML config ({' '.join(str(e).split())[:200]})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{p}: not a mapping of config keys")
    return cfg


def cmd_resume(ns) -> int:
    cfg = _frozen(ns.run_dir)
    cfg["run_dir"] = ns.run_dir  # resolved by main (safefs.resolve_run_dir)
    show = getattr(ns, "cfg", None) is not None   # --cfg job: print the config the resume would run, and exit
    if ns.overrides:
        from launch.compose import compose_points
        over = compose_points(list(ns.overrides) + [f"run_dir={cfg['run_dir']}"], False, check=not show)[0]
        over.pop("_overrides", None)
        cfg = over
    from omegaconf import OmegaConf
    if show:
        sys.stdout.write(OmegaConf.to_yaml(OmegaConf.create(cfg)))
        return 0
    from rl.contract.validation import validate
    validate(cfg)
    return _launch(cfg)[0]


def cmd_status(ns) -> int:
    from launch.status import render, status
    st = status(ns.run_dir)
    if ns.json:
        print(json.dumps(st, indent=1, default=str))
    else:
        render(st)
    return 0


def cmd_cancel(ns) -> int:
    from launch.backends import executor
    return executor(_frozen(ns.run_dir)).cancel_command(ns.run_dir)   # Slurm: scancel; local: SIGTERM


def cmd_logs(ns) -> int:
    import os
    from rl.contract import safefs
    if "/" in ns.role or ns.role in ("", ".", ".."):
        raise ConfigError(f"role {ns.role!r}: not a role name")
    p = Path(ns.run_dir) / "logs" / f"{ns.role}.log"
    try:  # through safefs: a log that is a link or a FIFO is refused, never followed or blocked on
        fd = safefs.open_read(p)
    except FileNotFoundError:
        have = sorted(n[:-4] for n, _ in safefs.scandir(p.parent) if n.endswith(".log"))
        raise ConfigError(f"role {ns.role!r}: no log in {p.parent} (have: {', '.join(have) or 'none'})") from None
    with os.fdopen(fd, errors="replace") as f:
        sys.stdout.write(f.read())
        while ns.follow:
            line = f.readline()
            if line:
                sys.stdout.write(line)
                sys.stdout.flush()
            else:
                time.sleep(0.5)
    return 0


def cmd_export(ns) -> int:
    from launch import export
    return export.run(ns)


def cmd_report(ns) -> int:
    from launch import report
    return report.run(ns)


def cmd_doctor(ns) -> int:
    from launch.doctor import run
    return run(ns)


def cmd_scale(ns) -> int:
    from launch.scale import run
    return run(ns)


# (one-line help in `python -m launch --help`, description in `python -m launch CMD --help`)
COMMANDS = {
    "run": ("compose, validate, plan, then run here (cluster=local) or submit to Slurm (cluster=slurm)",
            "Compose conf/ with the Hydra overrides, validate every point of a sweep, plan, then run the roles "
            "here (cluster=local, the default) or submit one heterogeneous Slurm job per point "
            "(cluster=slurm) and return. Nothing is written, started or submitted before every point passed."),
    "plan": ("print the allocation, memory and step-time plan and the batch script; submit nothing",
             "Compose and validate like run, then print the allocation plan, the per-GPU memory estimate "
             "(docs/memory.md), the step-time prediction (docs/perf.md) and, for cluster=slurm, the batch "
             "script. Writes and submits nothing."),
    "status": ("job state, progress and roles of a run, read from its directory",
               "The run's state (Slurm job or local roles), its progress and its roles, read from RUN_DIR."),
    "resume": ("start or resubmit a run from its frozen config, from the newest complete checkpoint",
               "Start (cluster=local) or resubmit (cluster=slurm) the run in RUN_DIR from its frozen "
               "config.yaml; it resumes from the newest complete checkpoint. Overrides may change what a "
               "resume can (trainer.max_steps, cluster.*)."),
    "cancel": ("stop a run (Slurm: scancel; local: SIGTERM to the roles)",
               "Stop the run in RUN_DIR: scancel its Slurm job and the jobs `launch scale` added to it "
               "(each named), or send SIGTERM to its local roles (they checkpoint, then exit)."),
    "logs": ("print a role's log (-f to follow)", "Print RUN_DIR/logs/ROLE.log; -f follows it."),
    "export": ("write the trained policy as a Hugging Face checkpoint (docs/export.md)",
               "Write a checkpoint of RUN_DIR as a Hugging Face checkpoint directory (docs/export.md)."),
    "report": ("one self-contained HTML page about a run (docs/report.md)",
               "Write one self-contained HTML page about the run in RUN_DIR (docs/report.md)."),
    "scale": ("add (+N) or drain (-N) inference servers of a running run",
              "Add N inference servers to the running run in RUN_DIR as a separate job (copies of its first "
              "replica, joining through the run directory), or drain the N newest of those (launch/scale.py)."),
    "doctor": ("check packages, devices, kernels, filesystem and Slurm (docs/doctor.md)",
               "Check packages, devices, kernels, the shared filesystem and Slurm against the config the "
               "overrides compose; --gpu runs the trainer and publisher paths (docs/doctor.md)."),
}
# Subcommands whose config Hydra composes from overrides: they take Hydra's --cfg and --info.
COMPOSING = ("run", "plan", "doctor")


def _texts(name: str) -> dict:
    short, long = COMMANDS[name]
    return dict(help=short, description=long)


def _compose_flags(s) -> None:
    """Hydra's conventions (its app flags of the same names): print the config or Hydra's view of it and
    exit, writing, starting and submitting nothing."""
    from launch.compose import CFG_TYPES, INFO_TYPES
    s.add_argument("-c", "--cfg", choices=CFG_TYPES, default=None,
                   help="print the composed config (job: what the run would freeze; hydra: Hydra's own; all: "
                        "both) as YAML and exit")
    s.add_argument("-p", "--package", default=None, help="with --cfg: only this key of it (e.g. trainer)")
    s.add_argument("--info", nargs="?", const="all", choices=INFO_TYPES, default=None,
                   help="print Hydra's information (config search path, defaults tree and list, the config) "
                        "and exit")


def cmd_show(ns) -> int:
    from launch import compose
    over, multirun = list(getattr(ns, "overrides", None) or []), bool(getattr(ns, "multirun", False))
    if ns.info is not None:
        compose.show_info(over, multirun, ns.info)
    else:
        sys.stdout.write(compose.show_cfg(over, multirun, ns.cfg, ns.package))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch", description=__doc__.split("\n\n")[0],
                                epilog="python -m launch CMD --help: the arguments of CMD")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="CMD")
    argv = list(sys.argv[1:] if argv is None else argv)
    from rl.contract.safefs import private_umask
    private_umask()   # run dirs, records and Slurm's log files: writable by this user alone
    wanted = argv[0] if argv else None
    for name in ("run", "plan"):
        s = sub.add_parser(name, **_texts(name))
        s.add_argument("-m", "--multirun", action="store_true", help="sweep: one job per point")
        s.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +experiment=debug trainer.max_steps=10")
        _compose_flags(s)
        if name == "run":
            s.add_argument("--detach", action="store_true", help="local backend: start the roles and return; "
                           "they outlive the launcher (a Slurm job always does)")
        if name == "plan":   # the step-time prediction's inputs (docs/perf.md)
            s.add_argument("--simulate", action="store_true", help="also simulate the async pipeline")
            s.add_argument("--assume", action="append", metavar="KEY=VALUE",
                           help="workload: rollout_tokens, decode_tokens, turns, env_s")
            s.add_argument("--metrics", metavar="METRICS_JSONL", help="workload from a finished run's metrics.jsonl")
            s.add_argument("--calibrate", metavar="RUN_DIR", help="predict steps/h from a finished pilot run's "
                           "measured trainer, token and tool times (launch/calibrate.py); the pilot is checked "
                           "first (one line naming file, line and key) and the simulations bounded: 5,000,000 "
                           "events each, 300 s in all, progress on stderr")
            s.add_argument("--search", action="store_true",
                           help="rank trainer/prefill/decode splits and trainer layouts of the same total nodes")
    s = sub.add_parser("resume", **_texts("resume"))
    s.add_argument("run_dir")
    s.add_argument("overrides", nargs="*", help="resumable overrides (trainer.max_steps, cluster.*)")
    s.add_argument("-c", "--cfg", choices=("job",), default=None,
                   help="print the config the resume would run (frozen config + overrides) as YAML and exit")
    s.add_argument("--detach", action="store_true", help="as for run")
    s = sub.add_parser("status", **_texts("status"))
    s.add_argument("run_dir")
    s.add_argument("--json", action="store_true", help="print the status as JSON")
    sub.add_parser("cancel", **_texts("cancel")).add_argument("run_dir")
    s = sub.add_parser("logs", **_texts("logs"))
    s.add_argument("run_dir")
    s.add_argument("role", help="trainer, orchestrator, router, inference_0, ... (the names in RUN_DIR/logs: a role "
                                "name for one process, inference_<i> per replica)")
    s.add_argument("-f", "--follow", action="store_true", help="keep printing what is appended")
    import importlib
    for name in ("export", "report", "doctor", "scale"):
        s = sub.add_parser(name, **_texts(name))
        if wanted == name:   # their arguments need their modules: imported for that command only (plan stays fast)
            importlib.import_module(f"launch.{name}").add_arguments(s)
            if name in COMPOSING:
                _compose_flags(s)
    if wanted in COMPOSING and "--info" in argv[1:]:
        # `--info` takes an optional value; an override right after it is not one (Hydra reads it so too)
        k = argv.index("--info", 1)
        from launch.compose import INFO_TYPES
        if k + 1 >= len(argv) or argv[k + 1] not in INFO_TYPES:
            argv.insert(k + 1, "all")
    multirun = False
    if argv and argv[0] in ("run", "plan"):
        # Hydra users put -m anywhere among the overrides; argparse would not accept it after them.
        multirun = any(a in ("-m", "--multirun") for a in argv[1:])
        argv = [argv[0]] + [a for a in argv[1:] if a not in ("-m", "--multirun")]
    # Overrides may come on both sides of an option (`plan +experiment=x --cfg job seed=1`): argparse gives a
    # nargs="*" positional only its first run, so the rest of them join it here; anything else is its error.
    ns, extra = p.parse_known_args(argv)
    if extra:
        if isinstance(getattr(ns, "overrides", None), list) and not any(e.startswith("-") for e in extra):
            ns.overrides += extra
        elif ns.cmd == "scale":   # its errors are one line, exit 2 (launch/scale.py add_arguments)
            sub.choices["scale"].error(f"unrecognized arguments: {' '.join(extra)}")
        else:
            p.parse_args(argv)   # argparse's own one-line error and exit 2
    if ns.cmd in ("run", "plan"):
        ns.multirun = ns.multirun or multirun
    if getattr(ns, "detach", False):   # the local backend's roles outlive the launcher (launch/local.py)
        from launch.local import set_detached
        set_detached()
    if getattr(ns, "run_dir", None) is not None:
        # resolved once, here: a run under a symlinked path (/scratch -> /lustre/scratch) works, and below
        # it every reader and writer refuses links (rl.contract.safefs, docs/run-directory-safety.md)
        from rl.contract import paths, safefs
        ns.run_dir = str(safefs.resolve_run_dir(ns.run_dir))
        try:   # the trust boundary (docs/run-directory-safety.md): someone else's run dir is not obeyed
            safefs.check_run_dir_private(ns.run_dir, paths.PRIVATE_DIRS)
        except safefs.UnsafePath as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if ns.cmd in ("export", "report") and getattr(ns, "out", None):
        # the user's own output path: the links on the way to it are the user's choice and followed here;
        # the file or directory itself is then written without following a link (a report's name is kept,
        # an export directory is resolved whole: it is the user's, not the run's)
        from rl.contract.safefs import resolve_run_dir
        out = Path(ns.out).expanduser()
        ns.out = str(resolve_run_dir(out) if ns.cmd == "export" else resolve_run_dir(out.parent) / out.name)
    # --cfg / --info: print and exit; nothing is written, started or submitted
    show = ns.cmd in COMPOSING and (getattr(ns, "cfg", None) or getattr(ns, "info", None)) is not None
    try:
        return cmd_show(ns) if show else {
            "run": cmd_run, "plan": cmd_plan, "resume": cmd_resume, "status": cmd_status,
            "cancel": cmd_cancel, "logs": cmd_logs, "export": cmd_export,
            "report": cmd_report, "doctor": cmd_doctor, "scale": cmd_scale}[ns.cmd](ns)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except OSError as e:  # the filesystem (a full disk, a read-only or missing run dir): one line, no traceback
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    except Exception as e:
        from launch.slurm import SlurmError
        from rl.contract.records import RecordError
        from rl.contract.secret import SecretError
        # sbatch's own words, a run-directory record that does not parse (its message names the file), or
        # a run secret refused (mode, owner, a link in its place): one line each, never a traceback
        if isinstance(e, (SlurmError, RecordError, SecretError)):
            print(f"error: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
