"""ZeRO levels 0-3 against torch FSDP2 and DDP on one model, in one interleaved run.

    python -m autopar.launch --nproc_per_node 4 benchmarks/bench_zero.py
    python -m autopar.launch --nproc_per_node 2 benchmarks/bench_zero.py --layers 2 --reps 5 --levels 2,3

Model: HuggingFace LlamaForCausalLM built from a config (no download; --hidden, --layers,
--vocab, ...), trained by `model(input_ids=ids, labels=ids).loss`, AdamW(lr=1e-3), a batch of
--batch sequences split over the ranks.  One step = forward, backward, optimizer step,
zero_grad, loss.item().
  autopar_z0..z3 : `parallelize(model, opt, mesh, {"dp_config": {"sharding_level": L}})`.
  autopar_z0_local : level 0 with `"input_source": "local"`, each rank fed its own rows as DDP is.
  autopar_z0_known : autopar_z0_local with the count of targets the job knows passed to HF's loss
                   (`num_items_in_batch`; no padding here): the loss a sum over it, no collective
                   in the forward, the whole model one local region.
  autopar_z0_static : autopar_z0_local's step captured once by `dist.to_static` and replayed.
  ddp            : torch DistributedDataParallel (what level 0 does).
  fsdp2          : `fully_shard` on every decoder layer and the model (what ZeRO-3 does).
  fsdp2_keep     : the same with reshard_after_forward=False (parameters stay gathered from
                   forward to backward: the ZeRO-2 comparison in FSDP2's terms).
  plain          : the single-process step on rank 0 (the others wait).
  no_comm        : each rank steps its own model on its own rows, sending nothing: the floor
                   of any data-parallel step here (its losses are its rows', not checked).
Checks: every other implementation's losses equal the single-process run's (rtol 1e-5).
Per implementation (one record each, rank 0's view, max over ranks where it says so):
  median/min/max ms per step, interleaved with the others (ratio_time_vs_z0 / vs the torch peer);
  collectives and bytes sent per step (autopar: comm_log; torch: its c10d ops, priced with
  the same bandwidth-optimal formula);
  memory, max over ranks: local bytes of parameters, gradients after backward, optimizer
  states; the peak of the parameter bytes held during a step (sharded pieces plus what
  ZeRO-3 / FSDP2 has gathered, sampled wherever a layer starts its forward or backward); on
  GPUs the peak of all memory allocated during a step above its start
  (torch.cuda.max_memory_allocated; a CPU has no such counter).
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import autopar as dist  # noqa: E402


def llama(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.heads // 2, max_position_embeddings=args.seq,
                      attn_implementation="eager", use_cache=False)  # (training: no key cache, for every impl)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


class C10dCounter(TorchDispatchMode):
    """torch's own collectives (DDP's and FSDP2's c10d ops) with the bytes this rank sends,
    priced like autopar's comm_log: all-gather its input to each peer, reduce-scatter and
    all-reduce (k-1)/k and 2(k-1)/k of the buffer."""

    def __init__(self):
        super().__init__()
        self.records: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func._schema.name.split("::")[-1]
            k = tdist.get_world_size()
            if name == "_allgather_base_":
                self.records.append(("all_gather", C._nbytes(args[1]) * (k - 1)))
            elif name == "_reduce_scatter_base_":
                self.records.append(("reduce_scatter", C._nbytes(args[0]) * (k - 1)))
            elif name == "allreduce_":
                self.records.append(("all_reduce", sum(2 * (k - 1) * C._nbytes(t) // k for t in args[0])))
            elif name not in ("barrier", "monitored_barrier"):
                self.records.append((name, 0))
        return func(*args, **(kwargs or {}))


class Runner:
    """`counted`: HF's loss as a sum over the count of targets, given (`num_items_in_batch`)."""

    def __init__(self, name, model, opt, batches, loss_of=None, counted=None):
        self.name, self.model, self.opt, self.batches = name, model, opt, batches
        self.loss_of = loss_of or (lambda loss: float(loss.item()))
        self.counted = {} if counted is None else {"num_items_in_batch": counted}
        self.losses: list = []

    def step(self, after_backward=None):
        ids = self.batches[len(self.losses) % len(self.batches)]
        loss = self.model(input_ids=ids, labels=ids, **self.counted).loss
        loss.backward()
        if after_backward is not None:
            after_backward()
        self.opt.step()
        self.opt.zero_grad()
        self.losses.append(self.loss_of(loss))


