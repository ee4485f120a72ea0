"""Rules for the fp8 product `_scaled_mm` and the grouped product of mixture-of-experts layers
`_grouped_mm`: their choices without processes, and the CPU kernels of both on 2 ranks
against one process (rows, columns and the contracted dim split, nothing sent)."""
import torch

from autopar import Partial, ProcessMesh, Replicate, Shard
from autopar.spmd import engine
from distpool import run_dist
from opcheck import check
from rulecheck import meta as _m, op_call as _call

aten = torch.ops.aten
R, P = Replicate(), Partial()
F8 = torch.float8_e4m3fn


def _scaled_call(scale_a, scale_b, **kwargs):
    return _call(aten._scaled_mm.default, _m(32, 32, dtype=F8), _m(32, 32, dtype=F8).t(), scale_a, scale_b,
                 out_dtype=torch.float32, **kwargs)


def test_scaled_mm_splits_rows_columns_and_the_contracted_dim_with_their_scales():
    mesh = ProcessMesh([0, 1])
    for scale_a, scale_b, split in ((_m(), _m(), False), (_m(32, 1), _m(1, 32), True)):
        call = _scaled_call(scale_a, scale_b)
        s_a, s_b = (Shard(0),) if split else (R,), (Shard(1),) if split else (R,)
        assert engine.choose(call, mesh, [(Shard(0),), (R,), (R,), (R,)], inplace=False)[:2] == (
            [(Shard(0),), (R,), s_a, (R,)], [(Shard(0),)])
        assert engine.choose(call, mesh, [(R,), (Shard(1),), (R,), (R,)], inplace=False)[:2] == (
            [(R,), (Shard(1),), (R,), s_b], [(Shard(1),)])
        assert engine.choose(call, mesh, [(Shard(1),), (Shard(0),), (R,), (R,)], inplace=False)[1] == [(P,)]
    # a bias is added once: the contracted dim no longer splits, the bias follows the columns
    call = _scaled_call(_m(), _m(), bias=_m(32, dtype=torch.float32))
    ins, outs, _ = engine.choose(call, mesh, [(Shard(1),), (Shard(0),), (R,), (R,), (R,)], inplace=False)
    assert outs != [(P,)]
    ins, outs, _ = engine.choose(call, mesh, [(R,), (Shard(1),), (R,), (R,), (R,)], inplace=False)
    assert ins[4] == (Shard(0),) and outs == [(Shard(1),)]


def test_grouped_mm_keeps_the_dim_its_groups_cut_whole():
    mesh = ProcessMesh([0, 1])
    bf = torch.bfloat16
    offs = _m(2, dtype=torch.int32)
    # tokens routed to 2 experts: the token rows stay whole, the features split
    call = _call(aten._grouped_mm.default, _m(8, 16, dtype=bf), _m(2, 16, 32, dtype=bf), offs)
    assert engine.choose(call, mesh, [(R,), (Shard(2),), (R,)], inplace=False)[1] == [(Shard(1),)]
    assert engine.choose(call, mesh, [(Shard(1),), (Shard(1),), (R,)], inplace=False)[1] == [(P,)]
    ins, _, _ = engine.choose(call, mesh, [(Shard(0),), (R,), (R,)], inplace=False)
    assert ins[0] != (Shard(0),)
    # the weights' gradient: runs of the contracted dim, out (g, m, n)
    call = _call(aten._grouped_mm.default, _m(16, 8, dtype=bf), _m(8, 32, dtype=bf), offs)
    assert engine.choose(call, mesh, [(Shard(0),), (R,), (R,)], inplace=False)[1] == [(Shard(1),)]
    assert engine.choose(call, mesh, [(R,), (Shard(1),), (R,)], inplace=False)[1] == [(Shard(2),)]
    ins, _, _ = engine.choose(call, mesh, [(Shard(1),), (Shard(0),), (R,)], inplace=False)
    assert ins[:2] != [(Shard(1),), (Shard(0),)]
    # no offs: a batched product over the groups
    call = _call(aten._grouped_mm.default, _m(2, 8, 16, dtype=bf), _m(2, 16, 32, dtype=bf))
    assert engine.choose(call, mesh, [(Shard(0),), (Shard(0),)], inplace=False)[1] == [(Shard(0),)]


def _values_rank():
    mesh = ProcessMesh([0, 1])
    g = torch.Generator().manual_seed(2)
    a = torch.randn(32, 32, generator=g).to(F8)
    bt = torch.randn(32, 32, generator=g).to(F8)  # b is column-major: the transpose of a row-major weight
    rows, cols = torch.rand(32, 1, generator=g) + 0.5, torch.rand(1, 32, generator=g) + 0.5
    sent = []
    scaled = lambda a, bt, sa, sb: aten._scaled_mm(a, bt.t(), sa, sb, out_dtype=torch.float32)  # noqa: E731
    for sa, sb in ((torch.tensor(0.7), torch.tensor(1.3)), (rows, cols)):
        for pa, pb, split in (([Shard(0)], [R], "m"), ([R], [Shard(0)], "n"), ([Shard(1)], [Shard(1)], "k")):
            psa = [Shard(0)] if split == "m" and sa.dim() else [R]
            psb = [Shard(1)] if split == "n" and sb.dim() else [R]
            _, log = check(scaled, [a, bt, sa, sb], [pa, pb, psa, psb], mesh, grad=False)
            sent += [r.op for r in log]
    bf = torch.bfloat16  # (the grouped product takes bf16 only)
    x, w = torch.randn(8, 16, generator=g).to(bf), torch.randn(2, 16, 32, generator=g).to(bf)
    offs = torch.tensor([3, 8], dtype=torch.int32)
    grouped = lambda x, w, offs: aten._grouped_mm(x, w, offs)  # noqa: E731
    # the columns: the same sums as one process; the contracted dim: bf16 partial sums, rounded apart
    for px, pw, rtol in (([R], [Shard(2)], 1e-5), ([Shard(1)], [Shard(1)], 2e-2)):
        _, log = check(grouped, [x, w, offs], [px, pw, [R]], mesh, grad=False, rtol=rtol, atol=rtol)
        sent += [r.op for r in log]
    xb, wb = torch.randn(2, 8, 16, generator=g).to(bf), torch.randn(2, 16, 32, generator=g).to(bf)
    batched = lambda x, w: aten._grouped_mm(x, w)  # noqa: E731
    for p in ([Shard(0)], [Shard(1)]):
        _, log = check(batched, [xb, wb], [p, [Shard(0)] if p == [Shard(0)] else [R]], mesh, grad=False)
        sent += [r.op for r in log]
    return sent


def test_scaled_and_grouped_products_match_one_process_and_send_nothing():
    for sent in run_dist(_values_rank, 2):
        assert sent == [], sent
