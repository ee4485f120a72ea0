"""Which op packets DTensor has sharding strategies for and autopar has no rule for.

    python benchmarks/coverage_dtensor.py            # the missing packets, one a line
    python benchmarks/coverage_dtensor.py --json     # {"dtensor": N, "autopar": M, "missing": [...]}

Reads DTensor's registry (torch/distributed/tensor/_ops/: every op with a strategy or a
propagation rule) and autopar's (`autopar.spmd.registry.RULES`), by packet: a packet counts as
covered when autopar has a rule for one of the overloads DTensor covers.  (Only this script
imports torch.distributed.tensor; the library never does.)
"""
from __future__ import annotations

import argparse
import json

import torch
from torch.distributed.tensor import DTensor

import autopar  # noqa: F401  (registers every rule)
from autopar.spmd.registry import RULES


def dtensor_ops() -> set:
    """Every OpOverload DTensor's sharding propagator has a strategy or rule for."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    ops = set()
    for table in vars(propagator).values():
        if isinstance(table, dict):
            ops.update(k for k in table if isinstance(k, torch._ops.OpOverload))
    return ops


def missing_packets() -> tuple[int, int, list[str]]:
    """(DTensor's packets, those autopar covers, the names of the rest)."""
    packets: dict = {}
    for op in dtensor_ops():
        packets.setdefault(op.overloadpacket, []).append(op)
    missing = sorted(str(p) for p, overloads in packets.items() if not any(o in RULES for o in overloads))
    return len(packets), len(packets) - len(missing), missing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    n_dtensor, n_covered, missing = missing_packets()
    if parser.parse_args().json:
        print(json.dumps({"dtensor": n_dtensor, "autopar": n_covered, "missing": missing}))
        return
    print(f"# DTensor: {n_dtensor} op packets; autopar has rules for {n_covered}; missing {len(missing)}:")
    print("\n".join(missing))


if __name__ == "__main__":
    main()
