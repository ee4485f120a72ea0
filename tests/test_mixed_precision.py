"""Mixed precision for sharded training against one process running the same precision policy.

The reference is one process that runs the micro-batches the ranks see (the batch cut in two
halves): each half's forward and backward in `param_dtype` (inputs cast, outputs cast to
`output_dtype`), the two gradients cast to `reduce_dtype` and averaged in it, then a float32
master step, the parameters cast back.  Every parallel run must give its losses and
parameters to rtol 1e-5 (bitwise in practice); the collectives' bytes say where gathers run
in low precision; each rank holds only its shard of the float32 masters.
"""
import copy
import re

import pytest
import torch

import autopar as dist
import hf_llama
from autopar.placement import Shard
from autopar.runtime import grad_reduce
from distpool import run_dist

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
STEPS, LR = 3, 1e-2


class _Net(torch.nn.Module):
    """Two repeated blocks (ZeRO-3 units) and a head; every weight cut evenly over 2 ranks."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)])
        self.head = torch.nn.Linear(16, 8)

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def _net():
    torch.manual_seed(0)
    return _Net()


def _data(steps=STEPS):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)) for _ in range(steps)]


def _loss(out, y):
    return torch.nn.functional.mse_loss(out, y)


def _net_half(model, batch, half, policy):
    """The net's loss on one half of a batch, as a rank computes it under `policy`."""
    x, y = batch
    return _loss(model(x[half].to(policy.param_dtype)).to(policy.output_dtype or policy.param_dtype), y[half])


def _reference(policy, grad_dtype, steps=STEPS, scale=None, inf_at=None, autocast=None, optimizer=torch.optim.AdamW,
               make=_net, data=_data, half_loss=_net_half):
    """One process, the same policy: (losses, float32 master weights, low-precision weights,
    loss scales).  The reduced gradients land in `grad_dtype`: float32 under ZeRO-3 (sharded
    float32 parameters), the parameters' low precision under O2 (torch keeps .grad in its
    parameter's dtype); with a loss `scale` (GradScaler's init_scale, growth every 2 steps)
    they are unscaled there, a step whose gradients hold an inf is skipped and halves the
    scale.  `inf_at`: the step whose first gradient element is made inf; `autocast`: the
    dtype each half's forward autocasts to (Paddle's O1); `make`, `data(steps)` and
    `half_loss(model, batch, half, policy)`: the model, its batches and one half's loss."""
    master = make()
    opt = optimizer(master.parameters(), lr=LR)
    pd, rd = policy.param_dtype, policy.reduction_dtype
    scaling = scale is not None
    if scaling:
        scale, tracker = torch.full((), float(scale)), torch.zeros((), dtype=torch.int32)
    losses, scales = [], []
    for step, batch in enumerate(data(steps)):
        low = copy.deepcopy(master)
        for p in low.parameters():  # (parameters only, as the policy: buffers such as RoPE's stay as they are)
            p.data = p.data.to(pd)
        grads, terms = [], []
        for half in (slice(0, 4), slice(4, 8)):
            with torch.autocast("cpu", dtype=autocast or BF16, enabled=autocast is not None):
                loss = half_loss(low, batch, half, policy)
            (loss * scale if scaling else loss).backward()
            grads.append([p.grad.to(rd) for p in low.parameters()])
            terms.append(loss.detach().float())
            low.zero_grad()
        landed = [((a + b) / 2).to(grad_dtype) for a, b in zip(*grads)]
        if step == inf_at:
            landed[0].view(-1)[0] = float("inf")
        found = torch.zeros(())
        if scaling:
            torch._amp_foreach_non_finite_check_and_unscale_(landed, found, scale.double().reciprocal().float())
        for p, g in zip(master.parameters(), landed):
            p.grad = g.to(FP32)
        if not found:
            opt.step()
        if scaling:
            scales.append(float(scale))
            torch._amp_update_scale_(scale, tracker, found, 2.0, 0.5, 2)
        opt.zero_grad()
        losses.append(float((terms[0] + terms[1]) / 2))
    weights = {k: v.detach().clone() for k, v in master.state_dict().items()}
    return losses, weights, {k: v.to(pd) for k, v in weights.items()}, scales


def _mesh():
    return dist.ProcessMesh([0, 1], dim_names=["dp"])


