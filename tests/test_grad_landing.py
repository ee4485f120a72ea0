"""Gradients written where their bucket reduces them (DDP's `gradient_as_bucket_view`): after
the first pre-step has packed a bucket, backward writes each first gradient into its slot of
the bucket's buffer, and a bucket whose gradients have all landed, each its parameter's
`.grad`, is all-reduced in place during backward (DDP's overlap).  The numbers stay the single
process's; the bytes stay the same; a gradient someone still holds is never written over; a
gradient that comes in parts (accumulation, a layer used twice) is reduced at the pre-step;
`autograd.grad`'s gradients are never reduced."""
import pytest
import torch

import autopar as dist
from autopar.runtime import grad_reduce
from autopar.tensor import grad_landing, riders
from distpool import run_dist
from example_scripts import example
import hf_llama

# a mean loss's (sum, count), carried by the first bucket reduced in backward (`deferred_mean`)
MEAN_BYTES = 4 * (riders.PIECES + 1)


def _landed(model) -> bool:
    """The gradients lie, last parameter first, whole and in order in one flat buffer."""
    locals_ = [p.grad._local for p in reversed(list(model.parameters())) if p.grad is not None]
    return grad_reduce._tiled(locals_) is not None


def _llama_dp(steps: int = 4, use_cache: bool = False):
    """HF Llama (each decoder layer a region of its own: the bucket spans regions; with HF's
    key cache the layers stay op by op and the gradients land through their hooks) under dp
    2: per step whether the gradients landed, the collectives of backward and of the step,
    and the training record."""
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model = hf_llama.tiny_llama(use_cache=use_cache)
    model, opt = dist.parallelize(model, hf_llama.optimizer(model.parameters()), mesh,
                                  {"dp_config": {"sharding_level": 0}})
    landed, in_backward, in_step, losses = [], [], [], []
    for ids, labels in hf_llama.batches(steps):
        loss = model(input_ids=ids, labels=labels).loss
        with dist.comm_log() as log:
            loss.backward()
        in_backward.append([(r.op, r.bytes) for r in log])
        landed.append(_landed(model))
        with dist.comm_log() as log:
            opt.step()
        in_step.append([(r.op, r.bytes) for r in log])
        opt.zero_grad()
        losses.append(loss.item())
    weights = {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}
    return landed, in_backward, in_step, (losses, weights, [])  # (reading a gradient would reduce it early)


@pytest.mark.parametrize("use_cache", [False, True], ids=["regions", "hooks"])
def test_gradients_land_in_their_bucket_reduced_in_backward_and_train_as_one_process(use_cache):
    ref = hf_llama.reference(hf_llama.batches(4))
    for landed, in_backward, in_step, got in run_dist(_llama_dp, 2, 4, use_cache):
        hf_llama.assert_matches(got, ref + ([],))
        # step 1 verifies the regions op by op and its pre-step packs the bucket, learning its
        # layout; from step 2 on the gradients are written into the bucket in backward, which
        # all-reduces it there, once its last gradient has landed
        assert landed == [False, True, True, True], landed
        # (the mean loss's (sum, count): reduced in step 1's forward, which the regions' check
        # records, then carried by the bucket)
        assert in_backward[0] == [] and [op for op, _ in in_step[0]] == ["all_reduce"], (in_backward, in_step)
        # the same bucket, whole: the bytes the pre-step sent at step 1, now sent in backward
        carried = [(op, n + MEAN_BYTES) for op, n in in_step[0]]
        assert all(b == carried and s == [] for b, s in zip(in_backward[1:], in_step[1:])), (in_backward, in_step)


def _gpt_dp_on_mp_of_one(steps: int = 5, distributed: bool = True):
    """The examples' GPT, its Megatron plan on a (dp, mp) mesh whose mp dim holds one rank
    (2 x 1), or in one process: per step the collectives of backward and of the step, the
    losses, the weights."""
    gpt = example("train_gpt")
    args = gpt.argparse.Namespace(vocab=64, dim=32, heads=4, layers=2, seq=8, batch=4, lr=1e-6, seed=0)
    mesh = dist.ProcessMesh([[0], [1]], dim_names=["dp", "mp"]) if distributed else None
    model, opt = gpt.build(args, mesh)
    place = (lambda t: dist.shard_tensor(t, mesh, [dist.Shard(0), dist.Replicate()])) if distributed else (lambda t: t)
    in_backward, in_step, losses = [], [], []
    for x, y in gpt.batches(args, steps):
        loss = torch.nn.functional.cross_entropy(model(place(x)).reshape(-1, args.vocab), place(y).reshape(-1))
        with dist.comm_log() as log:
            loss.backward()
        in_backward.append([(r.op, r.bytes) for r in log])
        with dist.comm_log() as log:
            opt.step()
        in_step.append([(r.op, r.bytes) for r in log])
        opt.zero_grad()
        losses.append(loss.item())
    weights = {k: dist.unshard_dtensor(v.detach()) if distributed else v for k, v in model.state_dict().items()}
    return in_backward, in_step, losses, weights


