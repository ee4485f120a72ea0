"""Convolutional and recurrent models data parallel on 2 gloo ranks against the single process:
a ResNet (torchvision's layout), a U-Net block, GRU/LSTM/RNN classifiers; and the ops they
reach (convolutions, batch/group/instance norm, pooling, resampling, recurrent layers), values
and gradients, with the communication each costs."""
import warnings
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import autopar as dist
from autopar import Replicate, Shard
from autopar.tensor import riders
from distpool import run_dist
from opcheck import check
from vision_models import ResNet, SequenceClassifier, UNetBlock

R, S0, S1, S2 = Replicate(), Shard(0), Shard(1), Shard(2)
MESH = [0, 1]


def _ops(log):
    return [(r.op, tuple(r.shape)) for r in log]


# -- ops ---------------------------------------------------------------------------------------
def _conv_ops():
    torch.manual_seed(0)
    x, x1, x3 = torch.randn(5, 4, 6, 6), torch.randn(3, 4, 9), torch.randn(2, 4, 4, 5, 5)
    w, b, wt = torch.randn(6, 4, 3, 3), torch.randn(6), torch.randn(4, 6, 3, 3)
    cases = [  # (function, inputs, placements, collectives the forward may run)
        (lambda x, w, b: F.conv2d(x, w, b, padding=1), [x, w, b], [S0, R, R]),  # data parallel
        (lambda x, w, b: F.conv2d(x, w, b, padding=1), [x, w, b], [R, S0, S0]),  # output channels: column
        (lambda x, w, b: F.conv2d(x, w, b, padding=1), [x, w, b], [S1, S1, R]),  # input channels: row, Partial
        (lambda x, w, b: F.conv2d(x, w, b, stride=2, dilation=2), [x, w, b], [S0, R, R]),
        (lambda x, w: F.conv2d(x, w[:, :1], groups=4, padding=1), [x, w[:4]], [S1, S0]),  # depthwise
        (lambda x, w: F.conv2d(x, w[:4, :1].repeat(2, 1, 1, 1), groups=4), [x, w[:4]], [S0, R]),
        (lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, padding=1, output_padding=1), [x, wt, b], [S0, R, R]),
        (lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2), [x, wt, b], [R, S1, S0]),
        (lambda x, w, b: F.conv_transpose2d(x, w, b), [x, wt, b], [S1, S0, R]),
        (lambda x, w: F.conv1d(x, w[:, :, 1]), [x1, w], [S0, R]),
        (lambda x, w: F.conv3d(x, w[..., None].expand(6, 4, 3, 3, 3).contiguous(), padding=1), [x3, w], [S0, R]),
        (lambda x, w: F.conv2d(x, w[:, :, :1, :1]), [x, w], [S2, R]),  # 1x1: a row split stays local
    ]
    found = []
    for fn, inputs, placements in cases:
        _, log = check(fn, inputs, [[p] for p in placements], MESH)
        found.append(_ops(log))
    return found


def test_convolutions_match_and_keep_their_splits():
    """Batch split: no communication; weight Shard(0)/Shard(1): the column/row patterns, no
    gather (the row pattern's Partial output is reduced only when read)."""
    for found in run_dist(_conv_ops, 2):
        assert all(ops == [] for ops in found), found


