"""Annotated models (layers on their stages' meshes) run by micro-batch schedules, dynamic
(`pipelining.build_schedule`) and static (`to_static` with `Strategy.pipeline`), against the
single-process whole-batch run."""
import pytest
import torch
import torch.nn.functional as F

import autopar as dist
from autopar.api.parallelize import SCHEDULE_MODES
from autopar.pipelining import build_schedule
from distpool import run_dist

R = dist.Replicate()
H, FFN, ROWS, STEPS = 16, 32, 8, 2


class SeedMlp(torch.nn.Module):
    """The guide's pipeline (§4.3): w0 on mesh0, w1 on mesh1, an explicit reshard between the stages."""

    def __init__(self, mesh0=None, mesh1=None):
        super().__init__()
        torch.manual_seed(0)
        self.mesh1 = mesh1
        w0 = torch.nn.Parameter(torch.randn(H, FFN) * H**-0.5)
        w1 = torch.nn.Parameter(torch.randn(FFN, H) * FFN**-0.5)
        if mesh0 is not None:
            w0, w1 = dist.shard_tensor(w0, mesh0, [R]), dist.shard_tensor(w1, mesh1, [R])
        self.w0, self.w1 = w0, w1

    def forward(self, x):
        y = torch.tanh(torch.matmul(x, self.w0))
        if self.mesh1 is not None:
            y = dist.reshard(y, self.mesh1, [R])
        return torch.matmul(y, self.w1)


def _batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(ROWS, H, generator=g), torch.randn(ROWS, H, generator=g)) for _ in range(STEPS)]


def _reference(model_fn, loss_fn=F.mse_loss):
    model = model_fn()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    for x, y in _batches():
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _seed_dynamic(mode, m=4):
    model = SeedMlp(dist.ProcessMesh([0, 1]), dist.ProcessMesh([2, 3]))
    opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    schedule = build_schedule(model, F.mse_loss, mode, accumulate_steps=m)
    losses = []
    for x, y in _batches():
        micro = []
        losses.append(schedule.step(x, target=y, losses=micro).item())
        assert len(micro) == m
        opt.step()
        opt.zero_grad()
    params = {n: dist.unshard_dtensor(p).detach() for n, p in model.named_parameters()}
    return losses, params, schedule.peak_held, schedule.stage, schedule.format_order(), schedule.format_times()


@pytest.mark.parametrize("mode", ["FThenB", "1F1B"])
def test_seed_pipeline_by_micro_batches_dynamic(mode):
    ref_losses, ref_params = _reference(SeedMlp)
    for losses, params, peak, stage, order, times in run_dist(_seed_dynamic, 4, mode):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for name, p in params.items():
            torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        assert peak == (4 if mode == "FThenB" else 2 - stage)  # 1F1B: num_stages - stage_index
        assert order.splitlines()[0].startswith("stage 0 [0, 1]: F0") and "bubble" in times


