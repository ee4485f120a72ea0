"""Dispatch is exact or refuses, on every rank: an op without a rule that writes an input
writes the tensor itself; lazy conjugates and negations are applied; an op whose output
shape depends on values runs on the gathered inputs; an op that raises on one rank raises
on every rank; the decision cache stays bounded."""
import time
import warnings

import pytest
import torch
import torch.nn.functional as F

import autopar as dist
from autopar import comm
from autopar.tensor import dispatch
from autopar.comm import backend
from autopar.placement import Partial, Replicate, Shard
from distpool import run_dist
from opcheck import check

# An in-place op no rule will ever cover: each row becomes the running sum of the rows
# above it (the whole column is needed, so on pieces it would be wrong).
_LIB = torch.library.Library("autopar_test", "DEF")
_LIB.define("running_sum_(Tensor(a!) self) -> Tensor(a!)")
_LIB.impl("running_sum_", lambda t: t.copy_(t.cumsum(0)), "CompositeExplicitAutograd")
running_sum_ = torch.ops.autopar_test.running_sum_.default


def _mesh():
    return dist.ProcessMesh([0, 1], dim_names=["x"])


# -- writes of the replicated fallback ------------------------------------------------------
def _weight():
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(0)) * 3


def _embedding_max_norm(kind, dim):
    w0 = _weight()
    ids = torch.tensor([[0, 2, 5], [5, 2, 3]])
    w = dist.shard_tensor(w0.clone(), _mesh(), [Shard(dim)])
    if kind == "embedding":
        out = F.embedding(ids, w, max_norm=1.0)
    else:
        out = F.embedding_bag(ids, w, max_norm=1.0, mode="sum")
    return dist.unshard_dtensor(w), dist.unshard_dtensor(out), list(w.placements)


@pytest.mark.parametrize("kind", ["embedding", "embedding_bag"])
@pytest.mark.parametrize("dim", [0, 1])
def test_max_norm_renormalises_a_sharded_weight_as_one_process_does(kind, dim):
    w0 = _weight()
    ids = torch.tensor([[0, 2, 5], [5, 2, 3]])
    ref_w = w0.clone()
    ref = F.embedding(ids, ref_w, max_norm=1.0) if kind == "embedding" else F.embedding_bag(
        ids, ref_w, max_norm=1.0, mode="sum")
    assert not torch.equal(ref_w, w0)  # the call renormalises rows in place
    for w, out, placements in run_dist(_embedding_max_norm, 2, kind, dim):
        torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        assert placements == [Shard(dim)]  # the weight keeps its placement


def _module_and_views():
    """A distributed Parameter written through nn.Embedding(max_norm=); an op without a rule
    writing a view of a Shard(0) tensor, a Shard(1) tensor with a detach() alias, one that
    nothing else holds and a Partial one (these two take the placement the op ran on)."""
    w0 = _weight()
    mesh = _mesh()
    emb = torch.nn.Embedding(6, 4, max_norm=1.0)
    with torch.no_grad():
        emb.weight.copy_(w0)
    emb.weight = dist.shard_tensor(emb.weight, mesh, [Shard(0)])
    out = emb(torch.tensor([1, 4, 4]))
    t = dist.shard_tensor(torch.arange(24.0).reshape(6, 4), mesh, [Shard(0)])
    running_sum_(t[:, 1:3])  # the view's pieces lie in t's pieces
    s = dist.shard_tensor(torch.arange(24.0).reshape(6, 4), mesh, [Shard(1)])
    alias = s.detach()
    returned = running_sum_(s)
    alone = dist.shard_tensor(torch.arange(24.0).reshape(6, 4), mesh, [Shard(1)])
    running_sum_(alone)  # nothing else holds its piece: it takes the placement the op ran on
    a = dist.shard_tensor(torch.arange(12.0).reshape(3, 4), mesh, [Shard(1)])
    b = dist.shard_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    p = a @ b
    p_placements = list(p.placements)
    running_sum_(p)
    return (dist.unshard_dtensor(emb.weight), isinstance(emb.weight, torch.nn.Parameter), dist.unshard_dtensor(out),
            dist.unshard_dtensor(t), dist.unshard_dtensor(s), dist.unshard_dtensor(alias), returned is s,
            list(s.placements), p_placements, dist.unshard_dtensor(p), list(p.placements),
            dist.unshard_dtensor(alone), list(alone.placements))


