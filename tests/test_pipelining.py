"""Pipeline schedules (autopar.pipelining) against the single-process whole-batch step."""
import weakref

import pytest
import torch
import torch.nn.functional as F

import autopar as dist
from autopar.pipelining import PipelineStage, Schedule1F1B, ScheduleFThenB, ScheduleVPP, ScheduleZBH1, ScheduleZBVPP
from autopar.pipelining.orders import zbvpp
from distpool import run_dist

D, ROWS, M = 8, 16, 8
SCHEDULES = {"FThenB": ScheduleFThenB, "1F1B": Schedule1F1B, "ZBH1": ScheduleZBH1}


def _model(blocks=8):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Tanh()) for _ in range(blocks)])


def _batch(step=0, rows=ROWS):
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(rows, D, generator=g), torch.randn(rows, D, generator=g)


def _reference(steps=2, lr=0.1):
    """The whole batch on one process: per step the loss, the micro-batch losses and the gradients."""
    model = _model()
    out = []
    for step in range(steps):
        x, y = _batch(step)
        model.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        with torch.no_grad():
            parts = [F.mse_loss(model(a), b) for a, b in zip(x.chunk(M), y.chunk(M))]
        out.append((loss.detach(), torch.stack(parts), {n: p.grad.clone() for n, p in model.named_parameters()}))
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return out


def _names(model, modules):
    """{full-model name: parameter} of the parameters `modules` hold."""
    held = {id(p) for m in modules for p in m.parameters()}
    return {n: p for n, p in model.named_parameters() if id(p) in held}


