"""The trainer role: warm start, then one optimizer step per rollout batch, publishing every version.

`run(run_dir)` is the whole role (docs/internals.md, "Trainer"); `python -m rl.trainer --run-dir D`
calls it, and the tests call it in-process with their own stop flag and warm-start examples.

Run-directory use, in order:
- `roles/trainer.json` (record_role); `config.yaml` and `resume.json` are read;
- first start: `assets/step_000000` (tokenizer + config.json, `rl.model.tiny.write_hf_assets`), the
  supervised warm start, `weights/step_000000` (version 0) and `checkpoints/step_000000`, so a restart
  before the first periodic checkpoint does not redo the warm start;
- resume: `checkpoints/step_c` (c from resume.json, else the newest complete one), and
  `weights/step_c` is republished if missing;
- per step n: waits for `rollouts/step_n`, verifies it with checksums, trains, appends to
  `rollouts/consumed.jsonl`, publishes `weights/step_{n+1}`, logs a line to `metrics.jsonl`, prunes old
  weights (never the newest checkpoint's), checkpoints every `trainer.checkpoint_every` steps, at the
  end and when asked to stop; `DONE` after the last step.

A rollout batch that fails verification (truncated, checksum mismatch, unreadable) is never trained on.
The trainer logs it, moves it aside to `rollouts/corrupt/step_N-<time>` (out of every reader's sight,
kept for inspection) and waits for the step to be published again: the orchestrator produces every
missing step, and exiting instead would not help, since a restart keeps rollout steps up to the
checkpoint and would find the same corrupt file.

Single process for now. Multi-rank (`trainer.parallel`: FSDP / EP / CP) goes through
`built.spec.parallelize_fn` after `build_model` and DCP already reshards; the loss normaliser would then
be all-reduced across data-parallel ranks.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from rl import exchange
from rl.exchange import weights as wire
from rl.orchestrator.batch import BATCH_FILE, RolloutBatch
from rl.runtime import EXIT_PREEMPTED, StopFlag, load_config, log, mark_done, record_role, resume_state
from rl.trainer import checkpoint as ckpt
from rl.trainer.loss import LossConfig, add_stats, finalize_stats, pg_loss
from rl.trainer.model import Built, build_model, hf_state_dict, token_logprobs

ROLE = "trainer"
# (n, rng) -> [(prompt_ids, completion_ids)]: the supervised warm start's data.
Examples = Callable[[int, random.Random], Sequence[tuple[Sequence[int], Sequence[int]]]]


@dataclass
class MicroBatch:
    tokens: torch.Tensor      # [1, L] int64, several samples back to back
    positions: torch.Tensor   # [1, L] restarting at 0 at each sample
    per_token: dict[str, torch.Tensor]  # mask, lp_inf, adv, lag ... each [1, L]


def pack(offsets: np.ndarray, max_tokens: int, max_seq_len: int, tokens: np.ndarray,
         **per_token: np.ndarray) -> list[MicroBatch]:
    """Greedy in-order packing of whole samples into rows of at most `max_tokens` tokens.

    A sample longer than `max_tokens` gets a row of its own; one longer than the model's context is an
    error (RoPE has no positions for it).
    """
    lengths = np.diff(offsets)
    if len(lengths) and lengths.max() > max_seq_len:
        raise ValueError(f"a sample has {int(lengths.max())} tokens, above model.max_seq_len={max_seq_len}")
    groups, cur, size = [], [], 0
    for i, n in enumerate(lengths):
        if cur and size + n > max_tokens:
            groups.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += int(n)
    if cur:
        groups.append(cur)
    out = []
    for g in groups:
        a, b = int(offsets[g[0]]), int(offsets[g[-1] + 1])
        pos = np.concatenate([np.arange(n) for n in lengths[g]])
        out.append(MicroBatch(
            tokens=torch.from_numpy(tokens[a:b].astype(np.int64))[None],
            positions=torch.from_numpy(pos.astype(np.int64))[None],
            per_token={k: torch.from_numpy(np.ascontiguousarray(v[a:b], dtype=np.float32))[None]
                       for k, v in per_token.items()}))
    return out


def build_optimizer(model, t):
    """AdamW through torchtitan's OptimizersContainer (FQN-keyed state dict, DCP-ready)."""
    from torchtitan.components.optimizer.optimizer import default_adamw

    oc = default_adamw(lr=float(t.lr), betas=tuple(float(b) for b in t.betas),
                       weight_decay=float(t.weight_decay), eps=1e-8)
    oc.implementation = "for-loop" if next(model.parameters()).device.type == "cpu" else "fused"
    return oc.build(model_parts=[model])


