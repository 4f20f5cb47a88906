"""Router replay (R3) on multi-turn episodes: each turn asks the engine only for the routed-expert rows
the episode does not hold (vLLM's `routed_experts_prompt_start`), the episode appends them, the sample
carries one row per token in order, and the trainer replays exactly those rows.

The engine is faked because vLLM returns routed experts only from its GPU MoE kernels (0.32 refuses
`--enable-return-routed-experts` on the CPU). The fake speaks vLLM's wire format by construction: it
parses each request with vLLM's own `GenerateRequest` (so `routed_experts_prompt_start` is read as the
server reads it, a `SamplingParams` field) and answers with vLLM's `GenerateTokensResponse`, the routes
encoded by vLLM's `numpy2base64` (base64 `.npy`, uint8 [prompt + completion - 1 - start, layers, top_k]).
Everything else is real: the InferenceClient over HTTP (httpx transport), the Sampler, the multi-turn
driver, the Orchestrator's batch, RolloutBatch and the Trainer.
"""
from __future__ import annotations

import asyncio
import json
import random

import httpx
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from rl.contract.config import Config
from rl.tiny_models.tiny import build_tokenizer
from rl.orchestrator.client import InferenceClient
from rl.orchestrator.multiturn import Rollout

P = pytest.importorskip("vllm.entrypoints.scale_out.token_in_token_out.protocol")
numpy2base64 = pytest.importorskip("vllm.utils.serial_utils").numpy2base64


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


class ToolEnv:
    """Every turn answered with a tool response; never done (episodes end at env.max_turns)."""

    def sample_tasks(self, n, rng):
        return [{"id": i} for i in range(n)]

    def start(self, task):
        class Ep:
            turns = 0

            def initial_messages(self):
                return [{"role": "user", "content": f"task {task['id']}"}]

            def step(self, text):
                self.turns += 1
                return f"ran {self.turns}", False

            def tool_message(self, obs):
                return {"role": "user", "content": f"<tool_response>\n{obs}\n</tool_response>"}

            def reward(self):
                return float(task["id"] % 2)

        return Ep()