def _norm_ops():
    torch.manual_seed(0)
    x = torch.randn(6, 4, 5, 5) * 3 + 2
    g, b = torch.randn(4), torch.randn(4)
    found = {}
    for name, placements in (("batch", [S0, R, R]), ("channels", [S1, S0, S0]), ("rows", [S2, R, R])):
        mean, var = torch.randn(4), torch.rand(4) + 0.5
        stats = [dist.shard_tensor(t.clone(), dist.ProcessMesh(MESH), [placements[1]]) for t in (mean, var)]

        def bn(x, g, b):
            rm, rv = (stats if dist.is_dist_tensor(x) else (mean, var))
            return F.batch_norm(x, rm, rv, g, b, training=True, momentum=0.3)

        _, log = check(bn, [x, g, b], [[p] for p in placements], MESH)
        for got, want in zip(stats, (mean, var)):  # updated identically on every rank
            torch.testing.assert_close(dist.unshard_dtensor(got), want, rtol=1e-5, atol=1e-6)
        found[name] = _ops(log)
    mean, var = torch.randn(4), torch.rand(4) + 0.5
    _, log = check(lambda x, g, b: F.batch_norm(x, mean, var, g, b, training=False), [x, g, b], [[S0], [R], [R]], MESH)
    found["eval"] = _ops(log)
    _, log = check(lambda x: F.batch_norm(x.flatten(2), None, None, training=True), [x], [[S0]], MESH)
    found["1d"] = _ops(log)
    _, log = check(lambda x, g, b: F.group_norm(x, 2, g, b), [x, g, b], [[S0], [R], [R]], MESH)
    found["group"] = _ops(log)
    _, log = check(lambda x, g, b: F.group_norm(x, 2, g, b), [x, g, b], [[S1], [S0], [S0]], MESH)
    found["group_channels"] = _ops(log)
    _, log = check(lambda x, g, b: F.instance_norm(x, weight=g, bias=b), [x, g, b], [[S0], [R], [R]], MESH)
    found["instance"] = _ops(log)
    _, log = check(lambda x, g, b: F.layer_norm(x, (5, 5), g[:1].expand(5, 5), b[:1].expand(5, 5)),
                   [x, g, b], [[S0], [R], [R]], MESH)
    found["layer"] = _ops(log)
    return found


def test_batch_norm_uses_the_global_batch_and_other_norms_stay_local():
    """Training BatchNorm over a split batch (or split rows): one all-reduce of (sum, squared
    deviations) per channel, 2 x C values; running statistics as one process updates them.
    Split channels, eval mode, group/instance/layer norm over a split batch: nothing moves."""
    for found in run_dist(_norm_ops, 2):
        assert found["batch"] == [("all_reduce", (2, 4))]
        assert found["rows"] == [("all_reduce", (2, 4))]
        assert found["1d"] == [("all_reduce", (2, 4))]
        for name in ("channels", "eval", "group", "group_channels", "instance", "layer"):
            assert found[name] == [], (name, found[name])


def _batch_norm_over_an_empty_piece():
    """Three rows over four ranks: the last rank holds none (its sums are zeros; torch's own
    kernels divide by a piece's count)."""
    torch.manual_seed(0)
    x, g, b = torch.randn(3, 4) * 2 + 1, torch.randn(4), torch.randn(4)
    _, log = check(lambda x, g, b: F.batch_norm(x, None, None, g, b, training=True), [x, g, b],
                   [[S0], [R], [R]], [0, 1, 2, 3])
    return _ops(log)


def test_batch_norm_over_an_empty_piece():
    for ops in run_dist(_batch_norm_over_an_empty_piece, 4):
        assert ops == [("all_reduce", (2, 4))]


def _batch_norm_backward_log():
    """The input needs no gradient (BatchNorm on the data): only the weight's and bias's."""
    mesh = dist.ProcessMesh(MESH)
    torch.manual_seed(0)
    x, dy = torch.randn(6, 4, 3, 3) * 2 + 1, torch.randn(6, 4, 3, 3)
    ref = torch.nn.BatchNorm2d(4)
    bn = dist.shard_layer(torch.nn.BatchNorm2d(4), mesh)
    ref(x).backward(dy)
    y, dy_split = bn(dist.shard_tensor(x, mesh, [S0])), dist.shard_tensor(dy, mesh, [S0])
    with dist.comm_log() as log:
        y.backward(dy_split)
    for p, want in ((bn.weight, ref.weight), (bn.bias, ref.bias)):
        torch.testing.assert_close(dist.unshard_dtensor(p.grad), want.grad, rtol=1e-5, atol=1e-5)
    return _ops(log), bn.weight.grad.placements, type(bn.forward).__name__, list(bn.forward.regions.values())


def test_batch_norm_backward_reduces_once_and_is_no_local_region():
    for ops, grad_placements, forward, regions in run_dist(_batch_norm_backward_log, 2):
        assert ops == [("all_reduce", (2, 4))]  # (sum dy, sum dy * xhat) together
        assert grad_placements == [R]  # already the global sums: nothing left to reduce
        assert forward == "RegionForward" and regions == [None]  # it communicates: never a local region


def _plain_running_statistics():
    """A plain InstanceNorm (not shard_layer'd) over a split batch: instance_norm repeats its
    running statistics into a plain tensor that batch norm writes; the engine must not cut it."""
    torch.manual_seed(0)
    x = torch.randn(4, 3, 5, 5) * 2 + 1
    ref, norm = (torch.nn.InstanceNorm2d(3, affine=True, track_running_stats=True) for _ in range(2))
    want = ref(x)
    got = norm(dist.shard_tensor(x, dist.ProcessMesh(MESH), [S0]))
    torch.testing.assert_close(dist.unshard_dtensor(got), want)
    return norm.running_mean, norm.running_var, ref.running_mean, ref.running_var


