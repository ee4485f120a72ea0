"""to_static's Strategy: gradient merge, ZeRO sharding and bfloat16 autocast, each checked
against the single process (and the dynamic mode); settings validated without processes."""
import numpy as np
import pytest
import torch

import autopar as dist
from autopar.placement import Shard
from distpool import run_dist
from test_static import Net, _batches, _loss, run_steps

S0 = Shard(0)


# -- settings, no processes ----------------------------------------------------------------------
def test_strategy_sections_and_settings_are_checked():
    s = dist.Strategy({"gradient_merge": {"enable": True, "k_steps": 3, "avg": False}})
    assert (s.merge_steps(), s.gradient_merge.avg, s.autocast_dtype()) == (3, False, None)
    s.amp.enable = True
    assert s.autocast_dtype() == torch.bfloat16
    with pytest.raises(AttributeError, match="Strategy.amp has no setting 'scale'"):
        s.amp.scale = 2.0
    with pytest.raises(ValueError, match="no section 'recompute'"):
        dist.Strategy({"recompute": {"enable": True}})
    assert s.loss_scaler("cpu") is None  # (bfloat16 needs no loss scaling)
    s.amp.dtype = "float16"  # O1 float16: autocast, and a loss scaler agreeing over the job
    assert s.autocast_dtype() == torch.float16 and s.mp_policy() is None
    assert s.loss_scaler("cpu").get_scale() == 32768.0
    s.amp.dtype, s.amp.level = "bfloat16", "O2"  # O2: the optimizer's policy, no autocast
    assert s.autocast_dtype() is None and s.mp_policy() == dist.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    s.amp.level = "O3"
    with pytest.raises(ValueError, match="Strategy.amp level must be 'O0', 'O1'"):
        s.autocast_dtype()
    s.amp.level, s.amp.dtype = "O2", "float8"
    with pytest.raises(ValueError, match="Strategy.amp dtype must be one of"):
        s.mp_policy()
    s.gradient_merge.k_steps = 0
    with pytest.raises(ValueError, match="k_steps must be an int >= 1"):
        s.merge_steps()
    with pytest.raises(TypeError, match="needs an autopar.Strategy"):
        dist.to_static(torch.nn.Linear(2, 2), None, None, None, {"amp": {"enable": True}})


# -- against the single process ------------------------------------------------------------------
def _single(k_steps=1, amp=False):
    """Plain torch: k micro-batches per AdamW step, the mean of their gradients."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    for i, (x, y) in enumerate(_batches()):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = _loss(model(x), y)
        (loss / k_steps).backward()
        losses.append(loss.item())
        if (i + 1) % k_steps == 0:
            opt.step()
            opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _distributed(config, static=True, autocast=False):
    torch.manual_seed(0)
    model = Net()
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    dist.shard_layer(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    strategy = dist.Strategy(config)
    if not strategy.sharding.enable:
        opt = dist.shard_optimizer(opt)
    step = dist.to_static(model, None, _loss, opt, strategy) if static else None
    losses, params = run_steps(model, opt, step, lambda t: dist.shard_tensor(t, mesh, [S0]), autocast)
    opt = step.optimizer if static else opt
    states = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
    state_numel = sum(v.local_value().numel() if dist.is_dist_tensor(v) else v.numel() for v in states)
    program = step.dist_main_program() if static else ""
    return losses, params, state_numel, getattr(opt._autopar_sharding, "stage", None), program


def _check(got, ref, rtol=1e-5, atol=1e-5):
    np.testing.assert_allclose(got[0], ref[0], rtol=rtol, atol=atol)
    for k, v in ref[1].items():
        torch.testing.assert_close(got[1][k], v, rtol=rtol, atol=atol)


@pytest.mark.parametrize("k_steps,stage", [(2, None), (4, None), (2, 2), (2, 3)])
def test_gradient_merge_steps_once_per_k_micro_batches(k_steps, stage):
    ref = _single(k_steps)
    config = {"gradient_merge": {"enable": True, "k_steps": k_steps, "avg": True}}
    if stage:  # with ZeRO: gradients merge on the optimizer's shards
        config["sharding"] = {"enable": True, "stage": stage}
    for got in run_dist(_distributed, 4, config):
        _check(got, ref)
        if not stage:  # gradients add up unreduced: the program's one all-reduce is the loss's
            assert "(all_reduce x1)" in got[4], got[4]


def test_sharding_section_applies_zero_to_the_optimizer():
    ref = _single()
    full = sum(p.numel() for p in Net().parameters()) * 2  # AdamW's exp_avg and exp_avg_sq
    for got in run_dist(_distributed, 4, {"sharding": {"enable": True, "stage": 2, "degree": 4}}):
        _check(got, ref)
        assert got[3] == 2
        assert got[2] < full / 2, (got[2], full)  # states sharded over the 4 dp ranks


def _sharding_degree_mismatch():
    try:
        _distributed({"sharding": {"enable": True, "stage": 1, "degree": 2}})
    except ValueError as e:
        return str(e)


def test_sharding_degree_must_match_the_mesh_dim():
    for err in run_dist(_sharding_degree_mismatch, 4):
        assert "degree 2 does not match mesh dim 'dp' of size 4" in err


def _amp_both():
    return _distributed({"amp": {"enable": True}}), _distributed({}, static=False, autocast=True)


def test_amp_runs_the_forward_in_bfloat16_like_autocast():
    ref = _single(amp=True)
    for static, dynamic in run_dist(_amp_both, 4):
        # the dynamic mode under autocast, to the last bits: its gradient bucket also carries the
        # mean loss's (sum, count) (`deferred_mean`; the captured step reduces them in its
        # forward), and gloo sums 4 ranks' elements of the longer buffer in another order
        np.testing.assert_allclose(static[0], dynamic[0], rtol=1e-6)
        for k in dynamic[1]:
            torch.testing.assert_close(static[1][k], dynamic[1][k], rtol=1e-6, atol=1e-8)
        assert "bfloat16" in static[4]
        # bfloat16 keeps ~3 significant digits: per-rank pieces round differently from one process
        _check(static, ref, rtol=2e-2, atol=2e-2)
