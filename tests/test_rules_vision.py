"""The rules of convolutions, batch/group norm, pooling, resampling and recurrent ops as pure
functions (no processes): which placements the engine picks, with which kernel, and what a
local argument rewrite gives the local op.  GPU-only ops (cudnn) are checked here through
their meta kernels."""
import pytest
import torch

from autopar import Partial, ProcessMesh, Replicate, Shard
from autopar.spec import DistSpec, TensorMeta
from autopar.spmd import engine
from autopar.spmd.registry import KERNEL_PLAIN_WHEN, KERNELS, LOCAL_ARGS, MODULE_RULES, UNDECLARED_WRITES, rule_for
from rulecheck import meta as _m, op_call as _call

aten = torch.ops.aten
R, P = Replicate(), Partial()
S0, S1, S2, S3 = Shard(0), Shard(1), Shard(2), Shard(3)
MESH = ProcessMesh([0, 1])


def _choose(call, *current, mesh=MESH):
    ins, outs, kernel = engine.choose(call, mesh, [(p,) for p in current], inplace=False)
    return [i[0] for i in ins], [o[0] for o in outs], kernel


# -- convolution -------------------------------------------------------------------------------
def _conv(x, w, bias=True, stride=(1, 1), padding=(1, 1), transposed=False, groups=1, out_pad=(0, 0)):
    b = _m(w.shape[1] * groups if transposed else w.shape[0]) if bias else None
    return _call(aten.convolution.default, x, w, b, list(stride), list(padding), [1] * len(stride), transposed,
                 list(out_pad), groups)


def test_convolution_letters():
    call = _conv(_m(4, 3, 8, 8), _m(6, 3, 3, 3))
    assert _choose(call, S0, R, R) == ([S0, R, R], [S0], None)  # batch: data parallel
    # output channels: column; input channels: row (bias as one term); their kernel gives a rank
    # holding no channels its term
    assert _choose(call, R, S0, S0) == ([R, S0, S0], [S1], "convolution")
    assert _choose(call, S1, S1, R) == ([S1, S1, P], [P], "convolution")
    assert _choose(call, P, R, R) == ([P, R, P], [P], None)  # linear in the input
    call = _conv(_m(4, 3, 8, 8), _m(3, 6, 3, 3), transposed=True, stride=(2, 2))  # weight (in, out, k)
    assert _choose(call, R, S1, S0)[1] == [S1]
    assert _choose(call, S1, S0, R)[1] == [P]
    call = _conv(_m(2, 4, 9), _m(5, 4, 3), stride=(1,), padding=(0,))  # 1-D
    assert _choose(call, S0, R, R)[1] == [S0]
    call = _conv(_m(2, 4, 5, 6, 7), _m(5, 4, 3, 3, 3), stride=(1, 1, 1), padding=(1, 1, 1))  # 3-D
    assert _choose(call, S0, R, R)[1] == [S0]


