"""Time-to-reward and the correction menu's report for benchmarks/async_rollouts.py.

What a user buys from asynchrony is wall time to a given policy quality, so the headline is the wall time
until the exact policy reward (the toy's probabilities, no sampling noise) first reaches a target, from
the run's start: the sync baseline's final policy reward of the same seed, and a fixed level printed
beside it. Speed-ups are paired per seed (sync's time over the mode's: 2.0 = reached twice as soon), then
the median with min/max. A run that never reaches a target within its steps has an infinite time (a
speed-up of 0 against a baseline that does).

Variants: every non-baseline mode runs once per correction (`trainer.mismatch`) and per mismatch KL; the
sync baselines run once, with the default correction and no mismatch. A variant's label is its mode,
then `+<correction>` when not the default, then `@kl<value>` when mismatched.

Also the learning summary every run gets (`learning_summary`: reward per step, two ways) and the per-seed
pairing of a mode against its baseline (`paired`, `spread`): the same comparisons, kept with this report.
"""
from __future__ import annotations

import math
import statistics

BASELINES = ("sync", "sync_oversample")


def variant_label(mode: str, corr: str, kl: float, default_corr: str) -> str:
    return mode + ("" if corr == default_corr else f"+{corr}") + (f"@kl{kl:g}" if kl else "")


def variant_list(modes, corrs, kls, default_corr) -> list[tuple[str, str, str, float]]:
    """[(label, mode, correction, mismatch KL)] in run order."""
    out = []
    for mode in modes:
        if mode in BASELINES:
            out.append((mode, mode, default_corr, 0.0))
        else:
            out += [(variant_label(mode, c, kl, default_corr), mode, c, kl) for c in corrs for kl in kls]
    return out


def time_to(res: dict, target: float) -> float:
    """Wall seconds from the run's start to the first step whose policy reward is >= target (inf: never)."""
    for t, r in zip(res.get("policy_times", []), res.get("policy_rewards", [])):
        if r >= target - 1e-12:
            return t
    return math.inf


def add_times(results: dict, level: float) -> None:
    """Per run: `sync_target` (its seed's sync final policy reward), `ttr_sync` and `ttr_level`."""
    for (model, _), rs in results.items():
        syncs = results.get((model, "sync"), [])
        for i, res in enumerate(rs):
            if "policy_rewards" not in res:
                continue
            if i < len(syncs) and "final_policy_reward" in syncs[i]:
                res["sync_target"] = syncs[i]["final_policy_reward"]
                res["ttr_sync"] = time_to(res, res["sync_target"])
            res["ttr_level"] = time_to(res, level)


def sooner(results: dict, model: str, label: str, base: str, field: str) -> list[float]:
    """Per seed: base's time over the variant's (how many times sooner the variant got there)."""
    out = []
    for x, y in zip(results.get((model, label), []), results.get((model, base), [])):
        if field in x and field in y:
            tx, ty = x[field], y[field]
            out.append(math.nan if math.isinf(tx) and math.isinf(ty) else 0.0 if math.isinf(tx) else ty / tx)
    return out


def _fmt(xs, f=".2f") -> str:
    return " ".join(f"{x:{f}}" for x in xs)


def _med(xs):
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else math.nan


