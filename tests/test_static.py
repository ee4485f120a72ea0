"""to_static: the captured program gives the dynamic mode's numbers, bit for bit, for every
strategy (data, tensor, hybrid, pipeline across meshes, ZeRO 1/2/3, plain parameters with a
marked input, dropout), and both match the single process."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import autopar as dist
from autopar.placement import Replicate, Shard
from autopar.static.program import Recorder
from distpool import run_dist

R, S0, S1 = Replicate(), Shard(0), Shard(1)
STEPS = 4


class Net(torch.nn.Module):
    """col -> gelu -> row -> layer norm -> dropout -> col: every kind of op the strategies split."""

    def __init__(self, p_drop=0.0):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)
        self.ln, self.head = torch.nn.LayerNorm(8), torch.nn.Linear(8, 6)
        self.p_drop = p_drop

    def forward(self, x):
        h = self.ln(self.fc2(F.gelu(self.fc1(x))))
        return self.head(F.dropout(h, self.p_drop, self.training))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 6, (8,), generator=g)) for _ in range(STEPS)]


def _megatron(name, sub, mesh):
    col, row = [R] * (mesh.ndim - 1) + [S0], [R] * (mesh.ndim - 1) + [S1]
    if name in ("fc1", "head"):
        sub.weight = dist.shard_tensor(sub.weight, mesh, col)
        sub.bias = dist.shard_tensor(sub.bias, mesh, col)
    if name == "fc2":
        sub.weight = dist.shard_tensor(sub.weight, mesh, row)


MESHES = {"dp": [0, 1, 2, 3], "tp": [0, 1], "dp_tp": [[0, 1], [2, 3]]}


def _setup(strategy, p_drop):
    torch.manual_seed(0)
    model = Net(p_drop)
    if strategy == "single":
        return model, torch.optim.AdamW(model.parameters(), lr=0.01), None
    if strategy == "plain_params":  # only the input is marked: data parallel through plain parameters
        return model, torch.optim.AdamW(model.parameters(), lr=0.01), dist.ProcessMesh([0, 1, 2, 3])
    mesh = dist.ProcessMesh(MESHES.get(strategy, [0, 1, 2, 3]))
    dist.shard_layer(model, mesh, _megatron if strategy in ("tp", "dp_tp") else None)
    stage = {"zero1": dist.ShardingStage1, "zero2": dist.ShardingStage2, "zero3": dist.ShardingStage3}.get(strategy)
    opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01), stage(0) if stage else None)
    return model, opt, mesh


def _loss(logits, y):
    return F.cross_entropy(logits, y)


def run_steps(model, opt, step, place, autocast=False):
    """Train on `_batches()` placed by `place`: through the DistModel `step`, else dynamically
    (under bfloat16 autocast when asked).  Returns the losses and the global parameters."""
    losses = []
    for x, y in _batches():
        x, y = place(x), place(y)
        if step is not None:
            losses.append(float(step(x, y)))
            continue
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}


def _train(strategy, static, p_drop=0.0):
    model, opt, mesh = _setup(strategy, p_drop)
    torch.manual_seed(5)  # the dropout stream
    step = dist.to_static(model, None, _loss, opt) if static else None
    placements = [S0] + [R] * (mesh.ndim - 1) if mesh is not None else None
    losses, params = run_steps(model, opt, step, lambda t: t if mesh is None else dist.shard_tensor(t, mesh, placements))
    if static:
        assert len(step._programs) == 1  # captured once, replayed for every later step
    return losses, params, step.dist_main_program() if static else None


def _both(strategy, p_drop=0.0):
    return _train(strategy, False, p_drop), _train(strategy, True, p_drop)


@pytest.mark.parametrize("strategy", ["dp", "tp", "dp_tp", "zero1", "zero2", "zero3", "plain_params"])
def test_static_equals_dynamic_equals_single_process(strategy):
    ref_losses, ref_params, _ = _train("single", False)
    world = 2 if strategy == "tp" else 4
    for (dyn_losses, dyn_params, _), (st_losses, st_params, program) in run_dist(_both, world, strategy):
        assert st_losses == dyn_losses  # the same local ops in the same order: bit for bit
        for k in dyn_params:
            if strategy == "dp":  # the dynamic step's gradient bucket carries the mean loss's (sum, count)
                # too (`deferred_mean`; the captured step reduces them in its forward): gloo sums the
                # 4 ranks' elements of the longer buffer in another order, a last-bit difference
                torch.testing.assert_close(st_params[k], dyn_params[k], rtol=1e-6, atol=1e-8)
            else:
                assert torch.equal(st_params[k], dyn_params[k]), k
        np.testing.assert_allclose(st_losses, ref_losses, rtol=1e-5)
        for k, v in ref_params.items():
            torch.testing.assert_close(st_params[k], v, rtol=1e-5, atol=1e-5)
        assert "aten.addmm" in program or "aten.mm" in program


def _dropout():
    return _both("dp_tp", p_drop=0.3)


def test_static_replays_random_ops_with_fresh_draws():
    for (dyn_losses, _, _), (st_losses, _, _) in run_dist(_dropout, 4):
        assert st_losses == dyn_losses
        assert len(set(st_losses)) == len(st_losses)


class Stages(torch.nn.Module):
    """The guide's pipeline (§4.3): w0 on mesh0, w1 on mesh1, the activation sent between them."""

    def __init__(self, mesh0, mesh1):
        super().__init__()
        torch.manual_seed(0)
        self.mesh1 = mesh1
        self.w0 = dist.shard_tensor(torch.nn.Parameter(torch.randn(16, 32) * 0.25), mesh0, [R])
        self.w1 = dist.shard_tensor(torch.nn.Parameter(torch.randn(32, 8) * 0.2), mesh1, [R])

    def forward(self, x):
        return torch.matmul(dist.reshard(torch.matmul(x, self.w0), self.mesh1, [R]), self.w1)


