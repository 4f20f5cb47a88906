"""The trajectory view of `launch report`: a sample of episodes per step, read back from the rollout batches.

Every `rollouts/step_N` stays in the run directory for the whole run, and a batch holds each episode as
one token sequence (rl.contract.batch): the prompt, then the completion, in which the policy's tokens
carry the version that generated them and observations (tool outputs, environment messages; loss mask
0, version -1) sit between the model's turns. Decoding with the run's own tokenizer
(`assets/step_000000/tokenizer.json`, through `tokenizers`, no torch) gives back the text: the prompt,
the turns, the tool calls the model wrote (`<tool_call>...</tool_call>`, listed per turn) and what came
back. Where the prompt ends is the batch meta's `prompt_tokens` (written by the orchestrator); batches
from before that key existed fall back to the first policy token.

Policy tokens are shown in runs of one version, coloured by lag (trainer step - version: 0 green, 1
yellow, 2 orange, 3+ red); hovering shows the version, the lag and the token span. A policy token that
the staleness bound masked out of the loss (`orchestrator.stale_policy=mask`) is stored with version -1
like an observation, so it reads as one here.

The batches come from the run directory, whose writers may be hostile and whose texts (the prompt, the
tool outputs) come from datasets and the model, so each step is verified against its manifest before it
is read (a step that does not is named in one line and not shown), the tokenizer is read without following
a link, a prompt length the meta gives is used only when it is an integer within the sample, and every
text is bounded: a prompt shows its first and last PROMPT_TOKENS // 2 tokens, an episode its first and
last `limit // 2` after the prompt, any decoded span at most MAX_CHARS characters and a turn at most
MAX_CALLS tool calls, each cut marked on the page; past PAGE_BUDGET bytes of episodes the view stops with
a note. A million-token prompt thus costs a few KiB of page, not ten MiB.
"""
from __future__ import annotations

import re
from pathlib import Path

from launch.report_svg import clip, esc, fmt

PROMPT_TOKENS = 2000      # a prompt longer than this shows its head and tail
MAX_CHARS = 100_000       # characters of one decoded span (a token may decode to many)
MAX_CALLS = 20            # tool calls listed per turn
PAGE_BUDGET = 6 << 20     # bytes of episode HTML per page; the view stops past it
_TOKENIZER_LIMIT = 256 << 20

_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


def _decoder(assets: Path):
    """ids -> text with the run's tokenizer, or a plain rendering of the ids when it cannot be read."""
    from rl.contract import safefs
    tj = assets / "tokenizer.json"
    try:
        text = safefs.read_text(tj, limit=_TOKENIZER_LIMIT)  # no link followed, no FIFO opened
    except FileNotFoundError:
        why = f"{tj} is missing (a checkpoint with another tokenizer format)"
    except (OSError, UnicodeDecodeError) as e:
        why = f"{tj} could not be read ({getattr(e, 'strerror', None) or e})"
    else:
        try:
            from tokenizers import Tokenizer
            tok = Tokenizer.from_str(text)
            return (lambda ids: tok.decode([int(i) for i in ids], skip_special_tokens=False)), None
        except Exception as e:  # noqa: BLE001 - a tokenizer this library cannot read: ids instead
            why = f"{tj} could not be read by `tokenizers` ({type(e).__name__}: {clip(e, 200)})"
    return (lambda ids: " ".join(f"[{int(i)}]" for i in ids)), why


def pick_steps(steps: list[int], n: int) -> list[int]:
    """`n` steps spread over `steps`, the first and the last included."""
    if len(steps) <= n:
        return list(steps)
    if n <= 1:
        return [steps[-1]]
    return sorted({steps[round(i * (len(steps) - 1) / (n - 1))] for i in range(n)})


def pick_episodes(rewards, groups, n: int) -> list[int]:
    """Sample indices: the best and the worst reward first, then others from groups not shown yet."""
    order = sorted(range(len(rewards)), key=lambda i: (-float(rewards[i]), i))
    if not order:
        return []
    chosen = [order[0]] + ([order[-1]] if len(order) > 1 else [])
    seen = {int(groups[i]) for i in chosen}
    for i in order[1:-1]:
        if len(chosen) >= n:
            break
        if int(groups[i]) not in seen:
            chosen.append(i)
            seen.add(int(groups[i]))
    for i in order:  # fewer groups than episodes asked for
        if len(chosen) >= n:
            break
        if i not in chosen:
            chosen.append(i)
    return chosen[:n]


def segments(loss_mask, versions, prompt_len: int) -> list[tuple[str, int, int]]:
    """(kind, start, end) over a sample's tokens: `prompt`, then alternating `model` (policy tokens) and
    `obs` (everything else after the prompt)."""
    out = [("prompt", 0, prompt_len)] if prompt_len else []
    i, n = prompt_len, len(versions)
    while i < n:
        kind = "model" if versions[i] >= 0 or loss_mask[i] else "obs"
        j = i
        while j < n and ("model" if versions[j] >= 0 or loss_mask[j] else "obs") == kind:
            j += 1
        out.append((kind, i, j))
        i = j
    return out