class Trainer:
    """Model + optimizer + progress of one trainer lineage; no run-directory polling in here."""

    def __init__(self, cfg, device: str = "cpu"):
        if cfg.trainer.fp8:
            raise NotImplementedError("trainer.fp8 (emulated FP8 training) is not implemented yet")
        if cfg.trainer.kl_coef:
            raise NotImplementedError("trainer.kl_coef > 0 (reference-KL penalty) is not implemented yet")
        self.cfg = cfg
        self.built: Built = build_model(cfg.model, seed=int(cfg.seed), device=device, dtype=cfg.trainer.dtype)
        self.model = self.built.model
        self.optimizer = build_optimizer(self.model, cfg.trainer)
        self.loss_cfg = LossConfig.from_trainer(cfg.trainer)
        self.progress = ckpt.TrainerProgress()

    def _pack(self, offsets, tokens, **per_token) -> list[MicroBatch]:
        return pack(offsets, int(self.cfg.trainer.micro_batch_tokens), int(self.cfg.model.max_seq_len),
                    tokens, **per_token)

    def _clip(self) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), float(self.cfg.trainer.grad_clip)))

    def warm_start(self, examples: Examples) -> dict:
        """Supervised steps (cross-entropy on completion tokens) with a private AdamW, discarded after.

        Only a tiny model made from scratch needs it: it makes the first RL rewards non-zero. The RL
        optimizer starts fresh afterwards, so the warm start's moments do not leak into RL.
        """
        ws, t = self.cfg.trainer.warm_start, self.cfg.trainer
        opt = torch.optim.AdamW(self.model.parameters(), lr=float(ws.lr), betas=tuple(t.betas),
                                weight_decay=float(t.weight_decay), foreach=False)
        rng = random.Random(int(self.cfg.seed))
        loss_v = float("nan")
        for i in range(int(ws.steps)):
            ex = examples(int(ws.batch_size), rng)
            toks, mask, offs = [], [], [0]
            for p, c in ex:
                toks += list(p) + list(c)
                mask += [0] * len(p) + [1] * len(c)
                offs.append(len(toks))
            mbs = self._pack(np.asarray(offs), np.asarray(toks), mask=np.asarray(mask))
            n = sum(float(mb.per_token["mask"].sum()) for mb in mbs)
            opt.zero_grad()
            loss_v = 0.0
            for mb in mbs:
                lp, _ = token_logprobs(self.model, mb.tokens, mb.positions)
                loss = -(lp * mb.per_token["mask"]).sum() / n
                loss.backward()
                loss_v += float(loss.detach())
            self._clip()
            opt.step()
            if i % 10 == 0 or i == int(ws.steps) - 1:
                log(ROLE, f"warm start {i + 1}/{ws.steps}: nll {loss_v:.3f}")
        return {"warm_start_nll": loss_v}

    def train_step(self, batch: RolloutBatch, step: int) -> dict:
        """One optimizer step on rollout batch `step`; returns its metrics."""
        counts = np.diff(batch.offsets)
        mask = batch.loss_mask.astype(np.float32)
        lag = np.where(batch.loss_mask > 0, step - batch.versions, 0).astype(np.float32)
        mbs = self._pack(batch.offsets, batch.tokens, mask=mask, lp_inf=batch.logprobs,
                         adv=np.repeat(batch.advantages, counts), lag=lag)
        n_loss = float(mask.sum())
        self.optimizer.zero_grad()
        loss_v, stats = 0.0, None
        for mb in mbs:
            pt = mb.per_token
            if n_loss == 0:
                break  # nothing to learn from: no backward, the optimizer leaves the weights alone
            lp, ent = token_logprobs(self.model, mb.tokens, mb.positions)
            loss, st = pg_loss(lp, pt["lp_inf"], pt["adv"], pt["mask"], self.loss_cfg, entropy=ent,
                               normalizer=n_loss)
            loss.backward()
            loss_v += float(loss.detach())
            stats = add_stats(stats, st)
        grad_norm = self._clip() if n_loss else 0.0
        self.optimizer.step()
        m = finalize_stats(stats) if stats else {}
        loss_lag = lag[batch.loss_mask > 0]
        return {"loss": loss_v, "grad_norm": grad_norm, **m,
                "reward_mean": float(batch.rewards.mean()) if len(batch.rewards) else math.nan,
                "lag": float(loss_lag.mean()) if len(loss_lag) else 0.0,
                "lag_max": int(loss_lag.max()) if len(loss_lag) else 0,
                "samples": int(batch.num_samples), "tokens": int(len(batch.tokens)),
                "micro_batches": len(mbs)}

    # -- run-directory side ---------------------------------------------------------------------------
    def publish_weights(self, run_dir, version: int) -> exchange.Published:
        """`weights/step_<version>`: FP8 block-scaled linears, the rest in the trainer's dtype."""
        sd = hf_state_dict(self.built)
        return exchange.publish(run_dir, "weights", version,
                                lambda d: wire.write_shards(d, sd, wire_dtype=self.built.dtype),
                                producer=ROLE, policy_version=version)

    def save(self, run_dir, step: int) -> None:
        ckpt.save(run_dir, step, self.model, self.optimizer, self.progress)
        exchange.prune(run_dir, ckpt.KIND, int(self.cfg.trainer.keep_checkpoints))

    def load(self, run_dir, step: int) -> None:
        self.progress = ckpt.load(run_dir, step, self.model, self.optimizer)
        if self.progress.next_step != step:
            raise RuntimeError(f"checkpoints/step_{step:06d} says next_step={self.progress.next_step}")