def _pipeline(static):
    mesh0, mesh1 = dist.ProcessMesh([0, 1]), dist.ProcessMesh([2, 3])
    model = Stages(mesh0, mesh1)
    opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    step = dist.to_static(model, None, torch.mean, opt)
    losses = []
    for x, _ in _batches():
        if static:
            losses.append(float(step(x)))
        else:
            loss = torch.mean(model(x))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, step.dist_main_program() if static else ""


def _pipeline_both():
    return _pipeline(False), _pipeline(True)


def test_static_pipeline_sends_between_meshes():
    for rank, ((dyn, _), (st, program)) in enumerate(run_dist(_pipeline_both, 4)):
        assert st == dyn
        assert "send/recv" in program  # every rank takes part in the stage-to-stage transfer


def _modes():
    mesh = dist.ProcessMesh([0, 1])
    model, opt, _ = _setup("single", 0.0)
    dist.shard_layer(model, mesh, _megatron)
    opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    dm = dist.to_static(model, None, _loss, opt)
    x, y = _batches()[0]
    xd, yd = dist.shard_tensor(x, mesh, [S0]), dist.shard_tensor(y, mesh, [S0])
    out = {}
    dm.eval()
    out["eval"] = [float(dm(xd, yd)) for _ in range(2)]  # captured, replayed: no training
    dm.predict()
    logits = [dm(xd) for _ in range(2)]
    out["predict"] = [dist.unshard_dtensor(t) for t in logits]
    out["predict_placements"] = logits[1].placements
    dm.train()
    out["train"] = [float(dm(xd, yd)) for _ in range(2)]
    x2, y2 = torch.randn(4, 16), torch.randint(0, 6, (4,))  # a new batch shape: captured anew
    out["new_shape"] = float(dm(dist.shard_tensor(x2, mesh, [S0]), dist.shard_tensor(y2, mesh, [S0])))
    out["programs"] = len(dm._programs)
    with torch.no_grad():
        model.eval()
        out["eager_eval"] = float(_loss(model(xd), yd))
    return out