def _train(model, opt, mesh, steps=STEPS, scaler=None, inf_at=None, autocast=None, batches=None,
           backward_ends=None):
    """The parallel loop: per step the loss, the collectives of forward + backward + step and
    the loss scale it ran with; `autocast`: the dtype the user's torch.autocast runs in;
    `batches`: other than the first `steps` of `_data`; a list `backward_ends` gets, per
    step, how many of its collectives ran before the optimizer step."""
    losses, logs, scales = [], [], []
    for step, (x, y) in enumerate(batches or _data(steps)):
        x, y = (dist.shard_tensor(t, mesh, [Shard(0)]) for t in (x, y))
        with dist.comm_log() as log:
            with torch.autocast("cpu", dtype=autocast or BF16, enabled=autocast is not None):
                loss = _loss(model(x), y)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if backward_ends is not None:
                backward_ends.append(len(log))
            if step == inf_at:
                p = next(model.parameters())
                dist.unshard_dtensor(p.grad)  # (a read: every pending gradient reduced first)
                if dist.get_rank() == 0:  # only rank 0's piece: without one job-wide found-inf the ranks part ways
                    p.grad._local.view(-1)[0] = float("inf")
            if scaler is not None:
                scales.append(scaler.get_scale())
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        opt.zero_grad()
        logs.append([(r.op, r.bytes) for r in log])
        losses.append(float(loss.detach()))
    return losses, logs, scales


def _weights(model):
    return {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}


def _masters(opt):
    """This rank's float32 master pieces (None where the parameter is its own master)."""
    return [zp.master for zp in opt._autopar_sharding.params]


def _check(losses, weights, ref_losses, ref_weights):
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for k, v in ref_weights.items():
        torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=0, msg=lambda m: f"{k}: {m}")


# -- ZeRO-3: bfloat16 gathers and compute, float32 reduction and masters ----------------------

def _sharded(stage, policy):
    """The net converted by shard_layer on ranks [0, 1], its AdamW under `stage` and `policy`."""
    mesh = _mesh()
    model = dist.shard_layer(_net(), mesh)
    opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=LR), stage and stage("dp"), mp_policy=policy)
    return mesh, model, opt


def _dtypes(model):
    return sorted({str(p.dtype) for p in model.parameters()})


def _zero3(policy):
    mesh, model, opt = _sharded(dist.ShardingStage3, policy)
    losses, logs, _ = _train(model, opt, mesh)
    return losses, _weights(model), logs, _dtypes(model)


def test_zero3_bf16_matches_one_process_and_gathers_half_the_bytes():
    policy = dist.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32, output_dtype=FP32)
    ref = _reference(policy, FP32)
    for (losses, weights, logs, dtypes), (_, _, logs32, _) in zip(run_dist(_zero3, 2, policy),
                                                                   run_dist(_zero3, 2, None)):
        _check(losses, weights, ref[0], ref[1])
        assert dtypes == ["torch.float32"]  # the sharded parameters are the float32 masters
        for step, step32 in zip(logs, logs32):
            gathers = [b for op, b in step if op == "all_gather"]
            gathers32 = [b for op, b in step32 if op == "all_gather"]
            assert len(gathers) == len(gathers32) > 0 and sum(gathers) * 2 == sum(gathers32)
            # reductions stay float32 (reduce_dtype), the same bytes as without a policy
            assert [(op, b) for op, b in step if op != "all_gather"] == [
                (op, b) for op, b in step32 if op != "all_gather"]


# -- ZeRO-1, Paddle's O2: bfloat16 parameters, float32 masters sharded ------------------------

def _zero12_o2(level, policy):
    mesh, model, opt = _sharded(dist.ShardingStage1 if level == 1 else dist.ShardingStage2, policy)
    losses, logs, _ = _train(model, opt, mesh)
    shards = [(m.dtype, tuple(m.shape), tuple(p.shape)) for m, p in zip(_masters(opt), model.parameters())
              if m is not None]
    state = opt.state[next(model.parameters())]["exp_avg"]
    return losses, _weights(model), logs, _dtypes(model), shards, _masters(opt), (state.dtype, state.placements)