class Tracked(torch.nn.Module):
    """Runs `inner` while counting whose activations (saved tensors) are alive: `peak` is the most
    micro-batches holding activations when one is saved."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls, self.peak, self.live = inner, 0, 0, {}

    def forward(self, x):
        mb, self.calls = self.calls, self.calls + 1

        def pack(t):
            box = _Box(t.detach())  # (holding `t` itself would tie a saved output to its own graph)
            key = id(box)
            self.live[key] = mb
            weakref.finalize(box, self.live.pop, key, None)
            self.peak = max(self.peak, len(set(self.live.values())))
            return box

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t):
            return self.inner(x)


class _Box:
    def __init__(self, t):
        self.t = t


def _run(kind, steps=2, lr=0.1):
    """Every rank: its stage(s) of the 8-block model, `steps` SGD steps of M micro-batches."""
    model = _model()
    rank = dist.get_rank()
    virtual = {"VPP": ScheduleVPP, "ZBVPP": ScheduleZBVPP}.get(kind)
    n = 8 if virtual else 4
    per = len(model) // n
    mine = [k for k in range(n) if k % 4 == rank]
    modules = {k: Tracked(model[k * per:(k + 1) * per]) for k in mine}
    stages = [PipelineStage(modules[k], k, n) for k in mine]
    schedule = virtual(stages, M, F.mse_loss) if virtual else SCHEDULES[kind](stages[0], M, F.mse_loss)
    params = _names(model, modules.values())
    out = []
    for step in range(steps):
        x, y = _batch(step)
        losses = []
        with dist.comm_log() as log:
            schedule.step(x, target=y, losses=losses)
        out.append({"losses": losses, "grads": {n: p.grad.clone() for n, p in params.items()},
                    "comm": [(r.op, r.bytes, r.recv_bytes) for r in log]})
        with torch.no_grad():
            for p in params.values():
                p -= lr * p.grad
                p.grad = None
    peaks = {k: modules[k].peak for k in mine}
    return out, peaks, schedule.format_order(), schedule.format_times()


@pytest.mark.parametrize("kind", ["FThenB", "1F1B", "VPP", "ZBH1", "ZBVPP"])
def test_schedule_equals_the_whole_batch_step(kind):
    ref = _reference()
    results = run_dist(_run, 4, kind)
    for rank, (steps, peaks, order, times) in enumerate(results):
        for step, (got, (loss, parts, grads)) in enumerate(zip(steps, ref)):
            if rank == 3:  # the last stage (stages 3 and 7 with VPP)
                torch.testing.assert_close(torch.stack(got["losses"]), parts, rtol=1e-5, atol=0)
                torch.testing.assert_close(torch.stack(got["losses"]).mean(), loss, rtol=1e-5, atol=0)
            else:
                assert got["losses"] == []
            assert got["grads"], rank
            for name, g in got["grads"].items():
                torch.testing.assert_close(g, grads[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
        # each stage edge carries one message per micro-batch; the shapes go once, before step 1
        for step, got in enumerate(steps):
            sends = [b for op, b, _ in got["comm"] if op == "send"]
            metas = [b for b in sends if b == 8192]
            edges = (1 if rank in (0, 3) else 2) if "VPP" not in kind else (3 if rank in (0, 3) else 4)
            assert len(metas) == (edges if step == 0 else 0), (rank, step, metas)
            assert len(sends) - len(metas) == edges * M
            assert all(b == (ROWS // M) * D * 4 for b in sends if b != 8192)
        assert order.count("rank ") == 4 and "bubble" in times
    peaks = {k: p for _, pk, _, _ in results for k, p in pk.items()}
    if kind == "1F1B":
        assert peaks == {0: 4, 1: 3, 2: 2, 3: 1}  # at most num_stages - stage_index micro-batches
    elif kind == "FThenB":
        assert peaks == {0: M, 1: M, 2: M, 3: M}
    elif kind == "ZBH1":
        assert max(peaks.values()) <= 4
    elif kind == "ZBVPP":  # a stage frees a micro-batch's activations at its W: as the order holds them
        held = {}
        for row in zbvpp(4, 2, M):
            for stage in {a.stage for a in row}:
                live, held[stage] = 0, 0
                for a in row:
                    if a.stage == stage:
                        live += {"F": 1, "W": -1}.get(a.kind, 0)
                        held[stage] = max(held[stage], live)
        assert peaks == held


# -- tied weights: the first and the last stage share one matrix ------------------------------
class Tied(torch.nn.Module):
    """x @ W.T, four tanh layers, then @ W again (W tied between the first and the last stage)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(D, D) * 0.3)
        self.body = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Tanh()) for _ in range(2)])

    def stages(self):
        first = _Apply(self.w, transpose=True)
        last = _Apply(torch.nn.Parameter(self.w.detach().clone()), transpose=False)
        return [first, self.body[0], self.body[1], last]

    def forward(self, x):
        return self.body(x @ self.w.t()) @ self.w


class _Apply(torch.nn.Module):
    def __init__(self, w, transpose):
        super().__init__()
        self.w, self.transpose = w, transpose

    def forward(self, x):
        return x @ (self.w.t() if self.transpose else self.w)


def _tied(lr=0.1):
    model = Tied()
    stages = model.stages()
    with torch.no_grad():
        stages[3].w.zero_()  # the pipeline starts every copy from the first holder's value
    rank = dist.get_rank()
    tie = [{"params": [stages[0].w, stages[3].w]}]
    stage = PipelineStage(stages[rank], rank, 4, shared_parameters=tie)
    schedule = Schedule1F1B(stage, M, F.mse_loss)
    x, y = _batch(0)
    schedule.step(x, target=y)
    w = stages[rank].w if rank in (0, 3) else None
    grad = None if w is None else w.grad.clone()
    if w is not None:
        with torch.no_grad():
            w -= lr * w.grad
    return grad, None if w is None else w.detach().clone()


def test_tied_weights_between_the_first_and_the_last_stage():
    model = Tied()
    x, y = _batch(0)
    F.mse_loss(model(x), y).backward()
    results = run_dist(_tied, 4)
    for rank in (0, 3):
        grad, after = results[rank]
        torch.testing.assert_close(grad, model.w.grad, rtol=1e-5, atol=1e-7)  # the sum of both uses
        torch.testing.assert_close(after, model.w.detach() - 0.1 * model.w.grad, rtol=1e-5, atol=1e-7)