def test_a_plain_tensor_an_op_writes_stays_whole():
    for mean, var, ref_mean, ref_var in run_dist(_plain_running_statistics, 2):
        torch.testing.assert_close(mean, ref_mean)
        torch.testing.assert_close(var, ref_var)


def _pool_and_resample_ops():
    torch.manual_seed(0)
    x, grid = torch.randn(4, 6, 8, 8), torch.rand(4, 5, 3, 2) * 2 - 1
    cases = {
        "max": lambda x: F.max_pool2d(x, 3, 2, 1),
        "max_indices": lambda x: F.max_pool2d(x, 2, return_indices=True)[0],
        "max1d": lambda x: F.max_pool1d(x.flatten(2), 4),
        "avg": lambda x: F.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
        "avg3d": lambda x: F.avg_pool3d(x[:, None], 2),
        "adaptive_avg": lambda x: F.adaptive_avg_pool2d(x, (3, 5)),
        "adaptive_max": lambda x: F.adaptive_max_pool2d(x, 3),
        "nearest": lambda x: F.interpolate(x, scale_factor=2),
        "nearest_exact": lambda x: F.interpolate(x, size=(12, 12), mode="nearest-exact"),
        "bilinear": lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"),
        "bilinear_corners": lambda x: F.interpolate(x, size=(11, 13), mode="bilinear", align_corners=True),
        "bicubic": lambda x: F.interpolate(x, scale_factor=1.5, mode="bicubic"),
        "antialias": lambda x: F.interpolate(x, size=(5, 5), mode="bilinear", antialias=True),
        "linear": lambda x: F.interpolate(x.flatten(2), scale_factor=2, mode="linear"),
        "trilinear": lambda x: F.interpolate(x[:, None], scale_factor=2, mode="trilinear"),
        "pixel_shuffle": lambda x: F.pixel_shuffle(x[:, :4], 2),
        "pixel_unshuffle": lambda x: F.pixel_unshuffle(x, 2),
        "unfold": lambda x: F.unfold(x, 3, padding=1),
        "fold": lambda x: F.fold(F.unfold(x, 3, padding=1, stride=2), (8, 8), 3, padding=1, stride=2),
        "reflect": lambda x: F.pad(x, (1, 2, 2, 1), mode="reflect"),
        "replicate": lambda x: F.pad(x, (1, 2, 2, 1), mode="replicate"),
        "constant": lambda x: F.pad(x, (1, 2, 2, 1), value=0.5),
        "channel_shuffle": lambda x: F.channel_shuffle(x, 3),
        "grid_sample": lambda x: F.grid_sample(x, grid, align_corners=False),
        "spectrum": lambda x: torch.fft.rfft(x, dim=-1).abs(),
        "spectrum_2d": lambda x: torch.fft.irfft2(torch.fft.fft2(x)[..., :5]),
    }
    found = {}
    for name, fn in cases.items():
        _, log = check(fn, [x], [[S0]], MESH)
        found[name] = _ops(log)
    # splits of a row or channel dim that stay local: whole windows, blocks or groups per piece
    local = {
        "avg_tiles_rows": (lambda x: F.avg_pool2d(x, 2), S2),
        "adaptive_tiles_rows": (lambda x: F.adaptive_avg_pool2d(x, (4, 2)), S2),
        "nearest_rows": (lambda x: F.interpolate(x, scale_factor=2), S2),
        "pixel_shuffle_rows": (lambda x: F.pixel_shuffle(x[:, :4], 2), S2),
        "pixel_unshuffle_rows": (lambda x: F.pixel_unshuffle(x, 2), S2),
        "pixel_unshuffle_channels": (lambda x: F.pixel_unshuffle(x, 2), S1),
        "unfold_channels": (lambda x: F.unfold(x, 3), S1),
        "max_channels": (lambda x: F.max_pool2d(x, 3, 2, 1), S1),
        "bilinear_channels": (lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), S1),
        "spectrum_channels": (lambda x: torch.fft.rfft(x, dim=-1).abs(), S1),
    }
    for name, (fn, p) in local.items():
        _, log = check(fn, [x], [[p]], MESH)
        found[name] = _ops(log)
    return found


