"""torch's OpInfo database on a gloo world: autopar and DTensor against one process, op by op.

    python benchmarks/opinfo_sweep.py                            # every op (spawns its 2 ranks)
    python benchmarks/opinfo_sweep.py --ops add,linalg.eig --samples 3
    python benchmarks/opinfo_sweep.py --summary benchmarks/results/opinfo_2ranks.<commit>-1.jsonl

Every OpInfo of `op_db` (its function variant), in fp32 and complex64 where the op supports them
(an op with neither: its first integer or bool dtype), the first `--samples` samples, each
sample's tensors (input, args, kwargs, tensor lists) placed Shard(0), Replicate or Shard(-1)
(a 0-dim tensor stays Replicate; a placement that places every tensor as an earlier one does is
not run twice).  A case is (op, dtype, sample, placement, fwd | grad); each runs through autopar
(`shard_tensor`) and DTensor (`distribute_tensor`) and is compared with the single-process run of
the same sample:
  fwd   every output (tensors and Python numbers): shape, dtype, values;
  grad  the gradients of the differentiable inputs of sum(out * w) over the floating outputs
        (after the sample's output_process_fn_grad; w random, seeded; the real part for complex);
        a gradient the single process has and the distributed run lacks is wrong.
Tolerances: rtol = atol = 1e-5 (tests/opcheck.py), or the op's own toleranceOverride /
precisionOverride in the OpInfo where looser; NaN equals NaN.  An op whose output depends on
the random stream (two seeds give two results) is compared by shape and dtype only.
Classes, worst first: wrong (a value, shape, dtype or gradient differs), crash (a rank died,
hung or the world fell out of step: restarted, recorded), error (the library raised; the first
line of the message is kept), fallback (right, but autopar warned "no sharding rule for <op>":
the aten ops are recorded), pass.  A sample whose single-process run raises, or (without
--sparse) that holds a sparse tensor, is recorded as a skip and not counted.

The ranks are tests/distpool.py's pool.  After every case the ranks agree on its outcome (a
gather on a group of its own).  A case some ranks raised on and others did not (or raised
differently) is recorded with each rank's message; a probe then checks that collectives still
pair up, and the world restarts where they do not.  A rank that dies or hangs (collective
timeouts 20 s) is killed with its world: the case is recorded as a crash and the sweep goes on
from the next one.

Results: JSON lines (an "env" record, then one record per case and library) under
benchmarks/results/opinfo_<N>ranks.<commit>-<run>.jsonl, and a summary in Markdown (counts per
class, the wrong cases, the errors grouped, the fallback ops).  Run it on a snapshot of the
library (run_all.sh's way) when others edit autopar/ meanwhile.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import gzip
import itertools
import json
import math
import os
import random
import re
import signal
import sys
import time
import traceback
import warnings
import zlib

import torch

PLACEMENTS = ("S(0)", "R", "S(-1)")
LIBS = ("autopar", "dtensor")
SEVERITY = ("wrong", "crash", "error", "fallback", "pass")  # worst first; "skip" is not a case
RTOL = ATOL = 1e-5  # tests/opcheck.py's
_FALLBACK = re.compile(r"autopar: no sharding rule for (\S+);")
_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)


# -- the cases ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Selection:
    """Which cases to run.  `ops`: full names ("softmax.with_dtype"; a name no op has as its
    full name selects every variant of that op); None is every op.  `chunk` (i, n): ops i,
    i + n, i + 2n... of that list.  `fast`: the suite's selection (two samples, see
    `fast_plan`).  `libs`: the libraries run on each case.  `sparse`: run the samples holding
    sparse tensors too (else each is recorded as a skip, see SPARSE)."""

    ops: tuple | None = None
    chunk: tuple = (0, 1)
    samples: int = 10
    placements: tuple = PLACEMENTS
    fast: bool = False
    libs: tuple = LIBS
    sparse: bool = False


def op_db():
    from torch.testing._internal.common_methods_invocations import op_db as db

    return db


def full_name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def select_ops(sel: Selection) -> list:
    """The OpInfos of the selection, in op_db's order."""
    ops = op_db()
    if sel.ops is not None:
        wanted = set(sel.ops)
        full = {full_name(op) for op in ops}
        ops = [op for op in ops if full_name(op) in wanted or (op.name in wanted and op.name not in full)]
        unknown = wanted - {full_name(op) for op in ops} - {op.name for op in ops}
        if unknown:
            raise ValueError(f"no OpInfo named {sorted(unknown)}")
    i, n = sel.chunk
    return ops[i::n]


def dtypes_for(op) -> list:
    """fp32 and complex64 where the op has them on CPU; an op with neither: its first integer
    or bool dtype (none at all: not run)."""
    have = op.supported_dtypes("cpu")
    out = [d for d in (torch.float32, torch.complex64) if d in have]
    if not out:
        out = [d for d in (torch.int64, torch.int32, torch.bool, torch.uint8, torch.float64) if d in have][:1]
    return out


def seed_of(*parts) -> int:
    """A seed from names (stable across runs and processes, unlike hash())."""
    return zlib.crc32("/".join(map(str, parts)).encode())


def _seed(seed: int) -> None:
    """Seed the CPU generator the sweep's ops draw from (`torch.manual_seed` also seeds every
    accelerator module, a millisecond a call with CPU-only torch: seconds over the sweep)."""
    torch.random.default_generator.manual_seed(seed)