class StaticRunner(Runner):
    """The same step captured once by `dist.to_static`, then replayed."""

    def __init__(self, name, model, opt, batches):
        super().__init__(name, model, opt, batches)
        self.program = dist.to_static(model, None, lambda loss: loss, opt)

    def step(self, after_backward=None):
        ids = self.batches[len(self.losses) % len(self.batches)]
        self.losses.append(float(self.program(ids)))


def _pieces(tensors):
    return C.local_bytes([t for t in tensors if t is not None])


def gathered_bytes(model) -> int:
    """Bytes of the parameters ZeRO-3 (autopar's units) or FSDP2 holds gathered right now."""
    from autopar.runtime.zero import zero3

    gathered = [zero3.gathered_piece(p) for p in model.parameters()]
    # (a unit's pieces share one storage)
    total = sum({g.untyped_storage()._cdata: g.untyped_storage().nbytes() for g in gathered if g is not None}.values())
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state is not None else None
        if group is not None:
            total += sum(fp._unsharded_param.untyped_storage().nbytes() for fp in group.fsdp_params
                         if hasattr(fp, "_unsharded_param"))
    return total


def memory(runner) -> dict:
    """Local bytes held after one step, the gradients right after backward, and the peaks
    during the step."""
    model, opt = runner.model, runner.opt
    grads, seen = {}, [0]
    sharded = _pieces(model.parameters())
    sample = lambda *_: seen.__setitem__(0, max(seen[0], sharded + gathered_bytes(model)))  # noqa: E731
    hooks = [h for m in model.modules()
             for h in (m.register_forward_pre_hook(sample), m.register_full_backward_pre_hook(sample))]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    runner.step(lambda: grads.setdefault("b", _pieces(p.grad for p in model.parameters())))
    peak = torch.cuda.max_memory_allocated() - start if torch.cuda.is_available() else -1
    for h in hooks:
        h.remove()
    states = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    got = torch.tensor([sharded, grads["b"], _pieces(states), seen[0], peak], dtype=torch.int64)
    tdist.all_reduce(got, op=tdist.ReduceOp.MAX)
    keys = ("param_bytes", "grad_bytes_after_backward", "state_bytes", "peak_param_bytes", "peak_step_bytes")
    return {k: v for k, v in zip(keys, got.tolist()) if v >= 0}


