"""The sandbox runtimes an SWE episode's commands can run under (`env.swe.runtime`), one row each.

One registry with each runtime's capabilities, read by config validation (rl.contract.config: the
names, and which need `env.swe.image_cache`), by the tasks (rl.envs.swe.tasks / grader / env: which
runtimes run each task in its own image) and by the runtime factory (rl.envs.swe.runtimes.runtime_class:
the module and class, imported only when that runtime is picked). Torch-free, importing nothing else of rl.
Adding a runtime: a module under rl/envs/swe with a `Runtime` subclass, and a row here
(docs/internals.md, "Where to add").
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SandboxRuntime:
    name: str                     # env.swe.runtime
    module: str                   # where its class lives (imported when picked)
    cls: str                      # its rl.envs.swe.runtimes.Runtime subclass
    uses_image: bool = False      # each command runs in the task's own container image
    needs_image_cache: bool = False   # env.swe.image_cache must be set (images converted once, shared)


ROWS = (
    SandboxRuntime("inprocess", "rl.envs.swe.runtimes", "InprocessRuntime"),
    SandboxRuntime("bubblewrap", "rl.envs.swe.runtime_bwrap", "BubblewrapRuntime"),
    SandboxRuntime("podman", "rl.envs.swe.runtime_podman", "PodmanRuntime", uses_image=True),
    SandboxRuntime("apptainer", "rl.envs.swe.runtime_apptainer", "ApptainerRuntime", uses_image=True,
                   needs_image_cache=True),
)
BY_NAME = {r.name: r for r in ROWS}
NAMES = tuple(BY_NAME)
IMAGE_RUNTIMES = tuple(r.name for r in ROWS if r.uses_image)   # each command runs in the task's own image


def names_text() -> str:
    """'inprocess, bubblewrap, podman or apptainer' (for one-line errors)."""
    return ", ".join(NAMES[:-1]) + " or " + NAMES[-1]


def get(name: str) -> SandboxRuntime:
    row = BY_NAME.get(name)
    if row is None:
        raise ValueError(f"env.swe.runtime={name!r}: must be one of {', '.join(NAMES)}")
    return row