def make_samples(op, dtype, n: int) -> list:
    """The first n samples, seeded by op and dtype: `--ops` reruns draw the sweep's samples."""
    seed = seed_of(full_name(op), dtype)
    _seed(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    grad = op.supports_autograd and (dtype.is_floating_point or dtype.is_complex)
    with warnings.catch_warnings(), _test_fn_found_by_frames():
        warnings.simplefilter("ignore")
        return list(itertools.islice(op.sample_inputs("cpu", dtype, requires_grad=grad), n))


def _test_fn_of_the_stack():
    """torch's `extract_test_fn` (the unittest test running, found on the stack; None here)
    over the same frames without `inspect.stack()`, which reads every frame's source file
    and searches sys.modules for it: twice per `sample_inputs`, a third of the sweep's time."""
    import unittest

    try:
        frame = sys._getframe(1)
        while frame is not None:
            self_val = frame.f_locals.get("self")
            if isinstance(self_val, unittest.TestCase):
                *_, cls_name, test_name = self_val.id().rsplit(".", 2)
                if cls_name == type(self_val).__name__ and test_name.startswith("test"):
                    return getattr(self_val, test_name).__func__
            frame = frame.f_back
    except Exception:
        pass
    return None


@contextlib.contextmanager
def _test_fn_found_by_frames():
    """`_test_fn_of_the_stack` in place of torch's `extract_test_fn` while samples are drawn."""
    from torch.testing._internal import common_utils
    from torch.testing._internal.opinfo import core

    saved = common_utils.extract_test_fn, core.extract_test_fn
    common_utils.extract_test_fn = core.extract_test_fn = _test_fn_of_the_stack
    try:
        yield
    finally:
        common_utils.extract_test_fn, core.extract_test_fn = saved


def tolerance(op, dtype) -> tuple[float, float]:
    """(rtol, atol): 1e-5 each, or the op's own CPU tolerance overrides where looser."""
    from torch.testing._internal.common_device_type import precisionOverride, toleranceOverride
    from torch.testing._internal.opinfo.core import DecorateInfo

    rtol, atol = RTOL, ATOL
    for info in op.decorators:
        if not isinstance(info, DecorateInfo) or info.device_type not in (None, "cpu") or not info.active_if:
            continue
        if info.dtypes is not None and dtype not in info.dtypes:
            continue
        for d in info.decorators:
            if isinstance(d, toleranceOverride) and dtype in d.d:
                rtol, atol = max(rtol, d.d[dtype].rtol), max(atol, d.d[dtype].atol)
            elif isinstance(d, precisionOverride) and dtype in d.d:
                atol = max(atol, d.d[dtype])
    return rtol, atol


def map_tensors(fn, x):
    """x with every tensor t (in lists, tuples, dicts) replaced by fn(t); other values kept."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if type(x) in (list, tuple):
        return type(x)(map_tensors(fn, v) for v in x)
    if type(x) is dict:
        return {k: map_tensors(fn, v) for k, v in x.items()}
    return x


def tensors_of(x) -> list:
    found = []
    map_tensors(found.append, x)
    return found


def sample_parts(sample) -> tuple:
    return (sample.input, tuple(sample.args), dict(sample.kwargs))


def shard_dims(sample, placement: str) -> tuple:
    """The tensor dim each of the sample's tensors is split on (None: replicated)."""
    if placement == "R":
        return tuple(None for _ in tensors_of(sample_parts(sample)))
    d = int(placement[2:-1])
    return tuple((d % t.dim()) if t.dim() > 0 else None for t in tensors_of(sample_parts(sample)))


def canonical(sample, placement: str) -> str:
    """The label of `placement` on this sample: R where it splits no tensor (0-dim tensors
    only), else the first of PLACEMENTS that places the sample's tensors alike."""
    dims = shard_dims(sample, placement)
    if all(d is None for d in dims):
        return "R"
    return next(p for p in PLACEMENTS if shard_dims(sample, p) == dims)


def plan(samples, sel: Selection, first_dtype: bool = True) -> list[tuple[int, str]]:
    """(sample index, placement) pairs to run, each distinct placing once."""
    if sel.fast:
        return fast_plan(samples, first_dtype)
    pairs = []
    for i, s in enumerate(samples):
        for p in sel.placements:
            if (i, canonical(s, p)) not in pairs:
                pairs.append((i, canonical(s, p)))
    return pairs


def fast_plan(samples, first_dtype: bool = True) -> list[tuple[int, str]]:
    """The suite's selection: in the op's first dtype sample 0 split on its first dim and
    sample 1 on its last, in its second (complex64) sample 0 on its last (each labelled as the
    full sweep labels it): every op runs sharded both ways where it can, complex paths too."""
    if not samples:
        return []
    if not first_dtype:
        return [(0, canonical(samples[0], "S(-1)"))]
    pairs = [(0, canonical(samples[0], "S(0)"))]
    if len(samples) > 1:
        pairs.append((1, canonical(samples[1], "S(-1)")))
    return pairs


# -- running one case -----------------------------------------------------------------------


def leaves(out) -> list:
    """An op's outputs, flattened: tensors and Python numbers (None and the like dropped)."""
    if isinstance(out, torch.Tensor) or (isinstance(out, (bool, int, float, complex))):
        return [out]
    if isinstance(out, (list, tuple)):
        return [x for o in out for x in leaves(o)]
    return []


def call(op, parts):
    inp, args, kwargs = parts
    return op.op(inp, *args, **kwargs)


def clone_parts(parts, make=None):
    """Fresh copies of a sample's tensors (requires_grad kept), or make(tensor, requires_grad)."""
    if make is None:
        return map_tensors(lambda t: t.detach().clone().requires_grad_(t.requires_grad), parts)
    return map_tensors(lambda t: make(t, t.requires_grad), parts)


def grad_outputs(outs) -> list[int]:
    """Indices of the floating outputs the loss sums over."""
    return [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad
            and (o.is_floating_point() or o.is_complex())]


def loss_weights(outs, idx, seed) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(outs[i].shape, generator=gen, dtype=outs[i].dtype) for i in idx]


