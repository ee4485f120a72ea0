"""A training step that reads no value makes no host sync (issue 28: on a GPU each one stalls
the host until the device catches up): after the first steps (whose verifications read
verdicts), a data-parallel, ZeRO-1, ZeRO-3 and tensor-parallel step of a HF Llama runs no op
that copies a value to the host, but for the bound checks torch asserts asynchronously on a
GPU (`torch._assert_async`, a sync on a CPU only)."""
import pytest
from torch.profiler import ProfilerActivity, profile

import autopar as dist
from distpool import run_dist
from hf_llama import batches, mp_plan, optimizer, tiny_llama

# ops that wait for the device and copy a value to the host
SYNCS = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal", "aten::allclose", "aten::nonzero"}


def _syncs(prof) -> list:
    """(op, the ops it ran under) of each host sync in the profile but asynchronous asserts."""
    found = []
    for e in prof.events():
        if e.name in SYNCS:
            chain, parent = [], e.cpu_parent
            while parent is not None:
                chain.append(parent.name)
                parent = parent.cpu_parent
            if "aten::_assert_async" not in chain:
                found.append((e.name, chain[:6]))
    return found


def _syncs_in_the_fourth_step(kind: str) -> list:
    dims = ["mp"] if kind == "mp" else ["dp"]
    config = ({"mp_config": {"parallelize_plan": mp_plan()}} if kind == "mp"
              else {"dp_config": {"sharding_level": {"dp": 0, "zero1": 1, "zero3": 3}[kind]}})
    model = tiny_llama()
    model, opt = dist.parallelize(model, optimizer(model.parameters()), dist.ProcessMesh([0, 1], dim_names=dims),
                                  config)
    data = batches(4)
    for ids, labels in data[:3]:
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    ids, labels = data[3]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    return _syncs(prof)


@pytest.mark.parametrize("kind", ["dp", "zero1", "zero3", "mp"])
def test_a_training_step_that_reads_no_value_makes_no_host_sync(kind):
    for rank, found in enumerate(run_dist(_syncs_in_the_fourth_step, 2, kind)):
        assert found == [], (rank, found)
