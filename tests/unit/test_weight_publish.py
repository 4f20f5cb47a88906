"""Publishing weights from several trainer ranks into one step, and reading them back in parts.

- the owners plan: single-holder tensors (experts under EP) stay with their holder, sharded ones are
  spread by bytes; every tensor has exactly one owner;
- two ranks' publish equals one rank's byte for byte once reassembled, and what they wrote is real
  safetensors (safetensors' own reader agrees with ours);
- a rank killed mid-publish leaves no complete-looking step, only a tmp directory the next start removes;
- a worker reads only the experts it serves, reads each selected byte once, verifies what it read, and a
  second reader on the same node hashes nothing again; a flipped byte is caught in the tensor it hits.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from rl import exchange
from rl.exchange import retention
from rl.exchange import shard_reader as rd
from rl.exchange import shards
from rl.exchange.publisher import WeightPublisher
from rl.trainer.owners import Unit, assign_owners

ROOT = Path(__file__).resolve().parents[2]


def moe_state(layers=2, experts=8, dim=256, ffn=128, vocab=300, seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {"model.embed_tokens.weight": torch.randn(vocab, dim, generator=g),
          "lm_head.weight": torch.randn(vocab, dim, generator=g), "model.norm.weight": torch.rand(dim, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}"
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[f"{p}.self_attn.{n}.weight"] = torch.randn(dim, dim, generator=g)
        sd[f"{p}.mlp.gate.weight"] = torch.randn(experts, dim, generator=g)
        for e in range(experts):
            for n, shape in (("gate_proj", (ffn, dim)), ("up_proj", (ffn, dim)), ("down_proj", (dim, ffn))):
                sd[f"{p}.mlp.experts.{e}.{n}.weight"] = torch.randn(*shape, generator=g) * 0.02
    return sd


def split_like_ep(sd, world):
    """What each rank owns under expert parallelism: its experts, and a byte-balanced share of the rest."""
    units = []
    for name, t in sd.items():
        if ".experts." in name:
            e = int(name.split(".experts.")[1].split(".")[0])
            units.append(Unit(name, t.numel() * 4, (e * world // 8,)))
        else:
            units.append(Unit(name, t.numel() * 4, tuple(range(world))))
    owner = assign_owners(units, world)
    return [{n: t for n, t in sd.items() if owner[n] == r} for r in range(world)], owner


def stored(weights_dir: Path) -> dict[str, bytes]:
    return {n: bytes(shards._bytes(t)) for n, t in rd.ShardReader(weights_dir).tensors(dequantize=False)}


def test_owners_keep_experts_with_their_holder_and_balance_the_rest():
    units = [Unit(f"e{i}", 100, (i % 2,)) for i in range(6)]
    units += [Unit("big", 500, (0, 1)), Unit("mid", 300, (0, 1)), Unit("small", 200, (0, 1))]
    units += [Unit("e0", 100, (0,))]  # listed again by another rank: still one unit
    owner = assign_owners(units, 2)
    assert all(owner[f"e{i}"] == i % 2 for i in range(6))
    load = [sum(u.nbytes for u in {u.name: u for u in units}.values() if owner[u.name] == r) for r in (0, 1)]
    assert load == [800, 800] and (owner["big"], owner["mid"], owner["small"]) == (0, 1, 1)
    assert assign_owners(list(reversed(units)), 2) == owner  # order of listing does not matter


def test_two_ranks_publish_what_one_rank_publishes_byte_for_byte(tmp_path):
    sd = moe_state()
    one = WeightPublisher(tmp_path / "one", background=False)
    one.publish(3, sd)
    parts, owner = split_like_ep(sd, 2)
    pubs = [WeightPublisher(tmp_path / "two", rank=r, world=2, token="t0") for r in (0, 1)]
    for r in (1, 0):  # rank 1 first: rank 0 must wait for it before committing
        pubs[r].publish(3, parts[r])
    for p in pubs:
        p.wait()
    # what a GPU rank does: quantize during the copy-out, the background only writes FP8 bytes
    pre = WeightPublisher(tmp_path / "pre", quantize_on_copy=True)
    pre.publish(3, sd)
    pre.wait()
    assert any(isinstance(v, shards.Prequantized) for v in pre._copy_out(sd).values())
    a, b = (exchange.step_dir(tmp_path / d, "weights", 3) for d in ("one", "two"))
    assert stored(a) == stored(b) == stored(exchange.step_dir(tmp_path / "pre", "weights", 3))
    m = exchange.read_manifest(b)
    assert m["meta"]["ranks"] == 2 and min(m["meta"]["bytes_per_rank"]) > 0
    files = sorted(p.name for p in b.glob("*.safetensors"))
    assert any("-r00000-" in f for f in files) and any("-r00001-" in f for f in files)
    assert not (b / shards.PARTS).exists() and not list((tmp_path / "two" / "weights").glob("*.tmp-*"))
    # the files are safetensors as the safetensors library reads them, and the index names every tensor
    index = json.loads((b / shards.INDEX).read_text())["weight_map"]
    for fname in set(index.values()):
        with safe_open(str(b / fname), framework="pt") as f:
            for k in f.keys():
                assert index[k] == fname
                assert bytes(shards._bytes(f.get_tensor(k))) == stored(b)[k]
    assert json.loads((b / shards.FP8_META).read_text()) == json.loads((a / shards.FP8_META).read_text())
    # the expert of rank 1 was written by rank 1
    assert index["model.layers.0.mlp.experts.7.up_proj.weight"].startswith("model-r00001-")


_KILLED_RANK = """
import os, torch
from rl.exchange import shard_reader as rd
from rl.exchange import shards
from rl.exchange.publisher import WeightPublisher
from test_weight_publish import moe_state, split_like_ep
real = shards.atomic_write_json
def die(path, obj):
    if "parts" in str(path):
        os._exit(9)  # killed after its shard files, before its part record
    real(path, obj)
