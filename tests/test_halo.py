"""Halo exchange: convolution, pooling, interpolation and padding over a split spatial dim.

Without processes: which rows each rank's windows read (the halo widths), what it sends and
receives, and that the local windows reassemble the global op (values and gradients) for many
kernel, stride, padding, dilation and ceil-mode settings.  On 2 and 4 gloo ranks: every op
against one process (tests/opcheck.py, forward and gradient; uneven and empty pieces), with
comm_log showing only the send/recv of the rows the kernels need; a convolution whose channel
pieces are empty; the gather (with its warning) where no halo serves; splits of two spatial dims
on a 2-D mesh, corners included."""
import os
import random
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

import autopar as dist
from autopar import ProcessMesh, Replicate, Shard
from autopar.redistribute.halo import parts, transfers
from autopar.spec import DistSpec, TensorMeta, split_range
from autopar.spmd.halo import (Piece, Window, interpolation_map, padding_map, probed_map, split_dims)
from distpool import run_dist
from opcheck import check

aten = torch.ops.aten
R, S0, S1, S2, S3, S4 = Replicate(), Shard(0), Shard(1), Shard(2), Shard(3), Shard(4)


# -- the plan, without processes ------------------------------------------------------------------
def test_halo_widths_of_a_window():
    """7 rows cut 4 | 3, a 3x3 window padded by 1: each rank reads one row of the other."""
    w = Window(3, 1, 1)
    assert w.reads(0, 4) == (-1, 5) and w.reads(4, 7) == (3, 8)
    assert w.piece(0, 4, 7) == Piece(origin=0, stop=5, lo=0, hi=5, first=0)  # the op pads the top itself
    assert w.piece(4, 7, 7) == Piece(origin=3, stop=7, lo=3, hi=7, first=1)  # row 3 received
    # stride 2: a piece starts on the stride's phase; row 2 is read by a discarded window only (a zero row)
    assert Window(3, 2, 1).piece(2, 4, 7) == Piece(origin=2, stop=7, lo=3, hi=7, first=1)
    assert Window(3, 1, 2, dilation=2).reads(3, 5) == (1, 7)  # dilation 2: five rows per window
    # transposed, kernel 4, stride 2, padding 1 (x2 upsampling): output rows 6..9 come from input rows 2..5
    assert Window(4, 2, 1, transposed=True).reads(6, 10) == (2, 6)
    assert Window(2, 2, 0).piece(3, 5, 10) == Piece(origin=6, stop=10, lo=6, hi=10, first=0)  # tiling windows


def test_what_each_rank_sends_and_receives():
    have = [split_range(7, 4, r) for r in range(4)]  # (0, 2) (2, 4) (4, 6) (6, 7)
    assert parts(have, [(3, 7)]) == [(1, 3, 4), (2, 4, 6), (3, 6, 7)]
    # a 7-row window of rank 3 reaches past its neighbour's piece: rows from ranks 1 and 2
    need = [[(0, 5)], [(0, 7)], [(1, 7)], [(3, 7)]]
    assert transfers(have, need, 3) == ({1: [(6, 7)], 2: [(6, 7)]}, {1: [(3, 4)], 2: [(4, 6)]})
    assert transfers(have, need, 1)[0] == {0: [(2, 4)], 2: [(2, 4)], 3: [(3, 4)]}
    # an empty piece (3 rows over 4 ranks) sends nothing and receives what its outputs read
    have = [split_range(3, 4, r) for r in range(4)]
    need = [[(0, 1)], [(0, 2)], [(1, 3)], [(2, 3)]]
    assert transfers(have, need, 3) == ({}, {2: [(2, 3)]})
    assert transfers(have, need, 2) == ({3: [(2, 3)]}, {1: [(1, 2)]})