def collectives(runner) -> tuple:
    if runner.name.startswith("autopar"):
        with dist.comm_log() as log:
            runner.step()
        return len(log), log.total_bytes(), sorted({r.op for r in log})
    counter = C10dCounter()
    with counter:
        runner.step()
    # the loss read of a torch peer (an all-reduce of one number) is not part of training
    records = [r for r in counter.records if r[1] > 8]
    return len(records), sum(b for _, b in records), sorted({op for op, _ in records})


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=4, help="steps before timing (local regions verify in the first three)")
    p.add_argument("--levels", "--stages", default="0,1,2,3", help="autopar ZeRO levels besides 0, e.g. 1,3")
    p.add_argument("--no-plain", action="store_true")
    args = p.parse_args()
    rank, k = C.setup()
    warnings.simplefilter("ignore")
    C.check(args.batch % k == 0, f"batch {args.batch} not divisible by {k} ranks")
    gen = torch.Generator().manual_seed(2024)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen) for _ in range(4)]
    per = args.batch // k
    mine = [b[rank * per:(rank + 1) * per] for b in batches]
    C.emit({"bench": "env", **C.env_info(), "ranks": k, "model": vars(args)})

    def global_loss(loss):  # torch peers see their own batch slice: the global mean loss
        t = loss.detach().clone()
        tdist.all_reduce(t)
        return float(t.item()) / k

    runners: dict = {}
    mesh = dist.ProcessMesh(list(range(k)), dim_names=["dp"])
    for level in sorted({0} | {int(s) for s in args.levels.split(",")}):
        model = llama(args)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = dist.parallelize(model, opt, mesh, {"dp_config": {"sharding_level": level}})
        runners[f"autopar_z{level}"] = Runner(f"autopar_z{level}", model, opt, batches)
    def fed_locally(model):
        """Level 0 fed as DDP is: each rank its own rows, used where they are (no hand-out from rank 0)."""
        return dist.parallelize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), mesh,
                                {"dp_config": {"sharding_level": 0, "input_source": "local"}})

    runners["autopar_z0_local"] = Runner("autopar_z0_local", *fed_locally(llama(args)), mine)
    # and with the count of targets known (no padding: every label but each row's first)
    runners["autopar_z0_known"] = Runner("autopar_z0_known", *fed_locally(llama(args)), mine,
                                         counted=torch.tensor(args.batch * (args.seq - 1)))
    runners["autopar_z0_static"] = StaticRunner("autopar_z0_static", *fed_locally(C.CausalLMLoss(llama(args))), mine)
    ddp = DistributedDataParallel(llama(args))
    runners["ddp"] = Runner("ddp", ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3), mine, global_loss)
    dmesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (k,), mesh_dim_names=("dp",))
    for name, reshard in (("fsdp2", True), ("fsdp2_keep", False)):
        model = llama(args)
        for layer in model.model.layers:
            fully_shard(layer, mesh=dmesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=dmesh, reshard_after_forward=reshard)
        runners[name] = Runner(name, model, torch.optim.AdamW(model.parameters(), lr=1e-3), mine, global_loss)
    model = llama(args)
    runners["no_comm"] = Runner("no_comm", model, torch.optim.AdamW(model.parameters(), lr=1e-3), mine)
    if not args.no_plain:
        model = llama(args)
        runners["plain"] = Runner("plain", model, torch.optim.AdamW(model.parameters(), lr=1e-3), batches)

    # warmup steps (untimed): local regions verify, FSDP2 lazily initialises; then one step each
    # for the collectives and one for the memory
    facts = {}
    for name, r in runners.items():
        for _ in range(args.warmup):
            C.barrier()
            if name != "plain" or rank == 0:
                r.step()
        C.barrier()
        if isinstance(r, StaticRunner):  # a replayed step has no backward to look into for memory
            facts[name] = collectives(r), {}
            r.step()  # (memory's step: the losses stay in line with the others')
        elif name not in ("plain", "no_comm"):
            facts[name] = collectives(r), memory(r)
        elif rank == 0:
            r.step(), r.step()
    C.barrier()

    fns = {name: r.step for name, r in runners.items()}
    times = C.interleaved(fns, reps=args.reps, warmup=1, only_rank0=frozenset({"plain"}))

    names = [n for n in runners if n not in ("plain", "no_comm")]
    if rank == 0 and "plain" in runners:
        ref = runners["plain"].losses
        for n in names:
            C.assert_close(torch.tensor(runners[n].losses), torch.tensor(ref), f"{n} vs single-process losses")
    st = {n: C.stats_ms(v) for n, v in times.items()}
    peers = {"autopar_z0": "ddp", "autopar_z0_local": "ddp", "autopar_z0_known": "ddp", "autopar_z0_static": "ddp",
             "autopar_z1": "ddp",
             "autopar_z2": "fsdp2_keep", "autopar_z3": "fsdp2"}
    peers = {n: peer for n, peer in peers.items() if n in runners}
    for n in runners:
        rec = {"bench": "zero_llama_step", "impl": n, "ranks": 1 if n == "plain" else k, **st[n]}
        if n in facts:
            (count, sent, ops), mem = facts[n]
            rec.update(collectives_per_step=count, bytes_sent_per_step=sent, ops=ops, **mem)
        if n not in ("plain", "no_comm"):
            rec["ratio_time_vs_no_comm"] = round(st[n]["median_ms"] / st["no_comm"]["median_ms"], 3)
        if n != "plain":
            rec["ratio_time_vs_autopar_z0"] = round(st[n]["median_ms"] / st["autopar_z0"]["median_ms"], 3)
        if n in peers:
            rec[f"ratio_time_vs_{peers[n]}"] = round(st[n]["median_ms"] / st[peers[n]]["median_ms"], 3)
        C.emit(rec)


if __name__ == "__main__":
    C.fail_loudly(main)
