"""Collectives keep every value: a NaN through max/min on any number of ranks and wherever it
sits (as torch.amax/amin keep it), complex tensors through every transfer (moved as their
(re, im) pairs, the bytes they hold), and the integer dtypes the backends refuse.

Every rank can build every rank's term (`_term`), so each rank checks its result against the
single-process reduction of all the terms itself.
"""
import math

import pytest
import torch

import autopar as dist
from autopar import comm
from autopar.comm.collectives import GATHERED_ALL_REDUCE_BYTES
from distpool import run_dist
from opcheck import check

MAX, MIN = dist.ReduceType.MAX, dist.ReduceType.MIN
INF, NAN = math.inf, math.nan


def _term(rank: int, numel: int, nan_rank, nan_at: int = 5) -> torch.Tensor:
    """Rank `rank`'s term: distinct values, a +inf and a -inf on rank 0 (so a result can come out
    saturated without any NaN), and a NaN at `nan_at` on `nan_rank`."""
    t = torch.sin(torch.arange(numel, dtype=torch.float32) * (rank + 1.3)) * 10
    if rank == 0:
        t[1], t[2] = INF, -INF
    if rank == nan_rank:
        t[nan_at] = NAN
    return t


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal values, NaN where the reference has NaN (±0 compare equal)."""
    return got.shape == want.shape and got.dtype == want.dtype and bool(
        ((got == want) | (got.isnan() & want.isnan())).all())


def _reduced(terms, reduce_type):
    return (torch.amax if reduce_type is MAX else torch.amin)(torch.stack(terms), 0)


def _mesh():
    return dist.ProcessMesh(list(range(dist.get_world_size())), dim_names=["x"])


# -- NaN through max/min ------------------------------------------------------------------------
def _partial_max_min(numel, shard_dim_size):
    """Partial(max/min) -> Replicate and -> Shard(0) / Shard(1) (even and uneven), with the NaN on
    each rank in turn and on none; returns [(case, equal to the reference, ops logged)]."""
    k, me, mesh = dist.get_world_size(), dist.get_rank(), _mesh()
    out = []
    for reduce_type in (MAX, MIN):
        for nan_rank in [*range(k), None]:
            terms = [_term(r, numel, nan_rank) for r in range(k)]
            want = _reduced(terms, reduce_type)
            for to in ([dist.Replicate()], [dist.Shard(0)], [dist.Shard(1)]):
                shape = (numel // shard_dim_size, shard_dim_size) if to[0] != dist.Shard(1) else (shard_dim_size, -1)
                local = terms[me].reshape(shape)
                part = dist.dtensor_from_local(local.clone(), mesh, [dist.Partial(reduce_type.value)])
                with dist.comm_log() as log:
                    got = dist.reshard(part, mesh, to)
                full = dist.unshard_dtensor(got)
                out.append(((reduce_type.value, nan_rank, str(to[0])), _same(full.reshape(-1), want),
                            [(r.op, r.shape, r.bytes) for r in log]))
    return out


@pytest.mark.parametrize("k", [3, 4])
def test_partial_max_min_keep_a_nan_on_any_rank(k):
    """gloo's ring max/min dropped a NaN held by some ranks (torch.amax keeps it): on 3 ranks a
    Partial(max) with a NaN on rank 1 came out as a number."""
    numel = 6 * (4 * k + 1)  # split 4k + 1 ways: uneven pieces
    for results in run_dist(_partial_max_min, k, numel, 6):
        for case, same, ops in results:
            assert same, (case, ops)
            if case[2] == "Replicate()":
                nan = case[1] is not None
                # one ring all-reduce; a second of one byte per saturated place (a +inf/-inf in
                # the result, where a NaN may hide) only when there is one: rank 0's +inf for max
                # (plus the NaN), rank 0's -inf for min
                main = ("all_reduce", (numel // 6, 6), 2 * (k - 1) * numel * 4 // k)
                assert ops[0] == main, (case, ops)
                assert [op for op, _, _ in ops[1:]] == ["all_reduce"] and ops[1][1] == (1 + nan,), (case, ops)
            else:
                assert [op for op, _, _ in ops] == ["reduce_scatter"], (case, ops)


def _ring_max_without_infs(numel):
    """A max/min all-reduce whose result has no +inf/-inf moves once, as before."""
    k, me = dist.get_world_size(), dist.get_rank()
    ranks = tuple(range(k))
    t = torch.sin(torch.arange(numel, dtype=torch.float32) * (me + 1.3))
    with dist.comm_log() as log:
        got = comm.all_reduce(t, ranks, MAX)
        got_min = comm.all_reduce_start(t.clone(), ranks, MIN).wait()
    terms = [torch.sin(torch.arange(numel, dtype=torch.float32) * (r + 1.3)) for r in range(k)]
    return (_same(got, _reduced(terms, MAX)) and _same(got_min, _reduced(terms, MIN)),
            [(r.op, r.shape, r.bytes) for r in log])


@pytest.mark.parametrize("k", [3, 4])
def test_max_min_without_nan_or_inf_move_once(k):
    for same, ops in run_dist(_ring_max_without_infs, k, 1000):
        assert same
        assert ops == [("all_reduce", (1000,), 2 * (k - 1) * 4000 // k)] * 2, ops


def _raw_max_min(numel, nan_at):
    """comm's own max/min collectives, synchronous and started, with the NaN on each rank."""
    k, me = dist.get_world_size(), dist.get_rank()
    ranks = tuple(range(k))
    bad = []
    for reduce_type in (MAX, MIN):
        for nan_rank in [*range(k), None]:
            terms = [_term(r, numel, nan_rank, nan_at) for r in range(k)]
            want = _reduced(terms, reduce_type)
            mine = terms[me]
            got = {
                "all_reduce": comm.all_reduce(mine, ranks, reduce_type),
                "all_reduce inplace": comm.all_reduce(mine.clone(), ranks, reduce_type, inplace=True),
                "all_reduce_start": comm.all_reduce_start(mine.clone(), ranks, reduce_type).wait(),
                "reduce_scatter": comm.reduce_scatter(mine, ranks, reduce_type),
                "reduce_scatter_start": comm.reduce_scatter_start(mine, ranks, reduce_type).wait(),
            }
            piece = want.chunk(k)[me]
            for name, value in got.items():
                if not _same(value, piece if "scatter" in name else want):
                    bad.append((name, reduce_type.value, nan_rank))
            assert torch.isnan(mine).any() == (me == nan_rank)  # the caller's input is left alone
    return bad