class Layers(torch.nn.Module):
    """An embedding-free stack for parallelize: in, 4 tanh layers, out."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(H, FFN)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(FFN, FFN) for _ in range(4))
        self.out = torch.nn.Linear(FFN, H)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.out(x)


def _parallelized(pp_config, mesh_ids=((0, 1), (2, 3)), dims=("dp", "pp"), mp_plan=None):
    model = Layers()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    mesh = dist.ProcessMesh([list(r) for r in mesh_ids], dim_names=list(dims))
    config = {"dp_config": {"sharding_level": 0}, "pp_config": pp_config}
    if mp_plan:
        config["mp_config"] = {"parallelize_plan": mp_plan}
    model, opt = dist.parallelize(model, opt, mesh, config)
    return model, opt


def _parallel_dynamic():
    model, opt = _parallelized({"split_spec": "layers", "schedule_mode": "1F1B", "accumulate_steps": 4})
    schedule = build_schedule(model, F.mse_loss)  # the schedule and micro-batches come from pp_config
    losses = []
    for x, y in _batches():
        losses.append(schedule.step(x, target=y).item())
        opt.step()
        opt.zero_grad()
    return losses, {n: dist.unshard_dtensor(p).detach() for n, p in model.named_parameters()}, schedule.format_order()


def test_parallelize_pp_config_schedule_dynamic():
    ref_losses, ref_params = _reference(Layers)
    for losses, params, order in run_dist(_parallel_dynamic, 4):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for name, p in params.items():
            torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        assert order == "stage 0 [0, 2]: F0 F1 B0 F2 B1 F3 B2 B3\nstage 1 [1, 3]: F0 B0 F1 B1 F2 B2 F3 B3"


def _pipeline_strategy(mode, m=4, vpp=1):
    return dist.Strategy({"pipeline": {"enable": True, "schedule_mode": mode, "accumulate_steps": m, "vpp_degree": vpp}})


def _seed_static(mode):
    model = SeedMlp(dist.ProcessMesh([0, 1]), dist.ProcessMesh([2, 3]))
    opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    dist_model = dist.to_static(model, None, F.mse_loss, opt, _pipeline_strategy(mode))
    losses = []
    for x, y in _batches():
        with dist.comm_log() as log:  # the last step's: a replay
            loss = dist_model(x, y)
        losses.append(float(loss))
    transfers = [(r.op, r.bytes, r.recv_bytes) for r in log if r.op in ("send", "recv")]
    params = {n: dist.unshard_dtensor(p).detach() for n, p in model.named_parameters()}
    return losses, params, transfers, dist_model.dist_main_program()


@pytest.mark.parametrize("mode", ["FThenB", "1F1B", "ZBH1"])
def test_seed_pipeline_to_static(mode):
    ref_losses, ref_params = _reference(SeedMlp)
    for rank, (losses, params, transfers, program) in enumerate(run_dist(_seed_static, 4, mode)):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for name, p in params.items():
            torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        assert program.startswith(f"pipeline {mode}, 4 micro-batches"), program
        # one activation (2 rows x 32 floats) forward and its gradient back per micro-batch, nothing else
        piece = 2 * FFN * 4
        sent, received = (("send", piece, 0), ("recv", 0, piece)) if rank < 2 else (("recv", 0, piece), ("send", piece, 0))
        assert sorted(transfers) == sorted([sent] * 4 + [received] * 4), transfers


def _parallel_static(pp_config, strategy):
    model, opt = _parallelized(pp_config)
    dist_model = dist.to_static(model, None, F.mse_loss, opt, strategy)
    losses = [float(dist_model(x, y)) for x, y in _batches()]
    params = {n: dist.unshard_dtensor(p).detach() for n, p in model.named_parameters()}
    return losses, params, dist_model.dist_main_program()


@pytest.mark.parametrize("schedule", ["VPP", "ZBVPP", "1F1B from pp_config"])
def test_parallelize_pipeline_to_static(schedule):
    if "VPP" in schedule:  # four stages on the two pp slices: stage k on slice k % 2
        args = ({"split_spec": "layers", "vpp_degree": 2}, _pipeline_strategy(schedule, m=4, vpp=2))
    else:
        args = ({"split_spec": "layers", "schedule_mode": "1F1B", "accumulate_steps": 4}, None)
    ref_losses, ref_params = _reference(Layers)
    for losses, params, program in run_dist(_parallel_static, 4, *args):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for name, p in params.items():
            torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        assert program.startswith(f"pipeline {schedule}, 4 micro-batches, this rank: F0s" if "VPP" in schedule
                                  else "pipeline 1F1B, 4 micro-batches")


def _by_pp_config_and_by_strategy(mode):
    """One to_static step of the schedule `mode` names on 2 stages, read from pp_config and
    from Strategy.pipeline: (loss, this rank's program) each way."""
    settings = {"schedule_mode": mode, "accumulate_steps": 4, "vpp_degree": 2 if "VPP" in mode else 1}
    routes = (({"split_spec": "layers", **settings}, None),
              ({"split_spec": "layers", "vpp_degree": settings["vpp_degree"]},
               dist.Strategy({"pipeline": {"enable": True, **settings}})))
    results = []
    for pp_config, strategy in routes:
        model, opt = _parallelized(pp_config, mesh_ids=((0, 1),))
        dist_model = dist.to_static(model, None, F.mse_loss, opt, strategy)
        loss = float(dist_model(*_batches()[0]))
        results.append((loss, dist_model.dist_main_program()))
    return results


@pytest.mark.parametrize("mode", SCHEDULE_MODES)
def test_every_schedule_name_runs_the_same_schedule_from_pp_config_and_from_strategy(mode):
    for by_pp_config, by_strategy in run_dist(_by_pp_config_and_by_strategy, 2, mode):
        assert by_pp_config == by_strategy
        assert by_pp_config[1].startswith(f"pipeline {mode}, 4 micro-batches"), by_pp_config[1]


def _bad_settings(strategy_config):
    model = SeedMlp(dist.ProcessMesh([0]), dist.ProcessMesh([1]))
    opt = dist.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError) as err:
        dist.to_static(model, None, F.mse_loss, opt, dist.Strategy(strategy_config))
    return str(err.value)