# -- pipeline x data parallel, pipeline x tensor parallel ----------------------------------------
def _two_stage_cut(model):
    return model[:4], model[4:]


def _pp_dp(steps=2, lr=0.1):
    """mesh pp2 x dp2: stage k on ranks (2k, 2k+1), each replicated over dp; pipelines (0, 2), (1, 3)."""
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["pp", "dp"])
    rank = dist.get_rank()
    k = rank // 2
    stage_mesh = mesh.get_mesh_with_dim("pp", k)
    model = _model()
    module = dist.shard_layer(_two_stage_cut(model)[k], stage_mesh)
    opt = dist.shard_optimizer(torch.optim.SGD(module.parameters(), lr=lr))
    group = dist.ProcessMesh([rank % 2, rank % 2 + 2])
    schedule = Schedule1F1B(PipelineStage(module, k, 2, group=group), 4, F.mse_loss)
    for step in range(steps):
        x, y = _batch(step)
        xs = dist.shard_tensor(x, mesh.get_mesh_with_dim("pp", 0), [dist.Shard(0)])
        ys = dist.shard_tensor(y, mesh.get_mesh_with_dim("pp", 1), [dist.Shard(0)])
        schedule.step(xs, target=ys)
        opt.step()
        opt.zero_grad()
    return {n: dist.reshard(p, stage_mesh, [dist.Replicate()])._local.detach() for n, p in module.named_parameters()}, k


def _pp_mp(steps=2, lr=0.1):
    """mesh pp2 x mp2: stage k on ranks (2k, 2k+1), its linears split over mp (columns, then rows)."""
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["pp", "mp"])
    rank = dist.get_rank()
    k = rank // 2
    stage_mesh = mesh.get_mesh_with_dim("pp", k)
    module = _two_stage_cut(_model())[k]

    def megatron(name, layer, m):
        if isinstance(layer, torch.nn.Linear):
            col = name.startswith(("0.", "2."))
            layer.weight = dist.shard_tensor(layer.weight, m, [dist.Shard(0 if col else 1)])
            layer.bias = dist.shard_tensor(layer.bias, m, [dist.Shard(0) if col else dist.Replicate()])

    dist.shard_layer(module, stage_mesh, megatron)
    opt = dist.shard_optimizer(torch.optim.SGD(module.parameters(), lr=lr))
    group = dist.ProcessMesh([rank % 2, rank % 2 + 2])
    schedule = ScheduleZBH1(PipelineStage(module, k, 2, group=group), 4, F.mse_loss)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        schedule.step(x, target=y, losses=losses)
        opt.step()
        opt.zero_grad()
    params = {n: dist.reshard(p, stage_mesh, [dist.Replicate()])._local.detach() for n, p in module.named_parameters()}
    return params, k, losses


def _reference_params(steps=2, lr=0.1):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        x, y = _batch(step)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return _two_stage_cut(model)