def next_batch(run_dir, step: int, stop: StopFlag, poll: float = 0.2) -> tuple[RolloutBatch, dict] | None:
    """Wait for `rollouts/step_<step>`, verified with checksums; quarantine and re-wait if corrupt."""
    while True:
        path = exchange.wait_for(run_dir, "rollouts", step, poll=poll, should_stop=stop.is_set)
        if path is None:
            return None
        try:
            manifest = exchange.verify(path, checksums=True)
            return RolloutBatch.load(path), manifest
        except (exchange.CorruptStep, OSError, ValueError) as e:
            dest = Path(run_dir) / "rollouts" / "corrupt" / f"{path.name}-{int(time.time())}"
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                path.rename(dest)  # atomic: the step is now missing, the orchestrator republishes it
            except FileNotFoundError:
                pass  # someone else moved it already
            log(ROLE, f"CORRUPT rollouts/step_{step:06d}, not consumed ({e}); moved to {dest}, "
                      f"waiting for it to be published again")


def _default_examples(run_dir, cfg) -> Examples:
    from transformers import AutoTokenizer
    from rl.envs import make_env
    env = make_env(cfg)
    tok = AutoTokenizer.from_pretrained(str(exchange.step_dir(run_dir, "assets", 0)))
    return lambda n, rng: env.sft_examples(n, rng, tok)


def _metrics_logger(run_dir, cfg):
    from rl.metrics import MetricsLogger
    return MetricsLogger(run_dir, cfg)