def report(results: dict, variants, models, head: str, level: float, k: int) -> list[str]:
    """Prints the time-to-reward section, the corrections table and the mismatch comparison; returns
    the last line's first figures (for `head`, the default variant)."""
    meta = {label: (mode, corr, kl) for label, mode, corr, kl in variants}
    line: list[str] = []
    print()
    print(f"Time to reward (wall s from the run's start until the exact policy reward first reaches the target; "
          f"targets: the same seed's sync final policy reward, and {level}); x sooner = base's time / this one's")
    for model in models:
        pre = "" if model == "agentic" else f"{model}_"
        targets = [r.get("final_policy_reward", math.nan) for r in results.get((model, "sync"), [])]
        print(f"  {model}: sync final policy reward per seed {_fmt(targets, '.4f')}")
        for label, *_ in variants:
            rs = results.get((model, label), [])
            if not rs or "ttr_level" not in rs[0]:
                continue
            row = f"  {model:8s} {label:28s} to sync final {_fmt([r.get('ttr_sync', math.nan) for r in rs], '.1f')} s"
            for base in BASELINES:
                if label != base and (model, base) in results:
                    xs = sooner(results, model, label, base, "ttr_sync")
                    row += f"; x{_fmt(xs)} vs {base}"
            row += f"; to {level}: {_fmt([r['ttr_level'] for r in rs], '.1f')} s"
            print(row)
        for base, name in (("sync", "time_to_reward_vs_sync"), ("sync_oversample", "time_to_reward_vs_oversample")):
            xs = sooner(results, model, head, base, "ttr_sync")
            if xs:
                line += [f"{pre}{name}={_med(xs):.3f}", f"{pre}{name}_min={min(xs):.3f}",
                         f"{pre}{name}_max={max(xs):.3f}", f"{pre}{name}_seeds={','.join(f'{x:.3f}' for x in xs)}"]
            ys = sooner(results, model, head, base, "ttr_level")
            if ys:
                line.append(f"{pre}{name}_at_{level:g}={_med(ys):.3f}")
    print()
    print(f"Corrections at max_off_policy={k}: medians over seeds (time to sync's final: inf = never reached "
          f"within the run's steps)")
    print("| model | variant | correction | mismatch KL | time to sync final (s) | x sooner than sync | time to "
          f"{level} (s) | final policy reward | masked share | samples masked | k3 KL |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for model in models:
        for label, mode, corr, kl in variants:
            rs = results.get((model, label), [])
            if not rs or "final_policy_reward" not in rs[0] or mode in BASELINES:
                continue
            m = lambda f: _med([r.get(f, math.nan) for r in rs])  # noqa: E731
            print(f"| {model} | {label} | {corr} | {kl:g} | {m('ttr_sync'):.1f} | "
                  f"{_med(sooner(results, model, label, 'sync', 'ttr_sync')):.2f} | {m('ttr_level'):.1f} | "
                  f"{m('final_policy_reward'):.4f} | {m('masked_share'):.1%} | {m('seq_masked_share'):.1%} | "
                  f"{m('mismatch_k3'):.2e} |")
    # the same mode and correction with and without mismatch, seed by seed
    pairs = [(lab0, lab1) for lab0, (m0, c0, k0) in meta.items() if k0 == 0 and m0 not in BASELINES
             for lab1, (m1, c1, k1) in meta.items() if k1 > 0 and (m1, c1) == (m0, c0)]
    if pairs:
        print()
        print("Final policy reward without / with mismatch, paired per seed (with - without):")
    for model in models:
        pre = "" if model == "agentic" else f"{model}_"
        for lab0, lab1 in pairs:
            r0, r1 = results.get((model, lab0), []), results.get((model, lab1), [])
            f0 = [r["final_policy_reward"] for r in r0 if "final_policy_reward" in r]
            f1 = [r["final_policy_reward"] for r in r1 if "final_policy_reward" in r]
            ds = [y - x for x, y in zip(f0, f1)]
            if not ds:
                continue
            mode, corr, kl = meta[lab1]
            print(f"  {model:8s} {mode} {corr:12s} without {_fmt(f0, '.4f')} | with KL {kl:g} {_fmt(f1, '.4f')} | "
                  f"change {_fmt(ds, '+.4f')} -> median {_med(ds):+.4f}")
            if mode == head.split("+")[0].split("@")[0]:
                line += [f"{pre}final_policy_reward_{corr}={_med(f0):.4f}",
                         f"{pre}final_policy_reward_{corr}_kl{kl:g}={_med(f1):.4f}",
                         f"{pre}mismatch_change_{corr}={_med(ds):+.4f}"]
    return line


def paired(results: dict, model: str, mode: str, base: str, field: str, ratio: bool = False) -> list[float]:
    """Per repeat (the same seed for both modes), mode's field minus (or over) base's."""
    xs, ys = results.get((model, mode), []), results.get((model, base), [])
    return [(x[field] / y[field] if ratio else x[field] - y[field]) for x, y in zip(xs, ys)
            if field in x and field in y and (not ratio or y[field] > 0)]


def spread(ds: list[float], fmt: str = "+.4f") -> str:
    """median [min, max], the mean's 90% interval (t, over repeats) and the sign count."""
    if not ds:
        return "n/a"
    med = statistics.median(ds)
    out = f"median {med:{fmt}} [min {min(ds):{fmt}}, max {max(ds):{fmt}}] over {len(ds)} seed(s)"
    if len(ds) >= 3:
        t90 = {2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833}.get(len(ds) - 1, 1.8)
        m, sd = statistics.fmean(ds), statistics.stdev(ds)
        out += f"; mean {m:{fmt}}, 90% CI [{m - t90 * sd / len(ds) ** 0.5:{fmt}}, {m + t90 * sd / len(ds) ** 0.5:{fmt}}]"
    return out


def learning_summary(res: dict, policy_rewards: list) -> None:
    """Reward per step, two ways, each averaged over the later half of the steps (the early steps are
    alike under every mode: the policy has barely moved): `reward_per_step`, the batch's own reward (the
    rollouts trained at step n, generated by versions up to max_off_policy older, so a mode with a larger
    lag reports a lower reward for the same policy), and `policy_reward_per_step`, the exact expected
    reward of the policy each step produced (sim only: the toy's probabilities, no sampling noise).
    `reward_all_steps` keeps the mean over every step."""
    rw = res["rewards"]
    late = rw[len(rw) // 2:] or rw
    res["reward_all_steps"] = statistics.fmean(rw)
    res["reward_per_step"] = statistics.fmean(late)
    pr = [x for x in policy_rewards if x is not None]
    if len(pr) == len(rw) and pr:
        res["policy_rewards"] = pr
        res["policy_reward_per_step"] = statistics.fmean(pr[len(pr) // 2:] or pr)