def test_an_op_without_a_rule_writes_a_parameter_a_view_an_alias_and_a_partial_tensor():
    w0 = _weight()
    emb = torch.nn.Embedding(6, 4, max_norm=1.0)
    with torch.no_grad():
        emb.weight.copy_(w0)
    ref_out = emb(torch.tensor([1, 4, 4]))
    t = torch.arange(24.0).reshape(6, 4)
    running_sum_(t[:, 1:3])
    s = running_sum_(torch.arange(24.0).reshape(6, 4))
    p = running_sum_(torch.arange(12.0).reshape(3, 4) @ torch.ones(4, 2))
    for (w, is_param, out, t_d, s_d, alias, same, s_pl, p_before, p_d, p_after, alone,
         alone_pl) in run_dist(_module_and_views, 2):
        torch.testing.assert_close(w, emb.weight.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out, ref_out.detach(), rtol=1e-5, atol=1e-6)
        assert is_param
        torch.testing.assert_close(t_d, t)
        torch.testing.assert_close(s_d, s)
        torch.testing.assert_close(alias, s)  # a detach() alias sees the write
        assert same and s_pl == [Shard(1)]
        assert p_before == [Partial()] and p_after == [Replicate()]
        torch.testing.assert_close(p_d, p)
        torch.testing.assert_close(alone, s)
        assert alone_pl == [Replicate()]


def _write_to_a_copy():
    t = dist.shard_tensor(torch.arange(16.0).reshape(2, 8), _mesh(), [Shard(1)])
    try:
        running_sum_(t.reshape(4, 4))  # splits the split dim anew: the view holds a copy
    except ValueError as e:
        return str(e), dist.unshard_dtensor(t)
    return None, dist.unshard_dtensor(t)


def test_a_write_that_cannot_reach_the_tensor_is_refused_on_every_rank():
    for msg, t in run_dist(_write_to_a_copy, 2):
        assert msg is not None and "writes in place into a view" in msg and "[Shard(1)]" in msg, msg
        torch.testing.assert_close(t, torch.arange(16.0).reshape(2, 8))


# -- lazy conjugates -------------------------------------------------------------------------
def _complex_cases():
    g = torch.Generator().manual_seed(0)
    c = torch.randn(4, 6, generator=g, dtype=torch.complex64)
    x = torch.randn(6, 4, generator=g)
    a = torch.randn(4, 4, generator=g) + 4 * torch.eye(4)
    return {
        "conj": (lambda c: torch.view_as_real(c.conj() + 0), [c]),
        "conj_physical": (lambda c: torch.view_as_real(torch.conj_physical(c)), [c]),
        "resolve_conj": (lambda c: torch.view_as_real(c.conj().resolve_conj()), [c]),
        "conj_of_a_plain_operand": (lambda c: torch.view_as_real(c * c.detach().clone().conj()), [c]),
        "hfft2": (lambda x: torch.fft.hfft2(x.to(torch.complex64)), [x]),
        "hfftn": (lambda x: torch.fft.hfftn(x.to(torch.complex64)), [x]),
        # eigenvectors up to their phase: their moduli
        "eig": (lambda a: (torch.view_as_real(torch.linalg.eig(a)[0]), torch.linalg.eig(a)[1].abs()), [a]),
        # kernels that conjugate lazily inside; the real and imaginary parts of a complex input
        "lstsq_gels": (lambda ar, ai, b: [torch.view_as_real(o) if o.is_complex() else o for o in torch.linalg.lstsq(
            torch.complex(ar, ai), b.to(torch.complex64), driver="gels")[:2]], [x[:4, :3], x[2:, 1:], x[:4, 2:]]),
        "corrcoef": (lambda xr, xi: torch.view_as_real(torch.corrcoef(torch.complex(xr, xi))), [x[:3], x[3:]]),
    }


