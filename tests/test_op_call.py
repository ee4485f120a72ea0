"""op_call.fast_op: the Python binding is used only where it runs exactly the op it stands for."""
import torch
from torch.overrides import TorchFunctionMode

import autopar as dist
from autopar.tensor.op_call import fast_op
from distpool import run_dist

aten = torch.ops.aten


def _samples():
    torch.manual_seed(0)
    a, b = torch.randn(4, 6), torch.randn(4, 6)
    m, v = torch.randn(6, 3), torch.randn(6)
    idx = torch.tensor([0, 2, 3])
    return [
        (aten.add.Tensor, (a, b), {}),
        (aten.add.Tensor, (a, b), {"alpha": 2}),
        (aten.add.Scalar, (a, 2), {}),
        (aten.mul.Tensor, (a, b), {}),
        (aten.div.Tensor_mode, (a, b), {"rounding_mode": "floor"}),
        (aten.mm.default, (a, m), {}),
        (aten.addmm.default, (torch.randn(3), a, m), {}),
        (aten.t.default, (a,), {}),
        (aten.view.default, (a, [6, 4]), {}),
        (aten.transpose.int, (a, 0, 1), {}),
        (aten.sum.dim_IntList, (a, [1], True), {}),
        (aten.sum.default, (a,), {}),
        (aten.mean.dim, (a, [0]), {}),
        (aten.gelu.default, (a,), {"approximate": "tanh"}),
        (aten.gelu.default, (a,), {}),
        (aten._softmax.default, (a, 1, False), {}),
        (aten.mse_loss.default, (a, b), {}),  # the binding's default reduction is not the schema's
        (aten.mse_loss.default, (a, b, 2), {}),
        (aten.index_select.default, (a, 0, idx[:2]), {}),
        (aten.mv.default, (a, v), {}),
        (aten.gelu_backward.default, (b, a), {}),  # no Python binding at all
        (aten.where.self, (a > 0, a, b), {}),
        (aten.clone.default, (a,), {}),
        (aten.cat.default, ([a, b], 1), {}),
    ]


def test_fast_op_runs_the_same_op_with_the_same_arguments():
    bound = 0
    for func, args, kwargs in _samples():
        call = fast_op(func, args, kwargs)
        want = func._op(*args, **kwargs)
        got = call(*args, **kwargs)
        assert torch.equal(got, want), f"{func} {call}"
        bound += call is not func._op
    assert bound >= 15  # most ops have a binding that reaches them


def test_fast_op_keeps_the_op_where_the_binding_differs():
    a, b = torch.randn(2, 2), torch.randn(2, 2)
    assert fast_op(aten.add.Tensor, (a, b), {}) is torch._C._VariableFunctions.add
    assert fast_op(aten.add.Scalar, (a, 2), {}) is aten.add.Scalar._op  # torch.add(a, 2) reaches add.Tensor
    assert fast_op(aten.mse_loss.default, (a, b), {}) is aten.mse_loss.default._op  # another default
    assert fast_op(aten.gelu_backward.default, (a, b), {}) is aten.gelu_backward.default._op  # no binding


def test_in_place_ops_write_through_the_binding():
    a, b = torch.randn(3), torch.randn(3)
    want = a + b
    call = fast_op(aten.add_.Tensor, (a, b), {})
    assert call is not aten.add_.Tensor._op
    out = call(a, b)
    assert out is a and torch.equal(a, want)


class _Names(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def _mode_sees_only_the_users_calls():
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    x = torch.arange(8.0).reshape(4, 2)
    w = torch.ones(2, 2, requires_grad=True)
    X = dist.shard_tensor(x, mesh, [dist.Shard(0)])
    W = dist.shard_tensor(w, mesh, [dist.Replicate()])
    W.retain_grad()
    (X @ W).sum().backward()  # decisions made and cached outside the mode
    W.grad = None
    mode = _Names()
    with mode:
        y = torch.relu(torch.add(X, X))
        loss = (y @ W).sum()
        loss.backward()
    return mode.seen, y.full_value(), W.grad.full_value()


def test_a_users_torch_function_mode_does_not_see_the_local_ops():
    x = torch.arange(8.0).reshape(4, 2)
    for seen, y, grad in run_dist(_mode_sees_only_the_users_calls, 2):
        assert torch.equal(y, torch.relu(x + x))
        assert torch.equal(grad, (torch.relu(x + x)).sum(0, keepdim=True).T.expand(2, 2))
        # what the user called (and the tensor methods autograd reads), never the local pieces' ops
        assert seen.count("add") == 1 and seen.count("relu") == 1 and seen.count("matmul") == 1, seen


class _Doubled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(2, 2))

    def forward(self, x):
        return torch.relu(x + x) @ self.w


def _mode_sees_no_replayed_op():
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    X = dist.shard_tensor(torch.arange(8.0).reshape(4, 2), mesh, [dist.Shard(0)])
    program = dist.to_static(dist.shard_layer(_Doubled(), mesh)).predict()
    program(X)  # captured
    program(X)  # captured again: the step after the first reads what it read
    mode = _Names()
    with mode:
        y = program(X)  # replayed
    return mode.seen, y.full_value()


def test_a_users_torch_function_mode_does_not_see_a_replayed_programs_ops():
    x = torch.arange(8.0).reshape(4, 2)
    for seen, y in run_dist(_mode_sees_no_replayed_op, 2):
        assert torch.equal(y, torch.relu(x + x) @ torch.ones(2, 2))
        assert not {"add", "relu", "mm", "matmul"} & set(seen), seen