def test_output_boxes_of_a_split():
    """Pieces of input and output by the split rule, per group of a 2-D mesh."""
    mesh = ProcessMesh([[0, 1], [2, 3]])
    x = DistSpec(mesh, (S2, S3), TensorMeta.contiguous((2, 3, 7, 9), torch.float32))
    out = DistSpec(mesh, (S2, S3), TensorMeta.contiguous((2, 3, 4, 5), torch.float32))
    rows, cols = split_dims(x, out, (1, 0), [2, 3])
    assert (rows.group, rows.me, rows.have, rows.out) == ((0, 2), 1, ((0, 4), (4, 7)), ((0, 2), (2, 4)))
    assert (cols.group, cols.me, cols.have, cols.out) == ((2, 3), 0, ((0, 5), (5, 9)), ((0, 3), (3, 5)))
    x = DistSpec(mesh, (S0, S2), TensorMeta.contiguous((2, 3, 7, 9), torch.float32))
    assert [sd.dim for sd in split_dims(x, x, (0, 1), [2, 3])] == [2]  # the batch split is no halo


def _assembled(op, x, window, k, out_size, dim=2):
    """The global op's output assembled from k ranks' local ops on their widened pieces (rows
    [lo, hi) of x, zeros elsewhere), as `spmd.halo.widen` and `keep` run them."""
    outs = []
    for r in range(k):
        c, e = split_range(out_size, k, r)
        if e == c:
            continue
        pc = window.piece(c, e, x.shape[dim])
        rows = x.narrow(dim, pc.lo, pc.hi - pc.lo)
        pads = [0, 0] * (x.dim() - 1 - dim) + [pc.lo - pc.origin, pc.stop - pc.hi]
        outs.append(op(F.pad(rows, pads)).narrow(dim, pc.first, e - c))
    return torch.cat(outs, dim)


