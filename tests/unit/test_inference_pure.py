"""Pure parts of the inference path: request keys, version spans, the update protocol (the orchestrator's
client), and the server role's plumbing around the plan (environment, node rank, URL, node-local disk,
the start record of a multi-node replica)."""
from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest

from rl.orchestrator import client as C
from rl.inference.worker_ext import external_request_id


def test_external_request_id_strips_vllm_suffix(monkeypatch):
    monkeypatch.delenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", raising=False)
    assert external_request_id("cmpl-abc-0-1a2b3c4d") == C.completion_key("abc")
    assert external_request_id("chatcmpl-x-y-deadbeef") == C.chat_key("x-y")
    assert external_request_id("generate-tokens-r1-00ff00ff") == C.generate_key("r1")
    assert external_request_id("no-suffix") == "no-suffix"
    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
    assert external_request_id("cmpl-abc-0") == "cmpl-abc-0"


def test_versions_from_spans_and_updates():
    spans = [{"version": "2", "start": 0, "end": 3}, {"version": "3", "start": 3, "end": 5}]
    assert C.versions_from_spans(spans, 5) == [2, 2, 2, 3, 3]
    with pytest.raises(C.InferenceError):
        C.versions_from_spans(spans[:1], 5)
    assert C.versions_from_updates(5, 2, [(3, 3)]) == [2, 2, 2, 3, 3]
    assert C.versions_from_updates(4, 0, []) == [0] * 4
    assert C.versions_from_updates(4, 0, [(1, 0), (2, 2)]) == [1, 1, 2, 2]
    assert C.versions_from_updates(3, 0, [(1, 9)]) == [0, 0, 0]  # finished before the reload


def _mock_client(handler):
    c = C.InferenceClient("http://x")
    c._http = httpx.AsyncClient(base_url="http://x", transport=httpx.MockTransport(handler))
    return c


def test_update_weights_protocol_order_and_result():
    calls = []

    def handler(req: httpx.Request):
        calls.append((req.url.path, dict(req.url.params)))
        if req.url.path == "/collective_rpc":
            body = json.loads(req.content)
            assert body["method"] == "load_policy"
            assert body["kwargs"] == {"weights_dir": "/w/step_000003", "version": 3}
            return httpx.Response(200, json={"results": [{"version": 3, "in_flight": {"cmpl-a-0": 7}}]})
        if req.url.path == "/reset_prefix_cache":
            return httpx.Response(200, json={"success": False})
        return httpx.Response(200, json={})

    out = asyncio.run(_mock_client(handler).update_weights("/w/step_000003", 3))
    assert [p for p, _ in calls] == ["/pause", "/collective_rpc", "/update_weight_version",
                                     "/reset_prefix_cache", "/resume"]
    assert calls[0][1] == {"mode": "keep"} and calls[3][1] == {"reset_running_requests": "false"}
    assert out["in_flight"] == {"cmpl-a-0": 7} and out["prefix_cache_reset"] is False


@pytest.mark.parametrize("failure", ["http500", "refused"])
def test_update_weights_always_resumes(failure):
    calls = []

    def handler(req):
        calls.append(req.url.path)
        if req.url.path == "/collective_rpc":
            if failure == "http500":
                return httpx.Response(500, text="boom")
            return httpx.Response(200, json={"results": [{"error": "refused x: sha256 does not match",
                                                          "loaded": False}]})
        return httpx.Response(200, json={})

    with pytest.raises(C.InferenceError, match="boom|sha256"):
        asyncio.run(_mock_client(handler).update_weights("/w", 1))
    assert calls[-1] == "/resume" and "/update_weight_version" not in calls


def test_generate_parses_token_endpoint():
    def handler(req):
        body = json.loads(req.content)
        assert req.url.path == "/inference/v1/generate" and body["token_ids"] == [5, 6]
        assert body["sampling_params"]["logprobs"] == 0 and body["request_id"] == "r"
        return httpx.Response(200, json={"choices": [{
            "index": 0, "token_ids": [1, 2], "finish_reason": "length",
            "logprobs": {"content": [{"token_id": 1, "logprob": -0.5}, {"token_id": 2, "logprob": -1.0}]},
            "weight_versions": [{"version": "4", "start": 0, "end": 2}]}]})

    comp = asyncio.run(_mock_client(handler).generate([5, 6], 2, request_id="r"))
    assert comp.ids == [1, 2] and comp.logprobs == [-0.5, -1.0] and comp.versions == [4, 4]
    assert comp.request_id == C.generate_key("r") and comp.finish_reason == "length"