def test_grouped_convolution_splits_whole_groups_only():
    depthwise = _conv(_m(4, 8, 6, 6), _m(16, 1, 3, 3), groups=8)
    assert _choose(depthwise, S1, S0, S0) == ([S1, S0, S0], [S1], None)
    assert _choose(depthwise, S1, S0, S0, mesh=ProcessMesh([0, 1, 2]))[1] == [S0]  # 8 on 3: not whole: batch
    grouped = _conv(_m(4, 8, 6, 6), _m(8, 4, 3, 3), groups=2)  # groups neither the in nor the out channels
    assert S1 not in _choose(grouped, R, S0, S0)[1] and P not in _choose(grouped, S1, S1, R)[1]
    args = [torch.empty(4, 4, 6, 6), torch.empty(8, 1, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 8]
    assert LOCAL_ARGS[aten.convolution.default](args, {}, [(4, 8, 6, 6)])[0][8] == 4  # half the groups here
    args[0] = torch.empty(2, 8, 6, 6)
    assert LOCAL_ARGS[aten.convolution.default](args, {}, [(2, 16, 6, 6)])[0][8] == 8  # a batch split keeps them


def test_convolution_backward_reads_the_forward_backwards():
    x, w, g = _m(4, 3, 8, 8), _m(6, 3, 3, 3), _m(4, 6, 8, 8)
    call = _call(aten.convolution_backward.default, g, x, w, [6], [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                 [True, True, True])
    assert _choose(call, S0, S0, R)[1] == [S0, P, P]  # data parallel: weight gradients Partial
    assert _choose(call, S1, R, S0)[1] == [P, S0, S0]  # column: the input gradient Partial
    assert _choose(call, R, S1, S1)[1] == [S1, S1, R]  # row
    assert _choose(call, P, R, R)[1] == [P, P, P]  # linear in grad_output
    call = _call(aten.convolution_backward.default, g, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                 [False, True, False])
    assert _choose(call, S0, S0, R)[1] == [P]
    args = [torch.empty(4, 3, 8, 8), torch.empty(4, 3, 8, 8), torch.empty(3, 1, 3, 3), [6], [1, 1], [1, 1], [1, 1],
            False, [0, 0], 6, [True, True, True]]
    local, _ = LOCAL_ARGS[aten.convolution_backward.default](args, {}, [(4, 3, 8, 8)])
    assert local[9] == 3 and local[3] == [3]  # half the groups; this rank's bias size


def test_spatial_splits_stay_split():
    call = _conv(_m(4, 3, 8, 8), _m(6, 3, 1, 1), padding=(0, 0))  # 1x1: each position alone
    assert _choose(call, S2, R, R) == ([S2, R, R], [S2], "convolution")
    call = _conv(_m(4, 3, 8, 8), _m(6, 3, 3, 3))  # 3x3: through a halo
    assert _choose(call, S2, R, R) == ([S2, R, R], [S2], "convolution")
    assert _choose(call, S3, R, R) == ([S3, R, R], [S3], "convolution")
    assert _choose(call, R, R, R) == ([R, R, R], [R], None)  # nothing is cut without a reason
    x, w, g = _m(4, 3, 8, 8), _m(6, 3, 3, 3), _m(4, 6, 8, 8)
    call = _call(aten.convolution_backward.default, g, x, w, [6], [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                 [True, True, True])
    assert _choose(call, S2, S2, R) == ([S2, S2, R], [S2, P, P], "convolution_backward")
    assert "convolution" in KERNEL_PLAIN_WHEN and "needs_halo" not in KERNELS


# -- batch norm --------------------------------------------------------------------------------
def _bn(training=True, op=aten.native_batch_norm.default, stats=True):
    c = _m(3)
    rs = (c, c) if stats else (None, None)
    return _call(op, _m(4, 3, 5, 5), c, c, *rs, training, 0.1, 1e-5)


def test_batch_norm_over_a_split_batch_takes_the_global_statistics():
    assert _choose(_bn(), S0, R, R, R, R) == ([S0, R, R, R, R], [S0, R, R], "batch_norm_stats")
    assert _choose(_bn(), S2, R, R, R, R)[2] == "batch_norm_stats"  # any reduced dim
    assert _choose(_bn(), S1, S0, S0, S0, S0) == ([S1, S0, S0, S0, S0], [S1, S0, S0], None)  # channels: local
    assert _choose(_bn(training=False), S0, R, R, R, R) == ([S0, R, R, R, R], [S0, R, R], None)  # eval: affine
    assert _choose(_bn(stats=False), S0, R, R)[2] == "batch_norm_stats"
    assert "batch_norm_stats" not in KERNEL_PLAIN_WHEN  # it communicates: no module holding it is a local region


def test_batch_norm_declares_the_running_statistics_it_writes():
    writes = UNDECLARED_WRITES[aten.native_batch_norm.default]
    assert writes([None] * 5 + [True], {}) == ("running_mean", "running_var")
    assert writes([None] * 5 + [False], {}) == ()
    assert UNDECLARED_WRITES[aten.cudnn_batch_norm.default] is writes


@pytest.mark.parametrize("op, args, n_out", [
    (aten._native_batch_norm_legit.default, (True, 0.1, 1e-5), 3),
    (aten._native_batch_norm_legit_functional.default, (True, 0.1, 1e-5), 5),
    (aten._batch_norm_with_update.default, (0.1, 1e-5), 4),
    (aten.cudnn_batch_norm.default, (True, 0.1, 1e-5), 4),
    (aten.miopen_batch_norm.default, (True, 0.1, 1e-5), 3),
])
def test_batch_norm_variants_of_every_backend(op, args, n_out):
    c = _m(3)
    call = _call(op, _m(4, 3, 5, 5), c, c, c, c, *args)
    ins, outs, kernel = _choose(call, S0, R, R, R, R)
    assert (outs[0], kernel, len(outs)) == (S0, "batch_norm_stats", n_out)
    assert _choose(call, S1, S0, S0, S0, S0)[2] is None


def test_batch_norm_backward():
    x, c = _m(4, 3, 5, 5), _m(3)
    call = _call(aten.native_batch_norm_backward.default, x, x, c, c, c, c, c, True, 1e-5, [True, True, True])
    assert _choose(call, S0, S0, R, R, R, R, R) == ([S0, S0, R, R, R, R, R], [S0, R, R], "batch_norm_backward_stats")
    assert _choose(call, S1, S1, S0, S0, S0, S0, S0)[1:] == ([S1, S0, S0], None)
    assert _choose(call, P, R, R, R, R, R, R)[1:] == ([P, P, P], None)  # linear in grad_output
    call = _call(aten.native_batch_norm_backward.default, x, x, c, c, c, c, c, False, 1e-5, [True, True, True])
    assert _choose(call, S0, S0, R, R, R, R, R)[1:] == ([S0, P, P], None)  # eval: local terms
    # its meta kernel makes all three gradients whatever the mask: the rule places all three
    call = _call(aten.native_batch_norm_backward.default, x, x, c, c, c, c, c, True, 1e-5, [False, True, True])
    assert len(call.outputs) == 3 and _choose(call, S0, S0, R, R, R, R, R)[1] == [S0, R, R]
    reserve = _m(0, dtype=torch.uint8)
    call = _call(aten.cudnn_batch_norm_backward.default, x, x, c, c, c, c, c, 1e-5, reserve)
    assert _choose(call, S0, S0, R, R, R, R, R, R)[2] == "batch_norm_backward_stats"
    call = _call(aten.batch_norm_backward.default, x, x, c, c, c, c, c, True, 1e-5, [True, True, True], reserve)
    assert _choose(call, S0, S0, R, R, R, R, R, R)[2] == "batch_norm_backward_stats"


def test_group_norm():
    call = _call(aten.native_group_norm.default, _m(4, 6, 5, 5), _m(6), _m(6), 4, 6, 25, 3, 1e-5)
    assert _choose(call, S0, R, R)[1:] == ([S0, S0, S0], None)
    assert _choose(call, S1, S0, S0, mesh=ProcessMesh([0, 1, 2]))[1] == [S1, S1, S1]  # one group per rank
    assert _choose(call, S1, S0, S0)[1] != [S1, S1, S1]  # 3 groups on 2 ranks would cut one
    args = [torch.empty(2, 6, 5, 5), None, None, 4, 6, 25, 3, 1e-5]
    assert LOCAL_ARGS[aten.native_group_norm.default](args, {}, [(2, 6, 5, 5), (2, 3), (2, 3)])[0][3:7] == [2, 6, 25, 3]
    call = _call(aten.native_group_norm_backward.default, _m(4, 6, 5, 5), _m(4, 6, 5, 5), _m(4, 3), _m(4, 3), _m(6),
                 4, 6, 25, 3, [True, True, True])
    assert _choose(call, S0, S0, S0, S0, R)[1] == [S0, P, P]


# -- pooling and resampling ---------------------------------------------------------------------
def test_pooling():
    x = _m(4, 6, 8, 8)
    call = _call(aten.max_pool2d_with_indices.default, x, [3, 3], [2, 2], [1, 1])
    assert _choose(call, S0)[1] == [S0, S0] and _choose(call, S1)[1] == [S1, S1]
    assert _choose(call, S2) == ([S2], [S2, S2], "pool")  # a halo; the indices rebased to the whole plane
    call = _call(aten.avg_pool2d.default, x, [2, 2])
    assert _choose(call, S2) == ([S2], [S2], None)  # windows tile the rows: each piece pools its own
    assert _choose(call, P)[1] == [P]
    assert _choose(_call(aten.avg_pool2d.default, _m(4, 6, 12, 8), [4, 4]), S2)[2] == "pool"  # 3 windows on 2
    assert _choose(_call(aten.avg_pool2d.default, x, [3, 3], [2, 2], [1, 1]), S2)[2] == "pool"
    call = _call(aten._adaptive_avg_pool2d.default, x, [3, 3])  # windows of uneven overlap: gathered
    assert _choose(call, S2) == ([S2], [R], "gather_spatial")
    call = _call(aten._adaptive_avg_pool2d.default, x, [1, 1])  # global pooling: each piece's mean a term
    assert _choose(call, S2) == ([S2], [P], "pool")
    call = _call(aten._adaptive_avg_pool2d_backward.default, _m(4, 6, 1, 1), x)
    assert _choose(call, R, S3) == ([R, S3], [S3], "pool_backward")
    call = _call(aten._adaptive_avg_pool2d.default, x, [4, 2])
    assert _choose(call, S3) == ([S3], [S3], None)
    args, _ = LOCAL_ARGS[aten._adaptive_avg_pool2d.default]([torch.empty(4, 6, 8, 4), [4, 2]], {}, [(4, 6, 4, 1)])
    assert args[1] == [4, 1]
    call = _call(aten.max_pool2d_with_indices_backward.default, _m(4, 6, 4, 4), x, [2, 2], [2, 2], [0, 0], [1, 1],
                 False, _m(4, 6, 4, 4, dtype=torch.long))
    assert _choose(call, S0, S0, S0)[1] == [S0] and _choose(call, P, R, R)[1] == [P]


def test_resampling():
    x = _m(4, 6, 8, 8)
    call = _call(aten.upsample_nearest2d.default, x, [16, 16])
    assert _choose(call, S0)[1] == [S0] and _choose(call, S2) == ([S2], [S2], None)
    args, _ = LOCAL_ARGS[aten.upsample_nearest2d.default]([torch.empty(4, 6, 4, 8), [16, 16]], {}, [(4, 6, 8, 16)])
    assert args[1] == [8, 16]
    assert _choose(_call(aten.upsample_nearest2d.default, x, [24, 24]), S2)[2] == "interpolate"  # factor 3
    call = _call(aten.upsample_bilinear2d.default, x, [16, 16], False)
    assert _choose(call, S1)[1] == [S1] and _choose(call, S2) == ([S2], [S2], "interpolate")
    call = _call(aten.upsample_bilinear2d_backward.default, _m(4, 6, 16, 16), [16, 16], [4, 6, 8, 8], False)
    assert _choose(call, S3) == ([S3], [S3], "interpolate_backward")
    assert _choose(_call(aten._upsample_bilinear2d_aa.default, x, [5, 5], False), S2)[2] == "gather_spatial"
    call = _call(aten.upsample_nearest2d_backward.default, _m(4, 6, 16, 16), [16, 16], [4, 6, 8, 8])
    assert _choose(call, S2)[1] == [S2] and _choose(call, P)[1] == [P]
    args, _ = LOCAL_ARGS[aten.upsample_nearest2d_backward.default](
        [torch.empty(2, 6, 16, 16), [16, 16], [4, 6, 8, 8]], {}, [(2, 6, 8, 8)])
    assert args[1:3] == [[16, 16], [2, 6, 8, 8]]
    call = _call(aten.pixel_shuffle.default, _m(4, 8, 6, 6), 2)  # (4, 2, 12, 12)
    assert _choose(call, S1)[1] == [S1] and _choose(call, S2)[1] == [S2]
    assert _choose(_call(aten.pixel_shuffle.default, _m(4, 12, 5, 5), 2), S1)[1] != [S1]  # 3 channels on 2 ranks
    assert _choose(_call(aten.pixel_shuffle.default, _m(4, 8, 5, 5), 2), S2)[1] != [S2]  # 5 rows on 2 ranks
    call = _call(aten.im2col.default, x, [3, 3], [1, 1], [1, 1], [1, 1])
    assert _choose(call, S1)[1] == [S1] and _choose(call, S2)[2] == "gather_spatial"
    call = _call(aten.constant_pad_nd.default, x, [1, 1], 0.0)
    assert _choose(call, S2) == ([S2], [S2], None) and _choose(call, S3) == ([S3], [S3], "pad")
    call = _call(aten.reflection_pad2d.default, x, [1, 1, 0, 0])
    assert _choose(call, S2) == ([S2], [S2], None) and _choose(call, S3) == ([S3], [S3], "pad")


def test_grid_sample_and_fourier_transforms():
    x, grid = _m(4, 6, 8, 8), _m(4, 5, 3, 2)
    call = _call(aten.grid_sampler_2d.default, x, grid, 0, 0, False)
    assert _choose(call, S0, S0)[1] == [S0] and _choose(call, S1, R)[1] == [S1]
    assert _choose(call, R, S1)[1] == [S2]  # the grid's positions are the output's
    call = _call(aten.grid_sampler_2d_backward.default, _m(4, 6, 5, 3), x, grid, 0, 0, False, [True, True])
    assert _choose(call, S1, S1, R)[1] == [S1, P] and _choose(call, S2, R, S1)[1] == [P, S1]
    call = _call(aten._fft_r2c.default, _m(4, 6, 16), [2], 0, True)
    assert _choose(call, S0)[1] == [S0] and _choose(call, S2)[1] != [S2]
    call = _call(aten.view_as_real.default, _m(4, 9, dtype=torch.complex64))
    assert _choose(call, S1)[1] == [S1]


# -- recurrent -----------------------------------------------------------------------------------
def test_recurrent_ops_of_each_backend():
    w = [_m(24, 3), _m(24, 6), _m(24), _m(24)]
    call = _call(aten.mkldnn_rnn_layer.default, _m(5, 4, 3), *w, _m(4, 6), _m(4, 6), False, [], 2, 6, 1, True,
                 False, True, True)  # batch_first only misleads the meta: the input is time-major here
    assert _choose(call, S1, R, R, R, R, S0, S0)[1] == [S1, S0, S0, R]
    seq, state = _m(5, 4, 6), _m(4, 6)
    call = _call(aten.mkldnn_rnn_layer_backward.default, _m(5, 4, 3), *w, state, state, seq, state, state, seq, state,
                 state, False, 2, 6, 1, True, True, False, [], False, _m(0, dtype=torch.uint8))
    ins, outs, _ = _choose(call, S1, R, R, R, R, S0, S0, S1, S0, S0, S1, S0, S0, R)
    assert outs == [S1, P, P, P, P, S0, S0] and ins[-1] == R  # the workspace never moves
    call = _call(aten._cudnn_rnn.default, _m(4, 5, 3), w, 4, None, _m(1, 4, 6), _m(1, 4, 6), 2, 6, 0, 1, True, 0.0,
                 True, False, [], None)
    assert _choose(call, S0, R, R, R, R, S1, S1)[1] == [S0, S1, S1, R]
    call = _call(aten._thnn_fused_lstm_cell.default, _m(4, 24), _m(4, 24), _m(4, 6), _m(24), _m(24))
    assert _choose(call, S0, S0, S0, R, R)[1] == [S0, S0, S0]
    call = _call(aten._thnn_fused_lstm_cell_backward_impl.default, _m(4, 6), _m(4, 6), _m(4, 6), _m(4, 6),
                 _m(4, 24), True)
    assert _choose(call, S0, S0, S0, S0, S0)[1] == [S0, S0, P]
    assert rule_for(aten._thnn_fused_gru_cell.default) is not None
    assert rule_for(aten._cudnn_rnn_backward.default) is not None
    call = _call(aten.unsafe_split.Tensor, _m(4, 18), 6, 1)
    assert _choose(call, S0)[1] == [S0, S0, S0]


def _specs(placements, *shape):
    return DistSpec(ProcessMesh([0, 1]), placements, TensorMeta.contiguous(shape, torch.float32))


def test_recurrent_modules_over_a_split_batch_are_vouched_for():
    rule = MODULE_RULES[torch.nn.RNNBase]
    gru = torch.nn.GRU(3, 6, num_layers=2, batch_first=True, bidirectional=True)
    whole = [_specs([R], *p.shape) for p in gru.parameters()]
    x = _specs([S0], 4, 5, 3)
    out, h = rule(gru, (x,), {}, whole)
    assert (out.shape, out.placements, out.meta.stride) == ((4, 5, 12), (S0,), (12, 48, 1))  # as torch's
    assert (h.shape, h.placements) == ((4, 4, 6), (S1,))
    assert rule(gru, (_specs([S1], 4, 5, 3),), {}, whole) is None  # time split
    assert rule(gru, (x, _specs([R], 4, 4, 6)), {}, whole) is None  # whole state
    assert rule(gru, (None,), {}, whole) is None  # a plain input
    assert rule(gru, (x,), {}, [None] + whole[1:]) is None  # a plain parameter
    assert rule(gru, (x,), {}, [_specs([S0], *whole[0].shape)] + whole[1:]) is None  # a split one
    gru.dropout = 0.5
    assert rule(gru, (x,), {}, whole) is None  # dropout between layers draws per rank
    lstm = torch.nn.LSTM(3, 6, batch_first=True)
    assert rule(lstm, (x,), {}, [_specs([R], *p.shape) for p in lstm.parameters()]) is None  # its fused op has a rule


# -- coverage ----------------------------------------------------------------------------------
VISION_AUDIO_RECURRENT_OPS = [
    # convolution, normalization
    "convolution", "convolution_backward", "native_batch_norm", "native_batch_norm_backward",
    "_native_batch_norm_legit", "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional",
    "_batch_norm_with_update", "_batch_norm_with_update_functional", "_batch_norm_no_update", "batch_norm_backward",
    "cudnn_batch_norm", "cudnn_batch_norm_backward", "miopen_batch_norm", "miopen_batch_norm_backward",
    "native_group_norm", "native_group_norm_backward", "native_layer_norm", "native_layer_norm_backward",
    # pooling
    "max_pool2d_with_indices", "max_pool2d_with_indices_backward", "max_pool3d_with_indices",
    "max_pool3d_with_indices_backward", "avg_pool2d", "avg_pool2d_backward", "avg_pool3d", "avg_pool3d_backward",
    "_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward", "_adaptive_avg_pool3d", "_adaptive_avg_pool3d_backward",
    "adaptive_max_pool2d", "adaptive_max_pool2d_backward", "adaptive_max_pool3d", "adaptive_max_pool3d_backward",
    "max_unpool2d", "max_unpool3d",
    # resampling
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d", "upsample_bilinear2d",
    "upsample_bicubic2d", "upsample_trilinear3d", "_upsample_nearest_exact2d", "_upsample_bilinear2d_aa",
    "upsample_nearest2d_backward", "upsample_bilinear2d_backward", "pixel_shuffle", "pixel_unshuffle", "im2col",
    "col2im", "reflection_pad1d", "reflection_pad2d", "replication_pad2d", "constant_pad_nd", "channel_shuffle",
    "grid_sampler_2d", "grid_sampler_2d_backward", "grid_sampler_3d", "grid_sampler_3d_backward",
    # spectra (audio front ends)
    "_fft_r2c", "_fft_c2r", "_fft_c2c", "view_as_real", "view_as_complex",
    # recurrent
    "mkldnn_rnn_layer", "mkldnn_rnn_layer_backward", "_cudnn_rnn", "_cudnn_rnn_backward", "_thnn_fused_lstm_cell",
    "_thnn_fused_lstm_cell_backward_impl", "_thnn_fused_gru_cell", "_thnn_fused_gru_cell_backward", "unsafe_split",
]


def test_ops_of_vision_audio_and_recurrent_models_have_rules():
    """What torchvision-style, audio and recurrent models reach on CPU and GPU (see
    benchmarks/coverage_dtensor.py for the list against DTensor's)."""
    missing = [name for name in VISION_AUDIO_RECURRENT_OPS
               if not any(rule_for(getattr(getattr(aten, name), o)) for o in getattr(aten, name).overloads())]
    assert missing == []
