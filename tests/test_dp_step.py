"""A data-parallel step pays only what DDP pays: the batch each rank holds is used where it is
(dp_config input_source), and the loss stays Partial until it is read.  Numbers against one
process, collectives and bytes from `comm_log`."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import autopar as dist
from autopar.tensor import riders
from autopar.tensor.observers import watching
from distpool import run_dist

BATCH, IN, OUT = 6, 16, 8


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, 32), torch.nn.GELU(), torch.nn.Linear(32, OUT))


def _batches(n=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)) for _ in range(n)]


def _reference():
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    for x, y in _batches():
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def _what_rank_feeds(source, x, y, rank):
    """rank0: rank 0's batch is used, so the others pass anything of the shape; replicated:
    the whole batch everywhere; local: this rank's rows."""
    if source == "local":
        rows = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
        return x[rows], y[rows]
    if source == "rank0" and rank != 0:
        return torch.full_like(x, 7.0), torch.full_like(y, 7.0)
    return x, y


def _labels(y, mesh, source):
    """The labels placed as the model's input is, from the same source."""
    if source == "local":
        return dist.dtensor_from_local(y, mesh, [dist.Shard(0)], shape=(BATCH, OUT))
    return dist.shard_tensor(y, mesh, [dist.Shard(0)], src_data_rank=0 if source == "rank0" else None)


def _dp_steps(source):
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    rank = dist.get_rank()
    model, opt = dist.parallelize(_mlp(), None, mesh, {"dp_config": {"input_source": source}})
    opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    losses, logs = [], []
    for x, y in _batches():
        x, y = _what_rank_feeds(source, x, y, rank)
        with dist.comm_log() as log:
            out = model(x)
            loss = F.mse_loss(out, _labels(y, mesh, source))
            loss.backward()
            opt.step()
            opt.zero_grad()
        logs.append([(r.op, r.bytes) for r in log])
        losses.append(loss.item())
    return losses, {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}, logs, out.placements


GRAD_BYTES = 4 * (IN * 32 + 32 + 32 * OUT + OUT)


