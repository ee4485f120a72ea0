"""`dist.simulate`: one rank of an N-rank job run in a plain process records the collectives,
groups and bytes the real job's rank sends, for data, tensor, pipeline parallel and ZeRO."""
import json

import pytest
import torch

import autopar as dist
from distpool import run_dist
from hf_llama import batches, mp_plan, optimizer, tiny_llama
from plain_process import evaluated, run_forked

KINDS = ("dp0", "zero1", "zero2", "zero3", "dpmp", "pp")


def program(kind: str, device: str = "cpu") -> list:
    """Three training steps of a tiny HF Llama on 4 ranks; every step's comm_log as
    [(op, ranks, bytes, shape)].  With device "meta" the model and the batches are meta
    tensors (a simulation that allocates nothing)."""
    if kind == "dpmp":
        mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
        config = {"dp_config": {"sharding_level": 0}, "mp_config": {"parallelize_plan": mp_plan()}}
    elif kind == "pp":
        mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["pp", "dp"])
        config = {"dp_config": {"sharding_level": 0}, "pp_config": {"split_spec": "model.layers"}}
    else:
        mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
        config = {"dp_config": {"sharding_level": 0 if kind == "dp0" else int(kind[-1])}}
    return logged_steps(mesh, config, 3, device)


def logged_steps(mesh, config: dict, steps: int, device: str = "cpu") -> list:
    """A tiny HF Llama (on `device`) parallelized by `config` on `mesh`, trained `steps`
    steps; each step's comm_log as [(op, ranks, bytes, shape)] (the loss read after it)."""
    with torch.device(device):
        model = tiny_llama()
    model, opt = dist.parallelize(model, optimizer(model.parameters()), mesh, config)
    logs = []
    for ids, labels in batches(steps):
        ids, labels = ids.to(device), labels.to(device)
        with dist.comm_log() as log:
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        loss.item()
        logs.append([[r.op, list(r.ranks), r.bytes, list(r.shape)] for r in log])
    return logs


def each_rank(world: int, fn, *args) -> list:
    """fn(*args) simulated as every rank of a `world`-rank job in turn, in this process."""
    out = []
    for rank in range(world):
        with dist.simulate(world, rank):
            out.append(fn(*args))
    return out


@pytest.fixture(scope="module")
def simulated():
    """{device: {kind: [logs of rank 0, 1, 2, 3]}} from one plain process simulating every
    rank, with real CPU tensors and with meta tensors."""
    return evaluated("{d: {k: t.each_rank(4, t.program, k, d) for k in t.KINDS} for d in ('cpu', 'meta')}",
                     "test_simulate")


@pytest.mark.parametrize("kind", KINDS)
def test_a_simulated_rank_sends_what_the_real_rank_sends(kind, simulated):
    real = run_dist(program, 4, kind)
    for device, rank in [(d, r) for d in ("cpu", "meta") for r in range(4)]:
        assert simulated[device][kind][rank] == real[rank], (kind, device, rank)
    assert any(real[0]), kind  # the job communicates


def test_simulate_refuses_a_rank_outside_the_world():
    with pytest.raises(ValueError, match="rank 4 is not in a world of 4"):
        with dist.simulate(4, 4):
            pass


def test_the_docstring_example_runs_in_a_plain_process():
    code = ("import doctest, autopar.tools.simulate as m\n"
            "r = doctest.testmod(m, optionflags=doctest.ELLIPSIS)\n"
            "assert r.attempted > 0 and not r.failed, r\n")
    run_forked(code)


def _explained_mlp():
    mesh = dist.ProcessMesh([0, 1], dim_names=["mp"])
    torch.manual_seed(0)
    x = dist.shard_tensor(torch.randn(4, 8), mesh, [dist.Replicate()])
    w1 = dist.shard_tensor(torch.randn(8, 16), mesh, [dist.Shard(1)])
    w2 = dist.shard_tensor(torch.randn(16, 8), mesh, [dist.Shard(0)])
    with dist.explain() as ex:
        y = (x @ w1).relu() @ w2  # Megatron's column then row split: the product is Partial
        z = y + 1                 # adding a constant needs the reduced value
    return [(r.op, r.inputs, r.outputs, r.reshards, [(c.op, c.bytes) for c in r.comm]) for r in ex], ex.total_bytes()


def test_explain_names_each_ops_placements_and_the_reshard_it_caused():
    for records, total in run_dist(_explained_mlp, 2):
        ops = [r[0] for r in records]
        assert ops == ["aten.mm.default", "aten.relu.default", "aten.mm.default", "aten.add.Tensor"], ops
        assert records[0][1:3] == (["[R]", "[S(1)]"], ["[S(1)]"])
        assert records[2][2] == ["[P]"] and records[2][4] == []
        add = records[3]
        assert add[3] == [(0, "[P]", "[R]")] and add[4] == [("all_reduce", 4 * 8 * 4)], add
        assert total == sum(b for r in records for _, b in r[4])


def test_explain_runs_under_simulate():
    """The same record for rank 1 of the 2-rank job, from a plain process."""
    simulated = evaluated("t.each_rank(2, t._explained_mlp)[1]", "test_simulate")
    real = run_dist(_explained_mlp, 2)[1]
    assert simulated == json.loads(json.dumps(real))


def test_a_parameter_storage_at_a_released_activations_address_leaves_the_activation_counted():
    """An activation's storage, released, may leave its address (the peak's key) to a storage
    allocated later, such as the optimizer's flat buffer; excluding the parameters' storages at
    the end must not take that activation for a parameter."""
    import weakref

    from autopar.tools.simulate import SavedActivations
    from autopar.tensor.dispatch import storage_key

    param = torch.zeros(16)
    released = torch.ones(16)
    gone = weakref.ref(released.untyped_storage())
    del released
    assert gone() is None
    saved = SavedActivations()
    key = storage_key(param)  # the address the released activation had, as the allocator may hand it out again
    saved.events += [(key, 64, 1, gone), (key, 64, -1, gone)]
    assert saved.peak(exclude=[param.untyped_storage()]) == 64
    held = weakref.ref(param.untyped_storage())
    saved.events += [(key, 64, 1, held), (key, 64, -1, held)]
    assert saved.peak(exclude=[param.untyped_storage()]) == 64  # the parameter's own save is left out
