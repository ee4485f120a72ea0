"""`dist.simulate` on the meta device: the model and the batches are meta tensors, nothing
is allocated or computed, and the simulated rank still sends what the real rank sends,
collective for collective and byte for byte."""
import dataclasses

import torch

import autopar as dist
from distpool import run_dist
from hf_llama import batches, mp_plan, optimizer, tiny_llama
from plain_process import evaluated
from test_simulate import each_rank, logged_steps  # noqa: F401  (the plain processes call t.each_rank)


def mixed(device: str = "cpu", steps: int = 2) -> list:
    """Two steps of a tiny HF Llama on pp 2 x dp 2 x mp 2 (ZeRO-1 over dp); each step's
    comm_log as [(op, ranks, bytes, shape)]."""
    mesh = dist.ProcessMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], dim_names=["pp", "dp", "mp"])
    config = {"dp_config": {"sharding_level": 1}, "mp_config": {"parallelize_plan": mp_plan()},
              "pp_config": {"split_spec": "model.layers"}}
    return logged_steps(mesh, config, steps, device)


def test_a_meta_simulation_of_8_ranks_sends_what_the_real_ranks_send():
    simulated = evaluated("t.each_rank(8, t.mixed, 'meta')", "test_simulate_meta")
    real = run_dist(mixed, 8)
    assert all(len(steps) == 2 and all(steps) for steps in real)  # every rank communicates each step
    for rank in range(8):
        assert simulated[rank] == real[rank], rank


def value_reads() -> list:
    """A sharded meta tensor's reads: made-up values (zeros), no error."""
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    t = dist.shard_tensor(torch.ones(4, 2, device="meta"), mesh, [dist.Shard(0)])
    total = t.sum()
    return [total.item(), bool(total), float(total), int(total), t.tolist(), t.numpy().shape, "meta" in repr(t)]


def test_value_reads_under_a_meta_simulation_are_made_up_zeros():
    assert evaluated("t.each_rank(2, t.value_reads)", "test_simulate_meta") == [
        [0.0, False, 0.0, 0, [[0.0, 0.0]] * 4, [4, 2], True]] * 2


MP_SPLIT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def held(kind: str, device: str = "cpu") -> list:
    """A 4-rank job's memory after its second backward (AdamW, stepped once so that its
    states exist), as [parameters, gradients, optimizer states, activation peak] bytes of
    this rank."""
    from autopar.tools.simulate import SavedActivations, memory

    if kind == "dpmp":
        mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
        config = {"dp_config": {"sharding_level": 1}, "mp_config": {"parallelize_plan": mp_plan()}}
    else:
        mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
        config = {"dp_config": {"sharding_level": int(kind[-1])}}
    with torch.device(device):
        model = tiny_llama()
    model, opt = dist.parallelize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), mesh, config)
    with SavedActivations() as saved:
        for step, (ids, labels) in enumerate(batches(2)):
            model(input_ids=ids.to(device), labels=labels.to(device)).loss.backward()
            if step == 0:
                opt.step()
                opt.zero_grad()
    return list(dataclasses.astuple(memory(model, opt, saved)))


