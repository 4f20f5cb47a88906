"""The Trainer: model + optimizer + progress of one trainer lineage, and its weights' publishing.

The role around it (waiting for rollouts, checkpoints, metrics, DONE) is rl.trainer.loop; start-up and
assets rl.trainer.startup; the end-of-step bookkeeping rl.trainer.bookkeeping; packing rl.trainer.packing.

An update that would make the weights non-finite is never applied: when the batch's loss or the global
gradient norm is not finite (an overflow in the model, on a valid batch), the optimizer step is skipped.
The batch still counts as consumed (it is not trained again), with `update_skipped` 1 in its metrics and
`applied: false` in consumed.jsonl; the next version is published unchanged. Before every publish the
weights are checked to be finite, and publishing non-finite weights is refused (an error).
"""
from __future__ import annotations

import dataclasses
import math
import random
import uuid
from typing import Callable, Sequence

import numpy as np
import torch

from rl import exchange
from rl.exchange import retention
from rl.exchange import layout
from rl.exchange.publisher import WeightPublisher
from rl.contract.batch import RolloutBatch
from rl.runtime import log
from rl.trainer import checkpoint as ckpt
from rl.models import replay
from rl.models.common import position_logprobs
from rl.trainer import parallel
from rl.trainer.owners import OwnershipPlan
from rl.trainer.loss import LossConfig, add_stats, finalize_stats, is_max_stat, pg_loss
from rl.trainer.model import Built, build_model
from rl.trainer.packing import MicroBatch, Row, pack, rows_for_rank

ROLE = "trainer"
# (n, rng) -> [(prompt_ids, completion_ids)]: the supervised warm start's data.
Examples = Callable[[int, random.Random], Sequence[tuple[Sequence[int], Sequence[int]]]]


# the weights' float dtypes (masters are fp32; isfinite has no kernel for the float8 types)
_CHECKED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def build_optimizer(model, t):
    """AdamW through torchtitan's OptimizersContainer (FQN-keyed state dict, DCP-ready)."""
    from torchtitan.components.optimizer.optimizer import default_adamw

    oc = default_adamw(lr=float(t.lr), betas=tuple(float(b) for b in t.betas),
                       weight_decay=float(t.weight_decay), eps=1e-8)
    oc.implementation = "for-loop" if next(model.parameters()).device.type == "cpu" else "fused"
    return oc.build(model_parts=[model])