def _lag_class(lag: int) -> str:
    return f"v{min(max(lag, 0), 3)}"


def _model_html(decode, tokens, versions, lo: int, hi: int, step: int) -> str:
    """A model turn: runs of one policy version, each coloured by its lag with a tooltip."""
    parts, i = [], lo
    while i < hi:
        v, j = int(versions[i]), i
        while j < hi and int(versions[j]) == v:
            j += 1
        text = clip(decode(tokens[i:j]), MAX_CHARS)
        if v < 0:
            parts.append(f'<span class="vm" title="tokens {i}..{j - 1}: loss-masked">{esc(text)}</span>')
        else:
            parts.append(f'<span class="{_lag_class(step - v)}" title="tokens {i}..{j - 1}: policy version {v}, '
                         f'lag {step - v}">{esc(text)}</span>')
        i = j
    return "".join(parts)


def _clip(segs: list[tuple[str, int, int]], limit: int) -> list[tuple[str, int, int]]:
    """The segments cut to the first and last `limit // 2` tokens after the prompt, a `gap` between."""
    rest = [s for s in segs if s[0] != "prompt"]
    if not rest or rest[-1][2] - rest[0][1] <= limit:
        return segs
    a, b = rest[0][1] + limit // 2, rest[-1][2] - limit // 2
    head = [s for s in segs if s[0] == "prompt"] + [(k, lo, min(hi, a)) for k, lo, hi in rest if lo < a]
    tail = [(k, max(lo, b), hi) for k, lo, hi in rest if hi > b]
    return head + [("gap", a, b)] + tail


