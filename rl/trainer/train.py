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

A rollout batch that fails verification (truncated, checksum mismatch, unreadable) or validation (a
malformed header or meta.json, non-finite floats, token ids outside the vocabulary, inconsistent offsets
or lengths: rl.contract.batch.RolloutBatch.validate) is never trained on. The trainer logs the one-line
reason, moves the step aside to `rollouts/corrupt/step_N-<time>` (rl.exchange.set_aside: out of every
reader's sight, kept for inspection) and waits for the step to be published again: the orchestrator
produces every missing step, and exiting instead would not help, since a restart keeps rollout steps up
to the checkpoint and would find the same file. The step that finally trains counts the versions set
aside before it (`rollouts_set_aside` in its metrics); consumed.jsonl lists only the trained one.

An update that would make the weights non-finite is never applied: when the batch's loss or the global
gradient norm is not finite (an overflow in the model, on a valid batch), the optimizer step is skipped.
The batch still counts as consumed (it is not trained again), with `update_skipped` 1 in its metrics and
`applied: false` in consumed.jsonl; the next version is published unchanged. Before every publish the
weights are checked to be finite, and publishing non-finite weights is refused (an error).

Multi-rank (`trainer.parallel`, dp_shard x ep x cp = world size, launched by torchrun): see
rl.trainer.parallel. Rank 0 alone touches the run directory (waits for and verifies rollouts, then
broadcasts the path; commits the weights every rank wrote (rl.exchange.publisher); logs metrics); every rank trains and
writes its DCP shard of each checkpoint. Rank 0's stop flag decides for all ranks at step boundaries.
"""
from __future__ import annotations

import math
import random
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from rl import exchange, runtime
from rl.exchange import retention
from rl.exchange import layout
from rl.exchange.publisher import WeightPublisher
from rl.contract.batch import BATCH_FILE, InvalidBatch, RolloutBatch
from rl.runtime import EXIT_PREEMPTED, StopFlag, load_config, log, mark_done, own_epoch, record_role, resume_state
from rl.trainer import checkpoint as ckpt
from rl.models import replay
from rl.models.common import gathered_index, headtail_index, position_logprobs
from rl.trainer import parallel
from rl.trainer.owners import OwnershipPlan
from rl.trainer.loss import LossConfig, add_stats, finalize_stats, pg_loss
from rl.trainer.model import Built, build_model

ROLE = "trainer"
# (n, rng) -> [(prompt_ids, completion_ids)]: the supervised warm start's data.
Examples = Callable[[int, random.Random], Sequence[tuple[Sequence[int], Sequence[int]]]]


# the weights' float dtypes (masters are fp32; isfinite has no kernel for the float8 types)
_CHECKED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass
class MicroBatch:
    tokens: torch.Tensor      # [1, L] int64, several samples back to back
    positions: torch.Tensor   # [1, L] restarting at 0 at each sample
    per_token: dict[str, torch.Tensor]  # mask, lp_inf, adv, lag ... each [1, L]
    routed: torch.Tensor | None = None  # [1, L, moe layers, top_k] int64: recorded expert ids (replay)


@dataclass
class Row:
    """What one rank runs for one micro-batch: position j predicts `targets[j]` (= token j+1).

    `per_token` is shifted to the predicting position (entry j is about token j+1), so a row can be
    split along the sequence (context parallel) and every part scored on its own. `masks`: the
    attention mask rows of this rank under context parallel (None: built from `positions`).
    """
    tokens: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor
    per_token: dict[str, torch.Tensor]
    routed: torch.Tensor | None = None
    masks: torch.Tensor | None = None


def to_row(mb: MicroBatch) -> Row:
    tok, pos = mb.tokens, mb.positions
    targets = torch.nn.functional.pad(tok[:, 1:], (0, 1))
    # the last position of each sample predicts nothing inside it (the next token starts a new sample)
    ends = torch.nn.functional.pad(pos[:, 1:] == 0, (0, 1), value=True)
    per = {k: torch.nn.functional.pad(v[:, 1:], (0, 1)).masked_fill(ends, 0.0)
           for k, v in mb.per_token.items()}
    return Row(tok, pos, targets, per, mb.routed)


def _empty_row(keys, length: int, routed_like: torch.Tensor | None) -> Row:
    """A row with no loss token: keeps a rank with fewer micro-batches in its peers' collectives."""
    z = torch.zeros(1, length, dtype=torch.int64)
    routed = None
    if routed_like is not None:
        k = routed_like.shape[-1]
        routed = torch.arange(k).expand(1, length, routed_like.shape[2], k).clone()
    per = {key: torch.zeros(1, length) for key in keys}
    return Row(z, torch.arange(length)[None], z.clone(), per, routed)


def _cp_shard(row: Row, d: parallel.Dist) -> Row:
    """This cp rank's head-tail part of `row` and its attention mask rows (against gathered keys)."""
    from rl.models import cpu
    n, m = row.tokens.shape[1], 2 * d.cp
    pad = -n % m
    if pad:  # a separate document of padding tokens, outside the loss
        routed = row.routed
        if routed is not None:
            routed = torch.cat([routed, torch.arange(routed.shape[-1]).expand(1, pad, *routed.shape[2:])], 1)
        row = Row(torch.nn.functional.pad(row.tokens, (0, pad)),
                  torch.cat([row.positions, torch.arange(pad)[None]], 1),
                  torch.nn.functional.pad(row.targets, (0, pad)),
                  {k: torch.nn.functional.pad(v, (0, pad)) for k, v in row.per_token.items()}, routed)
        n += pad
    mine = headtail_index(n, d.cp, d.cp_rank)
    masks = cpu.cp_document_mask(row.positions, mine, gathered_index(n, d.cp))
    return Row(row.tokens[:, mine], row.positions[:, mine], row.targets[:, mine],
               {k: v[:, mine] for k, v in row.per_token.items()},
               None if row.routed is None else row.routed[:, mine], masks)


def rows_for_rank(mbs: list[MicroBatch], d: parallel.Dist) -> list[Row]:
    """This rank's rows: micro-batches round robin over the data ranks, each split over the cp ranks.

    Every rank gets the same number of rows (empty ones fill up), so FSDP and EP collectives match.
    """
    rows = [to_row(mb) for mb in mbs]
    if not d.distributed:
        return rows
    per_rank = -(-len(rows) // d.dp_size)
    mine = rows[d.dp_rank::d.dp_size]
    keys = list(rows[0].per_token) if rows else ["mask"]
    routed_like = rows[0].routed if rows else None
    mine += [_empty_row(keys, 2 * d.cp, routed_like) for _ in range(per_rank - len(mine))]
    return [_cp_shard(r, d) for r in mine] if d.cp > 1 else mine


def pack(offsets: np.ndarray, max_tokens: int, max_seq_len: int, tokens: np.ndarray,
         routed: np.ndarray | None = None, **per_token: np.ndarray) -> list[MicroBatch]:
    """Greedy in-order packing of whole samples into rows of at most `max_tokens` tokens.

    A sample longer than `max_tokens` gets a row of its own; one longer than the model's context is an
    error (RoPE has no positions for it). `routed` ([T, layers, top_k] expert ids) is cut like tokens.
    """
    lengths = np.diff(offsets)
    if len(lengths) and lengths.max() > max_seq_len:
        raise ValueError(f"a sample has {int(lengths.max())} tokens, above model.max_seq_len={max_seq_len}")
    if routed is not None and len(routed) != len(tokens):
        raise ValueError(f"routed experts cover {len(routed)} tokens, the batch has {len(tokens)}")
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
                       for k, v in per_token.items()},
            routed=None if routed is None else torch.from_numpy(routed[a:b].astype(np.int64))[None]))
    return out