@pytest.mark.parametrize("level,reduce_dtype", [(1, None), (2, FP32)])
def test_zero12_o2_bf16_matches_one_process_with_sharded_float32_masters(level, reduce_dtype):
    """ZeRO-1 reducing in bfloat16 (the policy's default), ZeRO-2 in float32 (the gradients
    cast up for the reduce-scatter, the sum rounded once into the bfloat16 .grad)."""
    policy = dist.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=reduce_dtype)
    ref = _reference(policy, BF16)
    ref_masters = list(ref[1].values())
    fp32 = run_dist(_zero12_o2, 2, level, None)
    for rank, (losses, weights, logs, dtypes, shards, masters, state) in enumerate(
            run_dist(_zero12_o2, 2, level, policy)):
        _check(losses, weights, ref[0], ref[2])  # the bf16 parameters: the masters cast
        assert dtypes == ["torch.bfloat16"]
        assert state == (FP32, [Shard(0)])
        assert len(shards) == len(ref_masters)
        for (dtype, shape, full), master, want in zip(shards, masters, ref_masters):
            assert dtype == FP32 and shape[0] * 2 == full[0] and shape[1:] == full[1:]  # half of each master
            torch.testing.assert_close(master, want.chunk(2)[rank], rtol=1e-5, atol=0)
        for step, step32 in zip(logs, fp32[rank][2]):  # bfloat16 shards gathered; gradients in reduce_dtype
            for op, ratio in (("reduce_scatter", 1 if reduce_dtype == FP32 else 2), ("all_gather", 2)):
                sent = [b for o, b in step if o == op]
                sent32 = [b for o, b in step32 if o == op]
                assert len(sent) == len(sent32) > 0 and sum(sent) * ratio == sum(sent32)


# -- levels 0-2: float32 reduction of bfloat16 gradients, overlapped with backward ---------------

_STAGES = {0: None, 1: dist.ShardingStage1, 2: dist.ShardingStage2}


def _o2_overlapped(level, policy):
    """The net under ZeRO-`level` and `policy`, with bucket caps small enough for several
    buckets (backward reduces them as it goes): losses, weights, and per step the
    collectives of forward + backward and those of the optimizer step."""
    caps = grad_reduce.FIRST_BUCKET_BYTES, grad_reduce.BUCKET_BYTES
    grad_reduce.FIRST_BUCKET_BYTES, grad_reduce.BUCKET_BYTES = 600, 2000
    try:
        mesh, model, opt = _sharded(_STAGES[level], policy)
        ends = []
        losses, logs, _ = _train(model, opt, mesh, backward_ends=ends)
        return losses, _weights(model), [(log[:n], log[n:]) for log, n in zip(logs, ends)]
    finally:
        grad_reduce.FIRST_BUCKET_BYTES, grad_reduce.BUCKET_BYTES = caps


@pytest.mark.parametrize("level", [0, 1, 2])
def test_o2_float32_reduction_runs_in_backward_buckets(level):
    """bfloat16 parameters, float32 reduction: backward casts each bucket's ready gradients
    to float32 and reduces them while it goes on (after the first step, which verifies the
    region op by op and leaves its gradients to the optimizer; ZeRO-2 reduces at the end of
    every backward), landing them in bfloat16; the optimizer step reduces nothing.  The
    single process's numbers; float32 bytes, those of a run without a policy."""
    policy = dist.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
    ref = _reference(policy, BF16)
    reduce = "all_reduce" if level == 0 else "reduce_scatter"
    numel = sum(p.numel() for p in _Net().parameters())
    fp32 = run_dist(_o2_overlapped, 2, level, None)
    for rank, (losses, weights, phases) in enumerate(run_dist(_o2_overlapped, 2, level, policy)):
        _check(losses, weights, ref[0], ref[2])
        for step, ((backward, stepped), (backward32, stepped32)) in enumerate(zip(phases, fp32[rank][2])):
            reductions = [(op, b) for op, b in backward + stepped if op == reduce]
            assert reductions == [(op, b) for op, b in backward32 + stepped32 if op == reduce], step
            if step > 0 or level == 2:
                assert reduce not in [op for op, _ in stepped], (step, stepped)
            if step > 0:  # (the first forward checks its region with an 8-byte all-reduce)
                assert len(reductions) > 1, reductions  # several buckets: reduced while backward went on
                # float32: 4 bytes an element (an all-reduce of 2 ranks sends all, a reduce-scatter half)
                assert sum(b for _, b in reductions) == 4 * numel // (1 if level == 0 else 2)


