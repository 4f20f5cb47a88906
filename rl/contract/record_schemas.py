"""The schema of every JSON-lines record in the run directory, and of a rollout batch's bookkeeping.

A record is data from a shared filesystem: a torn line, a hand edit, another tool's output or a hostile
process can put anything on a line. Each reader therefore hands the check of its record kind to
`rl.exchange.read_jsonl(path, check=...)`, which skips a line the check refuses with one warning naming
the file, the line and the reason; the reader then only ever sees records whose fields have the types
and ranges it relies on (`int(e["group"])` cannot raise, a reward is a finite number). Without this a
single bad line of `eval/results.jsonl` crashed the trainer on every step and every restart, and one of
`rollouts/groups.jsonl` kept the orchestrator from resuming at all.

A check is a function of one record returning None when the record is good, else the reason in a few
words naming the key and its (clipped) value. The checks are strict about what readers use and lenient
about the rest: a key no reader looks at may be added by a newer writer without older readers skipping
the line. docs/records.md lists every record, its writer, readers and schema.

`batch_meta` checks the bookkeeping in a rollout batch's meta.json (which groups and rollouts a batch
trains): the orchestrator's resume and the trainer both act on it, so a meta.json whose parts disagree
(a part with fewer rewards than rollouts, groups listed complete that are not among its entries) is
refused whole rather than half-believed.

A leaf of rl.contract: imports nothing of rl. Torch-free, numpy-free.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

# Step numbers and policy versions are stored as int32 in a rollout batch; anything beyond is not a step.
MAX_STEP = 2**31 - 1
# A logprob is log p <= 0. vLLM reports -inf as -9999.0 (its OpenAI layer); a tiny positive value is
# float rounding. Outside [LOGPROB_MIN, LOGPROB_MAX] the number is not a logprob (rl.contract.batch).
LOGPROB_MIN, LOGPROB_MAX = -1e4, 1e-4
_MAX_TEXT = 4096   # a reason or error string longer than this is not one a role wrote

Check = Callable[[dict], Optional[str]]


def shown(v: Any, n: int = 60) -> str:
    """A value as a reason shows it: its repr, clipped (a hostile value may be a megabyte)."""
    r = repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."


def is_int(v: Any, lo: int = 0, hi: int = MAX_STEP) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def is_number(v: Any) -> bool:
    """A finite number (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _time(v: Any) -> bool:
    return is_number(v) and v >= 0


def _text(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= _MAX_TEXT


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float)) or _text(v)


def _indices(v: Any, size: int | None) -> bool:
    """A list of distinct rollout indices of a group (below `size` when known)."""
    return (isinstance(v, list) and all(is_int(i, 0, MAX_STEP if size is None else size - 1) for i in v)
            and len(set(v)) == len(v))


Spec = dict[str, tuple[Callable[[Any], bool], str, bool]]   # key -> (ok, what it must be, required)


def fields(rec: dict, spec: Spec) -> str | None:
    """The first key of `spec` that is missing (when required) or fails its check, as a reason."""
    for key, (ok, expected, required) in spec.items():
        if key not in rec:
            if required:
                return f"no {key!r}"
            continue
        if not ok(rec[key]):
            return f"{key}={shown(rec[key])} is not {expected}"
    return None


# -- rollouts/groups.jsonl (rl.orchestrator.grouplog.GroupLog) ---------------------------------------
_GROUP_COMMON: Spec = {
    "event": (lambda v: v in ("start", "drop"), "start or drop", True),
    "group": (is_int, "a group id", True),
    "restart": (is_int, "a restart count", False),
    "time": (_time, "a time in seconds", False),
}
_GROUP_START: Spec = {"version": (is_int, "a policy version", True)}
_GROUP_DROP: Spec = {
    "reason": (_text, "a reason", True),
    "step": (lambda v: is_int(v, -1), "a step number (or -1)", True),
    "where": (_text, "a place in the pool", False),
    "tokens": (lambda v: is_number(v) and v >= 0, "a token count", False),
    "seconds": (_time, "a duration in seconds", False),
}


