"""Router replay (R3): train with the experts the inference engine routed each token to.

A MoE policy trained asynchronously has a second source of trainer/inference mismatch besides
numerics: a token whose router scores are nearly tied can go to other experts in the trainer than it
went to in the engine (FP8 weights, other kernels), and its logprob then differs by much more than
rounding. Rollouts therefore carry the routed expert ids recorded at inference
(`RolloutBatch.routed_experts`, uint8 or uint16 [tokens, moe layers, top_k]), and with `trainer.router_replay`
the trainer's routers use those ids instead of their own top-k.

The gate keeps learning: the weights of the replayed experts are the *live* router's scores gathered
at the recorded ids and renormalised as the model does (softmax over all experts, then the top-k
renormalisation `route_norm` of Qwen3-MoE), so the loss is differentiable in the gate weights.

`ReplayRouter` is torchtitan's `TokenChoiceTopKRouter` with two switches, set per forward by the
context managers below (torchtitan has no hook to inject indices):
- `replay_ids` ([B, L, K] expert ids): use them instead of top-k;
- `recorded` (a list): append the ids used (its own top-k, or the replayed ones).

Where the ids come from:
- GPU: vLLM `--enable-return-routed-experts` returns them per request (rl.orchestrator.client decodes
  them; the orchestrator puts them into `Sample.routed_experts`).
- CPU: vLLM's CPU path cannot return them. `record_routing` records them with the trainer's own
  forward in eval mode (no grad), e.g. on an FP8 fake-quantized copy of the weights that inference
  serves; `Trainer.train_step` uses it when replay is on and a batch carries no routing, which makes
  the replay path run but is NOT a mismatch reduction (the trainer replays itself). benchmarks/
  router_replay.py measures what replay of real engine routing buys, with a perturbed model copy
  standing in for the engine.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from torchtitan.models.common.moe import MoE, TokenChoiceTopKRouter


class ReplayRouter(TokenChoiceTopKRouter):
    """TokenChoiceTopKRouter that can replay given expert ids and record the ids it used."""

    @dataclass(kw_only=True, slots=True)
    class Config(TokenChoiceTopKRouter.Config):
        pass

    replay_ids: torch.Tensor | None = None
    recorded: list | None = None

    def forward(self, x_BLD: torch.Tensor, expert_bias_E: torch.Tensor | None = None):
        ids = self.replay_ids
        if ids is None:
            out = super().forward(x_BLD, expert_bias_E)
        else:
            if ids.shape[:2] != x_BLD.shape[:2] or ids.shape[-1] != self.top_k:
                raise ValueError(f"replayed expert ids {tuple(ids.shape)} do not fit tokens "
                                 f"{tuple(x_BLD.shape[:2])} x top_k {self.top_k}")
            with torch.autocast(device_type=x_BLD.device.type, dtype=torch.float32):
                scores_BLE = self.gate(x_BLD)
            if self.score_func == "sigmoid":
                scores_BLE = torch.sigmoid(scores_BLE)
            elif self.score_func == "softmax":
                scores_BLE = F.softmax(scores_BLE, dim=-1)
            else:
                raise NotImplementedError(f"Unknown score function {self.score_func}")
            ids = ids.to(device=x_BLD.device, dtype=torch.int64).contiguous()
            top = scores_BLE.gather(dim=-1, index=ids)
            if self.route_norm:
                top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
            out = (top * self.route_scale, ids, scores_BLE)
        if self.recorded is not None:
            self.recorded.append(out[1].detach())
        return out


def apply(model_config) -> None:
    """Make every MoE router of a Decoder config a ReplayRouter (same fields, same parameters)."""
    for layer in model_config.layers:
        moe = getattr(layer, "moe", None)
        if moe is not None and type(moe.router) is TokenChoiceTopKRouter.Config:
            r = moe.router
            import dataclasses
            moe.router = ReplayRouter.Config(**{f.name: getattr(r, f.name) for f in dataclasses.fields(r)
                                                if f.init})


def routers(model) -> list[ReplayRouter]:
    """The MoE routers in layer order (index = the `layers` axis of routed_experts). A network that is not
    a torchtitan Decoder offers its own (`model.replay_routers()`, e.g. rl.models.nemotron_h): routers with
    the same `replay_ids` / `recorded` switches."""
    if callable(getattr(model, "replay_routers", None)):
        return list(model.replay_routers())
    out = [m.router for m in model.modules() if isinstance(m, MoE)]
    if not all(isinstance(r, ReplayRouter) for r in out):
        raise TypeError("the model was not built with rl.models.replay.apply (no ReplayRouter)")
    return out


@contextlib.contextmanager
def replaying(model, routed: torch.Tensor | None):
    """Forward passes inside use `routed` ([B, L, moe layers, top_k]) as every router's choice."""
    if routed is None:
        yield
        return
    rs = routers(model)
    if routed.shape[2] != len(rs):
        raise ValueError(f"routed experts cover {routed.shape[2]} MoE layers, the model has {len(rs)}")
    for i, r in enumerate(rs):
        r.replay_ids = routed[:, :, i, :].contiguous()
    try:
        yield
    finally:
        for r in rs:
            r.replay_ids = None


@contextlib.contextmanager
def recording(model):
    """Collect the expert ids of forward passes inside: yields a list, per forward [B, L, layers, K]."""
    rs = routers(model)
    for r in rs:
        r.recorded = []
    out: list[torch.Tensor] = []
    try:
        yield out
    finally:
        per_layer = [r.recorded for r in rs]
        for r in rs:
            r.recorded = None
        out.extend(torch.stack(ids, dim=2) for ids in zip(*per_layer))


def record_routing(model, tokens: torch.Tensor, positions: torch.Tensor, masks=None) -> torch.Tensor:
    """The expert ids the model routes packed rows to, in eval mode without grad: [B, L, layers, K]."""
    from rl.models.common import logits
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), recording(model) as rec:
            logits(model, tokens, positions, masks)
    finally:
        model.train(was_training)
    return rec[0]


def to_batch_ids(ids: torch.Tensor) -> np.ndarray:
    """Rollout-batch storage of expert ids: the narrowest of uint8/uint16 that holds them."""
    from rl.contract.batch import expert_ids
    return expert_ids(ids.to(torch.int64).cpu().numpy())