shards.atomic_write_json = die
WeightPublisher({run!r}, rank=1, world=2, token="t1", background=False).publish(5, split_like_ep(moe_state(), 2)[0][1])
"""


def test_a_rank_killed_mid_publish_leaves_no_complete_step(tmp_path):
    run = tmp_path / "run"
    parts, _ = split_like_ep(moe_state(), 2)
    # the child imports this file's helpers by its name: the repository and tests/unit on its path
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "unit")])}
    p = subprocess.run([sys.executable, "-c", _KILLED_RANK.format(run=str(run))],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert p.returncode == 9, p.stderr[-2000:]
    rank0 = WeightPublisher(run, rank=0, world=2, token="t1", commit_timeout_s=2)
    rank0.publish(5, parts[0])
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] did not finish"):
        rank0.wait()
    assert exchange.list_steps(run, "weights") == [] and exchange.latest_complete(run, "weights") is None
    tmp = list((run / "weights").glob("step_000005.tmp-*"))
    assert len(tmp) == 1 and list(tmp[0].glob("model-r00001-*.safetensors"))  # rank 1 had written shards
    assert exchange.clean_tmp(run, ["weights"]) == 1 and not list((run / "weights").iterdir())


def test_a_worker_reads_and_verifies_only_the_experts_it_serves(tmp_path):
    sd = moe_state(experts=8)
    pub = WeightPublisher(tmp_path, background=False)
    pub.publish(1, sd)
    w = exchange.step_dir(tmp_path, "weights", 1)
    served = {f"model.layers.{i}.mlp.experts": range(2, 4) for i in range(2)}
    select = rd.expert_selector(served)
    verified = rd.VerifiedOnNode(tmp_path / "node" / "verified-1.txt")
    r = rd.ShardReader(w)
    got = dict(r.tensors(select, dequantize=False, verified=verified))
    experts = {n.split(".experts.")[1].split(".")[0] for n in got if ".experts." in n}
    assert experts == {"2", "3"}
    assert "model.embed_tokens.weight" in got and "model.layers.1.mlp.gate.weight" in got
    need = r.needed_bytes(select)
    assert r.stats.bytes_needed == need == sum(t.numel() * t.element_size() for t in got.values())
    assert r.stats.bytes_hashed == need and r.stats.bytes_read / need <= 1.1  # + the file header
    total = sum(f.stat().st_size for f in w.glob("*.safetensors"))
    assert need < 0.6 * total
    again = rd.ShardReader(w)  # another engine on the node: same tensors, hashed by nobody again
    assert {n for n, _ in again.tensors(select, dequantize=False, verified=verified)} == set(got)
    assert again.stats.bytes_hashed == 0
    # dequantized reads give what the trainer quantized
    full = dict(rd.ShardReader(w).tensors())
    from rl import fp8
    q, s = fp8.quantize_block(sd["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(full["model.layers.0.self_attn.q_proj.weight"], fp8.dequantize_block(q, s))


def test_a_flipped_byte_is_caught_in_the_tensor_it_hits_and_nowhere_else(tmp_path):
    sd = moe_state(experts=8)
    WeightPublisher(tmp_path, background=False).publish(1, sd)
    w = exchange.step_dir(tmp_path, "weights", 1)
    index = json.loads((w / shards.INDEX).read_text())["weight_map"]
    victim = "model.layers.1.mlp.experts.6.down_proj.weight"
    path = w / index[victim]
    with open(path, "rb") as fh:
        _, head, start = rd._read_header(fh.fileno(), path)
    lo, _ = head[victim]["data_offsets"]
    data = bytearray(path.read_bytes())
    data[start + lo + 7] ^= 0x10
    path.write_bytes(bytes(data))
    others = rd.expert_selector({f"model.layers.{i}.mlp.experts": range(0, 4) for i in range(2)})
    assert len(dict(rd.ShardReader(w).tensors(others, dequantize=False))) > 0  # not read: not noticed
    with pytest.raises(exchange.CorruptStep, match=victim.replace(".", r"\.")):
        list(rd.ShardReader(w).tensors(dequantize=False))


def test_a_republished_step_of_the_same_number_is_verified_again(tmp_path):
    """A node's verified-tensors record is keyed by digest too: another step_N (a resume discarded and
    republished it) with a damaged tensor is caught although the name was verified before."""
    verified = rd.VerifiedOnNode(tmp_path / "node" / "step_000005.txt")
    for seed, run in ((0, tmp_path / "a"), (1, tmp_path / "b")):
        WeightPublisher(run, background=False).publish(5, moe_state(seed=seed))
    a, b = (exchange.step_dir(tmp_path / r, "weights", 5) for r in ("a", "b"))
    assert len(dict(rd.ShardReader(a).tensors(dequantize=False, verified=verified))) > 0
    shard = sorted(b.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(exchange.CorruptStep):
        list(rd.ShardReader(b).tensors(dequantize=False, verified=verified))


def _ranks_publish(rank, world, port, run, sd):
    import os
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from rl.trainer.owners import OwnershipPlan
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    state = {}
    for name, t in sd.items():  # experts: plain on their EP rank; the rest FSDP-sharded (uneven rows too)
        t = t.clone()  # spawn shares the parent's storage: the parent's reference must not change
        if ".experts." in name:
            if int(name.split(".experts.")[1].split(".")[0]) * world // 8 == rank:
                state[name] = t
        else:
            state[name] = distribute_tensor(t, mesh, [Shard(0)])
    plan = OwnershipPlan(rank, world)
    pub = WeightPublisher(run, rank=rank, world=world, token="g")
    for version in (1, 2):
        own, gathers = plan.owned(state)
        assert not any(n in own for n in (g.name for g in gathers))
        pub.publish(version, own, gathers)
        for t in state.values():  # the next optimizer step changes the parameters at once
            (t.to_local() if hasattr(t, "to_local") else t).mul_(2.0)
    pub.wait()
    dist.barrier()
    dist.destroy_process_group()


def test_fsdp_shards_are_gathered_at_their_owner_in_the_background(tmp_path):
    """Shard(0) tensors over a gloo mesh, rows not divisible by the ranks (one rank even holds none of
    a 1-row tensor), gathered to their owners on the publisher's thread while the caller already changed
    the parameters: both versions equal one process's publish of the same values."""
    import socket
    import torch.multiprocessing as mp
    sd = moe_state()
    sd["model.layers.0.odd.weight"] = torch.randn(129, 64)  # rows 65 + 64
    sd["model.layers.0.one.bias"] = torch.randn(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_ranks_publish, args=(2, port, tmp_path / "two", sd), nprocs=2, join=True,
                       start_method="spawn")
    one = WeightPublisher(tmp_path / "one", background=False)
    one.publish(1, sd)
    one.publish(2, {k: v * 2.0 for k, v in sd.items()})
    for v in (1, 2):
        a, b = (exchange.step_dir(tmp_path / d, "weights", v) for d in ("one", "two"))
        assert stored(a) == stored(b), v
        assert exchange.read_manifest(b)["meta"]["ranks"] == 2