def _run_complex(placement):
    out = {}
    for name, (fn, inputs) in _complex_cases().items():
        placements = [[placement]] * len(inputs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                check(fn, inputs, placements, _mesh(), grad=True)
                out[name] = "ok"
            except AssertionError as e:
                out[name] = str(e)
    return out


@pytest.mark.parametrize("placement", [Replicate(), Shard(0), Shard(1)], ids=["R", "S0", "S1"])
def test_conjugates_and_their_gradients_are_the_single_process_ones(placement):
    for out in run_dist(_run_complex, 2, placement):
        assert out == {name: "ok" for name in _complex_cases()}, out


def _plain_conj_operand():
    c = torch.tensor([1 + 2j, 3 - 1j, -2 + 1j, 1j])
    d = dist.shard_tensor(c, _mesh(), [Shard(0)])
    piece = c.conj()[2 * dist.get_rank():2 * dist.get_rank() + 2]  # a lazy conjugate given as the piece
    given = dist.dtensor_from_local(piece, _mesh(), [Shard(0)], shape=c.shape)
    return (dist.unshard_dtensor(d * c.conj()), dist.unshard_dtensor(d.conj()).is_conj(),
            dist.unshard_dtensor(torch.view_as_real(given)), dist.unshard_dtensor(torch.sqrt(d.conj())))


def test_a_plain_conjugate_operand_and_a_conjugate_given_are_applied():
    c = torch.tensor([1 + 2j, 3 - 1j, -2 + 1j, 1j])
    for prod, lazy, given, root in run_dist(_plain_conj_operand, 2):
        torch.testing.assert_close(prod, c * c.conj())
        assert not lazy
        torch.testing.assert_close(given, torch.view_as_real(c.conj().resolve_conj()))
        torch.testing.assert_close(root, torch.sqrt(c.conj()))


# -- output shapes that depend on values ----------------------------------------------------
def _gathered_cases():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 4, generator=g)
    return {  # (fn, inputs, differentiable)
        "masked_select": (lambda x: torch.masked_select(x, x > 0), [x], True),
        "nonzero": (lambda x: torch.nonzero(x > 0), [x], False),
        "unique": (lambda x: torch.unique((x * 2).round(), return_inverse=True, return_counts=True), [x], False),
        "histogram": (lambda x: torch.histogram(x, 5), [x], False),
        "lstsq": (lambda a, b: torch.linalg.lstsq(a, b).solution, [x, torch.randn(6, 2, generator=g)], True),
        "geqrf": (lambda x: torch.geqrf(x), [x], False),
        "ctc_loss": (lambda lp: F.ctc_loss(lp.log_softmax(-1), torch.tensor([[1, 2], [2, 3], [1, 1]]), (6, 6, 6),
                                           (2, 2, 2)), [torch.randn(6, 3, 4, generator=g)], True),
        "to_sparse": (lambda x: x.to_sparse().to_dense(), [x], True),
    }


def _run_gathered():
    out = {}
    for name, (fn, inputs, grad) in _gathered_cases().items():
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            try:
                result, _ = check(fn, inputs, [[Shard(0)]] * len(inputs), _mesh(), grad=grad)
                placements = [list(o.placements) for o in (result if isinstance(result, tuple) else (result,))
                              if dist.is_dist_tensor(o)]
                out[name] = "ok", placements
            except (AssertionError, NotImplementedError) as e:
                out[name] = str(e), []
        out[name] += (any("depends on values" in str(x.message) for x in w),)
    return out


def test_ops_whose_output_shape_depends_on_values_run_on_the_gathered_inputs():
    results = run_dist(_run_gathered, 2)
    assert results[0] == results[1]
    for name, (verdict, placements, warned) in results[0].items():
        assert verdict == "ok", (name, verdict)
        assert all(p == [Replicate()] for p in placements), (name, placements)
    # the ops torch dispatches with no meta kernel warn that they ran replicated
    assert all(results[0][name][2] for name in ["masked_select", "nonzero", "unique", "histogram", "geqrf"])


