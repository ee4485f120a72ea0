"""HuggingFace transformers on autopar: the ops HF runs every step keep their shards, plans see
HF's keyword-only layer calls, and a parallelized model saves and loads with HF's own API;
each against the single-process run."""
import os
import warnings

import numpy as np
import pytest
import torch

import autopar as dist
from autopar.placement import Replicate, Shard
from autopar.spec import TensorMeta
from autopar.spmd import engine
from autopar.spmd.strategy import OpCall
from distpool import run_dist
from hf_llama import assert_matches, batches, mp_plan, optimizer, reference, tiny_llama, train
from opcheck import check

aten = torch.ops.aten
R, S0, S1 = Replicate(), Shard(0), Shard(1)


def _meta(*shape, dtype=torch.int64):
    return TensorMeta.contiguous(shape, dtype)


def test_isin_rule_follows_the_elements_and_keeps_test_elements_whole():
    mesh = dist.ProcessMesh([0, 1])
    x, test, out = _meta(4, 6), _meta(5), _meta(4, 6, dtype=torch.bool)
    call = OpCall(aten.isin.Tensor_Tensor, (x, test), {}, [x, test], [out])
    for cur in (S0, S1):
        ins, outs, _ = engine.choose(call, mesh, [(cur,), (R,)], False)
        assert ins == [(cur,), (R,)] and outs == [(cur,)]
    # a sharded test_elements is gathered (every element is looked up in all of it)
    ins, outs, _ = engine.choose(call, mesh, [(S0,), (S0,)], False)
    assert ins == [(S0,), (R,)] and outs == [(S0,)]
    call = OpCall(aten.isin.Tensor_Scalar, (x, 3), {}, [x], [out])
    assert engine.choose(call, mesh, [(S1,)], False)[1] == [(S1,)]
    scalar = OpCall(aten.isin.Scalar_Tensor, (3, test), {}, [test], [_meta(dtype=torch.bool)])
    assert engine.choose(scalar, mesh, [(S0,)], False)[0] == [(R,)]


def _isin_and_label_shift():
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    g = torch.Generator().manual_seed(2)
    # a batch of 4 divides over dp (flattening an uneven one moves rows: its pieces are not
    # the split rule's pieces of the flat tensor)
    ids, stop = torch.randint(0, 10, (4, 7), generator=g), torch.tensor([2, 3, 9])
    records = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, fn, placements in [
            ("isin", lambda x, t: torch.isin(x, t), [[S0], [R]]),
            ("isin_invert", lambda x, t: torch.isin(x, t, invert=True), [[S1], [R]]),
            ("isin_scalar", lambda x: torch.isin(x, 3), [[S0]]),
            # LlamaForCausalLM's loss: labels padded with ignore_index, shifted, flattened
            ("label_shift", lambda y: torch.nn.functional.pad(y, (0, 1), value=-100)[..., 1:].contiguous().view(-1),
             [[S0]]),
        ]:
            inputs = [ids, stop][: len(placements)]
            out, log = check(fn, inputs, placements, mesh, grad=False)
            records[name] = (out.placements, [(r.op, r.bytes) for r in log])
    missing = [str(w.message) for w in caught if "no sharding rule" in str(w.message)]
    return records, missing


def test_isin_and_the_hf_label_shift_move_no_bytes():
    for records, missing in run_dist(_isin_and_label_shift, 2):
        assert not missing, missing
        assert records == {
            "isin": ([S0], []), "isin_invert": ([S1], []), "isin_scalar": ([S0], []), "label_shift": ([S0], []),
        }