@pytest.mark.parametrize("source", ["rank0", "replicated", "local"])
def test_dp_batch_sources_match_one_process_and_move_only_what_they_must(source):
    ref_losses, ref_params = _reference()
    for rank, (losses, params, logs, placements) in enumerate(run_dist(_dp_steps, 2, source)):
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        for k, v in params.items():
            torch.testing.assert_close(v, ref_params[k], rtol=1e-5, atol=1e-6)
        assert placements == [dist.Shard(0)]
        for ops in logs:
            rows = [4 * (BATCH // 2) * IN, 4 * (BATCH // 2) * OUT]  # rank 0 sends rank 1 its rows of x and y
            moved = [("recv", 0)] * 2 if rank else [("send", n) for n in rows]
            batch = moved if source == "rank0" else []
            assert sorted(ops) == sorted(batch + [("all_reduce", GRAD_BYTES)]), ops


def _dp_steps_from_loader():
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    xs, ys = map(torch.cat, zip(*_batches()))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=BATCH)
    model, opt = dist.parallelize(_mlp(), None, mesh, {"dp_config": {}})
    opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    losses, logs = [], []
    batches = iter(dist.shard_dataloader(loader, mesh, shard_dims="dp"))
    for _ in range(len(loader)):
        with dist.comm_log() as log:
            x, y = next(batches)  # this rank reads only its rows
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        logs.append([(r.op, r.bytes) for r in log])
        losses.append(loss.item())
    return losses, {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}, logs


def test_dp_batches_from_shard_dataloader_are_used_where_they_are_read():
    ref_losses, ref_params = _reference()
    for losses, params, logs in run_dist(_dp_steps_from_loader, 2):
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        for k, v in params.items():
            torch.testing.assert_close(v, ref_params[k], rtol=1e-5, atol=1e-6)
        assert all(ops == [("all_reduce", GRAD_BYTES)] for ops in logs), logs


def _dp_steps_reading_the_loss_every(n, loss_of):
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model, _ = dist.parallelize(_mlp(), None, mesh, {"dp_config": {"input_source": "replicated"}})
    opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    losses, logs = [], []
    for i, (x, y) in enumerate(_batches(4)):
        with dist.comm_log() as log:
            loss = loss_of(model(x), y)
            placements = loss.placements
            loss.backward()
            opt.step()
            opt.zero_grad()
            if i % n == 0:  # a logging step
                losses.append(loss.item())
        logs.append([(r.op, r.bytes) for r in log])
    return losses, logs, placements


def _mse(out, y):
    return F.mse_loss(out, y)


def _reference_read_every(n, loss_of):
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    for i, (x, y) in enumerate(_batches(4)):
        loss = loss_of(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i % n == 0:
            losses.append(loss.item())
    return losses


def test_a_mean_loss_stays_partial_and_is_reduced_only_when_read():
    """Backward of a Partial(avg) loss needs no reduced value: a step that does not read the
    loss moves only the gradients; a logging step adds one 4-byte all-reduce."""
    ref = _reference_read_every(2, _mse)
    for losses, logs, placements in run_dist(_dp_steps_reading_the_loss_every, 2, 2, _mse):
        assert placements == [dist.Partial("avg")]
        np.testing.assert_allclose(losses, ref, rtol=1e-5)
        for i, ops in enumerate(logs):
            read = [("all_reduce", 4)] if i % 2 == 0 else []
            assert ops == [("all_reduce", GRAD_BYTES)] + read, (i, ops)


def _ce(out, y):
    target = y.argmax(-1)
    target = torch.where(torch.arange(target.shape[0]) < 2, -100, target)
    return F.cross_entropy(out, target)


def test_a_mean_cross_entropy_carries_its_count_in_the_gradient_bucket():
    """The exact mean of a cross-entropy divides by the count of targets it did not ignore over
    all ranks, which only the ranks' targets tell (no per-rank mean is exact when the counts
    differ, as here): each rank's (sum, count) rides in the gradient bucket's all-reduce (20
    bytes more; `tensor/deferred_mean.py`), so the step has no collective of its own; the loss
    is then Replicate and reading it moves nothing."""
    ref = _reference_read_every(2, _ce)
    for losses, logs, placements in run_dist(_dp_steps_reading_the_loss_every, 2, 2, _ce):
        assert placements == [dist.Replicate()]
        np.testing.assert_allclose(losses, ref, rtol=1e-5)
        # (the first step's bucket is reduced by the pre-step, which learns its layout: the pair
        # is posted as its backward ends)
        assert logs[0] == [("all_reduce", 8), ("all_reduce", GRAD_BYTES)], logs
        for ops in logs[1:]:
            assert ops == [("all_reduce", GRAD_BYTES + 4 * (riders.PIECES + 1))], ops


def _ce_sum_over_known_count(out, y):
    return F.cross_entropy(out, y.argmax(-1), reduction="sum") / BATCH


def test_a_summed_cross_entropy_over_a_known_count_moves_nothing_until_read():
    ref = _reference_read_every(2, _ce_sum_over_known_count)
    for losses, logs, placements in run_dist(_dp_steps_reading_the_loss_every, 2, 2, _ce_sum_over_known_count):
        assert placements == [dist.Partial("sum")]
        np.testing.assert_allclose(losses, ref, rtol=1e-5)
        for i, ops in enumerate(logs):
            assert ops == [("all_reduce", GRAD_BYTES)] + ([("all_reduce", 4)] if i % 2 == 0 else []), (i, ops)


def _static_steps(source):
    """The same data-parallel steps captured by `to_static` and replayed on new batches."""
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model, _ = dist.parallelize(_mlp(), None, mesh, {"dp_config": {"input_source": source}})
    opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    step = dist.to_static(model, None, F.mse_loss, opt)
    losses = []
    for x, y in _batches():
        x, y = _what_rank_feeds(source, x, y, dist.get_rank())
        losses.append(float(step(x, _labels(y, mesh, source))))
    return losses


def test_dp_batch_sources_under_to_static_replay_each_new_batch():
    ref_losses, _ = _reference()
    for source in ("rank0", "replicated", "local"):
        for losses in run_dist(_static_steps, 2, source):
            np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=source)


def _pipeline_fed_locally(static):
    """pp x dp: each dp rank of the first stage feeds its rows; the labels follow the model
    to the last stage."""
    import test_parallelize as P

    model = P._LossInside()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["pp", "dp"])
    config = {"pp_config": {"split_spec": "layers"}, "dp_config": {"input_source": "local"}}
    model, opt = dist.parallelize(model, opt, mesh, config)
    rows = slice(dist.get_rank() % 2 * 4, dist.get_rank() % 2 * 4 + 4)
    batches = [(x[rows], y[rows]) for x, y in P._batches((8, 16), (8, 16))]
    if static:
        step = dist.to_static(model, None, lambda loss: loss, opt)
        return [float(step(x, y)) for x, y in batches]
    return P._train(model, opt, batches, lambda model, x, y: model(x, y))