# -- dp x mp: a Megatron plan with data parallel under a policy ---------------------------------

def _dp_mp(policy, level):
    """The net on a 2 x 2 mesh, its first block by columns and its second by rows over "mp",
    ZeRO-`level` over "dp", SGD (its update is linear in the gradients): losses, per step the
    bytes of forward + backward + step by (op, group), {name: (parameter dtype, gradient
    dtype)}, and the float32 masters, whole (under ZeRO-3 the sharded parameters themselves)."""
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    model = _net()
    plan = {"blocks.0": dist.ColWiseParallel(), "blocks.1": dist.RowWiseParallel()}
    config = {"dp_config": {"sharding_level": level, "mp_policy": policy}, "mp_config": {"parallelize_plan": plan}}
    model, opt = dist.parallelize(model, torch.optim.SGD(model.parameters(), lr=LR), mesh, config)
    me = dist.get_rank()
    groups = {mesh.group_of(me, (0,)): "dp", mesh.group_of(me, (1,)): "mp"}
    losses, logs, dtypes = [], [], {}
    for x, y in _data():
        with dist.comm_log() as log:
            loss = _loss(model(x).float(), y)  # (plain inputs: parallelize splits them over "dp")
            loss.backward()
            dtypes = {name: (p.dtype, p.grad.dtype) for name, p in model.named_parameters()}
            opt.step()
        opt.zero_grad()
        sent: dict = {}
        for r in log:
            key = (r.op, groups.get(tuple(r.ranks), str(list(r.ranks))))
            sent[key] = sent.get(key, 0) + r.bytes
        logs.append(sent)
        losses.append(float(loss.detach()))
    names = [name for name, _ in model.named_parameters()]
    masters = {name: dist.unshard_dtensor(p.detach()) for name, p in model.named_parameters() if p.dtype == FP32}
    masters.update({names[i]: dist.unshard_dtensor(m) for i, m in opt.state_dict().get("master_weights", {}).items()})
    return losses, logs, dtypes, masters


# bfloat16 keeps 8 significant bits: each rounding is off by at most u = 2**-8 of the value.
# The mp run rounds each rank's partial sum of the row-parallel block to bfloat16 and then
# their sum, where one process rounds the whole sum once: about 2u more error relative to the
# terms' size, which propagates (about linearly) into the loss and every gradient; the
# gradient of the first block goes back through that sum once more.  So 4u, norm-wise per
# tensor: element by element the two orders differ without bound where terms cancel (a
# gradient element near zero).  A reduction missing a rank or a term is off by O(1).
BF16_SUM_ORDER = 4 * 2.0 ** -8


@pytest.mark.parametrize("level", [0, 1, 3])
def test_dp_x_mp_under_a_policy_matches_one_process_to_bfloat16_rounding(level):
    """ZeRO-`level` over "dp" with Megatron's column/row blocks over "mp", bfloat16 compute,
    float32 reduction and masters, against one process under the same policy: the losses and
    each master's update within BF16_SUM_ORDER; the float32 parts exact: the masters' dtype,
    the gradients' (float32 where the parameter is the float32 master: ZeRO-3's shards; in the
    bfloat16 parameter's dtype elsewhere), the dp gradient reductions' bytes (those of a run
    without a policy); the bfloat16 ones at half the bytes: the mp all-reduce of activations,
    the dp all-gather of parameters (ZeRO-1's updated shards, ZeRO-3's before use)."""
    policy = dist.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
    ref = _reference(policy, BF16, optimizer=torch.optim.SGD)
    start = _net().state_dict()
    fp32 = run_dist(_dp_mp, 4, None, level)
    halved = {("all_reduce", "mp")} | ({("all_gather", "dp")} if level else set())
    for rank, (losses, logs, dtypes, masters) in enumerate(run_dist(_dp_mp, 4, policy, level)):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]), rtol=BF16_SUM_ORDER, atol=0)
        # (torch keeps .grad in its parameter's dtype; blocks.0.bias, its one dim split over "mp"
        # already, is too small for ZeRO-3 to cut: held in bfloat16 with a master, as at level 0)
        for name, (param, grad) in dtypes.items():
            assert param == grad == (FP32 if level == 3 and name != "blocks.0.bias" else BF16), (name, param, grad)
        assert sorted(masters) == sorted(start)
        for name, master in masters.items():
            assert master.dtype == FP32, name
            update, want = master - start[name], ref[1][name] - start[name]
            assert (update - want).norm() <= BF16_SUM_ORDER * want.norm(), (name, (update - want).norm() / want.norm())
        for step, (sent, sent32) in enumerate(zip(logs, fp32[rank][1])):
            assert sent.keys() == sent32.keys(), (step, sent, sent32)
            assert halved <= sent.keys() and {("all_reduce", "dp"), ("reduce_scatter", "dp")} & sent.keys(), sent
            for key, nbytes in sent.items():
                assert nbytes * (2 if key in halved else 1) == sent32[key], (step, key, nbytes, sent32[key])