@pytest.mark.parametrize("layout", ["dp", "mp"])
def test_pipeline_with_data_or_tensor_parallel_stages(layout):
    ref = _reference_params()
    results = run_dist(_pp_dp if layout == "dp" else _pp_mp, 4)
    for rank, (params, k, *rest) in enumerate(results):
        want = dict(ref[k].named_parameters())
        assert params.keys() == want.keys()
        for name, p in params.items():
            torch.testing.assert_close(p, want[name].detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    if layout == "mp":
        ref_losses = []
        model = _model()
        for step in range(2):
            x, y = _batch(step)
            with torch.no_grad():
                ref_losses += [F.mse_loss(model(a), b) for a, b in zip(x.chunk(4), y.chunk(4))]
            F.mse_loss(model(x), y).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
        for rank in (2, 3):
            torch.testing.assert_close(torch.stack(results[rank][2]), torch.stack(ref_losses), rtol=1e-5, atol=0)


# -- bad input: the same ValueError on every rank, never a hang ---------------------------------
class Shrinks(torch.nn.Module):
    """Passes x on; after `shrink()` drops its last column (its output shape changes while its
    input shape does not)."""

    def __init__(self):
        super().__init__()
        self.lin, self.cut = torch.nn.Linear(D, D), D

    def forward(self, x):
        return self.lin(x)[:, : self.cut]


def _bad(case):
    rank = dist.get_rank()
    x, y = _batch(0)
    if case == "stage_index":
        with pytest.raises(ValueError, match=r"stage_index 4 is out of range for num_stages 4") as err:
            PipelineStage(torch.nn.Linear(D, D), rank + 1, 4)
        return str(err.value)
    module = Shrinks() if rank == 1 else torch.nn.Sequential(torch.nn.Linear(D, D))
    if case == "shared":
        stray = torch.nn.Parameter(torch.zeros(D))
        with pytest.raises(ValueError, match=r"shared_parameters\[0\]\['params'\]\[1\] \(shape \[8\]\) is held by no"):
            Schedule1F1B(PipelineStage(module, rank, 4, shared_parameters=[{"params": [module.lin.bias if rank == 1 else module[0].bias, stray]}]),
                         M, F.mse_loss)
        return "ok"
    schedule = Schedule1F1B(PipelineStage(module, rank, 4), M, F.mse_loss)
    if case == "microbatches":
        with pytest.raises(ValueError, match="Schedule1F1B needs at least 4 micro-batches for its 4 stages, got"):
            Schedule1F1B(PipelineStage(torch.nn.Linear(D, D), rank, 4), 2, F.mse_loss)
        return "ok"
    if case == "split":
        with pytest.raises(ValueError, match=r"x of shape \[12, 8\] does not split into 8 equal micro-batches"):
            schedule.step(x[:12], target=y[:12])
        return "ok"
    if case == "shape":
        schedule.step(x, target=y)
        if rank == 1:
            module.cut = D - 1
        with pytest.raises(ValueError, match=r"stage 1 \(rank 1\) -> stage 2 \(rank 2\), activations: value 0 is "
                                             r"float32\[2, 7\] where the receiving stage was told float32\[2, 8\]"):
            schedule.step(x, target=y)
        if rank == 1:
            module.cut = D
        schedule.step(x, target=y)  # the pipeline works again
        return "ok"
    if case == "raises":
        if rank == 2:
            module.forward = lambda x: (_ for _ in ()).throw(RuntimeError("no luck"))
        with pytest.raises(RuntimeError, match=r"stage 2 \(rank 2\), F0: RuntimeError: no luck"):
            schedule.step(x, target=y)
        return "ok"


@pytest.mark.parametrize("case", ["stage_index", "shared", "microbatches", "split", "shape", "raises"])
def test_bad_input_fails_on_every_rank(case):
    assert all(r is not None for r in run_dist(_bad, 4, case))


def _resized():
    """Batches of 16, 8, 8 and 16 rows through one schedule: shapes go again only when they change."""
    model = _model()
    rank = dist.get_rank()
    module = model[2 * rank:2 * rank + 2]
    schedule = Schedule1F1B(PipelineStage(module, rank, 4), M, F.mse_loss)
    out = []
    for rows in (16, 8, 8, 16):
        x, y = _batch(rows, rows)
        with dist.comm_log() as log:
            schedule.step(x, target=y)
        metas = sum(1 for r in log if r.op == "send" and r.bytes == 8192)
        out.append((metas, {n: p.grad.clone() for n, p in _names(model, [module]).items()}))
        module.zero_grad()
    return out


def test_shapes_go_again_only_when_the_batch_shape_changes():
    model = _model()
    for rank, steps in enumerate(run_dist(_resized, 4)):
        edges = 1 if rank in (0, 3) else 2
        assert [metas for metas, _ in steps] == [edges, edges, 0, edges]
        for rows, (_, grads) in zip((16, 8, 8, 16), steps):
            x, y = _batch(rows, rows)
            model.zero_grad()
            F.mse_loss(model(x), y).backward()
            for name, g in grads.items():
                torch.testing.assert_close(g, model.get_parameter(name).grad, rtol=1e-5, atol=1e-7)