def test_pooling_and_resampling_keep_a_split_batch_local():
    for found in run_dist(_pool_and_resample_ops, 2):
        moved = {name: ops for name, ops in found.items() if ops}
        assert moved == {}, moved


class _RowsCNN(torch.nn.Module):
    """conv - pool - conv - upsample - 1x1 conv: every op a halo's (or local) on split rows."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 3, padding=1)
        self.head = torch.nn.Conv2d(8, 2, 1)

    def forward(self, x):
        y = F.max_pool2d(torch.relu(self.conv1(x)), 2)
        y = F.interpolate(torch.relu(self.conv2(y)), scale_factor=2, mode="bilinear")
        return self.head(y)


def _train_split_rows(static: bool = False):
    """Three SGD steps (momentum) on images split by rows (Shard(2); 14 rows: uneven pieces on 4
    ranks, 7 after pooling), the parameters replicated; the target split alike."""
    torch.manual_seed(0)
    model = _RowsCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mesh = dist.ProcessMesh(list(range(dist.get_world_size())), dim_names=["rows"])
    model, opt = dist.shard_layer(model, mesh), dist.shard_optimizer(opt)
    step = dist.to_static(model, None, F.mse_loss, opt) if static else None
    g = torch.Generator().manual_seed(1)
    losses, ops = [], set()
    for _ in range(3):
        x, y = torch.randn(2, 3, 14, 10, generator=g), torch.randn(2, 2, 14, 10, generator=g)
        x, y = dist.shard_tensor(x, mesh, [S2]), dist.shard_tensor(y, mesh, [S2])
        with dist.comm_log() as log:
            if static:
                loss = step(x, y)
            else:
                loss = F.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
        ops |= {r.op for r in log}
        losses.append(float(loss))
    state = {k: dist.unshard_dtensor(v).detach() for k, v in model.state_dict().items()}
    return losses, state, ops


def _train_rows_one_process():
    torch.manual_seed(0)
    model = _RowsCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x, y = torch.randn(2, 3, 14, 10, generator=g), torch.randn(2, 2, 14, 10, generator=g)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.mark.parametrize("world", [2, 4])
def test_a_cnn_trained_on_split_rows_equals_one_process(world):
    """Spatial parallelism: each rank holds its rows of every activation; the convolutions,
    the pooling and the upsampling exchange halo rows point to point, and only the gradients
    (and the loss) are all-reduced; nothing is gathered.  Dynamic and captured alike."""
    ref_losses, ref_state = _train_rows_one_process()
    for static in (False, True):
        for losses, state, ops in run_dist(_train_split_rows, world, static):
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
            for k, v in state.items():
                torch.testing.assert_close(v, ref_state[k], rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
            assert ops == {"send", "recv", "all_reduce"}, (static, ops)


def _recurrent_ops():
    torch.manual_seed(0)
    x = torch.randn(4, 5, 3)
    found = {}
    for cell in ("GRU", "LSTM", "RNN"):
        for batch_first in (True, False):
            torch.manual_seed(1)
            layer = getattr(torch.nn, cell)(3, 6, num_layers=2, batch_first=batch_first, bidirectional=True)
            names = [n for n, _ in layer.named_parameters()]
            weights = [p.detach().clone() for p in layer.parameters()]

            def run(x, *ws):
                return torch.func.functional_call(layer, dict(zip(names, ws)), (x,))

            xp = x if batch_first else x.transpose(0, 1).contiguous()
            _, log = check(run, [xp] + weights, [[S0 if batch_first else S1]] + [[R]] * len(weights), MESH)
            found[(cell, batch_first)] = _ops(log)
    return found


def test_recurrent_layers_over_a_split_batch():
    """Values and gradients (input and weights) of GRU/LSTM/RNN, batch first or not, 2 layers,
    bidirectional, run op by op (LSTM: its fused op; GRU/RNN: their composite steps)."""
    for found in run_dist(_recurrent_ops, 2):
        assert found[("LSTM", True)] == [] and found[("LSTM", False)] == []


# -- models ------------------------------------------------------------------------------------
def _model(name: str):
    torch.manual_seed(0)
    if name == "resnet":
        return ResNet(width=8, classes=10)
    if name == "unet":
        return UNetBlock(cin=3, width=8, cout=2)
    return SequenceClassifier(cell=name, features=5, hidden=8, classes=3)


def _batches(name: str, steps: int = 3):
    g = torch.Generator().manual_seed(1)
    if name == "resnet":
        return [(torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(steps)]
    if name == "unet":
        return [(torch.randn(4, 3, 8, 8, generator=g), torch.randn(4, 2, 16, 16, generator=g)) for _ in range(steps)]
    return [(torch.randn(4, 6, 5, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(steps)]


def _loss(name: str, out, target):
    return F.mse_loss(out, target) if name == "unet" else F.cross_entropy(out, target)


def _train(name: str, data_parallel: bool):
    """Three SGD steps (momentum); data parallel: shard_layer + batch Shard(0) + shard_optimizer."""
    model = _model(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mesh = dist.ProcessMesh(MESH, dim_names=["dp"])
    if data_parallel:
        model = dist.shard_layer(model, mesh)
        opt = dist.shard_optimizer(opt)
    losses, logs = [], []
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="autopar: no sharding rule")
        for x, y in _batches(name):
            if data_parallel:
                x, y = dist.shard_tensor(x, mesh, [S0]), dist.shard_tensor(y, mesh, [S0])
            with dist.comm_log() as log:
                loss = _loss(name, model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
            logs.append(_ops(log))
    state = {k: (dist.unshard_dtensor(v) if dist.is_dist_tensor(v) else v).detach() for k, v in model.state_dict().items()}
    return losses, state, logs


def _reduced_elements(model) -> int:
    """Gradient elements the data-parallel step all-reduces: every parameter's but BatchNorm's
    (those come out of its backward whole)."""
    bn = {id(p) for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
          for p in m.parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in bn)


@pytest.mark.parametrize("name", ["resnet", "unet", "GRU", "LSTM"])
def test_model_data_parallel_equals_one_process(name):
    """Losses of every step and the final weights and running statistics equal the single
    process's; nothing is gathered: per step the only collectives are BatchNorm's statistics
    (one all-reduce of 2 x C values per layer, forward and backward), the loss's (sum, count),
    the gradients' bucketed all-reduce (each element once) and 1-element verdicts of the
    local-region verification."""
    ref_losses, ref_state, _ = _train(name, False)
    model = _model(name)
    bn_channels = Counter((2, m.num_features) for m in model.modules()
                          if isinstance(m, torch.nn.modules.batchnorm._BatchNorm))
    for losses, state, logs in run_dist(_train, 2, name, True):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        assert state.keys() == ref_state.keys()
        for k, v in state.items():
            torch.testing.assert_close(v, ref_state[k], rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
        for step, ops in enumerate(logs):
            assert {op for op, _ in ops} == {"all_reduce"}, (step, ops)
            shapes = Counter(shape for _, shape in ops)
            for shape, n in bn_channels.items():
                assert shapes.pop(shape) == 2 * n, (step, shape, ops)
            gradients = sum(s[0] for s in shapes if len(s) == 1 and s[0] > 2)
            # (the bucket may carry the mean loss's (sum, count): `deferred_mean`)
            assert gradients - _reduced_elements(model) in (0, riders.PIECES + 1), (step, ops)
            assert set(shapes) <= {(1,), (2,), ()} | {s for s in shapes if len(s) == 1 and s[0] > 2}, (step, ops)


def _resnet_static_and_dynamic():
    mesh = dist.ProcessMesh(MESH, dim_names=["dp"])
    results = []
    for static in (False, True):
        model = dist.shard_layer(_model("resnet"), mesh)
        opt = dist.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        step = dist.to_static(model, None, F.cross_entropy, opt) if static else None
        losses = []
        for x, y in _batches("resnet"):
            x, y = dist.shard_tensor(x, mesh, [S0]), dist.shard_tensor(y, mesh, [S0])
            if static:
                losses.append(float(step(x, y)))
            else:
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        results.append((losses, dist.unshard_dtensor(model.layer2[0].bn2.running_var)))
    return results


def test_resnet_captured_by_to_static_gives_the_dynamic_numbers():
    """The BatchNorm kernels (their all-reduces, the running statistics' updates) replay."""
    for (dyn_losses, dyn_var), (st_losses, st_var) in run_dist(_resnet_static_and_dynamic, 2):
        assert st_losses == dyn_losses
        assert torch.equal(st_var, dyn_var)