def test_on_a_mesh_with_a_dim_of_one_rank_buckets_are_reduced_in_backward_too():
    """The first step's gradients (op by op, while the region verifies) are placed otherwise
    on a mesh dim of one rank than the region's later ones (any placement is the same values
    there): the bucket learns them again at the next pre-step and is reduced in backward from
    step 3 on."""
    _, _, ref_losses, ref_weights = _gpt_dp_on_mp_of_one(distributed=False)
    for in_backward, in_step, losses, weights in run_dist(_gpt_dp_on_mp_of_one, 2):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for k, v in ref_weights.items():
            torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-5)
        assert [op for op, _ in in_step[0]] == ["all_reduce"], in_step
        assert in_backward[:2] == [[("all_reduce", 8)]] * 2, in_backward  # (the loss's (sum, count), posted)
        carried = [(op, n + MEAN_BYTES) for op, n in in_step[0]]
        assert all(b == carried and s == [] for b, s in zip(in_backward[2:], in_step[2:])), (in_backward, in_step)


def _accumulating(steps: int = 3, micro: int = 2):
    """HF Llama under dp 2, `micro` backwards per step: the first reduces its bucket in
    backward, the next ones add to gradients already reduced."""
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model = hf_llama.tiny_llama(use_cache=False)
    model, opt = dist.parallelize(model, hf_llama.optimizer(model.parameters()), mesh,
                                  {"dp_config": {"sharding_level": 0}})
    return _train_accumulating(model, opt, hf_llama.batches(steps * micro), micro, collective=True)


def _train_accumulating(model, opt, data, micro: int, collective: bool = False):
    """Train on `data`, `micro` backwards of loss / micro per step: (losses, final weights,
    the ops of each backward and each step when `collective`)."""
    losses, ops = [], []

    def logged(run):
        if not collective:
            return run()
        with dist.comm_log() as log:
            run()
        ops.append([r.op for r in log])

    for n, (ids, labels) in enumerate(data):
        loss = model(input_ids=ids, labels=labels).loss
        logged((loss / micro).backward)
        losses.append(loss.item())
        if n % micro == micro - 1:
            logged(opt.step)
            opt.zero_grad()
    weights = {k: (dist.unshard_dtensor(v.detach()) if collective else v.detach().clone())
               for k, v in model.state_dict().items()}
    return losses, weights, ops


def test_accumulation_after_a_bucket_reduced_in_backward_adds_up_as_one_process():
    model = hf_llama.tiny_llama(use_cache=False)
    ref = _train_accumulating(model, hf_llama.optimizer(model.parameters()), hf_llama.batches(6), 2)
    for losses, weights, ops in run_dist(_accumulating, 2):
        hf_llama.assert_matches((losses, weights, []), ref[:2] + ([],))
        # step 1 reduces at the pre-step; step 2's first backward reduces in backward, its
        # second finds the gradients reduced and makes them Partial again (no bytes): the
        # pre-step reduces the sum; the bucket stays with the pre-step from then on
        assert ops == [[], [], ["all_reduce"],
                       ["all_reduce"], [], ["all_reduce"],
                       [], [], ["all_reduce"]], ops


def _shared_layer(steps: int = 5):
    """HF Llama whose two decoder layers are one module (ALBERT's sharing: two regions share
    parameters), with small buckets: a bucket holding the shared layer's parameters starts in
    backward after the second use's gradients, and the first use's arrive while it runs."""
    caps = grad_reduce.FIRST_BUCKET_BYTES, grad_reduce.BUCKET_BYTES
    # buckets, last parameter first: the LM head and the final norm; the decoder layer's
    # parameters (144.5 KiB, a bucket of the exact size: the region reduces none itself); the
    # embedding
    grad_reduce.FIRST_BUCKET_BYTES, grad_reduce.BUCKET_BYTES = (128 * 64 + 64) * 4, 147968
    try:
        mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
        model = _shared(hf_llama.tiny_llama(use_cache=False))
        # a hook of the user's on the final norm keeps the base model op by op (a region would
        # run the hook on local pieces): its decoder layers are regions of their own
        model.model.norm.register_forward_hook(lambda *_: None)
        model, opt = dist.parallelize(model, hf_llama.optimizer(model.parameters()), mesh,
                                      {"dp_config": {"sharding_level": 0}})
        shared = [p for p in model.parameters() if p.__dict__.pop(grad_landing.IN_PARTS, False)]
        assert len(shared) == 9  # (parallelize sees the sharing; here it is hidden, as a functional reuse would be)
        again = []
        written_again = grad_landing.Landing.written_again
        grad_landing.Landing.written_again = lambda self, i: again.append(self.flight is not None) or written_again(self, i)
        try:
            return _train_accumulating(model, opt, hf_llama.batches(steps), 1, collective=True) + (again,)
        finally:
            grad_landing.Landing.written_again = written_again
    finally:
        grad_reduce.FIRST_BUCKET_BYTES, grad_reduce.BUCKET_BYTES = caps