@dataclasses.dataclass
class Reference:
    """The single-process run of one sample."""

    outs: list
    random: bool
    grads: list | None  # None: no gradient case
    weights: list
    grad_idx: list


def reference(op, sample, seed) -> Reference:
    """Run the sample on plain tensors twice under two seeds (the second only to tell whether
    the output depends on the random stream; OpInfo's has_nondeterministic_output, uninitialised
    memory, counts as random too), then its gradients.  Raises what the op raises."""
    parts = clone_parts(sample_parts(sample))
    _seed(seed)
    out = call(op, parts)
    outs = leaves(out)
    _seed(seed + 1)
    again = leaves(call(op, clone_parts(sample_parts(sample))))
    rand = op.has_nondeterministic_output or compare(
        [o.detach() if isinstance(o, torch.Tensor) else o for o in again],
        [o.detach() if isinstance(o, torch.Tensor) else o for o in outs], 0.0, 0.0)[0] != "pass"
    inputs = [t for t in tensors_of(parts) if t.requires_grad]
    processed = leaves(sample.output_process_fn_grad(out))
    idx = grad_outputs(processed)
    grads, weights = None, []
    if inputs and idx:
        weights = loss_weights(processed, idx, seed)
        try:
            loss_of([processed[i] for i in idx], weights, lambda o, w: o * w).backward()
            grads = [t.grad for t in inputs]
        except Exception:  # the op has no derivative here: no gradient case
            grads = None
    return Reference([o.detach() if isinstance(o, torch.Tensor) else o for o in outs], rand, grads, weights, idx)


def loss_of(outs, weights, mul):
    total = 0
    for o, w in zip(outs, weights):
        term = mul(o, w)
        total = total + (term.real if term.is_complex() else term).sum()
    return total


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want|, NaN in both places agreeing, NaN in one of them infinite."""
    if got.numel() == 0:
        return 0.0
    wide = torch.complex128 if (got.is_complex() or want.is_complex()) else torch.float64
    g, w = got.detach().to(wide), want.detach().to(wide)
    diff = (g - w).abs()
    both_nan = torch.isnan(g) & torch.isnan(w) if not g.is_complex() else (torch.isnan(g) & torch.isnan(w))
    same = g == w  # equal infinities
    diff = torch.where(both_nan | same, torch.zeros_like(diff), diff)
    diff = torch.nan_to_num(diff, nan=math.inf)
    return float(diff.max())


def compare(got: list, want: list, rtol: float, atol: float, shape_only: bool = False):
    """(class, max error, message): "pass" or "wrong"."""
    if len(got) != len(want):
        return "wrong", None, f"{len(got)} outputs vs {len(want)}"
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, want)):
        if isinstance(w, torch.Tensor):
            if not isinstance(g, torch.Tensor):
                return "wrong", None, f"output {i}: {type(g).__name__} vs a tensor"
            g = g.detach()
            if g.layout != w.layout:
                return "wrong", None, f"output {i}: layout {g.layout} vs {w.layout}"
            if w.layout != torch.strided:
                g, w = g.to_dense(), w.to_dense()
            if tuple(g.shape) != tuple(w.shape):
                return "wrong", None, f"output {i}: shape {tuple(g.shape)} vs {tuple(w.shape)}"
            if g.dtype != w.dtype:
                return "wrong", None, f"output {i}: dtype {g.dtype} vs {w.dtype}"
            if shape_only:
                continue
            err = max_error(g.resolve_conj().resolve_neg(), w.resolve_conj().resolve_neg())
            worst = max(worst, err)
            try:
                torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=True)
            except AssertionError:
                return "wrong", err, f"output {i}: values differ (max abs error {err:.3g})"
        elif isinstance(g, torch.Tensor) and g.numel() == 1:
            if not _numbers_close(g.item(), w, rtol, atol):
                return "wrong", None, f"output {i}: {g.item()!r} vs {w!r}"
        elif type(g) is not type(w) and not (isinstance(g, (int, float)) and isinstance(w, (int, float))):
            return "wrong", None, f"output {i}: {type(g).__name__} vs {type(w).__name__}"
        elif not shape_only and not _numbers_close(g, w, rtol, atol):
            return "wrong", None, f"output {i}: {g!r} vs {w!r}"
    return "pass", worst, None


def _numbers_close(a, b, rtol, atol) -> bool:
    if isinstance(a, complex) or isinstance(b, complex):
        return abs(a - b) <= atol + rtol * abs(b)
    if math.isnan(a) and math.isnan(b):
        return True
    return a == b or abs(a - b) <= atol + rtol * abs(b)


def compare_grads(got: list, want: list, rtol, atol):
    """Gradients: None in the single process allows zeros or None; a missing one is wrong."""
    g2, w2 = [], []
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            if g is not None and bool((g.detach() != 0).any()):
                return "wrong", None, f"grad {i}: nonzero where the single process has none"
            continue
        if g is None:
            return "wrong", None, f"grad {i}: missing"
        g2.append(g)
        w2.append(w)
    cls, err, msg = compare(g2, w2, rtol, atol)
    return cls, err, (msg.replace("output", "grad", 1) if msg else msg)


class Autopar:
    """autopar's side: shard_tensor, unshard_dtensor (the global value, differentiable), the loss
    as tests/opcheck.py builds it."""

    name = "autopar"

    def __init__(self, world: int):
        import autopar as dist

        self.dist = dist
        self.mesh = dist.ProcessMesh(list(range(world)), dim_names=["x"])

    def distribute(self, t, dim, requires_grad):
        d = self.dist
        p = d.Shard(dim) if dim is not None else d.Replicate()
        return d.shard_tensor(t.detach().clone(), self.mesh, [p], stop_gradient=not requires_grad)

    def full(self, x):
        return self.dist.unshard_dtensor(x) if self.dist.is_dist_tensor(x) else x

    def weight(self, o, w):
        return o.clone() * w  # through a copy: a Partial output keeps its own placements

    def backward(self, loss):
        loss.backward()

    @contextlib.contextmanager
    def watch(self, found: list):
        """Record the ops autopar falls back on: its once-per-op warning set and dispatch cache
        (a cached op warns no more) are cleared first."""
        import autopar
        from autopar.spmd import engine

        engine._WARNED.clear()
        autopar._reset_for_tests()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                yield
            finally:
                for w in caught:
                    m = _FALLBACK.search(str(w.message))
                    if m and m.group(1) not in found:
                        found.append(m.group(1))


class DTensorLib:
    """torch.distributed.tensor's side: distribute_tensor, full_tensor (no fallback to watch)."""

    name = "dtensor"

    def __init__(self, world: int):
        from torch.distributed.device_mesh import DeviceMesh

        self.mesh = DeviceMesh("cpu", list(range(world)))

    def distribute(self, t, dim, requires_grad):
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        p = Shard(dim) if dim is not None else Replicate()
        return distribute_tensor(t.detach().clone(), self.mesh, [p]).requires_grad_(requires_grad)

    def full(self, x):
        from torch.distributed.tensor import DTensor

        return x.full_tensor() if isinstance(x, DTensor) else x

    def weight(self, o, w):
        from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

        return o * (distribute_tensor(w, self.mesh, [Replicate()]) if isinstance(o, DTensor) else w)

    def backward(self, loss):
        self.full(loss).backward()

    @contextlib.contextmanager
    def watch(self, found: list):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield


