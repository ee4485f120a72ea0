"""`dist.simulate` on the meta device: the model and the batches are meta tensors, nothing
is allocated or computed, and the simulated rank still sends what the real rank sends,
collective for collective and byte for byte."""
import json
import os

import torch

import autopar as dist
from distpool import run_dist
from hf_llama import batches, mp_plan, optimizer, tiny_llama
from plain_process import last_line, run_plain

HERE = os.path.dirname(os.path.abspath(__file__))


def mixed(device: str = "cpu", steps: int = 2) -> list:
    """Two steps of a tiny HF Llama on pp 2 x dp 2 x mp 2 (ZeRO-1 over dp); each step's
    comm_log as [(op, ranks, bytes, shape)]."""
    mesh = dist.ProcessMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], dim_names=["pp", "dp", "mp"])
    config = {"dp_config": {"sharding_level": 1}, "mp_config": {"parallelize_plan": mp_plan()},
              "pp_config": {"split_spec": "model.layers"}}
    with torch.device(device):
        model = tiny_llama()
    model, opt = dist.parallelize(model, optimizer(model.parameters()), mesh, config)
    logs = []
    for ids, labels in batches(steps):
        with dist.comm_log() as log:
            loss = model(input_ids=ids.to(device), labels=labels.to(device)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        logs.append([[r.op, list(r.ranks), r.bytes, list(r.shape)] for r in log])
    return logs


def each_rank(world: int, fn, *args) -> list:
    """fn(*args) simulated as every rank of a `world`-rank job in turn."""
    out = []
    for rank in range(world):
        with dist.simulate(world, rank):
            out.append(fn(*args))
    return out


def _in_plain_process(expr: str):
    """The JSON value of `expr`, evaluated in a fresh plain process (simulating needs one
    outside any job) with this module imported as `t`."""
    code = ("import json, sys; sys.path.insert(0, %r)\n"
            "import autopar as dist, test_simulate_meta as t\n"
            "print(json.dumps(%s))\n" % (HERE, expr))
    return json.loads(last_line(run_plain(code, timeout=600)))


def test_a_meta_simulation_of_8_ranks_sends_what_the_real_ranks_send():
    simulated = _in_plain_process("t.each_rank(8, t.mixed, 'meta')")
    real = run_dist(mixed, 8)
    assert all(len(steps) == 2 and all(steps) for steps in real)  # every rank communicates each step
    for rank in range(8):
        assert simulated[rank] == real[rank], rank


def value_reads() -> list:
    """A sharded meta tensor's reads: made-up values (zeros), no error."""
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    t = dist.shard_tensor(torch.ones(4, 2, device="meta"), mesh, [dist.Shard(0)])
    total = t.sum()
    return [total.item(), bool(total), float(total), int(total), t.tolist(), t.numpy().shape, "meta" in repr(t)]


def test_value_reads_under_a_meta_simulation_are_made_up_zeros():
    assert _in_plain_process("t.each_rank(2, t.value_reads)") == [
        [0.0, False, 0.0, 0, [[0.0, 0.0]] * 4, [4, 2], True]] * 2