def _analytic(kind: str) -> list:
    """[parameters, gradients, optimizer states] bytes of a rank, from the parameter counts:
    a piece is 1/degree of its parameter (fp32), AdamW keeps 2 states per element and a
    4-byte step per parameter."""
    named = dict(tiny_llama().named_parameters())
    if kind == "dpmp":  # mp 2 splits the Megatron layers; ZeRO-1 over dp 2 the states
        params = sum(p.numel() // (2 if n.split(".")[-2] in MP_SPLIT else 1) for n, p in named.items()) * 4
        return [params, params, params + 4 * len(named)]
    n = sum(p.numel() for p in named.values()) * 4
    stage = int(kind[-1])
    return [n // 4 if stage == 3 else n, n // 4 if stage >= 2 else n, 2 * n // 4 + 4 * len(named)]


def test_a_meta_simulation_holds_what_the_real_rank_holds():
    peaks = {}
    for kind in ("zero1", "zero2", "zero3", "dpmp"):
        real = run_dist(held, 4, kind)
        assert evaluated("t.each_rank(4, t.held, %r, 'meta')" % kind, "test_simulate_meta") == real, kind
        for rank in range(4):
            assert real[rank][:3] == _analytic(kind), (kind, rank)
        peaks[kind] = [r[3] for r in real]
    # ZeRO shards no activation: every stage holds the same peak (ZeRO-3's gathered
    # parameters, which autograd saves, do not count as activations)
    assert peaks["zero1"] == peaks["zero2"] == peaks["zero3"] and min(peaks["zero1"]) > 0, peaks


PP, DP, MP = 4, 32, 8  # 1024 ranks
VOCAB, HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, BATCH, SEQ = 32000, 8192, 28672, 64, 8, 4, 2 * DP, 256


def big_job(sim, steps: int = 2) -> dict:
    """A Llama with 70B-sized layers (4 of them) on pp 4 x dp 32 x mp 8 with ZeRO-1, built on
    meta: this rank's parameter pieces, its memory after the first backward and after the
    first step, and the last step's collectives as [op, ranks, bytes, shape]."""
    from transformers import LlamaConfig, LlamaForCausalLM

    mesh = dist.ProcessMesh(torch.arange(PP * DP * MP).reshape(PP, DP, MP).tolist(), dim_names=["pp", "dp", "mp"])
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, attn_implementation="eager")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    config = {"dp_config": {"sharding_level": 1}, "mp_config": {"parallelize_plan": mp_plan()},
              "pp_config": {"split_spec": "model.layers"}}
    model, opt = dist.parallelize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), mesh, config)
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    out = {"pieces": {n: list(p._local.shape) for n, p in model.named_parameters() if p._local.numel()}}
    for step in range(steps):
        with dist.comm_log() as log:
            model(input_ids=ids, labels=ids).loss.backward()
            if step == 0:
                out["after_backward"] = list(dataclasses.astuple(sim.memory(model, opt)))
            opt.step()
            opt.zero_grad()
        if step == 0:
            out["after_step"] = list(dataclasses.astuple(sim.memory(model, opt)))
    out["log"] = [[r.op, list(r.ranks), r.bytes, list(r.shape)] for r in log]
    return out


def representatives_of_big_job() -> dict:
    """{rank: big_job} for one rank per pipeline stage, and the seconds it took."""
    import time

    start = time.perf_counter()
    mesh = dist.ProcessMesh(torch.arange(PP * DP * MP).reshape(PP, DP, MP).tolist(), dim_names=["pp", "dp", "mp"])
    out = {}
    for rank in dist.representative_ranks(mesh):
        with dist.simulate(PP * DP * MP, rank) as sim:
            out[rank] = big_job(sim)
    return {"jobs": out, "seconds": time.perf_counter() - start}