def _shared(model):
    model.model.layers[1] = model.model.layers[0]
    return model


def test_a_parameter_used_twice_reduced_early_is_reduced_again_at_the_pre_step():
    model = _shared(hf_llama.tiny_llama(use_cache=False))
    ref = _train_accumulating(model, hf_llama.optimizer(model.parameters()), hf_llama.batches(5), 1)
    for losses, weights, ops, again in run_dist(_shared_layer, 2):
        hf_llama.assert_matches((losses, weights, []), ref[:2] + ([],))
        # once the layer runs as a region, its second use's gradients arrive while its
        # bucket, started after the first, is being reduced: they wait for it, and the
        # pre-step reduces the sum
        # (the layers verified at step 0; step 1: all three reduced in backward, the layer's
        # bucket again at the pre-step, as on every step from then on)
        assert again.count(True) == 1, again
        assert ops[2] == ["all_reduce"] * 3 and ops[3] == ["all_reduce"] * 2, ops
        assert all(op == "all_reduce" for op in ops[-1]) and ops[-1], ops


def _holding(drop_without_step: bool):
    """Hold a step's gradients (the DistTensors and a copy of their values) past `zero_grad`
    (after the step, or without one), then run the next backwards: the held gradients keep
    their values."""
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model = hf_llama.tiny_llama()
    model, opt = dist.parallelize(model, hf_llama.optimizer(model.parameters()), mesh,
                                  {"dp_config": {"sharding_level": 0}})
    data = hf_llama.batches(6)
    held, kept, landed = None, None, []
    for n, (ids, labels) in enumerate(data):
        model(input_ids=ids, labels=labels).loss.backward()
        landed.append(_landed(model))
        if held is not None:  # the gradients of the step before, written over would differ
            assert all(torch.equal(g._local, v) for g, v in zip(held, kept))
        if not (drop_without_step and n == 3):
            opt.step()  # (reduces the gradients in place: one holding them sees them reduced)
        if n == 3:
            held = [p.grad for p in model.parameters()]
            kept = [g._local.clone() for g in held]
        opt.zero_grad()
    return landed, all(torch.equal(g._local, v) for g, v in zip(held, kept))


def test_a_held_gradient_is_never_written_over():
    # step 1 verifies the regions op by op; the gradients land from step 2 on: past the held
    # ones into a fresh buffer, also after gradients dropped without a step
    for drop, expected in ((False, [False] + [True] * 5), (True, [False] + [True] * 5)):
        for landed, unchanged in run_dist(_holding, 2, drop):
            assert unchanged
            assert landed == expected, (drop, landed)


def _autograd_grad_after_landing():
    """After steps whose buckets were reduced in backward, `torch.autograd.grad` hands back
    this batch's gradients (Partial over dp: read whole, the batch's sum), with nothing sent
    in backward but the loss's (sum, count) as it reads the loss, and `.grad` stays untouched."""
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model = hf_llama.tiny_llama(use_cache=False)
    model, opt = dist.parallelize(model, hf_llama.optimizer(model.parameters()), mesh,
                                  {"dp_config": {"sharding_level": 0}})
    data = hf_llama.batches(4)
    _train_accumulating(model, opt, data[:3], 1)
    ids, labels = data[3]
    loss = model(input_ids=ids, labels=labels).loss
    params = list(model.parameters())
    with dist.comm_log() as log:
        grads = torch.autograd.grad(loss, params)
    return [(r.op, r.bytes) for r in log], [p.grad is None for p in params], [dist.unshard_dtensor(g) for g in grads]


def test_autograd_grad_gradients_are_never_reduced_early():
    model = hf_llama.tiny_llama(use_cache=False)
    data = hf_llama.batches(4)
    _train_accumulating(model, hf_llama.optimizer(model.parameters()), data[:3], 1)
    ids, labels = data[3]
    ref = torch.autograd.grad(model(input_ids=ids, labels=labels).loss, list(model.parameters()))
    for ops, no_grad, grads in run_dist(_autograd_grad_after_landing, 2):
        assert ops == [("all_reduce", 8)] and all(no_grad), (ops, no_grad)
        for g, r in zip(grads, ref):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def _zeroed_in_place(steps: int):
    """`zero_grad(set_to_none=False)`: the gradients reduced in backward are zeroed in place
    and the next backward adds to them."""
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model = hf_llama.tiny_llama(use_cache=False)
    model, opt = dist.parallelize(model, hf_llama.optimizer(model.parameters()), mesh,
                                  {"dp_config": {"sharding_level": 0}})
    losses = []
    for ids, labels in hf_llama.batches(steps):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        losses.append(loss.item())
    return losses, {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}


def test_gradients_zeroed_in_place_add_up_as_one_process():
    ref = hf_llama.reference(hf_llama.batches(4))
    for got in run_dist(_zeroed_in_place, 2, 4):
        hf_llama.assert_matches(got + ([],), ref + ([],))