def _versions(n, seed=0):
    """n consecutive versions as one Adam step each would make them: every weight moves by ~1e-6."""
    g = torch.Generator().manual_seed(seed)
    sd, out = moe_state(), []
    for _ in range(n):
        out.append({k: v.clone() for k, v in sd.items()})
        sd = {k: v + 1e-6 * torch.randn(v.shape, generator=g).sign() for k, v in sd.items()}
    return out


def test_deltas_rebuild_every_version_bit_exactly_and_are_small(tmp_path):
    from rl.exchange import deltas
    vs = _versions(5)
    full = WeightPublisher(tmp_path / "full", background=False)
    pub = WeightPublisher(tmp_path / "delta", background=False, full_every=3)
    parts, _ = split_like_ep(vs[0], 2)
    two = [WeightPublisher(tmp_path / "two", rank=r, world=2, token="d", full_every=3) for r in (0, 1)]
    for v, sd in enumerate(vs):
        full.publish(v, sd)
        pub.publish(v, sd)
        for r, p in enumerate(two):
            p.publish(v, {k: sd[k] for k in parts[r]})
        for p in two:
            p.wait()
    step = {d: [exchange.step_dir(tmp_path / d, "weights", v) for v in range(5)] for d in ("full", "delta", "two")}
    assert [exchange.delta_base(p) for p in step["delta"]] == [None, 0, 1, None, 3]
    assert [exchange.delta_base(p) for p in step["two"]] == [None, 0, 1, None, 3]
    size = lambda p: sum(f.stat().st_size for f in p.glob("*.safetensors"))  # noqa: E731
    assert size(step["delta"][1]) < 0.15 * size(step["delta"][0]), (size(step["delta"][1]), size(step["delta"][0]))
    for v in range(5):  # rebuilt from the chain, by one rank's or two ranks' deltas: the full version's bytes
        want = stored(step["full"][v])
        for d in ("delta", "two"):
            got, _ = deltas.stored_tensors(step[d][v])
            assert {n: bytes(shards._bytes(t)) for n, t in got.items()} == want, (d, v)
        ref = dict(rd.ShardReader(step["full"][v]).tensors(dtype=torch.float32))
        assert all(torch.equal(ref[n], t) for n, t in wire_iter(step["delta"][v]))
    # an inference worker's own copy of the base rebuilds the same; a wrong base is caught
    base, _ = deltas.stored_tensors(step["delta"][1])
    got, _ = deltas.stored_tensors(step["delta"][2], cache=(1, base), verify_rebuilt=False)
    assert {n: bytes(shards._bytes(t)) for n, t in got.items()} == stored(step["full"][2])
    wrong, _ = deltas.stored_tensors(step["delta"][0])
    with pytest.raises(exchange.CorruptStep, match="rebuilt"):
        deltas.stored_tensors(step["delta"][2], cache=(1, wrong))
    with pytest.raises(shards.NeedsBase):
        list(rd.ShardReader(step["delta"][4]).tensors(dequantize=False))
    # retention keeps what a kept delta is rebuilt from
    assert retention.prune(tmp_path / "delta", "weights", 1) == [0, 1, 2]
    assert exchange.list_steps(tmp_path / "delta", "weights") == [3, 4]


