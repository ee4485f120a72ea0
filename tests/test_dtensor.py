"""The distributed tensor and its API on real gloo worlds."""
import os
import warnings

import numpy as np
import pytest
import torch

import autopar as dist
from autopar.tensor import dispatch
from autopar.placement import Partial, Replicate, Shard
from distpool import run_dist

R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()


def _seed_section3():
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    A = dist.shard_tensor(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), mesh, [dist.Replicate()])
    B = dist.shard_tensor(torch.tensor([[5.0, 6.0], [7.0, 8.0]]), mesh, [dist.Shard(0)])
    with dist.comm_log() as mm_log:
        C = torch.matmul(A, B)
    c_placements = C.placements
    with dist.comm_log() as relu_log:
        D = torch.relu(C)
    # C was reduced for relu; C keeps the reduced value, so a second use does not reduce again
    with dist.comm_log() as again:
        torch.relu(C)
    assert C.placements == [Replicate()] and len(again) == 0
    return c_placements, list(mm_log), D.placements, [(r.op, r.ranks) for r in relu_log], D.local_value()


def test_seed_matmul_relu_example_comes_out_as_the_seed_says():
    for c_pl, mm_log, d_pl, relu_log, d_local in run_dist(_seed_section3, 2):
        assert c_pl == [Partial()] and mm_log == []  # A sliced to Shard(1) locally: no communication
        assert d_pl == [Replicate()] and relu_log == [("all_reduce", (0, 1))]
        assert torch.equal(d_local, torch.tensor([[19.0, 22.0], [43.0, 50.0]]))


def _global_values():
    mesh = dist.ProcessMesh([[2, 0], [1, 3]], dim_names=["a", "b"])
    x = torch.arange(10.0).reshape(5, 2)
    t = dist.shard_tensor(x, mesh, [S0, P])
    return t.tolist(), t.numpy().tolist(), t.sum().item(), repr(t), tuple(t.shape), t.local_value().shape


def test_python_conversions_give_global_values():
    for lst, arr, total, text, shape, local_shape in run_dist(_global_values, 4):
        assert lst == arr == torch.arange(10.0).reshape(5, 2).tolist()
        assert total == 45.0 and shape == (5, 2)
        assert "DistTensor(" in text and "Shard(0)" in text and "Partial()" in text
        assert local_shape[1] == 2 and local_shape[0] in (2, 3)


def _train(mesh):
    """Three SGD steps of a column/row sharded MLP (mesh None: the single-process run)."""
    torch.manual_seed(0)
    w0, w1 = torch.nn.Parameter(torch.randn(8, 16)), torch.nn.Parameter(torch.randn(16, 8))
    model = torch.nn.Module()
    model.w0 = dist.shard_tensor(w0, mesh, [S1]) if mesh else w0
    model.w1 = dist.shard_tensor(w1, mesh, [S0]) if mesh else w1
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    losses = []
    for _ in range(3):
        loss = torch.matmul(torch.relu(torch.matmul(x, model.w0)), model.w1).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses


def _parameters_train():
    model, losses = _train(dist.ProcessMesh([0, 1, 2, 3]))
    names = [n for n, _ in model.named_parameters()]
    assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad and p.is_leaf for p in model.parameters())
    ref_model, ref_losses = _train(None)
    params = [dist.unshard_dtensor(p.detach()) for p in model.parameters()]
    return names, losses, ref_losses, params, [p.detach() for p in ref_model.parameters()], model.w0.local_value().shape


def test_sharded_parameters_are_parameters_and_train_like_one_process():
    for names, losses, ref_losses, params, ref_params, local_shape in run_dist(_parameters_train, 4):
        assert names == ["w0", "w1"] and local_shape == (8, 4)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        for p, r in zip(params, ref_params):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


def _outside_mesh():
    mesh = dist.ProcessMesh([0, 1])
    t = dist.shard_tensor(torch.ones(4, 4), mesh, [S0])
    with dist.comm_log() as log:
        u = torch.relu(t * 3 + 1)
        v = u.sum(0)
    return dist.get_rank(), u.local_value().numel(), tuple(u.shape), v.placements, len(log)


def test_rank_outside_the_mesh_holds_nothing_and_skips():
    for rank, numel, shape, placements, ncomm in run_dist(_outside_mesh, 4):
        assert shape == (4, 4) and placements == [P]
        assert numel == (8 if rank < 2 else 0)
        assert ncomm == 0


def _plain_mixed():
    mesh = dist.ProcessMesh([0, 1, 2, 3])
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 3))
    b = torch.randn(3)
    x = dist.shard_tensor(torch.randn(8, 6), mesh, [S0])
    y = (x @ w + b).tanh()
    y.sum().backward()
    return y.placements, type(w.grad).__name__, w.grad