@pytest.mark.parametrize("static", [False, True])
def test_a_pipeline_fed_locally_matches_one_process(static):
    import test_parallelize as P

    ref = P._loss_inside(False)
    for losses in run_dist(_pipeline_fed_locally, 4, static):
        np.testing.assert_allclose(losses, ref, rtol=1e-5)


def _padded_llama_batches():
    """HF-style dict batches whose labels end in padding (-100), more of it in the second
    half of each batch: the ranks count different targets."""
    import hf_llama as L

    rows = []
    for b, (ids, labels) in enumerate(L.batches(5, batch=4)):
        for i, (row, lab) in enumerate(zip(ids, labels)):
            lab = lab.clone()
            lab[L.SEQ - (2 + 5 * (i >= 2) + i % 2 + b):] = -100  # (each batch counts other targets too)
            rows.append({"input_ids": row, "labels": lab})
    return rows


def _shifted_targets(batch) -> torch.Tensor:
    """The targets HF's causal-LM loss keeps: the labels shifted by one, padding ignored."""
    return (batch["labels"][..., 1:] != -100).sum()


def _llama_reference() -> list:
    import hf_llama as L

    model = L.tiny_llama(use_cache=False)
    opt = L.optimizer(model.parameters())
    losses = []
    for batch in torch.utils.data.DataLoader(_padded_llama_batches(), batch_size=4):
        loss = model(**batch).loss  # HF's mean over the targets not ignored
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _llama_counted_by_the_loader():
    import hf_llama as L

    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model = L.tiny_llama(use_cache=False)
    model, opt = dist.parallelize(model, L.optimizer(model.parameters()), mesh, {"dp_config": {}})
    loader = torch.utils.data.DataLoader(_padded_llama_batches(), batch_size=4)
    batches = dist.shard_dataloader(loader, mesh, shard_dims="dp", count_items=_shifted_targets)
    losses, handouts, forwards, backwards, placements, counts, dispatched = [], [], [], [], [], [], []
    it = iter(batches)
    for _ in range(len(loader)):
        with dist.comm_log() as handed:
            batch = next(it)
        ops = []
        with dist.comm_log() as forward, watching(type("Ops", (), {"see": lambda self, op, *a: ops.append(op)})()):
            loss = model(**batch).loss  # the loss divides by batch["num_items_in_batch"]
        dispatched.append(len(ops))
        with dist.comm_log() as backward:
            loss.backward()
            opt.step()
        opt.zero_grad()
        handouts.append([(r.op, r.bytes) for r in handed])
        forwards.append([(r.op, r.bytes) for r in forward])
        backwards.append([(r.op, r.bytes) for r in backward])
        placements.append(loss.placements)
        counts.append((int(batch["num_items_in_batch"]), int(batches.num_items_in_batch)))
        losses.append(loss.item())
    grads = sum(p.numel() * 4 for p in model.parameters())
    return losses, handouts, forwards, backwards, grads, placements, counts, dispatched


def test_a_loader_counting_the_targets_leaves_the_forward_no_collective():
    """HF's Llama with `num_items_in_batch` from `shard_dataloader(count_items=...)`: each rank
    counts its rows' targets, the loader sums the counts, the model's loss is a sum over it
    (Partial, nothing moved in the forward) and equals the single process's mean over the
    targets not ignored, though the ranks and the batches count differently.  The sum is an
    8-byte all-reduce posted a batch ahead until the gradient bucket starts in backward (from
    the second step, once the first pre-step has laid it out); from then on the next batch's
    count rides in it (16 bytes more) and the hand-out moves nothing.  After the first step
    (which verifies it) the whole model, LM head and loss included, runs as one local region
    for every count: no op dispatched."""
    ref = _llama_reference()
    want_counts = [int(_shifted_targets(b)) for b in torch.utils.data.DataLoader(_padded_llama_batches(), batch_size=4)]
    assert len(set(want_counts)) == 5
    for losses, handouts, forwards, backwards, grads, placements, counts, dispatched in run_dist(
            _llama_counted_by_the_loader, 2):
        np.testing.assert_allclose(losses, ref, rtol=1e-5)
        assert counts == [(n, n) for n in want_counts], counts
        # batches 0-2 counted before any bucket started in backward; 3 and 4 in the buckets
        # of steps 2 and 3 (no batch after the last: step 4's bucket carries nothing)
        assert handouts == [[("all_reduce", 8)]] * 3 + [[]] * 2, handouts
        carried = [grads] * 2 + [grads + 4 * riders.PIECES] * 2 + [grads]
        assert backwards == [[("all_reduce", n)] for n in carried], backwards
        assert forwards[1:] == [[]] * 4, forwards  # (the first forward verifies the model's local region)
        assert placements == [[dist.Partial("sum")]] * 5
        assert dispatched[0] > 0 and dispatched[1:] == [0] * 4, dispatched