@pytest.mark.parametrize("k", [2, 3, 4])
def test_comm_max_min_keep_a_nan(k):
    assert run_dist(_raw_max_min, k, 12 * k, 5) == [[]] * k


def test_comm_max_min_keep_a_nan_past_the_gathered_size():
    """Two ranks gather a small all-reduce and reduce it with torch.amax; past
    GATHERED_ALL_REDUCE_BYTES they use gloo's ring, whose max dropped a NaN on rank 0."""
    numel = GATHERED_ALL_REDUCE_BYTES // 4 + 16
    assert run_dist(_raw_max_min, 2, numel, numel - 3) == [[], []]


def _clip_inf(nan_rank):
    """clip_grad_norm_(norm_type=inf) over gradients split over the ranks (one uneven)."""
    k, me, mesh = dist.get_world_size(), dist.get_rank(), _mesh()
    gen = torch.Generator().manual_seed(0)
    fulls = [torch.randn(4 * k, 3, generator=gen), torch.randn(2 * k + 1, generator=gen)]
    grads = [torch.randn(f.shape, generator=gen) * 3 for f in fulls]
    if nan_rank is not None:
        grads[0][4 * nan_rank + 1, 2] = NAN
    ref = [torch.nn.Parameter(f.clone()) for f in fulls]
    for p, g in zip(ref, grads):
        p.grad = g.clone()
    want = torch.nn.utils.clip_grad_norm_(ref, 1.0, norm_type=INF)
    params = [dist.shard_tensor(torch.nn.Parameter(f.clone()), mesh, [dist.Shard(0)]) for f in fulls]
    for p, g in zip(params, grads):
        p.grad = dist.shard_tensor(g.clone(), mesh, [dist.Shard(0)])
    got = torch.nn.utils.clip_grad_norm_(params, 1.0, norm_type=INF)
    return (_same(dist.unshard_dtensor(got), want),
            all(_same(dist.unshard_dtensor(p.grad), r.grad) for p, r in zip(params, ref)), me)


@pytest.mark.parametrize("k", [3, 4])
def test_clip_grad_norm_inf_sees_a_nan_gradient_on_any_rank(k):
    for nan_rank in [*range(k), None]:
        for norm_same, grads_same, me in run_dist(_clip_inf, k, nan_rank):
            assert norm_same and grads_same, (nan_rank, me)


# -- complex tensors ------------------------------------------------------------------------------
def _complex_full(rows, cols):
    re = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    return torch.complex(re, torch.cos(re))


