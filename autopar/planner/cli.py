"""`python -m autopar.planner`: plan a Llama-shaped model on N devices, or calibrate this machine.

    python -m autopar.planner --model llama --layers 80 --hidden 8192 --heads 64 --kv-heads 8 \\
        --ffn 28672 --vocab 128256 --seq 4096 --global-batch 1024 --ranks 1024 --device h100 \\
        --compare tp8,pp4 [--json]
    python -m autopar.planner --model llama3-405b --seq 131072 --global-batch 128 --ranks 16384
    python -m autopar.planner --model deepseek-v3 --global-batch 15360 --ranks 2048
    python -m autopar.planner --calibrate cpu.json      # then --device cpu.json, or AUTOPAR_CPU_PROFILE
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Optional

from .api import plan
from .cost import calibrate, save_profile
from .model import PRESETS

_DEGREE = {"tp": "mp", "mp": "mp", "pp": "pp", "dp": "dp", "zero": "zero", "vpp": "vpp", "cp": "cp", "sep": "cp",
           "ep": "ep"}
# the model's dimensions: flag -> TransformerSpec field (default: the preset's, else llama's 8B)
_DIMS = {"layers": "layers", "hidden": "hidden", "heads": "heads", "kv-heads": "kv_heads", "ffn": "ffn",
         "vocab": "vocab", "seq": "seq", "experts": "experts", "top-k": "top_k", "expert-ffn": "expert_ffn",
         "shared-experts": "shared_experts", "dense-layers": "dense_layers"}


def parse_degrees(text: str) -> dict:
    """"tp8,pp4" -> {"mp": 8, "pp": 4} (tp and mp are the same dim; also dp, zero, vpp:
    chunks per pipeline stage, 1 for plain 1F1B; cp or sep: context parallel; ep: experts).

    >>> parse_degrees("tp8,pp4,zero1")
    {'mp': 8, 'pp': 4, 'zero': 1}
    >>> parse_degrees("tp8,pp4,vpp1")
    {'mp': 8, 'pp': 4, 'vpp': 1}
    """
    out = {}
    for part in filter(None, text.split(",")):
        key = part.rstrip("0123456789")
        if key not in _DEGREE or key == part:
            raise argparse.ArgumentTypeError(f"{part!r}: expected one of {sorted(_DEGREE)} followed by a number")
        out[_DEGREE[key]] = int(part[len(key):])
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m autopar.planner", description=__doc__.splitlines()[0])
    p.add_argument("--calibrate", metavar="OUT.json", help="measure this machine (2 gloo ranks) into a device profile")
    p.add_argument("--model", choices=sorted(PRESETS), default="llama",
                   help="a preset's dimensions (llama: Llama 3 8B); the flags below change any of them")
    for name in _DIMS:
        p.add_argument(f"--{name}", type=int)
    p.add_argument("--global-batch", type=int, default=512)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--device", default="h100", help="h100, h200, a100, cpu or a profile JSON")
    p.add_argument("--memory-per-rank", type=float, help="GB per rank (default: the device's memory)")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--fix", type=parse_degrees, help="pin degrees, e.g. tp8 or pp4,zero1")
    p.add_argument("--compare", type=parse_degrees, help="also price a hand configuration, e.g. tp8,pp4")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--png", metavar="OUT.png", help="also draw the stages and memory per rank (matplotlib)")
    return p


def main(argv: Optional[list] = None) -> int:
    args = _parser().parse_args(argv)
    if args.calibrate:
        profile = calibrate()
        save_profile(profile, args.calibrate)
        print(f"wrote {args.calibrate}: {profile}")
        return 0
    given = {field: getattr(args, flag.replace("-", "_")) for flag, field in _DIMS.items()}
    spec = dataclasses.replace(PRESETS[args.model], **{k: v for k, v in given.items() if v is not None})
    if given["heads"] is not None and given["kv_heads"] is None:
        spec = dataclasses.replace(spec, kv_heads=spec.heads)  # heads given alone: no grouped queries
    memory = None if args.memory_per_rank is None else args.memory_per_rank * 1e9
    try:
        result = plan(spec, world_size=args.ranks, global_batch=args.global_batch, device=args.device,
                      memory_per_rank=memory, precision=args.precision, fixed=args.fix, compare=args.compare)
    except ValueError as err:
        print(f"autopar.planner: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_json(), indent=1) if args.json else result)
    if args.png:
        from .picture import draw

        draw(result, args.png)
    return 0