def test_plain_tensors_mix_as_replicate_and_plain_params_get_reduced_grads():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 3))
    b = torch.randn(3)
    x = torch.randn(8, 6)
    (x @ w + b).tanh().sum().backward()
    for placements, grad_type, grad in run_dist(_plain_mixed, 4):
        assert placements == [S0] and grad_type == "Tensor"
        torch.testing.assert_close(grad, w.grad, rtol=1e-5, atol=1e-6)


def _from_fn_and_local():
    rank = dist.get_rank()
    mesh = dist.ProcessMesh([0, 1, 2])
    ones = dist.dtensor_from_fn(torch.ones, mesh, [S0], [7, 2])
    part = dist.dtensor_from_local(torch.full((2, 2), float(rank)), mesh, [P])
    shard = dist.dtensor_from_local(torch.full((1, 3), float(rank)), mesh, [S0])
    return ones.local_value().shape, dist.unshard_dtensor(part), dist.unshard_dtensor(shard), ones.sum().item()


def test_dtensor_from_fn_builds_only_the_local_piece_and_from_local_wraps():
    res = run_dist(_from_fn_and_local, 3)
    assert [r[0] for r in res] == [(3, 2), (2, 2), (2, 2)]
    for _, part, shard, total in res:
        assert torch.equal(part, torch.full((2, 2), 3.0))
        assert torch.equal(shard, torch.tensor([[0.0] * 3, [1.0] * 3, [2.0] * 3]))
        assert total == 14.0


def _strided_inputs():
    """A strided input (seq[:, 1:]) sharded or replicated, on a mesh with a size-1 dim too."""
    seq = torch.arange(4 * 9).reshape(4, 9)
    out = []
    for mesh, pl in ((dist.ProcessMesh([0, 1]), [S0]), (dist.ProcessMesh([0, 1]), [R]),
                     (dist.ProcessMesh([[0], [1]]), [S0, S0]), (dist.ProcessMesh([[0, 1]]), [R, R])):
        y = dist.shard_tensor(seq[:, 1:], mesh, pl)
        out.append(dist.unshard_dtensor(y.reshape(-1)))
    return out


def test_strided_inputs_shard_into_pieces_that_views_accept():
    for outs in run_dist(_strided_inputs, 2):
        for got in outs:
            assert torch.equal(got, torch.arange(4 * 9).reshape(4, 9)[:, 1:].reshape(-1))


def _cached_decisions():
    mesh = dist.ProcessMesh([0, 1])
    a = dist.shard_tensor(torch.randn(4, 4), mesh, [S0])
    b = dist.shard_tensor(torch.randn(4, 4), mesh, [S0])
    a + b
    calls = []
    orig = dispatch.decide

    def counting(*args, **kw):
        calls.append(args[0])
        return orig(*args, **kw)

    dispatch.decide = counting
    try:
        for _ in range(5):
            a + b
    finally:
        dispatch.decide = orig
    return len(calls)


def test_repeated_ops_pay_no_planning():
    assert run_dist(_cached_decisions, 2) == [0, 0]


def _bad_inputs():
    errors = {}
    mesh = dist.ProcessMesh([0, 1])

    def grab(name, fn):
        try:
            fn()
        except (ValueError, TypeError) as e:
            errors[name] = f"{type(e).__name__}: {e}"

    grab("shard_dim", lambda: dist.shard_tensor(torch.ones(4, 3), mesh, [Shard(2)]))
    grab("too_many", lambda: dist.shard_tensor(torch.ones(4, 3), mesh, [S0, S1]))
    grab("beyond_world", lambda: dist.shard_tensor(torch.ones(4), dist.ProcessMesh([0, 5]), [S0]))
    grab("not_tensor", lambda: dist.shard_tensor("abc", mesh, [R]))
    a = dist.shard_tensor(torch.ones(4), mesh, [R])
    b = dist.shard_tensor(torch.ones(4), dist.ProcessMesh([1, 0]), [R])
    grab("two_meshes", lambda: a + b)
    return errors


def test_bad_input_gets_a_clear_error():
    errors = run_dist(_bad_inputs, 2)[0]
    assert "Shard(2) is out of range for a 2-D tensor" in errors["shard_dim"]
    assert "shape [4, 3]" in errors["shard_dim"]
    assert "2 placements" in errors["too_many"] and "1-D mesh" in errors["too_many"]
    assert "ranks [5]" in errors["beyond_world"] and "2 processes" in errors["beyond_world"]
    assert errors["not_tensor"].startswith("TypeError") and "str" in errors["not_tensor"]
    assert "different meshes" in errors["two_meshes"] and "[0, 1]" in errors["two_meshes"]