def _complex_reshards():
    """Shard(0) -> Replicate / Shard(1), Partial(sum/avg) -> Replicate / Shard(0), on complex64."""
    k, me, mesh = dist.get_world_size(), dist.get_rank(), _mesh()
    full = _complex_full(2 * k, 3 * k)
    out = {}
    rows = dist.shard_tensor(full, mesh, [dist.Shard(0)])
    with dist.comm_log() as log:
        out["S0->R"] = dist.reshard(rows, mesh, [dist.Replicate()]).local_value()
        out["S0->S1"] = dist.unshard_dtensor(dist.reshard(rows, mesh, [dist.Shard(1)]))
        terms = [full * (r + 1) for r in range(k)]
        summed = dist.dtensor_from_local(terms[me].clone(), mesh, [dist.Partial("sum")])
        out["P->R"] = dist.reshard(summed, mesh, [dist.Replicate()]).local_value()
        summed = dist.dtensor_from_local(terms[me].clone(), mesh, [dist.Partial("sum")])
        out["P->S0"] = dist.unshard_dtensor(dist.reshard(summed, mesh, [dist.Shard(0)]))
        avg = dist.dtensor_from_local(terms[me].clone(), mesh, [dist.Partial("avg")])
        out["Pavg->R"] = dist.reshard(avg, mesh, [dist.Replicate()]).local_value()
    ops = [(r.op, r.bytes) for r in log]
    want = {"S0->R": full, "S0->S1": full, "P->R": sum(terms), "P->S0": sum(terms), "Pavg->R": sum(terms) / k}
    return {name: torch.equal(out[name], want[name]) if name[0] == "S" else torch.allclose(out[name], want[name])
            for name in want}, ops