def test_static_eval_predict_and_recapture_on_a_new_signature():
    for out in run_dist(_modes, 2):
        assert out["eval"][0] == out["eval"][1]
        assert torch.equal(out["predict"][0], out["predict"][1])
        assert out["predict_placements"] == [S1]  # head is column parallel: logits stay split
        assert out["train"][1] < out["train"][0]
        assert out["programs"] == 4  # eval, predict, train, train with the new shape
        assert out["eager_eval"] < out["eval"][0]  # the trained model is better, and eval saw it


class DictIn(torch.nn.Module):
    def __init__(self, mesh):
        super().__init__()
        torch.manual_seed(0)
        self.w = dist.shard_tensor(torch.nn.Parameter(torch.randn(4, 3)), mesh, [R])

    def forward(self, batch):
        return batch["x"] @ self.w * batch["scale"]


def _dict_batches():
    """Tensors nested in a dict batch are inputs of the program, not constants."""
    mesh = dist.ProcessMesh([0, 1])
    model = DictIn(mesh)
    dm = dist.to_static(model).predict()
    outs = []
    for i in range(3):
        x = dist.shard_tensor(torch.full((4, 4), float(i + 1)), mesh, [S0])
        outs.append(dist.unshard_dtensor(dm({"x": x, "scale": torch.tensor(2.0)})))
    return outs, dist.unshard_dtensor(model.w.detach())