def _timeout():
    from autopar import comm

    os.environ["AUTOPAR_TIMEOUT"] = "2"
    comm.reset_groups()  # every rank: sub-groups made from now on use the 2 s timeout
    msg = None
    if dist.get_rank() < 2:
        comm.group_for((0, 1))  # a sub-group (not the world), made by both members
        if dist.get_rank() == 0:  # rank 1 never joins the collective
            try:
                comm.all_reduce(torch.ones(3), (0, 1))
            except dist.CommError as e:
                msg = str(e)
    comm.reset_groups()  # every rank: drop the broken group
    return msg


def test_a_collective_that_cannot_complete_times_out_naming_op_and_group():
    msg = run_dist(_timeout, 4)[0]
    assert msg is not None and "all_reduce" in msg and "[0, 1]" in msg


# An op no rule will ever cover (the running sum needs the whole column: on pieces it is wrong)
_LIB = torch.library.Library("autopar_dtensor_test", "DEF")
_LIB.define("running_sum(Tensor t) -> Tensor")
_LIB.impl("running_sum", lambda t: t.cumsum(0), "CompositeExplicitAutograd")
running_sum = torch.ops.autopar_dtensor_test.running_sum


def _no_rule_warns_once():
    mesh = dist.ProcessMesh([0, 1])
    t = dist.shard_tensor(torch.arange(6.0), mesh, [S0])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        a = running_sum(t)
        b = running_sum(t + 1)
    msgs = [str(x.message) for x in w if "no sharding rule" in str(x.message)]
    return msgs, dist.unshard_dtensor(a), dist.unshard_dtensor(b)


def test_an_op_with_no_rule_still_works_and_warns_once():
    msgs, a, b = run_dist(_no_rule_warns_once, 2)[0]
    assert len(msgs) == 1 and "autopar_dtensor_test.running_sum" in msgs[0], msgs
    torch.testing.assert_close(a, torch.arange(6.0).cumsum(0))
    torch.testing.assert_close(b, (torch.arange(6.0) + 1).cumsum(0))


def _labels_on_another_stage():
    """Logits on the last stage's mesh, labels left on the first's (a pipeline's data loader)."""
    import torch.nn.functional as F

    first, last = dist.ProcessMesh([0, 1]), dist.ProcessMesh([2, 3])
    g = torch.Generator().manual_seed(0)
    w, x, y = torch.randn(6, 5, generator=g), torch.randn(8, 6, generator=g), torch.randint(0, 5, (8,), generator=g)
    W = dist.shard_tensor(torch.nn.Parameter(w.clone()), last, [R])
    X, Y = dist.shard_tensor(x, last, [S0]), dist.shard_tensor(y, first, [S0])
    with dist.comm_log() as log:
        loss = F.cross_entropy(X @ W, Y)
        loss.backward()
    ref_w = w.clone().requires_grad_()
    ref = F.cross_entropy(x @ ref_w, y)
    ref.backward()
    errors = {}
    A = dist.shard_tensor(torch.nn.Parameter(torch.ones(4)), first, [R])
    B = dist.shard_tensor(torch.nn.Parameter(torch.ones(4)), last, [R])
    try:
        A + B
    except ValueError as e:
        errors["both_graded"] = str(e)
    return (float(loss.item()), float(ref), dist.unshard_dtensor(W.grad), ref_w.grad, W.grad.process_mesh.process_ids,
            sorted({r.op for r in log}), errors)


def test_operands_without_gradient_follow_the_op_to_its_mesh():
    for rank, (loss, ref, grad, ref_grad, grad_mesh, ops, errors) in enumerate(run_dist(_labels_on_another_stage, 4)):
        assert loss == pytest.approx(ref, rel=1e-6)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
        assert grad_mesh == [2, 3]  # the parameter's gradient stays on its own mesh
        assert ("send" in ops) == (rank in (0, 1)) and ("recv" in ops) == (rank in (2, 3)), (rank, ops)
        assert "each holds tensors that need gradients" in errors["both_graded"]
        assert "dist.reshard" in errors["both_graded"]


def _sparse_refused():
    mesh = dist.ProcessMesh([0, 1])
    dense = torch.eye(4)
    msgs = []
    for sparse in (dense.to_sparse_csr(), dense.to_sparse()):
        for make in (lambda: dist.shard_tensor(sparse, mesh, [S0]), lambda: dist.dtensor_from_local(sparse, mesh, [S0])):
            try:
                make()
                msgs.append(None)
            except TypeError as e:
                msgs.append(str(e))
    after = dist.unshard_dtensor(dist.shard_tensor(dense, mesh, [S0]))  # the ranks are still in step
    return msgs, after


def test_a_sparse_tensor_is_refused_on_every_rank_and_the_job_goes_on():
    for msgs, after in run_dist(_sparse_refused, 2):
        assert len(msgs) == 4 and all(m and "cannot be split into pieces; pass t.to_dense()" in m for m in msgs), msgs
        assert "torch.sparse_csr tensor of shape [4, 4]" in msgs[0] and "torch.sparse_coo" in msgs[2]
        assert torch.equal(after, torch.eye(4))