class FakeVLLM:
    """`POST /inference/v1/generate` of one vLLM 0.32 server run with `--enable-return-routed-experts`.
    Request q routes position p, layer l to experts (7p + 3l + q + k) mod E, k < top_k: every row says
    which request computed it, so the test can tell whose prefill a token's row came from."""

    def __init__(self, tok, layers, top_k, experts, honour_start=True):
        self.tok, self.layers, self.top_k, self.experts = tok, layers, top_k, experts
        self.honour_start = honour_start
        self.requests: list[dict] = []

    def route(self, q, pos):
        return np.array([[(7 * pos + 3 * layer + q + k) % self.experts for k in range(self.top_k)]
                         for layer in range(self.layers)], dtype=np.uint8)

    def handle(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/inference/v1/generate"
        req = P.GenerateRequest.model_validate(json.loads(request.content))
        sp, prompt = req.sampling_params, list(req.token_ids)
        start = sp.routed_experts_prompt_start if self.honour_start else 0
        if not 0 <= start <= len(prompt):  # vLLM's input processor refuses it the same way
            return httpx.Response(400, json={"error": "routed_experts_prompt_start out of range"})
        rng = random.Random(sp.seed)
        text = rng.choice(["look {}", "<tool_call>{{\"name\": \"a{}\", \"arguments\": {{}}}}</tool_call>"])
        ids = self.tok.encode(text.format(rng.randint(0, 99999)), add_special_tokens=False)[:sp.max_tokens - 1]
        ids.append(self.tok.eos_token_id)
        q = len(self.requests)
        rows = np.stack([self.route(q, p) for p in range(start, len(prompt) + len(ids) - 1)])
        b64 = numpy2base64(rows)
        self.requests.append({"prompt": prompt, "ids": ids, "start": start, "rows": len(rows),
                              "b64_bytes": len(b64), "asked": sp.routed_experts_prompt_start})
        lps = P.GenerateLogProbs(content=[P.GenerateLogProbsContent(token_id=t, logprob=-0.5) for t in ids])
        choice = P.GenerateTokensChoice(index=0, finish_reason="stop", token_ids=ids, logprobs=lps,
                                        routed_experts=b64,
                                        weight_versions=[P.WeightVersionSpan(version="0", start=0, end=len(ids))])
        resp = P.GenerateTokensResponse(request_id=req.request_id, choices=[choice], prompt_token_ids=prompt)
        return httpx.Response(200, content=resp.model_dump_json(), headers={"content-type": "application/json"})


def _cfg(tmp_path):
    cfg = OmegaConf.structured(Config(run_dir=str(tmp_path)))
    cfg.wandb.mode = "disabled"
    cfg.env.max_turns = 4
    cfg.orchestrator.prompts_per_step = 2
    cfg.orchestrator.group_size = 2
    cfg.orchestrator.max_tokens = 24
    cfg.model.max_seq_len = 1024
    cfg.inference.max_model_len = 1024
    cfg.trainer.router_replay = True
    cfg.trainer.micro_batch_tokens = 1024
    return cfg


def _build_batch(cfg, engine):
    from rl.orchestrator.loop import Orchestrator
    from rl.orchestrator.versions import VersionTracker
    import rl.orchestrator.loop as loop

    orig = loop.make_env
    loop.make_env = lambda c: ToolEnv()
    try:
        o = Orchestrator(cfg.run_dir, cfg)
    finally:
        loop.make_env = orig

    async def run():
        client = InferenceClient("http://fake-vllm:8000")
        await client._http.aclose()
        client._http = httpx.AsyncClient(base_url=client.url, transport=httpx.MockTransport(engine.handle))
        o.sampler.clients, o.sampler.tracker = [client], VersionTracker(0)
        try:
            return await o.build_batch(0)
        finally:
            await client.aclose()

    o.sampler.tokenizer = engine.tok
    return asyncio.run(run())


def _episodes(batch, engine):
    """Each sample's token sequence and the engine requests that were its turns, in order."""
    out = []
    for s in range(batch.num_samples):
        a, b = int(batch.offsets[s]), int(batch.offsets[s + 1])
        toks = batch.tokens[a:b].tolist()
        turns = sorted((q for q, r in enumerate(engine.requests)
                        if toks[:len(r["prompt"]) + len(r["ids"])] == r["prompt"] + r["ids"]),
                       key=lambda q: len(engine.requests[q]["prompt"]))
        out.append((a, toks, turns))
    return out


def test_multiturn_episode_rows_are_asked_once_and_replayed_in_order(tok, tmp_path):
    from rl.trainer.train import Trainer
    cfg = _cfg(tmp_path)
    m = cfg.model
    engine = FakeVLLM(tok, m.n_layers, m.top_k, m.num_experts)
    batch = _build_batch(cfg, engine).batch()
    assert batch.num_samples == 4 and batch.routed_experts is not None
    assert batch.routed_experts.shape == (len(batch.tokens), m.n_layers, m.top_k)
    assert batch.routed_experts.dtype == np.uint8

    episodes = _episodes(batch, engine)
    assert sorted(q for _, _, turns in episodes for q in turns) == list(range(len(engine.requests)))
    for a, toks, turns in episodes:
        n = len(toks)
        assert len(turns) == cfg.env.max_turns
        held = 0
        for q in turns:  # each turn asks from the rows held: every position is sent exactly once
            r = engine.requests[q]
            assert r["asked"] == held
            held += r["rows"]
        assert held == n - 1
        # row p is the one computed by the request whose forward processed p: the prompt's rows by the
        # first turn, a turn's last token and the observation after it by the next turn's prefill
        want, prev = [], 0
        for q in turns:
            r = engine.requests[q]
            end = len(r["prompt"]) + len(r["ids"]) - 1
            want += [engine.route(q, p) for p in range(prev, end)]
            prev = end
        want.append(want[-1])  # the final sampled token was never forwarded: it repeats the row before
        assert np.array_equal(batch.routed_experts[a:a + n], np.stack(want))

    # the trainer's routers use exactly these rows, token by token and layer by layer
    tr = Trainer(cfg)
    seen, hooks = [], []
    for mod in tr.model.modules():
        if type(mod).__name__ == "RoutedExperts":
            hooks.append(mod.register_forward_pre_hook(lambda mod_, args: seen.append(args[2].clone())))
    metrics = tr.train_step(batch, 0)
    for h in hooks:
        h.remove()
    assert metrics["router_replay"] == 1 and metrics["routing_recorded_by_engine"] == 1
    for layer in range(m.n_layers):
        got = torch.cat([e.reshape(-1, m.top_k) for e in seen[layer::m.n_layers]])
        assert torch.equal(got, torch.from_numpy(batch.routed_experts[:, layer].astype(np.int64))), layer
    assert np.isfinite(metrics["loss"])


def test_rows_not_asked_for_fail_the_episode_naming_the_turn(tmp_path):
    """A server that re-sends the whole context's rows (ignoring routed_experts_prompt_start), or stops
    sending rows, would misalign every later row: the episode fails with one line naming the turn (its
    group is then dropped like any failed episode)."""
    m = _cfg(tmp_path).model
    r = Rollout(prompt_ids=[1, 2, 3])
    r.add_routes(np.zeros((4, m.n_layers, m.top_k), np.uint8), 0, 3, 2, 0)   # turn 0: 3 + 2 - 1 rows
    r.add_model([5, 6], [-0.1, -0.1], [0, 0])
    r.add_env([7])
    with pytest.raises(ValueError, match=r"turn 1: routed_experts has 7 rows from position 0, expected"):
        r.add_routes(np.zeros((7, m.n_layers, m.top_k), np.uint8), 0, 6, 2, 1)
    with pytest.raises(ValueError, match="turn 1: the engine returned no routed_experts, earlier turns did"):
        r.add_routes(None, 4, 6, 2, 1)