def _dp_generate(ids):
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model = dist.shard_layer(tiny_llama(), mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with dist.comm_log() as log:
            out = model.generate(dist.shard_tensor(ids, mesh, [S0]), max_new_tokens=4, do_sample=False,
                                 attention_mask=dist.shard_tensor(torch.ones_like(ids), mesh, [S0]), pad_token_id=0)
    missing = [str(w.message) for w in caught if "no sharding rule" in str(w.message)]
    return out.placements, dist.unshard_dtensor(out), missing, sorted({r.op for r in log})


def test_hf_generate_on_a_dp_sharded_batch_keeps_it_sharded():
    """Greedy generate (its stopping criteria call isin on the last tokens) on a batch split
    over dp: the tokens of one process, the batch never gathered."""
    ids = batches()[0][0][:, :6]
    ref = tiny_llama().generate(ids, max_new_tokens=4, do_sample=False, attention_mask=torch.ones_like(ids),
                                pad_token_id=0)
    for placements, tokens, missing, ops in run_dist(_dp_generate, 2, ids):
        assert placements == [S0] and not missing, (placements, missing)
        assert torch.equal(tokens, ref)
        assert "all_gather" not in ops, ops


def _dp_loss_traffic():
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model = tiny_llama()
    model, _ = dist.parallelize(model, optimizer(model.parameters()), mesh, {"dp_config": {"sharding_level": 0}})
    ids, labels = (dist.shard_tensor(t, mesh, [S0]) for t in batches()[0])
    with dist.comm_log() as log:
        loss = model(input_ids=ids, labels=labels).loss
    return loss.item(), [r.op for r in log]


def test_hf_causal_lm_loss_under_dp_gathers_no_labels():
    """The forward of a data-parallel LlamaForCausalLM with labels communicates only the loss's
    two scalar sums (the loss and the count of counted tokens), never the labels."""
    model = tiny_llama()
    ids, labels = batches()[0]
    ref = model(input_ids=ids, labels=labels).loss.item()
    for loss, ops in run_dist(_dp_loss_traffic, 2):
        np.testing.assert_allclose(loss, ref, rtol=1e-5)
        assert ops == ["all_reduce", "all_reduce"], ops


def _sequence_parallel_plan() -> dict:
    """mp_plan plus Megatron's sequence parallelism on HF's layout ([b, s, h] throughout, so
    no transposes): the norms run on sequence shards, attention and MLP on whole sequences.
    HF calls self_attn with keyword arguments only."""
    plan = mp_plan()
    plan.update({
        "model.embed_tokens": dist.SequenceParallelBegin(need_transpose=False),
        "model.layers.*.self_attn": dist.SequenceParallelDisable(need_transpose=False),
        "model.layers.*.mlp": dist.SequenceParallelDisable(need_transpose=False),
        "model.norm": dist.SequenceParallelEnable(),
        "lm_head": [dist.ColWiseParallel(), dist.SequenceParallelEnd(need_transpose=False)],
    })
    return plan


_SP_MESHES = {"mp": ([0, 1], ["mp"]), "dpxmp": ([[0, 1], [2, 3]], ["dp", "mp"])}


def _hf_sequence_parallel(layout):
    ids, names = _SP_MESHES[layout]
    mesh = dist.ProcessMesh(ids, dim_names=names)
    config = {"mp_config": {"parallelize_plan": _sequence_parallel_plan()}}
    if "dp" in names:
        config["dp_config"] = {"sharding_level": 0}
    model = tiny_llama()
    model, opt = dist.parallelize(model, optimizer(model.parameters()), mesh, config)
    grads = []
    losses = train(model, opt, batches(), grads=grads)
    with dist.comm_log() as log:
        model(input_ids=batches()[0][0])
    weights = {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}
    return (losses, weights, grads), [(r.op, r.bytes) for r in log]


@pytest.mark.parametrize("layout", ["mp", "dpxmp"])
def test_hf_llama_sequence_parallel_matches_one_process(layout):
    """With dp too, the sequence dim is read off the batch's split over dp ([b, s, h])."""
    ref_grads = []
    ref = (*reference(batches(), grads=ref_grads), ref_grads)
    for got, ops in run_dist(_hf_sequence_parallel, 2 if layout == "mp" else 4, layout):
        assert_matches(got, ref)
        # each sequence-parallel-disabled layer reduce-scatters its Partial output (2 per decoder
        # layer), never all-reduces it (with dp, HF's mask code reads a few scalars of the batch)
        assert [op for op, _ in ops].count("reduce_scatter") == 2 * 2, ops
        assert not [n for op, n in ops if op == "all_reduce" and n > 16], ops


class _KeywordsOnly(torch.nn.Module):
    def forward(self, **inputs):
        return inputs["x"] * 2


def test_a_plan_on_a_layer_called_without_its_first_input_names_plan_and_layer():
    mesh = dist.ProcessMesh([0], dim_names=["mp"])
    model = torch.nn.Sequential(_KeywordsOnly())
    model, _ = dist.parallelize(model, mesh=mesh,
                                config={"mp_config": {"parallelize_plan": {"0": dist.SequenceParallelEnable()}}})
    with pytest.raises(TypeError, match=r"SequenceParallelEnable on '0': .*without its first input.*\['x'\]"):
        model[0](x=torch.ones(2, 3, 4))


_LAYOUTS = {
    "mp": {"mp_config": {"parallelize_plan": mp_plan()}},
    "dp": {"dp_config": {"sharding_level": 0}},
    "zero3": {"dp_config": {"sharding_level": 3}},  # every parameter split over dp
}


def _save_pretrained(path, layout, tie, given):
    from transformers import LlamaForCausalLM

    mesh = dist.ProcessMesh([0, 1], dim_names=["mp" if layout == "mp" else "dp"])
    model = tiny_llama(tie=tie)
    model, opt = dist.parallelize(model, optimizer(model.parameters()), mesh, _LAYOUTS[layout])
    train(model, opt, batches(2))
    # HF's Trainer hands it the state dict (distributed tensors), a user mostly does not
    model.save_pretrained(path, **({"state_dict": model.state_dict()} if given else {}))
    # every rank returns once the files are complete, so each can read them at once
    return LlamaForCausalLM.from_pretrained(path).state_dict()


@pytest.mark.parametrize("layout,tie,given", [("mp", False, False), ("mp", True, False), ("zero3", False, False),
                                             ("mp", False, True)])
def test_save_pretrained_of_a_parallel_model_loads_in_one_process(tmp_path, layout, tie, given):
    """HF's own save_pretrained / from_pretrained: the trained weights, full, in one process."""
    from transformers import LlamaForCausalLM

    model = tiny_llama(tie=tie)
    train(model, optimizer(model.parameters()), batches(2))
    ids = batches()[2][0]
    for loaded in run_dist(_save_pretrained, 2, str(tmp_path), layout, tie, given):
        assert loaded.keys() == model.state_dict().keys()
        for k, v in model.state_dict().items():
            torch.testing.assert_close(loaded[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path)
    assert (reloaded.lm_head.weight is reloaded.model.embed_tokens.weight) == tie
    torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-6)


def _save_pretrained_blocked(path):
    """Rank 0, the writer, cannot write the weights file (a directory is in its place)."""
    os.makedirs(os.path.join(path, "model.safetensors"), exist_ok=True)
    mesh = dist.ProcessMesh([0, 1], dim_names=["mp"])
    model, _ = dist.parallelize(tiny_llama(), mesh=mesh, config=_LAYOUTS["mp"])
    try:
        model.save_pretrained(path)
    except dist.CheckpointError as e:
        return str(e)
    return "no error"


def test_save_pretrained_raises_the_writers_error_on_every_rank(tmp_path):
    for msg in run_dist(_save_pretrained_blocked, 2, str(tmp_path)):
        assert msg.startswith(f"save_pretrained({str(tmp_path)!r}) failed; the directory may be incomplete"), msg
        assert "[rank 0] SafetensorError" in msg and "Is a directory" in msg, msg


def _parallel(layout, data):
    """(model, optimizer, batches) under `layout`: parallelize's mp2 or dp2, or "dp_plain":
    shard_layer and a torch optimizer never given to shard_optimizer, batches split by hand."""
    mesh = dist.ProcessMesh([0, 1], dim_names=[layout[:2]])
    model = tiny_llama()
    if layout == "dp_plain":
        model = dist.shard_layer(model, mesh)
        return model, optimizer(model.parameters()), [tuple(dist.shard_tensor(t, mesh, [S0]) for t in b) for b in data]
    return (*dist.parallelize(model, optimizer(model.parameters()), mesh, _LAYOUTS[layout]), data)


def _resume_elsewhere(saved_layout, loaded_layout, path):
    """Two steps under one layout, a checkpoint, then a fresh model and optimizer under the
    other layout loaded by the load_state_dict recipe and trained two more steps."""
    model, opt, data = _parallel(saved_layout, batches(4))
    losses = train(model, opt, data[:2])
    dist.save_state_dict({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    model, opt, data = _parallel(loaded_layout, batches(4))
    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    dist.load_state_dict(state, path)
    opt.load_state_dict(state["opt"])
    losses += train(model, opt, data[2:3])
    # placed like the parameters by the first step after loading (and the second loss is right)
    placed = {name: [(v.process_mesh, v.placements) == (p.process_mesh, p.placements)
                     for v in opt.state[p].values() if v.dim() > 0]
              for name, p in model.named_parameters()}
    losses += train(model, opt, data[3:])
    return losses, {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}, placed


@pytest.mark.parametrize("saved,loaded", [("mp", "dp"), ("dp", "mp"), ("mp", "dp_plain")])
def test_optimizer_states_saved_under_one_layout_land_like_their_parameters_under_another(saved, loaded, tmp_path):
    """(SGD with momentum: its momentum buffers are states like AdamW's, and its update keeps
    rounding as rounding, see hf_llama.optimizer.)"""
    ref = reference(batches(4))
    for losses, weights, placed in run_dist(_resume_elsewhere, 2, saved, loaded, str(tmp_path / "ckpt")):
        assert all(flags == [True] for flags in placed.values()), placed
        assert_matches((losses, weights, []), (*ref, []))