# -- a composite that reads a tensor argument's memory ----------------------------------------
def _split_by_index_tensor():
    """tensor_split by a distributed tensor of indices (torch's kernel reads the indices' memory
    before dispatch) splits as one process does, forward and gradient; torch's own kernel still
    serves plain indices, its errors included."""
    mesh, g = _mesh(), torch.Generator().manual_seed(0)
    x = torch.randn(5, 6, generator=g)
    for idx in (torch.tensor([1, 3]), torch.tensor([4, 0, 2]), torch.tensor(3)):
        for pl in ([Shard(0)], [Replicate()])[idx.dim() == 0:]:
            for dim in (0, 1):
                check(lambda a, i: torch.tensor_split(a, i, dim), [x, idx], [[Shard(1)], pl], mesh)
                check(lambda a, i: a.tensor_split(i, dim), [x, idx], [[Shard(0)], pl], mesh)
    plain = torch.tensor_split(x, torch.tensor([2]), 1)
    assert [tuple(p.shape) for p in plain] == [(5, 2), (5, 4)]
    with pytest.raises(RuntimeError, match="dtype of long"):
        torch.tensor_split(x, torch.tensor([2.0]))
    return True


def test_tensor_split_by_a_distributed_index_tensor():
    assert all(run_dist(_split_by_index_tensor, 2))


# -- ops whose decomposition or derivative writes into views --------------------------------
def _writes_into_views():
    """householder_product's and ormqr's backward fill a diagonal and add into narrowed columns of
    the input autograd saved; circular padding writes its borders into slices of its output.  On
    split matrix dims or a split padded dim those views would need communication (a copy, the
    write refused): the values and gradients are the single process's instead."""
    mesh, g = _mesh(), torch.Generator().manual_seed(0)
    a, tau, c = torch.randn(6, 4, generator=g), torch.randn(4, generator=g), torch.randn(6, 5, generator=g)
    batch = torch.randn(3, 5, 4, generator=g), torch.randn(3, 2, generator=g)
    for pa, pt in (([Shard(0)], [Shard(0)]), ([Shard(1)], [Replicate()]), ([Replicate()], [Shard(0)])):
        check(torch.linalg.householder_product, [a, tau], [pa, pt], mesh)
        for left, transpose in ((True, False), (True, True)):
            check(lambda x, t, o: torch.ormqr(x, t, o, left, transpose), [a, tau, c], [pa, pt, pa], mesh)
    # a split batch dim stays split: the backward's views are local there
    out, log = check(torch.linalg.householder_product, list(batch), [[Shard(0)], [Shard(0)]], mesh)
    assert out.placements == [Shard(0)] and len(log) == 0
    x = torch.randn(2, 3, 5, 6, generator=g)
    for pad in ((1, 2, 0, 0), (-1, 1, -2, 1), (2, 0, 0, 3), (0, 0, -2, 2), (3, 3, 1, 1)):
        for pl in ([Shard(3)], [Shard(2)], [Shard(0)]):
            check(lambda t: F.pad(t, pad, mode="circular"), [x], [pl], mesh)
    with pytest.raises(ValueError, match="more than once"):
        F.pad(dist.shard_tensor(x, mesh, [Shard(3)]), (0, 0, 3, -3), mode="circular")
    return True


def test_ops_writing_into_views_are_the_single_process_ones():
    assert all(run_dist(_writes_into_views, 2))


# -- an op that raises on one rank ----------------------------------------------------------
def _raises_on_one_rank(case):
    """Ids out of range in rank 1's piece (or in both pieces): the embedding's local lookup
    raises there; rank 0 goes on to a read of the output, on a group it made before or on one
    it makes then."""
    comm.reset_groups()  # every rank: the groups below are made in this task
    mesh = _mesh()
    ids = torch.tensor([[0, 1], [2, 7 if case == "everywhere" else 3], [1, 9], [0, 0]])
    w = dist.shard_tensor(torch.arange(20.0).reshape(5, 4), mesh, [Replicate()])
    x = dist.shard_tensor(ids, mesh, [Shard(0)])
    if case != "new group":
        w.sum().item()  # the reads' group exists
    generation, start = backend._GENERATION[0], time.monotonic()
    try:
        out = F.embedding(x, w)
        caught = "no error", out.sum().item()
    except (IndexError, dist.CommError) as e:
        # well before a group's own rendezvous would give up waiting for rank 1 (AUTOPAR_TIMEOUT)
        caught = type(e).__name__, str(e), time.monotonic() - start < min(60.0, backend.timeout_seconds() / 2)
    # the job goes on: collectives pair as they should
    y = dist.shard_tensor(torch.arange(8.0), mesh, [Shard(0)])
    after = (y * 2).sum().item(), dist.unshard_dtensor(dist.reshard(y + 1, mesh, [Replicate()]))
    return caught, after, backend._GENERATION[0] - generation


