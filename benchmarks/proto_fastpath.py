"""What a cached per-decision fast path would save (an experiment, NOT library code).

    python benchmarks/proto_fastpath.py

Installs, in this process only, a __torch_dispatch__ in front of `autopar.dispatch.dispatch` that
keys on (func, spec, spec) for two-DistTensor-argument ops and, once the normal path has
made and cached its Decision, compiles it into a closure
`lambda a, b: DistTensor(func(a._local, b._local), out_spec)` when the decision needs no
reshard, no kernel, no local-argument rewrite, no mutation and has a single output.
Everything else falls through to the library's dispatcher unchanged.

Measures, interleaved: plain torch, autopar as shipped, autopar + this fast path, DTensor,
and the floor (a bare wrapper subclass whose __torch_dispatch__ only unwraps, calls and
rewraps) so the lead can see how far each is from the minimum a Python subclass costs.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import torch  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Replicate as DR, distribute_tensor  # noqa: E402

import autopar as dist  # noqa: E402
import autopar.dispatch as apd  # noqa: E402
from autopar.dtensor import DistTensor  # noqa: E402

_ORIG = apd.dispatch
_ORIG_TD = DistTensor.__dict__["__torch_dispatch__"]
_FAST: dict = {}
_NO = object()


def _compile(func, key):
    dec = apd._CACHE.get(key)
    if dec is None or dec.kind != "op" or dec.kernel is not None or dec.local_args is not None:
        return _NO
    if dec.mutated or dec.out_alias[0] != "value" or not isinstance(dec.out_alias[1], torch.Tensor):
        return _NO
    if len(dec.out_specs) != 1 or any(s is not k and s != k for s, k in zip(dec.in_specs, key[1:])):
        return _NO
    if apd._rank() not in dec.mesh:
        return _NO
    out_spec = dec.out_specs[0]

    def run(a, b):
        return DistTensor(func(a._local, b._local), out_spec)

    return run


def fast_dispatch(func, args, kwargs):
    if not kwargs and len(args) == 2:
        a, b = args
        if type(a) is DistTensor and type(b) is DistTensor:
            key = (func, a._spec, b._spec)
            f = _FAST.get(key)
            if f is not None and f is not _NO:
                return f(a, b)
            out = _ORIG(func, args, kwargs)
            if f is None:
                _FAST[key] = _compile(func, key)
            return out
    return _ORIG(func, args, kwargs)


def _fast_td(cls, func, types, args=(), kwargs=None):
    return fast_dispatch(func, args, kwargs or {})


def _set_dispatch(fn) -> None:
    """Route DistTensor.__torch_dispatch__ to `fn` (the prototype) or back to the library's."""
    DistTensor.__torch_dispatch__ = classmethod(_fast_td) if fn is fast_dispatch else _ORIG_TD


class Floor(torch.Tensor):
    """The least a wrapper subclass can do per op: unwrap, call, wrap (no specs, no cache)."""

    __slots__ = ("_local",)

    @staticmethod
    def __new__(cls, local):
        r = torch.Tensor._make_wrapper_subclass(cls, local.shape, strides=local.stride(), dtype=local.dtype,
                                                device=local.device)
        r._local = local
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        a, b = args
        return Floor(func(a._local, b._local))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--inner", type=int, default=50)
    p.add_argument("--reps", type=int, default=60)
    args = p.parse_args()
    rank, world = C.setup()
    mesh = dist.ProcessMesh(list(range(world)))
    dmesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    A = dist.shard_tensor(a, mesh, [dist.Replicate()])
    B = dist.shard_tensor(b, mesh, [dist.Replicate()])
    DA, DB = distribute_tensor(a, dmesh, [DR()]), distribute_tensor(b, dmesh, [DR()])
    FA, FB = Floor(a), Floor(b)
    C.emit({"bench": "env", **C.env_info(), "ranks": world})
    aten_of = {"add": torch.ops.aten.add.Tensor, "mm": torch.ops.aten.mm.default}
    for name, op in (("add", torch.add), ("mm", torch.mm)):
        want = op(a, b)
        _set_dispatch(fast_dispatch)
        for _ in range(3):
            out = op(A, B)
        C.check(_FAST.get((aten_of[name], A._spec, B._spec)) not in (None, _NO), f"{name}: fast path not compiled")
        C.assert_close(out.full_value(), want, f"{name}: fast path result")
        _set_dispatch(_ORIG)

        def run_fast():
            _set_dispatch(fast_dispatch)
            try:
                for _ in range(args.inner):
                    op(A, B)
            finally:
                _set_dispatch(_ORIG)

        fns = {
            "plain": _repeat(lambda: op(a, b), args.inner),
            "floor_subclass": _repeat(lambda: op(FA, FB), args.inner),
            "autopar_shipped": _repeat(lambda: op(A, B), args.inner),
            "autopar_fastpath_proto": run_fast,  # loops itself: the switch stays outside the loop
            "dtensor": _repeat(lambda: op(DA, DB), args.inner),
        }
        cpu: dict = {}
        times = C.interleaved(fns, reps=args.reps, warmup=3, inner=1, cpu=cpu)
        res = {k: C.stats_ms([t / args.inner for t in v]) for k, v in times.items()}
        cres = {k: C.stats_ms([t / args.inner for t in v], "cpu_") for k, v in cpu.items()}
        for k in fns:
            us = res[k]["median_ms"] * 1e3
            C.emit({"bench": f"proto_{name}_64x64_R", "impl": k, "ranks": world, **res[k], **cres[k],
                    "us_per_op": round(us, 3), "cpu_us_per_op": round(cres[k]["cpu_median_ms"] * 1e3, 3),
                    "bytes_sent_per_rank": 0})


def _repeat(fn, n):
    def run():
        for _ in range(n):
            fn()
    return run


if __name__ == "__main__":
    C.fail_loudly(main)