@pytest.mark.parametrize("config, match", [
    ({"pipeline": {"enable": True, "schedule_mode": "GPipe"}}, "schedule_mode must be one of"),
    ({"pipeline": {"enable": True, "schedule_mode": "VPP", "accumulate_steps": 2}}, "VPP and ZBVPP run vpp_degree > 1"),
    ({"pipeline": {"enable": True, "schedule_mode": "1F1B", "accumulate_steps": 1}},
     "1F1B needs at least 2 micro-batches for its 2 stages"),
    ({"pipeline": {"enable": True, "schedule_mode": "VPP", "accumulate_steps": 3, "vpp_degree": 2}},
     "VPP needs a multiple of the 2 stage meshes"),
    ({"pipeline": {"enable": True, "accumulate_steps": 2}, "gradient_merge": {"enable": True, "k_steps": 2}},
     "use pipeline.accumulate_steps alone"),
])
def test_pipeline_settings_are_checked_on_every_rank(config, match):
    for message in run_dist(_bad_settings, 2, config):
        assert match in message, message


@pytest.mark.parametrize("pp_config, match", [
    ({"split_spec": "layers", "schedule": "1F1B"}, r"unknown keys \['schedule'\]"),
    ({"split_spec": "layers", "schedule_mode": "2F2B"}, "schedule_mode must be one of"),
    ({"split_spec": "layers", "accumulate_steps": 0}, "accumulate_steps must be an int >= 1"),
    ({"split_spec": "layers", "vpp_degree": 1.5}, "vpp_degree must be an int >= 1"),
])
def test_pp_config_schedule_keys_are_checked(pp_config, match):
    from autopar.api.parallelize import pipeline_settings

    with pytest.raises(ValueError, match=match):
        pipeline_settings(pp_config)


def _hf_lm_loss(out, labels):
    return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())


def _hf_llama_steps(pipelined):
    """A HF Llama trained 3 steps with the loss on its logits: in one process, or cut into 2
    stages with nothing but split_spec, 1F1B over 4 micro-batches (with the last step's
    transfers)."""
    from hf_llama import batches, optimizer, tiny_llama

    model = tiny_llama()
    opt = optimizer(model.parameters())
    step = None
    if pipelined:
        mesh = dist.ProcessMesh([0, 1], dim_names=["pp"])
        config = {"pp_config": {"split_spec": "model.layers", "schedule_mode": "1F1B", "accumulate_steps": 4}}
        model, opt = dist.parallelize(model, opt, mesh, config)
        step = build_schedule(model, _hf_lm_loss).step
    losses, transfers = [], []
    for ids, labels in batches(3):
        with dist.comm_log() as log:
            if step is not None:
                loss = step(ids, target=labels)
            else:
                loss = _hf_lm_loss(model(input_ids=ids), labels)
                loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        transfers = [(r.op, r.bytes) for r in log if r.op in ("send", "recv")]
    weights = {k: dist.unshard_dtensor(v.detach()) if dist.is_dist_tensor(v) else v.detach()
               for k, v in model.state_dict().items()}
    return losses, weights, transfers


def test_hf_llama_pipelines_with_its_rotary_embedding_run_where_it_is_called():
    """HF Llama registers its rotary embedding after the layers but calls it before the first:
    a module without parameters belongs to no stage, so each stage computes the cos/sin it
    needs locally; only the hidden states (and their gradients) cross, one per micro-batch."""
    from hf_llama import HIDDEN, SEQ

    ref_losses, ref_weights, _ = _hf_llama_steps(False)
    for losses, weights, transfers in run_dist(_hf_llama_steps, 2, True):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for k, v in ref_weights.items():
            torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
        hidden = 1 * SEQ * HIDDEN * 4  # one micro-batch of one sequence, fp32
        assert sorted(transfers) == sorted([("send", hidden)] * 4 + [("recv", 0)] * 4), transfers