class _TargetsPerRank(torch.utils.data.IterableDataset):
    """An iterable dataset (a loader read whole) yielding other targets on rank 0 than on
    rank 1: rank 0's batch is the one cut, so its targets are the ones to count."""

    def __iter__(self):
        ignored = dist.get_rank() == 0
        return iter([torch.tensor(-100 if ignored and i % 3 == 0 else i) for i in range(8)])


def _counts_of_a_loader_read_whole():
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    loader = torch.utils.data.DataLoader(_TargetsPerRank(), batch_size=4)
    batches = dist.shard_dataloader(loader, mesh, shard_dims="dp", count_items=lambda t: (t != -100).sum())
    return [(batches.num_items_in_batch.item(), dist.unshard_dtensor(b).tolist()) for b in batches]


def test_a_loader_read_whole_counts_the_batch_it_cuts():
    for got in run_dist(_counts_of_a_loader_read_whole, 2):
        assert got == [(2, [-100, 1, 2, -100]), (3, [4, 5, -100, 7])], got


def _counts_of_splitted_data():
    """Each rank's own loader yields its part of every batch (`is_dataset_splitted`)."""
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    mine = [[1, -100, 3], [-100, 6]] if dist.get_rank() == 0 else [[-100, 8], [9, 10]]
    loader = torch.utils.data.DataLoader([torch.tensor(v) for v in mine], batch_size=None)
    batches = dist.shard_dataloader(loader, mesh, shard_dims="dp", is_dataset_splitted=True,
                                    count_items=lambda t: (t != -100).sum())
    return [(int(batches.num_items_in_batch), tuple(b.shape)) for b in batches]


def test_a_loader_of_each_ranks_own_part_counts_every_part():
    for got in run_dist(_counts_of_splitted_data, 2):
        assert got == [(3, (5,)), (3, (4,))], got


def _resuming_a_counting_loader():
    mesh = dist.ProcessMesh([0], dim_names=["dp"])
    loader = torch.utils.data.DataLoader(torch.tensor([1, -100, 3, -100, -100, -100]), batch_size=2)
    count = lambda t: (t != -100).sum()  # noqa: E731
    first = dist.shard_dataloader(loader, mesh, shard_dims="dp", count_items=count)
    it = iter(first)
    assert next(it).tolist() == [1, -100] and first.num_items_in_batch.item() == 1
    state = first.state_dict()
    assert state["batches"] == 1
    resumed = dist.shard_dataloader(loader, mesh, shard_dims="dp", count_items=count)
    resumed.load_state_dict(state)
    assert [(b.tolist(), resumed.num_items_in_batch.item()) for b in resumed] == [([3, -100], 1), ([-100, -100], 0)]
    return True


def test_a_counting_loader_reads_ahead_but_resumes_after_what_it_handed_out():
    """The loader reads one batch ahead to post its count early; the state says how many it
    handed out, so a resumed loader gives the next one, counted."""
    assert run_dist(_resuming_a_counting_loader, 1) == [True]  # (a rank of its own: the test process joins no job)