def run(run_dir, cfg=None, *, stop: StopFlag | None = None, examples: Examples | None = None,
        after_step: Callable[[int, dict], None] | None = None, poll: float = 0.2,
        device: str = "cpu") -> int:
    """The trainer role. Returns 0 when all steps are done, EXIT_PREEMPTED when stopped early."""
    run_dir = Path(run_dir)
    cfg = load_config(run_dir) if cfg is None else cfg
    stop = StopFlag(install=False) if stop is None else stop
    record_role(run_dir, ROLE)
    max_steps = int(cfg.trainer.max_steps)
    if cfg.model.get("hf_path"):
        raise NotImplementedError("model.hf_path: starting from an HF checkpoint is not implemented yet")
    if not exchange.step_dir(run_dir, "assets", 0).is_dir():
        from rl.model.tiny import write_hf_assets
        exchange.publish(run_dir, "assets", 0, lambda d: write_hf_assets(d, cfg.model), producer=ROLE)

    tr = Trainer(cfg, device=device)
    start = ckpt.resume_step(run_dir)
    if start is None:
        if int(cfg.trainer.warm_start.steps) > 0:
            t0 = time.monotonic()
            tr.warm_start(examples or _default_examples(run_dir, cfg))
            log(ROLE, f"warm start: {cfg.trainer.warm_start.steps} steps in {time.monotonic() - t0:.1f} s")
        tr.publish_weights(run_dir, 0)
        tr.save(run_dir, 0)
        last_ckpt = 0
    else:
        tr.load(run_dir, start)
        tr.publish_weights(run_dir, start)  # no-op when weights/step_<start> is still there
        last_ckpt = start
        log(ROLE, f"resumed from checkpoints/step_{start:06d}")

    metrics = _metrics_logger(run_dir, cfg)
    consumed = exchange.ConsumedLog(run_dir, "rollouts", ROLE)
    restart = resume_state(run_dir).get("restart", 0)
    every = int(cfg.trainer.checkpoint_every)
    for n in range(tr.progress.next_step, max_steps):
        t_wait = time.monotonic()
        got = next_batch(run_dir, n, stop, poll)
        if got is None:
            break
        batch, manifest = got
        t0 = time.monotonic()
        m = tr.train_step(batch, n)
        step_s = time.monotonic() - t0
        tr.progress.consumed.append(n)
        tr.progress.next_step = n + 1
        consumed.record(n, restart=restart, sha256=manifest["files"].get(BATCH_FILE, {}).get("sha256"))
        t1 = time.monotonic()
        tr.publish_weights(run_dir, n + 1)
        publish_s = time.monotonic() - t1
        exchange.prune(run_dir, "weights", int(cfg.trainer.keep_weights), protect=[last_ckpt])
        m.update(step_time_s=step_s, tokens_per_s=m["tokens"] / max(step_s, 1e-9), publish_s=publish_s,
                 wait_s=t0 - t_wait, policy_version=n + 1)
        m.update({f"orchestrator/{k}": v for k, v in batch.meta.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool)})
        metrics.log(n, m)
        log(ROLE, f"step {n}: loss {m['loss']:.4f} reward {m['reward_mean']:.3f} kl {m.get('mismatch_kl', 0):.2e} "
                  f"lag {m['lag']:.2f} {step_s:.2f} s")
        if (n + 1) % every == 0 or n + 1 == max_steps or stop.is_set():
            tr.save(run_dir, n + 1)
            last_ckpt = n + 1
        if after_step is not None:
            after_step(n, m)
        if stop.is_set():
            break
    if tr.progress.next_step >= max_steps:
        if last_ckpt != tr.progress.next_step:
            tr.save(run_dir, tr.progress.next_step)
        mark_done(run_dir, step=tr.progress.next_step)
        log(ROLE, f"done: {max_steps} steps")
        return 0
    if last_ckpt != tr.progress.next_step:
        tr.save(run_dir, tr.progress.next_step)
    log(ROLE, f"stopped ({stop.reason}) at step {tr.progress.next_step}: checkpointed, exiting")
    return EXIT_PREEMPTED
