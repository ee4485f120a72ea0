"""examples/train_gpt.py's GPT on 4 ranks: autopar DP and DPxTP vs torch DDP and DTensor TP + DP.

    python -m autopar.launch --nproc_per_node 4 benchmarks/bench_gpt.py

Model and data: train_gpt.GPT / train_gpt.batches with train_gpt's defaults (vocab 64, dim
64, 4 heads, 2 layers, seq 32, global batch 8, AdamW lr 3e-3); one step = forward,
cross-entropy, backward, optimizer step, zero_grad, loss.item().
  autopar_dp   : train_gpt.build on a 4x1 (dp, mp) mesh (mp=1: pure data parallel); the model
                 is one local region (verified on the first step, then plain torch ops).
  autopar_dp_loader : autopar_dp fed by `shard_dataloader` (each rank reads its rows of the same
                 batches).
  autopar_dp_counted : autopar_dp_loader with the targets counted by the loader (`count_items`: the
                 sum's 8-byte all-reduce posted a batch ahead) and the loss their sum over that
                 count: nothing moved in the forward.
  autopar_dp_op_by_op : the same with local regions off (every op through the dispatch).
  autopar_dp_sum : autopar_dp with the loss as cross_entropy(reduction="sum") / the global
                 count of targets (known here: none is ignored), as docs/training.md offers
                 when the count is known: the loss stays Partial, no collective before
                 backward, no gradient to scale (the mean's (sum, count) rides in the
                 gradient bucket and its gradients are scaled after backward).
  ddp          : torch DistributedDataParallel, each rank feeds its 2-sequence batch slice.
  autopar_dptp : train_gpt.build on a 2x2 (dp, mp) mesh (Megatron plan, incl. vocab-sharded
                 tok embedding and head).
  autopar_*_static : the same model and plan run by `dist.to_static` (the step captured once,
                 then replayed as a program of local ops and transfers).
  dtensor_dptp : 2-D DeviceMesh (dp=2, tp=2); parallelize_module per block with q,k,v,fc1
                 ColwiseParallel and proj,fc2 RowwiseParallel (tok/pos/ln/head replicated);
                 attention runs on the local heads (heads // tp, as torchtitan does); data
                 parallel by one flat all-reduce (mean) of all local grads over the dp group
                 after backward; each dp group feeds its 4-sequence batch slice.
  plain        : train_gpt.build(args, None) on rank 0 (other ranks wait in a barrier).
  no_comm      : each rank steps its own model on its DDP batch slice and sends nothing: the
                 floor of any data-parallel step here (its losses are its slice's, not checked).
With --accum K (K > 1) only data parallelism runs, one step = K micro-batches (the losses
divided by K, one optimizer step): autopar_dp_accum (regions notice the accumulation and
reduce once per step), ddp_accum (DDP as written: one all-reduce per micro-batch) and
ddp_accum_no_sync (the first K-1 backwards under `no_sync()`), against plain_accum; and
autopar_dp_accum_counted: the micro-batches from `shard_dataloader` with `count_items` over
each step's K (`count_window`), each loss a sum over that count (no collective in any forward).
Checks: per-step losses of every impl agree with the single-process run (rtol 1e-5,
atol 1e-5); distributed losses are global means (all-reduced where the impl reports a local one).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import _common as C  # noqa: E402

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import autopar as dist  # noqa: E402
import train_gpt as G  # noqa: E402
from autopar.runtime.local_region import local_regions  # noqa: E402


def local_heads_attention(tp):
    """Block.attention on the column-parallel q/k/v outputs: heads // tp local heads."""

    def attention(self, x):
        b, s, _ = x.shape
        h = self.heads // tp
        q, k, v = (f(x) for f in (self.q, self.k, self.v))
        dl = q.shape[-1]
        q, k, v = (t.view(b, s, h, dl // h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, dl))

    return attention


class StaticRunner:
    """One step of a `dist.to_static` model: forward, loss, backward and optimizer step."""

    def __init__(self, name, model, opt, data, vocab):
        self.name, self.opt, self.data = name, opt, data
        self.model = dist.to_static(model, None, lambda logits, y: F.cross_entropy(logits.reshape(-1, vocab),
                                                                                    y.reshape(-1)), opt)
        self.layer = model
        self.losses: list[float] = []

    def step(self):
        x, y = self.data[len(self.losses) % len(self.data)]
        self.losses.append(float(self.model(x, y)))


def accumulation_runners(args, k, rank, world, data, world_mean) -> tuple[dict, dict]:
    """The --accum runners and the peer each is compared with."""
    mesh = dist.ProcessMesh([[r] for r in range(world)], dim_names=["dp", "mp"])
    sh = lambda t: dist.shard_tensor(t, mesh, [dist.Shard(0), dist.Replicate()])  # noqa: E731
    m, o = G.build(args, mesh)
    runners = {"autopar_dp_accum": Runner("autopar_dp_accum", m, o, [(sh(x), sh(y)) for x, y in data], args.vocab,
                                          k=k)}
    C.check(len(data) % k == 0, f"--accum {k} must divide the {len(data)} batches (a count window per step)")
    m, o = G.build(args, mesh)
    runners["autopar_dp_accum_counted"] = LoaderRunner("autopar_dp_accum_counted", m, o, data, args.vocab, mesh, True,
                                                       k=k)
    per = args.batch // world
    ddata = [(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]) for x, y in data]
    for name in ("ddp_accum", "ddp_accum_no_sync"):
        torch.manual_seed(args.seed)
        dm = DDP(G.GPT(args.vocab, args.dim, args.heads, args.layers, args.seq))
        runners[name] = Runner(name, dm, torch.optim.AdamW(dm.parameters(), lr=args.lr), ddata, args.vocab,
                               loss_fn=world_mean, k=k, quiet=dm.no_sync if name.endswith("no_sync") else None)
    pm, po = G.build(args, None)
    runners["plain"] = Runner("plain", pm, po, data, args.vocab, k=k)
    return runners, {"autopar_dp_accum": ("ddp_accum", "ddp_accum_no_sync"),
                     "autopar_dp_accum_counted": ("ddp_accum_no_sync", "autopar_dp_accum")}


class Runner:
    """One optimizer step over `k` micro-batches (their losses divided by k); `quiet()` is the
    context of the first k-1 backwards (DDP's no_sync)."""

    def __init__(self, name, model, opt, data, vocab, after_backward=None, loss_fn=None, regions=True, k=1,
                 quiet=None, count=None):
        self.name, self.model, self.opt, self.data, self.vocab, self.k = name, model, opt, data, vocab, k
        self.count = count  # the global count of targets: the loss as their sum over it
        self.window = 1  # micro-batches the count covers: their losses already add up to the step's mean
        self.after_backward = after_backward
        self.loss_fn = loss_fn or (lambda loss: float(loss.item()))
        self.regions = regions
        self.quiet = quiet or contextlib.nullcontext
        self.losses: list[float] = []

    def batch(self) -> tuple:
        """The next (input, targets, their global count or None)."""
        x, y = self.data[len(self.losses) % len(self.data)]
        return x, y, self.count

    def step(self):
        with local_regions(self.regions):
            losses = []
            for j in range(self.k):
                x, y, count = self.batch()
                with self.quiet() if j < self.k - 1 else contextlib.nullcontext():
                    logits = self.model(x).reshape(-1, self.vocab)
                    if count is None:
                        loss = F.cross_entropy(logits, y.reshape(-1))
                    else:
                        loss = F.cross_entropy(logits, y.reshape(-1), reduction="sum") / count
                    (loss if self.k == self.window else loss / self.k).backward()
                if self.window == 1:
                    self.losses.append(self.loss_fn(loss))
                else:  # a count over the step: its losses read once, at its end, as a log would
                    losses.append(loss.detach())
            if losses:  # (each the micro-batch's mean, as the others')
                self.losses += [v * self.window for v in torch.stack(losses).tolist()]
            if self.after_backward is not None:
                self.after_backward()
            self.opt.step()
            self.opt.zero_grad()


class LoaderRunner(Runner):
    """Batches from `shard_dataloader` over the same data, each rank reading its rows; with
    `counted`, the targets counted by the loader (`count_items`, over the step's `k`
    micro-batches) and the loss a sum over that count."""

    def __init__(self, name, model, opt, data, vocab, mesh, counted, k=1):
        xs, ys = (torch.cat(t) for t in zip(*data))
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=len(data[0][0]))
        self.loader = dist.shard_dataloader(loader, mesh, shard_dims="dp", count_items=(lambda b: b[1].numel())
                                            if counted else None, count_window=k if counted else 1)
        self.batches = iter(())
        super().__init__(name, model, opt, data, vocab, k=k)
        self.window = k if counted else 1

    def batch(self) -> tuple:
        return (*self.next_rows(), self.loader.num_items_in_batch)

    def next_rows(self) -> tuple:
        """The loader's next (input, targets), a new epoch after its last."""
        x, y = next(self.batches, (None, None))
        if x is None:
            self.batches = iter(self.loader)
            x, y = next(self.batches)
        return x, y