def group_event(group_size: int | None = None) -> Check:
    """The check of a groups.jsonl line; with `group_size`, a drop's `rollouts` must be indices below it."""
    def check(rec: dict) -> str | None:
        why = fields(rec, _GROUP_COMMON) or fields(rec, _GROUP_START if rec["event"] == "start" else _GROUP_DROP)
        if why is None and rec["event"] == "drop" and "rollouts" in rec and not _indices(rec["rollouts"], group_size):
            return (f"rollouts={shown(rec['rollouts'])} is not a list of distinct rollout indices"
                    + (f" below group_size={group_size}" if group_size else ""))
        return why
    return check


# -- eval/results.jsonl (rl.orchestrator.evaluation) --------------------------------------------------
def eval_result(rec: dict) -> str | None:
    """A line per evaluated version: `version`, and `eval/...` values that are scalars (numbers finite)."""
    why = fields(rec, {"version": (is_int, "a policy version", True),
                       "eval/version": (is_int, "a policy version", False),
                       "time": (_time, "a time in seconds", False)})
    if why is not None:
        return why
    if "eval/version" in rec and rec["eval/version"] != rec["version"]:
        return f"eval/version={shown(rec['eval/version'])} is not its line's version {rec['version']}"
    for k, v in rec.items():
        if k.startswith("eval/") and not (_scalar(v) and (not isinstance(v, float) or math.isfinite(v))):
            return f"{k}={shown(v)} is not a finite number, a string or null"
    return None