def _totals(batch: RolloutBatch) -> dict:
    """The totals of a whole batch held in memory (a share carries its batch's, from the sample index)."""
    on = batch.loss_mask > 0
    v = batch.versions[on].astype(np.int64)
    return {"samples": int(batch.num_samples), "tokens": int(len(batch.tokens)), "loss_tokens": int(on.sum()),
            "version_sum": int(v.sum()), "version_min": int(v.min()) if len(v) else None,
            "reward_mean": float(batch.rewards.mean()) if len(batch.rewards) else math.nan}


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

    def _pack(self, offsets, tokens, routed=None, sizes=None, **per_token) -> list[MicroBatch]:
        return pack(offsets, int(self.cfg.trainer.micro_batch_tokens), int(self.cfg.model.max_seq_len),
                    tokens, routed, sizes, **per_token)

    def _clip(self) -> float:
        return parallel.clip_grad_norm(self.model, float(self.cfg.trainer.grad_clip), self.dist)

    def _autocast(self):
        """One process computing in bf16: autocast over fp32 masters (several ranks: FSDP2's
        mixed-precision policy casts the parameters instead)."""
        import contextlib
        if self.built.dtype == torch.float32 or self.dist.distributed:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.built.device.type, dtype=self.built.dtype)

    def _on_device(self, row: Row) -> Row:
        """`row` on the model's device: packing makes host tensors (from numpy), and every tensor the
        step combines with the model's must live where the model does (a no-op on the CPU)."""
        d = self.built.device
        if d.type == "cpu":
            move = lambda t: None if t is None else t.to(d)  # noqa: E731 (returns t itself)
        else:
            move = lambda t: None if t is None else t.to(d, non_blocking=True)  # noqa: E731
        # routes travel in the batch's narrow width (uint8: 1/8 of int64's bytes) and widen on the device
        routed = None if row.routed is None else move(row.routed).long()
        return dataclasses.replace(row, tokens=move(row.tokens), positions=move(row.positions),
                                   targets=move(row.targets), routed=routed, masks=move(row.masks),
                                   per_token={k: move(v) for k, v in row.per_token.items()})

    def _forward(self, row: Row, replay_routing: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        with replay.replaying(self.model, row.routed if replay_routing else None), self._autocast():
            return position_logprobs(self.model, row.tokens, row.positions, row.targets, row.masks)

    def _routing_for(self, row: Row) -> None:
        """Replay without recorded routing: record it with the trainer's own eval-mode forward (CPU)."""
        if row.routed is None:
            if not self._warned_self_recorded and self.dist.is_main:
                log(ROLE, "router_replay: the batch carries no routed experts (the servers returned none: vLLM "
                          "records them only in GPU MoE kernels, with --enable-return-routed-experts, which "
                          "launch.plan passes when inference.gpus_per_node > 0); replaying the trainer's own "
                          "eval-mode routing instead (exercises R3, no mismatch reduction; see rl.models.replay)")
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
            loss_sum = torch.zeros((), device=self.built.device)
            for row in map(self._on_device, rows_for_rank(mbs, self.dist)):
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
        share, totals = batch.share, batch.totals or _totals(batch)
        # each token's sample index: the sequence corrections (rl.trainer.corrections) work per sample
        mbs = self._pack(batch.offsets, batch.tokens, routed, mask=mask, lp_inf=batch.logprobs,
                         adv=np.repeat(batch.advantages, counts), lag=lag,
                         sample=np.repeat(np.arange(len(counts)), counts),
                         sizes=share["micro_batches"] if share else None)
        # a share's rows are this data rank's own; every rank pads to the most any rank has
        per_rank = share["rows_per_rank"] if share else None
        routed_like = None if routed is None else torch.zeros(1, 0, *routed.shape[1:], dtype=torch.int64)
        n_loss = float(totals["loss_tokens"])   # the whole batch's: every rank normalizes alike
        self.optimizer.zero_grad()
        loss_sum, stats = torch.zeros((), device=self.built.device), None
        if n_loss > 0:  # else nothing to learn from: no backward, the optimizer leaves the weights alone
            for row in map(self._on_device, rows_for_rank(mbs, self.dist, per_rank, routed_like)):
                pt = row.per_token
                if self.router_replay:
                    self._routing_for(row)
                lp, ent = self._forward(row, replay_routing=self.router_replay)
                loss, st = pg_loss(lp, pt["lp_inf"], pt["adv"], pt["mask"], self.loss_cfg, entropy=ent,
                                   normalizer=n_loss, sample=pt["sample"], n_samples=len(counts),
                                   reduce_samples=self._cp_sum(), gather_row=self._cp_gather(),
                                   count_samples=self.dist.cp_rank == 0)
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
        n_tok = totals["loss_tokens"]
        return {"loss": loss_v, "grad_norm": grad_norm, **m, "update_skipped": int(skip is not None),
                **({"update_skip_reason": f"{skip} is not finite"} if skip else {}),
                "reward_mean": totals["reward_mean"],
                "lag": step - totals["version_sum"] / n_tok if n_tok else 0.0,
                "lag_max": step - totals["version_min"] if n_tok else 0,
                "samples": totals["samples"], "tokens": totals["tokens"],
                "micro_batches": share["total_micro_batches"] if share else len(mbs),
                **({"router_replay": 1, "routing_recorded_by_engine": int(routed is not None)}
                   if self.router_replay else {})}

    def _reduce_stats(self, stats: dict) -> dict:
        if not self.dist.distributed:
            return stats
        keys = [k for k in stats if not is_max_stat(k)]
        summed = self.dist.sum(torch.stack([stats[k].float() for k in keys]))
        out = dict(zip(keys, summed.unbind()))
        maxed = [k for k in stats if is_max_stat(k)]
        out.update(zip(maxed, self.dist.max(torch.stack([stats[k].float().reshape(()) for k in maxed])).unbind()))
        return out

    def _cp_sum(self):
        """Under context parallel a sample's tokens are spread over the cp ranks of its row: the sum of
        per-sample vectors over them (the sequence corrections decide on whole samples). None otherwise."""
        if self.dist.cp <= 1:
            return None
        import torch.distributed as dist
        group = self.dist.dims.get_mesh("cp").get_group()

        def cp_sum(t: torch.Tensor) -> torch.Tensor:
            t = t.clone()
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
            return t
        return cp_sum

    def _cp_gather(self):
        """Under context parallel: the whole row's per-token values on every cp rank (M2PO ranks a row's
        tokens), and where this rank's tokens sit in it (rl.models.common.headtail_index). None otherwise."""
        if self.dist.cp <= 1:
            return None
        import torch.distributed as dist
        from rl.models.common import headtail_index
        cp, group = self.dist.cp, self.dist.dims.get_mesh("cp").get_group()

        def gather(*ts: torch.Tensor):
            n = ts[0].numel() * cp   # _cp_shard gave every rank an equal part
            where = [headtail_index(n, cp, r).to(ts[0].device) for r in range(cp)]
            out = []
            for t in ts:
                parts = [torch.empty_like(t.reshape(-1)) for _ in range(cp)]
                dist.all_gather(parts, t.reshape(-1).contiguous(), group=group)
                full = torch.empty(n, dtype=t.dtype, device=t.device)
                for idx, part in zip(where, parts):
                    full[idx] = part
                out.append(full)
            return (*out, where[self.dist.cp_rank])
        return gather

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
        n_bad = int(self.dist.sum(torch.tensor(float(len(bad)), device=self.built.device)))
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

    @property
    def publish_blocked_s(self) -> float:
        """Seconds the caller spent in the last publish: the copy-out (on a GPU with the FP8 quantization)."""
        return self._pub.last_blocked_s if self._pub is not None else 0.0

    @property
    def publish_background_s(self) -> float:
        """Seconds the background part of the last finished publish took (0.0 before the first)."""
        return self._pub.last_write_s if self._pub is not None else 0.0

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
