"""The measuring half of benchmarks/seed_rehearsal.py: from what a run left (the published steps, the
ranks' and the engine's records, the orchestrator's /proc samples) to the per-step table, the seed's
extrapolation, the plan's prediction at the same volume and the last `key=value` line.

Episodes are matched to their engine requests by hashes of token prefixes: turn 0 by its prompt (the
batch meta's `prompt_tokens`) and prompt + completion (siblings of a group share the prompt), each later
turn by its routed start (the rows the episode held) and its prompt. So the routed bytes of an episode
are the ones the engine actually sent for it, counted per request, not inferred from the batch.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path

import _rehearsal_memory as mem
import _rehearsal_workers as W
from _rehearsal_engine import prompt_key as _key   # the engine's hash of a request's prompt ids

# glm5_seed (conf/experiment/glm5_seed.yaml): 16 x 16 rollouts, max_inflight 2048, max_off_policy 8, its 3
# replicas behind the router (one client, so one bound on answers read at once: InferenceClient.READ_BODIES);
# 50 turns is the plan's workload assumption (launch.perf), which sizes a turn's answer
SEED = {"rollouts": 256, "mean_tokens": 65536, "max_tokens": 131072, "layers": 75, "top_k": 8, "experts": 256,
        "trainer_ranks": 128, "data_ranks": 16, "inflight": 2048, "off_policy": 8, "servers": 1, "turns": 50}
GIB = 2 ** 30


def episodes(batch, recs_by_key: dict, recs_by_start: dict) -> list[dict]:
    """Each sample's engine requests, in turn order: turn 0 by the hash of its prompt and of prompt +
    completion, each later turn by its routed start (= rows held) and the hash of its prompt."""
    out = []
    for s in range(batch.num_samples):
        a, b = int(batch.offsets[s]), int(batch.offsets[s + 1])
        toks = batch.tokens[a:b]
        p0 = int(batch.meta["prompt_tokens"][s])
        turn = next((r for r in recs_by_key.get(_key(toks[:p0]), [])
                     if r["start"] == 0 and r.get("out") == _key(toks[:p0 + r["new"]]) and not r.get("used")), None)
        turns = []
        while turn is not None:
            turn["used"] = True
            turns.append(turn)
            held = sum(x["rows"] for x in turns)
            turn = next((r for r in recs_by_start.get(held, []) if not r.get("used") and r["prompt"] <= len(toks)
                         and r["key"] == _key(toks[:r["prompt"]])), None)
        out.append({"tokens": b - a, "turns": turns, "routed_rows": int(len(batch.routed_experts[a:b]))
                    if batch.routed_experts is not None else 0})
    return out


def analyse(a, t: dict) -> dict:
    from rl import exchange
    from rl.contract.batch import RolloutBatch, Sample
    run_dir, cfg = t["run_dir"], t["cfg"]
    recs = t["engine_stats"]
    by_key, by_start = {}, {}
    for r in recs:
        by_key.setdefault(r["key"], []).append(r)
        by_start.setdefault(r["start"], []).append(r)
    row_b = a.layers * a.top_k   # uint8 ids (<= 256 experts)
    steps, eps_all = [], []
    for n in range(a.steps):
        sd = exchange.step_dir(run_dir, "rollouts", n)
        man = exchange.read_manifest(sd)
        files = {k: int(v["size"]) for k, v in man["files"].items()}
        data = {k: v for k, v in files.items() if k.endswith(".safetensors")}
        # the batch: its data files (shards and the sample index, or the one batch file) and meta.json
        batch_bytes = sum(data.values()) + files.get("meta.json", 0)
        ranks = [r for r in t["ranks"] if r["step"] == n]
        share = batch_bytes / a.data_ranks
        own = {r["rank"]: f"shard_{r['dp_rank']:05d}.safetensors" for r in ranks}
        shard_files = {k for k in data if k.startswith("shard_")}
        # a batch whose routes are the rollout workers' part files: each rank's samples' route files are its own
        layout = json.loads((sd / "meta.json").read_text())["layout"]["ranks"]
        route_files = {k for k in data if k.startswith("routes_")}
        own_routes = {r["rank"]: {f"routes_{i:06d}.safetensors" for i in layout[r["dp_rank"]]["samples"]} & route_files
                      for r in ranks}
        own_size = {r["rank"]: data.get(own[r["rank"]], 0) + sum(data[k] for k in own_routes[r["rank"]]) for r in ranks}
        small = sum(v for k, v in files.items() if k not in shard_files | route_files) + max(
            sum(r["unlisted"].values()) for r in ranks)
        slack = 1 << 20   # lazily imported modules, /proc reads: what else a rank may read meanwhile
        only_own = None
        if shard_files and all(own[r["rank"]] in shard_files for r in ranks):
            others = {r["rank"]: min([data[k] for k in shard_files if k != own[r["rank"]]] +
                                     [sum(data[k] for k in own_routes[q["rank"]]) for q in ranks
                                      if q["rank"] != r["rank"] and route_files] or [math.inf]) for r in ranks}
            determinable = all(small + slack < others[r["rank"]] for r in ranks)
            fits = all(own_size[r["rank"]] <= r["rchar_load"] <= own_size[r["rank"]] + small + slack for r in ranks)
            only_own = fits if determinable or not fits else None
        elif not shard_files:
            only_own = False   # one batch file: every rank reads all of it
        batch = RolloutBatch.load(sd)
        eps = episodes(batch, by_key, by_start)
        eps_all += eps
        # build re-run here on the step's own samples (the orchestrator is not instrumented)
        samples = []
        for s in range(batch.num_samples):
            sl, p0 = batch.sample_slice(s), int(batch.meta["prompt_tokens"][s])
            c = slice(sl.start + p0, sl.stop)
            samples.append(Sample(prompt_ids=batch.tokens[sl.start:c.start], completion_ids=batch.tokens[c],
                                  completion_logprobs=batch.logprobs[c], completion_versions=batch.versions[c],
                                  completion_mask=batch.loss_mask[c], reward=float(batch.rewards[s]),
                                  group=int(batch.groups[s]), routed_experts=batch.routed_experts[sl]))
        tb = time.perf_counter()
        RolloutBatch.from_samples(samples, dict(batch.meta))
        build_s = time.perf_counter() - tb
        del samples
        seen = min(r["t_seen"] for r in ranks)
        st, prev = t["steps"][n], (t["steps"].get(n - 1) or t["base"])
        timing_keys = sorted({k for r in ranks for k in r["timings"]})
        http = sum(x["req_bytes"] + x["resp_bytes"] for e in eps for x in e["turns"])
        gen = sum(x["new"] for e in eps for x in e["turns"])
        steps.append({
            "step": n, "samples": batch.num_samples, "tokens": int(len(batch.tokens)), "batch_bytes": batch_bytes,
            "files": len(data), "path": ranks[0]["path"], "build_s": build_s,
            "publish_s": (st["seen"] - t["tmp_seen"][n]) if n in t["tmp_seen"] else float("nan"),
            "timings": {k: max(r["timings"].get(k, 0.0) for r in ranks) for k in timing_keys},
            "verify_load_s": max(r["t_loaded"] - r["t_seen"] for r in ranks),
            "pack_s": max(r["t_packed"] - r["t_loaded"] for r in ranks),
            "critical_s": max(r["t_packed"] for r in ranks) - seen,
            # per replay the slowest rank's share; over the replays (repeated: machine load) their median
            "alone_s": med([max(r["t_packed"] - r["t_seen"] for r in t["replay"] if r["step"] == n and
                                r.get("rep", 0) == k) for k in sorted({r.get("rep", 0) for r in t["replay"]})]),
            "rank_read": [r["rchar_load"] for r in sorted(ranks, key=lambda r: r["rank"])],
            "rank_opened": [len(r["opened"]) for r in sorted(ranks, key=lambda r: r["rank"])],
            "share": share, "only_own_shard": only_own,
            # the data ranks' own shards are every shard of the step, once each, and add up to it
            "shards_partition": (sorted(own.values()) == sorted(shard_files) if shard_files else False)
            and sum(r["tokens"] for r in ranks) == len(batch.tokens)
            and sum(data[k] for k in shard_files) == sum(data[o] for o in own.values())
            and sorted(k for o in own_routes.values() for k in o) == sorted(route_files),
            "orch_cpu_s": st.get("cpu", float("nan")) - prev.get("cpu", float("nan")),
            "orch_cpu_abs": st.get("cpu", float("nan")), "orch_hwm": st.get("hwm", 0), "orch_rss": st.get("rss", 0), "http_per_token": http / max(gen, 1),
            "episodes_matched": sum(bool(e["turns"]) for e in eps),
        })
    matched = [e for e in eps_all if e["turns"]]
    http_rows = [sum(x["row_bytes"] for x in e["turns"]) / (e["tokens"] * row_b) for e in matched]
    wire_rows = [sum(x["b64"] for x in e["turns"]) / (e["tokens"] * row_b) for e in matched]
    rows_ok = all(sum(x["rows"] for x in e["turns"]) == e["tokens"] - 1 and e["routed_rows"] == e["tokens"]
                  for e in matched) and len(matched) == len(eps_all)
    return {"steps": steps, "episodes": len(eps_all), "matched": len(matched),
            "routes_http_vs_rows": max(http_rows) if http_rows else float("nan"),
            "routes_wire_vs_rows": max(wire_rows) if wire_rows else float("nan"),
            "routes_rows_eq_tokens": rows_ok,
            "turns_mean": statistics.mean(len(e["turns"]) for e in matched) if matched else 0.0,
            "tokens_mean": statistics.mean(e["tokens"] for e in eps_all),
            "tokens_max": max(e["tokens"] for e in eps_all),
            "requests": len(recs), "http_bytes_all": sum(r["req_bytes"] + r["resp_bytes"] for r in recs),
            "generated_all": sum(r["new"] for r in recs)}


def plan_prediction(a, m: dict, t: dict, work: Path):
    """launch.dataplane at the rehearsal's own volume, and plan_vs_rehearsal measured so machine load cancels:
    the replay process (benchmarks/_rehearsal_rank.py --repeats --rates-dir) measured the rates before each
    replay of every rank's share and after the last, so replay k is compared with the plan evaluated at the
    rates measured just before and just after it (the mean of the two predicted critical paths: rates
    measured under the same load as the replay); its ratio is that over the slowest rank's share in the
    replay (median over steps). Returns ((prediction at the median rates, at the seed, the median rates,
    the per-replay ratios), None), or (None, why) where launch.dataplane is missing."""
    try:
        from launch import dataplane
    except ImportError as e:
        return None, f"launch.dataplane not importable ({e})"
    vol = dataplane.Volume(rollouts=a.rollouts_per_step, mean_tokens=m["tokens_mean"],
                           max_tokens=float(m["budget"]), moe_layers=a.layers, top_k=a.top_k,
                           n_experts=a.experts, data_ranks=a.data_ranks, trainer_ranks=a.data_ranks,
                           inflight=a.inflight, turns=max(m["turns_mean"], 1.0), router_replay=True, off_policy=1)
    seed = dataplane.Volume(rollouts=SEED["rollouts"], mean_tokens=SEED["mean_tokens"],
                            max_tokens=SEED["max_tokens"], moe_layers=SEED["layers"], top_k=SEED["top_k"],
                            n_experts=SEED["experts"], data_ranks=SEED["data_ranks"],
                            trainer_ranks=SEED["trainer_ranks"], inflight=SEED["inflight"], turns=SEED["turns"],
                            off_policy=SEED["off_policy"],
                            router_replay=True)
    measured = {r["rep"]: dataplane.Rates(**r["rates"]) for r in t.get("replay_rates") or []}
    if not measured:   # a replay without rates (probe-sized runs): measured once, now
        measured = {0: dataplane.measure_rates(work, mib=64)}
    ratios = []
    for k in sorted({r.get("rep", 0) for r in t["replay"]}):
        around = [measured[j] for j in (k, k + 1) if j in measured]
        pred = statistics.mean(dataplane.predict(vol, x).critical_path_s for x in around)
        alone = med([max(r["t_packed"] - r["t_seen"] for r in t["replay"] if r["step"] == n and r.get("rep", 0) == k)
                     for n in range(a.steps)])
        ratios.append(pred / alone)
    rates = dataplane.Rates(**{f: statistics.median(getattr(x, f) for x in measured.values())
                               for f in ("sha256", "read", "write", "build", "decode", "pack")})
    return (dataplane.predict(vol, rates), dataplane.predict(seed, rates), rates, ratios), None


def med(xs):
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def report(a, t: dict, m: dict, work: Path) -> str:
    steps = m["steps"]
    seed_tokens = SEED["rollouts"] * SEED["mean_tokens"]
    print(f"rehearsal: {a.rollouts_per_step} rollouts x {a.tokens_per_episode} tokens (mean measured "
          f"{m['tokens_mean']:.0f}, max {m['tokens_max']}, budget {m['budget']}) in {a.turns} turns "
          f"({m['turns_mean']:.1f} measured), routes {a.layers} x {a.top_k} uint8, {a.data_ranks} data ranks, "
          f"{a.steps} steps, {a.inflight} in flight; {a.rollouts_per_step * m['tokens_mean'] / seed_tokens:.2%} "
          f"of the seed's tokens per step; data path: {steps[0]['path']}")
    print(f"{'step':>4} {'batch MB':>9} {'build s':>8} {'publ s':>7} {'ver+load s':>10} {'pack s':>7} "
          f"{'crit s':>7} {'alone s':>7} {'rank read MB':>28} {'orch cpu s':>10} {'orch RSS/HWM MB':>15} "
          f"{'HTTP B/tok':>10}")
    for s in steps:
        reads = " ".join(f"{r / 1e6:.1f}" for r in s["rank_read"])
        print(f"{s['step']:>4} {s['batch_bytes'] / 1e6:>9.1f} {s['build_s']:>8.2f} {s['publish_s']:>7.2f} "
              f"{s['verify_load_s']:>10.2f} {s['pack_s']:>7.2f} {s['critical_s']:>7.2f} {s['alone_s']:>7.2f} {reads:>28} "
              f"{s['orch_cpu_s']:>10.1f} {s['orch_rss'] / 1e6:>7.0f}/{s['orch_hwm'] / 1e6:<7.0f} {s['http_per_token']:>10.0f}")
        if s["timings"]:
            print("      its data path's own timings (max over ranks): " + ", ".join(
                f"{k} {v:.3f}" if k.endswith("_s") else f"{k} {v:.0f}" for k, v in s["timings"].items()))
    batch_b = med([s["batch_bytes"] for s in steps])
    tokens = med([s["tokens"] for s in steps])
    per_token = batch_b / tokens
    route_b = a.layers * a.top_k
    seed_per_token = per_token - route_b + SEED["layers"] * SEED["top_k"]
    seed_batch = seed_tokens * seed_per_token
    # per step: the most a rank read over that step's batch / data ranks (batches differ in size)
    worst = max(steps, key=lambda s: max(s["rank_read"]) / s["share"])
    rank_read, share = max(worst["rank_read"]), worst["share"]
    rank_read_vs_share = rank_read / share
    whole = steps[0]["path"] != "share"
    seed_rank_read = seed_batch if whole else rank_read_vs_share * seed_batch / SEED["data_ranks"]
    crit = med([s["critical_s"] for s in steps])
    alone = med([s["alone_s"] for s in steps])
    seed_crit, seed_alone = crit * seed_rank_read / rank_read, alone * seed_rank_read / rank_read
    # per batch over the run: the pool works ahead, so batches come in bursts and per-step deltas say little;
    # the tokenizer's load after the servers are up (measured apart) is start-up, not a step's
    cpu = (steps[-1]["orch_cpu_abs"] - t["base"]["cpu"] - t["startup_cpu"]) / len(steps)
    seed_cpu = cpu * seed_tokens / tokens
    rollout_side = {**W.keys(cpu, t, len(steps), tokens, seed_tokens, getattr(a, "seed_workers", 16),
                             getattr(a, "baseline_cpu_per_token", None)), **W.router_keys(t, SEED)}
    base = t["fixed_rss"]
    peak = t["end"].get("hwm", 0)
    scale = SEED["inflight"] * SEED["mean_tokens"] / (a.inflight * m["tokens_mean"])
    seed_rss_batch = base + (peak - base) * seed_tokens / tokens
    anon = t["anon_peak"]
    # Anonymous memory between builds, a sum of parts each scaled to the seed by its own driver (fixed,
    # rest, episodes in flight, tokens in flight, the largest answer, finished samples waiting for their
    # batch): benchmarks/_rehearsal_memory.py. While a step is written the shard being built comes on top
    # (`build`, scaled by a data rank's share of the batch). File-backed pages (libraries; one sample's
    # mapped routes while it is copied, rl.contract.batch_files._drop_pages) come on top as measured.
    probes = t.get("probes") or {}
    idle = t.get("anon_idle") or anon
    build = max(0.0, anon - idle)
    seed_share = seed_batch / SEED["data_ranks"]
    largest = max((r["resp_bytes"] for r in t["engine_stats"]), default=0)
    main_run = mem.Run(a.inflight, m["tokens_mean"], max(m["turns_mean"], 1.0), largest, idle)
    seed_vol = mem.SeedVolume(SEED["inflight"], SEED["mean_tokens"], SEED["turns"], SEED["rollouts"],
                              SEED["off_policy"], SEED["servers"])
    servers_here = t["servers"]
    if all(probes.get(k, {}).get("anon_idle") for k in ("inflight", "length", "turn")):
        runs = {"main": main_run, **{k: mem.Run(p["inflight"], p["mean_tokens"], p["turns"], p["largest_answer"],
                                                p["anon_idle"]) for k, p in probes.items()}}
        fit = mem.fit(runs["main"], runs["inflight"], runs["length"], runs["turn"], t["fixed_anon"])
        how = "three probe runs, each part by its own driver"
    else:
        runs = {"main": main_run}
        fit = mem.Fit(t["fixed_anon"], 0.0, max(0.0, idle - t["fixed_anon"]) / max(main_run.tokens_inflight, 1.0),
                      0.0, 0.0)
        how = "no probe runs: all growth charged to tokens in flight"
    parts = mem.at_seed(fit, main_run, seed_vol, servers_here, build, seed_share / max(share, 1.0))
    seed_anon = parts["anon"]
    mem_token, per_episode = fit.per_token, fit.per_episode
    one_sample_routes = SEED["max_tokens"] * SEED["layers"] * SEED["top_k"]
    seed_rss = seed_anon + max(0, base - t["fixed_anon"]) + one_sample_routes
    http_tok = m["http_bytes_all"] / max(m["generated_all"], 1)
    print(f"routes over HTTP per episode / the episode's rows: decoded {m['routes_http_vs_rows']:.3f} (max over "
          f"{m['matched']} of {m['episodes']} episodes), on the wire (base64 in JSON) {m['routes_wire_vs_rows']:.3f}")
    print(f"rank read: max {rank_read / 1e6:.1f} MB vs share {share / 1e6:.1f} MB (that step's batch / {a.data_ranks}) = "
          f"{rank_read_vs_share:.2f}; orchestrator: {cpu:.1f} CPU s per batch (all CPU after start-up / batches), peak RSS "
          f"{peak / GIB:.2f} GiB over a fixed part of {base / GIB:.2f} GiB (a process doing its start-up only); HTTP {http_tok:.0f} B per generated token")
    print(f"seed ({SEED['rollouts']} x {SEED['mean_tokens']} tokens, {SEED['layers']} x {SEED['top_k']} routes, "
          f"{SEED['trainer_ranks']} trainer ranks = {SEED['data_ranks']} data ranks x 8 cp, {SEED['inflight']} in flight):")
    print(f"  batch {seed_batch / 1e9:.2f} GB ({seed_per_token:.0f} B/token: measured {per_token:.1f} B/token less "
          f"{route_b} B of rehearsal routes plus {SEED['layers'] * SEED['top_k']} B of the seed's)")
    print(f"  critical path {seed_crit:.1f} s = measured {crit:.2f} s x rank read {seed_rank_read / 1e9:.2f} GB / "
          f"{rank_read / 1e6:.1f} MB ({'every rank reads the whole batch' if whole else 'batch / data ranks'}; "
          f"linear in bytes at this machine's per-rank rate, the filesystem assumed to keep up); "
          f"{seed_alone:.1f} s from the slowest rank alone ({alone:.2f} s)")
    print(f"  (live: {a.data_ranks} ranks, the orchestrator and the engine share {os.cpu_count()} cores; alone: each "
          f"rank's share replayed after the run, nothing of it still running, as a rank with a core of its own)")
    print(f"  orchestrator CPU {seed_cpu:.0f} s per step = {cpu:.1f} s (per batch over the run) x {seed_tokens / tokens:.0f} (tokens per step, "
          f"at {m['turns_mean']:.0f} turns per episode)")
    if "seed_router_cpu_s" in rollout_side:
        r = rollout_side
        print(f"  router CPU {r['seed_router_cpu_s']:.1f} s per step (one process) = {r['router_us_per_context_token']:.3f} us "
              f"per context token ({r['router_cpu_s']:.1f} s over {r['router_context_tokens'] / 1e6:.1f} M context tokens of "
              f"every request here) x {SEED['rollouts'] * SEED['mean_tokens'] * (SEED['turns'] + 1) / 2 / 1e6:.0f} M "
              f"(rollouts x mean tokens x (turns + 1) / 2 at the seed)")
    print(f"  orchestrator memory ({how}): RssAnon {idle / GIB:.2f} GiB with {a.inflight} in flight between "
          f"builds, {anon / GIB:.2f} GiB at its peak while a step was written (build {build / GIB:.2f} GiB for a "
          f"{share / 1e6:.0f} MB share, x {seed_share / max(share, 1):.1f} at the seed)")
    for ln in mem.describe(fit, parts, seed_vol, runs):
        print(ln)
    print(f"  orchestrator RSS {seed_rss / GIB:.1f} GiB = anonymous {seed_anon / GIB:.2f} + file-backed "
          f"{max(0, base - t['fixed_anon']) / GIB:.2f} (libraries, as measured) + one sample's mapped routes "
          f"{one_sample_routes / GIB:.2f}; measured here: HWM {peak / GIB:.2f} GiB (fixed {base / GIB:.2f}); "
          f"cruder, all growth scaled by tokens in flight {(base + (peak - base) * scale) / GIB:.1f} GiB, by "
          f"tokens per batch {seed_rss_batch / GIB:.1f} GiB (neither counts samples waiting)")
    pred, why = plan_prediction(a, m, t, work)
    plan_vs, plan_cpu_vs, plan_vs_alone = float("nan"), float("nan"), float("nan")
    spread = (float("nan"), float("nan"))
    if pred is None:
        print(f"plan: {why}")
    else:
        p, ps, rates, ratios = pred
        plan_vs, plan_cpu_vs = p.critical_path_s / crit, p.orchestrator_cpu_s / cpu
        plan_vs_alone, spread = med(ratios), (min(ratios), max(ratios))
        n_rates = len(t.get("replay_rates") or []) or 1
        print(f"plan (launch.dataplane at this volume, rates measured in the replay process, median of {n_rates}: "
              + ", ".join(f"{k} {getattr(rates, k) / 1e9:.2f}" for k in ("sha256", "read", "write", "build",
                                                                        "decode", "pack")) + " GB/s):")
        for r in t.get("replay_rates") or []:
            print(f"  rates before replay {r['rep'] + 1}: " + ", ".join(
                f"{k} {r['rates'][k] / 1e9:.2f}" for k in ("sha256", "read", "pack")) + " GB/s")
        res = [r["resident"] for r in t["replay"] if r.get("resident", float("nan")) == r.get("resident")]
        print(f"  plan_vs_rehearsal per replay (plan at the rates measured before and after it / its slowest "
              f"rank's share, median over steps): {', '.join(f'{x:.2f}' for x in ratios)}; median "
              f"{plan_vs_alone:.2f}, spread {spread[0]:.2f}-{spread[1]:.2f}; shards in the page cache before "
              f"each replayed read: min {min(res, default=float('nan')):.0%} (the rates' read is a page-cache hit)")
        print(f"  batch {p.batch_bytes / 1e6:.1f} MB (measured {batch_b / 1e6:.1f}), rank read {p.rank_read_bytes / 1e6:.1f} MB "
              f"(measured {rank_read / 1e6:.1f}), critical path {p.critical_path_s:.2f} s (measured {crit:.2f} live: "
              f"{plan_vs:.2f}; {alone:.2f} alone: {plan_vs_alone:.2f}), orchestrator data-plane CPU {p.orchestrator_cpu_s:.1f} s (measured all CPU "
              f"{cpu:.1f}: {plan_cpu_vs:.2f})")
        print(f"  at the seed: critical path {ps.critical_path_s:.1f} s, orchestrator CPU {ps.orchestrator_cpu_s:.0f} s, "
              f"RSS {ps.orchestrator_rss_bytes / GIB:.1f} GiB, batch {ps.batch_bytes / 1e9:.2f} GB")
    kv = {
        "routes_http_vs_rows": m["routes_http_vs_rows"], "routes_wire_vs_rows": m["routes_wire_vs_rows"],
        "rank_read_vs_share": rank_read_vs_share, "seed_critical_path_s": seed_crit,
        # the plan predicts a rank with a core of its own: compared with each rank's share replayed alone;
        # live, four ranks, the orchestrator and the engines share two cores
        "seed_orchestrator_rss_gib": seed_rss / GIB, "plan_vs_rehearsal": plan_vs_alone,
        "plan_vs_rehearsal_spread": f"{spread[0]:.3g},{spread[1]:.3g}",
        "plan_vs_rehearsal_live": plan_vs, "seed_critical_path_alone_s": seed_alone,
        "seed_orchestrator_rss_batch_scaled_gib": seed_rss_batch / GIB,
        "seed_orchestrator_anon_gib": seed_anon / GIB, "orch_bytes_per_inflight_token": mem_token,
        "orch_kib_per_inflight_episode": per_episode / 2**10, "orch_answers_held": fit.per_answer,
        "orch_anon_rest_gib": fit.rest / GIB, "orch_anon_fixed_gib": fit.fixed / GIB,
        "seed_rss_tokens_gib": parts["tokens"] / GIB, "seed_rss_episodes_gib": parts["episodes"] / GIB,
        "seed_rss_answers_gib": parts["answers"] / GIB, "seed_rss_waiting_gib": parts["waiting"] / GIB,
        "seed_rss_build_gib": parts["build"] / GIB, "orch_anon_peak_gib": anon / GIB,
        "plan_vs_rehearsal_orch_cpu": plan_cpu_vs, "seed_orchestrator_cpu_s": seed_cpu,
        "seed_batch_gb": seed_batch / 1e9, "critical_path_s": crit, "critical_path_alone_s": alone, "batch_bytes": int(batch_b),
        "share_bytes": int(share), "rank_read_bytes_max": int(rank_read),
        "build_s": med([s["build_s"] for s in steps]), "publish_s": med([s["publish_s"] for s in steps]),
        "verify_load_s": med([s["verify_load_s"] for s in steps]), "pack_s": med([s["pack_s"] for s in steps]),
        "orch_cpu_s_per_step": cpu, "orch_rss_fixed_gib": base / GIB, "orch_rss_peak_gib": peak / GIB,
        "http_bytes_per_token": http_tok, "tokens_per_step": int(tokens), "tokens_mean": m["tokens_mean"],
        "tokens_max": m["tokens_max"], "turns_mean": m["turns_mean"], "episodes": m["episodes"],
        "episodes_matched": m["matched"], "rollouts": a.rollouts_per_step, "data_ranks": a.data_ranks,
        "steps": a.steps, "path": steps[0]["path"],
        "only_own_shard": "na" if any(s["only_own_shard"] is None for s in steps)
        else int(all(s["only_own_shard"] for s in steps)),
        "routes_rows_eq_tokens": int(m["routes_rows_eq_tokens"]),
        "shards_partition_batch": int(all(s["shards_partition"] for s in steps)),
        "wall_s": t["wall_s"], **rollout_side,
    }
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in kv.items())