def _stage_pieces(stage: int) -> dict:
    """The shapes of a rank's parameter pieces on pipeline stage `stage`: Megatron's layers cut
    by mp, the rest whole (the vocabulary by mp in the LM head)."""
    kv = HIDDEN // HEADS * KV_HEADS
    pre = f"model.layers.{stage}."  # each stage holds one of the 4 layers
    pieces = {
        pre + "self_attn.q_proj.weight": [HIDDEN // MP, HIDDEN], pre + "self_attn.k_proj.weight": [kv // MP, HIDDEN],
        pre + "self_attn.v_proj.weight": [kv // MP, HIDDEN], pre + "self_attn.o_proj.weight": [HIDDEN, HIDDEN // MP],
        pre + "mlp.gate_proj.weight": [FFN // MP, HIDDEN], pre + "mlp.up_proj.weight": [FFN // MP, HIDDEN],
        pre + "mlp.down_proj.weight": [HIDDEN, FFN // MP],
        pre + "input_layernorm.weight": [HIDDEN], pre + "post_attention_layernorm.weight": [HIDDEN],
    }
    if stage == 0:
        pieces["model.embed_tokens.weight"] = [VOCAB, HIDDEN]
    if stage == PP - 1:
        pieces.update({"model.norm.weight": [HIDDEN], "lm_head.weight": [VOCAB // MP, HIDDEN]})
    return pieces


def test_one_rank_per_stage_of_a_1024_rank_job_on_meta_holds_and_sends_the_analytic_figures():
    got = evaluated("t.representatives_of_big_job()", "test_simulate_meta")
    assert got["seconds"] < 60, got["seconds"]
    jobs = {int(r): job for r, job in got["jobs"].items()}
    assert sorted(jobs) == [0, 256, 512, 768]  # the first rank of each stage
    activation = BATCH // DP * SEQ * HIDDEN * 4
    n_params = LAYERS * 9 + 3
    for stage, rank in enumerate(sorted(jobs)):
        job = jobs[rank]
        assert job["pieces"] == _stage_pieces(stage), stage
        params = sum(torch.Size(s).numel() for s in job["pieces"].values()) * 4
        assert job["after_backward"][:2] == [params, params]  # fp32 pieces and their gradients
        assert job["after_step"][2] == 2 * params // DP + 4 * n_params  # AdamW's states: ZeRO-1 over dp
        assert job["after_backward"][3] > 0
        log = [(op, len(ranks), b, shape) for op, ranks, b, shape in job["log"]]
        # ZeRO-1: the stage's gradients reduce-scattered over dp, the updated pieces all-gathered
        for op in ("reduce_scatter", "all_gather"):
            assert sum(b for o, k, b, _ in log if o == op and k == DP) == params * (DP - 1) // DP, (stage, op)
        # Megatron, all-reduced over mp: per layer the row-split outputs in forward and the
        # column-split inputs' gradients in backward; one more where the gradient a stage sends
        # back is reduced, and in the column-split LM head's backward; one less on the first
        # stage, whose embedding takes its input's gradient unreduced
        reduced = [(k, b) for o, k, b, shape in log if o == "all_reduce" and shape == [BATCH // DP, SEQ, HIDDEN]]
        count = 4 + (stage > 0) + (stage == PP - 1) - (stage == 0)
        assert reduced == [(MP, 2 * (MP - 1) * activation // MP)] * count, stage
        # the pipeline: activations to the same place on the next stage, their gradients back
        nxt, prev = rank + DP * MP, rank - DP * MP
        edges = [(op, ranks, b) for op, ranks, b, shape in job["log"] if shape == [BATCH // DP, SEQ, HIDDEN]
                 and op in ("send", "recv") and (nxt in ranks or prev in ranks)]
        expected = ([("recv", [prev, rank], 0), ("send", [rank, prev], activation)] if stage > 0 else [])
        expected += [("send", [rank, nxt], activation), ("recv", [nxt, rank], 0)] if stage < PP - 1 else []
        assert sorted(edges) == sorted(expected), stage


def _lm_loss(out, labels):
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten())


def scheduled_peak(mode: str, device: str = "cpu") -> int:
    """The activation peak of two steps of pp 2 x dp 2 by 4 micro-batches under `mode`.  The
    rotary embedding runs on every stage (`global_spec`): registered after the layers, it
    would sit on the last stage while the first calls it, and micro-batches in flight would
    cross its transfers with the stages' own."""
    from autopar.tools.simulate import SavedActivations, memory
    from autopar.pipelining import build_schedule

    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["pp", "dp"])
    config = {"dp_config": {"sharding_level": 0},
              "pp_config": {"split_spec": "model.layers", "global_spec": "model.rotary_emb",
                            "schedule_mode": mode, "accumulate_steps": 4}}
    with torch.device(device):
        model = tiny_llama()
    model, opt = dist.parallelize(model, optimizer(model.parameters()), mesh, config)
    schedule = build_schedule(model, _lm_loss)
    with SavedActivations() as saved:
        for ids, labels in batches(2, batch=8):
            schedule.step(ids.to(device), target=labels.to(device))
            opt.step()
            opt.zero_grad()
    return memory(model, opt, saved).activations_peak


def test_the_activation_peak_follows_the_pipeline_schedule_on_meta_as_in_the_real_run():
    peaks = {}
    for mode in ("FThenB", "1F1B"):
        peaks[mode] = run_dist(scheduled_peak, 4, mode)
        assert evaluated("t.each_rank(4, t.scheduled_peak, %r, 'meta')" % mode, "test_simulate_meta") == peaks[mode]
    # FThenB holds all 4 micro-batches' activations; 1F1B at most 2 on the first stage, 1 on the last
    assert all(b < a for a, b in zip(peaks["FThenB"], peaks["1F1B"])), peaks


def captured(level: int, device: str = "cpu") -> list:
    """Three `to_static` steps of data parallel with ZeRO stage `level` on 4 ranks; each
    step's comm_log as [(op, ranks, bytes, shape)]."""
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    with torch.device(device):
        model = tiny_llama()
    model, opt = dist.parallelize(model, optimizer(model.parameters()), mesh, {"dp_config": {"sharding_level": level}})
    step = dist.to_static(model, None, _lm_loss, opt)
    logs = []
    for ids, labels in batches(3):
        ids, labels = (dist.shard_tensor(t.to(device), mesh, [dist.Shard(0)]) for t in (ids, labels))
        with dist.comm_log() as log:
            step(ids, labels)
        logs.append([[r.op, list(r.ranks), r.bytes, list(r.shape)] for r in log])
    return logs


def test_a_captured_program_on_meta_sends_what_the_real_one_sends():
    for level in (0, 3):
        real = run_dist(captured, 4, level)
        assert all(all(steps) for steps in real)
        assert evaluated("t.each_rank(4, t.captured, %d, 'meta')" % level, "test_simulate_meta") == real, level