def wire_iter(path):
    from rl.exchange import weights as wire
    return wire.iter_tensors(path, dtype=torch.float32)


def test_a_damaged_delta_is_refused(tmp_path):
    from rl.exchange import deltas
    vs = _versions(2)
    pub = WeightPublisher(tmp_path, background=False, full_every=10)
    for v, sd in enumerate(vs):
        pub.publish(v, sd)
    d1 = exchange.step_dir(tmp_path, "weights", 1)
    r = rd.ShardReader(d1)
    name = next(iter(r.sparse))
    path = d1 / r.index["weight_map"][name]
    with open(path, "rb") as f:
        _, head, start = rd._read_header(f.fileno(), path)
    lo, hi = head[name + shards.VAL]["data_offsets"]
    assert hi > lo
    data = bytearray(path.read_bytes())
    data[start + lo] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(exchange.CorruptStep, match=r"::val does not match"):
        deltas.stored_tensors(d1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_parameters_are_quantized_on_the_device_and_publish_the_same_bytes(tmp_path):
    """A GPU rank's copy-out quantizes on the device and moves FP8 bytes to pinned host buffers; the
    step equals the one published from the same values on the CPU."""
    sd = moe_state()
    WeightPublisher(tmp_path / "cpu", background=False).publish(1, sd)
    pub = WeightPublisher(tmp_path / "gpu")
    gpu = {k: v.cuda() for k, v in sd.items()}
    snap = pub._copy_out(gpu)
    pre = [v for v in snap.values() if isinstance(v, shards.Prequantized)]
    assert pre and all(v.q.is_pinned() and v.q.device.type == "cpu" for v in pre)
    pub.publish(1, gpu)
    pub.wait()
    a, b = (exchange.step_dir(tmp_path / d, "weights", 1) for d in ("cpu", "gpu"))
    assert stored(a) == stored(b)