def _autocast():
    mesh = dist.ProcessMesh([0, 1])
    model = DictIn(mesh)
    dm = dist.to_static(model).predict()
    x = dist.shard_tensor(torch.ones(4, 4), mesh, [S0])
    batch = {"x": x, "scale": torch.tensor(1.0)}
    plain = dm(batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = dm(batch)
    again = dm(batch)
    return plain.dtype, low.dtype, again.dtype, len(dm._programs)


def test_static_captures_a_program_per_autocast_setting():
    for plain, low, again, programs in run_dist(_autocast, 2):
        assert (plain, low, again, programs) == (torch.float32, torch.bfloat16, torch.float32, 2)


def test_static_batches_may_nest_tensors_in_dicts():
    for outs, w in run_dist(_dict_batches, 2):
        for i, out in enumerate(outs):
            torch.testing.assert_close(out, torch.full((4, 4), float(i + 1)) @ w * 2)


def _branch_on_value():
    mesh = dist.ProcessMesh([0, 1])

    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = dist.shard_tensor(torch.nn.Parameter(torch.ones(4, 4)), mesh, [R])

        def forward(self, x):
            h = x @ self.w
            if self.read == "item":
                return h * 2 if h.sum() > 0 else h
            if self.read == "tolist":
                return h * len([v for v in h.sum(1).tolist() if v > 0])
            compare = getattr(torch, self.read)  # torch.equal, torch.allclose: a bool from the values
            return h * 2 if compare(h, x @ self.w) else h

    msgs = []
    for read in ("item", "tolist", "equal", "allclose"):
        model = Branchy()
        model.read = read
        dm = dist.to_static(model, None, torch.mean, torch.optim.SGD(model.parameters(), lr=0.1))
        try:
            dm(dist.shard_tensor(torch.ones(4, 4), mesh, [S0]))
            msgs.append("no error")
        except dist.CaptureError as e:
            msgs.append(str(e))
    return msgs


def test_static_refuses_a_step_that_branches_on_tensor_values():
    for item, tolist, equal, allclose in run_dist(_branch_on_value, 2):
        assert "reads a tensor's value" in item and "_local_scalar_dense" in item
        assert "reads a tensor's value" in tolist and "(tolist)" in tolist
        assert "reads a tensor's value" in equal and "aten.equal" in equal
        assert "reads a tensor's value" in allclose and "aten.allclose" in allclose


def test_a_value_made_from_shapes_alone_is_read_at_capture_and_its_branch_kept():
    """HF's check for packed sequences reads `(diff(arange(seq)) != 1).cumsum(-1)[:, -1] == 0`
    into Python: computed from no input and no random draw, it is the same on every replay of
    the signature, so the capture reads it (recording no read) and keeps the branch; a value
    that depends on an input or a draw, or a fixed tensor an input was written into, is refused."""
    x = torch.randn(4, 4)
    rec = Recorder([x])
    try:
        with rec:
            pos = torch.arange(4).expand(4, 4)
            packed = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
            assert bool((packed[:, -1] == 0).all())
            counted = torch.zeros(4)
            counted.add_(1)
            assert counted.sum().item() == 4.0
            with pytest.raises(dist.CaptureError, match="_local_scalar_dense"):
                (x.sum() > 0).item()
            with pytest.raises(dist.CaptureError, match="_local_scalar_dense"):
                bool(torch.rand(()) > 2)
            written = torch.zeros(4, 4)
            row = written[0]  # a view: the write below reaches it through the shared memory
            written.copy_(x)
            with pytest.raises(dist.CaptureError, match="aten.equal"):
                torch.equal(row, torch.zeros(4))
    finally:
        rec.close()
    reads = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal"}
    assert not reads & {e.fn.name() for e in rec.entries}, [e.fn for e in rec.entries]


def _reading_outside_values(kind, merge=1):
    """Four calls of dp over 4 ranks (`merge` of them a step) with a loss that reads a value
    from outside its inputs, set before each step as `kind` says; the losses, or the call that
    raised, its error and whether the parameters were left as they were."""
    model, opt, mesh = _setup("dp", 0.0)
    count, scale = [torch.tensor(8.0)], [1.0]

    def loss(logits, y):
        return F.cross_entropy(logits, y, reduction="sum") / count[0] * scale[0]

    strategy = dist.Strategy({"gradient_merge": {"enable": True, "k_steps": merge}}) if merge > 1 else None
    step = dist.to_static(model, None, loss, opt, strategy)
    losses = []
    for call, (x, y) in enumerate(_batches()):
        n = call // merge
        if kind == "tensor made anew":
            count[0] = torch.tensor(8.0 + n)
        elif kind == "tensor made anew, same value":
            count[0] = torch.tensor(8.0)
        elif kind == "tensor updated in place":
            count[0].fill_(8.0 + n)
        elif kind == "python number":
            scale[0] = 1.0 / (n + 1)
        before = [p.detach().clone() for p in model.parameters()]
        try:
            losses.append(float(step(dist.shard_tensor(x, mesh, [S0]), dist.shard_tensor(y, mesh, [S0]))))
        except dist.CaptureError as e:
            unchanged = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
            return call, str(e), unchanged
    return losses


def _expected(kind):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    out = []
    for n, (x, y) in enumerate(_batches()):
        loss = F.cross_entropy(model(x), y, reduction="sum") / (8.0 + n if kind == "tensor updated in place" else 8.0)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("kind", ["tensor made anew", "python number"])
def test_a_step_reading_an_outside_value_that_changes_is_refused_at_its_second_step(kind):
    """A loss dividing by a tensor made anew each step (or scaled by a changing Python number)
    would replay the first step's value: the second step is captured again, the two compared,
    and the step refused before the optimizer steps on it, naming the op and the value."""
    for call, msg, unchanged in run_dist(_reading_outside_values, 4, kind):
        assert call == 1 and unchanged
        assert "changed between its first two steps" in msg and "update it in place" in msg
        if kind == "python number":
            assert "aten.mul.Tensor read the Python number 1.0, then 0.5" in msg
        else:
            assert "aten.div.Tensor read a tensor () torch.float32" in msg


@pytest.mark.parametrize("kind", ["tensor made anew, same value", "tensor updated in place"])
def test_a_step_reading_an_outside_tensor_updated_in_place_replays_its_new_values(kind):
    ref = _expected(kind)
    for losses in run_dist(_reading_outside_values, 4, kind):
        np.testing.assert_allclose(losses, ref, rtol=1e-5)


def test_a_merged_step_is_captured_again_until_the_next_optimizer_step():
    """With two micro-batches a step, a count made anew each optimizer step is the same in a
    step's two micro-batches: the first replay that could read it stale is the next step's
    first micro-batch, and that is where it is refused."""
    for call, msg, unchanged in run_dist(_reading_outside_values, 4, "tensor made anew", 2):
        assert call == 2 and unchanged and "aten.div.Tensor" in msg