def _first_line(e: BaseException) -> str:
    """The exception's type and first line (300 characters at most); where it has no message,
    the line that raised it."""
    text = str(e).strip().splitlines()
    if text:
        return f"{type(e).__name__}: {text[0]}"[:300]
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (raised at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno} in {tb[-1].name})" if tb else ""
    return f"{type(e).__name__}{where}"


def run_lib(lib, op, sample, placement, ref: Reference, tol, seed) -> dict:
    """One library on one (sample, placement): {"fwd": outcome, "grad": outcome (if any)}, each
    {"class", "max_err", "msg", "fallback"}; exceptions are caught and classified."""
    rtol, atol = tol
    res = {}
    dims = iter(shard_dims(sample, placement))
    fb_fwd, fb_grad = [], []
    try:
        with lib.watch(fb_fwd):
            parts = clone_parts(sample_parts(sample), lambda t, rg: lib.distribute(t, next(dims), rg))
            _seed(seed)
            out = call(op, parts)
            got = [lib.full(o) for o in leaves(out)]
    except Exception as e:
        err = {"class": "error", "max_err": None, "msg": _first_line(e), "fallback": fb_fwd}
        return {"fwd": err, "grad": dict(err, msg="forward: " + err["msg"])} if ref.grads is not None else {"fwd": err}
    cls, max_err, msg = compare(got, ref.outs, rtol, atol, ref.random)
    res["fwd"] = _outcome(cls, max_err, msg, fb_fwd)
    if ref.grads is None:
        return res
    try:
        with lib.watch(fb_grad):
            processed = leaves(sample.output_process_fn_grad(out))
            outs = [processed[i] for i in ref.grad_idx if i < len(processed)]
            lib.backward(loss_of(outs, ref.weights, lib.weight))
            grads = [None if t.grad is None else lib.full(t.grad) for t in tensors_of(parts) if t.requires_grad]
    except Exception as e:
        res["grad"] = _outcome("error", None, _first_line(e), fb_grad)
        return res
    cls, max_err, msg = compare_grads(grads, ref.grads, rtol, atol)
    res["grad"] = _outcome(cls, max_err, msg, fb_grad)
    return res


def _outcome(cls, max_err, msg, fallback) -> dict:
    if cls == "pass" and fallback:
        cls = "fallback"
    return {"class": cls, "max_err": max_err, "msg": msg, "fallback": list(fallback)}


# -- ranks: agreeing on every case, resumable -----------------------------------------------

_AGREE = {}


def _agree_group():
    """A gloo group of its own for the per-case agreement: it never pairs with a collective a
    library left unmatched on the default group.  Its timeout outlasts the default group's, so
    a rank stuck in a library's collective times out and still arrives."""
    import torch.distributed as tdist

    if "group" not in _AGREE:
        _AGREE["group"] = tdist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=600))
    return _AGREE["group"]


def _fingerprint(sample) -> float:
    total = 0.0
    for t in tensors_of(sample_parts(sample)):
        v = t.detach() if t.layout == torch.strided else t.detach().to_dense()
        if v.is_complex():
            v = torch.view_as_real(v.resolve_conj())
        total += float(torch.nan_to_num(v.double(), nan=1.0, posinf=2.0, neginf=3.0).sum()) + t.numel()
    return total


