"""The request and answer codec of issue 50 item 7 (msgspec JSON, pybase64 routes, the router's incremental
completion key) gives exactly what the code before it gave: the same request bodies as vLLM parses them,
the same token ids, logprobs, versions, finish reasons and routes (bit-identical), the same router keys.

The baseline is benchmarks/request_codec.py's faithful copy of the old functions; answers are vLLM 0.32's own
`GenerateTokensResponse` serialized as its server does (`model_dump_json`), routes its `numpy2base64`."""
from __future__ import annotations

import base64
import importlib.util
import io
import json
from pathlib import Path

import numpy as np
import pytest

from rl.contract import routing
from rl.orchestrator import client
from rl.orchestrator.client import InferenceError

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("request_codec_bench", REPO / "benchmarks" / "request_codec.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
CFG = routing.RouterConfig()


def _npy_b64(a: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def _vllm():
    return pytest.importorskip("vllm.entrypoints.scale_out.token_in_token_out.protocol")


def _answer(ids, lps="auto", rows=None, spans="auto", finish="stop", prompt=None) -> bytes:
    """A generate answer as vLLM's server writes it."""
    P = _vllm()
    from vllm.utils.serial_utils import numpy2base64
    if lps == "auto":
        lps = P.GenerateLogProbs(content=[P.GenerateLogProbsContent(token_id=t, logprob=-0.1 * (i + 1) / 3)
                                          for i, t in enumerate(ids)])
    if spans == "auto":
        spans = [P.WeightVersionSpan(version="4", start=0, end=len(ids) // 2),
                 P.WeightVersionSpan(version="5", start=len(ids) // 2, end=len(ids))]
    choice = P.GenerateTokensChoice(index=0, finish_reason=finish, token_ids=ids, logprobs=lps,
                                    routed_experts=None if rows is None else numpy2base64(rows),
                                    weight_versions=spans)
    return P.GenerateTokensResponse(request_id="r", model="policy", choices=[choice], prompt_token_ids=prompt,
                                    usage={"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2,
                                           "prompt_tokens_details": {"cached_tokens": 16}}).model_dump_json().encode()


def _same_completion(content: bytes):
    try:
        old = bench.old_client_answer(content, "k")
    except ValueError:
        with pytest.raises(InferenceError, match="k: .* tokens but .* logprobs"):
            bench.new_client_answer(content, "k")
        return None
    new = bench.new_client_answer(content, "k")
    assert (new.ids, new.logprobs, new.versions, new.finish_reason, new.prompt_ids, new.request_id) == \
           (old.ids, old.logprobs, old.versions, old.finish_reason, old.prompt_ids, old.request_id)
    assert new.raw == old.raw and "routed_experts" not in new.raw["choices"][0]
    if old.routed_experts is None:
        assert new.routed_experts is None
    else:
        assert new.routed_experts.dtype == old.routed_experts.dtype
        assert new.routed_experts.shape == old.routed_experts.shape
        assert new.routed_experts.tobytes() == old.routed_experts.tobytes()
    return new


@pytest.mark.parametrize("ctx", [[5], list(range(1, 40)), np.arange(3, 70_000, 7, dtype=np.int32),
                                 np.array([0, 151_000, 2 ** 31 - 1], dtype=np.int64),
                                 np.arange(100, dtype=np.int32)[10:60:3]])
def test_request_bodies_are_the_old_ones_and_vllm_reads_them_the_same(ctx):
    sp = {"max_tokens": 64, "temperature": 0.7, "top_p": 0.95, "logprobs": 0, "ignore_eos": False, "seed": 9,
          "routed_experts_prompt_start": max(0, len(ctx) - 3)}
    body = {"request_id": "hetrl-3", "sampling_params": sp, "model": "policy", "priority": 2}
    old, new = bench.body_old(ctx, body), bench.body_new(ctx, body)
    assert json.loads(new) == json.loads(old)
    assert json.loads(new)["token_ids"] == [int(t) for t in ctx]
    P = _vllm()
    a, b = P.GenerateRequest.model_validate_json(old), P.GenerateRequest.model_validate_json(new)
    assert a.token_ids == b.token_ids == [int(t) for t in ctx]
    assert b.sampling_params.routed_experts_prompt_start == sp["routed_experts_prompt_start"]
    assert (b.sampling_params.max_tokens, b.sampling_params.seed, b.request_id) == (64, 9, "hetrl-3")


@pytest.mark.parametrize("rows", [
    np.random.default_rng(0).integers(0, 256, (37, 5, 8), dtype=np.uint8),
    np.random.default_rng(1).integers(0, 384, (9, 3, 2)).astype(np.uint16),
    np.random.default_rng(2).integers(-5, 1000, (4, 2, 6)).astype(np.int32),
    np.asfortranarray(np.random.default_rng(3).integers(0, 256, (6, 4, 8), dtype=np.uint8)),
    np.zeros((0, 75, 8), np.uint8),                        # no rows (routed_experts_prompt_start at the end)
    None])
def test_answers_parse_to_the_same_ids_logprobs_versions_and_routes(rows):
    ids = [11, 12, 13, 14, 15]
    new = _same_completion(_answer(ids, rows=rows, prompt=[1, 2, 3]))
    assert new.ids == ids and new.versions == [4, 4, 5, 5, 5]
    if rows is not None:
        assert np.array_equal(new.routed_experts, rows) and not new.routed_experts.flags.writeable


def test_answer_edge_cases_match_the_old_path():
    _same_completion(_answer([], spans=[]))                                  # nothing generated
    _same_completion(_answer([7, 8], lps=None, spans=None))                  # no logprobs: the same error
    _same_completion(_answer([7, 8], spans=None, finish="length"))           # no spans: versions None
    _same_completion(b'{"choices":[{"token_ids":null,"logprobs":{"content":null},"finish_reason":null}],"x":1}')
    a = json.loads(_answer([1, 2, 3], rows=np.ones((2, 2, 2), np.uint8)))
    a["choices"][0]["routed_experts"] = "\n".join(a["choices"][0]["routed_experts"][i:i + 76]   # MIME lines
                                                  for i in range(0, len(a["choices"][0]["routed_experts"]), 76))
    _same_completion(json.dumps(a).encode())                                 # lenient base64: stdlib's way


def test_bad_routes_are_the_same_one_line_errors():
    buf = io.BytesIO()
    np.save(buf, np.ones((5, 2, 8), np.uint8), allow_pickle=False)
    with pytest.raises(InferenceError, match=r"routed_experts: .* data bytes for shape \(5, 2, 8\)"):
        client.decode_routed_experts(base64.b64encode(buf.getvalue()[:-3]).decode())
    with pytest.raises(InferenceError, match="routed_experts is not a .npy array"):
        client.decode_routed_experts(base64.b64encode(b"not an npy file at all").decode())
    assert client.decode_routed_experts(None) is None
    for bad in ("abc", "é"):   # not base64 at all: the stdlib's own errors, as before
        with pytest.raises(ValueError):
            client.decode_routed_experts(bad)


@pytest.mark.parametrize("n_prompt,n_new", [(5, 3), (16, 16), (47, 1), (64, 40), (1000, 333), (3, 0)])
def test_router_keys_are_the_old_ones_and_the_extended_key_is_the_full_one(n_prompt, n_new):
    rng = np.random.default_rng(n_prompt)
    prompt, ids = rng.integers(0, 150_000, n_prompt).tolist(), rng.integers(0, 150_000, n_new).tolist()
    body = {"token_ids": prompt}
    key = routing.request_key("/inference/v1/generate", body, "s", CFG)
    old = bench.old_request_key(prompt, "s", CFG)
    assert (key.kind, key.n_tokens, key.ends, len(key.hashes), key.session) == \
           (old.kind, old.n_tokens, old.ends, len(old.hashes), old.session)
    answer = {"choices": [{"token_ids": ids}]}
    fast = routing.completion_key("/inference/v1/generate", body, answer, CFG, key)
    full = routing.completion_key("/inference/v1/generate", body, answer, CFG)
    if not ids:
        assert fast is None and full is None
        return
    assert fast == full == routing.request_key("/inference/v1/generate", {"token_ids": prompt + ids}, None, CFG)
    # the next turn's prompt (prompt + completion + observation) matches every block the server now holds
    nxt = routing.request_key("/inference/v1/generate", {"token_ids": prompt + ids + [1] * 40}, "s", CFG)
    assert nxt.hashes[:len(fast.hashes)] == fast.hashes


def test_router_answer_decode_reads_vllms_answer_without_its_routes():
    content = _answer([21, 22, 23], rows=np.ones((30, 4, 2), np.uint8))
    data = routing.decode_answer(content)
    assert data["choices"][0]["token_ids"] == [21, 22, 23] and routing.reported_cached_tokens(data) == 16
    prompt = list(range(40))
    body = {"token_ids": prompt, "sampling_params": {"routed_experts_prompt_start": 8}}
    key = routing.request_key("/inference/v1/generate", body, None, CFG)
    old = bench.old_router(json.dumps(body).encode(), content, CFG)
    new = bench.new_router(client.json_body(body), content, CFG)
    assert (new[0], new[1], new[2]) == (key, routing.request_key(
        "/inference/v1/generate", {"token_ids": prompt + [21, 22, 23]}, None, CFG), 16)
    assert (old[0].n_tokens, old[1].n_tokens, old[2]) == (new[0].n_tokens, new[1].n_tokens, new[2])
    with pytest.raises(ValueError):
        routing.decode_answer(b"not json")
    assert routing.decode_answer(b'{"error": "x"}') == {"choices": [], "usage": None}
    chat = routing.decode_answer(b'{"choices": [{"message": {"role": "assistant", "content": "a"}}]}')
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "a"}