def main():
    p = argparse.ArgumentParser()
    G.add_model_args(p)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step: run only the DP accumulation set")
    args = p.parse_args()
    rank, k = C.setup()
    warnings.simplefilter("default")
    tp, dp = args.tp, k // args.tp
    C.check(k % tp == 0 and args.batch % k == 0, "world must be divisible by tp and batch by world")
    C.emit({"bench": "env", **C.env_info(), "ranks": k})
    data = list(G.batches(args, 4))
    world_mean = lambda loss: _world_mean(loss, k)  # noqa: E731
    if args.accum > 1:
        runners, peers = accumulation_runners(args, args.accum, rank, k, data, world_mean)
        return report(runners, peers, rank, k, args, f"gpt_step_accum{args.accum}")

    runners: dict[str, Runner] = {}
    # autopar DP: (dp=k, mp=1)
    mesh_dp = dist.ProcessMesh([[r] for r in range(k)], dim_names=["dp", "mp"])
    m, o = G.build(args, mesh_dp)
    sh = lambda t, mesh: dist.shard_tensor(t, mesh, [dist.Shard(0), dist.Replicate()])  # noqa: E731
    runners["autopar_dp"] = Runner("autopar_dp", m, o, [(sh(x, mesh_dp), sh(y, mesh_dp)) for x, y in data], args.vocab)
    m, o = G.build(args, mesh_dp)
    runners["autopar_dp_sum"] = Runner("autopar_dp_sum", m, o, [(sh(x, mesh_dp), sh(y, mesh_dp)) for x, y in data],
                                       args.vocab, count=data[0][1].numel())
    m, o = G.build(args, mesh_dp)
    runners["autopar_dp_loader"] = LoaderRunner("autopar_dp_loader", m, o, data, args.vocab, mesh_dp, False)
    m, o = G.build(args, mesh_dp)
    runners["autopar_dp_counted"] = LoaderRunner("autopar_dp_counted", m, o, data, args.vocab, mesh_dp, True)
    m, o = G.build(args, mesh_dp)
    runners["autopar_dp_op_by_op"] = Runner("autopar_dp_op_by_op", m, o,
                                            [(sh(x, mesh_dp), sh(y, mesh_dp)) for x, y in data], args.vocab,
                                            regions=False)
    m, o = G.build(args, mesh_dp)
    runners["autopar_dp_static"] = StaticRunner("autopar_dp_static", m, o,
                                                [(sh(x, mesh_dp), sh(y, mesh_dp)) for x, y in data], args.vocab)

    # DDP
    torch.manual_seed(args.seed)
    dm = DDP(G.GPT(args.vocab, args.dim, args.heads, args.layers, args.seq))
    per = args.batch // k
    ddata = [(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]) for x, y in data]
    runners["ddp"] = Runner("ddp", dm, torch.optim.AdamW(dm.parameters(), lr=args.lr), ddata, args.vocab,
                            loss_fn=world_mean)

    torch.manual_seed(args.seed)
    nm = G.GPT(args.vocab, args.dim, args.heads, args.layers, args.seq)
    runners["no_comm"] = Runner("no_comm", nm, torch.optim.AdamW(nm.parameters(), lr=args.lr), ddata, args.vocab)

    # autopar DP x TP
    mesh_2d = dist.ProcessMesh(torch.arange(k).reshape(dp, tp).tolist(), dim_names=["dp", "mp"])
    m, o = G.build(args, mesh_2d)
    runners["autopar_dptp"] = Runner("autopar_dptp", m, o, [(sh(x, mesh_2d), sh(y, mesh_2d)) for x, y in data],
                                     args.vocab)
    m, o = G.build(args, mesh_2d)
    runners["autopar_dptp_static"] = StaticRunner("autopar_dptp_static", m, o,
                                                  [(sh(x, mesh_2d), sh(y, mesh_2d)) for x, y in data], args.vocab)

    # DTensor TP + manual DP
    dmesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(args.seed)
    tm = G.GPT(args.vocab, args.dim, args.heads, args.layers, args.seq)
    attn = local_heads_attention(tp)
    for blk in tm.blocks:
        parallelize_module(blk, dmesh["tp"], {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                                              "fc1": ColwiseParallel(), "proj": RowwiseParallel(),
                                              "fc2": RowwiseParallel()})
        blk.attention = attn.__get__(blk)
    dp_group = dmesh.get_group("dp")
    tparams = list(tm.parameters())

    def dp_allreduce():
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in tparams]
        flat = torch.cat([g.reshape(-1) for g in grads])
        tdist.all_reduce(flat, group=dp_group)
        flat /= dp
        off = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[off:off + n].view_as(g))
            off += n

    dpr = rank // tp
    pd = args.batch // dp
    tdata = [(x[dpr * pd:(dpr + 1) * pd], y[dpr * pd:(dpr + 1) * pd]) for x, y in data]
    runners["dtensor_dptp"] = Runner("dtensor_dptp", tm, torch.optim.AdamW(tm.parameters(), lr=args.lr), tdata,
                                     args.vocab, after_backward=dp_allreduce, loss_fn=world_mean)

    # single process
    pm, po = G.build(args, None)
    runners["plain"] = Runner("plain", pm, po, data, args.vocab)
    peer = {"autopar_dp": ("ddp", "no_comm"), "autopar_dp_sum": ("ddp", "autopar_dp"),
            "autopar_dp_loader": ("ddp", "autopar_dp"), "autopar_dp_counted": ("ddp", "autopar_dp_loader"),
            "autopar_dp_op_by_op": ("ddp",),
            "autopar_dp_static": ("ddp", "no_comm"), "ddp": ("no_comm",),
            "autopar_dptp": ("dtensor_dptp",), "autopar_dptp_static": ("dtensor_dptp",)}
    report(runners, peer, rank, k, args, "gpt_step")