def build_optimizer(model, t):
    """AdamW through torchtitan's OptimizersContainer (FQN-keyed state dict, DCP-ready)."""
    from torchtitan.components.optimizer.optimizer import default_adamw

    oc = default_adamw(lr=float(t.lr), betas=tuple(float(b) for b in t.betas),
                       weight_decay=float(t.weight_decay), eps=1e-8)
    oc.implementation = "for-loop" if next(model.parameters()).device.type == "cpu" else "fused"
    return oc.build(model_parts=[model])


class Trainer:
    """Model + optimizer + progress of one trainer lineage; no run-directory polling in here.

    Under torchrun every rank builds one (same seed, same initial weights), and `trainer.parallel`
    shards it (rl.trainer.parallel); on one process `dist` is the trivial one.
    """

    def __init__(self, cfg, device: str = "cpu", dist: parallel.Dist | None = None):
        self.cfg = cfg
        self.dist = dist if dist is not None else parallel.init(cfg.trainer.parallel, torch.device(device))
        hf_path = cfg.model.hf_path
        self.built: Built = build_model(cfg.model, seed=int(cfg.seed), device=device, dtype=cfg.trainer.dtype,
                                        parallel={"ep": self.dist.ep, "cp": self.dist.cp} if self.dist.distributed else None,
                                        fp8=bool(cfg.trainer.fp8), materialize=not hf_path)
        self.model = self.built.model = parallel.parallelize(
            self.built.model, self.built.spec, self.dist, self.built.dtype,
            activation_checkpointing=str(cfg.trainer.activation_checkpointing),
            cpu_offload=bool(cfg.trainer.cpu_offload))
        self.load_stats: dict = {}
        if hf_path:  # parallelized on meta, then each rank reads only its own slices of the checkpoint
            from rl.trainer import hf_load
            from rl.trainer.model import materialize_empty
            offload = bool(cfg.trainer.cpu_offload) and self.dist.distributed
            materialize_empty(self.model, "cpu" if offload else device, buffer_device=device)
            self.load_stats = hf_load.load(self.model, self.built.spec, hf_path,
                                           log=(lambda msg: log(ROLE, msg)) if self.dist.is_main else None)
        self.optimizer = build_optimizer(self.model, cfg.trainer)
        self.loss_cfg = LossConfig.from_trainer(cfg.trainer)
        self.progress = ckpt.TrainerProgress()
        self.router_replay = bool(cfg.trainer.router_replay)
        self._warned_self_recorded = False
        self._owners = OwnershipPlan(self.dist.rank, self.dist.world)
        # one tmp-directory token per incarnation, shared by all ranks (rl.exchange.publisher)
        self._publish_token = self.dist.broadcast(uuid.uuid4().hex[:12] if self.dist.is_main else None)
        self._pub: WeightPublisher | None = None

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding: a rollout token id at or above it would index past the table."""
        from rl.trainer.model import network_config
        return int(network_config(self.cfg.model)["vocab_size"])

    def _pack(self, offsets, tokens, routed=None, **per_token) -> list[MicroBatch]:
        return pack(offsets, int(self.cfg.trainer.micro_batch_tokens), int(self.cfg.model.max_seq_len),
                    tokens, routed, **per_token)

    def _clip(self) -> float:
        return parallel.clip_grad_norm(self.model, float(self.cfg.trainer.grad_clip), self.dist)

    def _autocast(self):
        """One process computing in bf16: autocast over fp32 masters (several ranks: FSDP2's
        mixed-precision policy casts the parameters instead)."""
        import contextlib
        if self.built.dtype == torch.float32 or self.dist.distributed:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.built.device.type, dtype=self.built.dtype)

    def _forward(self, row: Row, replay_routing: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        with replay.replaying(self.model, row.routed if replay_routing else None), self._autocast():
            return position_logprobs(self.model, row.tokens, row.positions, row.targets, row.masks)

    def _routing_for(self, row: Row) -> None:
        """Replay without recorded routing: record it with the trainer's own eval-mode forward (CPU)."""
        if row.routed is None:
            if not self._warned_self_recorded and self.dist.is_main:
                log(ROLE, "router_replay: the batch carries no routed experts; replaying the trainer's own "
                          "eval-mode routing (exercises R3, no mismatch reduction; see rl.models.replay)")
                self._warned_self_recorded = True
            row.routed = replay.record_routing(self.model, row.tokens, row.positions, row.masks)

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
            loss_sum = torch.zeros(())
            for row in rows_for_rank(mbs, self.dist):
                lp, _ = self._forward(row)
                loss = -(lp * row.per_token["mask"]).sum() / n
                loss.backward()
                loss_sum += loss.detach()
            self._clip()
            opt.step()
            loss_v = float(self.dist.sum(loss_sum))
            if self.dist.is_main and (i % 10 == 0 or i == int(ws.steps) - 1):
                log(ROLE, f"warm start {i + 1}/{ws.steps}: nll {loss_v:.3f}")
        return {"warm_start_nll": loss_v}

    def train_step(self, batch: RolloutBatch, step: int) -> dict:
        """One optimizer step on rollout batch `step`; returns its metrics (the same on every rank)."""
        counts = np.diff(batch.offsets)
        mask = batch.loss_mask.astype(np.float32)
        lag = np.where(batch.loss_mask > 0, step - batch.versions, 0).astype(np.float32)
        routed = batch.routed_experts if self.router_replay else None
        mbs = self._pack(batch.offsets, batch.tokens, routed, mask=mask, lp_inf=batch.logprobs,
                         adv=np.repeat(batch.advantages, counts), lag=lag)
        n_loss = float(mask.sum())
        self.optimizer.zero_grad()
        loss_sum, stats = torch.zeros(()), None
        if n_loss > 0:  # else nothing to learn from: no backward, the optimizer leaves the weights alone
            for row in rows_for_rank(mbs, self.dist):
                pt = row.per_token
                if self.router_replay:
                    self._routing_for(row)
                lp, ent = self._forward(row, replay_routing=self.router_replay)
                loss, st = pg_loss(lp, pt["lp_inf"], pt["adv"], pt["mask"], self.loss_cfg, entropy=ent,
                                   normalizer=n_loss)
                loss.backward()
                loss_sum += loss.detach()
                stats = add_stats(stats, st)
        grad_norm = self._clip() if n_loss else 0.0
        loss_v = float(self.dist.sum(loss_sum))
        # Both are reduced over all ranks, so every rank takes the same decision. A non-finite loss or
        # gradient would turn the weights (and Adam's moments) into NaN for good: skip the update.
        skip = (f"loss {loss_v}" if not math.isfinite(loss_v) else
                f"gradient norm {grad_norm}" if not math.isfinite(grad_norm) else None)
        if skip is None:
            self.optimizer.step()
        else:
            self.optimizer.zero_grad()  # the clip already scaled these by NaN: nothing may read them
            if self.dist.is_main:
                log(ROLE, f"step {step}: update SKIPPED, weights unchanged: {skip} is not finite")
        m = finalize_stats(self._reduce_stats(stats)) if stats else {}
        loss_lag = lag[batch.loss_mask > 0]
        return {"loss": loss_v, "grad_norm": grad_norm, **m, "update_skipped": int(skip is not None),
                **({"update_skip_reason": f"{skip} is not finite"} if skip else {}),
                "reward_mean": float(batch.rewards.mean()) if len(batch.rewards) else math.nan,
                "lag": float(loss_lag.mean()) if len(loss_lag) else 0.0,
                "lag_max": int(loss_lag.max()) if len(loss_lag) else 0,
                "samples": int(batch.num_samples), "tokens": int(len(batch.tokens)),
                "micro_batches": len(mbs),
                **({"router_replay": 1, "routing_recorded_by_engine": int(routed is not None)}
                   if self.router_replay else {})}

    def _reduce_stats(self, stats: dict) -> dict:
        if not self.dist.distributed:
            return stats
        keys = [k for k in stats if k != "ratio_max"]
        summed = self.dist.sum(torch.stack([stats[k].float() for k in keys]))
        out = dict(zip(keys, summed.unbind()))
        out["ratio_max"] = self.dist.max(stats["ratio_max"].float().reshape(()))
        return out

    # -- run-directory side ---------------------------------------------------------------------------
    def _checkpoint_naming(self) -> tuple[str, list[str]]:
        """(prefix of the text tower's names, the quantization ignore list) of the start checkpoint."""
        if not self.cfg.model.hf_path:
            return "", []
        from rl.contract import hf
        c = hf.read_config(self.cfg.model.hf_path)
        return hf.weight_prefix(c), hf.ignored_modules(c)

    def full_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named full weights on rank 0 ({} on the others, which still take part in the gathers),
        named as the start checkpoint names them (so vLLM's loader for that architecture reads them)."""
        prefix, _ = self._checkpoint_naming()
        adapter = self.built.spec.state_dict_adapter(self.built.spec.model, None)
        if not self.dist.distributed:
            sd = self.model.state_dict()
        else:
            sd = parallel.full_state_dict(self.model, self.dist)
            if not self.dist.is_main:
                return {}
        return {prefix + k: v.detach() for k, v in adapter.to_hf(sd).items()}

    def _publisher(self, run_dir) -> WeightPublisher:
        if self._pub is None:
            t = self.cfg.trainer
            self._pub = WeightPublisher(
                run_dir, rank=self.dist.rank, world=self.dist.world, token=self._publish_token, producer=ROLE,
                wire_dtype=self.built.dtype, quantize=layout.quantize_except(self._checkpoint_naming()[1]),
                background=bool(t.publish_async), commit_timeout_s=float(t.publish_timeout_s),
                full_every=int(t.weights_full_every), delta_max_fraction=float(t.delta_max_fraction))
        return self._pub

    def publish_weights(self, run_dir, version: int) -> bool:
        """Start publishing `weights/step_<version>` from every rank (rl.exchange.publisher): FP8
        block-scaled linears, the rest in the trainer's compute dtype, each rank the tensors it owns
        (rl.trainer.owners). Returns once the parameters may change; the step appears when complete.

        The router gate, the expert-bias correction, norms, embeddings and the LM head stay high-precision,
        and so does every module the start checkpoint's quantization_config ignores. False (nothing
        done, no collective) when the step is already published."""
        exists = self.dist.broadcast(exchange.step_dir(run_dir, "weights", version).is_dir()
                                     if self.dist.is_main else None)
        if exists:  # republishing is a no-op: skip the gathers too
            return False
        self.check_finite(f"weights/step_{version:06d}")
        prefix, _ = self._checkpoint_naming()
        adapter = self.built.spec.state_dict_adapter(self.built.spec.model, None)
        hf_state = {prefix + k: v for k, v in adapter.to_hf(self.model.state_dict()).items()}
        own, gathers = self._owners.owned(hf_state)
        self._publisher(run_dir).publish(version, own, gathers)
        return True

    def check_finite(self, what: str) -> None:
        """Raise on every rank if any rank's part of the weights holds a NaN or inf: servers must never
        load such weights, and train_step's guard should have made this impossible, so it is a bug to
        stop on, not a state to publish."""
        flags: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
        for k, v in self.model.state_dict().items():
            v = v.to_local() if hasattr(v, "to_local") else v  # this rank's shard of a DTensor
            if v.dtype in _CHECKED_DTYPES and v.numel():
                flags.setdefault(v.device, []).append((k, torch.isfinite(v).all()))
        bad = []
        for items in flags.values():  # one read-back per device: a sync per tensor costs thousands of them
            ok = torch.stack([f for _, f in items]).tolist()
            bad += [k for (k, _), good in zip(items, ok) if not good]
        n_bad = int(self.dist.sum(torch.tensor(float(len(bad)))))
        if n_bad:
            where = f"{bad[0]} (rank {self.dist.rank})" if bad else "on another rank"
            raise RuntimeError(f"{what}: refusing to publish non-finite weights: {n_bad} tensor(s) hold NaN "
                               f"or inf, first {where}")

    def wait_published(self) -> None:
        """Join the publish in flight (before exiting, and before anything that needs the step)."""
        if self._pub is not None:
            self._pub.wait()

    @property
    def publish_bytes_per_rank(self) -> list[int]:
        return self._owners.bytes_per_rank

    def save(self, run_dir, step: int) -> None:
        ckpt.save(run_dir, step, self.model, self.optimizer, self.progress, dist=self.dist)
        if self.dist.is_main:
            # checksums: a corrupt newest checkpoint must not count as kept (rl.exchange.retention)
            retention.prune(run_dir, ckpt.KIND, int(self.cfg.trainer.keep_checkpoints), checksums=True)

    def load(self, run_dir, step: int) -> None:
        self.progress = ckpt.load(run_dir, step, self.model, self.optimizer)
        if self.progress.next_step != step:
            raise RuntimeError(f"checkpoints/step_{step:06d} says next_step={self.progress.next_step}")

    def close(self) -> None:
        self.wait_published()
        self.dist.close()


def _final_sweep(run_dir, tr: "Trainer", d, final: int) -> None:
    """Before DONE: every step left in the run directory verifies (checksums, weights' delta chains).

    Damage to a step after it was written (a bit flip, a truncation on the filesystem) is found only when
    something reads it again, and after DONE nothing does. A damaged step is set aside (<kind>/corrupt/);
    the final checkpoint and the final weights are written again from the trainer's state, which is still
    in memory, so a finished run never ends with its result only in a damaged copy. It reads every retained
    byte once, at the end of the run only."""
    from rl.exchange.deltas import stored_tensors
    deep = {"weights": stored_tensors}
    bad = d.broadcast({k: retention.corrupt_steps(run_dir, k, deep.get(k))
                       for k in ("checkpoints", "weights", "rollouts")} if d.is_main else None)
    if d.is_main:
        for kind, steps in bad.items():
            for s, why in sorted(steps.items()):
                dest = exchange.set_aside(run_dir, kind, s)
                log(ROLE, f"final check: {kind}/step_{s:06d} set aside to {dest} ({why})")
    d.barrier()
    if final in bad["weights"]:
        tr.publish_weights(run_dir, final)
        tr.wait_published()
    if final in bad["checkpoints"]:
        tr.save(run_dir, final)


def next_batch(run_dir, step: int, stop: StopFlag, poll: float = 0.2, *, vocab_size: int | None = None,
               set_aside: list[str] | None = None) -> tuple[RolloutBatch, dict] | None:
    """Wait for `rollouts/step_<step>`, verified with checksums and validated (token ids below
    `vocab_size`); set it aside and re-wait if corrupt or invalid, appending the reason to `set_aside`."""
    while True:
        with runtime.waiting_for(f"rollouts/step_{step:06d} from the orchestrator"):
            path = exchange.wait_for(run_dir, "rollouts", step, poll=poll, should_stop=stop.is_set)
        if path is None:
            return None
        try:
            manifest = exchange.verify(path, checksums=True)
            return RolloutBatch.load(path, vocab_size=vocab_size), manifest
        except (exchange.CorruptStep, InvalidBatch, OSError) as e:
            try:  # atomic: the step is now missing, the orchestrator republishes it
                dest = exchange.set_aside(run_dir, "rollouts", step)
            except FileNotFoundError:
                dest = "(someone else moved it already)"
            kind = "INVALID" if isinstance(e, InvalidBatch) else "CORRUPT"
            log(ROLE, f"{kind} rollouts/step_{step:06d}, not consumed: {e}; moved to {dest}, "
                      f"waiting for it to be published again")
            if set_aside is not None:
                set_aside.append(str(e))


_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def write_assets(out_dir: Path, m) -> None:
    """`assets/step_000000`: tokenizer, chat template and config.json the orchestrator, the environments
    and vLLM use. From `model.hf_path`: the checkpoint's own files (everything but the weights);
    otherwise the tiny model's, created here (rl.model.tiny)."""
    if not m.hf_path:
        from rl.model.tiny import write_hf_assets
        write_hf_assets(out_dir, m)
        return
    import shutil
    src = Path(m.hf_path)
    for p in sorted(src.iterdir()):
        if p.is_file() and not p.name.endswith(_WEIGHT_FILES) and p.name != layout.INDEX:
            shutil.copy2(p, Path(out_dir) / p.name)


def _default_examples(run_dir, cfg) -> Examples:
    from transformers import AutoTokenizer
    from rl.envs import make_env
    env = make_env(cfg)
    tok = AutoTokenizer.from_pretrained(str(exchange.step_dir(run_dir, "assets", 0)))
    return lambda n, rng: env.sft_examples(n, rng, tok)


def _prune_weights(run_dir, cfg, last_ckpt: int) -> list[int]:
    """Retention of weights: `keep_weights` verified versions, the newest checkpoint's (a restart
    serves it), and every version a server may still load (rl.exchange.retention.weights_in_use)."""
    protect = {last_ckpt} | retention.weights_in_use(run_dir, int(cfg.orchestrator.max_off_policy))
    return retention.prune(run_dir, "weights", int(cfg.trainer.keep_weights), protect=protect)


def _metrics_logger(run_dir, cfg):
    from rl.metrics import MetricsLogger
    return MetricsLogger(run_dir, cfg)


def _next_batch_all_ranks(run_dir, step: int, stop: StopFlag, poll: float, d: parallel.Dist,
                          vocab_size: int | None = None, set_aside: list[str] | None = None
                          ) -> tuple[RolloutBatch, dict] | None:
    """Rank 0 waits for and verifies the batch; every rank then loads the same, verified file."""
    got = next_batch(run_dir, step, stop, poll, vocab_size=vocab_size, set_aside=set_aside) if d.is_main else None
    if not d.distributed:
        return got
    info = d.broadcast(None if got is None else (str(exchange.step_dir(run_dir, "rollouts", step)), got[1]))
    if info is None:
        return None
    if d.is_main:
        return got
    path, manifest = info
    return RolloutBatch.load(Path(path), vocab_size=vocab_size), manifest


def planned_device(run_dir) -> str:
    """This rank's device as the plan says: `cuda:LOCAL_RANK` when the trainer group has GPUs (one rank
    per GPU, NCCL), else the CPU (gloo). Without a plan.json (in-process tests) the CPU."""
    from rl.contract import paths
    from rl.runtime import load_plan
    if not paths.plan_file(run_dir).exists():
        return "cpu"
    tp = load_plan(run_dir).trainer
    if tp.device == "cpu":
        return "cpu"
    import os
    import socket
    if not torch.cuda.is_available():
        raise RuntimeError(f"plan.trainer.device=cuda (trainer.gpus_per_node={tp.gpus_per_node}) but torch "
                           f"sees no GPU on {socket.gethostname()} (CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}, torch {torch.__version__})")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if local >= torch.cuda.device_count():
        raise RuntimeError(f"LOCAL_RANK={local} but only {torch.cuda.device_count()} GPU(s) are visible on "
                           f"{socket.gethostname()} (trainer.gpus_per_node={tp.gpus_per_node})")
    torch.cuda.set_device(local)
    return f"cuda:{local}"


def run(run_dir, cfg=None, *, stop: StopFlag | None = None, examples: Examples | None = None,
        after_step: Callable[[int, dict], None] | None = None, poll: float = 0.2,
        device: str | None = None) -> int:
    """The trainer role. Returns 0 when all steps are done, EXIT_PREEMPTED when stopped early.

    Under torchrun every rank calls this; the return value is the same on every rank. `device`
    defaults to the plan's (rl.trainer.train.planned_device).
    """
    run_dir = Path(run_dir)
    cfg = load_config(run_dir) if cfg is None else cfg
    stop = StopFlag(install=False) if stop is None else stop
    max_steps = int(cfg.trainer.max_steps)
    device = device or planned_device(run_dir)
    d = parallel.init(cfg.trainer.parallel, torch.device(device))
    try:
        rc = _run(run_dir, cfg, d, stop, examples, after_step, poll, device, max_steps)
    finally:
        d.close()
    if d.is_main:  # for rl.trainer.torchrun: torchrun itself reports any non-zero worker status as 1
        from rl.contract.records import ExitRecord
        ExitRecord(rc=rc, reason=stop.reason).write(run_dir)
    return rc


def _run(run_dir, cfg, d, stop, examples, after_step, poll, device, max_steps) -> int:
    main = d.is_main
    if main:
        record_role(run_dir, ROLE, world_size=d.world, torch_threads=torch.get_num_threads())
        if not exchange.step_dir(run_dir, "assets", 0).is_dir():
            exchange.publish(run_dir, "assets", 0, lambda p: write_assets(p, cfg.model), producer=ROLE)
    else:  # every rank writes its shards of a publish: every rank is fenced, not only the one recorded
        exchange.fence(run_dir, own_epoch(run_dir))
    d.barrier()

    tr = Trainer(cfg, device=device, dist=d)
    start = d.broadcast(ckpt.resume_step(run_dir) if main else None)
    if start is None:
        if int(cfg.trainer.warm_start.steps) > 0:
            t0 = time.monotonic()
            tr.warm_start(examples or _default_examples(run_dir, cfg))
            if main:
                log(ROLE, f"warm start: {cfg.trainer.warm_start.steps} steps in "
                          f"{time.monotonic() - t0:.1f} s")
        tr.publish_weights(run_dir, 0)
        tr.save(run_dir, 0)
        last_ckpt = 0
    else:
        tr.load(run_dir, start)
        tr.publish_weights(run_dir, start)  # no-op when weights/step_<start> is still there
        last_ckpt = start
        if main:
            where = f" on {d.world} ranks" if d.distributed else ""
            log(ROLE, f"resumed from checkpoints/step_{start:06d}{where}")

    metrics = _metrics_logger(run_dir, cfg) if main else None
    consumed = exchange.ConsumedLog(run_dir, "rollouts", ROLE) if main else None
    restart = resume_state(run_dir).restart
    every = int(cfg.trainer.checkpoint_every)
    vocab = tr.vocab_size
    for n in range(tr.progress.next_step, max_steps):
        t_wait = time.monotonic()
        set_aside: list[str] = []
        got = _next_batch_all_ranks(run_dir, n, stop, poll, d, vocab, set_aside)
        if got is None:
            break
        batch, manifest = got
        exchange.check_fence(run_dir, f"training on rollouts/step_{n:06d}")  # a continued stale process stops here
        t0 = time.monotonic()
        m = tr.train_step(batch, n)
        step_s = time.monotonic() - t0
        tr.progress.consumed.append(n)
        tr.progress.next_step = n + 1
        if main:  # consumed even when the update was skipped: the batch is never trained again
            consumed.record(n, restart=restart, sha256=manifest["files"].get(BATCH_FILE, {}).get("sha256"),
                            **({"applied": False} if m["update_skipped"] else {}))
        t1 = time.monotonic()
        tr.publish_weights(run_dir, n + 1)
        publish_s = time.monotonic() - t1  # the trainer's share: copy-out (and joining the previous publish)
        if main:
            _prune_weights(run_dir, cfg, last_ckpt)
        m.update(step_time_s=step_s, tokens_per_s=m["tokens"] / max(step_s, 1e-9), publish_s=publish_s,
                 publish_background_s=tr._pub.last_write_s if tr._pub is not None else 0.0,
                 wait_s=t0 - t_wait, policy_version=n + 1, rollouts_set_aside=len(set_aside),
                 # the share of this step's wall time spent waiting for its rollout batch
                 idle_fraction=(t0 - t_wait) / max(time.monotonic() - t_wait, 1e-9), time=time.time())
        m.update({f"orchestrator/{k}": v for k, v in batch.meta.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool)})
        if main:
            metrics.log(n, m)
            log(ROLE, f"step {n}: loss {m['loss']:.4f} reward {m['reward_mean']:.3f} "
                      f"kl {m.get('mismatch_kl', 0):.2e} lag {m['lag']:.2f} {step_s:.2f} s")
        stopping = d.broadcast(stop.reason if main else None)  # rank 0's flag decides for every rank
        if stopping is not None:
            stop.set(stopping)
        if (n + 1) % every == 0 or n + 1 == max_steps or stop.is_set():
            tr.save(run_dir, n + 1)
            last_ckpt = n + 1
        if after_step is not None:
            after_step(n, m)
        if d.distributed:
            stopping = d.broadcast(stop.reason if main else None)
            if stopping is not None:
                stop.set(stopping)
        if stop.is_set():
            break
    tr.wait_published()  # the last version is complete before DONE (or before a stopped role exits)
    if main:  # in the loop the newest version was still being written: prune again now it counts
        _prune_weights(run_dir, cfg, last_ckpt)
    if tr.progress.next_step >= max_steps:
        if last_ckpt != tr.progress.next_step:
            tr.save(run_dir, tr.progress.next_step)
        _final_sweep(run_dir, tr, d, tr.progress.next_step)
        if main:
            mark_done(run_dir, step=tr.progress.next_step)
            log(ROLE, f"done: {max_steps} steps")
        return 0
    if last_ckpt != tr.progress.next_step:
        tr.save(run_dir, tr.progress.next_step)
    if main:
        log(ROLE, f"stopped ({stop.reason}) at step {tr.progress.next_step}: checkpointed, exiting")
    return EXIT_PREEMPTED