def test_generate_parses_completions_endpoint():
    def handler(req):
        body = json.loads(req.content)
        assert req.url.path == "/v1/completions" and body["prompt"] == [5] and body["return_token_ids"]
        return httpx.Response(200, json={"id": "cmpl-r", "choices": [{
            "index": 0, "text": "", "token_ids": [9], "finish_reason": "stop",
            "logprobs": {"token_logprobs": [-0.25], "tokens": ["x"], "top_logprobs": [],
                         "text_offset": []}}]})

    comp = asyncio.run(_mock_client(handler).generate([5], 1, request_id="r", endpoint="completions"))
    assert comp.ids == [9] and comp.logprobs == [-0.25] and comp.versions is None
    assert comp.request_id == "cmpl-r-0"


def test_client_module_is_light():
    import subprocess
    import sys
    code = "import sys, rl.orchestrator.client; assert 'torch' not in sys.modules and 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})


def test_resolve_fp8_load():
    from rl.inference.server import resolve_fp8_load
    assert resolve_fp8_load("auto", False) is False and resolve_fp8_load("auto", True) is True
    assert resolve_fp8_load("dequantize", True) is False
    with pytest.raises(RuntimeError, match="FP8"):
        resolve_fp8_load("fp8", False)
    with pytest.raises(ValueError):
        resolve_fp8_load("int4", True)


def _replica(tmp_path, *overrides):
    from launch.compose import compose
    from launch.plan import make_plan
    cfg = compose([f"run_dir={tmp_path / 'run'}", f"cluster.node_local_dir={tmp_path / 'nl'}", *overrides])
    return make_plan(cfg).replica(0)


def test_vllm_env_is_the_plans_plus_what_only_run_time_knows(tmp_path):
    import rl
    from pathlib import Path
    from rl.inference.server import VERIFIED_ENV, VERSION_ENV, vllm_env
    replica = _replica(tmp_path)
    repo = str(Path(rl.__file__).resolve().parent.parent)
    base = {"PYTHONPATH": os.pathsep.join(["/x", repo]), "HOME": "/h", "VLLM_API_KEY": "inherited",
            "VLLM_SERVER_DEV_MODE": "0"}
    env = vllm_env(replica, version=7, secret="s3cret", base=base)
    assert {k: env[k] for k in replica.env} == replica.env  # the plan wins over the inherited value
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["HOME"] == "/h"
    assert env["PYTHONPATH"] == os.pathsep.join([repo, "/x"])  # the repo first, once
    assert env[VERSION_ENV] == "7" and env["VLLM_API_KEY"] == "s3cret"
    assert set(env) == set(base) | set(replica.env) | {VERSION_ENV, VERIFIED_ENV}
    assert env[VERIFIED_ENV] == str(Path(replica.model_dir).parent / "verified")  # node-local, per run
    # a run without a secret: the server must not demand the key the user's shell happens to hold
    assert "VLLM_API_KEY" not in vllm_env(replica, version=0, secret=None, base=base)
    assert base["VLLM_API_KEY"] == "inherited"  # the caller's mapping is not modified


def test_node_rank_role_name_and_url(tmp_path):
    import socket
    from rl.contract.plan import PlanFormatError
    from rl.inference.server import advertised_url, node_rank_from_env, role_name
    assert node_rank_from_env({}) == 0 and node_rank_from_env({"SLURM_PROCID": "3"}) == 3
    with pytest.raises(ValueError, match="SLURM_PROCID"):
        node_rank_from_env({"SLURM_PROCID": "x"})
    replica = _replica(tmp_path, "cluster=slurm", "inference.nodes=2", "inference.gpus_per_node=2",
                       "inference.dp=4")
    assert [role_name(replica, k) for k in range(2)] == ["inference_0", "inference_0.node1"]
    with pytest.raises(PlanFormatError, match="node rank 2"):
        replica.vllm_argv(2)
    assert advertised_url("0.0.0.0", 8000, "n7") == "http://n7:8000"
    assert advertised_url("0.0.0.0", 8000) == f"http://{socket.gethostname()}:8000"
    assert advertised_url("127.0.0.1", 8000, "n7") == "http://127.0.0.1:8000"
    assert advertised_url("::1", 8000) == "http://[::1]:8000"