def _prompt(segs: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """A prompt longer than PROMPT_TOKENS cut to its head and tail, a `gap` between."""
    out = []
    for kind, lo, hi in segs:
        if kind == "prompt" and hi - lo > PROMPT_TOKENS:
            a, b = lo + PROMPT_TOKENS // 2, hi - PROMPT_TOKENS // 2
            out += [("prompt", lo, a), ("gap", a, b), ("prompt", b, hi)]
        else:
            out.append((kind, lo, hi))
    return out


def contexts(seg, i: int) -> list[int]:
    """The samples of sample i's episode, in order: a summarized episode is one sample per context, its
    later contexts marked by the meta's per-sample `segment` (k > 0, following k - 1); else [i]."""
    if seg is None:
        return [i]
    first = i
    while first > 0 and seg[first] > 0:
        first -= 1
    out = [first]
    while out[-1] + 1 < len(seg) and seg[out[-1] + 1] == seg[out[-1]] + 1:
        out.append(out[-1] + 1)
    return out


def episode_html(batch, i: int, step: int, decode, prompt_len: int, limit: int, context: str = "") -> str:
    sl = batch.sample_slice(i)
    toks, mask, vers = batch.tokens[sl], batch.loss_mask[sl], batch.versions[sl]
    segs = segments(mask, vers, prompt_len)
    pol = [int(v) for v in vers if v >= 0]
    turns = sum(1 for s in segs if s[0] == "model")
    head = (f"episode {context or i} | group {int(batch.groups[i])} | reward <b>{esc(fmt(float(batch.rewards[i])))}</b> | "
            f"advantage {esc(fmt(float(batch.advantages[i])))} | {len(toks)} tokens ({prompt_len} prompt, "
            f"{len(pol)} policy, {len(toks) - prompt_len - len(pol)} observation/masked) | {turns} model turn(s)"
            + (f" | versions {min(pol)}..{max(pol)}" if pol else ""))
    body, n_turn = [], 0
    for kind, lo, hi in _prompt(_clip(segs, limit)):
        if kind == "gap":
            body.append(f'<div class="seg vm">... {hi - lo} tokens not shown ...</div>')
        elif kind == "prompt":
            opened = " open" if prompt_len <= 200 else ""  # a short prompt is the task: shown; a long one folded
            part = "prompt" if (lo, hi) == (0, prompt_len) else f"prompt, tokens {lo}..{hi - 1} of {prompt_len}"
            body.append(f'<details{opened}><summary>{part} ({hi - lo} tokens)</summary><div class="seg prompt">'
                        f'{esc(clip(decode(toks[lo:hi]), MAX_CHARS))}</div></details>')
        elif kind == "model":
            n_turn += 1
            text = clip(decode(toks[lo:hi]), MAX_CHARS)
            calls = [c.strip() for c in _TOOL_CALL.findall(text)]
            tag = f"model turn {n_turn} ({hi - lo} tokens)" + (f", {len(calls)} tool call(s)" if calls else "")
            calls_html = "".join(f'<div class="tool">tool call: {esc(clip(c, 400))}</div>' for c in calls[:MAX_CALLS])
            if len(calls) > MAX_CALLS:
                calls_html += f'<div class="tool">... {len(calls) - MAX_CALLS} more tool calls not listed</div>'
            body.append(f'<div class="seg model"><span class="tag">{esc(tag)}</span>'
                        f'{_model_html(decode, toks, vers, lo, hi, step)}{calls_html}</div>')
        else:
            body.append(f'<div class="seg obs"><span class="tag">observation / tool output ({hi - lo} tokens)'
                        f'</span>{esc(clip(decode(toks[lo:hi]), MAX_CHARS))}</div>')
    return f'<div class="episode"><div class="head">{head}</div>{"".join(body)}</div>'


def _prompt_len(plens, i: int, batch, sl) -> int:
    """Where sample i's prompt ends: the meta's `prompt_tokens[i]` when it is an integer inside the sample
    (anything else, or an older batch without it: the first policy token)."""
    n = sl.stop - sl.start
    p = plens[i] if plens is not None else None
    if isinstance(p, int) and not isinstance(p, bool) and 0 <= p <= n:
        return p
    v, m = batch.versions[sl], batch.loss_mask[sl]
    return next((j for j in range(n) if v[j] >= 0 or m[j]), n)


def section(run_dir: Path, run: dict, n_steps: int, per_step: int, limit: int = 6000,
            notes: list[str] | None = None) -> str:
    """The trajectory view; steps that cannot be shown are named in `notes` (one line each) too."""
    from rl import exchange
    from rl.contract.batch import InvalidBatch, RolloutBatch
    from rl.contract.paths import ASSETS, ROLLOUTS

    notes = [] if notes is None else notes
    head = ("<h2>Trajectories</h2><p class=\"legendrow\">policy tokens by lag (step - version): "
            "<span class=\"v0\">0</span><span class=\"v1\">1</span><span class=\"v2\">2</span>"
            "<span class=\"v3\">3+</span><span class=\"vm\">loss-masked</span> &middot; hover a span for its "
            "version; <span class=\"tool\">tool calls</span> are listed under the turn that made them</p>")
    try:
        steps = exchange.list_steps(run_dir, ROLLOUTS)
    except OSError as e:  # RUN/rollouts is a link or not a directory
        notes.append(f"{run_dir / ROLLOUTS}: not read ({e.strerror or e})")
        return head + f'<p class="warn">{esc(clip(e, 400))}</p>'
    if not steps:
        return head + "<p>No rollout batches in this run directory yet.</p>"
    decode, why = _decoder(exchange.step_dir(run_dir, ASSETS, 0))
    out = [head] + ([f'<p class="warn">tokens shown as ids: {esc(why)}</p>'] if why else [])
    rewards = {m["step"]: m.get("reward_mean") for m in run["metrics"] if "step" in m}
    chosen = pick_steps(steps, n_steps)
    size = 0
    for k, step in enumerate(chosen):
        d = exchange.step_dir(run_dir, ROLLOUTS, step)
        try:
            exchange.verify(d, checksums=True)  # no link or FIFO read, nothing changed since it was published
            batch = RolloutBatch.load(d)
        except (exchange.CorruptStep, InvalidBatch, OSError) as e:
            notes.append(f"step {step}: not shown ({clip(e, 300)})")
            out.append(f'<p class="warn">step {step}: {esc(clip(e, 400))}</p>')
            continue
        plens = batch.meta.get("prompt_tokens")
        if not (isinstance(plens, list) and len(plens) == batch.num_samples):
            plens = None
        seg = batch.meta.get("segment")   # checked by RolloutBatch.load (record_schemas.batch_meta)
        items, shown = [], set()
        for i in pick_episodes(batch.rewards, batch.groups, per_step):
            parts = contexts(seg, i)
            if size > PAGE_BUDGET or parts[0] in shown:
                continue
            shown.add(parts[0])
            for k, j in enumerate(parts):   # a summarized episode: each context in order
                sl = batch.sample_slice(j)
                items.append(episode_html(batch, j, step, decode, _prompt_len(plens, j, batch, sl), limit,
                                          f"{parts[0]}, context {k + 1} of {len(parts)} (sample {j})"
                                          if len(parts) > 1 else ""))
                size += len(items[-1])
        r = rewards.get(step)
        summary = (f"step {step}: {seg.count(0) if seg else batch.num_samples} episodes, reward mean "
                   f"{esc(fmt(float(batch.rewards.mean())))}"
                   + (f" (trainer: {esc(fmt(r))})" if isinstance(r, (int, float)) and not isinstance(r, bool)
                      else " (not trained yet)")
                   + f", showing {len(items)}")
        opened = " open" if k == len(chosen) - 1 else ""
        out.append(f'<details class="step"{opened}><summary>{summary}</summary>{"".join(items)}</details>')
        if size > PAGE_BUDGET:
            out.append(f'<p class="warn">the trajectory view stops here: its episodes reached '
                       f'{PAGE_BUDGET >> 20} MiB of page (steps after {step} not shown)</p>')
            break
    return "".join(out)