def _refusals_of_count_items():
    mesh = dist.ProcessMesh([0], dim_names=["dp"])
    loader = torch.utils.data.DataLoader(torch.arange(4), batch_size=2)
    with pytest.raises(ValueError, match="count_items needs the batch on one mesh; this loader places it on 2"):
        dist.shard_dataloader(loader, [mesh, mesh], shard_dims="dp", count_items=len)
    with pytest.raises(TypeError, match="count_items must return an integer .* got 2.5"):
        next(iter(dist.shard_dataloader(loader, mesh, shard_dims="dp", count_items=lambda b: 2.5)))
    with pytest.raises(TypeError, match="got tensor\\(\\[1, 1\\]\\)"):
        next(iter(dist.shard_dataloader(loader, mesh, shard_dims="dp", count_items=lambda b: torch.ones(2).long())))
    dicts = torch.utils.data.DataLoader([{"x": 1, "num_items_in_batch": 2}] * 2, batch_size=2)
    with pytest.raises(ValueError, match="already has a 'num_items_in_batch' item"):
        next(iter(dist.shard_dataloader(dicts, mesh, shard_dims="dp", count_items=lambda b: 1)))
    return True


def test_count_items_refuses_what_it_cannot_count():
    assert run_dist(_refusals_of_count_items, 1) == [True]


def _windows(n=4):
    """The inputs and targets of n micro-batches, targets ignored (-100) unevenly over ranks
    and batches."""
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(n * BATCH, IN, generator=g)
    ts = torch.randint(0, OUT, (n * BATCH,), generator=g)
    ts[torch.tensor([0, 1, 2, 7, 8, 13, 15, 16, 17, 22])] = -100
    return xs, ts


def _accumulated_reference(k):
    xs, ts = _windows()
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    for w in range(0, len(xs), k * BATCH):  # one step: the mean over the window's targets
        loss = F.cross_entropy(model(xs[w:w + k * BATCH]), ts[w:w + k * BATCH])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {name: v.detach() for name, v in model.state_dict().items()}


def _accumulated_with_counts(k):
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model, _ = dist.parallelize(_mlp(), None, mesh, {"dp_config": {}})
    opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_windows()), batch_size=BATCH)
    batches = dist.shard_dataloader(loader, mesh, shard_dims="dp", count_items=lambda b: (b[1] != -100).sum(),
                                    count_window=k)
    losses, forwards, counts, total = [], [], [], 0.0
    for i, (x, t) in enumerate(batches):
        with dist.comm_log() as forward:
            loss = F.cross_entropy(model(x), t, reduction="sum") / batches.num_items_in_batch
        forwards.append([(r.op, r.bytes) for r in forward])
        counts.append(int(batches.num_items_in_batch))
        loss.backward()
        total = total + loss.detach()
        if i % k == k - 1:
            opt.step()
            opt.zero_grad()
            losses.append(total.item())
            total = 0.0
    return losses, {n: dist.unshard_dtensor(v.detach()) for n, v in model.state_dict().items()}, forwards, counts


def test_a_count_window_makes_accumulated_micro_batches_the_exact_mean_of_the_step():
    """`count_window=2`: each micro-batch's summed loss over the count of the step's two
    micro-batches adds up to the mean over the step's targets (HF's Trainer's count), with
    nothing moved in the micro-batches' forwards; weights as the single process's."""
    ref_losses, ref_params = _accumulated_reference(2)
    xs, ts = _windows()
    want = [int((ts[w:w + 2 * BATCH] != -100).sum()) for w in range(0, len(ts), 2 * BATCH) for _ in range(2)]
    for losses, params, forwards, counts in run_dist(_accumulated_with_counts, 2, 2):
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        for name, v in params.items():
            torch.testing.assert_close(v, ref_params[name], rtol=1e-5, atol=1e-6)
        assert counts == want and forwards == [[]] * 4, (counts, forwards)


def _counted_mlp():
    """The MLP under data parallel, its optimizer, and a loader counting the targets of
    `_windows(5)`'s batches."""
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model, _ = dist.parallelize(_mlp(), None, mesh, {"dp_config": {}})
    opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_windows(5)), batch_size=BATCH)
    return model, opt, dist.shard_dataloader(loader, mesh, shard_dims="dp", count_items=lambda b: (b[1] != -100).sum())


def _one_process(trained: list) -> tuple:
    """The single process's mean losses over `_windows(5)`'s batches in turn, each trained
    where `trained` says (else only evaluated), and each batch's count of targets."""
    xs, ts = _windows(5)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses, counts = [], []
    for i, train in enumerate(trained):
        rows = slice(i % 5 * BATCH, (i % 5 + 1) * BATCH)
        with torch.set_grad_enabled(train):
            loss = F.cross_entropy(model(xs[rows]), ts[rows])
        if train:
            loss.backward()
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        counts.append(int((ts[rows] != -100).sum()))
    return losses, counts