def test_clean_stale_removes_only_our_dead_dirs(tmp_path):
    import socket
    from rl.contract.atomic import atomic_write_json
    from rl.inference.model_dir import claim, clean_stale
    host, dead = socket.gethostname(), 2 ** 22 + 12345
    owners = {"cur": [(host, dead)], "live": [(host, os.getpid())], "dead": [(host, dead)],
              "mixed": [(host, dead), (host, os.getpid())], "elsewhere": [("other-host", dead)],
              "legacy": [(host, dead)], "notours": []}
    for name, recs in owners.items():
        (tmp_path / name).mkdir()
        for i, (h, pid) in enumerate(recs):
            f = "owner.json" if name == "legacy" else f"owner.inference_{i}.json"
            atomic_write_json(tmp_path / name / f, {"run_dir": "/r", "host": h, "pid": pid})
    (tmp_path / "notours" / "data").write_text("x")
    assert sorted(clean_stale(tmp_path, keep="cur")) == ["dead", "legacy"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cur", "elsewhere", "live", "mixed", "notours"]
    rec = claim(tmp_path / "new", tmp_path / "run", "inference_0.node1")
    assert rec.name == "owner.inference_0.node1.json" and clean_stale(tmp_path, keep="cur") == []


def test_start_record_pins_the_heads_version_for_this_incarnation(tmp_path):
    from rl.contract.records import ResumeState
    from rl.inference.server import runtime, start_record, wait_start, write_start
    run_dir = tmp_path / "run"
    (run_dir / "inference").mkdir(parents=True)
    stop = runtime.StopFlag(install=False)
    ResumeState(restart=0).write(run_dir)
    write_start(run_dir, 0, 5, True)
    assert wait_start(run_dir, 0, stop) == (5, True)
    ResumeState(restart=1).write(run_dir)  # the next incarnation: the old record is not its head's
    (run_dir / "DONE").write_text("{}")
    assert wait_start(run_dir, 0, stop) is None
    (run_dir / "DONE").unlink()
    write_start(run_dir, 0, 6, False)
    assert json.loads(start_record(run_dir, 0).read_text())["restart"] == 1
    assert wait_start(run_dir, 0, stop) == (6, False)


def _materialize_in_child(args):
    from rl.inference.model_dir import materialize
    import torch
    assets, w, out = args
    return str(materialize(assets, w, out, dtype=torch.float32, fp8=False))


def test_materialize_reuses_and_tolerates_a_shared_disk(tmp_path):
    torch = pytest.importorskip("torch")
    import multiprocessing
    from rl import exchange
    from rl.exchange.weights import write_shards
    from rl.inference.model_dir import SOURCE_FILE, materialize
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    sd = {"model.layers.0.self_attn.q_proj.weight": torch.randn(256, 128)}
    w0 = exchange.publish(tmp_path, "weights", 0, lambda d: write_shards(d, sd), producer="t").path
    w1 = exchange.publish(tmp_path, "weights", 1, lambda d: write_shards(d, {k: v + 1 for k, v in sd.items()}),
                          producer="t").path
    out = tmp_path / "model0"
    materialize(assets, w0, out, dtype=torch.float32, fp8=False)
    ino = (out / SOURCE_FILE).stat().st_ino
    materialize(assets, w0, out, dtype=torch.float32, fp8=False)  # same step: kept as it is
    assert (out / SOURCE_FILE).stat().st_ino == ino
    materialize(assets, w0, out, dtype=torch.bfloat16, fp8=False)  # another dtype: rewritten
    assert json.loads((out / SOURCE_FILE).read_text())["dtype"] == "bfloat16"
    # the nodes of one replica sharing a disk materialise the same step at once
    with multiprocessing.get_context("fork").Pool(4) as pool:
        got = pool.map(_materialize_in_child, [(assets, w1, out)] * 4)
    assert got == [str(out)] * 4
    src = json.loads((out / SOURCE_FILE).read_text())
    assert src["weights"] == str(w1) and src["dtype"] == "float32"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model0.lock", "assets", "model0", "weights"]


def test_materialize_dequantizes_in_hf_names(tmp_path):
    torch = pytest.importorskip("torch")
    from rl import exchange
    from rl.exchange.weights import load_state_dict, write_shards
    from rl.inference.model_dir import materialize
    from safetensors.torch import load_file
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    (assets / "tokenizer.json").write_text("{}")
    sd = {"model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64),
          "model.layers.0.input_layernorm.weight": torch.ones(64)}
    w = exchange.publish(tmp_path, "weights", 0, lambda d: write_shards(d, sd), producer="t").path
    out = materialize(assets, w, tmp_path / "model", dtype=torch.float32, fp8=False)
    shard_name = "model-r00000-00001.safetensors"  # one writer: rank 0's first file
    got = load_file(str(out / shard_name))
    assert set(got) == set(sd) and all(v.dtype == torch.float32 for v in got.values())
    ref = load_state_dict(w, torch.float32)
    assert all(torch.equal(got[k], ref[k]) for k in sd)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    assert (out / "tokenizer.json").exists() and not (out / exchange.MANIFEST).exists()
    # FP8 pass-through: the shards as stored and the DeepSeek-style quantization_config
    out8 = materialize(assets, w, tmp_path / "model8", dtype=torch.bfloat16, fp8=True)
    cfg = json.loads((out8 / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    shard8 = load_file(str(out8 / shard_name))
    assert "model.layers.0.self_attn.q_proj.weight_scale_inv" in shard8
    # a corrupted step is refused
    shard = w / shard_name
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(exchange.CorruptStep):  # (a node copy made before the damage stays usable)
        materialize(assets, w, tmp_path / "model_again", dtype=torch.float32, fp8=False)
    with pytest.raises(exchange.CorruptStep):
        materialize(assets, w, tmp_path / "model8_again", dtype=torch.float32, fp8=True)
    assert not [p for p in tmp_path.iterdir() if "_again" in p.name]


def test_every_workers_reload_result_is_collected_and_one_failure_fails_the_reload(tmp_path):
    """vLLM's data-parallel client answers /collective_rpc with the first engine's workers only; the
    workers also write their results (rl.inference.worker_ext.write_report) and the client reads all."""
    from rl.inference.worker_ext import write_report
    from rl.orchestrator.client import InferenceError, collect_reports, merge_results
    ok = {"version": 4, "previous_version": 3, "loaded": True, "seconds": 1.0, "bytes_read": 10}
    write_report(tmp_path, 0, 0, {**ok, "in_flight": {"cmpl-a-0": 5}})
    write_report(tmp_path, 1, 0, {**ok, "in_flight": {"cmpl-b-0": 7}, "seconds": 2.5})
    with pytest.raises(InferenceError, match="only 2 of 3 inference workers"):
        collect_reports(tmp_path, 3, "http://x", 4)
    merged = merge_results(collect_reports(tmp_path, 2, "http://x", 4))
    assert merged["in_flight"] == {"cmpl-a-0": 5, "cmpl-b-0": 7} and merged["seconds"] == 2.5
    assert merged["workers"] == 2 and merged["bytes_read"] == 20
    write_report(tmp_path, 2, 0, {"error": "refused step_000004: x does not match its sha256", "version": 3,
                                  "previous_version": 3, "loaded": False, "in_flight": {}})
    results = collect_reports(tmp_path, 3, "http://x", 4)
    assert [r["error"] for r in results if r.get("error")] == [
        "worker dp0002-rank0000: refused step_000004: x does not match its sha256"]
    with pytest.raises(InferenceError, match="disagree"):
        merge_results(results)


def test_a_server_whose_engine_died_is_named_dead_with_its_cause(tmp_path):
    """vLLM's API server outlives its engine core while a client holds a connection (its watchdog's
    uvicorn shutdown waits for them): /health answers 503. That state depends on timing in a real
    server (tests/integration/test_inference_server.py kills one; there it exits), so here a standard
    library server answers /health as vLLM's does, and the log is in vLLM 0.32's format."""
    import http.server
    import threading
    from rl.inference.server import check_engine_alive

    status = {"code": 200}

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status["code"])
            self.end_headers()

        def log_message(self, *a):
            pass
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    log = tmp_path / "inference_0.vllm.log"
    e = "(EngineCore pid=5) ERROR 12-04 18:39:58 [core.py:1512]"
    log.write_text(f"{e} EngineCore encountered a fatal error.\n{e} Traceback (most recent call last):\n"
                   f"{e} RuntimeError: Worker failed with error 'CPU Generator does not use offset'\n")
    try:
        check_engine_alive(url, "inference_0", log)           # healthy: nothing to say
        status["code"] = 500
        check_engine_alive(url, "inference_0", log)           # not vLLM's dead-engine answer
        status["code"] = 503
        with pytest.raises(RuntimeError, match=r"inference_0\): engine core died: RuntimeError: Worker failed "
                                               r"with error 'CPU Generator does not use offset' \(.*vllm.log:3\)"):
            check_engine_alive(url, "inference_0", log)
    finally:
        srv.shutdown()
    check_engine_alive(url, "inference_0", log)               # refused: left to the next look