def report(runners: dict, peer: dict, rank: int, k: int, args, bench: str) -> None:
    """Time every runner interleaved, check its losses against `plain`, emit one record each."""
    if rank != 0:
        runners["plain"].step = lambda: None
    fns = {n: r.step for n, r in runners.items()}
    times = C.interleaved(fns, reps=args.reps, warmup=args.warmup, only_rank0=frozenset({"plain"}))

    ref = runners["plain"].losses
    max_rel = {}
    if rank == 0:
        for n, r in runners.items():
            if n in ("plain", "no_comm"):
                continue
            C.assert_close(torch.tensor(r.losses), torch.tensor(ref), f"{n} vs single-process losses")
            max_rel[n] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r.losses, ref))

    st = {n: C.stats_ms(v) for n, v in times.items()}
    pbytes = {}
    for n, r in runners.items():
        states = [v for s in r.opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        layer = getattr(r, "layer", r.model)
        t = torch.tensor([C.local_bytes(layer.parameters()), C.local_bytes(states)], dtype=torch.int64)
        if n != "plain":
            tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        pbytes[n] = t.tolist()
    for n in runners:
        rec = {"bench": bench, "impl": n, "ranks": 1 if n == "plain" else k, "world": k, **st[n],
               "steps_checked": len(ref), "max_rel_loss_diff_vs_plain": max_rel.get(n),
               "loss_first_last": runners[n].losses[:1] + runners[n].losses[-1:],
               "param_bytes_per_rank": pbytes[n][0], "optim_state_bytes_per_rank": pbytes[n][1]}
        for other in peer.get(n, ()):
            rec[f"ratio_vs_{other}"] = round(st[n]["median_ms"] / st[other]["median_ms"], 3)
        if n != "plain":
            rec["ratio_vs_plain"] = round(st[n]["median_ms"] / st["plain"]["median_ms"], 3)
        C.emit(rec)
    C.emit({"bench": "rules_missing", "ranks": k, "ops": C.rule_warnings()})


def _world_mean(loss, k):
    t = loss.detach().clone()
    if isinstance(t, DTensor):
        t = t.full_tensor()
    tdist.all_reduce(t)
    return float(t.item()) / k


if __name__ == "__main__":
    C.fail_loudly(main)