# -- metrics.jsonl (rl.metrics.MetricsLogger) ---------------------------------------------------------
def metrics_line(rec: dict) -> str | None:
    """A trainer step's line (or the final evaluation's): `step`, scalar values. A number may be
    non-finite here: a skipped update records the non-finite loss or norm that made it skip."""
    why = fields(rec, {"step": (is_int, "a step number", True),
                       "eval/version": (is_int, "a policy version", False),
                       "loss": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number", False)})
    if why is not None:
        return why
    for k, v in rec.items():
        if not (_scalar(v) or (isinstance(v, list) and len(v) <= 1 << 16 and all(_scalar(x) for x in v))):
            return f"{k}={shown(v)} is not a number, a string or null"
    return None


# -- <kind>/consumed.jsonl (rl.exchange.ConsumedLog) --------------------------------------------------
def consumed(rec: dict) -> str | None:
    """A consumed step: `step`, `consumer`, and the incarnation and batch checksum that trained it."""
    return fields(rec, {
        "step": (is_int, "a step number", True),
        "consumer": (_text, "a role name", True),
        "restart": (is_int, "a restart count", False),
        "time": (_time, "a time in seconds", False),
        "sha256": (lambda v: v is None or (isinstance(v, str) and len(v) == 64), "a sha256 or null", False),
        "applied": (lambda v: isinstance(v, bool), "true or false", False),
    })


# -- a rollout batch's meta.json: what it trains ------------------------------------------------------
def _str_key(k: Any) -> bool:
    return isinstance(k, str) and k.isdigit() and len(k) < 11 and int(k) <= MAX_STEP


def batch_meta(meta: Any, *, num_samples: int | None = None, group_size: int | None = None) -> str | None:
    """Why the bookkeeping of a rollout batch's meta.json cannot be believed, or None.

    `group_ids` (groups the batch completes), `entries` ([group, [rollout indices]] per dense group, in
    sample order), `partial_groups` ({group: {rollouts, rewards}} of the parts that do not complete their
    group), `snapshots` ({group: {rollout: reward}}), `num_samples`, `version_min/max`, `prompt_tokens`:
    `segment` (per sample, its context's number within its episode: summarized episodes are one sample
    per context, consecutive, rl.orchestrator.segments): each optional (schedule=batch writes none of the
    group bookkeeping), each of its type, and together consistent: a part's rewards are one per rollout,
    the entries are exactly the complete groups and the parts, each part's rollouts are its entry's, and
    the entries hold as many rollouts as there are samples with segment 0 (every sample without
    `segment`), each later segment following the one before it."""
    if not isinstance(meta, dict):
        return f"a JSON {type(meta).__name__}, not an object"
    why = fields(meta, {
        "step": (is_int, "a step number", False),
        "num_samples": (is_int, "a sample count", False),
        "version_min": (lambda v: v is None or is_int(v), "a policy version or null", False),
        "version_max": (lambda v: v is None or is_int(v), "a policy version or null", False),
        "group_ids": (lambda v: _indices(v, None), "a list of distinct group ids", False),
        "entries": (lambda v: isinstance(v, list) and all(
            isinstance(e, list) and len(e) == 2 and is_int(e[0]) and _indices(e[1], group_size) for e in v),
            "a list of [group id, [rollout indices]]", False),
        "partial_groups": (lambda v: isinstance(v, dict) and all(
            _str_key(g) and isinstance(p, dict) and set(p) == {"rollouts", "rewards"} for g, p in v.items()),
            "a map of group id to {rollouts, rewards}", False),
        "snapshots": (lambda v: isinstance(v, dict) and all(
            _str_key(g) and isinstance(s, dict) and all(_str_key(i) and is_number(r) for i, r in s.items())
            for g, s in v.items()), "a map of group id to {rollout: finite reward}", False),
        "prompt_tokens": (lambda v: isinstance(v, list) and all(is_int(n) for n in v),
                          "a list of token counts", False),
        "segment": (lambda v: isinstance(v, list) and all(is_int(n) for n in v),
                    "a list of segment numbers", False),
        "route_files": (lambda v: isinstance(v, list) and len(v) == 2 and all(is_int(n) and n > 0 for n in v),
                        "[layers, top_k] of the batch's route files", False),
    })
    if why is not None:
        return why
    n = meta.get("num_samples")
    if num_samples is not None and n is not None and n != num_samples:
        return f"num_samples={n}, the batch has {num_samples} samples"
    n = num_samples if num_samples is not None else n
    if n is not None and "prompt_tokens" in meta and len(meta["prompt_tokens"]) != n:
        return f"prompt_tokens has {len(meta['prompt_tokens'])} entries for {n} samples"
    if "segment" in meta:
        seg = meta["segment"]
        if n is not None and len(seg) != n:
            return f"segment has {len(seg)} entries for {n} samples"
        if bad := [i for i, k in enumerate(seg) if k and (i == 0 or seg[i - 1] != k - 1)]:
            return f"segment[{bad[0]}]={seg[bad[0]]} does not follow segment {seg[bad[0]] - 1} of its episode"
        n = sum(k == 0 for k in seg)   # rollouts: an episode's later contexts are not rollouts of their own
    parts = meta.get("partial_groups") or {}
    for g, p in parts.items():
        if not _indices(p["rollouts"], group_size):
            return f"partial_groups[{g}].rollouts={shown(p['rollouts'])} is not a list of distinct rollout indices"
        if not (isinstance(p["rewards"], list) and all(is_number(r) for r in p["rewards"])):
            return f"partial_groups[{g}].rewards={shown(p['rewards'])} is not a list of finite numbers"
        if len(p["rewards"]) != len(p["rollouts"]):
            return (f"partial_groups[{g}] has {len(p['rewards'])} rewards for {len(p['rollouts'])} rollouts "
                    f"(one reward per rollout)")
    complete = set(meta.get("group_ids") or [])
    if both := complete & {int(g) for g in parts}:
        return f"group {min(both)} is listed both complete (group_ids) and as a part (partial_groups)"
    if "entries" not in meta:
        return None
    entries = meta["entries"]
    gids = [e[0] for e in entries]
    if len(set(gids)) != len(gids):
        return f"entries list group {next(g for g in gids if gids.count(g) > 1)} twice"
    if set(gids) != complete | {int(g) for g in parts}:
        extra = sorted((complete | {int(g) for g in parts}) - set(gids))
        return (f"group_ids and partial_groups list group {extra[0]}, which is not among the entries" if extra
                else f"entry of group {sorted(set(gids) - complete - {int(g) for g in parts})[0]} is neither "
                     f"complete (group_ids) nor a part (partial_groups)")
    for g, idx in entries:
        if str(g) in parts and parts[str(g)]["rollouts"] != idx:
            return f"partial_groups[{g}].rollouts={shown(parts[str(g)]['rollouts'])} are not its entry's {shown(idx)}"
    if unknown := sorted(int(g) for g in (meta.get("snapshots") or {}) if int(g) not in set(gids)):
        return f"snapshots has group {unknown[0]}, which is not among the entries"
    if n is not None and (total := sum(len(idx) for _, idx in entries)) != n:
        return f"entries hold {total} rollouts for {n} samples" + (" with segment 0" if "segment" in meta else "")
    return None