@pytest.mark.parametrize("k", [2, 3])
def test_complex_tensors_reshard(k):
    n = 2 * k * 3 * k  # elements of the whole tensor, 8 bytes each
    for same, ops in run_dist(_complex_reshards, k):
        assert all(same.values()), same
        piece, ring = n * 8 // k, 2 * (k - 1) * n * 8 // k
        # S(0)->R: the piece to each peer; S(0)->S(1): the (k-1)/k of the piece that leaves;
        # P->R: the all-reduce; P->S(0): a reduce-scatter; the value reads' all-gathers between
        assert [op for op, _ in ops if op != "all_gather"][:3] == ["all_to_all", "all_reduce", "reduce_scatter"], ops
        assert ops[0] == ("all_gather", (k - 1) * piece), ops
        assert ops[1] == ("all_to_all", (k - 1) * piece // k), ops
        assert ("all_reduce", ring) in ops and ("reduce_scatter", (k - 1) * piece) in ops, ops


def _complex_collectives():
    """Every raw collective and transfer on complex tensors, against the same moves done on
    their real and imaginary parts; max/min refused on every rank before anything moves."""
    k, me = dist.get_world_size(), dist.get_rank()
    ranks = tuple(range(k))
    full = _complex_full(2 * k, 3)
    mine = full * (me + 1)
    terms = [full * (r + 1) for r in range(k)]
    got, want = {}, {}
    with dist.comm_log() as log:
        got["all_gather"] = torch.cat(comm.all_gather(mine[:2], ranks))
        want["all_gather"] = torch.cat([t[:2] for t in terms])
        got["all_gather_start"] = comm.all_gather_start(mine[:2], ranks).wait()
        want["all_gather_start"] = want["all_gather"]
        got["all_reduce sum"] = comm.all_reduce(mine, ranks)
        want["all_reduce sum"] = sum(terms)
        got["all_reduce avg"] = comm.all_reduce(mine, ranks, dist.ReduceType.AVG)
        want["all_reduce avg"] = sum(terms) / k
        got["all_reduce conj"] = comm.all_reduce(mine.conj(), ranks)  # a lazy conjugate
        want["all_reduce conj"] = sum(terms).conj()
        got["all_reduce_start"] = comm.all_reduce_start(mine.clone(), ranks).wait()
        want["all_reduce_start"] = sum(terms)
        got["reduce_scatter"] = comm.reduce_scatter(mine, ranks)
        want["reduce_scatter"] = sum(terms).chunk(k)[me]
        got["reduce_scatter_start"] = comm.reduce_scatter_start(mine, ranks, dist.ReduceType.AVG).wait()
        want["reduce_scatter_start"] = (sum(terms) / k).chunk(k)[me]
        got["all_to_all"] = comm.all_to_all(mine, [2] * k, [2] * k, ranks)
        want["all_to_all"] = torch.cat([t[2 * me:2 * me + 2] for t in terms])
        got["broadcast"] = comm.broadcast(mine.clone(), k - 1, ranks)
        want["broadcast"] = terms[k - 1]
        nxt, prev = (me + 1) % k, (me - 1) % k
        buf = torch.empty_like(mine)
        comm.send_recv([(mine, nxt)], [(buf, prev)])
        got["send_recv"], want["send_recv"] = buf, terms[prev]
        buf = torch.empty_like(mine)
        with comm.deferred_sends():  # the sends are posted, the receives waited for
            comm.exchange([(mine.conj(), nxt)], [(buf, prev)])
        got["exchange conj"], want["exchange conj"] = buf, terms[prev].conj()
        buf = torch.empty_like(mine)
        works = [comm.isend(mine, nxt, "ring"), comm.irecv(buf, prev, "ring")] if me % 2 else \
            [comm.irecv(buf, prev, "ring"), comm.isend(mine, nxt, "ring")]
        for w in works:
            w.wait()
        got["isend/irecv"], want["isend/irecv"] = buf, terms[prev]
    same = {name: torch.allclose(got[name], want[name]) and got[name].dtype == torch.complex64 for name in want}
    errors = []
    for call in (lambda: comm.all_reduce(mine, ranks, MAX), lambda: comm.all_reduce_start(mine, ranks, MIN),
                 lambda: comm.reduce_scatter(mine, ranks, MAX), lambda: comm.reduce_scatter_start(mine, ranks, MIN)):
        try:
            call()
            errors.append(None)
        except TypeError as e:
            errors.append(str(e))
    ring = 2 * (k - 1) * mine.numel() * 8 // k
    return same, [(r.op, r.bytes) for r in log], errors, ring


@pytest.mark.parametrize("k", [2, 3])
def test_complex_through_every_collective(k):
    for same, ops, errors, ring in run_dist(_complex_collectives, k):
        assert all(same.values()), same
        row = 3 * 8  # a row of 3 complex64
        assert ops[:4] == [("all_gather", (k - 1) * 2 * row), ("all_gather", (k - 1) * 2 * row),
                           ("all_reduce", ring), ("all_reduce", ring)], ops
        assert ("all_to_all", (k - 1) * 2 * row) in ops and ("send", 2 * k * row) in ops, ops
        for message in errors:
            assert message is not None and "complex64" in message and ("max" in message or "min" in message), errors


def _fft(dim):
    k, mesh = dist.get_world_size(), _mesh()
    x = torch.randn(2 * k, 4 * k, generator=torch.Generator().manual_seed(3))
    check(lambda t: torch.fft.fft(t, dim=dim).abs(), [x], [[dist.Shard(0)]], mesh)
    got = dist.unshard_dtensor(torch.fft.fft(dist.shard_tensor(x, mesh, [dist.Shard(0)]), dim=dim))
    return torch.allclose(got, torch.fft.fft(x, dim=dim), atol=1e-5)


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("dim", [0, 1])
def test_fft_of_a_split_input(k, dim):
    """Along the split dim the input is gathered first; along the other the pieces transform
    where they are; the complex result's value read gathers complex pieces."""
    assert run_dist(_fft, k, dim) == [True] * k


def _refused_complex_partial_max():
    mesh = _mesh()
    full = _complex_full(2 * dist.get_world_size(), 2)
    try:
        dist.reshard(dist.shard_tensor(full, mesh, [dist.Shard(0)]), mesh, [dist.Partial("max")])
    except TypeError as e:
        return str(e)
    return None


def test_complex_partial_max_is_refused_naming_the_placement():
    for message in run_dist(_refused_complex_partial_max, 2):
        assert message is not None and "Partial('max')" in message and "complex64" in message
        assert "ProcessMesh([0, 1]" in message, message


def _captured_max(nan_ranks):
    """A captured step whose loss reduces a Partial(max) over 3 ranks replays the NaN check:
    captured on clean data, replayed with a NaN on each rank in turn."""
    k, me, mesh = dist.get_world_size(), dist.get_rank(), _mesh()
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 2)
    ref = torch.nn.Linear(4, 2)
    ref.load_state_dict(layer.state_dict())
    layer = dist.shard_layer(layer, mesh)
    opt = dist.shard_optimizer(torch.optim.SGD(layer.parameters(), lr=0.0))
    model = dist.to_static(layer, None, lambda out: out.amax(0).sum(), opt)
    model.eval()
    got, want = [], []
    for nan_rank in nan_ranks:
        x = torch.randn(2 * k, 4, generator=torch.Generator().manual_seed(1))
        if nan_rank is not None:
            x[2 * nan_rank + 1, 3] = NAN
        got.append(float(model(dist.shard_tensor(x, mesh, [dist.Shard(0)]))))
        want.append(float(ref(x).amax(0).sum()))
    return got, want


