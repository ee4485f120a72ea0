"""Mistakes users make get errors that name what is at fault, raised where the mistake is made
and the same on every rank."""
import re

import torch

import autopar as dist
from autopar.tensor.dispatch import _no_meta_kernel
from autopar.placement import Partial, Replicate, Shard
from distpool import run_dist

R, S0 = Replicate(), Shard(0)


def _raised(fn) -> tuple:
    """(exception type name, message) of `fn()`, or ("", "") if it raised nothing."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects whatever was raised
        return type(e).__name__, str(e)
    return "", ""


def _ones(shape):
    return torch.ones(shape)


def _dtensor_from_fn_errors():
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    good = dist.dtensor_from_fn(torch.full, mesh, [S0], [4, 3], 2.0)
    return {
        "good": (good.placements, tuple(good.local_value().shape), dist.unshard_dtensor(good)),
        "number": _raised(lambda: dist.dtensor_from_fn(lambda: 3, mesh, [S0])),
        "returns_number": _raised(lambda: dist.dtensor_from_fn(lambda **kw: 3, mesh, [S0])),
        "no_device": _raised(lambda: dist.dtensor_from_fn(_ones, mesh, [S0], [4, 3])),
        "ignores_device": _raised(lambda: dist.dtensor_from_fn(lambda *s, **kw: torch.ones(*s), mesh, [S0], 4, 3)),
    }


def test_dtensor_from_fn_given_a_non_factory_says_what_it_needs():
    for out in run_dist(_dtensor_from_fn_errors, 2):
        placements, local_shape, value = out["good"]
        assert placements == [S0] and local_shape == (2, 3)
        torch.testing.assert_close(value, torch.full((4, 3), 2.0))
        factory = "needs a torch factory like torch.ones"
        kind, msg = out["number"]
        assert kind == "TypeError" and factory in msg and "dtype/device keywords" in msg, msg
        assert "<lambda> failed with device='meta'" in msg, msg
        kind, msg = out["returns_number"]
        assert kind == "TypeError" and factory in msg and "<lambda> returned int, not a tensor" in msg, msg
        kind, msg = out["no_device"]
        assert kind == "TypeError" and factory in msg and "_ones failed with device='meta'" in msg, msg
        assert "unexpected keyword argument 'device'" in msg, msg
        kind, msg = out["ignores_device"]
        assert kind == "TypeError" and factory in msg and "ignored device='meta'" in msg, msg


def _integer_average():
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    rank = dist.get_rank()
    ints = torch.arange(4) + rank
    summed = dist.dtensor_from_local(ints, mesh, [Partial("sum")])
    mean = dist.dtensor_from_local(ints.float(), mesh, [Partial("avg")])  # floats may be averaged
    return {
        "from_local": _raised(lambda: dist.dtensor_from_local(ints, mesh, [Partial("avg")])),
        "shard_tensor": _raised(lambda: dist.shard_tensor(torch.ones(4, dtype=torch.int32), mesh, [Partial("avg")])),
        "reshard": _raised(lambda: dist.reshard(summed, mesh, [Partial("avg")])),
        "from_fn": _raised(lambda: dist.dtensor_from_fn(torch.zeros, mesh, [Partial("avg")], [4], dtype=torch.bool)),
        "sum": dist.unshard_dtensor(summed),
        "mean": dist.unshard_dtensor(mean),
    }


def test_an_integer_tensor_with_partial_avg_is_refused_where_it_is_made():
    for out in run_dist(_integer_average, 2):
        for where, dtype in [("from_local", "torch.int64"), ("shard_tensor", "torch.int32"), ("reshard", "torch.int64"),
                             ("from_fn", "torch.bool")]:
            kind, msg = out[where]
            assert kind == "ValueError", (where, kind, msg)
            assert "Partial('avg') on mesh dim 0 ('dp')" in msg and f"the tensor is {dtype}" in msg, (where, msg)
            assert "needs a floating dtype" in msg, (where, msg)
        assert torch.equal(out["sum"], 2 * torch.arange(4) + 1)
        torch.testing.assert_close(out["mean"], torch.arange(4.0) + 0.5)


_SHAPE_MISTAKES = {
    "add": (lambda a, b: a + b, (4, 3), (5, 3)),
    "mm": (torch.mm, (4, 3), (4, 3)),
    "cat": (lambda a, b: torch.cat([a, b], dim=1), (4, 3), (5, 3)),
}


def _shape_mistakes():
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    out = {}
    for name, (fn, sa, sb) in _SHAPE_MISTAKES.items():
        a = dist.shard_tensor(torch.randn(sa), mesh, [S0])
        b = dist.shard_tensor(torch.randn(sb), mesh, [R])
        out[name] = _raised(lambda: fn(a, b))
    return out


def test_a_shape_mismatch_raises_torchs_error_with_the_op_and_global_operands():
    for out in run_dist(_shape_mistakes, 2):
        for name, (fn, sa, sb) in _SHAPE_MISTAKES.items():
            plain_kind, _ = _raised(lambda: fn(torch.randn(sa), torch.randn(sb)))
            kind, msg = out[name]
            assert kind == plain_kind == "RuntimeError", (name, kind, plain_kind)
            assert "no meta kernel" not in msg, msg
            assert re.search(rf"in aten\.{name}\.\w+ on operands {re.escape(str(list(sa)))} \[Shard\(0\)\] on "
                             rf".*; {re.escape(str(list(sb)))} \[Replicate\(\)\] on ", msg), msg


def test_a_missing_meta_kernel_is_told_from_a_users_mistake():
    # a missing kernel runs the op on the gathered inputs (tests/test_dispatch_exact.py); a mistake raises
    assert _no_meta_kernel(NotImplementedError("no Meta kernel registered"))
    assert _no_meta_kernel(RuntimeError("Tensor.item() cannot be called on meta tensors"))
    assert not _no_meta_kernel(RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"))


def _short_last_batch(drop_last):
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    data = torch.utils.data.TensorDataset(torch.arange(10.).reshape(5, 2), torch.arange(5))
    iterable = [(torch.arange(10.).reshape(5, 2)[i:i + 2], torch.arange(5)[i:i + 2]) for i in range(0, 5, 2)]
    out = {}
    for name, loader in [("samples", torch.utils.data.DataLoader(data, batch_size=2, drop_last=drop_last)),
                         ("batches", iterable[:2] if drop_last else iterable)]:
        sizes = []
        out[name] = sizes, _raised(lambda: sizes.extend(
            tuple(x.shape) for x, _ in dist.shard_dataloader(loader, mesh, shard_dims="dp")))
    return out


def test_a_last_batch_smaller_than_the_dp_degree_names_drop_last():
    """Per-rank sample reading (a map-style dataset) and whole batches cut by rank 0 alike."""
    for out in run_dist(_short_last_batch, 2, False):
        for name, (sizes, (kind, msg)) in out.items():
            assert sizes == [(2, 2), (2, 2)], (name, sizes)
            assert kind == "ValueError", (name, kind, msg)
            assert "a batch of 1 samples cannot be split over the 2 ranks of mesh dim 'dp'" in msg, msg
            assert "drop_last=True" in msg, msg
    for out in run_dist(_short_last_batch, 2, True):
        assert out == {"samples": ([(2, 2), (2, 2)], ("", "")), "batches": ([(2, 2), (2, 2)], ("", ""))}