# -- float16 with a loss scale: every rank skips the step one rank's inf gradient spoils --------

def _fp16_scaled(level, policy, steps, inf_at):
    mesh, model, opt = _sharded(dist.ShardingStage3 if level == 3 else None, policy)
    scaler = dist.shard_scaler(torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2))
    losses, logs, scales = _train(model, opt, mesh, steps, scaler, inf_at)
    found_inf = [[b for op, b in step if op == "all_reduce" and b == 4] for step in logs]
    return losses, _weights(model), scales, found_inf


@pytest.mark.parametrize("level", [0, 3])
def test_fp16_with_shard_scaler_skips_the_inf_step_on_every_rank(level):
    """float16, Paddle's O2 under data parallel (float16 parameters and reduction) and ZeRO-3
    (float16 gathers, float32 reduction): the single process's losses, weights and scales;
    the step whose gradient one rank spoiled is skipped everywhere (the scale halves), by one
    4-byte found-inf all-reduce per step."""
    steps, inf_at = 4, 1
    if level == 3:
        policy, landed = dist.MixedPrecisionPolicy(param_dtype=FP16, reduce_dtype=FP32, output_dtype=FP32), FP32
    else:
        policy, landed = dist.MixedPrecisionPolicy(param_dtype=FP16, output_dtype=FP32), FP16
    ref = _reference(policy, landed, steps, scale=2.0 ** 10, inf_at=inf_at)
    assert ref[3] == [1024.0, 1024.0, 512.0, 512.0]  # (grown after two clean steps: none here)
    for losses, weights, scales, found_inf in run_dist(_fp16_scaled, 2, level, policy, steps, inf_at):
        _check(losses, weights, ref[0], ref[1] if level == 3 else ref[2])
        assert scales == ref[3]
        assert found_inf == [[4]] * steps


# -- Paddle's levels: O1 is autocast (float32 parameters), O2 the policy -------------------------

def _o1(route):
    if route == "torch.autocast":  # the user's own torch.autocast around a data-parallel forward
        mesh, model, opt = _sharded(None, None)
        losses, _, _ = _train(model, opt, mesh, autocast=BF16)
    else:
        mesh, model = _mesh(), _net()
        config = {"dp_config": {}, "amp_config": {"level": "O1"}}
        model, opt = dist.parallelize(model, torch.optim.AdamW(model.parameters(), lr=LR), mesh, config)
        losses, _, _ = _train(model, opt, mesh)
    return losses, _weights(model), _dtypes(model)


@pytest.mark.parametrize("route", ["torch.autocast", "amp_config"])
def test_o1_is_autocast_with_float32_parameters(route):
    ref = _reference(dist.MixedPrecisionPolicy(param_dtype=FP32), FP32, autocast=BF16)
    plain = _reference(dist.MixedPrecisionPolicy(param_dtype=FP32), FP32)
    assert ref[0] != plain[0]  # (autocast changes the numbers: the check below can tell)
    for losses, weights, dtypes in run_dist(_o1, 2, route):
        _check(losses, weights, ref[0], ref[1])
        assert dtypes == ["torch.float32"]