def _trained_and_evaluated(plan):
    """A counting loader's 5 batches an epoch, each trained or only evaluated as `plan` says
    (cross-entropy summed over the loader's count); each hand-out's collectives and count."""
    model, opt, batches = _counted_mlp()
    handouts, counts, losses, it = [], [], [], iter(())
    for train in plan:
        with dist.comm_log() as handed:
            x, t = next(it, (None, None))
            if x is None:  # (the next epoch)
                it = iter(batches)
                x, t = next(it)
        handouts.append([(r.op, r.bytes) for r in handed])
        counts.append(int(batches.num_items_in_batch))
        with torch.set_grad_enabled(train):
            loss = F.cross_entropy(model(x), t, reduction="sum") / batches.num_items_in_batch
        if train:
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return handouts, counts, losses


def test_a_count_rides_in_the_bucket_of_the_step_before_its_batch_or_is_posted():
    """Two epochs of 5 batches, the first trained for 3 batches then only evaluated.  Batch 3's
    count rides in step 2's bucket; batch 4's, offered then, finds no bucket (nothing trains)
    and is posted at its hand-out.  Each epoch's first count is needed at once (posted); the
    second epoch's second too (no bucket started while the first ended); from its third on
    every count rides.  Every count and loss is the single process's."""
    plan = [True] * 3 + [False] * 2 + [True] * 5
    want_losses, want_counts = _one_process(plan)
    posted = [("all_reduce", 8)]
    for handouts, counts, losses in run_dist(_trained_and_evaluated, 2, plan):
        assert counts == want_counts
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
        assert handouts == [posted] * 3 + [[], posted] + [posted] * 2 + [[]] * 3, handouts


def _a_backward_raising_with_a_count_in_flight():
    """Batch 3's backward raises at its end, before it settles its buckets: the last layer's
    (a bucket of its own), started as the first layer's gradients landed, carries batch 4's
    count; the loop skips that step.  Each hand-out's count and each loss."""
    from autopar.runtime import grad_reduce

    caps = grad_reduce.FIRST_BUCKET_BYTES
    grad_reduce.FIRST_BUCKET_BYTES = (32 * OUT + OUT) * 4  # (the last layer's weight and bias)
    try:
        return _raising_with_a_count_in_flight()
    finally:
        grad_reduce.FIRST_BUCKET_BYTES = caps


def _raising_with_a_count_in_flight():
    model, opt, batches = _counted_mlp()
    engine = torch.autograd.Variable._execution_engine
    counts, losses, raised = [], [], []

    def fail():
        raise RuntimeError("a skipped step")

    for i, (x, t) in enumerate(batches):
        counts.append(int(batches.num_items_in_batch))
        opt.zero_grad()  # (after the next batch's hand-out: nothing settled the bucket before it)
        loss = F.cross_entropy(model(x), t, reduction="sum") / batches.num_items_in_batch
        if i == 3:  # queued first, so it runs (and raises) before the bucket is settled
            loss.register_hook(lambda g: engine.queue_callback(fail) or g)
        try:
            loss.backward()
            opt.step()
        except RuntimeError as e:
            raised.append((i, str(e)))
        losses.append(float(loss))
    return counts, losses, raised


def test_a_count_in_the_bucket_of_a_backward_that_raised_still_arrives():
    """The next batch's count rode in a bucket that a raising backward left in flight: its
    hand-out settles that bucket (the counts and losses are the single process's, the
    raising step skipped)."""
    want_losses, want_counts = _one_process([i != 3 for i in range(5)])  # (the raising step skipped)
    for counts, losses, raised in run_dist(_a_backward_raising_with_a_count_in_flight, 2):
        assert raised == [(3, "a skipped step")]
        assert counts == want_counts
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5)


def _static_steps_over_the_loaders_count():
    model, opt, batches = _counted_mlp()
    step = dist.to_static(model, batches, lambda out, t: F.cross_entropy(out, t, reduction="sum")
                          / batches.num_items_in_batch, opt)
    return [float(step(x, t)) for x, t in batches]


