"""Which policy version produced each completion token.

Weights are loaded in flight: the orchestrator pauses the servers with requests kept, reloads, resumes.
At each reload the worker extension reports, for every request the model runner holds, how many
completion tokens it had generated so far; those tokens came from the old version, the rest from the
new one. A request can span several reloads, so each keeps a list of switch points.

A request that was outstanding but is absent from the worker's report either finished just before the
pause (all its tokens old) or had not been scheduled yet (all new). The two cannot be told apart from
here, so such a request keeps its older version: the conservative choice, since versions only decide the
off-policy bound and the lag metric (the importance ratio uses the logprobs the engine really sampled
with, whatever the version label says).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class _Req:
    start_version: int
    switches: list[tuple[int, int]] = field(default_factory=list)  # (tokens before switch, new version)


class VersionTracker:
    """`version` is what the servers generate with; `published` the newest version the trainer has
    published (seen by the weight watcher, possibly still loading): from then on the trainer waits for
    batch `published`, whatever the servers run. Listeners are called on either change (the pool wakes)."""

    def __init__(self, version: int):
        self.version = version
        self._published = version
        self._reqs: dict[str, _Req] = {}
        self.ambiguous = 0
        self.loaded_at: float | None = None   # when the servers got the current version (monotonic)
        self.listeners: list = []

    @property
    def published(self) -> int:
        return max(self._published, self.version)

    def on_published(self, version: int) -> None:
        if version > self.published:
            self._published = version
            for f in self.listeners:
                f()

    def start(self, request_id: str) -> None:
        self._reqs[request_id] = _Req(self.version)

    def on_reload(self, new_version: int, in_flight: dict[str, int]) -> None:
        for rid, req in self._reqs.items():
            if rid in in_flight:
                req.switches.append((int(in_flight[rid]), new_version))
            else:
                self.ambiguous += 1
        self.version = new_version
        self.loaded_at = time.monotonic()
        for f in self.listeners:
            f()

    def finish(self, request_id: str, n_tokens: int) -> list[int]:
        """Per-token versions of a finished request's `n_tokens` completion tokens."""
        req = self._reqs.pop(request_id)
        out = []
        v = req.start_version
        pos = 0
        for k, nv in req.switches:
            k = min(k, n_tokens)
            out += [v] * (k - pos)
            pos = max(pos, k)
            v = nv
        out += [v] * (n_tokens - pos)
        return out

    def forget(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)