def test_a_captured_max_keeps_a_nan_when_replayed():
    for got, want in run_dist(_captured_max, 3, [None, 0, 1, 2, None]):
        assert all(g == w or (math.isnan(g) and math.isnan(w)) for g, w in zip(got, want)), (got, want)


# -- integer dtypes the backends refuse -----------------------------------------------------------
NARROW = (torch.int16, torch.uint16, torch.uint32)


def _narrow_ints():
    """int16 / uint16 / uint32 (gloo and NCCL refuse them) through a gather, an all-to-all, a
    Partial sum reduced to Replicate and to Shard (wrapping as one process's sum does), a max and
    a value read; uneven pieces.  Every rank checks the single-process values."""
    k, me = dist.get_world_size(), dist.get_rank()
    mesh = dist.ProcessMesh(list(range(k)))
    out = []
    for dtype in NARROW:
        full = (torch.arange(7 * 5) * 9001 % 65000).reshape(7, 5).to(dtype)
        t = dist.shard_tensor(full, mesh, [dist.Shard(0)])
        whole = dist.reshard(t, mesh, [dist.Replicate()])._local
        cols = dist.reshard(t, mesh, [dist.Shard(1)])
        terms = [(full.to(torch.int64) * (r + 1) * 7).to(dtype) for r in range(k)]  # sums wrap in dtype
        total = terms[0]
        for term in terms[1:]:
            total = (total.to(torch.int64) + term.to(torch.int64)).to(dtype)
        part = dist.dtensor_from_local(terms[me].clone(), mesh, [dist.Partial("sum")])
        summed = dist.reshard(part, mesh, [dist.Replicate()])._local
        split = dist.unshard_dtensor(dist.reshard(part, mesh, [dist.Shard(0)]))
        highest = dist.dtensor_from_local(terms[me].clone(), mesh, [dist.Partial("max")])
        out.append((
            torch.equal(whole, full), torch.equal(dist.unshard_dtensor(cols), full),
            torch.equal(summed, total), torch.equal(split, total),
            torch.equal(dist.reshard(highest, mesh, [dist.Replicate()])._local,
                        torch.stack([x.to(torch.int64) for x in terms]).amax(0).to(dtype)),
            dist.unshard_dtensor(t).tolist() == full.tolist(),
        ))
    return out


@pytest.mark.parametrize("k", [2, 3])
def test_integer_dtypes_the_backends_refuse_move_and_reduce(k):
    for rank, results in enumerate(run_dist(_narrow_ints, k)):
        for dtype, checks in zip(NARROW, results):
            assert all(checks), (rank, dtype, checks)


def _fp8_moves():
    """fp8 tensors (gloo refuses them) gathered, all-to-all'd and read; a Partial sum reduced
    in float32 and rounded once to fp8; every rank against one process."""
    k, me = dist.get_world_size(), dist.get_rank()
    mesh = dist.ProcessMesh(list(range(k)))
    out = []
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        full = (torch.linspace(-3, 3, 7 * 5).reshape(7, 5)).to(dtype)
        t = dist.shard_tensor(full, mesh, [dist.Shard(0)])
        whole = dist.reshard(t, mesh, [dist.Replicate()])._local
        cols = dist.unshard_dtensor(dist.reshard(t, mesh, [dist.Shard(1)]))
        terms = [(full.float() * (r + 1) / 4).to(dtype) for r in range(k)]
        total = torch.stack([x.float() for x in terms]).sum(0).to(dtype)
        part = dist.dtensor_from_local(terms[me].clone(), mesh, [dist.Partial("sum")])
        summed = dist.reshard(part, mesh, [dist.Replicate()])._local
        out.append([whole.view(torch.uint8).equal(full.view(torch.uint8)),
                    cols.view(torch.uint8).equal(full.view(torch.uint8)),
                    torch.equal(summed.float(), total.float())])
    return out


def test_fp8_tensors_move_and_reduce():
    for rank, results in enumerate(run_dist(_fp8_moves, 3)):
        assert results == [[True] * 3] * 2, (rank, results)