def agree(step, result, fingerprint):
    """Gather every rank's outcome of one step; returns (combined outcomes, restart?).  The
    worst class over ranks wins; where the ranks raised differently (or some not at all) each
    rank's message is kept, and collectives left unmatched restart the world."""
    import torch.distributed as tdist

    gathered = [None] * tdist.get_world_size()
    tdist.all_gather_object(gathered, (step, result, fingerprint), group=_agree_group())
    if any(g[0] != step for g in gathered):
        raise RuntimeError(f"ranks out of step: {[g[0] for g in gathered]}")
    if len({g[2] for g in gathered}) > 1:
        return {"fwd": _outcome("skip", None, "the sample differs between ranks", [])}, False
    order = SEVERITY + ("skip",)
    combined = {}
    for kind in sorted({k for g in gathered for k in g[1]}):
        outs = [g[1][kind] for g in gathered if kind in g[1]]
        worst = min(outs, key=lambda o: order.index(o["class"]))
        errs = [o["max_err"] for o in outs if o["max_err"] is not None]
        combined[kind] = dict(worst, max_err=max(errs) if errs else None,
                              fallback=sorted({f for o in outs for f in o["fallback"]}))
    raised = [tuple(o["msg"] for _, o in sorted(g[1].items()) if o["class"] == "error") for g in gathered]
    if not (any(raised) and len(set(raised)) > 1):
        return combined, False
    restart = not _in_step(step)
    for kind in combined:
        combined[kind]["per_rank"] = [g[1].get(kind, {}).get("msg") for g in gathered]
        combined[kind]["restarted"] = restart
    return combined, restart


def _in_step(step) -> bool:
    """After the ranks raised differently: do the libraries' collectives still pair up?  A
    collective run on one rank only shifts that rank's sequence on its group; the probes (a
    gather of known values on the default group, DTensor's on a 1-D world mesh, and an autopar
    scatter and gather) then fail, read another collective's data or time out.  The ranks
    agree on the verdict."""
    import torch.distributed as tdist

    import autopar

    rank, world = tdist.get_rank(), tdist.get_world_size()
    mine = torch.tensor([step[0], step[1], rank], dtype=torch.int64)
    timeout = os.environ.get("AUTOPAR_TIMEOUT")
    os.environ["AUTOPAR_TIMEOUT"] = "30"  # a group the ranks make under different names waits this long
    try:
        got = [torch.zeros(3, dtype=torch.int64) for _ in range(world)]
        tdist.all_gather(got, mine)
        ok = all(g.tolist() == [step[0], step[1], r] for r, g in enumerate(got))
        values = torch.arange(2.0 * world) + step[1]
        mesh = autopar.ProcessMesh(list(range(world)))
        ok = ok and torch.equal(autopar.unshard_dtensor(autopar.shard_tensor(values, mesh, [autopar.Shard(0)])), values)
    except Exception:
        ok = False
    finally:
        if timeout is None:
            del os.environ["AUTOPAR_TIMEOUT"]
        else:
            os.environ["AUTOPAR_TIMEOUT"] = timeout
    verdicts = [None] * world
    tdist.all_gather_object(verdicts, ok, group=_agree_group())
    return all(verdicts)


_LIBS = {}


def _libs(names, world):
    if (names, world) not in _LIBS:
        _LIBS[names, world] = [{"autopar": Autopar, "dtensor": DTensorLib}[n](world) for n in names]
    return _LIBS[names, world]


CASE_SECONDS = 120  # a case still running after this is interrupted and recorded as a crash


class CaseTimeout(BaseException):
    """Raised into a case that runs too long (a BaseException: libraries' `except Exception`
    must not swallow it)."""