def _window_cases(rng):
    """(op, window) pairs of random settings: conv (transposed too), max and average pooling."""
    for _ in range(160):
        k, s, d = rng.randint(1, 5), rng.randint(1, 3), rng.randint(1, 2)
        p = rng.randint(0, k // 2)
        kind = rng.choice(["conv", "convt", "max", "avg"])
        if kind == "conv":
            w = torch.randn(2, 3, k, 1, dtype=torch.float64)
            yield (lambda x, w=w, s=s, p=p, d=d: F.conv2d(x, w, stride=(s, 1), padding=(p, 0), dilation=(d, 1)),
                   Window(k, s, p, d))
        elif kind == "convt":
            w, op_ = torch.randn(3, 2, k, 1, dtype=torch.float64), rng.randint(0, max(s, d) - 1)
            yield (lambda x, w=w, s=s, p=p, d=d, op_=op_: F.conv_transpose2d(
                x, w, stride=(s, 1), padding=(p, 0), output_padding=(op_, 0), dilation=(d, 1)),
                Window(k, s, p, d, transposed=True))
        elif kind == "max":
            ceil = rng.random() < 0.5
            yield (lambda x, k=k, s=s, p=p, d=d, ceil=ceil: F.max_pool2d(x, (k, 1), (s, 1), (p, 0), (d, 1), ceil),
                   Window(k, s, p, d))
        else:
            ceil, inc = rng.random() < 0.5, rng.random() < 0.5
            yield (lambda x, k=k, s=s, p=p, ceil=ceil, inc=inc: F.avg_pool2d(x, (k, 1), (s, 1), (p, 0), ceil, inc),
                   Window(k, s, p))


def test_local_windows_reassemble_the_global_op():
    """Random windows over random row counts on 1 to 5 ranks: the pieces' outputs and the
    gradients they send back (summed where rows were shared) are the global op's."""
    rng = random.Random(0)
    torch.manual_seed(0)
    checked = 0
    for op, window in _window_cases(rng):
        size, k = rng.randint(1, 13), rng.randint(1, 5)
        x = torch.randn(2, 3, size, 2, dtype=torch.float64, requires_grad=True)
        try:
            want = op(x)
        except RuntimeError:  # settings torch refuses for this size
            continue
        got = _assembled(op, x, window, k, want.shape[2])
        torch.testing.assert_close(got, want, msg=lambda m: f"{window} over {size} rows on {k}: {m}")
        w = torch.randn_like(want)
        want_grad, = torch.autograd.grad((want * w).sum(), x)
        got_grad, = torch.autograd.grad((got * w).sum(), x)
        torch.testing.assert_close(got_grad, want_grad, msg=lambda m: f"{window} grad over {size} on {k}: {m}")
        checked += 1
    assert checked > 120


@pytest.mark.parametrize("mode", ["linear", "cubic"])
@pytest.mark.parametrize("align", [False, True])
def test_interpolation_taps_are_torchs(mode, align):
    """The taps along one dim reproduce torch's interpolation along it (the op along the other
    dim left alone), sizes up and down, with and without a scale factor."""
    op = aten.upsample_bilinear2d.default if mode == "linear" else aten.upsample_bicubic2d.default
    for size, out, scale in [(7, 14, None), (7, 14, 2.0), (7, 10, 1.5), (9, 4, None), (5, 13, None), (1, 3, None)]:
        x = torch.randn(2, 3, size, 4)
        taps = interpolation_map(mode, size, out, align, None if align else scale, torch.float32)
        got = sum(x[:, :, taps.index[t]] * taps.weight[t].view(-1, 1) for t in range(taps.index.shape[0]))
        want = op(x, [out, 4], align, None if align else scale, None)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{size} -> {out}: {m}")


def test_copying_maps_are_torchs():
    for func, size, out, scale in [(aten.upsample_nearest2d.default, 7, 10, None),
                                   (aten.upsample_nearest2d.default, 9, 27, 3.0),
                                   (aten._upsample_nearest_exact2d.default, 7, 3, None)]:
        x = torch.randn(1, 2, size, 3)
        rows = probed_map(func, 2, 0, size, out, scale, "cpu").index[0]
        torch.testing.assert_close(x[:, :, rows], func(x, [out, 3], scale, None))
    x = torch.randn(1, 2, 6, 3)
    for mode, torch_mode in (("reflect", "reflect"), ("replicate", "replicate")):
        rows = padding_map(mode, 6, 3, 2).index[0]
        torch.testing.assert_close(x[:, :, rows], F.pad(x, (0, 0, 3, 2), mode=torch_mode))


# -- every op on a gloo world -----------------------------------------------------------------------
def _cases():
    """name -> (function, inputs, split dims of input 0); the other inputs whole."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x, x1, x3 = r(2, 3, 7, 9), r(2, 3, 11), r(1, 2, 7, 6, 5)
    tiny = r(2, 3, 3, 9)  # 3 rows: over 4 ranks one piece is empty
    hw, sp3 = (2, 3), (2, 3, 4)
    return {
        "conv": (lambda x, w: F.conv2d(x, w, padding=1), [x, r(4, 3, 3, 3)], hw),
        "conv_stride": (lambda x, w: F.conv2d(x, w, stride=2), [x, r(4, 3, 3, 3)], hw),
        "conv_stride_pad": (lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1), [x, r(4, 3, 3, 3), r(4)], hw),
        "conv_dilated": (lambda x, w: F.conv2d(x, w, dilation=2, padding=2), [x, r(4, 3, 3, 3)], hw),
        "conv_wide": (lambda x, w: F.conv2d(x, w, padding=3), [x, r(4, 3, 7, 7)], hw),
        "conv_k5_stride3": (lambda x, w: F.conv2d(x, w, stride=3, padding=2), [x, r(4, 3, 5, 5)], hw),
        "conv_groups": (lambda x, w: F.conv2d(x, w, groups=2, padding=1), [r(2, 4, 7, 9), r(4, 2, 3, 3)], hw),
        "conv_depthwise": (lambda x, w: F.conv2d(x, w, groups=3, padding=(1, 0)), [x, r(6, 1, 3, 2)], hw),
        "conv_same_even": (lambda x, w: F.conv2d(x, w, padding="same"), [x, r(4, 3, 2, 4)], hw),
        "conv_tiny": (lambda x, w: F.conv2d(x, w, padding=1), [tiny, r(4, 3, 3, 3)], (2,)),
        "conv_transpose": (lambda x, w: F.conv_transpose2d(x, w, stride=2, padding=1, output_padding=1),
                           [x, r(3, 4, 3, 3)], hw),
        "conv_transpose_k4": (lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, padding=1),
                              [x, r(3, 4, 4, 4), r(4)], hw),
        "conv_transpose_dilated": (lambda x, w: F.conv_transpose2d(x, w, dilation=2, padding=2),
                                   [x, r(3, 4, 3, 3)], hw),
        "conv_transpose_gaps": (lambda x, w: F.conv_transpose2d(x, w, stride=3), [x, r(3, 4, 2, 2)], hw),
        "conv1d": (lambda x, w: F.conv1d(x, w, padding=2, stride=2), [x1, r(4, 3, 5)], (2,)),
        "conv3d": (lambda x, w: F.conv3d(x, w, padding=1), [x3, r(3, 2, 3, 3, 3)], sp3),
        "conv_transpose3d": (lambda x, w: F.conv_transpose3d(x, w, stride=2), [x3, r(2, 2, 2, 2, 2)], sp3),
        "max_pool": (lambda x: F.max_pool2d(x, 3, 2, 1), [x], hw),
        "max_pool_indices": (lambda x: F.max_pool2d(x, 3, 2, 1, return_indices=True), [x], hw),
        "max_pool_ceil": (lambda x: F.max_pool2d(x, 3, 2, 0, ceil_mode=True), [x], hw),
        "max_pool_dilated": (lambda x: F.max_pool2d(x, 2, 1, 1, dilation=2), [x], hw),
        "max_pool_tiles": (lambda x: F.max_pool2d(x, 2), [x], hw),
        "max_pool1d": (lambda x: F.max_pool1d(x, 3, 2, 1), [x1], (2,)),
        "max_pool3d": (lambda x: F.max_pool3d(x, 3, 2, 1, return_indices=True), [x3], sp3),
        "avg_pool": (lambda x: F.avg_pool2d(x, 3, 2, 1), [x], hw),
        "avg_pool_exclude_pad": (lambda x: F.avg_pool2d(x, 3, 2, 1, count_include_pad=False), [x], hw),
        "avg_pool_ceil": (lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True), [x], hw),
        "avg_pool_divisor": (lambda x: F.avg_pool2d(x, 2, divisor_override=3), [x], hw),
        "avg_pool1d": (lambda x: F.avg_pool1d(x, 4, 3, 2), [x1], (2,)),
        "avg_pool3d": (lambda x: F.avg_pool3d(x, 2, 2, 1), [x3], sp3),
        "adaptive_avg": (lambda x: F.adaptive_avg_pool2d(x, (7, 3)), [x], hw),
        "adaptive_max": (lambda x: F.adaptive_max_pool2d(x, (7, 3), return_indices=True), [x], hw),
        "adaptive_avg3d": (lambda x: F.adaptive_avg_pool3d(x, (7, 3, 5)), [x3], sp3),
        "global_avg": (lambda x: F.adaptive_avg_pool2d(x, (1, 3)), [x], hw),  # rows: a mean, a Partial term
        "global_avg3d": (lambda x: F.adaptive_avg_pool3d(x, 1), [x3], sp3),
        "global_avg_tiny": (lambda x: F.adaptive_avg_pool2d(x, 1), [tiny], (2,)),
        "nearest": (lambda x: F.interpolate(x, scale_factor=2), [x], hw),
        "nearest_3": (lambda x: F.interpolate(x, scale_factor=3), [x], hw),
        "nearest_1_5": (lambda x: F.interpolate(x, scale_factor=1.5), [x], hw),
        "nearest_down": (lambda x: F.interpolate(x, size=(3, 4)), [x], hw),
        "nearest_exact": (lambda x: F.interpolate(x, size=(10, 13), mode="nearest-exact"), [x], hw),
        "nearest_tiny": (lambda x: F.interpolate(x, scale_factor=2), [tiny], (2,)),
        "bilinear": (lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), [x], hw),
        "bilinear_corners": (lambda x: F.interpolate(x, size=(11, 13), mode="bilinear", align_corners=True), [x], hw),
        "bilinear_down": (lambda x: F.interpolate(x, size=(4, 5), mode="bilinear"), [x], hw),
        "bilinear_1_7": (lambda x: F.interpolate(x, scale_factor=1.7, mode="bilinear"), [x], hw),
        "bicubic": (lambda x: F.interpolate(x, scale_factor=1.5, mode="bicubic"), [x], hw),
        "bicubic_corners": (lambda x: F.interpolate(x, size=(12, 10), mode="bicubic", align_corners=True), [x], hw),
        "linear": (lambda x: F.interpolate(x, scale_factor=2, mode="linear"), [x1], (2,)),
        "nearest1d": (lambda x: F.interpolate(x, scale_factor=2.5), [x1], (2,)),
        "trilinear": (lambda x: F.interpolate(x, scale_factor=2, mode="trilinear"), [x3], sp3),
        "nearest3d": (lambda x: F.interpolate(x, size=(9, 5, 5)), [x3], sp3),
        "constant": (lambda x: F.pad(x, (1, 2, 2, 1), value=0.5), [x], hw),
        "crop": (lambda x: F.pad(x, (-1, 2, -2, 1)), [x], hw),
        "reflect": (lambda x: F.pad(x, (1, 2, 2, 1), mode="reflect"), [x], hw),
        "replicate": (lambda x: F.pad(x, (1, 2, 3, 1), mode="replicate"), [x], hw),
        "reflect1d": (lambda x: F.pad(x, (3, 2), mode="reflect"), [x1], (2,)),
        "replicate3d": (lambda x: F.pad(x, (1, 2, 2, 1, 1, 3), mode="replicate"), [x3], sp3),
        "reflect3d": (lambda x: F.pad(x, (1, 2, 2, 1, 3, 1), mode="reflect"), [x3], sp3),
        "conv_reflect": (lambda x, w: F.conv2d(F.pad(x, (1, 1, 1, 1), mode="reflect"), w), [x, r(4, 3, 3, 3)], hw),
        # the output pieces are dense: a view merging the channels into the split rows runs on them
        "conv_flatten": (lambda x, w: F.conv2d(x, w, stride=2, padding=1).flatten(1, 2), [x, r(4, 3, 3, 3)], (2,)),
    }


def _run_cases(names):
    """Each case against one process on this world, input 0 split on each of its dims; what
    this rank sent and received in the forward."""
    k = dist.get_world_size()
    cases = _cases()
    found = {}
    for name in names:
        fn, inputs, dims = cases[name]
        for d in dims:
            placements = [[Shard(d)]] + [[R]] * (len(inputs) - 1)
            try:
                _, log = check(fn, inputs, placements, list(range(k)))
            except AssertionError as e:
                raise AssertionError(f"{name}, input split on dim {d} over {k} ranks: {e}") from e
            found[(name, d)] = ([r.op for r in log], sum(r.bytes for r in log), sum(r.recv_bytes for r in log))
    return found


@pytest.mark.parametrize("world", [2, 4])
def test_every_op_over_a_split_spatial_dim_equals_one_process(world):
    """Values and gradients; the forward moves only halo rows, point to point (never a gather):
    what all ranks send is what all ranks receive."""
    results = run_dist(_run_cases, world, sorted(_cases()))
    for key in results[0]:
        ops = {op for found in results for op in found[key][0]}
        assert ops <= {"send", "recv"}, (key, ops)
        assert sum(found[key][1] for found in results) == sum(found[key][2] for found in results), key
    row, col = 2 * 3 * 9 * 4, 2 * 3 * 7 * 4  # bytes of one row (split H) and one column (split W) of x
    received = {key: [found[key][2] for found in results] for key in results[0]}
    if world == 2:  # rows 0-3 | 4-6, columns 0-4 | 5-8
        assert received[("conv", 2)] == [row, row]  # a 3x3 window: one row each way
        assert received[("max_pool", 2)] == [0, row]  # outputs 2, 3 read rows 3..6: row 3
        assert received[("bilinear", 2)] == [0, row]  # output rows 7.. read from row 3
        assert received[("reflect", 2)] == [0, row]  # output rows 5..9 copy rows 3..6 and 5
        assert received[("conv_transpose_k4", 3)] == [0, col]  # output columns 9.. come from column 4 on
        assert received[("nearest_tiny", 2)] == [0, row]  # 3 rows 0-1 | 2: output rows 3.. read rows 1, 2
    else:  # rows 0-1 | 2-3 | 4-5 | 6
        assert received[("conv", 2)] == [row, 2 * row, 2 * row, row]
        # a 7x7 window: rank 3 reads rows 3..6, from rank 1 too (past its neighbour's piece)
        assert received[("conv_wide", 2)] == [3 * row, 5 * row, 4 * row, 3 * row]
        assert received[("nearest_tiny", 2)] == [0, 0, 0, row]  # 3 rows: rank 3 holds none, reads row 2


def _empty_channel_pieces():
    """A convolution over channels cut so that a rank holds none (1 over 2 ranks, 3 over 4)."""
    k = dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    cin = 1 if k == 2 else 3
    x, w, b = torch.randn(2, cin, 5, 5, generator=g), torch.randn(4, cin, 3, 3, generator=g), torch.randn(4)
    wt = torch.randn(cin, 4, 3, 3, generator=g)  # transposed: (in, out)
    mesh = list(range(k))
    found = {}
    out, log = check(lambda x, w, b: F.conv2d(x, w, b, padding=1), [x, w, b], [[S1], [S1], [R]], mesh)
    found["row"] = (out.placements, [r.op for r in log])
    out, log = check(lambda x, w, b: F.conv2d(x, w, b, padding=1), [torch.randn(2, 4, 5, 5, generator=g), wt, b[:cin]],
                     [[R], [S0], [S0]], mesh)  # cin output channels: the column pattern
    found["column"] = (out.placements, [r.op for r in log])
    out, log = check(lambda x, w: F.conv_transpose2d(x, w, stride=2), [x, wt], [[S1], [S0]], mesh)
    found["transposed_row"] = (out.placements, [r.op for r in log])
    out, log = check(lambda x, w, b: F.conv2d(x, w, b, padding=1), [x, w, b], [[S2], [R], [R]], mesh)
    found["rows_split_too"] = (out.placements, [r.op for r in log])
    return found


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_holding_no_channels_takes_part(world):
    """It gives its zero term (plus the bias on the first rank) and joins the reduction: the
    value is right and nobody waits for it."""
    for found in run_dist(_empty_channel_pieces, world):
        assert found["row"] == ([dist.Partial()], [])
        assert found["column"] == ([S1], [])
        assert found["transposed_row"] == ([dist.Partial()], [])
        assert found["rows_split_too"][0] == [S2]


def _gathered_where_no_halo_serves():
    x = torch.randn(2, 3, 7, 9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, log = check(lambda x: F.adaptive_avg_pool2d(x, (3, 4)), [x], [[S2]], [0, 1])
        antialias, _ = check(lambda x: F.interpolate(x, size=(4, 5), mode="bilinear", antialias=True), [x],
                             [[S3]], [0, 1])
    return [str(w.message) for w in caught], [r.op for r in log], out.placements, antialias.placements


def test_overlapping_adaptive_windows_are_gathered_with_a_warning():
    for messages, ops, placements, antialias in run_dist(_gathered_where_no_halo_serves, 2):
        assert any("no sharding rule for aten._adaptive_avg_pool2d" in m and "halo" in m for m in messages)
        assert any("_upsample_bilinear2d_aa" in m for m in messages)
        assert ops == ["all_gather"] and placements == [R] and antialias == [R]


def _two_dims_split():
    """Rows over one mesh dim and columns over the other: each rank's corners come with the
    second exchange (it sends the rows it received first)."""
    mesh = [[0, 1], [2, 3]]
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 3, 7, 9, generator=g), torch.randn(4, 3, 3, 3, generator=g)
    found = {}
    for name, fn, inputs in [
        ("conv", lambda x, w: F.conv2d(x, w, padding=1), [x, w]),
        ("conv_transpose", lambda x, w: F.conv_transpose2d(x, w, stride=2, padding=1), [x, w.transpose(0, 1)]),
        ("max_pool", lambda x: F.max_pool2d(x, 3, 2, 1, return_indices=True), [x]),
        ("bilinear", lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), [x]),
        ("reflect", lambda x: F.pad(x, (2, 1, 1, 2), mode="reflect"), [x]),
        ("global_avg", lambda x: F.adaptive_avg_pool2d(x, (1, 3)), [x]),
    ]:
        for placements in ([S2, S3], [S0, S3], [S2, S2]):
            out, log = check(fn, inputs, [placements] + [[R, R]] * (len(inputs) - 1), mesh)
            out = out[0] if isinstance(out, tuple) else out
            found[(name, str(placements))] = (out.placements, {r.op for r in log})
    return found


def test_rows_and_columns_split_on_a_2d_mesh():
    for found in run_dist(_two_dims_split, 4):
        for (name, placements), (out, ops) in found.items():
            want = placements.replace("Shard(2)", "Partial()") if name == "global_avg" else placements  # a mean
            assert str(out) == want and ops <= {"send", "recv"}, (name, placements, out, ops)


def _backward_sends_gradients_back():
    """The backward of a split convolution moves only rows: the input's halo again (for the
    weight's gradient) and the halo rows' gradients back to their holders; the weight's gradient
    stays Partial until it is read."""
    mesh = dist.ProcessMesh([0, 1])
    torch.manual_seed(0)
    x = dist.shard_tensor(torch.randn(2, 3, 8, 5), mesh, [S2]).requires_grad_()
    w = dist.shard_tensor(torch.randn(4, 3, 3, 3), mesh, [R]).requires_grad_()
    y = F.conv2d(x, w, padding=1)
    dy = dist.shard_tensor(torch.randn(2, 4, 8, 5), mesh, [S2])
    with dist.comm_log() as log:
        y.backward(dy)
    return [(r.op, r.bytes, r.recv_bytes) for r in log], w.grad.placements, x.grad.placements


def test_the_backward_returns_halo_gradients():
    row = 2 * 3 * 5 * 4
    for records, w_grad, x_grad in run_dist(_backward_sends_gradients_back, 2):
        assert sorted(records) == sorted([("send", row, 0), ("recv", 0, row)] * 2)
        assert w_grad == [dist.Partial()] and x_grad == [S2]


def _models_page_halo_example() -> bool:
    """docs/models.md's halo example (its second python block)."""
    page = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "models.md")
    with open(page) as f:
        code = re.findall(r"```python\n(.*?)```", f.read(), re.S)[1]
    exec(compile(code, page, "exec"), {"__name__": "__docs__"})
    return True


def test_the_models_page_halo_example_runs():
    assert all(run_dist(_models_page_halo_example, 2))