def test_a_captured_step_divides_by_each_batchs_count_from_the_loader():
    """`to_static`'s step dividing by `loader.num_items_in_batch` replays with each batch's
    count (the loader writes each count into the one tensor the program captured): the
    single process's mean losses, though the batches count differently."""
    want, counts = _one_process([True] * 5)
    assert len(set(counts)) > 2
    for losses in run_dist(_static_steps_over_the_loaders_count, 2):
        np.testing.assert_allclose(losses, want, rtol=1e-5)


def _resuming_a_count_window():
    mesh = dist.ProcessMesh([0], dim_names=["dp"])
    loader = torch.utils.data.DataLoader(torch.tensor([1, -100, 3, 4, -100, -100, 7, 8]), batch_size=2)
    count = lambda t: (t != -100).sum()  # noqa: E731
    batches = dist.shard_dataloader(loader, mesh, shard_dims="dp", count_items=count, count_window=2)
    assert [(b.tolist(), int(batches.num_items_in_batch)) for b in batches] == [
        ([1, -100], 3), ([3, 4], 3), ([-100, -100], 2), ([7, 8], 2)]
    it = iter(batches)
    next(it)
    mid_window = batches.state_dict()
    resumed = dist.shard_dataloader(loader, mesh, shard_dims="dp", count_items=count, count_window=2)
    resumed.load_state_dict(mid_window)
    with pytest.raises(ValueError, match="handed out 1 batches, not a whole number of count windows of 2"):
        next(iter(resumed))
    next(it)
    resumed.load_state_dict(batches.state_dict())
    assert [(b.tolist(), int(resumed.num_items_in_batch)) for b in resumed] == [([-100, -100], 2), ([7, 8], 2)]
    with pytest.raises(ValueError, match="count_window is the number of batches count_items counts together"):
        dist.shard_dataloader(loader, mesh, shard_dims="dp", count_window=2)
    return True


def test_a_count_window_resumes_only_at_a_window_boundary():
    assert run_dist(_resuming_a_count_window, 1) == [True]


class _Checkpointed(torch.nn.Module):
    """`_mlp` with its last layers under a reentrant checkpoint (whose backward accumulates
    into their parameters from a backward of its own)."""

    def __init__(self):
        super().__init__()
        self.net = _mlp()

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.net[1:], self.net[0](x), use_reentrant=True)


def _model(mode):
    return _Checkpointed() if mode == "reentrant checkpoint" else _mlp()