def _o2_via_parallelize(level, amp):
    mesh = _mesh()
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    if amp:
        config = {"dp_config": {"sharding_level": level}, "amp_config": {"level": "O2", "dtype": "bfloat16"}}
    else:
        config = {"dp_config": {"sharding_level": level, "mp_policy": dist.MixedPrecisionPolicy(BF16)}}
    model, opt = dist.parallelize(model, opt, mesh, config)
    x, y = _data(1)[0]
    loss = _loss(model(x).float(), y)  # (plain inputs: parallelize splits them over "dp" and casts them)
    loss.backward()
    opt.step()
    return float(loss.detach()), _weights(model), _dtypes(model)


@pytest.mark.parametrize("level,amp", [(2, True), (0, False)])
def test_parallelize_takes_o2_as_amp_config_or_a_policy(level, amp):
    ref = _reference(dist.MixedPrecisionPolicy(param_dtype=BF16, output_dtype=FP32), BF16, steps=1)
    for loss, weights, dtypes in run_dist(_o2_via_parallelize, 2, level, amp):
        _check([loss], weights, ref[0], ref[2])
        assert dtypes == ["torch.bfloat16"]


# -- the static mode: Strategy.amp O2, float16 with loss scaling ----------------------------------

def _static_amp(dtype, level, stage, steps):
    mesh = _mesh()
    model = dist.shard_layer(_net(), mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)  # (linear in the gradients: a wrong scale shows)
    if level == "O1":  # (O2: to_static gives the plain optimizer its policy)
        opt = dist.shard_optimizer(opt)
    amp = {"enable": True, "dtype": dtype, "level": level, "init_loss_scaling": 1024.0, "incr_every_n_steps": 2}
    config = {"amp": amp, "sharding": {"enable": stage is not None, "stage": stage or 1}}
    step = dist.to_static(model, None, lambda out, y: _loss(out.float(), y), opt, dist.Strategy(config))
    losses, scales = [], []
    for x, y in _data(steps):
        scales.append(step.scaler.get_scale() if step.scaler is not None else None)
        losses.append(float(step(dist.shard_tensor(x, mesh, [Shard(0)]), dist.shard_tensor(y, mesh, [Shard(0)]))))
    return losses, _weights(model), scales, _dtypes(model), step.dist_main_program()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_static_float16_scales_the_loss_like_one_process(level):
    """A captured float16 step, O1 (autocast, float32 parameters) or O2 (float16 parameters,
    float32 masters): the replays read the scale the scaler updated (it doubles after two
    clean steps: a program that kept the first would unscale wrongly); the single process's
    losses and weights."""
    steps = 4
    if level == "O1":
        ref = _reference(dist.MixedPrecisionPolicy(param_dtype=FP32), FP32, steps, scale=1024.0, autocast=FP16,
                         optimizer=torch.optim.SGD)
        held, dtype = ref[1], "torch.float32"
    else:
        ref = _reference(dist.MixedPrecisionPolicy(param_dtype=FP16, output_dtype=FP32), FP16, steps, scale=1024.0,
                         optimizer=torch.optim.SGD)
        held, dtype = ref[2], "torch.float16"
    assert ref[3] == [1024.0, 1024.0, 2048.0, 2048.0]
    for losses, weights, scales, dtypes, program in run_dist(_static_amp, 2, "float16", level, None, steps):
        _check(losses, weights, ref[0], held)
        assert scales == ref[3] and dtypes == [dtype]
        assert "all_reduce" in program