@pytest.mark.parametrize("case", ["group made before", "new group"])
def test_an_op_raising_on_one_rank_raises_on_every_rank_and_the_job_goes_on(case):
    results = run_dist(_raises_on_one_rank, 2, case)
    (kind0, msg0, promptly), after0, made_anew0 = results[0]
    (kind1, msg1, _), after1, made_anew1 = results[1]
    assert kind1 == "IndexError" and "index out of range" in msg1, msg1
    assert kind0 == "CommError", (kind0, msg0)
    assert promptly  # rank 1 sees within seconds that rank 0 did not raise it
    assert "rank 1 raised IndexError: index out of range in self, in aten.embedding.default" in msg0, msg0
    for after in (after0, after1):
        assert after[0] == 56.0
        torch.testing.assert_close(after[1], torch.arange(8.0) + 1)
    assert made_anew0 == made_anew1 == 1  # each rank made its groups anew, once


def test_an_op_raising_on_every_rank_raises_its_own_error_and_keeps_the_groups():
    for (kind, msg, _), after, made_anew in run_dist(_raises_on_one_rank, 2, "everywhere"):
        assert kind == "IndexError" and "index out of range" in msg, msg
        assert after[0] == 56.0 and made_anew == 0


def _raises_on_one_rank_of_a_pair():
    """3 ranks: the embedding runs on ranks 0 and 1 and raises on rank 1; every rank then reads
    a value over all three (rank 2 is not in the op's mesh)."""
    comm.reset_groups()
    z = dist.shard_tensor(torch.arange(6.0), dist.ProcessMesh([0, 1, 2]), [Shard(0)])
    z.sum().item()  # the world's groups exist on every rank
    x = dist.shard_tensor(torch.tensor([[0, 1], [9, 3]]), _mesh(), [Shard(0)])
    w = dist.shard_tensor(torch.arange(20.0).reshape(5, 4), _mesh(), [Replicate()])
    try:
        F.embedding(x, w)
        caught = "no error", (z * 2).sum().item()
    except (IndexError, dist.CommError) as e:
        caught = type(e).__name__, str(e)
    return caught, (z + 1).sum().item()


def test_an_op_raising_on_one_rank_raises_outside_its_mesh_too():
    results = run_dist(_raises_on_one_rank_of_a_pair, 3)
    assert results[1][0][0] == "IndexError"
    for rank in (0, 2):
        kind, msg = results[rank][0]
        assert kind == "CommError" and "rank 1 raised IndexError" in msg and "aten.embedding.default" in msg, msg
    assert [after for _, after in results] == [21.0] * 3


# -- the decision cache ----------------------------------------------------------------------
def _many_shapes(n):
    t = dist.shard_tensor(torch.zeros(n + 1), dist.ProcessMesh([0]), [Shard(0)])
    dispatch.clear_cache()
    most = 0
    for k in range(1, n + 1):
        t[:k].neg()  # a slice and a neg of every length: a new key each
        most = max(most, len(dispatch._CACHE))
    return most, len(dispatch._CACHE)


def test_six_thousand_shapes_keep_the_decision_cache_at_its_bound():
    # (12,000 decisions, two per shape: three times the capacity, evicted twice over)
    most, now = run_dist(_many_shapes, 1, 6000)[0]
    assert most <= dispatch.CACHE_CAPACITY and now > dispatch.CACHE_CAPACITY // 2