def _sgd_one_process(mode):
    """The single process's mean cross-entropy over `_windows(5)`'s batches under SGD (whose
    step, unlike Adam's, shows a gradient's scale): each batch's loss and gradients; with
    `mode` "accumulate" the gradients of two batches add up before each step."""
    xs, ts = _windows(5)
    model = _model(mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads = [], []
    for i in range(5):
        rows = slice(i * BATCH, (i + 1) * BATCH)
        loss = F.cross_entropy(model(xs[rows]), ts[rows])
        loss.backward()
        losses.append(loss.item())
        grads.append([p.grad.clone() for p in model.parameters()])
        if mode != "accumulate" or i % 2 == 1:
            opt.step()
            opt.zero_grad()
    return losses, grads


def _deferred_mean_steps(mode):
    """`_sgd_one_process` under data parallel on 2 ranks, the loss read after each step
    ("read after"), before its backward ("read before"), or gradients accumulated over two
    batches ("accumulate"); each step's loss, gradients, and the collectives of its forward,
    backward and read."""
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model = _model(mode)
    level = {"zero2": 2, "zero3": 3}.get(mode, 0)
    model, opt = dist.parallelize(model, torch.optim.SGD(model.parameters(), lr=0.5), mesh,
                                  {"dp_config": {"sharding_level": level}})
    xs, ts = _windows(5)
    losses, grads, logs = [], [], []
    for i in range(5):
        rows = slice(i * BATCH, (i + 1) * BATCH)
        x, t = (dist.shard_tensor(v[rows], mesh, [dist.Shard(0)]) for v in (xs, ts))
        with dist.comm_log() as forward:
            loss = F.cross_entropy(model(x), t)
        with dist.comm_log() as read_before:
            if mode == "read before":
                losses.append(loss.item())
        with dist.comm_log() as backward:
            if mode == "given gradient":  # (made without reading the loss: reduced in the backward)
                loss.backward(dist.shard_tensor(torch.ones(()), mesh, [dist.Replicate()], src_data_rank=None))
            else:
                loss.backward()
        with dist.comm_log() as read_after:
            if mode != "read before":
                losses.append(loss.item())
        grads.append([dist.unshard_dtensor(p.grad).clone() for p in model.parameters()])  # (a view: later steps add to it)
        if mode != "accumulate" or i % 2 == 1:
            opt.step()
            opt.zero_grad()
        logs.append([[(r.op, r.bytes) for r in log] for log in (forward, read_before, backward, read_after)])
    return losses, grads, logs


def _bucket_bytes():
    return 4 * sum(p.numel() for p in _mlp().parameters())


@pytest.mark.parametrize("mode", ["read after", "read before", "accumulate", "reentrant checkpoint", "zero2", "zero3",
                                  "given gradient"])
def test_a_mean_loss_is_reduced_in_the_gradient_bucket_not_before_backward(mode):
    """The mean cross-entropy over targets ignored unevenly on the ranks: its forward moves
    nothing.  Backpropagated before anything reads it, its backward runs with the count taken
    as every target while the ranks' (sum, count) ride in the gradient bucket (20 bytes; the
    first step, whose bucket is reduced by the optimizer's pre-step, posts them as the
    backward ends), and the gradients are scaled by the count once it arrives; the loss is
    then read for free.  Read before its backward, backpropagated onto gradients already there
    (accumulation), through a reentrant checkpoint (whose own backward reaches leaves the
    factor would not) or under ZeRO-2/3 (which move gradients off their leaves in backward), it
    is reduced where it is read, as the exact forward did; backpropagated from a gradient given
    to it, in that backward.  Losses and gradients are the single process's in every case."""
    ref_losses, ref_grads = _sgd_one_process(mode)
    grads_bytes = _bucket_bytes()
    for losses, grads, logs in run_dist(_deferred_mean_steps, 2, mode):
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        for step, (got, want) in enumerate(zip(grads, ref_grads)):
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=f"step {step}")
        forwards, read_before, backwards, read_after = zip(*logs)
        assert all(op == "all_gather" for ops in forwards for op, _ in ops), forwards  # (ZeRO-3's parameters)
        if mode == "read after":
            assert backwards == ([("all_reduce", 8)],) + ([("all_reduce", grads_bytes + 20)],) * 4, backwards
            assert read_after == ([],) * 5 and read_before == ([],) * 5
        elif mode == "read before":
            assert read_before == ([("all_reduce", 8)],) * 5 and read_after == ([],) * 5
            assert backwards == ([],) + ([("all_reduce", grads_bytes)],) * 4, backwards
        elif mode == "given gradient":
            assert all(ops[0] == ("all_reduce", 8) for ops in backwards), backwards
        elif mode == "reentrant checkpoint":
            assert all(ops[0] == ("all_reduce", 8) for ops in backwards), backwards  # (reduced as backward starts)


class _Refused(RuntimeError):
    pass


def _mean_backward_that_raises():
    """`_deferred_mean_steps`' training, the third backward raising from a hook on the logits'
    gradient (with the pair riding: a leaf's hook would have it reduced before): the loss is
    still read whole, and the next steps train as if that batch had been skipped."""
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model, _ = dist.parallelize(_mlp(), None, mesh, {"dp_config": {}})
    opt = dist.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    xs, ts = _windows(5)
    losses, raised = [], []
    for i in range(5):
        rows = slice(i * BATCH, (i + 1) * BATCH)
        x, t = (dist.shard_tensor(v[rows], mesh, [dist.Shard(0)]) for v in (xs, ts))
        logits = model(x)
        handle = logits.register_hook(lambda g: (_ for _ in ()).throw(_Refused())) if i == 2 else None
        loss = F.cross_entropy(logits, t)
        try:
            loss.backward()
            opt.step()
        except _Refused:
            raised.append(i)
        finally:
            if handle is not None:
                handle.remove()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, raised


def test_a_mean_loss_whose_backward_raises_is_read_whole_and_training_goes_on():
    xs, ts = _windows(5)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref = []
    for i in range(5):
        rows = slice(i * BATCH, (i + 1) * BATCH)
        loss = F.cross_entropy(model(xs[rows]), ts[rows])
        if i != 2:
            loss.backward()
            opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    for losses, raised in run_dist(_mean_backward_that_raises, 2):
        assert raised == [2]
        np.testing.assert_allclose(losses, ref, rtol=1e-5)