def test_static_zero3_o2_bfloat16_gathers_in_the_captured_step():
    """Strategy.sharding stage 3 with amp O2 bfloat16: the captured program gathers bfloat16
    shards of the float32 parameters, as the dynamic mode does."""
    ref = _reference(dist.MixedPrecisionPolicy(param_dtype=BF16, output_dtype=FP32), FP32, optimizer=torch.optim.SGD)
    for losses, weights, scales, dtypes, program in run_dist(_static_amp, 2, "bfloat16", "O2", 3, STEPS):
        _check(losses, weights, ref[0], ref[1])
        assert scales == [None] * STEPS and dtypes == ["torch.float32"]
        gathered = [int(n) for n in re.findall(r"^(?:arrive )?all_gather\(.*sent=(\d+) B$", program, re.M)]
        # a captured step gathers at every use (whole, or posted and arriving later): forward
        # and backward each send this rank's half of every parameter, 2 bytes an element
        numel = sum(p.numel() for p in _Net().parameters())
        assert len(gathered) == 6 and sum(gathered) == 2 * (numel // 2) * 2


# -- bad input ------------------------------------------------------------------------------------

def _bad_policies_and_amp_settings():
    with pytest.raises(ValueError, match="MixedPrecisionPolicy.param_dtype must be a floating-point"):
        dist.MixedPrecisionPolicy(param_dtype=torch.int32)
    mesh = dist.ProcessMesh([0], dim_names=["dp"])
    policy = dist.MixedPrecisionPolicy(param_dtype=BF16)
    layer = dist.shard_layer(torch.nn.Linear(4, 2), mesh)
    with pytest.raises(ValueError, match="needs an elementwise optimizer .* got LBFGS"):
        dist.shard_optimizer(torch.optim.LBFGS(layer.parameters()), mp_policy=policy)
    with pytest.raises(TypeError, match="needs an autopar.MixedPrecisionPolicy"):
        dist.shard_optimizer(torch.optim.SGD(layer.parameters(), lr=0.1), mp_policy="bf16")
    plain = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match=r"parameter #0 of the optimizer \(shape \[2, 4\]\) is not a distributed"):
        dist.shard_optimizer(torch.optim.SGD(plain.parameters(), lr=0.1), mp_policy=policy)
    with pytest.raises(ValueError, match="amp_config level must be 'O0', 'O1'"):
        dist.parallelize(torch.nn.Linear(4, 2), None, mesh, {"amp_config": {"level": "O3"}})
    with pytest.raises(ValueError, match="amp_config: unknown keys \\['dtpye'\\]"):
        dist.parallelize(torch.nn.Linear(4, 2), None, mesh, {"amp_config": {"level": "O2", "dtpye": "bfloat16"}})
    with pytest.raises(ValueError, match="steps float32 master weights in the optimizer: give parallelize"):
        dist.parallelize(torch.nn.Linear(4, 2), None, mesh, {"amp_config": {"level": "O2"}})
    with pytest.raises(TypeError, match="shard_scaler needs a torch.amp.GradScaler"):
        dist.shard_scaler(object())


def test_bad_policies_and_amp_settings_are_refused_naming_what_is_wrong():
    run_dist(_bad_policies_and_amp_settings, 1)  # (a rank of its own: the test process joins no job)


# -- a real model: HF Llama under ZeRO-3 in bfloat16 ----------------------------------------------

def _llama_data(steps):
    return hf_llama.batches(steps, batch=8)


def _llama_half(model, batch, half, policy):
    ids, labels = batch
    return model(input_ids=ids[half], labels=labels[half]).loss


def _llama_zero3(policy, steps):
    mesh = _mesh()
    model = hf_llama.tiny_llama()
    config = {"dp_config": {"sharding_level": 3, "mp_policy": policy}}
    model, opt = dist.parallelize(model, torch.optim.AdamW(model.parameters(), lr=LR), mesh, config)
    losses = []
    for ids, labels in _llama_data(steps):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, _weights(model), _dtypes(model)


def test_hf_llama_zero3_bf16_matches_one_process():
    policy = dist.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
    ref = _reference(policy, FP32, 2, make=hf_llama.tiny_llama, data=_llama_data, half_loss=_llama_half)
    for losses, weights, dtypes in run_dist(_llama_zero3, 2, policy, 2):
        _check(losses, weights, ref[0], ref[1])
        assert dtypes == ["torch.float32"]


# -- pipeline stages: each rank holds only its stage's parameters -----------------------------------

def _two_stages():
    """A two-stage pipeline (the seed's: a layer on each rank's mesh, the activation resharded
    across), one scaled step whose gradient rank 1 spoils: (whether this rank's stage
    stepped, the scale after, the collectives of the step)."""
    meshes = [dist.ProcessMesh([0], dim_names=["x"]), dist.ProcessMesh([1], dim_names=["x"])]
    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    dist.shard_layer(first, meshes[0])
    dist.shard_layer(second, meshes[1])
    opt = dist.shard_optimizer(torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1))
    scaler = dist.shard_scaler(torch.amp.GradScaler("cpu", init_scale=8.0))
    x = dist.shard_tensor(torch.ones(2, 4), meshes[0], [dist.Replicate()])
    hidden = dist.reshard(first(x), meshes[1], [dist.Replicate()])
    scaler.scale(second(hidden).sum()).backward()
    if dist.get_rank() == 1:
        second.weight.grad._local[0, 0] = float("inf")
    mine = (first if dist.get_rank() == 0 else second).weight
    before = mine.local_value().clone()
    with dist.comm_log() as log:
        scaler.step(opt)
    scaler.update()
    return not torch.equal(mine.local_value(), before), scaler.get_scale(), [(r.op, r.ranks, r.bytes) for r in log]


