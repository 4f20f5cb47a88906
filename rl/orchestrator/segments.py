"""Episodes of several contexts (context summarization) cut into one training sample per segment.

rl.orchestrator.multiturn keeps a summarized episode as one rollout until its batch is formed: one Sample
over its whole token store, with `info["segments"]` saying where each context starts and ends. Why so
late: everything before the batch counts rollouts, not samples. The pool schedules and accounts
rollouts one by one (slots, tokens, staleness, parts of groups), the group log and the batch meta's
`entries` / `partial_groups` record rollout indices for exactly-once training across restarts
(rl.orchestrator.grouplog), and advantages are relative among a group's episodes
(rl.orchestrator.advantages), so an episode of three segments must weigh as one episode, not three.
Cutting after the advantages keeps all of that unchanged: every segment carries its episode's reward,
advantage and group, all segments of an episode enter the same batch (so an episode is trained exactly
once, all of it or none), and per-token staleness has already been applied to the episode's tokens
(the segments' arrays are views of the episode's, masks included).

The batch's meta.json learns one optional per-sample list, `segment` (0 for an episode's first
context, k for its k-th summary's continuation; written only when some episode has more than one),
and the samples of one episode are consecutive and in order. A reader counts rollouts as the samples
with segment 0 (rl.contract.record_schemas.batch_meta, rl.contract.batch_checks.check_meta), so
`entries` keep listing each rollout index once, and the report can show an episode's segments in order.

What a cancelled episode loses (`LostSegments`). An episode in flight when its group is cancelled (stale,
the end-of-run drain, a stop or preemption) loses every context it had already closed by summarizing:
none of them can be trained, because every segment is trained with its episode's reward and advantage
and only the episode's end gives a reward (a SWE episode is graded on its final tree). Keeping them for
an unfinished episode would mean training policy turns without a reward; continuing the episode after a
restart would need its sandbox's state, which dies with the job. So they are counted, never silently
dropped: the drop line of the group in rollouts/groups.jsonl carries `segments` and `segment_tokens`,
the next batch's meta (metrics.jsonl's `orchestrator/lost_segments...`) counts them since the previous
batch and in all, and the orchestrator's log names the group and the reason. A stop writes no drop line
(its groups are played again from the start by the next incarnation), so its loss is in the log only.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

from rl.contract.batch import Sample
from rl.runtime import log


def expand(samples: list[Sample]) -> list[Sample]:
    """`samples` with each summarized episode replaced by its segments, in order (one Sample each, its
    own prompt, tokens, logprobs, versions, mask and routes; the episode's reward, advantage, group).
    Episodes of one context are passed through as they are."""
    out: list[Sample] = []
    for s in samples:
        segs = s.info.get("segments")
        if not segs:
            out.append(s)
            continue
        np_ = len(s.prompt_ids)
        comp = {k: np.asarray(getattr(s, k)) for k in
                ("completion_ids", "completion_logprobs", "completion_versions", "completion_mask")}
        for k, (start, end, plen, routed, reason) in enumerate(segs):
            if k == 0:
                if start != 0 or plen != np_:
                    raise ValueError(f"segment 0 starts at {start} with a prompt of {plen} tokens, the episode's "
                                     f"prompt has {np_}")
                prompt = s.prompt_ids
            else:
                if not np_ <= start < start + plen <= end:
                    raise ValueError(f"segment {k} spans [{start}, {end}) with a prompt of {plen} tokens")
                prompt = comp["completion_ids"][start - np_:start - np_ + plen]
            a, b = start + plen - np_, end - np_
            if routed is not None and len(routed) != end - start:
                raise ValueError(f"segment {k} has {len(routed)} routed-expert rows for {end - start} tokens")
            info = {"finish_reason": reason, "segment": k}
            if "rollout" in s.info:
                info["rollout"] = s.info["rollout"]
            if k == 0 and "multiturn" in s.info:
                info["multiturn"] = s.info["multiturn"]   # the episode's per-turn metrics, counted once
            out.append(Sample(prompt_ids=prompt, completion_ids=comp["completion_ids"][a:b],
                              completion_logprobs=comp["completion_logprobs"][a:b],
                              completion_versions=comp["completion_versions"][a:b],
                              completion_mask=comp["completion_mask"][a:b], reward=s.reward, group=s.group,
                              advantage=s.advantage, routed_experts=routed, info=info))
    return out


def meta(samples: list[Sample]) -> dict:
    """The batch meta's `segment` list (one entry per sample), or nothing when no episode was cut."""
    seg = [int(s.info.get("segment", 0)) for s in samples]
    return {"segment": seg} if any(seg) else {}


class LostSegments:
    """The closed contexts of cancelled episodes (the module docstring), counted from what the driver
    reported per rollout (rl.orchestrator.accounting.segment_closed)."""

    def __init__(self):
        self.since = {"segments": 0, "tokens": 0}    # since the previous batch
        self.total = {"segments": 0, "tokens": 0}    # in this incarnation

    def cancelled(self, gid: int, rollouts: Iterable, reason: str) -> dict:
        """Group `gid` is cancelled for `reason` with its rollouts' accounts `rollouts`: count and log what
        its episodes had closed; returns the drop line's extra fields (none when nothing was closed)."""
        rollouts = list(rollouts)
        segs = sum(r.segments for r in rollouts)
        if not segs:
            return {}
        toks = sum(r.segment_tokens for r in rollouts)
        for d in (self.since, self.total):
            d["segments"] += segs
            d["tokens"] += toks
        log("orchestrator", f"group {gid} cancelled ({reason}): its episodes had closed {segs} context(s) by "
                            f"summarizing ({toks} policy tokens), lost untrained"
                            + ("; the group is played again from its start after the restart" if reason == "stop" else ""))
        return {"segments": segs, "segment_tokens": toks}

    def meta(self) -> dict:
        """The batch meta's counts (since the previous batch, and in all), then a new count begins."""
        out = {"lost_segments": self.since["segments"], "lost_segment_tokens": self.since["tokens"],
               "lost_segments_total": self.total["segments"], "lost_segment_tokens_total": self.total["tokens"]}
        self.since = {"segments": 0, "tokens": 0}
        return out
