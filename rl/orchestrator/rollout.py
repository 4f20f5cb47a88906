"""One multi-turn episode's token store (`Rollout`) and its per-turn record (`Turn`), kept apart from the
driver that fills them (rl.orchestrator.multiturn) because they are two concerns: the driver decides what
happens next in an episode; the store decides how its tokens, routes and contexts are held and what
sample they become.

Memory: an in-flight rollout holds its tokens in compact numpy arrays (13 bytes a token, at most 16.25
with the arrays' spare capacity: they grow by a quarter) and its routed-expert rows not at all: each
turn's rows are appended to the episode's own file in the process's spill directory (`orchestrator.spill_dir`, default node-local
temp; rl/orchestrator/spill.py) and the sample maps that file read-only when the episode ends. A failed
or cancelled episode removes its file.

Routed experts (router replay, R3; servers started with `--enable-return-routed-experts`): vLLM returns
one row per token of the request but the last one sampled, from position `routed_experts_prompt_start`
on. Each turn asks only for the rows the episode does not hold yet (`routed_start` = rows held) and
appends them, so the last model token of a turn and the observation after it get their rows from the
prefill of the next turn, the one that processed them, and the engine sends each row once: the routed
bytes of an episode grow with its tokens, not with turns x context. The sample carries one row per
token, in order. An engine that returns rows for some turns only, or not the rows asked for, fails the
episode with one line naming the turn (its group is dropped, not trained on a misaligned routing).

How a segmented episode is held (context summarization, rl.orchestrator.multiturn): one token store for
the whole episode (a new segment's prompt is appended as non-policy tokens, mask 0 and version -1;
`Rollout._segs` records where each segment starts), so the compact arrays stay the only per-token
state, the request's context is a view from the current segment's start, and the pool accounts the
episode as one rollout. Routed-expert rows restart with each segment (its context is prefilled anew),
one spill file per segment, sealed when the segment closes. The episode is cut into one sample per
segment when its batch is formed (rl.orchestrator.segments says why). `closed()` says what a cancelled
episode had already finished (the pool counts it as lost, rl.orchestrator.pool).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rl.contract.batch import Sample
from rl.orchestrator import spill


@dataclass(slots=True)   # one per turn of every episode held: ~100 bytes each with slots, ~300 without
class Turn:
    gen_tokens: int
    obs_tokens: int
    gen_s: float
    env_s: float
    tool_calls: int
    tool_errors: int
    finish_reason: str | None
    summary: bool = False   # the policy's summary of its context (not an environment step)


@dataclass(slots=True)
class EpisodeStats:
    """What the batch's per-turn metrics (multiturn.batch_metrics) read of a finished episode, without its
    token arrays: a rollout worker sends this in the sample's info instead of the `Rollout` itself, whose
    arrays the sample already carries (rl/orchestrator/wire.py)."""
    turns: list
    prompt_tokens: int
    tokens: int          # prompt + completion, every segment's
    segments: int
    seconds: float
    end_reason: str
    env_metrics: dict


class Rollout:
    """One episode, growing turn by turn, then finished: what the trainer needs plus what the metrics need.

    Per-token fields live in compact numpy arrays that grow by a quarter at a time (the prompt and the
    completion's ids in one int32 array, the completion's uint8 loss mask, float32 logprobs and int32
    versions): 13 bytes a token, at most 16.25 with the spare capacity, where Python lists took 30-40
    bytes per field. `ids`, `mask`, `logprobs`, `versions` and `prompt_ids` are views of them. Routed-expert
    rows go to a spill file as they arrive (rl.orchestrator.spill); only their count is held here.
    Segments (context summarization, the module docstring): `_segs` holds (start in the token store,
    prompt length) per segment; the routes of closed segments are sealed maps in `_sealed`."""

    _MIN_CAP = 256

    def __init__(self, prompt_ids, spill_dir: str = ""):
        p = np.asarray(prompt_ids, dtype=np.int64)
        if p.ndim != 1:
            raise ValueError(f"prompt_ids must be a flat list of token ids, got shape {p.shape}")
        self._np, self._n = len(p), 0
        self._tok = np.empty(self._np + self._MIN_CAP, np.int32)
        self._tok[:self._np] = p
        self._mask = np.empty(self._MIN_CAP, np.uint8)
        self._lp = np.empty(self._MIN_CAP, np.float32)
        self._ver = np.empty(self._MIN_CAP, np.int32)
        self.turns: list[Turn] = []
        self.reward = 0.0
        self.end_reason = "open"
        self.seconds = 0.0
        self.env_metrics: dict = {}
        self.routed_rows = 0                        # engine rows held (= the next turn's routed_start)
        self._spill_dir = spill_dir
        self._routes: spill.RouteSpill | None = None
        self._segs: list[tuple[int, int]] = [(0, self._np)]
        self._sealed: list = []                     # routed rows of each closed segment (a map or None)
        self._reasons: list = []                    # finish reason of each closed segment's last turn
        self._routed_any = False                    # some turn of the episode returned routes

    def __repr__(self) -> str:
        return (f"Rollout(prompt={self._np}, tokens={self._n}, turns={len(self.turns)}, "
                f"end_reason={self.end_reason!r}, reward={self.reward}, routed_rows={self.routed_rows})")

    @property
    def prompt_ids(self) -> np.ndarray:
        return self._tok[:self._np]

    @property
    def ids(self) -> np.ndarray:
        """Everything after the prompt (model turns and observations)."""
        return self._tok[self._np:self._np + self._n]

    @property
    def mask(self) -> np.ndarray:
        return self._mask[:self._n]

    @property
    def logprobs(self) -> np.ndarray:
        return self._lp[:self._n]

    @property
    def versions(self) -> np.ndarray:
        return self._ver[:self._n]

    def __len__(self) -> int:
        """Tokens of the sequence so far, prompt included (every segment's)."""
        return self._np + self._n

    @property
    def segments(self) -> int:
        return len(self._segs)

    def context(self) -> np.ndarray:
        """The current segment so far, the next request's prompt: a view, no copy (the client encodes it to
        JSON bytes once; nothing is appended while the request is out)."""
        return self._tok[self._segs[-1][0]:self._np + self._n]

    def new_segment(self, prompt_ids) -> None:
        """Close the current segment (its routes sealed) and open a fresh context whose prompt is
        `prompt_ids`."""
        self._sealed.append(self._seal(self._segs[-1][0], self._np + self._n))
        self._reasons.append(self.turns[-1].finish_reason if self.turns else None)
        self._routes, self.routed_rows = None, 0
        start = self._np + self._n
        self.add_env(prompt_ids)
        self._segs.append((start, len(prompt_ids)))

    def stats(self) -> EpisodeStats:
        return EpisodeStats(turns=self.turns, prompt_tokens=self._np, tokens=self._np + self._n,
                            segments=self.segments, seconds=self.seconds, end_reason=self.end_reason,
                            env_metrics=self.env_metrics)

    def closed(self) -> tuple[int, int]:
        """(segments closed so far, their policy tokens): what a cancelled episode had already finished.
        Counted, not summed: a uint8 mask's sum wraps."""
        end = self._segs[-1][0] - self._np      # the current segment's start, in completion positions
        return len(self._segs) - 1, int(np.count_nonzero(self._mask[:max(end, 0)]))

    def _grow(self, k: int) -> None:
        need = self._n + k
        if need <= len(self._mask):
            return
        # 1.25x, not 2x: the spare capacity is memory held per in-flight token (13 B a token at most 16 B,
        # not 26); the copies it costs (~5 bytes copied per byte held, once) are small beside a turn's JSON
        cap = max(len(self._mask) + len(self._mask) // 4, need)
        for name in ("_mask", "_lp", "_ver"):
            old = getattr(self, name)
            new = np.empty(cap, old.dtype)
            new[:self._n] = old[:self._n]
            setattr(self, name, new)
        tok = np.empty(self._np + cap, np.int32)
        tok[:self._np + self._n] = self._tok[:self._np + self._n]
        self._tok = tok

    def _append(self, ids, mask: int, logprobs, versions) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        k = len(ids)
        self._grow(k)
        a, b = self._n, self._n + k
        self._tok[self._np + a:self._np + b] = ids
        self._mask[a:b] = mask
        self._lp[a:b] = logprobs
        self._ver[a:b] = versions
        self._n = b

    def add_routes(self, rows, start: int, n_prompt: int, n_new: int, turn: int) -> None:
        """The engine's routed experts of one turn: `rows` ([prompt + new - 1 - start, layers, top_k] or
        None) for a request of `n_prompt` tokens that asked for them from position `start`. They go to
        the episode's spill file; only their count stays in memory."""
        if rows is None:
            if self._routed_any:
                raise ValueError(f"turn {turn}: the engine returned no routed_experts, earlier turns did "
                                 f"({self.routed_rows} rows held)")
            return
        if turn > 0 and not self._routed_any:
            raise ValueError(f"turn {turn}: the engine returned routed_experts, earlier turns did not")
        want = max(n_prompt + n_new - 1 - start, 0)
        if start != self.routed_rows or len(rows) != want:
            raise ValueError(f"turn {turn}: routed_experts has {len(rows)} rows from position {start}, "
                             f"expected {want} (prompt {n_prompt} + generated {n_new} - 1 - {start}; "
                             f"{self.routed_rows} rows held)")
        if self._routes is None:
            if np.ndim(rows) != 3:
                raise ValueError(f"turn {turn}: routed_experts has shape {np.shape(rows)}, expected "
                                 "[tokens, layers, top_k]")
            self._routes = spill.directory(self._spill_dir).new(np.shape(rows)[1:])
        self._routes.append(rows)
        self.routed_rows += len(rows)
        self._routed_any = True

    def discard_routes(self) -> None:
        """Remove the episode's spill file (a failed or cancelled episode)."""
        if self._routes is not None:
            self._routes.discard()

    def routed(self):
        """One row per token of the (last) segment ([its prompt + the rest, layers, top_k], a read-only
        np.memmap of the spill file) or None. The rows the engine never returned are the tail after the
        last forwarded position (the final sampled token, and an observation a timed-out turn never
        read): no trained token's logprob depends on them (the loss on token j reads the logits at j - 1,
        causal in positions < j), so they repeat the last row."""
        return self._seal(self._segs[-1][0], self._np + self._n)

    def _seal(self, start: int, end: int):
        """The routes of the segment at store positions [start, end), sealed (see routed())."""
        if self._routes is None or not self.routed_rows:
            return None
        lo = max(start, self._np)                 # the first position of the segment with a mask entry
        trained = np.flatnonzero(self._mask[lo - self._np:end - self._np])
        if len(trained) and self.routed_rows < lo - start + int(trained[-1]):
            raise ValueError(f"routed experts cover {self.routed_rows} positions, the last trained token "
                             f"is at {lo - start + int(trained[-1])}")
        n = end - start
        if self.routed_rows > n:
            raise ValueError(f"routed experts cover {self.routed_rows} tokens, the sample has {n}")
        return self._routes.seal(n)

    def add_model(self, ids, logprobs, versions):
        if not (len(ids) == len(logprobs) == len(versions)):
            raise ValueError(f"a model turn has {len(ids)} ids, {len(logprobs)} logprobs, "
                             f"{len(versions)} versions")
        self._append(ids, 1, np.asarray(logprobs, np.float32), np.asarray(versions, np.int64))

    def add_env(self, ids):
        self._append(ids, 0, 0.0, -1)

    def sample(self, group: int, rollout: int | None = None) -> Sample:
        """The finished episode as a Sample of numpy arrays. The arrays are trimmed to their length (the
        growth capacity is freed) and the sample's fields are views of them: editing the sample's mask in
        place (accounting.mask_stale) edits this rollout's. An episode of several segments is one Sample
        over its whole token store (later segments' prompts are mask-0 tokens of its completion) with
        `info["segments"]`: per segment (start, end, prompt length, routes, finish reason), cut into one
        sample per segment when the batch is formed (rl.orchestrator.segments.expand)."""
        n = self._np + self._n
        if len(self._tok) != n:
            self._tok = self._tok[:n].copy()
            self._mask, self._lp, self._ver = (a[:self._n].copy() for a in (self._mask, self._lp, self._ver))
        info = {"finish_reason": self.turns[-1].finish_reason if self.turns else None, "multiturn": self}
        if rollout is not None:
            info["rollout"] = rollout
        routed = self.routed()
        if len(self._segs) > 1:
            ends = [s for s, _ in self._segs[1:]] + [n]
            reasons = self._reasons + [info["finish_reason"]]
            info["segments"] = [(s, e, p, rows, why) for (s, p), e, rows, why in
                                zip(self._segs, ends, self._sealed + [routed], reasons)]
            routed = None   # per segment, in info["segments"]
        return Sample(prompt_ids=self.prompt_ids, completion_ids=self.ids,
                      completion_logprobs=self.logprobs, completion_versions=self.versions,
                      completion_mask=self.mask, reward=float(self.reward), group=group,
                      routed_experts=routed, info=info)