def test_shard_scaler_makes_pipeline_stages_skip_together():
    """Rank 0 holds only the first stage, whose gradients are finite: it skips the step and
    halves its scale with rank 1, told by one 4-byte all-reduce over the job."""
    for stepped, scale, log in run_dist(_two_stages, 2):
        assert (stepped, scale) == (False, 4.0)
        assert log == [("all_reduce", (0, 1), 4)]


def _masters_follow_loaded_weights(level):
    """SGD with lr 0 (a step changes nothing): weights loaded between steps must stay, not be
    overwritten by masters that still hold the old values."""
    mesh = _mesh()
    model = dist.shard_layer(_net(), mesh)
    opt = dist.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                               dist.ShardingStage1("dp") if level else None, mp_policy=dist.MixedPrecisionPolicy(BF16))
    _train(model, opt, mesh, steps=1)
    torch.manual_seed(5)
    loaded = {k: v.to(BF16) for k, v in _Net().state_dict().items()}
    model.load_state_dict(loaded)
    _train(model, opt, mesh, steps=1)
    return _weights(model), loaded


@pytest.mark.parametrize("level", [0, 1])
def test_masters_take_weights_loaded_between_steps(level):
    for weights, loaded in run_dist(_masters_follow_loaded_weights, 2, level):
        for k, v in loaded.items():
            torch.testing.assert_close(weights[k], v, rtol=0, atol=0, msg=lambda m: f"{k}: {m}")


def _resume_o2(level, path):
    """Three steps straight, and two steps, a checkpoint, a fresh model and optimizer loading
    it, the third step: the weights and this rank's masters of each."""
    policy, stage = dist.MixedPrecisionPolicy(BF16), dist.ShardingStage1 if level else None
    mesh, model, opt = _sharded(stage, policy)
    _train(model, opt, mesh, steps=3)
    straight = _weights(model), _masters(opt)
    mesh, model, opt = _sharded(stage, policy)
    _train(model, opt, mesh, steps=2)
    dist.save_state_dict({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    mesh, model, opt = _sharded(stage, policy)
    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    dist.load_state_dict(state, path)
    opt.load_state_dict(state["opt"])
    _train(model, opt, mesh, batches=_data(3)[2:])
    return straight, (_weights(model), _masters(opt))


@pytest.mark.parametrize("level", [0, 1])
def test_o2_checkpoints_resume_from_the_exact_float32_masters(level, tmp_path):
    """The optimizer's state dict holds the masters (Paddle's "master_weights", each rank's
    shard under ZeRO-1): a resumed run is the straight run, bit for bit."""
    for (weights, masters), (resumed, resumed_masters) in run_dist(_resume_o2, 2, level, str(tmp_path / "ckpt")):
        for k, v in weights.items():
            torch.testing.assert_close(resumed[k], v, rtol=0, atol=0, msg=lambda m: f"{k}: {m}")
        for a, b in zip(resumed_masters, masters):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def _state_placed_elsewhere():
    mesh, model, opt = _sharded(dist.ShardingStage1, dist.MixedPrecisionPolicy(BF16))
    w = model.blocks[0].weight
    opt.state[w]["exp_avg"] = dist.shard_tensor(torch.zeros(32, 16), mesh, [dist.Replicate()])  # (not its shard)
    x = dist.shard_tensor(_data(1)[0][0], mesh, [Shard(0)])
    model(x).float().sum().backward()
    try:
        opt.step()
    except RuntimeError as err:
        return str(err)


def test_a_master_step_that_cannot_run_on_local_pieces_names_the_parameter():
    for message in run_dist(_state_placed_elsewhere, 2):
        assert "cannot step its float32 master weights" in message, message
        assert "shape [32, 16], is stepped at [Shard(0)]" in message, message