@contextlib.contextmanager
def _time_limit(seconds):
    """Interrupt the block after `seconds` (a Python loop that never ends: DTensor's unflatten of
    one sample spun for good on both ranks).  A rank blocked inside a collective is left to the
    collective's own timeout."""
    def expire(signum, frame):
        raise CaseTimeout(f"hung: interrupted after {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


SPARSE = ("sparse layout: not run without --sparse (autopar's shard_tensor of a sparse CSR tensor succeeds "
          "on rank 0 and raises on rank 1, and the ranks fall out of step: each case costs a collective "
          "timeout and a world restart)")


def is_sparse(sample) -> bool:
    return any(t.layout != torch.strided for t in tensors_of(sample_parts(sample)))


def _reference_or_why(op, sample, seed):
    try:
        return reference(op, sample, seed)
    except Exception as e:
        return _first_line(e)


def run_units(sel: Selection, start=(0, 0), sink=None, progress=None) -> dict:
    """Rank function: run the selection's cases from `start` = (unit, step).

    A unit is one (op, dtype); its steps are (pair, library) in order.  Rank 0 appends each
    case's records to `sink` (JSON lines) once the ranks agreed on it, and writes the step
    about to run to `progress` (what the parent records if the world dies).  Returns
    {"records": [...] (without a sink), "restart": (unit, step) to resume from after a world
    restart, or None when done}."""
    with warnings.catch_warnings():  # the ops' own warnings, thousands of them
        warnings.simplefilter("ignore")
        return _run_units(sel, tuple(start), sink, progress)


def _run_units(sel, start, sink, progress) -> dict:
    import torch.distributed as tdist

    rank, world = tdist.get_rank(), tdist.get_world_size()
    _agree_group()
    libs = _libs(tuple(sel.libs), world)
    records = []

    def emit(recs):
        if sink is None:
            records.extend(recs)
        elif rank == 0:
            with open(sink, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in recs)

    def note(u, step, case, kinds):
        if rank == 0 and progress is not None:
            with open(progress, "w") as f:
                json.dump({"unit": u, "step": step, "case": case, "kinds": kinds}, f)

    ops = select_ops(sel)
    if start == (0, 0):
        emit([{"bench": "opinfo", "op": full_name(op), "lib": "reference", "class": "skip",
               "msg": "no CPU dtype"} for op in ops if not dtypes_for(op)])
    units = [(op, dt, k == 0) for op in ops for k, dt in enumerate(dtypes_for(op))]
    for u, (op, dtype, first_dtype) in enumerate(units):
        if u < start[0]:
            continue
        name, dt = full_name(op), str(dtype).replace("torch.", "")
        base = {"bench": "opinfo", "op": name, "dtype": dt}
        note(u, -1, dict(base, lib="reference"), [])  # a crash drawing the samples skips the unit
        try:
            samples = make_samples(op, dtype, 2 if sel.fast else sel.samples)
        except Exception as e:
            emit([dict(base, lib="reference", **{"class": "skip"}, msg="samples: " + _first_line(e))])
            continue
        tol = tolerance(op, dtype)
        refs = {}
        for s, (i, placement) in enumerate(plan(samples, sel, first_dtype)):
            for li, lib in enumerate(libs):
                step = s * len(libs) + li
                if (u, step) < start:
                    continue
                case = dict(base, sample=i, placement=placement, lib=lib.name)
                seed = seed_of(name, dt, i)
                if i not in refs:
                    note(u, step, case, ["fwd"])  # a crash in the single process counts as this case's
                    refs[i] = (SPARSE if not sel.sparse and is_sparse(samples[i])
                               else _reference_or_why(op, samples[i], seed))
                ref = refs[i]
                skip = isinstance(ref, str)
                note(u, step, case, ["fwd"] + (["grad"] if not skip and ref.grads is not None else []))
                t0 = time.perf_counter()
                if skip:
                    result = {"fwd": _outcome("skip", None, ref if ref is SPARSE else "single process: " + ref, [])}
                else:
                    try:
                        with _time_limit(CASE_SECONDS):
                            result = run_lib(lib, op, samples[i], placement, ref, tol, seed)
                    except CaseTimeout as e:
                        hung = _outcome("crash", None, str(e), [])
                        result = {"fwd": hung, **({"grad": hung} if ref.grads is not None else {})}
                    except BaseException as e:  # a bug in the sweep: keep the ranks in step
                        traceback.print_exc()
                        result = {"fwd": _outcome("error", None, "sweep: " + _first_line(e), [])}
                combined, restart = agree((u, step), result, _fingerprint(samples[i]))
                secs = round(time.perf_counter() - t0, 4)
                emit([dict(case, kind=kind, shape_only=not skip and ref.random, secs=secs, **out)
                      for kind, out in combined.items()])
                if restart:
                    return {"records": records, "restart": (u, step + 1)}
    return {"records": records, "restart": None}


# -- the parent: the sweep, its world restarts, the summary ---------------------------------


def sweep(sel: Selection, world: int, sink: str, deadline: float = 900.0, start_op: str | None = None) -> None:
    """Run the selection op by op (from `start_op`) on a pool of `world` ranks, restarting the
    world after a crash or a desync and recording the case it happened on."""
    sys.path.insert(0, os.path.join(_ROOT, "tests"))
    os.environ.setdefault("AUTOPAR_TEST_TIMEOUT", "20")  # a library's collective left unmatched
    os.environ.setdefault("AUTOPAR_TIMEOUT", "20")  # autopar's own groups likewise
    os.environ["AUTOPAR_TEST_TASK_TIMEOUT"] = str(deadline)  # one op, every dtype and case
    import distpool

    self_mod = sys.modules.get("opinfo_sweep") or __import__("opinfo_sweep")
    names = [full_name(op) for op in select_ops(sel)]
    names = names[names.index(start_op):] if start_op is not None else names
    progress = sink + ".progress"
    t0 = time.monotonic()
    for k, name in enumerate(names):
        one = dataclasses.replace(sel, ops=(name,), chunk=(0, 1))
        start = (0, 0)
        while start is not None:
            if os.path.exists(progress):
                os.unlink(progress)
            try:
                start = distpool.run_dist(self_mod.run_units, world, one, start, sink, progress)[0]["restart"]
                if start is not None:
                    distpool.shutdown(world)
            except distpool.RunDistError as e:
                distpool.shutdown(world)
                resume = _record_crash(progress, sink, e, name)
                start = resume if resume is not None and resume > start else None
        print(f"[{k + 1}/{len(names)}] {name} ({time.monotonic() - t0:.0f}s)", file=sys.stderr, flush=True)
    if os.path.exists(progress):
        os.unlink(progress)


def _record_crash(progress, sink, err, name):
    """Record the case the world died on; return where to resume (None: give up on the op)."""
    import distpool

    why = "; ".join(f"rank {r}: " + (distpool._last_exc_line(tb) if tb.startswith("Traceback") else tb.split(";")[0])
                    for r, tb in sorted(err.failures.items()))
    head = str(err).splitlines()[0].split(": ", 1)[-1].split(". The pool was killed")[0]
    msg = f"{head} ({why})"[:300]
    try:
        with open(progress) as f:
            p = json.load(f)
    except (OSError, ValueError):
        p = {"unit": None, "step": -1, "case": {"bench": "opinfo", "op": name, "lib": "reference"}, "kinds": []}
    with open(sink, "a") as f:
        if p["step"] < 0:  # outside any case (drawing the samples)
            f.write(json.dumps(dict(p["case"], **{"class": "skip"}, msg="world died: " + msg)) + "\n")
            return None if p["unit"] is None else (p["unit"] + 1, 0)
        for kind in p["kinds"]:
            f.write(json.dumps(dict(p["case"], kind=kind, **{"class": "crash"}, max_err=None, msg=msg,
                                    fallback=[], shape_only=False)) + "\n")
    return (p["unit"], p["step"] + 1)


def load(paths) -> tuple[dict, list]:
    """(the first env line, with "resumed": [(op, date)] of any later ones; the case records).
    A file ending in .gz is read gzipped (the committed results are)."""
    env, recs = {}, []
    for path in paths:
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            for line in f:
                r = json.loads(line)
                if r.get("bench") == "env" and env:
                    env.setdefault("resumed", []).append((r.get("resumed_from"), r.get("date")))
                elif r.get("bench") == "env":
                    env = r
                elif r.get("bench") == "opinfo":
                    recs.append(r)
    return env, recs


def _norm(msg: str) -> str:
    """An error message with its op names, numbers and shapes blanked, to group alike messages
    (a gradient's "forward: ..." with its forward's)."""
    msg = msg.removeprefix("forward: ")
    msg = re.sub(r"aten(::|\.)[\w.]+", "aten.<op>", msg)
    msg = re.sub(r"ProcessMesh\([^)]*\)", "<mesh>", msg)
    msg = re.sub(r"\[[\d, ]*\]|\([\d, ]*\)|torch\.Size\(\[[\d, ]*\]\)", "[..]", msg)
    return re.sub(r"\d+", "#", msg)[:120]


def _case_key(r) -> tuple:
    return (r["op"], r["dtype"], r["sample"], r["placement"], r["kind"])


def summary(env: dict, recs: list, top: int = 25, grouped: bool = False) -> str:
    """The Markdown summary: counts per class and library, the two libraries side by side on
    the same cases, then per library the wrong (and crashed) cases, the errors grouped by
    message and the aten ops autopar's fallback ran.  `grouped`: wrong cases one row per op,
    dtype and kind."""
    cases = [r for r in recs if r["class"] != "skip"]
    libs = [lib for lib in LIBS if any(r["lib"] == lib for r in cases)]
    out = []
    if env:
        out += [f"autopar {env.get('autopar_commit')}, torch {env.get('torch')}, {env.get('ranks')} ranks, "
                f"{env.get('samples')} samples per op and dtype, {env.get('date')}"
                + "".join(f" (resumed at {op} on {date})" for op, date in env.get("resumed", [])), ""]
    out += ["| | " + " | ".join(SEVERITY[::-1]) + " | cases | ops |", "|---" * (len(SEVERITY) + 3) + "|"]
    for lib in libs:
        mine = [r for r in cases if r["lib"] == lib]
        c = collections.Counter(r["class"] for r in mine)
        out.append(f"| {lib} | " + " | ".join(f"{c[k]:,}" for k in SEVERITY[::-1])
                   + f" | {len({_case_key(r) for r in mine}):,} | {len({r['op'] for r in mine})} |")
    if len(libs) == 2:
        out += [""] + _side_by_side(cases, *libs)
    out += ["", _notes(recs, cases)]
    for lib in libs:
        mine = [r for r in cases if r["lib"] == lib]
        out += _wrong_table(lib, mine, grouped) + _error_table(lib, mine, top) + _fallback_table(lib, mine)
    return "\n".join(out)


def _side_by_side(cases, a, b) -> list:
    """Rows: the class under a; columns: the class of the same case under b."""
    by = collections.defaultdict(dict)
    for r in cases:
        by[_case_key(r)][r["lib"]] = r["class"]
    both = collections.Counter((v[a], v[b]) for v in by.values() if len(v) == 2)
    rows = [f"| {a} \\ {b} | " + " | ".join(SEVERITY[::-1]) + " |", "|---" * (len(SEVERITY) + 1) + "|"]
    return rows + [f"| {x} | " + " | ".join(f"{both[x, y]:,}" for y in SEVERITY[::-1]) + " |" for x in SEVERITY[::-1]]


def _notes(recs, cases) -> str:
    skipped = collections.defaultdict(set)
    for r in recs:
        if r["class"] == "skip":
            m = r["msg"] or ""
            why = ("no CPU dtype" if m == "no CPU dtype" else "sparse" if m == SPARSE
                   else "single process" if m.startswith("single process") else "other")
            skipped[why].add((r["op"], r.get("dtype"), r.get("sample")))
    differ = sum(1 for r in cases if r.get("per_rank") and r["kind"] == "fwd")
    restarts = sum(1 for r in cases if r.get("restarted") and r["kind"] == "fwd")
    shape_only = len({(r["op"], r["dtype"]) for r in cases if r.get("shape_only")})
    return (f"Not run: {len(skipped['no CPU dtype'])} ops without a CPU dtype, {len(skipped['single process'])} "
            f"samples the single process raised on, {len(skipped['sparse'])} samples holding sparse tensors "
            f"(--sparse runs them), {len(skipped['other'])} other (samples not drawn, a world lost outside a "
            f"case).  {shape_only} op/dtype pairs draw random numbers or leave memory uninitialised: compared "
            f"by shape and dtype.  {differ} cases raised differently on the ranks (each rank's message in "
            f"per_rank), {restarts} of them left collectives unmatched (the world restarted).")


def _wrong_table(lib, mine, grouped) -> list:
    wrong = sorted((r for r in mine if r["class"] in ("wrong", "crash")), key=_case_key)
    out = ["", f"### {lib}: wrong and crashed cases ({len(wrong)})", ""]
    if not wrong:
        return out + ["none"]
    if grouped:
        groups = collections.defaultdict(list)
        for r in wrong:
            groups[r["op"], r["dtype"], r["kind"], r["class"]].append(r)
        out += ["| op | dtype | kind | class | cases | placements | max error | e.g. |", "|---" * 8 + "|"]
        for (op, dt, kind, cls), rs in sorted(groups.items()):
            errs = [r["max_err"] for r in rs if r["max_err"] is not None]
            places = ", ".join(p for p in PLACEMENTS if any(r["placement"] == p for r in rs))
            out.append(f"| {op} | {dt} | {kind} | {cls} | {len(rs)} | {places} | "
                       f"{f'{max(errs):.3g}' if errs else ''} | {(rs[0]['msg'] or '').replace('|', '/')} |")
        return out
    out += ["| op | dtype | sample | placement | kind | class | max error | what |", "|---" * 8 + "|"]
    for r in wrong:
        err = "" if r["max_err"] is None else f"{r['max_err']:.3g}"
        out.append(f"| {r['op']} | {r['dtype']} | {r['sample']} | {r['placement']} | {r['kind']} | "
                   f"{r['class']} | {err} | {(r['msg'] or '').replace('|', '/')} |")
    return out


def _error_table(lib, mine, top) -> list:
    ops_of = collections.defaultdict(set)
    groups = collections.Counter()
    for r in mine:
        if r["class"] == "error":
            groups[_norm(r["msg"] or "")] += 1
            ops_of[_norm(r["msg"] or "")].add(r["op"])
    out = ["", f"### {lib}: errors grouped ({sum(groups.values())} cases, {len(groups)} messages"
           + (f", the {top} commonest)" if len(groups) > top else ")"), ""]
    if not groups:
        return out + ["none"]
    out += ["| cases | ops | message | e.g. |", "|---|---|---|---|"]
    for msg, n in groups.most_common(top):
        eg = ", ".join(sorted(ops_of[msg])[:3])
        out.append(f"| {n} | {len(ops_of[msg])} | {msg.replace('|', '/')} | {eg} |")
    return out


def _fallback_table(lib, mine) -> list:
    fb = collections.Counter(f for r in mine for f in r.get("fallback", []))
    if not fb:
        return []
    fb_ops = collections.defaultdict(set)
    for r in mine:
        for f in r.get("fallback", []):
            fb_ops[f].add(r["op"])
    out = ["", f"### {lib}: aten ops run by the replicated fallback ({len(fb)})", "",
           "| aten op | cases | OpInfo ops |", "|---|---|---|"]
    for f, n in fb.most_common():
        names = sorted(fb_ops[f])
        out.append(f"| {f} | {n} | {', '.join(names[:4])}{f' and {len(names) - 4} more' if len(names) > 4 else ''} |")
    return out


def _default_out(world: int, commit: str) -> str:
    base = os.path.join(_HERE, "results", f"opinfo_{world}ranks.{commit}")
    n = 1
    while os.path.exists(f"{base}-{n}.jsonl"):
        n += 1
    return f"{base}-{n}.jsonl"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=10, help="samples per op and dtype (10)")
    p.add_argument("--ops", default=None, help="comma-separated OpInfo names (full or bare): rerun a few ops")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--libs", default=",".join(LIBS))
    p.add_argument("--sparse", action="store_true", help="run the samples holding sparse tensors too (slow)")
    p.add_argument("--out", default=None, help="JSON lines (default: benchmarks/results/opinfo_<N>ranks.<commit>-<run>"
                   ".jsonl for a full sweep, a file under /tmp with --ops)")
    p.add_argument("--from", dest="start", default=None, metavar="OP",
                   help="resume an interrupted sweep at this op (full name), appending to --out")
    p.add_argument("--summary", nargs="*", default=None, metavar="JSONL", help="only summarise these result files")
    p.add_argument("--grouped", action="store_true", help="wrong cases one row per op, dtype and kind")
    a = p.parse_args(argv)
    if a.summary:
        print(summary(*load(a.summary), grouped=a.grouped))
        return
    sys.path.insert(0, _HERE)
    import _common

    torch.set_num_threads(1)  # as the ranks run (env_info reads it here)
    env = {"bench": "env", **_common.env_info(), "ranks": a.ranks, "samples": a.samples}
    ops = tuple(a.ops.split(",")) if a.ops else None
    out = os.path.abspath(a.out) if a.out else (_default_out(a.ranks, env["autopar_commit"]) if ops is None
                    else f"/tmp/opinfo_{a.ranks}ranks.{env['autopar_commit']}.{os.getpid()}.jsonl")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    sel = Selection(ops=ops, samples=a.samples, libs=tuple(a.libs.split(",")), sparse=a.sparse)
    names = [full_name(op) for op in select_ops(sel)]
    kept = []
    if a.start is not None:  # keep the records of the ops before it, the env line first
        if not (a.out and os.path.exists(out)) or a.start not in names:
            p.error("--from needs the --out of the interrupted sweep and an op of its selection")
        later = set(names[names.index(a.start):])
        with open(out) as f:  # an earlier resume at or after it goes too
            kept = [ln for ln in f if json.loads(ln).get("op", json.loads(ln).get("resumed_from")) not in later]
        env["resumed_from"] = a.start
    with open(out, "w") as f:
        f.writelines(kept + [json.dumps(env) + "\n"])
    t0 = time.time()
    sweep(sel, a.ranks, out, start_op=a.start)
    print(summary(*load([out])))
    print(f"\n{out} ({time.time() - t0:.0f}s)")


if __name__ == "__main__":
    sys.path.insert(0, _HERE)
    import opinfo_sweep  # the ranks import the module by name, not as __main__

    opinfo_sweep.main()
